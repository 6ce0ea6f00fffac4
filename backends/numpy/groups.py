"""One Python function per fused group (`tg.fusion`), for the NumPy emitter.

How a group runs, in the code this module writes:

    def fusion_3(layer_norm_2, w_fc1, b_fc1, buf0):      # matmul_epilogue: matmul add gelu
        np.matmul(layer_norm_2, w_fc1, out=buf0)         # the anchor, whole: one BLAS call
        def chunk(s):                                    # the rest, on rows s of axis 1
            np.add(buf0[:, s], b_fc1, out=buf0[:, s])
            K.gelu(buf0[:, s], 'none', out=buf0[:, s])
        run_chunks(chunk, buf0.shape[1], 16)             # chunks on all cores (tile: rows=16)
        return buf0

* The anchor (matmul, attention, conv) is computed whole, into a buffer the caller
  passes (`out=`); sibling matmuls of a horizontal group are one GEMM against
  their weights concatenated once in `build`, and their results are views of it.
* The other ops run per chunk of `rows` along the group's row axis (from `tile`)
  while the chunk is in cache, on all cores (`backends.numpy.chunks`).
* Every value gets a home: a buffer the caller passes (group results), a chunk
  temporary, or, when an operand of the same shape and dtype dies at the op,
  that operand's memory (`out=` on ufuncs and kernels that take it, else slice
  assignment). Nothing is written into the group's inputs.

The caller (`emit.py`) decides which buffers are new and which are reused.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from xdsl.ir import SSAValue

from ir import kernels
from ir.dialect import FusionOp, TgOp
from ir.interpreter import dtype_code
from ir.ops import render
from ir.shapes import TensorInfo, dims_equal, info_of
from passes.cost.model import ANCHORS

INDENT = "    "
_CALL = re.compile(r"^(np|K)\.(\w+)\((.*)\)$", re.S)


def accepts_out(expr: str) -> bool:
    """Whether an op's rendered expression is one call of a function taking `out=` (a ufunc, or a kernel)."""
    m = _CALL.match(expr)
    if not m or not _one_call(expr):
        return False
    fn = getattr(np if m.group(1) == "np" else kernels, m.group(2), None)
    if isinstance(fn, np.ufunc):
        return True
    return callable(fn) and "out" in _parameters(fn)


def _parameters(fn) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _one_call(expr: str) -> bool:
    """The first '(' closes at the very end (not `np.f(a) + np.g(b)`)."""
    depth = 0
    start = expr.index("(")
    for i, c in enumerate(expr[start:], start):
        depth += c == "("
        depth -= c == ")"
        if depth == 0:
            return i == len(expr) - 1
    return False


def with_out(expr: str, target: str) -> str:
    return f"{expr[:-1]}, out={target})"


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


@dataclass
class Buffer:
    """A full-size array the caller passes in for the group to write."""

    info: TensorInfo
    name: str  # the parameter's name inside the group function


@dataclass
class GroupCode:
    function: list[str]  # the def, indented for `build`
    name: str
    params: list[SSAValue]  # outside values passed in
    buffers: list[Buffer]  # then these, allocated by the caller
    results: list[tuple[int, str]] = field(default_factory=list)  # per group result: (buffer index, view suffix)


class GroupEmitter:
    """Writes the function of one tg.fusion group."""

    def __init__(self, group: FusionOp, name: str, outer_name: Callable[[SSAValue], str],
                 attrs: Callable[[TgOp], dict], concat_weights: Callable[[list[SSAValue]], str]):
        self.group, self.name = group, name
        self.outer_name, self.attrs, self.concat_weights = outer_name, attrs, concat_weights
        self.tile = group.tile()
        self.ops = group.ops
        self.yielded = list(group.block.last_op.operands)
        self.ref = max((info_of(r.type) for op in self.ops for r in op.results), key=lambda i: i.rank)
        self.chunked = bool(self.tile.get("rows")) and all(row_local(op) for op in self.ops)
        self.axis = self.tile.get("axis", self.ref.rank - 2)
        self.local: dict[SSAValue, str] = {}  # value -> its full-size name (param, buffer, anchor view)
        self.temp: dict[SSAValue, str] = {}  # value -> chunk temporary name
        self.used_names: set[str] = set()
        self.buffers: list[Buffer] = []
        self.buffer_of: dict[SSAValue, tuple[int, str]] = {}

    def _fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.used_names:
            name, i = f"{base}{i}", i + 1
        self.used_names.add(name)
        return name

    def _buffer(self, info: TensorInfo) -> tuple[int, str]:
        name = self._fresh(f"buf{len(self.buffers)}")
        self.buffers.append(Buffer(info, name))
        return len(self.buffers) - 1, name

    # --- reading values -------------------------------------------------------------

    def _sliced(self, value: SSAValue, name: str) -> str:
        """`name`, restricted to the chunk's rows when the value spans them."""
        if not self.chunked:
            return name
        info = info_of(value.type)
        axis = self.axis - (self.ref.rank - info.rank)
        if axis < 0 or (isinstance(info.shape[axis], int) and info.shape[axis] == 1):
            return name  # broadcast along the chunk axis: every chunk reads all of it
        return f"{name}[{':, ' * axis}s]"

    def _read(self, value: SSAValue) -> str:
        if value in self.temp:
            return self.temp[value]
        return self._sliced(value, self.local[value])

    # --- the function ----------------------------------------------------------------

    def emit(self) -> GroupCode:
        group = self.group
        params = list(group.operands)
        for arg, outer in zip(group.block.args, params):
            self.local[arg] = self._fresh(self.outer_name(outer))
        body: list[str] = []
        anchors = [op for op in self.ops if op.op_name in ANCHORS]
        if len(anchors) > 1:
            body += self._horizontal(anchors)
        elif anchors:
            body += self._anchor(anchors[0])
        last_use = {}
        for i, op in enumerate(self.ops):
            for v in op.operands:
                last_use[v] = i
        chunk: list[str] = []
        for i, op in enumerate(self.ops):
            if op.op_name in ANCHORS:
                continue
            chunk.append(self._chunk_line(op, i, last_use))
        if chunk:
            body.append("def chunk(s):")
            body += [INDENT + line for line in chunk]
            length = self._length()
            rows = self.tile.get("rows", 0) if self.chunked else 0
            body.append(f"run_chunks(chunk, {length}, {rows})" if rows else "chunk(slice(None))")
        results = []
        for v in self.yielded:
            results.append(self.buffer_of[v])
        returns = [self.buffers[b].name + suffix for b, suffix in results]
        body.append(f"return {', '.join(returns)}" + ("," if len(returns) == 1 else ""))
        params_code = ", ".join([self.local[a] for a in group.block.args] + [b.name for b in self.buffers])
        tile = ", ".join(f"{k}={v}" for k, v in self.tile.items())
        doc = f'"""{group.kind}: {" ".join(op.op_name for op in self.ops)}' + (f"; tile {tile}" if tile else "") + '"""'
        function = [f"def {self.name}({params_code}):", INDENT + doc] + [INDENT + line for line in body]
        return GroupCode(function, self.name, params, self.buffers, results)

    def _length(self) -> str:
        for v, (b, suffix) in self.buffer_of.items():
            info = info_of(v.type)
            if info.rank == self.ref.rank:
                return f"{self.buffers[b].name}{suffix}.shape[{self.axis}]"
        raise AssertionError("a chunked group has a full-rank result")

    def _own(self, value: SSAValue, buffer: tuple[int, str], suffix: str = "") -> str:
        index, name = buffer
        self.buffer_of[value] = (index, suffix)
        self.local[value] = name + suffix
        return name + suffix

    def _render(self, op: TgOp, operands: list[str]) -> str:
        out = op.result_infos()[0]
        return render(op.SPEC, operands, self.attrs(op), "None", dtype_code(out.dtype))

    def _anchor(self, op: TgOp) -> list[str]:
        out = op.result_infos()[0]
        name = self._own(op.results[0], self._buffer(out))
        operands = [self.local[v] for v in op.operands]
        if op.op_name == "attention" and "block_kv" in self.tile:
            q, k, v = operands[:3]
            mask = operands[3] if len(operands) > 3 else "None"
            return [f"K.attention_tiled({q}, {k}, {v}, {mask}, {op.attr('scale')!r}, {op.attr('causal')}, "
                    f"{self.tile['block_q']}, {self.tile['block_kv']}, threads=THREADS, out={name})"]
        lhs, rhs = (info_of(v.type) for v in op.operands[:2]) if op.op_name == "matmul" else (None, None)
        if lhs is not None and lhs.rank > 2 and rhs.rank == 2 and not op.result_infos()[0].dtype.startswith("bf"):
            # [..., M, K] @ [K, N] is one GEMM of all rows: NumPy would loop over the batch
            # dims (and, writing into out=, leave BLAS for its own slower loop).
            return [f"np.matmul({operands[0]}.reshape(-1, {operands[0]}.shape[-1]), {operands[1]}, "
                    f"out={name}.reshape(-1, {name}.shape[-1]))"]
        expr = self._render(op, operands)
        return [with_out(expr, name) if accepts_out(expr) else f"{name}[...] = {expr}"]

    def _horizontal(self, anchors: list[TgOp]) -> list[str]:
        lhs = self.local[anchors[0].operands[0]]
        widths = [info_of(op.results[0].type).shape[-1] for op in anchors]
        ref = anchors[0].result_infos()[0]
        total = sum(widths)
        combined = self._buffer(TensorInfo(ref.shape[:-1] + (total,), ref.dtype))
        # The weights are block arguments here; build() concatenates the values they stand for.
        weights = self.concat_weights([self.group.operands[op.operands[1].index] for op in anchors])
        offset = 0
        for op, width in zip(anchors, widths):
            self._own(op.results[0], combined, f"[..., {offset}:{offset + width}]")
            offset += width
        return [f"np.matmul({lhs}.reshape(-1, {lhs}.shape[-1]), {weights}, "
                f"out={combined[1]}.reshape(-1, {combined[1]}.shape[-1]))  # {len(anchors)} sibling matmuls, one GEMM"]

    def _chunk_line(self, op: TgOp, index: int, last_use: dict) -> str:
        operands = [self._read(v) for v in op.operands]
        expr = self._render(op, operands)
        result = op.results[0]
        out = info_of(result.type)
        # Reuse the memory of an operand that dies here, has the result's shape and dtype,
        # and belongs to the group (a buffer it writes, or a chunk temporary).
        # (A rank-0 temporary is a NumPy scalar, not an array: it cannot be written into.)
        donors = [v for v in op.operands if last_use.get(v) == index and v not in self.yielded
                  and info_of(v.type) == out and ((v in self.temp and out.rank > 0) or v in self.buffer_of)]
        if result in self.yielded:  # lives on after the group: a buffer, a dying one if there is one
            donor = next((v for v in donors if v in self.buffer_of), None)
            if donor is not None:
                b, suffix = self.buffer_of[donor]
                self._own(result, (b, self.buffers[b].name), suffix)
            else:
                self._own(result, self._buffer(out))
            target = self._sliced(result, self.local[result])
        elif donors and donors[0] in self.temp:
            target = self.temp[result] = self.temp[donors[0]]
        elif donors:
            b, suffix = self.buffer_of[donors[0]]
            self._own(result, (b, self.buffers[b].name), suffix)
            target = self._sliced(result, self.local[result])
        else:
            target = self.temp[result] = self._fresh(f"t{index}")
            return f"{target} = {expr}"
        if accepts_out(expr):
            return with_out(expr, target)
        return f"{target}[...] = {expr}"
