"""The runtime's block-format and KV-cache kernels (blockq.c), called on NumPy arrays.

The emitted C of `tg.block_matmul`, `tg.block_gather`, `tg.cache_write` and
`tg.cache_attention` calls these kernels inside a module's native step; this module
binds the same entry points with ctypes for the tests (each kernel against the float64
reference, at each instruction set) and for benchmarks/blockq_kernels.py.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from tilegraph.backends.c.build import runtime
from tilegraph.ir.errors import TilegraphError

# Each block format's number in blockq.h's enum (TG_BQ_*): the names are ir/block_formats.py's.
FORMATS = {"f32": 0, "f16": 1, "bf16": 2, "q4_0": 3, "q4_1": 4, "q8_0": 5, "q4_k": 6, "q6_k": 7, "q5_0": 8}
ISAS = {"scalar": 0, "avx2": 1, "avx512_vnni": 2, "avx512_vbmi": 3, "amx": 4}
# What tg_block_matmul runs (blockq.h TG_BQ_KERNEL_*), by number.
KERNELS = ["float", "sgemm", "blocks", "zmm", "zmm8", "amx"]
# What tg_cache_attention(_f16) runs (blockq.h TG_CA_KERNEL_*), by number.
ATTENTION_KERNELS = ["prompt", "zmm", "units"]

_i64, _p = ctypes.c_int64, ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(runtime()))
    lib.tg_block_matmul.argtypes = [_p, _i64, _i64, _p, _i64, _i64, ctypes.c_int, _p, _i64]
    lib.tg_block_matmul_f32.argtypes = [_p, _i64, _i64, _p, _i64, _i64, ctypes.c_int, _p, _i64]
    lib.tg_block_rows.argtypes = [_p, _i64, _i64, _i64, ctypes.c_int, _p, _i64, _p]
    lib.tg_cache_write.argtypes = [_p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _p, _i64]
    lib.tg_cache_write_f16.argtypes = [_p, _p, _i64, _i64, _i64, _i64, _i64, _p, _i64]
    lib.tg_cache_attention.argtypes = [_p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _p, _i64, ctypes.c_float,
                                       _i64]
    lib.tg_cache_attention_f16.argtypes = lib.tg_cache_attention.argtypes
    lib.tg_blockq_isa.argtypes = [ctypes.c_int]
    lib.tg_blockq_kernel.argtypes = [ctypes.c_int, _i64]
    lib.tg_cache_attention_kernel.argtypes = [_i64, _i64, _i64, _i64]
    lib.tg_error.restype = ctypes.c_char_p
    return lib


class KernelError(TilegraphError):
    """A kernel refused its arguments (what it said is the message)."""


def _check(rc: int) -> None:
    if rc:
        raise KernelError((library().tg_error() or b"").decode(errors="replace"))


def isa(name: str | None = None) -> str:
    """Selects the instruction set (None: the best the processor has); returns the one in use."""
    got = library().tg_blockq_isa(-1 if name is None else ISAS[name])
    return {v: k for k, v in ISAS.items()}[got]


def kernel(fmt: str, m: int) -> str:
    """The kernel block_matmul (activation='q8') takes for m rows of fmt at the current instruction set."""
    got = library().tg_blockq_kernel(FORMATS[fmt], m)
    _check(got < 0)
    return KERNELS[got]


def attention_kernel(t: int, d: int, keys: int, window: int = 0) -> str:
    """The path cache_attention takes for t queries of head size d over `keys` keys at the current
    instruction set: 'prompt' (GEMMs), 'zmm' (AVX-512, the cache read in place, f16 too) or 'units'
    (portable; an f16 cache widened a block at a time into scratch)."""
    return ATTENTION_KERNELS[library().tg_cache_attention_kernel(t, d, window, keys)]


def block_matmul(x: np.ndarray, w: np.ndarray, fmt: str, k: int, activation: str = "q8") -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32).reshape(-1, k)
    w = np.ascontiguousarray(w, np.uint8)
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    fn = library().tg_block_matmul if activation == "q8" else library().tg_block_matmul_f32
    _check(fn(x.ctypes.data, x.shape[0], k, w.ctypes.data, w.shape[0], w.shape[1],
                                     FORMATS[fmt], y.ctypes.data, w.shape[0]))
    return y


def block_rows(w: np.ndarray, fmt: str, k: int, idx: np.ndarray) -> np.ndarray:
    w = np.ascontiguousarray(w, np.uint8)
    idx = np.ascontiguousarray(idx, np.int64).reshape(-1)
    out = np.empty((idx.size, k), np.float32)
    _check(library().tg_block_rows(w.ctypes.data, w.shape[0], k, w.shape[1], FORMATS[fmt], idx.ctypes.data,
                                   idx.size, out.ctypes.data))
    return out


def _positions(pos, batch: int) -> tuple[np.ndarray, int]:
    pos = np.array(pos, np.int64)  # (np.ascontiguousarray would make a scalar 1-d)
    if pos.ndim > 1 or (pos.ndim == 1 and pos.size != batch):
        raise KernelError(f"pos must be a scalar or one per sequence ({batch}), got shape {pos.shape}")
    return pos, (0 if pos.ndim == 0 else 1)


def cache_write(cache: np.ndarray, x: np.ndarray, pos) -> None:
    """cache[b, :, pos_b:pos_b + T] = x[b], in place (cache must be C-contiguous); an f16 cache
    takes f32 rows, rounded to nearest even."""
    f16 = cache.dtype == np.float16 and x.dtype == np.float32
    if not cache.flags.c_contiguous or (cache.dtype != x.dtype and not f16):
        raise KernelError("cache_write needs a C-contiguous cache of x's dtype (or f16, of f32 rows)")
    x = np.ascontiguousarray(x)
    B, H, S, D = cache.shape
    p, stride = _positions(pos, B)
    if f16:
        _check(library().tg_cache_write_f16(cache.ctypes.data, x.ctypes.data, B, H, S, x.shape[2], D, p.ctypes.data,
                                            stride))
        return
    _check(library().tg_cache_write(cache.ctypes.data, x.ctypes.data, B, H, S, x.shape[2], D, cache.itemsize,
                                    p.ctypes.data, stride))


def cache_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos, scale: float, window: int = 0) -> np.ndarray:
    """The decode attention kernel over an f32 cache, or an f16 one (k and v both float16)."""
    f16 = k.dtype == np.float16
    q = np.ascontiguousarray(q, np.float32)
    k, v = (np.ascontiguousarray(a, np.float16 if f16 else np.float32) for a in (k, v))
    B, H, T, D = q.shape
    p, stride = _positions(pos, B)
    o = np.empty_like(q)
    fn = library().tg_cache_attention_f16 if f16 else library().tg_cache_attention
    _check(fn(q.ctypes.data, k.ctypes.data, v.ctypes.data, o.ctypes.data, B, H, k.shape[1], T, k.shape[2], D,
              p.ctypes.data, stride, scale, window))
    return o


# --- how far the integer path (activation='q8') is from the op's float semantics ----

def activation_error_bound(x: np.ndarray, w_dequantized: np.ndarray) -> np.ndarray:
    """The bound on |block_matmul(activation='q8') - block_matmul(activation='f32')| beyond rounding:
    each activation moves by at most half its block's step, max|x_block| / 254, so an output
    moves by at most sum_k (max|x_block(k)| / 254) |w[n, k]|. (The float formats f32, f16, bf16
    multiply x unquantized: no such term.)"""
    x = np.asarray(x, np.float64)
    xb = x.reshape(x.shape[:-1] + (-1, 32))
    half_step = np.broadcast_to(np.abs(xb).max(-1, keepdims=True) / 254.0, xb.shape).reshape(x.shape)
    return half_step @ np.abs(np.asarray(w_dequantized, np.float64)).T
