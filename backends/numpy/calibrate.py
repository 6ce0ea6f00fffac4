"""Measure this machine for the cost model: what `tilegraph calibrate` runs.

The NumPy backend spends its time in three ways, and each is measured the way the
backend incurs it:

- GEMMs: f32 `np.matmul(a, b, out=c)` with BLAS on one thread, as the backend
  runs them (one chunk of rows per core, backends/numpy/chunks.py), at shapes from
  tiny to large, including MiniLM's projections, the row chunks `tile` chooses
  between, and one attention head; `gemm_samples` keeps the per-core curve; peak
  f32 FLOP/s is its best point times the cores (f64: measured at the largest).
- Elementwise passes: one single-threaded NumPy call over f32 arrays, either
  streaming from DRAM (arrays well beyond L3: `memory_bandwidth`) or resident in
  one core's L2 (`ufunc_rates`, elements/s per function; `cache_bandwidth` is the
  rate of `add` times its 12 bytes per element). Cache rates are the slope between
  two sizes that both fit in L2, so they exclude the fixed cost of the call.
- Fixed costs: one NumPy call on a 16-element array (`launch_overhead`), and
  allocating plus first touching a 1 MiB temporary beyond touching a reused buffer
  (`alloc_overhead`).

So a pass over n cache-resident elements costs about launch_overhead + n / rate.
Every number is the median of repeated timings (ir/calibration.median_times). The full run takes well under a
minute; `quick=True` (what the first hardware("cpu") runs) a couple of seconds.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from tilegraph.ir.calibration import (ATTENTION_BATCH, ATTENTION_HEAD_DIMS, ATTENTION_HEADS, ATTENTION_SEQ, Progress,
                                     cache_sizes, measure_and_save, median_time, median_times, physical_memory, table)
from tilegraph.ir.hardware import Hardware, cpu_model, cpu_profile_path

# (m, n, k) of the GEMMs timed: tiny (call-overhead bound), one attention head of
# MiniLM (seq 128, head dim 32: Q@K^T and P@V), a MiniLM projection at batch 1,
# the FFN matmuls at batch 8 (1024 tokens, 384 <-> 1536), and a large square one.
GEMM_SHAPES = ((16, 16, 16), (128, 128, 32), (128, 32, 128), (32, 384, 384), (128, 384, 384),
               (64, 1536, 384), (256, 1536, 384), (256, 384, 1536),
               (1024, 1536, 384), (1024, 384, 1536), (1024, 1024, 1024))
QUICK_GEMM_SHAPES = ((16, 16, 16), (128, 128, 32), (128, 384, 384), (256, 1536, 384), (1024, 384, 1536))

CALL_ELEMENTS = 16  # "a small array": the call's fixed cost dominates
ALLOC_BYTES = 1 * 2**20  # a typical activation chunk: MiniLM b1 s128 x 1536 f32 is 0.75 MiB
REDUCE_AXIS = 256  # last-axis length of the reductions timed (a row of a hidden state)
# Elements of the spilled measurement: 1 MiB per array, a 64-row chunk of a 4096-wide layer;
# three arrays of it (two in, one out) overflow a 1-2 MiB L2.
SPILLED_ELEMENTS = 1 << 18

STREAM_MIN_BYTES = 64 * 2**20  # each streaming array: at least 2x L3 and this ...
STREAM_MAX_BYTES = 256 * 2**20  # ... but at most this (servers with huge L3)

# Seconds of timing per measurement: the full run (~30 steps) stays well under a
# minute, the quick one around two seconds even on a busy machine.
BUDGET, QUICK_BUDGET = 0.6, 0.03
def _ufuncs(n: int, rng: np.random.Generator) -> dict[str, Callable[[], object]]:
    """One f32 NumPy call per cost-model function over arrays of `n` elements."""
    from tilegraph.ir import kernels as K

    # Values in [0.5, 2): no NaN, inf, denormal or domain-error slow paths.
    x = rng.uniform(0.5, 2.0, n).astype(np.float32)
    y = rng.uniform(0.5, 2.0, n).astype(np.float32)
    out = np.empty_like(x)
    cond = x > 1.25
    rows = x.reshape(-1, REDUCE_AXIS)
    reduced = np.empty(rows.shape[0], np.float32)
    transposed = out.reshape(REDUCE_AXIS, -1)
    out_rows = out.reshape(rows.shape)
    scale, shift = x[:REDUCE_AXIS].copy(), y[:REDUCE_AXIS].copy()
    return {
        "add": lambda: np.add(x, y, out=out),
        "sub": lambda: np.subtract(x, y, out=out),
        "mul": lambda: np.multiply(x, y, out=out),
        "div": lambda: np.divide(x, y, out=out),
        "maximum": lambda: np.maximum(x, y, out=out),
        "exp": lambda: np.exp(x, out=out),
        "log": lambda: np.log(x, out=out),
        "tanh": lambda: np.tanh(x, out=out),
        "sqrt": lambda: np.sqrt(x, out=out),
        "where": lambda: np.where(cond, x, y),  # allocates its result: np.where has no out=
        "sum": lambda: np.sum(rows, axis=-1, out=reduced),
        "max": lambda: np.max(rows, axis=-1, out=reduced),
        "erf": lambda: K.erf(x),  # the float32 kernel: 16 NumPy passes
        # The fused kernels as K runs them, rather than a guess of their passes.
        "gelu": lambda: K.gelu(x, "none", out=out),
        "layer_norm": lambda: K.layer_norm(rows, scale, shift, -1, 1e-5, out=out_rows),
        "softmax": lambda: K.softmax(rows, -1, out=out_rows),
        "copy": lambda: np.copyto(out, x),
        "transpose": lambda: np.copyto(transposed, rows.T),  # a layout change, strided reads
    }


def measure(quick: bool = False, progress: bool | None = None) -> Hardware:
    """Time this machine and return its profile (not saved: see `run` and `save_profile`)."""
    budget = QUICK_BUDGET if quick else BUDGET
    shapes = QUICK_GEMM_SHAPES if quick else GEMM_SHAPES
    caches = cache_sizes()
    rng = np.random.default_rng(0)
    # Cache-resident rates: the slope between two sizes whose working sets (erf keeps
    # ~6 arrays live) fit in one core's L2, which removes the call's fixed cost.
    big = max(REDUCE_AXIS * 8, caches["l2"] // (4 * 8) // REDUCE_AXIS * REDUCE_AXIS)
    small = max(REDUCE_AXIS, big // 8 // REDUCE_AXIS * REDUCE_AXIS)
    small_calls, big_calls = _ufuncs(small, rng), _ufuncs(big, rng)
    bar = Progress(10 + len(shapes) + len(big_calls), sys.stderr.isatty() if progress is None else progress)
    f32 = np.float32

    bar.step("call overhead")
    launch = _add_time(CALL_ELEMENTS, budget)

    # A NumPy call in a fused group's chunk loop on all cores: chunks of 16 rows sliced
    # from a shared array, a few in-place calls each (what the backend's groups run).
    bar.step("chunk loop call overhead")
    chunk_call = _chunk_call_time(budget)
    bar.step("parallel region")
    fork_join, efficiency, blas_efficiency, blas_call = _parallel_costs(budget, rng)
    bar.step("convolution")
    conv_rate = _conv_rate(budget, rng)
    bar.step("attention")
    attention_rates, attention_speedup = _attention_rates(budget, rng)

    # A temporary: allocate and first touch, beyond touching a buffer that is reused.
    # glibc hands a freed block of this size straight back (no page faults), so the
    # difference is often within noise: then the np.empty call alone is the cost.
    bar.step("allocation")
    n_alloc = ALLOC_BYTES // 4
    reused = np.empty(n_alloc, f32)
    touch, alloc, empty = median_times((lambda: reused.fill(0), lambda: np.empty(n_alloc, f32).fill(0),
                                        lambda: np.empty(n_alloc, f32)), budget)

    # Streaming: np.add over arrays far bigger than L3 (2 reads + 1 write per element).
    bar.step("stream bandwidth")
    n_stream = min(max(2 * caches["l3"], STREAM_MIN_BYTES), STREAM_MAX_BYTES) // 4
    memory_bandwidth = 12 * n_stream / _add_time(n_stream, budget)

    samples = []
    from tilegraph.backends.numpy.chunks import single_threaded_blas

    with single_threaded_blas():  # per core, as the NumPy backend runs its GEMM chunks
        for m, n, k in shapes:
            bar.step(f"gemm {m}x{n}x{k}")
            samples.append((m, n, k, _gemm_rate(m, n, k, np.float32, launch, budget, rng)))
        bar.step("gemm f64")
        f64_rate = _gemm_rate(*shapes[-1], np.float64, launch, budget, rng)
        bar.step("skinny gemm")
        tall = _gemm_rate(SKINNY_ROWS[-1], *SKINNY_NK, np.float32, launch, budget, rng)
        skinny = tuple((r, _gemm_rate(r, *SKINNY_NK, np.float32, launch, budget, rng) / tall)
                       for r in SKINNY_ROWS[:-1]) + ((SKINNY_ROWS[-1], 1.0),)
    cores = os.cpu_count() or 1

    rates = {}
    for name in big_calls:
        bar.step(f"{name} in cache")
        t_small, t_big = median_times((small_calls[name], big_calls[name]), budget)
        # Noise can make the slope meaningless on a busy machine: then the whole big call.
        rates[name] = (big - small) / (t_big - t_small) if t_big > t_small * 1.05 else big / t_big
    # Chunks of wide layers spill: their arrays stream between L2 and L3 at every pass.
    bar.step("passes over spilled chunks")
    spilled_calls = _ufuncs(SPILLED_ELEMENTS, rng)
    spilled = {name: SPILLED_ELEMENTS / t
               for name, t in zip(spilled_calls, median_times(tuple(spilled_calls.values()), budget))}
    bar.close()

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return Hardware(
        name="cpu", device="cpu",
        peak_flops={"f32": max(r for *_, r in samples) * cores, "f64": f64_rate * cores},
        memory_bandwidth=memory_bandwidth,
        cache_bandwidth=12 * rates["add"],
        cache_bytes=caches["l2"],
        memory_bytes=physical_memory(),
        cores=cores,
        shared_memory_per_core=caches["l1d"],
        registers_per_core=0,
        launch_overhead=launch,
        alloc_overhead=max(alloc - touch, empty),
        chunk_call_overhead=chunk_call,
        parallel_overhead=fork_join,
        parallel_efficiency=efficiency,
        blas_parallel_efficiency=blas_efficiency,
        blas_call_overhead=blas_call,
        conv_rate=conv_rate,
        attention_rates=attention_rates,
        attention_speedup=attention_speedup,
        skinny_gemm=skinny,
        links={},
        gemm_samples=tuple(samples),
        ufunc_rates=rates,
        ufunc_rates_spilled=spilled,
        source=(f"calibrated {stamp} on {cpu_model()} ({cores} cores, numpy {np.__version__}"
                f"{', quick' if quick else ''})"),
    )


def _add_time(n: int, budget: float) -> float:
    """Seconds of one np.add(a, b, out=c) over `n` f32 elements."""
    a, b, c = (np.full(n, 1.5, np.float32) for _ in range(3))
    return median_time(lambda: np.add(a, b, out=c), budget)


CHUNK_ROWS, CHUNK_CALLS, CHUNKS = 16, 4, 64


def _chunk_call_time(budget) -> float:
    from tilegraph.backends.numpy.chunks import run_chunks

    data = np.zeros((CHUNK_ROWS * CHUNKS, CALL_ELEMENTS), np.float32)

    def chunk(s):
        for _ in range(CHUNK_CALLS):
            np.add(data[s], 1.0, out=data[s])

    (t,) = median_times((lambda: run_chunks(chunk, len(data), CHUNK_ROWS),), budget)
    return t / (CHUNKS * CHUNK_CALLS)


# Row counts of the skinny GEMMs (x SKINNY_NK: a GPT-2 FFN weight), up to a tall one:
# the row chunks `tile` chooses between.
SKINNY_ROWS = (4, 8, 16, 32, 64, 256)
SKINNY_NK = (3072, 768)
# The GEMM each core runs in the parallel-efficiency measurement: a MiniLM FFN row chunk.
PARALLEL_GEMM = (256, 1536, 384)
# (m, n, k) too small for BLAS to start its threads (OpenBLAS runs m*n*k < 65536*4 on one):
# what is left of a call on BLAS's threads is the handover itself.
TINY_GEMM = (32, 16, 64)
# A small CNN's convolution (N, C, H, W), (M, C, kh, kw): the kernel's rate on real work.
CONV_SHAPES = ((32, 8, 16, 16), (16, 8, 3, 3))



def _parallel_costs(budget, rng) -> tuple[float, float, float, float]:
    """(one fork/join of the chunk pool, all cores' GEMM rate over cores x one core's with
    a chunk of rows per core on the pool, the same with one GEMM on BLAS's threads, what a
    tiny GEMM's call on BLAS's threads costs beyond the same call on one)."""
    from tilegraph.backends.numpy.chunks import THREADS, blas_threads, run_chunks, single_threaded_blas

    if THREADS == 1:
        return 0.0, 1.0, 0.0, 0.0
    m, n, k = PARALLEL_GEMM
    a = rng.standard_normal((m * THREADS, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    c = np.empty((m * THREADS, n), np.float32)

    def gemm(s):
        np.matmul(a[s], b, out=c[s])

    def blas_gemm():
        with blas_threads():
            np.matmul(a, b, out=c)

    with single_threaded_blas():
        one, together, empty = median_times((lambda: gemm(slice(0, m)), lambda: run_chunks(gemm, m * THREADS, m),
                                             lambda: run_chunks(lambda s: None, THREADS, 1)), budget)
        # Timed apart: BLAS's threads spin for a while after each call, and interleaved
        # they took the cores from our chunks (0.49 against 0.8-0.9 measured alone).
        (blas,) = median_times((blas_gemm,), budget)
        x, w, y = (np.ones(shape, np.float32) for shape in ((TINY_GEMM[0], TINY_GEMM[2]), TINY_GEMM[2:0:-1],
                                                             TINY_GEMM[:2]))

        def tiny_on_blas_threads():
            with blas_threads():
                np.matmul(x, w, out=y)

        tiny, tiny_blas = median_times((lambda: np.matmul(x, w, out=y), tiny_on_blas_threads), budget)
    # Ideally the cores' chunks together take as long as one alone, plus the fork/join.
    return empty, min(1.0, one / max(together - empty, 1e-12)), min(1.0, one / blas), max(0.0, tiny_blas - tiny)


def _attention_rates(budget, rng) -> tuple[tuple[tuple[int, float], ...], float]:
    """((head dim, FLOP/s on one core) of attention_tiled (attention.py) for each of ATTENTION_HEAD_DIMS,
    its speedup on all cores at the largest head dim)."""
    from tilegraph.backends.numpy.attention import attention_tiled
    from tilegraph.backends.numpy.chunks import THREADS

    rates, speedup = [], 1.0
    for d in ATTENTION_HEAD_DIMS:
        # Heads as a transformer hands them over: strided views into one Q|K|V projection.
        qkv = rng.standard_normal((ATTENTION_BATCH, ATTENTION_SEQ, 3, ATTENTION_HEADS, d), dtype=np.float32)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        out = np.empty(q.shape, np.float32)

        def attend(threads):
            return lambda: attention_tiled(q, k, v, None, 0.125, False, ATTENTION_SEQ, ATTENTION_SEQ,  # noqa: B023
                                           threads=threads, out=out)  # noqa: B023

        one, = median_times((attend(1),), budget)
        # (the FLOP count of passes/cost/model.op_flops: two GEMMs and the softmax's passes)
        rates.append((d, ATTENTION_BATCH * ATTENTION_HEADS * ATTENTION_SEQ ** 2 * (4 * d + 5) / one))
        if THREADS > 1 and d == ATTENTION_HEAD_DIMS[-1]:
            together, = median_times((attend(THREADS),), budget)
            speedup = one / together
    return tuple(rates), speedup


def _conv_rate(budget, rng) -> float:
    from tilegraph.ir import kernels

    xs, ws = CONV_SHAPES
    x = rng.standard_normal(xs, dtype=np.float32)
    w = rng.standard_normal(ws, dtype=np.float32)
    out = kernels.conv(x, w, None, (), (), (), 1)
    (t,) = median_times((lambda: kernels.conv(x, w, None, (), (), (), 1),), budget)
    return 2 * out.size * math.prod(ws[1:]) / t


def _gemm_rate(m, n, k, dtype, launch, budget, rng) -> float:
    """FLOP/s of one np.matmul, net of the fixed call cost (so time = launch + 2mnk/rate)."""
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    c = np.empty((m, n), dtype)
    t = median_time(lambda: np.matmul(a, b, out=c), budget)
    return 2 * m * n * k / max(t - launch, t / 10)


def summary(hw: Hardware) -> str:
    """The measured numbers as a table."""
    rows = [
        ("call overhead (np.add, 16 elements)", f"{hw.launch_overhead * 1e6:.2f} us"),
        ("temporary, 1 MiB alloc + first touch", f"{hw.alloc_overhead * 1e6:.2f} us"),
        ("stream bandwidth (np.add, > L3)", f"{hw.memory_bandwidth / 1e9:.1f} GB/s"),
        (f"cache bandwidth (np.add, in {hw.cache_bytes // 1024} KiB L2)", f"{hw.cache_bandwidth / 1e9:.1f} GB/s"),
        ("NumPy call in a chunk loop", f"{hw.chunk_call_overhead * 1e6:.2f} us"),
        ("fork/join of the chunk pool", f"{hw.parallel_overhead * 1e6:.1f} us"),
        ("GEMM on all cores / (cores x one core)", f"{hw.parallel_efficiency:.2f}"),
        ("the same, one GEMM on BLAS's threads", f"{hw.blas_parallel_efficiency:.2f}"),
        ("a call on BLAS's threads, beyond one on one thread", f"{hw.blas_call_overhead * 1e6:.1f} us"),
        ("convolution kernel (K.conv)", f"{hw.conv_rate / 1e9:.1f} GFLOP/s"),
        ("attention kernel (attention_tiled, one core, by head dim)",
         " ".join(f"{d}:{r / 1e9:.1f}" for d, r in hw.attention_rates) + " GFLOP/s"),
        ("attention kernel: all cores / one core", f"{hw.attention_speedup:.2f}x"),
        ("skinny GEMM efficiency (rows: share of a tall one)",
         " ".join(f"{r}:{e:.2f}" for r, e in hw.skinny_gemm)),
        ("peak f32 GEMM (all cores)", f"{hw.flops('f32') / 1e9:.1f} GFLOP/s"),
        ("f64 GEMM (largest shape)", f"{hw.flops('f64') / 1e9:.1f} GFLOP/s"),
    ]
    rows += [(f"GEMM f32 {m}x{n}x{k} (one core)", f"{r / 1e9:.1f} GFLOP/s") for m, n, k, r in hw.gemm_samples]
    rows += [(f"f32 {name} (in cache / spilled)",
              f"{rate / 1e9:.2f} / {hw.ufunc_rates_spilled.get(name, rate) / 1e9:.2f} Gelem/s")
             for name, rate in hw.ufunc_rates.items()]
    return table(hw.source, rows)


def run(quick: bool = False, output: str | Path | None = None, progress: bool = True) -> Path:
    """Measure, save (default: the cache file hardware("cpu") reads), print the table."""
    return measure_and_save(measure, summary, output if output is not None else cpu_profile_path(), quick, progress,
                            "tilegraph calibrate")


