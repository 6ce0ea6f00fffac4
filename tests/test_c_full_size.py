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


@pytest.mark.parametrize("case", ["conv-silu", "linear-silu", "silu-also-read"])
def test_silu_after_a_gemm_or_convolution_is_onednns_swish_epilogue(case):
    """x * sigmoid(x) after a convolution (EfficientNet) or a linear layer (Llama's gate)
    is one swish post-op applied while the output block is in cache; where x has another
    reader the epilogue may not overwrite it, and the result still agrees."""
    rng = np.random.default_rng(2)
    g = Graph()
    if case == "conv-silu":
        x = g.input("x", (1, 6, 10, 10))
        a = g.op("conv", x, g.weight("w", rng.standard_normal((16, 6, 3, 3)).astype(np.float32)), pads=(1, 1, 1, 1))
        y = a * g.sigmoid(a)
        xs, n = rng.standard_normal((1, 6, 10, 10)).astype(np.float32), 54
    else:
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



@pytest.mark.parametrize("case", ["conv-hardswish", "linear-hardswish", "hardswish-also-read"])
def test_hardswish_after_a_gemm_or_convolution_is_one_onednn_epilogue(case):
    """MobileNetV3's activation x * hardsigmoid(x) (relu6(x + 3) / 6, decomposed into five
    ops) after a convolution or its classifier's linear layer is one post-op rather than a
    loop over the output after the primitive; where x has another reader the epilogue may
    not overwrite it. Results agree."""
    rng = np.random.default_rng(3)
    g = Graph()
    if case == "linear-hardswish":
        x = g.input("x", (64, 96))
        a = g.matmul(x, g.weight("w", rng.standard_normal((96, 80)).astype(np.float32) / 3))
        xs, n = rng.standard_normal((64, 96)).astype(np.float32), 96
    else:
        x = g.input("x", (1, 6, 10, 10))
        a = g.op("conv", x, g.weight("w", 3 * rng.standard_normal((16, 6, 3, 3)).astype(np.float32)), pads=(1, 1, 1, 1))
        xs, n = rng.standard_normal((1, 6, 10, 10)).astype(np.float32), 54
    # torch's hardsigmoid as ir/decompositions.hard_sigmoid spells it (the torch and ONNX frontends' form)
    def c(v):
        return g.constant(v, "f32")
    gate = g.op("max", g.op("min", a * c(1 / 6) + c(0.5), c(1.0)), c(0.0))
    y = a * gate
    if case == "hardswish-also-read":
        y = y + a
    model = g.build(y, names=["y"])
    compiled = tilegraph.compile(model, target="c")  # fuse makes the epilogue group
    assert ("dnnl_eltwise_hardswish" in compiled.source) == (case != "hardswish-also-read")
    step = compiled.source[compiled.source.index("/* step 0"):]
    after = step[step.index("tg_prim_run"):step.index("return 0;")]
    assert ("for (" in after) == (case == "hardswish-also-read"), after  # a loop after the primitive or none
    got, want = compiled.run(xs)[0], interpret(model, [xs])[0]
    assert 0.05 < np.mean((want > -3) & (want < 3)), "no value between the clamps: the case tests nothing"
    assert_close(got, want, "f32", reduction_length=n)


@pytest.mark.parametrize("equation,shapes", [
    ("bghid,bghjd->bghij", [(1, 3, 2, 7, 5), (1, 3, 2, 6, 5)]),  # MaxViT's scores: q @ k^T over (batch, window, head)
    ("bghij,bghjd->bghid", [(2, 3, 2, 7, 6), (2, 3, 2, 6, 5)]),  # and its weights @ v
    ("abcd,cdbe->eab", [(2, 3, 4, 5), (4, 5, 3, 6)]),  # grouped dims and an output in another order
    ("ij,kl->ijkl", [(2, 3), (4, 5)]),  # an outer product: nothing summed
    ("bi,bi->b", [(3, 40), (3, 40)]),  # rows' dot products
])
def test_an_einsum_that_is_a_batched_matrix_product_runs_in_c_as_a_matmul(equation, shapes):
    """canonicalize spells a two-operand einsum that is a batched matrix product as one
    matmul between transposes and reshapes: the C backend runs it on oneDNN instead of
    NumPy's einsum on the host (MaxViT-T's 44 attention einsums were 30% of its time), and
    the result agrees with the interpreter's einsum."""
    rng = np.random.default_rng(4)
    g = Graph()
    x, y = g.input("x", shapes[0]), g.input("y", shapes[1])
    model = g.build(g.einsum(x, y, equation=equation), names=["o"])
    compiled = tilegraph.compile(model, target="c")
    steps = compiled._runner.program.steps
    assert [s.comment for s in steps if s.host_op is not None] == []
    assert "matmul" in str(compiled.model.module) and "einsum" not in str(compiled.model.module)
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    k = max(1, int(np.prod([shapes[0][equation.index(c)] for c in equation.split(",")[0]
                            if c not in equation.split("->")[1]])))
    assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], "f32", reduction_length=k)


def test_an_einsum_that_is_no_matrix_product_is_left_to_einsum():
    """A trace, a sum over one operand's index and a repeated index are no matmul: the
    einsum stays (and runs on the host), with the interpreter's result."""
    rng = np.random.default_rng(5)
    for equation, shapes in [("ij,jk->k", [(3, 4), (4, 5)]), ("ii,ij->j", [(4, 4), (4, 3)])]:
        g = Graph()
        x, y = g.input("x", shapes[0]), g.input("y", shapes[1])
        model = g.build(g.einsum(x, y, equation=equation), names=["o"])
        compiled = tilegraph.compile(model, target="c")
        assert "einsum" in str(compiled.model.module), equation
        xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], "f32", reduction_length=12)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_concat_of_convolutions_is_channels_last_and_copies_rows_of_channels(batch):
    """DenseNet's blocks concatenate convolutions' channels-last outputs along the channels
    and normalize the result before the next convolution. The concat is channels-last too,
    each piece copied as rows of its channels into the wider rows (row-major, each piece
    was a transposing copy and the convolution after it read a transposed buffer); the
    result agrees with the interpreter."""
    rng = np.random.default_rng(6)
    g = Graph()
    x = g.input("x", (batch, 16, 12, 12))
    a = g.relu(g.op("conv", x, g.weight("wa", rng.standard_normal((48, 16, 1, 1)).astype(np.float32) / 4)))
    b = g.op("conv", a, g.weight("wb", rng.standard_normal((32, 48, 3, 3)).astype(np.float32) / 20), pads=(1, 1, 1, 1))
    cat = g.op("concat", a, b, axis=1)
    scale, shift = (g.weight(n, rng.standard_normal((1, 80, 1, 1)).astype(np.float32)) for n in ("s", "t"))
    y = g.op("conv", g.relu(cat * scale + shift), g.weight("wc", rng.standard_normal((24, 80, 1, 1)).astype(np.float32) / 9))
    model = g.build(y, names=["y"])
    compiled = tilegraph.compile(model, target="c")
    steps = compiled._runner.program.steps
    assert not [s.comment for s in steps if "copy" in s.comment or s.host_op is not None]
    source = compiled.source
    concat = source[source.index("concat ->"):]
    concat = concat[:concat.index("return 0;")]
    assert concat.count("r1[j] = r0[j];") == 2, concat  # each piece: rows of contiguous channels
    xs = rng.standard_normal((batch, 16, 12, 12)).astype(np.float32)
    assert_close(compiled.run(xs)[0], interpret(model, [xs])[0], "f32", reduction_length=16 + 48 * 9 + 80)

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
