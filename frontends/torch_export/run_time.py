"""Data-dependent sizes: .item(), nonzero, masked_select and unique, as run-time symbols."""


from __future__ import annotations

from typing import Any

import sympy
import torch

from tilegraph.frontends import FrontendError
from tilegraph.ir import dtypes
from tilegraph.ir.builder import Tensor
from tilegraph.ir.shapes import broadcast_shapes, dims_equal, numel, symbol, symbol_named
from tilegraph.frontends.torch_export.registry import RUN_TIME_SCALARS, _axis, converts

aten = torch.ops.aten



# --- data-dependent sizes --------------------------------------------------------------------
# torch.export names a size known only at run time with an unbacked symbol (u0) in the node's
# metadata and checks its range with _assert_scalar / sym_constrain_range_for_size (skipped:
# tg's ops keep their sizes in range by construction, narrow clamps). The converter of the op
# that makes the size gives its symbol a tg name, and the tg op that defines it (ir/ops.py,
# "data-dependent sizes") carries that name; later metadata holding u0 then reads as that symbol.


def _run_time_size(cv, d: Any) -> str:
    """The tg name of torch's unbacked size d (a SymInt that is one symbol), made on first use."""
    e = sympy.sympify(d.node.expr if isinstance(d, torch.SymInt) else d)
    if not e.is_Symbol:
        raise FrontendError(f"a data-dependent size {e} that is not one symbol")
    if e not in cv.symbols:
        cv.symbols[e] = symbol_named(str(e), {s.name for s in cv.symbols.values()})
    return cv.symbols[e].name


def _masked_rows(cv, x: Tensor, mask: Tensor, axis: int, size: str) -> Tensor:
    """x[..., mask] where mask covers dims axis.. of x: those dims flattened, the rows of the
    nonzero mask entries gathered (row-major order, as torch)."""
    dims = x.shape[axis:axis + mask.rank]
    if len(dims) != mask.rank or not all(dims_equal(a, b) for a, b in zip(dims, mask.shape)):
        raise FrontendError(f"mask {mask.info} does not cover dims {axis}.. of {x.info}")
    flat = cv.g.reshape(x, x.shape[:axis] + (numel(dims),) + x.shape[axis + mask.rank:])
    rows = cv.g.op("nonzero", cv.g.reshape(mask, (numel(mask.shape),)), size=size)
    return cv.g.gather(flat, cv.g.reshape(rows, (symbol(size),)), axis=axis)


@converts("nonzero.default")
def _nonzero(cv, node, a):
    x = a.self
    mask = x if x.dtype == "i1" else cv.g.op("ne", x, cv.const(0, x.dtype))
    return cv.g.transpose(cv.g.op("nonzero", mask, size=_run_time_size(cv, node.meta["val"].shape[0])), [1, 0])


@converts("masked_select.default")
def _masked_select(cv, node, a):
    shape = broadcast_shapes(a.self.shape, a.mask.shape)
    x, mask = cv.g.broadcast(a.self, shape), cv.g.broadcast(a.mask, shape)
    return _masked_rows(cv, cv.g.reshape(x, (numel(shape),)), cv.g.reshape(mask, (numel(shape),)), 0,
                        _run_time_size(cv, node.meta["val"].shape[0]))


@converts("_unique2.default", "unique_dim.default")
def _unique(cv, node, a):
    """torch.unique (always sorted on CPU): values, inverse indices shaped as the input, counts."""
    x = a.self
    flatten = "dim" not in a
    axis = 0 if flatten else _axis(a.dim, x.rank)
    values = node.meta["val"][0]
    size = _run_time_size(cv, values.shape[axis])
    out, _first, inverse, counts = cv.g.op("unique", x, size=size, flatten=flatten, axis=axis)
    return out, cv.g.reshape(inverse, x.shape if flatten else (x.shape[axis],)), counts


def _item(cv, node, a):
    """x.item() used as a size: its symbol, with the tensor that holds it at run time."""
    x = a.self
    if not dtypes.is_int(x.dtype) or numel(x.shape) != 1:
        raise FrontendError(f".item() of {x.info} used as a size: only an integer of one element can be")
    name = _run_time_size(cv, node.meta["val"])
    cv.run_time_values[name] = cv.g.cast(cv.g.reshape(x, ()), "i64")
    return symbol(name)


RUN_TIME_SCALARS.update({"aten.item.default": _item, "aten._local_scalar_dense.default": _item})


def _topk_run_time_k(cv, node, a):
    """topk with k from .item(): the whole axis sorted, then both results narrowed to k."""
    x = a.self
    axis = _axis(a.dim, x.rank)
    if not isinstance(x.shape[axis], int):
        raise FrontendError(f"topk with a run-time k over symbolic dim {axis} of {x.info}")
    k = cv.run_time_values[a.k.name]
    full = cv.g.topk(x, k=x.shape[axis], axis=axis, largest=a.largest)
    return tuple(cv.g.op("narrow", t, k, axis=axis, size=a.k.name) for t in full)
