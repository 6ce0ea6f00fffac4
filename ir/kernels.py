"""NumPy kernels for the ops whose semantics are more than one NumPy call.

These are the semantics: the reference interpreter calls them in float64, the
NumPy backend calls them in the graph's dtypes. They are written once, for any
float dtype, and look at the dtype only to pick how precisely to evaluate a
transcendental function (as libm has erf and erff): never what it computes.
"""

from __future__ import annotations

import math

import numpy as np

try:  # scipy's erf is exact to the last bit; math.erf is the fallback.
    from scipy.special import erf as _erf
except ImportError:  # pragma: no cover - scipy is present wherever sklearn is
    _erf = np.frompyfunc(math.erf, 1, 1)


# erf for float32 and narrower: a rational approximation x*P(x^2)/Q(x^2) on
# [-4, 4] (erf is +-1 to float32 precision outside), the one Eigen and XLA use for
# float32 (Eigen's generic_fast_erf_float). Measured against scipy on 2e6 points
# of [-6, 6]: max abs and rel error 4.4e-7 (a few float32 ulp), 2.5x faster than
# scipy's double-precision erf, which dominated GELU in MiniLM.
_ERF32_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
            -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF32_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02)


def erf(x):
    x = np.asarray(x)
    if x.dtype == np.float64:  # the reference interpreter: exact
        return np.asarray(_erf(x)).astype(x.dtype, copy=False)
    x32 = np.clip(x, -4.0, 4.0, dtype=np.float32)
    x2 = x32 * x32
    p = np.full_like(x2, _ERF32_P[0])
    for c in _ERF32_P[1:]:
        p *= x2
        p += c
    q = np.full_like(x2, _ERF32_Q[0])
    for c in _ERF32_Q[1:]:
        q *= x2
        q += c
    p *= x32
    p /= q
    return p.astype(x.dtype, copy=False)


def sigmoid(x):
    # exp of -|x| never overflows; both branches share it.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1 + erf(x * 0.7071067811865476))


def div(a, b):
    """True division for floats; integers truncate toward zero as C, ONNX and torch.trunc do."""
    if np.issubdtype(np.result_type(a, b), np.integer):
        q = np.abs(a) // np.abs(b)
        return np.where((a < 0) != (b < 0), -q, q).astype(np.result_type(a, b))
    return np.divide(a, b)


def pow(a, b):
    out = np.power(a, b)
    return out.astype(np.result_type(a), copy=False)


def mod(a, b, fmod):
    return np.fmod(a, b) if fmod else np.mod(a, b)


def isinf(x, detect_positive, detect_negative):
    return (np.isposinf(x) & bool(detect_positive)) | (np.isneginf(x) & bool(detect_negative))


def argmax(x, axis, keepdims, select_last_index):
    return _arg(np.argmax, x, axis, keepdims, select_last_index)


def argmin(x, axis, keepdims, select_last_index):
    return _arg(np.argmin, x, axis, keepdims, select_last_index)


def _arg(fn, x, axis, keepdims, select_last_index):
    if select_last_index:
        flipped = np.flip(x, axis)
        idx = x.shape[axis] - 1 - fn(flipped, axis=axis, keepdims=keepdims)
    else:
        idx = fn(x, axis=axis, keepdims=keepdims)
    return np.asarray(idx, dtype=np.int64)


def softmax(x, axis):
    # One temporary, reused in place: softmax is memory-bound, and each extra
    # full-size array cost ~15% on MiniLM's attention scores (8x12x128x128).
    e = np.subtract(x, np.max(x, axis=axis, keepdims=True))
    np.exp(e, out=e)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


def layer_norm(x, scale, bias, axis, epsilon):
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = np.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    var = np.mean(centered * centered, axis=axes, keepdims=True)
    y = centered / np.sqrt(var + epsilon)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


def attention(q, k, v, mask, scale, causal):
    """softmax(q k^T * scale + mask) v; a boolean mask keeps where True."""
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * np.asarray(scale, dtype=q.dtype)
    if causal:
        lq, lk = scores.shape[-2], scores.shape[-1]
        keep = np.tril(np.ones((lq, lk), dtype=bool), k=lk - lq)
        scores = np.where(keep, scores, -np.inf)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == np.bool_ else scores + mask
    return np.matmul(softmax(scores, -1), v)


def _window_view(x, kernel, strides, dilations):
    """A strided view (N, C, *out, *kernel) of the spatial windows of x (N, C, *spatial)."""
    nd = len(kernel)
    spatial = x.shape[2:]
    out = [(spatial[i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(nd)]
    s = x.strides
    shape = x.shape[:2] + tuple(out) + tuple(kernel)
    strides_ = s[:2] + tuple(s[2 + i] * strides[i] for i in range(nd)) + tuple(s[2 + i] * dilations[i] for i in range(nd))
    return np.lib.stride_tricks.as_strided(x, shape, strides_, writeable=False)


def _pad_spatial(x, pads, value):
    nd = x.ndim - 2
    widths = [(0, 0), (0, 0)] + [(pads[i], pads[i + nd]) for i in range(nd)]
    if not any(pads):
        return x
    return np.pad(x, widths, constant_values=value)


def conv(x, w, bias, strides, pads, dilations, groups):
    """N-d convolution, NC* layout, weights (M, C/groups, *kernel), as ONNX Conv."""
    nd = x.ndim - 2
    strides, pads, dilations = _window_defaults(nd, strides, pads, dilations)
    xp = _pad_spatial(x, pads, 0)
    windows = _window_view(xp, w.shape[2:], strides, dilations)  # N, C, *out, *k
    n, c = x.shape[:2]
    m = w.shape[0]
    cg, mg = c // groups, m // groups
    outs = []
    letters = "defgh"[:nd]
    kl = "uvwxy"[:nd]
    spec = f"nc{letters}{kl},mc{kl}->nm{letters}"
    for g in range(groups):
        outs.append(np.einsum(spec, windows[:, g * cg:(g + 1) * cg], w[g * mg:(g + 1) * mg], optimize=True))
    y = outs[0] if groups == 1 else np.concatenate(outs, axis=1)
    if bias is not None:
        y = y + bias.reshape((1, m) + (1,) * nd)
    return y


# --- NumPy backend: the empty default of strides/pads/dilations (as the op table
# and the shape rule read it) means 1s, 0s and 1s here too.
def _window_defaults(nd, strides, pads, dilations):
    return tuple(strides) or (1,) * nd, tuple(pads) or (0,) * (2 * nd), tuple(dilations) or (1,) * nd


def _pool_pads(x, kernel, strides, pads, dilations, ceil_mode):
    """Pads (begin..., end...) extended at the end so ceil_mode windows exist."""
    nd = len(kernel)
    pads = list(pads)
    if ceil_mode:
        for i in range(nd):
            size = x.shape[2 + i] + pads[i] + pads[i + nd]
            span = dilations[i] * (kernel[i] - 1) + 1
            out = -(-(size - span) // strides[i]) + 1
            # A window must start inside the input or its left padding.
            if (out - 1) * strides[i] >= x.shape[2 + i] + pads[i]:
                out -= 1
            pads[i + nd] += max(0, (out - 1) * strides[i] + span - size)
    return pads


def max_pool(x, kernel, strides, pads, dilations, ceil_mode):
    strides, pads, dilations = _window_defaults(len(kernel), strides, pads, dilations)
    pads = _pool_pads(x, kernel, strides, pads, dilations, ceil_mode)
    fill = -np.inf if np.issubdtype(x.dtype, np.floating) else np.iinfo(x.dtype).min
    windows = _window_view(_pad_spatial(x, pads, fill), kernel, strides, dilations)
    return np.max(windows, axis=tuple(range(-len(kernel), 0)))


def avg_pool(x, kernel, strides, pads, dilations, ceil_mode, count_include_pad):
    nd = len(kernel)
    strides, pads, dilations = _window_defaults(nd, strides, pads, dilations)
    explicit = list(pads)
    pads = _pool_pads(x, kernel, strides, pads, dilations, ceil_mode)
    axes = tuple(range(-nd, 0))
    sums = np.sum(_window_view(_pad_spatial(x, pads, 0), kernel, strides, dilations), axis=axes)
    # Count what each window covers: the input, plus the explicit padding if asked,
    # never the extra padding that ceil_mode adds.
    ones = np.ones((1, 1) + x.shape[2:], dtype=x.dtype)
    if count_include_pad:
        ones = _pad_spatial(ones, explicit, 1)
        extra = [0] * nd + [pads[i + nd] - explicit[i + nd] for i in range(nd)]
    else:
        extra = pads
    counts = np.sum(_window_view(_pad_spatial(ones, extra, 0), kernel, strides, dilations), axis=axes)
    return sums / counts


def pad(x, pads, mode, value):
    nd = x.ndim
    widths = [(pads[i], pads[i + nd]) for i in range(nd)]
    if mode == "constant":
        return np.pad(x, widths, mode="constant", constant_values=np.asarray(value).astype(x.dtype))
    return np.pad(x, widths, mode={"reflect": "reflect", "edge": "edge", "wrap": "wrap"}[mode])


def split(x, axis, sizes):
    bounds = np.cumsum(sizes)[:-1]
    parts = tuple(np.split(x, bounds, axis=axis))
    # --- passes: a split into one piece has one result, which callers take as a
    # single value, not a 1-tuple (found by tests/test_passes.py).
    return parts[0] if len(parts) == 1 else parts


def cumsum(x, axis, exclusive, reverse):
    if reverse:
        x = np.flip(x, axis)
    y = np.cumsum(x, axis=axis, dtype=x.dtype)
    if exclusive:
        y = y - x
    return np.flip(y, axis) if reverse else y


def gather_elements(x, indices, axis):
    indices = np.where(indices < 0, indices + x.shape[axis], indices)
    return np.take_along_axis(x, indices, axis=axis)


def trilu(x, k, upper):
    return np.triu(x, k) if upper else np.tril(x, k)


# --- kernels added for the ONNX frontend ---


def iota(shape, axis, dtype):
    index = np.arange(shape[axis], dtype=dtype).reshape((-1,) + (1,) * (len(shape) - axis - 1))
    return np.broadcast_to(index, shape)


# Scatter reductions as NumPy ufuncs; "none" assigns (the last of duplicate indices wins).
_SCATTER_UFUNCS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter(x, index, updates, reduction):
    out = np.array(x, copy=True)
    if reduction == "none":
        out[index] = updates
    else:
        _SCATTER_UFUNCS[reduction].at(out, index, updates)
    return out


def scatter_elements(x, indices, updates, axis, reduction):
    index = list(np.indices(indices.shape, sparse=True))
    index[axis] = np.where(indices < 0, indices + x.shape[axis], indices)
    return _scatter(x, tuple(index), updates, reduction)


def scatter_nd(x, indices, updates, reduction):
    index = tuple(np.where(i < 0, i + x.shape[j], i) for j, i in enumerate(np.moveaxis(indices, -1, 0)))
    return _scatter(x, index, updates, reduction)


def cumprod(x, axis, exclusive, reverse):
    if reverse:
        x = np.flip(x, axis)
    y = np.cumprod(x, axis=axis, dtype=x.dtype)
    if exclusive:  # shift by one: the product of the elements strictly before
        y = np.concatenate([np.ones_like(np.take(y, [0], axis=axis)), np.delete(y, -1, axis=axis)], axis=axis)
    return np.flip(y, axis) if reverse else y


def topk(x, k, axis, largest):
    n = x.shape[axis]
    if largest:
        # A stable ascending sort of the reversed axis, read backwards: values descending,
        # equal values by increasing index (no negation, so unsigned and extreme values are safe).
        order = n - 1 - np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
    else:
        order = np.argsort(x, axis=axis, kind="stable")
    idx = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(x, idx, axis=axis), idx.astype(np.int64)
