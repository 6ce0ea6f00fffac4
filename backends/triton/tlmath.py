"""Math functions the Triton kernels need and `triton.language` lacks in its interpreter.

Triton's interpreter (TRITON_INTERPRET=1, how kernels run without a GPU) supports
exp, log, sqrt, sin, cos, erf, floor, ceil and abs, but not libdevice (tanh, atan,
expm1, ...). Writing these few functions from those primitives, once, means the CPU
tests run exactly the code a GPU runs. Each is accurate to a few float32 ulps:
the NumPy templates of the op table (ir/ops.py) are the reference semantics, with
their special values (nan, inf, signed results) kept.

Sources: expm1/log1p by Kahan's trick (Goldberg, "What every computer scientist
should know about floating-point arithmetic", 1991, Theorem 4); atan's range
reduction and minimax polynomial from Cephes `atanf.c` (S. Moshier).
"""

import triton
import triton.language as tl

# Globals a kernel reads must be constexpr.
PI_2: tl.constexpr = tl.constexpr(1.5707963267948966)
PI_4: tl.constexpr = tl.constexpr(0.7853981633974483)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
TAN_3PI_8: tl.constexpr = tl.constexpr(2.414213562373095)  # tan(3*pi/8): Cephes' reduction thresholds
TAN_PI_8: tl.constexpr = tl.constexpr(0.4142135623730950)
# Beyond this |x|, x*x overflows float32 and asinh/acosh use log(2|x|).
HUGE: tl.constexpr = tl.constexpr(1e18)


@triton.jit
def expm1(x):
    u = tl.exp(x)
    # (u - 1) * x / log(u) cancels the rounding of u (Kahan); u == 1 means |x| < ulp.
    small = tl.where(u == 1.0, x, (u - 1.0) * x / tl.log(tl.where(u == 1.0, 2.0, u)))
    return tl.where((u - 1.0) == -1.0, -1.0, tl.where(u == float("inf"), u, small))


@triton.jit
def log1p(x):
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * x / tl.where(d == 0.0, 1.0, d))


@triton.jit
def tanh(x):
    a = tl.abs(x)
    e = expm1(2.0 * a)
    t = e / (e + 2.0)
    t = tl.where(a > 10.0, 1.0, t)  # tanh(10) rounds to 1 in float32 (and e would overflow)
    return tl.where(x < 0, -t, tl.where(x == x, t, x))


@triton.jit
def sigmoid(x):
    # As ir.kernels.sigmoid: exp of -|x| never overflows.
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def sinh(x):
    a = tl.abs(x)
    s = expm1(a)
    r = tl.where(s == float("inf"), s, 0.5 * (s + s / (s + 1.0)))
    return tl.where(x < 0, -r, tl.where(x == x, r, x))


@triton.jit
def cosh(x):
    a = tl.abs(x)
    # exp(a - ln 2) + exp(-a) / 2: no overflow for a just under float32's cosh limit.
    return tl.exp(a - LN2) + 0.5 * tl.exp(-a)


@triton.jit
def asinh(x):
    a = tl.abs(x)
    small = log1p(a + a * a / (1.0 + tl.sqrt(1.0 + a * a)))
    r = tl.where(a > HUGE, tl.log(a) + LN2, small)
    return tl.where(x < 0, -r, tl.where(x == x, r, x))


@triton.jit
def acosh(x):
    t = x - 1.0
    near = log1p(t + tl.sqrt(2.0 * t + t * t))
    return tl.where(x > HUGE, tl.log(x) + LN2, near)


@triton.jit
def atanh(x):
    return 0.5 * log1p(2.0 * x / (1.0 - x))


@triton.jit
def atan(x):
    a = tl.abs(x)
    big = a > TAN_3PI_8
    mid = (a > TAN_PI_8) & (~big)
    y0 = tl.where(big, PI_2, tl.where(mid, PI_4, 0.0))
    r = tl.where(big, -1.0 / tl.where(big, a, 1.0), tl.where(mid, (a - 1.0) / (a + 1.0), a))
    z = r * r
    p = (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * r + r
    y = y0 + p
    return tl.where(x < 0, -y, tl.where(x == x, y, x))


@triton.jit
def asin(x):
    # (1 - x)(1 + x) keeps 1 - x*x accurate near |x| = 1; |x| > 1 gives sqrt(<0) = nan.
    return atan(x / tl.sqrt((1.0 - x) * (1.0 + x)))


@triton.jit
def acos(x):
    return 2.0 * atan(tl.sqrt((1.0 - x) / (1.0 + x)))


@triton.jit
def rint(x):
    """Round half to even (np.round)."""
    r = tl.floor(x)
    d = x - r
    odd = (r - 2.0 * tl.floor(0.5 * r)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def sign(x):
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, x))  # 0 stays 0, nan stays nan


@triton.jit
def mod(a, b, FMOD: tl.constexpr):
    """np.fmod (C, the sign of a) if FMOD else np.mod (Python, the sign of b); `%` is fmod."""
    r = a % b
    if not FMOD:
        r = tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
    return r


@triton.jit
def pow(a, b):
    """np.power for floats, computed in float64 (exp(b log|a|) loses |b log a| ulps in float32)."""
    a64 = a.to(tl.float64)
    b64 = b.to(tl.float64)
    r = tl.exp(b64 * tl.log(tl.abs(a64)))
    b_int = tl.floor(b64) == b64
    b_odd = b_int & ((b64 - 2.0 * tl.floor(0.5 * b64)) != 0.0)
    r = tl.where(a64 < 0, tl.where(b_int, tl.where(b_odd, -r, r), float("nan")), r)
    r = tl.where((b64 == 0.0) | (a64 == 1.0), 1.0, r)
    return r.to(a.dtype)


@triton.jit
def ipow(a, b):
    """np.power for integers (b >= 0), by squaring: 32 steps cover every exponent below 2**32."""
    result = a * 0 + 1
    base = a
    e = b
    for _ in tl.static_range(32):
        result = tl.where((e & 1) != 0, result * base, result)
        base = base * base
        e = e >> 1
    return result
