"""The NumPy code generator: one readable Python module per model.

What it decides and how:

* Each tg op becomes one line, `name = <expression>  # type`, where the
  expression is the op's NumPy template from the op table (`ir.ops.render`) in
  the model's own dtypes — the same text the float64 interpreter evaluates, so
  there is no second description of any op here.
* Weights are bound once, by readable local names, in `build(W)`; small
  constants are hoisted to module-level arrays; `build` returns `forward`, whose
  parameters are the model inputs and which first binds the symbolic dims from
  the input shapes (`B = input_ids.shape[0]`) that shape expressions use.
* A value is `del`eted right after its last use (`liveness`), so peak memory
  follows the graph, not its length. The plan is its own function because buffer
  reuse (`out=`) will be planned from the same facts.
* The module also carries its signature (`INPUTS`, `OUTPUTS`, `WEIGHTS`) as data,
  so `backends.numpy.runtime.load` needs only the source and the weights.

An op holding one region whose block takes the op's operands and ends in a
terminator yielding its results (a fusion group) is emitted inline, op by op.
"""

from __future__ import annotations

import builtins
import keyword
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import sympy
from xdsl.dialects.func import ReturnOp
from xdsl.ir import Operation, SSAValue

from ir import dtypes
from ir.dialect import TgOp
from ir.interpreter import SHAPE_FUNCTIONS, dtype_code, shape_code
from ir.model import Model, ModelError
from ir.ops import py_literal, render
from ir.shapes import Dim, TensorInfo

# Names the generated module defines or imports; nothing else may take them.
MODULE_NAMES = {"np", "ml_dtypes", "K", "W", "build", "forward", "INPUTS", "OUTPUTS", "WEIGHTS", *SHAPE_FUNCTIONS}
RESERVED = MODULE_NAMES | set(keyword.kwlist) | set(dir(builtins))
# Op categories whose NumPy code cannot raise a floating-point warning (they move
# or name data, never compute on it); a body of only these needs no np.errstate.
SILENT_CATEGORIES = {"layout", "source"}
INDENT = "    "


def sanitize(name: str, prefix: str = "v") -> str:
    """A Python identifier close to `name`: 'encoder.layer.0.w' -> 'encoder_layer_0_w'."""
    ident = re.sub(r"[^0-9A-Za-z_]+", "_", name).strip("_") or prefix
    return f"{prefix}_{ident}" if ident[0].isdigit() else ident


class Namer:
    """Hands out distinct identifiers, none of them reserved."""

    def __init__(self, reserved: set[str]):
        self.used = set(reserved)

    def fresh(self, base: str, prefix: str = "v") -> str:
        base = sanitize(base, prefix)
        name, i = base, 1
        while name in self.used:
            name, i = f"{base}_{i}", i + 1
        self.used.add(name)
        return name


class Code(str):
    """Python source that `py_literal` must insert as is (a hoisted array's name)."""

    def __repr__(self) -> str:
        return str(self)


@dataclass
class Program:
    """The model flattened to the ops that compute, with values renamed through regions."""

    steps: list[TgOp]
    outputs: list[SSAValue]
    alias: dict[SSAValue, SSAValue] = field(default_factory=dict)

    def canon(self, v: SSAValue) -> SSAValue:
        while v in self.alias:
            v = self.alias[v]
        return v


def flatten(model: Model) -> Program:
    prog = Program([], [])

    def walk(ops) -> list[SSAValue] | None:
        for op in ops:
            if isinstance(op, ReturnOp):
                return list(op.operands)
            if isinstance(op, TgOp):
                prog.steps.append(op)
            elif len(op.regions) == 1 and len(op.regions[0].blocks) == 1:
                block = op.regions[0].blocks[0]
                body = list(block.ops)
                if len(block.args) != len(op.operands) or not body or len(body[-1].operands) != len(op.results):
                    raise ModelError(f"the NumPy backend cannot emit {op.name}: its region does not map "
                                     "operands to block arguments and results to the terminator")
                prog.alias.update(zip(block.args, op.operands))
                walk(body[:-1])
                prog.alias.update(zip(op.results, body[-1].operands))
            elif not _is_terminator(op):
                raise ModelError(f"the NumPy backend cannot emit {op.name}")
        return None

    outputs = walk(model.func.body.block.ops)
    if outputs is None:
        raise ModelError("@forward has no func.return")
    prog.outputs = outputs
    return prog


def _is_terminator(op: Operation) -> bool:
    return op.parent_block() is not None and op is op.parent_block().last_op and not op.results


def liveness(steps: Sequence[TgOp], outputs: Sequence[SSAValue], canon=lambda v: v) -> list[list[SSAValue]]:
    """For each step, the computed values that are dead once it has run.

    A value dies at its last use (or at its definition, if nothing uses it);
    outputs never die. Only results of computing ops are listed: inputs belong to
    the caller, weights and constants to the compiled module.
    """
    last: dict[SSAValue, int] = {}
    computed: list[SSAValue] = []
    for i, op in enumerate(steps):
        for v in op.operands:
            last[canon(v)] = i
        if op.op_name not in ("weight", "constant"):
            for r in op.results:
                last[r] = i
                computed.append(r)
    keep = {canon(v) for v in outputs}
    dies: list[list[SSAValue]] = [[] for _ in steps]
    for v in computed:
        if v not in keep:
            dies[last[v]].append(v)
    return dies


def emit(model: Model, name: str | None = None) -> str:
    """The Python source of a module computing `model` with NumPy (see the module docstring)."""
    return _Emitter(model, name).source()


class _Emitter:
    def __init__(self, model: Model, name: str | None):
        self.model = model
        self.name = name or _model_name(model)
        self.prog = flatten(model)
        self.names: dict[SSAValue, str] = {}
        self.namer = Namer(RESERVED)
        self.symbols = self._bind_symbols()
        self.constants: list[str] = []  # module-level lines
        self._constant_names: dict[tuple, str] = {}
        self.weight_lines: list[str] = []
        self._weight_names: dict[str, str] = {}

    # --- names ----------------------------------------------------------------

    def _bind_symbols(self) -> dict[str, tuple[str, str, int]]:
        """symbol -> (its variable, the input variable, axis) for every symbolic dim."""
        m = self.model
        plain: dict[str, tuple[int, int]] = {}
        for i, info in enumerate(m.inputs):
            for axis, d in enumerate(info.shape):
                if isinstance(d, sympy.Symbol):
                    plain.setdefault(d.name, (i, axis))
        used = {s.name for info in m.inputs for d in info.shape if isinstance(d, sympy.Expr) for s in d.free_symbols}
        for op in self.prog.steps:
            for info in op.result_infos():
                used |= {s.name for d in info.shape if isinstance(d, sympy.Expr) for s in d.free_symbols}
        unbound = sorted(used - set(plain))
        if unbound:
            raise ModelError(f"symbolic dims {', '.join(unbound)} are not the size of any input dimension; "
                             "the NumPy backend binds each symbol from an input's shape")
        # Symbols keep their own name where they can (shape code is written in them).
        self.symbol_vars = {s: self.namer.fresh(s, "dim") for s in sorted(plain)}
        for i, (arg, name) in enumerate(zip(m.func.args, m.input_names)):
            self.names[arg] = self.namer.fresh(name, "input")
        return {s: (self.symbol_vars[s], self.names[m.func.args[i]], axis) for s, (i, axis) in plain.items()}

    def _dims(self, shape: Sequence[Dim]) -> str:
        renamed = {sympy.Symbol(s, integer=True, positive=True): sympy.Symbol(v, integer=True, positive=True)
                   for s, v in self.symbol_vars.items() if s != v}
        if renamed:
            shape = [d.xreplace(renamed) if isinstance(d, sympy.Expr) else d for d in shape]
        return shape_code(shape)

    def _value(self, v: SSAValue) -> str:
        return self.names[self.prog.canon(v)]

    # --- sources --------------------------------------------------------------

    def _constant(self, array: np.ndarray, dtype: str) -> str:
        key = (dtype, array.shape, array.tobytes())
        if key not in self._constant_names:
            name = self.namer.fresh(f"c{len(self._constant_names)}")
            self._constant_names[key] = name
            self.constants.append(f"{name} = np.array({_array_literal(array, dtype)}, dtype={dtype_code(dtype)})")
        return self._constant_names[key]

    def _weight(self, weight_name: str) -> str:
        if weight_name not in self._weight_names:
            var = self.namer.fresh(weight_name, "w")
            self._weight_names[weight_name] = var
            self.weight_lines.append(f"{var} = W[{_str_literal(weight_name)}]")
        return self._weight_names[weight_name]

    # --- ops ------------------------------------------------------------------

    def _result_names(self, op: TgOp, counts: Counter) -> list[str]:
        base = f"{op.op_name}_{counts[op.op_name]}"
        counts[op.op_name] += 1
        if len(op.results) == 1:
            return [self.namer.fresh(base)]
        return [self.namer.fresh(f"{base}_{i}") for i in range(len(op.results))]

    def _attrs(self, op: TgOp) -> dict[str, Any]:
        attrs = op.py_attrs()
        for k, v in attrs.items():
            if isinstance(v, np.ndarray):  # a dense attribute: hoisted, passed by name
                info = TensorInfo(tuple(v.shape), dtypes.dtype_name(v.dtype))
                attrs[k] = Code(self._constant(v, info.dtype))
        return attrs

    def _line(self, op: TgOp, counts: Counter) -> str | None:
        outs = op.result_infos()
        if op.op_name == "weight":
            self.names[op.results[0]] = self._weight(op.attr("name"))
            return None
        if op.op_name == "constant":
            self.names[op.results[0]] = self._constant(op.attr("value"), outs[0].dtype)
            return None
        targets = self._result_names(op, counts)
        expr = render(op.SPEC, [self._value(v) for v in op.operands], self._attrs(op),
                      self._dims(outs[0].shape), dtype_code(outs[0].dtype))
        self.names.update(zip(op.results, targets))
        return f"{', '.join(targets)} = {expr}  # {', '.join(map(str, outs))}"

    # --- the module -------------------------------------------------------------

    def source(self) -> str:
        m, prog = self.model, self.prog
        dies = liveness(prog.steps, prog.outputs, prog.canon)
        counts: Counter = Counter()
        body: list[str] = []
        for op, dead in zip(prog.steps, dies):
            line = self._line(op, counts)
            if line is not None:
                body.append(line)
            if dead:
                body.append("del " + ", ".join(self.names[v] for v in dead))
        quiet = all(op.SPEC.category in SILENT_CATEGORIES for op in prog.steps)

        out = self._header()
        out += ["import numpy as np", "import ml_dtypes", "", "from ir import kernels as K"]
        shape_fns = sorted({f for f in SHAPE_FUNCTIONS if re.search(rf"\b{f}\(", "\n".join(body))})
        if shape_fns:
            out.append("from ir.interpreter import SHAPE_FUNCTIONS")
            out.append(f"{', '.join(shape_fns)} = " + ", ".join(f"SHAPE_FUNCTIONS[{f!r}]" for f in shape_fns))
        out += ["", "# The signature: (name, shape, dtype); a str dim is a symbol or an expression of symbols.",
                *_tuple("INPUTS", _signature(m.input_names, m.inputs)),
                *_tuple("OUTPUTS", _signature(m.output_names, m.outputs)),
                *_tuple("WEIGHTS", [_literal(w) for w in self._weight_names]), ""]
        if self.constants:
            out += ["# Small constants, hoisted: built once per process, shared by every call."]
            out += self.constants + [""]
        out += ["", "def build(W):", f'{INDENT}"""Bind the weights (a dict name -> array) once; returns forward."""']
        out += [INDENT + line for line in self.weight_lines]
        params = ", ".join(self.names[a] for a in m.func.args)
        out += ["", f"{INDENT}def forward({params}):"]
        for s, (var, arg, axis) in sorted(self.symbols.items()):
            out.append(f"{INDENT * 2}{var} = {arg}.shape[{axis}]")
        inner = INDENT * 2 if quiet else INDENT * 3
        if not quiet:
            # Same as the interpreter: IEEE results (inf, nan) are the semantics, not warnings.
            out.append(f'{INDENT * 2}with np.errstate(all="ignore"):')
        out += [inner + line for line in body]
        out.append(f"{inner}return [{', '.join(self._output(v) for v in prog.outputs)}]")
        out += ["", f"{INDENT}return forward", ""]
        return "\n".join(out)

    def _output(self, v: SSAValue) -> str:
        v = self.prog.canon(v)
        # An output that is, or may be a view of, an input, a weight or a constant is
        # copied, so that the caller cannot write into the module's arrays (or its
        # own inputs) through it; a computed output is returned as is.
        return f"np.array({self.names[v]})" if self._may_alias_external(v) else f"np.asarray({self.names[v]})"

    def _may_alias_external(self, v: SSAValue) -> bool:
        while True:
            owner = v.owner
            if not isinstance(owner, TgOp):
                return True  # a function argument: an input
            if owner.op_name in ("weight", "constant"):
                return True
            # Layout ops may return views of their first operand (reshape, transpose,
            # slice, broadcast); every other op computes a new array.
            if owner.SPEC.category != "layout" or not owner.operands:
                return False
            v = self.prog.canon(owner.operands[0])

    def _header(self) -> list[str]:
        m = self.model
        kinds = Counter(op.op_name for op in self.prog.steps)
        sources = kinds.pop("weight", 0), kinds.pop("constant", 0)
        lines = [f"# tilegraph NumPy backend: model {self.name!r}. Generated code; edit the model, not this file.",
                 "# inputs:"]
        lines += [f"#   {n}: {info}" for n, info in zip(m.input_names, m.inputs)]
        lines += ["# outputs:"]
        lines += [f"#   {n}: {info}" for n, info in zip(m.output_names, m.outputs)]
        lines.append(f"# {sum(kinds.values())} ops ({', '.join(f'{n} {k}' for k, n in kinds.most_common())}), "
                     f"{_count(sources[0], 'weight')}, {_count(sources[1], 'constant')}")
        lines.append("# use: forward = build(ir.model.WeightStore.load('<model>.weights.npz')); outputs = forward(*inputs)")
        return lines + [""]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _str_literal(s: str) -> str:
    """A string literal in double quotes where that is plain (weight names), else repr."""
    return f'"{s}"' if s.isprintable() and '"' not in s and "\\" not in s else repr(s)


def _model_name(model: Model) -> str:
    name = getattr(model.module, "sym_name", None)
    return name.data if name is not None else "forward"


def _signature(names: Sequence[str], infos: Sequence[TensorInfo]) -> list[str]:
    return [_literal((n, tuple(d if isinstance(d, int) else str(d) for d in info.shape), info.dtype))
            for n, info in zip(names, infos)]


def _literal(v: Any) -> str:
    """Python source for a str/int/tuple value, strings in double quotes where plain."""
    if isinstance(v, str):
        return _str_literal(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(map(_literal, v)) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


# A module-level tuple longer than this is written one item per line.
LINE_WIDTH = 100


def _tuple(name: str, items: Sequence[str]) -> list[str]:
    one_line = f"{name} = (" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if len(one_line) <= LINE_WIDTH:
        return [one_line]
    return [f"{name} = ("] + [f"{INDENT}{item}," for item in items] + [")"]


def _array_literal(array: np.ndarray, dtype: str) -> str:
    """Exact Python source for the values of a small array (nested lists; nan/inf by name)."""
    if dtypes.is_float(dtype):
        values = np.asarray(array, dtype=np.float64)  # every float dtype widens exactly
        scalar = lambda x: py_literal(float(x))  # noqa: E731
    elif dtype == "i1":
        values, scalar = np.asarray(array, dtype=bool), lambda x: repr(bool(x))  # noqa: E731
    else:
        values, scalar = np.asarray(array), lambda x: repr(int(x))  # noqa: E731

    def lit(a):
        if a.ndim == 0:
            return scalar(a)
        return "[" + ", ".join(lit(x) for x in a) + "]"

    return lit(values)


__all__ = ["emit", "liveness", "flatten", "sanitize", "Namer", "Program"]
