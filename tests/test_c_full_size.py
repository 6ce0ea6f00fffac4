"""The C backend's fixes for the cliffs of the full-size sweep (benchmarks/full_size_sweep.py)
keep its results: each fast path is taken where it applies and agrees with the float64
interpreter.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import tilegraph

from tilegraph.backends.c import compile_model
from tilegraph.ir import Graph, interpret
from tilegraph.testing import assert_close


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("pool", ["max", "avg", "avg-exclude-pad", "max-1d"])
def test_a_pool_after_a_convolution_runs_over_channels_last_rows(pool, batch):
    """A pool reading a convolution's NHWC output (ResNet's stem) takes the channels-last
    loop (one simd pass over the channels per tap), pads and partial windows included."""
    rng = np.random.default_rng(0)
    g = Graph()
    if pool == "max-1d":
        x = g.input("x", (batch, 5, 33))
        a = g.op("conv", x, g.weight("w", rng.standard_normal((24, 5, 3)).astype(np.float32)), pads=(1, 1))
        y = g.op("max_pool", a, kernel=(3,), strides=(2,), pads=(1, 1))
        xs = rng.standard_normal((batch, 5, 33)).astype(np.float32)
    else:
        x = g.input("x", (batch, 5, 17, 15))
        a = g.op("conv", x, g.weight("w", rng.standard_normal((24, 5, 3, 3)).astype(np.float32)), pads=(1, 1, 1, 1))
        kind = "max_pool" if pool == "max" else "avg_pool"
        extra = {"count_include_pad": pool == "avg"} if kind == "avg_pool" else {}
        y = g.op(kind, a, kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), **extra)
        xs = rng.standard_normal((batch, 5, 17, 15)).astype(np.float32)
    model = g.build(y, names=["y"])
    compiled = compile_model(model)
    assert "yr[ch]" in compiled.source, "the pool did not take the channels-last loop"
    assert_close(compiled(xs)[0], interpret(model, [xs])[0], "f32", reduction_length=45)


def test_a_forward_starts_fewer_threads_while_other_processes_take_the_cores():
    """With a busy child process on every core, a forward runs on one thread (a team that
    waits for a core at every barrier is slower than one thread), its oneDNN primitives too
    (made for one thread: one made for two runs two whatever OpenMP's count); the thread
    count asked for is restored after the call."""
    import subprocess
    import sys

    from tilegraph.backends.c import runtime
    from tilegraph.backends.c.runtime import CORES
    from tilegraph.ir.hardware import QUIET_WINDOW, Neighbours

    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (256, 512))
    y = g.gelu(g.matmul(x, g.weight("w", rng.standard_normal((512, 512)).astype(np.float32) / 20)))
    model = g.build(y, names=["y"])
    compiled = compile_model(model)
    compiled.set_threads(2)
    xs = rng.standard_normal((256, 512)).astype(np.float32)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(CORES + 1)]
    try:
        import time

        time.sleep(0.5)  # the children get scheduled
        runtime._NEIGHBOURS = Neighbours()  # a first look: the threads runnable now decide
        got = compiled(xs)[0]
        assert compiled.last_threads == 1
        time.sleep(2 * QUIET_WINDOW)  # a later call: the CPU time others took since the first
        compiled(xs)
        assert compiled.last_threads == 1
        assert 1 in compiled._bindings[()].states  # the GEMM's primitive made for one thread
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert compiled._lib.tg_max_threads() == 2
    assert_close(got, interpret(model, [xs])[0], "f32", reduction_length=512)


def test_a_forward_on_fewer_threads_runs_primitives_made_for_that_many(monkeypatch):
    """oneDNN makes a convolution for the threads OpenMP gives when it is made and runs that
    many whatever is set later: a forward started on one thread (a neighbour holds a core)
    gets its own primitives, made on one thread, and the same result; the weights'
    preparation is not repeated and the primitives are reported once."""
    from tilegraph.backends.c import runtime

    rng = np.random.default_rng(2)
    g = Graph()
    x = g.input("x", (1, 32, 56, 56))  # enough work for both threads (not SERIAL_WORK)
    y = g.relu(g.op("conv", x, g.weight("w", rng.standard_normal((64, 32, 3, 3)).astype(np.float32) / 17),
                    pads=(1, 1, 1, 1)))
    model = g.build(y, names=["y"])
    compiled = compile_model(model)
    compiled.set_threads(2)
    xs = rng.standard_normal((1, 32, 56, 56)).astype(np.float32)
    monkeypatch.setattr(runtime, "_uncontended_threads", lambda threads: threads)
    both = compiled(xs)[0]
    reported = list(compiled.primitives)
    monkeypatch.setattr(runtime, "_uncontended_threads", lambda threads: 1)
    one = compiled(xs)[0]
    (binding,) = compiled._bindings.values()
    assert sorted(binding.states) == [1, 2] and compiled.last_threads == 1
    assert compiled.primitives == reported and compiled._lib.tg_max_threads() == 2
    want = interpret(model, [xs])[0]
    assert_close(both, want, "f32", reduction_length=288)
    assert_close(one, want, "f32", reduction_length=288)


@pytest.mark.parametrize("case", ["pool-nhwc", "pool-nhwc-wide", "columns", "sequence-mean"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_reduction_over_outer_positions_adds_rows_of_channels(case, batch):
    """A sum or mean whose kept innermost dim is contiguous (squeeze-excite's global pool
    over a convolution's NHWC output, column sums, a mean over a sequence) adds whole rows
    of channels in one pass, in blocks of channels (300 > one block), and agrees with the
    interpreter."""
    rng = np.random.default_rng(1)
    g = Graph()
    if case.startswith("pool"):
        c = 300 if case.endswith("wide") else 24
        x = g.input("x", (batch, 5, 9, 11))
        a = g.op("conv", x, g.weight("w", rng.standard_normal((c, 5, 3, 3)).astype(np.float32)), pads=(1, 1, 1, 1))
        y = g.reduce_mean(a, axes=(2, 3), keepdims=True)
        xs, n = rng.standard_normal((batch, 5, 9, 11)).astype(np.float32), 99 + 45
    elif case == "columns":
        x = g.input("x", (batch * 40, 33))
        y = g.reduce_sum(x, axes=(0,))
        xs, n = rng.standard_normal((batch * 40, 33)).astype(np.float32), batch * 40
    else:
        x = g.input("x", (batch, 17, 40))
        y = g.reduce_mean(x, axes=(1,), keepdims=False)
        xs, n = rng.standard_normal((batch, 17, 40)).astype(np.float32), 17
    model = g.build(y, names=["y"])
    compiled = compile_model(model)
    assert "acc[j] += row[j]" in compiled.source, "the reduction did not take the rows-of-channels loop"
    assert_close(compiled(xs)[0], interpret(model, [xs])[0], "f32", reduction_length=n)


def test_a_batch_1_squeeze_excite_pool_is_shared_among_threads():
    """At batch 1 the only parallel loop of a global pool over NHWC is its blocks of channels:
    a 96-channel pool (EfficientNet's first squeeze-excite) is at least two tasks of the
    OpenMP loop, not one block on one thread, and agrees with the interpreter."""
    rng = np.random.default_rng(2)
    g = Graph()
    x = g.input("x", (1, 8, 56, 56))
    a = g.op("conv", x, g.weight("w", rng.standard_normal((96, 8, 1, 1)).astype(np.float32)))
    model = g.build(g.reduce_mean(a, axes=(2, 3), keepdims=True), names=["y"])
    compiled = compile_model(model)
    source = compiled.source
    loop = source[source.index("acc[j] += row[j]") - 2000:source.index("acc[j] += row[j]")]
    block = int(re.findall(r"c0 \+= (\d+)\)", loop)[-1])
    assert "#pragma omp parallel for" in loop and -(-96 // block) >= 2, loop
    xs = rng.standard_normal((1, 8, 56, 56)).astype(np.float32)
    assert_close(compiled(xs)[0], interpret(model, [xs])[0], "f32", reduction_length=56 * 56 + 8)


@pytest.mark.parametrize("case", ["linear-silu", "silu-also-read"])
def test_silu_after_a_gemm_is_onednns_swish_epilogue(case):
    """x * sigmoid(x) after a linear layer (Llama's gate) is one swish post-op applied while
    the output block is in cache; where x has another reader the epilogue may not overwrite
    it, and the result still agrees."""
    rng = np.random.default_rng(2)
    g = Graph()
    x = g.input("x", (64, 96))
    a = g.matmul(x, g.weight("w", rng.standard_normal((96, 80)).astype(np.float32) / 10))
    y = g.sigmoid(a) * a
    if case == "silu-also-read":
        y = y + a
    xs, n = rng.standard_normal((64, 96)).astype(np.float32), 96
    model = g.build(y, names=["y"])
    compiled = tilegraph.compile(model, target="c")  # fuse makes the epilogue group
    assert ("dnnl_eltwise_swish" in compiled.source) == (case != "silu-also-read")
    assert_close(compiled.run(xs)[0], interpret(model, [xs])[0], "f32", reduction_length=n)


@pytest.mark.parametrize("conv", ["depthwise", "depthwise-stride-2", "pointwise", "stem"])
def test_a_swish_after_a_convolution_is_one_loop_in_its_step_not_onednns_post_op(conv):
    """x * sigmoid(x) after a convolution (EfficientNet's every convolution) runs as one simd
    loop over the result in the convolution's own step (runtime.h, tg_sigmoid_swish), not as
    oneDNN's swish post-op, which cost its kernels more; results far into both tails of the
    sigmoid (|x| past 88, where e^-x leaves float32) agree with the interpreter too."""
    from tilegraph.backends.c.emit import emit_program

    rng = np.random.default_rng(3)
    c, k, stride, groups = {"depthwise": (24, 3, 1, 24), "depthwise-stride-2": (24, 5, 2, 24),
                            "pointwise": (24, 1, 1, 1), "stem": (3, 3, 2, 1)}[conv]
    g = Graph()
    x = g.input("x", (1, c, 20, 20))
    w = rng.standard_normal((16 if conv == "stem" else 24, c // groups, k, k)).astype(np.float32)
    a = g.op("conv", x, g.weight("w", w), g.weight("b", rng.standard_normal(w.shape[0]).astype(np.float32)),
             pads=(k // 2,) * 4, strides=(stride, stride), groups=groups)
    model = g.build(a * g.sigmoid(a), names=["y"])
    compiled = tilegraph.compile(model, target="c")
    program = emit_program(compiled.model)
    assert len(program.steps) == 1 and program.steps[0].host_op is None, [s.comment for s in program.steps]
    assert "dnnl_eltwise_swish" not in compiled.source and "tg_sigmoid_swish(" in compiled.source
    xs = (rng.standard_normal((1, c, 20, 20)) * 40).astype(np.float32)  # a spans both tails
    want = interpret(model, [xs])[0]
    assert np.abs(want).max() > 100 and want.min() < 0
    assert_close(compiled.run(xs)[0], want, "f32", reduction_length=c // groups * k * k)


def _huge_pages_offered() -> bool:
    """Transparent huge pages on request, of a size the test's 9 MiB weight spans twice."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            size = int(f.read())
    except (OSError, ValueError):
        return False
    return ("[always]" in mode or "[madvise]" in mode) and size <= 4 << 20


def _huge_page_size() -> int:
    with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
        return int(f.read())


@pytest.mark.skipif(not _huge_pages_offered(), reason="the kernel offers no transparent huge pages")
def test_a_large_packed_weight_lies_on_huge_pages():
    """A convolution weight larger than a huge page (ResNet-50's 3x3 of 512 channels, 9 MiB)
    is packed into memory advised for transparent huge pages (each forward streams it: one
    TLB entry per 2 MiB rather than per 4 KiB), and the result is unchanged."""
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (1, 512, 7, 7))
    w = rng.standard_normal((512, 512, 3, 3)).astype(np.float32) / 48
    y = g.op("relu", g.op("conv", x, g.weight("w", w), pads=(1, 1, 1, 1)))
    model = g.build(y, names=["y"])
    compiled = compile_model(model)
    before = compiled.huge_page_bytes()
    xs = rng.standard_normal((1, 512, 7, 7)).astype(np.float32)
    out = compiled(xs)[0]
    assert compiled.huge_page_bytes() - before >= 2 * _huge_page_size(), "the packed weight was not advised for huge pages"
    assert_close(out, interpret(model, [xs])[0], "f32", reduction_length=512 * 9)
