"""ONNX -> tg: `from_onnx(path_or_proto)` maps an ONNX graph onto the tg dialect.

What it decides and how:

* Loading. A path or a `ModelProto`; a missing file or bytes that are not an ONNX
  model are a `FrontendError`, never a protobuf traceback.
* Checking first. One pass over all nodes collects every op it cannot convert
  (unknown op types, other domains, opset < 13 definitions that changed since) and
  raises ONE `FrontendError` listing them all, with counts and a node name each,
  before anything is converted.
* Values. Every ONNX value is either a tg `Tensor` (computed at run time) or a
  NumPy array known at import time: initializers, `Constant` nodes, `constant_inputs`,
  and whatever is computed from known values only. An op whose operands are all
  known is folded by evaluating that op's own NumPy template from `ir.ops` (the
  semantics live there, once), so the Shape -> Gather -> Unsqueeze -> Concat ->
  Reshape chains of exported models fold away. `Shape` of a symbolic dim gives an
  object array holding the sympy expression, so a Reshape target may be symbolic.
  A known value reaches the IR only where a tensor op needs it: as `tg.constant`
  when small, else as `tg.weight` under its ONNX name (initializers keep theirs).
* Ops. `CONVERTERS` maps an op type to a small function from a `Node` view to its
  output values; ONNX ops with no tg op of their own are compositions of tg ops
  (activations, normalizations, Gemm, Resize as gathers and weighted sums of taps
  computed here, ConvTranspose as a convolution of the zero-stuffed input, RNN/GRU/
  LSTM unrolled over their static sequence length). An op without a converter
  that ONNX defines as a function (Attention, the losses, RotaryEmbedding, ...) is
  expanded into ONNX's own function body, whose nodes are converted in its place.
  Inputs that must be static (shapes, axes, pads, sizes) are read from the known
  values; when one is computed from a graph input, `StaticInputNeeded` names the
  graph inputs that would have to be given as `constant_inputs`.
* Attribute-vs-input variants across opsets (axes of Reduce*/Squeeze/Unsqueeze,
  Split sizes, Pad pads, Clip bounds, ...) are read from whichever is present.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import numpy as np
import sympy

from tilegraph.frontends import FrontendError
from tilegraph.ir import dtypes
from tilegraph.ir.builder import INLINE_CONSTANT_LIMIT, Graph, Tensor
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.interpreter import GLOBALS, dtype_code, shape_code
from tilegraph.ir.model import Model
from tilegraph.ir.onnx_names import BINARY, REDUCE, UNARY
from tilegraph.ir.ops import OPS, REQUIRED, infer, normalize_attrs, render
from tilegraph.ir.shapes import Dim, ShapeError, TensorInfo, broadcast_shapes, is_static, normalize_dim, numel, symbol

MIN_OPSET = 13  # the oldest default-domain opset whose op definitions this frontend implements
DEFAULT_DOMAINS = ("", "ai.onnx")
INT64_MAX = (1 << 63) - 1  # ONNX's and tg.slice's "to the end"
# Ops whose definitions from this opset to 13 changed only in types tg does not have (sequences,
# optionals) or in what they refuse (Scan 9 took no negative axes): the converters take them.
UNCHANGED_SINCE = {"If": 11, "Loop": 11, "Scan": 9}
MAX_FUNCTION_DEPTH = 8  # function bodies calling functions: a guard against runaway recursion
# Ops with a function body that is random or otherwise not a computation tg can hold.
NOT_EXPANDED = {"Bernoulli", "SequenceMap"}
# Folding never makes a known array bigger than this from smaller operands (iota, broadcast,
# tile): the weight store holds what a model ships, not what it expands to at run time.
FOLD_MAX_NEW_ELEMENTS = 4096

Value = Union[Tensor, np.ndarray]  # run-time tensor, or a value known at import time


class StaticInputNeeded(FrontendError):
    """A value that must be known at import time (a shape, axes, pads) is computed at run time.

    `inputs` names the graph inputs it is computed from: passing those as
    `constant_inputs` makes the model importable.
    """

    def __init__(self, message: str, inputs: Sequence[str]):
        super().__init__(message)
        self.inputs = tuple(inputs)


# --- loading and checking -------------------------------------------------------


def load_model(model: Any):
    """A `ModelProto` from a proto, a path or raw bytes; FrontendError when it is not one."""
    import onnx
    from google.protobuf.message import DecodeError

    if isinstance(model, onnx.ModelProto):
        proto = model
    else:
        try:
            data = model if isinstance(model, bytes) else Path(model).read_bytes()
        except OSError as e:
            raise FrontendError(f"cannot read ONNX model {model}: {e.strerror}") from None
        try:
            proto = onnx.load_model_from_string(data)
        except (DecodeError, ValueError, RuntimeError) as e:
            raise FrontendError(f"{model} is not an ONNX model (protobuf decode failed: {e})") from None
        if not proto.HasField("graph") or not (proto.graph.node or proto.graph.output):
            raise FrontendError(f"{model} is not an ONNX model (it has no graph)")
    try:
        for f in proto.graph.initializer:
            if f.data_location == onnx.TensorProto.EXTERNAL and isinstance(model, (str, Path)):
                onnx.external_data_helper.load_external_data_for_model(proto, str(Path(model).parent))
                break
    except (OSError, onnx.checker.ValidationError) as e:  # missing, or outside the model's folder
        raise FrontendError(f"cannot read the external data of {model}: {e}") from None
    return proto


def default_opset(proto) -> int:
    versions = [o.version for o in proto.opset_import if o.domain in DEFAULT_DOMAINS]
    return versions[0] if versions else MIN_OPSET


def _op_key(node) -> str:
    return node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"


def _changed_since(op_type: str, opset: int) -> bool:
    """Whether the op's definition in force at `opset` (< 13) differs from its opset-13+ one."""
    import onnx.defs

    try:
        old = onnx.defs.get_schema(op_type, opset).since_version
        new = onnx.defs.get_schema(op_type, max(opset, MIN_OPSET)).since_version
    except (onnx.defs.SchemaError, TypeError):  # TypeError: an opset version past int32 (a corrupt file)
        return True
    return old != new


def function_schema(node, opset: int):
    """The schema of an op that ONNX defines as a function of other ops (None if it is not one).

    Such ops (Attention, the losses, RotaryEmbedding, ...) are imported by expanding
    ONNX's own function body, unless a converter maps them directly.
    """
    import onnx.defs

    try:
        schema = onnx.defs.get_schema(node.op_type, opset if node.domain in DEFAULT_DOMAINS else 1 << 30,
                                      "" if node.domain in DEFAULT_DOMAINS else node.domain)
    except (onnx.defs.SchemaError, TypeError):  # TypeError: an opset version past int32 (a corrupt file)
        return None
    versions = list(schema.function_opset_versions) + list(schema.context_dependent_function_opset_versions)
    return schema if versions else None


def unsupported_ops(proto) -> dict[str, list[str]]:
    """op key -> names of the nodes using it, for every op the frontend cannot convert."""
    opset = default_opset(proto)
    found: dict[str, list[str]] = {}
    for i, node in enumerate(proto.graph.node):
        key = _op_key(node)
        if key not in CONVERTERS and key not in NOT_EXPANDED and function_schema(node, opset) is not None:
            continue  # expanded into its function body at import
        if key not in CONVERTERS:
            reason = key
        elif opset < MIN_OPSET and opset < UNCHANGED_SINCE.get(key, MIN_OPSET) and _changed_since(node.op_type, opset):
            reason = f"{key} (opset {opset}; only its opset-{MIN_OPSET}+ definition is supported)"
        else:
            continue
        found.setdefault(reason, []).append(node.name or f"#{i} -> {node.output[0] if node.output else '?'}")
    return found


def check_supported(proto) -> None:
    found = unsupported_ops(proto)
    if found:
        total = sum(len(v) for v in found.values())
        lines = [f"  {key}: {len(names)} node{'s' if len(names) > 1 else ''} (e.g. '{names[0]}')"
                 for key, names in sorted(found.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
        raise FrontendError(f"the ONNX model uses {len(found)} unsupported op type{'s' if len(found) > 1 else ''} "
                            f"({total} node{'s' if total > 1 else ''}):\n" + "\n".join(lines))


def from_onnx(model: Any, *, constant_inputs: dict[str, np.ndarray] | None = None) -> Model:
    """Import an ONNX model (path, bytes or ModelProto) as a tg Model.

    constant_inputs: graph inputs whose values are known; they are folded into the
    model (and are no longer inputs of it).
    """
    proto = load_model(model)
    check_supported(proto)
    return _Importer(proto, constant_inputs or {}).run()


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


def _symbol_name(param: str) -> str:
    """A dim_param as a symbol name that generated code can use as a variable (not `np`, `K`, `int`, `in`)."""
    import builtins
    import keyword

    from tilegraph.ir.interpreter import GLOBALS

    while param in GLOBALS or hasattr(builtins, param) or keyword.iskeyword(param):
        param += "_"
    return param


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
            self.bind(t.name, tensor_array(t, f"initializer '{t.name}'"))
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
                self.env[inp.name] = self.g.input(inp.name, shape, dtype)
                self.runtime_inputs.add(inp.name)
        for node in graph.node:
            self.convert(node)
        outputs = []
        for out in graph.output:
            if out.name not in self.env:
                raise FrontendError(f"graph output '{out.name}' is computed by no node")
            t = self.tensor(self.env[out.name], out.name)
            if out.type.tensor_type.elem_type:
                declared = onnx_dtype(out.type.tensor_type.elem_type, f"graph output '{out.name}'")
                if declared != t.dtype:
                    raise FrontendError(f"graph output '{out.name}' is declared {declared} but computes {t.dtype}")
            if out.type.tensor_type.HasField("shape"):
                # A declared shape is checked where it is certain: its rank and its fixed dims
                # (a scalar output computed as a 1-element array is an importer bug, not a model's).
                dims = out.type.tensor_type.shape.dim
                shape = t.info.shape
                if len(dims) != len(shape) or any(d.HasField("dim_value") and isinstance(s, int) and d.dim_value != s
                                                  for d, s in zip(dims, shape)):
                    declared = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims)
                    raise FrontendError(f"graph output '{out.name}' is declared with shape {declared} "
                                        f"but computes {t.info}")
            outputs.append(t)
        if not outputs:
            raise FrontendError("the graph has no outputs: nothing to compute")
        return self.g.build(*outputs, names=[o.name for o in graph.output])

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
                shape.append(symbol(_symbol_name(d.dim_param)))
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
            a = _as_int_array(v)
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
                    # (issue 18) a numerator may be negative (floor(1/2 - H/2) is how sympy writes
                    # a part of a SAME padding): floor division as (a - a mod b) / b, exact, with
                    # mod taking the divisor's sign, where the truncating div alone is wrong.
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
                if symbolic and name == "div":
                    # K.div tests the dtype to truncate integers, which object arrays of sympy
                    # values defeat; shape values are >= 0, where truncation is floor.
                    value = np.vectorize(lambda a, b: sympy.floor(sympy.sympify(a) / sympy.sympify(b)),
                                         otypes=[object])(*arrays)
                else:
                    value = eval(expr, GLOBALS, local)
        except (TypeError, ValueError, AttributeError):
            if symbolic:
                return None
            raise
        values = list(value) if len(outs) > 1 else [value]
        results = []
        for info, v in zip(outs, values):
            a = np.asarray(v)
            if a.dtype == object:
                ints = _as_int_array(a)
                a = ints if ints is not None else a
            if a.dtype != object:
                # np.array keeps 0-d values 0-d (np.ascontiguousarray returns at least 1-d).
                a = np.array(a, dtype=dtypes.numpy_dtype(info.dtype), order="C")
            results.append(a)
        return tuple(results) if len(results) > 1 else results[0]


def info(v: Value) -> TensorInfo:
    if isinstance(v, Tensor):
        return v.info
    return TensorInfo(tuple(v.shape), known_dtype(v))


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


for _onnx, _tg in UNARY.items():
    CONVERTERS[_onnx] = lambda n, _tg=_tg: n.op(_tg, n.x(0))

for _onnx, _tg in BINARY.items():
    CONVERTERS[_onnx] = lambda n, _tg=_tg: n.op(_tg, n.x(0), n.x(1))

VARIADIC = {"Max": "max", "Min": "min", "Sum": "add"}
for _onnx, _tg in VARIADIC.items():
    def _variadic(n, _tg=_tg):
        out = n.x(0)
        for v in n.inputs[1:]:
            out = n.op(_tg, out, v)
        return out

    CONVERTERS[_onnx] = _variadic


@_conv("Identity")
def _identity(n):
    return n.x(0)


@_conv("Mean")
def _mean(n):
    total = CONVERTERS["Sum"](n)
    return n.op("div", total, len(n.inputs))


@_conv("Where")
def _where(n):
    return n.op("where", n.x(0), n.x(1), n.x(2))


@_conv("Mod")
def _mod(n):
    return n.op("mod", n.x(0), n.x(1), fmod=bool(n.attr("fmod", 0)))


@_conv("BitShift")
def _bitshift(n):
    direction = n.attr("direction")
    if direction not in ("LEFT", "RIGHT"):
        raise FrontendError(f"direction '{direction}' is neither LEFT nor RIGHT")
    return n.op("shift_left" if direction == "LEFT" else "shift_right", n.x(0), n.x(1))


@_conv("Pow")
def _pow(n):
    base, exp = n.x(0), n.x(1)
    bt, et = n.dtype(base), n.dtype(exp)
    if bt == et:
        return n.op("pow", base, exp)
    if dtypes.is_float(bt):
        return n.op("pow", base, n.cast(exp, bt))
    # An integer base to a float power: computed in the exponent's type, then truncated
    # back to the base's type (the ONNX reference does the same).
    return n.cast(n.op("pow", n.cast(base, et), exp), bt)


@_conv("IsInf")
def _isinf(n):
    return n.op("isinf", n.x(0), detect_positive=bool(n.attr("detect_positive", 1)),
                detect_negative=bool(n.attr("detect_negative", 1)))


# --- activations as compositions ---


@_conv("LeakyRelu")
def _leaky_relu(n):
    x = n.x(0)
    return n.op("where", n.op("lt", x, 0), n.op("mul", x, n.attr("alpha", 0.01)), x)


@_conv("PRelu")
def _prelu(n):
    x, slope = n.x(0), n.x(1)
    return n.op("where", n.op("lt", x, 0), n.op("mul", x, slope), x)


@_conv("Elu")
def _elu(n):
    x = n.x(0)
    return n.op("where", n.op("lt", x, 0), n.op("mul", n.op("sub", n.op("exp", x), 1), n.attr("alpha", 1.0)), x)


@_conv("Selu")
def _selu(n):
    # Defaults from the ONNX spec (Klambauer et al. 2017, rounded to float32).
    x = n.x(0)
    alpha, gamma = n.attr("alpha", 1.67326319217681884765625), n.attr("gamma", 1.05070102214813232421875)
    neg = n.op("sub", n.op("mul", n.op("exp", x), alpha), alpha)
    return n.op("mul", n.op("where", n.op("le", x, 0), neg, x), gamma)


@_conv("Celu")
def _celu(n):
    x, alpha = n.x(0), n.attr("alpha", 1.0)
    neg = n.op("mul", n.op("sub", n.op("exp", n.op("div", x, alpha)), 1), alpha)
    return n.op("add", n.op("max", x, 0), n.op("min", neg, 0))


@_conv("HardSigmoid")
def _hard_sigmoid(n):
    return _hard_sigmoid_of(n, n.x(0), n.attr("alpha", 0.2), n.attr("beta", 0.5))


def _hard_sigmoid_of(n, x, alpha, beta):
    return n.op("max", n.op("min", n.op("add", n.op("mul", x, alpha), beta), 1), 0)


@_conv("HardSwish")
def _hard_swish(n):
    x = n.x(0)
    return n.op("mul", x, _hard_sigmoid_of(n, x, 1 / 6, 0.5))


@_conv("Softplus")
def _softplus(n):
    return n.op("log", n.op("add", n.op("exp", n.x(0)), 1))


@_conv("Softsign")
def _softsign(n):
    x = n.x(0)
    return n.op("div", x, n.op("add", n.op("abs", x), 1))


@_conv("ThresholdedRelu")
def _thresholded_relu(n):
    x = n.x(0)
    return n.op("where", n.op("gt", x, n.attr("alpha", 1.0)), x, 0)


@_conv("Shrink")
def _shrink(n):
    x, bias, lambd = n.x(0), n.attr("bias", 0.0), n.attr("lambd", 0.5)
    if dtypes.is_int(n.dtype(x)):
        bias, lambd = int(bias), int(lambd)
    inner = n.op("where", n.op("gt", x, lambd), n.op("sub", x, bias), 0)
    return n.op("where", n.op("lt", x, -lambd), n.op("add", x, bias), inner)


@_conv("Mish")
def _mish(n):
    x = n.x(0)
    return n.op("mul", x, n.op("tanh", _softplus(n)))


@_conv("Swish")
def _swish(n):
    x = n.x(0)
    return n.op("mul", x, n.op("sigmoid", n.op("mul", x, n.attr("alpha", 1.0))))


@_conv("Gelu")
def _gelu(n):
    return n.op("gelu", n.x(0), approximate=n.attr("approximate", "none"))


@_conv("Clip")
def _clip(n):
    x = n.x(0)
    lo, hi = n.opt(1), n.opt(2)
    if lo is not None:
        x = n.op("max", x, lo)
    if hi is not None:
        x = n.op("min", x, hi)
    return x


# --- casts ---

# Largest finite values of the float8 types: what saturate=1 clamps to (ONNX Cast spec).
FLOAT8_MAX = {"f8E4M3FN": 448.0, "f8E5M2": 57344.0, "f8E4M3FNUZ": 240.0, "f8E5M2FNUZ": 57344.0}


def _cast_to(n, x, to: str):
    if to == "f8E8M0FNU" and n.dtype(x) != to:
        # ONNX rounds to E8M0 up (round_mode='up') and saturates tiny values to 2^-127;
        # tg's cast rounds to nearest as ml_dtypes does. Refused rather than computed differently.
        raise FrontendError(f"{n.where()}: Cast to FLOAT8E8M0 is not supported (ONNX's round_mode "
                            f"'{n.attr('round_mode', 'up')}' is not tg's round-to-nearest)")
    if to in FLOAT8_MAX and n.attr("saturate", 1) and dtypes.is_float(n.dtype(x)):
        m = FLOAT8_MAX[to]
        x = n.op("min", n.op("max", x, -m), m)
    return n.cast(x, to)


@_conv("Cast")
def _cast(n):
    return _cast_to(n, n.x(0), onnx_dtype(n.attr("to"), "attribute 'to'"))


@_conv("CastLike")
def _cast_like(n):
    return _cast_to(n, n.x(0), n.dtype(n.x(1)))


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


# --- reductions ---

def _reduce_axes(n, x) -> list[int] | None:
    """The axes to reduce; None: the identity (noop_with_empty_axes with no axes)."""
    r = n.rank(x)
    axes = n.ints_attr_or_input("axes", 1)
    if not axes:
        if n.attr("noop_with_empty_axes", 0):
            return None
        return list(range(r))
    return sorted({_axis(a, r) for a in axes})


def _empty_reduction(n, kind, x, axes, keepdims):
    """A reduction over an empty set: its identity element, as ONNX defines it."""
    shape = [1 if i in axes else d for i, d in enumerate(n.shape(x)) if keepdims or i not in axes]
    dt = dtypes.numpy_dtype(n.dtype(x))
    if dtypes.is_float(n.dtype(x)):
        big, small = np.inf, -np.inf
    elif n.dtype(x) == "i1":
        big, small = True, False
    else:
        big, small = np.iinfo(dt).max, np.iinfo(dt).min
    identity = {"sum": 0, "l1": 0, "l2": 0, "sum_square": 0, "prod": 1, "max": small, "min": big,
                "log_sum": -np.inf, "log_sum_exp": -np.inf, "mean": np.nan}[kind]
    return n.broadcast(np.full((1,) * len(shape), identity, dtype=dt), shape)


def _reduce(n, kind):
    x = n.x(0)
    axes = _reduce_axes(n, x)
    if axes is None:
        return x
    keep = bool(n.attr("keepdims", 1))
    shape = n.shape(x)
    if any(isinstance(shape[a], int) and shape[a] == 0 for a in axes):
        return _empty_reduction(n, kind, x, axes, keep)
    if kind in ("sum", "mean", "max", "min", "prod"):
        return n.reduce(kind, x, axes, keep)
    if kind == "l1":
        return n.reduce("sum", n.op("abs", x), axes, keep)
    if kind == "sum_square":
        return n.reduce("sum", n.op("mul", x, x), axes, keep)
    if kind == "l2":
        return n.op("sqrt", n.reduce("sum", n.op("mul", x, x), axes, keep))
    if kind == "log_sum":
        return n.op("log", n.reduce("sum", x, axes, keep))
    # log-sum-exp, shifted by the max so that exp cannot overflow
    m = n.reduce("max", x, axes, True)
    s = n.op("log", n.reduce("sum", n.op("exp", n.op("sub", x, m)), axes, True))
    out = n.op("add", s, m)
    return out if keep else n.reshape(out, [d for i, d in enumerate(shape) if i not in axes])


for _onnx, _kind in REDUCE.items():
    CONVERTERS[_onnx] = lambda n, _kind=_kind: _reduce(n, _kind)


@_conv("ArgMax", "ArgMin")
def _arg(n):
    x = n.x(0)
    return n.op(n.op_type.lower(), x, axis=_axis(n.attr("axis", 0), n.rank(x)), keepdims=bool(n.attr("keepdims", 1)),
                select_last_index=bool(n.attr("select_last_index", 0)))


@_conv("Softmax")
def _softmax(n):
    x = n.x(0)
    return n.op("softmax", x, axis=_axis(n.attr("axis", -1), n.rank(x)))


@_conv("LogSoftmax")
def _log_softmax(n):
    x = n.x(0)
    axis = _axis(n.attr("axis", -1), n.rank(x))
    shifted = n.op("sub", x, n.reduce("max", x, [axis], True))
    return n.op("sub", shifted, n.op("log", n.reduce("sum", n.op("exp", shifted), [axis], True)))


@_conv("Hardmax")
def _hardmax(n):
    x = n.x(0)
    axis = _axis(n.attr("axis", -1), n.rank(x))
    first = n.op("argmax", x, axis=axis, keepdims=True)
    return n.cast(n.op("eq", n.iota(n.shape(x), axis), first), n.dtype(x))


# --- contractions and windows ---


@_conv("MatMul")
def _matmul(n):
    return n.op("matmul", n.x(0), n.x(1))


@_conv("Gemm")
def _gemm(n):
    a, b, c = n.x(0), n.x(1), n.opt(2)
    if n.attr("transA", 0):
        a = n.transpose(a, (1, 0))
    if n.attr("transB", 0):
        b = n.transpose(b, (1, 0))
    y = n.op("matmul", a, b)
    alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
    if alpha != 1.0:
        y = n.op("mul", y, alpha)
    if c is not None and beta != 0.0:
        y = n.op("add", y, c if beta == 1.0 else n.op("mul", c, beta))
    return y


@_conv("Einsum")
def _einsum(n):
    vals = [v for v in n.inputs if v is not None]
    dtype = n.dtype(vals[0])
    if dtype == "bf16":  # NumPy has no bf16 einsum: accumulate in f32, round once
        vals = [n.cast(v, "f32") for v in vals]
    out = n.op("einsum", *vals, equation=n.attr("equation").replace(" ", ""))
    return n.cast(out, dtype)


def _window_attrs(n, x, kernel: Sequence[int]) -> dict:
    """strides, pads (begins, then ends), dilations of Conv/pools, auto_pad resolved."""
    nd = len(kernel)
    strides = list(n.attr("strides", [1] * nd))
    dilations = list(n.attr("dilations", [1] * nd))
    pads = list(n.attr("pads", [0] * (2 * nd)))
    auto = n.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        spatial = n.shape(x)[2:]
        # With stride 1 the total padding is dilation * (kernel - 1) whatever the size; with a
        # larger stride it depends on the size modulo the stride, which must then be known.
        if not all(isinstance(d, int) or s == 1 for d, s in zip(spatial, strides)):
            raise FrontendError(f"auto_pad {auto} with strides {strides} needs static spatial dims, got {spatial}")
        pads = [0] * (2 * nd)
        for i in range(nd):
            if strides[i] == 1:
                total = dilations[i] * (kernel[i] - 1)
            else:
                out = -(-spatial[i] // strides[i])
                total = max(0, (out - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1 - spatial[i])
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads[i], pads[i + nd] = lo, total - lo
    elif auto == "VALID":
        pads = [0] * (2 * nd)
    elif auto != "NOTSET":
        raise FrontendError(f"auto_pad '{auto}' is not supported")
    return {"strides": tuple(strides), "pads": tuple(pads), "dilations": tuple(dilations)}


@_conv("Conv")
def _conv_op(n):
    x, w, b = n.x(0), n.x(1), n.opt(2)
    kernel = n.attr("kernel_shape", list(n.shape(w)[2:]))
    return n.op("conv", x, w, b, groups=n.attr("group", 1), **_window_attrs(n, x, kernel))


@_conv("MaxPool")
def _max_pool(n):
    if n.wants_output(1):
        raise FrontendError("the Indices output of MaxPool is not supported")
    x = n.x(0)
    kernel = n.attr("kernel_shape")
    return n.op("max_pool", x, kernel=tuple(kernel), ceil_mode=bool(n.attr("ceil_mode", 0)),
                **_window_attrs(n, x, kernel))


@_conv("AveragePool")
def _avg_pool(n):
    x = n.x(0)
    kernel = n.attr("kernel_shape")
    return n.op("avg_pool", x, kernel=tuple(kernel), ceil_mode=bool(n.attr("ceil_mode", 0)),
                count_include_pad=bool(n.attr("count_include_pad", 0)), **_window_attrs(n, x, kernel))


@_conv("LpPool")
def _lp_pool(n):
    x = n.x(0)
    kernel = n.attr("kernel_shape")
    if n.attr("ceil_mode", 0):
        raise FrontendError("LpPool with ceil_mode is not supported")
    p = n.attr("p", 2)
    # sum |x|^p over a window = mean with padding counted * window size (no ceil_mode).
    powered = n.op("pow", n.op("abs", x), float(p))
    mean = n.op("avg_pool", powered, kernel=tuple(kernel), count_include_pad=True, **_window_attrs(n, x, kernel))
    return n.op("pow", n.op("mul", mean, float(math.prod(kernel))), 1.0 / p)


@_conv("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(n):
    x = n.x(0)
    return n.reduce("mean" if n.op_type == "GlobalAveragePool" else "max", x, range(2, n.rank(x)), True)


# --- normalizations ---


def _channel(n, v, rank):
    """A per-channel (C,) vector shaped to broadcast against (N, C, ...)."""
    return n.reshape(v, (n.shape(v)[0],) + (1,) * (rank - 2))


@_conv("BatchNormalization")
def _batch_norm(n):
    x, scale, bias, mean, var = (n.x(i) for i in range(5))
    r = n.rank(x)
    eps = n.attr("epsilon", 1e-5)
    outputs = ()
    if n.attr("training_mode", 0):
        # Normalize with the batch's statistics (population variance); the running
        # statistics are updated with `momentum` (ONNX spec, opset 14+).
        axes = [0] + list(range(2, r))
        batch_mean = n.reduce("mean", x, axes, False)
        centered = n.op("sub", x, _channel(n, batch_mean, r))
        batch_var = n.reduce("mean", n.op("mul", centered, centered), axes, False)
        momentum = n.attr("momentum", 0.9)
        outputs = (n.op("add", n.op("mul", mean, momentum), n.op("mul", batch_mean, 1 - momentum)),
                   n.op("add", n.op("mul", var, momentum), n.op("mul", batch_var, 1 - momentum)))
        mean, var = batch_mean, batch_var
    elif n.n_outputs > 1:
        raise FrontendError("running mean/var outputs need training_mode=1")
    inv = n.op("div", _channel(n, scale, r), n.op("sqrt", n.op("add", _channel(n, var, r), eps)))
    y = n.op("add", n.op("mul", n.op("sub", x, _channel(n, mean, r)), inv), _channel(n, bias, r))
    return (y,) + outputs


def _normalize(n, x, axes, eps):
    """(x - mean) / sqrt(var + eps) over axes, and the mean and 1/sqrt(var + eps) kept."""
    mean = n.reduce("mean", x, axes, True)
    centered = n.op("sub", x, mean)
    var = n.reduce("mean", n.op("mul", centered, centered), axes, True)
    inv = n.op("reciprocal", n.op("sqrt", n.op("add", var, eps)))
    return n.op("mul", centered, inv), mean, inv


@_conv("InstanceNormalization")
def _instance_norm(n):
    x, scale, bias = n.x(0), n.x(1), n.x(2)
    r = n.rank(x)
    y, _, _ = _normalize(n, x, range(2, r), n.attr("epsilon", 1e-5))
    return n.op("add", n.op("mul", y, _channel(n, scale, r)), _channel(n, bias, r))


def _stashed(n, x):
    """stash_type=1 (the default): statistics in float32 even for 16-bit inputs."""
    dtype = n.dtype(x)
    if n.attr("stash_type", 1) == 1 and dtype in ("f16", "bf16"):
        return n.cast(x, "f32"), dtype
    return x, dtype


@_conv("LayerNormalization")
def _layer_norm(n):
    x, scale, bias = n.x(0), n.x(1), n.opt(2)
    r = n.rank(x)
    axis = _axis(n.attr("axis", -1), r)
    eps = n.attr("epsilon", 1e-5)
    xs, dtype = _stashed(n, x)
    if n.n_outputs == 1 and xs is x:
        return n.op("layer_norm", x, scale, bias, axis=axis, epsilon=eps)
    y, mean, inv = _normalize(n, xs, range(axis, r), eps)
    y = n.op("mul", n.cast(y, dtype), scale)
    if bias is not None:
        y = n.op("add", y, bias)
    return y, mean, inv


@_conv("RMSNormalization")
def _rms_norm(n):
    x, scale = n.x(0), n.x(1)
    r = n.rank(x)
    axis = _axis(n.attr("axis", -1), r)
    xs, dtype = _stashed(n, x)
    ms = n.reduce("mean", n.op("mul", xs, xs), range(axis, r), True)
    y = n.op("div", xs, n.op("sqrt", n.op("add", ms, n.attr("epsilon", 1e-5))))
    return n.op("mul", n.cast(y, dtype), scale)


@_conv("GroupNormalization")
def _group_norm(n):
    x, scale, bias = n.x(0), n.x(1), n.x(2)
    shape = n.shape(x)
    groups = n.attr("num_groups")
    c = shape[1]
    if n.shape(scale)[0] != c:
        raise FrontendError(f"scale {n.info(scale)} must have one entry per channel ({c}); "
                            "the opset-18 per-group form is not supported")
    xs, dtype = _stashed(n, x)
    grouped = n.reshape(xs, (shape[0], groups, numel(shape[1:]) // groups))
    y, _, _ = _normalize(n, grouped, [2], n.attr("epsilon", 1e-5))
    y = n.cast(n.reshape(y, shape), dtype)
    return n.op("add", n.op("mul", y, _channel(n, scale, len(shape))), _channel(n, bias, len(shape)))


@_conv("MeanVarianceNormalization")
def _mvn(n):
    x = n.x(0)
    axes = [_axis(a, n.rank(x)) for a in n.attr("axes", [0, 2, 3])]
    # ONNX's function body: (X - E[X]) / (sqrt(E[X^2] - E[X]^2) + 1e-9)
    mean = n.reduce("mean", x, axes, True)
    var = n.op("sub", n.reduce("mean", n.op("mul", x, x), axes, True), n.op("mul", mean, mean))
    return n.op("div", n.op("sub", x, mean), n.op("add", n.op("sqrt", var), 1e-9))


@_conv("LpNormalization")
def _lp_norm(n):
    x = n.x(0)
    axis = _axis(n.attr("axis", -1), n.rank(x))
    p = n.attr("p", 2)
    if p == 1:
        norm = n.reduce("sum", n.op("abs", x), [axis], True)
    elif p == 2:
        norm = n.op("sqrt", n.reduce("sum", n.op("mul", x, x), [axis], True))
    else:
        raise FrontendError(f"p={p}: only 1 and 2 are defined")
    # A zero norm gives zeros, not NaN (the ONNX reference's choice).
    return n.op("where", n.op("eq", norm, 0), 0, n.op("div", x, norm))


@_conv("LRN")
def _lrn(n):
    x = n.x(0)
    size = n.attr("size")
    alpha, beta, bias = n.attr("alpha", 1e-4), n.attr("beta", 0.75), n.attr("bias", 1.0)
    c = n.shape(x)[1]
    r = n.rank(x)
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = n.op("mul", x, x)
    pads = [0] * (2 * r)
    pads[1], pads[1 + r] = lo, hi
    padded = n.op("pad", sq, pads=tuple(pads))
    total = None
    for k in range(size):
        part = n.slice(padded, 1, k, k + c)
        total = part if total is None else n.op("add", total, part)
    return n.op("div", x, n.op("pow", n.op("add", n.op("mul", total, alpha / size), bias), beta))


# --- quantization ---

# The integer ranges QuantizeLinear saturates to (ONNX spec).
QUANT_RANGES = {"ui8": (0, 255), "i8": (-128, 127), "ui16": (0, 65535), "i16": (-32768, 32767),
                "ui4": (0, 15), "i4": (-8, 7), "ui2": (0, 3), "i2": (-2, 1)}
FLOAT4_MAX = 6.0  # the largest finite f4E2M1FN (OCP MX spec), what QuantizeLinear saturates to


def _quant_param(n, v, x, axis: int, block: int):
    """A scale or zero point shaped to broadcast against x: per tensor, per axis or per block."""
    shape, r = n.shape(x), n.rank(x)
    if n.rank(v) == 0:
        return v
    if numel(n.shape(v)) == 1 and not block:
        return n.reshape(v, ())
    axis = _axis(axis, r)
    if not block:
        return n.reshape(v, [n.shape(v)[0] if i == axis else 1 for i in range(r)])
    # Blocked: each entry covers `block` consecutive elements along axis (the last block may be short).
    vs = n.shape(v)
    repeated = n.broadcast(n.unsqueeze(v, [axis + 1]), vs[:axis + 1] + (block,) + vs[axis + 1:])
    merged = n.reshape(repeated, vs[:axis] + (vs[axis] * block,) + vs[axis + 1:])
    return n.slice(merged, axis, 0, shape[axis])


@_conv("QuantizeLinear")
def _quantize(n):
    x, scale, zp = n.x(0), n.x(1), n.opt(2)
    axis = n.attr("axis", 1)
    block = n.attr("block_size", 0)
    if zp is not None:
        to = n.dtype(zp)
    elif "output_dtype" in n.attrs and n.attrs["output_dtype"]:
        to = onnx_dtype(n.attrs["output_dtype"], "attribute 'output_dtype'")
    else:
        to = "ui8"
    if "precision" in n.attrs and n.attrs["precision"]:
        p = onnx_dtype(n.attrs["precision"], "attribute 'precision'")
        x, scale = n.cast(x, p), n.cast(scale, p)
    y = n.op("div", x, n.cast(_quant_param(n, scale, x, axis, block), n.dtype(x)))
    if to in FLOAT8_MAX:
        return _cast_to(n, y, to)
    if to == "f4E2M1FN":
        return n.cast(n.op("min", n.op("max", y, -FLOAT4_MAX), FLOAT4_MAX), to)
    if to not in QUANT_RANGES:
        raise FrontendError(f"quantizing to {to} is not supported "
                            f"(supported: {sorted(QUANT_RANGES)}, {', '.join(FLOAT8_MAX)}, f4E2M1FN)")
    # round half to even, then add the zero point in int32 and saturate (the ONNX reference's order)
    q = n.cast(n.op("round", y), "i32")
    if zp is not None:
        q = n.op("add", q, n.cast(_quant_param(n, zp, x, axis, block), "i32"))
    lo, hi = QUANT_RANGES[to]
    return n.cast(n.op("min", n.op("max", q, lo), hi), to)


@_conv("DequantizeLinear")
def _dequantize(n):
    x, scale, zp = n.x(0), n.x(1), n.opt(2)
    axis = n.attr("axis", 1)
    block = n.attr("block_size", 0)
    out = onnx_dtype(n.attrs["output_dtype"], "attribute 'output_dtype'") if n.attrs.get("output_dtype") \
        else n.dtype(scale)
    work = "f64" if n.dtype(scale) == "f64" else "f32"  # the reference computes in float32
    dx = n.cast(x, work)
    if zp is not None and n.dtype(x) not in FLOAT8_MAX:  # float8 zero points are zero by definition
        dx = n.op("sub", dx, n.cast(_quant_param(n, zp, x, axis, block), work))
    return n.cast(n.op("mul", dx, n.cast(_quant_param(n, scale, x, axis, block), work)), out)


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


def _pad_or_crop(n, x, pads: Sequence[int], mode: str = "constant", value: float = 0.0):
    """Pad (begins, then ends); negative entries crop instead: a slice after padding with the positive part."""
    r = n.rank(x)
    positive = [max(p, 0) for p in pads]
    if any(positive):
        x = n.op("pad", x, pads=tuple(positive), mode=mode, value=value)
    for a in range(r):
        lo, hi = pads[a], pads[a + r]
        if lo < 0 or hi < 0:
            x = n.slice(x, a, -lo if lo < 0 else 0, hi if hi < 0 else INT64_MAX)
    return x


@_conv("ConvTranspose")
def _conv_transpose(n):
    x, w, b = n.x(0), n.x(1), n.opt(2)
    xs, ws = n.shape(x), n.shape(w)
    nd = len(xs) - 2
    kernel = list(n.attr("kernel_shape", ws[2:]))
    strides = list(n.attr("strides", [1] * nd))
    dil = list(n.attr("dilations", [1] * nd))
    out_pad = list(n.attr("output_padding", [0] * nd))
    groups = n.attr("group", 1)
    auto = n.attr("auto_pad", "NOTSET")
    if not is_static(xs[2:]):
        raise FrontendError(f"ConvTranspose needs static spatial dims, got {xs}")
    span = [(kernel[i] - 1) * dil[i] + 1 for i in range(nd)]
    if "output_shape" in n.attrs or auto in ("SAME_UPPER", "SAME_LOWER"):
        target = list(n.attrs.get("output_shape", [xs[2 + i] * strides[i] for i in range(nd)]))[-nd:]
        total = [strides[i] * (xs[2 + i] - 1) + out_pad[i] + span[i] - target[i] for i in range(nd)]
        if auto == "SAME_UPPER":
            pads = [t // 2 for t in total] + [t - t // 2 for t in total]
        else:
            pads = [t - t // 2 for t in total] + [t // 2 for t in total]
    else:
        pads = list(n.attr("pads", [0] * (2 * nd)))
    # x with stride-1 zeros between its elements, along each spatial axis
    for i in range(nd):
        s, a = strides[i], 2 + i
        if s > 1:
            shape = n.shape(x)
            grown = n.op("pad", n.unsqueeze(x, [a + 1]), pads=tuple(s - 1 if j == a + 1 + len(shape) + 1 else 0
                                                                     for j in range(2 * (len(shape) + 1))))
            x = n.slice(n.reshape(grown, shape[:a] + (shape[a] * s,) + shape[a + 1:]), a, 0, (shape[a] - 1) * s + 1)
    # then a stride-1 convolution with the flipped kernel, padded by span - 1 - pads
    full = [0, 0] + [span[i] - 1 - pads[i] for i in range(nd)] + [0, 0] + \
           [span[i] - 1 - pads[nd + i] + out_pad[i] for i in range(nd)]
    x = _pad_or_crop(n, x, full)
    cin, cout_g = ws[0], ws[1]
    wt = n.reshape(w, (groups, cin // groups, cout_g) + tuple(ws[2:]))
    wt = n.transpose(wt, (0, 2, 1) + tuple(range(3, 3 + nd)))
    wt = n.reshape(wt, (groups * cout_g, cin // groups) + tuple(ws[2:]))
    wt = n.op("slice", wt, starts=(0, 0) + (-1,) * nd, ends=(INT64_MAX, INT64_MAX) + (-INT64_MAX,) * nd,
              steps=(1, 1) + (-1,) * nd)
    return n.op("conv", x, wt, b, groups=groups, dilations=tuple(dil))


# --- Resize: per axis, a gather of the taps and a weighted sum, taps and weights computed here ---


def _resize_source(ctm: str, out_idx: np.ndarray, scale: float, in_w: int, out_w: int, roi) -> np.ndarray:
    """Output index -> source coordinate, per coordinate_transformation_mode (ONNX Resize spec)."""
    length = scale * in_w  # the un-rounded output length the spec's formulas use
    if ctm == "half_pixel":
        return (out_idx + 0.5) / scale - 0.5
    if ctm == "half_pixel_symmetric":
        offset = in_w / 2 * (1 - out_w / length)
        return offset + (out_idx + 0.5) / scale - 0.5
    if ctm == "pytorch_half_pixel":
        return (out_idx + 0.5) / scale - 0.5 if length != 1 else np.full(out_w, -0.5)
    if ctm == "align_corners":
        return out_idx * (in_w - 1) / (length - 1) if length != 1 else np.zeros(out_w)
    if ctm == "asymmetric":
        return out_idx / scale
    if ctm == "tf_crop_and_resize":
        lo, hi = roi
        if length == 1:
            return np.full(out_w, (hi - lo) * (in_w - 1) / 2 + lo * (in_w - 1))
        return out_idx * (hi - lo) * (in_w - 1) / (length - 1) + lo * (in_w - 1)
    raise FrontendError(f"coordinate_transformation_mode '{ctm}' is not supported")


def _resize_coeffs(mode: str, ratio: float, scale: float, a: float, antialias: bool, nearest: str) -> list[float]:
    """Interpolation weights of the taps around a source coordinate with fractional part `ratio`."""
    if mode == "nearest":
        if ratio == 1.0:
            return [0.0, 1.0]
        pick_high = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5,
                     "floor": False, "ceil": True}[nearest]
        return [0.0, 1.0] if pick_high else [1.0, 0.0]
    if mode == "linear" and not antialias:
        return [1 - ratio, ratio]
    if mode == "cubic" and not antialias:
        r1, r2 = ratio + 1, 2 - ratio
        return [((a * r1 - 5 * a) * r1 + 8 * a) * r1 - 4 * a, ((a + 2) * ratio - (a + 3)) * ratio * ratio + 1,
                ((a + 2) * (1 - ratio) - (a + 3)) * (1 - ratio) * (1 - ratio) + 1,
                ((a * r2 - 5 * a) * r2 + 8 * a) * r2 - 4 * a]
    # antialiased: the kernel stretched by 1/scale when downsampling, weights normalized
    s = min(scale, 1.0)
    if mode == "linear":
        start = int(np.floor(-1 / s) + 1)
        w = np.clip(1 - np.abs((np.arange(start, 2 - start) - ratio) * s), 0, 1)
    else:
        def cubic(t):
            t = abs(t)
            if t <= 1:
                return (a + 2) * t ** 3 - (a + 3) * t ** 2 + 1
            return a * t ** 3 - 5 * a * t ** 2 + 8 * a * t - 4 * a if t < 2 else 0.0

        start = int(np.floor(-2 / s) + 1)
        w = np.array([cubic(s * (i - ratio)) for i in range(start, 2 - start)])
    return list(w / w.sum())


def _resize_taps(n, in_w: int, out_w: int, scale: float, roi) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(indices (out, taps) into the input, weights (out, taps), extrapolated rows or None) for one axis."""
    mode = n.attr("mode", "nearest")
    ctm = n.attr("coordinate_transformation_mode", "half_pixel")
    x = _resize_source(ctm, np.arange(out_w, dtype=np.float64), scale, in_w, out_w, roi)
    base = np.floor(x).astype(np.int64)
    ratios = np.where(x == base, 1.0, x - base)
    coeffs = np.array([_resize_coeffs(mode, float(r), scale, n.attr("cubic_coeff_a", -0.75),
                                      bool(n.attr("antialias", 0)), n.attr("nearest_mode", "round_prefer_floor"))
                       for r in ratios], dtype=np.float64).reshape(out_w, -1)
    taps = coeffs.shape[1]
    # The taps are the `taps` nearest integer positions, preferring lower ones on ties.
    pad = -(-taps // 2)
    p = np.floor(x + pad).astype(np.int64)
    frac = x + pad - p
    if taps % 2 == 0:
        offset = np.where(frac == 0, -(taps // 2), -(taps // 2) + 1)
    else:
        offset = np.where(frac <= 0.5, -((taps - 1) // 2), -((taps - 1) // 2) + 1)
    idx = (p + offset - pad)[:, None] + np.arange(taps)[None, :]
    if n.attr("exclude_outside", 0):
        coeffs = np.where((idx < 0) | (idx >= in_w), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    extrapolated = ((x < 0) | (x > in_w - 1)) if ctm == "tf_crop_and_resize" else None
    return np.clip(idx, 0, in_w - 1), coeffs, extrapolated


@_conv("Resize")
def _resize(n):
    x = n.x(0)
    shape = n.shape(x)
    r = len(shape)
    axes = [_axis(a, r) for a in n.attr("axes", range(r))]
    roi, scales, sizes = n.static(1), n.static(2), n.static(3)
    roi = None if roi is None or roi.size == 0 else [float(v) for v in roi.reshape(-1)]
    out = list(shape)
    factors = [1.0] * r
    if sizes is not None and sizes.size:
        for i, a in enumerate(axes):
            out[a] = int(sizes.reshape(-1)[i])
        if not all(isinstance(shape[a], int) and shape[a] > 0 for a in axes):
            raise FrontendError(f"resized dims must be static and non-empty, got {shape}")
        factors = [out[a] / shape[a] if a in axes else 1.0 for a in range(r)]
        policy = n.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            common = (min if policy == "not_larger" else max)(factors[a] for a in axes)
            for a in axes:
                factors[a] = common
                out[a] = int(common * shape[a] + 0.5)  # round half up (ONNX spec)
    elif scales is not None and scales.size:
        for i, a in enumerate(axes):
            factors[a] = float(scales.reshape(-1)[i])
            if not isinstance(shape[a], int):
                raise FrontendError(f"resized dims must be static, got {shape}")
            out[a] = int(factors[a] * shape[a])
    else:
        raise FrontendError("Resize needs scales or sizes")
    mode = n.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        raise FrontendError(f"Resize mode '{mode}' is not supported")
    if mode != "nearest" and not dtypes.is_float(n.dtype(x)):
        raise FrontendError(f"Resize mode '{mode}' needs a float input")
    for k, a in enumerate(axes):
        pair = (roi[k], roi[k + len(axes)]) if roi is not None else (0.0, 1.0)
        if math.isclose(factors[a], 1.0) and out[a] == shape[a] and \
                math.isclose(pair[0], 0.0) and math.isclose(pair[1], 1.0):
            continue
        idx, coeffs, extrapolated = _resize_taps(n, shape[a], out[a], factors[a], pair)
        if mode == "nearest":
            x = n.op("gather", x, idx[np.arange(out[a]), np.argmax(coeffs, axis=1)], axis=a)
        else:
            dt = dtypes.numpy_dtype(n.dtype(x))
            gathered = n.op("gather", x, idx, axis=a)  # (..., out, taps, ...)
            w = coeffs.astype(dt).reshape(coeffs.shape + (1,) * (r - a - 1))
            x = n.reduce("sum", n.op("mul", gathered, w), [a + 1], False)
        if extrapolated is not None and extrapolated.any():
            mask = extrapolated.reshape((out[a],) + (1,) * (r - a - 1))
            x = n.op("where", mask, float(n.attr("extrapolation_value", 0.0)), x)
    return x


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


# --- data-dependent sizes (issue 18): NonZero, Unique, Compress, TopK on run-time values, NonMaxSuppression ---
# The result's size is a symbol that one tg op defines (ir/ops.py, "data-dependent sizes"),
# named u0, u1, ... (a name no graph input uses); with known inputs these fold at import.


def _run_time_size(n) -> str:
    imp = n.imp
    taken = {p.dim_param for i in imp.proto.graph.input for p in i.type.tensor_type.shape.dim}
    k = getattr(imp, "_run_time_sizes", 0)
    while f"u{k}" in taken:
        k += 1
    imp._run_time_sizes = k + 1
    return f"u{k}"


@_conv("NonZero")
def _nonzero(n):
    x = n.x(0)
    if isinstance(x, np.ndarray):
        return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)
    if n.rank(x) == 0:
        raise FrontendError("NonZero of a scalar computed at run time")
    mask = x if n.dtype(x) == "i1" else n.op("ne", x, 0)
    return n.op("nonzero", mask, size=_run_time_size(n))


@_conv("Unique")
def _unique(n):
    x = n.x(0)
    flatten = "axis" not in n.attrs
    axis = 0 if flatten else _axis(n.attrs["axis"], n.rank(x))
    sort = bool(n.attr("sorted", 1))
    if isinstance(x, np.ndarray):
        from tilegraph.ir.kernels import unique

        return unique(x, flatten, axis, sort)
    return n.op("unique", x, size=_run_time_size(n), flatten=flatten, axis=axis, sorted=sort)


_static_compress = CONVERTERS["Compress"]


@_conv("Compress")
def _compress_run_time(n):
    """Compress on a condition computed at run time: the rows of its nonzero entries."""
    if isinstance(n.opt(1), np.ndarray):
        return _static_compress(n)
    x, cond = n.x(0), n.x(1)
    if "axis" not in n.attrs:
        x = n.reshape(x, (numel(n.shape(x)),))
        axis = 0
    else:
        axis = _axis(n.attrs["axis"], n.rank(x))
    length, dim = n.shape(cond)[0], n.shape(x)[axis]
    if not (isinstance(length, int) and isinstance(dim, int)) and not sympy.simplify(length - dim) == 0:
        raise FrontendError(f"a run-time condition of length {length} over a dim of {dim}")
    if isinstance(length, int) and isinstance(dim, int) and length > dim:
        cond = n.slice(cond, 0, 0, dim)  # (ONNX: a longer condition's extra entries are ignored)
    size = _run_time_size(n)
    rows = n.op("nonzero", n.cast(cond, "i1"), size=size)
    return n.op("gather", x, n.reshape(rows, (symbol(size),)), axis=axis)


_static_topk = CONVERTERS["TopK"]


@_conv("TopK")
def _topk_run_time_k(n):
    """TopK with k computed at run time: the whole axis sorted, then both results narrowed to k."""
    if isinstance(n.opt(1), np.ndarray):
        return _static_topk(n)
    x = n.x(0)
    axis = _axis(n.attr("axis", -1), n.rank(x))
    if not isinstance(n.shape(x)[axis], int):
        raise FrontendError(f"TopK with a run-time k over symbolic dim {axis} of {info(x)}")
    k = n.reshape(n.cast(n.x(1), "i64"), ())
    size = _run_time_size(n)
    full = n.op("topk", x, k=n.shape(x)[axis], axis=axis, largest=bool(n.attr("largest", 1)))
    return tuple(n.op("narrow", t, k, axis=axis, size=size) for t in full)


@_conv("NonMaxSuppression")
def _non_max_suppression(n):
    boxes, scores = n.x(0), n.x(1)
    # Absent inputs take the spec's defaults (no boxes kept, IoU 0); an absent score threshold
    # filters nothing, so it stays absent.
    count = n.opt(2) if n.opt(2) is not None else np.zeros(1, np.int64)
    iou = n.opt(3) if n.opt(3) is not None else np.zeros(1, np.float32)
    rest = [n.opt(4)] if n.opt(4) is not None else []
    return n.op("non_max_suppression", boxes, scores, count, iou, *rest, size=_run_time_size(n),
                center_point_box=int(n.attr("center_point_box", 0)))


# --- Resize on symbolic spatial dims (issue 18): integer scale factors, taps made at run time ---
# With an integer factor s and a coordinate transformation that does not depend on the input
# length, output o reads source taps floor(o / s) + offset[o % s] with weights[o % s]: the
# taps repeat with period s. The tables (s rows) come from the same _resize_taps as the static
# case, taken well inside a longer axis; the edge clamp becomes an edge pad of the input.
_PERIODIC_CTM = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "asymmetric")
_static_resize = CONVERTERS["Resize"]


def _symbolic_resize_factors(n, shape, axes) -> dict[int, int] | None:
    """axis -> integer factor when a resized axis is symbolic (None: the static converter's case)."""
    if all(isinstance(shape[a], int) for a in axes):
        return None
    scales, sizes = n.opt(2), n.opt(3)
    factors = {}
    for i, a in enumerate(axes):
        if sizes is not None and isinstance(sizes, np.ndarray) and sizes.size:
            f = sympy.simplify(sympy.sympify(sizes.reshape(-1)[i]) / sympy.sympify(shape[a]))
        elif scales is not None and isinstance(scales, np.ndarray) and scales.size:
            f = sympy.nsimplify(float(scales.reshape(-1)[i]))
        else:
            return None
        if not (f.is_Integer and f >= 1):
            raise FrontendError(f"Resize of symbolic dim {a} ({shape[a]}) by {f}: only integer factors can be "
                                "resized on symbolic dims")
        factors[a] = int(f)
    return factors


@_conv("Resize")
def _resize_symbolic(n):
    x = n.x(0)
    shape, r = n.shape(x), n.rank(x)
    axes = [_axis(a, r) for a in n.attr("axes", range(r))]
    factors = _symbolic_resize_factors(n, shape, axes)
    if factors is None:
        return _static_resize(n)
    mode, ctm = n.attr("mode", "nearest"), n.attr("coordinate_transformation_mode", "half_pixel")
    if ctm not in _PERIODIC_CTM or n.attr("exclude_outside", 0) or mode not in ("nearest", "linear", "cubic") or \
            n.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise FrontendError(f"Resize on symbolic dims supports integer factors with {', '.join(_PERIODIC_CTM)}, "
                            f"stretch, no exclude_outside; got mode {mode}, {ctm}")
    if mode != "nearest" and not dtypes.is_float(n.dtype(x)):
        raise FrontendError(f"Resize mode '{mode}' needs a float input")
    inside = 4  # the table rows are taken at source position `inside` of a 2 * inside + 1 long axis
    for a in axes:
        s = factors[a]
        if s == 1:
            continue
        idx, coeffs, _ = _resize_taps(n, 2 * inside + 1, s * (2 * inside + 1), float(s), (0.0, 1.0))
        offsets, coeffs = idx[inside * s:(inside + 1) * s] - inside, coeffs[inside * s:(inside + 1) * s]
        if mode == "nearest":
            offsets = offsets[np.arange(s), np.argmax(coeffs, axis=1)][:, None]
        pad = int(np.abs(offsets).max())
        padded = x
        if pad:
            pads = [0] * (2 * r)
            pads[a] = pads[a + r] = pad
            padded = n.op("pad", x, pads=tuple(pads), mode="edge")
        out = normalize_dim(s * sympy.sympify(shape[a]))
        o = n.iota((out,), 0)
        phase = n.op("mod", o, np.int64(s))
        source = n.op("add", n.op("div", o, np.int64(s)), np.int64(pad))  # floor(o / s) on the padded axis
        taps = n.op("add", n.reshape(source, (out, 1)), n.op("gather", offsets.astype(np.int64), phase, axis=0))
        if mode == "nearest":
            x = n.op("gather", padded, n.reshape(taps, (out,)), axis=a)
            continue
        dt = dtypes.numpy_dtype(n.dtype(x))
        gathered = n.op("gather", padded, taps, axis=a)  # (..., out, taps, ...)
        w = n.op("gather", coeffs.astype(dt), phase, axis=0)
        w = n.reshape(w, (out, coeffs.shape[1]) + (1,) * (r - a - 1))
        x = n.reduce("sum", n.op("mul", gathered, w), [a + 1], False)
    return x


# --- integer (quantized) matmul and conv: exact int32 arithmetic, then requantization ---


def _centered(n, v, zp, channel_axis: int | None = None):
    """v - zero_point in int32; a 1-D zero point applies per channel_axis (rows, output channels)."""
    v = n.cast(v, "i32")
    if zp is None:
        return v
    zp = n.cast(zp, "i32")
    if channel_axis is not None and n.rank(zp) == 1 and numel(n.shape(zp)) > 1:
        zp = n.reshape(zp, [n.shape(zp)[0] if i == channel_axis else 1 for i in range(n.rank(v))])
    return n.op("sub", v, zp)


def _requantize(n, acc, multiplier, zp, like_dtype: str, round_first: bool):
    """round(acc * multiplier) + zero point, saturated to the output type (float64 as the reference)."""
    y = n.op("mul", n.cast(acc, "f64"), n.cast(multiplier, "f64"))
    to = n.dtype(zp) if zp is not None else like_dtype
    if to not in QUANT_RANGES:
        raise FrontendError(f"requantizing to {to} is not supported")
    lo, hi = QUANT_RANGES[to]
    if zp is not None:
        y = n.op("add", y, n.cast(zp, "f64"))
    if round_first:
        y = n.op("round", y)
    y = n.op("min", n.op("max", y, float(lo)), float(hi))
    return n.cast(y if round_first else n.op("round", y), to)


@_conv("MatMulInteger")
def _matmul_integer(n):
    a = _centered(n, n.x(0), n.opt(2), channel_axis=n.rank(n.x(0)) - 2)
    return n.op("matmul", a, _centered(n, n.x(1), n.opt(3)))


@_conv("QLinearMatMul")
def _qlinear_matmul(n):
    a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = (n.opt(i) for i in range(8))
    acc = n.op("matmul", _centered(n, a, a_zp, channel_axis=n.rank(a) - 2), _centered(n, b, b_zp))
    multiplier = n.op("div", n.op("mul", a_scale, b_scale), y_scale)
    return _requantize(n, acc, multiplier, y_zp, n.dtype(a), round_first=True)


def _conv_integer_acc(n, x, w, x_zp, w_zp, bias):
    kernel = n.attr("kernel_shape", list(n.shape(w)[2:]))
    return n.op("conv", _centered(n, x, x_zp), _centered(n, w, w_zp, channel_axis=0), bias,
                groups=n.attr("group", 1), **_window_attrs(n, x, kernel))


@_conv("ConvInteger")
def _conv_integer(n):
    return _conv_integer_acc(n, n.x(0), n.x(1), n.opt(2), n.opt(3), None)


@_conv("QLinearConv")
def _qlinear_conv(n):
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = (n.opt(i) for i in range(8))
    bias = n.opt(8)
    acc = _conv_integer_acc(n, x, w, x_zp, w_zp, None if bias is None else n.cast(bias, "i32"))
    if n.rank(w_scale) == 1 and numel(n.shape(w_scale)) > 1:  # per output channel
        w_scale = _channel(n, w_scale, n.rank(x))
    multiplier = n.op("div", n.op("mul", x_scale, w_scale), y_scale)
    return _requantize(n, acc, multiplier, y_zp, n.dtype(x), round_first=False)


@_conv("ReverseSequence")
def _reverse_sequence(n):
    x, lens = n.x(0), n.cast(n.x(1), "i64")
    shape = n.shape(x)
    b, t = (_axis(n.attr(k, d), len(shape)) for k, d in (("batch_axis", 1), ("time_axis", 0)))
    # index along time: lens[b] - 1 - i inside each sequence, i beyond its end
    steps = n.iota(shape, t)
    lens = n.reshape(lens, [shape[b] if i == b else 1 for i in range(len(shape))])
    idx = n.op("where", n.op("lt", steps, lens), n.op("sub", n.op("sub", lens, 1), steps), steps)
    return n.op("gather_elements", x, idx, axis=t)


# --- RNN, GRU, LSTM: unrolled over the (static) sequence length ---

# Activation names of the recurrent ops' `activations` attribute -> (f(n, x, alpha, beta), default alpha,
# default beta); the defaults are those of the ONNX operators of the same name, None where it takes none.
RNN_ACTIVATIONS = {
    "tanh": (lambda n, x, a, b: n.op("tanh", x), None, None),
    "sigmoid": (lambda n, x, a, b: n.op("sigmoid", x), None, None),
    "relu": (lambda n, x, a, b: n.op("relu", x), None, None),
    "softsign": (lambda n, x, a, b: n.op("div", x, n.op("add", n.op("abs", x), 1)), None, None),
    "affine": (lambda n, x, a, b: n.op("add", n.op("mul", x, a), b), 1.0, 0.0),
    "leakyrelu": (lambda n, x, a, b: n.op("where", n.op("lt", x, 0), n.op("mul", x, a), x), 0.01, None),
    "hardsigmoid": (lambda n, x, a, b: _hard_sigmoid_of(n, x, a, b), 0.2, 0.5),
    "scaledtanh": (lambda n, x, a, b: n.op("mul", n.op("tanh", n.op("mul", x, b)), a), 1.0, 1.0),
}
# The gates of each op (ONNX order within W, R, B) and its default activations per direction.
RNN_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
RNN_DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


def _rnn_activations(n, directions: int) -> list[list[Callable]]:
    """Per direction, the activation functions (f, g, h); alphas and betas are consumed in order."""
    names = n.attr("activations", RNN_DEFAULT_ACTIVATIONS[n.op_type] * directions)
    alphas, betas = list(n.attr("activation_alpha", [])), list(n.attr("activation_beta", []))
    acts = []
    for name in names:
        if name.lower() not in RNN_ACTIVATIONS:
            raise FrontendError(f"activation '{name}' is not supported (supported: {sorted(RNN_ACTIVATIONS)})")
        fn, a, b = RNN_ACTIVATIONS[name.lower()]
        a = alphas.pop(0) if a is not None and alphas else a
        b = betas.pop(0) if b is not None and betas else b
        acts.append(lambda x, fn=fn, a=a, b=b: fn(n, x, a, b))
    per = len(RNN_DEFAULT_ACTIVATIONS[n.op_type])
    if len(acts) != per * directions:
        raise FrontendError(f"{len(acts)} activations for {directions} direction(s) of {per}")
    return [acts[d * per:(d + 1) * per] for d in range(directions)]


def _rnn_step(n, kind, acts, xw, h, c, r, rb, p, clip):
    """One time step: x's gate inputs xw (B, G*H, input bias in), states h (and c) -> new h (and c)."""
    hidden = n.shape(h)[-1]

    def gate(v, g):
        return n.slice(v, n.rank(v) - 1, g * hidden, (g + 1) * hidden)

    def clipped(v):
        return v if clip is None else n.op("min", n.op("max", v, -clip), clip)

    if kind == "RNN":
        return acts[0](clipped(n.op("add", xw, n.op("add", n.op("matmul", h, r), rb)))), None
    if kind == "LSTM":
        gates = n.op("add", xw, n.op("add", n.op("matmul", h, r), rb))
        i, o, f, g = (gate(gates, k) for k in range(4))
        pi, po, pf = (None if p is None else n.slice(p, 0, k * hidden, (k + 1) * hidden) for k in range(3))
        i = acts[0](clipped(i if p is None else n.op("add", i, n.op("mul", pi, c))))
        f = acts[0](clipped(f if p is None else n.op("add", f, n.op("mul", pf, c))))
        c = n.op("add", n.op("mul", f, c), n.op("mul", i, acts[1](clipped(g))))
        o = acts[0](clipped(o if p is None else n.op("add", o, n.op("mul", po, c))))
        return n.op("mul", o, acts[2](c)), c
    # GRU: gates z, r, h; the hidden gate reads r * h (or r * (h R_h + Rb_h) with linear_before_reset)
    rz, rr, rh = (n.slice(r, 1, k * hidden, (k + 1) * hidden) for k in range(3))
    bz, br, bh = (gate(rb, k) for k in range(3))
    z = acts[0](clipped(n.op("add", gate(xw, 0), n.op("add", n.op("matmul", h, rz), bz))))
    rt = acts[0](clipped(n.op("add", gate(xw, 1), n.op("add", n.op("matmul", h, rr), br))))
    if n.attr("linear_before_reset", 0):
        inner = n.op("mul", rt, n.op("add", n.op("matmul", h, rh), bh))
    else:
        inner = n.op("add", n.op("matmul", n.op("mul", rt, h), rh), bh)
    ht = acts[1](clipped(n.op("add", gate(xw, 2), inner)))
    return n.op("add", n.op("mul", n.op("sub", 1, z), ht), n.op("mul", z, h)), None


@_conv("RNN", "GRU", "LSTM")
def _recurrent(n):
    kind = n.op_type
    x, w, r = n.x(0), n.x(1), n.x(2)
    b, lens, h0 = n.opt(3), n.opt(4), n.opt(5)
    c0, p = (n.opt(6), n.opt(7)) if kind == "LSTM" else (None, None)
    layout = n.attr("layout", 0)
    if layout:
        x = n.transpose(x, (1, 0, 2))
        h0 = None if h0 is None else n.transpose(h0, (1, 0, 2))
        c0 = None if c0 is None else n.transpose(c0, (1, 0, 2))
    steps, batch, _ = n.shape(x)
    if not isinstance(steps, int):
        raise FrontendError(f"{kind} is unrolled over the sequence: its length must be static, got {steps}")
    if lens is not None and set(n.static(4).reshape(-1).tolist()) - {steps}:
        raise FrontendError("sequence_lens shorter than the sequence are not supported")
    if n.attr("input_forget", 0):
        raise FrontendError("input_forget=1 is not supported")
    directions, gh = n.shape(w)[0], n.shape(w)[1]
    hidden = gh // RNN_GATES[kind]
    direction = n.attr("direction", "forward")
    if (direction == "bidirectional") != (directions == 2):
        raise FrontendError(f"direction '{direction}' does not fit W {n.info(w)}")
    clip = n.attrs.get("clip")
    zeros = n.broadcast(n.const(0, n.dtype(x)).reshape(1, 1), (batch, hidden))
    ys, hs, cs = [], [], []
    for d, acts in enumerate(_rnn_activations(n, directions)):
        wd, rd = (n.reshape(n.slice(v, 0, d, d + 1), n.shape(v)[1:]) for v in (w, r))
        xw = n.op("matmul", x, n.transpose(wd, (1, 0)))  # (T, B, G*H), all steps at once
        rb = n.const(np.zeros(gh), n.dtype(x))  # the recurrence's bias; the input's joins xw
        if b is not None:
            bd = n.reshape(n.slice(b, 0, d, d + 1), (2 * gh,))
            xw = n.op("add", xw, n.slice(bd, 0, 0, gh))
            rb = n.slice(bd, 0, gh, 2 * gh)
        h = zeros if h0 is None else n.reshape(n.slice(h0, 0, d, d + 1), (batch, hidden))
        c = zeros if c0 is None else n.reshape(n.slice(c0, 0, d, d + 1), (batch, hidden))
        pd = None if p is None else n.reshape(n.slice(p, 0, d, d + 1), (3 * hidden,))
        order = range(steps - 1, -1, -1) if direction == "reverse" or d == 1 else range(steps)
        outs = {}
        rt = n.transpose(rd, (1, 0))
        for t in order:
            xt = n.reshape(n.slice(xw, 0, t, t + 1), (batch, gh))
            h, c = _rnn_step(n, kind, acts, xt, h, c if kind == "LSTM" else None, rt, rb, pd, clip)
            outs[t] = n.reshape(h, (1, 1, batch, hidden))
        ys.append(n.op("concat", *[outs[t] for t in range(steps)], axis=0) if steps > 1 else outs[0])
        hs.append(n.reshape(h, (1, batch, hidden)))
        cs.append(None if c is None else n.reshape(c, (1, batch, hidden)))
    y = ys[0] if directions == 1 else n.op("concat", *ys, axis=1)
    yh = hs[0] if directions == 1 else n.op("concat", *hs, axis=0)
    yc = None if kind != "LSTM" else (cs[0] if directions == 1 else n.op("concat", *cs, axis=0))
    if layout:
        y = n.transpose(y, (2, 0, 1, 3))
        yh = n.transpose(yh, (1, 0, 2))
        yc = None if yc is None else n.transpose(yc, (1, 0, 2))
    return (y, yh, yc) if kind == "LSTM" else (y, yh)


# --- Split of a run-time size into static parts (issue 18) ---
# torch's TorchScript exporter unrolls a Python loop over a nonzero's rows at the count it saw,
# splitting a (u0, ...) value into that many static parts: the count is checked when the model
# runs (tg.assert_size), as onnxruntime fails a Split whose parts do not add up.
_static_split = CONVERTERS["Split"]


@_conv("Split")
def _split_run_time_size(n):
    x = n.x(0)
    axis = _axis(n.attr("axis", 0), n.rank(x))
    dim = n.shape(x)[axis]
    sizes = n.ints_attr_or_input("split", 1) if isinstance(dim, sympy.Symbol) else None
    if sizes is not None and all(isinstance(s, int) for s in sizes) and not isinstance(x, np.ndarray) \
            and _defined_at_run_time(n, dim):
        n.inputs[0] = n.op("assert_size", x, axis=axis, size=sum(sizes))
    return _static_split(n)


def _defined_at_run_time(n, dim) -> bool:
    """Whether symbol `dim` is a size some tg op of the graph so far defines (not a graph input's)."""
    from tilegraph.ir.ops import size_definitions

    return any(name == dim.name for op in n.imp.g.block.ops for _, _, name in size_definitions(op))


# --- SAME padding with stride > 1 on symbolic spatial dims (issue 18) ---
# The padding then depends on the size modulo the stride. The window positions are the same as
# over the input's rows lo - P .. lo - P + L - 1 of a generously padded copy (P rows each side),
# with L = (ceil(H / s) - 1) * s + k_eff the padded length and lo the run-time begin padding: a
# gather of those rows (lo computed at run time from H), then the op without padding on that axis.
# Conv pads with zeros and MaxPool with the lowest value; an AveragePool's count of padding is
# not a gathered row, so it stays refused.
_static_window_ops = {name: CONVERTERS[name] for name in ("Conv", "MaxPool")}


@_conv("Conv", "MaxPool")
def _same_padding_on_symbolic_dims(n):
    convert = _static_window_ops[n.op_type]
    auto = n.attr("auto_pad", "NOTSET")
    x = n.x(0)
    spatial = n.shape(x)[2:]
    nd = len(spatial)
    strides = list(n.attr("strides", [1] * nd))
    if auto not in ("SAME_UPPER", "SAME_LOWER") or all(isinstance(d, int) or st == 1
                                                        for d, st in zip(spatial, strides)):
        return convert(n)
    kernel = list(n.attr("kernel_shape", list(n.shape(n.x(1))[2:]) if n.op_type == "Conv" else None))
    dilations = list(n.attr("dilations", [1] * nd))
    if n.op_type == "MaxPool" and (n.attr("ceil_mode", 0) or n.wants_output(1)):
        return convert(n)  # (its own error)
    dt = n.dtype(x)
    low = float(np.finfo(dtypes.numpy_dtype(dt)).min) if dtypes.is_float(dt) else \
        float(np.iinfo(dtypes.numpy_dtype(dt)).min)
    fill = 0.0 if n.op_type == "Conv" else low
    pads = [0] * (2 * nd)
    for i, (h, st, k, dil) in enumerate(zip(spatial, strides, kernel, dilations)):
        span = dil * (k - 1) + 1
        if isinstance(h, int) or st == 1:  # as the static converter pads it
            total = span - 1 if st == 1 else max(0, (-(-h // st) - 1) * st + span - h)
            pads[i] = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads[i + nd] = total - pads[i]
            continue
        if span < st:
            raise FrontendError(f"auto_pad {auto} with a window of {span} under stride {st} on symbolic dim {h}")
        length = normalize_dim((sympy.floor((h + st - 1) / st) - 1) * st + span)
        # at run time, from h: total = (ceil(h / s) - 1) * s + span - h, lo its SAME share
        size = n.imp.symbolic_tensor(np.array(h, dtype=object), "a SAME padding")
        steps = n.op("div", n.op("add", size, np.int64(st - 1)), np.int64(st))
        total = n.op("sub", n.op("add", n.op("mul", n.op("sub", steps, np.int64(1)), np.int64(st)), np.int64(span)), size)
        half = n.op("div", total, np.int64(2))
        lo = half if auto == "SAME_UPPER" else n.op("sub", total, half)
        edge = [0] * (2 * (nd + 2))
        edge[2 + i] = edge[2 + i + nd + 2] = span
        padded = n.op("pad", x, pads=tuple(edge), value=fill)
        rows = n.op("add", n.iota((length,), 0), n.op("sub", np.int64(span), lo))
        x = n.op("gather", padded, rows, axis=2 + i)
    n.inputs[0] = x
    n.attrs["auto_pad"] = "NOTSET"
    n.attrs["pads"] = pads
    return convert(n)


# --- RNN, GRU, LSTM over a symbolic number of steps (issue 18): tg.rnn, a loop inside one op ---
_unrolled_recurrent = CONVERTERS["LSTM"]


@_conv("RNN", "GRU", "LSTM")
def _recurrent_loop(n):
    """A static sequence is unrolled (_recurrent); a symbolic one becomes one tg.rnn per direction."""
    kind = n.op_type
    x = n.x(0)
    layout = n.attr("layout", 0)
    if isinstance(n.shape(x)[1 if layout else 0], int):
        return _unrolled_recurrent(n)
    w, r, b, lens, h0 = n.x(1), n.x(2), n.opt(3), n.opt(4), n.opt(5)
    c0, p = (n.opt(6), n.opt(7)) if kind == "LSTM" else (None, None)
    if lens is not None or n.attr("input_forget", 0) or \
            [a.lower() for a in n.attr("activations", [])] not in ([], [a.lower() for a in RNN_DEFAULT_ACTIVATIONS[kind]]
                                                                    * n.shape(w)[0]):
        raise FrontendError(f"{kind} over a symbolic sequence supports the default activations, no "
                            "sequence_lens, no input_forget")
    if layout:
        x = n.transpose(x, (1, 0, 2))
        h0 = None if h0 is None else n.transpose(h0, (1, 0, 2))
        c0 = None if c0 is None else n.transpose(c0, (1, 0, 2))
    _, batch, _ = n.shape(x)
    directions, gh = n.shape(w)[0], n.shape(w)[1]
    hidden = gh // RNN_GATES[kind]
    direction = n.attr("direction", "forward")
    if (direction == "bidirectional") != (directions == 2):
        raise FrontendError(f"direction '{direction}' does not fit W {n.info(w)}")
    zeros = n.broadcast(n.const(0, n.dtype(x)).reshape(1, 1), (batch, hidden))
    ys, hs, cs = [], [], []
    for d in range(directions):
        def pick(v, shape):
            return n.reshape(n.slice(v, 0, d, d + 1), shape)

        operands = [x, pick(w, (gh, n.shape(w)[2])), pick(r, (gh, hidden)),
                    pick(b, (2 * gh,)) if b is not None else n.const(np.zeros(2 * gh), n.dtype(x)),
                    pick(h0, (batch, hidden)) if h0 is not None else zeros]
        if kind == "LSTM":
            operands.append(pick(c0, (batch, hidden)) if c0 is not None else zeros)
            if p is not None:
                operands.append(pick(p, (3 * hidden,)))
        outs = n.op("rnn", *operands, cell=kind.lower(), reverse=direction == "reverse" or d == 1,
                    clip=float(n.attrs.get("clip", 0.0)), linear_before_reset=bool(n.attr("linear_before_reset", 0)))
        ys.append(n.unsqueeze(outs[0], [1]))
        hs.append(n.unsqueeze(outs[1], [0]))
        cs.append(n.unsqueeze(outs[2], [0]) if kind == "LSTM" else None)
    y = ys[0] if directions == 1 else n.op("concat", *ys, axis=1)
    yh = hs[0] if directions == 1 else n.op("concat", *hs, axis=0)
    yc = None if kind != "LSTM" else (cs[0] if directions == 1 else n.op("concat", *cs, axis=0))
    if layout:
        y = n.transpose(y, (2, 0, 1, 3))
        yh = n.transpose(yh, (1, 0, 2))
        yc = None if yc is None else n.transpose(yc, (1, 0, 2))
    return (y, yh, yc) if kind == "LSTM" else (y, yh)


# --- control flow, unrolled ---

# Iterations a Loop or Scan is unrolled to at most: past it the graph would be mostly copies
# of one body, better served by a run-time loop tg does not have yet.
MAX_UNROLL = 1024


def _stack(n, values: list, axis: int = 0) -> Value:
    """values (same shape) stacked along a new `axis`."""
    parts = [n.unsqueeze(v, [axis]) for v in values]
    return parts[0] if len(parts) == 1 else n.op("concat", *parts, axis=axis)


@_conv("If")
def _if(n):
    """A condition known at import picks its branch; a run-time one runs both branches and
    selects with where, when they give values of one type (their ops have no side effects)."""
    cond = n.x(0)
    then, other = n.attr("then_branch").g, n.attr("else_branch").g
    if isinstance(cond, np.ndarray):
        return n.imp.run_subgraph(then if bool(cond.reshape(-1)[0]) else other, [], n.where())
    a, b = n.imp.run_subgraph(then, [], n.where()), n.imp.run_subgraph(other, [], n.where())
    if [info(v) for v in a] != [info(v) for v in b]:
        raise FrontendError(f"its condition is computed at run time and its branches give different types "
                            f"({[str(info(v)) for v in a]} and {[str(info(v)) for v in b]})")
    c = n.reshape(cond, ())
    return [n.op("where", c, x, y) for x, y in zip(a, b)]


@_conv("Loop")
def _loop(n):
    """Unrolled: the trip count and the condition must be known at import at every iteration."""
    body = n.attr("body").g
    trips = n.static(0)
    trips = None if trips is None else int(trips.reshape(-1)[0])
    cond = n.static(1)
    cond = True if cond is None else bool(cond.reshape(-1)[0])
    carried = list(n.inputs[2:])
    scans: list[list] = []
    i = 0
    while cond and (trips is None or i < trips):
        if i >= MAX_UNROLL:
            raise FrontendError(f"it runs more than {MAX_UNROLL} iterations; it is unrolled at import")
        outs = n.imp.run_subgraph(body, [np.array(i, np.int64), np.array(cond), *carried], n.where())
        c = outs[0]
        if not isinstance(c, np.ndarray):
            raise FrontendError("its condition is computed at run time; it is unrolled at import")
        cond = bool(c.reshape(-1)[0])
        carried = outs[1:1 + len(carried)]
        for k, v in enumerate(outs[1 + len(carried):]):
            if k >= len(scans):
                scans.append([])
            scans[k].append(v)
        i += 1
    n_scans = len(body.output) - 1 - len(carried)
    if n_scans and not scans:
        raise FrontendError("it runs no iteration, so its scan outputs have no known shape")
    return [*carried, *(_stack(n, vs) for vs in scans)]


@_conv("Scan")
def _scan(n):
    """Unrolled over the static length of its scan inputs (opset 9+ form)."""
    body = n.attr("body").g
    m = n.attr("num_scan_inputs")
    states, xs = list(n.inputs[:len(n.inputs) - m]), n.inputs[len(n.inputs) - m:]
    in_axes = [_axis(a, n.rank(x)) for a, x in zip(n.attr("scan_input_axes", [0] * m), xs)]
    in_dirs = n.attr("scan_input_directions", [0] * m)
    lengths = {n.shape(x)[a] for x, a in zip(xs, in_axes)}
    if len(lengths) != 1 or not isinstance(next(iter(lengths)), int):
        raise FrontendError(f"its scan inputs must have one static length, got {sorted(map(str, lengths))}")
    steps = lengths.pop()
    if steps > MAX_UNROLL:
        raise FrontendError(f"it runs {steps} iterations, more than {MAX_UNROLL}; it is unrolled at import")
    k = len(body.output) - len(states)
    out_axes = n.attr("scan_output_axes", [0] * k)
    out_dirs = n.attr("scan_output_directions", [0] * k)
    scans: list[list] = [[] for _ in range(k)]
    for t in range(steps):
        slices = []
        for x, a, d in zip(xs, in_axes, in_dirs):
            j = steps - 1 - t if d else t
            slices.append(n.reshape(n.slice(x, a, j, j + 1), [s for i, s in enumerate(n.shape(x)) if i != a]))
        outs = n.imp.run_subgraph(body, [*states, *slices], n.where())
        states = outs[:len(states)]
        for j, v in enumerate(outs[len(states):]):
            scans[j].append(v)
    if k and not steps:
        raise FrontendError("it runs no iteration, so its scan outputs have no known shape")
    stacked = []
    for vs, a, d in zip(scans, out_axes, out_dirs):
        vs = vs[::-1] if d else vs
        stacked.append(_stack(n, vs, _axis(a, n.rank(vs[0]) + 1)))
    return [*states, *stacked]


# --- GridSample, as gathers of taps ---

# Keys' cubic convolution parameter ONNX and torch use for bicubic sampling.
CUBIC_ALPHA = -0.75


def _cubic_weights(n, t):
    """Keys' weights of the taps at -1, 0, 1, 2 for fractional offset t (t in [0, 1))."""
    a = CUBIC_ALPHA

    def near(x):  # |x| <= 1
        return n.op("add", n.op("mul", n.op("mul", n.op("sub", n.op("mul", x, a + 2), a + 3), x), x), 1)

    def far(x):  # 1 < |x| < 2
        inner = n.op("add", n.op("mul", n.op("sub", n.op("mul", x, a), 5 * a), x), 8 * a)
        return n.op("sub", n.op("mul", inner, x), 4 * a)

    one_minus = n.op("sub", 1, t)
    return [far(n.op("add", t, 1)), near(t), near(one_minus), far(n.op("add", one_minus, 1))]


def _reflect(n, x, lo: float, hi: float):
    """Reflect x into [lo, hi] by its borders, as many times as it takes (ONNX's _gs_reflect)."""
    span = hi - lo
    below = n.op("lt", x, lo)
    dx = n.op("where", below, n.op("sub", lo, x), n.op("sub", x, hi))
    k = n.op("floor", n.op("div", dx, span))
    r = n.op("sub", dx, n.op("mul", k, span))
    even = n.op("eq", n.op("mod", k, 2.0), 0.0)
    from_lo, from_hi = n.op("add", r, lo), n.op("sub", hi, r)
    reflected = n.op("where", below, n.op("where", even, from_lo, from_hi), n.op("where", even, from_hi, from_lo))
    return n.op("where", n.op("or", below, n.op("gt", x, hi)), reflected, x)


@_conv("GridSample")
def _grid_sample(n):
    """Each output point is a weighted sum of taps of X: 1 (nearest), 2 (linear) or 4 (cubic) per
    spatial dim, their indices and weights computed from the grid at run time and the taps read
    with gather_elements over X's flattened spatial dims."""
    x, grid = n.x(0), n.x(1)
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(n.attr("mode", "linear"), n.attr("mode", "linear"))
    padding = n.attr("padding_mode", "zeros")
    corners = bool(n.attr("align_corners", 0))
    if mode not in ("nearest", "linear", "cubic") or padding not in ("zeros", "border", "reflection"):
        raise FrontendError(f"mode '{mode}' with padding_mode '{padding}' is not supported")
    batch, channels, *dims = n.shape(x)
    out = n.shape(grid)[1:-1]
    r = len(dims)
    if not all(isinstance(d, int) for d in dims) or n.shape(grid)[-1] != r:
        raise FrontendError(f"X's spatial dims {dims} must be static and match the grid's last dim")
    dt = n.dtype(x)
    g = n.cast(grid, dt)
    taps = []  # per spatial dim: [(index (N, *out) i64, weight or None)]
    for d, size in enumerate(dims):
        c = n.reshape(n.slice(g, len(out) + 1, r - 1 - d, r - d), (batch, *out))  # the grid lists x (width) first
        pos = (n.op("mul", n.op("add", c, 1), (size - 1) / 2) if corners else
               n.op("div", n.op("sub", n.op("mul", n.op("add", c, 1), float(size)), 1), 2))
        lo, hi = (0.0, size - 1.0) if corners else (-0.5, size - 0.5)
        if mode == "nearest":
            pos = n.op("round", pos)
        if padding == "border":
            outside = n.op("or", n.op("lt", pos, lo), n.op("gt", pos, hi))
            pos = n.op("where", outside, n.op("min", n.op("max", pos, 0.0), size - 1.0), pos)
        elif padding == "reflection":
            pos = _reflect(n, pos, lo, hi)
        if mode == "nearest":
            first, weights = pos, [None]  # truncated toward zero, as the reference's astype(int32)
        else:
            first = n.op("floor", pos)
            t = n.op("sub", pos, first)
            weights = [n.op("sub", 1, t), t] if mode == "linear" else _cubic_weights(n, t)
            first = n.op("sub", first, 1.0) if mode == "cubic" else first
        dim_taps = []
        for k, w in enumerate(weights):
            i = n.op("add", first, float(k))
            if padding == "zeros":
                valid = n.cast(n.op("and", n.op("ge", i, 0.0), n.op("le", i, size - 1.0)), dt)
                w = valid if w is None else n.op("mul", w, valid)
            elif padding == "reflection":
                i = _reflect(n, i, lo, hi)
            i = n.op("min", n.op("max", n.cast(i, "i64"), 0), size - 1)
            dim_taps.append((i, w))
        taps.append(dim_taps)
    points = numel(out)
    flat = n.reshape(x, (batch, channels, numel(dims)))
    total = None
    strides = [math.prod(dims[d + 1:]) for d in range(r)]
    for combo in itertools.product(*taps):
        index, weight = None, None
        for (i, w), stride in zip(combo, strides):
            part = n.op("mul", i, stride)
            index = part if index is None else n.op("add", index, part)
            if w is not None:
                weight = w if weight is None else n.op("mul", weight, w)
        index = n.broadcast(n.reshape(index, (batch, 1, points)), (batch, channels, points))
        v = n.op("gather_elements", flat, index, axis=2)
        if weight is not None:
            v = n.op("mul", v, n.reshape(weight, (batch, 1, points)))
        total = v if total is None else n.op("add", total, v)
    return n.reshape(total, (batch, channels, *out))


# --- DFT and STFT, as matmuls ---


def _dft_matrix(length_in: int, complex_in: bool, length: int, inverse: bool, onesided: bool) -> np.ndarray:
    """The real matrix of ONNX's DFT along one axis: (length_in * c_in, K * c_out), where a row
    is an input (real[, imag]) pair and a column an output one. The transform is linear, so it is
    np.fft itself applied to the basis vectors (padding or truncating to `length` as ONNX does)."""
    c_in = 2 if complex_in else 1
    basis = np.eye(length_in * c_in).reshape(-1, length_in, c_in)
    z = basis[..., 0] + 1j * basis[..., 1] if complex_in else basis[..., 0]
    if inverse and onesided:
        out = np.fft.irfft(z, n=length, axis=1)[..., None]
    else:
        f = np.fft.ifft(z, n=length, axis=1) if inverse else np.fft.fft(z, n=length, axis=1)
        if onesided:
            f = f[:, :length // 2 + 1]
        out = np.stack([f.real, f.imag], axis=-1)
    return out.reshape(length_in * c_in, -1)


def _along_last_two(n, x, axis: int, matrix: np.ndarray, c_out: int):
    """Apply `matrix` to the (axis, last) dims of x, the result keeping x's dim order."""
    r = n.rank(x)
    perm = [d for d in range(r - 1) if d != axis] + [axis, r - 1]
    moved = n.transpose(x, perm)
    lead = n.shape(moved)[:-2]
    flat = n.reshape(moved, (*lead, matrix.shape[0]))
    y = n.op("matmul", flat, n.const(matrix, n.dtype(x)))
    y = n.reshape(y, (*lead, matrix.shape[1] // c_out, c_out))
    return n.transpose(y, [perm.index(d) for d in range(r)])


@_conv("DFT")
def _dft(n):
    x = n.x(0)
    r = n.rank(x)
    if n.opset >= 20:
        axis = n.static_ints(2)[0] if n.opt(2) is not None else -2
    else:
        axis = n.attr("axis", 1)
    axis = _axis(int(axis), r)
    if axis == r - 1:
        raise FrontendError("the DFT axis cannot be the last (real, imaginary) dim")
    inverse, onesided = bool(n.attr("inverse", 0)), bool(n.attr("onesided", 0))
    size, c_in = n.shape(x)[axis], n.shape(x)[-1]
    if not isinstance(size, int) or c_in not in (1, 2):
        raise FrontendError(f"the signal length must be static and the last dim 1 or 2, got {n.info(x)}")
    length = n.static_ints(1)[0] if n.opt(1) is not None else (2 * (size - 1) if inverse and onesided else size)
    matrix = _dft_matrix(size, c_in == 2, int(length), inverse, onesided)
    return _along_last_two(n, x, axis, matrix, 1 if inverse and onesided else 2)


@_conv("STFT")
def _stft(n):
    """Frames gathered by a constant index, weighted by the window, then one DFT matmul."""
    x, window = n.x(0), n.opt(2)
    step = int(n.static_ints(1)[0])
    batch, size, c_in = n.shape(x)
    if n.opt(3) is not None:
        frame = int(n.static_ints(3)[0])
    elif window is not None:
        frame = n.shape(window)[0]
    else:
        frame = size
    if not all(isinstance(d, int) for d in (size, frame)) or step <= 0 or not 0 < frame <= size:
        raise FrontendError(f"frame_step {step} and frame length {frame} must be static and fit {n.info(x)}")
    frames = 1 + (size - frame) // step
    index = np.arange(frames)[:, None] * step + np.arange(frame)[None, :]
    framed = n.op("gather", x, n.const(index, "i64"), axis=1)  # (batch, frames, frame, c_in)
    if window is not None:
        framed = n.op("mul", framed, n.reshape(n.cast(window, n.dtype(x)), (1, 1, frame, 1)))
    matrix = _dft_matrix(frame, c_in == 2, frame, False, bool(n.attr("onesided", 1)))
    return _along_last_two(n, framed, 2, matrix, 2)


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


# --- the training optimizers (ai.onnx.preview.training), one update step ---

TRAINING = "ai.onnx.preview.training."


def _optimizer_groups(n, per: int) -> list[list]:
    """The (X, G, state...) tensors of each optimized tensor: inputs after R and T, grouped by kind."""
    rest = n.inputs[2:]
    k = len(rest) // per
    if k * per != len(rest) or not k:
        raise FrontendError(f"expects R, T and {per} tensors per optimized tensor, got {len(n.inputs)} inputs")
    return [[rest[j * k + i] for j in range(per)] for i in range(k)]


def _regularized(n, x, g):
    return n.op("add", n.op("mul", x, float(n.attr("norm_coefficient", 0.0))), g)


@_conv(TRAINING + "Adagrad")
def _adagrad(n):
    r, t = n.x(0), n.cast(n.x(1), n.dtype(n.x(0)))
    rate = n.op("div", r, n.op("add", n.op("mul", t, float(n.attr("decay_factor", 0.0))), 1.0))
    xs, hs = [], []
    for x, g, h in _optimizer_groups(n, 3):
        gr = _regularized(n, x, g)
        h_new = n.op("add", h, n.op("mul", gr, gr))
        step = n.op("div", n.op("mul", n.cast(rate, n.dtype(x)), gr),
                    n.op("add", n.op("sqrt", h_new), float(n.attr("epsilon", 0.0))))
        xs.append(n.op("sub", x, step))
        hs.append(h_new)
    return xs + hs


@_conv(TRAINING + "Adam")
def _adam(n):
    dt = n.dtype(n.x(0))
    r, t = n.x(0), n.cast(n.x(1), dt)
    alpha, beta = float(n.attr("alpha", 0.9)), float(n.attr("beta", 0.999))
    # r * sqrt(1 - beta^t) / (1 - alpha^t) once steps were taken (t > 0), else r
    power = lambda base: n.op("pow", n.const(base, dt), t)  # noqa: E731
    corrected = n.op("div", n.op("mul", r, n.op("sqrt", n.op("sub", 1.0, power(beta)))), n.op("sub", 1.0, power(alpha)))
    rate = n.op("where", n.op("gt", t, 0.0), corrected, r)
    xs, vs, hs = [], [], []
    for x, g, v, h in _optimizer_groups(n, 4):
        gr = _regularized(n, x, g)
        v_new = n.op("add", n.op("mul", v, alpha), n.op("mul", gr, 1 - alpha))
        h_new = n.op("add", n.op("mul", h, beta), n.op("mul", n.op("mul", gr, gr), 1 - beta))
        denom = n.op("add", n.op("sqrt", h_new), float(n.attr("epsilon", 0.0)))
        x_new = n.op("sub", x, n.op("mul", n.cast(rate, n.dtype(x)), n.op("div", v_new, denom)))
        xs.append(n.op("mul", x_new, 1.0 - float(n.attr("norm_coefficient_post", 0.0))))
        vs.append(v_new)
        hs.append(h_new)
    return xs + vs + hs


@_conv(TRAINING + "Momentum")
def _momentum(n):
    dt = n.dtype(n.x(0))
    r, t = n.x(0), n.cast(n.x(1), dt)
    alpha, beta = float(n.attr("alpha")), float(n.attr("beta"))
    nesterov = n.attr("mode") == "nesterov"
    scale = n.op("where", n.op("gt", t, 0.0), n.const(beta, dt), n.const(1.0, dt))  # beta once steps were taken
    xs, vs = [], []
    for x, g, v in _optimizer_groups(n, 3):
        gr = _regularized(n, x, g)
        v_new = n.op("add", n.op("mul", v, alpha), n.op("mul", n.cast(scale, n.dtype(x)), gr))
        direction = n.op("add", gr, n.op("mul", v_new, alpha)) if nesterov else v_new
        xs.append(n.op("sub", x, n.op("mul", n.cast(r, n.dtype(x)), direction)))
        vs.append(v_new)
    return xs + vs


@_conv("BitCast")
def _bitcast(n):
    x = n.x(0)
    to = onnx_dtype(n.attr("to"), "attribute 'to'")
    return n.op("bitcast", x, to=to, source=n.dtype(x))
