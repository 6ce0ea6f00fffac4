"""GGUF's block formats, each described once (after ggml's `type_traits`).

A weight in a block format is stored as its raw bytes, `ui8[N, row_bytes]`: each of the N
rows holds `k / block` blocks of `block_bytes` bytes, exactly as in the GGUF file (and in
ggml's memory), and is never widened to f32 in memory. `tg.block_matmul` and
`tg.block_gather` (ir/ops.py) read it with the format named in their `format` attribute.

Every format here is described by one `BlockFormat`: its name, elements and bytes per
block, the NumPy reference `dequantize(raw, shape) -> float32`, a reference
`quantize(float32) -> raw` (what tests and `tilegraph quantize` write), and the
activation format its dot product pairs with (ggml's `vec_dot_type`: a kernel that
quantizes the activation row on the fly uses that format, q8_0 / q8_1 / q8_k, also
described below). The byte layouts are ggml's (`ggml/src/ggml-common.h`):

    format  block  bytes  layout of one block                               value
    f32     1      4      f32                                               x
    f16     1      2      f16                                               x
    bf16    1      2      bf16 (the high half of an f32)                    x
    q4_0    32     18     f16 d, u8 qs[16]                                  (q - 8) * d
    q4_1    32     20     f16 d, f16 m, u8 qs[16]                           q * d + m
    q5_0    32     22     f16 d, u8 qh[4], u8 qs[16]                        (q - 16) * d
    q8_0    32     34     f16 d, i8 qs[32]                                  q * d
    q4_k    256    144    f16 d, f16 dmin, u8 scales[12], u8 qs[128]        d*sc[j]*q - dmin*m[j]
    q6_k    256    210    u8 ql[128], u8 qh[64], i8 scales[16], f16 d       d*sc[j]*(q - 32)

q4_0/q4_1: byte i of qs holds element i in its low nibble and element i + 16 in its high one.
q5_0: the same nibbles as q4_0, and bit i of the little-endian 32-bit qh is element i's fifth bit.
q4_k: eight sub-blocks of 32 with 6-bit scale sc[j] and min m[j] packed into 12 bytes
(`_unpack_k_scales`); each 32 bytes of qs hold sub-block 2i in the low nibbles, 2i+1 in the high.
q6_k: sixteen sub-blocks of 16, each its own int8 scale; a 6-bit q is 4 low bits from ql and
2 high bits from qh, laid out per half of 128 elements (`_q6_k_dequantize`).

The references agree with the `gguf` package's `gguf.quants` (tests/test_block_formats.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

QK = 32  # elements per block of q4_0, q4_1, q8_0 (ggml's QK4_0 = QK8_0 = 32)
QK_K = 256  # elements per super-block of the k-quants (ggml's QK_K)


class BlockFormatError(ValueError):
    """A shape or byte count that does not fit a block format."""


@dataclass(frozen=True)
class BlockFormat:
    name: str
    block: int  # elements per block
    block_bytes: int  # bytes per block
    _dequantize: Callable[[np.ndarray], np.ndarray]  # uint8[n_blocks, block_bytes] -> float32[n_blocks, block]
    _quantize: Callable[[np.ndarray], np.ndarray]  # float32[n_blocks, block] -> uint8[n_blocks, block_bytes]
    vec_dot_type: str  # the activation format its dot product pairs with (ggml's vec_dot_type)
    ggml_type: int  # GGMLQuantizationType's number in the GGUF file
    doc: str = ""

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k elements; k must be a whole number of blocks."""
        if k <= 0 or k % self.block:
            raise BlockFormatError(f"{self.name}: a row of {k} elements is not a whole number of "
                                   f"{self.block}-element blocks")
        return k // self.block * self.block_bytes

    def dequantize(self, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """float32 values of `shape` from raw bytes (any shape whose size is the byte count)."""
        shape = tuple(int(d) for d in shape)
        if not shape:
            raise BlockFormatError(f"{self.name}: dequantize needs a shape of rank >= 1")
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * self.row_bytes(shape[-1])
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        if raw.size != nbytes:
            raise BlockFormatError(f"{self.name}: {raw.size} bytes, but {shape} needs {nbytes}")
        return self._dequantize(raw.reshape(-1, self.block_bytes)).reshape(shape)

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """Raw bytes `uint8[..., row_bytes]` of float values x (last dim a whole number of blocks)."""
        x = np.asarray(x, np.float32)
        row = self.row_bytes(x.shape[-1]) if x.ndim else self.row_bytes(0)
        blocks = np.ascontiguousarray(x).reshape(-1, self.block)
        return self._quantize(blocks).reshape(x.shape[:-1] + (row,))


# --- helpers -----------------------------------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    """float32 of little-endian f16 bytes [..., 2] (one value per pair)."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _f16_at(blocks: np.ndarray, byte: int) -> np.ndarray:
    """float32[n, 1] of the f16 at (even) byte offset `byte` of each block: a strided read, no copy
    of the blocks (every block's size is even)."""
    return blocks.view(np.uint16)[:, byte // 2].view(np.float16).astype(np.float32)[:, None]


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(np.float16)).view(np.uint8)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8[n, 16] (element i low, i + 16 high) -> float32[n, 32]: two masked passes written
    straight into the float result (a byte -> pair lookup table gathers 4x slower)."""
    out = np.empty(qs.shape[:-1] + (2 * qs.shape[-1],), np.float32)
    half = qs.shape[-1]
    np.bitwise_and(qs, 0x0F, out=out[..., :half], casting="unsafe")
    np.right_shift(qs, 4, out=out[..., half:], casting="unsafe")
    return out


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8[n, 32] in 0..15 -> uint8[n, 16] (element i low, i + 16 high)."""
    half = q.shape[-1] // 2
    return (q[..., :half] | (q[..., half:] << 4)).astype(np.uint8)


def _round(x: np.ndarray) -> np.ndarray:
    # ggml's nearest_int / roundf: halves away from zero (np.rint would round half to even)
    return np.trunc(x + np.copysign(np.float32(0.5), x)).astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


# --- f32, f16, bf16 ----------------------------------------------------------------


def _plain(dtype) -> tuple[Callable, Callable]:
    def dequant(b):
        return b.view(dtype).astype(np.float32)

    def quant(x):
        return np.ascontiguousarray(x.astype(dtype)).view(np.uint8)
    return dequant, quant


def _bf16_dequantize(b: np.ndarray) -> np.ndarray:
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _bf16_quantize(x: np.ndarray) -> np.ndarray:
    n = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    rounded = (n + (0x7FFF + ((n >> 16) & 1))) >> 16  # round to nearest even, as ggml_compute_fp32_to_bf16
    n = np.where(nan, (n >> 16) | 64, rounded)  # a NaN stays a (quiet) NaN
    return n.astype(np.uint16).view(np.uint8)


# --- q4_0, q4_1, q8_0 --------------------------------------------------------------


def _q4_0_dequantize(b):
    d = _f16_at(b, 0)
    q = _unpack_nibbles(b[:, 2:])
    q -= 8.0
    q *= d
    return q


def _q4_0_quantize(x):
    # ggml's quantize_row_q4_0_ref: d = the element of largest magnitude / -8
    imax = np.abs(x).argmax(axis=-1)[:, None]
    d = (np.take_along_axis(x, imax, axis=-1) / np.float32(-8)).astype(np.float32)
    q = np.clip(np.trunc(x * _inverse(d) + np.float32(8.5)), 0, 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=-1)


def _q4_1_dequantize(b):
    d, m = _f16_at(b, 0), _f16_at(b, 2)
    q = _unpack_nibbles(b[:, 4:])
    q *= d
    q += m
    return q


def _q4_1_quantize(x):
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = ((hi - lo) / np.float32(15)).astype(np.float32)
    q = np.clip(np.trunc((x - lo) * _inverse(d) + np.float32(0.5)), 0, 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=-1)


def _q5_0_dequantize(b):
    q = _unpack_nibbles(b[:, 6:])
    high = np.unpackbits(b[:, 2:6], axis=-1, bitorder="little")  # bit i of qh: element i's fifth bit
    q += high * np.float32(16)
    q -= 16.0
    q *= _f16_at(b, 0)
    return q


def _q5_0_quantize(x):
    # ggml's quantize_row_q5_0_ref: d = the element of largest magnitude / -16
    imax = np.abs(x).argmax(axis=-1)[:, None]
    d = (np.take_along_axis(x, imax, axis=-1) / np.float32(-16)).astype(np.float32)
    q = np.clip(np.trunc(x * _inverse(d) + np.float32(16.5)), 0, 31).astype(np.uint8)
    qh = np.packbits(q >> 4, axis=-1, bitorder="little")
    return np.concatenate([_f16_bytes(d), qh, _pack_nibbles(q & 0x0F)], axis=-1)


def _q8_0_dequantize(b):
    q = b[:, 2:].view(np.int8).astype(np.float32)
    q *= _f16_at(b, 0)
    return q


def _q8_0_quantize(x):
    d = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = _round(x * _inverse(d)).astype(np.int8)
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=-1)


def _q8_1_dequantize(b):
    return b[:, 4:].view(np.int8).astype(np.float32) * _f16(b[:, :2])


def _q8_1_quantize(x):
    # q8_0 plus s = d * sum(q) (f16), which a q4_1 dot product uses for its min term
    d = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = _round(x * _inverse(d)).astype(np.int8)
    s = d * q.astype(np.float32).sum(axis=-1, keepdims=True)
    return np.concatenate([_f16_bytes(d), _f16_bytes(s), q.view(np.uint8)], axis=-1)


# --- k-quants ----------------------------------------------------------------------


def _unpack_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_k's 12 scale bytes -> (sc, m), each uint8[n, 8] of 6-bit values: bytes 0-3 hold
    sc[0..3] in bits 0-5 and bits 4-5 of sc[4..7] in 6-7; bytes 4-7 the same for m; bytes
    8-11 hold the low 4 bits of sc[4..7] (low nibble) and of m[4..7] (high nibble)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _q4_k_dequantize(b):
    n = b.shape[0]
    d, dmin = _f16_at(b, 0), _f16_at(b, 2)
    sc, mn = _unpack_k_scales(b[:, 4:16])
    scale = (d * sc.astype(np.float32))[:, :, None]  # [n, 8, 1]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    q = _unpack_nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32)  # sub-block 2i low, 2i+1 high
    return (scale * q - offset).reshape(n, QK_K)


def _q4_k_quantize(x):
    # A reference encoding (not ggml's iterative make_qkx2_quants search): per sub-block
    # of 32, the range [min(x, 0), max(x)] in 15 steps; the 8 scales and mins in 6 bits
    # against the super-block's d and dmin.
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)
    hi = np.maximum(sub.max(axis=-1), lo)
    scale, minv = (hi - lo) / np.float32(15), -lo
    d = (scale.max(axis=-1, keepdims=True) / np.float32(63)).astype(np.float16).astype(np.float32)
    dmin = (minv.max(axis=-1, keepdims=True) / np.float32(63)).astype(np.float16).astype(np.float32)
    sc = np.clip(_round(scale * _inverse(d)), 0, 63).astype(np.uint8)
    mn = np.clip(_round(minv * _inverse(dmin)), 0, 63).astype(np.uint8)
    step = d * sc.astype(np.float32)
    q = np.clip(_round((sub + (dmin * mn.astype(np.float32))[..., None]) * _inverse(step)[..., None]), 0, 15)
    q = q.astype(np.uint8).reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qs], axis=-1)


def _q6_k_dequantize(b):
    n = b.shape[0]
    ql, qh = b[:, 0:128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16_at(b, 208)
    # per half of 128: elements [32 l-groups] j*32 + l for j = 0..3 take
    # ql[l] low, ql[l+32] low, ql[l] high, ql[l+32] high, with qh[l] bits 2j..2j+1 on top
    low = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    high = np.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=2)
    q = ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32).reshape(n, 16, 16)
    return ((d * scales)[:, :, None] * q).reshape(n, QK_K)


def _q6_k_quantize(x):
    # A reference encoding: per sub-block of 16, q in -32..31 against max|x| / 32; the
    # 16 scales as int8 against the super-block's d.
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    imax = np.abs(sub).argmax(axis=-1)[..., None]
    scale = np.take_along_axis(sub, imax, axis=-1)[..., 0] / np.float32(-32)
    amax = np.abs(scale).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    sc = np.clip(_round(scale * _inverse(d)), -128, 127).astype(np.int8)
    step = d * sc.astype(np.float32)
    q = (np.clip(_round(sub * _inverse(step)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, 2, 4, 32)  # half, j, l
    lo = q & 0x0F
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=-1)
    ql = ql.astype(np.uint8).reshape(n, 128)
    qh = sum(((q[:, :, j] >> 4) & 0x03) << (2 * j) for j in range(4)).astype(np.uint8).reshape(n, 64)
    return np.concatenate([ql.astype(np.uint8), qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1)


def _q8_k_quantize(x):
    # f32 d, i8 qs[256], i16 bsums[16] (sums of each 16 q): the activation side of a k-quant dot
    n = x.shape[0]
    d = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = np.clip(_round(x * _inverse(d)), -127, 127).astype(np.int8)
    bsums = q.reshape(n, 16, 16).astype(np.int16).sum(axis=-1).astype(np.int16)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)], axis=-1)


def _q8_k_dequantize(b):
    return b[:, 4:260].view(np.int8).astype(np.float32) * b[:, 0:4].view(np.float32)


# --- the table ---------------------------------------------------------------------

FORMATS: dict[str, BlockFormat] = {}


def _format(name, block, block_bytes, dequant, quant, vec_dot_type, ggml_type, doc=""):
    FORMATS[name] = BlockFormat(name, block, block_bytes, dequant, quant, vec_dot_type, ggml_type, doc)


_format("f32", 1, 4, *_plain(np.float32), "f32", 0)
_format("f16", 1, 2, *_plain(np.float16), "f16", 1)
_format("bf16", 1, 2, _bf16_dequantize, _bf16_quantize, "bf16", 30)
_format("q4_0", QK, 18, _q4_0_dequantize, _q4_0_quantize, "q8_0", 2)
_format("q4_1", QK, 20, _q4_1_dequantize, _q4_1_quantize, "q8_1", 3)
_format("q5_0", QK, 22, _q5_0_dequantize, _q5_0_quantize, "q8_0", 6)
_format("q8_0", QK, 34, _q8_0_dequantize, _q8_0_quantize, "q8_0", 8)
_format("q4_k", QK_K, 144, _q4_k_dequantize, _q4_k_quantize, "q8_k", 12)
_format("q6_k", QK_K, 210, _q6_k_dequantize, _q6_k_quantize, "q8_k", 14)
# Activation formats only (what a kernel quantizes the activation row to; no weight is stored in them).
ACTIVATION_FORMATS: dict[str, BlockFormat] = {
    "q8_0": FORMATS["q8_0"],
    "q8_1": BlockFormat("q8_1", QK, 36, _q8_1_dequantize, _q8_1_quantize, "q8_1", 9,
                        "f16 d, f16 s = d * sum(q), i8 qs[32]"),
    "q8_k": BlockFormat("q8_k", QK_K, 292, _q8_k_dequantize, _q8_k_quantize, "q8_k", 15,
                        "f32 d, i8 qs[256], i16 bsums[16]"),
}

BY_GGML_TYPE: dict[int, BlockFormat] = {f.ggml_type: f for f in FORMATS.values()}


def block_format(name: str) -> BlockFormat:
    if name not in FORMATS:
        raise BlockFormatError(f"unknown block format '{name}'; known: {', '.join(FORMATS)}")
    return FORMATS[name]


# Rows dequantized at a time by `block_matmul`: its f32 panel stays a few MB whatever the weight.
PANEL_ELEMENTS = 1 << 20


def quantize_activations(x: np.ndarray) -> np.ndarray:
    """x as an integer dot product sees it (block_matmul's activation='q8'): each 32 values
    rounded to d * q with d = max|x| / 127 and q = round-half-even(x * 127 / max|x|) in int8,
    computed in float32 (as the C kernels' vector code: cvtps2dq rounds half to even), d kept
    in float32; returned in x's float type. ggml's quantize_row_q8_0 (x86) rounds the same q."""
    x = np.asarray(x)
    xb = x.astype(np.float32).reshape(x.shape[:-1] + (-1, QK))
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((xb * inv).astype(np.float32)), -128, 127)
    d = (amax / np.float32(127)).astype(np.float32)
    dtype = x.dtype if np.issubdtype(x.dtype, np.floating) else np.float32
    return (q.astype(dtype) * d.astype(dtype)).reshape(x.shape)


def block_matmul(x: np.ndarray, w: np.ndarray, format: str, k: int, dtype=None,  # noqa: A002
                 activation: str = "f32") -> np.ndarray:
    """x[..., k] @ dequantize(w[N, row_bytes]).T -> [..., N], a panel of rows at a time (the f32
    weight never exists whole); computed in x's float type (float64 in the interpreter).
    activation='q8': x as quantize_activations rounds it."""
    if activation == "q8":
        x = quantize_activations(x)
    fmt = block_format(format)
    n = w.shape[0]
    out_dtype = np.result_type(x.dtype, np.float32) if dtype is None else dtype
    out = np.empty(x.shape[:-1] + (n,), out_dtype)
    flat = x.reshape(-1, k)
    rows = max(1, PANEL_ELEMENTS // max(k, 1))
    for r0 in range(0, n, rows):
        panel = fmt.dequantize(w[r0:r0 + rows], (min(rows, n - r0), k)).astype(flat.dtype, copy=False)
        out.reshape(-1, n)[:, r0:r0 + rows] = flat @ panel.T
    return out


def block_gather(w: np.ndarray, indices: np.ndarray, format: str, k: int, dtype=np.float32) -> np.ndarray:  # noqa: A002
    """Rows `indices` of dequantize(w[N, row_bytes]) -> [*indices.shape, k] (an embedding lookup);
    an index outside [-N, N) is an IndexError, as np.take's."""
    rows = np.take(w, np.asarray(indices).reshape(-1), axis=0)
    return block_format(format).dequantize(rows, (rows.shape[0], k)).astype(dtype, copy=False).reshape(
        np.shape(indices) + (k,))
