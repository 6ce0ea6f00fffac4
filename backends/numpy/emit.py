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
  follows the graph, not its length.
* The module also carries its signature (`INPUTS`, `OUTPUTS`, `WEIGHTS`) as data,
  so `backends.numpy.runtime.load` needs only the source and the weights.
* A `tg.fusion` group becomes one function (`backends/numpy/groups.py`), called
  with the buffers it writes; `BufferPlan` decides which buffers are new and which
  reuse a dead one, and `PLAN` in the module records kernels, buffers and the
  planned peak of intermediates. While a model with groups runs, BLAS is pinned to
  one thread: the groups parallelise GEMM rows themselves (`chunks.py`).
* `emit(model, profile=True)` times every kernel into the module's `PROFILE`.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Sequence

import numpy as np
import sympy
from xdsl.ir import Operation, SSAValue

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.interpreter import SHAPE_FUNCTIONS, dtype_code, shape_code
from tilegraph.ir.model import Model, ModelError
from tilegraph.ir.ops import Op, OPS, render, size_definitions
from tilegraph.ir.shapes import Dim, TensorInfo, dims_equal, info_of, numel
from tilegraph.backends.lowering import table
from tilegraph.backends.numpy.groups import GroupCode, GroupEmitter
from tilegraph.backends.program import (PYTHON_RESERVED, Namer, Program, array_literal, flatten, liveness,  # noqa: F401
                              literal, py_comment, sanitize, signature_rows, str_literal, tuple_lines)

# Names the generated module defines or imports; nothing else may take them.
MODULE_NAMES = {"np", "ml_dtypes", "K", "W", "build", "forward", "INPUTS", "OUTPUTS", "WEIGHTS", *SHAPE_FUNCTIONS,
                "THREADS", "blas_threads", "run_chunks", "single_threaded_blas", "attention_tiled"}
# A fused group's body is `def chunk(s)`: a value named `s` or `chunk` there would be shadowed
# (an ONNX BatchNormalization's scale input named "s" was).
RESERVED = MODULE_NAMES | PYTHON_RESERVED | {"chunk", "s"}
# Op categories whose NumPy code cannot raise a floating-point warning (they move
# or name data, never compute on it); a body of only these needs no np.errstate.
SILENT_CATEGORIES = {"layout", "source"}
# The lowering table (backends/lowering.py): every op is its NumPy template in ir/ops.py.
LOWERINGS = table(template=[name for name, spec in OPS.items() if spec.numpy])
INDENT = "    "


class Code(str):
    """Python source that `py_literal` must insert as is (a hoisted array's name)."""

    def __repr__(self) -> str:
        return str(self)



def emit(model: Model, name: str | None = None, profile: bool = False) -> str:
    """The Python source of a module computing `model` with NumPy (see the module docstring).

    `profile=True` times every kernel (fused group or unfused op): the module's
    `PROFILE` dict maps each kernel's name to its accumulated seconds and calls, and
    `KERNELS` to what it computes (the cost model's accuracy is measured on these).
    """
    return _Emitter(model, name, profile).source()


def emit_profiled(model: Model, name: str | None = None) -> tuple[str, dict[str, Operation]]:
    """`emit(model, profile=True)`, and which op or group each name in its PROFILE runs."""
    emitter = _Emitter(model, name, profile=True)
    return emitter.source(), emitter.kernel_ops


class _Emitter:
    def __init__(self, model: Model, name: str | None, profile: bool = False):
        self.model = model
        self.profile = profile
        self.kernel_names: list[str] = []  # (profile) in program order
        self.kernel_ops: dict[str, Operation] = {}  # (profile) kernel name -> the tg op or tg.fusion it runs
        self.name = name or _model_name(model)
        self.prog = flatten(model)
        self.names: dict[SSAValue, str] = {}
        self.namer = Namer(RESERVED)
        self.symbols = self._bind_symbols()
        self.constants: list[str] = []  # module-level lines
        self._constant_names: dict[tuple, str] = {}
        self.weight_lines: list[str] = []
        self._weight_names: dict[str, str] = {}
        self.group_functions: list[list[str]] = []
        self._concatenated: dict[tuple, str] = {}

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
            for info in (info_of(r.type) for r in op.results):
                used |= {s.name for d in info.shape if isinstance(d, sympy.Expr) for s in d.free_symbols}
        # Dims known only at run time (tg.nonzero's count...): bound right after the op defining them.
        self.defined = {name for op in self.prog.steps for _, _, name in size_definitions(op)}
        unbound = sorted(used - set(plain) - self.defined)
        if unbound:
            raise ModelError(f"symbolic dims {', '.join(unbound)} are not the size of any input dimension; "
                             "the NumPy backend binds each symbol from an input's shape")
        # Symbols keep their own name where they can (shape code is written in them).
        self.symbol_vars = {s: self.namer.fresh(s, "dim") for s in sorted(set(plain) | self.defined)}
        for i, (arg, name) in enumerate(zip(m.func.args, m.input_names)):  # noqa: B007
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
            self.constants.append(f"{name} = np.array({array_literal(array, dtype)}, dtype={dtype_code(dtype)})")
        return self._constant_names[key]

    def _weight(self, weight_name: str) -> str:
        if weight_name not in self._weight_names:
            var = self.namer.fresh(weight_name, "w")
            self._weight_names[weight_name] = var
            self.weight_lines.append(f"{var} = W[{str_literal(weight_name)}]")
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
        if op.op_name == Op.weight:
            self.names[op.results[0]] = self._weight(op.attr("name"))
            return None
        if op.op_name == Op.constant:
            self.names[op.results[0]] = self._constant(op.attr("value"), outs[0].dtype)
            return None
        targets = self._result_names(op, counts)
        expr = render(op.SPEC, [self._value(v) for v in op.operands], self._attrs(op),
                      self._dims(outs[0].shape), dtype_code(outs[0].dtype))
        self.names.update(zip(op.results, targets))
        return f"{', '.join(targets)} = {expr}  # {py_comment(', '.join(map(str, outs)))}"

    # --- the module -------------------------------------------------------------

    def source(self) -> str:
        m, prog = self.model, self.prog
        dies = liveness(prog.steps, prog.outputs, prog.canon)
        plan = BufferPlan(self, dies)
        counts: Counter = Counter()
        body: list[str] = []
        for i, (op, dead) in enumerate(zip(prog.steps, dies)):
            if isinstance(op, FusionOp):
                body += self._timed(self._group_call(op, counts, plan, i), op)
            else:
                line = self._line(op, counts)
                if line is not None:
                    body += self._timed([line], op) if op.SPEC.category not in SILENT_CATEGORIES else [line]
                body += [f"{self.symbol_vars[name]} = {self.names[op.results[r]]}.shape[{axis}]  # known only now"
                         for r, axis, name in size_definitions(op)]
            if dead:
                body.append("del " + ", ".join(self.names[v] for v in dead))
            plan.step_done(i)
        quiet = all(not isinstance(op, FusionOp) and op.SPEC.category in SILENT_CATEGORIES for op in prog.steps)

        out = self._header()
        out += ["import numpy as np", "import ml_dtypes", "", "from tilegraph.ir import kernels as K"]
        if self.profile:
            out += ["from time import perf_counter", "", "# kernel -> [seconds, calls], accumulated over calls",
                    f"PROFILE = {{name: [0.0, 0] for name in {self.kernel_names!r}}}"]
        if self.group_functions:
            out.append("from tilegraph.backends.numpy.chunks import THREADS, blas_threads, run_chunks, single_threaded_blas")
        if any(re.search(r"\battention_tiled\(", line) for function in self.group_functions for line in function):
            out.append("from tilegraph.backends.numpy.attention import attention_tiled")
        shape_fns = sorted({f for f in SHAPE_FUNCTIONS if re.search(rf"\b{f}\(", "\n".join(body))})
        if shape_fns:
            out.append("from tilegraph.ir.interpreter import SHAPE_FUNCTIONS")
            out.append(f"{', '.join(shape_fns)} = " + ", ".join(f"SHAPE_FUNCTIONS[{f!r}]" for f in shape_fns))
        out += ["", "# The signature: (name, shape, dtype); a str dim is a symbol or an expression of symbols.",
                *tuple_lines("INPUTS", signature_rows(m.input_names, m.inputs)),
                *tuple_lines("OUTPUTS", signature_rows(m.output_names, m.outputs)),
                *tuple_lines("WEIGHTS", [literal(w) for w in self._weight_names]),
                "# What the memory planner decided (intermediates; inputs and weights not counted).",
                f"PLAN = {{'kernels': {plan.kernels}, 'buffers': {len(plan.slots)}, "
                f"'peak_bytes': {str(plan.peak_bytes)!r}}}", ""]
        if self.constants:
            out += ["# Small constants, hoisted: built once per process, shared by every call."]
            out += self.constants + [""]
        out += ["", "def build(W):", f'{INDENT}"""Bind the weights (a dict name -> array) once; returns forward."""']
        out += [INDENT + line for line in self.weight_lines]
        for function in self.group_functions:
            out += [""] + [INDENT + line for line in function]
        params = ", ".join(self.names[a] for a in m.func.args)
        out += ["", f"{INDENT}def forward({params}):"]
        for _s, (var, arg, axis) in sorted(self.symbols.items()):
            out.append(f"{INDENT * 2}{var} = {arg}.shape[{axis}]")
        contexts = [] if quiet else ['np.errstate(all="ignore")']
        if self.group_functions:  # groups run GEMM rows on their own threads (backends/numpy/chunks.py)
            contexts.append("single_threaded_blas()")
        inner = INDENT * 3 if contexts else INDENT * 2
        if contexts:
            # errstate: same as the interpreter, IEEE results (inf, nan) are the semantics, not warnings.
            out.append(f'{INDENT * 2}with {", ".join(contexts)}:')
        out += [inner + line for line in body]
        out.append(f"{inner}return [{', '.join(self._output(v, i) for i, v in enumerate(prog.outputs))}]")
        out += ["", f"{INDENT}return forward", ""]
        return "\n".join(out)

    def _timed(self, lines: list[str], op: Operation) -> list[str]:
        """(profile) The kernel call (the last line) between two clock reads, under the
        name of the kernel's first result."""
        if not self.profile:
            return lines
        name = self.names[op.results[0]]
        self.kernel_names.append(name)
        self.kernel_ops[name] = op
        return lines[:-1] + ["_t = perf_counter()", lines[-1],
                             f"PROFILE[{name!r}][0] += perf_counter() - _t", f"PROFILE[{name!r}][1] += 1"]

    # --- fused groups -------------------------------------------------------------

    def _group_call(self, group: FusionOp, counts: Counter, plan: "BufferPlan", step: int) -> list[str]:
        name = self.namer.fresh(f"fusion_{counts['fusion']}")
        counts["fusion"] += 1
        code = GroupEmitter(group, name, self._value, self._attrs, self._concat_weights).emit()
        self.group_functions.append(code.function)
        lines, buffers = plan.allocate(step, group, code)
        inner = {v: r for v, r in zip(group.block.last_op.operands, group.results)}
        targets = []
        for value in group.block.last_op.operands:
            owner = value.owner
            base = f"{owner.op_name}_{counts[owner.op_name]}" if isinstance(owner, TgOp) else "arg"
            counts[owner.op_name if isinstance(owner, TgOp) else "arg"] += 1
            targets.append(self.namer.fresh(base))
            self.names[inner[value]] = targets[-1]
        args = ", ".join([self._value(v) for v in code.params] + buffers)
        types = ", ".join(str(r) for r in (info_of(r.type) for r in group.results))
        lines.append(f"{', '.join(targets)}{',' if len(targets) == 1 else ''} = {name}({args})  # {py_comment(types)}")
        return lines

    def _concat_weights(self, weights: list[SSAValue]) -> str:
        """A build-time concatenation of 2-D weights along their columns (horizontal fusion)."""
        names = [self._value(w) for w in weights]
        key = tuple(names)
        if key not in self._concatenated:
            var = self.namer.fresh("wcat")
            self._concatenated[key] = var
            self.weight_lines.append(f"{var} = np.concatenate([{', '.join(names)}], axis=1)  # one GEMM for "
                                     f"{len(names)} sibling matmuls")
        return self._concatenated[key]

    def _output(self, v: SSAValue, index: int) -> str:
        v = self.prog.canon(v)
        if index in self.model.aliases.values():
            return self.names[v]  # a donated input's buffer, updated in place: the caller's own array
        # An output that is, or may be a view of, an input, a weight or a constant is
        # copied, so that the caller cannot write into the module's arrays (or its
        # own inputs) through it; a computed output is returned as is.
        return f"np.array({self.names[v]})" if self._may_alias_external(v) else f"np.asarray({self.names[v]})"

    def _may_alias_external(self, v: SSAValue) -> bool:
        while True:
            owner = v.owner
            if isinstance(owner, FusionOp):
                return False  # a group's result: a buffer of its own, never reused once it is an output
            if not isinstance(owner, TgOp):
                return True  # a function argument: an input
            if owner.op_name in (Op.weight, Op.constant):
                return True
            # Layout ops may return views of their first operand (reshape, transpose,
            # slice, broadcast); every other op computes a new array.
            if owner.SPEC.category != "layout" or not owner.operands:
                return False
            v = self.prog.canon(owner.operands[0])

    def _header(self) -> list[str]:
        m = self.model
        kinds = Counter(inner.op_name for op in self.prog.steps
                        for inner in (op.ops if isinstance(op, FusionOp) else [op]))
        sources = kinds.pop("weight", 0), kinds.pop("constant", 0)
        lines = [f"# tilegraph NumPy backend: model {self.name!r}. Generated code; edit the model, not this file.",
                 "# inputs:"]
        lines += [f"#   {py_comment(n)}: {py_comment(info)}" for n, info in zip(m.input_names, m.inputs)]
        lines += ["# outputs:"]
        lines += [f"#   {py_comment(n)}: {py_comment(info)}" for n, info in zip(m.output_names, m.outputs)]
        groups = sum(isinstance(op, FusionOp) for op in self.prog.steps)
        lines.append(f"# {sum(kinds.values())} ops ({', '.join(f'{n} {k}' for k, n in kinds.most_common())}), "
                     f"{_count(sources[0], 'weight')}, {_count(sources[1], 'constant')}"
                     + (f"; {_count(groups, 'fused group')}" if groups else ""))
        lines.append("# use: forward = build(ir.model.WeightStore.load('<model>.weights.npz')); outputs = forward(*inputs)")
        return lines + [""]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _model_name(model: Model) -> str:
    name = getattr(model.module, "sym_name", None)
    return name.data if name is not None else "forward"


class BufferPlan:
    """The memory plan: which group buffers are new and which reuse a dead one.

    A group writes its results into buffers its caller passes. A buffer is free
    again once every value living in it (the group's results, and views of them:
    reshapes, transposes, slices) has had its last use; a later group needing a
    buffer of the same shape and dtype takes it instead of allocating. Buffers
    holding a model output are never reused. `peak_bytes` is the planned peak of
    intermediates: every buffer, plus unfused results while they live.
    """

    def __init__(self, emitter: "_Emitter", dies: list[list[SSAValue]]):
        self.emitter = emitter
        self.prog = emitter.prog
        self.slots: list[tuple[TensorInfo, str]] = []  # (info, variable)
        self.free: list[int] = []
        self.slot_of: dict[SSAValue, int] = {}  # value -> the slot it lives in
        self.kernels = 0
        self._last = self._last_uses()
        self._pinned = {self._root(v) for v in self.prog.outputs}
        self._live_fresh: dict[SSAValue, Any] = {}
        self._peaks: list[Any] = []

    def _root(self, v: SSAValue) -> SSAValue:
        """The value whose memory v lives in (through view-like layout ops)."""
        v = self.prog.canon(v)
        while isinstance(v.owner, TgOp) and v.owner.SPEC.category == "layout" and v.owner.operands:
            v = self.prog.canon(v.owner.operands[0])
        return v

    def _last_uses(self) -> dict[SSAValue, int]:
        last: dict[SSAValue, int] = {}
        for i, op in enumerate(self.prog.steps):
            for v in op.operands:
                root = self._root(v)
                last[root] = max(last.get(root, -1), i)
        return last

    def allocate(self, step: int, group: FusionOp, code: GroupCode) -> tuple[list[str], list[str]]:
        """Lines allocating the new buffers of a group call, and the buffer arguments to pass."""
        self.kernels += 1
        lines, args = [], []
        slots = []
        for buf in code.buffers:
            slot = next((k for k in self.free if self.slots[k][0].dtype == buf.info.dtype
                         and len(self.slots[k][0].shape) == len(buf.info.shape)
                         and all(dims_equal(a, b) for a, b in zip(self.slots[k][0].shape, buf.info.shape))), None)
            if slot is None:
                var = self.emitter.namer.fresh(f"buf{len(self.slots)}")
                self.slots.append((buf.info, var))
                slot = len(self.slots) - 1
                lines.append(f"{var} = np.empty({self.emitter._dims(buf.info.shape)}, "
                             f"dtype={dtype_code(buf.info.dtype)})")
            else:
                self.free.remove(slot)
            slots.append(slot)
            args.append(self.slots[slot][1])
        for result, (b, _) in zip(group.results, code.results):
            self.slot_of[result] = slots[b]
        for b, slot in enumerate(slots):  # a buffer no result lives in is free right after the call
            if b not in {i for i, _ in code.results}:
                self.free.append(slot)
        return lines, args

    def step_done(self, step: int) -> None:
        op = self.prog.steps[step]
        if not isinstance(op, FusionOp) and getattr(op, "op_name", None) not in (Op.weight, Op.constant):
            if op.SPEC.category != "layout":
                for r in op.results:
                    self._live_fresh[r] = _nbytes(info_of(r.type))
        live_slots = sum((_nbytes(info) for info, _ in self.slots), sympy.Integer(0))
        self._peaks.append(live_slots + sum(self._live_fresh.values(), sympy.Integer(0)))
        held: dict[int, list[SSAValue]] = {}
        for v, slot in self.slot_of.items():
            held.setdefault(slot, []).append(v)
        for slot, values in held.items():
            if slot in self.free:
                continue
            if all(v not in self._pinned and self._last.get(v, -1) <= step for v in values):
                self.free.append(slot)
                for v in values:
                    del self.slot_of[v]
        for v in [v for v in self._live_fresh if v not in self._pinned and self._last.get(v, -1) <= step]:
            del self._live_fresh[v]
        if not isinstance(op, FusionOp) and getattr(op, "op_name", None) not in (Op.weight, Op.constant):
            self.kernels += 1 if op.SPEC.category != "layout" else 0

    @property
    def peak_bytes(self):
        peaks = [sympy.sympify(p) for p in self._peaks] or [sympy.Integer(0)]
        if all(p.is_number for p in peaks):
            return max(peaks)
        return sympy.Max(*peaks)


def _nbytes(info: TensorInfo):
    return sympy.sympify(numel(info.shape)) * dtypes.numpy_dtype(info.dtype).itemsize


__all__ = ["emit", "emit_profiled", "liveness", "flatten", "sanitize", "Namer", "Program"]
