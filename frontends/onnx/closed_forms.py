"""Converters: small closed forms (Det, the Optional ops, the ai.onnx.ml ops)."""

from __future__ import annotations

import numpy as np

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import _conv
from tilegraph.ir.shapes import numel


# --- small closed forms ---


@_conv("Det")
def _det(n):
    """Determinants of 1x1, 2x2 and 3x3 matrices by their cofactor expansions."""
    x = n.x(0)
    size = n.shape(x)[-1]
    if size not in (1, 2, 3) or n.shape(x)[-2] != size:
        raise FrontendError(f"only 1x1, 2x2 and 3x3 matrices are supported, got {n.info(x)}")
    lead = n.shape(x)[:-2]
    a = [[n.reshape(n.slice(n.slice(x, n.rank(x) - 2, i, i + 1), n.rank(x) - 1, j, j + 1), lead)
          for j in range(size)] for i in range(size)]
    mul, sub = (lambda p, q: n.op("mul", p, q)), (lambda p, q: n.op("sub", p, q))
    if size == 1:
        return a[0][0]
    if size == 2:
        return sub(mul(a[0][0], a[1][1]), mul(a[0][1], a[1][0]))
    minors = [sub(mul(a[1][(j + 1) % 3], a[2][(j + 2) % 3]), mul(a[1][(j + 2) % 3], a[2][(j + 1) % 3]))
              for j in range(3)]
    return n.op("add", n.op("add", mul(a[0][0], minors[0]), mul(a[0][1], minors[1])), mul(a[0][2], minors[2]))


@_conv("OptionalHasElement")
def _optional_has_element(n):
    """Only tensors reach here (optional-typed graph values are refused at the inputs): present
    is true, an absent input false."""
    return np.array(n.opt(0) is not None)


@_conv("OptionalGetElement")
def _optional_get_element(n):
    return n.x(0)


@_conv("ai.onnx.ml.Binarizer")
def _binarizer(n):
    x = n.x(0)
    return n.cast(n.op("gt", x, float(n.attr("threshold", 0.0))), n.dtype(x))


@_conv("ai.onnx.ml.ArrayFeatureExtractor")
def _array_feature_extractor(n):
    """x[..., indices] with the indices flattened; a 1-D x gives one row (as onnxruntime does)."""
    x, idx = n.x(0), n.x(1)
    idx = n.reshape(n.cast(idx, "i64"), (numel(n.shape(idx)),))
    y = n.op("gather", x, idx, axis=n.rank(x) - 1)
    return n.reshape(y, (1, numel(n.shape(idx)))) if n.rank(x) == 1 else y
