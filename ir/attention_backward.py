"""Attention's backward as tg ops: the decomposition of `tg.attention_grad` (ir/decompositions.py),
the VJP rule of `tg.attention` where q, k and v broadcast over the batch (ir/vjp.py), and training
code that differentiates attention by hand: the whole-row form (the probabilities
recomputed from q and k in one matmul) and FlashAttention-2's blockwise form, which never
holds an Lq x Lk value. Each takes a `Backward` emitter `b` and returns tg values.
"""

from __future__ import annotations

import math

from xdsl.ir import SSAValue

from tilegraph.ir.shapes import TensorInfo, dims_equal, info_of


def info(v: SSAValue) -> TensorInfo:
    return info_of(v.type)


def swap_last(b, x):
    """x with its last two dims swapped."""
    r = info(x).rank
    return b.transpose(x, tuple(range(r - 2)) + (r - 1, r - 2))


def attention_backward(b, q, k, v, mask, scale: float, causal: bool, gy):
    """(dq, dk, dv) of softmax(q k^T scale + mask) v: the probabilities recomputed from q and k
    in one matmul, memory O(Lq Lk): the form at or below ir/vjp.ATTENTION_BACKWARD_BLOCK keys, where
    that is one block's slab anyway (attention_backward_blockwise above it)."""
    from tilegraph.ir.decompositions import attention_probabilities

    p = attention_probabilities(b, q, k, mask, scale, causal)
    dv = b("matmul", swap_last(b, p), gy)
    dp = b("matmul", gy, swap_last(b, v))
    pdp = b("mul", p, dp)
    ds = b("sub", pdp, b("mul", p, b.broadcast_to(b.sum(pdp, (info(p).rank - 1,), keepdims=True), info(p).shape)))
    ds = b("mul", ds, b.scalar(q, scale))
    dq = b("matmul", ds, k)
    dk = b("matmul", swap_last(b, ds), q)
    return dq, dk, dv, ds




def _keys(b, x, start: int, stop: int):
    """x[..., start:stop, :] (a block of keys or values), or x itself when that is all of it."""
    r = info(x).rank
    if start == 0 and dims_equal(info(x).shape[-2], stop):
        return x
    big = (1 << 63) - 1
    return b("slice", x, starts=(0,) * (r - 2) + (start, 0), ends=(big,) * (r - 2) + (stop, big), steps=(1,) * r)


def _columns(b, x, start: int, stop: int, lk: int):
    """x[..., start:stop] of a mask whose last dim is Lk (a mask broadcast along keys: itself)."""
    r = info(x).rank
    if not dims_equal(info(x).shape[-1], lk):
        return x
    big = (1 << 63) - 1
    return b("slice", x, starts=(0,) * (r - 1) + (start,), ends=(big,) * (r - 1) + (stop,), steps=(1,) * r)


def attention_backward_blockwise(b, q, k, v, mask, scale: float, causal: bool, out, gy, block: int):
    """(dq, dk, dv, mask's cotangent or None) of attention, FlashAttention-2's backward over blocks
    of `block` keys: each row's logsumexp first (online over the blocks: a running max and a
    rescaled running sum), then per block the scores recomputed from q and the block's keys,
    P = exp(S - lse), dV_j = P^T dO, dS = P (dO V_j^T - D) with D = rowsum(dO * O) from the
    forward's output (so no row sum over P), dQ += dS K_j, dK_j = dS^T Q. No Lq x Lk value exists."""
    dt = info(q).dtype
    lq, lk = info(q).shape[-2], info(k).shape[-2]
    offset = lk - lq
    rank = info(q).rank
    minus_inf, zero = b.const(-math.inf, dt), b.const(0.0, dt)
    last = (rank - 1,)

    def scores(start, stop):
        s = b("mul", b("matmul", q, swap_last(b, _keys(b, k, start, stop))), b.const(scale, dt))
        if causal:  # key c of the block at or before query i's position: (start + c) - i <= offset
            ones = b("broadcast", b.const(True, "i1"), result=TensorInfo((lq, stop - start), "i1"))
            s = b("where", b("trilu", ones, k=offset - start, upper=False), s, minus_inf)
        if mask is not None:
            part = _columns(b, mask, start, stop, lk)
            s = b("where", part, s, minus_inf) if info(mask).dtype == "i1" else b("add", s, part)
        return s

    # (causal masks align the last query with the last key: every block has a key some query reads)
    blocks = [(j, min(j + block, lk)) for j in range(0, lk, block)]
    m = total = None
    for start, stop in blocks:
        s = scores(start, stop)
        bm = b("reduce_max", s, axes=last, keepdims=True)
        new = bm if m is None else b("max", m, bm)
        safe = b("where", b("eq", new, minus_inf), zero, new)  # a row masked so far: exp(-inf - 0) = 0
        part = b.sum(b("exp", b("sub", s, safe)), last, keepdims=True)
        total = part if total is None else b("add", b("mul", total, b("exp", b("sub", m, safe))), part)
        m = new
    assert m is not None and total is not None
    lse = b("add", b("where", b("eq", m, minus_inf), zero, m), b("log", total))
    d = b.sum(b("mul", gy, out), last, keepdims=True)
    dq = None
    dks, dvs, dmasks = [], [], []
    for start, stop in blocks:
        s = scores(start, stop)
        p = b("exp", b("sub", s, b.broadcast_to(lse, info(s).shape)))
        dvs.append(b("matmul", swap_last(b, p), gy))
        dp = b("matmul", gy, swap_last(b, _keys(b, v, start, stop)))
        ds = b("mul", p, b("sub", dp, b.broadcast_to(d, info(dp).shape)))
        if mask is not None and info(mask).dtype != "i1":
            dmasks.append(b.sum_to(ds, info(_columns(b, mask, start, stop, lk)).shape))
        ds = b("mul", ds, b.const(scale, dt))
        step = b("matmul", ds, _keys(b, k, start, stop))
        dq = step if dq is None else b("add", dq, step)
        dks.append(b("matmul", swap_last(b, ds), q))
    concat = lambda parts: parts[0] if len(parts) == 1 else b("concat", *parts, axis=rank - 2)  # noqa: E731
    dmask = None
    if dmasks:
        if dims_equal(info(mask).shape[-1], lk):
            dmask = dmasks[0] if len(dmasks) == 1 else b("concat", *dmasks, axis=info(mask).rank - 1)
        else:
            dmask = dmasks[0]
            for extra in dmasks[1:]:
                dmask = b("add", dmask, extra)
    return dq, concat(dks), concat(dvs), dmask
