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
from tilegraph.accuracy import tolerance

PROPERTY = settings(max_examples=25, deadline=None)


def decode_step(b, h, hkv, t, s, d, per_sequence, cache_dtype="f32", window=0):
    """One attention layer's cache update and attention, the cache donated to output 1."""
    g = Graph()
    kc = g.input("k_cache", (b, hkv, s, d), cache_dtype)
    vc = g.input("v_cache", (b, hkv, s, d), cache_dtype)
    q = g.input("q", (b, h, "T", d))
    k = g.input("k", (b, hkv, "T", d))
    v = g.input("v", (b, hkv, "T", d))
    pos = g.input("pos", (b,) if per_sequence else (), "i64")
    store = {} if cache_dtype == "f32" else {"store": cache_dtype}
    kc2 = g.op("cache_write", kc, k, pos, **store)
    vc2 = g.op("cache_write", vc, v, pos, **store)
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
    model = decode_step(b, hkv * group, hkv, t, s, d, per_sequence, window=window)
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


@PROPERTY
@given(b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.integers(1, 3), t=st.integers(1, 4),
       extra=st.integers(0, 6), d=st.sampled_from([2, 8]), per_sequence=st.booleans(),
       magnitude=st.sampled_from([1e-6, 1.0, 3e4, 1e5]), seed=st.integers(0, 2**31))
def test_an_f16_cache_holds_each_row_rounded_to_f16(b, hkv, group, t, extra, d, per_sequence, magnitude, seed):
    """store='f16': the float64 interpreter rounds what it writes as the kernels do (to nearest
    even, overflow to inf, subnormals kept), so a step over an f16 cache is the same step over
    the f32 cache holding the rounded rows; the NumPy backend writes the caller's f16 arrays."""
    rng = np.random.default_rng(seed)
    s = t + extra
    pos = rng.integers(0, s - t + 1, b if per_sequence else ()).astype(np.int64)
    model = decode_step(b, hkv * group, hkv, t, s, d, per_sequence, "f16")
    k_cache, v_cache = (rng.standard_normal((b, hkv, s, d)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((b, hkv * group, t, d)).astype(np.float32)
    k = (rng.standard_normal((b, hkv, t, d)) * magnitude).astype(np.float32)
    v = rng.standard_normal((b, hkv, t, d)).astype(np.float32)
    want = interpret(model, [k_cache, v_cache, q, k, v, pos])
    with np.errstate(over="ignore"):
        k16, v16 = k.astype(np.float16), v.astype(np.float16)
    for i, p in enumerate(np.broadcast_to(pos, (b,))):
        np.testing.assert_array_equal(want[1][i, :, p:p + t], k16[i].astype(np.float64))
    if np.isfinite(k16).all():
        exact = interpret(decode_step(b, hkv * group, hkv, t, s, d, per_sequence),
                          [k_cache.astype(np.float32), v_cache.astype(np.float32), q, k16.astype(np.float32),
                           v16.astype(np.float32), pos])
        np.testing.assert_allclose(want[0], exact[0], rtol=1e-12, atol=1e-12)
    got = tilegraph.compile(model, target="numpy").run(k_cache, v_cache, q, k, v, pos)
    assert got[1] is k_cache and got[1].dtype == np.float16
    np.testing.assert_array_equal(k_cache.astype(np.float64), want[1])
    if np.isfinite(want[0]).all():
        assert_close(got[0], want[0], "f32", s, name="attention")


def test_store_must_name_the_cache_type():
    g = Graph()
    kc, x, pos = g.input("c", (1, 1, 4, 2)), g.input("x", (1, 1, 1, 2)), g.input("pos", (), "i64")
    with pytest.raises(Exception, match="store='f16' rounds f32 rows"):
        g.op("cache_write", kc, x, pos, store="f16")
    kc16 = g.input("c16", (1, 1, 4, 2), "f16")
    with pytest.raises(Exception, match="must be \\[B, Hkv, T, D\\] of the cache"):
        g.op("cache_write", kc16, x, pos)  # an f16 cache takes f32 rows only with store='f16'


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


# --- tg.sample: the next token drawn inside the compiled step ---

def sampler(b, v, **attrs):
    g = Graph()
    out = g.op("sample", g.input("logits", (b, v)), g.input("seen", (b, v), "ui8"), g.input("u", (b,)), **attrs)
    return g.build(out)


SAMPLINGS = st.fixed_dictionaries({}, optional={"temperature": st.sampled_from([0.0, 0.3, 1.0, 2.5]),
                                                "top_k": st.integers(0, 12), "top_p": st.sampled_from([0.2, 0.9, 1.0]),
                                                "repetition_penalty": st.sampled_from([1.0, 0.8, 1.5])})


def _kept(logits, seen, attrs):
    """The interpreter's kept probabilities (unnormalised) before the draw, in float64."""
    a = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, **attrs}
    x = np.asarray(logits, np.float64)
    r = a["repetition_penalty"]
    x = np.where(seen != 0, np.where(x > 0, x / r, x * r), x) / a["temperature"]
    if a["top_k"] and a["top_k"] < x.shape[1]:
        x = np.where(x < np.sort(x, axis=1)[:, -a["top_k"]][:, None], -np.inf, x)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    for row in p:  # the top_p set: ranked by probability, ties by index
        order = sorted(range(row.size), key=lambda i: (-row[i], i))
        before, drop = 0.0, []
        for i in order:
            if before >= a["top_p"]:
                drop.append(i)
            before += row[i]
        row[drop] = 0.0
    return p


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), v=st.integers(1, 300), attrs=SAMPLINGS, scale=st.sampled_from([0.1, 3.0, 30.0]),
       seed=st.integers(0, 2**31))
def test_sample_draws_from_the_kept_distribution(b, v, attrs, scale, seed):
    """Against the float64 interpreter: greedy picks the first largest exactly; otherwise the C
    kernel's token is the one whose interval of the kept distribution (in vocabulary order) holds
    u, up to the f32 rounding of the running sums (an interval edge within it may go either way)."""
    from tilegraph.backends.c import compile_model

    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((b, v)) * scale).astype(np.float32)
    logits[:, rng.integers(0, v)] = logits.max()  # a tie for the largest
    seen = (rng.random((b, v)) < 0.2).astype(np.uint8)
    u = rng.random(b).astype(np.float32)
    model = sampler(b, v, **attrs)
    want = interpret(model, [logits, seen, u])[0]
    got = compile_model(model)(logits, seen, u)[0]
    numpy_got = tilegraph.compile(model, target="numpy").run(logits, seen, u)[0]
    assert got.dtype == np.int64 and got.shape == (b,)
    if not attrs.get("temperature"):
        x = np.where(seen != 0, np.where(logits > 0, logits / attrs.get("repetition_penalty", 1.0),
                                         logits * attrs.get("repetition_penalty", 1.0)), logits)
        np.testing.assert_array_equal(want, x.argmax(axis=1))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(numpy_got, want)
        return
    p = _kept(logits, seen, attrs)
    rtol, _ = tolerance("f32", v)
    for picks in (got, numpy_got, want):
        for row in range(b):
            cdf = np.cumsum(p[row])
            target = float(u[row]) * cdf[-1]
            lo = cdf[picks[row] - 1] if picks[row] else 0.0
            assert p[row, picks[row]] > 0 or abs(cdf[picks[row]] - target) <= rtol, "a token outside the kept set"
            assert lo - rtol <= target <= cdf[picks[row]] + rtol


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    from tilegraph.backends.c import compile_model

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 500)).astype(np.float32)
    seen, u = np.zeros((4, 500), np.uint8), rng.random(4).astype(np.float32)
    greedy = compile_model(sampler(4, 500))(logits, seen, u)[0]
    np.testing.assert_array_equal(greedy, logits.argmax(axis=1))
    for t in (0.5, 1.0, 4.0):
        np.testing.assert_array_equal(compile_model(sampler(4, 500, temperature=t, top_k=1))(logits, seen, u)[0],
                                      greedy)


def test_seeded_sampling_is_deterministic_and_follows_the_draws():
    """The draws are an input: the same u gives the same tokens; u across [0, 1) visits the kept
    tokens in vocabulary order, each as often as its probability."""
    from tilegraph.backends.c import compile_model

    rng = np.random.default_rng(5)
    logits = rng.standard_normal((1, 50)).astype(np.float32)
    seen = np.zeros((1, 50), np.uint8)
    step = compile_model(sampler(1, 50, temperature=0.9, top_k=6, top_p=0.95))
    u = rng.random(1).astype(np.float32)
    assert step(logits, seen, u)[0] == step(logits, seen, u.copy())[0]
    picks = np.array([step(logits, seen, np.array([x], np.float32))[0][0] for x in (np.arange(2000) + 0.5) / 2000])
    assert (np.diff(picks) >= 0).all(), "u in order walks the vocabulary in order"
    p = _kept(logits, seen, {"temperature": 0.9, "top_k": 6, "top_p": 0.95})[0]
    counts = np.bincount(picks, minlength=50) / 2000
    np.testing.assert_allclose(counts, p / p.sum(), atol=1e-3)


def test_sample_settings_out_of_range_are_refused():
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"repetition_penalty": 0.0}):
        with pytest.raises(Exception, match="temperature >= 0"):
            sampler(1, 4, **bad)
