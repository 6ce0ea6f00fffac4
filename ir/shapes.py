"""Shapes with symbolic dimensions.

A dimension is an `int` or a sympy expression in named positive-integer symbols
(`B`, `S`, `2*S`). In the IR a tensor type keeps `?` for a symbolic dimension and
names its expression in the type's encoding, so the builtin `TensorType` stays the
only type: `tensor<?x128x?xf32, ["B", "S*2"]>`.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import Collection, Iterable, Sequence, Union

import sympy
from xdsl.dialects.builtin import ArrayAttr, NoneAttr, StringAttr, TensorType
from xdsl.ir import Attribute

from tilegraph.ir.dtypes import dtype_name, element_type
from tilegraph.ir.errors import TilegraphError

Dim = Union[int, sympy.Expr]
Shape = tuple[Dim, ...]

from xdsl.dialects.builtin import DYNAMIC_INDEX as DYNAMIC  # how TensorType spells "?"  # noqa: E402


class ShapeError(TilegraphError):
    """A shape rule was broken; the message names the op and the shapes."""


# The largest rank any backend takes: oneDNN's DNNL_MAX_NDIMS, the size of the stack arrays
# the C runtime copies dims and strides into (a rank-13 MatMul overflowed them). A type of
# more dims is refused where it is made or read, so no backend sees one.
MAX_RANK = 12
# The most elements a tensor may have: at 8 bytes an element 2^59 bytes, so every byte count and
# byte offset the backends compute fits int64 with room to spare (NumPy's np.tile crashed the
# process past 2^63 bytes, and C's sizes are int64). No machine holds a tensor near it.
MAX_NUMEL = 1 << 56


def check_dims(dims: Sequence, where: str) -> None:
    """ShapeError unless `dims` is at most MAX_RANK long, no static dim is negative and the
    static dims make at most MAX_NUMEL elements: every tensor type is made (tensor_type) or read
    (info_of) through here. (Symbolic dims: `signature.SizeConditions`, at each binding.)"""
    if len(dims) > MAX_RANK:
        raise ShapeError(f"{where} has rank {len(dims)}; tilegraph takes tensors of rank {MAX_RANK} at most")
    for d in dims:
        if isinstance(d, int) and d < 0:
            raise ShapeError(f"{where} would have a negative dimension ({shape_str(dims)})")
    if math.prod(d for d in dims if isinstance(d, int)) > MAX_NUMEL:
        raise ShapeError(f"{where} would have more than 2^56 elements ({shape_str(dims)}), more than any "
                         "memory holds")


@lru_cache(maxsize=None)
def symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, positive=True)


def symbol_named(text: str, taken: Collection[str] = ()) -> sympy.Symbol:
    """A symbolic dim named after `text` (a user's dim name, torch's `s43`, an ONNX dim_param):
    made an identifier, then given trailing underscores until it is none of `taken`, Python's
    keywords and builtins, and the names generated code evaluates shapes with (np, K, floor, ...),
    since shapes are written as Python in every emitted module."""
    import builtins
    import keyword

    from tilegraph.ir.interpreter import GLOBALS

    name = "".join(c if c.isalnum() or c == "_" else "_" for c in text)
    name = name if name and not name[0].isdigit() else "d_" + name
    while name in taken or name in GLOBALS or hasattr(builtins, name) or keyword.iskeyword(name):
        name += "_"
    return symbol(name)




def parse_dim(text: str | int | sympy.Expr) -> Dim:
    """'B' -> B, '2*S' -> 2*S, '7' -> 7, ints and expressions pass through."""
    if isinstance(text, (int, sympy.Expr)):
        return normalize_dim(text)
    return _parse_dim_text(text)


# --- NumPy backend: every read of a type (info_of) parses its dim names again, and
# parsing costs ~1 ms a call; dims are immutable, so each text is parsed once.
@lru_cache(maxsize=4096)
def _parse_dim_text(text: str) -> Dim:
    # A dim's text comes from files (a .mlir type's names): it is parsed, never evaluated
    # (sympy.parse_expr runs eval, and `().__class__...` reaches os.system through it).
    try:
        tree = ast.parse(text.strip(), mode="eval")
        return normalize_dim(sympy.sympify(_dim_tree(tree.body)))
    except (SyntaxError, TypeError, ValueError, RecursionError, MemoryError, ZeroDivisionError, sympy.SympifyError) as e:
        raise ShapeError(f"cannot read dimension {text!r}: {e}") from None


_DIM_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
                  ast.FloorDiv: lambda a, b: sympy.floor(a / b), ast.Pow: operator.pow}
# How sympy prints the functions a dim may hold (floor(S/2)); the interpreter defines them.
DIM_FUNCTIONS = {"floor": sympy.floor, "ceiling": sympy.ceiling, "Max": sympy.Max, "Min": sympy.Min}
MAX_DIM_EXPONENT = 8  # S**2 appears (a flattened square); a larger power is no dimension but a way to hang sympy
MAX_DIM_DIGITS = 30


def _dim_tree(node: ast.expr) -> Dim:
    """A dim expression from its syntax tree: integers, names (symbols), + - * / // % **,
    and DIM_FUNCTIONS; anything else is refused."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if len(str(node.value)) > MAX_DIM_DIGITS:
            raise ValueError("an integer too large for a dimension")
        return sympy.Integer(node.value)
    if isinstance(node, ast.Name):
        return symbol(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _dim_tree(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _DIM_OPERATORS:
        left, right = _dim_tree(node.left), _dim_tree(node.right)
        if isinstance(node.op, ast.Pow) and not (right.is_Integer and abs(int(right)) <= MAX_DIM_EXPONENT):
            raise ValueError(f"a power other than a small integer one ({MAX_DIM_EXPONENT} at most)")
        return _DIM_OPERATORS[type(node.op)](left, right)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DIM_FUNCTIONS
            and node.args and not node.keywords):
        return DIM_FUNCTIONS[node.func.id](*[_dim_tree(a) for a in node.args])
    raise ValueError("not an expression of sizes (integers, names, + - * / // **, "
                     f"{', '.join(DIM_FUNCTIONS)})")


def normalize_dim(d: Dim) -> Dim:
    if isinstance(d, sympy.Expr):
        return _simplified(d)
    if isinstance(d, bool) or not isinstance(d, (int,)):
        import numpy as np

        if isinstance(d, np.integer):
            return int(d)
        raise ShapeError(f"dimension {d!r} is neither an int nor a symbolic expression")
    return int(d)


# (cost model, fuse, tile) sympy.simplify costs ~7 ms a call and the passes ask about
# the same few dims thousands of times: each expression is simplified once.
@lru_cache(maxsize=16384)
def _simplified(d: sympy.Expr) -> Dim:
    d = sympy.simplify(d)
    return int(d) if d.is_Integer else d


def as_shape(dims: Iterable[Dim | str]) -> Shape:
    return tuple(parse_dim(d) for d in dims)


def is_static(shape: Shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def dims_equal(a: Dim, b: Dim) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return a == b or _simplified(sympy.sympify(a) - sympy.sympify(b)) == 0


def numel(shape: Sequence[Dim]) -> Dim:
    if is_static(tuple(shape)):
        return math.prod(shape)  # type: ignore[arg-type]
    # A product of simplified dims needs no simplify of its own: sympy.Mul collects it.
    product = sympy.Mul(*[sympy.sympify(d) for d in shape])
    return int(product) if product.is_Integer else product


def shape_str(shape: Sequence[Dim]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def broadcast_shapes(*shapes: Sequence[Dim]) -> Shape:
    """NumPy broadcasting over symbolic dims: equal dims, or one side is 1."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        dim: Dim = 1
        for s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            d = s[j]
            if isinstance(d, int) and d == 1:
                continue
            if isinstance(dim, int) and dim == 1:
                dim = d
            elif not dims_equal(dim, d):
                raise ShapeError(
                    "shapes " + " and ".join(shape_str(s) for s in shapes) + f" do not broadcast (dimension {i})"
                )
        out.append(dim)
    return tuple(out)


def concrete(shape: Sequence[Dim], bindings: dict[str, int]) -> tuple[int, ...]:
    """Evaluate a symbolic shape at concrete sizes {'B': 8, 'S': 128}."""
    subs = {symbol(k): v for k, v in bindings.items()}
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
            continue
        v = sympy.sympify(d).subs(subs)
        if not v.is_Integer:
            raise ShapeError(f"dimension {d} is not known from the sizes {bindings}")
        out.append(int(v))
    return tuple(out)


def free_symbols(shape: Sequence[Dim]) -> set[str]:
    return {s.name for d in shape if isinstance(d, sympy.Expr) for s in d.free_symbols}


@dataclass(frozen=True)
class TensorInfo:
    """What shape inference works on: a shape and a dtype spelling ("f32")."""

    shape: Shape
    dtype: str

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}{shape_str(self.shape)}"


def tensor_type(dtype: str, shape: Sequence[Dim | str]) -> TensorType:
    dims = as_shape(shape)
    check_dims(dims, f"a {dtype} tensor")
    symbolic = [d for d in dims if not isinstance(d, int)]
    encoding: Attribute = NoneAttr()
    if symbolic:
        encoding = ArrayAttr([StringAttr(str(d)) for d in symbolic])
    return TensorType(element_type(dtype), [d if isinstance(d, int) else DYNAMIC for d in dims], encoding)


def info_of(t: Attribute) -> TensorInfo:
    if not isinstance(t, TensorType):
        raise ShapeError(f"expected a tensor type, got {t}")
    return _tensor_info(t)


# Types are immutable and the passes read the same few hundred of them ~100,000 times on
# a BERT (fuse and tile price every candidate group from its ops' types).
@lru_cache(maxsize=8192)
def _tensor_info(t: TensorType) -> TensorInfo:
    names = []
    if isinstance(t.encoding, ArrayAttr):
        names = [a.data for a in t.encoding.data if isinstance(a, StringAttr)]
    dims: list[Dim] = []
    it = iter(names)
    for d in t.get_shape():
        if d == DYNAMIC:
            name = next(it, None)
            if name is None:
                raise ShapeError(f"type {t} has a '?' dimension without a name")
            dims.append(parse_dim(name))
        else:
            dims.append(d)
    check_dims(dims, f"type {t}")
    return TensorInfo(tuple(dims), dtype_name(t.element_type))


def type_of(info: TensorInfo) -> TensorType:
    return tensor_type(info.dtype, info.shape)
