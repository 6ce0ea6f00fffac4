"""The C backend's fixes for the cliffs of the full-size sweep's torchvision models
(benchmarks/vision_models.py: MobileNetV3-Large, DenseNet-121, MaxViT-T) keep their results:
each fast path is taken where it applies and agrees with the float64 interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph

from tilegraph.ir import Graph, interpret
from tilegraph.testing import assert_close


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


@pytest.mark.parametrize("batch,also_read", [(1, False), (2, False), (1, True)])
def test_a_concat_of_convolutions_is_channels_last_and_read_by_its_batch_norm_piece_by_piece(batch, also_read):
    """DenseNet's blocks concatenate convolutions' channels-last outputs along the channels
    and normalize the result (batch norm, relu) before the next convolution. The norm's loop
    reads each piece where it lies and writes that piece's channels of the channels-last
    result: no concat step copies the pieces first (it did, 58 times in DenseNet-121), and
    the pieces' loops share one parallel region (a piece alone may be too small to split). Where
    the concat has another reader its own step remains, copying each piece as rows of its
    channels into the wider rows. The result agrees with the interpreter."""
    rng = np.random.default_rng(6)
    g = Graph()
    x = g.input("x", (batch, 16, 24, 24))
    a = g.relu(g.op("conv", x, g.weight("wa", rng.standard_normal((48, 16, 1, 1)).astype(np.float32) / 4)))
    b = g.op("conv", a, g.weight("wb", rng.standard_normal((32, 48, 3, 3)).astype(np.float32) / 20), pads=(1, 1, 1, 1))
    cat = g.op("concat", a, b, axis=1)
    scale, shift = (g.weight(n, rng.standard_normal((1, 80, 1, 1)).astype(np.float32)) for n in ("s", "t"))
    y = g.op("conv", g.relu(cat * scale + shift), g.weight("wc", rng.standard_normal((24, 80, 1, 1)).astype(np.float32) / 9))
    model = g.build(y, *([g.reduce_sum(cat, axes=(2, 3))] if also_read else []), names=["y", "s"][:1 + also_read])
    compiled = tilegraph.compile(model, target="c", threads=2)  # the region's threads share each piece
    steps = [s.comment for s in compiled._runner.program.steps]
    assert not [s for s in steps if "copy" in s or "(host)" in s], steps
    assert any("concat" in s for s in steps) == also_read, steps
    source = compiled.source
    if also_read:
        concat = source[source.index("concat ->"):]
        concat = concat[:concat.index("return 0;")]
        assert concat.count("r1[j] = r0[j];") == 2, concat  # each piece: rows of contiguous channels
    else:
        norm = source[source.index("mul, add, relu */"):]
        norm = norm[:norm.index("return 0;")]
        assert norm.count("for (int64_t j = 0; j < 48; j++)") == norm.count("for (int64_t j = 0; j < 32; j++)") == 1
        assert norm.count("#pragma omp parallel if") == 1 and norm.count("#pragma omp for nowait") == 2, norm
    xs = rng.standard_normal((batch, 16, 24, 24)).astype(np.float32)
    got, want = compiled.run(xs), interpret(model, [xs])
    assert_close(got[0], want[0], "f32", reduction_length=16 + 48 * 9 + 80)
    if also_read:
        assert_close(got[1], want[1], "f32", reduction_length=16 + 48 * 9 + 576)


def test_swin_attention_biases_and_shift_mask_are_folded_not_computed_each_call():
    """Swin's window attention adds a relative-position bias gathered from a weight table
    and a shift mask made from constants (an outer difference, compared and selected);
    both depend on weights only and are folded at compile time, so the compiled program has
    no gather and no mask step, and the scores' chain (matmul, scale, add, softmax) is one
    step, as in the unshifted windows. The result agrees with the interpreter."""
    rng = np.random.default_rng(7)
    windows, heads, tokens, d = 4, 2, 16, 8
    g = Graph()
    q, k = (g.input(n, (windows, heads, tokens, d)) for n in ("q", "k"))
    table = g.weight("table", rng.standard_normal((49, heads)).astype(np.float32))
    index = g.weight("index", rng.integers(0, 49, tokens * tokens).astype(np.int64))
    bias = g.transpose(g.reshape(g.gather(table, index), (tokens, tokens, heads)), (2, 0, 1))
    region = g.weight("region", rng.integers(0, 3, (windows, tokens)).astype(np.float32))
    diff = g.reshape(region, (windows, 1, tokens)) - g.reshape(region, (windows, tokens, 1))
    mask = g.where(g.op("ne", diff, g.constant(0.0, "f32")), g.constant(-100.0, "f32"), diff)
    scores = g.matmul(q, g.transpose(k, (0, 1, 3, 2))) * g.constant(d ** -0.5, "f32")
    y = g.softmax(scores + bias + g.reshape(mask, (windows, 1, tokens, tokens)), axis=-1)
    model = g.build(y, names=["y"])
    compiled = tilegraph.compile(model, target="c")
    steps = [s.comment for s in compiled._runner.program.steps]
    assert len(steps) == 1 and "softmax" in steps[0], steps
    xs = [rng.standard_normal((windows, heads, tokens, d)).astype(np.float32) for _ in range(2)]
    assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], "f32", reduction_length=d)


@pytest.mark.parametrize("channels, unrolled", [(3, True), (4, True), (5, False)])
def test_an_image_copied_into_channels_last_is_written_pixel_by_pixel(channels, unrolled):
    """An image of a few planes copied into channels-last for its first convolution (the stem of
    every CNN here): up to UNROLLED_CHANNELS planes, each pixel's channels written one after
    another inside one loop over the pixels (not a loop per plane storing every 3rd float);
    more stay a loop per plane. Both agree with the interpreter."""
    rng = np.random.default_rng(5)
    g = Graph()
    x = g.input("x", (1, channels, 30, 34))
    w = (rng.standard_normal((16, channels, 3, 3)) / 5).astype(np.float32)
    y = g.relu(g.op("conv", x, g.weight("w", w), pads=(1, 1, 1, 1), strides=(2, 2)))
    model = g.build(y, names=["y"])
    compiled = tilegraph.compile(model, target="c")
    last = f"[j * {channels} + {channels - 1}]"
    assert (last in compiled.source) == unrolled, compiled.source
    xs = [rng.standard_normal((1, channels, 30, 34)).astype(np.float32)]
    assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], "f32", reduction_length=9 * channels)
