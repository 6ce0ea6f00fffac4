"""@triton.jit helpers of the quantized kernels (backends/triton/quant.py): number formats
Triton has no type for, decoded and encoded with integer bit operations, so that a GPU
and Triton's interpreter compute the same bits.

    pow2(n)               2^n as float32, n an int32 in [-127, 127] (2^-127 is subnormal)
    e8m0(s)               an f8E8M0FNU scale (its byte, uint8) as float32: 2^(s - 127)
    mx_exponent(amax, .)  the exponent of the OCP MX scale of blocks whose largest magnitude
                          is amax: ir.quant.mx_scale, bit for bit
    e2m1(nibble)          an f4E2M1FN value (its 4 bits) as float32
    int4(nibble)          an i4 value (its 4 bits, two's complement) as float32
    unpack_k(p, BK, BN)   [BK // 2, BN] bytes holding two 4-bit values each (the row 2i in the
                          low nibble, 2i + 1 in the high one: how the backend stores 4-bit
                          weights, as tl.dot_scaled reads e2m1) -> [BK, BN] nibbles
"""

import triton
import triton.language as tl


@triton.jit
def pow2(n):
    # A normal float32 2^n has the biased exponent n + 127 and no mantissa; 2^-127 is the
    # subnormal whose mantissa's top bit is set.
    bits = tl.where(n >= -126, (n + 127) << 23, 1 << 22)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0(s):
    return pow2(s.to(tl.int32) - 127)


@triton.jit
def mx_exponent(amax, EMAX: tl.constexpr, MANTISSA_LIMIT: tl.constexpr):
    """The smallest e in [-127, 127] with amax <= hi * 2^e, where the format's largest value
    hi = (1 + MANTISSA_LIMIT / 2^23) * 2^EMAX; 0 where amax is 0 (ir.quant.mx_scale).
    amax = (1 + f) 2^x (normal) needs e = x - EMAX, one more when its mantissa f is above hi's;
    a subnormal amax (below 2^-126) needs less than -127 for any format with EMAX >= 1."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    e = biased - 127 - EMAX + ((bits & 0x7FFFFF) > MANTISSA_LIMIT).to(tl.int32)
    e = tl.where(biased == 0, -127, e)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(amax == 0, 0, e)


@triton.jit
def e2m1(nibble):
    """sign, 2 exponent bits (bias 1), 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    n = nibble.to(tl.int32)
    e = (n >> 1) & 3
    m = n & 1
    # (1 + m/2) 2^(e-1) = (2 + m) 2^e / 4 for normal values; the subnormal (e = 0) is m / 2 = 2m / 4.
    mag = tl.where(e == 0, 2 * m, (2 + m) << e).to(tl.float32) * 0.25
    return tl.where((n & 8) != 0, -mag, mag)


@triton.jit
def int4(nibble):
    return (((nibble.to(tl.int32) & 15) ^ 8) - 8).to(tl.float32)


@triton.jit
def unpack_k(p, BK: tl.constexpr, BN: tl.constexpr):
    # join puts each byte's (low, high) pair on a new last axis; moving it next to the packed
    # rows and merging the two makes rows 2i (low) and 2i + 1 (high).
    return tl.join(p & 15, p >> 4).permute(0, 2, 1).reshape(BK, BN)
