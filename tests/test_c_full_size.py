"""The C backend's fixes for the cliffs of the full-size sweep (benchmarks/full_size_sweep.py)
keep its results: each fast path is taken where it applies and agrees with the float64
interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest

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
