"""Winograd F(4x4, 3x3) convolutions on the C backend (backends/c/winograd.c).

What holds: a 3x3, stride-1, dense, ungrouped convolution the emitter's rule picks runs on
winograd.c (its primitive reported as such, the run counter moving), and agrees with the float64
interpreter within f32's tolerance for the convolution's reduction length, with pads 0 and 1,
sizes whose 4x4 tiles overhang the image, channel counts that are no multiple of the 16-channel
vector, batches 1 and 3, and every epilogue the convolution step fuses (bias, relu, relu6's two
clips, a residual read from an input, a residual accumulated into its buffer); a grouped one
(36 x groups GEMMs) likewise, with groups whose channels straddle the 16-channel vectors; a
strided or dilated 3x3 is left to oneDNN, as is a shape the rule refuses (narrow groups,
depthwise), and bf16 precision.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tilegraph
from tilegraph.ir.hardware import winograd_wins
from tilegraph.ir import Graph, interpret
from tilegraph.testing import assert_close

WINOGRAD = "winograd F(4x4,3x3)"


def _model(batch, c, k, h, w, pad=1, epilogue="relu", stride=1, dilation=1, groups=1, seed=0):
    """x -> conv3x3 (+bias) -> the epilogue; returns (model, inputs). The residual epilogues add
    a 1x1 convolution of a second input, made first (as ResNet's shortcut), so the 3x3's step
    takes the add: as a sum into the shortcut's buffer, or where the shortcut is an output too
    (its buffer kept), as a binary post-op reading it; "input residual" adds a plain NCHW input
    (a loop after the convolution)."""
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", (batch, c, h, w))
    inputs = [rng.standard_normal((batch, c, h, w)).astype(np.float32)]
    eff = dilation * 2 + 1
    oh, ow = ((h + 2 * pad - eff) // stride + 1, (w + 2 * pad - eff) // stride + 1)
    short = None
    if epilogue in ("sum residual", "binary residual"):
        r = g.input("r", (batch, c, oh, ow))
        inputs.append(rng.standard_normal((batch, c, oh, ow)).astype(np.float32))
        short = g.op("conv", r, g.weight("wr", (rng.standard_normal((k, c, 1, 1)) / np.sqrt(c)).astype(np.float32)))
    wt = (rng.standard_normal((k, c // groups, 3, 3)) / np.sqrt(9 * c / groups)).astype(np.float32)
    y = g.op("conv", x, g.weight("w", wt), g.weight("b", rng.standard_normal(k).astype(np.float32)),
             pads=(pad,) * 4, strides=(stride, stride), dilations=(dilation, dilation), groups=groups)
    if epilogue == "relu":
        y = g.relu(y)
    elif epilogue == "relu6":
        y = g.op("min", g.op("max", y, g.constant(0.0, "f32")), g.constant(6.0, "f32"))
    elif epilogue == "input residual":
        r = g.input("r", (batch, k, oh, ow))
        inputs.append(rng.standard_normal((batch, k, oh, ow)).astype(np.float32))
        y = g.relu(y + r)
    elif short is not None:
        y = g.relu(y + short)
    outs = [y, short] if epilogue == "binary residual" else [y]
    return g.build(*outs, names=["y", "short"][:len(outs)]), inputs


# The post-op each epilogue must hand the Winograd step (as its state line spells it).
POSTS = {"relu": "dnnl_eltwise_relu", "relu6": "dnnl_eltwise_clip", "input residual": "",
         "sum residual": "TG_POST_SUM", "binary residual": "{1, dnnl_binary_add"}


def _run(model, inputs, reduction_length, precision="f32", posts=""):
    """Compiled for C, checked against the float64 interpreter; (its report lines, Winograd runs).
    `posts`: text the Winograd convolution's state line must hold (its post-ops)."""
    compiled = tilegraph.compile(model, target="c", precision=precision)
    runner = compiled._runner
    before = runner._lib.tg_winograd_count()
    outs = compiled.run(*inputs)
    for out, ref in zip(outs, interpret(model, inputs)):
        assert_close(out, ref, precision, reduction_length=reduction_length)
    state = runner.source[runner.source.index("tg_state_init"):]
    wino = [block for block in state.split("    {\n") if "tg_wino_create" in block]
    assert not posts or (len(wino) == 1 and posts in wino[0]), wino
    return runner.primitives, runner._lib.tg_winograd_count() - before


@pytest.mark.parametrize("epilogue", list(POSTS))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("pad", [0, 1])
def test_winograd_matches_the_interpreter_and_is_taken(pad, batch, epilogue):
    # 9x11 and 40 -> 36 channels: tiles overhang the image on both sides, vectors of channels the end
    model, inputs = _model(batch, 40, 36, 9, 11, pad=pad, epilogue=epilogue)
    lines, runs = _run(model, inputs, 9 * 40 + 40, posts=POSTS[epilogue])
    assert sum(WINOGRAD in line for line in lines) == 1, lines
    assert runs == 1
    assert not any(" source: ref" in line for line in lines), lines


def test_tiles_in_chunks_with_a_shorter_last_one():
    """More tiles than a chunk holds (tables.py, WINOGRAD_CHUNK_BYTES): the chunks and the
    shorter last one (its own GEMM primitive) each write their own tiles, with the sum epilogue.
    The 320 tiles go in chunks of as even a size as fit (onednn.winograd_floats): 107, 107, 106."""
    model, inputs = _model(5, 64, 64, 30, 30, epilogue="sum residual")
    lines, runs = _run(model, inputs, 9 * 64 + 64, posts="TG_POST_SUM")
    chunk = [int(line.split(", ")[-1].split()[0]) for line in lines if WINOGRAD in line]
    assert runs == 1 and chunk == [107], lines


def test_a_batch_known_at_run_time():
    """A symbolic batch: the emitter reserves one chunk's scratch (a batch of 1 fills part of
    it, a batch of 5 more than one), each binding runs on winograd.c and agrees."""
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", ("N", 64, 30, 30))
    w = (rng.standard_normal((64, 64, 3, 3)) / 24).astype(np.float32)
    model = g.build(g.relu(g.op("conv", x, g.weight("w", w), pads=(1,) * 4)), names=["y"])
    compiled = tilegraph.compile(model, target="c")
    for n in (1, 5):
        xs = [rng.standard_normal((n, 64, 30, 30)).astype(np.float32)]
        before = compiled._runner._lib.tg_winograd_count()
        assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], "f32", reduction_length=9 * 64)
        assert compiled._runner._lib.tg_winograd_count() - before == 1
        assert WINOGRAD in compiled._runner.primitives[-1] and f"{n}x64x30x30" in compiled._runner.primitives[-1]


@pytest.mark.parametrize("kind", ["stride 2", "dilation 2", "groups 2", "depthwise", "narrow"])
def test_other_convolutions_stay_on_onednn(kind):
    # (groups 2: 32 channels a group over 9 tiles, too little work a GEMM for the rule)
    opts = {"stride 2": {"stride": 2}, "dilation 2": {"dilation": 2, "pad": 2}, "groups 2": {"groups": 2},
            "depthwise": {"groups": 64}, "narrow": {}}[kind]
    c = 16 if kind == "narrow" else 64  # (16 channels: the rule refuses, the transforms cost what they save)
    model, inputs = _model(2, c, c, 12, 12, **opts)
    lines, runs = _run(model, inputs, 9 * c)
    assert runs == 0 and not any(WINOGRAD in line for line in lines), lines
    assert any(line.startswith("convolution") for line in lines), lines


def test_bf16_precision_keeps_the_convolution_on_onednn():
    model, inputs = _model(1, 64, 64, 12, 12)
    compiled = tilegraph.compile(model, target="c", precision="bf16")
    if compiled._runner.precision != "bf16":
        pytest.skip("this processor has no bf16 dot products")
    lines, runs = _run(model, inputs, 9 * 64, precision="bf16")
    assert runs == 0 and not any(WINOGRAD in line for line in lines), lines


def test_the_rule_refuses_what_measured_slower():
    """(benchmarks/winograd_convs.py) A 7x7x512 convolution at batch 1 streams a 38 MB
    transformed weight for 4 tiles; at batch 8, or 128 channels (2.4 MB), it wins; 16 channels lose."""
    assert not winograd_wins(1, 512, 512, 7, 7)
    assert winograd_wins(8, 512, 512, 7, 7) and winograd_wins(1, 128, 128, 7, 7)
    assert winograd_wins(1, 64, 64, 56, 56) and not winograd_wins(1, 16, 16, 56, 56)


def test_the_rule_on_grouped_convolutions():
    """(benchmarks/winograd_convs.py) RegNetY-4GF's 64-channel groups win at 56x56, 28x28 and
    14x14 (16 tiles) but not at 7x7 (4 tiles); 32-channel groups over 16 tiles, and 16-channel
    groups, lose; depthwise never qualifies."""
    assert all(winograd_wins(1, c, c, hw, hw, c // 64) for c, hw in ((128, 56), (192, 28), (512, 14)))
    assert not winograd_wins(1, 1088, 1088, 7, 7, 17)
    assert winograd_wins(1, 256, 256, 28, 28, 8) and not winograd_wins(1, 512, 512, 14, 14, 16)
    assert not winograd_wins(1, 256, 256, 28, 28, 16) and not winograd_wins(1, 96, 96, 56, 56, 96)


@pytest.mark.parametrize("epilogue", ["relu", "relu6", "input residual"])
@pytest.mark.parametrize("groups", [2, 3])
def test_grouped_winograd_matches_the_interpreter_and_is_taken(groups, epilogue):
    # 40 channels a group (each group's columns start mid-vector), 22x22: 36 tiles x 40 passes the rule
    c = 40 * groups
    model, inputs = _model(1, c, c, 22, 22, epilogue=epilogue, groups=groups)
    lines, runs = _run(model, inputs, 9 * 40 + c, posts=POSTS[epilogue])
    assert runs == 1 and sum(f"{WINOGRAD}, 36 x {groups} GEMMs" in line for line in lines) == 1, lines
    assert not any(" source: ref" in line for line in lines), lines


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 2), groups=st.integers(1, 4), cg=st.integers(1, 24), kg=st.integers(1, 24),
       h=st.integers(3, 10), w=st.integers(3, 10), pad=st.integers(0, 2))
def test_forced_winograd_over_groups_and_widths(batch, groups, cg, kg, h, w, pad):
    """Every grouped shape winograd.c takes agrees with the interpreter, those the rule refuses
    too (tg_set_winograd(1) sends each there: depthwise, groups of a few channels, 1x1 images)."""
    model, inputs = _model(batch, cg * groups, kg * groups, h, w, pad=pad, groups=groups)
    compiled = tilegraph.compile(model, target="c")
    lib = compiled._runner._lib
    lib.tg_set_winograd(1)
    try:
        before = lib.tg_winograd_count()
        out = compiled.run(*inputs)[0]
        assert lib.tg_winograd_count() - before == 1, compiled._runner.primitives
    finally:
        lib.tg_set_winograd(-1)
    assert_close(out, interpret(model, inputs)[0], "f32", reduction_length=9 * cg)


@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 2), c=st.integers(32, 48), k=st.integers(32, 48), h=st.integers(3, 14),
       w=st.integers(3, 14), pad=st.integers(0, 1))
def test_winograd_over_shapes(batch, c, k, h, w, pad):
    if h + 2 * pad < 3 or w + 2 * pad < 3:
        return
    model, inputs = _model(batch, c, k, h, w, pad=pad)
    lines, runs = _run(model, inputs, 9 * c)
    assert runs == 1 and any(WINOGRAD in line for line in lines), lines
