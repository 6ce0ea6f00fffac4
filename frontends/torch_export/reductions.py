"""Converters of reductions, scans, sorts and softmax."""


from __future__ import annotations

import math

import sympy
import torch

from tilegraph.frontends import FrontendError
from tilegraph.ir.shapes import normalize_dim, numel
from tilegraph.frontends.torch_export.registry import _axes, _axis, converts
from tilegraph.frontends.torch_export.run_time import _topk_run_time_k

aten = torch.ops.aten



def _reduce(kind):
    def convert(cv, node, a):
        x = cv.g.cast(a.self, cv.meta_dtype(node))
        return cv.g.op("reduce_" + kind, x, axes=_axes(a.get("dim"), x.rank), keepdims=bool(a.get("keepdim")))

    return convert


converts("sum.default", "sum.dim_IntList")(_reduce("sum"))
converts("mean.default", "mean.dim")(_reduce("mean"))
converts("amax.default", "max.default")(_reduce("max"))
converts("amin.default", "min.default")(_reduce("min"))
converts("prod.default", "prod.dim_int")(_reduce("prod"))


def _max_min_dim(kind):
    def convert(cv, node, a):
        x, axis = a.self, _axis(a.dim, a.self.rank)
        values = cv.g.op("reduce_" + kind, x, axes=(axis,), keepdims=a.keepdim)
        indices = cv.g.op("argmax" if kind == "max" else "argmin", x, axis=axis, keepdims=a.keepdim)
        return (values, indices)

    return convert


converts("max.dim")(_max_min_dim("max"))
converts("min.dim")(_max_min_dim("min"))


def _arg(kind):
    def convert(cv, node, a):
        x = a.self
        if a.dim is None:  # over the flattened tensor
            flat = cv.g.reshape(x, (numel(x.shape),))
            out = cv.g.op(kind, flat, axis=0)
            return cv.g.reshape(out, cv.meta_shape(node))
        return cv.g.op(kind, x, axis=_axis(a.dim, x.rank), keepdims=a.keepdim)

    return convert


converts("argmax.default")(_arg("argmax"))
converts("argmin.default")(_arg("argmin"))


def _any_all(kind):
    def convert(cv, node, a):
        x = cv.g.cast(a.self, "i1")
        return cv.g.op(kind, x, axes=_axes(a.get("dim"), x.rank), keepdims=bool(a.get("keepdim")))

    return convert


converts("any.default", "any.dim", "any.dims")(_any_all("reduce_max"))
converts("all.default", "all.dim", "all.dims")(_any_all("reduce_min"))


def _variance(cv, x, dim, correction, keepdim):
    axes = _axes(dim, x.rank)
    n = numel([x.shape[i] for i in axes])
    centered = x - cv.g.mean(x, axes, keepdims=True)
    ss = cv.g.sum(centered * centered, axes, keepdims=keepdim)
    correction = 1 if correction is None else correction
    return ss / cv.operand(normalize_dim(n - correction) if not isinstance(n, int) else float(n - correction), x.dtype)


@converts("var.correction", "var.dim", "var.default", "std.correction", "std.dim", "std.default")
def _var_std(cv, node, a):
    correction = a.get("correction") if "correction" in str(node.target) else (1 if a.unbiased else 0)
    var = _variance(cv, cv.g.cast(a.self, cv.meta_dtype(node)), a.get("dim"), correction, bool(a.get("keepdim")))
    return cv.g.sqrt(var) if str(node.target).startswith("aten.std") else var


@converts("var_mean.correction")
def _var_mean(cv, node, a):
    x = a.self
    var = _variance(cv, x, a.dim, a.correction, a.keepdim)
    return (var, cv.g.mean(x, _axes(a.dim, x.rank), keepdims=a.keepdim))


@converts("logsumexp.default")
def _logsumexp(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    axes = _axes(a.dim, x.rank)
    m = cv.g.amax(x, axes, keepdims=True)
    m = cv.g.where(cv.g.isinf(m), 0.0, m)  # as torch: an all -inf row stays -inf, not nan
    out = cv.g.log(cv.g.sum(cv.g.exp(x - m), axes, keepdims=True)) + m
    return out if a.keepdim else cv.g.reshape(out, cv.meta_shape(node))


@converts("linalg_vector_norm.default")
def _vector_norm(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    axes, keep, p = _axes(a.dim, x.rank), a.keepdim, float(a.ord)
    if p == 2:
        return cv.g.sqrt(cv.g.sum(x * x, axes, keep))
    if p == 1:
        return cv.g.sum(cv.g.abs(x), axes, keep)
    if p == math.inf:
        return cv.g.amax(cv.g.abs(x), axes, keep)
    if p == -math.inf:
        return cv.g.amin(cv.g.abs(x), axes, keep)
    if p == 0:
        return cv.g.sum(cv.g.cast(cv.g.op("ne", x, cv.const(0, x.dtype)), x.dtype), axes, keep)
    return cv.g.pow(cv.g.sum(cv.g.pow(cv.g.abs(x), cv.const(p, x.dtype)), axes, keep), cv.const(1 / p, x.dtype))


@converts("cumprod.default")
def _cumprod(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    return cv.g.cumprod(x, axis=_axis(a.dim, x.rank))


@converts("topk.default")
def _topk(cv, node, a):
    x = a.self
    if isinstance(a.k, sympy.Symbol) and a.k.name in cv.run_time_values:
        return _topk_run_time_k(cv, node, a)
    if not isinstance(a.k, int):
        raise FrontendError(f"topk with a symbolic k ({a.k})")
    # tg.topk is sorted, equal values by index: a valid answer for sorted=False too.
    return tuple(cv.g.topk(x, k=a.k, axis=_axis(a.dim, x.rank), largest=a.largest))


@converts("sort.default", "sort.stable", "argsort.default", "argsort.stable")
def _sort(cv, node, a):
    """A sort is a top-k of the whole axis; equal values keep index order, as a stable sort."""
    x = a.self
    axis = _axis(a.dim, x.rank)
    if not isinstance(x.shape[axis], int):
        raise FrontendError(f"sort along symbolic dim {x.shape[axis]}")
    values, indices = cv.g.topk(x, k=x.shape[axis], axis=axis, largest=a.descending)
    return indices if "argsort" in str(node.target) else (values, indices)


@converts("cumsum.default")
def _cumsum(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    return cv.g.cumsum(x, axis=_axis(a.dim, x.rank))


# softmax and normalization -------------------------------------------------------------


@converts("softmax.int", "_softmax.default")
def _softmax(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    return cv.g.softmax(x, axis=_axis(a.dim, x.rank))


@converts("log_softmax.int", "_log_softmax.default")
def _log_softmax(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    axis = _axis(a.dim, x.rank)
    shifted = x - cv.g.amax(x, axis, keepdims=True)
    return shifted - cv.g.log(cv.g.sum(cv.g.exp(shifted), axis, keepdims=True))
