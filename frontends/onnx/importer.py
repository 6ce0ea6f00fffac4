"""The importer: binds graph inputs and initializers, converts node by node (expanding ops
that ONNX defines as functions into their bodies), and folds ops on known values."""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Sequence

import numpy as np
import sympy

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.load import (DEFAULT_DOMAINS, MAX_FUNCTION_DEPTH, NOT_EXPANDED, _op_key, check_supported,
                                           default_opset, function_schema, load_model)
from tilegraph.frontends.onnx.node import CONVERTERS, Node
from tilegraph.frontends.onnx.values import (FOLD_MAX_NEW_ELEMENTS, ByFunctionBody, StaticInputNeeded, Value, _as_int_array,
                                             info, known_dtype, onnx_dtype, tensor_array)
from tilegraph.ir import dtypes
from tilegraph.ir.builder import INLINE_CONSTANT_LIMIT, Graph, Tensor
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.interpreter import dtype_code, evaluate_rendered, shape_code
from tilegraph.ir.model import Model
from tilegraph.ir.ops import Op, OPS, infer, normalize_attrs, render
from tilegraph.ir.shapes import Dim, TensorInfo, is_static, symbol, symbol_named


def _renamed(b, rename: Callable[[str], str], attrs: dict):
    """A copy of function-body node `b` with every value name mapped by `rename` (inside its
    subgraphs too, so a Scan body in a function body sees the renamed outer names) and its
    attribute references resolved against the calling node's `attrs`."""
    from onnx import AttributeProto, NodeProto

    n = NodeProto()
    n.CopyFrom(b)
    del n.input[:], n.output[:], n.attribute[:]
    n.input.extend(rename(i) for i in b.input)
    n.output.extend(rename(o) for o in b.output)
    for a in b.attribute:
        if a.ref_attr_name:
            if a.ref_attr_name in attrs:
                ref = AttributeProto()
                ref.CopyFrom(attrs[a.ref_attr_name])
                ref.name = a.name
                n.attribute.append(ref)
            continue
        a2 = AttributeProto()
        a2.CopyFrom(a)
        for g in ([a2.g] if a2.type == AttributeProto.GRAPH else
                  list(a2.graphs) if a2.type == AttributeProto.GRAPHS else []):
            nodes = [_renamed(sub, rename, attrs) for sub in g.node]
            del g.node[:]
            g.node.extend(nodes)
            for v in list(g.input) + list(g.output) + list(g.value_info):
                v.name = rename(v.name)
            for t in g.initializer:
                t.name = rename(t.name)
        n.attribute.append(a2)
    return n


class _Importer:
    def __init__(self, proto, constant_inputs: dict[str, np.ndarray]):
        self.proto = proto
        self.opset = default_opset(proto)
        self.g = Graph()
        self.env: dict[str, Value] = {}
        self.constant_inputs = constant_inputs
        self.producers = {out: node for node in proto.graph.node for out in node.output}
        self.initializers = {t.name for t in proto.graph.initializer}
        self.runtime_inputs: set[str] = set()
        self._names: dict[int, str] = {}  # id(known array) -> ONNX name, for weight names
        self._materialized: dict[int, tuple[np.ndarray, Tensor]] = {}
        self._fresh = 0

    # --- the graph ---

    def run(self) -> Model:
        graph = self.proto.graph
        for t in graph.initializer:
            self.bind(t.name, self.initializer(t))
        graph_inputs = {i.name for i in graph.input}
        unknown = sorted(set(self.constant_inputs) - graph_inputs)
        if unknown:
            raise FrontendError(f"constant_inputs {unknown} are not inputs of the graph "
                                f"(inputs: {sorted(graph_inputs)})")
        for inp in graph.input:
            if inp.name in self.initializers and inp.name not in self.constant_inputs:
                continue  # IR < 4 lists initializers as inputs too: they are weights here
            dtype, shape = self.input_type(inp)
            if inp.name in self.constant_inputs:
                self.bind(inp.name, np.asarray(self.constant_inputs[inp.name]).astype(dtypes.numpy_dtype(dtype)))
            else:
                self.bind_input(inp.name, shape, dtype)
        for node in self.graph_nodes():
            self.convert(node)
        outputs = []
        for out in graph.output:
            if out.name not in self.env:
                raise FrontendError(f"graph output '{out.name}' is computed by no node")
            t = self.tensor(self.env[out.name], out.name)
            declared = self.declared_dtype(out)
            if declared is not None:
                if declared != t.dtype:
                    raise FrontendError(f"graph output '{out.name}' is declared {declared} but computes {t.dtype}")
            if out.type.tensor_type.HasField("shape"):
                # A declared shape is checked where it is certain: its rank and its fixed dims
                # (a scalar output computed as a 1-element array is an importer bug, not a model's).
                dims = out.type.tensor_type.shape.dim
                shape = t.info.shape
                if len(dims) != len(shape) or any(d.HasField("dim_value") and isinstance(s, int) and d.dim_value != s
                                                  for d, s in zip(dims, shape)):
                    declared = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims)  # type: ignore[assignment]
                    raise FrontendError(f"graph output '{out.name}' is declared with shape {declared} "
                                        f"but computes {t.info}")
            outputs.append(t)
        if not outputs:
            raise FrontendError("the graph has no outputs: nothing to compute")
        return self.close(outputs, [o.name for o in graph.output])

    # Hooks a decoder import (kv_cache.py) overrides: which inputs become what, which nodes are
    # converted, and what the model returns.
    def initializer(self, t) -> np.ndarray:
        return tensor_array(t, f"initializer '{t.name}'")

    def bind_input(self, name: str, shape: tuple[Dim, ...], dtype: str) -> None:
        self.env[name] = self.g.input(name, shape, dtype)
        self.runtime_inputs.add(name)

    def graph_nodes(self) -> Sequence:
        return self.proto.graph.node

    def close(self, outputs: list[Tensor], names: list[str]) -> Model:
        return self.g.build(*outputs, names=names)

    def declared_dtype(self, out) -> str | None:
        """The element type graph output `out` must compute (None where the file does not say)."""
        elem = out.type.tensor_type.elem_type
        return onnx_dtype(elem, f"graph output '{out.name}'") if elem else None

    def input_type(self, inp) -> tuple[str, tuple[Dim, ...]]:
        if inp.type.WhichOneof("value") != "tensor_type":
            raise FrontendError(f"graph input '{inp.name}' is a {inp.type.WhichOneof('value')}; "
                                "only tensors are supported")
        tt = inp.type.tensor_type
        dtype = onnx_dtype(tt.elem_type, f"graph input '{inp.name}'")
        if not tt.HasField("shape"):
            raise FrontendError(f"graph input '{inp.name}' has no shape (not even a rank)")
        shape: list[Dim] = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            elif d.HasField("dim_param") and re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*", d.dim_param):
                shape.append(symbol_named(d.dim_param))
            else:
                shape.append(self.fresh_symbol())
        return dtype, tuple(shape)

    def fresh_symbol(self) -> sympy.Symbol:
        taken = {p.dim_param for i in self.proto.graph.input for p in i.type.tensor_type.shape.dim}
        while True:
            self._fresh += 1
            name = f"d{self._fresh}"
            if name not in taken:
                return symbol(name)

    def bind(self, name: str, value: Value) -> None:
        if isinstance(value, np.ndarray):
            self._names.setdefault(id(value), name)
        self.env[name] = value

    def convert(self, proto, depth: int = 0) -> None:
        key = _op_key(proto)
        if key not in CONVERTERS:
            for body_node in self.expand(proto, depth):
                self.convert(body_node, depth + 1)
            return
        node = Node(self, proto)
        try:
            outs = CONVERTERS[key](node)
        except ByFunctionBody:
            for body_node in self.expand(proto, depth):
                self.convert(body_node, depth + 1)
            return
        except StaticInputNeeded:
            raise
        except FrontendError as e:
            raise FrontendError(f"{node.where()}: {e}") from None
        except TilegraphError as e:
            raise FrontendError(f"{node.where()}: {e}") from None
        except (ValueError, IndexError, KeyError, TypeError, ArithmeticError) as e:
            raise FrontendError(f"{node.where()}: cannot convert ({type(e).__name__}: {e})") from None
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        for i, name in enumerate(proto.output):
            if not name:
                continue
            if i >= len(outs) or outs[i] is None:
                raise FrontendError(f"{node.where()}: output {i} ('{name}') is not supported")
            self.bind(name, outs[i])

    def expand(self, proto, depth: int) -> list:
        """The nodes of ONNX's function body for `proto`, renamed into this graph."""
        from onnx import AttributeProto, FunctionProto, NodeProto, helper

        schema = function_schema(proto, self.opset)
        where = f"node '{proto.name or proto.output[0]}' ({_op_key(proto)})"
        if schema is None or _op_key(proto) in NOT_EXPANDED or depth > MAX_FUNCTION_DEPTH:
            raise FrontendError(f"{where}: unsupported op")
        node = NodeProto()
        node.CopyFrom(proto)
        given = {a.name for a in node.attribute}
        for name, a in schema.attributes.items():  # defaults, for the body's attribute references
            if name not in given and a.default_value.type != AttributeProto.UNDEFINED:
                node.attribute.append(a.default_value)
        opset = self.opset if proto.domain in DEFAULT_DOMAINS else 1 << 30
        body = FunctionProto()
        plain = [v for v in schema.function_opset_versions if v <= opset]
        if plain:
            body.ParseFromString(schema.get_function_with_opset_version(max(plain)))
        else:
            versions = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
            types = []
            for i in proto.input:
                if not i:
                    types.append(helper.make_tensor_type_proto(0, None).SerializeToString())
                    continue
                t = info(self.env[i])
                elem = helper.np_dtype_to_tensor_dtype(dtypes.numpy_dtype(t.dtype))
                types.append(helper.make_tensor_type_proto(elem, [d if isinstance(d, int) else str(d)
                                                                  for d in t.shape]).SerializeToString())
            try:
                body.ParseFromString(schema.get_context_dependent_function_with_opset_version(
                    max(versions), node.SerializeToString(), types))
            except Exception as e:  # the C++ function builder rejects what it cannot expand
                raise FrontendError(f"{where}: ONNX cannot expand its function body ({e})") from None
        unknown = sorted({_op_key(n) for n in body.node} - set(CONVERTERS)
                         - {_op_key(n) for n in body.node if function_schema(n, self.opset) is not None})
        if unknown:
            raise FrontendError(f"{where}: its function body uses unsupported ops {unknown}")
        prefix = f"{proto.name or proto.output[0]}/{proto.op_type}/"
        # Formal inputs the node leaves out are absent (""); internal names get the prefix.
        rename = {formal: (proto.input[k] if k < len(proto.input) else "") for k, formal in enumerate(body.input)}
        for formal, actual in zip(body.output, proto.output):
            if actual:
                rename[formal] = actual
        attrs = {a.name: a for a in node.attribute}
        out = []
        for b in body.node:
            n = _renamed(b, lambda v: rename.get(v, prefix + v) if v else "", attrs)
            n.name = prefix + (b.name or b.output[0])
            out.append(n)
            self.producers.update({o: n for o in n.output if o})
        return out

    def run_subgraph(self, graph, args: Sequence[Value], where: str) -> list[Value]:
        """The outputs of subgraph `graph` (an If branch, a Loop or Scan body) on `args`, its nodes
        converted in place. It sees the names of the enclosing scope; its own names are dropped
        after, so the next iteration of an unrolled loop binds them afresh."""
        if len(args) != len(graph.input):
            raise FrontendError(f"{where}: its subgraph takes {len(graph.input)} inputs, given {len(args)}")
        saved = dict(self.env)
        try:
            for formal, v in zip(graph.input, args):
                self.env[formal.name] = v
            for t in graph.initializer:
                self.bind(t.name, tensor_array(t, f"{where}: subgraph initializer '{t.name}'"))
            for node in graph.node:
                self.producers.update({o: node for o in node.output if o})
                self.convert(node)
            missing = [o.name for o in graph.output if o.name not in self.env]
            if missing:
                raise FrontendError(f"{where}: subgraph outputs {missing} are computed by no node")
            return [self.env[o.name] for o in graph.output]
        finally:
            self.env = saved

    def upstream_inputs(self, name: str) -> list[str]:
        """The run-time graph inputs that value `name` is computed from."""
        seen, stack, found = set(), [name], set()
        while stack:
            n = stack.pop()
            if n in seen or not n:
                continue
            seen.add(n)
            if n in self.runtime_inputs:
                found.add(n)
            elif n in self.producers:
                stack.extend(self.producers[n].input)
        return sorted(found)

    # --- values ---

    def tensor(self, v: Value, what: str = "a value") -> Tensor:
        """v as a run-time tensor; a known value becomes tg.constant or tg.weight (once)."""
        if isinstance(v, Tensor):
            return v
        hit = self._materialized.get(id(v))
        if hit is not None:
            return hit[1]
        a = v
        if a.dtype == object:
            a = _as_int_array(v)  # type: ignore[assignment]
            if a is None:
                t = self.symbolic_tensor(v, what)
                self._materialized[id(v)] = (v, t)
                return t
        name = self._names.get(id(v))
        if name is not None and a.size > INLINE_CONSTANT_LIMIT:
            base, k = name, 0
            while name in self.g.weights:
                k += 1
                name = f"{base}.{k}"
            t = self.g.weight(name, a)
        else:
            t = self.g.constant(a)
        self._materialized[id(v)] = (v, t)
        return t

    def symbolic_tensor(self, v: np.ndarray, what: str) -> Tensor:
        """An i64 shape value with symbolic entries (a sequence length fed to Range, Mul, Add) as
        tg ops computing it at run time.

        tg has no op reading a shape, so a symbol `s` is the sum of an s-long vector of ones:
        every backend runs it, it is exact in i64 (also for s = 0), and its O(s) cost is noise
        beside the ops that consume it. Sums, products, floor divisions and remainders of
        symbols (what Shape arithmetic folds to) become add, mul, div and mod."""
        g = self.g

        def build(e) -> Tensor:
            e = sympy.sympify(e)
            if e.is_Integer:
                return g.constant(np.asarray(int(e), dtype=np.int64))
            if e.is_Symbol:
                ones = g.op("broadcast", g.constant(np.asarray(1, dtype=np.int64)),
                            result=TensorInfo((e,), "i64"))
                return g.op("reduce_sum", ones, axes=(0,), keepdims=False)
            if isinstance(e, (sympy.Add, sympy.Mul)) and all(a.is_integer for a in e.args):
                out = build(e.args[0])
                for arg in e.args[1:]:
                    out = g.op("add" if isinstance(e, sympy.Add) else "mul", out, build(arg))
                return out
            if isinstance(e, sympy.floor):
                num, den = sympy.fraction(sympy.together(e.args[0]))
                if num.is_integer and den.is_integer:
                    # a numerator may be negative (floor(1/2 - H/2) is how sympy writes a part of
                    # a SAME padding): floor division as (a - a mod b) / b, exact, with mod taking
                    # the divisor's sign, where the truncating div alone is wrong.
                    a, b = build(num), build(den)
                    return g.op("div", g.op("sub", a, g.op("mod", a, b)), b)
            if isinstance(e, sympy.Mod) and all(a.is_integer for a in e.args):
                return g.op("mod", build(e.args[0]), build(e.args[1]))
            raise FrontendError(f"{what} = {v.tolist()} depends on symbolic dims through {e}, "
                                "which cannot be computed at run time")

        parts = [build(e) for e in v.reshape(-1).tolist()]
        if v.ndim == 0:
            return parts[0]
        flat = (parts[0] if len(parts) == 1 else
                g.op("concat", *(g.op("reshape", p, result=TensorInfo((1,), "i64")) for p in parts), axis=0))
        if len(parts) == 1:
            flat = g.op("reshape", flat, result=TensorInfo((1,), "i64"))
        return flat if v.shape == (len(parts),) else g.op("reshape", flat, result=TensorInfo(v.shape, "i64"))

    def op(self, name: str, *vals: Value | None, result: TensorInfo | None = None, **attrs) -> Any:
        """Make tg op `name`, or fold it when every operand is known."""
        if all(v is None or isinstance(v, np.ndarray) for v in vals):
            folded = self.fold(name, vals, result, attrs)
            if folded is not None:
                return folded
        tensors = [None if v is None else self.tensor(v) for v in vals]
        return self.g.op(name, *tensors, result=result, **attrs)

    def fold(self, name: str, vals: Sequence[np.ndarray | None], result: TensorInfo | None, attrs: dict) -> Any:
        """Evaluate op `name` on known operands with its template from ir.ops; None if it cannot be."""
        spec = OPS[name]
        attrs = normalize_attrs(spec, attrs)
        arrays = [v for v in vals if v is not None]
        outs = infer(spec, [TensorInfo(a.shape, known_dtype(a)) for a in arrays], attrs,
                     [result] if result is not None else None)
        if not all(is_static(o.shape) for o in outs):
            return None
        if sum(math.prod(o.shape) for o in outs) > max(FOLD_MAX_NEW_ELEMENTS, sum(a.size for a in arrays)):
            return None  # an op that makes a big array from small ones (iota, broadcast) stays an op
        symbolic = any(a.dtype == object for a in arrays)
        if symbolic and not dtypes.is_int(outs[0].dtype) and outs[0].dtype != "i1":
            return None
        names = [f"a{i}" if v is not None else None for i, v in enumerate(vals)]
        local = {n: v for n, v in zip(names, vals) if n is not None}
        dt = "object" if symbolic and dtypes.is_int(outs[0].dtype) else dtype_code(outs[0].dtype)
        expr = render(spec, [n for n in names if n] if spec.variadic else names, attrs,
                      shape_code(outs[0].shape), dt)
        try:
            with np.errstate(all="ignore"):
                if symbolic and name == Op.div:
                    # K.div tests the dtype to truncate integers, which object arrays of sympy
                    # values defeat; shape values are >= 0, where truncation is floor.
                    value = np.vectorize(lambda a, b: sympy.floor(sympy.sympify(a) / sympy.sympify(b)),
                                         otypes=[object])(*arrays)
                else:
                    value = evaluate_rendered(expr, local)
        except (TypeError, ValueError, AttributeError):
            if symbolic:
                return None
            raise
        values = list(value) if len(outs) > 1 else [value]
        results = []
        for info, v in zip(outs, values):  # noqa: F402
            a = np.asarray(v)
            if a.dtype == object:
                ints = _as_int_array(a)
                a = ints if ints is not None else a
            if a.dtype != object:
                # np.array keeps 0-d values 0-d (np.ascontiguousarray returns at least 1-d).
                a = np.array(a, dtype=dtypes.numpy_dtype(info.dtype), order="C")
            results.append(a)
        return tuple(results) if len(results) > 1 else results[0]


def from_onnx(model: Any, *, constant_inputs: dict[str, np.ndarray] | None = None) -> Model:
    """Import an ONNX model (path, bytes or ModelProto) as a tg Model.

    constant_inputs: graph inputs whose values are known; they are folded into the
    model (and are no longer inputs of it).
    """
    proto = load_model(model)
    check_supported(proto)
    return _Importer(proto, constant_inputs or {}).run()
