"""PyTorch frontend: a `torch.export` program onto the tg dialect.

    batch = torch.export.Dim("batch")
    model = from_torch(module, (ids, mask), dynamic_shapes=({0: batch}, {0: batch}))
    model = from_exported_program(ep)          # an ExportedProgram you already have
    model = load_pt2("model.pt2")               # torch.export.save'd file

What it decides, and how:

* The op level. `torch.export.export` gives ATen ops at about the level the user
  wrote: linear, layer_norm, softmax, scaled_dot_product_attention, conv2d,
  batch_norm. These map one-to-one onto tg ops and composites, so they are
  converted as they stand. Only when the graph holds an op with no converter, or
  an in-place op, is the program run through `run_decompositions` with a table that
  keeps the ops tg has whole (`KEEP_WHOLE`) and lowers the rest to core ATen
  (which also removes mutation). Converters cover both levels (`linear` and
  `addmm`, `layer_norm` and `native_layer_norm`, `max_pool2d` and
  `max_pool2d_with_indices`, ...), so a user's already-decomposed program imports too.
* Names. Parameters, buffers and lifted constants become `tg.weight` ops named by
  their state-dict key ("bert.encoder.layer.0.attention.self.query.weight"), made
  when first used; user inputs become @forward arguments named as in the signature.
* Shapes. A symbolic size (torch's SymInt `s43`) becomes a tg symbol named after
  the `torch.export.Dim` the user gave ("batch"), else after torch's symbol. Size
  arithmetic (`sym_size`, `operator.mul`) is not converted node by node: every
  node's `meta["val"]` already holds its value as a sympy expression.
* Types. Each node's result is checked against torch's own fake-tensor metadata:
  a shape that differs is a frontend bug and is reported; the dtype is made to
  agree. Operands are cast to the result dtype (torch promotion), comparisons to
  `torch.result_type` of their operands.
* Errors. A first pass lists every unsupported op, with its count and first node,
  in one FrontendError; a converter that cannot handle its arguments (a
  dropout in training mode) names the node and the op.
"""

from __future__ import annotations

import functools
import keyword
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import sympy
import torch

from tilegraph.frontends import FrontendError
from tilegraph.ir import decompositions as D, dtypes
from tilegraph.ir.builder import Graph, Tensor
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.interpreter import GLOBALS as _INTERPRETER_NAMES
from tilegraph.ir.model import Model
from tilegraph.ir.shapes import Dim, TensorInfo, broadcast_shapes, dims_equal, normalize_dim, numel, shape_str, symbol

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
_RESERVED = set(_INTERPRETER_NAMES) | set(keyword.kwlist) | {"None", "True", "False"}


# --- public entry points -------------------------------------------------------


def from_torch(module: torch.nn.Module, example_inputs: tuple, dynamic_shapes=None) -> Model:
    """Export `module` (in eval mode) with torch.export and convert the program."""
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    # tilegraph compiles inference: export what eval() computes (no dropout, BN with
    # running stats), then give the module back in the mode it came in.
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        ep = torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes)
    except Exception as e:  # torch's own message says what in the module it could not trace
        raise FrontendError(f"torch.export.export failed for {type(module).__name__}: {_first_lines(e)}") from e
    finally:
        for m, training in modes:
            m.training = training
    return from_exported_program(ep)


def load_pt2(path: str | Path) -> Model:
    """Convert a program saved with `torch.export.save`."""
    refuse_pickled_code(path)
    try:
        ep = torch.export.load(str(path))
    except Exception as e:
        raise FrontendError(f"cannot load the exported program {path}: {_first_lines(e)}") from e
    return from_exported_program(ep)


def refuse_pickled_code(path: str | Path) -> None:
    """FrontendError unless every pickle in the .pt2 archive at `path` is plain data.

    torch.export.load (torch 2.13) unpickles with weights_only=False, which runs any code a
    pickle names: weights and constants marked `use_pickle`, custom and opaque objects, and,
    when the restricted unpickler refuses them, the sample inputs (`.pt`, a fallback). What
    torch.export.save writes for a plain model is tensors in raw files and one `.pt` of
    sample inputs that the restricted (weights_only) unpickler reads; anything else is refused
    here, before torch sees it, so that loading an untrusted .pt2 never runs its code."""
    import io
    import json
    import zipfile

    from torch.export.pt2_archive.constants import TENSOR_CONSTANT_FILENAME_PREFIX

    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise FrontendError(f"cannot load the exported program {path}: not a .pt2 archive ({e})") from None
    with archive:
        for name in archive.namelist():
            if name.endswith(("_weights_config.json", "_constants_config.json")):
                try:
                    entries = json.loads(archive.read(name))["config"].values()
                except (ValueError, KeyError, TypeError, AttributeError, zipfile.BadZipFile) as e:
                    raise FrontendError(f"cannot load the exported program {path}: {name} is malformed ({e})") from None
                for meta in entries:
                    pickled = not isinstance(meta, dict) or meta.get("use_pickle") is not False or (
                        name.endswith("_constants_config.json")
                        and not str(meta.get("path_name", "")).startswith(TENSOR_CONSTANT_FILENAME_PREFIX))
                    if pickled:
                        raise FrontendError(f"refusing {path}: {name} holds a pickled object, and unpickling "
                                            "runs code; tilegraph loads .pt2 files whose weights are plain tensors")
            elif name.endswith(".pt"):
                try:
                    torch.load(io.BytesIO(archive.read(name)), weights_only=True)
                except Exception as e:  # noqa: BLE001 - whatever the restricted unpickler refuses
                    raise FrontendError(f"refusing {path}: {name} is not plain tensor data ({_first_lines(e)}); "
                                        "unpickling it would run code") from None


def from_exported_program(ep: torch.export.ExportedProgram) -> Model:
    """Convert an ExportedProgram to a tg Model (decomposing first only if it must)."""
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
    return _Importer(ep).run()


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
    def __init__(self, ep):
        self.ep = ep
        self.g = Graph()
        self.env: dict[Any, Any] = {}
        self.symbols = self._symbol_table()
        # Sizes read off tensors at run time (`k.item()`): tg symbol name -> the 0-d i64 tensor
        # holding it; an op using it as a size (topk's k, a slice end) defines it with tg.narrow.
        self.run_time_values: dict[str, Tensor] = {}

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
        out, used = {}, set()
        for sym in sorted(torch_syms, key=str):
            name = _identifier(debug.get(sym, str(sym)))
            while name in used or name in _RESERVED:
                name += "_"
            used.add(name)
            out[sym] = symbol(name)
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

        results = []
        for i, (spec, node) in enumerate(zip(self.ep.graph_signature.output_specs, outputs)):
            if spec.kind != OutputKind.USER_OUTPUT:
                continue  # buffer updates: inference keeps the weights fixed
            v = self.value(node) if isinstance(node, torch.fx.Node) else node
            if not isinstance(v, Tensor):
                raise FrontendError(f"model output {i} is {v!r}, not a tensor")
            results.append(v)
        if not results:
            raise FrontendError("the exported program has no tensor outputs")
        return self.g.build(*results)


def _same_dim(a: Dim, b: Dim) -> bool:
    return a == b or (not isinstance(a, int) or not isinstance(b, int)) and dims_equal(a, b)


def _identifier(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return out if out and not out[0].isdigit() else "d_" + out


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


# --- converters ---------------------------------------------------------------------
#
# One table: ATen op (as str(OpOverload)) -> converter(importer, node, args). `args`
# holds the op's schema arguments by name, tensors already tg Tensors.

Converter = Callable[[_Importer, Any, _Args], Any]
CONVERTERS: dict[str, Converter] = {}


# Names given to `converts` that this torch does not have (a typo, or an overload
# another torch version lacks); the tests keep it empty for the pinned torch.
UNKNOWN_NAMES: list[str] = []


def converts(*names: str):
    def register(fn):
        for n in names:
            packet, _, overload = n.partition(".")
            if overload not in getattr(getattr(aten, packet, None), "overloads", lambda: [])():
                UNKNOWN_NAMES.append(n)
                continue
            CONVERTERS["aten." + n] = fn
        return fn

    return register


def _axis(d: int, rank: int) -> int:
    if not -max(rank, 1) <= d < max(rank, 1):
        raise FrontendError(f"dim {d} is out of range for rank {rank}")
    return d % max(rank, 1)


def _axes(dim: Any, rank: int) -> tuple[int, ...]:
    """torch's dim argument (None, [], int, list) as sorted axes; None and [] mean all."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(rank))
    if isinstance(dim, int):
        dim = [dim]
    return tuple(sorted({_axis(d, rank) for d in dim}))


def _ntuple(v: Any, n: int) -> tuple:
    if isinstance(v, (list, tuple)):
        v = list(v)
        if len(v) == 1:
            return tuple(v * n)
        if len(v) != n:
            raise FrontendError(f"{v} does not give one value per spatial dim ({n})")
        return tuple(v)
    return (v,) * n


# identity and type conversion --------------------------------------------------


@converts("clone.default", "contiguous.default", "alias.default", "detach.default", "lift_fresh_copy.default",
          "_to_copy.default", "to.dtype", "to.dtype_layout", "to.device", "to.other", "type_as.default")
def _identity(cv, node, a):
    x = a.get("self", a.get("input"))
    return cv.g.cast(x, cv.meta_dtype(node))  # dtype conversions take the result dtype


@converts("dropout.default", "feature_dropout.default", "alpha_dropout.default", "feature_alpha_dropout.default")
def _dropout(cv, node, a):
    if a.train and a.p > 0:
        raise FrontendError("dropout in training mode; export the module in eval mode")
    return a.input


@converts("native_dropout.default")
def _native_dropout(cv, node, a):
    if a.train and a.p > 0:
        raise FrontendError("dropout in training mode; export the module in eval mode")
    return (a.input, None)


# elementwise -----------------------------------------------------------------------

UNARY = {
    "neg": "neg", "abs": "abs", "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt",
    "reciprocal": "reciprocal", "tanh": "tanh", "sigmoid": "sigmoid", "relu": "relu", "erf": "erf",
    "sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin", "acos": "acos", "atan": "atan", "sinh": "sinh",
    "cosh": "cosh", "asinh": "asinh", "acosh": "acosh", "atanh": "atanh", "floor": "floor", "ceil": "ceil",
    "sign": "sign", "bitwise_not": "bitwise_not", "expm1": "expm1", "log1p": "log1p",
}


def _unary(tg_name):
    def convert(cv, node, a):
        return cv.g.op(tg_name, cv.g.cast(a.self, cv.meta_dtype(node)))

    return convert


for _name, _tg in UNARY.items():
    converts(f"{_name}.default")(_unary(_tg))


@converts("round.default", "round.decimals")
def _round(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    decimals = a.get("decimals") or 0
    if decimals == 0:
        return cv.g.round(x)
    scale = 10.0 ** decimals  # torch: nearbyint(x * 10^d) / 10^d
    return cv.g.round(x * scale) / scale


@converts("trunc.default", "fix.default")
def _trunc(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    if not dtypes.is_float(x.dtype):
        return x
    return cv.g.where(x < 0, cv.g.ceil(x), cv.g.floor(x))


@converts("frac.default")
def _frac(cv, node, a):
    x = a.self
    return x - cv.g.where(x < 0, cv.g.ceil(x), cv.g.floor(x))


@converts("square.default")
def _square(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    return x * x


@converts("log2.default", "log10.default")
def _log_base(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    base = 2.0 if "log2" in str(node.target) else 10.0
    return cv.g.log(x) * (1.0 / math.log(base))


@converts("exp2.default")
def _exp2(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    return cv.g.pow(cv.const(2.0, x.dtype), x)


@converts("logical_not.default")
def _logical_not(cv, node, a):
    return cv.g.op("not", cv.g.cast(a.self, "i1"))


@converts("isnan.default")
def _isnan(cv, node, a):
    return cv.g.isnan(a.self)


@converts("isinf.default", "isposinf.default", "isneginf.default")
def _isinf(cv, node, a):
    kind = str(node.target).split(".")[1]
    return cv.g.isinf(a.self, detect_positive=kind != "isneginf", detect_negative=kind != "isposinf")


@converts("isfinite.default")
def _isfinite(cv, node, a):
    return cv.g.op("not", cv.g.op("or", cv.g.isnan(a.self), cv.g.isinf(a.self)))


BINARY = {
    "add.Tensor": "add", "add.Scalar": "add", "sub.Tensor": "sub", "sub.Scalar": "sub", "mul.Tensor": "mul",
    "mul.Scalar": "mul", "maximum.default": "max", "minimum.default": "min", "max.other": "max", "min.other": "min",
    **{f"bitwise_{k}.{o}": f"bitwise_{k}" for k in ("and", "or", "xor") for o in ("Tensor", "Scalar", "Scalar_Tensor")},
}


def _binary(tg_name):
    def convert(cv, node, a):
        dt = cv.meta_dtype(node)
        x, y = cv.operand(a.self, dt), cv.operand(a.other, dt)
        alpha = a.get("alpha", 1)
        if alpha != 1:
            y = y * alpha
        return cv.g.op(tg_name, x, y)

    return convert


for _name, _tg in BINARY.items():
    converts(_name)(_binary(_tg))


@converts("rsub.Scalar", "rsub.Tensor")
def _rsub(cv, node, a):
    dt = cv.meta_dtype(node)
    x, y = cv.operand(a.self, dt), cv.operand(a.other, dt)
    return y - (x * a.alpha if a.alpha != 1 else x)


@converts("div.Tensor", "div.Scalar", "div.Tensor_mode", "div.Scalar_mode", "true_divide.Tensor")
def _div(cv, node, a):
    mode = a.get("rounding_mode")
    dt = cv.meta_dtype(node)
    x, y = cv.operand(a.self, dt), cv.operand(a.other, dt)
    if mode is None:
        return cv.g.div(x, y)
    return _floor_div(cv, x, y) if mode == "floor" else _trunc_div(cv, x, y)


def _trunc_div(cv, x, y):
    q = cv.g.div(x, y)  # tg.div truncates integers, as C and torch do
    return cv.g.where(q < 0, cv.g.ceil(q), cv.g.floor(q)) if dtypes.is_float(q.dtype) else q


def _floor_div(cv, x, y):
    if dtypes.is_float(x.dtype):
        return cv.g.floor(cv.g.div(x, y))
    # (x - x mod y) is a multiple of y, so the truncating tg.div is exact here.
    return cv.g.div(x - cv.g.mod(x, y), y)


@converts("floor_divide.default", "floor_divide.Scalar")
def _floor_divide(cv, node, a):
    dt = cv.meta_dtype(node)
    return _floor_div(cv, cv.operand(a.self, dt), cv.operand(a.other, dt))


@converts("remainder.Tensor", "remainder.Scalar", "fmod.Tensor", "fmod.Scalar")
def _mod(cv, node, a):
    dt = cv.meta_dtype(node)
    return cv.g.mod(cv.operand(a.self, dt), cv.operand(a.other, dt), fmod="fmod" in str(node.target))


@converts("pow.Tensor_Tensor", "pow.Tensor_Scalar", "pow.Scalar")
def _pow(cv, node, a):
    dt = cv.meta_dtype(node)
    return cv.g.pow(cv.operand(a.self, dt), cv.operand(a.exponent, dt))


COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}


def _compare(tg_name):
    def convert(cv, node, a):
        dt = cv.promote(a.self, a.other)
        return cv.g.op(tg_name, cv.operand(a.self, dt), cv.operand(a.other, dt))

    return convert


for _name, _tg in COMPARE.items():
    converts(f"{_name}.Tensor", f"{_name}.Scalar")(_compare(_tg))


def _logical(tg_name):
    def convert(cv, node, a):
        return cv.g.op(tg_name, cv.operand(a.self, "i1"), cv.operand(a.other, "i1"))

    return convert


for _name in ("and", "or", "xor"):
    converts(f"logical_{_name}.default")(_logical(_name))


@converts("where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar")
def _where(cv, node, a):
    dt = cv.meta_dtype(node)
    return cv.g.where(cv.g.cast(a.condition, "i1"), cv.operand(a.self, dt), cv.operand(a.other, dt))


@converts("masked_fill.Scalar", "masked_fill.Tensor")
def _masked_fill(cv, node, a):
    dt = cv.meta_dtype(node)
    return cv.g.where(cv.g.cast(a.mask, "i1"), cv.operand(a.value, dt), cv.operand(a.self, dt))


@converts("clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_min.Tensor", "clamp_max.default",
          "clamp_max.Tensor", "hardtanh.default")
def _clamp(cv, node, a):
    dt = cv.meta_dtype(node)
    name = str(node.target)
    lo = a.get("min", a.get("min_val"))
    hi = a.get("max", a.get("max_val"))
    if "clamp_max" in name:
        lo, hi = None, a.max
    x = cv.g.cast(a.self, dt)
    if lo is not None:  # torch: min(max(x, lo), hi)
        x = cv.g.max(x, cv.operand(lo, dt))
    if hi is not None:
        x = cv.g.min(x, cv.operand(hi, dt))
    return x


# activations ------------------------------------------------------------------------


@converts("gelu.default")
def _gelu(cv, node, a):
    return cv.g.gelu(a.self, approximate=a.approximate)


@converts("silu.default")
def _silu(cv, node, a):
    return D.swish(cv.emit, a.self)


@converts("mish.default")
def _mish(cv, node, a):
    return D.mish(cv.emit, a.self, threshold=20.0)  # torch's softplus threshold


@converts("softplus.default")
def _softplus(cv, node, a):
    return D.softplus(cv.emit, a.self, a.beta, a.threshold)


@converts("hardsigmoid.default")
def _hardsigmoid(cv, node, a):
    return D.hard_sigmoid(cv.emit, a.self, 1 / 6, 0.5)  # torch: relu6(x + 3) / 6


@converts("hardswish.default")
def _hardswish(cv, node, a):
    return D.hard_swish(cv.emit, a.self)


@converts("leaky_relu.default")
def _leaky_relu(cv, node, a):
    return D.leaky_relu(cv.emit, a.self, a.negative_slope)


@converts("elu.default")
def _elu(cv, node, a):
    return D.elu(cv.emit, a.self, a.alpha, a.scale, a.input_scale)


# reductions -------------------------------------------------------------------------


def _reduce(kind):
    def convert(cv, node, a):
        x = cv.g.cast(a.self, cv.meta_dtype(node))
        return cv.g.op("reduce_" + kind, x, axes=_axes(a.get("dim"), x.rank), keepdims=bool(a.get("keepdim")))

    return convert


converts("sum.default", "sum.dim_IntList")(_reduce("sum"))
converts("mean.default", "mean.dim")(_reduce("mean"))
converts("amax.default", "max.default")(_reduce("max"))
converts("amin.default", "min.default")(_reduce("min"))
converts("prod.default", "prod.dim_int")(_reduce("prod"))


def _max_min_dim(kind):
    def convert(cv, node, a):
        x, axis = a.self, _axis(a.dim, a.self.rank)
        values = cv.g.op("reduce_" + kind, x, axes=(axis,), keepdims=a.keepdim)
        indices = cv.g.op("argmax" if kind == "max" else "argmin", x, axis=axis, keepdims=a.keepdim)
        return (values, indices)

    return convert


converts("max.dim")(_max_min_dim("max"))
converts("min.dim")(_max_min_dim("min"))


def _arg(kind):
    def convert(cv, node, a):
        x = a.self
        if a.dim is None:  # over the flattened tensor
            flat = cv.g.reshape(x, (numel(x.shape),))
            out = cv.g.op(kind, flat, axis=0)
            return cv.g.reshape(out, cv.meta_shape(node))
        return cv.g.op(kind, x, axis=_axis(a.dim, x.rank), keepdims=a.keepdim)

    return convert


converts("argmax.default")(_arg("argmax"))
converts("argmin.default")(_arg("argmin"))


def _any_all(kind):
    def convert(cv, node, a):
        x = cv.g.cast(a.self, "i1")
        return cv.g.op(kind, x, axes=_axes(a.get("dim"), x.rank), keepdims=bool(a.get("keepdim")))

    return convert


converts("any.default", "any.dim", "any.dims")(_any_all("reduce_max"))
converts("all.default", "all.dim", "all.dims")(_any_all("reduce_min"))


def _variance(cv, x, dim, correction, keepdim):
    axes = _axes(dim, x.rank)
    n = numel([x.shape[i] for i in axes])
    centered = x - cv.g.mean(x, axes, keepdims=True)
    ss = cv.g.sum(centered * centered, axes, keepdims=keepdim)
    correction = 1 if correction is None else correction
    return ss / cv.operand(normalize_dim(n - correction) if not isinstance(n, int) else float(n - correction), x.dtype)


@converts("var.correction", "var.dim", "var.default", "std.correction", "std.dim", "std.default")
def _var_std(cv, node, a):
    correction = a.get("correction") if "correction" in str(node.target) else (1 if a.unbiased else 0)
    var = _variance(cv, cv.g.cast(a.self, cv.meta_dtype(node)), a.get("dim"), correction, bool(a.get("keepdim")))
    return cv.g.sqrt(var) if str(node.target).startswith("aten.std") else var


@converts("var_mean.correction")
def _var_mean(cv, node, a):
    x = a.self
    var = _variance(cv, x, a.dim, a.correction, a.keepdim)
    return (var, cv.g.mean(x, _axes(a.dim, x.rank), keepdims=a.keepdim))


@converts("logsumexp.default")
def _logsumexp(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    axes = _axes(a.dim, x.rank)
    m = cv.g.amax(x, axes, keepdims=True)
    m = cv.g.where(cv.g.isinf(m), 0.0, m)  # as torch: an all -inf row stays -inf, not nan
    out = cv.g.log(cv.g.sum(cv.g.exp(x - m), axes, keepdims=True)) + m
    return out if a.keepdim else cv.g.reshape(out, cv.meta_shape(node))


@converts("linalg_vector_norm.default")
def _vector_norm(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    axes, keep, p = _axes(a.dim, x.rank), a.keepdim, float(a.ord)
    if p == 2:
        return cv.g.sqrt(cv.g.sum(x * x, axes, keep))
    if p == 1:
        return cv.g.sum(cv.g.abs(x), axes, keep)
    if p == math.inf:
        return cv.g.amax(cv.g.abs(x), axes, keep)
    if p == -math.inf:
        return cv.g.amin(cv.g.abs(x), axes, keep)
    if p == 0:
        return cv.g.sum(cv.g.cast(cv.g.op("ne", x, cv.const(0, x.dtype)), x.dtype), axes, keep)
    return cv.g.pow(cv.g.sum(cv.g.pow(cv.g.abs(x), cv.const(p, x.dtype)), axes, keep), cv.const(1 / p, x.dtype))


@converts("cumprod.default")
def _cumprod(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    return cv.g.cumprod(x, axis=_axis(a.dim, x.rank))


@converts("topk.default")
def _topk(cv, node, a):
    x = a.self
    if isinstance(a.k, sympy.Symbol) and a.k.name in cv.run_time_values:
        return _topk_run_time_k(cv, node, a)
    if not isinstance(a.k, int):
        raise FrontendError(f"topk with a symbolic k ({a.k})")
    # tg.topk is sorted, equal values by index: a valid answer for sorted=False too.
    return tuple(cv.g.topk(x, k=a.k, axis=_axis(a.dim, x.rank), largest=a.largest))


@converts("sort.default", "sort.stable", "argsort.default", "argsort.stable")
def _sort(cv, node, a):
    """A sort is a top-k of the whole axis; equal values keep index order, as a stable sort."""
    x = a.self
    axis = _axis(a.dim, x.rank)
    if not isinstance(x.shape[axis], int):
        raise FrontendError(f"sort along symbolic dim {x.shape[axis]}")
    values, indices = cv.g.topk(x, k=x.shape[axis], axis=axis, largest=a.descending)
    return indices if "argsort" in str(node.target) else (values, indices)


@converts("cumsum.default")
def _cumsum(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    return cv.g.cumsum(x, axis=_axis(a.dim, x.rank))


# softmax and normalization -------------------------------------------------------------


@converts("softmax.int", "_softmax.default")
def _softmax(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    return cv.g.softmax(x, axis=_axis(a.dim, x.rank))


@converts("log_softmax.int", "_log_softmax.default")
def _log_softmax(cv, node, a):
    x = cv.g.cast(a.self, cv.meta_dtype(node))
    axis = _axis(a.dim, x.rank)
    shifted = x - cv.g.amax(x, axis, keepdims=True)
    return shifted - cv.g.log(cv.g.sum(cv.g.exp(shifted), axis, keepdims=True))


@converts("layer_norm.default", "native_layer_norm.default")
def _layer_norm(cv, node, a):
    x = a.input
    y = cv.g.layer_norm(x, a.weight, a.bias, axis=-len(a.normalized_shape), epsilon=a.eps)
    return y if "native" not in str(node.target) else (y, None, None)


@converts("rms_norm.default")
def _rms_norm(cv, node, a):
    x = a.input
    axes = tuple(range(x.rank - len(a.normalized_shape), x.rank))
    eps = a.eps if a.eps is not None else float(torch.finfo(_TG_TO_TORCH[x.dtype]).eps)
    y = D.rms_norm(cv.emit, x, axes, eps)
    return y if a.weight is None else y * a.weight


@converts("batch_norm.default", "_native_batch_norm_legit_no_training.default", "native_batch_norm.default",
          "_native_batch_norm_legit.default", "_native_batch_norm_legit.no_stats")
def _batch_norm(cv, node, a):
    if a.get("training"):
        # The running statistics torch would also update are state, not output: dropped.
        y, _, _ = D.batch_norm_training(cv.emit, a.input, a.weight, a.bias, a.eps)
    elif a.get("running_mean") is None or a.get("running_var") is None:
        raise FrontendError("batch_norm in eval mode without running statistics")
    else:
        y = D.batch_norm(cv.emit, a.input, a.weight, a.bias, a.running_mean, a.running_var, a.eps)
    return y if str(node.target) == "aten.batch_norm.default" else (y, None, None)


@converts("group_norm.default")
def _group_norm(cv, node, a):
    return D.group_norm(cv.emit, a.input, a.num_groups, a.weight, a.bias, a.eps)


@converts("native_group_norm.default")
def _native_group_norm(cv, node, a):
    return (D.group_norm(cv.emit, a.input, a.group, a.weight, a.bias, a.eps), None, None)


# contractions ----------------------------------------------------------------------


@converts("matmul.default", "mm.default", "bmm.default", "mv.default", "dot.default")
def _matmul(cv, node, a):
    dt = cv.meta_dtype(node)
    # The second operand's name differs per overload: other, mat2, vec, tensor.
    other = next(a[k] for k in ("other", "mat2", "vec", "tensor") if k in a)
    return cv.g.matmul(cv.g.cast(a.self, dt), cv.g.cast(other, dt))


@converts("linear.default")
def _linear(cv, node, a):
    w = a.weight
    y = cv.g.matmul(a.input, cv.g.transpose(w, (1, 0)) if w.rank == 2 else w)
    return y if a.bias is None else y + a.bias


@converts("addmm.default", "baddbmm.default", "addmv.default")
def _addmm(cv, node, a):
    m1 = a.get("mat1", a.get("batch1", a.get("mat")))
    m2 = a.get("mat2", a.get("batch2", a.get("vec")))
    y = cv.g.matmul(m1, m2)
    if a.alpha != 1:
        y = y * a.alpha
    if a.beta == 0:  # torch ignores self (even nan) when beta is 0
        return y
    return (a.self * a.beta if a.beta != 1 else a.self) + y


@converts("einsum.default")
def _einsum(cv, node, a):
    return cv.g.einsum(*a.tensors, equation=a.equation)


def _unbatched(cv, x, nd, fn):
    """Run a batched (N, C, *spatial) op on an unbatched (C, *spatial) input too."""
    if x.rank == nd + 1:
        y = fn(cv.g.reshape(x, (1,) + x.shape))
        return cv.g.reshape(y, y.shape[1:])
    return fn(x)


def _conv(cv, x, w, bias, stride, padding, dilation, groups):
    nd = w.rank - 2
    stride, dilation = _ntuple(stride, nd), _ntuple(dilation, nd)
    if isinstance(padding, str):
        if padding == "valid":
            lo = hi = (0,) * nd
        else:  # "same": total d*(k-1), the odd one at the end, as torch
            total = [dilation[i] * (w.shape[2 + i] - 1) for i in range(nd)]
            lo = tuple(t // 2 for t in total)
            hi = tuple(t - t // 2 for t in total)
    else:
        lo = hi = _ntuple(padding, nd)
    return _unbatched(cv, x, nd, lambda xb: cv.g.conv(xb, w, bias, strides=stride, pads=lo + hi,
                                                         dilations=dilation, groups=groups))


@converts("convolution.default", "_convolution.default")
def _convolution(cv, node, a):
    if a.transposed:
        nd = a.weight.rank - 2
        return _unbatched(cv, a.input, nd, lambda xb: _conv_transpose(
            cv, xb, a.weight, a.bias, _ntuple(a.stride, nd), _ntuple(a.padding, nd), _ntuple(a.dilation, nd),
            _ntuple(a.output_padding, nd), a.groups))
    return _conv(cv, a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups)


def _conv_transpose(cv, x, w, bias, stride, padding, dilation, output_padding, groups):
    """The transposed convolution as a stride-1 convolution of x with stride-1 zeros between its
    elements, padded by dilation*(k-1) - padding (cropped where that is negative; output_padding
    more at the end), with the kernel flipped and its in/out channels swapped per group."""
    g, nd = cv.g, w.rank - 2
    if not all(isinstance(d, int) for d in x.shape[2:]):
        raise FrontendError(f"transposed convolution of symbolic spatial dims {x.shape[2:]}")
    for i, s in enumerate(stride):
        a = 2 + i
        if s > 1:
            shape = x.shape
            pads = [0] * (2 * (x.rank + 1))
            pads[x.rank + 1 + a + 1] = s - 1  # s - 1 zeros after each element, on a new axis
            grown = g.pad(g.reshape(x, shape[:a + 1] + (1,) + shape[a + 1:]), pads)
            grown = g.reshape(grown, shape[:a] + (shape[a] * s,) + shape[a + 1:])
            x = g.slice(grown, [0], [(shape[a] - 1) * s + 1], axes=[a])
    for i in range(nd):
        a, k = 2 + i, w.shape[2 + i]
        lo = dilation[i] * (k - 1) - padding[i]
        hi = lo + output_padding[i]
        if lo < 0 or hi < 0:
            x = g.slice(x, [max(-lo, 0)], [x.shape[a] - max(-hi, 0)], axes=[a])
        if lo > 0 or hi > 0:
            pads = [0] * (2 * x.rank)
            pads[a], pads[x.rank + a] = max(lo, 0), max(hi, 0)
            x = g.pad(x, pads)
    cin, cout_g, *kernel = w.shape
    wt = g.reshape(w, (groups, cin // groups, cout_g, *kernel))
    wt = g.reshape(g.transpose(wt, (0, 2, 1, *range(3, 3 + nd))), (groups * cout_g, cin // groups, *kernel))
    wt = g.slice(wt, [-1] * nd, [-(1 << 63) + 1] * nd, axes=list(range(2, 2 + nd)), steps=[-1] * nd)  # flipped
    return g.conv(x, wt, bias, strides=(1,) * nd, pads=(0,) * (2 * nd), dilations=tuple(dilation), groups=groups)


@converts("conv1d.default", "conv2d.default", "conv3d.default", "conv1d.padding", "conv2d.padding",
          "conv3d.padding")
def _convnd(cv, node, a):
    return _conv(cv, a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups)


# pooling ---------------------------------------------------------------------------


def _pool_nd(node) -> int:
    name = str(node.target)
    return 3 if "3d" in name else 1 if "1d" in name else 2


def _fit_window(x, kernel, pads, ceil_mode):
    """With ceil_mode torch accepts a window larger than the padded input (EfficientNet's pooler:
    320 over 1x1) and makes one window of the whole padded input of it; tg's pools take that
    window at its real size, which gives the same single output."""
    if not ceil_mode:
        return kernel
    spatial = x.shape[-len(kernel):]
    return tuple(min(k, s + 2 * p) if isinstance(s, int) else k for k, s, p in zip(kernel, spatial, pads))


def _window(node, a):
    """A pool's spatial rank, window (fitted, see _fit_window), strides (the window by default) and pads."""
    nd = _pool_nd(node)
    kernel = _ntuple(a.kernel_size, nd)
    pads = _ntuple(a.padding, nd)
    return nd, _fit_window(a.self, kernel, pads, a.ceil_mode), _ntuple(a.stride, nd) if a.stride else kernel, pads


@converts("max_pool1d.default", "max_pool2d.default", "max_pool3d.default", "max_pool2d_with_indices.default",
          "max_pool3d_with_indices.default", "max_pool1d_with_indices.default")
def _max_pool(cv, node, a):
    nd, kernel, stride, pads = _window(node, a)
    y = _unbatched(cv, a.self, nd, lambda xb: cv.g.max_pool(xb, kernel=kernel, strides=stride, pads=pads + pads,
                                                             dilations=_ntuple(a.dilation, nd), ceil_mode=a.ceil_mode))
    return (y, None) if "indices" in str(node.target) else y


@converts("avg_pool1d.default", "avg_pool2d.default", "avg_pool3d.default")
def _avg_pool(cv, node, a):
    nd, kernel, stride, pads = _window(node, a)
    divisor = a.get("divisor_override")
    if divisor is not None and a.ceil_mode:
        raise FrontendError("avg_pool with both divisor_override and ceil_mode is not supported")
    include = a.count_include_pad or divisor is not None

    def pool(xb):
        y = cv.g.avg_pool(xb, kernel=kernel, strides=stride, pads=pads + pads, ceil_mode=a.ceil_mode,
                          count_include_pad=include)
        # Every window then averages exactly prod(kernel) terms: rescale to the divisor.
        return y if divisor is None else y * (math.prod(kernel) / divisor)

    return _unbatched(cv, a.self, nd, pool)


def _adaptive(cv, node, x, output_size, kind):
    nd = len(output_size)
    spatial = x.shape[-nd:]
    out = [s if o is None else o for s, o in zip(spatial, output_size)]
    if all(o == 1 for o in out):
        axes = tuple(range(x.rank - nd, x.rank))
        return cv.g.mean(x, axes, keepdims=True) if kind == "avg" else cv.g.amax(x, axes, keepdims=True)
    if not all(isinstance(s, int) and s % o == 0 for s, o in zip(spatial, out)):
        raise FrontendError(f"adaptive pooling from {shape_str(spatial)} to {tuple(out)} is supported only "
                            "when each output size divides its input size")
    # Divisible sizes: torch's windows [floor(i*in/out), ceil((i+1)*in/out)) are the
    # fixed windows of a pool with kernel = stride = in/out.
    kernel = tuple(s // o for s, o in zip(spatial, out))
    op = cv.g.avg_pool if kind == "avg" else cv.g.max_pool
    return _unbatched(cv, x, nd, lambda xb: op(xb, kernel=kernel, strides=kernel))


@converts("adaptive_avg_pool1d.default", "adaptive_avg_pool2d.default", "_adaptive_avg_pool2d.default",
          "adaptive_avg_pool3d.default", "_adaptive_avg_pool3d.default")
def _adaptive_avg(cv, node, a):
    return _adaptive(cv, node, a.self, list(a.output_size), "avg")


@converts("adaptive_max_pool1d.default", "adaptive_max_pool2d.default")
def _adaptive_max(cv, node, a):
    return (_adaptive(cv, node, a.self, list(a.output_size), "max"), None)


_NEAREST = [f"{kind}{n}d.{o}" for kind in ("upsample_nearest", "_upsample_nearest_exact") for n in (1, 2, 3)
            for o in ("default", "vec")]


@converts(*_NEAREST)
def _upsample_nearest(cv, node, a):
    """Nearest upsampling as one gather per spatial axis, of torch's source indices."""
    x = a.get("input", a.get("self"))
    nd = x.rank - 2
    out = cv.meta_shape(node)[2:]
    scales = a.get("scale_factors") or [v for k, v in a.items() if k.startswith("scales")] or [None] * nd
    exact = "exact" in str(node.target)
    for i in range(nd):
        size, n = x.shape[2 + i], out[i]
        if not (isinstance(size, int) and isinstance(n, int)):
            raise FrontendError(f"nearest upsampling of a symbolic size ({size} -> {n})")
        # ATen: src = min(floor((dst [+ 0.5]) * scale), in - 1), scale = 1/scale_factor
        # when one was given, else in/out; computed in float32 as ATen does.
        scale = np.float32(1.0 / scales[i] if scales[i] else size / n)
        dst = np.arange(n, dtype=np.float32) + np.float32(0.5 if exact else 0.0)
        src = np.minimum(np.floor(dst * scale).astype(np.int64), size - 1)
        if not (n == size and np.array_equal(src, np.arange(n))):
            x = cv.g.gather(x, cv.g.constant(src), axis=2 + i)
    return x


_LINEAR = [f"{kind}.{o}" for kind in ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d")
           for o in ("default", "vec")]


@converts(*_LINEAR)
def _upsample_linear(cv, node, a):
    """(Bi/tri)linear upsampling, one axis at a time: two gathers of torch's source taps and
    their weights, all computed here from the static sizes (ATen's upsample_linear rules)."""
    x = a.get("input", a.get("self"))
    nd = x.rank - 2
    out = cv.meta_shape(node)[2:]
    scales = a.get("scale_factors") or [v for k, v in a.items() if k.startswith("scales")] or [None] * nd
    corners = bool(a.align_corners)
    dtype = dtypes.numpy_dtype(x.dtype)
    for i in range(nd):
        size, n = x.shape[2 + i], out[i]
        if not (isinstance(size, int) and isinstance(n, int)):
            raise FrontendError(f"linear upsampling of a symbolic size ({size} -> {n})")
        # area_pixel_compute_scale / _source_index, in float32 as ATen computes them for float32
        if corners:
            scale = np.float32((size - 1) / (n - 1) if n > 1 else 0.0)
            src = np.arange(n, dtype=np.float32) * scale
        else:
            scale = np.float32(1.0 / scales[i] if scales[i] else size / n)
            src = np.maximum((np.arange(n, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5), 0)
        lo = src.astype(np.int64)
        hi = np.minimum(lo + 1, size - 1)
        frac = (src - lo).astype(dtype)
        shape = [1] * x.rank
        shape[2 + i] = n
        near = cv.g.gather(x, cv.g.constant(lo), axis=2 + i)
        far = cv.g.gather(x, cv.g.constant(hi), axis=2 + i)
        x = (near * cv.g.constant((1 - frac).reshape(shape).astype(dtype))
             + far * cv.g.constant(frac.reshape(shape)))
    return x


# attention and embedding -------------------------------------------------------------


def _sdpa(cv, node, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    if dropout_p:
        raise FrontendError(f"attention dropout_p={dropout_p}; pass dropout_p=0 at inference")
    if scale is None:
        if not isinstance(q.shape[-1], int):
            raise FrontendError("attention with a symbolic head dim needs an explicit scale")
        scale = 1.0 / math.sqrt(q.shape[-1])
    if enable_gqa and q.rank >= 3 and not _same_dim(q.shape[-3], k.shape[-3]):
        k, v = (_repeat_heads(cv, t, q.shape[-3]) for t in (k, v))
    lq, lk = q.shape[-2], k.shape[-2]
    user_mask = mask is not None
    causal = False
    if is_causal:
        if _same_dim(lq, lk):
            causal = True  # tg's causal mask then equals torch's (top-left aligned) one
        elif isinstance(lq, int) and isinstance(lk, int):
            mask = cv.g.constant(np.tril(np.ones((lq, lk), dtype=bool)))
        else:
            raise FrontendError(f"causal attention with query length {lq} != key length {lk} (symbolic)")
    if mask is not None and mask.dtype != "i1":
        mask = cv.g.cast(mask, q.dtype)
    out = cv.g.attention(q, k, v, mask, scale=float(scale), causal=causal)
    if user_mask:
        # torch returns 0, not nan, for a query row whose every key is masked out.
        # (A causal mask, torch's top-left aligned one, never masks a whole row.)
        keep = mask if mask.dtype == "i1" else cv.g.op("ne", mask, cv.const(-np.inf, mask.dtype))
        out = cv.g.where(cv.g.op("reduce_max", keep, axes=(keep.rank - 1,), keepdims=True), out, 0.0)
    return out


def _repeat_heads(cv, t, heads):
    """(..., Hk, S, E) -> (..., heads, S, E), each kv head repeated heads/Hk times in a row."""
    hk = t.shape[-3]
    rep = heads // hk
    lead = t.shape[:-3]
    x = cv.g.reshape(t, lead + (hk, 1) + t.shape[-2:])
    x = cv.g.broadcast(x, lead + (hk, rep) + t.shape[-2:])
    return cv.g.reshape(x, lead + (heads,) + t.shape[-2:])


@converts("scaled_dot_product_attention.default")
def _attention(cv, node, a):
    return _sdpa(cv, node, a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, a.scale, a.enable_gqa)


@converts("_scaled_dot_product_flash_attention_for_cpu.default")
def _attention_cpu(cv, node, a):
    out = _sdpa(cv, node, a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, a.scale, False)
    return (out, None)


@converts("embedding.default")
def _embedding(cv, node, a):
    return cv.g.gather(a.weight, a.indices, axis=0)


# layout ------------------------------------------------------------------------------


@converts("view.default", "_unsafe_view.default", "reshape.default", "flatten.using_ints", "unflatten.int",
          "unsqueeze.default", "squeeze.default", "squeeze.dim", "squeeze.dims", "view_as.default",
          "reshape_as.default")
def _reshape(cv, node, a):
    # The result shape is torch's own (with -1 and symbolic sizes already resolved).
    return cv.g.reshape(a.self, cv.meta_shape(node))


@converts("permute.default")
def _permute(cv, node, a):
    x = a.self
    return cv.g.transpose(x, [_axis(d, x.rank) for d in a.dims])


@converts("transpose.int", "swapaxes.default")
def _transpose(cv, node, a):
    x = a.self
    perm = list(range(x.rank))
    i, j = _axis(a.get("dim0", a.get("axis0")), x.rank), _axis(a.get("dim1", a.get("axis1")), x.rank)
    perm[i], perm[j] = perm[j], perm[i]
    return x if i == j else cv.g.transpose(x, perm)


@converts("t.default", "numpy_T.default")
def _t(cv, node, a):
    x = a.self
    return cv.g.transpose(x, list(range(x.rank))[::-1]) if x.rank >= 2 else x


@converts("expand.default", "expand_as.default", "broadcast_to.default")
def _expand(cv, node, a):
    return cv.g.broadcast(a.self, cv.meta_shape(node))


@converts("copy.default")
def _copy(cv, node, a):
    return cv.g.broadcast(cv.g.cast(a.src, a.self.dtype), a.self.shape)


@converts("cat.default", "concat.default", "concatenate.default")
def _cat(cv, node, a):
    dt = cv.meta_dtype(node)
    ts = [cv.g.cast(t, dt) for t in a.tensors]
    rank = max(t.rank for t in ts)
    # torch still accepts legacy 1-D empty tensors next to tensors of any rank.
    ts = [t for t in ts if not (t.rank == 1 and t.shape[0] == 0 and rank > 1)]
    return ts[0] if len(ts) == 1 else cv.g.concat(ts, axis=_axis(a.dim, rank))


@converts("stack.default")
def _stack(cv, node, a):
    dt = cv.meta_dtype(node)
    ts = [cv.g.cast(t, dt) for t in a.tensors]
    axis = _axis(a.dim, ts[0].rank + 1)
    ts = [cv.g.reshape(t, t.shape[:axis] + (1,) + t.shape[axis:]) for t in ts]
    return ts[0] if len(ts) == 1 else cv.g.concat(ts, axis=axis)


@converts("split.Tensor", "split_with_sizes.default", "split.sizes", "chunk.default", "unbind.int",
          "tensor_split.sections")
def _split(cv, node, a):
    x = a.self
    axis = _axis(a.get("dim", 0), x.rank)
    parts = node.meta["val"]
    sizes = [cv.dim(p.shape[axis]) if "unbind" not in str(node.target) else 1 for p in parts]
    if not all(isinstance(s, int) for s in sizes):
        raise FrontendError(f"split of symbolic dim {x.shape[axis]} into {sizes}")
    out = cv.g.split(x, sizes, axis=axis)
    if "unbind" in str(node.target):
        out = tuple(cv.g.reshape(t, x.shape[:axis] + x.shape[axis + 1:]) for t in out)
    return tuple(out)


def _slice_axis(cv, x, axis, start, end, step):
    """x[start:end:step] on one axis; symbolic bounds become a gather of computed indices."""
    size = x.shape[axis]
    start = 0 if start is None else start
    end = TO_END if end is None else end
    if not isinstance(end, int) and _same_dim(end, size):
        end = TO_END
    if isinstance(end, int) and end >= BIG:
        end = TO_END
    if isinstance(start, int) and isinstance(end, int):
        if (start, end, step) == (0, TO_END, 1):
            return x
        return cv.g.slice(x, [start], [end], axes=[axis], steps=[step])
    # A symbolic bound (x[:, :seq] of a fixed-size buffer): the indices
    # start, start+step, ... as a tensor (symbolic arange), then gather them.
    if (isinstance(start, int) and start < 0) or (isinstance(end, int) and end < 0):
        raise FrontendError(f"slice [{start}:{end}:{step}] mixing negative and symbolic bounds")
    stop = size if isinstance(end, int) and end >= BIG else end
    if isinstance(stop, int) and isinstance(size, int):
        stop = min(stop, size)
    length = normalize_dim(sympy.ceiling((sympy.sympify(stop) - start) / step))
    idx = _arange(cv, length, start, step, "i64")
    return cv.g.gather(x, idx, axis=axis)


def _arange(cv, length: Dim, start: Any, step: Any, dtype: str) -> Tensor:
    """[start, start+step, ...] of `length` elements (a symbolic length through tg.iota)."""
    if isinstance(length, int) and not isinstance(start, sympy.Expr) and not isinstance(step, sympy.Expr):
        values = np.asarray(start, dtype=np.float64 if dtypes.is_float(dtype) else np.int64) + \
            np.asarray(step) * np.arange(length)
        return cv.const(values, dtype)
    idx = cv.g.op("iota", result=TensorInfo((length,), "i64"), axis=0)  # exact in i64
    idx = cv.g.cast(idx, dtype)
    if step != 1:
        idx = idx * cv.operand(step, dtype)
    if start != 0:
        idx = idx + cv.operand(start, dtype)
    return idx


@converts("slice.Tensor")
def _slice(cv, node, a):
    x = a.self
    if isinstance(a.end, sympy.Symbol) and a.end.name in cv.run_time_values and a.start in (0, None) \
            and a.step == 1:  # x[:n] with n from .item(): a run-time length (torch names the clamped size anew)
        axis = _axis(a.dim, x.rank)
        return cv.g.op("narrow", x, cv.run_time_values[a.end.name], axis=axis,
                       size=_run_time_size(cv, node.meta["val"].shape[axis]))
    return _slice_axis(cv, x, _axis(a.dim, x.rank), a.start, a.end, a.step)


@converts("narrow.default")
def _narrow(cv, node, a):
    x = a.self
    return _slice_axis(cv, x, _axis(a.dim, x.rank), a.start, normalize_dim(a.start + a.length), 1)


@converts("select.int")
def _select(cv, node, a):
    x = a.self
    axis, i = _axis(a.dim, x.rank), a.index
    if isinstance(i, int) and i < 0 and isinstance(x.shape[axis], int):
        i += x.shape[axis]
    end = TO_END if i == -1 else normalize_dim(i + 1)
    return cv.g.reshape(_slice_axis(cv, x, axis, i, end, 1), cv.meta_shape(node))


@converts("index_select.default")
def _index_select(cv, node, a):
    x = a.self
    return cv.g.gather(x, a.index, axis=_axis(a.dim, x.rank))


@converts("index.Tensor", "index.Tensor_hacked_twin", "_unsafe_index.Tensor", "_unsafe_index.Tensor_hacked_twin")
def _index(cv, node, a):
    """x[..., i, j, ...] with integer index tensors: one gather on the indexed dims flattened."""
    x = a.self
    given = [(d, t) for d, t in enumerate(a.indices) if t is not None]
    if any(t.dtype == "i1" for _, t in given):
        if len(given) != 1:
            raise FrontendError("a boolean mask together with other index tensors (x[mask, i])")
        (axis, mask), = given
        return _masked_rows(cv, x, mask, axis, _run_time_size(cv, node.meta["val"].shape[axis]))
    if len(given) == 1:
        (axis, idx), = given
        return cv.g.gather(x, idx, axis=axis)  # np.take counts negative indices from the end, as torch
    axes = [d for d, _ in given]
    if axes != list(range(axes[0], axes[0] + len(axes))):
        # Index tensors apart from each other: torch puts the indexed dims first.
        x = cv.g.transpose(x, axes + [d for d in range(x.rank) if d not in axes])
        axes = list(range(len(axes)))
    sizes = [x.shape[d] for d in axes]
    flat_index = None  # row-major position in the indexed dims; index tensors broadcast together
    for size, (_, idx) in zip(sizes, given):
        n = cv.operand(size, "i64")  # a symbolic size becomes a computed value
        idx = cv.g.mod(cv.g.cast(idx, "i64"), n)  # negative indices count from the end
        flat_index = idx if flat_index is None else flat_index * n + idx
    first = axes[0]
    flat = cv.g.reshape(x, x.shape[:first] + (numel(sizes),) + x.shape[first + len(axes):])
    return cv.g.gather(flat, flat_index, axis=first)


@converts("index_put.default", "_unsafe_index_put.default", "index_put.hacked_twin",
          "_unsafe_index_put.hacked_twin")
def _index_put(cv, node, a):
    """x[i, j] = v (or += with accumulate): a scatter_nd; x[bool_mask] = one value: a where."""
    x, values = a.self, cv.g.cast(a["values"], a.self.dtype)
    indices = list(a.indices)
    while indices and indices[-1] is None:
        indices.pop()
    if not indices or any(t is None for t in indices):
        raise FrontendError("index assignment needs index tensors on the leading dims (x[i, j] = v)")
    if indices[0].dtype == "i1":
        (mask,) = indices if len(indices) == 1 else (None,)
        if mask is None or a.accumulate or numel(values.shape) != 1:
            raise FrontendError("boolean-mask assignment is supported as x[mask] = one value only")
        mask = cv.g.reshape(mask, mask.shape + (1,) * (x.rank - mask.rank))  # a mask over leading dims
        return cv.g.where(mask, cv.g.reshape(values, ()), x)
    # scatter_nd takes the index tuples stacked on a last axis: (*batch, k).
    k = len(indices)
    batch = broadcast_shapes(*(t.shape for t in indices))
    stacked = cv.g.concat([cv.g.reshape(cv.g.broadcast(cv.g.cast(t, "i64"), batch), batch + (1,)) for t in indices],
                          axis=len(batch))
    updates = cv.g.broadcast(values, batch + x.shape[k:])
    return cv.g.scatter_nd(x, stacked, updates, reduction="add" if a.accumulate else "none")


_SCATTER_REDUCE = {"sum": "add", "add": "add", "prod": "mul", "multiply": "mul", "amax": "max", "amin": "min"}


@converts("scatter.src", "scatter.value", "scatter.reduce", "scatter.value_reduce", "scatter_add.default",
          "scatter_reduce.two")
def _scatter(cv, node, a):
    x, index = a.self, a.index
    axis = _axis(a.dim, x.rank)
    name = str(node.target)
    reduce = "add" if "scatter_add" in name else a.get("reduce")
    if reduce is not None and (reduce not in _SCATTER_REDUCE or a.get("include_self") is False):
        raise FrontendError(f"scatter reduce='{reduce}'" + (" without include_self" if a.get("include_self") is False
                                                             else "") + " is not supported")
    src = a.get("src", a.get("value"))
    if isinstance(src, Tensor):
        # torch reads src where index points from, like gather: src may be larger.
        src = cv.g.cast(src, x.dtype)
        for d in range(x.rank):
            if not _same_dim(src.shape[d], index.shape[d]):
                src = _slice_axis(cv, src, d, 0, index.shape[d], 1)
    else:
        src = cv.g.broadcast(cv.const(src, x.dtype), index.shape)
    return cv.g.scatter_elements(x, index, src, axis=axis,
                                 reduction=_SCATTER_REDUCE[reduce] if reduce else "none")


def _scatter_slice(cv, x, src, axis, start, end):
    """x with x[start:end] on `axis` replaced by src (step 1): a concat of three pieces."""
    size = x.shape[axis]
    start = 0 if start is None else start
    end = TO_END if end is None or (isinstance(end, int) and end >= BIG) else end
    if isinstance(size, int):
        start, end = (v + size if isinstance(v, int) and v < 0 else v for v in (start, end))
        end = min(end, size) if isinstance(end, int) else end
    if not isinstance(start, int) or not isinstance(end, int) or start < 0 or end < 0:
        raise FrontendError(f"slice_scatter bounds [{start}:{end}] on dim {size}")
    parts = [cv.g.slice(x, [0], [start], axes=[axis])] if start > 0 else []
    parts.append(cv.g.cast(src, x.dtype))
    if end != TO_END and not (isinstance(size, int) and end >= size):
        parts.append(cv.g.slice(x, [end], [TO_END], axes=[axis]))
    return parts[0] if len(parts) == 1 else cv.g.concat(parts, axis=axis)


@converts("slice_scatter.default")
def _slice_scatter(cv, node, a):
    x = a.self
    if a.step != 1:
        raise FrontendError(f"slice_scatter with step {a.step}")
    return _scatter_slice(cv, x, a.src, _axis(a.dim, x.rank), a.start, a.end)


@converts("select_scatter.default")
def _select_scatter(cv, node, a):
    x = a.self
    axis = _axis(a.dim, x.rank)
    src = cv.g.reshape(a.src, a.src.shape[:axis] + (1,) + a.src.shape[axis:])
    i = a.index
    end = TO_END if i == -1 else normalize_dim(i + 1)
    return _scatter_slice(cv, x, src, axis, i, end)


@converts("gather.default")
def _gather(cv, node, a):
    x, idx = a.self, a.index
    axis = _axis(a.dim, x.rank)
    # torch lets the index be shorter than the input off the gather axis; the
    # elements it reads are then those of the leading corner.
    for d in range(x.rank):
        if d != axis and not _same_dim(x.shape[d], idx.shape[d]):
            x = _slice_axis(cv, x, d, 0, idx.shape[d], 1)
    return cv.g.gather_elements(x, idx, axis=axis)


@converts("repeat.default")
def _repeat(cv, node, a):
    x, reps = a.self, list(a.repeats)
    if len(reps) > x.rank:
        x = cv.g.reshape(x, (1,) * (len(reps) - x.rank) + x.shape)
    return cv.g.tile(x, repeats=reps)


@converts("flip.default")
def _flip(cv, node, a):
    x = a.self
    axes = _axes(a.dims, x.rank)
    return cv.g.slice(x, [-1] * len(axes), [-TO_END - 1] * len(axes), axes=axes, steps=[-1] * len(axes))


def _torch_pads(cv, x, pad, mode, value):
    """torch's pad list (last dim first, (begin, end) pairs) as tg.pad; negatives crop."""
    n = len(pad) // 2
    begins, ends = [0] * x.rank, [0] * x.rank
    for i in range(n):
        begins[x.rank - 1 - i], ends[x.rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    grow = [max(p, 0) for p in begins] + [max(p, 0) for p in ends]
    y = cv.g.pad(x, grow, mode=mode, value=float(value or 0.0)) if any(grow) else x
    for axis in range(x.rank):
        if begins[axis] < 0 or ends[axis] < 0:
            y = _slice_axis(cv, y, axis, max(-begins[axis], 0), -ends[axis] if ends[axis] < 0 else TO_END, 1)
    return y


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


@converts("constant_pad_nd.default")
def _constant_pad(cv, node, a):
    return _torch_pads(cv, a.self, list(a.pad), "constant", a.value)


@converts("pad.default")
def _pad(cv, node, a):
    if a.mode not in _PAD_MODES:
        raise FrontendError(f"pad mode '{a.mode}' is not supported")
    return _torch_pads(cv, a.self, list(a.pad), _PAD_MODES[a.mode], a.value)


@converts("reflection_pad1d.default", "reflection_pad2d.default", "reflection_pad3d.default",
          "replication_pad1d.default", "replication_pad2d.default", "replication_pad3d.default")
def _mode_pad(cv, node, a):
    mode = "reflect" if "reflection" in str(node.target) else "edge"
    return _torch_pads(cv, a.self, list(a.padding), mode, 0.0)


@converts("tril.default", "triu.default")
def _trilu(cv, node, a):
    return cv.g.trilu(a.self, k=a.diagonal, upper="triu" in str(node.target))


# mixture of experts -----------------------------------------------------------------------


@converts("histc.default")
def _histc(cv, node, a):
    """Counts of values per equal-width bin of [min, max] (the last bin closed), values outside
    ignored: one comparison against every bin, summed. The bins are static; MoE routing counts
    the tokens sent to each expert with it."""
    x, bins = a.self, int(a.get("bins", 100))
    lo, hi = float(a.get("min", 0)), float(a.get("max", 0))
    if not hi > lo:
        raise FrontendError(f"histc over [{lo}, {hi}]: a range taken from the data is not supported")
    g, dt = cv.g, x.dtype
    const = lambda v: g.constant(np.asarray(v, dtypes.numpy_dtype(dt)))  # noqa: E731
    flat = g.reshape(x, (numel(x.shape),))
    index = g.op("floor", (flat - lo) * (bins / (hi - lo)))
    index = g.where(g.op("eq", flat, const(hi)), const(bins - 1), index)
    inside = g.op("and", flat >= lo, flat <= hi)
    index = g.where(inside, index, const(-1))
    hits = g.op("eq", g.reshape(index, (flat.shape[0], 1)), g.constant(np.arange(bins, dtype=dtypes.numpy_dtype(dt))))
    return g.sum(g.cast(hits, dt), axes=(0,))


def _grouped_mm(cv, node, a):
    """transformers' grouped_mm_fallback: rows sorted by expert, offs the cumulative row count of
    each expert; row s is multiplied by the weight of the expert whose range holds s (rows past
    the last offset are zero). Each row gathers its own expert's weight, so the work is that of
    the experts actually chosen, one row-matmul per routed token."""
    g, x, w, offs = cv.g, a.input, a.weight, a.offs
    rows, experts = x.shape[0], w.shape[0]
    row = g.op("iota", result=TensorInfo((rows, 1), offs.dtype), axis=0)
    expert = g.sum(g.cast(g.op("ge", row, g.reshape(offs, (1, experts))), "i64"), axes=(1,))  # (rows,)
    used = g.cast(g.op("lt", expert, g.constant(np.asarray(experts, np.int64))), x.dtype)
    chosen = g.gather(w, g.op("min", expert, g.constant(np.asarray(experts - 1, np.int64))), axis=0)
    out = g.reshape(g.matmul(g.reshape(x, (rows, 1, x.shape[1])), chosen), (rows, w.shape[2]))
    return out * g.reshape(used, (rows, 1))


CONVERTERS["transformers.grouped_mm_fallback.default"] = _grouped_mm


# creation ------------------------------------------------------------------------------


def _filled(cv, node, value):
    """A tensor of torch's result shape and dtype filled with one value: a broadcast scalar."""
    dt, shape = cv.meta_dtype(node), cv.meta_shape(node)
    scalar = cv.operand(value, dt)
    return scalar if len(shape) == 0 else cv.g.broadcast(scalar, shape)


@converts("zeros.default", "zeros_like.default", "new_zeros.default", "empty.memory_format", "empty_like.default",
          "new_empty.default", "empty_strided.default", "new_empty_strided.default", "empty_permuted.default")
def _zeros(cv, node, a):
    return _filled(cv, node, 0)  # torch leaves empty() uninitialized: any value is right, 0 is stable


@converts("ones.default", "ones_like.default", "new_ones.default")
def _ones(cv, node, a):
    return _filled(cv, node, 1)


@converts("full.default", "full_like.default", "new_full.default", "fill.Scalar", "fill.Tensor")
def _full(cv, node, a):
    return _filled(cv, node, a.get("fill_value", a.get("value")))


@converts("scalar_tensor.default")
def _scalar_tensor(cv, node, a):
    return cv.operand(a.s, cv.meta_dtype(node))


@converts("arange.default", "arange.start", "arange.start_step")
def _arange_op(cv, node, a):
    (length,) = cv.meta_shape(node)
    start = a.get("start", 0)
    step = a.get("step", 1)
    return _arange(cv, length, start, step, cv.meta_dtype(node))


# --- data-dependent sizes --------------------------------------------------------------------
# torch.export names a size known only at run time with an unbacked symbol (u0) in the node's
# metadata and checks its range with _assert_scalar / sym_constrain_range_for_size (skipped:
# tg's ops keep their sizes in range by construction, narrow clamps). The converter of the op
# that makes the size gives its symbol a tg name, and the tg op that defines it (ir/ops.py,
# "data-dependent sizes") carries that name; later metadata holding u0 then reads as that symbol.


def _run_time_size(cv, d: Any) -> str:
    """The tg name of torch's unbacked size d (a SymInt that is one symbol), made on first use."""
    e = sympy.sympify(d.node.expr if isinstance(d, torch.SymInt) else d)
    if not e.is_Symbol:
        raise FrontendError(f"a data-dependent size {e} that is not one symbol")
    if e not in cv.symbols:
        taken = {s.name for s in cv.symbols.values()}
        name = _identifier(str(e))
        while name in taken or name in _RESERVED:
            name += "_"
        cv.symbols[e] = symbol(name)
    return cv.symbols[e].name


def _masked_rows(cv, x: Tensor, mask: Tensor, axis: int, size: str) -> Tensor:
    """x[..., mask] where mask covers dims axis.. of x: those dims flattened, the rows of the
    nonzero mask entries gathered (row-major order, as torch)."""
    dims = x.shape[axis:axis + mask.rank]
    if len(dims) != mask.rank or not all(dims_equal(a, b) for a, b in zip(dims, mask.shape)):
        raise FrontendError(f"mask {mask.info} does not cover dims {axis}.. of {x.info}")
    flat = cv.g.reshape(x, x.shape[:axis] + (numel(dims),) + x.shape[axis + mask.rank:])
    rows = cv.g.op("nonzero", cv.g.reshape(mask, (numel(mask.shape),)), size=size)
    return cv.g.gather(flat, cv.g.reshape(rows, (symbol(size),)), axis=axis)


@converts("nonzero.default")
def _nonzero(cv, node, a):
    x = a.self
    mask = x if x.dtype == "i1" else cv.g.op("ne", x, cv.const(0, x.dtype))
    return cv.g.transpose(cv.g.op("nonzero", mask, size=_run_time_size(cv, node.meta["val"].shape[0])), [1, 0])


@converts("masked_select.default")
def _masked_select(cv, node, a):
    shape = broadcast_shapes(a.self.shape, a.mask.shape)
    x, mask = cv.g.broadcast(a.self, shape), cv.g.broadcast(a.mask, shape)
    return _masked_rows(cv, cv.g.reshape(x, (numel(shape),)), cv.g.reshape(mask, (numel(shape),)), 0,
                        _run_time_size(cv, node.meta["val"].shape[0]))


@converts("_unique2.default", "unique_dim.default")
def _unique(cv, node, a):
    """torch.unique (always sorted on CPU): values, inverse indices shaped as the input, counts."""
    x = a.self
    flatten = "dim" not in a
    axis = 0 if flatten else _axis(a.dim, x.rank)
    values = node.meta["val"][0]
    size = _run_time_size(cv, values.shape[axis])
    out, _first, inverse, counts = cv.g.op("unique", x, size=size, flatten=flatten, axis=axis)
    return out, cv.g.reshape(inverse, x.shape if flatten else (x.shape[axis],)), counts


def _item(cv, node, a):
    """x.item() used as a size: its symbol, with the tensor that holds it at run time."""
    x = a.self
    if not dtypes.is_int(x.dtype) or numel(x.shape) != 1:
        raise FrontendError(f".item() of {x.info} used as a size: only an integer of one element can be")
    name = _run_time_size(cv, node.meta["val"])
    cv.run_time_values[name] = cv.g.cast(cv.g.reshape(x, ()), "i64")
    return symbol(name)


RUN_TIME_SCALARS = {"aten.item.default": _item, "aten._local_scalar_dense.default": _item}


def _topk_run_time_k(cv, node, a):
    """topk with k from .item(): the whole axis sorted, then both results narrowed to k."""
    x = a.self
    axis = _axis(a.dim, x.rank)
    if not isinstance(x.shape[axis], int):
        raise FrontendError(f"topk with a run-time k over symbolic dim {axis} of {x.info}")
    k = cv.run_time_values[a.k.name]
    full = cv.g.topk(x, k=x.shape[axis], axis=axis, largest=a.largest)
    return tuple(cv.g.op("narrow", t, k, axis=axis, size=a.k.name) for t in full)
