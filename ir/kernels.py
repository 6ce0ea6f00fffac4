"""NumPy kernels for the ops whose semantics are more than one NumPy call.

These are the semantics: the reference interpreter calls them in float64, the
NumPy backend calls them in the graph's dtypes. They are written once, for any
float dtype, and look at the dtype only to pick how precisely to evaluate a
transcendental function (as libm has erf and erff): never what it computes.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from tilegraph.ir import dtypes
from tilegraph.ir.quant import dequantize, dynamic_quantize, matmul_integer, quantize  # noqa: F401 - op templates

try:  # scipy's erf is exact to the last bit; math.erf is the fallback.
    from scipy.special import erf as _erf
except ImportError:  # pragma: no cover - scipy is present wherever sklearn is
    _erf = np.frompyfunc(math.erf, 1, 1)


# erf for float32 and narrower: erf(a) = tanh(a * P(a^2)) on [-4, 4] (erf is +-1 to
# float32 precision outside), P of degree 6 fitted for tilegraph: least squares on
# atanh(erf(a))/a over 200k points of [0, 4], weighted by (1 - erf^2) a (how an error
# in P moves erf) and reweighted 30 times towards the largest error. In float32 its max
# abs error against scipy is 1.4e-7 on [0, 4] (6e-7 relative near 0): as accurate as
# Eigen's rational x*P(x^2)/Q(x^2) that XLA uses, in 16 NumPy passes instead of 24,
# because NumPy's tanh and exp are vectorised (0.8 ns/element here against 0.3 ns for
# a multiply). Used by K.erf and, via tanh(z) = 2 sigmoid(2z) - 1, by K.gelu.
_ERF32_TANH = (1.1283797054744082, 0.10276548136458284, -0.00018438336189809988, -0.0006257199752547707,
               8.971278670560025e-05, -5.985731764659775e-06, 1.5896309688683545e-07)
# gelu(x) = x * Phi(x) = x / (1 + exp(x * G(x^2))), G(x^2) = -2 P(x^2 / 2) / sqrt(2): the
# same fit with the 1/sqrt(2), the 2 of the sigmoid and its sign folded into the coefficients.
# (Python floats, not NumPy float64 scalars: those would make NumPy compute the f32 passes in f64.)
_GELU32_EXP = tuple(float(-math.sqrt(2.0) * c / 2.0 ** i) for i, c in enumerate(_ERF32_TANH))
_GELU32_CLIP = 4.0 * math.sqrt(2.0)  # x / sqrt(2) = 4: erf is +-1 beyond, and P is fitted up to there


def erf(x, out=None):
    x = np.asarray(x)
    if x.dtype == np.float64:  # the reference interpreter: exact
        return _into(np.asarray(_erf(x)).astype(x.dtype, copy=False), out)
    if out is not None and out.dtype == np.float32:  # (NumPy backend, fused groups) no full-size temporaries
        return _erf32(x, out)
    return _into(_erf32(x, np.empty(x.shape, np.float32)).astype(x.dtype, copy=False), out)


# Elements per block of the f32 gelu: its 18 passes then run over temporaries (three of
# 256 KiB) that stay in a core's L2 instead of streaming a whole activation through memory
# each pass; larger blocks than this stop fitting, smaller ones pay NumPy's per-call cost.
ERF_BLOCK = 1 << 16


def _erf32(x, out):
    """erf of x (any float dtype) into the f32 array `out` (which may be x)."""
    x2 = np.clip(x, -4.0, 4.0, out=np.empty(x.shape, np.float32), dtype=np.float32)
    np.multiply(x2, x2, out=x2)
    # the polynomial in `out` where that is not x (read again below): one temporary, not two
    p = _horner(x2, _ERF32_TANH, out if not np.may_share_memory(out, x) else np.empty_like(x2))
    np.multiply(p, x, out=p)  # x, not the clipped x: beyond the clip tanh keeps saturating
    return np.tanh(p, out=out)


def _horner(x2, coefficients, out):
    """sum(c_i * x2**i) into `out`, in place."""
    p = np.multiply(x2, coefficients[-1], out=out)
    p += coefficients[-2]
    for c in coefficients[-3::-1]:
        p *= x2
        p += c
    return p


def _blocks(x, out, block: int):
    """Pairs of views of x and out (one shape) of about `block` elements each: flat pieces
    where both are contiguous, else slices along the first axis (a column window of a
    fused group's buffer has contiguous rows), else the whole arrays."""
    if x.shape != out.shape or out.ndim == 0:
        return [(x, out)]
    if x.flags.c_contiguous and out.flags.c_contiguous:
        xf, of = x.reshape(-1), out.reshape(-1)
        return [(xf[i:i + block], of[i:i + block]) for i in range(0, of.size, block)]
    step = max(1, block // max(1, out.size // out.shape[0]))
    return [(x[i:i + step], out[i:i + step]) for i in range(0, out.shape[0], step)]


def _into(value, out):
    if out is None:
        return value
    out[...] = value
    return out


def sigmoid(x):
    # exp of -|x| never overflows; both branches share it.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def gelu(x, approximate, out=None):
    # Out of place, each formula in one array besides x (erf's own two f32 temporaries aside), in
    # the order of 0.5 * x * (1 + ...): x * 0.5 last is exact, so the numbers are the same.
    if approximate == "tanh":
        t = np.asarray(np.multiply(x, 0.044715))  # (an array even for a 0-d x: written in place)
        t *= x
        t *= x
        t += x
        t *= 0.7978845608028654
        np.tanh(t, out=t)
        t += 1
        t *= x
        t *= 0.5
        return _into(t, out)
    if out is None or out.dtype != np.float32:
        t = erf(np.multiply(x, 0.7071067811865476))
        t += 1
        t *= x
        t *= 0.5
        return _into(t, out)
    # (NumPy backend, fused groups) the same formula in place, x possibly out itself,
    # a block of about ERF_BLOCK elements at a time.
    pairs = _blocks(np.asarray(x), out, ERF_BLOCK)
    scratch = [np.empty(pairs[0][1].shape, np.float32) for _ in range(3)]
    for xs, os_ in pairs:
        t, x2, p = [a[:len(os_)] for a in scratch] if len(pairs) > 1 else scratch
        np.clip(xs, -_GELU32_CLIP, _GELU32_CLIP, out=t)
        np.multiply(t, t, out=x2)
        _horner(x2, _GELU32_EXP, p)
        p *= xs  # (not t: beyond the clip the sigmoid keeps saturating, gelu(-3e38) is -0)
        np.exp(p, out=p)
        p += 1
        np.divide(xs, p, out=os_)
    return out


def negative(x, out=None):
    """np.negative(x), computed as the product with -1.

    NumPy 2.1 to 2.4 (at least 2.4.6, x86 with AVX-512) has a SIMD negative loop that
    reads a strided input as if it were contiguous when the output is strided too:
    4-byte dtypes at an input stride of 4 elements, 8-byte ones at 8. A chunk of a
    [1, 2, 4, 1] buffer cut along axis 2 is such a view (hypothesis found it).
    The product gives the same value on every path, -0.0, infinities and integer
    wrap-around included. Booleans still go to np.negative, which refuses them.
    """
    dtype = np.result_type(x)
    if dtype == np.bool_:
        return np.negative(x, out=out)
    return np.multiply(x, np.array(-1).astype(dtype), out=out)


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


def row_max(x, axis):
    """The max over `axis` (keepdims) that softmax shifts by. np.fmax.reduce, not np.max:
    1.6x faster over rows of 128 here (NumPy's max checks for NaN element by element).
    It skips NaN, but a row holding a NaN comes out all NaN anyway: x - max keeps that
    NaN, and the row's sum carries it to every element."""
    return np.fmax.reduce(x, axis=axis, keepdims=True)


def softmax(x, axis, out=None):
    # One temporary, reused in place: softmax is memory-bound, and each extra
    # full-size array cost ~15% on MiniLM's attention scores (8x12x128x128).
    e = np.subtract(x, row_max(x, axis), out=out)
    np.exp(e, out=e)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


def layer_norm(x, scale, bias, axis, epsilon, out=None):
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = np.mean(x, axis=axes, keepdims=True)
    centered = np.subtract(x, mean, out=out)  # x may be out: nothing reads x after this
    var = np.mean(centered * centered, axis=axes, keepdims=True)
    var += epsilon
    y = np.divide(centered, np.sqrt(var, out=var), out=centered)
    if scale is not None:
        y = np.multiply(y, scale, out=y) if np.result_type(y, scale) == y.dtype else y * scale
    if bias is not None:
        y = np.add(y, bias, out=y) if np.result_type(y, bias) == y.dtype else y + bias
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


def attention_grad(q, k, v, gy, mask, scale, causal):
    """(dq, dk, dv) of attention(q, k, v, mask, scale, causal) given gy, its result's cotangent:
    the probabilities recomputed, then dS = P (dP - rowsum(P dP)). One batch row (head) at a
    time, so the Lq x Lk temporaries are one head's, not the batch's."""
    batch = q.shape[:-2]
    lq, lk = q.shape[-2], k.shape[-2]
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    keep = np.tril(np.ones((lq, lk), dtype=bool), k=lk - lq) if causal else None
    full = None if mask is None else np.broadcast_to(mask, batch + (lq, lk))
    dt = np.asarray(scale, dtype=q.dtype)
    for i in np.ndindex(*batch):
        s = np.matmul(q[i], k[i].T) * dt
        if keep is not None:
            s = np.where(keep, s, -np.inf)
        if full is not None:
            s = np.where(full[i], s, -np.inf) if full.dtype == np.bool_ else s + full[i]
        p = softmax(s, -1)
        dv[i] = np.matmul(p.T, gy[i])
        dp = np.matmul(gy[i], v[i].T)
        ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True)) * dt
        dq[i] = np.matmul(ds, k[i])
        dk[i] = np.matmul(ds.T, q[i])
    return dq, dk, dv


def _window_view(x, kernel, strides, dilations, counts=None):
    """A strided view (N, C, *out, *kernel) of the spatial windows of x (N, C, *spatial); at
    most `counts` windows per spatial dim when given (a pool's, _pool_pads)."""
    nd = len(kernel)
    spatial = x.shape[2:]
    out = [(spatial[i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(nd)]
    if counts is not None:
        out = [min(o, c) for o, c in zip(out, counts)]
    s = x.strides
    shape = x.shape[:2] + tuple(out) + tuple(kernel)
    strides_ = s[:2] + tuple(s[2 + i] * strides[i] for i in range(nd)) + tuple(s[2 + i] * dilations[i] for i in range(nd))
    return np.lib.stride_tricks.as_strided(x, shape, strides_, writeable=False)


def _pad_spatial(x, pads, value):
    """x with its spatial axes padded by `value` (pads: begins, then ends). A filled array
    and one slice assignment: a third of np.pad's time on the small CNN's 32x3x16x16."""
    nd = x.ndim - 2
    if not any(pads):
        return x
    shape = x.shape[:2] + tuple(x.shape[2 + i] + pads[i] + pads[i + nd] for i in range(nd))
    out = np.full(shape, value, x.dtype)
    out[(..., *(slice(pads[i], pads[i] + x.shape[2 + i]) for i in range(nd)))] = x
    return out


def conv(x, w, bias, strides, pads, dilations, groups, out=None):
    """N-d convolution, NC* layout, weights (M, C/groups, *kernel), as ONNX Conv.

    im2col laid out (N, groups, C/groups * kernel, positions), so the copy walks each
    window offset's rows contiguously, then one batched GEMM per image and group whose
    result is already NC*. On the small CNN's 32x3x16x16 conv with 8 3x3 filters:
    0.3 ms, against 0.9-1.3 ms for one einsum over the window view.
    """
    nd = x.ndim - 2
    strides, pads, dilations = _window_defaults(nd, strides, pads, dilations)
    xp = _pad_spatial(x, pads, 0)
    windows = _window_view(xp, w.shape[2:], strides, dilations)  # N, C, *out, *k
    n, c = x.shape[:2]
    m = w.shape[0]
    spatial = windows.shape[2:2 + nd]
    taps = int(np.prod(w.shape[2:], dtype=np.int64))
    positions = int(np.prod(spatial, dtype=np.int64))
    perm = (0, 1) + tuple(range(2 + nd, 2 + 2 * nd)) + tuple(range(2, 2 + nd))  # N, C, *k, *out
    cols = np.ascontiguousarray(windows.transpose(perm)).reshape(n, groups, c // groups * taps, positions)
    dtype = np.result_type(x, w)
    if out is None:
        out = np.empty((n, m) + spatial, dtype)
    # (N, groups, M/groups, positions): a view of `out` when it is contiguous, else a temporary
    result = out.reshape(n, groups, m // groups, positions) if out.flags.c_contiguous else None
    y = np.matmul(w.reshape(groups, m // groups, c // groups * taps).astype(dtype, copy=False), cols, out=result)
    if result is None:
        out[...] = y.reshape(out.shape)
    if bias is not None:
        np.add(out, bias.reshape((1, m) + (1,) * nd), out=out)
    return out


# --- NumPy backend: the empty default of strides/pads/dilations (as the op table
# and the shape rule read it) means 1s, 0s and 1s here too.
def _window_defaults(nd, strides, pads, dilations):
    return tuple(strides) or (1,) * nd, tuple(pads) or (0,) * (2 * nd), tuple(dilations) or (1,) * nd


def _pool_pads(x, kernel, strides, pads, dilations, ceil_mode):
    """Pads (begin..., end...) extended at the end so ceil_mode windows exist, and the number
    of windows per spatial dim (the shape rule's, as ONNX counts them). With ceil_mode the last
    window must start inside the input or its left padding: where the end pad is wider than a
    window, the padded input holds more windows than that (found by fault seeding's fault 21:
    the kernel returned a longer result than the op's type), so the count is kept apart."""
    nd = len(kernel)
    pads = list(pads)
    counts = []
    for i in range(nd):
        size = x.shape[2 + i] + pads[i] + pads[i + nd]
        span = dilations[i] * (kernel[i] - 1) + 1
        out = (size - span) // strides[i] + 1
        if ceil_mode:
            out = -(-(size - span) // strides[i]) + 1
            # A window must start inside the input or its left padding.
            if (out - 1) * strides[i] >= x.shape[2 + i] + pads[i]:
                out -= 1
            pads[i + nd] += max(0, (out - 1) * strides[i] + span - size)
        counts.append(out)
    return pads, counts


def max_pool(x, kernel, strides, pads, dilations, ceil_mode, out=None):
    strides, pads, dilations = _window_defaults(len(kernel), strides, pads, dilations)
    pads, counts = _pool_pads(x, kernel, strides, pads, dilations, ceil_mode)
    fill = np.iinfo(x.dtype).min if np.issubdtype(x.dtype, np.integer) else -np.inf  # ml_dtypes floats too
    return _window_reduce(_pad_spatial(x, pads, fill), kernel, strides, dilations, np.maximum, counts, out)


def _window_reduce(xp, kernel, strides, dilations, ufunc, counts, out=None):
    """ufunc-reduce every window (`counts` of them per spatial dim): one call per kernel offset
    over a strided view of all windows. np.max over the window axes of the same view walks a
    6-d strided view and was 25x slower (1.5 ms against 63 us for a 32x8x16x16 2x2 max pool)."""
    windows = _window_view(xp, kernel, strides, dilations, counts)  # N, C, *out, *k
    offsets = itertools.product(*(range(k) for k in kernel))
    first = windows[(..., *next(offsets))]
    if out is None:
        acc = np.array(first)
    else:
        acc = out
        np.copyto(acc, first)
    for offset in offsets:
        ufunc(acc, windows[(..., *offset)], out=acc)
    return acc


def avg_pool(x, kernel, strides, pads, dilations, ceil_mode, count_include_pad, out=None):
    nd = len(kernel)
    strides, pads, dilations = _window_defaults(nd, strides, pads, dilations)
    explicit = list(pads)
    pads, windows = _pool_pads(x, kernel, strides, pads, dilations, ceil_mode)
    sums = _window_reduce(_pad_spatial(x, pads, 0), kernel, strides, dilations, np.add, windows, out)
    if not any(pads):  # every window lies inside x and counts all its taps
        return np.divide(sums, math.prod(kernel), out=sums, casting="unsafe")
    # Count what each window covers: the input, plus the explicit padding if asked,
    # never the extra padding that ceil_mode adds.
    ones = np.ones((1, 1) + x.shape[2:], dtype=x.dtype)
    if count_include_pad:
        ones = _pad_spatial(ones, explicit, 1)
        extra = [0] * nd + [pads[i + nd] - explicit[i + nd] for i in range(nd)]
    else:
        extra = pads
    counts = _window_reduce(_pad_spatial(ones, extra, 0), kernel, strides, dilations, np.add, windows)
    # In place, in x's dtype: integer averages truncate, as assigning the quotient would.
    return np.divide(sums, counts, out=sums, casting="unsafe")


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


def _scan_of_scalar(scan):
    """A scan of a rank-0 value (axis 0, as torch takes it) is the scan of its one element, and
    rank-0 again: np.cumsum and np.cumprod return it 1-d, one dim more than the op's type."""
    def run(x, axis, exclusive, reverse):
        if np.ndim(x) == 0:
            return scan(np.reshape(x, (1,)), 0, exclusive, reverse).reshape(())
        return scan(x, axis, exclusive, reverse)
    return run


@_scan_of_scalar
def cumsum(x, axis, exclusive, reverse):
    if reverse:
        x = np.flip(x, axis)
    y = np.cumsum(x, axis=axis, dtype=x.dtype)
    if exclusive:
        y = y - x
    return np.flip(y, axis) if reverse else y


def gather_elements(x, indices, axis):
    """out[..., i, ...] = x[..., indices[..., i, ...], ...] along `axis`; off the axis, position
    i of the indices reads position i of x (np.take_along_axis would broadcast shorter indices
    to x's length, one result per data position, not per index)."""
    if indices.shape[:axis] + indices.shape[axis + 1:] != x.shape[:axis] + x.shape[axis + 1:]:
        if any(n > d for i, (n, d) in enumerate(zip(indices.shape, x.shape)) if i != axis):
            raise IndexError(f"gather_elements: indices {indices.shape} are longer than the data {x.shape} off "
                             f"axis {axis}")
        x = x[tuple(slice(None) if i == axis else slice(0, n) for i, n in enumerate(indices.shape))]
    indices = np.where(indices < 0, indices + x.shape[axis], indices)
    return np.take_along_axis(x, indices, axis=axis)


def trilu(x, k, upper):
    return np.triu(x, k) if upper else np.tril(x, k)


# --- kernels added for the ONNX frontend ---


def bitcast(x, source, to):
    bits = np.ascontiguousarray(np.asarray(x).astype(dtypes.numpy_dtype(source)))
    return bits.view(dtypes.numpy_dtype(to)).reshape(np.shape(x))


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


@_scan_of_scalar
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


# --- data-dependent sizes (ir/ops.py: nonzero, unique, narrow) ---


def nonzero(x):
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


def unique(x, flatten, axis, sorted_):
    """ONNX Unique: values, first-occurrence indices, inverse indices, counts (i64)."""
    axis = None if flatten else axis % x.ndim
    values, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True,
                                               axis=axis)
    inverse = inverse.reshape(-1)
    if not sorted_:  # in order of first occurrence, as ONNX's reference reorders np.unique's
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        values = np.take(values, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    return values, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)


def narrow(x, length, axis):
    n = min(max(int(length), 0), x.shape[axis])
    return x[(slice(None),) * axis + (slice(0, n),)]


def non_max_suppression(boxes, scores, max_output, iou_threshold, score_threshold, center_point_box):
    """ONNX NonMaxSuppression, as onnx's reference computes it: IoU in float32 whatever the
    arrays arrive in (the float64 interpreter selects the same boxes as a float32 backend)."""
    boxes, scores = np.asarray(boxes, np.float32), np.asarray(scores, np.float32)
    keep_most = 0 if max_output is None else max(int(np.asarray(max_output).reshape(-1)[0]), 0)
    iou_limit = np.float32(0 if iou_threshold is None else np.asarray(iou_threshold).reshape(-1)[0])
    rows = []
    for b in range(boxes.shape[0]):
        box = boxes[b]
        if center_point_box:
            half = box[:, 2:] / np.float32(2)
            xs, ys = (box[:, 0] - half[:, 0], box[:, 0] + half[:, 0]), (box[:, 1] - half[:, 1], box[:, 1] + half[:, 1])
        else:  # [y1, x1, y2, x2], either corner first
            xs = (np.minimum(box[:, 1], box[:, 3]), np.maximum(box[:, 1], box[:, 3]))
            ys = (np.minimum(box[:, 0], box[:, 2]), np.maximum(box[:, 0], box[:, 2]))
        area = (xs[1] - xs[0]) * (ys[1] - ys[0])
        for c in range(scores.shape[1]):
            s = scores[b, c]
            candidates = np.arange(len(s)) if score_threshold is None else \
                np.flatnonzero(s > np.float32(np.asarray(score_threshold).reshape(-1)[0]))
            # by falling score, equal scores by rising index (the reference's order)
            candidates = candidates[np.lexsort((candidates, -s[candidates]))]
            kept: list[int] = []
            for i in candidates:
                if len(kept) >= keep_most:
                    break
                k = np.array(kept, dtype=np.int64)
                w = np.minimum(xs[1][k], xs[1][i]) - np.maximum(xs[0][k], xs[0][i])
                h = np.minimum(ys[1][k], ys[1][i]) - np.maximum(ys[0][k], ys[0][i])
                inter = w * h
                union = area[k] + area[i] - inter
                with np.errstate(all="ignore"):
                    overlap = (w > 0) & (h > 0) & (inter > 0) & (area[k] > 0) & (area[i] > 0) & (union > 0) & \
                        (inter / union > iou_limit)
                if not overlap.any():
                    kept.append(int(i))
                    rows.append((b, c, int(i)))
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


# --- recurrences (ir/ops.py: rnn) ---


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def rnn(x, w, r, bias, h0, c0, peephole, cell, reverse, clip, linear_before_reset):
    """One direction of ONNX RNN/GRU/LSTM with its default activations, a loop over the steps."""
    steps, batch, _ = x.shape
    hidden = r.shape[1]
    gh = r.shape[0]
    bias = np.zeros(2 * gh, x.dtype) if bias is None else bias
    xw = np.matmul(x, w.T) + bias[:gh]  # every step's input projection at once
    rb = bias[gh:]
    h = np.zeros((batch, hidden), x.dtype) if h0 is None else h0
    c = np.zeros((batch, hidden), x.dtype) if c0 is None else c0
    clipped = (lambda v: v) if not clip else (lambda v: np.clip(v, -clip, clip))
    ys = np.empty((steps, batch, hidden), x.dtype)
    for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
        if cell == "rnn":
            h = np.tanh(clipped(xw[t] + h @ r.T + rb))
        elif cell == "lstm":
            g = xw[t] + h @ r.T + rb
            i, o, f, z = (g[:, k * hidden:(k + 1) * hidden] for k in range(4))
            if peephole is not None:
                i, f = i + peephole[:hidden] * c, f + peephole[2 * hidden:] * c
            i, f = _sigmoid(clipped(i)), _sigmoid(clipped(f))
            c = f * c + i * np.tanh(clipped(z))
            if peephole is not None:
                o = o + peephole[hidden:2 * hidden] * c
            h = _sigmoid(clipped(o)) * np.tanh(c)
        else:  # gru: update z, reset r, hidden gate
            rz, rr, rh = (r[k * hidden:(k + 1) * hidden] for k in range(3))
            bz, br, bh = (rb[k * hidden:(k + 1) * hidden] for k in range(3))
            xz, xr, xh = (xw[t][:, k * hidden:(k + 1) * hidden] for k in range(3))
            z = _sigmoid(clipped(xz + h @ rz.T + bz))
            reset = _sigmoid(clipped(xr + h @ rr.T + br))
            inner = reset * (h @ rh.T + bh) if linear_before_reset else (reset * h) @ rh.T + bh
            h = (1 - z) * np.tanh(clipped(xh + inner)) + z * h
        ys[t] = h
    return (ys, h, c) if cell == "lstm" else (ys, h)


def assert_size(x, axis, size):
    if x.shape[axis] != size:
        from tilegraph.ir.shapes import ShapeError

        raise ShapeError(f"a run-time size is {x.shape[axis]} where the model was built for {size} "
                         f"(dim {axis} of a value of shape {x.shape})")
    return x


# --- generation: block-format weights, the KV cache, RMSNorm, RoPE ---------------------------
# (block_matmul and block_gather are ir/block_formats.py's, where each format is described.)
from tilegraph.ir.block_formats import block_gather, block_matmul  # noqa: E402,F401 - op templates


class CachePositionError(IndexError):
    """A cache position outside the cache (pos < 0 or pos + T past its length)."""


def _positions(pos, batch: int, steps: int, length: int) -> np.ndarray:
    """pos (a scalar or one per sequence) as int64[batch], each checked: [pos, pos + steps) in the cache."""
    p = np.broadcast_to(np.asarray(pos, dtype=np.int64).reshape(-1), (batch,))
    if p.size and (p.min() < 0 or p.max() + steps > length):
        raise CachePositionError(f"cache positions {p.tolist()} + {steps} new entries fall outside the cache of "
                                 f"{length} positions")
    return p


def cache_write(cache, x, pos, store=""):
    """cache[b, :, pos_b : pos_b + T] = x[b], in place: the result is `cache` itself (its
    operand is donated, as XLA's aliased buffers), so nothing of the cache is copied.
    store='f16': x rounded to f16 first (the cache's type: the interpreter's cache is widened)."""
    b, _, t, _ = x.shape
    if store:
        x = np.asarray(x).astype(dtypes.numpy_dtype(store))
    p = _positions(pos, b, t, cache.shape[2])
    if p.size and (p == p[0]).all():
        cache[:, :, p[0]:p[0] + t] = x
    else:
        for i in range(b):
            cache[i, :, p[i]:p[i] + t] = x[i]
    return cache


def cache_attention(q, k_cache, v_cache, pos, scale, window=0):
    """Causal grouped-query attention of the T new queries q[B, H, T, D] over the cache:
    query t of sequence b (at position p = pos_b + t) attends to cache positions 0..p, or with
    a sliding window (window > 0) to the `window` positions p - window + 1..p.
    Query head h reads K/V head h // (H / Hkv), never a repeated copy."""
    b, h, t, _ = q.shape
    hkv = k_cache.shape[1]
    group = h // hkv
    p = _positions(pos, b, t, k_cache.shape[2])
    out = np.empty(q.shape[:3] + (v_cache.shape[-1],), np.result_type(q, v_cache))
    for i in range(b):
        n = int(p[i]) + t
        qi = q[i].reshape(hkv, group * t, q.shape[-1])  # the group's query heads share their K/V head
        scores = np.matmul(qi, np.swapaxes(k_cache[i, :, :n], -1, -2)) * np.asarray(scale, dtype=qi.dtype)
        at = (p[i] + np.arange(t))[:, None]  # [T, 1]: each query's position
        keep = np.arange(n)[None, :] <= at  # [T, n]
        if window > 0:
            keep &= np.arange(n)[None, :] > at - window
        scores = np.where(np.tile(keep, (group, 1))[None], scores, -np.inf)
        out[i] = np.matmul(softmax(scores, -1), v_cache[i, :, :n]).reshape(h, t, -1)
    return out


def rms_norm(x, scale, axis, epsilon):
    """x / sqrt(mean(x^2 over dims axis..) + epsilon) * scale."""
    axes = tuple(range(axis % x.ndim, x.ndim))
    ms = np.mean(np.square(x), axis=axes, keepdims=True)
    ms += np.asarray(epsilon, dtype=ms.dtype)
    y = x / np.sqrt(ms)
    return y if scale is None else y * scale


def rope(x, cos, sin):
    """Rotary embedding, the two halves of the last dim rotated as pairs (i, i + D/2), as
    GPT-NeoX and transformers' rotate_half: [x1 cos - x2 sin, x2 cos + x1 sin]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


PHILOX_M, PHILOX_W = 0xD256D193, 0x9E3779B9  # Philox2x32's multiplier and Weyl key step (Random123)
MASK32 = 0xFFFFFFFF


def philox_bits(seed, site: int, n: int) -> np.ndarray:
    """Philox2x32-10 of counters (i mod 2^32, site ^ (i >> 32) << 16), i = 0..n-1, under the key of
    seed's two halves xored: n uint32s, a pure function of (seed, site, i) (tg.dropout's doc)."""
    s = int(np.asarray(seed).astype(np.int64)) & ((1 << 64) - 1)
    key = np.uint64((s ^ (s >> 32)) & MASK32)
    i = np.arange(n, dtype=np.uint64)
    c0 = i & np.uint64(MASK32)
    c1 = (np.uint64(site & MASK32) ^ ((i >> np.uint64(32)) << np.uint64(16))) & np.uint64(MASK32)
    for _ in range(10):
        prod = c0 * np.uint64(PHILOX_M)  # both factors below 2^32: the product fits in 64 bits
        c0, c1 = (prod >> np.uint64(32)) ^ key ^ c1, prod & np.uint64(MASK32)
        key = (key + np.uint64(PHILOX_W)) & np.uint64(MASK32)
    return c0.astype(np.uint32)


def dropout_keep(seed, site: int, p: float, shape) -> np.ndarray:
    """Which elements of a tensor of `shape` tg.dropout keeps (bool, row-major counters)."""
    threshold = np.uint32(math.floor(p * 2.0 ** 32))
    return (philox_bits(seed, site, math.prod(shape)) >= threshold).reshape(shape)


def dropout(x, seed, p, site):
    x = np.asarray(x)
    scale = np.asarray(1.0 / (1.0 - p), x.dtype)
    return np.where(dropout_keep(seed, site, p, x.shape), x * scale, np.zeros((), x.dtype))


def sample(logits, seen, u, temperature, top_k, top_p, repetition_penalty):
    """One token per row of logits [B, vocab] (tg.sample's doc in ir/ops.py says how)."""
    x = np.array(logits)
    if repetition_penalty != 1.0:
        x = np.where(np.asarray(seen) != 0, np.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
    if temperature == 0:
        return x.argmax(axis=-1).astype(np.int64)
    x = x / np.asarray(temperature, x.dtype)
    vocab = x.shape[-1]
    if top_k and top_k < vocab:
        kth = np.partition(x, -top_k, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")  # most likely first, ties by index
        ranked = np.take_along_axis(p, order, axis=-1)
        keep = np.zeros(p.shape, bool)
        np.put_along_axis(keep, order, np.cumsum(ranked, axis=-1) - ranked < top_p, axis=-1)
        p = np.where(keep, p, 0.0)
    cdf = np.cumsum(p, axis=-1)
    target = np.asarray(u, cdf.dtype).reshape(-1, 1) * cdf[:, -1:]
    return np.minimum((cdf <= target).sum(axis=-1), vocab - 1).astype(np.int64)
