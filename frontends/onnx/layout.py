"""Converters: shapes known at import time, and layout (reshape, slice, gather, pad, ...)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import sympy

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.nn import _pad_or_crop
from tilegraph.frontends.onnx.node import _axis, _conv
from tilegraph.frontends.onnx.values import INT64_MAX, onnx_dtype
from tilegraph.ir import dtypes
from tilegraph.ir.shapes import Dim, ShapeError, broadcast_shapes, is_static, normalize_dim, numel


# --- shapes, known at import time ---


@_conv("Constant")
def _constant(n):
    for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if key in n.attrs:
            v = n.attrs[key]
            if key == "value":
                onnx_dtype(next(a for a in n.proto.attribute if a.name == key).t.data_type, "constant")
                return np.asarray(v)
            return np.asarray(v, dtype=np.float32 if "float" in key else np.int64)
    raise FrontendError(f"only value, value_float(s) and value_int(s) are supported, got {sorted(n.attrs)}")


@_conv("Shape")
def _shape(n):
    shape = n.shape(n.x(0))
    r = len(shape)
    start = n.attr("start", 0)
    end = n.attr("end", r)
    start, end = (max(0, min(r, s + r if s < 0 else s)) for s in (start, end))
    dims = list(shape[start:end])
    if all(isinstance(d, int) for d in dims):
        return np.asarray(dims, dtype=np.int64)
    out = np.empty(len(dims), dtype=object)
    out[:] = dims
    return out


@_conv("Size")
def _size(n):
    size = numel(n.shape(n.x(0)))
    if isinstance(size, int):
        return np.asarray(size, dtype=np.int64)
    out = np.empty((), dtype=object)
    out[()] = size
    return out


def _target_shape(n, i: int) -> list[Dim]:
    dims = n.static_ints(i)
    for d in dims:
        if isinstance(d, int) and d < 0:
            raise FrontendError(f"shape {dims} has a negative dim")
    return dims


@_conv("ConstantOfShape")
def _constant_of_shape(n):
    value = n.attr("value", np.zeros(1, dtype=np.float32))
    value = np.asarray(value).reshape(())
    # folds to a known array when small, else stays a broadcast (see FOLD_MAX_NEW_ELEMENTS)
    return n.broadcast(value.reshape((1,) * len(shape := _target_shape(n, 0))), shape)


@_conv("Range")
def _range(n):
    dtype = n.dtype(n.x(0))
    start, limit, delta = (n.static(i).reshape(-1)[0] for i in range(3))
    if not isinstance(limit, sympy.Expr):
        return np.arange(start, limit, delta).astype(dtypes.numpy_dtype(dtype))
    # A symbolic limit (a sequence length): start + delta * iota.
    if not (isinstance(start, (int, np.integer)) and isinstance(delta, (int, np.integer))):
        raise FrontendError(f"Range({start}, {limit}, {delta}) with a symbolic start or delta is not supported")
    length = normalize_dim(sympy.ceiling((limit - int(start)) / int(delta)))
    return n.op("add", n.op("mul", n.iota((length,), 0, dtype), int(delta)), int(start))


# --- layout ---


@_conv("Reshape")
def _reshape(n):
    x = n.x(0)
    target = n.static_ints(1)
    in_shape = n.shape(x)
    allowzero = n.attr("allowzero", 0)
    dims: list[Any] = []
    for i, d in enumerate(target):
        if isinstance(d, int) and d == 0 and not allowzero:
            if i >= len(in_shape):
                raise FrontendError(f"target {target}: dim {i} copies a dim the input {in_shape} lacks")
            dims.append(in_shape[i])
        else:
            dims.append(d)
    return n.reshape(x, _fill_minus_one(dims, in_shape))


def _fill_minus_one(dims: list, in_shape) -> list:
    holes = [i for i, d in enumerate(dims) if isinstance(d, int) and d == -1]
    if len(holes) > 1:
        raise FrontendError(f"target shape {dims} has more than one -1")
    if holes:
        known = numel([d for d in dims if not (isinstance(d, int) and d == -1)])
        total = numel(in_shape)
        if isinstance(known, int) and isinstance(total, int):
            if known == 0 or total % known:
                raise FrontendError(f"cannot reshape {tuple(in_shape)} to {dims}")
            dims[holes[0]] = total // known
        else:
            dims[holes[0]] = normalize_dim(sympy.sympify(total) / sympy.sympify(known))
    return dims


@_conv("Flatten")
def _flatten(n):
    x = n.x(0)
    shape = n.shape(x)
    axis = n.attr("axis", 1)
    axis = axis + len(shape) if axis < 0 else axis  # in [-r, r]
    return n.reshape(x, (numel(shape[:axis]), numel(shape[axis:])))


@_conv("Squeeze")
def _squeeze(n):
    x = n.x(0)
    shape = n.shape(x)
    axes = n.ints_attr_or_input("axes", 1)
    if axes is None:
        axes = [i for i, d in enumerate(shape) if isinstance(d, int) and d == 1]
    axes = {_axis(a, len(shape)) for a in axes}
    for a in axes:
        if shape[a] != 1:
            raise FrontendError(f"cannot squeeze dim {a} of size {shape[a]}")
    return n.reshape(x, [d for i, d in enumerate(shape) if i not in axes])


@_conv("Unsqueeze")
def _unsqueeze(n):
    x = n.x(0)
    axes = n.ints_attr_or_input("axes", 1)
    rank = n.rank(x) + len(axes)
    return n.unsqueeze(x, [_axis(a, rank) for a in axes])


@_conv("Transpose")
def _transpose(n):
    x = n.x(0)
    perm = n.attr("perm", list(reversed(range(n.rank(x)))))
    return n.transpose(x, perm)


@_conv("Concat")
def _concat(n):
    vals = [v for v in n.inputs if v is not None]
    rank = n.rank(vals[0])
    axis = _axis(n.attr("axis"), rank)
    # Empty operands add nothing (exporters emit them for empty shape lists).
    nonempty = [v for v in vals if not (isinstance(n.shape(v)[axis], int) and n.shape(v)[axis] == 0)] or vals[:1]
    if len(nonempty) == 1:
        return nonempty[0]
    known = all(isinstance(v, np.ndarray) for v in nonempty)
    if known and any(v.dtype == object for v in nonempty):  # shape values with symbolic dims
        return np.concatenate([v.astype(object) for v in nonempty], axis=axis)
    return n.op("concat", *nonempty, axis=axis)


@_conv("Split")
def _split(n):
    x = n.x(0)
    shape = n.shape(x)
    axis = _axis(n.attr("axis", 0), len(shape))
    sizes = n.ints_attr_or_input("split", 1)
    count = n.attr("num_outputs", len(n.proto.output))
    if sizes is None:
        dim = shape[axis]
        if not isinstance(dim, int):
            raise FrontendError(f"cannot split symbolic dim {dim} into {count} parts")
        part = -(-dim // count)
        sizes = [part] * (dim // part) + ([dim % part] if dim % part else [])
        if len(sizes) != count:
            raise FrontendError(f"cannot split {dim} into {count} parts")
    outs = n.op("split", x, axis=axis, sizes=tuple(sizes))
    return outs if isinstance(outs, tuple) else (outs,)


@_conv("Slice")
def _slice(n):
    x = n.x(0)
    shape = n.shape(x)
    r = len(shape)
    starts = n.static_ints(1)
    ends = n.static_ints(2)
    axes = n.static_ints(3)
    steps = n.static_ints(4)
    axes = list(range(len(starts))) if axes is None else [_axis(a, r) for a in axes]
    steps = [1] * len(axes) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise FrontendError(f"starts {starts}, ends {ends}, axes {axes} and steps {steps} differ in length")
    full = [[0, INT64_MAX, 1] for _ in range(r)]
    symbolic: list[tuple[int, int, Dim]] = []
    for a, s, e, st in zip(axes, starts, ends, steps):
        if not isinstance(s, int) or not isinstance(st, int):
            raise FrontendError(f"a symbolic start or step on axis {a} is not supported")
        if st == 0:
            raise FrontendError("slice step 0")
        if not isinstance(e, int):
            if dims_match(e, shape[a]) and st == 1 and s >= 0:
                full[a] = [s, INT64_MAX, 1]  # [s:dim] where the end is the dim itself
                continue
            if st != 1 or s < 0 or not isinstance(shape[a], int):
                raise FrontendError(f"slice [{s}:{e}:{st}] of dim {shape[a]} has no tg form")
            symbolic.append((a, s, e))
            continue
        full[a] = [s, max(min(e, INT64_MAX), -INT64_MAX), st]
    out = n.op("slice", x, starts=tuple(f[0] for f in full), ends=tuple(f[1] for f in full),
               steps=tuple(f[2] for f in full)) if any(f != [0, INT64_MAX, 1] for f in full) else x
    # A slice of a static dim to a symbolic end [s:E] (position ids cut to the sequence
    # length): gather the indices s, ..., E-1. It assumes E <= dim, as the model does.
    for a, s, e in symbolic:
        out = n.op("gather", out, n.op("add", n.iota((normalize_dim(e - s),), 0), s), axis=a)
    return out


def dims_match(a: Dim, b: Dim) -> bool:
    try:
        return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0
    except (TypeError, sympy.SympifyError):
        return False


@_conv("Gather")
def _gather(n):
    x, idx = n.x(0), n.x(1)
    axis = _axis(n.attr("axis", 0), n.rank(x))
    return n.op("gather", x, idx, axis=axis)


@_conv("GatherElements")
def _gather_elements(n):
    x = n.x(0)
    return n.op("gather_elements", x, n.x(1), axis=_axis(n.attr("axis", 0), n.rank(x)))


@_conv("Expand")
def _expand(n):
    x = n.x(0)
    target = _target_shape(n, 1)
    try:
        shape = broadcast_shapes(n.shape(x), target)
    except ShapeError as e:
        raise FrontendError(f"cannot expand to {target}: {e}") from None
    return n.broadcast(n.reshape(x, (1,) * (len(shape) - n.rank(x)) + n.shape(x)), shape)


@_conv("Tile")
def _tile(n):
    return n.op("tile", n.x(0), repeats=tuple(n.static_ints(1)))


@_conv("Pad")
def _pad(n):
    x = n.x(0)
    r = n.rank(x)
    mode = n.attr("mode", "constant")
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise FrontendError(f"pad mode '{mode}' is not supported")
    pads = n.ints_attr_or_input("pads", 1)
    value = n.opt(2)
    axes = n.static_ints(3)
    axes = list(range(r)) if axes is None else [_axis(a, r) for a in axes]
    if len(pads) != 2 * len(axes):
        raise FrontendError(f"pads {pads} need 2 entries per axis {axes}")
    full = [0] * (2 * r)
    for k, a in enumerate(axes):
        full[a], full[a + r] = pads[k], pads[k + len(axes)]
    fill = 0.0
    if value is not None:
        fill = n.static(2).reshape(-1)
        fill = float(fill[0]) if fill.size else 0.0
    return _pad_or_crop(n, x, full, mode, fill)


@_conv("DepthToSpace")
def _depth_to_space(n):
    x = n.x(0)
    b, c, h, w = n.shape(x)
    bs = n.attr("blocksize")
    if n.attr("mode", "DCR") == "DCR":
        y = n.transpose(n.reshape(x, (b, bs, bs, c // (bs * bs), h, w)), (0, 3, 4, 1, 5, 2))
    else:
        y = n.transpose(n.reshape(x, (b, c // (bs * bs), bs, bs, h, w)), (0, 1, 4, 2, 5, 3))
    return n.reshape(y, (b, c // (bs * bs), h * bs, w * bs))


@_conv("SpaceToDepth")
def _space_to_depth(n):
    x = n.x(0)
    b, c, h, w = n.shape(x)
    bs = n.attr("blocksize")
    perm = (0, 3, 5, 1, 2, 4) if n.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
    y = n.transpose(n.reshape(x, (b, c, h // bs, bs, w // bs, bs)), perm)
    return n.reshape(y, (b, c * bs * bs, h // bs, w // bs))


@_conv("Trilu")
def _trilu(n):
    k = n.static_ints(1)
    return n.op("trilu", n.x(0), k=int(k[0]) if k else 0, upper=bool(n.attr("upper", 1)))


@_conv("CumSum", "CumProd")
def _cumulative(n):
    x = n.x(0)
    axis = _axis(int(n.static_ints(1)[0]), n.rank(x))
    return n.op({"CumSum": "cumsum", "CumProd": "cumprod"}[n.op_type], x, axis=axis,
                exclusive=bool(n.attr("exclusive", 0)), reverse=bool(n.attr("reverse", 0)))


@_conv("EyeLike")
def _eye_like(n):
    x = n.x(0)
    dtype = onnx_dtype(n.attr("dtype"), "attribute 'dtype'") if "dtype" in n.attrs else n.dtype(x)
    shape = n.shape(x)
    rows = n.op("add", n.iota(shape, 0), n.attr("k", 0))
    return n.cast(n.op("eq", rows, n.iota(shape, 1)), dtype)


@_conv("OneHot")
def _one_hot(n):
    idx, values = n.x(0), n.x(2)
    depth = n.static(1).reshape(-1)[0]
    depth = int(depth)
    rank = n.rank(idx) + 1
    axis = _axis(n.attr("axis", -1), rank)
    idx = n.cast(idx, "i64")
    idx = n.op("where", n.op("lt", idx, 0), n.op("add", idx, depth), idx)  # negative indices count from depth
    shape = list(n.shape(idx))
    shape.insert(axis, depth)
    hot = n.op("eq", n.unsqueeze(idx, [axis]), n.iota(shape, axis))
    off, on = (n.reshape(n.slice(values, 0, i, i + 1), ()) for i in (0, 1))
    return n.op("where", hot, on, off)


@_conv("Dropout")
def _dropout(n):
    x = n.x(0)
    training = n.static(2)
    ratio = n.static(1)
    if training is not None and bool(training.reshape(-1)[0]) and (ratio is None or float(ratio.reshape(-1)[0]) > 0):
        raise FrontendError("training-mode Dropout (random) is not supported")
    if not n.wants_output(1):
        return x
    return x, n.broadcast(np.ones((1,) * n.rank(x), dtype=np.bool_), n.shape(x))  # the mask keeps all


# --- more layout ---


@_conv("GatherND")
def _gather_nd(n):
    x, idx = n.x(0), n.x(1)
    b = n.attr("batch_dims", 0)
    xs, ishape = n.shape(x), n.shape(idx)
    k = ishape[-1]
    if not isinstance(k, int) or not is_static(xs[:b + k]) or (b and not is_static(ishape)):
        raise FrontendError("GatherND needs static index depth and indexed dims")
    dims = xs[b:b + k]
    idx = n.cast(idx, "i64")
    idx = n.op("where", n.op("lt", idx, 0), n.op("add", idx, np.asarray(dims, dtype=np.int64)), idx)
    # The row-major linear index into the k indexed dims.
    strides = [math.prod(dims[j + 1:]) for j in range(k)]
    linear = n.reduce("sum", n.op("mul", idx, np.asarray(strides, dtype=np.int64)), [n.rank(idx) - 1], False)
    rest = xs[b + k:]
    batch = math.prod(xs[:b]) if b else 1
    flat = n.reshape(x, (batch * math.prod(dims),) + rest)
    if b:  # offset each batch entry into its own block of the flattened dims
        linear = n.reshape(linear, (batch, numel(ishape[b:-1])))
        linear = n.op("add", linear, n.op("mul", n.iota((batch, 1), 0), math.prod(dims)))
    out = n.op("gather", flat, linear, axis=0)
    return n.reshape(out, ishape[:-1] + rest)


@_conv("Compress")
def _compress(n):
    x = n.x(0)
    keep = np.nonzero(n.static(1).reshape(-1))[0].astype(np.int64)
    if "axis" not in n.attrs:
        x = n.reshape(x, (numel(n.shape(x)),))
        axis = 0
    else:
        axis = _axis(n.attrs["axis"], n.rank(x))
    return n.op("gather", x, keep, axis=axis)
