"""What fusion, tiling and the backends need to know about ops, in one place.

`passes/fuse.py` and `passes/tile.py` decide with these facts; the backends read
the decisions (and these facts) off the IR. None of it is op semantics (that is
`ir/ops.py`): it is which ops may share a loop over row chunks.
"""

from __future__ import annotations

from ir.dialect import FusionOp, TgOp
from ir.shapes import TensorInfo, dims_equal, info_of

# Ops that move or name data without computing: free on the CPU (NumPy views), and
# folded into the indexing of a fused GPU kernel.
VIEW_OPS = {"reshape", "transpose", "broadcast", "slice", "identity", "weight", "constant"}
# Anchors: ops a group is built around; at most one per group (horizontal fusion of
# siblings sharing an input makes one wider anchor out of several).
ANCHORS = {"matmul", "einsum", "conv", "attention"}


def row_local(op: TgOp) -> bool:
    """Whether the op computes each row (all but the last axis) from the same row of its operands."""
    if op.op_name == "trilu":  # elementwise, but which elements depends on the row index
        return False
    if op.op_name in ANCHORS or op.SPEC.category == "elementwise" or op.op_name == "gelu":
        return True
    rank = info_of(op.operands[0].type).rank
    if op.op_name in ("softmax", "layer_norm"):
        return op.attr("axis") % rank == rank - 1
    if op.op_name.startswith("reduce_"):
        return [a % rank for a in op.attr("axes")] == [rank - 1] and op.attr("keepdims")
    return False


def row_gemm(op: TgOp) -> bool:
    """A matmul whose rows can be computed a chunk at a time: [..., M, K] @ [K, N]."""
    if op.op_name != "matmul":
        return False
    lhs, rhs = (info_of(v.type) for v in op.operands)
    return lhs.rank >= 2 and rhs.rank == 2 and not op.result_infos()[0].dtype.startswith("bf")


def widest(group: FusionOp) -> TensorInfo:
    """The group's reference shape: its highest-rank result."""
    return max((info_of(r.type) for op in group.ops for r in op.results), key=lambda i: i.rank)


def operand_rows(info: TensorInfo, ref: TensorInfo) -> str:
    """How a group input meets the group's rows: 'full' (same leading dims), 'last' (only a
    last axis: bias-like, read whole by every chunk), or 'partial' (broadcast over some)."""
    if info.rank == ref.rank and all(dims_equal(a, b) for a, b in zip(info.shape[:-1], ref.shape[:-1])):
        return "full"
    if all(d == 1 for d in info.shape[:-1]):
        return "last"
    return "partial"


def flat_rows_ok(group: FusionOp) -> bool:
    """Whether the group may run on its values viewed as [rows, last axis] (leading dims flattened)."""
    ref = widest(group)
    if ref.rank < 2 or not all(row_local(op) for op in group.ops):
        return False
    inside = [op for op in group.ops if op.op_name in ANCHORS and not row_gemm(op)]
    if inside:
        return False
    args = set(group.block.args)
    for op in group.ops:
        for i, v in enumerate(op.operands):
            if v in args and not (op.op_name == "matmul" and i == 1):
                if operand_rows(info_of(v.type), ref) == "partial":
                    return False
    return all(info_of(r.type).rank == ref.rank for op in group.ops for r in op.results)
