"""The C backend never runs a GEMM or a convolution on oneDNN's reference kernel silently.

What holds: every convolution and matmul the emitter hands oneDNN, at batch 1 and at a
larger batch, in every layout the emitter produces (channels-last sources from an input,
from an earlier convolution and from a transpose; plain, transposed and broadcast matmul
operands; dims of size 1 anywhere), gets one of oneDNN's fast kernels, and agrees with the
float64 interpreter. A primitive that stays on the reference kernel is listed in the
compiled model's `reference_kernels` and warned of: this test fails on either.

(A batch-1 NHWC source whose batch stride was C read as layout `cdab`, which only the
reference convolution takes: ResNet-50 at batch 1 ran 200x slower than onnxruntime.)

The same at precision="bf16", where the processor has bf16 units: every primitive with a
constant weight multiplies bf16 by bf16 (its weight converted and packed once, not per
call), the others run f32 operands on the bf16 units (oneDNN's fpmath mode), none on ref.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import tilegraph
from tilegraph.backends.c import compile_model, emit, load
from tilegraph.ir import Graph, interpret
from tilegraph.testing import assert_close

RNG = np.random.default_rng(0)


def _w(*shape):
    return (RNG.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)


def _conv_model(case: str, batch: int):
    """(model, inputs, reduction length) of one convolution layout case."""
    g = Graph()
    if case == "conv1d":
        x = g.input("x", (batch, 16, 40))
        y = g.op("conv", x, g.weight("w", _w(32, 16, 3)), pads=(1, 1))
        return g.build(y, names=["y"]), [RNG.standard_normal((batch, 16, 40)).astype(np.float32)], 48
    if case == "conv3d":
        x = g.input("x", (batch, 8, 6, 10, 10))
        y = g.op("conv", x, g.weight("w", _w(16, 8, 3, 3, 3)), pads=(1,) * 6)
        return g.build(y, names=["y"]), [RNG.standard_normal((batch, 8, 6, 10, 10)).astype(np.float32)], 216
    h, w = (1, 48) if case == "height-1" else (20, 20)
    if case == "residual-nchw":  # a residual in plain NCHW (MaxViT's MBConv after its permuted attention)
        x = g.relu(g.input("x", (batch, 32, h, w)))
        a = g.op("conv", x, g.weight("w0", _w(64, 32, 1, 1)))
        y = g.relu(x + g.op("conv", a, g.weight("w1", _w(32, 64, 1, 1)), g.weight("b1", _w(32))))
        return g.build(y, names=["y"]), [RNG.standard_normal((batch, 32, h, w)).astype(np.float32)], 32 + 64 + 1
    if case == "from-nhwc":  # an NHWC input seen as NCHW: the conv reads the transpose's view
        x_nhwc = g.input("x", (batch, h, w, 16))
        x = x_nhwc.transpose(0, 3, 1, 2)
        inputs = [RNG.standard_normal((batch, h, w, 16)).astype(np.float32)]
    else:
        x = g.input("x", (batch, 16, h, w))
        inputs = [RNG.standard_normal((batch, 16, h, w)).astype(np.float32)]
    kh = 1 if case == "height-1" else 3
    # The stem: plain NCHW input; then convolutions reading the one before (channels-last).
    a = g.relu(g.op("conv", x, g.weight("w0", _w(32, 16, kh, 3)), g.weight("b0", _w(32)), pads=(kh // 2, 1) * 2))
    groups = {"depthwise": 32, "grouped": 4}.get(case, 1)
    b = g.op("conv", a, g.weight("w1", _w(32, 32 // groups, kh, 3)), pads=(kh // 2, 1) * 2, groups=groups)
    c = g.op("conv", b, g.weight("w2", _w(32, 32, 1, 1)), g.weight("b2", _w(32)))
    y = g.relu(c + a)  # a residual: a binary post-op
    if case == "strided":
        y = g.op("conv", y, g.weight("w3", _w(64, 32, 3, 3)), strides=(2, 2), pads=(1, 1, 1, 1))
    if case == "weight-input":  # a weight computed at run time: no packing once
        wt = g.input("wt", (32, 32, 1, 1))
        y = g.op("conv", y, wt)
        inputs.append(_w(32, 32, 1, 1))
    return g.build(y, names=["y"]), inputs, 16 * 9 + 32 * 9 + 32 + 32


CONV_CASES = ["plain", "height-1", "from-nhwc", "depthwise", "grouped", "strided", "weight-input", "conv1d", "conv3d",
              "residual-nchw"]


def _matmul_model(case: str, batch: int):
    """(model, inputs, reduction length) of one matmul layout case."""
    g = Graph()
    k, n = 64, 96
    if case == "linear":  # x @ W + b, gelu: one 2-D GEMM over all rows, with post-ops
        x = g.input("x", (batch, 24, k))
        y = g.gelu(g.matmul(x, g.weight("w", _w(k, n))) + g.weight("b", _w(n)))
        return g.build(y, names=["y"]), [RNG.standard_normal((batch, 24, k)).astype(np.float32)], k
    if case == "one-row":  # a decoder's step: M = 1
        x = g.input("x", (batch, 1, 256))
        y = g.matmul(x, g.weight("w", _w(256, n)))
        return g.build(y, names=["y"]), [RNG.standard_normal((batch, 1, 256)).astype(np.float32)], 256
    if case == "one-column":  # a classifier's single logit: N = 1
        x = g.input("x", (batch, 400, k))
        y = g.matmul(x, g.weight("w", _w(k, 1)))
        return g.build(y, names=["y"]), [RNG.standard_normal((batch, 400, k)).astype(np.float32)], k
    q = g.input("q", (batch, 4, 32, k))
    qs = RNG.standard_normal((batch, 4, 32, k)).astype(np.float32)
    if case == "batched-transposed":  # attention scores: q @ k^T, both activations
        kk = g.input("k", (batch, 4, 48, k))
        y = g.matmul(q, kk.transpose(0, 1, 3, 2))
        return g.build(y, names=["y"]), [qs, RNG.standard_normal((batch, 4, 48, k)).astype(np.float32)], k
    if case == "batched-broadcast":  # one (k, 48) matrix against every batch and head
        m = g.input("m", (1, 1, k, 48))
        y = g.matmul(q, m)
        return g.build(y, names=["y"]), [qs, RNG.standard_normal((1, 1, k, 48)).astype(np.float32)], k
    raise KeyError(case)


MATMUL_CASES = ["linear", "one-row", "one-column", "batched-transposed", "batched-broadcast"]


def _no_reference_kernel(model, inputs, reduction_length, precision="f32", fused=False):
    if fused:  # the default pipeline: epilogues fused into the primitives as post-ops
        compiled = tilegraph.compile(model, target="c")._runner
    else:
        compiled = compile_model(model) if precision == "f32" else load(emit(model), model.weights, model,
                                                                         precision=precision)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the warning of a reference kernel fails the test too
        got = compiled(*inputs)
    assert compiled.reference_kernels == [], compiled.reference_kernels
    assert compiled.source.count("tg_prim_run") >= 1, "no oneDNN primitive: the case tests nothing"
    for a, e in zip(got, interpret(model, inputs)):
        assert_close(a, e, precision, reduction_length)
    return compiled


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("case", CONV_CASES)
def test_every_convolution_layout_gets_a_fast_onednn_kernel(case, batch):
    _no_reference_kernel(*_conv_model(case, batch))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("case", CONV_CASES)
def test_every_convolution_with_its_fused_epilogue_gets_a_fast_onednn_kernel(case, batch):
    """The same after fusion: an epilogue oneDNN takes as post-ops only where a fast kernel
    takes them too (a binary operand in another layout than the destination's sent the whole
    convolution to the reference kernel)."""
    compiled = _no_reference_kernel(*_conv_model(case, batch), fused=True)
    if case == "residual-nchw":  # the add left to a loop after the convolution, not dropped
        assert "dnnl_binary_add" not in compiled.source and "conv, add, relu" in compiled.source


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("case", MATMUL_CASES)
def test_every_matmul_layout_gets_a_fast_onednn_kernel(case, batch):
    _no_reference_kernel(*_matmul_model(case, batch))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("case", CONV_CASES + MATMUL_CASES)
def test_bf16_primitives_get_fast_kernels_and_constant_weights_are_bf16_once(case, batch):
    built = (_conv_model if case in CONV_CASES else _matmul_model)(case, batch)
    compiled = _no_reference_kernel(*built, precision="bf16")
    if compiled.precision != "bf16":
        pytest.skip("this processor has no bf16 dot products: the module runs f32 (test_c_bf16.py checks the warning)")
    lines = compiled.primitives
    assert lines, "no primitive was made"
    if case == "depthwise":  # it stays f32 at bf16 (runtime.c: oneDNN's bf16 depthwise kernel is slower)
        depthwise = [line for line in lines if "_dw:" in line.split(" source: ")[-1]]
        assert len(depthwise) == 1 and not depthwise[0].startswith("convolution (bf16"), lines
        lines = [line for line in lines if line not in depthwise]
    # A run-time weight (an input, or both operands activations) is the one kind not packed in bf16.
    runtime_weight = case in ("weight-input", "batched-transposed", "batched-broadcast")
    packed = [line for line in lines if line.startswith(("convolution (bf16 x bf16)", "matmul (bf16 x bf16)"))]
    amx = compiled._lib.tg_amx_supported()  # as oneDNN dispatches on this processor
    for line in lines:
        impl = line.split(" source: ")[-1]
        if line in packed or amx:
            assert "amx" in impl or "bf16" in impl, line  # on the processor's bf16 units
        else:
            # f32 operands with bf16 products (oneDNN's fpmath mode): its kernels take that on AMX
            # only; elsewhere an f32 kernel of the processor's vector width, never a reference one
            assert "avx512" in impl or "avx2" in impl, line
    if runtime_weight:
        assert len(packed) < len(lines), lines
    else:
        assert len(packed) == len(lines), lines
