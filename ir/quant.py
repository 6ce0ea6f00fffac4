"""Quantized number formats and the kernels of tg.quantize, tg.dequantize, tg.dynamic_quantize
and tg.matmul_integer (their semantics; `ir.ops` holds the op table rows, `ir.kernels`
re-exports these so the templates call them as `K.quantize(...)`).

A quantized tensor is `q = saturate(round(x / scale) + zero_point)` in a storage type:

    storage     values                           rounding
    i8, ui8, i4 integers in the type's range     half to even (np.rint), as ONNX QuantizeLinear
    f8E4M3FN,   the type's finite values         to nearest even (ml_dtypes), saturating at
    f8E5M2,                                      +-max (ONNX saturate=1): no inf, no nan
    f6E2M3FN, f4E2M1FN                           out of finite input
    (MXFP8 = f8E4M3FN, MXFP6 = f6E2M3FN, MXFP4 = f4E2M1FN elements in blocks of 32 sharing an
    f8E8M0FNU power-of-two scale: OCP Microscaling Formats spec v1.0)

and `dequantize(q) = (q - zero_point) * scale`. The scale's shape says how it is shared,
as in ONNX QuantizeLinear (opset 21), plus one form for per-row activation scales:

    scale rank 0                         per tensor
    scale rank 1, x rank > 1             per channel: one scale per index of dim `axis`
    scale rank = x rank, block_size > 0  per block: block_size consecutive elements along
                                         `axis` share one (the last block may be short)
    scale rank = x rank, block_size = 0  broadcast (each scale dim 1 or x's): per row

x / scale is computed in float32 (as ONNX does for float32 inputs), also in the float64
interpreter, so that the interpreter and the NumPy backend round the same quotients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class Format:
    """A storage type of quantized values."""

    name: str
    integer: bool
    lo: float  # smallest and largest value (floats: -max finite, max finite)
    hi: float
    mantissa_bits: int = 0  # floats: explicit mantissa bits
    min_exponent: int = 0  # floats: exponent of the smallest normal number

    @property
    def numpy(self) -> np.dtype:
        from tilegraph.ir import dtypes

        return dtypes.numpy_dtype(self.name)

    @property
    def bits(self) -> int:
        return {"i8": 8, "ui8": 8, "i4": 4, "f8E4M3FN": 8, "f8E5M2": 8, "f6E2M3FN": 6, "f4E2M1FN": 4}[self.name]

    def max_exponent(self) -> int:
        """Exponent of the largest normal value (floats): emax of the OCP MX spec."""
        return math.frexp(self.hi)[1] - 1

    def half_ulp(self, v: np.ndarray) -> np.ndarray:
        """Half the spacing of the format's values at |v| (in units of the stored value):
        the largest rounding error of a value inside the range."""
        if self.integer:
            return np.full(np.shape(v), 0.5)
        a = np.abs(np.asarray(v, np.float64))
        exponent = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), self.min_exponent)
        return np.ldexp(0.5, (exponent - self.mantissa_bits).astype(np.int64))


def _float_format(name: str) -> Format:
    info = ml_dtypes.finfo(ml_dtypes.__dict__[{"f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2",
                                               "f6E2M3FN": "float6_e2m3fn", "f4E2M1FN": "float4_e2m1fn"}[name]])
    return Format(name, False, -float(info.max), float(info.max), int(info.nmant), int(info.minexp))


FORMATS: dict[str, Format] = {
    "i8": Format("i8", True, -128, 127),
    "ui8": Format("ui8", True, 0, 255),
    "i4": Format("i4", True, -8, 7),
    **{n: _float_format(n) for n in ("f8E4M3FN", "f8E5M2", "f6E2M3FN", "f4E2M1FN")},
}
STORAGE_TYPES = tuple(FORMATS)
# What tg.dequantize reads: the storage types, and int32 accumulators of tg.matmul_integer.
DEQUANTIZE_TYPES = STORAGE_TYPES + ("i32",)
SCALE_TYPES = ("f32", "f16", "bf16", "f8E8M0FNU")
# OCP MX: 32 elements share one scale.
MX_BLOCK = 32
# f8E8M0FNU holds 2^-127 .. 2^127.
E8M0_EXPONENTS = (-127, 127)


def scale_layout(x_rank: int, scale_shape: tuple, axis: int, block_size: int) -> str:
    """'tensor', 'channel', 'block' or 'broadcast' (see the module docstring); ValueError if none."""
    if block_size < 0:
        raise ValueError(f"block_size {block_size} is negative")
    if len(scale_shape) == 0:
        if block_size:
            raise ValueError("a per-tensor (rank-0) scale takes no block_size")
        return "tensor"
    if not -x_rank <= axis < max(x_rank, 1):
        raise ValueError(f"axis {axis} is out of range for rank {x_rank}")
    if block_size:
        if len(scale_shape) != x_rank:
            raise ValueError(f"a block scale must have the rank of x ({x_rank}), got rank {len(scale_shape)}")
        return "block"
    if len(scale_shape) == 1 and x_rank > 1:
        return "channel"
    if len(scale_shape) == x_rank:
        return "broadcast"
    raise ValueError(f"a scale of rank {len(scale_shape)} fits neither per-channel nor per-block use on rank {x_rank}")


def expand_scale(s: np.ndarray, shape: tuple, axis: int, block_size: int) -> np.ndarray:
    """The scale (or zero point) `s` broadcastable against x of `shape`."""
    s = np.asarray(s)
    layout = scale_layout(len(shape), s.shape, axis, block_size)
    axis = axis % max(len(shape), 1)
    if layout == "channel":
        return s.reshape([-1 if i == axis else 1 for i in range(len(shape))])
    if layout == "block":
        full = np.repeat(s, block_size, axis=axis)
        return full[tuple(slice(0, shape[axis]) if i == axis else slice(None) for i in range(len(shape)))]
    return s


def quantize(x, scale, zero_point, axis, block_size, to, dtype):
    """tg.quantize: saturate(round(x / scale) + zero_point) in storage type `to`, returned as `dtype`."""
    fmt = FORMATS[to]
    x = np.asarray(x, dtype=np.float32)
    y = x / expand_scale(np.asarray(scale).astype(np.float32), x.shape, axis, block_size)
    if fmt.integer:
        y = np.rint(y)
        if zero_point is not None:
            y += expand_scale(np.asarray(zero_point).astype(np.float32), x.shape, axis, block_size)
    y = np.clip(y, fmt.lo, fmt.hi)  # nan stays nan for float formats (casts to 0 for integers)
    return np.asarray(y.astype(fmt.numpy)).astype(dtype, copy=False)


def dequantize(q, scale, zero_point, axis, block_size, dtype):
    """tg.dequantize: (q - zero_point) * scale, computed in `dtype` (float32 for narrower types)."""
    q = np.asarray(q)
    ct = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    y = q.astype(ct)
    if zero_point is not None:
        y = y - expand_scale(np.asarray(zero_point).astype(ct), q.shape, axis, block_size)
    y = y * expand_scale(np.asarray(scale).astype(ct), q.shape, axis, block_size)
    return np.asarray(y).astype(dtype, copy=False)


def mx_scale(amax: np.ndarray, fmt: Format) -> np.ndarray:
    """The f8E8M0FNU scale of blocks whose largest magnitude is `amax`: the smallest power of two
    2^e with amax / 2^e <= fmt's largest value, so that no element saturates and every one is
    within half an ulp. (The OCP spec's example rule, 2^(floor(log2 amax) - emax), keeps one more
    bit for the top binade but clips up to 1 - max/2^(emax+1) of the largest values: 12.5% for
    e4m3, 25% for e2m1.)"""
    ratio = np.asarray(amax, np.float64) / fmt.hi
    mant, exp = np.frexp(np.where(ratio > 0, ratio, 1.0))
    exp = np.where(mant == 0.5, exp - 1, exp)  # an exact power of two needs no rounding up
    exp = np.clip(exp, *E8M0_EXPONENTS)
    return np.ldexp(1.0, exp).astype(ml_dtypes.float8_e8m0fnu)


# A float32 scale below the smallest normal float32 loses bits of its own (found by
# hypothesis: amax 4e-43 quantized to 3.6e-43): scales stop there, as PyTorch's observers
# clamp theirs to an epsilon.
MIN_SCALE = float(np.finfo(np.float32).tiny)


def absmax_scale(amax: np.ndarray, fmt: Format) -> np.ndarray:
    """Symmetric float32 scale mapping amax to the format's largest value (127 for i8, not 128,
    keeps it symmetric); 1 where amax is 0, at least MIN_SCALE."""
    amax = np.asarray(amax, np.float32)
    return np.where(amax > 0, np.maximum(amax / np.float32(fmt.hi), np.float32(MIN_SCALE)),
                    np.float32(1.0)).astype(np.float32)


def dynamic_quantize(x, to, block_size, dtype):
    """tg.dynamic_quantize: scales from x itself, symmetric. block_size 0: one float32 scale per
    row (last axis), amax -> the format's largest value; block_size > 0: one f8E8M0FNU scale per
    block of the last axis (`mx_scale`). Returns (q as `dtype`, scale)."""
    fmt = FORMATS[to]
    x = np.asarray(x, dtype=np.float32)
    rank = x.ndim
    if block_size:
        k = x.shape[-1]
        blocks = -(-k // block_size)
        padded = np.pad(np.abs(x), [(0, 0)] * (rank - 1) + [(0, blocks * block_size - k)])
        amax = padded.reshape(x.shape[:-1] + (blocks, block_size)).max(axis=-1)
        scale = mx_scale(amax, fmt) if not fmt.integer else absmax_scale(amax, fmt)
    else:
        amax = np.max(np.abs(x), axis=-1, keepdims=True) if x.shape[-1] else np.zeros(x.shape[:-1] + (1,))
        scale = absmax_scale(amax, fmt)
    return quantize(x, scale, None, rank - 1, block_size, to, dtype), scale


# --- tg.matmul_integer ---------------------------------------------------------------
# NumPy has no integer GEMM: np.matmul on int8/int32 runs a plain C loop, ~50x slower than
# BLAS here (benchmarks/quantization.py measures it). A float32 GEMM of integer-valued
# operands is exact while every partial sum stays within 2^24 (float32 holds every integer
# up to there, so no product and no sum rounds, in any order BLAS picks): with |a - za| <= A
# and |b| <= B that is K * A * B <= 2^24. So the contraction runs on sgemm in chunks of K
# that keep that bound, and the chunks add up in int32: the exact int32 result of
# int8 x int8 -> int32 accumulation, at the speed of sgemm.
FLOAT32_EXACT = 1 << 24


@lru_cache(maxsize=None)  # np.iinfo costs more than a small GEMM's conversion
def _magnitude(dtype: np.dtype, shifted: bool) -> int:
    """The largest |value| (|value - zero point| when shifted) of an integer type."""
    info = np.iinfo(dtype) if dtype != np.dtype(ml_dtypes.int4) else ml_dtypes.iinfo(ml_dtypes.int4)
    return int(info.max) - int(info.min) if shifted else max(abs(int(info.min)), int(info.max))


def matmul_integer(a, b, a_zero_point, dtype=np.int32):
    """tg.matmul_integer: (a - a_zero_point) @ b, exact, accumulated in int32."""
    a, b = np.asarray(a), np.asarray(b)
    fa = a.astype(np.float32)
    if a_zero_point is not None:
        fa -= np.asarray(a_zero_point).astype(np.float32)
    fb = b.astype(np.float32)
    k = a.shape[-1]
    chunk = max(1, FLOAT32_EXACT // (_magnitude(a.dtype, a_zero_point is not None) * _magnitude(b.dtype, False)))
    if k <= chunk:
        return np.matmul(fa, fb).astype(np.int32)
    acc = None
    for k0 in range(0, k, chunk):
        part = np.matmul(fa[..., k0:k0 + chunk], fb[..., k0:k0 + chunk, :]).astype(np.int32)
        acc = part if acc is None else acc + part
    return acc
