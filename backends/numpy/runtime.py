"""Loading and calling an emitted NumPy module.

`load` compiles the module source once, under a filename registered with
`linecache` so that a traceback shows the emitted line that failed, and calls its
`build(W)` with the weights. `CompiledModel` checks each call's inputs against the
signature the module carries (`INPUTS`) before running `forward`: the count, the
rank, every static dim, that a symbolic dim has one size across inputs, and that
dims written as expressions of symbols agree. The checks are precomputed per
input so a call costs a few dict and tuple operations on top of the NumPy work.

Input dtypes: an array of the declared dtype is used as is; one of the same kind
or a safely widening one (float64 for an f32 input, int64 for i32, int for a float)
is cast, as NumPy would; one that would lose its kind (float into an integer
input) is a DTypeError.
"""

from __future__ import annotations

import hashlib
import linecache
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ir import dtypes
from ir.dtypes import DTypeError
from ir.interpreter import SHAPE_FUNCTIONS, to_numpy
from ir.model import Model, ModelError
from ir.shapes import ShapeError

_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z_0-9]*$")


@dataclass(frozen=True)
class _Input:
    name: str
    dtype: np.dtype
    shape_text: str  # for messages: "(B, 8)"
    rank: int
    static: tuple[tuple[int, int], ...]  # (axis, size)
    symbols: tuple[tuple[int, str], ...]  # (axis, symbol)
    exprs: tuple[tuple[int, str, Any], ...]  # (axis, text, code object)


def _input_spec(name: str, shape: Sequence[int | str], dtype: str) -> _Input:
    static, symbols, exprs = [], [], []
    for axis, d in enumerate(shape):
        if isinstance(d, int):
            static.append((axis, d))
        elif _SYMBOL.match(d):
            symbols.append((axis, d))
        else:
            exprs.append((axis, d, compile(d, "<shape>", "eval")))
    text = "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"
    return _Input(name, dtypes.numpy_dtype(dtype), text, len(shape), tuple(static), tuple(symbols), tuple(exprs))


class CompiledModel:
    """A loaded module: call it with the model inputs, get the list of outputs."""

    def __init__(self, forward: Callable[..., list], inputs, outputs, source: str, model: Model | None = None):
        self._forward = forward
        self._inputs = tuple(_input_spec(*row) for row in inputs)
        self._any_exprs = any(spec.exprs for spec in self._inputs)
        self.source = source
        self.model = model
        self.input_names = [row[0] for row in inputs]
        self.output_names = [row[0] for row in outputs]
        self.output_dtypes = [dtypes.numpy_dtype(row[2]) for row in outputs]

    def __call__(self, *inputs: Any, **named: Any) -> list[np.ndarray]:
        if named:
            inputs = self._by_name(inputs, named)
        return self._forward(*self.check(inputs))

    def _by_name(self, inputs: tuple, named: Mapping[str, Any]) -> tuple:
        if inputs:
            raise ShapeError("give the inputs either all by position or all by name")
        missing = [n for n in self.input_names if n not in named]
        extra = [n for n in named if n not in self.input_names]
        if missing or extra:
            raise ShapeError(f"inputs: missing {missing}, unexpected {extra}; the model takes {self.input_names}")
        return tuple(named[n] for n in self.input_names)

    def check(self, values: Sequence[Any]) -> list[np.ndarray]:
        """The inputs as arrays of the declared dtypes; ShapeError/DTypeError naming the input otherwise."""
        specs = self._inputs
        if len(values) != len(specs):
            raise ShapeError(f"the model takes {len(specs)} inputs ({', '.join(self.input_names)}), got {len(values)}")
        sizes: dict[str, int] = {}
        arrays = []
        for spec, value in zip(specs, values):
            a = value if type(value) is np.ndarray else to_numpy(value)
            if a.dtype != spec.dtype:
                a = _cast(spec, a)
            shape = a.shape
            if len(shape) != spec.rank:
                raise _shape_error(spec, shape)
            for axis, size in spec.static:
                if shape[axis] != size:
                    raise _shape_error(spec, shape)
            for axis, sym in spec.symbols:
                n = sizes.setdefault(sym, shape[axis])
                if n != shape[axis]:
                    raise ShapeError(f"input '{spec.name}' has {sym} = {shape[axis]} (shape {shape}), but an "
                                     f"earlier input has {sym} = {n}")
            arrays.append(a)
        if self._any_exprs:
            env = {**SHAPE_FUNCTIONS, **sizes}
            for spec, a in zip(specs, arrays):
                for axis, _text, code in spec.exprs:
                    if eval(code, env) != a.shape[axis]:  # noqa: S307 - our own shape expression
                        raise _shape_error(spec, a.shape)
        return arrays

    def __repr__(self) -> str:
        return f"CompiledModel({', '.join(self.input_names)} -> {', '.join(self.output_names)})"


def _shape_error(spec: _Input, shape: tuple) -> ShapeError:
    return ShapeError(f"input '{spec.name}' has shape {shape}, the model expects {spec.shape_text}")


def _cast(spec: _Input, a: np.ndarray) -> np.ndarray:
    if not np.can_cast(a.dtype, spec.dtype, "same_kind"):
        raise DTypeError(f"input '{spec.name}' is {a.dtype}, the model expects {dtypes.dtype_name(spec.dtype)} "
                         f"({spec.dtype}); cast it first")
    return a.astype(spec.dtype)


def load(source: str, weights: Mapping[str, np.ndarray], model: Model | None = None) -> CompiledModel:
    """Compile an emitted module once and bind its weights; returns the callable model."""
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    filename = f"<tilegraph-numpy-{digest}>"
    # Registered lines let tracebacks (and inspect) show the emitted source; an
    # mtime of None tells linecache.checkcache to keep the entry.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": f"tilegraph_numpy_{digest}"}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated module
    missing = [w for w in namespace["WEIGHTS"] if w not in weights]
    if missing:
        raise ModelError("weights missing for the compiled model: " + ", ".join(missing))
    forward = namespace["build"](weights)
    return CompiledModel(forward, namespace["INPUTS"], namespace["OUTPUTS"], source, model)
