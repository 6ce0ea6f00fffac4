"""A model's input signature and the one check of the inputs a caller passes.

The interpreter and every backend's runtime check a call's inputs here: the
count, the rank, every static dim, that a symbolic dim has one size across
inputs, and that dims written as expressions of symbols agree. The checks are
precomputed per input so a call costs a few dict and tuple operations.

Input dtypes: an array of the declared dtype is used as is; one of the same kind
or a safely widening one (float64 for an f32 input, int64 for i32, int for a float)
is cast, as NumPy would; one that would lose its kind (float into an integer
input) is a DTypeError.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from tilegraph.ir import dtypes
from tilegraph.ir.dtypes import DTypeError
from tilegraph.ir.shapes import MAX_NUMEL, ShapeError
from tilegraph.ir.ops import Op

# Names that symbolic shape expressions use, for the code that evaluates them.
SHAPE_FUNCTIONS = {"floor": math.floor, "ceiling": math.ceil, "Max": max, "Min": min}

_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z_0-9]*$")


def to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor, without importing torch
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: its bits, as ml_dtypes' bfloat16
            import torch  # already imported by whoever made the tensor

            return value.contiguous().view(torch.uint16).numpy().view(dtypes.numpy_dtype("bf16"))
        return value.numpy()
    return np.asarray(value)


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


@dataclass(frozen=True)
class IndexCheck:
    """An input that indexes a table (an embedding's ids): its values must lie in [-size, size)."""

    input: int
    op: str  # for messages: "tg.gather (axis 0 of f32(30522, 384))"
    size: int


def index_checks(model) -> tuple[IndexCheck, ...]:
    """The inputs that reach a gather's indices unchanged (through views and casts, and into
    fused groups), with the static size of the axis they index: the ids a caller passes
    are checked up front, as onnxruntime does, not left to fail inside the emitted code."""
    from xdsl.ir import BlockArgument

    from tilegraph.ir.dialect import FusionOp, TgOp
    from tilegraph.ir.shapes import info_of

    args = list(model.func.args)
    checks = []
    for op in model.func.walk():
        if not (isinstance(op, TgOp) and op.SPEC.indexed):
            continue
        v = op.operands[1]
        while True:
            if isinstance(v, BlockArgument) and isinstance(v.owner.parent_op(), FusionOp):
                v = v.owner.parent_op().operands[v.index]
            elif isinstance(v.owner, TgOp) and (v.owner.op_name == Op.cast or v.owner.SPEC.category == "layout"
                                                and not v.owner.SPEC.indexed):
                v = v.owner.operands[0]
            else:
                break
        table = info_of(op.operands[0].type)
        axis = op.attr("axis") % max(table.rank, 1)
        if v in args and table.rank and isinstance(table.shape[axis], int):
            checks.append(IndexCheck(args.index(v), f"tg.{op.op_name} (axis {axis} of {table})", table.shape[axis]))
    return tuple(checks)


class Signature:
    """Built from rows (name, shape with str symbolic dims, dtype spelling), and the inputs
    that index tables (`index_checks`)."""

    def __init__(self, rows: Sequence[tuple[str, Sequence[int | str], str]], indices: Sequence[IndexCheck] = ()):
        self._inputs = tuple(_input_spec(*row) for row in rows)
        self._any_exprs = any(spec.exprs for spec in self._inputs)
        self.names = [row[0] for row in rows]
        self.indices = tuple(indices)

    @classmethod
    def of(cls, model) -> "Signature":
        return cls([(name, tuple(d if isinstance(d, int) else str(d) for d in info.shape), info.dtype)
                    for name, info in zip(model.input_names, model.inputs)], index_checks(model))

    def bind(self, values: Sequence[Any] | Mapping[str, Any]) -> tuple[list[np.ndarray], dict[str, int]]:
        """The inputs as arrays of the declared dtypes, and the size of every symbol.

        Raises ShapeError/DTypeError naming the input otherwise.
        """
        if isinstance(values, Mapping):
            values = self._by_name(values)
        specs = self._inputs
        if len(values) != len(specs):
            raise ShapeError(f"the model takes {len(specs)} inputs ({', '.join(self.names)}), got {len(values)}")
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
                if shape[axis] < 1:  # symbols are positive: shapes, reshapes and the cost model assume it
                    raise ShapeError(f"input '{spec.name}' has {sym} = {shape[axis]} (shape {shape}); a symbolic "
                                     "dimension is at least 1")
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
        for check in self.indices:
            a = arrays[check.input]
            if a.size and a.dtype.kind in "iu":
                low, high = a.min(), a.max()
                if low < -check.size or high >= check.size:
                    bad = low if low < -check.size else high
                    at = tuple(int(i) for i in np.argwhere(a == bad)[0])
                    raise ShapeError(f"input '{self.names[check.input]}' holds {bad} at {list(at)}, outside the "
                                     f"valid range [{-check.size}, {check.size - 1}] of the {check.op} it indexes")
        return arrays, sizes

    def _by_name(self, named: Mapping[str, Any]) -> tuple:
        missing = [n for n in self.names if n not in named]
        extra = [n for n in named if n not in self.names]
        if missing or extra:
            raise ShapeError(f"inputs: missing {missing}, unexpected {extra}; the model takes {self.names}")
        return tuple(named[n] for n in self.names)


def _shape_error(spec: _Input, shape: tuple) -> ShapeError:
    return ShapeError(f"input '{spec.name}' has shape {shape}, the model expects {spec.shape_text}")


def _cast(spec: _Input, a: np.ndarray) -> np.ndarray:
    if not np.can_cast(a.dtype, spec.dtype, "same_kind"):
        raise DTypeError(f"input '{spec.name}' is {a.dtype}, the model expects {dtypes.dtype_name(spec.dtype)} "
                         f"({spec.dtype}); cast it first")
    return a.astype(spec.dtype)


@dataclass(frozen=True)
class SizeConditions:
    """Every symbolic size a model's values take, with the first op that makes each: a shape
    binding checks them all once, before any kernel runs (`check`).

    Shape rules compute a result's dims from the operands' symbols (a pool's L - 3, a
    reshape's 3*B/2, a split's S - 4), and each must come out a non-negative integer at the
    sizes of a call: a negative one made C write before its buffer, a fractional one was
    truncated. Checking every value's type here covers every rule, whichever op made it.
    """

    exprs: tuple  # ((sympy expression, what makes it), ...)
    shapes: tuple = ()  # ((shape with a symbolic dim, what makes it), ...): their element counts

    @classmethod
    def of(cls, model) -> "SizeConditions":
        from xdsl.dialects.builtin import TensorType

        from tilegraph.ir.shapes import info_of

        found: dict = {}
        shapes: dict = {}
        for index, op in enumerate(model.module.walk()):
            for k, r in enumerate(op.results):
                if not isinstance(r.type, TensorType):
                    continue
                info = info_of(r.type)
                name = f"%{r.name_hint}" if r.name_hint else f"result {k}"
                where = f"{op.name} ({name} of op {index}, {info})"
                for d in info.shape:
                    if not isinstance(d, int) and d not in found:
                        found[d] = where
                if any(not isinstance(d, int) for d in info.shape):
                    shapes.setdefault(tuple(info.shape), where)
        return cls(tuple(found.items()), tuple(shapes.items()))

    def check(self, sizes: Mapping[str, int]) -> None:
        """ModelError naming the op, its result and the sizes where a dim is not a
        non-negative integer at `sizes`."""
        if not self.exprs:
            return
        import sympy

        from tilegraph.ir.model import ModelError
        from tilegraph.ir.shapes import symbol

        subs = {symbol(k): sympy.Integer(v) for k, v in sizes.items()}
        at = ", ".join(f"{k}={v}" for k, v in sizes.items())
        values = {}
        for expr, where in self.exprs:
            value = sympy.sympify(expr).xreplace(subs)
            if value.free_symbols:  # a size only the run finds (NonZero's count): checked by its op
                continue
            if not (value.is_Integer and value >= 0):
                raise ModelError(f"the model cannot run at {at}: {where} has a dimension {expr} = {value}, "
                                 "not a non-negative integer")
            values[expr] = int(value)
        for shape, where in self.shapes:
            if all(isinstance(d, int) or d in values for d in shape):
                count = math.prod(values.get(d, d) for d in shape)
                if count > MAX_NUMEL:
                    raise ModelError(f"the model cannot run at {at}: {where} would have {count} elements, "
                                     "more than 2^56, more than any memory holds")
