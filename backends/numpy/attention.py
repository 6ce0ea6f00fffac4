"""The NumPy backend's tiled attention kernel (what `tile` chooses for attention).

Flash-style attention (Dao et al., "FlashAttention", 2022, Algorithm 1): the same
result as `K.attention` (ir/kernels.py, the semantics), computed one block of
`block_q` query rows at a time against blocks of `block_kv` keys, with an online
softmax (running row max m, running sum l, and an accumulator rescaled by
exp(m_old - m_new) whenever the max grows). Extra memory is one scores block per
worker, [batch..., block_q, block_kv], plus the [batch..., Lq, Dv] accumulator
(the output itself): it grows with N·d, never N². The `tile` pass picks the
block sizes; when one block covers the whole sequence the kernel computes the
plain softmax in place on a single scores buffer, which is cheaper than
`attention` (one full-size temporary instead of three).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from tilegraph.ir.hardware import MIN_PARALLEL_SCORES
from tilegraph.ir.kernels import row_max
from tilegraph.backends.numpy.chunks import OneBlasThread, parallel_for

# Work items per thread when `threads > 1`: enough that an uneven last item (a
# short query block, a causal block with few keys) does not leave a core idle,
# few enough that per-item Python overhead (tens of microseconds) stays small.
_ITEMS_PER_THREAD = 4


@lru_cache(maxsize=64)
def _causal_drop(lq: int, lk: int, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
    """True where the causal mask drops (row i, key j) of a block: j > i + (lk - lq), as `attention`'s tril."""
    rows = np.arange(i0, i1)[:, None] + (lk - lq)
    drop = np.arange(j0, j1)[None, :] > rows
    drop.flags.writeable = False
    return drop


def _accumulator_dtype(dtype: np.dtype) -> np.dtype:
    # Half-precision sums of Lk terms lose too much; float32 and float64 keep their own.
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def _lead(a, lead):
    """a[lead] for an array that broadcasts against the batch: its size-1 dims take index
    0 (or stay whole under a slice, so they still broadcast against the others)."""
    return a[tuple(i if n > 1 else (slice(None) if isinstance(i, slice) else 0) for i, n in zip(lead, a.shape))]


def _apply_masks(s, mask, causal, lq, lk, i0, i1, j0, j1, exact=False):
    """Mask the scores block s = rows [i0, i1) x keys [j0, j1) in place, as `attention` does.

    `mask` is the caller's, not broadcast: negating a boolean block then costs the
    mask's own size ([batch, 1, 1, keys] for a padding mask), not the scores'.

    Fast (default): s = min(s, cap), cap +inf where kept and -inf where dropped, built
    at the mask's size: 4-5x faster over MiniLM's scores than a masked copy, and the
    same unless a dropped score is NaN (min keeps the NaN where `attention` puts -inf).
    That NaN reaches its row's sum, so the caller sees a NaN row and redoes the block
    with `exact` (see `_attend`)."""
    def drop(where):
        if exact:
            np.copyto(s, -np.inf, where=where)
        else:
            np.minimum(s, np.where(where, s.dtype.type(-np.inf), s.dtype.type(np.inf)), out=s)

    if causal and j1 - 1 > i0 + (lk - lq):  # some key of the block lies past some row's diagonal
        drop(_causal_drop(lq, lk, i0, i1, j0, j1))
    if mask is not None:
        rows = slice(i0, i1) if mask.shape[-2] > 1 else slice(None)
        keys = slice(j0, j1) if mask.shape[-1] > 1 else slice(None)
        block = mask[..., rows, keys]
        if block.dtype == np.bool_:
            drop(~block)
        else:
            s += block


def _attend_whole(q, k, v, mask, scale, causal, out, acc, exact=False):
    """One block covers the sequence: softmax in place on one scores buffer, normalize after P @ V.

    The buffer holds the scores transposed, keys x queries (K Q^T), so the softmax's max
    and sum run over a non-last axis: NumPy reduces that with SIMD across the contiguous
    queries, but a short last axis one row at a time (on MiniLM's 12x128x128 scores, one
    thread: max 119 against 210 us, sum 89 against 151). P @ V reads it transposed.
    Whole kernel, benchmarks/kernels_ab.py back to back: MiniLM b1 0.85x (quartiles
    0.76-0.95), b8 0.94x (0.84-1.01). The sum over keys is then sequential rather than
    pairwise: for the at most FLASH_BLOCK_KV keys of one block, within the f32 tolerance."""
    lq, lk = q.shape[-2], k.shape[-2]
    st = np.matmul(k.astype(acc, copy=False), np.swapaxes(q.astype(acc, copy=False) * scale, -1, -2))
    s = np.swapaxes(st, -1, -2)  # queries x keys, as `attention` and _apply_masks see it
    _apply_masks(s, mask, causal, lq, lk, 0, lq, 0, lk, exact)
    st -= np.fmax.reduce(st, axis=-2, keepdims=True)  # as row_max: a NaN row stays NaN
    np.exp(st, out=st)  # a fully masked row: -inf - -inf = NaN, as in `attention`
    total = np.swapaxes(np.add.reduce(st, axis=-2, keepdims=True), -1, -2)
    # Dividing the [Lq, Dv] output rather than the [Lq, Lk] probabilities: Dv < Lk in practice.
    if out.dtype == acc:
        np.matmul(s, v.astype(acc, copy=False), out=out)
        out /= total
    else:
        out[...] = np.matmul(s, v.astype(acc, copy=False)) / total


def _attend_rows(q, k, v, mask, scale, causal, i0, i1, block_kv, out, acc, exact=False):
    """Rows [i0, i1) of the output (out is their view), streaming over key/value blocks."""
    lq, lk = q.shape[-2], k.shape[-2]
    # Keys past the last row's diagonal are dropped for every row of the block: skip them.
    kv_end = min(lk, i1 + (lk - lq)) if causal else lk
    if kv_end <= 0:  # every row fully masked: `attention` gives NaN
        out[...] = np.nan
        return
    qs = q[..., i0:i1, :].astype(acc, copy=False) * scale
    # One scores buffer and one P @ V buffer for all key blocks (a short last block
    # uses a view): a new array per block would hold two blocks at once while the
    # next matmul runs. The output rows themselves accumulate when the dtype allows.
    s_buf = np.empty(qs.shape[:-1] + (min(block_kv, kv_end),), dtype=acc)
    total = out if out.dtype == acc else np.empty(out.shape, dtype=acc)
    pv = m = l = None
    for j0 in range(0, kv_end, block_kv):
        j1 = min(j0 + block_kv, kv_end)
        s = s_buf if j1 - j0 == s_buf.shape[-1] else s_buf[..., :j1 - j0]
        np.matmul(qs, np.swapaxes(k[..., j0:j1, :], -1, -2).astype(acc, copy=False), out=s)
        _apply_masks(s, mask, causal, lq, lk, i0, i1, j0, j1, exact)
        block_max = row_max(s, -1)  # a NaN score makes its row's sum (l), so the row, NaN
        m_new = block_max if m is None else np.maximum(m, block_max)  # NaN stays NaN
        # Rows with no kept key yet have m = -inf; shifting them by 0 keeps exp(-inf) = 0
        # rather than exp(-inf - -inf) = NaN, so a later kept key still counts.
        shift = np.where(m_new == -np.inf, 0, m_new).astype(acc, copy=False)
        s -= shift
        np.exp(s, out=s)
        vb = v[..., j0:j1, :].astype(acc, copy=False)
        if m is None:
            np.matmul(s, vb, out=total)
            l = np.sum(s, axis=-1, keepdims=True)
        else:
            pv = np.matmul(s, vb, out=pv)
            alpha = np.exp(m - shift)
            l *= alpha
            l += np.sum(s, axis=-1, keepdims=True)
            total *= alpha
            total += pv
        m = m_new
    # l = 0 exactly when a row kept no key: 0 / 0 = NaN, as `attention` gives.
    with np.errstate(invalid="ignore", divide="ignore"):
        np.divide(total, l, out=total)
    if total is not out:
        out[...] = total


def attention_tiled(q, k, v, mask, scale, causal, block_q, block_kv, threads=1, out=None):
    """`attention`, flash-style: query blocks of `block_q` rows against key/value blocks of
    `block_kv` with an online softmax, so extra memory is O(batch·block_q·block_kv + Lq·Dv).

    Batch dims broadcast as in np.matmul (and with the mask's). `threads > 1` runs
    independent (batch slice, query block) items on a shared thread pool; NumPy
    releases the GIL inside matmul and ufuncs. `out` (the result's shape and
    dtype) receives the result in place of a new array.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    lq, lk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                                () if mask is None else np.shape(mask)[:-2])
    if out is None:
        out = np.empty(batch + (lq, dv), dtype=q.dtype)
    elif out.shape != batch + (lq, dv) or out.dtype != q.dtype:
        raise ValueError(f"attention_tiled: out {out.shape} {out.dtype} != result {batch + (lq, dv)} {q.dtype}")
    acc = _accumulator_dtype(q.dtype)
    scale = np.asarray(scale, dtype=acc)
    # Views with the full batch shape (zero strides where a dim broadcasts): every
    # work item slices them the same way, and nothing is copied.
    q, k, v = (x if x.shape[:-2] == batch else np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v))
    if mask is not None:  # the batch rank, with leading 1s; never broadcast (see _apply_masks)
        mask = np.asarray(mask)
        mask = mask.reshape((1,) * (len(batch) + 2 - mask.ndim) + mask.shape)
    block_q, block_kv = max(1, min(block_q, lq)), max(1, min(block_kv, lk))
    whole = block_q == lq and block_kv == lk
    row_blocks = [(i0, min(i0 + block_q, lq)) for i0 in range(0, lq, block_q)]

    if math.prod(batch) * lq * lk < MIN_PARALLEL_SCORES:
        threads = 1
    # Split the leading batch dims only as far as needed to give each thread a few
    # items: whole indices of the outer dims, then contiguous slices of the next one.
    want = threads * _ITEMS_PER_THREAD if threads > 1 else 1
    split = 0
    while split < len(batch) and math.prod(batch[:split]) * len(row_blocks) < want:
        split += 1
    leads = [()]
    if split:
        outer = math.prod(batch[:split - 1]) * len(row_blocks)
        pieces = -(-want // outer)
        step = -(-batch[split - 1] // pieces)
        leads = [lead + (slice(c, c + step),)
                 for lead in np.ndindex(*batch[:split - 1]) for c in range(0, batch[split - 1], step)]
    items = [(lead, rows) for lead in leads for rows in row_blocks]

    masked = causal or (mask is not None and mask.dtype == np.bool_)  # what the fast mask applies to

    def run(item):
        lead, (i0, i1) = item
        bm = None if mask is None else _lead(mask, lead)
        rows = out[lead][..., i0:i1, :]
        for exact in (False, True):
            if whole:
                _attend_whole(q[lead], k[lead], v[lead], bm, scale, causal, out[lead], acc, exact)
            else:
                _attend_rows(q[lead], k[lead], v[lead], bm, scale, causal, i0, i1, block_kv, rows, acc, exact)
            # A NaN row may come from a NaN score the fast mask kept (_apply_masks): redo exactly.
            if exact or not masked or not np.isnan(rows).any():
                break

    if threads <= 1 or len(items) == 1:
        with OneBlasThread(), np.errstate(invalid="ignore"):
            for item in items:
                run(item)
        return out

    with OneBlasThread():
        parallel_for(run, items, threads)
    return out


