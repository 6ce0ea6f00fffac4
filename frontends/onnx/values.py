"""What a converter computes with: a Value (a run-time tensor or a known array), ONNX
tensors, dtypes and attributes read into NumPy, and the error for an input that must be static."""

from __future__ import annotations

from typing import Any, Sequence, Union

import numpy as np
import sympy

from tilegraph.frontends import FrontendError
from tilegraph.ir import dtypes
from tilegraph.ir.builder import Tensor
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.shapes import Dim, TensorInfo, normalize_dim


INT64_MAX = (1 << 63) - 1  # ONNX's and tg.slice's "to the end"


# Folding never makes a known array bigger than this from smaller operands (iota, broadcast,
# tile): the weight store holds what a model ships, not what it expands to at run time.
FOLD_MAX_NEW_ELEMENTS = 4096


Value = Union[Tensor, np.ndarray]  # run-time tensor, or a value known at import time


class ByFunctionBody(Exception):
    """A converter's answer for a case it leaves to ONNX's own function body for the op (the
    importer expands that instead), e.g. RotaryEmbedding's interleaved pairs."""


class StaticInputNeeded(FrontendError):
    """A value that must be known at import time (a shape, axes, pads) is computed at run time.

    `inputs` names the graph inputs it is computed from: passing those as
    `constant_inputs` makes the model importable.
    """

    def __init__(self, message: str, inputs: Sequence[str]):
        super().__init__(message)
        self.inputs = tuple(inputs)


# --- values ---------------------------------------------------------------------


def onnx_dtype(elem_type: int, what: str) -> str:
    """tg dtype spelling of an ONNX element type; FrontendError naming `what` if it has none."""
    from onnx import helper

    try:
        np_dtype = helper.tensor_dtype_to_np_dtype(elem_type)
        return dtypes.dtype_name(np_dtype)
    except (KeyError, ValueError, TilegraphError):
        from onnx import TensorProto

        name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
        raise FrontendError(f"{what}: element type {name} is not supported "
                            f"(supported: {', '.join(dtypes.DTYPES)})") from None


def known_dtype(a: np.ndarray) -> str:
    # Object arrays hold shape values with symbolic entries: they are int64 tensors.
    return "i64" if a.dtype == object else dtypes.dtype_name(a.dtype)


def _as_int_array(a: np.ndarray) -> np.ndarray | None:
    """An object array of int-valued entries as int64; None if an entry is symbolic."""
    out = []
    for v in a.reshape(-1):
        if isinstance(v, (int, np.integer)):
            out.append(int(v))
        elif isinstance(v, sympy.Expr) and v.is_Integer:
            out.append(int(v))
        else:
            return None
    return np.asarray(out, dtype=np.int64).reshape(a.shape)


def _dim_value(v: Any) -> Dim:
    return normalize_dim(v) if isinstance(v, sympy.Expr) else int(v)


def tensor_array(t, what: str) -> np.ndarray:
    """The array of a TensorProto; FrontendError naming `what` for an unknown element type
    or data that does not fill its dims (a malformed file)."""
    import onnx
    from onnx import numpy_helper

    onnx_dtype(t.data_type, what)
    if t.data_location == onnx.TensorProto.EXTERNAL:  # load_model read the external data it could
        raise FrontendError(f"{what}: its data is in an external file that was not read (a model given as "
                            "bytes, or an external tensor outside the model's graph)")
    try:
        return numpy_helper.to_array(t)
    except (ValueError, TypeError, KeyError, onnx.checker.ValidationError) as e:
        raise FrontendError(f"{what}: {e}") from None


def _attr_value(a, what: str) -> Any:
    from onnx import AttributeProto, helper

    if a.type == AttributeProto.TENSOR:
        return tensor_array(a.t, f"{what}: attribute '{a.name}'")
    if a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
        return a  # no converter takes subgraphs; kept so the error can name it
    try:
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            return v.decode("utf-8")
        if isinstance(v, list) and v and isinstance(v[0], bytes):
            return [s.decode("utf-8") for s in v]
    except (ValueError, UnicodeDecodeError) as e:  # a reference to a function's attribute, bytes not UTF-8
        raise FrontendError(f"{what}: attribute '{a.name}' cannot be read: {str(e).splitlines()[0]}") from None
    return v


def info(v: Value) -> TensorInfo:
    if isinstance(v, Tensor):
        return v.info
    return TensorInfo(tuple(v.shape), known_dtype(v))
