"""The C runtime's block-format and KV-cache kernels (backends/c/blockq.c) against the float64
reference, at every instruction set this processor has (scalar, AVX2, AVX512-VNNI):

- block_matmul multiplies the q8 activations it makes (quantize_activations) by the exact
  dequantized weight, within f32 rounding over K; and the op's float result within the stated
  activation bound (activation_error_bound), so a kernel that dropped a block's offset or min
  (an error of the weight's size) fails both;
- block_rows is the dequantization, bit for bit; cache_write writes exactly the rows it is
  given, in place; cache_attention is ir/kernels.py's causal grouped-query attention."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tilegraph.backends.c import blockq
from tilegraph.ir import kernels
from tilegraph.ir.block_formats import FORMATS
from tilegraph.testing.tolerances import assert_close, tolerance

WEIGHT_FORMATS = ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "f16", "bf16", "f32"]
ISAS = sorted({blockq.isa(name) for name in blockq.ISAS}, key=blockq.ISAS.get)  # those the processor has


def _cache_write_ref(cache, x, pos):  # until ir/kernels.py's lands from issue-27-gguf
    p = np.broadcast_to(np.asarray(pos).reshape(-1), (x.shape[0],))
    for i in range(x.shape[0]):
        cache[i, :, p[i]:p[i] + x.shape[2]] = x[i]
    return cache


def _cache_attention_ref(q, k, v, pos, scale):
    b, h, t, _ = q.shape
    g = h // k.shape[1]
    p = np.broadcast_to(np.asarray(pos).reshape(-1), (b,))
    out = np.empty(q.shape)
    for i in range(b):
        n = int(p[i]) + t
        kk, vv = np.repeat(k[i, :, :n], g, 0), np.repeat(v[i, :, :n], g, 0)
        sc = q[i] @ kk.transpose(0, 2, 1) * scale
        sc = np.where(np.arange(n)[None, None, :] <= (p[i] + np.arange(t))[None, :, None], sc, -np.inf)
        e = np.exp(sc - sc.max(-1, keepdims=True))
        out[i] = (e / e.sum(-1, keepdims=True)) @ vv
    return out


cache_write_ref = getattr(kernels, "cache_write", _cache_write_ref)
cache_attention_ref = getattr(kernels, "cache_attention", _cache_attention_ref)


@pytest.fixture(autouse=True)
def _best_isa():
    yield
    blockq.isa(None)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(WEIGHT_FORMATS), isa=st.sampled_from(ISAS), m=st.integers(1, 9), n=st.integers(1, 40),
       blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_block_matmul_is_its_reference(fmt, isa, m, n, blocks, seed, scale):
    f = FORMATS[fmt]
    k = blocks * max(f.block, 32)
    rng = np.random.default_rng(seed)
    w = f.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    x[rng.random((m, k)) < 0.1] = 0.0  # blocks of zeros and lone values: the scale's edge cases
    wd = f.dequantize(w, (n, k)).astype(np.float64)
    blockq.isa(isa)
    y = blockq.block_matmul(x, w, fmt, k)
    exact = x.astype(np.float64) @ wd.T
    if f.block == 1:
        assert_close(y, exact, "f32", k, name=f"{fmt} x @ w.T")
        return
    assert_close(y, blockq.quantize_activations(x) @ wd.T, "f32", k, name=f"{fmt} q8(x) @ w.T ({isa})")
    rtol, _ = tolerance("f32", k)
    slack = blockq.activation_error_bound(x, wd) + rtol * (np.abs(x) @ np.abs(wd).T) + 1e-30
    assert (np.abs(y - exact) <= slack).all(), f"{fmt} ({isa}): outside the activation bound"


def test_the_activation_bound_is_tight_enough_to_fail():
    """A kernel that ignored q4_1's minimum would be off by m * sum(x): far outside the bound."""
    f = FORMATS["q4_1"]
    rng = np.random.default_rng(1)
    w = f.quantize(rng.standard_normal((8, 64)).astype(np.float32) + 3.0)
    x = rng.standard_normal((1, 64)).astype(np.float32) + 1.0
    wd = f.dequantize(w, (8, 64)).astype(np.float64)
    no_min = f.dequantize(w, (8, 64)).astype(np.float64) - np.repeat(
        w.reshape(8, 2, 20)[:, :, 2:4].copy().view(np.float16).astype(np.float64), 32, axis=1).reshape(8, 64)
    assert (np.abs(x @ no_min.T - x @ wd.T) > blockq.activation_error_bound(x, wd)).any()


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_block_rows_dequantize_exactly(fmt):
    f = FORMATS[fmt]
    k = 2 * max(f.block, 32)
    w = f.quantize(np.random.default_rng(2).standard_normal((7, k)).astype(np.float32))
    idx = np.array([6, 0, 3, 3])
    np.testing.assert_array_equal(blockq.block_rows(w, fmt, k, idx), f.dequantize(w, (7, k))[idx])
    with pytest.raises(blockq.KernelError, match="outside the table"):
        blockq.block_rows(w, fmt, k, np.array([7]))


def test_a_row_that_is_not_whole_blocks_is_refused():
    w = np.zeros((2, 18), np.uint8)
    with pytest.raises(blockq.KernelError, match="rows of 18 bytes"):
        blockq.block_matmul(np.zeros((1, 64), np.float32), w, "q4_0", 64)


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 3), s=st.integers(1, 12), t=st.integers(1, 4), d=st.integers(1, 9),
       per_sequence=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_cache_write_writes_in_place(b, h, s, t, d, per_sequence, seed):
    rng = np.random.default_rng(seed)
    t = min(t, s)
    cache = rng.standard_normal((b, h, s, d)).astype(np.float32)
    x = rng.standard_normal((b, h, t, d)).astype(np.float32)
    pos = rng.integers(0, s - t + 1, b) if per_sequence else np.int64(rng.integers(0, s - t + 1))
    want = cache_write_ref(cache.copy(), x, pos)
    address = cache.ctypes.data
    blockq.cache_write(cache, x, pos)
    assert cache.ctypes.data == address
    np.testing.assert_array_equal(cache, want)


def test_cache_write_past_the_end_is_refused():
    cache = np.zeros((1, 1, 4, 2), np.float32)
    with pytest.raises(blockq.KernelError, match="do not fit a cache of 4"):
        blockq.cache_write(cache, np.ones((1, 1, 2, 2), np.float32), np.int64(3))
    with pytest.raises(blockq.KernelError, match="position -1"):
        blockq.cache_write(cache, np.ones((1, 1, 1, 2), np.float32), np.int64(-1))
    assert not cache.any()


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), kv=st.integers(1, 3), group=st.integers(1, 4), t=st.sampled_from([1, 2, 5, 17, 24]),
       d=st.sampled_from([1, 8, 64]), extra=st.integers(0, 300), per_sequence=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_cache_attention_is_its_reference(b, kv, group, t, d, extra, per_sequence, seed):
    """Decode (T <= 16: spans of keys split across threads and combined) and prompt (T > 16) paths."""
    rng = np.random.default_rng(seed)
    s = t + extra
    q = rng.standard_normal((b, kv * group, t, d)).astype(np.float32)
    k = rng.standard_normal((b, kv, s, d)).astype(np.float32)
    v = rng.standard_normal((b, kv, s, d)).astype(np.float32)
    pos = rng.integers(0, s - t + 1, b) if per_sequence else np.int64(rng.integers(0, s - t + 1))
    scale = d ** -0.5
    got = blockq.cache_attention(q, k, v, pos, scale)
    want = cache_attention_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), pos, scale)
    assert_close(got, want, "f32", max(d, int(np.max(pos)) + t), name="cache_attention")


def test_cache_attention_past_the_cache_is_refused():
    q = np.zeros((1, 2, 3, 4), np.float32)
    k = np.zeros((1, 1, 8, 4), np.float32)
    with pytest.raises(blockq.KernelError, match="reach past a cache of 8"):
        blockq.cache_attention(q, k, k, np.int64(6), 0.5)
    with pytest.raises(blockq.KernelError, match="share"):
        blockq.cache_attention(np.zeros((1, 3, 1, 4), np.float32), np.zeros((1, 2, 8, 4), np.float32),
                               np.zeros((1, 2, 8, 4), np.float32), np.int64(0), 0.5)
