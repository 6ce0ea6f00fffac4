"""Converters: scatters, and scatters into a buffer (MaxUnpool, Col2Im, TensorScatter)."""

from __future__ import annotations

import math

import numpy as np

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import _axis, _conv
from tilegraph.frontends.onnx.values import Value
from tilegraph.ir.shapes import numel


# --- scatter ---


def _scatter_reduction(n) -> str:
    reduction = n.attr("reduction", "none")
    if reduction not in ("none", "add", "mul", "max", "min"):
        raise FrontendError(f"reduction '{reduction}' is not supported")
    return reduction


@_conv("ScatterElements")
def _scatter_elements(n):
    x = n.x(0)
    return n.op("scatter_elements", x, n.x(1), n.x(2), axis=_axis(n.attr("axis", 0), n.rank(x)),
                reduction=_scatter_reduction(n))


@_conv("ScatterND")
def _scatter_nd(n):
    return n.op("scatter_nd", n.x(0), n.x(1), n.x(2), reduction=_scatter_reduction(n))


@_conv("TopK")
def _topk(n):
    x = n.x(0)
    k = n.static_ints(1)[0]
    if not isinstance(k, int):
        raise FrontendError(f"k = {k} must be static")
    return n.op("topk", x, k=k, axis=_axis(n.attr("axis", -1), n.rank(x)), largest=bool(n.attr("largest", 1)))


# --- scatters into a buffer: MaxUnpool, Col2Im, TensorScatter ---


def _zeros(n, shape, dtype: str) -> Value:
    return n.broadcast(n.const(0, dtype).reshape((1,) * len(shape)), tuple(shape))


@_conv("MaxUnpool")
def _max_unpool(n):
    """Each value written at its flat index (MaxPool's Indices index the whole tensor) into
    zeros of the inferred shape, then padded at the end to output_shape when one is given."""
    x, idx = n.x(0), n.x(1)
    kernel = n.attr("kernel_shape")
    k = len(kernel)
    strides = n.attr("strides", [1] * k)
    pads = n.attr("pads", [0] * 2 * k)
    shape = list(n.shape(x))
    if not all(isinstance(d, int) for d in shape):
        raise FrontendError(f"its input shape must be static, got {n.info(x)}")
    inferred = shape[:2] + [(shape[2 + d] - 1) * strides[d] - pads[d] - pads[k + d] + kernel[d] for d in range(k)]
    flat = n.op("scatter_elements", _zeros(n, (numel(inferred),), n.dtype(x)),
                n.reshape(n.cast(idx, "i64"), (numel(shape),)), n.reshape(x, (numel(shape),)), axis=0)
    y = n.reshape(flat, inferred)
    wanted = n.static_ints(2)
    if wanted is None or [int(v) for v in wanted] == inferred:
        return y
    extra = [int(w) - i for w, i in zip(wanted, inferred)]
    if len(extra) != len(inferred) or min(extra) < 0:
        raise FrontendError(f"output_shape {wanted} is smaller than the unpooled shape {inferred}")
    return n.op("pad", y, pads=tuple([0] * len(extra) + extra))


@_conv("Col2Im")
def _col2im(n):
    """The adjoint of im2col: every column entry added at its image position (a constant index
    computed here) into the zero-padded image, whose padding is then cut off."""
    x = n.x(0)
    image = [int(v) for v in n.static_ints(1)]
    block = [int(v) for v in n.static_ints(2)]
    r = len(image)
    dil = n.attr("dilations", [1] * r)
    strides = n.attr("strides", [1] * r)
    pads = n.attr("pads", [0] * 2 * r)
    batch, rows, cols = n.shape(x)
    kernel = math.prod(block)
    padded = [image[d] + pads[d] + pads[r + d] for d in range(r)]
    blocks = [(padded[d] - dil[d] * (block[d] - 1) - 1) // strides[d] + 1 for d in range(r)]
    if not isinstance(rows, int) or rows % kernel or cols != math.prod(blocks) or min(blocks) < 1:
        raise FrontendError(f"input {n.info(x)} does not fit image {image}, block {block} and "
                            f"{math.prod(blocks)} sliding blocks")
    channels = rows // kernel
    k_pos = np.stack(np.meshgrid(*[np.arange(b) for b in block], indexing="ij"), -1).reshape(-1, r)
    l_pos = np.stack(np.meshgrid(*[np.arange(b) for b in blocks], indexing="ij"), -1).reshape(-1, r)
    coords = k_pos[:, None, :] * np.array(dil) + l_pos[None, :, :] * np.array(strides)  # (K, L, r) in the padded image
    index = np.ravel_multi_index(tuple(np.moveaxis(coords, -1, 0)), padded).reshape(1, 1, kernel * cols)
    cols_ = n.reshape(x, (batch, channels, kernel * cols))
    index_t = n.broadcast(n.const(index, "i64"), (batch, channels, kernel * cols))
    image_t = n.op("scatter_elements", _zeros(n, (batch, channels, math.prod(padded)), n.dtype(x)), index_t, cols_,
                   axis=2, reduction="add")
    image_t = n.reshape(image_t, (batch, channels, *padded))
    for d in range(r):
        image_t = n.slice(image_t, 2 + d, pads[d], pads[d] + image[d])
    return image_t


@_conv("TensorScatter")
def _tensor_scatter(n):
    """update written into the cache along axis at each batch row's write index (mod the cache
    length in circular mode): a scatter_elements whose index is that offset plus an iota."""
    cache, update, where = n.x(0), n.x(1), n.opt(2)
    r = n.rank(cache)
    axis = _axis(n.attr("axis", -2), r)
    mode = n.attr("mode", "linear")
    if mode not in ("linear", "circular"):
        raise FrontendError(f"mode '{mode}' is not supported")
    if axis == 0:
        raise FrontendError("axis 0 is the batch axis that write_indices index")
    shape = n.shape(update)
    index = n.iota(shape, axis)
    if where is not None:
        index = n.op("add", index, n.reshape(n.cast(where, "i64"), (shape[0],) + (1,) * (r - 1)))
    if mode == "circular":
        index = n.op("mod", index, n.shape(cache)[axis])
    return n.op("scatter_elements", cache, index, update, axis=axis)
