"""Converters: Resize and GridSample, as gathers of taps and weighted sums."""

from __future__ import annotations

import itertools
import math

import numpy as np

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import _axis, _conv
from tilegraph.ir import dtypes
from tilegraph.ir.shapes import numel


# --- Resize: per axis, a gather of the taps and a weighted sum, taps and weights computed here ---


def _resize_source(ctm: str, out_idx: np.ndarray, scale: float, in_w: int, out_w: int, roi) -> np.ndarray:
    """Output index -> source coordinate, per coordinate_transformation_mode (ONNX Resize spec)."""
    length = scale * in_w  # the un-rounded output length the spec's formulas use
    if ctm == "half_pixel":
        return (out_idx + 0.5) / scale - 0.5
    if ctm == "half_pixel_symmetric":
        offset = in_w / 2 * (1 - out_w / length)
        return offset + (out_idx + 0.5) / scale - 0.5
    if ctm == "pytorch_half_pixel":
        return (out_idx + 0.5) / scale - 0.5 if length != 1 else np.full(out_w, -0.5)
    if ctm == "align_corners":
        return out_idx * (in_w - 1) / (length - 1) if length != 1 else np.zeros(out_w)
    if ctm == "asymmetric":
        return out_idx / scale
    if ctm == "tf_crop_and_resize":
        lo, hi = roi
        if length == 1:
            return np.full(out_w, (hi - lo) * (in_w - 1) / 2 + lo * (in_w - 1))
        return out_idx * (hi - lo) * (in_w - 1) / (length - 1) + lo * (in_w - 1)
    raise FrontendError(f"coordinate_transformation_mode '{ctm}' is not supported")


def _resize_coeffs(mode: str, ratio: float, scale: float, a: float, antialias: bool, nearest: str) -> list[float]:
    """Interpolation weights of the taps around a source coordinate with fractional part `ratio`."""
    if mode == "nearest":
        if ratio == 1.0:
            return [0.0, 1.0]
        pick_high = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5,
                     "floor": False, "ceil": True}[nearest]
        return [0.0, 1.0] if pick_high else [1.0, 0.0]
    if mode == "linear" and not antialias:
        return [1 - ratio, ratio]
    if mode == "cubic" and not antialias:
        r1, r2 = ratio + 1, 2 - ratio
        return [((a * r1 - 5 * a) * r1 + 8 * a) * r1 - 4 * a, ((a + 2) * ratio - (a + 3)) * ratio * ratio + 1,
                ((a + 2) * (1 - ratio) - (a + 3)) * (1 - ratio) * (1 - ratio) + 1,
                ((a * r2 - 5 * a) * r2 + 8 * a) * r2 - 4 * a]
    # antialiased: the kernel stretched by 1/scale when downsampling, weights normalized
    s = min(scale, 1.0)
    if mode == "linear":
        start = int(np.floor(-1 / s) + 1)
        w = np.clip(1 - np.abs((np.arange(start, 2 - start) - ratio) * s), 0, 1)
    else:
        def cubic(t):
            t = abs(t)
            if t <= 1:
                return (a + 2) * t ** 3 - (a + 3) * t ** 2 + 1
            return a * t ** 3 - 5 * a * t ** 2 + 8 * a * t - 4 * a if t < 2 else 0.0

        start = int(np.floor(-2 / s) + 1)
        w = np.array([cubic(s * (i - ratio)) for i in range(start, 2 - start)])
    return list(w / w.sum())


def _resize_taps(n, in_w: int, out_w: int, scale: float, roi) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(indices (out, taps) into the input, weights (out, taps), extrapolated rows or None) for one axis."""
    mode = n.attr("mode", "nearest")
    ctm = n.attr("coordinate_transformation_mode", "half_pixel")
    x = _resize_source(ctm, np.arange(out_w, dtype=np.float64), scale, in_w, out_w, roi)
    base = np.floor(x).astype(np.int64)
    ratios = np.where(x == base, 1.0, x - base)
    coeffs = np.array([_resize_coeffs(mode, float(r), scale, n.attr("cubic_coeff_a", -0.75),
                                      bool(n.attr("antialias", 0)), n.attr("nearest_mode", "round_prefer_floor"))
                       for r in ratios], dtype=np.float64).reshape(out_w, -1)
    taps = coeffs.shape[1]
    # The taps are the `taps` nearest integer positions, preferring lower ones on ties.
    pad = -(-taps // 2)
    p = np.floor(x + pad).astype(np.int64)
    frac = x + pad - p
    if taps % 2 == 0:
        offset = np.where(frac == 0, -(taps // 2), -(taps // 2) + 1)
    else:
        offset = np.where(frac <= 0.5, -((taps - 1) // 2), -((taps - 1) // 2) + 1)
    idx = (p + offset - pad)[:, None] + np.arange(taps)[None, :]
    if n.attr("exclude_outside", 0):
        coeffs = np.where((idx < 0) | (idx >= in_w), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    extrapolated = ((x < 0) | (x > in_w - 1)) if ctm == "tf_crop_and_resize" else None
    return np.clip(idx, 0, in_w - 1), coeffs, extrapolated


@_conv("Resize")
def _resize(n):
    x = n.x(0)
    shape = n.shape(x)
    r = len(shape)
    axes = [_axis(a, r) for a in n.attr("axes", range(r))]
    roi, scales, sizes = n.static(1), n.static(2), n.static(3)
    roi = None if roi is None or roi.size == 0 else [float(v) for v in roi.reshape(-1)]
    out = list(shape)
    factors = [1.0] * r
    if sizes is not None and sizes.size:
        for i, a in enumerate(axes):
            out[a] = int(sizes.reshape(-1)[i])
        if not all(isinstance(shape[a], int) and shape[a] > 0 for a in axes):
            raise FrontendError(f"resized dims must be static and non-empty, got {shape}")
        factors = [out[a] / shape[a] if a in axes else 1.0 for a in range(r)]
        policy = n.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            common = (min if policy == "not_larger" else max)(factors[a] for a in axes)
            for a in axes:
                factors[a] = common
                out[a] = int(common * shape[a] + 0.5)  # round half up (ONNX spec)
    elif scales is not None and scales.size:
        for i, a in enumerate(axes):
            factors[a] = float(scales.reshape(-1)[i])
            if not isinstance(shape[a], int):
                raise FrontendError(f"resized dims must be static, got {shape}")
            out[a] = int(factors[a] * shape[a])
    else:
        raise FrontendError("Resize needs scales or sizes")
    mode = n.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        raise FrontendError(f"Resize mode '{mode}' is not supported")
    if mode != "nearest" and not dtypes.is_float(n.dtype(x)):
        raise FrontendError(f"Resize mode '{mode}' needs a float input")
    for k, a in enumerate(axes):
        pair = (roi[k], roi[k + len(axes)]) if roi is not None else (0.0, 1.0)
        if math.isclose(factors[a], 1.0) and out[a] == shape[a] and \
                math.isclose(pair[0], 0.0) and math.isclose(pair[1], 1.0):
            continue
        idx, coeffs, extrapolated = _resize_taps(n, shape[a], out[a], factors[a], pair)
        if mode == "nearest":
            x = n.op("gather", x, idx[np.arange(out[a]), np.argmax(coeffs, axis=1)], axis=a)
        else:
            dt = dtypes.numpy_dtype(n.dtype(x))
            gathered = n.op("gather", x, idx, axis=a)  # (..., out, taps, ...)
            w = coeffs.astype(dt).reshape(coeffs.shape + (1,) * (r - a - 1))
            x = n.reduce("sum", n.op("mul", gathered, w), [a + 1], False)
        if extrapolated is not None and extrapolated.any():
            mask = extrapolated.reshape((out[a],) + (1,) * (r - a - 1))
            x = n.op("where", mask, float(n.attr("extrapolation_value", 0.0)), x)
    return x


# --- GridSample, as gathers of taps ---

# Keys' cubic convolution parameter ONNX and torch use for bicubic sampling.
CUBIC_ALPHA = -0.75


def _cubic_weights(n, t):
    """Keys' weights of the taps at -1, 0, 1, 2 for fractional offset t (t in [0, 1))."""
    a = CUBIC_ALPHA

    def near(x):  # |x| <= 1
        return n.op("add", n.op("mul", n.op("mul", n.op("sub", n.op("mul", x, a + 2), a + 3), x), x), 1)

    def far(x):  # 1 < |x| < 2
        inner = n.op("add", n.op("mul", n.op("sub", n.op("mul", x, a), 5 * a), x), 8 * a)
        return n.op("sub", n.op("mul", inner, x), 4 * a)

    one_minus = n.op("sub", 1, t)
    return [far(n.op("add", t, 1)), near(t), near(one_minus), far(n.op("add", one_minus, 1))]


def _reflect(n, x, lo: float, hi: float):
    """Reflect x into [lo, hi] by its borders, as many times as it takes (ONNX's _gs_reflect)."""
    span = hi - lo
    below = n.op("lt", x, lo)
    dx = n.op("where", below, n.op("sub", lo, x), n.op("sub", x, hi))
    k = n.op("floor", n.op("div", dx, span))
    r = n.op("sub", dx, n.op("mul", k, span))
    even = n.op("eq", n.op("mod", k, 2.0), 0.0)
    from_lo, from_hi = n.op("add", r, lo), n.op("sub", hi, r)
    reflected = n.op("where", below, n.op("where", even, from_lo, from_hi), n.op("where", even, from_hi, from_lo))
    return n.op("where", n.op("or", below, n.op("gt", x, hi)), reflected, x)


@_conv("GridSample")
def _grid_sample(n):
    """Each output point is a weighted sum of taps of X: 1 (nearest), 2 (linear) or 4 (cubic) per
    spatial dim, their indices and weights computed from the grid at run time and the taps read
    with gather_elements over X's flattened spatial dims."""
    x, grid = n.x(0), n.x(1)
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(n.attr("mode", "linear"), n.attr("mode", "linear"))
    padding = n.attr("padding_mode", "zeros")
    corners = bool(n.attr("align_corners", 0))
    if mode not in ("nearest", "linear", "cubic") or padding not in ("zeros", "border", "reflection"):
        raise FrontendError(f"mode '{mode}' with padding_mode '{padding}' is not supported")
    batch, channels, *dims = n.shape(x)
    out = n.shape(grid)[1:-1]
    r = len(dims)
    if not all(isinstance(d, int) for d in dims) or n.shape(grid)[-1] != r:
        raise FrontendError(f"X's spatial dims {dims} must be static and match the grid's last dim")
    dt = n.dtype(x)
    g = n.cast(grid, dt)
    taps = []  # per spatial dim: [(index (N, *out) i64, weight or None)]
    for d, size in enumerate(dims):
        c = n.reshape(n.slice(g, len(out) + 1, r - 1 - d, r - d), (batch, *out))  # the grid lists x (width) first
        pos = (n.op("mul", n.op("add", c, 1), (size - 1) / 2) if corners else
               n.op("div", n.op("sub", n.op("mul", n.op("add", c, 1), float(size)), 1), 2))
        lo, hi = (0.0, size - 1.0) if corners else (-0.5, size - 0.5)
        if mode == "nearest":
            pos = n.op("round", pos)
        if padding == "border":
            outside = n.op("or", n.op("lt", pos, lo), n.op("gt", pos, hi))
            pos = n.op("where", outside, n.op("min", n.op("max", pos, 0.0), size - 1.0), pos)
        elif padding == "reflection":
            pos = _reflect(n, pos, lo, hi)
        if mode == "nearest":
            first, weights = pos, [None]  # truncated toward zero, as the reference's astype(int32)
        else:
            first = n.op("floor", pos)
            t = n.op("sub", pos, first)
            weights = [n.op("sub", 1, t), t] if mode == "linear" else _cubic_weights(n, t)
            first = n.op("sub", first, 1.0) if mode == "cubic" else first
        dim_taps = []
        for k, w in enumerate(weights):
            i = n.op("add", first, float(k))
            if padding == "zeros":
                valid = n.cast(n.op("and", n.op("ge", i, 0.0), n.op("le", i, size - 1.0)), dt)
                w = valid if w is None else n.op("mul", w, valid)
            elif padding == "reflection":
                i = _reflect(n, i, lo, hi)
            i = n.op("min", n.op("max", n.cast(i, "i64"), 0), size - 1)
            dim_taps.append((i, w))
        taps.append(dim_taps)
    points = numel(out)
    flat = n.reshape(x, (batch, channels, numel(dims)))
    total = None
    strides = [math.prod(dims[d + 1:]) for d in range(r)]
    for combo in itertools.product(*taps):
        index, weight = None, None
        for (i, w), stride in zip(combo, strides):
            part = n.op("mul", i, stride)
            index = part if index is None else n.op("add", index, part)
            if w is not None:
                weight = w if weight is None else n.op("mul", weight, w)
        index = n.broadcast(n.reshape(index, (batch, 1, points)), (batch, channels, points))
        v = n.op("gather_elements", flat, index, axis=2)
        if weight is not None:
            v = n.op("mul", v, n.reshape(weight, (batch, 1, points)))
        total = v if total is None else n.op("add", total, v)
    return n.reshape(total, (batch, channels, *out))
