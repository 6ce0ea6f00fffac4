"""Element types: the one table between xDSL element types, their MLIR spelling and NumPy.

Every other module converts through here, so a dtype is added in one place.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from xdsl.dialects.builtin import (
    BFloat16Type,
    Float16Type,
    Float32Type,
    Float64Type,
    Float8E4M3FNType,
    Float8E4M3FNUZType,
    Float8E5M2FNUZType,
    Float8E5M2Type,
    Float4E2M1FNType,
    Float6E2M3FNType,
    Float8E8M0FNUType,
    IntegerType,
    Signedness,
)
from xdsl.ir import Attribute

from tilegraph.ir.errors import TilegraphError

# MLIR spelling -> (xDSL element type, NumPy dtype)
_TABLE: dict[str, tuple[Attribute, np.dtype]] = {
    "f64": (Float64Type(), np.dtype(np.float64)),
    "f32": (Float32Type(), np.dtype(np.float32)),
    "f16": (Float16Type(), np.dtype(np.float16)),
    "bf16": (BFloat16Type(), np.dtype(ml_dtypes.bfloat16)),
    "f8E4M3FN": (Float8E4M3FNType(), np.dtype(ml_dtypes.float8_e4m3fn)),
    "f8E5M2": (Float8E5M2Type(), np.dtype(ml_dtypes.float8_e5m2)),
    # The FNUZ float8 variants (one NaN, no -0, no infinities) of AMD's and Graphcore's hardware.
    "f8E4M3FNUZ": (Float8E4M3FNUZType(), np.dtype(ml_dtypes.float8_e4m3fnuz)),
    "f8E5M2FNUZ": (Float8E5M2FNUZType(), np.dtype(ml_dtypes.float8_e5m2fnuz)),
    # Storage types of quantized values (ir.ops: tg.quantize / tg.dequantize): the OCP
    # microscaling element types (MXFP6, MXFP4) and their shared power-of-two scale.
    "f6E2M3FN": (Float6E2M3FNType(), np.dtype(ml_dtypes.float6_e2m3fn)),
    "f4E2M1FN": (Float4E2M1FNType(), np.dtype(ml_dtypes.float4_e2m1fn)),
    "f8E8M0FNU": (Float8E8M0FNUType(), np.dtype(ml_dtypes.float8_e8m0fnu)),
    "i1": (IntegerType(1), np.dtype(np.bool_)),
    "i2": (IntegerType(2), np.dtype(ml_dtypes.int2)),
    "i4": (IntegerType(4), np.dtype(ml_dtypes.int4)),
    "i8": (IntegerType(8), np.dtype(np.int8)),
    "i16": (IntegerType(16), np.dtype(np.int16)),
    "i32": (IntegerType(32), np.dtype(np.int32)),
    "i64": (IntegerType(64), np.dtype(np.int64)),
    "ui2": (IntegerType(2, Signedness.UNSIGNED), np.dtype(ml_dtypes.uint2)),
    "ui4": (IntegerType(4, Signedness.UNSIGNED), np.dtype(ml_dtypes.uint4)),
    "ui8": (IntegerType(8, Signedness.UNSIGNED), np.dtype(np.uint8)),
    "ui16": (IntegerType(16, Signedness.UNSIGNED), np.dtype(np.uint16)),
    "ui32": (IntegerType(32, Signedness.UNSIGNED), np.dtype(np.uint32)),
    "ui64": (IntegerType(64, Signedness.UNSIGNED), np.dtype(np.uint64)),
}
_BY_ATTR = {attr: name for name, (attr, _) in _TABLE.items()}
_BY_NUMPY = {dt: name for name, (_, dt) in _TABLE.items()}

DTYPES = tuple(_TABLE)
FLOAT_DTYPES = ("f64", "f32", "f16", "bf16", "f8E4M3FN", "f8E5M2", "f8E4M3FNUZ", "f8E5M2FNUZ", "f6E2M3FN",
                "f4E2M1FN", "f8E8M0FNU")
INT_DTYPES = ("i2", "i4", "i8", "i16", "i32", "i64", "ui2", "ui4", "ui8", "ui16", "ui32", "ui64")
# Types NumPy has no arithmetic for (ml_dtypes stores them a byte each): saved by their bits.
BIT_STORED = ("bf16", "f8E4M3FN", "f8E5M2", "f8E4M3FNUZ", "f8E5M2FNUZ", "f6E2M3FN", "f4E2M1FN", "f8E8M0FNU",
              "i2", "i4", "ui2", "ui4")
# Types stored two to a byte in a saved weight store (ir.model.WeightStore); in memory
# NumPy holds them a byte each.
PACKED_4BIT = ("i4", "ui4", "f4E2M1FN")


class DTypeError(TilegraphError):
    pass


def element_type(name: str) -> Attribute:
    try:
        return _TABLE[name][0]
    except KeyError:
        raise DTypeError(f"unsupported element type '{name}' (supported: {', '.join(DTYPES)})") from None


def dtype_name(t: Attribute | np.dtype | type | str) -> str:
    """The MLIR spelling ("f32") of an xDSL element type, NumPy dtype or spelling."""
    if isinstance(t, str) and t in _TABLE:
        return t
    if isinstance(t, Attribute):
        if t in _BY_ATTR:
            return _BY_ATTR[t]
        raise DTypeError(f"unsupported element type {t}")
    try:
        return _BY_NUMPY[np.dtype(t)]
    except (KeyError, TypeError):
        raise DTypeError(f"unsupported dtype {t!r} (supported: {', '.join(DTYPES)})") from None


def numpy_dtype(name: str) -> np.dtype:
    element_type(name)  # raises the clear error for unknown names
    return _TABLE[name][1]


def is_float(name: str) -> bool:
    return name in FLOAT_DTYPES


def is_int(name: str) -> bool:
    return name in INT_DTYPES


def storage_bytes(name: str, count: int) -> int:
    """Bytes that `count` values of type `name` take in a saved weight store (4-bit types packed)."""
    if name in PACKED_4BIT:
        return (count + 1) // 2
    return count * numpy_dtype(name).itemsize


def is_bool(name: str) -> bool:
    return name == "i1"
