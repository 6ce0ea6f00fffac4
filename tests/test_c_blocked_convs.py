"""Convolution chains in oneDNN's blocked layout (nChw16c, nChw8c) on the C backend.

Where ir/hardware.blocked_conv finds the blocked kernels faster (depthwise and narrow 1x1
convolutions at batch 8 on a 16-lane processor) and the convolutions are chained, the chain
runs blocked: its inner buffers stay blocked between the primitives, reordered only at the
chain's ends (its source in, its result out, a residual it adds into in and out); the block
is one for the chain, 16 where its kept buffers' channels divide by 16, else 8. A convolution
the rule admits but that nothing chains to stays channels-last, as does every one at batch 1.
Every result agrees with the float64 interpreter at f32's tolerance, and no primitive runs on
oneDNN's reference kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph
from tilegraph.backends.c.runtime import CompiledModel
from tilegraph.ir import Graph, interpret
from tilegraph.ir.hardware import BLOCKED_SHARE, hardware, vector_lanes
from tilegraph.passes.cost.model import at
from tilegraph.passes.targets.c import conv_time
from tilegraph.testing import assert_close

pytestmark = pytest.mark.skipif(vector_lanes() != 16, reason="the blocked rule holds on 16-lane (AVX-512) processors")


def _inverted_residual(batch: int, narrow: int, wide: int, size: int = 14):
    """MobileNetV2's block at a small size: a = relu(1x1 conv of x), then a 1x1 expansion to
    `wide` + relu, a 3x3 depthwise + relu, a 1x1 projection back to `narrow`, plus a."""
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (batch, narrow, size, size))

    def conv(v, name, o, i, k=1, **attrs):
        return g.op("conv", v, g.weight(name, (rng.standard_normal((o, i, k, k)) / np.sqrt(i * k * k)).astype(np.float32)),
                    **attrs)
    a = g.relu(conv(x, "w0", narrow, narrow))
    b = g.relu(conv(a, "w1", wide, narrow))
    c = g.relu(conv(b, "w2", wide, 1, 3, pads=(1, 1, 1, 1), groups=wide))
    y = conv(c, "w3", narrow, wide) + a
    return g.build(y, names=["y"]), [rng.standard_normal((batch, narrow, size, size)).astype(np.float32)]


def _compiled(batch: int, narrow: int, wide: int) -> tuple[CompiledModel, list[str], int]:
    """The runner (checked against the interpreter), its primitives' lines, and the reorders
    one warm call runs."""
    model, xs = _inverted_residual(batch, narrow, wide)
    compiled = tilegraph.compile(model, target="c")
    runner: CompiledModel = compiled._runner
    assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], "f32", reduction_length=narrow + wide + 9 + 1)
    before = runner.reorder_count()
    runner(*xs)
    assert not runner.reference_kernels, runner.primitives
    return runner, runner.primitives, runner.reorder_count() - before


@pytest.mark.parametrize("narrow, wide, block", [(16, 96, 16), (24, 72, 8)])
def test_a_chain_runs_blocked_and_reorders_only_at_its_ends(narrow, wide, block):
    runner, lines, reorders = _compiled(8, narrow, wide)
    assert len(lines) == 4, lines
    # the first convolution: chained to nothing (its result is the residual), channels-last
    assert "nChw" not in lines[0], lines
    # expansion and depthwise keep their results blocked; the projection adds into the residual
    assert [f"(nChw{block}c, kept)" in line for line in lines[1:]] == [True, True, False], lines
    assert f"(nChw{block}c)" in lines[3], lines
    # its source into the blocked layout; the residual in, the result out
    assert reorders == 3, (reorders, lines)
    assert runner.chained_buffers == 2


def test_at_batch_1_nothing_runs_blocked():
    _, lines, reorders = _compiled(1, 16, 96)
    assert not any("nChw" in line for line in lines), lines
    assert reorders == 0, (reorders, lines)


def test_a_convolution_nothing_chains_to_stays_channels_last():
    """A depthwise convolution the rule admits, between the model's input and its output."""
    rng = np.random.default_rng(2)
    g = Graph()
    x = g.input("x", (8, 32, 16, 16))
    w = g.weight("w", rng.standard_normal((32, 1, 3, 3)).astype(np.float32) / 3)
    model = g.build(g.relu(g.op("conv", x, w, pads=(1, 1, 1, 1), groups=32)), names=["y"])
    xs = [rng.standard_normal((8, 32, 16, 16)).astype(np.float32)]
    compiled = tilegraph.compile(model, target="c")
    assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], "f32", reduction_length=9)
    lines = compiled._runner.primitives
    assert len(lines) == 1 and "nChw" not in lines[0], lines


@pytest.mark.parametrize("batch, share", [(8, BLOCKED_SHARE), (1, 1.0)])
def test_the_cost_model_prices_by_the_emitters_rule(monkeypatch, batch, share):
    """A depthwise convolution the rule runs blocked costs BLOCKED_SHARE of its channels-last
    time (TG_BLOCKED=0 turns the rule off); at batch 1, where the rule says no, the same.
    (passes.targets.c.conv_time itself: op_cost memoizes by the op, not the environment.)"""
    def cost() -> float:
        g = Graph()
        w = g.weight("w", np.zeros((96, 1, 3, 3), np.float32))
        model = g.build(g.op("conv", g.input("x", (batch, 96, 56, 56)), w, pads=(1,) * 4, groups=96), names=["y"])
        op = next(op for op in model.func.body.block.ops if getattr(op, "op_name", None) == "conv")
        return at(conv_time(op, hardware("c"), 2.0 * batch * 96 * 56 * 56 * 9))

    blocked = cost()
    monkeypatch.setenv("TG_BLOCKED", "0")
    assert blocked == pytest.approx(share * cost())
