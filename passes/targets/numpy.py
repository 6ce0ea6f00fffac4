"""A CPU through the NumPy backend: what an op and a fused group cost, and how a group is tiled.

Cost: GEMMs at the calibrated per-core rate of their shape (`Hardware.matmul_rate`), on one
core when run whole in a group, on all cores when cut into chunks or run on BLAS's threads.
The attention kernel runs at its own calibrated rate by head dim (`Hardware.attention_rates`):
its batched small GEMMs over strided heads are far off the GEMM curve. NumPy makes one pass
over memory per ufunc call, so an op costs the passes its kernel makes (the op table's
`cpu_passes`) at the calibrated rate of each ufunc, or, for the kernels the profile timed
whole (gelu, layer_norm, softmax), one pass at that kernel's rate; cache-resident rates for
operands that fit one core's L2, spilled rates for bigger ones. Plus the fixed cost of each
call. A fused group runs its non-contraction ops over row or column chunks on all cores (what
`tile` writes and the NumPy backend does). Main memory: a kernel's weights always (a model's
weights outgrow the caches), and the rest of its inputs and outputs unless they fit one core's
L2; added to compute, not overlapped, since NumPy makes one pass at a time.

Quantization ops run what ir/quant.py does, pass by pass: casts to and from the storage type
(ml_dtypes' 4- and 8-bit float casts are ~150x an f32 add: `CAST_PASSES`), the scale
broadcast, multiply, rint, clip; a weight-only layer dequantizes its whole weight every call,
and tg.matmul_integer converts both operands to float32 and runs an sgemm, so on this backend
quantization predicts no speedup (benchmarks/quantization.py). The C backend runs them the
same way.

Tiles: the group runs over chunks of `rows` on all cores. With `flat`, its values are seen as
[rows, last axis] and a chunk is a block of rows, GEMM rows included (their epilogue runs
while they are in cache); that needs every input to span the rows or only the last axis (a
bias). Otherwise a chunk is a slice along `axis` (the outermost leading axis with rows for
every core) and anchors run whole first. Candidates are powers of two, each priced by the
cost model (a GEMM of fewer rows runs slower; a chunk whose working set, the values live at
once times the rows, exceeds the core's cache streams from memory; more chunks cost more
NumPy calls); the cheapest wins. `chunks` records how many that makes at the sizes priced. A
flat GEMM group has two more ways to run, priced the same way and kept if cheaper: `blas`,
the GEMM whole on BLAS's own threads and then the epilogue in row chunks (how well BLAS's
threads scale is calibrated: on one machine they beat our chunks, on another they fight the
epilogue for the cores); and `cols` (a GEMM with an elementwise epilogue), chunks of columns
that each multiply all the rows by a slice of the weight. Attention runs in flash blocks.
"""

from __future__ import annotations

import math

import sympy

from tilegraph.ir.block_formats import PANEL_ELEMENTS
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.fusion import ANCHORS, VIEW_OPS, cols_ok, flat_rows_ok, live_row_bytes, row_gemm, row_local, widest
from tilegraph.ir.hardware import MIN_PARALLEL_SCORES
from tilegraph.ir.ops import Op, OPS
from tilegraph.ir.shapes import info_of
from tilegraph.passes.cost import model
from tilegraph.passes.cost.model import (Cost, at_nominal, cold_bytes, element_count, float_cost, flat, gemm_rate,
                                         group_traffic, interpolate, matmul_shape, memo_hw, one_gemm, op_bytes,
                                         op_flops, parallel_speedup, quant_flops)
from tilegraph.passes.remarks import listening, remark
from tilegraph.passes.targets import attention_tile

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

# Passes over each value a block format dequantizes (ir/block_formats.py's q4: two masked
# unpacks into the f32 panel, the scale, the offset; q8 and the k-quants about as many).
BLOCK_DEQUANT_PASSES = 4

# Bytes per element that a pass keeps in L2: two f32 operands, a result, and the rest of
# the chunk's live values (backends/numpy/calibrate.SPILLED_ELEMENTS spills at 1 MiB per array).
SPILL_ELEMENT_BYTES = 16

# Attention: keys per block. 128 query rows x 512 keys of f32 scores is 256 KB, half of
# a 512 KB L2 (the smallest per-core L2 of the CPUs this runs on), leaving room for the
# q, k, v blocks.
FLASH_BLOCK_Q = 128
FLASH_BLOCK_KV = 512

# A chunk's working set may outgrow the core's L2 into the shared L3 before its passes
# slow down: MiniLM's FFN group (GEMM rows + bias + gelu) ran fastest with 5-10x an L2
# live, slower at both a quarter and twice that (a one-off timing, not calibrated: the
# calibration measures L2 only).
SPILL_FACTOR = 8

# Column chunks are at least this wide: BLAS's register blocking wants a few dozen
# columns, and the calibrated skinny-GEMM curve starts at 4.
MIN_GEMM_COLS = 32


def op_cost(op: TgOp, hw) -> Cost:
    """One op alone: one NumPy call (a view too), or the passes of its template."""
    name = op.op_name
    flops, bytes_ = op_flops(op), op_bytes(op)
    out = op.result_infos()[0]
    zero = sympy.Integer(0)
    if name in VIEW_OPS:  # nothing moves, but the call is made
        overhead = sympy.Float(hw.launch_overhead)
        return Cost(zero, zero, overhead, zero, zero, overhead, kernels=0, label=name, ops=[name])
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
    elements = element_count(out) if op.SPEC.category != "reduction" else element_count(info_of(op.operands[0].type))
    compute = _cpu_passes_time(hw, name, elements, True, bytes_)
    memory = _uncached(hw, bytes_, [op])
    overhead = sympy.Float(_calls(name) * hw.launch_overhead + hw.alloc_overhead)
    return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=name,
                ops=[name])


def quant_cost(op: TgOp, hw) -> Cost:
    """A quantization op, or a GEMM reading dequantized operands: the NumPy passes of ir/quant.py,
    each over the elements it touches (module docstring)."""
    name = op.op_name
    ins = [info_of(v.type) for v in op.operands]
    out = op.result_infos()[0]
    flops = quant_flops(op)
    bytes_ = op_bytes(op)
    add = hw.ufunc_rates.get("add") or hw.cache_bandwidth / 8
    x = element_count(ins[0])
    calls = 0
    if name == Op.matmul:
        cost = float_cost(op, hw)  # NumPy: the dequantized operands are float arrays by then
        return Cost(cost.flops, bytes_, cost.time, cost.compute_time, cost.memory_time, cost.overhead, label=name,
                    ops=[name])
    if name == Op.dequantize:  # cast, (subtract zero point), broadcast the scale to x's shape, multiply
        scale = ins[1]
        passes = x * (CAST_PASSES.get(ins[0].dtype, (1, 1))[0] + 2 + (1 if len(ins) > 2 else 0)) \
            + element_count(scale) * CAST_PASSES.get(scale.dtype, (1, 1))[0]
        calls = 5
    elif name == Op.quantize:  # divide, rint, (add zero point), clip, cast
        passes = x * (2 + CLIP_PASSES + CAST_PASSES.get(out.dtype, (1, 1))[1] + (1 if len(ins) > 2 else 0))
        calls = 6
    elif name in (Op.block_matmul, Op.block_gather):  # ir/block_formats.py: unpack, scale, offset per value
        values = element_count(out) if name == Op.block_gather else element_count(ins[1]) / ins[1].shape[1] * op.attr("k")
        passes = values * BLOCK_DEQUANT_PASSES
        if name == Op.block_matmul:  # then one sgemm per panel of dequantized rows
            passes += flops / (gemm_rate(hw, op) * parallel_speedup(hw, hw.cores)) * add
        calls = 4 * (1 + values // PANEL_ELEMENTS)
    elif name == Op.dynamic_quantize:  # |x|, row max, then quantize by the row (or block) scale
        passes = x * (3 + 2 + CLIP_PASSES + CAST_PASSES.get(out.dtype, (1, 1))[1])
        calls = 10
    else:  # matmul_integer: both operands to float32, one sgemm per 2^24-safe chunk of K, int32 adds
        m, n, k = matmul_shape(op)
        passes = x * 2 + element_count(ins[1]) + 2 * element_count(out)
        gemm = flops / (gemm_rate(hw, op) * parallel_speedup(hw, hw.cores))
        passes += gemm * add
        calls = 6
    compute = passes / add
    memory = _uncached(hw, bytes_, [op])
    overhead = sympy.Float(calls * hw.launch_overhead + hw.alloc_overhead)
    return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=name,
                ops=[name])


def group_cost(ops, anchors, rest, inputs, outputs, hw, label: str = "", chunks: sympy.Expr | int | None = None,
               gemm_rows: int | None = None, gemm_cols: int | None = None, blas_gemm: bool = False) -> Cost:
    """A group's non-contraction ops over chunks on all cores (module docstring).

    `chunks`: how many row chunks the NumPy backend splits the group into (from
    `tile`); by default (before `tile`) the cheapest of one chunk, one per core and,
    for a GEMM group, its GEMM in a chunk of rows per core or on BLAS's threads. `gemm_rows`: the
    rows of a chunk when its GEMMs run chunk by chunk too (`flat` tiles);
    `gemm_cols`: the columns of a chunk instead (`cols` tiles: all the rows times a
    slice of the weight). `blas_gemm`: the GEMM runs whole on BLAS's own threads
    before the chunk loop, which then runs the epilogue (`blas` tiles).
    """
    names = [op.op_name for op in ops]
    flops, bytes_ = group_traffic(ops, inputs, outputs)
    if chunks is None:  # before `tile` (what `fuse` ranks merges by): the cheapest way `tile` may run it
        ways = [{"chunks": 1}, {"chunks": hw.cores}]
        if hw.cores > 1 and gemm_rows is None and one_gemm(anchors) and flat(ops):
            # Its GEMM on all cores too, as a chunk of rows per core or on BLAS's threads;
            # priced whole on one core, a GEMM group would look slower than its lone matmul.
            rows = max(1, -(-int(at_nominal(matmul_shape(anchors[0])[0])) // hw.cores))
            ways.append({"chunks": hw.cores, "gemm_rows": rows})
            if hw.blas_parallel_efficiency:
                ways.append({"chunks": 1, "blas_gemm": True})
        costs = [group_cost(ops, anchors, rest, inputs, outputs, hw, label=label, **{"gemm_rows": gemm_rows} | way)
                 for way in ways]
        return min(costs, key=lambda c: at_nominal(c.time))
    threads = hw.cores
    n_chunks = sympy.sympify(chunks)
    workers = sympy.Min(n_chunks, threads)
    if blas_gemm and one_gemm(anchors):
        # One GEMM of all rows (sibling weights side by side) on all cores' BLAS threads.
        m, n, k = matmul_shape(anchors[0])
        n = sum((matmul_shape(op)[1] for op in anchors), sympy.Integer(0))
        rate = hw.matmul_rate(*(max(1, int(at_nominal(d))) for d in (m, n, k)), anchors[0].result_infos()[0].dtype)
        anchor_time = 2 * m * n * k / (rate * threads * hw.blas_parallel_efficiency)
    elif (gemm_rows or gemm_cols) and one_gemm(anchors):
        # GEMMs cut in rows (or columns): each chunk's GEMM at the rate of its own (smaller)
        # shape, on all cores.
        m, n, k = matmul_shape(anchors[0])
        n = sum((matmul_shape(op)[1] for op in anchors), sympy.Integer(0))
        rows = max(1, min(gemm_rows, int(at_nominal(m)))) if gemm_rows else max(1, int(at_nominal(m)))
        cols = max(1, min(gemm_cols, int(at_nominal(n)))) if gemm_cols else max(1, int(at_nominal(n)))
        rate = hw.matmul_rate(rows, cols, max(1, int(at_nominal(k))), anchors[0].result_infos()[0].dtype)
        anchor_time = 2 * m * n * k / rate / parallel_speedup(hw, workers)
    else:  # anchors run whole before the chunk loop, BLAS on one thread (attention threads itself)
        anchor_time = sum((_anchor_time(op, hw, cores=1) for op in anchors), sympy.Integer(0))
    passes = sympy.Integer(0)
    calls = 0
    for op in rest:
        elements = element_count(op.result_infos()[0]) if op.SPEC.category != "reduction" \
            else element_count(info_of(op.operands[0].type))
        passes += _cpu_passes_time(hw, op.op_name, elements, True, sympy.Integer(0))
        calls += _calls(op.op_name)
    # Chunks run on all cores; with fewer chunks than cores, some cores idle. Each
    # parallel loop pays one fork/join of the pool.
    parallel = parallel_speedup(hw, workers)
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


@memo_hw
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


def _calls(name: str) -> int:
    spec = OPS[name]
    return spec.numpy_calls or sum(count for _, count in spec.cpu_passes or (("add", 1),))


def _anchor_time(op: TgOp, hw, cores: int) -> sympy.Expr:
    """Compute time of an anchor run whole, its GEMMs on `cores` cores."""
    flops = op_flops(op)
    if op.op_name == Op.conv and hw.conv_rate:  # K.conv: im2col and small batched GEMMs, off the GEMM curve, one core
        return flops / hw.conv_rate
    if op.op_name != Op.attention:
        return flops / (gemm_rate(hw, op) * parallel_speedup(hw, cores))
    # attention_tiled (backends/numpy/attention.py): QK^T and PV GEMMs and a softmax over the scores, on all cores
    # only above the kernel's own threshold (ir/hardware.MIN_PARALLEL_SCORES).
    m, n, d = matmul_shape(op)
    if hw.attention_rates:  # the kernel as calibrated: its batched small GEMMs are far off the GEMM curve
        one_core = flops / interpolate(hw.attention_rates, at_nominal(d))
        speedup = hw.attention_speedup or parallel_speedup(hw, hw.cores)
    else:
        one_core = flops / gemm_rate(hw, op) + _cpu_passes_time(hw, "softmax", m * n, True, sympy.Integer(0))
        speedup = parallel_speedup(hw, hw.cores)
    return sympy.Piecewise((one_core, m * n < MIN_PARALLEL_SCORES), (one_core / speedup, True))


def _uncached(hw, bytes_: sympy.Expr, ops) -> sympy.Expr:
    """Time to move a kernel's `bytes_` from memory: only its weights when the rest
    fits one core's cache, else all of them.

    Weights: read once per forward, and a model's weights outgrow the caches, so each
    comes from memory. One core's cache, not all of them: the kernel before ran its
    chunks on every core, so what it wrote sits in several private caches. Measured
    (benchmarks/cost_model_accuracy.py): GPT-2's 2.4 MB residual adds ran at memory,
    not cache, speed, though under 2 cores' L2.
    """
    return _from_memory(hw, bytes_, cold_bytes(ops))


@memo_hw
def _from_memory(hw, bytes_: sympy.Expr, cold: sympy.Expr) -> sympy.Expr:
    return sympy.Piecewise((cold, bytes_ <= hw.cache_bytes), (bytes_, True)) / hw.memory_bandwidth


def choose_tile(group: FusionOp, hw, max_rows: int, max_cols: int, blas_gemm: bool) -> dict[str, int]:
    """Chunks of rows (or columns), attention in flash blocks first (module docstring)."""
    attention = [op for op in group.ops if op.op_name == Op.attention]
    blocks = attention_tile(attention[0], FLASH_BLOCK_Q, FLASH_BLOCK_KV) if attention else {}
    if max_cols and cols_ok(group):
        width = int(at_nominal(info_of(group.ops[0].results[0].type).shape[-1]))
        return blocks | {"flat": 1, "cols": min(max_cols, width), "chunks": math.ceil(width / min(max_cols, width))}
    return blocks | _rows(group, hw, max_rows, blas_gemm)


def _rows(group: FusionOp, hw, max_rows: int = 0, blas_gemm: bool = False) -> dict[str, int]:
    chunked = [op for op in group.ops if op.op_name not in VIEW_OPS]
    ref = widest(group)
    if not chunked or ref.rank < 2 or not all(row_local(op) for op in group.ops):
        return {}
    flat = flat_rows_ok(group)
    if flat:  # rows of the values seen as [rows, last axis]
        axis, total, outer = 0, int(at_nominal(sympy.sympify(math.prod(ref.shape[:-1])))), 1.0
    else:  # slices along the outermost leading axis long enough to feed every core, others whole
        axis = next((a for a in range(ref.rank - 1) if at_nominal(ref.shape[a]) >= 2 * hw.cores), ref.rank - 2)
        total = int(at_nominal(ref.shape[axis]))
        outer = at_nominal(sympy.sympify(math.prod(ref.shape[:axis])) if axis else 1)
    # Bytes of one row of the values live at once in a chunk (GEMM rows read their lhs row too).
    row_bytes = outer * live_row_bytes(group.ops, set(group.block.last_op.operands), at_nominal)
    priced = _price_rows(group, hw, total, row_bytes, max_rows, gemm_rows=flat)
    time, _, rows, chunks = min(priced)
    what = f"{group.kind} group ({len(group.ops)} ops)"
    gemms = [op for op in group.ops if op.op_name in ANCHORS]
    # The other ways a flat GEMM group can run: (time, tile, what the remark says).
    others = []
    if flat and gemms and all(row_gemm(op) for op in gemms) and (
            blas_gemm or (hw.cores > 1 and hw.blas_parallel_efficiency and not max_rows)):
        t, _, r, c = min(_price_rows(group, hw, total, row_bytes, max_rows, blas_gemm=True))
        others.append((t, {"flat": 1, "blas": 1} | ({"rows": r, "chunks": c} if c > 1 else {}),
                       f"its GEMM whole on BLAS's threads, then {c} chunks of {r} rows: predicted {t * 1e6:.1f} us"))
    columns = _cols(group, hw, total, row_bytes) if flat and hw.cores > 1 and cols_ok(group) and not max_rows \
        else None
    if columns and not blas_gemm:
        t, c, n = columns
        others.append((t, {"flat": 1, "cols": c, "chunks": n},
                       f"chunks of {c} columns, all {total} rows each ({n} chunks): predicted {t * 1e6:.1f} us"))
    best = min(others, key=lambda o: o[0], default=None)
    if best and (best[0] < time or blas_gemm):  # (tile{blas-gemm=true}: the only other candidate, taken)
        _, tile, why = best
        if listening():
            remark("tile", f"{what}: {why}; next best: the GEMM in chunks of {rows} rows, {time * 1e6:.1f} us")
        return tile
    if chunks == 1:  # the whole group in one go: a fork/join would cost more than it saves
        if listening():
            remark("tile", f"{what}: one chunk, on one core: predicted "
                           f"{time * 1e6:.1f} us; {len(priced) - 1} smaller chunk sizes priced higher")
        return {"flat": 1} if flat else {}
    if listening():
        alternatives = ", ".join(f"{r} rows {t * 1e6:.1f} us" for t, _, r, _ in sorted(priced)[1:4])
        where = "of the values seen as [rows, last axis]" if flat else f"along axis {axis}"
        remark("tile", f"{what}: chunks of {rows} rows {where} "
                       f"({chunks} chunks, {rows * row_bytes / 1024:.0f} KiB live per chunk): predicted "
                       f"{time * 1e6:.1f} us; next best: {alternatives}")
    return ({"flat": 1} if flat else {"axis": axis}) | {"rows": rows, "chunks": chunks}


def _price_rows(group: FusionOp, hw, total: int, row_bytes: float, max_rows: int = 0, gemm_rows: bool = True,
                blas_gemm: bool = False) -> list[tuple[float, int, int, int]]:
    """(time, -rows, rows, chunks) for chunks of 1, 2, 4, ... rows (at most max_rows, if set)."""
    inputs = [info_of(v.type) for v in group.operands]
    outputs = [info_of(r.type) for r in group.results]
    priced = []
    rows = 1
    while True:
        chunks = math.ceil(total / rows)
        cost = model.group_cost(group.ops, inputs, outputs, hw, chunks=chunks, gemm_rows=rows if gemm_rows else None,
                          blas_gemm=blas_gemm)
        priced.append((at_nominal(cost.time) + _spill(rows * row_bytes, cost, hw), -rows, rows, chunks))
        if rows >= total or (max_rows and rows * 2 > max_rows):
            return priced
        rows = min(rows * 2, total)


def _spill(live_bytes: float, cost, hw) -> float:
    """What a chunk whose values outgrow the cache pays: its passes stream from memory."""
    if live_bytes <= SPILL_FACTOR * hw.cache_bytes:
        return 0.0
    return at_nominal(cost.compute_time) * (hw.cache_bandwidth / hw.memory_bandwidth - 1) / hw.cores


def _cols(group: FusionOp, hw, rows: int, row_bytes: float) -> tuple | None:
    """(time, columns, chunks) of the best column chunking of a `cols_ok` group: at least one
    chunk per core, down to MIN_GEMM_COLS columns; None if the width allows no split."""
    inputs = [info_of(v.type) for v in group.operands]
    outputs = [info_of(r.type) for r in group.results]
    width = int(at_nominal(info_of(group.ops[0].results[0].type).shape[-1]))
    priced = []
    cols = -(-width // hw.cores)
    while cols >= MIN_GEMM_COLS:
        chunks = math.ceil(width / cols)
        cost = model.group_cost(group.ops, inputs, outputs, hw, chunks=chunks, gemm_cols=cols)
        priced.append((at_nominal(cost.time) + _spill(rows * row_bytes * cols / width, cost, hw), cols, chunks))
        if chunks >= width:
            break
        cols = -(-cols // 2)
    return min(priced) if priced else None
