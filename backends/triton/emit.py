"""The Triton code generator: a model becomes one Python module of @triton.jit kernels
and a host program over torch tensors that launches them.

What it decides and how:

* Every `tg.fusion` group becomes one kernel (`group_kernels.py`) with the tile sizes the
  `tile` pass wrote; a compute op outside any group (a pipeline without `fuse`)
  is a group of its own. Composites in a group (softmax, layer_norm, gelu) are first
  spelled out by the rules of `passes.decompose`, the same rules the reference
  semantics are checked against, so the kernels see reductions and elementwise ops.
* A group that no one kernel can express (an anchor the kernels do not cover, a
  reduction across a conv's tile) is split, and each of its ops becomes a kernel;
  an op that no kernel covers runs on the host through its NumPy template (the op
  table's own semantics), copied off and back onto the device. `HOST_OPS` in the
  module lists them, `tilegraph compile --report` prints them.
* Views (reshape, transpose, broadcast, slice with positive steps) are torch views;
  concat and split are torch.cat / torch.split.
* Weights become device tensors once, in `build(W, device)`; `forward` binds the
  symbolic dims from the input shapes and returns torch tensors on the device.
* `KERNELS` describes every kernel (its signature, its configurations ranked by the
  cost model with the constexprs and options each gives at nominal sizes, what it
  computes), so
  `backends/triton/aot.py` can build each for sm_90 and gfx942 without running it.
"""

from __future__ import annotations

import ast
from collections import Counter
from typing import Sequence

import numpy as np
import sympy
from xdsl.ir import Block, SSAValue

from tilegraph.ir.dialect import FusionOp, TgOp, make_op
from tilegraph.ir.dtypes import PACKED_4BIT
from tilegraph.ir.fusion import ANCHORS, GroupKind
from tilegraph.ir.interpreter import SHAPE_FUNCTIONS, dtype_code
from tilegraph.ir.model import Model, ModelError
from tilegraph.ir.ops import Op, QUANTIZATION_OPS, render, size_definitions
from tilegraph.ir.shapes import Dim, TensorInfo, info_of, numel, tensor_type
from tilegraph.backends.program import (PYTHON_RESERVED, Namer, array_literal, flatten, liveness, literal, py_comment,
                              signature_rows, str_literal, tuple_lines)
from tilegraph.backends.triton.lowering import TORCH_LAYOUT
from tilegraph.backends.triton.group_kernels import (AXIS_OPS, INDENT, TORCH_TYPES, KernelCode, KernelWriter, RowsTooWide,
                                                    Unsupported, needs_whole_rows, triton_next_power_of_2)
from tilegraph.backends.triton.prepare import in_block, prepare
from tilegraph.backends.triton.quant import QuantKernelWriter

# What a symbolic dim is taken to be for an ahead-of-time build (passes/cost/model.py prices
# symbolic dims at the same size).
NOMINAL_DIM = 256
MODULE_NAMES = {"torch", "triton", "tl", "tlmath", "tlquant", "pack_k", "np", "K", "ml_dtypes", "build", "forward", "DEVICE", "F32_DOT", "KERNELS",
                "CONFIGS", "INPUTS", "OUTPUTS", "WEIGHTS", "HOST_OPS", "SPLIT_GROUPS", "HOST_FLOPS", "TUNER", "pick", "host", "launch", "cfg",
                *SHAPE_FUNCTIONS}


class _Sizes:
    def __init__(self, **fns):
        self.__dict__.update(fns)


def emit(model: Model, name: str | None = None, hardware: str | None = None) -> str:
    """The Python source of a module computing `model` with Triton kernels (see the module docstring),
    for the GPU `hardware` names (ir/hardware.py; default: backends.triton.HARDWARE)."""
    from tilegraph.backends.triton import HARDWARE

    return _Emitter(model, hardware or HARDWARE).source()


def _axes_last(op: TgOp):
    """For a reduction or scan over axes other than (only) the last, keeping dims: the permutation
    moving them last, the same op over the last axis of that view (in a block of its own) and the
    permutation undoing it for a scan (None for reductions: their result is reshaped). None if
    the op needs no move."""
    if op.op_name not in AXIS_OPS:
        return None
    x = info_of(op.operands[0].type)
    if x.rank == 0:
        return None
    axes = tuple(sorted(a % x.rank for a in (op.attr("axes") if op.SPEC.reduction else
                                             [op.attr("axis")])))
    kept = tuple(a for a in range(x.rank) if a not in axes)
    keepdims = op.op_name in (Op.cumsum, Op.cumprod) or op.attr("keepdims")
    if axes == (x.rank - 1,) and keepdims:
        return None
    perm = kept + axes
    rows = TensorInfo(tuple(x.shape[a] for a in kept) + (numel(tuple(x.shape[a] for a in axes)),), x.dtype)
    block = Block(arg_types=[tensor_type(rows.dtype, rows.shape)])
    attrs = op.py_attrs()
    if op.SPEC.reduction:
        attrs |= {"axes": (rows.rank - 1,), "keepdims": True}
    elif op.op_name in (Op.argmax, Op.argmin):
        attrs |= {"axis": rows.rank - 1, "keepdims": True}
    else:
        attrs |= {"axis": rows.rank - 1}
    inner = make_op(op.op_name, [block.args[0]], attrs)
    block.add_op(inner)
    undo = tuple(perm.index(a) for a in range(x.rank)) if op.op_name in (Op.cumsum, Op.cumprod) else None
    return perm, inner, undo


class _Emitter:
    def __init__(self, model: Model, hardware: str):
        from tilegraph.ir.hardware import hardware as describe

        gpu = describe(hardware)
        self.shared_memory = gpu.shared_memory_per_block or gpu.shared_memory_per_core
        self.tf32 = "tf32" in gpu.peak_flops
        self.model = prepare(model)
        self.prog = flatten(self.model)
        self.namer = Namer(MODULE_NAMES | PYTHON_RESERVED)
        self.names: dict[SSAValue, str] = {}
        self.kernels: list[KernelCode] = []
        self._bodies: dict[str, str] = {}  # kernel text (name left out) -> its kernel's name
        self.split_groups: list[str] = []  # groups run op by op, with the reason
        self.host_flops: dict[str, str] = {}  # host launcher -> the FLOPs of its launch (d_<symbol> expression)
        self.host_functions: list[list[str]] = []
        self.weight_lines: list[str] = []
        self._weights: dict[str, str] = {}
        self.constants: list[str] = []
        self.host_ops: Counter = Counter()
        self.symbols = self._bind_symbols()
        self.uses_tlmath = False
        self.uses_tlquant = False

    # --- names and dims ------------------------------------------------------------

    def _bind_symbols(self) -> dict[str, tuple[str, str, int]]:
        m = self.model
        for arg, name in zip(m.func.args, m.input_names):
            self.names[arg] = self.namer.fresh(name, "input")
        bound: dict[str, tuple[str, str, int]] = {}
        for arg, info in zip(m.func.args, m.inputs):
            for axis, d in enumerate(info.shape):
                if isinstance(d, sympy.Symbol) and d.name not in bound:
                    bound[d.name] = (self.namer.fresh(f"d_{d.name}"), self.names[arg], axis)
        # A dim known only at run time (tg.nonzero's count) is bound once its op has run on the
        # host; until then its variable holds 0 (kernels take every symbol, and none before uses it).
        for op in self.prog.steps:
            for _, _, name in size_definitions(op):
                bound.setdefault(name, (self.namer.fresh(f"d_{name}"), None, None))
        return bound

    def dim(self, d: Dim | str) -> str:
        """Host Python for one dim (symbols are the forward's dim variables)."""
        if isinstance(d, str):
            return d
        if isinstance(d, int):
            return str(d)
        d = sympy.sympify(d)
        missing = {s.name for s in d.free_symbols} - set(self.symbols)
        if missing:
            raise ModelError(f"symbolic dims {', '.join(sorted(missing))} are not the size of any input dimension; "
                             "the Triton backend binds each symbol from an input's shape")
        renamed = d.xreplace({s: sympy.Symbol(self.symbols[s.name][0], integer=True, positive=True)
                              for s in d.free_symbols})
        if "/" in str(renamed):
            return f"int({renamed})"
        # A sum is parenthesized: kernels write products of dims (`{a} * {n}`).
        return f"({renamed})" if isinstance(renamed, sympy.Add) else str(renamed)

    def _shape(self, shape: Sequence[Dim]) -> str:
        return "(" + ", ".join(self.dim(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"

    def _value(self, v: SSAValue) -> str:
        return self.names[self.prog.canon(v)]

    def _result(self, v: SSAValue, base: str) -> str:
        self.names[v] = self.namer.fresh(base)
        return self.names[v]

    # --- steps ---------------------------------------------------------------------

    def _source_op(self, op: TgOp) -> None:
        info = op.result_infos()[0]
        if op.op_name == Op.weight:
            wname = op.attr("name")
            if wname not in self._weights:
                self._weights[wname] = self.namer.fresh(wname, "w")
                # 4-bit weights live on the device two to a byte along K, as the quantized GEMMs read them.
                read = f"W[{str_literal(wname)}]"
                if info.dtype in PACKED_4BIT and info.rank == 2:
                    read = f"pack_k({read})"
                self.weight_lines.append(f"{self._weights[wname]} = {read}")
            self.names[op.results[0]] = self._weights[wname]
            return
        var = self.namer.fresh(f"c{len(self.constants)}")
        array = np.asarray(op.attr("value"))
        self.constants.append(f"{var} = host_tensor(np.array({array_literal(array, info.dtype)}, "
                              f"dtype={dtype_code(info.dtype)}))")
        self.names[op.results[0]] = var

    def _layout_line(self, op: TgOp) -> str | None:
        out = op.result_infos()
        name = op.op_name
        operands = [self._value(v) for v in op.operands]
        if name == Op.split:
            sizes = op.attr("sizes")
            targets = [self._result(r, f"split_{i}") for i, r in enumerate(op.results)]
            return f"{', '.join(targets)}, = torch.split({operands[0]}, {list(sizes)}, dim={op.attr('axis')})"
        if name == Op.slice and all(s > 0 for s in op.attr("steps")):
            expr = render(op.SPEC, operands, op.py_attrs(), self._shape(out[0].shape), "")
        elif name in TORCH_LAYOUT:
            attrs = {k: literal(tuple(v)) if isinstance(v, (list, tuple)) else literal(v)
                     for k, v in op.py_attrs().items()}
            env = {"inputs": "[" + ", ".join(operands) + "]"} if op.SPEC.variadic else \
                dict(zip(op.SPEC.operand_names, operands))
            expr = TORCH_LAYOUT[name].format(**env, **attrs, out_shape=self._shape(out[0].shape))
        else:
            return None
        target = self._result(op.results[0], name)
        return f"{target} = {expr}  # {py_comment(out[0])}"

    def _host_line(self, op: TgOp) -> str:
        """An op no kernel covers: its NumPy template on host copies (the op table's own semantics)."""
        self.host_ops[op.op_name] += 1
        outs = op.result_infos()
        operands = [f"host({self._value(v)})" for v in op.operands]
        expr = render(op.SPEC, operands, op.py_attrs(), self._shape(outs[0].shape), dtype_code(outs[0].dtype))
        targets = [self._result(r, f"{op.op_name}_{i}") for i, r in enumerate(op.results)]
        if len(targets) == 1:
            return f"{targets[0]} = device(np.asarray({expr}))  # on the host: {py_comment(outs[0])}"
        return f"{', '.join(targets)} = [device(np.asarray(a)) for a in {expr}]  # on the host"

    def _group_lines(self, group: FusionOp, counts: Counter) -> list[str]:
        inputs = list(group.block.args)
        outer = {arg: self._value(v) for arg, v in zip(group.block.args, group.operands)}
        outputs = list(group.block.last_op.operands)
        name = self.namer.fresh(f"fusion_{counts['fusion']}")
        counts["fusion"] += 1
        try:
            code = self._kernel(name, group.kind, group.ops, inputs, outputs, group.tile())
        except RowsTooWide:
            return self._gemm_then_rows(group, name)
        except Unsupported as why:
            self.split_groups.append(f"{group.kind} ({' '.join(op.op_name for op in group.ops)}): {why}")
            return self._split(group, counts)
        self._host_function(name, code, len(inputs))
        targets = [self._result(r, f"{name}_out{i}") for i, r in enumerate(group.results)]
        args = [outer[a] for a in inputs] + [v for v, _, _ in sorted(self.symbols.values())]
        types = ", ".join(str(info_of(r.type)) for r in group.results)
        return [f"{', '.join(targets)}, = {name}_host({', '.join(args)})  # {py_comment(types)}"]

    def _kernel(self, name, kind, ops, inputs, outputs, tile) -> KernelCode:
        constants = [op for op in ops if op.op_name == Op.constant and np.asarray(op.attr("value")).size != 1]
        if constants:
            raise Unsupported("a constant array inside a group")
        writer = QuantKernelWriter if any(op.op_name in QUANTIZATION_OPS for op in ops) else KernelWriter
        code = writer(f"{name}_kernel", kind, ops, inputs, outputs, tile, self.dim, self.shared_memory, self.tf32).write()
        # A kernel the module has already (the same layer again) is launched, not written twice:
        # fewer kernels for Triton to compile when the model first runs.
        body = "\n".join(code.kernel).replace(code.name, "KERNEL") + repr(code.configs)
        same = self._bodies.get(body)
        if same is not None:
            code.host = [line.replace(code.name, same) for line in code.host]
            code.name = same
            return code
        self._bodies[body] = code.name
        self.kernels.append(code)
        self.uses_tlmath |= "tlmath" in code.helpers
        self.uses_tlquant |= "tlquant" in code.helpers
        return code

    def _gemm_then_rows(self, group: FusionOp, name: str) -> list[str]:
        """A GEMM group whose epilogue reduces rows too wide for one program (RowsTooWide) as two
        kernels: the GEMM with the elementwise ops that need no whole row, then the row ops
        (layer_norm, softmax) reading its result, as a group of kind reduction would."""
        rows: set[TgOp] = set()
        for op in group.ops:
            if op.op_name not in ANCHORS and (needs_whole_rows(op) or any(
                    isinstance(v.owner, TgOp) and v.owner in rows for v in op.operands)):
                rows.add(op)
        scalars = [op for op in group.ops if op.op_name == Op.constant]  # inline in either kernel
        first = [op for op in group.ops if op not in rows]
        second = scalars + [op for op in group.ops if op in rows]
        made_first = {r for op in first if op.op_name != Op.constant for r in op.results}
        yielded = list(group.block.last_op.operands)
        outer: dict[SSAValue, str] = {arg: self._value(v) for arg, v in zip(group.block.args, group.operands)}
        lines = []
        for suffix, kind, ops, later in (("a", GroupKind.around("matmul", len(first) > len(scalars) + 1).value, first,
                                          second),
                                         ("b", GroupKind.REDUCTION.value, second, [])):
            made = {r for op in ops for r in op.results}
            inputs = list(dict.fromkeys(v for op in ops for v in op.operands if v not in made))
            outputs = list(dict.fromkeys(
                [v for v in yielded if v in made] +
                [v for op in later for v in op.operands if v in made and v in made_first]))
            code = self._kernel(f"{name}{suffix}", kind, ops, inputs, outputs, group.tile())
            self._host_function(f"{name}{suffix}", code, len(inputs))
            args = [outer.get(v) or self.names[v] for v in inputs] + [v for v, _, _ in sorted(self.symbols.values())]
            targets = [self._result(v, f"{name}{suffix}_out{i}") for i, v in enumerate(outputs)]
            types = ", ".join(str(info_of(v.type)) for v in outputs)
            lines.append(f"{', '.join(targets)}, = {name}{suffix}_host({', '.join(args)})  # {py_comment(types)}")
        for r, v in zip(group.results, yielded):
            self.names[r] = outer.get(v) or self.names[v]
        return lines

    def _split(self, group: FusionOp, counts: Counter) -> list[str]:
        """A group no one kernel can express: each op on its own (values renamed through the region)."""
        for arg, v in zip(group.block.args, group.operands):
            self.names[arg] = self._value(v)
        lines = []
        for op in group.ops:
            if op.op_name == Op.constant:
                self._source_op(op)
                continue
            lines += self._single(op, counts)
        for r, v in zip(group.results, group.block.last_op.operands):
            self.names[r] = self.names[v]
        return lines

    def _single(self, op: TgOp, counts: Counter) -> list[str]:
        if op.SPEC.bound is not None:  # a data-dependent size: on the host, then its symbol is bound
            line = self._host_line(op)
            return [line] + [f"{self.symbols[name][0]} = {self.names[op.results[r]]}.shape[{axis}]"
                             for r, axis, name in size_definitions(op)]
        if op.op_name == Op.iota:  # an index along one axis, made on the device
            out = op.result_infos()[0]
            axis = op.attr("axis") % len(out.shape)
            view = tuple(-1 if i == axis else 1 for i in range(len(out.shape)))
            target = self._result(op.results[0], "iota")
            return [f"{target} = torch.arange({self.dim(out.shape[axis])}, device=DEVICE, "
                    f"dtype={TORCH_TYPES[out.dtype]}).reshape({view}).expand({self._shape(out.shape)})  # {py_comment(out)}"]
        layout = self._layout_line(op) if op.SPEC.category == "layout" and op.op_name != Op.gather else None
        if layout is not None:
            return [layout]
        if op.SPEC.category == "layout" and op.op_name != Op.gather:
            return [self._host_line(op)]
        name = self.namer.fresh(f"{op.op_name}_{counts[op.op_name]}")
        counts[op.op_name] += 1
        moved = _axes_last(op)
        if moved is not None:  # a reduction or scan over other axes: on rows of a permuted view
            perm, inner, undo = moved
            block = inner.parent_block()
        else:
            block, inner = in_block(op)
        try:
            code = self._kernel(name, op.op_name, [inner], list(block.args), list(inner.results), {})
        except Unsupported:
            return [self._host_line(op)]
        self._host_function(name, code, len(block.args))
        targets = [self._result(r, f"{name}_out{i}") for i, r in enumerate(op.results)]
        operands = [self._value(v) for v in op.operands]
        if moved is not None:
            shape = info_of(inner.operands[0].type).shape
            operands[0] = f"{operands[0]}.permute({perm}).reshape({self._shape(shape)})"
        args = operands + [v for v, _, _ in sorted(self.symbols.values())]
        line = f"{', '.join(targets)}, = {name}_host({', '.join(args)})  # {py_comment(op.result_infos()[0])}"
        if moved is None:
            return [line]
        out = op.result_infos()[0]
        fix = f".permute({undo})" if undo else f".reshape({self._shape(out.shape)})"
        return [line, f"{targets[0]} = {targets[0]}{fix}"]

    def _host_function(self, name: str, code: KernelCode, n_inputs: int) -> None:
        self.host_flops[f"{name}_host"] = code.flops  # a shared kernel's FLOPs differ per launch
        params = [f"in{i}" for i in range(n_inputs)] + [v for v, _, _ in sorted(self.symbols.values())]
        self.host_functions.append([f"def {name}_host({', '.join(params)}):"] + [INDENT + ln if ln else ""
                                                                              for ln in code.host])

    def _nominal_env(self, cfg: dict) -> dict:
        import math

        env = {"cfg": cfg, "max": max, "min": min, "int": int,
               "triton": _Sizes(next_power_of_2=lambda n: triton_next_power_of_2(int(n)),
                                cdiv=lambda a, b: -(-a // b))}
        env |= {var: NOMINAL_DIM for var, _, _ in self.symbols.values()}
        return env | {f: getattr(math, f) for f in ("floor", "ceil")}

    def _nominal_blocks(self, code: KernelCode, cfg: dict) -> dict[str, int]:
        """The kernel's constexprs under configuration `cfg`, every symbolic dim at NOMINAL_DIM:
        what an ahead-of-time build compiles."""
        env = self._nominal_env(cfg)
        out: dict[str, int] = {}
        for b, expr in code.blocks.items():
            out[b] = int(eval(expr, env | out))  # noqa: S307 - our own expressions
        return out

    def _nominal_args(self, code: KernelCode, cfg: dict) -> dict[str, int]:
        """The int arguments that are sizes (not strides) at nominal sizes: what an ahead-of-time
        build specializes on as a launch would (ints equal to 1, multiples of 16)."""
        env = self._nominal_env(cfg) | self._nominal_blocks(code, cfg)
        out = {}
        for param, expr in zip(code.params, code.host_args):
            if param.signature == "i32" and ".stride(" not in expr:
                try:
                    out[param.name] = int(eval(expr, env))  # noqa: S307 - our own expressions
                except (NameError, TypeError, ValueError):
                    pass
        return out

    def _nominal_options(self, code: KernelCode, cfg: dict) -> dict[str, int]:
        """num_warps and num_stages under `cfg` at nominal sizes."""
        env = self._nominal_env(cfg) | self._nominal_blocks(code, cfg)
        return {"num_warps": cfg["num_warps"], "num_stages": int(eval(code.stages, env))}  # noqa: S307

    # --- the module ----------------------------------------------------------------

    def source(self) -> str:
        m, prog = self.model, self.prog
        dies = liveness(prog.steps, prog.outputs, prog.canon)
        counts: Counter = Counter()
        body: list[str] = []
        for op, dead in zip(prog.steps, dies):
            if isinstance(op, FusionOp):
                body += self._group_lines(op, counts)
            elif op.SPEC.category == "source" and op.op_name in (Op.weight, Op.constant):
                self._source_op(op)
            else:
                body += self._single(op, counts)
            if dead:
                body.append("del " + ", ".join(self.names[v] for v in dead if v in self.names))
        body = [line for line in body if line != "del "]
        out = [f"# tilegraph Triton backend: {len(self.kernels)} kernels"
               + (f", {sum(self.host_ops.values())} ops on the host ({', '.join(sorted(self.host_ops))})"
                  if self.host_ops else "") + ". Generated code; edit the model, not this file.",
               "import numpy as np", "import ml_dtypes", "import torch", "import triton", "import triton.language as tl",
               "", "from tilegraph.ir import kernels as K",
               "from tilegraph.ir.interpreter import SHAPE_FUNCTIONS",
               "from tilegraph.backends.triton.runtime import device, f32_dot, host, host_tensor, pack_k, pick"]
        if self.uses_tlmath:
            out.append("from tilegraph.backends.triton import tlmath")
        if self.uses_tlquant:
            out.append("from tilegraph.backends.triton import tlquant")
        out += [f"{f} = SHAPE_FUNCTIONS[{f!r}]" for f in sorted(SHAPE_FUNCTIONS)]
        out += ["", *tuple_lines("INPUTS", signature_rows(m.input_names, m.inputs)),
                *tuple_lines("OUTPUTS", signature_rows(m.output_names, m.outputs)),
                *tuple_lines("WEIGHTS", [literal(w) for w in self._weights]),
                f"HOST_OPS = {dict(self.host_ops)!r}",
                "# Fused groups no one kernel could express, run op by op (why).",
                *tuple_lines("SPLIT_GROUPS", [literal(g) for g in self.split_groups]), "DEVICE = None", "TUNER = None  # set by the runtime: autotuning",
                "F32_DOT = tl.constexpr(\"ieee\")  # how tl.dot multiplies fp32: set by build for its device", ""]
        if any("_multiply" in k.helpers for k in self.kernels):
            out += ["", "@triton.jit", "def _multiply(a, b):", f"{INDENT}return a * b", ""]
        for k in self.kernels:
            out += ["", *k.kernel, ""]
        out += ["", "# What each kernel is, for ahead-of-time builds (backends/triton/aot.py) and autotuning.",
                "KERNELS = {"]
        for k in self.kernels:
            sig = {p.name: p.signature for p in k.params}
            builds = [{"constexprs": self._nominal_blocks(k, c), "options": self._nominal_options(k, c),
                       "args": self._nominal_args(k, c)} for c in k.configs]
            out.append(f"    {k.name!r}: {{'signature': {sig!r}, 'configs': {k.configs!r}, 'builds': {builds!r}, "
                       f"'group': {ast.literal_eval(k.kernel[2].strip())!r}, 'flops': {k.flops!r}}},")
        out += ["}", "CONFIGS = {name: entry['configs'] for name, entry in KERNELS.items()}",
                "# The FLOPs of each launcher's launch (kernels are shared between layers of other sizes).",
                f"HOST_FLOPS = {self.host_flops!r}", ""]
        for fn in self.host_functions:
            out += ["", *fn, ""]
        out += ["", "def build(W, device_):", f'{INDENT}"""Bind the weights (name -> device tensor) once; returns forward."""',
                f"{INDENT}global DEVICE, F32_DOT", f"{INDENT}DEVICE = device_", f"{INDENT}F32_DOT = f32_dot(device_)"]
        out += [INDENT + line for line in self.weight_lines + self.constants]
        params = ", ".join(self.names[a] for a in m.func.args)
        out += ["", f"{INDENT}def forward({params}):"]
        for _s, (var, arg, axis) in sorted(self.symbols.items()):
            out.append(f"{INDENT * 2}{var} = {arg}.shape[{axis}]" if arg else f"{INDENT * 2}{var} = 0  # known at run time")
        out += [INDENT * 2 + line for line in body]
        out.append(f"{INDENT * 2}return [{', '.join(self._value(v) for v in prog.outputs)}]")
        out += ["", f"{INDENT}return forward", ""]
        return "\n".join(out)


__all__ = ["emit", "prepare", "TORCH_LAYOUT"]
