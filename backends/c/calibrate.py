"""Measure this machine as the C backend runs on it: what `tilegraph calibrate --target c` runs.

Every number is the time of a real compiled C module (built by this backend from a tiny
graph, cached like any other module), called as a model is called:

- The module call: one add over 16 elements (`launch_overhead`: the input check, the
  ctypes call, the fresh output); one more step, a C function, in a module
  (`chunk_call_overhead`: a chain of tiny unfused adds against one).
- Elementwise passes: a chain of unfused adds, one step each, over arrays that fit the
  cores' L2 at two sizes: the slope is a step's bytes (2 reads, 1 write a element) over
  `cache_bandwidth`, the intercept the fixed cost of a step that opens an OpenMP region
  (`parallel_overhead`). The same chain over arrays beyond L3 gives `memory_bandwidth`.
- Fused loops: one `tg.fusion` of k ops of one kind against one of a single op, all
  threads, in cache: the difference is what each more op costs in the loop
  (`ufunc_rates`, elements/s). Softmax and layer_norm: the row kernels, elements/s
  from two row counts.
- GEMMs: x @ W with W a weight (oneDNN, reordered once to its packed layout at load),
  at MiniLM's and GPT-2's shapes, on one thread (`gemm_samples`) and on all
  (`gemm_samples_threaded`), net of the module call.
- A gather's row copy, one more in a module (`copy_bandwidth`: what every copy costs), and
  its rows from a table beyond L3 (`cold_copy_bandwidth`: what a weight's rows cost).
- Attention: the flash kernel at MiniLM's and GPT-2's head dims on one thread
  (`attention_rates`) and at the largest on all (`attention_speedup`); convolutions on
  oneDNN, all threads, one image: a 3x3, a 1x1 and a depthwise 3x3 (`conv_rates`).

The whole measurement runs in rounds far apart in time (ROUNDS), and each number is built
from each timing's fastest round (ir/calibration.in_rounds): a neighbour that holds a core
through one round's GEMMs leaves another round alone. The quick run (what the first
hardware("c") runs when there is no profile), in two rounds, takes a few seconds, most of it
compiling the modules the first time; the full one, in three, a couple of minutes.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
from pathlib import Path

import numpy as np

from tilegraph.backends.c.build import BuildError
from tilegraph.ir import Graph
from tilegraph.ir.calibration import (ATTENTION_BATCH, ATTENTION_HEAD_DIMS, ATTENTION_HEADS, ATTENTION_SEQ, Progress,
                                     Fastest, cache_sizes, in_rounds, measure_and_save, physical_memory, table)
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.fusion import POST_RATE, GroupKind, outline
from tilegraph.ir.hardware import Hardware, c_profile_path, cpu_model
from tilegraph.ir.ops import Op

# (m, n, k) of x @ W timed: a MiniLM projection at batch 1 (128 tokens) and a short
# sequence, its FFN at batch 8 (1024 tokens, 384 <-> 1536), a GPT-2 row block, a large square.
GEMM_SHAPES = ((32, 384, 384), (128, 384, 384), (256, 1536, 384), (256, 384, 1536), (256, 3072, 768),
               (1024, 1536, 384), (1024, 384, 1536), (1024, 1024, 1024), (128, 768, 768), (128, 3072, 768),
               (128, 768, 3072), (49, 512, 4608), (3136, 64, 576))
# ... and BERT-base's projections at 128 tokens, a weight wider than L2 (its FFN), the late
# and early 3x3 convolutions of ResNet-50 as GEMMs: rates are looked up by shape
# (ir/hardware._by_shape), so the samples span the models' weight sizes and row counts.
QUICK_GEMM_SHAPES = ((32, 384, 384), (128, 384, 384), (1024, 384, 1536), (128, 3072, 768))
# Convolutions timed (oneDNN, all threads, one image): x shape, weight shape, groups. A 3x3 and a
# 1x1 of ResNet's middle stages, and a depthwise 3x3 of MobileNet's: each kind's rate is read
# against the GEMM curve at its implicit GEMM's shape (passes/targets/c.conv_time); and the same
# 3x3 on winograd.c (its rate in the direct convolution's FLOPs).
CONV_CASES = {"dense": ((1, 64, 56, 56), (64, 64, 3, 3), 1), "pointwise": ((1, 256, 28, 28), (128, 256, 1, 1), 1),
              "depthwise": ((1, 96, 56, 56), (96, 1, 3, 3), 96), "winograd": ((1, 64, 56, 56), (64, 64, 3, 3), 1)}
# An image model's first convolutions, each reading the caller's plain image of 3 channels as
# a model's first does: a 3x3 stride-2 stem (MobileNet's, EfficientNet's, RegNet's), a 7x7
# stride-2 one (ResNet's) and a ViT's 16x16 stride-16 patch embedding, spanning the FLOPs per
# output of the stems between them, as x shape, weight shape, stride
# (conv_rates[kind]: passes/targets/c.stem_time, STEM_KINDS).
STEM_CASES = {"stem": ((1, 3, 224, 224), (32, 3, 3, 3), 2), "stem7x7": ((1, 3, 224, 224), (64, 3, 7, 7), 2),
              "patch": ((1, 3, 224, 224), (768, 3, 16, 16), 16)}
QUICK_STEMS = ("stem", "patch")  # the quick run's: the 7x7 is then priced on the line through them
# A global average pool over a convolution's channels-last result, as a squeeze-excitation
# takes it (pool_rate): a middle stage's map of a RegNet or an EfficientNet.
POOL_CASE = (1, 192, 28, 28)
# The input of the tiny convolutions timed for a primitive's fixed cost: a squeeze-excitation's.
TINY_CONV = (1, 64, 1, 1)
# The gather timed: rows of a table as wide as a BERT-base hidden state.
GATHER_TABLE, GATHER_WIDTH, GATHER_ROWS = 4096, 768, 512
# ... and the same rows of a table twice as large as L3 (a language model's embedding), each call
# taking other rows (ids cycled through COLD_CYCLE arrays, more rows than L3 holds between two
# reads of one): rows from memory (`cold_copy_bandwidth`; the full run's).
COLD_CYCLE = 64
# Ops timed inside one fused loop, each as a chain that keeps values in [0.1, 2] (no
# overflow, NaN or denormal slow paths): exp reads its negated input (a sign flip the
# compiler folds into the call). Others are priced at `add`'s rate.
LOOP_OPS = ("add", "mul", "div", "sqrt", "exp", "tanh", "erf", "sigmoid", "gelu")
QUICK_LOOP_OPS = ("add", "exp", "tanh", "erf", "gelu")
CHAIN = 9  # ops (steps, unfused) in the longer chain (one in the shorter)
ROW = 256  # row length of the softmax and layer_norm timed (a hidden state's row)
# ... and the short rows they are timed over too, as many elements in more rows (a 7x7 window's
# attention scores): what a row costs beyond its elements (`row_overhead`).
SHORT_ROW = 49
REDUCE_ROW = 1024  # row length of the sum along rows timed (a hidden state's row)
TINY = 16  # elements of "a tiny step": its fixed cost dominates
# Elements per array of the in-cache passes: 2 arrays in and 1 out of both sizes fit two cores'
# L2 of 1 MiB or more, and both are above the emitted loops' OpenMP threshold.
CACHE_SIZES = (1 << 16, 1 << 17)
# Bytes per array of the L3 pass: three of them (2 in, 1 out) overflow two cores' L2 of up to
# 2 MiB each, and fit an L3 of 24 MiB or more.
L3_ARRAY = 4 << 20
STREAM_QUICK = 1 << 23  # 32 MiB per array: three of them overflow a 32 MiB L3
# Seconds of timing per measurement. Quick: enough batches that a neighbour's time slice
# spoils a minority of them on a shared machine (with three samples each, a quick profile
# taken under load had tanh 100x slower than a quiet one).
BUDGET, QUICK_BUDGET = 0.4, 0.1


# Which batch of a measurement counts (ir/calibration.median_times): the lower
# quartile. On a shared machine most batches lose time slices to other processes, so a
# median prices the neighbours' load into every kernel; the quietest batch alone would be
# too fast (a lone core's turbo clock).
QUIET = 0.25


# Rounds of the whole measurement (ir/calibration.in_rounds), each measurement's fastest kept:
# a neighbour that held a core through one round's GEMMs (2-2.5x slower than the models' GEMMs
# ran later) leaves another round alone. Before each round after the first, up to ROUND_WAIT
# seconds pass waiting for the machine to go quiet. The quick run (a first compile's) takes two.
ROUNDS, QUICK_ROUNDS = 3, 2
ROUND_WAIT, QUICK_ROUND_WAIT = 10.0, 0.0
# ... and the full run takes more rounds, up to this many, while a timing had a neighbour beside
# it in every round so far.
MOST_ROUNDS = 6


def _after_depthwise(rng, xs, then=None, group: GroupKind | None = None):
    """(module, output shape) of a depthwise 3x3 over an input of shape `xs`, then (where
    given) `then(graph, y)` of its result, in one group of kind `group` where one is given:
    what is timed reads its input as a model's convolutions hand it on (channels-last, as the
    one before wrote it), not a plain array from the caller that it would reorder first."""
    g = Graph()
    pre = (rng.standard_normal((xs[1], 1, 3, 3)) / 3).astype(np.float32)
    y = g.op("conv", g.input("x", xs), g.weight("pre", pre), pads=(1, 1, 1, 1), groups=xs[1])
    if then is not None:
        y = then(g, y)
    model = g.build(y, names=["y"])
    return _module(_outline_after_first(model, group) if group else model), y.shape


def _conv_then(rng, ws, groups: int, swish: bool = False):
    """A convolution of weight shape `ws`, 'same' padded, to run after another
    (_after_depthwise), and a swish of its result where asked."""
    def then(g, y):
        w = g.weight("w", (rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))).astype(np.float32))
        pad = ws[-1] // 2
        z = g.op("conv", y, w, pads=(pad, pad, pad, pad), groups=groups)
        return z * g.op("sigmoid", z) if swish else z
    return then


def _outline_after_first(model, kind: GroupKind):
    """`model` with every computing op after its first (the depthwise of _after_depthwise) in
    one tg.fusion of `kind`, as `fuse` outlines a convolution and its epilogue."""
    block = model.func.body.block
    ops = [op for op in block.ops if isinstance(op, TgOp) and op.op_name not in (Op.weight, Op.constant)][1:]
    inside = set(ops)
    inputs = list(dict.fromkeys(v for op in ops for v in op.operands if v.owner not in inside))
    outline(ops, kind, inputs, [v for v in block.last_op.operands if v.owner in inside], block.last_op)
    model.verify()
    return model


def _tiny_convs(rng, count: int):
    """`count` 1x1 convolutions on a 1x1 map (TINY_CONV), each a oneDNN primitive of next to no work."""
    g = Graph()
    y = g.input("x", TINY_CONV)
    for i in range(count):
        w = (rng.standard_normal((TINY_CONV[1], TINY_CONV[1], 1, 1)) / np.sqrt(TINY_CONV[1])).astype(np.float32)
        y = g.op("conv", y, g.weight(f"w{i}", w))
    return g.build(y, names=["y"])


def _module(model):
    """`model` compiled, each call on every thread OpenMP gives (the team the cost model prices),
    not the fewer the runtime leaves a busy neighbour: a round a neighbour slows is slower,
    which the fastest round sees past, where one thread's times are not the team's."""
    from tilegraph.backends.c import compile_model

    module = compile_model(model)
    module.adaptive_threads = False
    return module


def _fuse_all(model, kind: GroupKind):
    """`model` with every computing op in one tg.fusion of `kind`, as `fuse` outlines a group."""
    block = model.func.body.block
    ret = block.last_op
    ops = [op for op in block.ops if isinstance(op, TgOp) and op.op_name not in (Op.weight, Op.constant)]
    inside = set(ops)
    inputs = list(dict.fromkeys(v for op in ops for v in op.operands if v.owner not in inside))
    outputs = list(dict.fromkeys(v for v in ret.operands if v.owner in inside))
    outline(ops, kind, inputs, outputs, ret)
    model.verify()
    return model


def _chain(n, length: int, op: str = "add", fused: bool = False):
    """z = op(...op(x)...) `length` times over n f32 elements (binary ops: with y); n may
    be a symbol, so one module serves every size."""
    g = Graph()
    x, y = g.input("x", (n,)), g.input("y", (n,))
    z = x
    for _ in range(length):
        if op in (Op.add, Op.mul, Op.div):
            z = g.op(op, z, y)
        elif op == Op.exp:
            z = g.op("exp", g.op("neg", z))
        else:
            z = g.op(op, z)
    model = g.build(z, names=["z"])
    return _fuse_all(model, GroupKind.ELEMENTWISE) if fused else model


def _inputs(rng, n: int, op: str = "add") -> tuple[np.ndarray, np.ndarray]:
    x = rng.uniform(0.5, 2.0, n).astype(np.float32)
    # y keeps a chain of adds, multiplies and divides near its start: + ~0, x ~1, / ~1
    y = np.full(n, {"add": 1e-3, "mul": 1.0, "div": 1.0}.get(op, 1.0), np.float32)
    return x, y


def _call(module, *arrays):
    return lambda: module(*arrays)


def _threads() -> int:
    """The threads a module runs on: OpenMP's default, OMP_NUM_THREADS where it is set
    (`OMP_NUM_THREADS=1 tilegraph calibrate --target c` measures a one-thread profile)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0]))
    except ValueError:
        return os.cpu_count() or 1


def _all_then_one(timed: Fastest, model, inputs, budget: float, cores: int) -> tuple[float, float]:
    """Seconds of one call of `model` on all threads, then on one. Each on a module loaded
    afresh: oneDNN fixes a primitive's threads when the first call creates it, so a module
    first called on one thread stays on one."""
    module = _module(model)
    (all_threads,) = timed((_call(module, *inputs),), budget)
    if cores == 1:
        return all_threads, all_threads
    module.set_threads(1)
    try:
        one = _module(model)
        (one_thread,) = timed((_call(one, *inputs),), budget)
    finally:
        module.set_threads(cores)
    return all_threads, one_thread


def measure(quick: bool = False, progress: bool | None = None) -> Hardware:
    """Time this machine's C backend and return its profile (not saved: see `run`)."""
    try:
        from tilegraph.backends.c.build import compiler, onednn

        compiler()
        onednn()
    except BuildError as e:
        raise TilegraphError(f"cannot calibrate the C backend: {e}") from None
    rounds = QUICK_ROUNDS if quick else ROUNDS
    steps = (13 + len(QUICK_LOOP_OPS) + len(QUICK_GEMM_SHAPES) if quick
             else 14 + len(LOOP_OPS) + len(GEMM_SHAPES))
    bar = Progress(rounds * steps, sys.stderr.isatty() if progress is None else progress)
    hw = in_rounds(lambda timed: _round(timed, quick, bar), rounds, QUIET, QUICK_ROUND_WAIT if quick else ROUND_WAIT,
                   QUICK_ROUNDS if quick else MOST_ROUNDS)
    bar.close()
    return hw


def _round(timed: Fastest, quick: bool, bar: Progress) -> Hardware:
    """One round of the measurement (ir/calibration.in_rounds): the profile from `timed`'s
    fastest round of each measurement so far."""
    budget = QUICK_BUDGET if quick else BUDGET
    shapes = QUICK_GEMM_SHAPES if quick else GEMM_SHAPES
    loop_ops = QUICK_LOOP_OPS if quick else LOOP_OPS
    caches = cache_sizes()
    cores = _threads()
    rng = np.random.default_rng(0)

    # One chain of unfused adds, short and long, serves every size: its length is symbolic.
    short, long_ = _module(_chain("n", 1)), _module(_chain("n", CHAIN))

    def step_time(n: int, budget: float) -> tuple[float, float]:
        """(one call of the short chain, one more step) over n elements."""
        x, y = _inputs(rng, n)
        t_short, t_long = timed((_call(short, x, y), _call(long_, x, y)), budget)
        return t_short, (t_long - t_short) / (CHAIN - 1)

    # The module call, and one more tiny step in it (no OpenMP region below the threshold).
    bar.step("module call")
    launch, step = step_time(TINY, budget)
    step = max(0.0, step)

    # Unfused steps in cache at two sizes: bytes per element over bandwidth, plus a fixed cost.
    bar.step("passes in cache")
    (n1, n2), (p1, p2) = CACHE_SIZES, (max(step_time(n, budget)[1], 1e-9) for n in CACHE_SIZES)
    slope = (p2 - p1) / (n2 - n1)
    if slope <= 0:  # noise on a busy machine: the whole step at the larger size, no fixed part
        slope, fork_join = p2 / n2, 0.0
    else:
        fork_join = max(0.0, p1 - slope * n1)
    cache_bandwidth = 12 / slope

    # The same steps over arrays beyond L3 (the steps' buffers are the arena's: no page faults).
    bar.step("stream bandwidth")
    n_stream = STREAM_QUICK if quick else max(STREAM_QUICK, 2 * caches["l3"] // 4)
    t_short, per_step = step_time(n_stream, max(budget, 0.2))
    if per_step <= 0:  # noise left no difference: the one step's whole call (its fresh output's page faults too)
        per_step = t_short - launch
    memory_bandwidth = min(12 * n_stream / max(per_step - fork_join, 1e-9), cache_bandwidth)

    # And over arrays beyond the cores' L2 that fit L3 (a layer's activations), where it has one.
    bar.step("L3 bandwidth")
    l3_elements = L3_ARRAY // 4
    if caches.get("l3", 0) >= 3 * L3_ARRAY * 2 and 3 * L3_ARRAY > caches["l2"] * cores:
        _, per_step = step_time(l3_elements, budget)
        l3_bandwidth = min(max(12 * l3_elements / max(per_step - fork_join, 1e-9), memory_bandwidth), cache_bandwidth)
        l3_bytes = caches["l3"]
    else:
        l3_bandwidth, l3_bytes = 0.0, 0

    # Each more op in one fused loop, in cache, all threads.
    rates = {}
    n = CACHE_SIZES[-1]
    for op in loop_ops:
        bar.step(f"{op} in a fused loop")
        x, y = _inputs(rng, n, op)
        one, chain = _module(_chain("n", 1, op, fused=True)), _module(_chain("n", CHAIN, op, fused=True))
        t_one, t_chain = timed((_call(one, x, y), _call(chain, x, y)), budget)
        extra = t_chain - t_one
        rates[op] = (CHAIN - 1) * n / extra if extra > 0 else n / max(t_one - launch, 1e-9)

    bar.step("softmax and layer_norm rows")
    row_overhead = {}
    for op in ("softmax", "layer_norm"):
        modules = []
        for width in (ROW, SHORT_ROW):
            g = Graph()
            xin = g.input("x", ("rows", width))
            modules.append(_module(g.build(g.softmax(xin) if op == Op.softmax else g.layer_norm(xin), names=["z"])))
        sizes = [n // ROW for n in CACHE_SIZES]
        short = sizes[-1] * ROW // SHORT_ROW  # as many elements as the larger, in short rows
        t_small, t_big, t_short = timed(
            [_call(modules[0], rng.standard_normal((r, ROW), dtype=np.float32)) for r in sizes]
            + [_call(modules[1], rng.standard_normal((short, SHORT_ROW), dtype=np.float32))], budget)
        e_small, e_big = (r * ROW for r in sizes)
        whole = (e_big - e_small) / (t_big - t_small) if t_big > t_small * 1.05 else e_big / max(t_big - launch, 1e-9)
        # The same elements in more rows took longer by each row's own cost (its max, sum and
        # scale loops' setup and tails): that per row, the rest per element.
        per_row = max(0.0, (t_short - t_big) / (short - sizes[-1]))
        per_element = 1 / whole - per_row / ROW
        if per_element <= 0:  # noise: the rows' rate as measured whole, at ROW
            per_row, per_element = 0.0, 1 / whole
        rates[op], row_overhead[op] = 1 / per_element, per_row

    # A sum along rows, as a fused loop reduces each row (an RMSNorm's mean of squares): one
    # accumulator a row, each element added to it in turn, far below `add`'s rate in a loop
    # (ufunc_rates["reduce_sum"]: passes/targets/c.reduction_rate).
    bar.step("a sum along rows")
    g = Graph()
    summed = _module(g.build(g.sum(g.input("x", ("rows", REDUCE_ROW)), axes=(1,), keepdims=True), names=["y"]))
    sizes = [n // REDUCE_ROW for n in CACHE_SIZES]
    t_small, t_big = timed([_call(summed, rng.standard_normal((r, REDUCE_ROW), dtype=np.float32)) for r in sizes],
                                  budget)
    e_small, e_big = (r * REDUCE_ROW for r in sizes)
    rates[Op.reduce_sum] = (e_big - e_small) / (t_big - t_small) if t_big > t_small * 1.05 \
        else e_big / max(t_big - launch, 1e-9)

    # A gather's row copy (embeddings; priced alike: every copy, concat, pad): one gather more
    # in the module, from an intermediate into the arena (the output's fresh pages cancel).
    bar.step("gather rows")
    g = Graph()
    table = g.weight("table", rng.standard_normal((GATHER_TABLE, GATHER_WIDTH), dtype=np.float32))
    one = _module(g.build(g.embedding(table, g.input("ids", (GATHER_ROWS,), "i64")), names=["y"]))
    g2 = Graph()
    table = g2.weight("table", rng.standard_normal((GATHER_TABLE, GATHER_WIDTH), dtype=np.float32))
    ids2, again = g2.input("ids", (GATHER_ROWS,), "i64"), g2.input("again", (GATHER_ROWS,), "i64")
    two = _module(g2.build(g2.embedding(g2.embedding(table, ids2), again), names=["y"]))
    rows = rng.integers(0, GATHER_TABLE, GATHER_ROWS)
    t_one, t_two = timed((_call(one, rows), _call(two, rows, rng.permutation(GATHER_ROWS))), budget)
    moved = GATHER_ROWS * GATHER_WIDTH * 4
    copy_bandwidth = moved / (t_two - t_one) if t_two > t_one * 1.05 else moved / max(t_one - launch, 1e-9)
    cold_copy_bandwidth = 0.0
    if not quick:
        bar.step("gather rows from memory")
        cold_rows = max(GATHER_TABLE, 2 * caches["l3"] // (GATHER_WIDTH * 4))
        g = Graph()
        table = g.weight("table", rng.standard_normal((cold_rows, GATHER_WIDTH), dtype=np.float32))
        cold = _module(g.build(g.embedding(table, g.input("ids", (GATHER_ROWS,), "i64")), names=["y"]))
        ids = itertools.cycle([rng.integers(0, cold_rows, GATHER_ROWS) for _ in range(COLD_CYCLE)])
        t_hot, t_cold = timed((_call(one, rows), lambda: cold(next(ids))), budget)
        # the hot gather's call, output and copy alike: what more the cold one took is the rows' trip
        cold_copy_bandwidth = moved / (moved / copy_bandwidth + max(t_cold - t_hot, 0.0))

    # GEMMs on a packed weight, one thread and all threads.
    samples, threaded = [], []
    for m, n_, k in shapes:
        bar.step(f"gemm {m}x{n_}x{k}")
        g = Graph()
        a = g.input("x", (m, k))
        w = g.weight("w", (rng.standard_normal((k, n_)) / np.sqrt(k)).astype(np.float32))
        model = g.build(g.matmul(a, w), names=["y"])
        xa = rng.standard_normal((m, k), dtype=np.float32)
        flops = 2 * m * n_ * k
        tn, t1 = _all_then_one(timed, model, (xa,), budget, cores)
        samples.append((m, n_, k, flops / max(t1 - launch, t1 / 10)))
        threaded.append((m, n_, k, flops / max(tn - launch, tn / 10)))
    biggest = max(range(len(shapes)), key=lambda i: shapes[i][0] * shapes[i][1] * shapes[i][2])
    efficiency = min(1.0, threaded[biggest][3] / (cores * samples[biggest][3]))

    bar.step("attention")
    attention_rates, speedup = [], 1.0
    for d in ATTENTION_HEAD_DIMS:
        g = Graph()
        shape = (ATTENTION_BATCH, ATTENTION_HEADS, ATTENTION_SEQ, d)
        q, k, v = (g.input(name, shape) for name in "qkv")  # type: ignore[assignment]
        model = g.build(g.attention(q, k, v), names=["o"])
        qkv = [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]
        flops = ATTENTION_BATCH * ATTENTION_HEADS * ATTENTION_SEQ ** 2 * (4 * d + 5)  # as cost.model.op_flops
        tn, t1 = _all_then_one(timed, model, qkv, budget, cores)
        attention_rates.append((d, flops / max(t1 - launch, t1 / 10)))
        if d == ATTENTION_HEAD_DIMS[-1]:
            speedup = (t1 - launch) / max(tn - launch, 1e-9)

    bar.step("convolutions")
    conv_rates = {}
    for kind, (xs, ws, groups) in CONV_CASES.items():
        # Each after a depthwise 3x3 that keeps the input's shape, less that one alone (_after_depthwise).
        (before, _), (both, out_shape) = _after_depthwise(rng, xs), _after_depthwise(rng, xs, _conv_then(rng, ws, groups))
        xc = rng.standard_normal(xs, dtype=np.float32)
        # "dense" is oneDNN's direct convolution, which every other dense one runs on; the same
        # 3x3 as winograd.c runs it (its binding made with that path on): "winograd"
        both._lib.tg_set_winograd(int(kind == "winograd"))
        try:
            both(xc)
        finally:
            both._lib.tg_set_winograd(-1)
        t_before, t_both = timed((_call(before, xc), _call(both, xc)), budget)
        conv_flops = 2 * int(np.prod(out_shape)) * int(np.prod(ws[1:]))
        gemm = (int(np.prod(out_shape)) // ws[0], ws[0] // groups, int(np.prod(ws[1:])))  # one group's (m, n, k)
        conv_rates[kind] = (*gemm, conv_flops / max(t_both - t_before, t_both / 10))
    conv_rate = conv_rates["dense"][3]

    # A transcendental activation applied as a convolution writes (a swish, sigmoid(y) * y, as
    # EfficientNet's convolutions take it: a loop over the result in the convolution's step; a
    # GEMM's is oneDNN's post-op): the pointwise convolution with and without it, each
    # one group after the depthwise, the difference per element (ufunc_rates["eltwise_post"]).
    bar.step("an activation a convolution applies")
    xs, ws, _ = CONV_CASES["pointwise"]
    (plain, out_shape), (swish, _) = (_after_depthwise(rng, xs, _conv_then(rng, ws, 1, post), GroupKind.CONV_EPILOGUE)
                                      for post in (False, True))
    xc = rng.standard_normal(xs, dtype=np.float32)
    t_plain, t_swish = timed((_call(plain, xc), _call(swish, xc)), budget)
    written = int(np.prod(out_shape))
    if t_swish > t_plain * 1.02:  # else within noise of nothing: priced free, as without the rate
        rates[POST_RATE] = written / (t_swish - t_plain)

    bar.step("stem convolutions")
    for kind, (xs, ws, stride) in STEM_CASES.items():
        if quick and kind not in QUICK_STEMS:
            continue
        g = Graph()
        w = g.weight("w", (rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))).astype(np.float32))
        y = g.op("conv", g.input("x", xs), w, pads=(ws[-1] // 2 if ws[-1] > stride else 0,) * 4, strides=(stride, stride))
        (t_stem,) = timed((_call(_module(g.build(y, names=["y"])), rng.standard_normal(xs, dtype=np.float32)),),
                                 budget)
        pixels = int(np.prod(y.shape)) // ws[0]
        conv_rates[kind] = (pixels, ws[0], int(np.prod(ws[1:])),
                            2 * pixels * ws[0] * int(np.prod(ws[1:])) / max(t_stem - launch, t_stem / 10))

    # Global average pools after the depthwise 3x3 that writes their input channels-last: two
    # (a mean and a sum) against one, so both modules hand back as small a result.
    bar.step("a global average pool")
    (one, _), (two, _) = (_after_depthwise(rng, POOL_CASE, lambda g, y: g.mean(y, axes=(2, 3), keepdims=True)),
                          _after_depthwise(rng, POOL_CASE, lambda g, y: g.mean(y, axes=(2, 3), keepdims=True)
                                           + g.sum(y, axes=(2, 3), keepdims=True)))
    xp = rng.standard_normal(POOL_CASE, dtype=np.float32)
    t_one, t_two = timed((_call(one, xp), _call(two, xp)), budget)
    pool_rate = int(np.prod(POOL_CASE)) / max(t_two - t_one, t_two / 10)

    # One more oneDNN primitive in a module, of next to no work: a 1x1 convolution on a 1x1
    # map (a squeeze-excitation's), beyond the step it is.
    bar.step("a primitive's call")
    tiny = rng.standard_normal(TINY_CONV, dtype=np.float32)
    t_one, t_chain = timed((_call(_module(_tiny_convs(rng, 1)), tiny), _call(_module(_tiny_convs(rng, CHAIN)), tiny)),
                                  budget)
    primitive = max(0.0, (t_chain - t_one) / (CHAIN - 1) - step)

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return Hardware(
        name="c", device="cpu", backend="c",
        peak_flops={"f32": max(r for *_, r in threaded)},
        memory_bandwidth=memory_bandwidth,
        cache_bandwidth=cache_bandwidth,
        cache_bytes=caches["l2"],
        l3_bytes=l3_bytes,
        l3_bandwidth=l3_bandwidth,
        memory_bytes=physical_memory(),
        cores=cores,
        shared_memory_per_core=caches["l1d"],
        registers_per_core=0,
        launch_overhead=launch,
        alloc_overhead=0.0,  # intermediates live in the module's arena, planned once per binding
        links={},
        gemm_samples=tuple(samples),
        gemm_samples_threaded=tuple(threaded),
        ufunc_rates=rates,
        chunk_call_overhead=step,
        parallel_overhead=fork_join,
        parallel_efficiency=efficiency,
        conv_rate=conv_rate,
        conv_rates=conv_rates,
        primitive_overhead=primitive,
        pool_rate=pool_rate,
        row_overhead=row_overhead,
        copy_bandwidth=copy_bandwidth,
        cold_copy_bandwidth=cold_copy_bandwidth,
        attention_rates=tuple(attention_rates),
        attention_speedup=speedup,
        source=f"calibrated {stamp} on {cpu_model()} ({cores} threads, C backend{', quick' if quick else ''})",
    )


def summary(hw: Hardware) -> str:
    """The measured numbers as a table."""
    inputs = {kind: xs for kind, (xs, _, _) in {**CONV_CASES, **STEM_CASES}.items()}
    rows = [
        ("module call (one add, 16 elements)", f"{hw.launch_overhead * 1e6:.2f} us"),
        ("one more step in a module (tiny, one thread)", f"{hw.chunk_call_overhead * 1e6:.2f} us"),
        ("one more step that opens an OpenMP region", f"{hw.parallel_overhead * 1e6:.2f} us"),
        (f"pass bandwidth, in cache ({hw.cache_bytes // 1024} KiB L2 per core)", f"{hw.cache_bandwidth / 1e9:.1f} GB/s"),
        ("pass bandwidth, beyond L2, in L3", f"{hw.l3_bandwidth / 1e9:.1f} GB/s"),
        ("pass bandwidth, beyond L3", f"{hw.memory_bandwidth / 1e9:.1f} GB/s"),
        ("one more oneDNN primitive (a 1x1 convolution on a 1x1 map)", f"{hw.primitive_overhead * 1e6:.2f} us"),
        ("a global average pool over channels-last data", f"{hw.pool_rate / 1e9:.2f} Gelem/s"),
        ("a gather's rows copied (bytes written)", f"{hw.copy_bandwidth / 1e9:.1f} GB/s"),
        ("... its rows from a table beyond L3 (bytes written)", f"{hw.cold_copy_bandwidth / 1e9:.1f} GB/s"),
        ("oneDNN GEMM all threads / (cores x one thread)", f"{hw.parallel_efficiency:.2f}"),
        *((f"convolution {kind} {'x'.join(map(str, inputs.get(kind, ())))} (oneDNN, all threads)",
           f"{rate / 1e9:.1f} GFLOP/s") for kind, (*_, rate) in hw.conv_rates.items()),
        ("attention (flash kernel, one thread, by head dim)",
         " ".join(f"{d}:{r / 1e9:.1f}" for d, r in hw.attention_rates) + " GFLOP/s"),
        ("attention: all threads / one thread", f"{hw.attention_speedup:.2f}x"),
    ]
    rows += [(f"GEMM f32 {m}x{n}x{k} (one thread / all)", f"{r / 1e9:.1f} / {t / 1e9:.1f} GFLOP/s")
             for (m, n, k, r), (*_, t) in zip(hw.gemm_samples, hw.gemm_samples_threaded)]
    where = {Op.softmax: "row kernel", Op.layer_norm: "row kernel", Op.reduce_sum: "along rows, one accumulator a row",
             POST_RATE: "as oneDNN writes a result (a swish post-op)"}
    rows += [(f"f32 {name} {where.get(name, 'in a fused loop')} (all threads)",
              f"{rate / 1e9:.2f} Gelem/s" + (f" + {hw.row_overhead[name] * 1e9:.0f} ns a row"
                                             if name in hw.row_overhead else ""))
             for name, rate in hw.ufunc_rates.items()]
    return table(hw.source, rows)


def run(quick: bool = False, output: str | Path | None = None, progress: bool = True) -> Path:
    """Measure, save (default: the cache file hardware("c") reads), print the table."""
    return measure_and_save(measure, summary, output if output is not None else c_profile_path(), quick, progress,
                            "tilegraph calibrate --target c")
