"""GPTQ: data-aware rounding of a linear layer's weight (the `quantize` pass's `rounding=gptq`).

What it decides: the grid value of every weight of one layer y = x @ W (W [K, N], K the
reduction axis), so that the layer's output error on the calibration inputs X is small,
rather than each weight's own error (round to nearest). The objective is

    E(Q) = trace((W - Q)^T H (W - Q)),   H = X^T X / rows   (X [rows, K]: the layer's inputs)

which is ||X W - X Q||^2 / rows. How (Frantar et al. 2022, "GPTQ", Algorithm 1): the K rows
of W (one per input feature) are rounded in order; each row's rounding error is spread over
the rows not rounded yet, in proportion to how their inputs correlate with this one, so that
they compensate it. With U the upper Cholesky factor of H^-1 (H^-1 = U^T U), rounding row k
to q_k updates

    W[j] -= U[k, j] / U[k, k] * (W[k] - q_k)      for every j > k,

applied lazily: within a block of GPTQ_BLOCK rows at once, to the rows after the block by
one GEMM. H is estimated from the calibration rows with Ledoit-Wolf shrinkage toward a
multiple of the identity (`ledoit_wolf`): a few hundred tokens against K = 384 or 1536
inputs leave X^T X singular, and GPTQ on the raw one fits the calibration set's noise
(MiniLM MXFP4, mean cosine on held-out sentences: 0.972 raw, 0.978 shrunk). DAMP of the
mean diagonal is added on top (the paper's 1%), so that H^-1 exists whatever the data.
`act_order` rounds the rows of the largest inputs first (the paper's "act-order"), while
the most rows remain to absorb their error (0.981 on the same set).

Scales: per tensor and per channel (one per output column) they come from the whole
original weight, as in the paper; per group along K (w4a16's groups of 128, an MX block of
32 sharing one E8M0 scale) each group's scale is chosen when the rounding reaches it, from
the weights as updated by the rows before it (the paper's "static groups" = false; with
act_order, up front from the original weights, since a group's rows are then visited out of
order), by the pass's weight observer (`mse`: for MX blocks, the better of the two
power-of-two exponents around the block's largest magnitude). The result is a weight whose every element is on
its format's grid times its scale: dequantize(quantize(W_gptq)) == W_gptq, so the layer's
storage format is unchanged (same types, same scales, same bytes).

GPTQ is greedy: on a layer whose inputs are uncorrelated (H diagonal) it reduces to round to
nearest, and a group scale chosen after updates may, rarely, be worse than the original's.
So the H-weighted error of the round-to-nearest result is computed too, and the better of
the two is kept: the rounding is never worse than round to nearest on its own objective.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
from threadpoolctl import threadpool_limits

from tilegraph.ir.quant import Format, dequantize, expand_scale, quantize

# Dampening added to H's diagonal, as a fraction of its mean: GPTQ's default (percdamp = .01).
DAMP = 0.01
# Rows rounded between two lazy GEMM updates of the remaining rows: the paper's B = 128 (a
# multiple of every group size used here, so a group never straddles two blocks).
GPTQ_BLOCK = 128


def hessians(model, batches: Iterable[Sequence[np.ndarray]],
             progress: Callable[[Iterable], Iterable] = iter) -> dict[str, np.ndarray]:
    """{layer name: H = X^T X / rows (float64, [K, K])} of every linear layer the quantize pass
    rewrites, X its input over the calibration batches (the interpreter, float32)."""
    from tilegraph.ir.interpreter import interpret
    from tilegraph.passes.quantize import QuantizeError, layer_name, linear_layers

    layers = linear_layers(model.func.body.block.ops, model.weights)
    if not layers:
        raise QuantizeError("the model has no matmul by a 2-D float weight to calibrate")
    sums: dict = {}  # by input value: Q, K and V projections read the same x
    rows: dict = {}
    fourth: dict = {}  # sum of ||x_i||^4, for the shrinkage
    for batch in progress(batches):
        values: dict = {}
        interpret(model, list(batch), float64=False, values=values)
        for mm, _ in layers:
            a = mm.operands[0]
            x = np.asarray(values[a], np.float64)
            x = x.reshape(-1, x.shape[-1])
            x = x[np.isfinite(x).all(axis=1)]
            sums[a] = sums.get(a, 0.0) + x.T @ x
            rows[a] = rows.get(a, 0) + x.shape[0]
            fourth[a] = fourth.get(a, 0.0) + float(np.sum(np.einsum("ij,ij->i", x, x) ** 2))
    if not rows:
        raise QuantizeError("no calibration batches")
    shrunk = {a: ledoit_wolf(sums[a], rows[a], fourth[a]) for a in sums}
    return {layer_name(w, i): shrunk[mm.operands[0]] for i, (mm, w) in enumerate(layers)}


def ledoit_wolf(xtx: np.ndarray, n: int, fourth: float) -> np.ndarray:
    """The Ledoit-Wolf estimate of E[x x^T] from n rows: S = X^T X / n shrunk toward mu I (mu: S's mean
    diagonal) by the intensity that minimizes the expected squared error (Ledoit & Wolf 2004, eq. 14),
    from sum_i ||x_i||^4 (`fourth`): b^2 = (sum ||x_i||^4 / n - ||S||_F^2) / n, d^2 = ||S - mu I||_F^2,
    delta = min(b^2, d^2) / d^2. With fewer rows than inputs (a few hundred tokens against K = 1536)
    S is singular and GPTQ would fit its noise: this is how much to trust it."""
    if n == 0:
        return xtx
    s = xtx / n
    p = len(s)
    mu = np.trace(s) / p
    d2 = float(np.sum(s ** 2) - 2 * mu * np.trace(s) + mu * mu * p)
    b2 = max(0.0, (fourth / n - float(np.sum(s ** 2))) / n)
    delta = min(b2, d2) / d2 if d2 > 0 else 1.0
    out = (1 - delta) * s
    out[np.diag_indices_from(out)] += delta * mu
    return out


def output_error(w: np.ndarray, q: np.ndarray, h: np.ndarray) -> float:
    """trace((W - Q)^T H (W - Q)): the layer's mean squared output error over the calibration rows."""
    d = np.asarray(w, np.float64) - np.asarray(q, np.float64)
    return float(np.einsum("kn,kn->", d, h @ d))


def _inverse_cholesky(h: np.ndarray) -> np.ndarray:
    """U upper triangular with U^T U = (H + damping)^-1."""
    from scipy.linalg import lapack

    h = np.array(h, np.float64)
    diag = np.diag(h).copy()
    diag[diag <= 0] = 0.0
    dead = diag == 0  # an input never seen: its weights change nothing on the data, keep them
    h[dead, :] = 0.0
    h[:, dead] = 0.0
    mean = diag.mean() if diag.any() else 1.0
    h[np.diag_indices_from(h)] += DAMP * mean + dead * mean
    # H = R R^T with R upper triangular (the Cholesky factor of H with its order reversed);
    # then H^-1 = (R^-1)^T R^-1, and U = R^-1: one factorization and one triangular inverse.
    r = np.linalg.cholesky(h[::-1, ::-1])[::-1, ::-1]
    u, info = lapack.dtrtri(r, lower=0)
    if info:
        raise np.linalg.LinAlgError(f"trtri failed ({info})")
    return np.triu(u)


def _round_rows(x: np.ndarray, scale: np.ndarray, fmt: Format) -> np.ndarray:
    """Rows x [r, N] rounded to nearest on the grid of `fmt` times `scale` (one per column or a
    scalar): dequantize(quantize(x)), in a few float32 NumPy passes, since this runs once per row
    and ml_dtypes' casts to 4- and 8-bit floats take ~40 ns an element here (150 float32 adds).
    A float format's values are integers times 2^(e - mantissa bits) in the binade 2^e of |y|
    (e at least the smallest normal exponent), so rint at that step, ties to even, is its
    round to nearest even; tests check it against ml_dtypes."""
    s = np.asarray(scale, np.float32)
    y = np.clip(np.asarray(x, np.float32) / s, np.float32(fmt.lo), np.float32(fmt.hi))
    if not fmt.integer:
        _, e = np.frexp(y)
        step = np.ldexp(np.float32(1.0), np.maximum(e - 1, fmt.min_exponent) - fmt.mantissa_bits)
        y /= step
        np.rint(y, out=y)
        y *= step
    else:
        np.rint(y, out=y)
    return y * s


def gptq(w: np.ndarray, h: np.ndarray, fmt: Format, granularity: str, size: int,
         scale_of: Callable[[np.ndarray, str], np.ndarray], act_order: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(W_gptq [K, N] float32 on the grid, its scale) for the weight `w` [K, N] and the Hessian `h`
    [K, K]; `scale_of(weights, granularity)` is the observer (per tensor: (), per channel: (N,),
    per group: one row per group of `size` rows). `act_order`: round the rows in order of decreasing
    H diagonal (largest inputs first), with every scale chosen up front from the original weights
    ("static groups"). Never worse than round to nearest in `output_error` (module docstring)."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if h.shape != (k, k):
        raise ValueError(f"gptq: a weight of {k} rows needs a {k}x{k} Hessian, got {h.shape}")
    grouped = granularity == "group"
    axis, bs = (0, size) if grouped else (1, 0)
    rtn_scale = scale_of(w, granularity)
    static = None
    if act_order or not grouped:  # one scale row per weight row, known before rounding starts
        static = np.broadcast_to(expand_scale(np.asarray(rtn_scale, np.float32), w.shape, axis, bs), w.shape)
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    block = GPTQ_BLOCK if not grouped else max(size, GPTQ_BLOCK // size * size)
    with threadpool_limits(1, user_api="blas"):  # OpenBLAS's threads spin on a busy machine
        out, scale = _rounded(w, h, fmt, size, scale_of, order, static, block)
    # Round to nearest, with the same observer, on the original weights: kept if it is better.
    rtn = dequantize(quantize(w, rtn_scale, None, axis, bs, fmt.name, fmt.numpy), rtn_scale, None, axis, bs,
                     np.float32)
    if output_error(w, rtn, h) < output_error(w, out, h):
        return rtn, rtn_scale
    return out, rtn_scale if static is not None else scale.astype(rtn_scale.dtype)


def _rounded(w, h, fmt, size, scale_of, order, static, block):
    """GPTQ's loop (module docstring): the rounded weights, and the group scales chosen on the way."""
    k = w.shape[0]
    u = _inverse_cholesky(h[np.ix_(order, order)])
    work = w[order].astype(np.float64)
    out = np.empty_like(w)
    group_scales = []
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = work[b0:b1]
        err = np.empty_like(wb)
        for i in range(b1 - b0):
            if static is not None:
                row_scale = static[order[b0 + i]]
            elif i % size == 0:  # this group's scale, from the weights as updated so far
                group_scales.append(scale_of(wb[i:i + size].astype(np.float32), "group"))
                row_scale = np.asarray(group_scales[-1][0], np.float32)
            row = wb[i:i + 1]
            q = _round_rows(row, row_scale, fmt)
            out[order[b0 + i]] = q[0]
            e = (row[0] - q[0]) / u[b0 + i, b0 + i]
            err[i] = e
            if i + 1 < b1 - b0:
                wb[i + 1:] -= np.outer(u[b0 + i, b0 + i + 1:b1], e)
        if b1 < k:
            work[b1:] -= u[b0:b1, b1:].T @ err
    return out, (np.concatenate(group_scales, axis=0) if group_scales else None)
