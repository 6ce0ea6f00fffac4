"""The cost model: FLOPs, bytes and predicted time of every op and fused group.

What it computes, per op and per `tg.fusion` group, as sympy expressions in the
model's symbolic dims (evaluated at concrete sizes on demand):

* `flops`: arithmetic, a multiply-add counted as 2 (the FLOPs-only baseline ranks
  kernels by this alone);
* `bytes`: memory traffic when each input is read once and each output written
  once. For a fused group only the group's inputs and outputs count: the values
  between its ops stay in cache (CPU chunks) or registers (GPU);
* `time`: the roofline, max(compute, memory), plus fixed overheads, and `bound`,
  which of the two terms won.

How time is predicted depends on how code runs on the target (`Hardware.execution`), because
the backends execute a group differently: each way has its module in passes/targets/ (GPU
kernels, the NumPy backend's chunked calls, the C backend's compiled steps), with the same
functions, `op_cost`, `quant_cost`, `group_cost` and the tile pass's `tile`. This module holds
what they share and dispatches to them.

A dim known only at run time (tg.nonzero's count, ir/ops.py) is priced at its expected size,
the defining op's stated fraction of its upper bound (`expected_sizes`); `module_cost` states
the sizes it used in `ModelCost.expected`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass, field
from functools import reduce
from typing import Iterable, Mapping, Sequence

import numpy as np
import sympy
from xdsl.ir import BlockArgument, Operation, SSAValue

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.fusion import ANCHORS, VIEW_OPS, flat_ok, row_gemm, siblings, widest
from tilegraph.ir.ops import Op, QUANTIZATION_OPS
from tilegraph.ir.ops import expected_sizes as op_expected_sizes
from tilegraph.ir.shapes import Dim, TensorInfo, info_of, numel, symbol

# FLOPs and the NumPy templates' passes per element are traits of the op table
# (OpSpec.flops, cpu_passes, numpy_calls in ir/ops.py).

# Entries per memoized term before its cache starts over (a BERT's passes make a few thousand).
MEMO_ENTRIES = 20_000


@dataclass
class Cost:
    """What one op or group costs; every field a sympy expression in the symbolic dims."""

    flops: sympy.Expr
    bytes: sympy.Expr
    time: sympy.Expr  # seconds
    compute_time: sympy.Expr
    memory_time: sympy.Expr
    overhead: sympy.Expr  # launches, NumPy calls, allocations
    kernels: int = 1
    label: str = ""
    ops: list[str] = field(default_factory=list)

    @property
    def intensity(self) -> sympy.Expr:
        """Arithmetic intensity, FLOPs per byte."""
        return self.flops / self.bytes if self.bytes != 0 else sympy.oo

    def bound(self, sizes: Mapping[str, int] | None = None) -> str:
        compute, memory = at(self.compute_time, sizes), at(self.memory_time, sizes)
        if max(compute, memory) < at(self.overhead, sizes):
            return "overhead"
        return "compute" if compute >= memory else "memory"

    def evaluate(self, sizes: Mapping[str, int] | None = None) -> dict[str, float]:
        return {"flops": at(self.flops, sizes), "bytes": at(self.bytes, sizes), "time": at(self.time, sizes)}


def at(expr, sizes: Mapping[str, int] | None = None) -> float:
    """A cost expression at concrete sizes (symbols by name)."""
    expr = sympy.sympify(expr)
    if sizes and expr.free_symbols:
        expr = expr.subs({s: sizes[s.name] for s in expr.free_symbols if s.name in sizes})
    if expr.free_symbols:
        missing = ", ".join(sorted(s.name for s in expr.free_symbols))
        raise ValueError(f"the cost depends on {missing}: give their sizes")
    return float(expr)


# --- pricing at the nominal size ----------------------------------------------------
# `fuse` and `tile` decide by costs at NOMINAL_DIM (at_nominal), not by formulas. Built
# from symbolic dims, each candidate's cost is a formula sympy must collapse (Piecewise
# regimes, Max and Min of symbolic terms, compared under the dims' assumptions) only to
# have the dims substituted at the end: most of their time on a model with dynamic
# batch and sequence. Within `nominal_sizes()` every size enters the model already at
# NOMINAL_DIM, so the same arithmetic runs on numbers; shapes without symbols are unchanged.
_NOMINAL = contextvars.ContextVar("tilegraph_cost_nominal", default=False)


@contextlib.contextmanager
def nominal_sizes():
    """Within: costs are numbers, the symbolic dims at NOMINAL_DIM (what at_nominal gives)."""
    token = _NOMINAL.set(True)
    try:
        yield
    finally:
        _NOMINAL.reset(token)


def sized(expr) -> sympy.Expr:
    """A size (a dim, an element or FLOP count) as the model prices it now."""
    expr = sympy.sympify(expr)
    return _at_nominal_dims(expr) if _NOMINAL.get() and expr.free_symbols else expr


@functools.lru_cache(maxsize=MEMO_ENTRIES)
def _at_nominal_dims(expr: sympy.Expr) -> sympy.Expr:
    return expr.subs({s: NOMINAL_DIM for s in expr.free_symbols})


def nbytes(info: TensorInfo) -> sympy.Expr:
    return element_count(info) * dtypes.numpy_dtype(info.dtype).itemsize


def element_count(info: TensorInfo) -> sympy.Expr:
    return sized(_numel(info.shape))


@functools.lru_cache(maxsize=MEMO_ENTRIES)
def _numel(shape) -> sympy.Expr:
    return sympy.sympify(numel(shape))


def prod(dims: Iterable[Dim]) -> sympy.Expr:
    return sized(reduce(lambda a, b: a * b, (sympy.sympify(d) for d in dims), sympy.Integer(1)))


def op_flops(op: TgOp) -> sympy.Expr:
    """FLOPs of one op (multiply-add = 2): the op table's `flops` trait at its shapes."""
    return sized(op.SPEC.flop_count([info_of(v.type) for v in op.operands], op.result_infos()))


def forward_flops(module, sizes: Mapping[str, int] | None = None) -> float:
    """FLOPs of one call of `module`'s @forward as written (convolutions direct, attention whole):
    the work a runtime that saves none must do, the numerator of a model's share of peak."""
    func = next(f for f in module.walk() if getattr(f, "sym_name", None) and f.sym_name.data == "forward")
    return sum(at(op_flops(op), sizes) for op in func.body.block.ops if isinstance(op, TgOp))


def op_bytes(op: Operation) -> sympy.Expr:
    """Bytes in (each operand once) and out (each result once)."""
    return sum((nbytes(info_of(v.type)) for v in op.operands), sympy.Integer(0)) + \
        sum((nbytes(info_of(r.type)) for r in op.results), sympy.Integer(0))


def matmul_shape(op: TgOp) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
    """(m, n, k) of the GEMM an anchor makes (the op table's `gemm`), as the model prices sizes now."""
    m, n, k = op.SPEC.gemm_dims([info_of(v.type) for v in op.operands], op.result_infos())
    return sized(m), sized(n), sized(k)


# A symbolic GEMM dim is costed at this size when the formula is printed symbolically:
# a sequence or batch of a few hundred rows is where these models run.
NOMINAL_DIM = 256


def gemm_rate(hw, op: TgOp) -> float:
    if op.op_name == Op.einsum:  # no fixed GEMM shape: priced as a cube of the same volume
        m = n = k = max(1.0, at_nominal(op_flops(op)) / 2) ** (1 / 3)
    else:
        m, n, k = (at_nominal(d) for d in matmul_shape(op))
    # (an empty tensor: priced as the smallest GEMM; it costs its call overhead anyway)
    return hw.matmul_rate(max(1, int(m)), max(1, int(n)), max(1, int(k)), op.result_infos()[0].dtype)


def memo_hw(fn):
    """`fn(hw, *args)` memoized: the cost model rebuilds the same sympy terms for every
    op and candidate group, and on symbolic dims building a Piecewise (sympy collapses and
    compares its conditions) costs milliseconds each. The Hardware is
    keyed by identity (its dict fields make it unhashable) and kept alive by the entry,
    so its id is never reused while the entry is there."""
    cache: dict = {}

    def memo(hw, *args):
        key = (id(hw), *args)
        hit = cache.get(key)
        if hit is None or hit[0] is not hw:
            if len(cache) > MEMO_ENTRIES:
                cache.clear()
            hit = cache[key] = (hw, fn(hw, *args))
        return hit[1]

    memo.__doc__, memo.__name__ = fn.__doc__, fn.__name__
    return memo


def interpolate(samples: Sequence[tuple[int, float]], x: float) -> float:
    """The sampled value at x, linear in log(x) between samples, clamped at the ends."""
    xs, ys = zip(*sorted(samples))
    return float(np.interp(math.log(max(x, 1)), [math.log(v) for v in xs], ys))


def through_views(v: SSAValue) -> SSAValue:
    """The value `v` is a view of (through reshapes, transposes, ..., and out of a
    `tg.fusion` body to the group's operand), or v itself."""
    while True:
        if isinstance(v, BlockArgument) and isinstance(v.owner.parent_op(), FusionOp):
            v = v.owner.parent_op().operands[v.index]
        elif isinstance(v.owner, TgOp) and v.owner.op_name in VIEW_OPS and v.owner.operands:
            v = v.owner.operands[0]
        else:
            return v


@memo_hw
def parallel_speedup(hw, workers) -> sympy.Expr:
    """The speedup of `workers` cores (a sympy expression), at the calibrated efficiency."""
    workers = sympy.sympify(workers)
    return sympy.Piecewise((1, workers <= 1), (workers * hw.parallel_efficiency, True))


def cold_bytes(ops: Sequence[TgOp]) -> sympy.Expr:
    """Bytes of the weights `ops` read: from memory on every run. A weight that only lookups
    read (an embedding table, a rotary table) costs the rows they take, any other all of it."""
    whole: dict[SSAValue, None] = {}
    looked_up: dict[SSAValue, sympy.Expr] = {}
    for op in ops:
        for index, operand in enumerate(op.operands):
            v = through_views(operand)
            if not (isinstance(v.owner, TgOp) and v.owner.op_name == Op.weight):
                continue
            rows = _bytes_looked_up(op) if index == 0 else None
            if rows is None:
                whole[v] = None
            else:
                looked_up[v] = looked_up.get(v, sympy.Integer(0)) + rows
    total = sum((nbytes(info_of(v.type)) for v in whole), sympy.Integer(0))
    return total + sum((sympy.Min(rows, nbytes(info_of(v.type))) for v, rows in looked_up.items() if v not in whole),
                       sympy.Integer(0))


def _bytes_looked_up(op: TgOp) -> sympy.Expr | None:
    """Bytes of its operand 0 that `op` reads when it only looks entries up: what a gather
    returns, a block-format row per index for block_gather; None for any other op."""
    if op.SPEC.indexed:
        return nbytes(op.result_infos()[0])
    if op.op_name == Op.block_gather:
        table = info_of(op.operands[0].type)
        return element_count(info_of(op.operands[1].type)) * nbytes(table) / sized(table.shape[0])
    return None


def target(hw):
    """The module of the way code runs on `hw` (`Hardware.execution`): its op, quantization
    and group costs and its tiles (module docstring)."""
    from tilegraph.passes.targets import c, gpu, numpy

    return {"gpu": gpu, "c": c, "numpy": numpy}[hw.execution]


def free(name: str) -> Cost:
    """What an op no kernel runs costs (a weight, a constant, a view that only renames)."""
    zero = sympy.Integer(0)
    return Cost(zero, zero, zero, zero, zero, zero, kernels=0, label=name, ops=[name])


def op_cost(op: TgOp, hw) -> Cost:
    """The predicted cost of one op run on its own (an unfused kernel / NumPy call)."""
    if op.op_name in QUANTIZATION_OPS or (op.op_name == Op.matmul and any(dequantized(v) for v in op.operands)):
        return target(hw).quant_cost(op, hw)
    return float_cost(op, hw)


def float_cost(op: TgOp, hw) -> Cost:
    """op_cost of an op that neither is a quantization op nor reads one's result."""
    if op.op_name in (Op.weight, Op.constant):
        return free(op.op_name)
    return target(hw).op_cost(op, hw)


def quant_flops(op: TgOp) -> sympy.Expr:
    """The FLOPs of a quantization op or a GEMM on dequantized operands: the GEMM's (a
    tg.matmul_integer's as the float GEMM it is), none for the conversions."""
    if op.op_name == Op.matmul_integer:
        m, n, k = matmul_shape(op)
        return 2 * m * n * k
    return op_flops(op) if op.op_name in (Op.matmul, Op.block_matmul) else sympy.Integer(0)


def dequantized(v) -> TgOp | None:
    """The tg.dequantize producing `v`, if one does."""
    owner = v.owner
    return owner if isinstance(owner, TgOp) and owner.op_name == Op.dequantize else None


def storage_bytes(info: TensorInfo) -> sympy.Expr:
    """Bytes of a tensor as stored (4-bit types two to a byte)."""
    bits = 4 if info.dtype in dtypes.PACKED_4BIT else 8 * dtypes.numpy_dtype(info.dtype).itemsize
    return element_count(info) * bits / 8


@functools.lru_cache(maxsize=MEMO_ENTRIES)
def at_nominal(expr: sympy.Expr) -> float:
    expr = sympy.sympify(expr)
    return at(expr.subs({s: NOMINAL_DIM for s in expr.free_symbols}))


def group_traffic(ops: Sequence[TgOp], inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo]):
    """(FLOPs, bytes) of a group: its ops' arithmetic, its inputs read and outputs written once."""
    zero = sympy.Integer(0)
    return (sum((op_flops(op) for op in ops), zero),
            sum((nbytes(i) for i in inputs), zero) + sum((nbytes(o) for o in outputs), zero))


def group_cost(ops: Sequence[TgOp], inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo], hw,
               chunks: sympy.Expr | int | None = None, gemm_rows: int | None = None, label: str = "",
               gemm_cols: int | None = None, blas_gemm: bool = False) -> Cost:
    """The predicted cost of ops fused into one group with these inputs and outputs, as the
    target runs it. The NumPy backend's chunks (`chunks`, `gemm_rows`, `gemm_cols`,
    `blas_gemm`: targets/numpy.group_cost) come from `tile`; the other targets run a group
    whole."""
    anchors = [op for op in ops if op.op_name in ANCHORS]
    rest = [op for op in ops if op.op_name not in ANCHORS and op.op_name not in VIEW_OPS]
    return target(hw).group_cost(ops, anchors, rest, inputs, outputs, hw, label=label, chunks=chunks,
                                 gemm_rows=gemm_rows, gemm_cols=gemm_cols, blas_gemm=blas_gemm)


def one_gemm(anchors: Sequence[TgOp]) -> bool:
    """Whether a group's anchors run as one row GEMM: a lone one, or siblings (a chain of
    two GEMMs, which `fuse` never makes, is priced whole)."""
    return siblings(anchors) and all(row_gemm(op) for op in anchors)


def flat(ops: Sequence[TgOp]) -> bool:
    """Whether ops (a group to be) may run on their values seen as [rows, last axis]
    (ir.fusion.flat_ok, with the inputs read off the ops)."""
    inside = set(ops)
    uses = [(op, i, info_of(v.type)) for op in ops for i, v in enumerate(op.operands) if v.owner not in inside]
    ref = max((info_of(r.type) for op in ops for r in op.results), key=lambda i: i.rank)
    return flat_ok(list(ops), uses, ref)


def fusion_cost(group: FusionOp, hw) -> Cost:
    """The cost of a `tg.fusion` op as the backend will run it: by its tile, or before `tile`
    ran, the cheapest way it may be tiled (what `fuse` assumed when it made the group)."""
    if "tile" not in group.attributes:
        return group_cost(group.ops, [info_of(v.type) for v in group.operands],
                          [info_of(r.type) for r in group.results], hw, label=group.kind)
    tile = group.tile()
    chunks, rows, cols = 1, tile.get("rows"), tile.get("cols")  # neither: the group runs as one chunk
    if rows or cols:  # as many chunks as they make at these sizes (`chunks` on the tile is at nominal ones)
        ref = widest(group)
        if cols:
            total = sized(ref.shape[-1])
        else:
            total = prod(ref.shape[:-1]) if tile.get("flat") else sized(ref.shape[tile.get("axis", 0)])
        # (backends/numpy/chunks.py) never fewer chunks than cores while there are rows for them
        chunks = sympy.Max(sympy.ceiling(total / (cols or rows)), sympy.Min(total, hw.cores))
    rows = rows if tile.get("flat") else None
    return group_cost(group.ops, [info_of(v.type) for v in group.operands],
                      [info_of(r.type) for r in group.results], hw, chunks=chunks, gemm_rows=rows, label=group.kind,
                      gemm_cols=cols, blas_gemm=bool(tile.get("blas")))


@dataclass
class ModelCost:
    """Per-kernel costs of a whole module and their totals."""

    rows: list[tuple[str, Cost]]  # (what: op name or "fusion <kind>", its cost)
    # The dims known only at run time and the sizes they are priced at (expected_sizes).
    expected: dict[str, sympy.Expr] = field(default_factory=dict)

    @property
    def time(self) -> sympy.Expr:
        return sum((c.time for _, c in self.rows), sympy.Integer(0))

    @property
    def flops(self) -> sympy.Expr:
        return sum((c.flops for _, c in self.rows), sympy.Integer(0))

    @property
    def bytes(self) -> sympy.Expr:
        return sum((c.bytes for _, c in self.rows), sympy.Integer(0))

    @property
    def kernels(self) -> int:
        return sum(c.kernels for _, c in self.rows)


def module_cost(module: Operation, hw) -> ModelCost:
    """Every top-level kernel of @forward: fused groups, and the ops left outside groups."""
    rows: list[tuple[str, Cost]] = []
    for op in module.walk():
        if isinstance(op, FusionOp):
            rows.append((f"fusion {op.kind}", fusion_cost(op, hw)))
        elif isinstance(op, TgOp) and not isinstance(op.parent_op(), FusionOp):
            if op.op_name not in (Op.weight, Op.constant):
                rows.append((op.op_name, op_cost(op, hw)))
    expected = expected_sizes(module)
    if expected:
        subs = {symbol(k): v for k, v in expected.items()}
        rows = [(what, Cost(*(sympy.sympify(getattr(c, f)).xreplace(subs) for f in _PRICED), kernels=c.kernels,  # type: ignore[misc]
                            label=c.label, ops=c.ops)) for what, c in rows]
    return ModelCost(rows, expected)


_PRICED = ("flops", "bytes", "time", "compute_time", "memory_time", "overhead")


def expected_sizes(module: Operation) -> dict[str, sympy.Expr]:
    """The size each dim known only at run time is priced at: the defining op's `expected`
    fraction of its upper bound (ir/ops.py), in the input symbols (a bound may itself hold an
    earlier run-time dim: a nonzero over a nonzero's result)."""
    expected: dict[str, sympy.Expr] = {}
    for op in module.walk():
        if isinstance(op, TgOp):
            for name, size in op_expected_sizes([op]).items():
                expected[name] = sympy.sympify(size).xreplace({symbol(k): v for k, v in expected.items()})
    return expected


__all__ = ["Cost", "ModelCost", "op_cost", "op_flops", "op_bytes", "group_cost", "fusion_cost", "module_cost", "at",
           "expected_sizes", "nominal_sizes", "ANCHORS", "VIEW_OPS"]
