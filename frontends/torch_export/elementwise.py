"""Converters of elementwise ATen ops."""


from __future__ import annotations

import math

import numpy as np
import torch

from tilegraph.frontends import DROPOUT_SEED, FrontendError
from tilegraph.ir import decompositions as D, dtypes
from tilegraph.frontends.torch_export.registry import converts

aten = torch.ops.aten



@converts("clone.default", "contiguous.default", "alias.default", "detach.default", "lift_fresh_copy.default",
          "_to_copy.default", "to.dtype", "to.dtype_layout", "to.device", "to.other", "type_as.default")
def _identity(cv, node, a):
    x = a.get("self", a.get("input"))
    return cv.g.cast(x, cv.meta_dtype(node))  # dtype conversions take the result dtype


def _seeded_dropout(cv, x, p: float):
    """tg.dropout of x, seeded by the model's one seed, at the next site (each dropout its own masks);
    an error unless the import asked for dropouts (a training step's)."""
    if not cv.dropout_allowed:
        raise FrontendError("dropout in training mode; export the module in eval mode (tilegraph.train_step "
                            "builds a training step's dropouts)")
    if cv.dropout_seed is None:
        cv.dropout_seed = cv.g.weight(DROPOUT_SEED, np.zeros((), np.int64))
    cv.dropout_sites += 1
    return cv.g.op("dropout", x, cv.dropout_seed, p=float(p), site=cv.dropout_sites - 1)


@converts("dropout.default")
def _dropout(cv, node, a):
    if not (a.train and a.p > 0):
        return a.input
    if not 0 < a.p < 1:
        raise FrontendError(f"dropout with p={a.p}: tg.dropout takes 0 <= p < 1")
    return _seeded_dropout(cv, a.input, a.p)


@converts("feature_dropout.default", "alpha_dropout.default", "feature_alpha_dropout.default")
def _other_dropout(cv, node, a):
    if a.train and a.p > 0:
        raise FrontendError(f"{node.target} in training mode: only element-wise dropout (nn.Dropout) is built; "
                            "export the module in eval mode")
    return a.input


@converts("native_dropout.default")
def _native_dropout(cv, node, a):
    if not (a.train and a.p > 0):
        return (a.input, None)
    if not 0 < a.p < 1:
        raise FrontendError(f"dropout with p={a.p}: tg.dropout takes 0 <= p < 1")
    return (_seeded_dropout(cv, a.input, a.p), None)


# elementwise -----------------------------------------------------------------------

UNARY = {
    "neg": "neg", "abs": "abs", "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt",
    "reciprocal": "reciprocal", "tanh": "tanh", "sigmoid": "sigmoid", "relu": "relu", "erf": "erf",
    "sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin", "acos": "acos", "atan": "atan", "sinh": "sinh",
    "cosh": "cosh", "asinh": "asinh", "acosh": "acosh", "atanh": "atanh", "floor": "floor", "ceil": "ceil",
    "sign": "sign", "bitwise_not": "bitwise_not", "expm1": "expm1", "log1p": "log1p",
}


def _unary(tg_name):
    def convert(cv, node, a):
        return cv.g.op(tg_name, cv.g.cast(a.self, cv.meta_dtype(node)))

    return convert


for _name, _tg in UNARY.items():
    converts(f"{_name}.default")(_unary(_tg))


@converts("round.default", "round.decimals")
def _round(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    decimals = a.get("decimals") or 0
    if decimals == 0:
        return cv.g.round(x)
    scale = 10.0 ** decimals  # torch: nearbyint(x * 10^d) / 10^d
    return cv.g.round(x * scale) / scale


@converts("trunc.default", "fix.default")
def _trunc(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    if not dtypes.is_float(x.dtype):
        return x
    return cv.g.where(x < 0, cv.g.ceil(x), cv.g.floor(x))


@converts("frac.default")
def _frac(cv, node, a):
    x = a.self
    return x - cv.g.where(x < 0, cv.g.ceil(x), cv.g.floor(x))


@converts("square.default")
def _square(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    return x * x


@converts("log2.default", "log10.default")
def _log_base(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    base = 2.0 if "log2" in str(node.target) else 10.0
    return cv.g.log(x) * (1.0 / math.log(base))


@converts("exp2.default")
def _exp2(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    return cv.g.pow(cv.const(2.0, x.dtype), x)


@converts("logical_not.default")
def _logical_not(cv, node, a):
    return cv.g.op("not", cv.g.cast(a.self, "i1"))


@converts("isnan.default")
def _isnan(cv, node, a):
    return cv.g.isnan(a.self)


@converts("isinf.default", "isposinf.default", "isneginf.default")
def _isinf(cv, node, a):
    kind = str(node.target).split(".")[1]
    return cv.g.isinf(a.self, detect_positive=kind != "isneginf", detect_negative=kind != "isposinf")


@converts("isfinite.default")
def _isfinite(cv, node, a):
    return cv.g.op("not", cv.g.op("or", cv.g.isnan(a.self), cv.g.isinf(a.self)))


BINARY = {
    "add.Tensor": "add", "add.Scalar": "add", "sub.Tensor": "sub", "sub.Scalar": "sub", "mul.Tensor": "mul",
    "mul.Scalar": "mul", "maximum.default": "max", "minimum.default": "min", "max.other": "max", "min.other": "min",
    **{f"bitwise_{k}.{o}": f"bitwise_{k}" for k in ("and", "or", "xor") for o in ("Tensor", "Scalar", "Scalar_Tensor")},
}


def _binary(tg_name):
    def convert(cv, node, a):
        dt = cv.meta_dtype(node)
        x, y = cv.operand(a.self, dt), cv.operand(a.other, dt)
        alpha = a.get("alpha", 1)
        if alpha != 1:
            y = y * alpha
        return cv.g.op(tg_name, x, y)

    return convert


for _name, _tg in BINARY.items():
    converts(_name)(_binary(_tg))


@converts("rsub.Scalar", "rsub.Tensor")
def _rsub(cv, node, a):
    dt = cv.meta_dtype(node)
    x, y = cv.operand(a.self, dt), cv.operand(a.other, dt)
    return y - (x * a.alpha if a.alpha != 1 else x)


@converts("div.Tensor", "div.Scalar", "div.Tensor_mode", "div.Scalar_mode", "true_divide.Tensor")
def _div(cv, node, a):
    mode = a.get("rounding_mode")
    dt = cv.meta_dtype(node)
    x, y = cv.operand(a.self, dt), cv.operand(a.other, dt)
    if mode is None:
        return cv.g.div(x, y)
    return _floor_div(cv, x, y) if mode == "floor" else _trunc_div(cv, x, y)


def _trunc_div(cv, x, y):
    q = cv.g.div(x, y)  # tg.div truncates integers, as C and torch do
    return cv.g.where(q < 0, cv.g.ceil(q), cv.g.floor(q)) if dtypes.is_float(q.dtype) else q


def _floor_div(cv, x, y):
    if dtypes.is_float(x.dtype):
        return cv.g.floor(cv.g.div(x, y))
    # (x - x mod y) is a multiple of y, so the truncating tg.div is exact here.
    return cv.g.div(x - cv.g.mod(x, y), y)


@converts("floor_divide.default", "floor_divide.Scalar")
def _floor_divide(cv, node, a):
    dt = cv.meta_dtype(node)
    return _floor_div(cv, cv.operand(a.self, dt), cv.operand(a.other, dt))


@converts("remainder.Tensor", "remainder.Scalar", "fmod.Tensor", "fmod.Scalar")
def _mod(cv, node, a):
    dt = cv.meta_dtype(node)
    return cv.g.mod(cv.operand(a.self, dt), cv.operand(a.other, dt), fmod="fmod" in str(node.target))


@converts("pow.Tensor_Tensor", "pow.Tensor_Scalar", "pow.Scalar")
def _pow(cv, node, a):
    dt = cv.meta_dtype(node)
    return cv.g.pow(cv.operand(a.self, dt), cv.operand(a.exponent, dt))


COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}


def _compare(tg_name):
    def convert(cv, node, a):
        dt = cv.promote(a.self, a.other)
        return cv.g.op(tg_name, cv.operand(a.self, dt), cv.operand(a.other, dt))

    return convert


for _name, _tg in COMPARE.items():
    converts(f"{_name}.Tensor", f"{_name}.Scalar")(_compare(_tg))


def _logical(tg_name):
    def convert(cv, node, a):
        return cv.g.op(tg_name, cv.operand(a.self, "i1"), cv.operand(a.other, "i1"))

    return convert


for _name in ("and", "or", "xor"):
    converts(f"logical_{_name}.default")(_logical(_name))


@converts("where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar")
def _where(cv, node, a):
    dt = cv.meta_dtype(node)
    return cv.g.where(cv.g.cast(a.condition, "i1"), cv.operand(a.self, dt), cv.operand(a.other, dt))


@converts("masked_fill.Scalar", "masked_fill.Tensor")
def _masked_fill(cv, node, a):
    dt = cv.meta_dtype(node)
    return cv.g.where(cv.g.cast(a.mask, "i1"), cv.operand(a.value, dt), cv.operand(a.self, dt))


@converts("clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_min.Tensor", "clamp_max.default",
          "clamp_max.Tensor", "hardtanh.default")
def _clamp(cv, node, a):
    dt = cv.meta_dtype(node)
    name = str(node.target)
    lo = a.get("min", a.get("min_val"))
    hi = a.get("max", a.get("max_val"))
    if "clamp_max" in name:
        lo, hi = None, a.max
    x = cv.g.cast(a.self, dt)
    if lo is not None:  # torch: min(max(x, lo), hi)
        x = cv.g.max(x, cv.operand(lo, dt))
    if hi is not None:
        x = cv.g.min(x, cv.operand(hi, dt))
    return x


# activations ------------------------------------------------------------------------


@converts("gelu.default")
def _gelu(cv, node, a):
    return cv.g.gelu(a.self, approximate=a.approximate)


@converts("silu.default")
def _silu(cv, node, a):
    return D.swish(cv.emit, a.self)


@converts("mish.default")
def _mish(cv, node, a):
    return D.mish(cv.emit, a.self, threshold=20.0)  # torch's softplus threshold


@converts("softplus.default")
def _softplus(cv, node, a):
    return D.softplus(cv.emit, a.self, a.beta, a.threshold)


@converts("hardsigmoid.default")
def _hardsigmoid(cv, node, a):
    return D.hard_sigmoid(cv.emit, a.self, 1 / 6, 0.5)  # torch: relu6(x + 3) / 6


@converts("hardswish.default")
def _hardswish(cv, node, a):
    return D.hard_swish(cv.emit, a.self)


@converts("leaky_relu.default")
def _leaky_relu(cv, node, a):
    return D.leaky_relu(cv.emit, a.self, a.negative_slope)


@converts("elu.default")
def _elu(cv, node, a):
    return D.elu(cv.emit, a.self, a.alpha, a.scale, a.input_scale)


# reductions -------------------------------------------------------------------------
