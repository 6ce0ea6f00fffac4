"""Converters: reductions, arg max/min, softmax."""

from __future__ import annotations

import numpy as np

from tilegraph.frontends.onnx.node import CONVERTERS, _axis, _conv
from tilegraph.ir import dtypes
from tilegraph.ir.onnx_names import REDUCE


# --- reductions ---

def _reduce_axes(n, x) -> list[int] | None:
    """The axes to reduce; None: the identity (noop_with_empty_axes with no axes)."""
    r = n.rank(x)
    axes = n.ints_attr_or_input("axes", 1)
    if not axes:
        if n.attr("noop_with_empty_axes", 0):
            return None
        return list(range(r))
    return sorted({_axis(a, r) for a in axes})


def _empty_reduction(n, kind, x, axes, keepdims):
    """A reduction over an empty set: its identity element, as ONNX defines it."""
    shape = [1 if i in axes else d for i, d in enumerate(n.shape(x)) if keepdims or i not in axes]
    dt = dtypes.numpy_dtype(n.dtype(x))
    if dtypes.is_float(n.dtype(x)):
        big, small = np.inf, -np.inf
    elif n.dtype(x) == "i1":
        big, small = True, False
    else:
        big, small = np.iinfo(dt).max, np.iinfo(dt).min
    identity = {"sum": 0, "l1": 0, "l2": 0, "sum_square": 0, "prod": 1, "max": small, "min": big,
                "log_sum": -np.inf, "log_sum_exp": -np.inf, "mean": np.nan}[kind]
    return n.broadcast(np.full((1,) * len(shape), identity, dtype=dt), shape)


def _reduce(n, kind):
    x = n.x(0)
    axes = _reduce_axes(n, x)
    if axes is None:
        return x
    keep = bool(n.attr("keepdims", 1))
    shape = n.shape(x)
    if any(isinstance(shape[a], int) and shape[a] == 0 for a in axes):
        return _empty_reduction(n, kind, x, axes, keep)
    if kind in ("sum", "mean", "max", "min", "prod"):
        return n.reduce(kind, x, axes, keep)
    if kind == "l1":
        return n.reduce("sum", n.op("abs", x), axes, keep)
    if kind == "sum_square":
        return n.reduce("sum", n.op("mul", x, x), axes, keep)
    if kind == "l2":
        return n.op("sqrt", n.reduce("sum", n.op("mul", x, x), axes, keep))
    if kind == "log_sum":
        return n.op("log", n.reduce("sum", x, axes, keep))
    # log-sum-exp, shifted by the max so that exp cannot overflow
    m = n.reduce("max", x, axes, True)
    s = n.op("log", n.reduce("sum", n.op("exp", n.op("sub", x, m)), axes, True))
    out = n.op("add", s, m)
    return out if keep else n.reshape(out, [d for i, d in enumerate(shape) if i not in axes])


for _onnx, _kind in REDUCE.items():
    CONVERTERS[_onnx] = lambda n, _kind=_kind: _reduce(n, _kind)  # type: ignore[misc]


@_conv("ArgMax", "ArgMin")
def _arg(n):
    x = n.x(0)
    return n.op(n.op_type.lower(), x, axis=_axis(n.attr("axis", 0), n.rank(x)), keepdims=bool(n.attr("keepdims", 1)),
                select_last_index=bool(n.attr("select_last_index", 0)))


@_conv("Softmax")
def _softmax(n):
    x = n.x(0)
    return n.op("softmax", x, axis=_axis(n.attr("axis", -1), n.rank(x)))


@_conv("LogSoftmax")
def _log_softmax(n):
    x = n.x(0)
    axis = _axis(n.attr("axis", -1), n.rank(x))
    shifted = n.op("sub", x, n.reduce("max", x, [axis], True))
    return n.op("sub", shifted, n.op("log", n.reduce("sum", n.op("exp", shifted), [axis], True)))


@_conv("Hardmax")
def _hardmax(n):
    x = n.x(0)
    axis = _axis(n.attr("axis", -1), n.rank(x))
    first = n.op("argmax", x, axis=axis, keepdims=True)
    return n.cast(n.op("eq", n.iota(n.shape(x), axis), first), n.dtype(x))
