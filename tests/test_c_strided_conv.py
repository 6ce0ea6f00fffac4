"""Strided 1-D convolutions as matmuls over views of the source (backends/c/strided_conv.c).

What holds: a 1-D, dense, unpadded convolution of stride >= 2 and a constant weight, no bias,
runs as ceil(k/s) matmuls where the emitter's rule picks it (wav2vec 2.0's 512-channel k 3
stride 2) or tg_set_strided_conv(1) forces it (its primitive reported as such, the run counter
moving), and agrees with the float64 interpreter within f32's tolerance for its reduction length:
k 3 stride 2, k 2 stride 2 and k 10 stride 5, with and without a gelu epilogue, batches 1 and 2,
lengths whose last window ends on the source's last position and lengths that leave positions
over, a batch known at run time, and three in a chain. Padded, biased, dilated and stride-1 convolutions stay on oneDNN even
forced; narrow ones and a single matmul's (k 2 stride 2) where the rule refuses them, and every one
tg_set_strided_conv(0) turns off.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy

import tilegraph
from tilegraph.ir import Graph, interpret
from tilegraph.ir.hardware import strided_conv_shape, strided_conv_wins
from tilegraph.testing import assert_close, run_on_c_path

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
    outs, runs = run_on_c_path(compiled, inputs, "strided_conv", mode)
    assert_close(outs[0], interpret(model, inputs)[0], "f32", reduction_length=reduction_length)
    return compiled._runner.primitives, runs


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
    lines, runs = _run(model, inputs, window * 64, mode=1)
    blocks = -(-window // stride)
    assert runs == 1, lines
    assert sum(f"{STRIDED}{window}, stride {stride}) as {blocks} matmuls" in line for line in lines) == 1, lines
    assert not any(" source: ref" in line for line in lines), lines


def test_wav2vec2_feature_encoder_shape():
    """512 -> 512 channels, k 3 stride 2, gelu: the convolution the path is for, the rule's choice."""
    model, inputs = _model(1, 512, 512, 1001, 3, 2)
    lines, runs = _run(model, inputs, 3 * 512)
    assert runs == 1 and any(STRIDED in line for line in lines), lines


def test_a_batch_known_at_run_time():
    """A symbolic batch: the rule judges it at 1; each binding (batch 1, then 3: a batched matmul
    over views of each sample) runs as matmuls and agrees."""
    rng = np.random.default_rng(2)
    g = Graph()
    w = (rng.standard_normal((512, 512, 3)) / np.sqrt(3 * 512)).astype(np.float32)
    y = g.op("gelu", g.op("conv", g.input("x", ("N", 512, 601)), g.weight("w", w), strides=(2,)), approximate="none")
    model = g.build(y, names=["y"])
    compiled = tilegraph.compile(model, target="c")
    for n in (1, 3):
        xs = [rng.standard_normal((n, 512, 601)).astype(np.float32)]
        before = compiled._runner._lib.tg_strided_conv_count()
        assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], "f32", reduction_length=3 * 512)
        assert compiled._runner._lib.tg_strided_conv_count() - before == 1
        assert STRIDED in compiled._runner.primitives[-1] and f"{n}x512x601" in compiled._runner.primitives[-1]


def test_a_chain_of_them_as_in_wav2vec2():
    """Three in a row (k 3 stride 2 twice, then k 2 stride 2), each with gelu, forced: each reads
    the one before as it left its result, all three on strided_conv.c."""
    rng = np.random.default_rng(1)
    g = Graph()
    y = g.input("x", (2, 64, 2051))
    for i, window in enumerate((3, 3, 2)):
        w = (rng.standard_normal((64, 64, window)) / np.sqrt(window * 64)).astype(np.float32)
        y = g.op("gelu", g.op("conv", y, g.weight(f"w{i}", w), strides=(2,)), approximate="none")
    model = g.build(y, names=["y"])
    lines, runs = _run(model, [rng.standard_normal((2, 64, 2051)).astype(np.float32)], (3 + 3 + 2) * 64, mode=1)
    assert runs == 3 and sum(STRIDED in line for line in lines) == 3, lines


@pytest.mark.parametrize("kind", ["pad 1", "bias", "dilation 2", "stride 1", "narrow", "one matmul", "forced off"])
def test_other_convolutions_stay_on_onednn(kind):
    opts = {"pad 1": {"pad": 1}, "bias": {"bias": True}, "dilation 2": {"dilation": 2}, "stride 1": {"stride": 1},
            "narrow": {}, "one matmul": {"window": 2}, "forced off": {}}[kind]
    # (the rule's cases at 512 channels, where it takes k 3 stride 2; the shape's forced on)
    c = 64 if kind in ("pad 1", "bias", "dilation 2", "stride 1") else 512 if kind != "narrow" else 256
    window = opts.pop("window", 3)
    model, inputs = _model(1, c, c, 600, window, opts.pop("stride", 2), **opts)
    mode = {"narrow": -1, "one matmul": -1, "forced off": 0}.get(kind, 1)
    lines, runs = _run(model, inputs, window * c, mode=mode)
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
    assert strided_conv_wins(1, 512, 512, 47999, 3, 2) and strided_conv_wins(sympy.Symbol("N"), 512, 512, 1499, 3, 2)
    assert not strided_conv_wins(1, 1, 512, 95999, 10, 5)  # (wav2vec 2.0's first convolution: one channel)
    assert not strided_conv_wins(1, 512, 512, 2999, 2, 2)  # (one matmul: the convolution's own GEMM)
    assert not strided_conv_wins(1, 256, 256, 4000, 3, 2)
    assert not strided_conv_wins(1, 512, 512, 16, 3, 2)


def test_the_cost_model_prices_the_matmuls_the_emitter_makes():
    """Where the rule sends a convolution to strided_conv.c, the C cost model prices its matmuls
    on the GEMM curve (one per block of `stride` taps), not oneDNN's convolution; padded, it
    prices the convolution."""
    from dataclasses import replace

    from tilegraph.ir.hardware import hardware
    from tilegraph.passes.cost.model import at_nominal, op_cost

    hw = replace(hardware("c"), conv_rates={"dense": (3136, 64, 576, 1e9)})  # (a slow convolution: the two differ)

    def conv_time(pad):
        g = Graph()
        y = g.op("conv", g.input("x", (1, 512, 4001)), g.weight("w", np.zeros((512, 512, 3), np.float32)),
                 pads=(pad, pad), strides=(2,))
        op = next(op for op in g.build(y, names=["y"]).func.body.block.ops if getattr(op, "op_name", None) == "conv")
        return float(at_nominal(op_cost(op, hw).compute_time)), y.shape[2]

    t, out = conv_time(0)
    gemms = 2 * out * 512 * 1024 / hw.matmul_rate(out, 512, 1024, threaded=True) + \
        2 * out * 512 * 512 / hw.matmul_rate(out, 512, 512, threaded=True)
    assert t == pytest.approx(gemms)
    t, out = conv_time(1)
    assert t > 2 * gemms
