"""What fusion, tiling and the backends need to know about ops, in one place.

`passes/fuse.py` and `passes/tile.py` decide with these facts; the backends read
the decisions (and these facts) off the IR. None of it is op semantics (that is
`ir/ops.py`): it is which ops may share a loop over row chunks.
"""

from __future__ import annotations

import enum
from typing import Callable

from xdsl.ir import Block, Operation, SSAValue

from tilegraph.ir.dialect import FusionOp, TgOp, YieldOp
from tilegraph.ir.dtypes import numpy_dtype
from tilegraph.ir.ops import Op, ANCHOR, ELEMWISE, OPS, REDUCE
from tilegraph.ir.shapes import TensorInfo, dims_equal, info_of, numel

# Both read off the op table's traits (ir/ops.py). Views: ops that move or name data
# without computing, free on the CPU (NumPy views) and folded into the indexing of a
# fused GPU kernel. Anchors: ops a group is built around; at most one per group
# (horizontal fusion of siblings sharing an input makes one wider anchor out of several).
VIEW_OPS = frozenset(name for name, spec in OPS.items() if spec.view)
ANCHORS = frozenset(name for name, spec in OPS.items() if spec.pattern == ANCHOR)
# Activations a GEMM or convolution applies to its result as it writes it (the C backend's
# oneDNN eltwise post-ops, backends/c/onednn.py; and sigmoid(x) * x as one swish): no loop of
# their own, which the C target's pricing (passes/targets/c.py) leaves out of a group's loop.
ELTWISE_POSTS = frozenset({Op.relu, Op.tanh, Op.exp, Op.sigmoid, Op.gelu})
# ... of which these evaluate an exp for each element the GEMM or convolution writes (a swish is
# its sigmoid): that costs time at the calibrated `ufunc_rates[POST_RATE]` (a relu is a max).
EXP_POSTS = ELTWISE_POSTS - {Op.relu}
POST_RATE = "eltwise_post"


class GroupKind(str, enum.Enum):
    """What a tg.fusion computes: `fuse` labels every group with one, and a backend lowers
    each kind as one step (tests/test_group_lowering.py). The value is the `kind` printed
    in the IR."""

    ELEMENTWISE = "elementwise"  # elementwise ops (and row reshapes): one loop
    REDUCTION = "reduction"  # elementwise ops with reductions or row ops (softmax, layer_norm) over rows
    HORIZONTAL_MATMUL = "horizontal_matmul"  # sibling matmuls sharing their left operand: one wider GEMM
    MATMUL = "matmul"
    MATMUL_EPILOGUE = "matmul_epilogue"
    CONV = "conv"
    CONV_EPILOGUE = "conv_epilogue"
    EINSUM = "einsum"
    EINSUM_EPILOGUE = "einsum_epilogue"
    ATTENTION = "attention"  # attention takes no epilogue into its kernel
    # Made by the Triton backend, not by `fuse`: a block-scaled GEMM with its dequantizations.
    QUANTIZED_MATMUL = "quantized_matmul"

    @staticmethod
    def around(anchor: str, epilogue: bool) -> "GroupKind":
        """The kind of a group built around one anchor op, with or without ops after it."""
        if anchor == "attention":
            return GroupKind.ATTENTION
        return GroupKind(f"{anchor}_epilogue" if epilogue else anchor)

    @staticmethod
    def of(ops: list[TgOp]) -> "GroupKind":
        """The kind of a group of these ops."""
        anchors = [op.op_name for op in ops if op.op_name in ANCHORS]
        if len(anchors) > 1:
            return GroupKind.HORIZONTAL_MATMUL
        if anchors:
            return GroupKind.around(anchors[0], epilogue=len(ops) > 1)
        if any(op.SPEC.pattern == REDUCE for op in ops):
            return GroupKind.REDUCTION
        return GroupKind.ELEMENTWISE


# Every anchor of the op table has its kinds: an anchor added without them fails here, at import.
for _anchor in ANCHORS:
    GroupKind.around(_anchor, False), GroupKind.around(_anchor, True)


def group_kind(group: FusionOp) -> GroupKind | None:
    """The kind of a tg.fusion as read from the IR; None for a kind `fuse` never makes
    (a hand-written or backend-made group), which a backend lowers op by op."""
    try:
        return GroupKind(group.kind)
    except ValueError:
        return None


def row_reshape(op: TgOp) -> bool:
    """A reshape that keeps the last dim: it only regroups the rows ([B*S, N] <-> [B, S, N]),
    which is nothing at all on values seen as [rows, last axis] (`flat` groups)."""
    if op.op_name != Op.reshape:
        return False
    a, b = info_of(op.operands[0].type), info_of(op.results[0].type)
    return a.rank >= 1 and b.rank >= 1 and dims_equal(a.shape[-1], b.shape[-1])


def row_local(op: TgOp) -> bool:
    """Whether the op computes each row (all but the last axis) from the same row of its operands."""
    if op.op_name == Op.reshape:
        return row_reshape(op)
    if op.SPEC.pattern in (ANCHOR, ELEMWISE):  # (trilu is injective: which elements depends on the row)
        return True
    rank = info_of(op.operands[0].type).rank
    if op.SPEC.row_normalizing:
        return op.attr("axis") % rank == rank - 1
    if op.SPEC.reduction:
        return [a % rank for a in op.attr("axes")] == [rank - 1] and op.attr("keepdims")
    return False


def siblings(anchors) -> bool:
    """Matmuls of one left operand: side by side they are one GEMM against their weights
    concatenated (a horizontal group), where a chain of matmuls is not."""
    return bool(anchors) and all(op.op_name == Op.matmul and op.operands[0] == anchors[0].operands[0]
                                 for op in anchors)


def row_gemm(op: TgOp) -> bool:
    """A matmul whose rows can be computed a chunk at a time: [..., M, K] @ [K, N]."""
    if op.op_name != Op.matmul:
        return False
    lhs, rhs = (info_of(v.type) for v in op.operands)
    return lhs.rank >= 2 and rhs.rank == 2 and not op.result_infos()[0].dtype.startswith("bf")


def widest(group: FusionOp) -> TensorInfo:
    """The group's reference shape: its highest-rank result."""
    return max((info_of(r.type) for op in group.ops for r in op.results), key=lambda i: i.rank)


def operand_rows(info: TensorInfo, ref: TensorInfo, flat: bool = False) -> str:
    """How a value meets the group's rows: 'full' (same leading dims; with `flat`, the same
    number of rows however grouped), 'last' (only a last axis: bias-like, read whole by
    every chunk), or 'partial' (broadcast over some)."""
    if info.rank == ref.rank and all(dims_equal(a, b) for a, b in zip(info.shape[:-1], ref.shape[:-1])):
        return "full"
    if all(d == 1 for d in info.shape[:-1]):
        return "last"
    if flat and info.rank >= 1 and dims_equal(numel(info.shape[:-1]), numel(ref.shape[:-1])):
        return "full"
    return "partial"


def flat_ok(ops: list[TgOp], inputs: list[tuple[TgOp, int, TensorInfo]], ref: TensorInfo) -> bool:
    """Whether ops may run on their values seen as [rows, last axis]: every op row-local, no
    anchor but row GEMMs, every input (op, operand index, type) spanning the rows or only
    the last axis (a GEMM's weight excepted), every result with the group's rows."""
    if ref.rank < 2 or not all(row_local(op) for op in ops):
        return False
    if any(op.op_name in ANCHORS and not row_gemm(op) for op in ops):
        return False
    if any(operand_rows(info, ref, flat=True) == "partial" for op, i, info in inputs
           if not (op.op_name == Op.matmul and i == 1)):
        return False
    return all(operand_rows(info_of(r.type), ref, flat=True) == "full" for op in ops for r in op.results)


def flat_rows_ok(group: FusionOp) -> bool:
    """Whether the group may run on its values viewed as [rows, last axis] (leading dims flattened)."""
    args = set(group.block.args)
    inputs = [(op, i, info_of(v.type)) for op in group.ops for i, v in enumerate(op.operands) if v in args]
    return widest(group).rank >= 2 and flat_ok(group.ops, inputs, widest(group))


def cols_ok(group: FusionOp) -> bool:
    """Whether a flat group may run in chunks of columns instead of rows: one row GEMM first,
    then only elementwise ops (no row reductions), every value the GEMM's width or a
    broadcast of width 1, so a column window of each value is computed from the same
    window of the others. Each chunk then multiplies all the rows by a slice of the
    weight: BLAS keeps its full row blocking, and each core packs only its share of the
    weight (a row chunk packs all of it again).
    """
    if not flat_rows_ok(group):
        return False
    anchors = [op for op in group.ops if op.op_name in ANCHORS]
    if len(anchors) != 1 or group.ops[0] is not anchors[0] or not row_gemm(anchors[0]):
        return False
    width = info_of(anchors[0].results[0].type).shape[-1]
    for op in group.ops[1:]:
        if not (op.SPEC.pattern == ELEMWISE or row_reshape(op)):
            return False
        for v in (*op.operands, *op.results):
            info = info_of(v.type)
            last = info.shape[-1] if info.rank else 1
            if not (dims_equal(last, width) or last == 1):
                return False
    return True


def live_row_bytes(ops: list[TgOp], keep: set, size: Callable[[object], float]) -> float:
    """Bytes of one row of every value live at once while a chunk runs the ops in order:
    the working set per row. A value dies after its last use in `ops` unless it is in
    `keep` (the group's results); views share their operand's memory; GEMM rows also
    read a row of their lhs. `size` turns a (symbolic) dim into a number.

    Counting every result instead (as if nothing died) overstates a chain such as
    GPT-2's tanh gelu, 10 ops computed in 2 temporaries, 5x, and `tile` then cut its
    GEMM into rows too few for BLAS to run at full speed.
    """
    def row(value) -> float:
        info = info_of(value.type)
        last = info.shape[-1] if info.rank else 1
        return size(last) * numpy_dtype(info.dtype).itemsize

    root: dict = {}  # a view -> the value whose memory it shares
    for op in ops:
        if op.op_name in VIEW_OPS and op.operands:
            root[op.results[0]] = root.get(op.operands[0], op.operands[0])
    last_use = {root.get(v, v): i for i, op in enumerate(ops) for v in op.operands}
    keep = {root.get(v, v) for v in keep}
    live: dict = {}
    peak = 0.0
    for i, op in enumerate(ops):
        if op.op_name not in VIEW_OPS:
            live.update({r: row(r) for r in op.results})
        peak = max(peak, sum(live.values()) + (row(op.operands[0]) if row_gemm(op) else 0.0))
        for v in op.operands:
            v = root.get(v, v)
            if last_use.get(v) == i and v not in keep:
                live.pop(v, None)
    return peak


def outline(ops: list[TgOp], kind: GroupKind, inputs: list[SSAValue], outputs: list[SSAValue],
            before: Operation) -> FusionOp:
    """Move `ops` (in order) into a new tg.fusion of `kind` placed before `before`: `inputs`
    become its block arguments, `outputs` its results, and their readers outside the group
    read the results."""
    inner = Block(arg_types=[v.type for v in inputs])
    arg_of = dict(zip(inputs, inner.args))
    for op in ops:
        op.detach()
        inner.add_op(op)
        for i, v in enumerate(op.operands):
            if v in arg_of:
                op.operands[i] = arg_of[v]
    fusion = FusionOp.build_group(kind.value, inputs, [v.type for v in outputs], inner)
    inside = set(ops)
    for value, result in zip(outputs, fusion.results):
        for use in list(value.uses):
            if use.operation not in inside:
                use.operation.operands[use.index] = result
    inner.add_op(YieldOp.create(operands=outputs))
    before.parent_block().insert_op_before(fusion, before)
    return fusion
