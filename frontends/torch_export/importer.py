"""The torch.export importer: entry points, the first pass over the graph, and the node-by-node conversion."""


from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import sympy
import torch

from tilegraph.frontends import FrontendError
from tilegraph.ir import decompositions as D, dtypes
from tilegraph.ir.builder import Graph, Tensor
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model
from tilegraph.ir.escape import identifier
from tilegraph.ir.shapes import Dim, dims_equal, normalize_dim, shape_str, symbol_named
from tilegraph.frontends.torch_export.registry import CONVERTERS, RUN_TIME_SCALARS

aten = torch.ops.aten



# Slice ends that mean "to the end" (torch writes sys.maxsize; tg writes 2**63-1).
TO_END = (1 << 63) - 1
BIG = 1 << 62

# torch names its dtypes as NumPy and ml_dtypes do (float32, bfloat16, float8_e4m3fn,
# bool, uint16...), so the map follows from ir.dtypes' one table.
_TORCH_DTYPES = {getattr(torch, dtypes.numpy_dtype(n).name): n for n in dtypes.DTYPES
                 if hasattr(torch, dtypes.numpy_dtype(n).name)}
_TG_TO_TORCH = {v: k for k, v in _TORCH_DTYPES.items()}

# CompositeImplicit ATen ops kept whole when the program must be decomposed: tg has
# each as one op or a short composition, and keeping them keeps the IR one-to-one
# with the model (and `decompose` free to lower them later where fusion wants).
KEEP_WHOLE = [
    "linear.default", "matmul.default", "layer_norm.default", "group_norm.default", "rms_norm.default",
    "softmax.int", "log_softmax.int", "scaled_dot_product_attention.default",
    "conv1d.default", "conv2d.default", "conv3d.default", "conv1d.padding", "conv2d.padding", "conv3d.padding",
    "max_pool1d.default", "max_pool2d.default", "max_pool3d.default", "adaptive_avg_pool1d.default",
    "adaptive_avg_pool2d.default", "silu.default", "hardswish.default", "hardsigmoid.default", "mish.default",
    "gelu.default", "elu.default", "leaky_relu.default", "softplus.default", "hardtanh.default",
    "logsumexp.default", "flatten.using_ints", "unflatten.int", "pad.default", "batch_norm.default",
    "dropout.default", "var.correction", "std.correction", "linalg_vector_norm.default",
    *[f"{kind}{n}d.{o}" for kind in ("upsample_nearest", "_upsample_nearest_exact") for n in (1, 2, 3)
      for o in ("default", "vec")],
    *[f"{kind}.{o}" for kind in ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d")
      for o in ("default", "vec")],
]

# Nodes that check or constrain and produce nothing the model computes.
SKIP = {
    "aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten._assert_async.msg",
    "aten.sym_constrain_range_for_size.default", "aten.sym_constrain_range.default",
    "aten._assert_async.default",
}

# Names a symbolic dim cannot take: the generated code evaluates shapes with the
# symbols as Python variables next to these.


# --- public entry points -------------------------------------------------------


def from_torch(module: torch.nn.Module, example_inputs: tuple, dynamic_shapes=None, dropout: bool = False) -> Model:
    """Export `module` (in eval mode) with torch.export and convert the program. dropout=True (a
    training step's export): its nn.Dropout modules in training mode stay so, each becoming a
    tg.dropout seeded by the weight `dropout.seed`."""
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    # tilegraph compiles inference: export what eval() computes (no dropout, BN with
    # running stats), then give the module back in the mode it came in.
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    if dropout:
        for m, training in modes:
            if training and isinstance(m, torch.nn.Dropout):
                m.train()
    try:
        ep = torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes)
    except Exception as e:  # torch's own message says what in the module it could not trace
        raise FrontendError(f"torch.export.export failed for {type(module).__name__}: {_first_lines(e)}") from e
    finally:
        for m, training in modes:
            m.training = training
    return from_exported_program(ep, dropout=dropout)


def load_pt2(path: str | Path, *, trust_pickle: bool = False) -> Model:
    """Convert a program saved with `torch.export.save`.

    torch.export.load runs code a file carries in several ways (frontends/pt2_archive.py
    lists them); torch reads only an archive rebuilt from the members of its plain layout,
    each checked. `trust_pickle=True` hands torch the file itself, as torch.export.load
    would: for a file you made, whose tensors torch pickled (subclasses, opaque objects)."""
    from tilegraph.frontends.pt2_archive import checked_archive

    source = str(path) if trust_pickle else checked_archive(path)
    try:
        ep = torch.export.load(source)
    except Exception as e:
        raise FrontendError(f"cannot load the exported program {path}: {_first_lines(e)}") from e
    return from_exported_program(ep)


def from_exported_program(ep: torch.export.ExportedProgram, dropout: bool = False) -> Model:
    """Convert an ExportedProgram to a tg Model (decomposing first only if it must). A dropout in
    training mode is an error naming it, unless `dropout` (a training step's export, from_torch's)."""
    problems = _unsupported(ep)
    decomposed = bool(problems) or _has_mutation(ep)
    if decomposed:
        try:
            ep = ep.run_decompositions(decomposition_table())
        except Exception as e:
            raise FrontendError(f"torch's run_decompositions failed: {_first_lines(e)}") from e
        problems = _unsupported(ep)
    if problems:
        total = sum(len(nodes) for nodes in problems.values())
        lines = [f"cannot import the exported program: {total} node(s) use {len(problems)} unsupported op(s)"
                 + (" (after decomposing to core ATen)" if decomposed else "")]
        for key, nodes in sorted(problems.items()):
            lines.append(f"  {key}  x{len(nodes)}  (first at node '{nodes[0]}')")
        raise FrontendError("\n".join(lines))
    return _Importer(ep, dropout).run()


def decomposition_table() -> dict:
    """torch.export's default (core ATen) table minus the ops tg keeps whole."""
    table = torch.export.default_decompositions()
    for name in KEEP_WHOLE:
        packet, overload = name.rsplit(".", 1)
        op = getattr(getattr(aten, packet), overload)
        if op in table:
            del table[op]
    return table


# --- the first pass -------------------------------------------------------------


def _key(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.add.Tensor"
    return getattr(target, "__name__", str(target))


def _is_sym_scalar(val: Any) -> bool:
    return isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def _unsupported(ep) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for node in ep.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        key = _key(node.target) if node.op == "call_function" else f"{node.op} {node.target}"
        if node.op == "call_function" and (key in SKIP or key in CONVERTERS or key == "getitem"
                                           or key in RUN_TIME_SCALARS or _is_sym_scalar(node.meta.get("val"))):
            continue
        found.setdefault(key, []).append(node.name)
    return found


def _has_mutation(ep) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in ep.graph.nodes if n.op == "call_function")


def _cache_buffers(ep) -> set[str]:
    """The buffers whose only update is a cache write: cache.index_copy(2, positions, x) or
    cache[:, :, positions] = x on a rank-4 buffer."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    buffer_of = {s.arg.name: s.target for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    nodes = {n.name: n for n in ep.graph.nodes}
    out = set()
    for node_name, target in ep.graph_signature.buffers_to_mutate.items():
        node = nodes.get(node_name)
        if node is None or node.op != "call_function" or not node.args:
            continue
        base = node.args[0]
        if not (isinstance(base, torch.fx.Node) and base.name in placeholders and buffer_of.get(base.name) == target
                and len(getattr(base.meta.get("val"), "shape", ())) == 4):
            continue
        key = _key(node.target)
        if key == "aten.index_copy.default" and node.args[1] in (2, -2):
            out.add(target)
        elif key.startswith(("aten.index_put", "aten._unsafe_index_put")) and len(node.args) > 1:
            index = list(node.args[1])
            if len(index) == 3 and index[0] is None and index[1] is None:
                out.add(target)
    return out


def _first_lines(e: Exception, n: int = 8) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return "\n".join(text[:n]) + ("\n  ..." if len(text) > n else "")


# --- conversion -------------------------------------------------------------------


class _Args(dict):
    """A node's arguments by schema name, resolved to tg Tensors and Python values."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _Lazy:
    """A weight placeholder: becomes a tg.weight the first time a node uses it."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name, self.tensor = name, tensor


class _Importer:
    def __init__(self, ep, dropout: bool = False):
        self.ep = ep
        self.dropout_allowed = dropout
        self.g = Graph()
        self.env: dict[Any, Any] = {}
        self.symbols = self._symbol_table()
        # Sizes read off tensors at run time (`k.item()`): tg symbol name -> the 0-d i64 tensor
        # holding it; an op using it as a size (topk's k, a slice end) defines it with tg.narrow.
        self.run_time_values: dict[str, Tensor] = {}
        # Buffers the program writes as a KV cache (index_copy / index_put along dim 2 of a
        # rank-4 buffer): donated inputs of the model, each updated in place and returned as the
        # output aliasing it. Other buffer writes (batch norm's running statistics) are dropped:
        # inference keeps the weights fixed. input name -> its Tensor.
        self.donated_targets = _cache_buffers(self.ep)
        self.donated: dict[str, Tensor] = {}
        # Dropouts in training mode (a training step's export): the model's one seed weight, and
        # how many dropouts read it so far (each its own `site`, so its own masks).
        self.dropout_seed: Tensor | None = None
        self.dropout_sites = 0

    # symbolic dims ----------------------------------------------------------

    def _symbol_table(self) -> dict[sympy.Symbol, sympy.Symbol]:
        """torch's size symbols -> tg symbols, named after the user's Dim when known."""
        env = None
        torch_syms: list[sympy.Symbol] = []
        for node in self.ep.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor):
                for d in val.shape:
                    if isinstance(d, torch.SymInt):
                        env = env or d.node.shape_env
                        torch_syms += [s for s in d.node.expr.free_symbols if s not in torch_syms]
        debug = {}
        if env is not None:
            for sym, sources in getattr(env, "var_to_sources", {}).items():
                for src in sources:
                    name = src.name() if callable(src.name) else src.name
                    if name in env.source_name_to_debug_name:
                        debug[sym] = env.source_name_to_debug_name[name]
                        break
        out: dict = {}
        for sym in sorted(torch_syms, key=str):
            out[sym] = symbol_named(debug.get(sym, str(sym)), {s.name for s in out.values()})
        return out

    def expr(self, e: Any) -> Dim:
        """A torch size expression (sympy, with torch's FloorDiv etc.) as a tg dim."""
        if isinstance(e, (int, np.integer)):
            return int(e)
        e = sympy.sympify(e)
        if e.is_Integer:
            return int(e)
        if e.is_Symbol:
            if e not in self.symbols:
                raise FrontendError(f"size symbol {e} is not a dimension of any input (data-dependent size)")
            return self.symbols[e]
        args = [sympy.sympify(self.expr(a)) for a in e.args]
        name = type(e).__name__
        if name in ("FloorDiv", "CleanDiv"):
            return normalize_dim(sympy.floor(args[0] / args[1]))
        if name == "CeilDiv":
            return normalize_dim(sympy.ceiling(args[0] / args[1]))
        if name in ("Mod", "PythonMod"):
            return normalize_dim(sympy.Mod(args[0], args[1]))
        if name in ("Max", "Min"):
            return normalize_dim((sympy.Max if name == "Max" else sympy.Min)(*args))
        if isinstance(e, (sympy.Add, sympy.Mul, sympy.Pow)):
            return normalize_dim(e.func(*args))
        raise FrontendError(f"size expression {e} uses {name}, which tg shapes cannot express")

    def dim(self, d: Any) -> Dim:
        if isinstance(d, torch.SymInt):
            return self.expr(d.node.expr)
        if isinstance(d, (torch.SymFloat, torch.SymBool)):
            v = d.node.expr
            if v.is_number:
                return bool(v) if isinstance(d, torch.SymBool) else float(v)
            raise FrontendError(f"symbolic {type(d).__name__} {v} cannot be converted")
        return d

    def meta_shape(self, node) -> tuple[Dim, ...]:
        return tuple(self.dim(d) for d in node.meta["val"].shape)

    def meta_dtype(self, node) -> str:
        return torch_dtype(node.meta["val"].dtype)

    # values ------------------------------------------------------------------

    def value(self, node) -> Any:
        v = self.env[node]
        if isinstance(v, _Lazy):
            v = self.env[node] = self.g.weight(v.name, to_numpy(v.tensor))
        return v

    def resolve(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return self.value(a)
        if isinstance(a, (list, tuple)):
            return [self.resolve(x) for x in a]
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.dim(a)
        return a

    def bind(self, node) -> _Args:
        args = _Args()
        schema = node.target._schema
        for i, arg in enumerate(schema.arguments):
            if i < len(node.args):
                v = node.args[i]
            elif arg.name in node.kwargs:
                v = node.kwargs[arg.name]
            elif arg.has_default_value():
                v = arg.default_value
            else:
                v = None
            args[arg.name] = self.resolve(v)
        return args

    def const(self, value: Any, dtype: str) -> Tensor:
        return self.g.constant(np.asarray(value).astype(dtypes.numpy_dtype(dtype)))

    @functools.cached_property
    def emit(self) -> D.Builder:
        """This graph's op maker for the composites of ir.decompositions."""
        return D.Builder(self.g.op, self.const, lambda t: t.info)

    def operand(self, v: Any, dtype: str) -> Tensor:
        """A Tensor cast to dtype; a Python scalar (or symbolic size) as a dtype constant."""
        if isinstance(v, Tensor):
            return self.g.cast(v, dtype)
        if isinstance(v, sympy.Expr):
            return self.g.cast(self.size_value(v), dtype)
        return self.const(v, dtype)

    def size_value(self, e: sympy.Expr) -> Tensor:
        """A symbolic size as a 0-d i64 tensor, computed from nothing but shapes.

        tg has no "shape of" op; a symbol's value is the sum of a broadcast of ones
        that long, and sums and products of sizes follow from those.
        """
        if e.is_Integer:
            return self.const(int(e), "i64")
        if e.is_Symbol:
            ones = self.g.broadcast(self.const(1, "i64"), (e,))
            return self.g.sum(ones, axes=(0,))
        if isinstance(e, (sympy.Add, sympy.Mul)):
            parts = [self.size_value(a) for a in e.args]
            out = parts[0]
            for p in parts[1:]:
                out = self.g.op("add" if isinstance(e, sympy.Add) else "mul", out, p)
            return out
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and e.exp > 0:
            base = self.size_value(e.base)
            out = base
            for _ in range(int(e.exp) - 1):
                out = out * base
            return out
        raise FrontendError(f"symbolic size {e} is used as a tensor value; only sums and products of sizes can be")

    def promote(self, *vals: Any) -> str:
        """torch.result_type of operands (Tensors, Python scalars, sizes) as a tg dtype."""
        proxies = []
        for v in vals:
            if isinstance(v, Tensor):
                proxies.append(torch.empty((1,) * min(v.rank, 1), dtype=_TG_TO_TORCH[v.dtype]))
            elif isinstance(v, sympy.Expr):
                proxies.append(1)
            else:
                proxies.append(v)
        dt = proxies[0] if isinstance(proxies[0], torch.Tensor) else torch.tensor(proxies[0])
        for p in proxies[1:]:
            dt = torch.empty((1,) * min(dt.dim(), 1), dtype=torch.result_type(dt, p))
        return torch_dtype(dt.dtype)

    # the walk ----------------------------------------------------------------

    def run(self) -> Model:
        specs = {s.arg.name: s for s in self.ep.graph_signature.input_specs if hasattr(s.arg, "name")}
        outputs = None
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                self.placeholder(node, specs.get(node.name))
            elif node.op == "call_function":
                self.call(node)
            elif node.op == "output":
                outputs = node.args[0]
        return self.finish(outputs)

    def placeholder(self, node, spec) -> None:
        from torch.export.graph_signature import InputKind

        val = node.meta.get("val")
        if spec is None or spec.kind == InputKind.USER_INPUT:
            if not isinstance(val, torch.Tensor) and not node.users:
                return  # a Python constant torch specialized the program on
            if not isinstance(val, torch.Tensor):
                raise FrontendError(f"input '{node.name}' is a {type(val).__name__}; only tensor inputs are supported")
            self.env[node] = self.g.input(node.name, self.meta_shape(node), self.meta_dtype(node))
        elif spec.kind == InputKind.BUFFER and spec.target in self.donated_targets:
            name = identifier(spec.target)
            self.env[node] = self.donated[name] = self.g.input(name, self.meta_shape(node), self.meta_dtype(node))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            source = self.ep.state_dict if spec.target in self.ep.state_dict else self.ep.constants
            if spec.target not in source:
                raise FrontendError(f"weight '{spec.target}' of input '{node.name}' is missing from the program")
            self.env[node] = _Lazy(spec.target, source[spec.target])
        else:
            raise FrontendError(f"input '{node.name}' is a {spec.kind.name} input, which tg cannot represent")

    def call(self, node) -> None:
        key = _key(node.target)
        if key in SKIP:
            return
        val = node.meta.get("val")
        try:
            if key in RUN_TIME_SCALARS:  # .item(): a value known only at run time, used as a size
                self.env[node] = RUN_TIME_SCALARS[key](self, node, self.bind(node))
                return
            if isinstance(val, torch.SymBool) and not val.node.expr.is_number:
                self.env[node] = None  # a condition on run-time sizes: only torch's own asserts read it
                return
            if _is_sym_scalar(val):  # size arithmetic: its value is in the metadata
                self.env[node] = self.dim(val)
                return
            if key == "getitem":
                out = self.getitem(node)
            else:
                out = CONVERTERS[key](self, node, self.bind(node))
            out = self.check(node, out)
        except TilegraphError as e:
            raise FrontendError(f"node '{node.name}' ({key}): {e}") from e
        except Exception as e:  # a converter bug; still say where
            raise FrontendError(f"node '{node.name}' ({key}): internal error {type(e).__name__}: {e}") from e
        self.env[node] = out

    def getitem(self, node) -> Any:
        src, index = node.args
        item = self.value(src)[index]
        if item is None and node.users:
            raise FrontendError(f"output {index} of '{src.name}' ({_key(src.target)}) is not supported "
                                "(tg computes only the main result, not indices or saved statistics)")
        return item

    def check(self, node, out: Any) -> Any:
        """Agree with torch's metadata: same shape (else a frontend bug), same dtype."""
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            return tuple(None if o is None else self._check_one(node, o, v) for o, v in zip(out, val))
        return self._check_one(node, out, val)

    def _check_one(self, node, out: Tensor, val) -> Tensor:
        if out is None or not isinstance(val, torch.Tensor):
            return out
        want = tuple(self.dim(d) for d in val.shape)
        if len(want) != out.rank or not all(_same_dim(a, b) for a, b in zip(out.shape, want)):
            raise FrontendError(f"converted to shape {shape_str(out.shape)}, torch says {shape_str(want)}")
        return self.g.cast(out, torch_dtype(val.dtype))

    def finish(self, outputs) -> Model:
        from torch.export.graph_signature import OutputKind

        results, names, aliases = [], [], {}
        updates = []
        for i, (spec, node) in enumerate(zip(self.ep.graph_signature.output_specs, outputs)):
            if spec.kind == OutputKind.BUFFER_MUTATION and identifier(spec.target) in self.donated:
                updates.append((identifier(spec.target), self.value(node)))
                continue
            if spec.kind != OutputKind.USER_OUTPUT:
                continue  # other buffer updates: inference keeps the weights fixed
            v = self.value(node) if isinstance(node, torch.fx.Node) else node
            if not isinstance(v, Tensor):
                raise FrontendError(f"model output {i} is {v!r}, not a tensor")
            results.append(v)
            names.append(f"output{len(names)}")
        if not results:
            raise FrontendError("the exported program has no tensor outputs")
        for name, v in updates:  # the new buffer, as the output that is the donated input's buffer
            results.append(v)
            names.append(name + ".out")
            aliases[name] = name + ".out"
        return self.g.build(*results, names=names, aliases=aliases)


def _same_dim(a: Dim, b: Dim) -> bool:
    return a == b or (not isinstance(a, int) or not isinstance(b, int)) and dims_equal(a, b)


def torch_dtype(dt: torch.dtype) -> str:
    try:
        return _TORCH_DTYPES[dt]
    except KeyError:
        raise FrontendError(f"torch dtype {dt} has no tg element type") from None


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A weight as a NumPy array of its own dtype (a copy: the IR must not alias the module)."""
    name = torch_dtype(t.dtype)
    if t.is_meta:  # a module on the meta device has shapes, no values: plan it, never run it
        return np.broadcast_to(np.zeros((), dtypes.numpy_dtype(name)), tuple(t.shape))
    t = t.detach().cpu()
    if name in ("bf16", "f8E4M3FN", "f8E5M2"):
        raw = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.uint8).numpy()
        return raw.view(dtypes.numpy_dtype(name)).copy()
    return np.array(t.numpy(), copy=True)
