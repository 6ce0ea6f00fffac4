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

How time is predicted depends on the target, because the backends execute a group
differently:

* GPU (Triton): one kernel per group: launch overhead + max(flops / peak(dtype),
  bytes / HBM bandwidth); matmuls at `Hardware.matmul_rate` (tile quantization).
* CPU (the NumPy backend): GEMMs at the calibrated per-core rate of their shape
  (`Hardware.matmul_rate`), on one core when run whole in a group, on all cores when
  cut into chunks or run on BLAS's threads. The attention kernel runs at its own
  calibrated rate by head dim (`Hardware.attention_rates`): its batched small GEMMs
  over strided heads are far off the GEMM curve. NumPy makes one pass over memory per
  ufunc call, so an op costs the passes its kernel makes (the op table's `cpu_passes`) at the
  calibrated rate of each ufunc, or, for the kernels the profile timed whole (gelu,
  layer_norm, softmax), one pass at that kernel's rate; cache-resident rates for
  operands that fit one core's L2, spilled rates for bigger ones. Plus the fixed
  cost of each call. A fused group runs its non-contraction ops over row or column
  chunks on all cores (what `tile` writes and the NumPy backend does). Main memory:
  a kernel's weights always (a model's weights outgrow the caches), and the rest of
  its inputs and outputs unless they fit one core's L2; added to compute, not
  overlapped, since NumPy makes one pass at a time.

* CPU (the C backend, a profile of `backend` "c": backends/c/calibrate.py): a group is
  one step of the compiled module, one loop over memory whatever its length, its GEMM or
  convolution on oneDNN with all threads (`Hardware.matmul_rate(threaded=True)`), its
  attention on the flash kernel. So a group costs its step's fixed cost (an OpenMP region
  when it is large enough for one, `C_PARALLEL_MIN`), its anchors, and the roofline of its
  loop: the calibrated per-element rate of each op in the loop on all threads against its
  inputs and outputs at the pass bandwidth (L2 while they fit the cores' caches, weights
  always from memory). Fusing a chain thus saves a step and the intermediate passes,
  never a NumPy call. `_c_group_cost`.

A dim known only at run time (tg.nonzero's count, ir/ops.py) is priced at its expected size,
the defining op's stated fraction of its upper bound (`expected_sizes`); `module_cost` states
the sizes it used in `ModelCost.expected`.

Quantization ops (tg.quantize, tg.dequantize, tg.dynamic_quantize, tg.matmul_integer) are
costed as each target runs them:

* CPU (NumPy): what ir/quant.py does, pass by pass: casts to and from the storage type
  (ml_dtypes' 4- and 8-bit float casts are ~150x an f32 add here: `CAST_PASSES`), the scale
  broadcast, multiply, rint, clip; a weight-only layer dequantizes its whole weight every
  call, and tg.matmul_integer converts both operands to float32 and runs an sgemm, so on
  this backend quantization predicts no speedup (measured: benchmarks/quantization.py).
* GPU: the kernels a low-precision GEMM is made of (as cuBLASLt / Triton's `tl.dot` on int8
  and fp8 run them): a dequantize feeding only GEMMs is that GEMM's prologue (no kernel of
  its own; the GEMM reads the stored type's bytes and the scales), a GEMM whose operands are
  both dequantized from 8-bit (or narrower) types runs at the peak of that type
  (`Hardware.flops`, which falls back where a part lacks it: fp8 on A100 -> bf16), and
  tg.matmul_integer at the i8 peak, as backends/triton/quant.py emits them.
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
from tilegraph.ir.hardware import MIN_PARALLEL_SCORES
from tilegraph.ir.block_formats import PANEL_ELEMENTS
from tilegraph.ir.ops import Op, OPS, QUANTIZATION_OPS
from tilegraph.ir.ops import expected_sizes as op_expected_sizes
from tilegraph.ir.shapes import Dim, TensorInfo, info_of, numel, symbol


# FLOPs and the NumPy templates' passes per element are traits of the op table
# (OpSpec.flops, cpu_passes, numpy_calls in ir/ops.py).

# Cost of one astype between float32 and a storage type, in f32 add passes (ns per element
# over an f32 add's): ml_dtypes' float formats convert element by element in C, dozens of
# times an add; integer casts are vectorised, about one. Ratios of one measurement on
# 64K-element arrays, not calibrated per machine yet; the other 4-6-bit floats are taken
# as f4E2M1FN.
CAST_PASSES = {  # storage type: (to float32, from float32)
    "f4E2M1FN": (155, 160), "f6E2M3FN": (155, 160), "f8E4M3FN": (150, 92), "f8E5M2": (150, 92),
    "f8E8M0FNU": (68, 180), "i4": (1, 70), "i8": (1, 1), "ui8": (1, 1), "i32": (1, 1),
}
# np.clip with scalar bounds, in f32 add passes (7.1 ns an element against 0.28, same measurement).
CLIP_PASSES = 25

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


def _sized(expr) -> sympy.Expr:
    """A size (a dim, an element or FLOP count) as the model prices it now."""
    expr = sympy.sympify(expr)
    return _at_nominal_dims(expr) if _NOMINAL.get() and expr.free_symbols else expr


@functools.lru_cache(maxsize=MEMO_ENTRIES)
def _at_nominal_dims(expr: sympy.Expr) -> sympy.Expr:
    return expr.subs({s: NOMINAL_DIM for s in expr.free_symbols})


def _nbytes(info: TensorInfo) -> sympy.Expr:
    return _elements(info) * dtypes.numpy_dtype(info.dtype).itemsize


def _elements(info: TensorInfo) -> sympy.Expr:
    return _sized(_numel(info.shape))


@functools.lru_cache(maxsize=MEMO_ENTRIES)
def _numel(shape) -> sympy.Expr:
    return sympy.sympify(numel(shape))


def _prod(dims: Iterable[Dim]) -> sympy.Expr:
    return _sized(reduce(lambda a, b: a * b, (sympy.sympify(d) for d in dims), sympy.Integer(1)))


def op_flops(op: TgOp) -> sympy.Expr:
    """FLOPs of one op (multiply-add = 2): the op table's `flops` trait at its shapes."""
    return _sized(op.SPEC.flop_count([info_of(v.type) for v in op.operands], op.result_infos()))


def op_bytes(op: Operation) -> sympy.Expr:
    """Bytes in (each operand once) and out (each result once)."""
    return sum((_nbytes(info_of(v.type)) for v in op.operands), sympy.Integer(0)) + \
        sum((_nbytes(info_of(r.type)) for r in op.results), sympy.Integer(0))


def _matmul_shape(op: TgOp) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
    """(m, n, k) of the GEMM an anchor makes (the op table's `gemm`), as the model prices sizes now."""
    m, n, k = op.SPEC.gemm_dims([info_of(v.type) for v in op.operands], op.result_infos())
    return _sized(m), _sized(n), _sized(k)


# A symbolic GEMM dim is costed at this size when the formula is printed symbolically:
# a sequence or batch of a few hundred rows is where these models run.
NOMINAL_DIM = 256


def _gemm_rate(hw, op: TgOp) -> float:
    if op.op_name == Op.einsum:  # no fixed GEMM shape: priced as a cube of the same volume
        m = n = k = max(1.0, at_nominal(op_flops(op)) / 2) ** (1 / 3)
    else:
        m, n, k = (at_nominal(d) for d in _matmul_shape(op))
    # (an empty tensor: priced as the smallest GEMM; it costs its call overhead anyway)
    return hw.matmul_rate(max(1, int(m)), max(1, int(n)), max(1, int(k)), op.result_infos()[0].dtype)


def _memo_hw(fn):
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


@_memo_hw
def _cpu_passes_time(hw, name: str, elements: sympy.Expr, in_cache: bool, bytes_: sympy.Expr) -> sympy.Expr:
    """Time of the NumPy passes an op makes over `elements` values. A kernel the profile
    timed whole (gelu, layer_norm, softmax) is one pass at its own rate; operands too big
    for one core's L2 run at the spilled rate.

    By the op's whole size, not its chunk's: pricing chunks that fit at the cache rate
    made `tile` pick chunks of 16-32 rows on MiniLM and GPT-2, whose per-chunk costs in a
    running model (pool wake-ups, BLAS threads still spinning) it underprices."""
    passes = ((name, 1),) if name in hw.ufunc_rates else OPS[name].cpu_passes or (("add", 1),)
    compute = sympy.Integer(0)
    for ufunc, count in passes:
        rate = hw.ufunc_rates.get(ufunc) or hw.ufunc_rates.get("add") or hw.cache_bandwidth / 8
        spilled = hw.ufunc_rates_spilled.get(ufunc)
        if spilled:
            rate = sympy.Piecewise((rate, elements <= hw.cache_bytes // SPILL_ELEMENT_BYTES), (spilled, True))
        compute += count * elements / rate
    if in_cache:
        return compute
    return sympy.Max(compute, bytes_ / hw.memory_bandwidth)


# Bytes per element that a pass keeps in L2: two f32 operands, a result, and the rest of
# the chunk's live values (backends/numpy/calibrate.SPILLED_ELEMENTS spills at 1 MiB per array).
SPILL_ELEMENT_BYTES = 16


def _calls(name: str) -> int:
    spec = OPS[name]
    return spec.numpy_calls or sum(count for _, count in spec.cpu_passes or (("add", 1),))


def _anchor_time(op: TgOp, hw, cores: int) -> sympy.Expr:
    """(CPU) Compute time of an anchor run whole, its GEMMs on `cores` cores."""
    flops = op_flops(op)
    if op.op_name == Op.conv and hw.conv_rate:  # K.conv: im2col and small batched GEMMs, off the GEMM curve, one core
        return flops / hw.conv_rate
    if op.op_name != Op.attention:
        return flops / (_gemm_rate(hw, op) * _parallel(hw, cores))
    # attention_tiled (backends/numpy/attention.py): QK^T and PV GEMMs and a softmax over the scores, on all cores
    # only above the kernel's own threshold (ir/hardware.MIN_PARALLEL_SCORES).
    m, n, d = _matmul_shape(op)
    if hw.attention_rates:  # the kernel as calibrated: its batched small GEMMs are far off the GEMM curve
        one_core = flops / _interpolate(hw.attention_rates, at_nominal(d))
        speedup = hw.attention_speedup or _parallel(hw, hw.cores)
    else:
        one_core = flops / _gemm_rate(hw, op) + _cpu_passes_time(hw, "softmax", m * n, True, sympy.Integer(0))
        speedup = _parallel(hw, hw.cores)
    return sympy.Piecewise((one_core, m * n < MIN_PARALLEL_SCORES), (one_core / speedup, True))


def _interpolate(samples: Sequence[tuple[int, float]], x: float) -> float:
    """The sampled value at x, linear in log(x) between samples, clamped at the ends."""
    xs, ys = zip(*sorted(samples))
    return float(np.interp(math.log(max(x, 1)), [math.log(v) for v in xs], ys))


def _uncached(hw, bytes_: sympy.Expr, ops: Sequence[Operation]) -> sympy.Expr:
    """(CPU) Time to move a kernel's `bytes_` from memory: only its weights when the rest
    fits one core's cache, else all of them.

    Weights: read once per forward, and a model's weights outgrow the caches, so each
    comes from memory. One core's cache, not all of them: the kernel before ran its
    chunks on every core, so what it wrote sits in several private caches. Measured
    (benchmarks/cost_model_accuracy.py): GPT-2's 2.4 MB residual adds ran at memory,
    not cache, speed, though under 2 cores' L2.
    """
    weights = {v: None for op in ops for v in map(_through_views, op.operands)
               if isinstance(v.owner, TgOp) and v.owner.op_name == Op.weight}
    cold = sum((_nbytes(info_of(v.type)) for v in weights), sympy.Integer(0))
    return _from_memory(hw, bytes_, cold)


@_memo_hw
def _from_memory(hw, bytes_: sympy.Expr, cold: sympy.Expr) -> sympy.Expr:
    return sympy.Piecewise((cold, bytes_ <= hw.cache_bytes), (bytes_, True)) / hw.memory_bandwidth


def _through_views(v: SSAValue) -> SSAValue:
    """The value `v` is a view of (through reshapes, transposes, ..., and out of a
    `tg.fusion` body to the group's operand), or v itself."""
    while True:
        if isinstance(v, BlockArgument) and isinstance(v.owner.parent_op(), FusionOp):
            v = v.owner.parent_op().operands[v.index]
        elif isinstance(v.owner, TgOp) and v.owner.op_name in VIEW_OPS and v.owner.operands:
            v = v.owner.operands[0]
        else:
            return v


@_memo_hw
def _parallel(hw, workers) -> sympy.Expr:
    """The speedup of `workers` cores (a sympy expression), at the calibrated efficiency."""
    workers = sympy.sympify(workers)
    return sympy.Piecewise((1, workers <= 1), (workers * hw.parallel_efficiency, True))


def op_cost(op: TgOp, hw) -> Cost:
    """The predicted cost of one op run on its own (an unfused kernel / NumPy call)."""
    if op.op_name in QUANTIZATION_OPS or (op.op_name == Op.matmul and any(_dequantized(v) for v in op.operands)):
        return _quant_cost(op, hw)
    return _float_cost(op, hw)


def _float_cost(op: TgOp, hw) -> Cost:
    """op_cost of an op that neither is a quantization op nor reads one's result."""
    name = op.op_name
    flops, bytes_ = op_flops(op), op_bytes(op)
    out = op.result_infos()[0]
    zero = sympy.Integer(0)
    if name in (Op.weight, Op.constant):
        return Cost(zero, zero, zero, zero, zero, zero, kernels=0, label=name, ops=[name])
    if name in VIEW_OPS:  # nothing moves: a NumPy view, or index arithmetic in the consumer's GPU kernel
        overhead = sympy.Float(hw.launch_overhead if hw.kind == "cpu" and hw.backend != "c" else 0)
        return Cost(zero, zero, overhead, zero, zero, overhead, kernels=0, label=name, ops=[name])
    if hw.backend == "c":  # an op alone is a step of its own: a group of one
        if op.SPEC.category in ("layout", "source"):  # copies: gather, concat, pad, ...
            # A copy reads what it writes (a gather reads its rows, not the whole table; a
            # split writes every part); rows of a weight (an embedding) come from memory,
            # at most the whole table.
            moved = sum((_nbytes(info) for info in op.result_infos()), zero)
            tables = [v for v in map(_through_views, op.operands)
                      if isinstance(v.owner, TgOp) and v.owner.op_name == Op.weight]
            cold = sympy.Min(moved, sum((_nbytes(info_of(v.type)) for v in tables), zero)) if tables else zero
            # At the calibrated row-copy rate where the profile has one: a copy is short rows,
            # each checked against its bounds, not a streaming pass, and for the few rows a
            # lookup takes that rate, not where in memory the table lies, sets its time.
            memory = moved / hw.copy_bandwidth if hw.copy_bandwidth else _c_memory(hw, 2 * moved, cold)
            overhead = _c_step(hw, _elements(out))
            return Cost(flops, bytes_, memory + overhead, zero, memory, overhead, label=name, ops=[name])
        return group_cost([op], [info_of(v.type) for v in op.operands], op.result_infos(), hw, label=name)
    if hw.kind == "gpu":
        memory = bytes_ / hw.memory_bandwidth
        compute = flops / (_gemm_rate(hw, op) if name in ANCHORS else hw.flops(out.dtype))
        overhead = sympy.Float(hw.launch_overhead)
        return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=name,
                    ops=[name])
    # CPU, NumPy backend
    if op.SPEC.category in ("layout", "source"):  # copies: gather, concat, pad, ...
        overhead = sympy.Float(hw.launch_overhead)
        memory = bytes_ / hw.memory_bandwidth
        return Cost(flops, bytes_, memory + overhead, zero, memory, overhead, label=name, ops=[name])
    if name in ANCHORS:
        compute = _anchor_time(op, hw, cores=hw.cores)  # unfused: BLAS on all cores
        memory = bytes_ / hw.memory_bandwidth
        overhead = sympy.Float(hw.launch_overhead + hw.alloc_overhead)
        return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=name,
                    ops=[name])
    elements = _elements(out) if op.SPEC.category != "reduction" else _elements(info_of(op.operands[0].type))
    compute = _cpu_passes_time(hw, name, elements, True, bytes_)
    memory = _uncached(hw, bytes_, [op])
    overhead = sympy.Float(_calls(name) * hw.launch_overhead + hw.alloc_overhead)
    return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=name,
                ops=[name])


def _dequantized(v) -> TgOp | None:
    """The tg.dequantize producing `v`, if one does."""
    owner = v.owner
    return owner if isinstance(owner, TgOp) and owner.op_name == Op.dequantize else None


def _prologue(op: TgOp) -> bool:
    """(GPU) A dequantize whose every use is a GEMM operand: it runs inside that GEMM."""
    uses = [u.operation for u in op.results[0].uses]
    return bool(uses) and all(isinstance(u, TgOp) and u.op_name in (Op.matmul, Op.matmul_integer) for u in uses)


def _storage_bytes(info: TensorInfo) -> sympy.Expr:
    """Bytes of a tensor as stored (4-bit types two to a byte)."""
    bits = 4 if info.dtype in dtypes.PACKED_4BIT else 8 * dtypes.numpy_dtype(info.dtype).itemsize
    return _elements(info) * bits / 8


# Passes over each value a block format dequantizes (ir/block_formats.py's q4: two masked
# unpacks into the f32 panel, the scale, the offset; q8 and the k-quants about as many).
BLOCK_DEQUANT_PASSES = 4


def _quant_cost(op: TgOp, hw) -> Cost:
    """A quantization op, or a GEMM reading dequantized operands, as the target runs it (module docstring)."""
    name, zero = op.op_name, sympy.Integer(0)
    ins = [info_of(v.type) for v in op.operands]
    out = op.result_infos()[0]
    flops = op_flops(op) if name in (Op.matmul, Op.block_matmul) else zero
    if name == Op.matmul_integer:
        m, n, k = _matmul_shape(op)
        flops = 2 * m * n * k
    if hw.kind == "gpu":
        if name == Op.dequantize and _prologue(op):
            return Cost(zero, zero, zero, zero, zero, zero, kernels=0, label=name, ops=[name])
        reads = []
        for v, info in zip(op.operands, ins):
            dq = _dequantized(v) if name == Op.matmul else None
            if dq is not None and _prologue(dq):  # the GEMM reads what the dequantize would have
                reads += [_storage_bytes(info_of(x.type)) for x in dq.operands]
            else:
                reads.append(_storage_bytes(info))
        bytes_ = sum(reads, zero) + _storage_bytes(out)
        memory = bytes_ / hw.memory_bandwidth
        if name in (Op.matmul, Op.matmul_integer):
            narrow = [info_of(d.operands[0].type).dtype for v in op.operands if (d := _dequantized(v)) is not None]
            dtype = "i8" if name == Op.matmul_integer else (
                min(narrow, key=lambda t: dtypes.numpy_dtype(t).itemsize) if len(narrow) == 2 else out.dtype)
            m, n, k = (max(1, int(at_nominal(d))) for d in _matmul_shape(op))
            compute = flops / hw.matmul_rate(m, n, k, dtype)
        else:
            compute = _elements(out) / hw.flops("f32")
        overhead = sympy.Float(hw.launch_overhead)
        return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=name,
                    ops=[name])
    # CPU: the NumPy passes of ir/quant.py, each over the elements it touches
    bytes_ = op_bytes(op)
    add = hw.ufunc_rates.get("add") or hw.cache_bandwidth / 8
    x = _elements(ins[0])
    calls = 0
    if name == Op.matmul:
        cost = _float_cost(op, hw)  # NumPy: the dequantized operands are float arrays by then
        return Cost(cost.flops, bytes_, cost.time, cost.compute_time, cost.memory_time, cost.overhead, label=name,
                    ops=[name])
    if name == Op.dequantize:  # cast, (subtract zero point), broadcast the scale to x's shape, multiply
        scale = ins[1]
        passes = x * (CAST_PASSES.get(ins[0].dtype, (1, 1))[0] + 2 + (1 if len(ins) > 2 else 0)) \
            + _elements(scale) * CAST_PASSES.get(scale.dtype, (1, 1))[0]
        calls = 5
    elif name == Op.quantize:  # divide, rint, (add zero point), clip, cast
        passes = x * (2 + CLIP_PASSES + CAST_PASSES.get(out.dtype, (1, 1))[1] + (1 if len(ins) > 2 else 0))
        calls = 6
    elif name in (Op.block_matmul, Op.block_gather):  # ir/block_formats.py: unpack, scale, offset per value
        values = _elements(out) if name == Op.block_gather else _elements(ins[1]) / ins[1].shape[1] * op.attr("k")
        passes = values * BLOCK_DEQUANT_PASSES
        if name == Op.block_matmul:  # then one sgemm per panel of dequantized rows
            passes += flops / (_gemm_rate(hw, op) * _parallel(hw, hw.cores)) * add
        calls = 4 * (1 + values // PANEL_ELEMENTS)
    elif name == Op.dynamic_quantize:  # |x|, row max, then quantize by the row (or block) scale
        passes = x * (3 + 2 + CLIP_PASSES + CAST_PASSES.get(out.dtype, (1, 1))[1])
        calls = 10
    else:  # matmul_integer: both operands to float32, one sgemm per 2^24-safe chunk of K, int32 adds
        m, n, k = _matmul_shape(op)
        passes = x * 2 + _elements(ins[1]) + 2 * _elements(out)
        gemm = flops / (_gemm_rate(hw, op) * _parallel(hw, hw.cores))
        passes += gemm * add
        calls = 6
    compute = passes / add
    memory = _uncached(hw, bytes_, [op])
    overhead = sympy.Float(calls * hw.launch_overhead + hw.alloc_overhead)
    return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=name,
                ops=[name])


@functools.lru_cache(maxsize=MEMO_ENTRIES)
def at_nominal(expr: sympy.Expr) -> float:
    expr = sympy.sympify(expr)
    return at(expr.subs({s: NOMINAL_DIM for s in expr.free_symbols}))


def group_cost(ops: Sequence[TgOp], inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo], hw,
               chunks: sympy.Expr | int | None = None, gemm_rows: int | None = None, label: str = "",
               gemm_cols: int | None = None, blas_gemm: bool = False) -> Cost:
    """The predicted cost of ops fused into one group with these inputs and outputs.

    `chunks`: how many row chunks the NumPy backend splits the group into (from
    `tile`); by default (before `tile`) the cheapest of one chunk, one per core and,
    for a GEMM group, its GEMM in a chunk of rows per core or on BLAS's threads. `gemm_rows`: the
    rows of a chunk when its GEMMs run chunk by chunk too (`flat` tiles);
    `gemm_cols`: the columns of a chunk instead (`cols` tiles: all the rows times a
    slice of the weight). `blas_gemm`: the GEMM runs whole on BLAS's own threads
    before the chunk loop, which then runs the epilogue (`blas` tiles).
    """
    names = [op.op_name for op in ops]
    flops = sum((op_flops(op) for op in ops), sympy.Integer(0))
    bytes_ = sum((_nbytes(i) for i in inputs), sympy.Integer(0)) + sum((_nbytes(o) for o in outputs), sympy.Integer(0))
    memory = bytes_ / hw.memory_bandwidth
    anchors = [op for op in ops if op.op_name in ANCHORS]
    rest = [op for op in ops if op.op_name not in ANCHORS and op.op_name not in VIEW_OPS]
    if hw.backend == "c":
        return _c_group_cost(ops, anchors, rest, inputs, outputs, hw, label)
    if hw.kind == "gpu":
        compute = sum((op_flops(op) / _gemm_rate(hw, op) for op in anchors), sympy.Integer(0))
        compute += sum((op_flops(op) for op in rest), sympy.Integer(0)) / hw.flops(outputs[0].dtype)
        overhead = sympy.Float(hw.launch_overhead)
        return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=label,
                    ops=names)
    if chunks is None:  # before `tile` (what `fuse` ranks merges by): the cheapest way `tile` may run it
        ways = [{"chunks": 1}, {"chunks": hw.cores}]
        if hw.cores > 1 and gemm_rows is None and _one_gemm(anchors) and _flat(ops):
            # Its GEMM on all cores too, as a chunk of rows per core or on BLAS's threads;
            # priced whole on one core, a GEMM group would look slower than its lone matmul.
            rows = max(1, -(-int(at_nominal(_matmul_shape(anchors[0])[0])) // hw.cores))
            ways.append({"chunks": hw.cores, "gemm_rows": rows})
            if hw.blas_parallel_efficiency:
                ways.append({"chunks": 1, "blas_gemm": True})
        costs = [group_cost(ops, inputs, outputs, hw, label=label, **{"gemm_rows": gemm_rows} | way) for way in ways]
        return min(costs, key=lambda c: at_nominal(c.time))
    threads = hw.cores
    n_chunks = sympy.sympify(chunks)
    workers = sympy.Min(n_chunks, threads)
    if blas_gemm and _one_gemm(anchors):
        # One GEMM of all rows (sibling weights side by side) on all cores' BLAS threads.
        m, n, k = _matmul_shape(anchors[0])
        n = sum((_matmul_shape(op)[1] for op in anchors), sympy.Integer(0))
        rate = hw.matmul_rate(*(max(1, int(at_nominal(d))) for d in (m, n, k)), anchors[0].result_infos()[0].dtype)
        anchor_time = 2 * m * n * k / (rate * threads * hw.blas_parallel_efficiency)
    elif (gemm_rows or gemm_cols) and _one_gemm(anchors):
        # GEMMs cut in rows (or columns): each chunk's GEMM at the rate of its own (smaller)
        # shape, on all cores.
        m, n, k = _matmul_shape(anchors[0])
        n = sum((_matmul_shape(op)[1] for op in anchors), sympy.Integer(0))
        rows = max(1, min(gemm_rows, int(at_nominal(m)))) if gemm_rows else max(1, int(at_nominal(m)))
        cols = max(1, min(gemm_cols, int(at_nominal(n)))) if gemm_cols else max(1, int(at_nominal(n)))
        rate = hw.matmul_rate(rows, cols, max(1, int(at_nominal(k))), anchors[0].result_infos()[0].dtype)
        anchor_time = 2 * m * n * k / rate / _parallel(hw, workers)
    else:  # anchors run whole before the chunk loop, BLAS on one thread (attention threads itself)
        anchor_time = sum((_anchor_time(op, hw, cores=1) for op in anchors), sympy.Integer(0))
    passes = sympy.Integer(0)
    calls = 0
    for op in rest:
        elements = _elements(op.result_infos()[0]) if op.SPEC.category != "reduction" \
            else _elements(info_of(op.operands[0].type))
        passes += _cpu_passes_time(hw, op.op_name, elements, True, sympy.Integer(0))
        calls += _calls(op.op_name)
    # Chunks run on all cores; with fewer chunks than cores, some cores idle. Each
    # parallel loop pays one fork/join of the pool.
    parallel = _parallel(hw, workers)
    compute = anchor_time + passes / parallel
    # A call in a loop on several threads pays for slicing and for the GIL the threads share.
    per_call = sympy.Piecewise((hw.launch_overhead, n_chunks <= 1),
                               (hw.chunk_call_overhead or hw.launch_overhead, True))
    chunk_calls = calls + (len(anchors) if (gemm_rows or gemm_cols) and not blas_gemm else 0)
    fork_join = sympy.Piecewise((0, n_chunks <= 1), (hw.parallel_overhead, True))
    overhead = sympy.Float(hw.launch_overhead) * len(anchors) + per_call * chunk_calls * n_chunks / \
        parallel + sympy.Float(hw.alloc_overhead) * len(outputs) + fork_join
    if blas_gemm:
        overhead += hw.blas_call_overhead
    # NumPy runs one pass at a time: the group's inputs stream in from memory on the
    # first pass over each chunk, and the rest run on cached data, so the two add up
    # (a roofline max would let a long epilogue hide its own memory traffic).
    memory = _uncached(hw, bytes_, ops)
    return Cost(flops, bytes_, compute + memory + overhead, compute, memory, overhead,
                kernels=1, label=label, ops=names)


# (backends/c/emit.PARALLEL_MIN) A C loop over more elements than this opens an OpenMP
# region; a smaller one runs on the calling thread. tests/test_c_calibrate.py checks they agree.
C_PARALLEL_MIN = 32768
# Ops the C loops compute through a libm call: priced at `exp`'s calibrated rate when the
# profile has no rate of their own. The rest are a few vector instructions: `add`'s.
C_LIBM = {"log", "pow", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
          "expm1", "log1p", "sigmoid", "erf", "tanh", "exp", "gelu"}


def _c_group_cost(ops, anchors, rest, inputs, outputs, hw, label: str) -> Cost:
    """(CPU, the C backend) One step of a compiled module (module docstring), as

        steps x step cost + anchors + row kernels + max(loop compute, loop memory)

    Anchors (oneDNN's GEMM and convolution on a packed weight, the flash kernel) and the
    row kernels (softmax, layer_norm) run at their calibrated rates, which include their own
    traffic; the loop (every other op, one pass) is a roofline of its ops' calibrated rates
    against the bytes the group moves beyond what its anchors read and write."""
    names = [op.op_name for op in ops]
    zero = sympy.Integer(0)
    inside = set(ops)
    flops = sum((op_flops(op) for op in ops), zero)
    bytes_ = sum((_nbytes(i) for i in inputs), zero) + sum((_nbytes(o) for o in outputs), zero)
    anchor_time = sum((_c_anchor_time(op, hw) for op in anchors), zero)
    # What the anchors read from outside and write out of the group: in their rates.
    anchor_in = {v: None for op in anchors for v in op.operands if v.owner not in inside}
    anchor_out = [r for op in anchors for r in op.results if any(u.operation not in inside for u in r.uses)]
    anchor_io = sum((_nbytes(info_of(v.type)) for v in [*anchor_in, *anchor_out]), zero)
    # Row ops (runtime.h): one call per group of rows, their rate calibrated whole.
    rows = [op for op in rest if op.SPEC.row_normalizing]
    row_time = sum((_elements(op.result_infos()[0]) / _c_rate(hw, op.op_name) for op in rows), zero)
    loop = zero
    for op in rest:
        if op.SPEC.row_normalizing:
            continue
        elements = _elements(op.result_infos()[0]) if op.SPEC.category != "reduction" \
            else _elements(info_of(op.operands[0].type))
        loop += elements / _c_rate(hw, op.op_name)
    loop_bytes = sympy.Max(bytes_ - anchor_io, zero)
    memory = _c_memory(hw, loop_bytes, _cold_bytes([op for op in ops if op not in anchors]))
    compute = anchor_time + row_time + loop
    # One step per anchor (an epilogue rides on oneDNN's post-ops or the step's own loop),
    # one more for a row kernel or reduction after it; a group without anchors is one step.
    after = any(op.SPEC.row_normalizing or op.SPEC.category == "reduction" for op in rest)
    steps = max(1, len(anchors) + (1 if anchors and after else 0))
    size = max((_elements(o) for o in outputs), key=at_nominal) if outputs else zero
    overhead = steps * _c_step(hw, size)
    time = overhead + anchor_time + row_time + sympy.Max(loop, memory)
    return Cost(flops, bytes_, time, compute, memory, overhead, kernels=1, label=label, ops=names)


def _c_rate(hw, name: str) -> float:
    rates = hw.ufunc_rates
    if name in rates:
        return rates[name]
    if name in C_LIBM and "exp" in rates:
        return rates["exp"]
    return rates.get("add") or hw.cache_bandwidth / 12


def _c_anchor_time(op: TgOp, hw) -> sympy.Expr:
    """(C) An anchor's compute: oneDNN's GEMM or convolution on all threads, the flash kernel."""
    flops = op_flops(op)
    if op.op_name == Op.conv and hw.conv_rates:
        return _c_conv_time(op, hw, flops)
    if op.op_name == Op.conv and hw.conv_rate:
        return flops / hw.conv_rate
    if op.op_name == Op.attention and hw.attention_rates:
        q, k = (info_of(v.type) for v in op.operands[:2])
        d = _sized(q.shape[-1])
        if op.attr("causal"):  # the flash kernel stops at the diagonal: the visible share of the keys
            lq, lk = (max(1.0, at_nominal(_sized(x.shape[-2]))) for x in (q, k))
            flops = flops * min(1.0, (max(lk - lq, 0.0) + (lq + 1) / 2) / lk)
        return flops / (_interpolate(hw.attention_rates, at_nominal(d)) * max(hw.attention_speedup, 1.0))
    if op.op_name == Op.einsum:
        return flops / _gemm_rate(hw, op) / _parallel(hw, hw.cores)
    m, n, k = (max(1, int(at_nominal(d))) for d in _matmul_shape(op))  # type: ignore[assignment]
    return flops / hw.matmul_rate(m, n, k, op.result_infos()[0].dtype, threaded=True)


def _c_conv_time(op: TgOp, hw, flops: sympy.Expr) -> sympy.Expr:
    """(C) A convolution on oneDNN, all threads. Depthwise (one input channel a group): at the
    calibrated depthwise rate, a pass over memory more than arithmetic (by the elements it
    reads and writes where that is more). Else as the GEMM it
    is, output pixels x a group's output channels x (a group's inputs x the window), at the
    GEMM curve's rate for that shape times how a calibrated convolution of its kind (3x3 or
    1x1) ran against the curve at its own shape: the curve carries the size, the calibration
    what oneDNN's convolution kernels do differently from its GEMMs."""
    x, w = (info_of(v.type) for v in op.operands[:2])
    groups = int(op.attr("groups") or 1)
    out = op.result_infos()[0]
    if groups > 1 and at_nominal(_sized(w.shape[1])) == 1 and "depthwise" in hw.conv_rates:
        # The calibrated one (stride 1) moved an element in and out per window of k taps; a
        # strided one reads more inputs per output than its arithmetic says.
        *_, k_cal, rate = hw.conv_rates["depthwise"]
        return sympy.Max(flops / rate, (_elements(x) + _elements(out)) * k_cal / rate)
    if groups > 1 and at_nominal(_sized(w.shape[1])) == 1:
        return flops / (hw.conv_rate or hw.flops("f32"))
    window = w.shape[2:]
    kind = "pointwise" if all(at_nominal(_sized(d)) == 1 for d in window) else "dense"
    if kind not in hw.conv_rates:
        return flops / (hw.conv_rate or hw.flops("f32"))
    m = max(1, int(at_nominal(_prod([out.shape[0], *out.shape[2:]]))))
    n = max(1, int(at_nominal(_sized(out.shape[1]))) // groups)
    k = max(1, int(at_nominal(_prod(w.shape[1:]))))
    rm, rn, rk, rate = hw.conv_rates[kind]
    efficiency = rate / hw.matmul_rate(rm, rn, rk, threaded=True)
    return flops / (hw.matmul_rate(m, n, k, threaded=True) * efficiency)


def _cold_bytes(ops: Sequence[TgOp]) -> sympy.Expr:
    """Bytes of the weights `ops` read: from memory on every forward."""
    weights = {v: None for op in ops for v in map(_through_views, op.operands)
               if isinstance(v.owner, TgOp) and v.owner.op_name == Op.weight}
    return sum((_nbytes(info_of(v.type)) for v in weights), sympy.Integer(0))


@_memo_hw
def _c_memory(hw, bytes_: sympy.Expr, cold: sympy.Expr) -> sympy.Expr:
    """(C) One pass over a step's inputs and outputs: at the cache rate while they fit the
    cores' L2 (the step before ran on every core), weights from memory; beyond L2, at the L3
    rate while they fit half of L3 (the rest of it holds the weights streaming through); else
    all from memory."""
    fits = bytes_ <= hw.cache_bytes * hw.cores
    if hw.l3_bandwidth:  # beyond L2, a layer's activations stay in L3 where it holds them
        in_l3 = bytes_ <= hw.l3_bytes / 2
        return sympy.Piecewise((cold / hw.memory_bandwidth + (bytes_ - cold) / hw.cache_bandwidth, fits),
                               (cold / hw.memory_bandwidth + (bytes_ - cold) / hw.l3_bandwidth, in_l3),
                               (bytes_ / hw.memory_bandwidth, True))
    return sympy.Piecewise((cold / hw.memory_bandwidth + (bytes_ - cold) / hw.cache_bandwidth, fits),
                           (bytes_ / hw.memory_bandwidth, True))


@_memo_hw
def _c_step(hw, elements: sympy.Expr) -> sympy.Expr:
    """(C) The fixed cost of one step: a function call, and an OpenMP region when it is big enough."""
    return sympy.Piecewise((hw.chunk_call_overhead, elements <= C_PARALLEL_MIN),
                           (hw.chunk_call_overhead + hw.parallel_overhead, True))


def _one_gemm(anchors: Sequence[TgOp]) -> bool:
    """Whether a group's anchors run as one row GEMM: a lone one, or siblings (a chain of
    two GEMMs, which `fuse` never makes, is priced whole)."""
    return siblings(anchors) and all(row_gemm(op) for op in anchors)


def _flat(ops: Sequence[TgOp]) -> bool:
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
            total = _sized(ref.shape[-1])
        else:
            total = _prod(ref.shape[:-1]) if tile.get("flat") else _sized(ref.shape[tile.get("axis", 0)])
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
