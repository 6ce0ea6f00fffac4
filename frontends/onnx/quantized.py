"""Converters: QuantizeLinear/DequantizeLinear, and integer matmul and conv."""

from __future__ import annotations

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.elementwise import FLOAT8_MAX, _cast_to
from tilegraph.frontends.onnx.nn import _window_attrs
from tilegraph.frontends.onnx.node import _axis, _conv
from tilegraph.frontends.onnx.values import onnx_dtype
from tilegraph.ir import decompositions as D
from tilegraph.ir.shapes import numel


# --- quantization ---

# The integer ranges QuantizeLinear saturates to (ONNX spec).
QUANT_RANGES = {"ui8": (0, 255), "i8": (-128, 127), "ui16": (0, 65535), "i16": (-32768, 32767),
                "ui4": (0, 15), "i4": (-8, 7), "ui2": (0, 3), "i2": (-2, 1)}
FLOAT4_MAX = 6.0  # the largest finite f4E2M1FN (OCP MX spec), what QuantizeLinear saturates to


def _quant_param(n, v, x, axis: int, block: int):
    """A scale or zero point shaped to broadcast against x: per tensor, per axis or per block."""
    shape, r = n.shape(x), n.rank(x)
    if n.rank(v) == 0:
        return v
    if numel(n.shape(v)) == 1 and not block:
        return n.reshape(v, ())
    axis = _axis(axis, r)
    if not block:
        return n.reshape(v, [n.shape(v)[0] if i == axis else 1 for i in range(r)])
    # Blocked: each entry covers `block` consecutive elements along axis (the last block may be short).
    vs = n.shape(v)
    repeated = n.broadcast(n.unsqueeze(v, [axis + 1]), vs[:axis + 1] + (block,) + vs[axis + 1:])
    merged = n.reshape(repeated, vs[:axis] + (vs[axis] * block,) + vs[axis + 1:])
    return n.slice(merged, axis, 0, shape[axis])


@_conv("QuantizeLinear")
def _quantize(n):
    x, scale, zp = n.x(0), n.x(1), n.opt(2)
    axis = n.attr("axis", 1)
    block = n.attr("block_size", 0)
    if zp is not None:
        to = n.dtype(zp)
    elif "output_dtype" in n.attrs and n.attrs["output_dtype"]:
        to = onnx_dtype(n.attrs["output_dtype"], "attribute 'output_dtype'")
    else:
        to = "ui8"
    if "precision" in n.attrs and n.attrs["precision"]:
        p = onnx_dtype(n.attrs["precision"], "attribute 'precision'")
        x, scale = n.cast(x, p), n.cast(scale, p)
    y = n.op("div", x, n.cast(_quant_param(n, scale, x, axis, block), n.dtype(x)))
    if to in FLOAT8_MAX:
        return _cast_to(n, y, to)
    if to == "f4E2M1FN":
        return n.cast(n.op("min", n.op("max", y, -FLOAT4_MAX), FLOAT4_MAX), to)
    if to not in QUANT_RANGES:
        raise FrontendError(f"quantizing to {to} is not supported "
                            f"(supported: {sorted(QUANT_RANGES)}, {', '.join(FLOAT8_MAX)}, f4E2M1FN)")
    # round half to even, then add the zero point in int32 and saturate (the ONNX reference's order)
    q = n.cast(n.op("round", y), "i32")
    if zp is not None:
        q = n.op("add", q, n.cast(_quant_param(n, zp, x, axis, block), "i32"))
    lo, hi = QUANT_RANGES[to]
    return n.cast(n.op("min", n.op("max", q, lo), hi), to)


@_conv("DequantizeLinear")
def _dequantize(n):
    x, scale, zp = n.x(0), n.x(1), n.opt(2)
    axis = n.attr("axis", 1)
    block = n.attr("block_size", 0)
    out = onnx_dtype(n.attrs["output_dtype"], "attribute 'output_dtype'") if n.attrs.get("output_dtype") \
        else n.dtype(scale)
    work = "f64" if n.dtype(scale) == "f64" else "f32"  # the reference computes in float32
    dx = n.cast(x, work)
    if zp is not None and n.dtype(x) not in FLOAT8_MAX:  # float8 zero points are zero by definition
        dx = n.op("sub", dx, n.cast(_quant_param(n, zp, x, axis, block), work))
    return n.cast(n.op("mul", dx, n.cast(_quant_param(n, scale, x, axis, block), work)), out)


# --- integer (quantized) matmul and conv: exact int32 arithmetic, then requantization ---


def _centered(n, v, zp, channel_axis: int | None = None):
    """v - zero_point in int32; a 1-D zero point applies per channel_axis (rows, output channels)."""
    v = n.cast(v, "i32")
    if zp is None:
        return v
    zp = n.cast(zp, "i32")
    if channel_axis is not None and n.rank(zp) == 1 and numel(n.shape(zp)) > 1:
        zp = n.reshape(zp, [n.shape(zp)[0] if i == channel_axis else 1 for i in range(n.rank(v))])
    return n.op("sub", v, zp)


def _requantize(n, acc, multiplier, zp, like_dtype: str, round_first: bool):
    """round(acc * multiplier) + zero point, saturated to the output type (float64 as the reference)."""
    y = n.op("mul", n.cast(acc, "f64"), n.cast(multiplier, "f64"))
    to = n.dtype(zp) if zp is not None else like_dtype
    if to not in QUANT_RANGES:
        raise FrontendError(f"requantizing to {to} is not supported")
    lo, hi = QUANT_RANGES[to]
    if zp is not None:
        y = n.op("add", y, n.cast(zp, "f64"))
    if round_first:
        y = n.op("round", y)
    y = n.op("min", n.op("max", y, float(lo)), float(hi))
    return n.cast(y if round_first else n.op("round", y), to)


@_conv("MatMulInteger")
def _matmul_integer(n):
    a = _centered(n, n.x(0), n.opt(2), channel_axis=n.rank(n.x(0)) - 2)
    return n.op("matmul", a, _centered(n, n.x(1), n.opt(3)))


@_conv("QLinearMatMul")
def _qlinear_matmul(n):
    a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = (n.opt(i) for i in range(8))
    acc = n.op("matmul", _centered(n, a, a_zp, channel_axis=n.rank(a) - 2), _centered(n, b, b_zp))
    multiplier = n.op("div", n.op("mul", a_scale, b_scale), y_scale)
    return _requantize(n, acc, multiplier, y_zp, n.dtype(a), round_first=True)


def _conv_integer_acc(n, x, w, x_zp, w_zp, bias):
    kernel = n.attr("kernel_shape", list(n.shape(w)[2:]))
    return n.op("conv", _centered(n, x, x_zp), _centered(n, w, w_zp, channel_axis=0), bias,
                groups=n.attr("group", 1), **_window_attrs(n, x, kernel))


@_conv("ConvInteger")
def _conv_integer(n):
    return _conv_integer_acc(n, n.x(0), n.x(1), n.opt(2), n.opt(3), None)


@_conv("QLinearConv")
def _qlinear_conv(n):
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = (n.opt(i) for i in range(8))
    bias = n.opt(8)
    acc = _conv_integer_acc(n, x, w, x_zp, w_zp, None if bias is None else n.cast(bias, "i32"))
    if n.rank(w_scale) == 1 and numel(n.shape(w_scale)) > 1:  # per output channel
        w_scale = D.channel(n.emit, w_scale, n.rank(x))
    multiplier = n.op("div", n.op("mul", x_scale, w_scale), y_scale)
    return _requantize(n, acc, multiplier, y_zp, n.dtype(x), round_first=False)


@_conv("ReverseSequence")
def _reverse_sequence(n):
    x, lens = n.x(0), n.cast(n.x(1), "i64")
    shape = n.shape(x)
    b, t = (_axis(n.attr(k, d), len(shape)) for k, d in (("batch_axis", 1), ("time_axis", 0)))
    # index along time: lens[b] - 1 - i inside each sequence, i beyond its end
    steps = n.iota(shape, t)
    lens = n.reshape(lens, [shape[b] if i == b else 1 for i in range(len(shape))])
    idx = n.op("where", n.op("lt", steps, lens), n.op("sub", n.op("sub", lens, 1), steps), steps)
    return n.op("gather_elements", x, idx, axis=t)
