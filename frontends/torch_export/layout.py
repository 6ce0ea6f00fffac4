"""Converters of layout ops: views, concatenation, splits, indexing, scatters, pads."""


from __future__ import annotations

from typing import Any

import numpy as np
import sympy
import torch

from tilegraph.frontends import FrontendError
from tilegraph.ir import dtypes
from tilegraph.ir.builder import Tensor
from tilegraph.ir.shapes import Dim, ShapeError, TensorInfo, broadcast_shapes, normalize_dim, numel
from tilegraph.frontends.torch_export.importer import BIG, TO_END, _same_dim
from tilegraph.frontends.torch_export.registry import _axes, _axis, converts
from tilegraph.frontends.torch_export.run_time import _masked_rows, _run_time_size

aten = torch.ops.aten



# layout ------------------------------------------------------------------------------


@converts("view.default", "_unsafe_view.default", "reshape.default", "flatten.using_ints", "unflatten.int",
          "unsqueeze.default", "squeeze.default", "squeeze.dim", "squeeze.dims", "view_as.default",
          "reshape_as.default")
def _reshape(cv, node, a):
    # The result shape is torch's own (with -1 and symbolic sizes already resolved).
    return cv.g.reshape(a.self, cv.meta_shape(node))


@converts("permute.default")
def _permute(cv, node, a):
    x = a.self
    return cv.g.transpose(x, [_axis(d, x.rank) for d in a.dims])


@converts("transpose.int", "swapaxes.default")
def _transpose(cv, node, a):
    x = a.self
    perm = list(range(x.rank))
    i, j = _axis(a.get("dim0", a.get("axis0")), x.rank), _axis(a.get("dim1", a.get("axis1")), x.rank)
    perm[i], perm[j] = perm[j], perm[i]
    return x if i == j else cv.g.transpose(x, perm)


@converts("t.default", "numpy_T.default")
def _t(cv, node, a):
    x = a.self
    return cv.g.transpose(x, list(range(x.rank))[::-1]) if x.rank >= 2 else x


@converts("expand.default", "expand_as.default", "broadcast_to.default")
def _expand(cv, node, a):
    return cv.g.broadcast(a.self, cv.meta_shape(node))


@converts("copy.default")
def _copy(cv, node, a):
    return cv.g.broadcast(cv.g.cast(a.src, a.self.dtype), a.self.shape)


@converts("cat.default", "concat.default", "concatenate.default")
def _cat(cv, node, a):
    dt = cv.meta_dtype(node)
    ts = [cv.g.cast(t, dt) for t in a.tensors]
    rank = max(t.rank for t in ts)
    # torch still accepts legacy 1-D empty tensors next to tensors of any rank.
    ts = [t for t in ts if not (t.rank == 1 and t.shape[0] == 0 and rank > 1)]
    return ts[0] if len(ts) == 1 else cv.g.concat(ts, axis=_axis(a.dim, rank))


@converts("stack.default")
def _stack(cv, node, a):
    dt = cv.meta_dtype(node)
    ts = [cv.g.cast(t, dt) for t in a.tensors]
    axis = _axis(a.dim, ts[0].rank + 1)
    ts = [cv.g.reshape(t, t.shape[:axis] + (1,) + t.shape[axis:]) for t in ts]
    return ts[0] if len(ts) == 1 else cv.g.concat(ts, axis=axis)


@converts("split.Tensor", "split_with_sizes.default", "split.sizes", "chunk.default", "unbind.int",
          "tensor_split.sections")
def _split(cv, node, a):
    x = a.self
    axis = _axis(a.get("dim", 0), x.rank)
    parts = node.meta["val"]
    sizes = [cv.dim(p.shape[axis]) if "unbind" not in str(node.target) else 1 for p in parts]
    if not all(isinstance(s, int) for s in sizes):
        raise FrontendError(f"split of symbolic dim {x.shape[axis]} into {sizes}")
    out = cv.g.split(x, sizes, axis=axis)
    if "unbind" in str(node.target):
        out = tuple(cv.g.reshape(t, x.shape[:axis] + x.shape[axis + 1:]) for t in out)
    return tuple(out)


def _slice_axis(cv, x, axis, start, end, step):
    """x[start:end:step] on one axis; symbolic bounds become a gather of computed indices."""
    size = x.shape[axis]
    start = 0 if start is None else start
    end = TO_END if end is None else end
    if not isinstance(end, int) and _same_dim(end, size):
        end = TO_END
    if isinstance(end, int) and end >= BIG:
        end = TO_END
    if isinstance(start, int) and isinstance(end, int):
        if (start, end, step) == (0, TO_END, 1):
            return x
        return cv.g.slice(x, [start], [end], axes=[axis], steps=[step])
    # A symbolic bound (x[:, :seq] of a fixed-size buffer): the indices
    # start, start+step, ... as a tensor (symbolic arange), then gather them.
    if (isinstance(start, int) and start < 0) or (isinstance(end, int) and end < 0):
        raise FrontendError(f"slice [{start}:{end}:{step}] mixing negative and symbolic bounds")
    stop = size if isinstance(end, int) and end >= BIG else end
    if isinstance(stop, int) and isinstance(size, int):
        stop = min(stop, size)
    length = normalize_dim(sympy.ceiling((sympy.sympify(stop) - start) / step))
    idx = _arange(cv, length, start, step, "i64")
    return cv.g.gather(x, idx, axis=axis)


def _arange(cv, length: Dim, start: Any, step: Any, dtype: str) -> Tensor:
    """[start, start+step, ...] of `length` elements (a symbolic length through tg.iota)."""
    if isinstance(length, int) and not isinstance(start, sympy.Expr) and not isinstance(step, sympy.Expr):
        values = np.asarray(start, dtype=np.float64 if dtypes.is_float(dtype) else np.int64) + \
            np.asarray(step) * np.arange(length)
        return cv.const(values, dtype)
    idx = cv.g.op("iota", result=TensorInfo((length,), "i64"), axis=0)  # exact in i64
    idx = cv.g.cast(idx, dtype)
    if step != 1:
        idx = idx * cv.operand(step, dtype)
    if start != 0:
        idx = idx + cv.operand(start, dtype)
    return idx


@converts("slice.Tensor")
def _slice(cv, node, a):
    x = a.self
    if isinstance(a.end, sympy.Symbol) and a.end.name in cv.run_time_values and a.start in (0, None) \
            and a.step == 1:  # x[:n] with n from .item(): a run-time length (torch names the clamped size anew)
        axis = _axis(a.dim, x.rank)
        return cv.g.op("narrow", x, cv.run_time_values[a.end.name], axis=axis,
                       size=_run_time_size(cv, node.meta["val"].shape[axis]))
    return _slice_axis(cv, x, _axis(a.dim, x.rank), a.start, a.end, a.step)


@converts("narrow.default")
def _narrow(cv, node, a):
    x = a.self
    return _slice_axis(cv, x, _axis(a.dim, x.rank), a.start, normalize_dim(a.start + a.length), 1)


@converts("select.int")
def _select(cv, node, a):
    x = a.self
    axis, i = _axis(a.dim, x.rank), a.index
    if isinstance(i, int) and i < 0 and isinstance(x.shape[axis], int):
        i += x.shape[axis]
    end = TO_END if i == -1 else normalize_dim(i + 1)
    return cv.g.reshape(_slice_axis(cv, x, axis, i, end, 1), cv.meta_shape(node))


@converts("index_select.default")
def _index_select(cv, node, a):
    x = a.self
    return cv.g.gather(x, a.index, axis=_axis(a.dim, x.rank))


@converts("index.Tensor", "index.Tensor_hacked_twin", "_unsafe_index.Tensor", "_unsafe_index.Tensor_hacked_twin")
def _index(cv, node, a):
    """x[..., i, j, ...] with integer index tensors: one gather on the indexed dims flattened."""
    x = a.self
    given = [(d, t) for d, t in enumerate(a.indices) if t is not None]
    if any(t.dtype == "i1" for _, t in given):
        if len(given) != 1:
            raise FrontendError("a boolean mask together with other index tensors (x[mask, i])")
        (axis, mask), = given
        return _masked_rows(cv, x, mask, axis, _run_time_size(cv, node.meta["val"].shape[axis]))
    if len(given) == 1:
        (axis, idx), = given
        return cv.g.gather(x, idx, axis=axis)  # np.take counts negative indices from the end, as torch
    axes = [d for d, _ in given]
    if axes != list(range(axes[0], axes[0] + len(axes))):
        # Index tensors apart from each other: torch puts the indexed dims first.
        x = cv.g.transpose(x, axes + [d for d in range(x.rank) if d not in axes])
        axes = list(range(len(axes)))
    sizes = [x.shape[d] for d in axes]
    flat_index = None  # row-major position in the indexed dims; index tensors broadcast together
    for size, (_, idx) in zip(sizes, given):
        n = cv.operand(size, "i64")  # a symbolic size becomes a computed value
        idx = cv.g.mod(cv.g.cast(idx, "i64"), n)  # negative indices count from the end
        flat_index = idx if flat_index is None else flat_index * n + idx
    first = axes[0]
    flat = cv.g.reshape(x, x.shape[:first] + (numel(sizes),) + x.shape[first + len(axes):])
    return cv.g.gather(flat, flat_index, axis=first)


def _cache_write(cv, x, values, index):
    """cache[:, :, index] = values on a buffer the program writes (a static KV cache
    [B, H, S, D], `index` its cache_position [T]): tg.cache_write in place at index[0], which
    takes the T positions to be consecutive, as a generation step's cache_position is. None
    where the write is not of that form (it is then an ordinary functional scatter)."""
    donated = getattr(cv, "donated", {})
    if not any(x.value is t.value for t in donated.values()) or x.rank != 4 or index.rank != 1 or values.rank > 4:
        return None
    rows = x.shape[:2] + (index.shape[0],) + x.shape[3:]
    try:
        if broadcast_shapes(values.shape, rows) != rows:
            return None
    except ShapeError:
        return None
    start = cv.g.reshape(cv.g.slice(cv.g.cast(index, "i64"), [0], [1]), ())
    return cv.g.op("cache_write", x, cv.g.broadcast(cv.g.cast(values, x.dtype), rows), start)


@converts("index_copy.default")
def _index_copy(cv, node, a):
    """x.index_copy(dim, index, source): transformers' StaticCache writes its keys and values so."""
    written = _cache_write(cv, a.self, a.source, a.index) if _axis(a.dim, a.self.rank) == 2 else None
    if written is None:
        raise FrontendError("index_copy is supported on a static KV cache buffer along dim 2 only")
    return written


@converts("index_put.default", "_unsafe_index_put.default", "index_put.hacked_twin",
          "_unsafe_index_put.hacked_twin")
def _index_put(cv, node, a):
    """x[i, j] = v (or += with accumulate): a scatter_nd; x[bool_mask] = one value: a where;
    cache[:, :, positions] = v on a static KV cache: an in-place tg.cache_write."""
    x, values = a.self, cv.g.cast(a["values"], a.self.dtype)
    indices = list(a.indices)
    while indices and indices[-1] is None:
        indices.pop()
    if len(indices) == 3 and indices[0] is None and indices[1] is None and not a.accumulate:
        written = _cache_write(cv, x, values, indices[2])
        if written is not None:
            return written
    if not indices or any(t is None for t in indices):
        raise FrontendError("index assignment needs index tensors on the leading dims (x[i, j] = v)")
    if indices[0].dtype == "i1":
        (mask,) = indices if len(indices) == 1 else (None,)
        if mask is None or a.accumulate or numel(values.shape) != 1:
            raise FrontendError("boolean-mask assignment is supported as x[mask] = one value only")
        mask = cv.g.reshape(mask, mask.shape + (1,) * (x.rank - mask.rank))  # a mask over leading dims
        return cv.g.where(mask, cv.g.reshape(values, ()), x)
    # scatter_nd takes the index tuples stacked on a last axis: (*batch, k).
    k = len(indices)
    batch = broadcast_shapes(*(t.shape for t in indices))
    stacked = cv.g.concat([cv.g.reshape(cv.g.broadcast(cv.g.cast(t, "i64"), batch), batch + (1,)) for t in indices],
                          axis=len(batch))
    updates = cv.g.broadcast(values, batch + x.shape[k:])
    return cv.g.scatter_nd(x, stacked, updates, reduction="add" if a.accumulate else "none")


_SCATTER_REDUCE = {"sum": "add", "add": "add", "prod": "mul", "multiply": "mul", "amax": "max", "amin": "min"}


@converts("scatter.src", "scatter.value", "scatter.reduce", "scatter.value_reduce", "scatter_add.default",
          "scatter_reduce.two")
def _scatter(cv, node, a):
    x, index = a.self, a.index
    axis = _axis(a.dim, x.rank)
    name = str(node.target)
    reduce = "add" if "scatter_add" in name else a.get("reduce")
    if reduce is not None and (reduce not in _SCATTER_REDUCE or a.get("include_self") is False):
        raise FrontendError(f"scatter reduce='{reduce}'" + (" without include_self" if a.get("include_self") is False
                                                             else "") + " is not supported")
    src = a.get("src", a.get("value"))
    if isinstance(src, Tensor):
        # torch reads src where index points from, like gather: src may be larger.
        src = cv.g.cast(src, x.dtype)
        for d in range(x.rank):
            if not _same_dim(src.shape[d], index.shape[d]):
                src = _slice_axis(cv, src, d, 0, index.shape[d], 1)
    else:
        src = cv.g.broadcast(cv.const(src, x.dtype), index.shape)
    return cv.g.scatter_elements(x, index, src, axis=axis,
                                 reduction=_SCATTER_REDUCE[reduce] if reduce else "none")


def _scatter_slice(cv, x, src, axis, start, end):
    """x with x[start:end] on `axis` replaced by src (step 1): a concat of three pieces."""
    size = x.shape[axis]
    start = 0 if start is None else start
    end = TO_END if end is None or (isinstance(end, int) and end >= BIG) else end
    if isinstance(size, int):
        start, end = (v + size if isinstance(v, int) and v < 0 else v for v in (start, end))
        end = min(end, size) if isinstance(end, int) else end
    if not isinstance(start, int) or not isinstance(end, int) or start < 0 or end < 0:
        raise FrontendError(f"slice_scatter bounds [{start}:{end}] on dim {size}")
    parts = [cv.g.slice(x, [0], [start], axes=[axis])] if start > 0 else []
    parts.append(cv.g.cast(src, x.dtype))
    if end != TO_END and not (isinstance(size, int) and end >= size):
        parts.append(cv.g.slice(x, [end], [TO_END], axes=[axis]))
    return parts[0] if len(parts) == 1 else cv.g.concat(parts, axis=axis)


@converts("slice_scatter.default")
def _slice_scatter(cv, node, a):
    x = a.self
    if a.step != 1:
        raise FrontendError(f"slice_scatter with step {a.step}")
    return _scatter_slice(cv, x, a.src, _axis(a.dim, x.rank), a.start, a.end)


@converts("select_scatter.default")
def _select_scatter(cv, node, a):
    x = a.self
    axis = _axis(a.dim, x.rank)
    src = cv.g.reshape(a.src, a.src.shape[:axis] + (1,) + a.src.shape[axis:])
    i = a.index
    end = TO_END if i == -1 else normalize_dim(i + 1)
    return _scatter_slice(cv, x, src, axis, i, end)


@converts("gather.default")
def _gather(cv, node, a):
    x, idx = a.self, a.index
    axis = _axis(a.dim, x.rank)
    # torch lets the index be shorter than the input off the gather axis; the
    # elements it reads are then those of the leading corner.
    for d in range(x.rank):
        if d != axis and not _same_dim(x.shape[d], idx.shape[d]):
            x = _slice_axis(cv, x, d, 0, idx.shape[d], 1)
    return cv.g.gather_elements(x, idx, axis=axis)


@converts("repeat.default")
def _repeat(cv, node, a):
    x, reps = a.self, list(a.repeats)
    if len(reps) > x.rank:
        x = cv.g.reshape(x, (1,) * (len(reps) - x.rank) + x.shape)
    return cv.g.tile(x, repeats=reps)


@converts("flip.default")
def _flip(cv, node, a):
    x = a.self
    axes = _axes(a.dims, x.rank)
    return cv.g.slice(x, [-1] * len(axes), [-TO_END - 1] * len(axes), axes=axes, steps=[-1] * len(axes))


def _torch_pads(cv, x, pad, mode, value):
    """torch's pad list (last dim first, (begin, end) pairs) as tg.pad; negatives crop."""
    n = len(pad) // 2
    begins, ends = [0] * x.rank, [0] * x.rank
    for i in range(n):
        begins[x.rank - 1 - i], ends[x.rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    grow = [max(p, 0) for p in begins] + [max(p, 0) for p in ends]
    y = cv.g.pad(x, grow, mode=mode, value=float(value or 0.0)) if any(grow) else x
    for axis in range(x.rank):
        if begins[axis] < 0 or ends[axis] < 0:
            y = _slice_axis(cv, y, axis, max(-begins[axis], 0), -ends[axis] if ends[axis] < 0 else TO_END, 1)
    return y


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


@converts("constant_pad_nd.default")
def _constant_pad(cv, node, a):
    return _torch_pads(cv, a.self, list(a.pad), "constant", a.value)


@converts("pad.default")
def _pad(cv, node, a):
    if a.mode not in _PAD_MODES:
        raise FrontendError(f"pad mode '{a.mode}' is not supported")
    return _torch_pads(cv, a.self, list(a.pad), _PAD_MODES[a.mode], a.value)


@converts("reflection_pad1d.default", "reflection_pad2d.default", "reflection_pad3d.default",
          "replication_pad1d.default", "replication_pad2d.default", "replication_pad3d.default")
def _mode_pad(cv, node, a):
    mode = "reflect" if "reflection" in str(node.target) else "edge"
    return _torch_pads(cv, a.self, list(a.padding), mode, 0.0)


@converts("tril.default", "triu.default")
def _trilu(cv, node, a):
    return cv.g.trilu(a.self, k=a.diagonal, upper="triu" in str(node.target))
