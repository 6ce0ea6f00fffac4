"""Export a tg module to ONNX (opset 21), quantized ones in QDQ form, for onnxruntime to run.

One tg op becomes one ONNX node where ONNX has the op (tg.quantize -> QuantizeLinear,
tg.dequantize -> DequantizeLinear, tg.matmul_integer -> MatMulInteger, tg.softmax ->
Softmax, ...), a few nodes where it has not (tg.dynamic_quantize: the scale computed from
the row or block maximum, then QuantizeLinear). tg.attention, which ONNX 21 has no op for,
is exported as the decomposition library spells it out (ir/decompositions.py), in a copy
of the module: the one definition of its ops, the causal band included. Weights become initializers in their storage type (int8, uint8, INT4
packed two to a byte, FLOAT8E4M3FN/E5M2) with their scales and zero points; a
`tg.fusion` group is exported as its body (the kernel boundaries mean nothing to ONNX), so
a module can be exported before or after `fuse`/`tile`. Symbolic dims stay symbolic:
inputs and outputs carry them as dim_params, and shapes that depend on them (reshape,
broadcast, iota) are computed in the graph from the inputs' Shape. The model is checked by
onnx.checker with full_check (ONNX's own shape inference) before it is returned.

Numbers: QuantizeLinear computes saturate(round_half_even(x / scale) + zero_point) in
float32, as tg.quantize does (ir/quant.py), so the exported graph rounds the same
quotients to the same integers.
One liberty, exact: int8 activation codes that only MatMulInteger reads are written as
uint8 codes + 128 and read back with a_zero_point 128 (onnxruntime's uint8 x int8 GEMM is
~20x faster than its int8 x int8 one on this CPU).

The OCP microscaling (MX) formats have ONNX types (FLOAT4E2M1 since opset 23, FLOAT8E8M0
since opset 24), but onnxruntime 1.32 has no DequantizeLinear or QuantizeLinear kernel for
them (probed: NOT_IMPLEMENTED). So MX values are exported exactly, in wider types it runs:
f4E2M1FN and f6E2M3FN elements as FLOAT8E4M3FN (every E2M1 and E2M3 value is an E4M3FN
value) and f8E8M0FNU scales as float32 (every power of two 2^-127..2^127 is a float32).
The dequantized weights are bit for bit tilegraph's; an MXFP4 weight takes 8 bits an
element plus a float32 scale per 32 in the file, not 4.25. Quantizing *to* f4/f6 at run
time, and casts to or from the MX types, have no exact ONNX form and are refused.

What cannot be exported is refused before anything is built: one ExportError listing
every unsupported op with its position and result type.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import sympy

from tilegraph.ir import dtypes, onnx_names
from tilegraph.ir.decompositions import expand
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model
from tilegraph.ir.ops import Op, OPS, size_definitions
from tilegraph.ir.quant import FORMATS, MIN_SCALE, E8M0_EXPONENTS, scale_layout
from tilegraph.ir.shapes import TensorInfo, dims_equal, info_of
from tilegraph.backends.lowering import table

# int8 codes a MatMulInteger reads are written as uint8 codes + SHIFT (see _dynamic_quantize).
SHIFT = 128
# QuantizeLinear/DequantizeLinear with block_size and INT4 came in opset 21; onnxruntime
# 1.32 runs every op used here at 21. IR version 10 is the one that goes with opset 21.
OPSET = 21
IR_VERSION = 10
INT64_MAX = (1 << 63) - 1


class ExportError(TilegraphError):
    """A module (or op) the ONNX exporter cannot write; the message lists what and why."""


def _onnx_types() -> dict[str, int]:
    from onnx import TensorProto as T

    return {"f64": T.DOUBLE, "f32": T.FLOAT, "f16": T.FLOAT16, "bf16": T.BFLOAT16,
            "f8E4M3FN": T.FLOAT8E4M3FN, "f8E5M2": T.FLOAT8E5M2, "i1": T.BOOL, "i4": T.INT4, "i8": T.INT8,
            "i16": T.INT16, "i32": T.INT32, "i64": T.INT64, "ui8": T.UINT8, "ui16": T.UINT16,
            "ui32": T.UINT32, "ui64": T.UINT64}


# MX types: exported exactly in a wider type onnxruntime runs (see the module docstring).
WIDENED = {"f4E2M1FN": "f8E4M3FN", "f6E2M3FN": "f8E4M3FN", "f8E8M0FNU": "f32"}

# The frontend's ONNX -> tg name tables (ir/onnx_names.py), inverted (one table per direction
# would drift apart), plus the tg ops the frontend reaches another way (Pow, variadic Max/Min, Where).
UNARY = {tg: onnx_op for onnx_op, tg in onnx_names.UNARY.items()}
BINARY = {tg: onnx_op for onnx_op, tg in onnx_names.BINARY.items()} | {
    "pow": "Pow", "max": "Max", "min": "Min", "where": "Where"}
REDUCE = {name: onnx_op for onnx_op, kind in onnx_names.REDUCE.items() for name, spec in OPS.items()
          if spec.reduction == kind}
# Ops whose ONNX form computes a shape from the symbolic dims (Reshape, Expand, Range, ...): each symbol
# must be an input's dim, read by Shape at run time.
SHAPE_COMPUTING = ("reshape", "broadcast", "iota", "attention", "layer_norm")
# Composites ONNX has no operator for, exported as their decomposition (ir/decompositions.py).
DECOMPOSED = ("attention", "attention_grad")
# tg ops ONNX has no operator for; each is refused with this reason.
NO_ONNX_OP = {"expm1": "ONNX has no Expm1 (exp(x) - 1 loses every digit for small x)",
              "log1p": "ONNX has no Log1p (log(1 + x) loses every digit for small x)",
              "cumprod": "ONNX has no CumProd",
              "block_matmul": "ONNX has no GGUF block formats (MatMulNBits is 4-bit groups with another layout)",
              "block_gather": "ONNX has no GGUF block formats",
              "cache_write": "an in-place cache write is not an ONNX op (onnxruntime-genai shares past/present "
                             "buffers outside the graph)",
              "cache_attention": "ONNX Attention with a KV cache came in opset 23; this exporter writes opset 21",
              "rms_norm": "ONNX RMSNormalization came in opset 23; this exporter writes opset 21",
              "rope": "ONNX RotaryEmbedding came in opset 23; this exporter writes opset 21",
              "sample": "ONNX has no sampler (onnxruntime-genai samples outside the graph)",
              "dropout": "ONNX Dropout draws its mask from the runtime's own generator: no backward could "
                         "recompute it (and inference graphs carry no dropout)"}


# --- what cannot be exported ----------------------------------------------------------------


def _walk(block):
    """The tg ops of a block, the bodies of fusion groups inlined."""
    for op in block.ops:
        if isinstance(op, FusionOp):
            yield from _walk(op.block)
        else:
            yield op


def _refusal(op, resolvable: Callable[[sympy.Expr], bool]) -> str | None:
    """Why `op` cannot be exported, or None."""
    if op.name in ("func.return", "tg.yield"):
        return None
    if not isinstance(op, TgOp):
        return "not a tg op"
    name = op.op_name
    if name in NO_ONNX_OP:
        return NO_ONNX_OP[name]
    if name not in EXPORTABLE:
        return "no ONNX exporter"
    infos = [info_of(v.type) for v in op.operands] + op.result_infos()
    if name not in (Op.dequantize, Op.weight, Op.dynamic_quantize) and \
            any(t.dtype in WIDENED for t in infos):
        return "MX element and scale types are exported widened, only as weights read by tg.dequantize"
    if name in (Op.quantize, Op.dynamic_quantize) and op.attr("to") in WIDENED:
        return f"quantizing to {op.attr('to')} at run time: onnxruntime has no {op.attr('to')} type"
    if name in (Op.shift_left, Op.shift_right) and not op.result_infos()[0].dtype.startswith("ui"):
        return "ONNX BitShift is defined on unsigned integers only"
    if name == Op.dequantize and op.attr("to") == "f64":
        return "DequantizeLinear computes in float32; tg dequantizes to f64 in float64"
    if name == Op.matmul_integer and any(t.dtype == "i4" for t in infos):
        return "ONNX MatMulInteger takes int8/uint8 operands, not int4"
    if name in (Op.quantize, Op.dequantize) and len(op.operands) == 3:
        x, scale = infos[0], infos[1]
        if scale_layout(x.rank, scale.shape, op.attr("axis"), op.attr("block_size")) == "broadcast" and \
                _block_axis(x, scale) is None:
            return "a zero point with a broadcast scale that is not one per block has no QuantizeLinear form"
    if name == Op.layer_norm and len(op.operands) == 1:
        x = infos[0]
        if not all(isinstance(d, int) for d in x.shape[op.attr("axis") % x.rank:]):
            return "a layer_norm without scale over symbolic dims"
    for t in infos:
        if t.dtype not in _onnx_types() and t.dtype not in WIDENED:
            return f"element type {t.dtype} has no ONNX type"
        if name in SHAPE_COMPUTING:
            for d in t.shape:
                if not isinstance(d, int) and not resolvable(d):
                    return f"dimension {d} is not computable from the inputs' dims"
    return None


def unsupported(model: Model) -> list[str]:
    """One line per op of `model` that cannot be exported: 'tg.cumprod (op 7, -> tensor ...): why'."""
    resolvable = _SymbolTable(model).resolvable
    lines = []
    for i, op in enumerate(_walk(model.func.body.block)):
        why = _refusal(op, resolvable)
        if why is not None:
            results = ", ".join(str(info_of(r.type)) for r in op.results)
            lines.append(f"{op.name} (op {i}{', -> ' + results if results else ''}): {why}")
    for label, infos in (("input", model.inputs), ("output", model.outputs)):
        for name, t in zip(model.input_names if label == "input" else model.output_names, infos):
            if t.dtype not in _onnx_types():
                lines.append(f"{label} '{name}' {t}: no ONNX type onnxruntime runs")
    return lines


class _SymbolTable:
    """Where each symbolic dim can be read at run time: an input and an axis whose dim it is."""

    def __init__(self, model: Model):
        self.where: dict[str, tuple[str, int]] = {}
        for name, info in zip(model.input_names, model.inputs):
            for axis, d in enumerate(info.shape):
                if isinstance(d, sympy.Symbol) and d.name not in self.where:
                    self.where[d.name] = (name, axis)
        # A dim known only at run time is read off its defining op's result once that is exported.
        for op in model.func.walk():
            for _, axis, name in size_definitions(op):
                self.where.setdefault(name, ("", axis))

    def resolvable(self, d) -> bool:
        return all(s.name in self.where for s in sympy.sympify(d).free_symbols)


def _block_axis(x: TensorInfo, scale: TensorInfo) -> tuple[int, int] | None:
    """A broadcast scale (one per row, [..., 1]) as blocked quantization: (axis, block size),
    when it equals x's shape but for one static axis where it is 1; None otherwise."""
    if len(scale.shape) != x.rank:
        return None
    odd = [i for i, (s, d) in enumerate(zip(scale.shape, x.shape)) if not dims_equal(s, d)]
    if not odd:
        return (x.rank - 1, 1) if x.rank else None
    if len(odd) == 1 and scale.shape[odd[0]] == 1 and isinstance(x.shape[odd[0]], int):
        return odd[0], x.shape[odd[0]]
    return None


# --- the exporter -----------------------------------------------------------------------------


class _Exporter:
    def __init__(self, model: Model):
        from onnx import helper

        self.h = helper
        self.model = model
        self.types = _onnx_types()
        self.nodes: list = []
        self.inits: dict[str, object] = {}
        self.names: dict = {}  # SSA value -> ONNX name
        self.count = 0
        self.symbols = _SymbolTable(model)
        self.dim_cache: dict = {}
        self.const_cache: dict = {}
        # ONNX names are one namespace: inputs and outputs keep theirs, nothing else may take them.
        self.taken = set(model.input_names) | set(model.output_names)
        self.weight_names: dict[str, str] = {}  # weight store name -> initializer name
        self.code_offsets: dict[str, int] = {}  # ONNX name -> what its codes carry on top of tg's

    # -- names, constants, nodes
    def fresh(self, hint: str = "v") -> str:
        while True:
            self.count += 1
            name = f"{hint}_{self.count}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def initializer(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        if name in self.inits:
            return name
        value = np.asarray(value)
        dt = dtypes.dtype_name(value.dtype)
        if dt in WIDENED:  # exact: see the module docstring
            value = value.astype(np.float32).astype(dtypes.numpy_dtype(WIDENED[dt]))
        self.inits[name] = numpy_helper.from_array(np.require(value, requirements='C'), name)  # (keeps 0-d)
        return name

    def const(self, value, dtype: str = "i64") -> str:
        value = np.asarray(value, dtypes.numpy_dtype(dtype))
        key = (value.dtype.str, value.shape, value.tobytes())
        if key not in self.const_cache:
            self.const_cache[key] = self.initializer(self.fresh("const"), value)
        return self.const_cache[key]

    def node(self, op_type: str, inputs: Sequence[str], outputs: int | Sequence[str] = 1, **attrs) -> list[str]:
        outs = [self.fresh(op_type.lower()) for _ in range(outputs)] if isinstance(outputs, int) else list(outputs)
        self.nodes.append(self.h.make_node(op_type, list(inputs), outs, **{k: v for k, v in attrs.items()
                                                                           if v is not None}))
        return outs

    def one(self, op_type: str, *inputs: str, **attrs) -> str:
        return self.node(op_type, inputs, 1, **attrs)[0]

    # -- symbolic dims as int64 tensors of shape [1]
    def dim(self, d) -> str:
        if isinstance(d, int):
            return self.const([d])
        d = sympy.sympify(d)
        if d in self.dim_cache:
            return self.dim_cache[d]
        out = self._dim(d)
        self.dim_cache[d] = out
        return out

    def _dim(self, d: sympy.Expr) -> str:
        if d.is_Integer:
            return self.const([int(d)])
        if isinstance(d, sympy.Symbol):
            source, axis = self.symbols.where[d.name]
            return self.one("Shape", source, start=axis, end=axis + 1)
        num, den = sympy.fraction(sympy.together(d))
        if den != 1:
            if not den.is_Integer:
                raise ExportError(f"dimension {d} has no ONNX form")
            return self.one("Div", self.dim(num), self.const([int(den)]))
        if isinstance(d, (sympy.Add, sympy.Mul, sympy.Max, sympy.Min)):
            op = {sympy.Add: "Add", sympy.Mul: "Mul", sympy.Max: "Max", sympy.Min: "Min"}[type(d)]
            args = [self.dim(a) for a in d.args]
            out = args[0]
            for a in args[1:]:
                out = self.one(op, out, a)
            return out
        if isinstance(d, sympy.Pow) and d.exp.is_Integer and d.exp > 0:
            out = base = self.dim(d.base)
            for _ in range(int(d.exp) - 1):
                out = self.one("Mul", out, base)
            return out
        if isinstance(d, (sympy.floor, sympy.ceiling)):
            num, den = sympy.fraction(sympy.together(d.args[0]))
            if not den.is_Integer:
                raise ExportError(f"dimension {d} has no ONNX form")
            n = self.dim(num) if isinstance(d, sympy.floor) else self.dim(num + den - 1)
            return self.one("Div", n, self.const([int(den)]))  # dims are >= 0: truncation is floor
        raise ExportError(f"dimension {d} has no ONNX form")

    def shape(self, dims) -> str:
        if all(isinstance(d, int) for d in dims):
            return self.const(list(dims))
        return self.one("Concat", *[self.dim(d) for d in dims], axis=0)

    def scalar(self, d) -> str:
        """A symbolic dim as a 0-D int64 tensor (Range, Trilu take scalars)."""
        if isinstance(d, int):
            return self.const(d)
        return self.one("Squeeze", self.dim(d), self.const([0]))

    def cast(self, name: str, src: str, dst: str) -> str:
        return name if src == dst else self.one("Cast", name, to=self.types[dst])

    # -- the graph
    def build(self, name: str):
        from onnx import helper

        m = self.model
        func = m.func
        inputs = []
        for arg, nm, info in zip(func.args, m.input_names, m.inputs):
            self.names[arg] = nm
            inputs.append(helper.make_tensor_value_info(nm, self.types[info.dtype], _dims(info.shape)))
        self._block(func.body.block)
        ret = func.body.block.last_op
        outputs, taken = [], set(m.input_names)
        for v, nm, info in zip(ret.operands, m.output_names, m.outputs):
            src = self.names[v]
            producer = next((n for n in self.nodes if src in n.output), None)
            if nm in taken and src != nm:
                raise ExportError(f"output name '{nm}' is also the name of an input or an earlier output")
            if src == nm:  # an input returned under its own name
                pass
            elif src in taken or producer is None:  # an input, an initializer or a value returned twice
                self.node("Identity", [src], [nm])
            else:
                producer.output[list(producer.output).index(src)] = nm
                self._rename(src, nm)
            taken.add(nm)
            outputs.append(helper.make_tensor_value_info(nm, self.types[info.dtype], _dims(info.shape)))
        graph = helper.make_graph(self.nodes, name, inputs, outputs, list(self.inits.values()))
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="tilegraph")
        proto.ir_version = IR_VERSION
        return proto

    def _rename(self, old: str, new: str) -> None:
        for n in self.nodes:
            for i, x in enumerate(n.input):
                if x == old:
                    n.input[i] = new
        for k, v in self.names.items():
            if v == old:
                self.names[k] = new

    def _block(self, block) -> None:
        for op in block.ops:
            if op.name in ("func.return", "tg.yield"):
                return
            if isinstance(op, FusionOp):
                for arg, v in zip(op.block.args, op.operands):
                    self.names[arg] = self.names[v]
                self._block(op.block)
                for r, v in zip(op.results, op.block.last_op.operands):
                    self.names[r] = self.names[v]
                continue
            ins = [self.names[v] for v in op.operands]
            outs = _EXPORT.get(op.op_name, _generic)(self, op, ins)
            for r, o in zip(op.results, outs):
                self.names[r] = o
            for r, axis, name in size_definitions(op):  # type: ignore[assignment]
                self.symbols.where[name] = (outs[r], axis)


def _dims(shape) -> list:
    return [d if isinstance(d, int) else str(d) for d in shape]


# --- per-op exporters: (exporter, op, ONNX names of its operands) -> ONNX names of its results ---


def _generic(ex: _Exporter, op: TgOp, ins: list[str]) -> list[str]:
    name = op.op_name
    out = op.result_infos()[0]
    if name in UNARY:
        if name in (Op.floor, Op.ceil, Op.round) and dtypes.is_int(out.dtype):
            return [ex.one("Identity", ins[0])]
        return [ex.one(UNARY[name], *ins)]
    if name in BINARY:
        return [ex.one(BINARY[name], *ins)]
    if name == Op.ne:
        return [ex.one("Not", ex.one("Equal", *ins))]
    if name in REDUCE:
        axes = list(op.attr("axes"))
        # ReduceSum/Prod/Mean take no 8- or 16-bit integers: in 64 bits, then cast back (wrapping, as NumPy's
        # sum in the operand's own dtype wraps).
        wide = {"i8": "i64", "i16": "i64", "ui8": "ui64", "ui16": "ui64"}.get(out.dtype) \
            if op.SPEC.reduction in ("sum", "prod", "mean") else None
        x = ex.cast(ins[0], out.dtype, wide) if wide else ins[0]
        y = ex.one(REDUCE[name], x, ex.const(axes), keepdims=int(op.attr("keepdims")),
                   noop_with_empty_axes=1 if not axes else None)
        return [ex.cast(y, wide, out.dtype) if wide else y]
    raise ExportError(f"tg.{name} has no ONNX exporter")  # unsupported() lists these first


def _rsqrt(ex, op, ins):
    return [ex.one("Reciprocal", ex.one("Sqrt", ins[0]))]


def _gelu(ex, op, ins):
    return [ex.one("Gelu", ins[0], approximate=op.attr("approximate"))]


def _isinf(ex, op, ins):
    return [ex.one("IsInf", ins[0], detect_positive=int(op.attr("detect_positive")),
                   detect_negative=int(op.attr("detect_negative")))]


def _cast(ex, op, ins):
    to = op.attr("to")
    # NumPy (ml_dtypes) casts out-of-range floats to nan/inf in the 8-bit float types: no saturation.
    return [ex.one("Cast", ins[0], to=ex.types[to], saturate=0 if to in ("f8E4M3FN", "f8E5M2") else None)]


def _mod(ex, op, ins):
    fmod = op.attr("fmod")
    if fmod or not dtypes.is_float(op.result_infos()[0].dtype):
        return [ex.one("Mod", *ins, fmod=int(fmod))]
    # Python's % on floats: the sign of the divisor. fmod, then move a remainder of the other sign over by b.
    a, b = ins
    r = ex.one("Mod", a, b, fmod=1)
    zero = ex.const(0.0, op.result_infos()[0].dtype)
    other_sign = ex.one("Xor", ex.one("Less", r, zero), ex.one("Less", b, zero))
    fix = ex.one("And", ex.one("Not", ex.one("Equal", r, zero)), other_sign)
    return [ex.one("Where", fix, ex.one("Add", r, b), r)]


def _shift(ex, op, ins):
    return [ex.one("BitShift", *ins, direction="LEFT" if op.op_name == Op.shift_left else "RIGHT")]


def _arg(ex, op, ins):
    return [ex.one("ArgMax" if op.op_name == Op.argmax else "ArgMin", ins[0], axis=op.attr("axis"),
                   keepdims=int(op.attr("keepdims")), select_last_index=int(op.attr("select_last_index")))]


def _matmul(ex, op, ins):
    return [ex.one("MatMul", *ins)]


def _einsum(ex, op, ins):
    return [ex.one("Einsum", *ins, equation=op.attr("equation"))]


def _window_attrs(op: TgOp) -> dict:
    a = op.py_attrs()
    return {"strides": list(a["strides"]) or None, "pads": list(a["pads"]) or None,
            "dilations": list(a["dilations"]) or None}


def _conv(ex, op, ins):
    return [ex.one("Conv", *ins, group=op.attr("groups"), **_window_attrs(op))]


def _pool(ex, op, ins):
    a = op.py_attrs()
    extra = {"count_include_pad": int(a["count_include_pad"])} if op.op_name == Op.avg_pool else {}
    ceil_mode, axes, ends = int(a["ceil_mode"]), [], []
    if ceil_mode:
        # Opset 21's ceil_mode keeps a last window that starts in the end padding; tg (and PyTorch,
        # and opset 22) drop it. onnxruntime 1.32's kernel drops it at every opset while ONNX's shape
        # inference of opset 21 keeps it, and its memory planner, trusting the inferred (larger) size,
        # hands the pool's buffer to a later value: a crash (differential fuzzing found it). So
        # ceil_mode is written only where both rules agree: where the floor rule already gives tg's
        # size (the dropped-window case), ceil_mode=0; where opset 21's rule does, ceil_mode=1; a
        # mix of the two (or a symbolic size) keeps ceil_mode=1 and slices the extra window off.
        x, out = info_of(op.operands[0].type), op.result_infos()[0]
        nd = len(a["kernel"])
        strides, pads, dil = a["strides"] or (1,) * nd, a["pads"] or (0,) * 2 * nd, a["dilations"] or (1,) * nd
        floor_ok = True
        for i in range(nd):
            size, want = x.shape[2 + i], out.shape[2 + i]
            if not (isinstance(size, int) and isinstance(want, int)):
                floor_ok = False
                continue
            span = size + pads[i] + pads[i + nd] - dil[i] * (a["kernel"][i] - 1) - 1
            floor_ok &= span // strides[i] + 1 == want
            if -(-span // strides[i]) + 1 != want:
                axes.append(2 + i)
                ends.append(want)
        if floor_ok:
            ceil_mode, axes = 0, []
    y = ex.one("MaxPool" if op.op_name == Op.max_pool else "AveragePool", ins[0], kernel_shape=list(a["kernel"]),
               ceil_mode=ceil_mode, **_window_attrs(op), **extra)
    if not axes:
        return [y]
    return [ex.one("Slice", y, ex.const([0] * len(axes)), ex.const(ends), ex.const(axes))]


def _softmax(ex, op, ins):
    return [ex.one("Softmax", ins[0], axis=op.attr("axis"))]


def _layer_norm(ex, op, ins):
    x = info_of(op.operands[0].type)
    axis = op.attr("axis") % x.rank
    norm = x.shape[axis:]
    args = [ins[0]]
    if len(ins) == 1:
        args.append(ex.const(np.ones(norm), x.dtype))
    for v, name in zip(op.operands[1:], ins[1:]):
        shape = info_of(v.type).shape
        same = len(shape) == len(norm) and all(dims_equal(a, b) for a, b in zip(shape, norm))
        args.append(name if same else ex.one("Expand", name, ex.shape(norm)))
    return [ex.one("LayerNormalization", *args, axis=axis, epsilon=op.attr("epsilon"))]


def _reshape(ex, op, ins):
    return [ex.one("Reshape", ins[0], ex.shape(op.result_infos()[0].shape), allowzero=1)]


def _broadcast(ex, op, ins):
    return [ex.one("Expand", ins[0], ex.shape(op.result_infos()[0].shape))]


def _transpose(ex, op, ins):
    perm = list(op.attr("perm"))
    return [ex.one("Transpose", ins[0], perm=perm) if perm else ex.one("Identity", ins[0])]  # (a scalar's)


def _concat(ex, op, ins):
    return [ex.one("Concat", *ins, axis=op.attr("axis"))]


def _split(ex, op, ins):
    sizes = list(op.attr("sizes"))
    return ex.node("Split", [ins[0], ex.const(sizes)], len(sizes), axis=op.attr("axis"))


def _slice(ex, op, ins):
    a = op.py_attrs()
    rank = len(a["starts"])
    return [ex.one("Slice", ins[0], ex.const(list(a["starts"])), ex.const(list(a["ends"])),
                   ex.const(list(range(rank))), ex.const(list(a["steps"])))]


def _index(ex, op, v, name, allowed=("i32", "i64")) -> str:
    dt = info_of(v.type).dtype
    return name if dt in allowed else ex.cast(name, dt, "i64")


def _gather(ex, op, ins):
    return [ex.one("Gather", ins[0], _index(ex, op, op.operands[1], ins[1]), axis=op.attr("axis"))]


def _gather_elements(ex, op, ins):
    return [ex.one("GatherElements", ins[0], _index(ex, op, op.operands[1], ins[1]), axis=op.attr("axis"))]


def _pad(ex, op, ins):
    a = op.py_attrs()
    dt = op.result_infos()[0].dtype
    args = [ins[0], ex.const(list(a["pads"]))] + ([ex.const(a["value"], dt)] if a["mode"] == "constant" else [])
    return [ex.one("Pad", *args, mode=a["mode"])]


def _tile(ex, op, ins):
    return [ex.one("Tile", ins[0], ex.const(list(op.attr("repeats"))))]


def _cumsum(ex, op, ins):
    scalar = op.result_infos()[0].rank == 0  # onnxruntime refuses a rank-0 CumSum: a 1-element one
    x = ex.one("Unsqueeze", ins[0], ex.const([0])) if scalar else ins[0]
    y = ex.one("CumSum", x, ex.const(0 if scalar else op.attr("axis")), exclusive=int(op.attr("exclusive")),
               reverse=int(op.attr("reverse")))
    return [ex.one("Squeeze", y, ex.const([0])) if scalar else y]


def _trilu(ex, op, ins):
    return [ex.one("Trilu", ins[0], ex.const(op.attr("k")), upper=int(op.attr("upper")))]


def _constant(ex, op, ins):
    return [ex.initializer(ex.fresh("const"), op.attr("value"))]


def _weight(ex, op, ins):
    name = op.attr("name")
    if name not in ex.weight_names:
        ex.weight_names[name] = name if name not in ex.taken else ex.fresh("weight")
        ex.taken.add(ex.weight_names[name])
    return [ex.initializer(ex.weight_names[name], ex.model.weights[name])]


def _iota(ex, op, ins):
    out = op.result_infos()[0]
    axis = op.attr("axis")
    range_type = out.dtype if out.dtype in ("i32", "i64", "f32", "f64") else "i64"
    line = ex.one("Range", ex.const(0, range_type), ex.cast(ex.scalar(out.shape[axis]), "i64", range_type),
                  ex.const(1, range_type))
    column = ex.one("Reshape", line, ex.shape((out.shape[axis],) + (1,) * (out.rank - axis - 1)))
    return [ex.cast(ex.one("Expand", column, ex.shape(out.shape)), range_type, out.dtype)]


def _scatter_elements(ex, op, ins):
    return [ex.one("ScatterElements", ins[0], _index(ex, op, op.operands[1], ins[1]), ins[2], axis=op.attr("axis"),
                   reduction=op.attr("reduction"))]


def _scatter_nd(ex, op, ins):
    return [ex.one("ScatterND", ins[0], _index(ex, op, op.operands[1], ins[1], ("i64",)), ins[2],
                   reduction=op.attr("reduction"))]


def _nonzero(ex, op, ins):
    return [ex.one("NonZero", ins[0])]


def _unique(ex, op, ins):
    axis = {} if op.attr("flatten") else {"axis": op.attr("axis")}
    return ex.node("Unique", [ins[0]], 4, sorted=int(op.attr("sorted")), **axis)


def _non_max_suppression(ex, op, ins):
    return [ex.one("NonMaxSuppression", *ins, center_point_box=op.attr("center_point_box"))]


def _rnn(ex, op, ins):
    """One direction of ONNX RNN/GRU/LSTM: tg's operands and results are ONNX's without their
    num_directions axis (sequence_lens is absent: every sequence runs its whole length)."""
    cell = op.attr("cell")
    hidden = info_of(op.operands[2].type).shape[1]
    with_axis = [ex.one("Unsqueeze", v, ex.const([0])) for v in ins[1:]]  # W, R, B, initial_h, initial_c, P
    onnx_inputs = [ins[0], *with_axis[:3]] + ([""] + with_axis[3:] if len(with_axis) > 3 else [])
    attrs = {"hidden_size": int(hidden), "direction": "reverse" if op.attr("reverse") else "forward"}
    if op.attr("clip"):
        attrs["clip"] = float(op.attr("clip"))
    if cell == "gru":
        attrs["linear_before_reset"] = int(op.attr("linear_before_reset"))
    outs = ex.node({"rnn": "RNN", "gru": "GRU", "lstm": "LSTM"}[cell], onnx_inputs, 3 if cell == "lstm" else 2,
                   **attrs)
    return [ex.one("Squeeze", outs[0], ex.const([1]))] + [ex.one("Squeeze", o, ex.const([0])) for o in outs[1:]]


def _narrow(ex, op, ins):
    # tg.narrow clamps a negative length to 0; Slice would count a negative end from the back.
    length = ex.one("Max", _index(ex, op, op.operands[1], ins[1], ("i64",)), ex.const(0))
    return [ex.one("Slice", ins[0], ex.const([0]), ex.one("Reshape", length, ex.const([1])),
                   ex.const([op.attr("axis")]))]


def _topk(ex, op, ins):
    return ex.node("TopK", [ins[0], ex.const([op.attr("k")])], 2, axis=op.attr("axis"),
                   largest=int(op.attr("largest")), sorted=1)


# --- quantization: QDQ --------------------------------------------------------------------------


def _scale_args(ex, op, ins) -> tuple[str, dict, str | None]:
    """(scale as float32, the axis/block_size attributes, zero point) of a tg.quantize/dequantize, the
    scale layouts of ir/quant.py mapped onto QuantizeLinear's: per tensor, per axis, blocked; a broadcast
    (per-row) scale as blocks of a whole row. Returns attrs None for a broadcast that does not fit."""
    x, s = info_of(op.operands[0].type), info_of(op.operands[1].type)
    scale = ex.cast(ins[1], WIDENED.get(s.dtype, s.dtype), "f32")
    zp = ins[2] if len(ins) == 3 else None
    axis, block = op.attr("axis"), op.attr("block_size")
    layout = scale_layout(x.rank, s.shape, axis, block)
    if layout == "tensor":
        return scale, {}, zp
    if layout == "channel":
        return scale, {"axis": axis}, zp
    if layout == "block":
        return scale, {"axis": axis, "block_size": block}, zp
    fit = _block_axis(x, s)
    return scale, (None if fit is None else {"axis": fit[0], "block_size": fit[1]}), zp  # type: ignore[return-value]


def _quantize(ex, op, ins):
    x = info_of(op.operands[0].type)
    to = op.attr("to")
    xf = ex.cast(ins[0], x.dtype, "f32")  # tg.quantize divides in float32
    scale, attrs, zp = _scale_args(ex, op, ins)
    saturate = 1 if to in ("f8E4M3FN", "f8E5M2") else None  # tg clips to the largest finite value
    if attrs is None:  # x / scale by Div, then a QuantizeLinear by 1: the same quotient, the same rounding
        return [ex.one("QuantizeLinear", ex.one("Div", xf, scale), ex.const(1.0, "f32"),
                       output_dtype=ex.types[to], saturate=saturate)]
    return [ex.one("QuantizeLinear", xf, scale, *([zp] if zp else []), output_dtype=ex.types[to],
                   saturate=saturate, **attrs)]


def _dequantize(ex, op, ins):
    to = op.attr("to")
    scale, attrs, zp = _scale_args(ex, op, ins)
    if attrs is None:  # DequantizeLinear by 1 (exact), then times the broadcast scale: one rounding, as tg
        y = ex.one("Mul", ex.one("DequantizeLinear", ins[0], ex.const(1.0, "f32"), *([zp] if zp else [])), scale)
    else:
        y = ex.one("DequantizeLinear", ins[0], scale, *([zp] if zp else []), **attrs)
    return [ex.cast(y, "f32", to)]


def _absmax_scale(ex, amax: str, hi: float) -> str:
    """ir.quant.absmax_scale: amax / hi, at least MIN_SCALE; 1 where amax is 0."""
    s = ex.one("Max", ex.one("Div", amax, ex.const(np.float32(hi), "f32")), ex.const(MIN_SCALE, "f32"))
    return ex.one("Where", ex.one("Greater", amax, ex.const(0.0, "f32")), s, ex.const(1.0, "f32"))


def _mx_scale(ex, amax: str, hi: float) -> str:
    """ir.quant.mx_scale in float32: the smallest power of two 2^e with amax <= hi * 2^e, e clipped to
    E8M0's [-127, 127]; 1 where amax is 0. e starts from log2 (a few ulps off at most) and is then
    corrected by the exact comparisons (hi * 2^e is a float32 without rounding)."""
    lo_e, hi_e = E8M0_EXPONENTS
    f32 = "f32"
    # Below hi * 2^lo_e every block gets 2^lo_e: clamp first, so that log sees a normal float32.
    a = ex.one("Max", amax, ex.const(np.float32(hi * 2.0 ** lo_e), f32))
    log2 = ex.one("Div", ex.one("Sub", ex.one("Log", a), ex.const(np.float32(math.log(hi)), f32)),
                  ex.const(np.float32(math.log(2)), f32))
    e = ex.one("Clip", ex.one("Ceil", log2), ex.const(float(lo_e), f32), ex.const(float(hi_e), f32))
    two, one = ex.const(2.0, f32), ex.const(1.0, f32)
    hi_c = ex.const(np.float32(hi), f32)
    # one step up where hi * 2^e < amax, one step down where hi * 2^(e-1) >= amax (within the clip)
    up = ex.one("And", ex.one("Less", ex.one("Mul", hi_c, ex.one("Pow", two, e)), a),
                ex.one("Less", e, ex.const(float(hi_e), f32)))
    e = ex.one("Where", up, ex.one("Add", e, one), e)
    down_e = ex.one("Sub", e, one)
    down = ex.one("And", ex.one("GreaterOrEqual", ex.one("Mul", hi_c, ex.one("Pow", two, down_e)), a),
                  ex.one("Greater", e, ex.const(float(lo_e), f32)))
    e = ex.one("Where", down, down_e, e)
    scale = ex.one("Pow", two, e)
    return ex.one("Where", ex.one("Greater", amax, ex.const(0.0, f32)), scale, one)


def _dynamic_quantize(ex, op, ins):
    """ir.quant.dynamic_quantize: symmetric scales from the data, per row (block_size 0) or per block of
    the last axis, then QuantizeLinear by them (blocked along the last axis)."""
    x = info_of(op.operands[0].type)
    to, block = op.attr("to"), op.attr("block_size")
    fmt = FORMATS[to]
    xf = ex.cast(ins[0], x.dtype, "f32")
    r = x.rank
    k = x.shape[-1]
    absx = ex.one("Abs", xf)
    if not block:
        amax = ex.one("ReduceMax", absx, ex.const([r - 1]), keepdims=1)
        scale = _absmax_scale(ex, amax, fmt.hi)
        # int8 codes only an integer GEMM reads are written shifted, as uint8 with zero point 128: the same
        # codes (clip(q + 128, 0, 255) - 128 = clip(q, -128, 127)), and MatMulInteger reads them back with
        # a_zero_point 128. onnxruntime's MLAS has a fast uint8 x int8 GEMM and, on x86, a much slower
        # int8 x int8 one.
        shift = to == "i8" and all(u.operation.name == "tg.matmul_integer" and u.index == 0
                                   and len(u.operation.operands) == 2 for u in op.results[0].uses)
        zp = [ex.one("Expand", ex.const(SHIFT, "ui8"), ex.one("Shape", scale))] if shift else []
        dtype = {} if shift else {"output_dtype": ex.types[to]}
        saturate = 1 if not fmt.integer else None
        if isinstance(k, int) and k > 0:
            q = ex.one("QuantizeLinear", xf, scale, *zp, saturate=saturate, axis=r - 1, block_size=k, **dtype)
        else:
            q = ex.one("QuantizeLinear", ex.one("Div", xf, scale), ex.const(1.0, "f32"),
                       *([ex.const(SHIFT, "ui8")] if shift else []), saturate=saturate, **dtype)
        if shift:
            ex.code_offsets[q] = SHIFT
        return [q, scale]
    blocks = -(-k // block)
    padded = absx if blocks * block == k else ex.one(
        "Pad", absx, ex.const([0] * (2 * r - 1) + [blocks * block - k]))
    grouped = ex.one("Reshape", padded, ex.const([0] * (r - 1) + [blocks, block]))
    amax = ex.one("ReduceMax", grouped, ex.const([r]), keepdims=0)
    scale = _absmax_scale(ex, amax, fmt.hi) if fmt.integer else _mx_scale(ex, amax, fmt.hi)
    q = ex.one("QuantizeLinear", xf, scale, output_dtype=ex.types[to], saturate=1 if not fmt.integer else None,
               axis=r - 1, block_size=block)
    return [q, scale]


def _matmul_integer(ex, op, ins):
    if ins[0] in ex.code_offsets:  # int8 codes written as uint8 + 128 (see _dynamic_quantize)
        return [ex.one("MatMulInteger", ins[0], ins[1], ex.const(ex.code_offsets[ins[0]], "ui8"))]
    return [ex.one("MatMulInteger", *ins)]


_EXPORT: dict[str, Callable] = {
    "rsqrt": _rsqrt, "gelu": _gelu, "isinf": _isinf, "cast": _cast, "mod": _mod, "shift_left": _shift,
    "shift_right": _shift, "argmax": _arg, "argmin": _arg, "matmul": _matmul, "einsum": _einsum, "conv": _conv,
    "max_pool": _pool, "avg_pool": _pool, "softmax": _softmax, "layer_norm": _layer_norm,
    "reshape": _reshape, "broadcast": _broadcast, "transpose": _transpose, "concat": _concat, "split": _split,
    "slice": _slice, "gather": _gather, "gather_elements": _gather_elements, "pad": _pad, "tile": _tile,
    "cumsum": _cumsum, "trilu": _trilu, "constant": _constant, "weight": _weight, "iota": _iota,
    "scatter_elements": _scatter_elements, "scatter_nd": _scatter_nd, "topk": _topk, "quantize": _quantize,
    "dequantize": _dequantize, "dynamic_quantize": _dynamic_quantize, "matmul_integer": _matmul_integer,
    "nonzero": _nonzero, "unique": _unique, "narrow": _narrow, "non_max_suppression": _non_max_suppression,
    "rnn": _rnn, "assert_size": lambda ex, op, ins: [ex.one("Identity", ins[0])],
}
TEMPLATES = frozenset(_EXPORT) | frozenset(UNARY) | frozenset(BINARY) | frozenset(REDUCE) | {"ne"}
EXPORTABLE = TEMPLATES | frozenset(DECOMPOSED)
# The lowering table (backends/lowering.py): ONNX nodes, decompositions, or the stated refusal.
LOWERINGS = table(template=sorted(TEMPLATES), decompose=DECOMPOSED, fallback={
    **{n: f"refused: {r}" for n, r in NO_ONNX_OP.items()},
    "bitcast": "refused by name: ONNX BitCast came in opset 26, this exporter writes opset 21"})


# --- entry points ------------------------------------------------------------------------------------


def to_onnx(model: Model, name: str = "tilegraph"):
    """`model` as an onnx.ModelProto (opset 21), checked by onnx.checker (full_check). Raises one
    ExportError listing every op that cannot be exported, before building anything."""
    return export(model, name)[0]


def export(model: Model, name: str = "tilegraph"):
    """(onnx.ModelProto, {tg SSA value: its ONNX name}, {ONNX name: offset of its codes}): `to_onnx`,
    where each tg value went, and which int8 codes went as uint8 + offset (tests compare the two
    graphs node by node)."""
    import onnx

    model.verify()
    refused = unsupported(model)
    if refused:
        raise ExportError(f"cannot export to ONNX: {len(refused)} unsupported op{'s' if len(refused) > 1 else ''} "
                          "or types:\n" + "\n".join(refused))
    spelled, where = _decomposed(model)
    exporter = _Exporter(spelled)
    proto = exporter.build(name)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ExportError(f"the exported ONNX model does not check (an exporter bug): {e}") from None
    names = {v: exporter.names[c] for v, c in where.items() if c in exporter.names}
    return proto, names, dict(exporter.code_offsets)


def _decomposed(model: Model) -> tuple[Model, dict]:
    """A copy of `model` with the DECOMPOSED ops spelled out, and where each value of `model` is in
    it: its copy, or for a decomposed op's result the value that replaces it."""
    where: dict = {}
    copy = Model(model.module.clone(value_mapper=where), model.weights)
    replaced = {}
    # (again while a decomposition made one: attention's long backward recomputes its forward)
    while pending := [(i, op) for i, op in enumerate(_walk(copy.func.body.block))
                      if isinstance(op, TgOp) and op.op_name in DECOMPOSED]:
        for i, op in pending:
            results = list(op.results)
            new = expand(op)
            if new is None:  # not reached for any attention the shape rules accept; an exporter bug if so
                raise ExportError(f"cannot export to ONNX: {op.name} (op {i}) has no decomposition here")
            replaced.update(zip(results, new))
    return copy, {v: replaced.get(c, c) for v, c in where.items()}


def save_onnx(model: Model, path: str | os.PathLike, name: str | None = None) -> Path:
    """Export `model` and write it to `path`; nothing is written if the export fails."""
    return write_onnx(to_onnx(model, name or Path(path).stem), path)


def write_onnx(proto, path: str | os.PathLike) -> Path:
    """Write an onnx.ModelProto all or nothing: a temporary file beside `path`, renamed into place."""
    import onnx

    path = Path(path)
    if not path.parent.is_dir():
        raise ExportError(f"cannot write {path}: no such directory {path.parent}")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name, suffix=".part")
    os.close(fd)
    try:
        onnx.save(proto, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def summary(proto) -> str:
    """'412 nodes (36 QuantizeLinear, 75 DequantizeLinear, ...), 142 initializers': what a QDQ export holds."""
    from collections import Counter

    kinds = Counter(n.op_type for n in proto.graph.node)
    qdq = ", ".join(f"{kinds[k]} {k}" for k in ("QuantizeLinear", "DequantizeLinear", "MatMulInteger") if kinds[k])
    return f"{len(proto.graph.node)} nodes" + (f" ({qdq})" if qdq else "") + \
        f", {len(proto.graph.initializer)} initializers, opset {OPSET}"
