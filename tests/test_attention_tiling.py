"""Flash-style tiled attention (`T.attention_tiled`) computes what `K.attention` computes.

* on random shapes (broadcasting batch dims, Lq != Lk, block sizes that do and do not
  divide the lengths, blocks longer than the sequence), causal or not, boolean or
  additive masks (fully masked rows included), f16/f32/f64, one thread or two, it
  agrees with `K.attention` evaluated in float64 within the dtype's tolerance, NaN
  rows included, and returns the input dtype;
* keys that are NaN or infinite give what `attention` gives: dropped by a mask, they
  change nothing (the fast mask's fallback, `_apply_masks`);
* causal key blocks wholly above the diagonal are never read;
* extra memory grows with the sequence times the block, not with Lq x Lk;
* `out=` receives the result in place.
"""

from __future__ import annotations

import tracemalloc
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tilegraph.backends.numpy import attention as T
from tilegraph.ir import kernels as K
from tilegraph.testing import assert_close

DTYPES = {"f16": np.float16, "f32": np.float32, "f64": np.float64}


def reference(q, k, v, mask, scale, causal):
    """K.attention on float64 copies: the semantics the tiled kernel must keep."""
    if mask is not None and mask.dtype != np.bool_:
        mask = mask.astype(np.float64)
    with np.errstate(invalid="ignore"):  # fully masked rows: -inf - -inf, as documented
        return K.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask, scale, causal)


@st.composite
def attention_cases(draw):
    rank = draw(st.integers(0, 2))
    batch = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))

    def operand_batch():  # each operand may hold 1 where the others hold n (np.matmul broadcasting)
        return tuple(d if draw(st.booleans()) else 1 for d in batch)

    lq, lk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    d, dv = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    seed = draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(operand_batch() + (lq, d))
    k = rng.standard_normal(operand_batch() + (lk, d))
    v = rng.standard_normal(operand_batch() + (lk, dv))
    # Non-finite keys (whole rows: every query's score for that key): where a mask drops
    # them the row stays finite, where it keeps them the row is NaN or saturates.
    poison = draw(st.sampled_from([None, np.nan, np.inf, -np.inf]))
    if poison is not None:
        k[rng.random(k.shape[:-1]) < 0.3] = poison
    kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask = None
    if kind != "none":
        # Mask shapes as models write them: per key, per (query, key), or with batch dims.
        mshape = draw(st.sampled_from(["key", "query-key", "batch"]))
        shape = {"key": (lk,), "query-key": (lq, lk), "batch": operand_batch() + (1, lk)}[mshape]
        keep = rng.random(shape) > draw(st.sampled_from([0.0, 0.3, 0.8]))
        if draw(st.booleans()):  # a fully masked row: every key dropped (a per-key mask: all rows)
            if mshape == "key":
                keep[...] = False
            else:
                keep[..., 0, :] = False
        mask = keep if kind == "bool" else np.where(keep, rng.standard_normal(shape), -np.inf)
    causal = draw(st.booleans())
    block_q = draw(st.integers(1, 12))
    block_kv = draw(st.integers(1, 12))
    threads = draw(st.sampled_from([1, 2]))
    np_dtype = DTYPES[dtype]
    q, k, v = (a.astype(np_dtype) for a in (q, k, v))
    if mask is not None and mask.dtype != np.bool_:
        mask = mask.astype(np_dtype)
    return dict(q=q, k=k, v=v, mask=mask, causal=causal, block_q=block_q, block_kv=block_kv,
                threads=threads, dtype=dtype)


def _case(lq, lk, causal, block_q, block_kv, mask_kind="none", dtype="f32", threads=1, batch=(2, 3), seed=0):
    rng = np.random.default_rng(seed)
    np_dtype = DTYPES[dtype]
    q = rng.standard_normal(batch + (lq, 4)).astype(np_dtype)
    k = rng.standard_normal(batch + (lk, 4)).astype(np_dtype)
    v = rng.standard_normal(batch + (lk, 3)).astype(np_dtype)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((lq, lk)) > 0.5
    elif mask_kind == "float":
        mask = np.where(rng.random((lq, lk)) > 0.5, 0.0, -np.inf).astype(np_dtype)
    return dict(q=q, k=k, v=v, mask=mask, causal=causal, block_q=block_q, block_kv=block_kv,
                threads=threads, dtype=dtype)


SCALE = 0.37


@contextmanager
def threaded_even_when_small():
    """The kernel keeps small problems on one thread; these tests' problems are all small."""
    saved = T.MIN_PARALLEL_SCORES
    T.MIN_PARALLEL_SCORES = 0
    try:
        yield
    finally:
        T.MIN_PARALLEL_SCORES = saved


@settings(max_examples=150, deadline=None)
@given(attention_cases())
# Lq > Lk with causal: the first Lq - Lk rows keep no key and whole query blocks are skipped.
@example(_case(9, 4, causal=True, block_q=2, block_kv=3))
# One block covers everything (the in-place path), with masks dropping whole rows.
@example(_case(5, 7, causal=False, block_q=12, block_kv=12, mask_kind="bool", threads=2))
@example(_case(5, 7, causal=True, block_q=12, block_kv=12, mask_kind="float", dtype="f64"))
def test_tiled_attention_matches_the_float64_reference(case):
    q, k, v, mask = case["q"], case["k"], case["v"], case["mask"]
    expected = reference(q, k, v, mask, SCALE, case["causal"])
    with threaded_even_when_small():
        got = T.attention_tiled(q, k, v, mask, SCALE, case["causal"], case["block_q"], case["block_kv"],
                                threads=case["threads"])
    assert got.dtype == q.dtype
    # assert_close compares NaNs by position: a row attention leaves NaN must be NaN here too.
    assert_close(got, expected, case["dtype"], reduction_length=k.shape[-2], name="attention_tiled")


@pytest.mark.parametrize("causal, mask_kind", [(False, "bool"), (True, "none"), (True, "bool")])
@pytest.mark.parametrize("block_q, block_kv", [(12, 12), (2, 3)])
def test_a_nan_key_the_mask_drops_changes_nothing(causal, mask_kind, block_q, block_kv):
    # The fast mask (min with -inf) keeps a dropped NaN score; the kernel must notice the
    # NaN row it makes and redo it with the exact mask, as `attention` drops it to -inf.
    case = _case(6, 6, causal=causal, block_q=block_q, block_kv=block_kv, mask_kind=mask_kind, batch=(2,))
    k, mask = case["k"].copy(), case["mask"]
    if mask is not None:
        mask = mask.copy()
        mask[:, 2] = False  # key 2 dropped for every query...
        mask[0, 0] = True   # ...and every row keeps a key
        k[..., 2, :] = np.nan
    else:
        k[..., 5, :] = np.nan  # causal: the last key, dropped for all but the last row
    expected = reference(case["q"], k, case["v"], mask, SCALE, causal)
    assert np.isfinite(expected[..., :5, :]).all()
    got = T.attention_tiled(case["q"], k, case["v"], mask, SCALE, causal, block_q, block_kv)
    assert_close(got, expected, "f32", reduction_length=6, name="attention_tiled")


def test_causal_blocks_above_the_diagonal_are_never_read():
    # NaN in keys/values that only blocks above the diagonal hold: were they read, the
    # rows would be NaN (p = 0 times v = NaN is NaN), as `attention` itself gives.
    case = _case(8, 8, causal=True, block_q=2, block_kv=2, batch=(1,))
    k, v = case["k"].copy(), case["v"].copy()
    k[..., 4:, :] = np.nan
    v[..., 4:, :] = np.nan
    got = T.attention_tiled(case["q"], k, v, None, SCALE, True, 2, 2)
    assert np.isfinite(got[..., :4, :]).all()
    expected = reference(case["q"][..., :4, :], k[..., :4, :], v[..., :4, :], None, SCALE, True)
    assert_close(got[..., :4, :], expected, "f32", reduction_length=4)


def test_extra_memory_grows_with_the_block_not_with_lq_times_lk():
    heads, length, d = 2, 1024, 16
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((heads, length, d)).astype(np.float32) for _ in range(3))
    padding = rng.random(length) > 0.1  # a per-key boolean mask: never broadcast to the scores
    scores_bytes = heads * length * length * 4  # what `attention` materialises: 8 MiB
    tracemalloc.start()
    try:
        T.attention_tiled(q, k, v, padding, SCALE, True, 64, 128)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The output (128 KiB) plus a few [heads, 64, 128] blocks (64 KiB each) and [heads, 64, d] rows.
    budget = heads * length * d * 4 + 6 * heads * 64 * 128 * 4
    assert peak <= budget, f"peak {peak} B over the O(N d + block) budget {budget} B (scores: {scores_bytes} B)"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("blocks", [(16, 16), (64, 64)], ids=["tiled", "whole"])
def test_out_receives_the_result_in_place(threads, blocks):
    case = _case(40, 40, causal=True, block_q=blocks[0], block_kv=blocks[1], mask_kind="bool", threads=threads)
    out = np.full((2, 3, 40, 3), 7.0, dtype=np.float32)
    with threaded_even_when_small():
        got = T.attention_tiled(case["q"], case["k"], case["v"], case["mask"], SCALE, True, *blocks,
                                threads=threads, out=out)
    assert got is out
    assert_close(out, reference(case["q"], case["k"], case["v"], case["mask"], SCALE, True), "f32",
                 reduction_length=40)
