"""Generation's ops (tg.cache_write, tg.cache_attention, tg.block_matmul, tg.block_gather,
tg.rms_norm, tg.rope) against the float64 interpreter on random shapes and positions, and
the interpreter against an independent spelling of the same maths; the cache is written in
place (the NumPy backend returns the caller's own array)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tilegraph
from tilegraph.ir import Graph
from tilegraph.ir.block_formats import FORMATS
from tilegraph.ir.interpreter import interpret
from tilegraph.ir.kernels import CachePositionError, attention
from tilegraph.ir.model import ModelError
from tilegraph.testing import assert_close

PROPERTY = settings(max_examples=25, deadline=None)


def decode_step(b, h, hkv, t, s, d, per_sequence, window=0):
    """One attention layer's cache update and attention, the cache donated to output 1."""
    g = Graph()
    kc = g.input("k_cache", (b, hkv, s, d))
    vc = g.input("v_cache", (b, hkv, s, d))
    q = g.input("q", (b, h, "T", d))
    k = g.input("k", (b, hkv, "T", d))
    v = g.input("v", (b, hkv, "T", d))
    pos = g.input("pos", (b,) if per_sequence else (), "i64")
    kc2 = g.op("cache_write", kc, k, pos)
    vc2 = g.op("cache_write", vc, v, pos)
    out = g.op("cache_attention", q, kc2, vc2, pos, scale=d ** -0.5, window=window)
    return g.build(out, kc2, vc2, names=["out", "k_cache_out", "v_cache_out"],
                   aliases={"k_cache": "k_cache_out", "v_cache": "v_cache_out"})


def reference_attention(q, k_cache, v_cache, k, v, pos, window=0):
    """The same step spelled with repeated K/V and tg.attention's boolean mask, per sequence."""
    b, h, t, d = q.shape
    group = h // k_cache.shape[1]
    out = np.empty((b, h, t, d))
    for i in range(b):
        p = int(np.broadcast_to(pos, (b,))[i])
        keys = np.concatenate([k_cache[i, :, :p], k[i]], axis=1).astype(np.float64)
        vals = np.concatenate([v_cache[i, :, :p], v[i]], axis=1).astype(np.float64)
        keys, vals = np.repeat(keys, group, axis=0), np.repeat(vals, group, axis=0)
        mask = np.arange(p + t)[None, :] <= (p + np.arange(t))[:, None]
        if window:  # the sliding window: a query at position q reads keys q - window + 1..q
            mask &= (p + np.arange(t))[:, None] - np.arange(p + t)[None, :] < window
        out[i] = attention(q[i].astype(np.float64), keys, vals, mask, d ** -0.5, False)
    return out


@PROPERTY
@given(b=st.integers(1, 3), hkv=st.integers(1, 3), group=st.integers(1, 3), t=st.integers(1, 5),
       extra=st.integers(0, 6), d=st.sampled_from([2, 4, 8]), per_sequence=st.booleans(),
       window=st.sampled_from([0, 1, 2, 3, 5]), seed=st.integers(0, 2**31))
def test_cache_step_matches_attention_over_the_concatenated_cache(b, hkv, group, t, extra, d, per_sequence, window,
                                                                  seed):
    rng = np.random.default_rng(seed)
    s = t + extra
    pos = rng.integers(0, s - t + 1, b if per_sequence else ()).astype(np.int64)
    model = decode_step(b, hkv * group, hkv, t, s, d, per_sequence, window)
    k_cache, v_cache = (rng.standard_normal((b, hkv, s, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((b, hkv * group, t, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, hkv, t, d)).astype(np.float32) for _ in range(2))
    inputs = [k_cache, v_cache, q, k, v, pos]
    want = interpret(model, [a.copy() for a in inputs])
    np.testing.assert_allclose(want[0], reference_attention(q, k_cache, v_cache, k, v, pos, window),
                               rtol=1e-12, atol=1e-12)
    got = tilegraph.compile(model, target="numpy").run(*inputs)
    assert got[1] is k_cache and got[2] is v_cache, "the donated caches are written in place"
    for p, i in zip(np.broadcast_to(pos, (b,)), range(b)):
        np.testing.assert_array_equal(k_cache[i, :, p:p + t], k[i])
        np.testing.assert_array_equal(v_cache[i, :, p:p + t], v[i])
    assert_close(got[0], want[0], "f32", s, name="attention")
    assert_close(got[1], want[1], "f32", name="k_cache")


def test_a_position_past_the_cache_is_refused():
    model = decode_step(1, 2, 1, 2, 4, 4, False)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(sh).astype(np.float32) for sh in
              [(1, 1, 4, 4), (1, 1, 4, 4), (1, 2, 2, 4), (1, 1, 2, 4), (1, 1, 2, 4)]]
    f = tilegraph.compile(model, target="numpy")
    for pos in (3, -1):
        with pytest.raises(ModelError, match="CachePositionError: cache positions .* outside the cache"):
            f.run(*inputs, np.int64(pos))
        with pytest.raises(CachePositionError):
            interpret(model, inputs + [np.int64(pos)])


@PROPERTY
@given(fmt=st.sampled_from(sorted(FORMATS)), rows=st.integers(1, 9), m=st.integers(1, 4),
       blocks=st.integers(1, 2), seed=st.integers(0, 2**31))
def test_block_matmul_is_x_times_the_dequantized_weight(fmt, rows, m, blocks, seed):
    rng = np.random.default_rng(seed)
    k = blocks * max(FORMATS[fmt].block, 32)
    raw = FORMATS[fmt].quantize(rng.standard_normal((rows, k)).astype(np.float32))
    g = Graph()
    x = g.input("x", ("M", k))
    ids = g.input("ids", (2,), "i64")
    w = g.weight("w", raw)
    model = g.build(g.op("block_matmul", x, w, format=fmt, k=k), g.op("block_gather", w, ids, format=fmt, k=k))
    xs = rng.standard_normal((m, k)).astype(np.float32)
    idx = rng.integers(0, rows, 2).astype(np.int64)
    want = interpret(model, [xs, idx])
    dense = FORMATS[fmt].dequantize(raw, (rows, k)).astype(np.float64)
    np.testing.assert_allclose(want[0], xs.astype(np.float64) @ dense.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(want[1], dense[idx])
    got = tilegraph.compile(model, target="numpy").run(xs, idx)
    assert_close(got[0], want[0], "f32", k)
    assert_close(got[1], want[1], "f32")


@PROPERTY
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), half=st.integers(1, 8), seed=st.integers(0, 2**31))
def test_rms_norm_and_rope(shape, half, seed):
    rng = np.random.default_rng(seed)
    d = 2 * half
    x = rng.standard_normal((*shape, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    angle = rng.uniform(-5, 5, (*shape, half))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    g = Graph()
    xs, ws, cs, ss = (g.input(n, a.shape) for n, a in zip("xwcs", (x, w, cos, sin)))
    model = g.build(g.op("rms_norm", xs, ws, epsilon=1e-5), g.op("rope", xs, cs, ss))
    want = interpret(model, [x, w, cos, sin])
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(want[0], x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w, rtol=1e-12)
    # rope as a complex rotation of the pairs (i, i + D/2) by the angle
    z = (x64[..., :half] + 1j * x64[..., half:]) * np.exp(1j * angle.astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(want[1], np.concatenate([z.real, z.imag], -1), rtol=1e-6, atol=1e-6)
    got = tilegraph.compile(model, target="numpy").run(x, w, cos, sin)
    assert_close(got[0], want[0], "f32", d)
    assert_close(got[1], want[1], "f32", 2)
