"""Converters of mixture-of-experts helpers and of ops that create tensors."""


from __future__ import annotations


import numpy as np
import torch

from tilegraph.frontends import FrontendError
from tilegraph.ir import dtypes
from tilegraph.ir.shapes import TensorInfo, numel
from tilegraph.frontends.torch_export.layout import _arange
from tilegraph.frontends.torch_export.registry import CONVERTERS, converts

aten = torch.ops.aten



# mixture of experts -----------------------------------------------------------------------


@converts("histc.default")
def _histc(cv, node, a):
    """Counts of values per equal-width bin of [min, max] (the last bin closed), values outside
    ignored: one comparison against every bin, summed. The bins are static; MoE routing counts
    the tokens sent to each expert with it."""
    x, bins = a.self, int(a.get("bins", 100))
    lo, hi = float(a.get("min", 0)), float(a.get("max", 0))
    if not hi > lo:
        raise FrontendError(f"histc over [{lo}, {hi}]: a range taken from the data is not supported")
    g, dt = cv.g, x.dtype
    const = lambda v: g.constant(np.asarray(v, dtypes.numpy_dtype(dt)))  # noqa: E731
    flat = g.reshape(x, (numel(x.shape),))
    index = g.op("floor", (flat - lo) * (bins / (hi - lo)))
    index = g.where(g.op("eq", flat, const(hi)), const(bins - 1), index)
    inside = g.op("and", flat >= lo, flat <= hi)
    index = g.where(inside, index, const(-1))
    hits = g.op("eq", g.reshape(index, (flat.shape[0], 1)), g.constant(np.arange(bins, dtype=dtypes.numpy_dtype(dt))))
    return g.sum(g.cast(hits, dt), axes=(0,))


def _grouped_mm(cv, node, a):
    """transformers' grouped_mm_fallback: rows sorted by expert, offs the cumulative row count of
    each expert; row s is multiplied by the weight of the expert whose range holds s (rows past
    the last offset are zero). Each row gathers its own expert's weight, so the work is that of
    the experts actually chosen, one row-matmul per routed token."""
    g, x, w, offs = cv.g, a.input, a.weight, a.offs
    rows, experts = x.shape[0], w.shape[0]
    row = g.op("iota", result=TensorInfo((rows, 1), offs.dtype), axis=0)
    expert = g.sum(g.cast(g.op("ge", row, g.reshape(offs, (1, experts))), "i64"), axes=(1,))  # (rows,)
    used = g.cast(g.op("lt", expert, g.constant(np.asarray(experts, np.int64))), x.dtype)
    chosen = g.gather(w, g.op("min", expert, g.constant(np.asarray(experts - 1, np.int64))), axis=0)
    out = g.reshape(g.matmul(g.reshape(x, (rows, 1, x.shape[1])), chosen), (rows, w.shape[2]))
    return out * g.reshape(used, (rows, 1))


CONVERTERS["transformers.grouped_mm_fallback.default"] = _grouped_mm


# creation ------------------------------------------------------------------------------


def _filled(cv, node, value):
    """A tensor of torch's result shape and dtype filled with one value: a broadcast scalar."""
    dt, shape = cv.meta_dtype(node), cv.meta_shape(node)
    scalar = cv.operand(value, dt)
    return scalar if len(shape) == 0 else cv.g.broadcast(scalar, shape)


@converts("zeros.default", "zeros_like.default", "new_zeros.default", "empty.memory_format", "empty_like.default",
          "new_empty.default", "empty_strided.default", "new_empty_strided.default", "empty_permuted.default")
def _zeros(cv, node, a):
    return _filled(cv, node, 0)  # torch leaves empty() uninitialized: any value is right, 0 is stable


@converts("ones.default", "ones_like.default", "new_ones.default")
def _ones(cv, node, a):
    return _filled(cv, node, 1)


@converts("full.default", "full_like.default", "new_full.default", "fill.Scalar", "fill.Tensor")
def _full(cv, node, a):
    return _filled(cv, node, a.get("fill_value", a.get("value")))


@converts("scalar_tensor.default")
def _scalar_tensor(cv, node, a):
    return cv.operand(a.s, cv.meta_dtype(node))


@converts("arange.default", "arange.start", "arange.start_step")
def _arange_op(cv, node, a):
    (length,) = cv.meta_shape(node)
    start = a.get("start", 0)
    step = a.get("step", 1)
    return _arange(cv, length, start, step, cv.meta_dtype(node))
