"""One Python function per fused group (`tg.fusion`), for the NumPy emitter.

How a group runs, in the code this module writes (MiniLM's FFN up-projection):

    def fusion_5(layer_norm_1, w_fc1, b_fc1, buf0):
        # matmul_epilogue: matmul add gelu; tile flat=1, rows=128, chunks=8
        layer_norm_1_2d = layer_norm_1.reshape(-1, layer_norm_1.shape[-1])
        buf0_2d = buf0.reshape(-1, buf0.shape[-1])
        def chunk(s):                                       # rows s of [B*S, 1536]
            np.matmul(layer_norm_1_2d[s], w_fc1, out=buf0_2d[s])
            np.add(buf0_2d[s], b_fc1, out=buf0_2d[s])
            K.gelu(buf0_2d[s], 'none', out=buf0_2d[s])
        run_chunks(chunk, buf0_2d.shape[0], 128)            # chunks on all cores
        return buf0,

* With `flat` (from `tile`), every value is seen as [rows, last axis] and a chunk
  is a block of rows: GEMM rows ([..., M, K] @ [K, N]) and their epilogue run
  together while the rows are in cache; sibling matmuls of a horizontal group are
  one GEMM against their weights concatenated once in `build`, and their results
  are column windows of it.
* With `blas`, the GEMM runs whole on BLAS's own threads first, and the chunks
  run only its epilogue.
* With `cols` (a GEMM and an elementwise epilogue), a chunk is a window of columns:
  all the rows times that window of the weight, then the epilogue on the window.
* Without `flat`, the chunk is a slice along `axis`; anchors that cannot be cut in
  rows (attention, conv, batched matmul) run whole first, into a buffer (`out=`).
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

from tilegraph.ir import kernels
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.escape import py_docstring
from tilegraph.ir.fusion import ANCHORS, cols_ok, flat_rows_ok, operand_rows, row_gemm, row_local, widest
from tilegraph.ir.interpreter import dtype_code
from tilegraph.ir.ops import Op, render
from tilegraph.ir.shapes import TensorInfo, info_of

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


@dataclass
class Home:
    """Where a full-size value lives: an array name, and a column window of it (horizontal groups)."""

    base: str
    cols: str = ""


class GroupEmitter:
    """Writes the function of one tg.fusion group."""

    def __init__(self, group: FusionOp, name: str, outer_name: Callable[[SSAValue], str],
                 attrs: Callable[[TgOp], dict], concat_weights: Callable[[list[SSAValue]], str]):
        self.group, self.name = group, name
        self.outer_name, self.attrs, self.concat_weights = outer_name, attrs, concat_weights
        self.tile = group.tile()
        self.ops = group.ops
        self.yielded = list(group.block.last_op.operands)
        self.ref = widest(group)
        # Values seen as [rows, last] (chunked or whole): what `tile` chose, and what a group
        # regrouping its rows (a reshape inside) needs whatever the tile.
        self.flat = bool(self.tile.get("flat")) and all(row_local(op) for op in self.ops) or (
            any(op.op_name == Op.reshape for op in self.ops) and flat_rows_ok(group))
        # (flat) Chunks of columns: every value's window [:, s], the GEMM's weight [:, s].
        self.cols = bool(self.tile.get("cols")) and self.flat and cols_ok(group)
        self.chunked = (bool(self.tile.get("rows")) and all(row_local(op) for op in self.ops)) or self.cols
        # (flat) The GEMM runs whole on BLAS's threads before the loop, which runs the epilogue.
        self.blas = bool(self.tile.get("blas")) and self.flat and not self.cols
        self.aliased: set[SSAValue] = set()  # values sharing memory with another (reshapes): never donors
        self.axis = self.tile.get("axis", self.ref.rank - 2)
        self.home: dict[SSAValue, Home] = {}  # full-size values: params, buffers, views of them
        self.temp: dict[SSAValue, str] = {}  # chunk temporaries
        # The chunk loop's own names: a parameter named `s` (a weight 's', found by hypothesis) was
        # read as the chunk's slice.
        self.used_names: set[str] = {"chunk", "s"}
        self.buffers: list[Buffer] = []
        self.buffer_of: dict[SSAValue, tuple[int, str]] = {}
        self.prelude: list[str] = []  # lines before the chunk loop
        self._flat_names: dict[str, str] = {}

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

    def _flat(self, base: str, kind: str) -> str:
        """(flat) A name for `base` seen as [rows, last] ('full') or as its last axis ('last')."""
        if (base, kind) not in self._flat_names:
            name = self._fresh(f"{base}_2d" if kind == "full" else f"{base}_1d")
            shape = f"-1, {base}.shape[-1]" if kind == "full" else "-1"
            self.prelude.append(f"{name} = {base}.reshape({shape})")
            self._flat_names[(base, kind)] = name
        return self._flat_names[(base, kind)]

    def _read(self, value: SSAValue) -> str:
        if value in self.temp:
            return self.temp[value]
        home = self.home[value]
        info = info_of(value.type)
        if self.cols:
            return self._read_cols(home.base, info)
        if self.flat:
            kind = operand_rows(info, self.ref, flat=True)
            if kind == "last" and info.rank > 1:
                return self._flat(home.base, "last")
            if kind == "last":
                return home.base
            return f"{self._flat(home.base, 'full')}[s{', ' + home.cols if home.cols else ''}]"
        if not self.chunked:
            return f"{home.base}[..., {home.cols}]" if home.cols else home.base
        base = f"{home.base}[..., {home.cols}]" if home.cols else home.base
        axis = self.axis - (self.ref.rank - info.rank)
        if axis < 0 or (isinstance(info.shape[axis], int) and info.shape[axis] == 1):
            return base  # broadcast along the chunk axis: every chunk reads all of it
        return f"{base}[{':, ' * axis}s]"

    def _read_cols(self, base: str, info: TensorInfo) -> str:
        """(cols) This chunk's columns of a value; a width-1 last axis is read whole."""
        narrow = info.rank == 0 or (isinstance(info.shape[-1], int) and info.shape[-1] == 1)
        if operand_rows(info, self.ref, flat=True) == "last":
            vector = self._flat(base, "last") if info.rank > 1 else base
            return vector if narrow else f"{vector}[s]"
        full = self._flat(base, "full")
        return full if narrow else f"{full}[:, s]"

    # --- the function ----------------------------------------------------------------

    def emit(self) -> GroupCode:
        group = self.group
        params = list(group.operands)
        for arg, outer in zip(group.block.args, params):
            self.home[arg] = Home(self._fresh(self.outer_name(outer)))
        anchors = [op for op in self.ops if op.op_name in ANCHORS]
        whole: list[str] = []  # anchors computed before the loop
        chunk: list[str] = []
        if len(anchors) > 1:
            chunk += self._horizontal(anchors)
        elif anchors and self.flat and row_gemm(anchors[0]):  # (flat: whole or chunked, GEMM rows in the loop)
            chunk += self._row_gemm(anchors[0])
        elif anchors:
            whole += self._anchor(anchors[0])
        last_use = {}
        for i, op in enumerate(self.ops):
            for v in op.operands:
                last_use[v] = i
        for i, op in enumerate(self.ops):
            if op.op_name == Op.reshape:  # (flat) the same rows: the result is its operand
                self._alias(op.results[0], op.operands[0])
            elif op.op_name not in ANCHORS:
                chunk.append(self._chunk_line(op, i, last_use))
        body = whole + self.prelude
        if chunk:
            body.append("def chunk(s):")
            body += [INDENT + line for line in chunk]
            rows = self.tile.get("cols" if self.cols else "rows", 0) if self.chunked else 0
            body.append(f"run_chunks(chunk, {self._length()}, {rows})" if rows else "chunk(slice(None))")
        results = [self.buffer_of[v] for v in self.yielded]
        returns = [self.buffers[b].name + (f"[..., {cols}]" if cols else "") for b, cols in results]
        body.append(f"return {', '.join(returns)}" + ("," if len(returns) == 1 else ""))
        params_code = ", ".join([self.home[a].base for a in group.block.args] + [b.name for b in self.buffers])
        tile = ", ".join(f"{k}={v}" for k, v in self.tile.items())
        doc = py_docstring(f'{group.kind}: {" ".join(op.op_name for op in self.ops)}' + (f"; tile {tile}" if tile else ""))
        function = [f"def {self.name}({params_code}):", INDENT + doc] + [INDENT + line for line in body]
        return GroupCode(function, self.name, params, self.buffers, results)

    def _alias(self, result: SSAValue, operand: SSAValue) -> None:
        if operand in self.temp:
            self.temp[result] = self.temp[operand]
        else:
            self.home[result] = self.home[operand]
        self.aliased |= {result, operand}

    def _length(self) -> str:
        """The number of rows (flat) or the chunk axis' length, read off a result buffer."""
        for b, _ in self.buffer_of.values():
            buf = self.buffers[b]
            # (flat) Any result with the group's rows, however grouped: a reshape may have
            # dropped a unit axis of the widest value (hypothesis: [1, 2, 4, 1] -> [2, 4, 1]).
            if self.flat and operand_rows(buf.info, self.ref, flat=True) == "full":
                return f"{self._flat(buf.name, 'full')}.shape[{1 if self.cols else 0}]"
            if not self.flat and buf.info.rank == self.ref.rank:
                return f"{buf.name}.shape[{self.axis}]"
        raise AssertionError("a chunked group has a result spanning its rows")

    def _own(self, value: SSAValue, buffer: tuple[int, str], cols: str = "") -> None:
        index, name = buffer
        self.buffer_of[value] = (index, cols)
        self.home[value] = Home(name, cols)

    def _render(self, op: TgOp, operands: list[str]) -> str:
        out = op.result_infos()[0]
        attrs = self.attrs(op)
        if self.flat:  # values are [rows, last]: a last-axis reduction is over axis -1
            if "axis" in attrs and op.SPEC.row_normalizing:
                attrs["axis"] = -1
            if "axes" in attrs:
                attrs["axes"] = (-1,)
        return render(op.SPEC, operands, attrs, "None", dtype_code(out.dtype))

    def _anchor(self, op: TgOp) -> list[str]:
        """An anchor computed whole before the chunk loop, into a buffer."""
        out = op.result_infos()[0]
        index, name = self._buffer(out)
        self._own(op.results[0], (index, name))
        operands = [self.home[v].base for v in op.operands]
        if op.op_name == Op.attention and "block_kv" in self.tile:
            q, k, v = operands[:3]
            mask = operands[3] if len(operands) > 3 else "None"
            return [f"attention_tiled({q}, {k}, {v}, {mask}, {op.attr('scale')!r}, {op.attr('causal')}, "
                    f"{self.tile['block_q']}, {self.tile['block_kv']}, threads=THREADS, out={name})"]
        if row_gemm(op):  # one GEMM of all rows: NumPy would loop over the batch dims
            lhs = operands[0]
            return [f"np.matmul({lhs}.reshape(-1, {lhs}.shape[-1]), {operands[1]}, "
                    f"out={name}.reshape(-1, {name}.shape[-1]))"]
        expr = self._render(op, operands)
        return [with_out(expr, name) if accepts_out(expr) else f"{name}[...] = {expr}"]

    def _row_gemm(self, op: TgOp) -> list[str]:
        """(flat) The GEMM rows of this chunk, into its result buffer."""
        index, name = self._buffer(op.result_infos()[0])
        self._own(op.results[0], (index, name))
        weight = self.home[op.operands[1]].base
        if self.blas:
            self._whole_gemm(self.home[op.operands[0]].base, weight, name)
            return []
        if self.cols:  # all the rows against this chunk's columns of the weight
            lhs = self._flat(self.home[op.operands[0]].base, "full")
            return [f"np.matmul({lhs}, {weight}[:, s], out={self._read(op.results[0])})"]
        lhs = self._read(op.operands[0])
        return [f"np.matmul({lhs}, {weight}, out={self._read(op.results[0])})"]

    def _horizontal(self, anchors: list[TgOp]) -> list[str]:
        """Sibling matmuls as one GEMM against their concatenated weights; results are column windows."""
        widths = [info_of(op.results[0].type).shape[-1] for op in anchors]
        ref = anchors[0].result_infos()[0]
        combined = self._buffer(TensorInfo(ref.shape[:-1] + (sum(widths),), ref.dtype))
        # The weights are block arguments here; build() concatenates the values they stand for.
        weights = self.concat_weights([self.group.operands[op.operands[1].index] for op in anchors])  # type: ignore[attr-defined]
        lhs = self.home[anchors[0].operands[0]].base
        offset = 0
        for op, width in zip(anchors, widths):
            self._own(op.results[0], combined, f"{offset}:{offset + width}")
            offset += width
        note = f"  # {len(anchors)} sibling matmuls, one GEMM"
        if self.blas:
            self._whole_gemm(lhs, weights, combined[1], note)
            return []
        if self.flat:
            lhs_rows = self._read(anchors[0].operands[0])
            return [f"np.matmul({lhs_rows}, {weights}, out={self._flat(combined[1], 'full')}[s])" + note]
        self.prelude.append(f"np.matmul({lhs}.reshape(-1, {lhs}.shape[-1]), {weights}, "
                            f"out={combined[1]}.reshape(-1, {combined[1]}.shape[-1])){note}")
        return []

    def _whole_gemm(self, lhs: str, weight: str, out: str, note: str = "") -> None:
        """(blas) All the rows of a GEMM at once, on BLAS's threads, before the chunk loop."""
        lhs_2d, out_2d = self._flat(lhs, "full"), self._flat(out, "full")
        self.prelude += ["with blas_threads():", f"{INDENT}np.matmul({lhs_2d}, {weight}, out={out_2d}){note}"]

    def _chunk_line(self, op: TgOp, index: int, last_use: dict) -> str:
        operands = [self._read(v) for v in op.operands]
        expr = self._render(op, operands)
        result = op.results[0]
        out = info_of(result.type)
        # Reuse the memory of an operand that dies here, has the result's shape and dtype,
        # and belongs to the group (a buffer it writes, or a chunk temporary).
        # (A rank-0 temporary is a NumPy scalar, not an array: it cannot be written into.)
        donors = [v for v in op.operands if last_use.get(v) == index and v not in self.yielded and v not in self.aliased
                  and info_of(v.type) == out and ((v in self.temp and out.rank > 0) or v in self.buffer_of)]
        if result in self.yielded:  # lives on after the group: a buffer, a dying one if there is one
            donor = next((v for v in donors if v in self.buffer_of), None)
            if donor is not None:
                b, cols = self.buffer_of[donor]
                self._own(result, (b, self.buffers[b].name), cols)
            else:
                self._own(result, self._buffer(out))
            target = self._read(result)
        elif donors and donors[0] in self.temp:
            target = self.temp[result] = self.temp[donors[0]]
        elif donors:
            b, cols = self.buffer_of[donors[0]]
            self._own(result, (b, self.buffers[b].name), cols)
            target = self._read(result)
        else:
            target = self.temp[result] = self._fresh(f"t{index}")
            return f"{target} = {expr}"
        if accepts_out(expr):
            return with_out(expr, target)
        return f"{target}[...] = {expr}"
