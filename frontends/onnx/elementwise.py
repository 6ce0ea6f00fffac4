"""Converters: elementwise ops, activations as compositions, casts."""

from __future__ import annotations

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import CONVERTERS, _conv
from tilegraph.frontends.onnx.values import onnx_dtype
from tilegraph.ir import decompositions as D, dtypes
from tilegraph.ir.onnx_names import BINARY, UNARY


for _onnx, _tg in UNARY.items():
    CONVERTERS[_onnx] = lambda n, _tg=_tg: n.op(_tg, n.x(0))  # type: ignore[misc]

for _onnx, _tg in BINARY.items():
    CONVERTERS[_onnx] = lambda n, _tg=_tg: n.op(_tg, n.x(0), n.x(1))  # type: ignore[misc]

VARIADIC = {"Max": "max", "Min": "min", "Sum": "add"}
for _onnx, _tg in VARIADIC.items():
    def _variadic(n, _tg=_tg):
        out = n.x(0)
        for v in n.inputs[1:]:
            out = n.op(_tg, out, v)
        return out

    CONVERTERS[_onnx] = _variadic


@_conv("Identity")
def _identity(n):
    return n.x(0)


@_conv("Mean")
def _mean(n):
    total = CONVERTERS["Sum"](n)
    return n.op("div", total, len(n.inputs))


@_conv("Where")
def _where(n):
    return n.op("where", n.x(0), n.x(1), n.x(2))


@_conv("Mod")
def _mod(n):
    return n.op("mod", n.x(0), n.x(1), fmod=bool(n.attr("fmod", 0)))


@_conv("BitShift")
def _bitshift(n):
    direction = n.attr("direction")
    if direction not in ("LEFT", "RIGHT"):
        raise FrontendError(f"direction '{direction}' is neither LEFT nor RIGHT")
    return n.op("shift_left" if direction == "LEFT" else "shift_right", n.x(0), n.x(1))


@_conv("Pow")
def _pow(n):
    base, exp = n.x(0), n.x(1)
    bt, et = n.dtype(base), n.dtype(exp)
    if bt == et:
        return n.op("pow", base, exp)
    if dtypes.is_float(bt):
        return n.op("pow", base, n.cast(exp, bt))
    # An integer base to a float power: computed in the exponent's type, then truncated
    # back to the base's type (the ONNX reference does the same).
    return n.cast(n.op("pow", n.cast(base, et), exp), bt)


@_conv("IsInf")
def _isinf(n):
    return n.op("isinf", n.x(0), detect_positive=bool(n.attr("detect_positive", 1)),
                detect_negative=bool(n.attr("detect_negative", 1)))


# --- activations as compositions ---


@_conv("LeakyRelu")
def _leaky_relu(n):
    return D.leaky_relu(n.emit, n.x(0), n.attr("alpha", 0.01))


@_conv("PRelu")
def _prelu(n):
    return D.leaky_relu(n.emit, n.x(0), n.x(1))


@_conv("Elu")
def _elu(n):
    return D.elu(n.emit, n.x(0), n.attr("alpha", 1.0), expm1=False)  # ONNX: alpha * (exp(x) - 1)


@_conv("Selu")
def _selu(n):
    # Defaults from the ONNX spec (Klambauer et al. 2017, rounded to float32).
    x = n.x(0)
    alpha, gamma = n.attr("alpha", 1.67326319217681884765625), n.attr("gamma", 1.05070102214813232421875)
    neg = n.op("sub", n.op("mul", n.op("exp", x), alpha), alpha)
    return n.op("mul", n.op("where", n.op("le", x, 0), neg, x), gamma)


@_conv("Celu")
def _celu(n):
    x, alpha = n.x(0), n.attr("alpha", 1.0)
    neg = n.op("mul", n.op("sub", n.op("exp", n.op("div", x, alpha)), 1), alpha)
    return n.op("add", n.op("max", x, 0), n.op("min", neg, 0))


@_conv("HardSigmoid")
def _hard_sigmoid(n):
    return D.hard_sigmoid(n.emit, n.x(0), n.attr("alpha", 0.2), n.attr("beta", 0.5))


@_conv("HardSwish")
def _hard_swish(n):
    return D.hard_swish(n.emit, n.x(0))


@_conv("Softplus")
def _softplus(n):
    return D.softplus(n.emit, n.x(0), log1p=False)  # ONNX: log(exp(x) + 1)


@_conv("Softsign")
def _softsign(n):
    x = n.x(0)
    return n.op("div", x, n.op("add", n.op("abs", x), 1))


@_conv("ThresholdedRelu")
def _thresholded_relu(n):
    x = n.x(0)
    return n.op("where", n.op("gt", x, n.attr("alpha", 1.0)), x, 0)


@_conv("Shrink")
def _shrink(n):
    x, bias, lambd = n.x(0), n.attr("bias", 0.0), n.attr("lambd", 0.5)
    if dtypes.is_int(n.dtype(x)):
        bias, lambd = int(bias), int(lambd)
    inner = n.op("where", n.op("gt", x, lambd), n.op("sub", x, bias), 0)
    return n.op("where", n.op("lt", x, -lambd), n.op("add", x, bias), inner)


@_conv("Mish")
def _mish(n):
    return D.mish(n.emit, n.x(0), log1p=False)


@_conv("Swish")
def _swish(n):
    return D.swish(n.emit, n.x(0), n.attr("alpha", 1.0))


@_conv("Gelu")
def _gelu(n):
    return n.op("gelu", n.x(0), approximate=n.attr("approximate", "none"))


@_conv("Clip")
def _clip(n):
    x = n.x(0)
    lo, hi = n.opt(1), n.opt(2)
    if lo is not None:
        x = n.op("max", x, lo)
    if hi is not None:
        x = n.op("min", x, hi)
    return x


# --- casts ---

# Largest finite values of the float8 types: what saturate=1 clamps to (ONNX Cast spec).
FLOAT8_MAX = {"f8E4M3FN": 448.0, "f8E5M2": 57344.0, "f8E4M3FNUZ": 240.0, "f8E5M2FNUZ": 57344.0}


def _cast_to(n, x, to: str):
    if to == "f8E8M0FNU" and n.dtype(x) != to:
        # ONNX rounds to E8M0 up (round_mode='up') and saturates tiny values to 2^-127;
        # tg's cast rounds to nearest as ml_dtypes does. Refused rather than computed differently.
        raise FrontendError(f"{n.where()}: Cast to FLOAT8E8M0 is not supported (ONNX's round_mode "
                            f"'{n.attr('round_mode', 'up')}' is not tg's round-to-nearest)")
    if to in FLOAT8_MAX and n.attr("saturate", 1) and dtypes.is_float(n.dtype(x)):
        m = FLOAT8_MAX[to]
        x = n.op("min", n.op("max", x, -m), m)
    return n.cast(x, to)


@_conv("Cast")
def _cast(n):
    return _cast_to(n, n.x(0), onnx_dtype(n.attr("to"), "attribute 'to'"))


@_conv("CastLike")
def _cast_like(n):
    return _cast_to(n, n.x(0), n.dtype(n.x(1)))


@_conv("BitCast")
def _bitcast(n):
    x = n.x(0)
    to = onnx_dtype(n.attr("to"), "attribute 'to'")
    return n.op("bitcast", x, to=to, source=n.dtype(x))
