"""Convolutions chained on oneDNN: a buffer that only convolutions read (as their source)
stays as its producer's kernel writes it, and the next convolution takes it so.

What holds: at bf16 the chained activations stay bf16 between the primitives, so a forward
through three chained convolutions converts only the model's input to bf16 (one reorder
per call; three without chaining) and reports bf16 results, except into a depthwise
convolution, which computes in f32; at f32 no reorder runs; a
buffer that anything else reads (an elementwise loop, an output) is not chained; every
result agrees with the float64 interpreter within the precision's tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph
from tilegraph.backends.c.runtime import CompiledModel
from tilegraph.ir import Graph, interpret
from tilegraph.testing import assert_close


def _chain(middle: str = "dense", side_reader: bool = False, batch: int = 2):
    """x (batch N) -> conv+relu -> conv+relu (3x3, dense or depthwise) -> 1x1 conv; with `side_reader`
    the first convolution's result is also added to the last one's (read by a loop)."""
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (batch, 16, 10, 10))
    a = g.relu(g.op("conv", x, g.weight("w1", rng.standard_normal((32, 16, 3, 3)).astype(np.float32) / 12),
                    pads=(1, 1, 1, 1)))
    groups = 32 if middle == "depthwise" else 1
    w2 = rng.standard_normal((32, 32 // groups, 3, 3)).astype(np.float32) / (3 if groups > 1 else 17)
    b = g.relu(g.op("conv", a, g.weight("w2", w2), pads=(1, 1, 1, 1), groups=groups))
    y = g.op("conv", b, g.weight("w3", rng.standard_normal((32, 32, 1, 1)).astype(np.float32) / 6))
    if side_reader:
        y = g.tanh(y) + a
    return g.build(y, names=["y"]), [rng.standard_normal((batch, 16, 10, 10)).astype(np.float32)]


def _run_checked(model, xs, precision: str, reduction_length: int) -> CompiledModel:
    """Compile for C at `precision` (skipped where the processor lacks it), check the result
    against the float64 interpreter, and return the runner to inspect."""
    compiled = tilegraph.compile(model, target="c", precision=precision)
    runner: CompiledModel = compiled._runner
    if precision == "bf16" and runner.precision != "bf16":
        pytest.skip("this processor has no bf16 dot products")
    assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], precision, reduction_length=reduction_length)
    return runner


def _reorders_per_call(runner: CompiledModel, xs, chained: int, primitives: int) -> tuple[int, list[str]]:
    """The reorders one warm call runs, and the primitives' lines, after checking that
    `chained` buffers were marked and `primitives` primitives made, none oneDNN's reference."""
    assert runner.chained_buffers == chained
    runner(*xs)  # binds: primitives made, weights packed
    before = runner.reorder_count()
    runner(*xs)
    assert not runner.reference_kernels, runner.primitives
    assert len(runner.primitives) == primitives, runner.primitives
    return runner.reorder_count() - before, runner.primitives


@pytest.mark.parametrize("batch", [1, 2])  # (at 1 the batch dim's stride is free: the views disagree there)
@pytest.mark.parametrize("middle", ["dense", "depthwise"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_chained_convolutions_pass_their_activations_on_as_they_lie(precision, middle, batch):
    model, xs = _chain(middle, batch=batch)
    runner = _run_checked(model, xs, precision, 16 * 9 + 32 * 9 + 32)
    reorders, lines = _reorders_per_call(runner, xs, chained=2, primitives=3)
    if precision == "f32":
        assert reorders == 0, (reorders, lines)
    elif middle == "dense":
        # Only the model's input is converted to bf16; the two chained results are written
        # in bf16 and read as they are (unchained: a conversion before each convolution).
        assert reorders == 1, (reorders, lines)
        assert [("(a bf16 result)" in line) for line in lines] == [True, True, False], lines
        assert all(line.startswith("convolution (bf16 x bf16)") for line in lines), lines
    else:
        # The depthwise convolution computes in f32 (oneDNN's bf16 one is slower): the first
        # result is left f32 for it, and the last convolution converts its source to bf16.
        assert reorders == 2, (reorders, lines)
        assert [line.startswith("convolution (bf16 x bf16)") for line in lines] == [True, False, True], lines
        assert not any("(a bf16 result)" in line for line in lines), lines


def test_a_buffer_a_loop_also_reads_is_not_chained():
    model, xs = _chain(side_reader=True)
    compiled = tilegraph.compile(model, target="c", precision="bf16")
    runner: CompiledModel = compiled._runner
    got = compiled.run(*xs)[0]
    assert runner.chained_buffers == 1  # (the middle result only: the first is read by the add)
    tol = "bf16" if runner.precision == "bf16" else "f32"
    assert_close(got, interpret(model, xs)[0], tol, reduction_length=16 * 9 + 32 * 9 + 32)


def _residual_block(read_after: bool):
    """ResNet's bottleneck at a small size: x -> 1x1 conv+relu (a) -> 3x3 conv+relu -> 1x1
    conv, plus a, then relu; with `read_after` the block's input `a` is read again after."""
    rng = np.random.default_rng(1)
    g = Graph()
    x = g.input("x", (2, 16, 9, 9))
    a = g.relu(g.op("conv", x, g.weight("w0", rng.standard_normal((32, 16, 1, 1)).astype(np.float32) / 4)))
    b = g.relu(g.op("conv", a, g.weight("w1", rng.standard_normal((16, 32, 3, 3)).astype(np.float32) / 17),
                    pads=(1, 1, 1, 1)))
    y = g.relu(g.op("conv", b, g.weight("w2", rng.standard_normal((32, 16, 1, 1)).astype(np.float32) / 4)) + a)
    if read_after:
        y = g.tanh(y) * a
    return g.build(y, names=["y"]), [rng.standard_normal((2, 16, 9, 9)).astype(np.float32)]


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("read_after", [False, True])
def test_a_residual_add_accumulates_into_the_shortcut_buffer(precision, read_after):
    """The residual add after a block's last convolution runs as oneDNN's sum post-op into
    the shortcut's buffer (no second buffer written, the residual read once), only where
    nothing reads the shortcut afterwards; the result is unchanged either way."""
    model, xs = _residual_block(read_after)
    runner = _run_checked(model, xs, precision, 16 + 32 * 9 + 16 + 1)
    sums = sum("{TG_POST_SUM," in line for line in runner.source.splitlines())
    assert sums == (0 if read_after else 1), runner.source
    assert not runner.reference_kernels, runner.primitives


def _residual_stack(blocks: int = 2):
    """A stem convolution, `blocks` ResNet bottlenecks (each adds into the stem's buffer, a
    sum post-op), and a 1x1 convolution out, at batch 1: the residual buffer is written by
    several convolutions and read only by convolutions."""
    rng = np.random.default_rng(2)
    g = Graph()
    x = g.input("x", (1, 16, 9, 9))
    s = g.relu(g.op("conv", x, g.weight("w0", rng.standard_normal((32, 16, 3, 3)).astype(np.float32) / 12),
                    pads=(1, 1, 1, 1)))
    for i in range(blocks):
        a = g.relu(g.op("conv", s, g.weight(f"a{i}", rng.standard_normal((16, 32, 1, 1)).astype(np.float32) / 6)))
        b = g.relu(g.op("conv", a, g.weight(f"b{i}", rng.standard_normal((16, 16, 3, 3)).astype(np.float32) / 12),
                        pads=(1, 1, 1, 1)))
        s = g.relu(g.op("conv", b, g.weight(f"c{i}", rng.standard_normal((32, 16, 1, 1)).astype(np.float32) / 8)) + s)
    y = g.op("conv", s, g.weight("wy", rng.standard_normal((8, 32, 1, 1)).astype(np.float32) / 6))
    return g.build(y, names=["y"]), [rng.standard_normal((1, 16, 9, 9)).astype(np.float32)]


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_a_residual_buffer_only_convolutions_touch_stays_bf16(precision):
    """ResNet's residual stream: the buffer that each block's last convolution adds into is
    written by several convolutions, so it is not chained, but at bf16 it holds bf16 for all
    of them: the model's input is the only activation converted to bf16 in a call (without:
    also before each block's first convolution and the last one), and every writer of the
    stream reports a bf16 result."""
    model, xs = _residual_stack()
    runner = _run_checked(model, xs, precision, 16 * 9 + 2 * (32 + 16 * 9 + 16) + 32)
    assert sum("{TG_POST_SUM," in line for line in runner.source.splitlines()) == 2, runner.source
    # (chained: the two buffers inside each block, and the stream)
    reorders, lines = _reorders_per_call(runner, xs, chained=5, primitives=8)
    if precision == "f32":
        assert reorders == 0, (reorders, lines)
    else:
        assert reorders == 1, (reorders, lines)
        assert all(line.startswith("convolution (bf16 x bf16)") for line in lines), lines
        # (stem, then per block: first, middle, last; the last convolution writes the f32 output)
        assert [("(a bf16 result)" in line) for line in lines] == [True] * 7 + [False], lines
