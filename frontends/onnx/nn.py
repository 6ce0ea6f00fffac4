"""Converters: contractions and windows (matmul, Gemm, conv, pools, ConvTranspose) and normalizations."""

from __future__ import annotations

import math
from typing import Sequence

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import _axis, _conv
from tilegraph.frontends.onnx.values import INT64_MAX, ByFunctionBody
from tilegraph.ir import decompositions as D
from tilegraph.ir.shapes import is_static


# --- contractions and windows ---


@_conv("MatMul")
def _matmul(n):
    return n.op("matmul", n.x(0), n.x(1))


@_conv("Gemm")
def _gemm(n):
    a, b, c = n.x(0), n.x(1), n.opt(2)
    if n.attr("transA", 0):
        a = n.transpose(a, (1, 0))
    if n.attr("transB", 0):
        b = n.transpose(b, (1, 0))
    y = n.op("matmul", a, b)
    alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
    if alpha != 1.0:
        y = n.op("mul", y, alpha)
    if c is not None and beta != 0.0:
        y = n.op("add", y, c if beta == 1.0 else n.op("mul", c, beta))
    return y


@_conv("Einsum")
def _einsum(n):
    vals = [v for v in n.inputs if v is not None]
    dtype = n.dtype(vals[0])
    if dtype == "bf16":  # NumPy has no bf16 einsum: accumulate in f32, round once
        vals = [n.cast(v, "f32") for v in vals]
    out = n.op("einsum", *vals, equation=n.attr("equation").replace(" ", ""))
    return n.cast(out, dtype)


def _window_attrs(n, x, kernel: Sequence[int]) -> dict:
    """strides, pads (begins, then ends), dilations of Conv/pools, auto_pad resolved."""
    nd = len(kernel)
    strides = list(n.attr("strides", [1] * nd))
    dilations = list(n.attr("dilations", [1] * nd))
    pads = list(n.attr("pads", [0] * (2 * nd)))
    auto = n.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        spatial = n.shape(x)[2:]
        # With stride 1 the total padding is dilation * (kernel - 1) whatever the size; with a
        # larger stride it depends on the size modulo the stride, which must then be known.
        if not all(isinstance(d, int) or s == 1 for d, s in zip(spatial, strides)):
            raise FrontendError(f"auto_pad {auto} with strides {strides} needs static spatial dims, got {spatial}")
        pads = [0] * (2 * nd)
        for i in range(nd):
            if strides[i] == 1:
                total = dilations[i] * (kernel[i] - 1)
            else:
                out = -(-spatial[i] // strides[i])
                total = max(0, (out - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1 - spatial[i])
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads[i], pads[i + nd] = lo, total - lo
    elif auto == "VALID":
        pads = [0] * (2 * nd)
    elif auto != "NOTSET":
        raise FrontendError(f"auto_pad '{auto}' is not supported")
    return {"strides": tuple(strides), "pads": tuple(pads), "dilations": tuple(dilations)}


@_conv("Conv")
def _conv_op(n):
    x, w, b = n.x(0), n.x(1), n.opt(2)
    kernel = n.attr("kernel_shape", list(n.shape(w)[2:]))
    return n.op("conv", x, w, b, groups=n.attr("group", 1), **_window_attrs(n, x, kernel))


@_conv("MaxPool")
def _max_pool(n):
    if n.wants_output(1):
        raise FrontendError("the Indices output of MaxPool is not supported")
    x = n.x(0)
    kernel = n.attr("kernel_shape")
    return n.op("max_pool", x, kernel=tuple(kernel), ceil_mode=bool(n.attr("ceil_mode", 0)),
                **_window_attrs(n, x, kernel))


@_conv("AveragePool")
def _avg_pool(n):
    x = n.x(0)
    kernel = n.attr("kernel_shape")
    return n.op("avg_pool", x, kernel=tuple(kernel), ceil_mode=bool(n.attr("ceil_mode", 0)),
                count_include_pad=bool(n.attr("count_include_pad", 0)), **_window_attrs(n, x, kernel))


@_conv("LpPool")
def _lp_pool(n):
    x = n.x(0)
    kernel = n.attr("kernel_shape")
    if n.attr("ceil_mode", 0):
        raise FrontendError("LpPool with ceil_mode is not supported")
    p = n.attr("p", 2)
    # sum |x|^p over a window = mean with padding counted * window size (no ceil_mode).
    powered = n.op("pow", n.op("abs", x), float(p))
    mean = n.op("avg_pool", powered, kernel=tuple(kernel), count_include_pad=True, **_window_attrs(n, x, kernel))
    return n.op("pow", n.op("mul", mean, float(math.prod(kernel))), 1.0 / p)


@_conv("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(n):
    x = n.x(0)
    return n.reduce("mean" if n.op_type == "GlobalAveragePool" else "max", x, range(2, n.rank(x)), True)


# --- normalizations ---


@_conv("BatchNormalization")
def _batch_norm(n):
    x, scale, bias, mean, var = (n.x(i) for i in range(5))
    eps = n.attr("epsilon", 1e-5)
    if n.attr("training_mode", 0):
        # Normalize with the batch's statistics (population variance); the running
        # statistics are updated with `momentum` (ONNX spec, opset 14+).
        y, batch_mean, batch_var = D.batch_norm_training(n.emit, x, scale, bias, eps)
        batch_mean, batch_var = (n.reshape(s, n.shape(mean)) for s in (batch_mean, batch_var))
        momentum = n.attr("momentum", 0.9)
        return (y, n.op("add", n.op("mul", mean, momentum), n.op("mul", batch_mean, 1 - momentum)),
                n.op("add", n.op("mul", var, momentum), n.op("mul", batch_var, 1 - momentum)))
    if n.n_outputs > 1:
        raise FrontendError("running mean/var outputs need training_mode=1")
    return D.batch_norm(n.emit, x, scale, bias, mean, var, eps)


def _normalize(n, x, axes, eps):
    """(x - mean) / sqrt(var + eps) over axes, and the mean and 1/sqrt(var + eps) kept."""
    mean = n.reduce("mean", x, axes, True)
    centered = n.op("sub", x, mean)
    var = n.reduce("mean", n.op("mul", centered, centered), axes, True)
    inv = n.op("reciprocal", n.op("sqrt", n.op("add", var, eps)))
    return n.op("mul", centered, inv), mean, inv


@_conv("InstanceNormalization")
def _instance_norm(n):
    x, scale, bias = n.x(0), n.x(1), n.x(2)
    r = n.rank(x)
    y, _, _ = _normalize(n, x, range(2, r), n.attr("epsilon", 1e-5))
    return D.affine(n.emit, y, scale, bias)


def _stashed(n, x):
    """stash_type=1 (the default): statistics in float32 even for 16-bit inputs."""
    dtype = n.dtype(x)
    if n.attr("stash_type", 1) == 1 and dtype in ("f16", "bf16"):
        return n.cast(x, "f32"), dtype
    return x, dtype


@_conv("LayerNormalization")
def _layer_norm(n):
    x, scale, bias = n.x(0), n.x(1), n.opt(2)
    r = n.rank(x)
    axis = _axis(n.attr("axis", -1), r)
    eps = n.attr("epsilon", 1e-5)
    xs, dtype = _stashed(n, x)
    if n.n_outputs == 1 and xs is x:
        return n.op("layer_norm", x, scale, bias, axis=axis, epsilon=eps)
    y, mean, inv = _normalize(n, xs, range(axis, r), eps)
    y = n.op("mul", n.cast(y, dtype), scale)
    if bias is not None:
        y = n.op("add", y, bias)
    return y, mean, inv


@_conv("RMSNormalization", "SimplifiedLayerNormalization")  # the second: onnxruntime's name for it
def _rms_norm(n, x=None):
    x, scale = n.x(0) if x is None else x, n.x(1) if x is None else n.x(2)
    r = n.rank(x)
    axis = _axis(n.attr("axis", -1), r)
    xs, dtype = _stashed(n, x)
    y = D.rms_norm(n.emit, xs, range(axis, r), n.attr("epsilon", 1e-5))
    return n.op("mul", n.cast(y, dtype), scale)


@_conv("RotaryEmbedding")
def _rotary_embedding(n):
    """ONNX's RotaryEmbedding (opset 23; torch's dynamo exporter writes it for transformers' rotary):
    X [B, H, T, D], or [B, T, H x D] with num_heads; cos/sin [B, T, R/2], or tables [positions, R/2]
    read at position_ids; the first R dims (rotary_embedding_dim, 0: all) rotated as pairs
    (i, i + R/2) (tg.rope), the rest passed through."""
    if n.attr("interleaved", 0):  # pairs (2i, 2i + 1): tg.rope rotates (i, i + R/2); ONNX's body has them
        raise ByFunctionBody
    x, cos, sin, where = n.x(0), n.x(1), n.x(2), n.opt(3)
    if where is not None:
        cos, sin = n.op("gather", cos, where, axis=0), n.op("gather", sin, where, axis=0)
    shape = n.shape(x)
    if len(shape) == 3 and n.attr("num_heads", 0) > 0 and isinstance(shape[2], int) \
            and shape[2] % n.attr("num_heads") == 0:
        heads = n.attr("num_heads")
        x4 = n.transpose(n.reshape(x, (shape[0], shape[1], heads, shape[2] // heads)), (0, 2, 1, 3))
    elif len(shape) == 4:
        x4 = x
    else:
        raise FrontendError(f"X {n.info(x)} must be [B, H, T, D], or [B, T, H x D] with num_heads dividing it")
    b, h, t, d = n.shape(x4)
    if n.rank(cos) != 3 or n.shape(cos) != n.shape(sin) or not isinstance(d, int):
        raise FrontendError(f"cos {n.info(cos)} and sin {n.info(sin)} must be [B, T, R/2] (or tables read at "
                            "position_ids) of one shape, the head size fixed")
    half = n.shape(cos)[2]
    rotated = n.attr("rotary_embedding_dim", 0) or d
    if not isinstance(half, int) or rotated != 2 * half or rotated > d:
        raise FrontendError(f"rotary_embedding_dim {rotated} must be twice cos's last dim {half}, at most the head "
                            f"size {d}")
    cos, sin = (n.reshape(c, (n.shape(c)[0], 1, n.shape(c)[1], half)) for c in (cos, sin))
    if rotated == d:
        y = n.op("rope", x4, cos, sin)
    else:
        part, rest = (n.op("slice", x4, starts=[0, 0, 0, lo], ends=[INT64_MAX] * 3 + [hi], steps=[1] * 4)
                      for lo, hi in ((0, rotated), (rotated, d)))
        y = n.op("concat", n.op("rope", part, cos, sin), rest, axis=3)
    return y if len(shape) == 4 else n.reshape(n.transpose(y, (0, 2, 1, 3)), shape)


@_conv("com.microsoft.SkipSimplifiedLayerNormalization")
def _skip_rms_norm(n):
    """onnxruntime's fused residual + RMSNorm: outputs the norm of input + skip (+ bias), and (as
    output 3) that sum itself; outputs 1 and 2 (statistics) are not computed."""
    total = n.op("add", n.x(0), n.x(1))
    if n.opt(3) is not None:
        total = n.op("add", total, n.x(3))
    if n.wants_output(1) or n.wants_output(2):
        raise FrontendError("its mean and inverse standard deviation outputs are not supported")
    return _rms_norm(n, total), None, None, total


@_conv("GroupNormalization")
def _group_norm(n):
    x, scale, bias = n.x(0), n.x(1), n.x(2)
    shape = n.shape(x)
    groups = n.attr("num_groups")
    c = shape[1]
    if n.shape(scale)[0] != c:
        raise FrontendError(f"scale {n.info(scale)} must have one entry per channel ({c}); "
                            "the opset-18 per-group form is not supported")
    xs, dtype = _stashed(n, x)
    y = n.cast(D.group_norm(n.emit, xs, groups, None, None, n.attr("epsilon", 1e-5)), dtype)
    return D.affine(n.emit, y, scale, bias)


@_conv("MeanVarianceNormalization")
def _mvn(n):
    x = n.x(0)
    axes = [_axis(a, n.rank(x)) for a in n.attr("axes", [0, 2, 3])]
    # ONNX's function body: (X - E[X]) / (sqrt(E[X^2] - E[X]^2) + 1e-9)
    mean = n.reduce("mean", x, axes, True)
    var = n.op("sub", n.reduce("mean", n.op("mul", x, x), axes, True), n.op("mul", mean, mean))
    return n.op("div", n.op("sub", x, mean), n.op("add", n.op("sqrt", var), 1e-9))


@_conv("LpNormalization")
def _lp_norm(n):
    x = n.x(0)
    axis = _axis(n.attr("axis", -1), n.rank(x))
    p = n.attr("p", 2)
    if p == 1:
        norm = n.reduce("sum", n.op("abs", x), [axis], True)
    elif p == 2:
        norm = n.op("sqrt", n.reduce("sum", n.op("mul", x, x), [axis], True))
    else:
        raise FrontendError(f"p={p}: only 1 and 2 are defined")
    # A zero norm gives zeros, not NaN (the ONNX reference's choice).
    return n.op("where", n.op("eq", norm, 0), 0, n.op("div", x, norm))


@_conv("LRN")
def _lrn(n):
    x = n.x(0)
    size = n.attr("size")
    alpha, beta, bias = n.attr("alpha", 1e-4), n.attr("beta", 0.75), n.attr("bias", 1.0)
    c = n.shape(x)[1]
    r = n.rank(x)
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = n.op("mul", x, x)
    pads = [0] * (2 * r)
    pads[1], pads[1 + r] = lo, hi
    padded = n.op("pad", sq, pads=tuple(pads))
    total = None
    for k in range(size):
        part = n.slice(padded, 1, k, k + c)
        total = part if total is None else n.op("add", total, part)
    return n.op("div", x, n.op("pow", n.op("add", n.op("mul", total, alpha / size), bias), beta))


def _pad_or_crop(n, x, pads: Sequence[int], mode: str = "constant", value: float = 0.0):
    """Pad (begins, then ends); negative entries crop instead: a slice after padding with the positive part."""
    r = n.rank(x)
    positive = [max(p, 0) for p in pads]
    if any(positive):
        x = n.op("pad", x, pads=tuple(positive), mode=mode, value=value)
    for a in range(r):
        lo, hi = pads[a], pads[a + r]
        if lo < 0 or hi < 0:
            x = n.slice(x, a, -lo if lo < 0 else 0, hi if hi < 0 else INT64_MAX)
    return x


@_conv("ConvTranspose")
def _conv_transpose(n):
    x, w, b = n.x(0), n.x(1), n.opt(2)
    xs, ws = n.shape(x), n.shape(w)
    nd = len(xs) - 2
    kernel = list(n.attr("kernel_shape", ws[2:]))
    strides = list(n.attr("strides", [1] * nd))
    dil = list(n.attr("dilations", [1] * nd))
    out_pad = list(n.attr("output_padding", [0] * nd))
    groups = n.attr("group", 1)
    auto = n.attr("auto_pad", "NOTSET")
    if not is_static(xs[2:]):
        raise FrontendError(f"ConvTranspose needs static spatial dims, got {xs}")
    span = [(kernel[i] - 1) * dil[i] + 1 for i in range(nd)]
    if "output_shape" in n.attrs or auto in ("SAME_UPPER", "SAME_LOWER"):
        target = list(n.attrs.get("output_shape", [xs[2 + i] * strides[i] for i in range(nd)]))[-nd:]
        total = [strides[i] * (xs[2 + i] - 1) + out_pad[i] + span[i] - target[i] for i in range(nd)]
        if auto == "SAME_UPPER":
            pads = [t // 2 for t in total] + [t - t // 2 for t in total]
        else:
            pads = [t - t // 2 for t in total] + [t // 2 for t in total]
    else:
        pads = list(n.attr("pads", [0] * (2 * nd)))
    # x with stride-1 zeros between its elements, along each spatial axis
    for i in range(nd):
        s, a = strides[i], 2 + i
        if s > 1:
            shape = n.shape(x)
            grown = n.op("pad", n.unsqueeze(x, [a + 1]), pads=tuple(s - 1 if j == a + 1 + len(shape) + 1 else 0
                                                                     for j in range(2 * (len(shape) + 1))))
            x = n.slice(n.reshape(grown, shape[:a] + (shape[a] * s,) + shape[a + 1:]), a, 0, (shape[a] - 1) * s + 1)
    # then a stride-1 convolution with the flipped kernel, padded by span - 1 - pads
    full = [0, 0] + [span[i] - 1 - pads[i] for i in range(nd)] + [0, 0] + \
           [span[i] - 1 - pads[nd + i] + out_pad[i] for i in range(nd)]
    x = _pad_or_crop(n, x, full)
    cin, cout_g = ws[0], ws[1]
    wt = n.reshape(w, (groups, cin // groups, cout_g) + tuple(ws[2:]))
    wt = n.transpose(wt, (0, 2, 1) + tuple(range(3, 3 + nd)))
    wt = n.reshape(wt, (groups * cout_g, cin // groups) + tuple(ws[2:]))
    wt = n.op("slice", wt, starts=(0, 0) + (-1,) * nd, ends=(INT64_MAX, INT64_MAX) + (-INT64_MAX,) * nd,
              steps=(1, 1) + (-1,) * nd)
    return n.op("conv", x, wt, b, groups=groups, dilations=tuple(dil))
