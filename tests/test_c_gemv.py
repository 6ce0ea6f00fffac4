"""One-row matmuls by a constant weight on gemv.c (batch-1 fully connected layers: image heads).

What holds: x[1, K] @ W[K, N] with its epilogue (a bias, hardswish, relu, sigmoid, tanh, a
scalar scale) agrees with the float64 interpreter within f32's tolerance for its reduction
length where gemv.c runs it (forced with tg_set_gemv(1), the run counter moving and the
primitive reported as gemv.c, no oneDNN reference kernel): widths that fill whole panels,
leave a part of one or are under one vector, odd K, a weight read through a transpose (torch's
Linear), a source row whose values lie 3 floats apart. The rule (ir/hardware.gemv_wins) sends
MobileNetV3-Large's head and squeeze-excitation's 1x1 convolutions of a 1x1 map there by itself;
a source of more rows, a batch known at run time run at 3, and tg_set_gemv(0) stay on oneDNN.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy

import tilegraph
from tilegraph.ir import Graph, interpret
from tilegraph.ir.hardware import gemv_wins
from tilegraph.testing import assert_close, run_on_c_path

GEMV = "gemv.c"


def _model(k, n, post="hardswish", rows=1, transposed=False, seed=0):
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", (rows, k))
    w = (rng.standard_normal((n, k) if transposed else (k, n)) / np.sqrt(k)).astype(np.float32)
    wt = g.weight("w", w)
    y = x @ (g.transpose(wt, (1, 0)) if transposed else wt)
    if post != "none":
        y = y + g.weight("b", rng.standard_normal(n).astype(np.float32))
    if post == "hardswish":
        y = y * g.op("max", g.op("min", y * (1 / 6) + 0.5, g.lift(1.0, y)), g.lift(0.0, y))
    elif post in ("relu", "sigmoid", "tanh"):
        y = g.op(post, y)
    elif post == "scale":
        y = y * 0.25
    return g.build(y, names=["y"]), [rng.standard_normal((rows, k)).astype(np.float32)]


def _run(model, inputs, k, mode=-1):
    """Compiled for C (tg_set_gemv(mode) while its binding is made), checked against the float64
    interpreter; (its primitives' lines, gemv.c runs)."""
    compiled = tilegraph.compile(model, target="c")
    runner = compiled._runner
    outs, runs = run_on_c_path(compiled, inputs, "gemv", mode)
    assert_close(outs[0], interpret(model, inputs)[0], "f32", reduction_length=k)
    assert not any(" source: ref" in line for line in runner.primitives), runner.primitives
    return runner.primitives, runs


@pytest.mark.parametrize("post", ["hardswish", "none", "relu", "sigmoid", "tanh", "scale"])
# (above the emitter's SMALL_GEMM, which runs as loops: two whole panels, two and a part of a
# vector, under one vector, one column)
@pytest.mark.parametrize("k, n", [(160, 128), (77, 300), (2100, 9), (17000, 1)])
def test_gemv_matches_the_interpreter_and_is_taken(k, n, post):
    model, inputs = _model(k, n, post)
    lines, runs = _run(model, inputs, k, mode=1)
    assert runs == 1 and sum(GEMV in line for line in lines) == 1, lines


def test_weight_read_through_a_transpose():
    """torch's Linear: W stored [N, K], read as its transpose (strided panels to pack)."""
    model, inputs = _model(300, 170, "relu", transposed=True)
    lines, runs = _run(model, inputs, 300, mode=1)
    assert runs == 1 and any(GEMV in line for line in lines), lines


def test_rule_takes_mobilenet_v3_head():
    """960 -> 1280 (a 4.9 MB weight, read once a call): the emitter's rule picks gemv.c unforced
    (a batch known at run time: judged at 1)."""
    assert gemv_wins(1) and gemv_wins(sympy.Symbol("N")) and not gemv_wins(2)
    model, inputs = _model(960, 1280)
    lines, runs = _run(model, inputs, 960)
    assert runs == 1 and any(GEMV in line for line in lines), lines


def test_more_rows_or_turned_off_stay_on_onednn():
    model, inputs = _model(160, 128, rows=2)
    lines, runs = _run(model, inputs, 160, mode=1)
    assert runs == 0 and not any(GEMV in line for line in lines), lines
    model, inputs = _model(960, 1280)
    lines, runs = _run(model, inputs, 960, mode=0)
    assert runs == 0 and not any(GEMV in line for line in lines), lines


def test_batch_known_at_run_time():
    """One module for every batch: gemv.c at 1, oneDNN at 3 (tg_gemv_create decides on the dims)."""
    rng = np.random.default_rng(1)
    g = Graph()
    x = g.input("x", ("N", 960))
    y = g.relu(x @ g.weight("w", (rng.standard_normal((960, 1280)) / 31).astype(np.float32)))
    model = g.build(y, names=["y"])
    compiled = tilegraph.compile(model, target="c")
    lib = compiled._runner._lib
    for batch, taken in ((1, 1), (3, 0)):
        xs = [rng.standard_normal((batch, 960)).astype(np.float32)]
        before = lib.tg_gemv_count()
        out = compiled.run(*xs)[0]
        assert lib.tg_gemv_count() - before == taken
        assert_close(out, interpret(model, xs)[0], "f32", reduction_length=960)


def _squeeze_excitation(c, squeeze, batch=1, seed=0):
    """MobileNetV3's block: the image's mean, 1x1 convolutions (bias, relu; bias, hardsigmoid)
    on the 1x1 map, the image scaled by the result."""
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", (batch, c, 7, 7))
    def conv(v, cin, cout, name):
        w = (rng.standard_normal((cout, cin, 1, 1)) / np.sqrt(cin)).astype(np.float32)
        return g.op("conv", v, g.weight(f"w{name}", w), g.weight(f"b{name}", rng.standard_normal(cout).astype(np.float32)))

    s = g.relu(conv(g.op("reduce_mean", x, axes=(2, 3), keepdims=True), c, squeeze, 1))
    s = conv(s, squeeze, c, 2)
    s = g.op("max", g.op("min", s * (1 / 6) + 0.5, g.lift(1.0, s)), g.lift(0.0, s))
    return g.build(x * s, names=["y"]), [rng.standard_normal((batch, c, 7, 7)).astype(np.float32)]


@pytest.mark.parametrize("c, squeeze", [(960, 240), (72, 24), (100, 30)])
def test_squeeze_excitation_convolutions(c, squeeze):
    """Both 1x1 convolutions of the 1x1 map on gemv.c by the rule (the second reading the first's
    result chained), against the interpreter; at batch 2 both on oneDNN."""
    model, inputs = _squeeze_excitation(c, squeeze)
    lines, runs = _run(model, inputs, c)
    assert runs == 2 and sum(line.startswith("convolution of a 1x") and GEMV in line for line in lines) == 2, lines
    model, inputs = _squeeze_excitation(c, squeeze, batch=2)
    lines, runs = _run(model, inputs, c, mode=1)
    assert runs == 0, lines


def test_a_strided_source_row():
    """x read as a column of a wider input (each of its K values 3 floats apart, a transposed
    slice): gathered first, then the same panels."""
    rng = np.random.default_rng(2)
    g = Graph()
    x = g.input("x", (300, 3))
    row = g.transpose(g.slice(x, [0, 1], [300, 2]), (1, 0))
    y = g.relu(row @ g.weight("w", (rng.standard_normal((300, 170)) / 17).astype(np.float32)))
    model = g.build(y, names=["y"])
    lines, runs = _run(model, [rng.standard_normal((300, 3)).astype(np.float32)], 300, mode=1)
    assert runs == 1 and any(GEMV in line for line in lines), lines
