"""The C runtime's f32 flash attention (backends/c/attention.c, tg_attention).

* At any blocks, lengths and head dims, with masks (bool, float) and causal with lq != lk, it
  computes what the float64 reference computes, within f32's tolerance: blocks smaller than the
  lengths make every step of the online softmax run (a later key block raising a row's max,
  rows with all keys of a block masked, partial blocks and slabs), which the compiled models of
  the other tests, one key block at their lengths, do not.
* On a processor with AVX-512 (the runtime is built for the running one) f32 attention takes
  the kernel with its own register-blocked products, not oneDNN's sgemm per block.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import tilegraph
from tilegraph.backends.c import build
from tilegraph.ir import Graph, interpret
from tilegraph.ir import kernels as K
from tilegraph.testing import assert_close


def _runtime():
    return ctypes.CDLL(str(build.runtime()))


def _avx512() -> bool:
    info = Path("/proc/cpuinfo")
    return info.exists() and " avx512f" in info.read_text()


def _call(lib, q, k, v, mask, scale, causal, bq, bk):
    """tg_attention over q (b, lq, d), k (b, lk, d), v (b, lk, dv), a mask (lq, lk) shared by the
    batch (bool or f32) or None; returns the result (b, lq, dv)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    b, lq, d = q.shape
    lk, dv = v.shape[1:]
    o = np.full((b, lq, dv), 7.0, np.float32)

    def arr(*xs):
        return (i64 * len(xs))(*xs)

    kind = 0 if mask is None else 1 if mask.dtype == np.bool_ else 2
    m = None if mask is None else np.ascontiguousarray(mask.astype(np.uint8) if kind == 1 else mask)
    rc = lib.tg_attention(1, arr(b), arr(lq * d), arr(lk * d), arr(lk * dv), arr(0), arr(lq * dv),
                          q.ctypes.data_as(ptr), k.ctypes.data_as(ptr), v.ctypes.data_as(ptr),
                          None if m is None else m.ctypes.data_as(ptr), o.ctypes.data_as(ptr), i64(lq), i64(lk),
                          i64(d), i64(dv), i64(d), i64(d), i64(dv), i64(dv), kind, i64(lk if kind else 0),
                          i64(1 if kind else 0), ctypes.c_float(scale), int(causal), i64(bq), i64(bk))
    assert rc == 0
    return o


@settings(max_examples=40, deadline=None)
@given(lq=st.integers(1, 90), lk=st.integers(1, 90), d=st.sampled_from([1, 16, 33, 64]),
       dv=st.sampled_from([5, 16, 64]), bq=st.integers(1, 40), bk=st.integers(1, 40), causal=st.booleans(),
       mask=st.sampled_from(["none", "bool", "float"]), seed=st.integers(0, 2**16))
def test_f32_attention_matches_the_float64_reference_at_any_blocks(lq, lk, d, dv, bq, bk, causal, mask, seed):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((2, n, d)).astype(np.float32) * 2 for n in (lq, lk))
    v = rng.standard_normal((2, lk, dv)).astype(np.float32)
    m = None
    if mask == "bool":
        m = rng.random((lq, lk)) < 0.7
    elif mask == "float":
        m = np.where(rng.random((lq, lk)) < 0.7, rng.standard_normal((lq, lk)), -np.inf).astype(np.float32)
    got = _call(_runtime(), q, k, v, m, d ** -0.5, causal, bq, bk)
    with np.errstate(invalid="ignore"):  # rows with every key masked: NaN, as softmax over all -inf
        want = K.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                           None if m is None else m if m.dtype == np.bool_ else m.astype(np.float64), d ** -0.5, causal)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert_close(np.nan_to_num(got), np.nan_to_num(want), "f32", reduction_length=lk + d)


def test_f32_attention_takes_the_register_blocked_products():
    """A compiled model's f32 attention: one call of the kernel with its own products where the
    processor has AVX-512, matching the interpreter; elsewhere the sgemm path (no counter)."""
    rng = np.random.default_rng(5)
    g = Graph()
    q, k, v = (g.input(n, (1, 3, 300, 40)) for n in "qkv")
    model = g.build(g.attention(q, k, v, causal=True), names=["y"])
    xs = [rng.standard_normal((1, 3, 300, 40)).astype(np.float32) for _ in range(3)]
    compiled = tilegraph.compile(model, target="c")
    assert compiled.source.count("tg_attention(") == 1
    lib = compiled._runner._lib
    if not _avx512():
        assert not hasattr(lib, "tg_f32_attention_count")
        return
    lib.tg_f32_attention_count.restype = ctypes.c_int
    before = lib.tg_f32_attention_count()
    got = compiled.run(*xs)[0]
    assert lib.tg_f32_attention_count() == before + 1
    assert_close(got, interpret(model, xs)[0], "f32", reduction_length=300 + 40)
