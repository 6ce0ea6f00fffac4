"""Strided 1-D convolutions as matmuls over views of the source (backends/c/strided_conv.c).

What holds: a 1-D, dense, unpadded convolution of stride >= 2 and a constant weight, no bias,
that the emitter's rule picks runs as ceil(k/s) matmuls (its primitive reported as such, the run
counter moving) and agrees with the float64 interpreter within f32's tolerance for its reduction
length: wav2vec 2.0's shapes (k 3 stride 2, k 2 stride 2) and k 10 stride 5, with and without a
gelu epilogue, batches 1 and 2, lengths whose last window ends on the source's last position and
lengths that leave positions over. Padded, biased, dilated, stride-1, narrow convolutions, and
any forced off by tg_set_strided_conv, stay on oneDNN.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy

import tilegraph
from tilegraph.ir import Graph, interpret
from tilegraph.ir.hardware import strided_conv_shape, strided_conv_wins
from tilegraph.testing import assert_close

STRIDED = "strided (k "


def _model(batch, c, k, length, window, stride, gelu=True, pad=0, bias=False, dilation=1, seed=0):
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", (batch, c, length))
    wt = (rng.standard_normal((k, c, window)) / np.sqrt(window * c)).astype(np.float32)
    b = g.weight("b", rng.standard_normal(k).astype(np.float32)) if bias else None
    y = g.op("conv", x, g.weight("w", wt), *([b] if b is not None else []), pads=(pad, pad), strides=(stride,),
             dilations=(dilation,))
    if gelu:
        y = g.op("gelu", y, approximate="none")
    return g.build(y, names=["y"]), [rng.standard_normal((batch, c, length)).astype(np.float32)]


def _run(model, inputs, reduction_length, mode=-1):
    """Compiled for C (tg_set_strided_conv(mode) while its bindings are made), checked against
    the float64 interpreter; (its report lines, strided runs)."""
    compiled = tilegraph.compile(model, target="c")
    runner = compiled._runner
    runner._lib.tg_set_strided_conv(mode)
    try:
        before = runner._lib.tg_strided_conv_count()
        out = compiled.run(*inputs)[0]
        runs = runner._lib.tg_strided_conv_count() - before
    finally:
        runner._lib.tg_set_strided_conv(-1)
    assert_close(out, interpret(model, inputs)[0], "f32", reduction_length=reduction_length)
    return runner.primitives, runs


@pytest.mark.parametrize("gelu", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("window, stride, length", [
    (3, 2, 515),  # (3 + 2 * 256 = 515: the last window ends on the last position)
    (3, 2, 516),  # (one position over)
    (2, 2, 600),
    (2, 2, 601),
    (10, 5, 1285),  # (10 + 5 * 255: ends exactly)
    (10, 5, 1288),
])
def test_strided_conv_matches_the_interpreter_and_is_taken(window, stride, length, batch, gelu):
    model, inputs = _model(batch, 64, 72, length, window, stride, gelu=gelu)
    lines, runs = _run(model, inputs, window * 64)
    blocks = -(-window // stride)
    assert runs == 1, lines
    assert sum(f"{STRIDED}{window}, stride {stride}) as {blocks} matmuls" in line for line in lines) == 1, lines
    assert not any(" source: ref" in line for line in lines), lines


def test_wav2vec2_feature_encoder_shape():
    """512 -> 512 channels, k 3 stride 2, gelu: the convolution the path is for."""
    model, inputs = _model(1, 512, 512, 1001, 3, 2)
    lines, runs = _run(model, inputs, 3 * 512)
    assert runs == 1 and any(STRIDED in line for line in lines), lines


@pytest.mark.parametrize("kind", ["pad 1", "bias", "dilation 2", "stride 1", "narrow", "forced off"])
def test_other_convolutions_stay_on_onednn(kind):
    opts = {"pad 1": {"pad": 1}, "bias": {"bias": True}, "dilation 2": {"dilation": 2}, "stride 1": {"stride": 1},
            "narrow": {}, "forced off": {}}[kind]
    c = 8 if kind == "narrow" else 64  # (8 channels: the rule refuses, a GEMM of so short a k gains nothing)
    model, inputs = _model(2, c, c, 400, 3, opts.pop("stride", 2), **opts)
    lines, runs = _run(model, inputs, 3 * c, mode=0 if kind == "forced off" else -1)
    assert runs == 0 and not any(STRIDED in line for line in lines), lines
    assert any(line.startswith("convolution") for line in lines), lines


def test_the_rule():
    assert strided_conv_shape(1, [3], [2], [1], [0, 0], 512, 512)
    assert strided_conv_shape(1, [2], [2], [1], [0, 0], 512, 512)
    assert not strided_conv_shape(1, [3], [2], [1], [1, 1], 384, 384)  # (Whisper's: padded)
    assert not strided_conv_shape(1, [3], [1], [1], [0, 0], 512, 512)
    assert not strided_conv_shape(2, [3], [2], [1], [0, 0], 512, 512)
    assert not strided_conv_shape(1, [3, 3], [2, 2], [1, 1], [0] * 4, 512, 512)
    assert not strided_conv_shape(1, [9], [2], [1], [0, 0], 512, 512)  # (5 matmuls: more than the rule allows)
    assert strided_conv_wins(1, 512, 512, 47999) and strided_conv_wins(sympy.Symbol("N"), 512, 512, 1499)
    assert not strided_conv_wins(1, 1, 512, 95999)  # (wav2vec 2.0's first convolution: one channel)
    assert not strided_conv_wins(1, 512, 512, 16)
