"""A small PyTorch-like API for writing tg graphs by hand.

    g = Graph()
    x = g.input("x", ("B", 784))
    w = g.weight("fc.w", np.random.rand(784, 10).astype(np.float32))
    y = g.relu(x @ w + 1.0)
    model = g.build(y)          # an ir.Model: module + weight store

Every op of the table is a method (`g.exp(x)`, `g.reduce_sum(x, axes=(1,))`); the
common ones get friendlier signatures below. Shape rules run as ops are made, so a
mistake is reported at the line that made it, naming the op and the shapes.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import sympy
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, FunctionType, IntegerAttr, ModuleOp, StringAttr
from xdsl.dialects.func import FuncOp, ReturnOp
from xdsl.ir import Block, Region, SSAValue

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import make_op
from tilegraph.ir.model import ALIAS_ATTR, NAME_ATTR, Model, ModelError, WeightStore, ssa_hint  # ModelError is a ValueError
from tilegraph.ir.ops import OPS
from tilegraph.ir.shapes import Dim, ShapeError, TensorInfo, as_shape, info_of, normalize_dim, numel, tensor_type

# Arrays up to this many elements print inline as tg.constant; larger ones go to the
# weight store so the IR text stays readable.
INLINE_CONSTANT_LIMIT = 16


class Tensor:
    """A value of the graph under construction; operators build ops."""

    __slots__ = ("graph", "value")
    __array_priority__ = 1000  # so np.float32(2) * t calls Tensor.__rmul__

    def __init__(self, graph: "Graph", value: SSAValue):
        self.graph = graph
        self.value = value

    @property
    def info(self) -> TensorInfo:
        return info_of(self.value.type)

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.info.shape

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Tensor({self.info})"

    def _bin(self, name, other, reverse=False):
        a, b = self, self.graph.lift(other, like=self)
        return self.graph.op(name, b, a) if reverse else self.graph.op(name, a, b)

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)
    def __pow__(self, o): return self._bin("pow", o)
    def __matmul__(self, o): return self.graph.op("matmul", self, o)
    def __neg__(self): return self.graph.op("neg", self)
    def __lt__(self, o): return self._bin("lt", o)
    def __le__(self, o): return self._bin("le", o)
    def __gt__(self, o): return self._bin("gt", o)
    def __ge__(self, o): return self._bin("ge", o)

    def reshape(self, *shape): return self.graph.reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
    def transpose(self, *perm): return self.graph.transpose(self, perm)
    def astype(self, dtype: str): return self.graph.cast(self, dtype)


class Graph:
    def __init__(self, weights: WeightStore | None = None):
        self.block = Block()
        self.weights = weights if weights is not None else WeightStore()
        self.input_names: list[str] = []
        self._const_count = 0

    # --- sources -----------------------------------------------------------

    def input(self, name: str, shape: Sequence[Dim | str], dtype: str = "f32") -> Tensor:
        if name in self.input_names:
            raise ModelError(f"input '{name}' is defined twice")
        arg = self.block.insert_arg(tensor_type(dtype, shape), len(self.block.args))
        arg.name_hint = ssa_hint(name)
        self.input_names.append(name)
        return Tensor(self, arg)

    def weight(self, name: str, array: Any) -> Tensor:
        array = np.asarray(array)
        if name in self.weights and self.weights[name] is not array:
            raise ModelError(f"weight '{name}' is defined twice")
        self.weights[name] = array
        return self.op("weight", name=name, result=TensorInfo(tuple(array.shape), dtypes.dtype_name(array.dtype)))

    def constant(self, value: Any, dtype: str | None = None) -> Tensor:
        array = np.asarray(value)
        if dtype is not None:
            array = array.astype(dtypes.numpy_dtype(dtype))
        info = TensorInfo(tuple(array.shape), dtypes.dtype_name(array.dtype))
        if array.size > INLINE_CONSTANT_LIMIT or not (dtypes.is_float(info.dtype) or dtypes.is_int(info.dtype) or info.dtype == "i1"):
            while f"const{self._const_count}" in self.weights:
                self._const_count += 1
            return self.weight(f"const{self._const_count}", array)
        return self.op("constant", value=array, result=info)

    def lift(self, value: Any, like: Tensor) -> Tensor:
        """A Tensor as is; a Python or NumPy scalar/array as a constant of like's dtype."""
        if isinstance(value, Tensor):
            return value
        return self.constant(np.asarray(value, dtype=dtypes.numpy_dtype(like.dtype)))

    # --- generic -----------------------------------------------------------

    def op(self, opname: str, /, *operands: Tensor | None, result: TensorInfo | None = None, **attrs) -> Any:
        """Make op `opname`; returns a Tensor, or a tuple of them for several results."""
        values = [t.value for t in operands if t is not None]
        for t in operands:
            if t is not None and t.graph is not self:
                raise ModelError(f"tg.{opname}: operand {t} belongs to another graph")
        op = make_op(opname, values, attrs, result)
        self.block.add_op(op)
        outs = tuple(Tensor(self, r) for r in op.results)
        return outs[0] if len(outs) == 1 else outs

    def __getattr__(self, name: str):
        if name in OPS:
            return lambda *xs, **attrs: self.op(name, *xs, **attrs)
        raise AttributeError(f"Graph has no method or tg op '{name}'")

    # --- friendlier signatures ------------------------------------------------

    def cast(self, x: Tensor, dtype: str) -> Tensor:
        return x if x.dtype == dtype else self.op("cast", x, to=dtype)

    def reshape(self, x: Tensor, shape: Sequence[Dim | str]) -> Tensor:
        dims = list(as_shape(d for d in shape))
        if sum(1 for d in dims if isinstance(d, int) and d == -1) > 1:
            raise ShapeError(f"tg.reshape: at most one -1 in {tuple(shape)}")
        if -1 in dims:
            known = numel([d for d in dims if not (isinstance(d, int) and d == -1)])
            dims[dims.index(-1)] = normalize_dim(sympy.sympify(numel(x.shape)) / sympy.sympify(known))
        return self.op("reshape", x, result=TensorInfo(tuple(dims), x.dtype))

    def broadcast(self, x: Tensor, shape: Sequence[Dim | str]) -> Tensor:
        return self.op("broadcast", x, result=TensorInfo(as_shape(shape), x.dtype))

    def transpose(self, x: Tensor, perm: Sequence[int]) -> Tensor:
        return self.op("transpose", x, perm=tuple(perm))

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        return self.op("matmul", a, b)

    def linear(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """x @ w + b with w stored (in, out)."""
        y = x @ w
        return y if b is None else y + b

    def _reduce(self, kind: str, x: Tensor, axes, keepdims: bool) -> Tensor:
        if axes is None:
            axes = tuple(range(x.rank))
        elif isinstance(axes, int):
            axes = (axes,)
        return self.op("reduce_" + kind, x, axes=tuple(axes), keepdims=keepdims)

    def sum(self, x, axes=None, keepdims=False): return self._reduce("sum", x, axes, keepdims)
    def mean(self, x, axes=None, keepdims=False): return self._reduce("mean", x, axes, keepdims)
    def prod(self, x, axes=None, keepdims=False): return self._reduce("prod", x, axes, keepdims)
    def amax(self, x, axes=None, keepdims=False): return self._reduce("max", x, axes, keepdims)
    def amin(self, x, axes=None, keepdims=False): return self._reduce("min", x, axes, keepdims)

    def softmax(self, x: Tensor, axis: int = -1) -> Tensor:
        return self.op("softmax", x, axis=axis)

    def layer_norm(self, x: Tensor, scale: Tensor | None = None, bias: Tensor | None = None,
                   axis: int = -1, epsilon: float = 1e-5) -> Tensor:
        if bias is not None and scale is None:
            scale = self.constant(np.ones((), dtype=dtypes.numpy_dtype(x.dtype)))
        return self.op("layer_norm", x, scale, bias, axis=axis, epsilon=epsilon)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                  scale: float | None = None, causal: bool = False) -> Tensor:
        if scale is None:
            d = q.shape[-1]
            if not isinstance(d, int):
                raise ShapeError("tg.attention: give scale= when the head dim is symbolic")
            scale = 1.0 / float(np.sqrt(d))
        return self.op("attention", q, k, v, mask, scale=scale, causal=causal)

    def concat(self, xs: Sequence[Tensor], axis: int) -> Tensor:
        return self.op("concat", *xs, axis=axis)

    def split(self, x: Tensor, sizes: Sequence[int], axis: int = 0) -> tuple[Tensor, ...]:
        out = self.op("split", x, axis=axis, sizes=tuple(sizes))
        return out if isinstance(out, tuple) else (out,)

    def slice(self, x: Tensor, starts: Sequence[int], ends: Sequence[int],
              axes: Sequence[int] | None = None, steps: Sequence[int] | None = None) -> Tensor:
        """Python slicing on the given axes (all leading axes when None)."""
        axes = list(range(len(starts))) if axes is None else [a % x.rank for a in axes]
        steps = [1] * len(axes) if steps is None else list(steps)
        full = [(0, (1 << 63) - 1, 1) for _ in range(x.rank)]
        for a, s, e, st in zip(axes, starts, ends, steps):
            full[a] = (int(s), int(e), int(st))
        return self.op("slice", x, starts=tuple(f[0] for f in full), ends=tuple(f[1] for f in full),
                       steps=tuple(f[2] for f in full))

    def gather(self, x: Tensor, indices: Tensor, axis: int = 0) -> Tensor:
        return self.op("gather", x, indices, axis=axis)

    def embedding(self, table: Tensor, ids: Tensor) -> Tensor:
        return self.gather(table, ids, axis=0)

    def pad(self, x: Tensor, pads: Sequence[int], mode: str = "constant", value: float = 0.0) -> Tensor:
        return self.op("pad", x, pads=tuple(pads), mode=mode, value=value)

    def where(self, cond: Tensor, a: Any, b: Any) -> Tensor:
        like = a if isinstance(a, Tensor) else b
        return self.op("where", cond, self.lift(a, like), self.lift(b, like))

    # --- finishing -----------------------------------------------------------

    def build(self, *outputs: Tensor, names: Sequence[str] | None = None,
              aliases: dict[str, str] | None = None) -> Model:
        """Close the graph: returns a Model whose @forward returns `outputs`. `aliases` maps
        an input name to the output name that is its buffer: a donated input updated in place."""
        if not outputs:
            raise ModelError("a graph needs at least one output")
        names = list(names) if names is not None else [f"output{i}" for i in range(len(outputs))]
        if len(names) != len(outputs):
            raise ModelError(f"{len(outputs)} outputs but {len(names)} names")
        self.block.add_op(ReturnOp(*[t.value for t in outputs]))
        in_types = [a.type for a in self.block.args]
        out_types = [t.value.type for t in outputs]
        func = FuncOp("forward", FunctionType.from_lists(in_types, out_types), Region(self.block))
        aliases = dict(aliases or {})
        unknown = [k for k in aliases if k not in self.input_names] + [v for v in aliases.values() if v not in names]
        if unknown:
            raise ModelError(f"aliases name no such input or output: {', '.join(unknown)}")
        func.arg_attrs = ArrayAttr([DictionaryAttr({NAME_ATTR: StringAttr(n), **(
            {ALIAS_ATTR: IntegerAttr(names.index(aliases[n]), 64)} if n in aliases else {})})
            for n in self.input_names])
        func.res_attrs = ArrayAttr([DictionaryAttr({NAME_ATTR: StringAttr(n)}) for n in names])
        model = Model(ModuleOp([func]), self.weights)
        model.verify()
        return model
