"""The C runtime's f32 flash attention (backends/c/attention.c, tg_attention).

* At any blocks, lengths and head dims, with masks (bool, float) and causal with lq != lk, it
  computes what the float64 reference computes, within f32's tolerance: blocks smaller than the
  lengths make every step of the online softmax run (a later key block raising a row's max,
  rows with all keys of a block masked, partial blocks and slabs), which the compiled models of
  the other tests, one key block at their lengths, do not.
* On a processor with AVX-512 (the runtime is built for the running one) f32 attention takes
  the kernel with its own register-blocked products, not oneDNN's sgemm per block.
* Its backward (attention_backward.c, tg_attention_backward) likewise: the float64 reference's
  gradients at short sequences and odd head dims, and its own products on AVX-512.
"""

from __future__ import annotations

import ctypes
import functools
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


@functools.cache
def _sgemm_runtime():
    """The runtime built without AVX-512: the kernels' oneDNN sgemm path, which a processor with
    it never takes."""
    return ctypes.CDLL(str(build.runtime(build.flags() + ["-mno-avx512f"])))


def _avx512() -> bool:
    info = Path("/proc/cpuinfo")
    return info.exists() and " avx512f" in info.read_text()


def _mask(rng, kind: str, lq: int, lk: int, keep: float):
    """None, a bool mask keeping `keep` of the keys, or a float one (-inf where it drops)."""
    if kind == "bool":
        return rng.random((lq, lk)) < keep
    if kind == "float":
        return np.where(rng.random((lq, lk)) < keep, rng.standard_normal((lq, lk)), -np.inf).astype(np.float32)
    return None


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
    m = _mask(rng, mask, lq, lk, 0.7)
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


def _call_backward(lib, q, k, v, gy, mask, scale, causal, bq):
    """tg_attention_backward over q (b, lq, d), k (b, lk, d), v (b, lk, e) and gy (b, lq, e), each
    read at a row stride past its row (columns beyond it hold junk), a mask (lq, lk) shared by the
    batch or None; returns (dq, dk, dv), written at row strides past their rows too (the columns
    beyond them checked untouched)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    b, lq, d = q.shape
    lk, e = v.shape[1:]
    wide = [np.concatenate([x, np.full(x.shape[:-1] + (3,), 1e30, np.float32)], -1) for x in (q, k, v, gy)]
    outs = [np.full(x.shape[:-1] + (x.shape[-1] + 2,), 7.0, np.float32) for x in (q, k, v)]

    def arr(*xs):
        return (i64 * len(xs))(*xs)

    kind = 0 if mask is None else 1 if mask.dtype == np.bool_ else 2
    m = None if mask is None else np.ascontiguousarray(mask.astype(np.uint8) if kind == 1 else mask)
    bs = arr(*[x.shape[1] * x.shape[2] for x in wide], 0, *[x.shape[1] * x.shape[2] for x in outs])
    rc = lib.tg_attention_backward(1, arr(b), bs, *[x.ctypes.data_as(ptr) for x in wide],
                                   None if m is None else m.ctypes.data_as(ptr), *[o.ctypes.data_as(ptr) for o in outs],
                                   i64(lq), i64(lk), i64(d), i64(e), *[i64(x.shape[-1]) for x in wide + outs], kind,
                                   i64(lk if kind else 0), i64(1 if kind else 0), ctypes.c_float(scale), int(causal),
                                   i64(bq))
    assert rc == 0
    assert all((o[..., -2:] == 7.0).all() for o in outs)
    return [o[..., :-2] for o in outs]


@settings(deadline=None, max_examples=80)
@given(lq=st.integers(1, 140), lk=st.integers(1, 140), d=st.sampled_from([16, 32, 33, 64]),
       e=st.sampled_from([5, 16, 32, 64]), bq=st.integers(1, 70), causal=st.booleans(),
       mask=st.sampled_from(["none", "bool", "float"]), seed=st.integers(0, 2**16), sgemm=st.booleans())
def test_attention_backward_matches_the_float64_reference(lq, lk, d, e, bq, causal, mask, seed, sgemm):
    """tg_attention_backward (on AVX-512 its own products; sgemm per block in a runtime built
    without it) at short sequences, head dims that are and are not whole vectors, query blocks
    that do and do not divide the rows, causal with lq != lk (rows before every key: NaN, as the
    forward's, and so every key's dK and dV) and masks that empty some rows: the float64
    reference's dq, dk and dv within f32's tolerance."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((2, n, d)).astype(np.float32) for n in (lq, lk))
    v = rng.standard_normal((2, lk, e)).astype(np.float32)
    gy = rng.standard_normal((2, lq, e)).astype(np.float32)
    m = _mask(rng, mask, lq, lk, 0.8)
    got = _call_backward(_sgemm_runtime() if sgemm else _runtime(), q, k, v, gy, m, d ** -0.5, causal, bq)
    with np.errstate(invalid="ignore"):
        want = K.attention_grad(*(x.astype(np.float64) for x in (q, k, v, gy)),
                                None if m is None else m if m.dtype == np.bool_ else m.astype(np.float64),
                                d ** -0.5, causal)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert np.array_equal(np.isnan(g), np.isnan(w)), name
        assert_close(np.nan_to_num(g), np.nan_to_num(w), "f32", reduction_length=lq + lk + d, name=name)


def test_attention_backward_takes_the_register_blocked_products():
    """At MiniLM's head shape (128 keys, head dim 32, a float mask) the backward runs on the
    kernel's own products where the processor has AVX-512 (its counter moves), else on sgemm."""
    lib = _runtime()
    rng = np.random.default_rng(3)
    q, k, v, gy = (rng.standard_normal((4, 128, 32)).astype(np.float32) for _ in range(4))
    m = rng.standard_normal((128, 128)).astype(np.float32)
    if not _avx512():
        assert not hasattr(lib, "tg_f32_attention_backward_count")
        return
    lib.tg_f32_attention_backward_count.restype = ctypes.c_int
    before = lib.tg_f32_attention_backward_count()
    got = _call_backward(lib, q, k, v, gy, m, 32 ** -0.5, False, 64)
    assert lib.tg_f32_attention_backward_count() == before + 1
    want = K.attention_grad(*(x.astype(np.float64) for x in (q, k, v, gy)), m.astype(np.float64), 32 ** -0.5, False)
    for g, w in zip(got, want):
        assert_close(g, w, "f32", reduction_length=128 + 128 + 32)
