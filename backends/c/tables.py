"""The C backend's tables: C types, operator spellings, oneDNN names and the emitter's thresholds."""

from __future__ import annotations

CTYPES = {"f32": "float", "f64": "double", "i64": "int64_t", "i32": "int32_t", "i16": "int16_t", "i8": "int8_t",
          "ui8": "uint8_t", "ui16": "uint16_t", "ui32": "uint32_t", "ui64": "uint64_t", "i1": "uint8_t"}
FLOATS = ("f32", "f64")
# How a buffer's elements are stored: CTYPES, and bf16 as its 16 bits, which only a step that
# writes a bf16 GEMM's source uses (onednn.py, bf16_sources); no tensor of the model is bf16
# in C (CTYPES has no bf16: such an op runs on the host).
STORAGE = {**CTYPES, "bf16": "uint16_t"}

# Elementwise ops as C expressions of their operands, computed in the operands' type
# (floats: tgmath picks the float or double function).
C_UNARY_FLOAT = {
    "neg": "(-{x})", "abs": "fabs({x})", "exp": "{exp}({x})", "log": "log({x})", "sqrt": "sqrt({x})",
    "rsqrt": "(1 / sqrt({x}))", "reciprocal": "(1 / {x})", "tanh": "{tanh}({x})", "erf": "{erf}({x})",
    "relu": "(({x}) > 0 || ({x}) != ({x}) ? ({x}) : 0)", "sin": "sin({x})", "cos": "cos({x})", "tan": "tan({x})",
    "asin": "asin({x})", "acos": "acos({x})", "atan": "atan({x})", "sinh": "sinh({x})", "cosh": "cosh({x})",
    "asinh": "asinh({x})", "acosh": "acosh({x})", "atanh": "atanh({x})", "floor": "floor({x})",
    "ceil": "ceil({x})", "round": "rint({x})", "sign": "(({x}) > 0 ? 1 : (({x}) < 0 ? -1 : ({x})))",
    "expm1": "expm1({x})", "log1p": "log1p({x})", "isnan": "(({x}) != ({x}))", "not": "(!({x}))",
}
C_UNARY_INT = {
    "neg": "(-{x})", "abs": "(({x}) < 0 ? -({x}) : ({x}))", "relu": "(({x}) > 0 ? ({x}) : 0)", "floor": "({x})",
    "ceil": "({x})", "round": "({x})", "sign": "((({x}) > 0) - (({x}) < 0))", "bitwise_not": "(~({x}))",
    "not": "(!({x}))", "isnan": "0",
}
C_BINARY = {
    "add": "(({lhs}) + ({rhs}))", "sub": "(({lhs}) - ({rhs}))", "mul": "(({lhs}) * ({rhs}))",
    "and": "(({lhs}) != 0 && ({rhs}) != 0)", "or": "(({lhs}) != 0 || ({rhs}) != 0)",
    "xor": "((({lhs}) != 0) != (({rhs}) != 0))", "eq": "(({lhs}) == ({rhs}))", "ne": "(({lhs}) != ({rhs}))",
    "lt": "(({lhs}) < ({rhs}))", "le": "(({lhs}) <= ({rhs}))", "gt": "(({lhs}) > ({rhs}))",
    "ge": "(({lhs}) >= ({rhs}))", "where": "(({cond}) ? ({lhs}) : ({rhs}))",
}
C_BINARY_FLOAT = {
    "div": "(({lhs}) / ({rhs}))", "pow": "pow({lhs}, {rhs})",
    # NumPy's maximum and minimum propagate NaN from either side.
    "max": "(({lhs}) > ({rhs}) || ({lhs}) != ({lhs}) ? ({lhs}) : ({rhs}))",
    "min": "(({lhs}) < ({rhs}) || ({lhs}) != ({lhs}) ? ({lhs}) : ({rhs}))",
}
C_BINARY_INT = {
    "max": "(({lhs}) > ({rhs}) ? ({lhs}) : ({rhs}))", "min": "(({lhs}) < ({rhs}) ? ({lhs}) : ({rhs}))",
    "bitwise_and": "(({lhs}) & ({rhs}))", "bitwise_or": "(({lhs}) | ({rhs}))", "bitwise_xor": "(({lhs}) ^ ({rhs}))",
}
# Integer division and modulo, and a float to int cast out of range, trap or are undefined
# in C where NumPy defines a result (x / 0, INT_MIN / -1, NaN to int): runtime.h's helpers
# (tg_div_i32, tg_mod_f32, tg_f2i64, ...) give NumPy's. A cast to each integer type goes
# through the int32 or int64 helper, as NumPy's casts do on x86. Integer power and shifts
# past the width run on the host (HOST_FALLBACK).
FLOAT_TO_INT = {"i64": "i64", "i32": "i32", "i16": "i32", "i8": "i32", "ui16": "i32", "ui8": "i32"}

# oneDNN algorithm kinds (dnnl_types.h) for epilogues it fuses into a GEMM or convolution.
DNNL_ELTWISE = {"relu": "dnnl_eltwise_relu", "tanh": "dnnl_eltwise_tanh", "exp": "dnnl_eltwise_exp",
                "sigmoid": "dnnl_eltwise_logistic", "linear": "dnnl_eltwise_linear",
                "gelu_tanh": "dnnl_eltwise_gelu_tanh", "gelu_erf": "dnnl_eltwise_gelu_erf", "clip": "dnnl_eltwise_clip",
                "swish": "dnnl_eltwise_swish", "hardswish": "dnnl_eltwise_hardswish"}
DNNL_BINARY = {"add": "dnnl_binary_add", "mul": "dnnl_binary_mul", "sub": "dnnl_binary_sub"}
DNNL_TYPES = {"f32": "dnnl_f32", "i8": "dnnl_s8", "ui8": "dnnl_u8", "i32": "dnnl_s32"}
# topk keeps at most this many values of a row in C (an insertion per value read: k compares
# at worst); more run on the host's sort.
TOPK_MAX = 64
# Work below this many elements runs on one thread: an OpenMP fork/join costs more.
PARALLEL_MIN = 32768
KNOWN = ("weight", "constant", "folded")  # buffers whose values no input changes
# A reduction's accumulator (double for floats) at its start and per value v; max and min
# keep a NaN, as NumPy's do.
REDUCE_INIT = {"sum": "0", "mean": "0", "max": "-INFINITY", "min": "INFINITY"}
REDUCE_STEP = {"sum": "acc += v;", "mean": "acc += v;", "max": "acc = v > acc || v != v ? v : acc;",
               "min": "acc = v < acc || v != v ? v : acc;"}
# The same as a simd loop (a row of a fused reduction): OpenMP's reduction clause, and for max
# and min a NaN flag beside it (lanes combine as max does, which would drop a lane's NaN).
REDUCE_SIMD = {"sum": ("reduction(+:acc)", "acc += v;"), "mean": ("reduction(+:acc)", "acc += v;"),
               "max": ("reduction(max:acc) reduction(|:nan)", "acc = v > acc ? v : acc; nan |= v != v;"),
               "min": ("reduction(min:acc) reduction(|:nan)", "acc = v < acc ? v : acc; nan |= v != v;")}
# A channels-last result of at most this many channels read from planes (an RGB image's copy
# for the stem convolution) is written a pixel at a time, its channels unrolled (loops.py, loop).
UNROLLED_CHANNELS = 4
SIMD_BLOCK = 4096  # elements a thread takes at a time in a flat parallel loop
# A GEMM's B passed each run whose rows lie a multiple of this many bytes apart is reordered each
# run (runtime.c, tg_aliased_rows: such rows share a few L1 sets, 4 KiB the L1's set stride).
REPACK_ROW_BYTES = 4096
# Multiply-adds below which a GEMM runs as emitted loops: a oneDNN call costs ~1.5 us.
SMALL_GEMM = 16384
# The bytes of transformed tiles (V and M) a Winograd convolution works through at a time: each
# chunk's input transform, GEMMs and output transform run before the next, while it is in cache
# (benchmarks/winograd_convs.py at batch 8: 56x56x64 0.51x direct in 2 MiB chunks, 0.55x in 1 MiB,
# 0.60x in 4 MiB, 0.67x all 1568 tiles at once; 28x28x128 0.37x, 0.50x, 0.47x, 0.51x).
WINOGRAD_CHUNK_BYTES = 2 << 20
