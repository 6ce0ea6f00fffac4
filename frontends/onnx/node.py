"""The converter registry, and `Node`: what a converter sees of one ONNX node."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import sympy

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.values import INT64_MAX, StaticInputNeeded, Value, _attr_value, _dim_value, info
from tilegraph.ir import decompositions as D, dtypes
from tilegraph.ir.builder import Tensor
from tilegraph.ir.ops import REQUIRED
from tilegraph.ir.shapes import Dim, TensorInfo, normalize_dim

if TYPE_CHECKING:
    from tilegraph.frontends.onnx.importer import _Importer


class Node:
    """What a converter sees of one ONNX node: its inputs as Values, its attributes, op helpers."""

    def __init__(self, imp: _Importer, proto):
        self.imp = imp
        self.proto = proto
        self.name = proto.name or (proto.output[0] if proto.output else "?")
        self.op_type = proto.op_type
        self.opset = imp.opset
        self.attrs = {a.name: _attr_value(a, self.where()) for a in proto.attribute}
        self.inputs: list[Value | None] = []
        for i in proto.input:
            if i and i not in imp.env:
                raise FrontendError(f"{self.where()}: input '{i}' is computed by no earlier node")
            self.inputs.append(imp.env[i] if i else None)
        self.n_outputs = sum(1 for o in proto.output if o)

    def where(self) -> str:
        ins = ", ".join(str(info(v)) if v is not None else "-" for v in getattr(self, "inputs", []))
        return f"node '{self.name}' ({self.op_type}{'' if not ins else ' on ' + ins})"

    def wants_output(self, i: int) -> bool:
        return i < len(self.proto.output) and bool(self.proto.output[i])

    # --- inputs and attributes ---

    def attr(self, name: str, default: Any = REQUIRED) -> Any:
        if name in self.attrs:
            return self.attrs[name]
        if default is REQUIRED:
            raise FrontendError(f"missing attribute '{name}'")
        return default

    def x(self, i: int) -> Value:
        """Input i, which must be present."""
        v = self.inputs[i] if i < len(self.inputs) else None
        if v is None:
            raise FrontendError(f"input {i} is required")
        return v

    def opt(self, i: int) -> Value | None:
        return self.inputs[i] if i < len(self.inputs) else None

    def static(self, i: int) -> np.ndarray | None:
        """Input i as a known array (None when absent); StaticInputNeeded if it is computed at run time."""
        v = self.opt(i)
        if v is None or isinstance(v, np.ndarray):
            return v
        name = self.proto.input[i]
        deps = self.imp.upstream_inputs(name)
        raise StaticInputNeeded(
            f"{self.where()}: input {i} ('{name}') must be known at import time, but it is computed at run time"
            + (f" from graph input(s) {deps}; give them as constant_inputs" if deps else ""), deps)

    def static_ints(self, i: int) -> list | None:
        """Input i as a list of ints (sympy expressions where symbolic), or None when absent."""
        a = self.static(i)
        if a is None:
            return None
        return [_dim_value(v) for v in a.reshape(-1).tolist()]

    def ints_attr_or_input(self, attr: str, i: int) -> list | None:
        if attr in self.attrs:
            return [int(v) for v in self.attrs[attr]]
        return self.static_ints(i)

    # --- building ---

    def op(self, name: str, *vals: Any, result: TensorInfo | None = None, **attrs) -> Any:
        # Python numbers take the dtype of a tensor operand, preferring a non-boolean one
        # (the branches of a where, not its condition).
        values = [v for v in vals if isinstance(v, (Tensor, np.ndarray))]
        like = next((v for v in values if self.dtype(v) != "i1"), values[0] if values else None)
        vals = tuple(self.lift(v, like) for v in vals)
        return self.imp.op(name, *vals, result=result, **attrs)

    def lift(self, v: Any, like: Value | None) -> Value | None:
        if v is None or isinstance(v, (Tensor, np.ndarray)):
            return v
        return np.asarray(v, dtype=dtypes.numpy_dtype(self.dtype(like) if like is not None else "f32"))

    def const(self, value: Any, dtype: str) -> np.ndarray:
        return np.asarray(value, dtype=dtypes.numpy_dtype(dtype))

    @functools.cached_property
    def emit(self) -> D.Builder:
        """This node's op maker for the composites of ir.decompositions."""
        return D.Builder(self.op, self.const, self.info)

    def info(self, v: Value) -> TensorInfo:
        return info(v)

    def shape(self, v: Value) -> tuple[Dim, ...]:
        return info(v).shape

    def dtype(self, v: Value) -> str:
        return info(v).dtype

    def rank(self, v: Value) -> int:
        return len(info(v).shape)

    def cast(self, v: Value, dtype: str) -> Value:
        return v if self.dtype(v) == dtype else self.op("cast", v, to=dtype)

    def reshape(self, v: Value, shape: Sequence[Dim]) -> Value:
        shape = tuple(normalize_dim(d) if isinstance(d, sympy.Expr) else int(d) for d in shape)
        if shape == self.shape(v):
            return v
        return self.op("reshape", v, result=TensorInfo(shape, self.dtype(v)))

    def broadcast(self, v: Value, shape: Sequence[Dim]) -> Value:
        shape = tuple(shape)
        if shape == self.shape(v):
            return v
        return self.op("broadcast", v, result=TensorInfo(shape, self.dtype(v)))

    def transpose(self, v: Value, perm: Sequence[int]) -> Value:
        if list(perm) == list(range(len(perm))):
            return v
        return self.op("transpose", v, perm=tuple(perm))

    def reduce(self, kind: str, v: Value, axes: Sequence[int], keepdims: bool) -> Value:
        return self.op("reduce_" + kind, v, axes=tuple(axes), keepdims=keepdims)

    def slice(self, v: Value, axis: int, start: int, end: int, step: int = 1) -> Value:
        r = self.rank(v)
        starts, ends, steps = [0] * r, [INT64_MAX] * r, [1] * r
        starts[axis], ends[axis], steps[axis] = start, end, step
        return self.op("slice", v, starts=tuple(starts), ends=tuple(ends), steps=tuple(steps))

    def iota(self, shape: Sequence[Dim], axis: int, dtype: str = "i64") -> Value:
        return self.op("iota", axis=axis, result=TensorInfo(tuple(shape), dtype))

    def unsqueeze(self, v: Value, axes: Sequence[int]) -> Value:
        shape = list(self.shape(v))
        rank = len(shape) + len(axes)
        for a in sorted(ax % rank for ax in axes):
            shape.insert(a, 1)
        return self.reshape(v, shape)


def _axis(a: int, rank: int, what: str = "axis") -> int:
    if not -rank <= a < max(rank, 1):
        raise FrontendError(f"{what} {a} is out of range for rank {rank}")
    return a % rank if rank else 0


# --- converters -----------------------------------------------------------------

CONVERTERS: dict[str, Callable[[Node], Any]] = {}


def _conv(*names: str):
    def deco(fn):
        for n in names:
            CONVERTERS[n] = fn
        return fn

    return deco
