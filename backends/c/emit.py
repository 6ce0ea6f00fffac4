"""The C code generator: one C11 + OpenMP source per model, the fast CPU path.

What it decides and how:

* Every value lives in a *view*: a buffer, an offset and strides (in elements).
  Layout ops that move no data (reshape of a contiguous value, transpose,
  broadcast, slice, split) make a new view of the same buffer, so they cost
  nothing; an op reading a view reads it through its strides.
* Every computing op, or fused group, is one *step*: a static C function with the
  IR it computes as its comment. Elementwise groups are one loop nest with one
  straight-line body per element; GEMM and convolution groups run on oneDNN with
  their weights reordered once into the primitive's packed layout (runtime.h) and
  as much of their epilogue as oneDNN fuses (bias, scaling, residual, activation)
  applied to each output block while it is in cache; softmax and layer_norm are
  one pass per row.
* Consecutive C steps form one *segment*, one native call. An op the C backend does
  not lower (HOST_FALLBACK says why for each) runs on the host between segments,
  through the op table's NumPy semantics, on the same buffers: every op of the
  table runs, and a model of only lowered ops is one native call per forward.
* Shapes, strides and offsets that depend on symbolic dims are entries of an int64
  table `s[]` that the Python side evaluates once per shape binding; a static model
  gets literals. One compiled module serves every batch and sequence length.
* Buffers are indices into a pointer table `p[]` (inputs, weights, constants and
  intermediates); the runtime plans intermediates into one arena per binding.

No string from the model enters the source: names are `p[i]` and `s[i]`, and the
IR in comments goes through `c_comment`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import sympy
from xdsl.ir import SSAValue

from tilegraph.backends.lowering import table
from tilegraph.backends.program import flatten
from tilegraph.ir import escape
from tilegraph.ir.dialect import FusionOp, TgOp, YieldOp
from tilegraph.ir.model import Model
from tilegraph.ir.ops import OPS
from tilegraph.ir.quant import FORMATS
from tilegraph.ir.shapes import Dim, TensorInfo, info_of, numel

CTYPES = {"f32": "float", "f64": "double", "i64": "int64_t", "i32": "int32_t", "i16": "int16_t", "i8": "int8_t",
          "ui8": "uint8_t", "ui16": "uint16_t", "ui32": "uint32_t", "ui64": "uint64_t", "i1": "uint8_t"}
FLOATS = ("f32", "f64")

# Elementwise ops as C expressions of their operands, computed in the operands' type
# (floats: tgmath picks the float or double function).
C_UNARY_FLOAT = {
    "neg": "(-{x})", "abs": "fabs({x})", "exp": "{exp}({x})", "log": "log({x})", "sqrt": "sqrt({x})",
    "rsqrt": "(1 / sqrt({x}))", "reciprocal": "(1 / {x})", "tanh": "{tanh}({x})", "erf": "{erf}({x})",
    "relu": "(({x}) > 0 || ({x}) != ({x}) ? ({x}) : 0)", "sin": "sin({x})", "cos": "cos({x})", "tan": "tan({x})",
    "asin": "asin({x})", "acos": "acos({x})", "atan": "atan({x})", "sinh": "sinh({x})", "cosh": "cosh({x})",
    "asinh": "asinh({x})", "acosh": "acosh({x})", "atanh": "atanh({x})", "floor": "floor({x})",
    "ceil": "ceil({x})", "round": "rint({x})", "sign": "(({x}) > 0 ? 1 : (({x}) < 0 ? -1 : ({x})))",
    "expm1": "expm1({x})", "log1p": "log1p({x})", "isnan": "(({x}) != ({x}))", "not": "(!({x}))",
}
C_UNARY_INT = {
    "neg": "(-{x})", "abs": "(({x}) < 0 ? -({x}) : ({x}))", "relu": "(({x}) > 0 ? ({x}) : 0)", "floor": "({x})",
    "ceil": "({x})", "round": "({x})", "sign": "((({x}) > 0) - (({x}) < 0))", "bitwise_not": "(~({x}))",
    "not": "(!({x}))", "isnan": "0",
}
C_BINARY = {
    "add": "(({lhs}) + ({rhs}))", "sub": "(({lhs}) - ({rhs}))", "mul": "(({lhs}) * ({rhs}))",
    "and": "(({lhs}) != 0 && ({rhs}) != 0)", "or": "(({lhs}) != 0 || ({rhs}) != 0)",
    "xor": "((({lhs}) != 0) != (({rhs}) != 0))", "eq": "(({lhs}) == ({rhs}))", "ne": "(({lhs}) != ({rhs}))",
    "lt": "(({lhs}) < ({rhs}))", "le": "(({lhs}) <= ({rhs}))", "gt": "(({lhs}) > ({rhs}))",
    "ge": "(({lhs}) >= ({rhs}))", "where": "(({cond}) ? ({lhs}) : ({rhs}))",
}
C_BINARY_FLOAT = {
    "div": "(({lhs}) / ({rhs}))", "pow": "pow({lhs}, {rhs})",
    # NumPy's maximum and minimum propagate NaN from either side.
    "max": "(({lhs}) > ({rhs}) || ({lhs}) != ({lhs}) ? ({lhs}) : ({rhs}))",
    "min": "(({lhs}) < ({rhs}) || ({lhs}) != ({lhs}) ? ({lhs}) : ({rhs}))",
}
C_BINARY_INT = {
    "max": "(({lhs}) > ({rhs}) ? ({lhs}) : ({rhs}))", "min": "(({lhs}) < ({rhs}) ? ({lhs}) : ({rhs}))",
    "bitwise_and": "(({lhs}) & ({rhs}))", "bitwise_or": "(({lhs}) | ({rhs}))", "bitwise_xor": "(({lhs}) ^ ({rhs}))",
}
# Integer division, modulo, power and shifts trap or are undefined in C where NumPy
# defines a result (x / 0, INT_MIN / -1, shifts past the width); a float to int cast
# is undefined out of range. Those run on the host (HOST_FALLBACK).

# What every op of the table does in this backend when it is not lowered to C: the
# host runs it with the op table's NumPy semantics between native segments. (An op
# lowered in C also runs on the host in a case its lowering refuses, a dtype without
# a C type or a layout it does not take; tests/test_c_backend.py checks each op
# lowered here runs natively on at least one of its examples.)
HOST_FALLBACK = {
    "einsum": "NumPy's einsum on the host",
    "scatter_elements": "host", "scatter_nd": "host",
    "pad": "C for constant padding (into a convolution's own padding where that reads it), the host for "
           "reflect/edge/wrap and negative pads",
    "cumprod": "host", "trilu": "host", "iota": "host", "topk": "host", "argmax": "host",
    "argmin": "host", "mod": "host", "isinf": "host", "reduce_prod": "host",
    "div": "C for floats, the host for integers", "pow": "C for floats, the host for integers",
    "quantize": "C for integer formats, the host for float formats and block scales",
    "dequantize": "C for scales per tensor or channel, the host for block scales",
    "dynamic_quantize": "C for rows to i8, the host for other formats and MX blocks",
    "matmul_integer": "oneDNN for i8/ui8 x i8 (a zero point subtracted after, by b's column sums), else the host",
    "shift_left": "host", "shift_right": "host", "bitcast": "host",
    # Data-dependent sizes: the runtime finds them before planning (ir.interpreter.run_time_sizes).
    "nonzero": "host", "unique": "host", "narrow": "host", "non_max_suppression": "host",
    "rnn": "host (a loop over the steps, NumPy's matmul per step)", "assert_size": "host",
}
LOWERINGS = table(template=[op for op in OPS if op not in HOST_FALLBACK],
                  fallback={op: f"runs on the host between native segments ({why})"
                            for op, why in HOST_FALLBACK.items()})

# oneDNN algorithm kinds (dnnl_types.h) for epilogues it fuses into a GEMM or convolution.
DNNL_ELTWISE = {"relu": "dnnl_eltwise_relu", "tanh": "dnnl_eltwise_tanh", "exp": "dnnl_eltwise_exp",
                "sigmoid": "dnnl_eltwise_logistic", "linear": "dnnl_eltwise_linear",
                "gelu_tanh": "dnnl_eltwise_gelu_tanh", "gelu_erf": "dnnl_eltwise_gelu_erf", "clip": "dnnl_eltwise_clip"}
DNNL_BINARY = {"add": "dnnl_binary_add", "mul": "dnnl_binary_mul", "sub": "dnnl_binary_sub"}
DNNL_TYPES = {"f32": "dnnl_f32", "i8": "dnnl_s8", "ui8": "dnnl_u8", "i32": "dnnl_s32"}
# Work below this many elements runs on one thread: an OpenMP fork/join costs more.
PARALLEL_MIN = 32768
KNOWN = ("weight", "constant", "folded")
# A reduction's accumulator (double for floats) at its start and per value v; max and min
# keep a NaN, as NumPy's do.
REDUCE_INIT = {"sum": "0", "mean": "0", "max": "-INFINITY", "min": "INFINITY"}
REDUCE_STEP = {"sum": "acc += v;", "mean": "acc += v;", "max": "acc = v > acc || v != v ? v : acc;",
               "min": "acc = v < acc || v != v ? v : acc;"}  # buffers whose values no input changes
SIMD_BLOCK = 4096  # elements a thread takes at a time in a flat parallel loop
# Multiply-adds below which a GEMM runs as emitted loops: a oneDNN call costs ~1.5 us.
SMALL_GEMM = 16384


def c_comment(text: str) -> str:
    """`text` as the inside of a C block comment, through the project's one escaping
    point for generated source (ir/escape.py): model names reach comments via the IR."""
    return escape.c_comment(text)[len("/* "):-len(" */")]


def c_float(value: float, dtype: str) -> str:
    if np.isnan(value):
        return "NAN"
    if np.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = repr(float(value))
    return text + "f" if dtype == "f32" else text


@dataclass(frozen=True)
class View:
    """A value in memory: element (offset, strides) into buffer `buf`, or a scalar literal."""

    buf: int | None
    offset: Any
    shape: tuple
    strides: tuple
    dtype: str
    literal: str | None = None  # the C text of a scalar constant
    value: Any = None  # and its value, for the host

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass
class Buffer:
    kind: str  # input, weight, constant, temp, or folded (made once from weights, kept)
    dtype: str
    elements: Any  # sympy expression
    index: int | str | None = None  # the input position, or the weight / constant key


@dataclass
class Step:
    """One kernel: C lines (a native step) or an op the host runs."""

    comment: str
    lines: list[str] | None = None
    host_op: TgOp | None = None
    host_in: list[View] = field(default_factory=list)
    host_out: list[View] = field(default_factory=list)
    reads: set[int] = field(default_factory=set)
    writes: set[int] = field(default_factory=set)
    state: list[str] = field(default_factory=list)  # per-binding primitive setup lines
    once: bool = False  # a host op of weights and constants only: run once, before the kernels are set up


def contiguous_strides(shape: Sequence[Dim]) -> tuple:
    strides, acc = [], sympy.Integer(1)
    for d in reversed(shape):
        strides.append(acc)
        acc = acc * d
    return tuple(reversed(strides))


def channels_last_strides(shape: Sequence[Dim]) -> tuple:
    """Strides of (N, C, *spatial) laid out as (N, *spatial, C): what oneDNN's fast
    convolution kernels read and write on these processors (plain NCHW goes through
    im2col and a GEMM, several times slower at small channel counts)."""
    order = (0, *range(2, len(shape)), 1)
    dense = contiguous_strides(tuple(shape[i] for i in order))
    strides = [None] * len(shape)
    for pos, axis in enumerate(order):
        strides[axis] = dense[pos]
    return tuple(strides)


def _eq(a, b) -> bool:
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def _is_one(d) -> bool:
    return _eq(d, 1)


class Unsupported(Exception):
    """This op or group has no C lowering here; the caller falls back (host or per-op)."""


class Ints:
    """Shape, stride and offset expressions as C: a literal when known, else s[k], an
    entry the runtime evaluates once per shape binding."""

    def __init__(self):
        self.exprs: list[sympy.Expr] = []
        self._index: dict[sympy.Expr, int] = {}

    def __call__(self, e) -> str:
        e = sympy.sympify(e)
        if e.is_number:
            return str(int(e))
        e = sympy.expand(e)
        if e not in self._index:
            self._index[e] = len(self.exprs)
            self.exprs.append(e)
        return f"s[{self._index[e]}]"


class CEmitter:
    def __init__(self, model: Model):
        self.model = model
        self.prog = flatten(model)
        self.ints = Ints()
        self.buffers: list[Buffer] = []
        self.views: dict[SSAValue, View] = {}
        self.steps: list[Step] = []
        self.gemm_count = 0
        self.constants: list[np.ndarray] = []  # arrays of the constants too big to be literals
        self.folded: dict[TgOp, View] = {}  # ops computed inside an earlier step: their results
        for arg_i, (arg, info) in enumerate(zip(model.func.args, model.inputs)):
            self.views[arg] = self._new_buffer("input", info.dtype, info.shape, arg_i)

    # --- buffers and views ------------------------------------------------------

    def _new_buffer(self, kind: str, dtype: str, shape, index=None) -> View:
        self.buffers.append(Buffer(kind, dtype, sympy.sympify(numel(tuple(shape))), index))
        return View(len(self.buffers) - 1, sympy.Integer(0), tuple(shape), contiguous_strides(shape), dtype)

    def view(self, v: SSAValue) -> View:
        return self.views[self.prog.canon(v)]

    def ptr(self, view: View, const: bool = True) -> str:
        """A C pointer expression to a view's first element."""
        ctype = CTYPES[view.dtype]
        off = self.ints(view.offset)
        base = f"(({'const ' if const else ''}{ctype} *)p[{view.buf}])"
        return base if off == "0" else f"({base} + {off})"

    def is_contiguous(self, view: View) -> bool:
        if view.literal is not None:
            return False
        want = contiguous_strides(view.shape)
        return all(_is_one(d) or _eq(s, w) for d, s, w in zip(view.shape, view.strides, want))

    # --- view ops (no data moves) ------------------------------------------------

    def reshape(self, view: View, shape) -> View:
        if view.literal is not None:
            return View(None, 0, tuple(shape), (0,) * len(shape), view.dtype, view.literal, view.value)
        if self.is_contiguous(view):
            return View(view.buf, view.offset, tuple(shape), contiguous_strides(shape), view.dtype)
        strides = _reshaped_strides(view, tuple(shape))
        if strides is None:  # dims merged that do not walk memory as one run: a copy
            view = self.materialize(view)
            strides = contiguous_strides(shape)
        return View(view.buf, view.offset, tuple(shape), strides, view.dtype)

    def materialize(self, view: View, channels_last: bool = False) -> View:
        """A contiguous (or channels-last) copy of a strided view (a reshape of a transpose
        needs one)."""
        if view.dtype not in CTYPES:
            raise Unsupported(f"{view.dtype} has no C type here")
        out = self._new_buffer("temp", view.dtype, view.shape)
        if channels_last:
            out = View(out.buf, out.offset, out.shape, channels_last_strides(out.shape), out.dtype)
        lines = self.loop(view.shape, [(view, False), (out, True)], lambda refs: [f"{refs[1]} = {refs[0]};"])
        self._step("copy into a contiguous buffer", lines, [view], [out])
        return out

    def for_onednn(self, view: View) -> View:
        """`view` as oneDNN can describe it: its memory descriptors take no negative stride
        (a flipped view, as ConvTranspose's kernel is), so such a view is copied first."""
        if any(sympy.sympify(st).is_negative for st in view.strides):
            return self.materialize(view)
        # A dim of size 1 with stride 0 (a broadcast's) sends a matmul to oneDNN's reference kernel.
        return View(view.buf, view.offset, view.shape, _unit_dims_strided(view.shape, view.strides), view.dtype,
                    view.literal, view.value)

    @staticmethod
    def transpose(view: View, perm) -> View:
        return View(view.buf, view.offset, tuple(view.shape[p] for p in perm), tuple(view.strides[p] for p in perm),
                    view.dtype, view.literal, view.value)

    @staticmethod
    def broadcast(view: View, shape) -> View:
        """`view` broadcast to `shape` (NumPy's rules, right-aligned): stride 0 where it repeats."""
        shape = tuple(shape)
        lead = len(shape) - view.rank
        strides = []
        for i, d in enumerate(shape):
            j = i - lead
            if j < 0 or (_is_one(view.shape[j]) and not _is_one(d)):
                strides.append(sympy.Integer(0))
            else:
                strides.append(view.strides[j])
        return View(view.buf, view.offset, shape, tuple(strides), view.dtype, view.literal, view.value)

    def slice(self, view: View, starts, ends, steps) -> View:
        offset, shape, strides = view.offset, [], []
        for d, st, s, e, k in zip(view.shape, view.strides, starts, ends, steps):
            if (s, e, k) == (0, (1 << 63) - 1, 1):
                shape.append(d)
                strides.append(st)
                continue
            if not isinstance(d, int) and not (isinstance(d, sympy.Integer)):
                raise Unsupported("slice of a symbolic dim")
            r = range(*slice(s, e, k).indices(int(d)))
            offset = offset + (r.start if len(r) else 0) * st
            shape.append(len(r))
            strides.append(st * k)
        return View(view.buf, offset, tuple(shape), tuple(strides), view.dtype, view.literal, view.value)

    # --- the program --------------------------------------------------------------

    def run(self) -> None:
        self.padding_convs = self._padding_convs()
        for op in self.prog.steps:
            if isinstance(op, FusionOp):
                self.group(op)
            else:
                self.op(op)

    def op(self, op: TgOp, env: dict | None = None) -> None:
        """Lower one op (top level, or inside a group lowered op by op with `env`
        mapping its block arguments)."""
        views = self.views if env is None else env
        get = (lambda v: views[self.prog.canon(v)]) if env is None else (lambda v: env.get(v) or self.view(v))
        name = op.op_name
        if op in self.folded:
            views[op.results[0]] = self.folded.pop(op)
            return
        if env is None and name in ("weight", "constant") and op.results[0] in views:
            return  # made early, for a step that folded in its reader
        if name == "weight":
            info = op.result_infos()[0]
            views[op.results[0]] = self._new_buffer("weight", info.dtype, info.shape, op.attr("name"))
            return
        if name == "constant":
            views[op.results[0]] = self.constant(op)
            return
        if name == "pad" and any(pad is op for pad, _ in self.padding_convs.values()):
            views[op.results[0]] = get(op.operands[0])  # the convolution reading it pads itself
            return
        try:
            operands = [get(v) for v in op.operands]
            outs = self.layout(op, operands)
            if outs is None:
                outs = self.compute(op, operands)
        except Unsupported:
            outs = self.host(op, [get(v) for v in op.operands])
        views.update(zip(op.results, outs))

    def _padding_convs(self) -> dict:
        """{conv: its input's zero padding} for each zero `pad` over only the spatial dims
        whose one reader is a convolution's input: the convolution pads instead (oneDNN
        skips the taps outside the input), and the pad is never written."""
        found = {}
        for op in self.prog.steps:
            if not isinstance(op, TgOp) or op.op_name != "pad" or op.attr("mode") != "constant" or op.attr("value"):
                continue
            pads, nd = list(op.attr("pads")), op.result_infos()[0].rank
            if nd < 3 or any(pads[i] or pads[nd + i] for i in (0, 1)) or any(p < 0 for p in pads):
                continue
            uses = list(op.results[0].uses)
            if len(uses) != 1:
                continue
            user, index = uses[0].operation, uses[0].index
            if isinstance(user, FusionOp):  # the group's block argument, read only by its head conv
                arg_uses = list(user.block.args[index].uses)
                if len(arg_uses) != 1 or arg_uses[0].index != 0 or arg_uses[0].operation is not user.ops[0]:
                    continue
                user, index = arg_uses[0].operation, 0
            if isinstance(user, TgOp) and user.op_name == "conv" and index == 0:
                found[user] = (op, pads[2:nd] + pads[nd + 2:])
        return found

    def constant(self, op: TgOp) -> View:
        info = op.result_infos()[0]
        value = np.asarray(op.attr("value"))
        if value.size == 1 and info.dtype in CTYPES:
            scalar = value.reshape(())[()]
            text = (c_float(float(scalar), info.dtype) if info.dtype in FLOATS
                    else str(int(bool(scalar))) if info.dtype == "i1" else f"(({CTYPES[info.dtype]}){int(scalar)})")
            return View(None, 0, tuple(info.shape), (sympy.Integer(0),) * len(info.shape), info.dtype, text, scalar)
        self.constants.append(value)
        return self._new_buffer("constant", info.dtype, info.shape, len(self.constants) - 1)

    def layout(self, op: TgOp, xs: list[View]) -> list[View] | None:
        """View-only layout ops; None when `op` computes."""
        name, outs = op.op_name, op.result_infos()
        if name == "reshape":
            return [self.reshape(xs[0], outs[0].shape)]
        if name == "transpose":
            return [self.transpose(xs[0], op.attr("perm"))]
        if name == "broadcast":
            return [self.broadcast(xs[0], outs[0].shape)]
        if name == "slice":
            return [self.slice(xs[0], op.attr("starts"), op.attr("ends"), op.attr("steps"))]
        if name == "split":
            axis = op.attr("axis") % xs[0].rank
            views, start = [], 0
            for size in op.attr("sizes"):  # each piece: the same strides, an offset along `axis`
                v = xs[0]
                views.append(View(v.buf, v.offset + start * v.strides[axis],
                                  v.shape[:axis] + (size,) + v.shape[axis + 1:], v.strides, v.dtype, v.literal,
                                  v.value))
                start += size
            return views
        return None

    # --- computing ops ------------------------------------------------------------

    def _temp(self, info, like: View | None = None) -> View:
        """A new intermediate; channels-last when `like`, a value of its rank, is."""
        view = self._new_buffer("temp", info.dtype, info.shape)
        if like is not None and self.is_channels_last(like) and like.rank == len(info.shape):
            view = View(view.buf, view.offset, view.shape, channels_last_strides(view.shape), view.dtype)
        return view

    @staticmethod
    def _laid_out_for_reader(op: TgOp, out: View) -> View:
        """`out` (a fresh buffer) laid out as its one reader wants it, where that is a
        transpose keeping the last axis (attention's heads merged back between the rows
        and the features): the transpose is then contiguous, and a reshape after it free."""
        reader = _sole_reader(op.results[0])
        perm = tuple(reader.attr("perm")) if isinstance(reader, TgOp) and reader.op_name == "transpose" else None
        if perm is None or perm[-1] != len(perm) - 1:
            return out
        moved = tuple(out.shape[p] for p in perm)
        inverse = [perm.index(i) for i in range(len(perm))]
        return View(out.buf, out.offset, out.shape, tuple(contiguous_strides(moved)[i] for i in inverse), out.dtype)

    def is_channels_last(self, view: View) -> bool:
        return (view.literal is None and view.rank >= 3 and not self.is_contiguous(view)
                and all(_is_one(d) or _eq(st, want) for d, st, want in
                        zip(view.shape, view.strides, channels_last_strides(view.shape))))

    def _check_dtypes(self, op: TgOp, xs: list[View]) -> None:
        for t in [*(x.dtype for x in xs), *(i.dtype for i in op.result_infos())]:
            if t not in CTYPES:
                raise Unsupported(f"{t} has no C type here")

    def compute(self, op: TgOp, xs: list[View]) -> list[View]:
        name = op.op_name
        self._check_dtypes(op, xs)
        if op.SPEC.category == "elementwise" or name == "gelu":
            out = self._temp(op.result_infos()[0], like=xs[0])
            self.elementwise([op], {r: None for r in op.results}, dict(zip(op.operands, xs)), [(op.results[0], out)],
                             op)
            return [out]
        if name == "matmul":
            return [self.matmul(op, xs[0], xs[1], [], {})[0]]
        if name in ("softmax", "layer_norm"):
            return [self.row_op(op, xs)]
        if name in ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min"):
            return [self.reduce(op, xs[0])]
        if name == "gather":
            return [self.gather(op, xs[0], xs[1])]
        if name == "concat":
            return [self.concat(op, xs)]
        if name == "conv":
            return [self.conv(op, xs, [], {})[0]]
        if name in ("max_pool", "avg_pool"):
            return [self.pool(op, xs[0])]
        if name == "pad":
            return [self.pad(op, xs[0])]
        if name == "gather_elements":
            return [self.gather_elements(op, xs[0], xs[1])]
        if name == "tile":
            return [self.tile(op, xs[0])]
        if name == "cumsum":
            return [self.cumsum(op, xs[0])]
        if name == "attention":
            return [self.attention(op, xs)]
        if name == "matmul_integer":
            return [self.matmul_integer(op, xs)]
        if name == "dynamic_quantize":
            return self.dynamic_quantize(op, xs[0])
        if name in ("quantize", "dequantize"):
            return [self.requantize(op, xs)]
        raise Unsupported(name)

    # --- quantized ops (ir/quant.py's semantics) ------------------------------------

    def dynamic_quantize(self, op: TgOp, x: View) -> list[View]:
        q_info, s_info = op.result_infos()
        if op.attr("block_size") or q_info.dtype != "i8" or x.dtype != "f32" or x.literal is not None or \
                not self.is_contiguous(x):
            raise Unsupported("dynamic_quantize: rows of f32 to i8")
        q, scale = self._temp(q_info), self._temp(s_info)
        n = x.shape[-1]
        self._step(_describe(op), [f"tg_dynamic_quantize_rows({self.ptr(x)}, {self.ptr(q, False)}, "
                                   f"{self.ptr(scale, False)}, {self.ints(numel(x.shape[:-1]))}, {self.ints(n)});"],
                   [x], [q, scale])
        return [q, scale]

    def requantize(self, op: TgOp, xs: list[View]) -> View:
        """quantize / dequantize with a scale per tensor, per channel or broadcast, as one loop."""
        info = op.result_infos()[0]
        x = xs[0]
        if op.attr("block_size") or x.literal is not None:
            raise Unsupported("block scales")
        if op.op_name == "quantize" and (not FORMATS[op.attr("to")].integer or x.dtype not in FLOATS):
            raise Unsupported("quantize to a float format")
        self._check_dtypes(op, xs)
        operands = {}
        for v, view in zip(op.operands, xs):
            if v is not op.operands[0] and view.rank == 1 and x.rank > 1:  # per channel: along `axis`
                axis = op.attr("axis") % x.rank
                view = self.reshape(view, tuple(view.shape[0] if i == axis else 1 for i in range(x.rank)))
            operands[v] = view
        out = self._temp(info)
        self.elementwise([op], {op.results[0]: None}, operands, [(op.results[0], out)], op)
        return out

    def matmul_integer(self, op: TgOp, xs: list[View]) -> View:
        """int8 x int8 -> int32 on oneDNN (VNNI where the processor has it). When the one
        reader of the result dequantizes it by one f32 scale per column, oneDNN applies
        that scale and writes f32: the dequantize is folded into the GEMM."""
        if len(xs) > 2:
            return self._matmul_integer_zero_point(op, *xs)
        a, b = xs
        users = {use.operation for use in op.results[0].uses}
        user = users.pop() if len(users) == 1 else None
        scales = None
        if (getattr(user, "op_name", None) == "dequantize" and len(user.operands) == 2
                and not user.attr("block_size") and user.result_infos()[0].dtype == "f32"):
            source = user.operands[1].owner
            if self.prog.canon(user.operands[1]) not in self.views and getattr(source, "op_name", None) in (
                    "weight", "constant"):
                self.op(source)
            s = self.views.get(self.prog.canon(user.operands[1]))
            n = op.result_infos()[0].shape[-1]
            if s is not None and s.literal is None and s.rank == 1 and _eq(s.shape[0], n) and \
                    user.attr("axis") % len(op.result_infos()[0].shape) == len(op.result_infos()[0].shape) - 1 \
                    and self.is_contiguous(s):
                scales = s
        out = self.matmul(op, a, b, [], {}, scales=scales)[0]
        if scales is not None:
            self.folded[user] = out
        return out

    def _matmul_integer_zero_point(self, op: TgOp, a: View, b: View, zero: View) -> View:
        """(a - z) @ b = a @ b - z * (column sums of b), exactly, in int32: the GEMM on oneDNN
        without the zero point, then one pass subtracting z times b's column sums (an
        asymmetric uint8 activation times an int8 weight, calibrated w8a8)."""
        if b.rank != 2 or not _is_one(numel(zero.shape)) or op.result_infos()[0].dtype != "i32":
            raise Unsupported("matmul_integer: one zero point, a 2-D right operand, int32")
        out = self.matmul(op, a, b, [], {})[0]
        if not self.is_contiguous(out):
            raise Unsupported("matmul_integer: a strided result")
        k, n = b.shape
        sums = self._temp(TensorInfo((n,), "i32"))
        z = zero.literal if zero.literal is not None else f"({self.ptr(zero)})[0]"
        lines = [
            "{",
            f"    const {CTYPES[b.dtype]} *B = {self.ptr(b)};",
            f"    int32_t *S = {self.ptr(sums, False)}, *C = {self.ptr(out, False)};",
            f"    const int32_t z = (int32_t){z};",
            f"    for (int64_t j = 0; j < {self.ints(n)}; j++) S[j] = 0;",
            f"    for (int64_t p = 0; p < {self.ints(k)}; p++)",
            "        #pragma omp simd",
            f"        for (int64_t j = 0; j < {self.ints(n)}; j++) S[j] += (int32_t)B[p * {self.ints(b.strides[0])} + "
            f"j * {self.ints(b.strides[1])}];",
            *("    " + line for line in self._parallel_for(numel(out.shape), 1)),
            f"    for (int64_t r = 0; r < {self.ints(numel(out.shape[:-1]))}; r++)",
            "        #pragma omp simd",
            f"        for (int64_t j = 0; j < {self.ints(n)}; j++) C[r * {self.ints(n)} + j] -= z * S[j];",
            "}",
        ]
        self._step("matmul_integer: the zero point times the column sums", lines,
                   [b, out] + ([zero] if zero.literal is None else []), [out, sums])
        return out

    def attention(self, op: TgOp, xs: list[View]) -> View:
        """runtime.h's flash-style kernel; q, k, v rows must be contiguous (copied if not)."""
        info = op.result_infos()[0]
        if info.dtype != "f32" or any(x.literal is not None for x in xs[:3]):
            raise Unsupported("attention in f32")
        # rows contiguous, row strides at least a row (what sgemm's leading dimensions take)
        q, k, v = (x if _eq(x.strides[-1], 1) and sympy.sympify(x.strides[-2] - x.shape[-1]).is_nonnegative
                   else self.materialize(x) for x in xs[:3])
        mask = xs[3] if len(xs) > 3 else None
        out = self._laid_out_for_reader(op, self._temp(info))
        group = op.parent_op()
        tile = group.tile() if isinstance(group, FusionOp) else {}  # the flash blocks `tile` chose
        batch = info.shape[:-2]
        lq, lk = q.shape[-2], k.shape[-2]

        def batch_strides(x: View, rows) -> list:
            full = self.broadcast(View(x.buf, x.offset, x.shape[:-2] + (1, 1), x.strides[:-2] + (0, 0), x.dtype),
                                  tuple(batch) + (1, 1))
            return list(full.strides[:-2])

        arr = self._c_array
        mask_kind, mask_ptr, mr, mc, mb = 0, "NULL", 0, 0, [0] * len(batch)
        if mask is not None:
            if mask.literal is not None:
                raise Unsupported("a scalar attention mask")
            full = self.broadcast(mask, tuple(batch) + (lq, lk))
            mask_kind = 1 if mask.dtype == "i1" else 2
            mask_ptr, mr, mc, mb = self.ptr(mask), full.strides[-2], full.strides[-1], list(full.strides[:-2])
        lines = [
            "{",
            f"    const int64_t bd[] = {arr(batch)}, qb[] = {arr(batch_strides(q, lq))}, kb[] = "
            f"{arr(batch_strides(k, lk))}, vb[] = {arr(batch_strides(v, lk))};",
            f"    const int64_t mb[] = {arr(mb)}, ob[] = {arr(out.strides[:-2])};",
            f"    if (tg_attention({len(batch)}, bd, qb, kb, vb, mb, ob, {self.ptr(q)}, {self.ptr(k)}, {self.ptr(v)}, "
            f"{mask_ptr}, {self.ptr(out, False)}, {self.ints(lq)}, {self.ints(lk)}, {self.ints(q.shape[-1])}, "
            f"{self.ints(v.shape[-1])}, {self.ints(q.strides[-2])}, {self.ints(k.strides[-2])}, "
            f"{self.ints(v.strides[-2])}, {self.ints(out.strides[-2])}, {mask_kind}, {self.ints(mr)}, {self.ints(mc)}, "
            f"{c_float(op.attr('scale'), 'f32')}, {int(bool(op.attr('causal')))}, {tile.get('block_q', 64)}, "
            f"{tile.get('block_kv', 64)})) return 1;",
            "}",
        ]
        self._step(_describe(op), lines, [q, k, v] + ([mask] if mask is not None else []), [out])
        return out

    def host(self, op: TgOp, xs: list[View]) -> list[View]:
        if op in self.padding_convs:  # a convolution C does not run reads its input padded after all
            pad = self.padding_convs.pop(op)[0]
            xs = [self.pad(pad, xs[0]), *xs[1:]]
        outs = [self._temp(info) for info in op.result_infos()]
        # A weight's dequantization (block scales, 4-bit formats) depends on no input: done once,
        # into buffers of its own that the GEMM then packs as it packs a weight.
        once = all(x.literal is not None or self.buffers[x.buf].kind in KNOWN for x in xs) and all(
            sympy.sympify(self.buffers[o.buf].elements).is_number for o in outs)
        for o in outs if once else []:
            self.buffers[o.buf].kind = "folded"
        self.steps.append(Step(f"{op.op_name} (host{', once' if once else ''})", host_op=op, host_in=xs,
                               host_out=outs, reads={x.buf for x in xs if x.buf is not None},
                               writes={o.buf for o in outs}, once=once))
        return outs

    def _c_array(self, values) -> str:
        """A C initializer of int64 values (literals, or s[] entries); {0} when empty."""
        return "{" + ", ".join(self.ints(v) for v in values) + "}" if len(values) else "{0}"

    def _new_prim(self) -> int:
        """The index of a new oneDNN primitive: st->prim[k], its weights in tg_packs[k]."""
        self.gemm_count += 1
        return self.gemm_count - 1

    def _step(self, comment: str, lines: list[str], reads: Sequence[View], writes: Sequence[View],
              state: list[str] | None = None) -> None:
        self.steps.append(Step(comment, lines=lines, reads={v.buf for v in reads if v.buf is not None},
                               writes={v.buf for v in writes}, state=state or []))

    # --- loops ----------------------------------------------------------------------

    def _parallel_for(self, total, loops: int) -> list[str]:
        """The OpenMP pragma sharing `loops` nested loops of `total` work among the threads:
        none where `total` is known and small (a team of one still costs a region)."""
        n = sympy.sympify(total)
        if n.is_number and int(n) <= PARALLEL_MIN:
            return []
        return [f"#pragma omp parallel for{f' collapse({loops})' if loops > 1 else ''} "
                f"if ({self.ints(n)} > {PARALLEL_MIN})"]

    def loop(self, shape, accesses: list[tuple[View, bool]], body) -> list[str]:
        """A loop nest over `shape` reading and writing `accesses` (views of that shape,
        broadcast already; flag: written). `body(refs)` gets each access's C element
        expression and returns the innermost lines. Axes that every access walks
        contiguously are merged; the outer loops run on OpenMP threads."""
        order = list(range(len(shape)))
        written = next((a for a, w in accesses if w), None)
        # Walk memory in a channels-last output's order, unless its channels are fewer than a
        # vector (an image's 3 planes copied into channels-last: read along rows instead).
        if written is not None and self.is_channels_last(written) and not (
                sympy.sympify(shape[1]).is_number and int(shape[1]) < 16 and any(not w and self.is_contiguous(a)
                                                                   for a, w in accesses if a.literal is None)):
            order = [0, *range(2, len(shape)), 1]
        dims = [(shape[i], [a.strides[i] for a, _ in accesses]) for i in order if not _is_one(shape[i])]
        merged: list[tuple[Any, list]] = []
        for d, strides in dims:
            if merged and all(_eq(ps, s * d) for ps, s in zip(merged[-1][1], strides)):
                merged[-1] = (merged[-1][0] * d, strides)
            else:
                merged.append((d, strides))
        lines = ["{"]
        bases = []
        for k, (a, written) in enumerate(accesses):
            if a.literal is not None:
                bases.append(None)
                continue
            lines.append(f"    {'' if written else 'const '}{CTYPES[a.dtype]} *b{k} = {self.ptr(a, not written)};")
            bases.append(f"b{k}")
        if not merged:
            refs = [a.literal if b is None else f"{b}[0]" for (a, _), b in zip(accesses, bases)]
            lines += ["    " + line for line in body(refs)] + ["}"]
            return lines
        total = numel(tuple(d for d, _ in merged))
        outer, (inner_n, inner_strides) = merged[:-1], merged[-1]
        indent = "    "
        if outer:
            lines += [indent + line for line in self._parallel_for(total, len(outer))]
            for i, (d, _) in enumerate(outer):
                lines.append(f"{indent}for (int64_t i{i} = 0; i{i} < {self.ints(d)}; i{i}++)")
            lines.append(indent + "{")
            indent += "    "
            for k, b in enumerate(bases):
                if b is None:
                    continue
                terms = [f"i{i} * {self.ints(st[k])}" for i, (_, st) in enumerate(outer) if self.ints(st[k]) != "0"]
                const = "" if accesses[k][1] else "const "
                lines.append(f"{indent}{const}{CTYPES[accesses[k][0].dtype]} *r{k} = {b}"
                             + "".join(f" + {t}" for t in terms) + ";")
            lines.append(f"{indent}#pragma omp simd")
            loop = f"for (int64_t j = 0; j < {self.ints(inner_n)}; j++) {{"
        elif self._parallel_for(total, 1):
            # Blocks over the threads, each a simd loop: GCC's combined `parallel for simd`
            # ran 10x slower on one thread, its if(false) path included.
            n = self.ints(inner_n)
            lines += [indent + line for line in self._parallel_for(total, 1)]
            lines += [f"{indent}for (int64_t j0 = 0; j0 < {n}; j0 += {SIMD_BLOCK})", f"{indent}#pragma omp simd"]
            loop = f"for (int64_t j = j0; j < (j0 + {SIMD_BLOCK} < {n} ? j0 + {SIMD_BLOCK} : {n}); j++) {{"
        else:
            lines.append(f"{indent}#pragma omp simd")
            loop = f"for (int64_t j = 0; j < {self.ints(inner_n)}; j++) {{"
        refs = []
        for k, b in enumerate(bases):
            if b is None:
                refs.append(accesses[k][0].literal)
                continue
            row = f"r{k}" if outer else b
            st = self.ints(inner_strides[k])
            refs.append(f"{row}[0]" if st == "0" else f"{row}[j]" if st == "1" else f"{row}[j * {st}]")
        lines.append(indent + loop)
        lines += [indent + "    " + line for line in body(refs)]
        lines.append(indent + "}")
        if outer:
            lines.append("    }")
        lines.append("}")
        return lines

    # --- elementwise ------------------------------------------------------------------

    def expr(self, op: TgOp, args: list[str], operand_dtypes: list[str]) -> str:
        """The C expression of one elementwise op on C operand expressions."""
        name, out = op.op_name, op.result_infos()[0]
        if name == "gelu":
            suffix = "" if out.dtype == "f32" else "_d"
            return f"tg_gelu_{'tanh' if op.attr('approximate') == 'tanh' else 'erf'}{suffix}({args[0]})"
        if name == "sigmoid":
            return f"tg_sigmoid{'' if out.dtype == 'f32' else '_d'}({args[0]})"
        if name == "cast":
            src, dst = operand_dtypes[0], out.dtype
            if dst == "i1":
                return f"(({args[0]}) != 0)"
            if src in FLOATS and dst not in FLOATS:
                raise Unsupported("float to integer cast")
            return f"(({CTYPES[dst]})({args[0]}))"
        if name in ("quantize", "dequantize"):
            ct = "double" if out.dtype == "f64" else "float"
            x, scale = (f"(({ct})({arg}))" for arg in args[:2])
            zp = f"(({ct})({args[2]}))" if len(args) > 2 else None
            if name == "dequantize":
                return f"(({x}{f' - {zp}' if zp else ''}) * {scale})"
            fmt = FORMATS[op.attr("to")]
            rounded = f"rintf({x} / {scale}){f' + {zp}' if zp else ''}"
            return f"(({CTYPES[out.dtype]})tg_saturate({rounded}, {fmt.lo}.f, {fmt.hi}.f))"
        if name == "bitwise_not" and out.dtype == "i1":  # ~ of a bool byte is 0xFE/0xFF, both true
            return f"(!({args[0]}))"
        if name == "add" and out.dtype == "i1":  # NumPy's True + True is True, C's is 2
            return f"(({args[0]}) != 0 || ({args[1]}) != 0)"
        is_float = operand_dtypes[-1] in FLOATS
        names = dict(zip(op.SPEC.operand_names, args))
        for templates in ((C_UNARY_FLOAT, C_BINARY_FLOAT) if is_float else (C_UNARY_INT, C_BINARY_INT)) + (C_BINARY,):
            if name in templates:
                f32 = operand_dtypes[-1] == "f32"
                if name == "pow" and f32 and args[1] in ("2.0f", "3.0f"):  # a literal exponent (gelu_new's
                    # x ** 3): products, not a libm call per element
                    return "(" + " * ".join([f"({args[0]})"] * int(float(args[1][:-1]))) + ")"
                return templates[name].format(**names, exp="tg_expf" if f32 else "exp", tanh="tg_tanhf" if f32 else "tanh",
                                              erf="tg_erff" if f32 else "erf")
        raise Unsupported(name)

    def elementwise(self, ops: list[TgOp], inner: dict, inputs: dict, outputs: list[tuple[SSAValue, View]],
                    describe, alias: dict | None = None) -> None:
        """One loop computing `ops` (elementwise, in order) at every element of the
        outputs' shape: `inputs` maps outside values to views, `inner` the values
        computed in the loop, `outputs` (value, view) pairs of one shape."""
        shape = outputs[0][1].shape
        reads: list[View] = []
        operand_ref: dict[SSAValue, int] = {}
        for v, view in inputs.items():
            if view.rank > len(shape):
                raise Unsupported("an input larger than the loop")
            operand_ref[v] = len(reads)
            reads.append(self.broadcast(view, shape))
        accesses = [(r, False) for r in reads] + [(o, True) for _, o in outputs]

        def viewed(v: SSAValue) -> SSAValue:  # a view made in the loop is the value it views
            while alias and v in alias:
                v = alias[v]
            return v

        def body(refs):
            lines, local = [], {}
            for v, k in operand_ref.items():
                local[v] = refs[k]
            for i, op in enumerate(ops):
                args = [local[viewed(v)] for v in op.operands]
                dts = [info_of(v.type).dtype for v in op.operands]
                out = op.result_infos()[0]
                lines.append(f"const {CTYPES[out.dtype]} t{i} = {self.expr(op, args, dts)};")
                local[op.results[0]] = f"t{i}"
            for k, (v, _) in enumerate(outputs):
                lines.append(f"{refs[len(reads) + k]} = {local[viewed(v)]};")
            return lines

        lines = self.loop(shape, accesses, body)
        self._step(_describe(describe), lines, reads, [o for _, o in outputs])

    # --- groups -------------------------------------------------------------------------

    def group(self, group: FusionOp) -> None:
        ops = group.ops
        env: dict[SSAValue, View] = {a: self.view(v) for a, v in zip(group.block.args, group.operands)}
        yields = list(group.block.last_op.operands)
        done = False
        try:
            if group.kind == "elementwise":
                done = self.fused_elementwise(group, ops, env, yields) or self.fused_rows(group, ops, env, yields)
            elif ops and ops[0].op_name in ("matmul", "conv") and group.kind in ("matmul_epilogue", "conv_epilogue",
                                                                                  "matmul", "reduction"):
                done = self.fused_contraction(group, ops, env, yields)
            elif group.kind == "horizontal_matmul":
                done = self.fused_siblings(group, ops, env, yields)
            elif group.kind == "reduction":
                done = self.fused_row(group, ops, env, yields) or self.fused_rows(group, ops, env, yields)
        except Unsupported:
            done = False
        if not done:
            for op in ops:
                self.op(op, env)
        for r, y in zip(group.results, yields):
            self.views[r] = env[y] if y in env else self.view(y)

    def _made_outside(self, op: TgOp, env: dict, computed) -> bool:
        """A constant, or a view of a value from outside the loop: made here, not in it."""
        if op.op_name == "constant":
            env[op.results[0]] = self.constant(op)
            return True
        if op.op_name in ("reshape", "transpose", "broadcast") and op.operands[0] not in computed:
            env[op.results[0]] = self.layout(op, [env[op.operands[0]]])[0]
            return True
        return False

    def fused_elementwise(self, group: FusionOp, ops, env, yields) -> bool:
        """A group of elementwise ops (and views of its inputs) as one loop. A reshape of a
        value computed in the loop that keeps the last dim (a linear layer's 2-D product
        back to its batch shape) is nothing in a loop over (rows, last dim)."""
        computed: dict[SSAValue, None] = {}
        inputs: dict[SSAValue, View] = {}
        consumer: dict[SSAValue, tuple] = {}  # input -> the shape of the first op reading it
        alias: dict[SSAValue, SSAValue] = {}
        body = []
        shape = info_of(yields[0].type).shape
        for op in ops:
            if op.op_name == "reshape" and op.operands[0] in computed and shape and \
                    _eq(info_of(op.operands[0].type).shape[-1:][0] if info_of(op.operands[0].type).shape else 1,
                        op.result_infos()[0].shape[-1:][0] if op.result_infos()[0].shape else 1):
                alias[op.results[0]] = op.operands[0]
                computed[op.results[0]] = None
                continue
            if self._made_outside(op, env, computed):
                continue
            if not (op.SPEC.category == "elementwise" or op.op_name == "gelu"):
                return False
            self._check_dtypes(op, [env[v] for v in op.operands if v in env])
            for v in op.operands:
                if v not in computed and v not in inputs:
                    inputs[v] = env[v]
                    consumer[v] = op.result_infos()[0].shape
            computed[op.results[0]] = None
            body.append(op)
        if not body or any(y not in computed for y in yields):
            return False
        if alias:  # one loop over (rows, last dim), every operand seen that way
            width = shape[-1]
            if any(not _eq(info_of(op.results[0].type).shape[-1:][0] if info_of(op.results[0].type).shape else 1,
                           width) or not _eq(numel(info_of(op.results[0].type).shape), numel(shape))
                   for op in body) or any(not _eq(numel(info_of(y.type).shape), numel(shape)) for y in yields):
                return False
            rows_shape = (sympy.sympify(numel(shape)) / sympy.sympify(width), width)
            inputs = {v: self._as_rows(self.broadcast(view, consumer[v]), rows_shape) for v, view in inputs.items()}
            outs = [(y, self._temp(info_of(y.type))) for y in yields]
            loop_outs = [(y, View(o.buf, o.offset, rows_shape, contiguous_strides(rows_shape), o.dtype))
                         for y, o in outs]
            self.elementwise(body, computed, inputs, loop_outs, group, alias)
            env.update({y: o for y, o in outs})
            return True
        if any(len(info_of(y.type).shape) != len(shape) or
               not all(_eq(a, b) for a, b in zip(info_of(y.type).shape, shape)) for y in yields):
            return False
        like = next((v for v in inputs.values() if self.is_channels_last(v)), None)
        outs = [(y, self._temp(info_of(y.type), like=like)) for y in yields]
        # Operands are named by the values the loop reads.
        self.elementwise(body, computed, inputs, outs, group)
        env.update({y: o for y, o in outs})
        return True

    def _as_rows(self, view: View, rows_shape) -> View:
        """A view (broadcast to its reader's shape) as (rows, last dim): it must repeat
        along all leading dims, or walk them as one run of rows."""
        if view.literal is not None:
            return self.broadcast(view, rows_shape)
        row = _row_stride(view)
        if row is None:
            raise Unsupported("an operand whose rows do not collapse")
        return View(view.buf, view.offset, tuple(rows_shape), (row, view.strides[-1]), view.dtype)

    def fused_row(self, group: FusionOp, ops, env, yields) -> bool:
        """Elementwise ops then softmax or layer_norm over the last axis: the prologue
        as one loop into the result buffer, then the row op in place."""
        last = ops[-1]
        if last.op_name not in ("softmax", "layer_norm") or len(yields) != 1 or yields[0] is not last.results[0]:
            return False
        pro = ops[:-1]
        x = last.operands[0]
        if pro:
            if any(not (o.SPEC.category == "elementwise" or o.op_name == "gelu") for o in pro) or \
                    pro[-1].results[0] is not x:
                return False
            inner = {o.results[0] for o in pro}
            if any(v in inner for o in [last] for v in o.operands[1:]):
                return False
            for o in pro:
                self._check_dtypes(o, [env[v] for v in o.operands if v in env])
            out = self._temp(info_of(x.type))
            inputs = {}
            for o in pro:
                for v in o.operands:
                    if v not in inner and v not in inputs:
                        inputs[v] = env[v]
            self.elementwise(pro, {r: None for r in inner}, inputs, [(x, out)], group)
            env[x] = out
        result = self.row_op(last, [env[v] for v in last.operands], in_place=bool(pro) and _only_use(x, last))
        env[last.results[0]] = result
        return True

    def fused_rows(self, group: FusionOp, ops, env, yields) -> bool:
        """Elementwise ops and reductions over the last axis (keepdims) that keep the rows
        (an RMS norm, a hand-written softmax): one pass over the rows, each reduction a loop
        over its row, every other value an expression computed where it is read (a row
        stays in cache: no intermediate goes through memory)."""
        widths: dict[SSAValue, Any] = {}  # computed value -> its last dim (the row's width, or 1)
        inputs: dict[SSAValue, View] = {}
        body: list[TgOp] = []
        shapes = [info_of(y.type).shape for y in yields]
        if not shapes or not all(shapes):
            return False
        full = next((sh for sh in shapes if not _is_one(sh[-1])), shapes[0])  # rows of width 1: all of them
        lead, width = tuple(full[:-1]), full[-1]
        for op in ops:
            if self._made_outside(op, env, widths):
                continue
            shape = info_of(op.results[0].type).shape
            if len(shape) != len(full) or not all(_eq(a, b) for a, b in zip(shape[:-1], lead)) or \
                    not (_is_one(shape[-1]) or _eq(shape[-1], width)) or len(op.results) != 1:
                return False
            if op.op_name in ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min"):
                src = op.operands[0]
                if [a % len(full) for a in op.attr("axes")] != [len(full) - 1] or not op.attr("keepdims") or \
                        info_of(src.type).dtype not in FLOATS or not _eq(info_of(src.type).shape[-1], width):
                    return False
            elif not (op.SPEC.category == "elementwise" or op.op_name == "gelu"):
                return False
            self._check_dtypes(op, [env[v] for v in op.operands if v in env])
            for v in op.operands:
                if v not in widths and v not in inputs:
                    if env[v].rank > len(full):
                        return False
                    inputs[v] = env[v]
            widths[op.results[0]] = 1 if _is_one(shape[-1]) else width
            body.append(op)
        if not any(o.op_name.startswith("reduce_") for o in body) or any(y not in widths for y in yields):
            return False
        # Inputs broadcast to a row of the group: (lead..., width) or (lead..., 1).
        reads = {v: self.broadcast(view, lead + ((1,) if _is_one(view.shape[-1]) and view.rank else (width,)))
                 if view.rank else self.broadcast(view, lead + (1,)) for v, view in inputs.items()}
        outs = {y: self._temp(info_of(y.type)) for y in dict.fromkeys(yields)}
        views = list(reads.values()) + list(outs.values())
        index = {v: k for k, v in enumerate(list(reads) + list(outs))}
        n_lead = len(lead)

        def ref(v: SSAValue, view: View, at_j: bool) -> str:
            if view.literal is not None:
                return view.literal
            st = self.ints(view.strides[-1]) if at_j and not _is_one(view.shape[-1]) else "0"
            return f"r{index[v]}[{'0' if st == '0' else 'j' if st == '1' else f'j * {st}'}]"

        def row_values(targets: list[SSAValue]) -> tuple[list[str], dict]:
            """Statements computing `targets` (full-width values) at column j, and their names."""
            names: dict[SSAValue, str] = {}
            need: set[SSAValue] = set()
            stack = list(targets)
            while stack:
                v = stack.pop()
                if v in need or v not in widths or widths[v] == 1:
                    continue
                need.add(v)
                stack += list(v.owner.operands)
            lines = []
            for k, o in enumerate(body):
                if o.results[0] in need:
                    args = [arg(v, names) for v in o.operands]
                    dts = [info_of(v.type).dtype for v in o.operands]
                    lines.append(f"const {CTYPES[o.result_infos()[0].dtype]} e{k} = {self.expr(o, args, dts)};")
                    names[o.results[0]] = f"e{k}"
            return lines, names

        scalars: dict[SSAValue, str] = {}

        def arg(v: SSAValue, names: dict) -> str:
            if v in names:
                return names[v]
            if v in scalars:
                return scalars[v]
            return ref(v, reads[v], True)

        inner = []
        for k, o in enumerate(body):
            if widths[o.results[0]] != 1:
                continue
            out_t = CTYPES[o.result_infos()[0].dtype]
            if o.op_name.startswith("reduce_"):
                kind = o.op_name[len("reduce_"):]
                lines, names = row_values([o.operands[0]])
                init, step = REDUCE_INIT[kind], REDUCE_STEP[kind]
                inner += [f"{out_t} s{k};", "{", f"    double acc = {init};",
                          f"    for (int64_t j = 0; j < {self.ints(width)}; j++) {{",
                          *("        " + line for line in lines),
                          f"        const double v = {arg(o.operands[0], names)};", "        " + step, "    }",
                          f"    s{k} = ({out_t})(" + (f"acc / (double){self.ints(width)}" if kind == "mean" else "acc")
                          + ");", "}"]
            else:
                dts = [info_of(v.type).dtype for v in o.operands]
                inner.append(f"const {out_t} s{k} = {self.expr(o, [arg(v, {}) for v in o.operands], dts)};")
            scalars[o.results[0]] = f"s{k}"
        full_yields = [y for y in outs if widths[y] != 1]
        for y in outs:
            if widths[y] == 1:
                inner.append(f"r{index[y]}[0] = {scalars[y]};")
        if full_yields:
            lines, names = row_values(full_yields)
            inner += [f"for (int64_t j = 0; j < {self.ints(width)}; j++) {{", *("    " + line for line in lines)]
            inner += [f"    r{index[y]}[j] = {names[y]};" for y in full_yields] + ["}"]
        lines = ["{"]
        for k, view in enumerate(views):
            written = k >= len(reads)
            if view.literal is None:
                lines.append(f"    {'' if written else 'const '}{CTYPES[view.dtype]} *b{k} = {self.ptr(view, not written)};")
        if n_lead:
            lines += ["    " + line for line in self._parallel_for(numel(lead) * sympy.sympify(width), n_lead)]
            lines += [f"    for (int64_t i{d} = 0; i{d} < {self.ints(n)}; i{d}++)" for d, n in enumerate(lead)]
        lines.append("    {")
        for k, view in enumerate(views):
            if view.literal is None:
                written = k >= len(reads)
                terms = "".join(f" + i{d} * {self.ints(view.strides[d])}" for d in range(n_lead)
                                if self.ints(view.strides[d]) != "0")
                lines.append(f"        {'' if written else 'const '}{CTYPES[view.dtype]} *r{k} = b{k}{terms};")
        lines += ["        " + line for line in inner] + ["    }", "}"]
        self._step(_describe(group), lines, list(reads.values()), list(outs.values()))
        env.update(outs)
        return True

    def row_op(self, op: TgOp, xs: list[View], in_place: bool = False) -> View:
        info = op.result_infos()[0]
        if info.dtype != "f32" or any(x.dtype != "f32" for x in xs):
            raise Unsupported("row ops in f32 only")
        x = xs[0]
        rank = x.rank
        axis = op.attr("axis") % rank
        if op.op_name == "softmax" and axis != rank - 1:
            raise Unsupported("softmax over a leading axis")
        if not self.is_contiguous(x):
            raise Unsupported("row op on a strided view")
        out = x if in_place else self._temp(info)
        n = numel(x.shape[axis:])
        rows = numel(x.shape[:axis])
        if op.op_name == "softmax":
            call = f"tg_softmax_rows({self.ptr(x)}, {self.ptr(out, False)}, {self.ints(rows)}, {self.ints(n)});"
            reads = [x]
        else:
            params = []
            reads = [x]
            for p in xs[1:3]:
                if p is None:
                    params.append("NULL")
                    continue
                full = self.broadcast(p, x.shape[axis:])
                if p.literal is not None or not self.is_contiguous(full):
                    raise Unsupported("layer_norm scale or bias not one value per element of a row")
                params.append(self.ptr(full))
                reads.append(p)
            while len(params) < 2:
                params.append("NULL")
            call = (f"tg_layer_norm_rows({self.ptr(x)}, {self.ptr(out, False)}, {params[0]}, {params[1]}, "
                    f"{self.ints(rows)}, {self.ints(n)}, {c_float(op.attr('epsilon'), 'f32')});")
        self._step(_describe(op), [call], reads, [out])
        return out

    # --- reductions, gathers, copies ----------------------------------------------------

    def reduce(self, op: TgOp, x: View) -> View:
        info = op.result_infos()[0]
        kind = op.op_name[len("reduce_"):]
        axes = sorted(a % x.rank for a in op.attr("axes"))  # none: nothing is reduced (np.sum(axis=()))
        if kind == "mean" and x.dtype not in FLOATS:
            raise Unsupported("integer mean")
        out = self._temp(info)
        keep = [i for i in range(x.rank) if i not in axes]
        kept_shape = tuple(x.shape[i] for i in keep)
        out_view = View(out.buf, 0, kept_shape, contiguous_strides(kept_shape), out.dtype)
        red = View(x.buf, x.offset, tuple(x.shape[i] for i in axes), tuple(x.strides[i] for i in axes), x.dtype,
                   x.literal)
        n = numel(red.shape)
        ctype = CTYPES[x.dtype]
        acc_type = "double" if x.dtype in FLOATS else ctype
        init = REDUCE_INIT[kind] if x.dtype in FLOATS or kind in ("sum", "mean") else ""
        if not init:
            raise Unsupported("integer max/min reduction")
        step = REDUCE_STEP[kind]
        finish = f"acc / (double){self.ints(n)}" if kind == "mean" else "acc"
        # Each output element walks its reduced axes as a nest of loops.
        kept_view = View(x.buf, x.offset, kept_shape, tuple(x.strides[i] for i in keep), x.dtype, x.literal)

        def body(refs):
            lines = [f"const {ctype} *base = &{refs[0]};", f"{acc_type} acc = {init};"]
            idx = []
            for i, (d, st) in enumerate(zip(red.shape, red.strides)):
                lines.append("    " * i + f"for (int64_t k{i} = 0; k{i} < {self.ints(d)}; k{i}++)")
                idx.append(f"k{i} * {self.ints(st)}")
            depth = "    " * len(red.shape)
            lines.append(depth + "{ " + f"const {acc_type} v = base[{' + '.join(idx) or '0'}]; " + step + " }")
            lines.append(f"{refs[1]} = ({CTYPES[info.dtype]})({finish});")
            return lines

        if x.literal is not None:
            raise Unsupported("reduction of a literal")
        lines = self.loop(kept_shape, [(kept_view, False), (out_view, True)], body)
        lines = [line.replace("#pragma omp simd", "") for line in lines]
        self._step(_describe(op), lines, [x], [out])
        return out

    def gather(self, op: TgOp, table: View, ids: View) -> View:
        """Slices of a table along an axis by index (rows: embedding lookups); an index out
        of range is an error naming the op and the range, never a read outside the table."""
        info = op.result_infos()[0]
        axis = op.attr("axis") % table.rank
        if ids.dtype not in ("i64", "i32"):
            raise Unsupported("gather by i64 or i32 indices")
        table, ids = (v if self.is_contiguous(v) else self.materialize(v) for v in (table, ids))
        out = self._temp(info)
        rows = self.ints(table.shape[axis])
        outer = self.ints(numel(table.shape[:axis]))
        width = self.ints(numel(table.shape[axis + 1:]))
        count = self.ints(numel(ids.shape))
        ctype = CTYPES[table.dtype]
        lines = [
            "{",
            f"    const {CTYPES[ids.dtype]} *ids = {self.ptr(ids)};",
            f"    const {ctype} *table = {self.ptr(table)};",
            f"    {ctype} *out = {self.ptr(out, False)};",
            f"    for (int64_t o = 0; o < {outer}; o++)",
            f"    for (int64_t i = 0; i < {count}; i++) {{",
            "        int64_t r = ids[i];",
            f"        if (r < -{rows} || r >= {rows})",
            f'            TG_FAIL("gather: index %lld is out of range [-%lld, %lld) of the table (step %d)", '
            f"(long long)r, (long long){rows}, (long long){rows}, {len(self.steps)});",
            f"        if (r < 0) r += {rows};",
            f"        memcpy(out + (o * {count} + i) * {width}, table + (o * {rows} + r) * {width}, "
            f"sizeof({ctype}) * {width});",
            "    }",
            "}",
        ]
        self._step(_describe(op), lines, [table, ids], [out])
        return out

    def tile(self, op: TgOp, x: View) -> View:
        """np.tile as one copy: the output seen as (r0, d0, r1, d1, ...) reads x repeated
        (stride 0) along each r."""
        info = op.result_infos()[0]
        reps = list(op.attr("repeats"))
        if x.literal is not None or len(reps) != x.rank:
            raise Unsupported("tile of a tensor, one repeat per dim")
        out = self._temp(info)
        split = tuple(d for r, n in zip(reps, x.shape) for d in (r, n))
        dst = View(out.buf, out.offset, split, contiguous_strides(split), out.dtype)
        src = View(x.buf, x.offset, split, tuple(st for s_ in x.strides for st in (sympy.Integer(0), s_)), x.dtype)
        self._step(_describe(op), self.loop(split, [(src, False), (dst, True)], lambda refs: [f"{refs[1]} = {refs[0]};"]),
                   [x], [out])
        return out

    def _nest(self, shape, skip: int | None, inner: list[str]) -> list[str]:
        """Loops c0, c1, ... over `shape` (leaving out axis `skip`) around `inner`."""
        dims = [d for d in range(len(shape)) if d != skip]
        lines = [f"{'    ' * k}for (int64_t c{d} = 0; c{d} < {self.ints(shape[d])}; c{d}++)" for k, d in enumerate(dims)]
        return lines + ["    " * len(dims) + line for line in inner]

    def _at(self, view: View, coords: dict[int, str]) -> str:
        """The element offset of `view` at C coordinate expressions (dims of size 1: 0)."""
        terms = [f"{c} * {self.ints(view.strides[d])}" for d, c in coords.items() if not _is_one(view.shape[d])]
        return " + ".join(terms) or "0"

    def gather_elements(self, op: TgOp, x: View, ids: View) -> View:
        """out[c] = x[c with c[axis] = ids[c]], an index out of range an error."""
        info = op.result_infos()[0]
        axis = op.attr("axis") % x.rank
        if ids.dtype not in ("i64", "i32") or ids.literal is not None or x.literal is not None or any(
                d != axis and not (_is_one(xd) or _eq(xd, od)) for d, (xd, od) in enumerate(zip(x.shape, ids.shape))):
            raise Unsupported("gather_elements: i64/i32 indices, x as large as them but along the axis")
        out = self._temp(info)
        coords = {d: f"c{d}" for d in range(x.rank)}
        rows = self.ints(x.shape[axis])
        ctype = CTYPES[x.dtype]
        lines = ["{", f"    const {CTYPES[ids.dtype]} *ids = {self.ptr(ids)};", f"    const {ctype} *x = {self.ptr(x)};",
                 f"    {ctype} *out = {self.ptr(out, False)};"]
        lines += ["    " + line for line in self._nest(info.shape, None, [
            "{",
            f"    int64_t r = ids[{self._at(ids, coords)}];",
            f"    if (r < -{rows} || r >= {rows})",
            f'        TG_FAIL("gather_elements: index %lld is out of range [-%lld, %lld) (step %d)", (long long)r, '
            f"(long long){rows}, (long long){rows}, {len(self.steps)});",
            f"    if (r < 0) r += {rows};",
            f"    out[{self._at(out, coords)}] = x[{self._at(x, {**coords, axis: 'r'})}];",
            "}"])]
        lines.append("}")
        self._step(_describe(op), lines, [x, ids], [out])
        return out

    def cumsum(self, op: TgOp, x: View) -> View:
        """Running sums along an axis, in the order of the axis (or reversed), exclusive or not."""
        info = op.result_infos()[0]
        axis = op.attr("axis") % max(x.rank, 1)
        if x.literal is not None or x.rank == 0:
            raise Unsupported("cumsum of a tensor")
        out = self._temp(info)
        n = self.ints(x.shape[axis])
        ctype = CTYPES[info.dtype]
        k = f"({n} - 1 - k)" if op.attr("reverse") else "k"
        coords = {d: f"c{d}" for d in range(x.rank) if d != axis}
        at_x = self._at(x, {**coords, axis: k})
        at_out = self._at(out, {**coords, axis: k})
        step = [f"out[{at_out}] = acc;", f"acc += x[{at_x}];"] if op.attr("exclusive") else \
            [f"acc += x[{at_x}];", f"out[{at_out}] = acc;"]
        lines = ["{", f"    const {ctype} *x = {self.ptr(x)};", f"    {ctype} *out = {self.ptr(out, False)};"]
        lines += ["    " + line for line in self._nest(info.shape, axis, [
            "{", f"    {ctype} acc = 0;", f"    for (int64_t k = 0; k < {n}; k++) {{",
            *("        " + line for line in step), "    }", "}"])]
        lines.append("}")
        self._step(_describe(op), lines, [x], [out])
        return out

    def concat(self, op: TgOp, xs: list[View]) -> View:
        info = op.result_infos()[0]
        out = self._temp(info)
        axis = op.attr("axis") % len(info.shape)
        start = sympy.Integer(0)
        lines = []
        for x in xs:
            if x.literal is not None and x.rank:
                raise Unsupported("concat of a literal")
            part = View(out.buf, start * out.strides[axis], x.shape, out.strides, out.dtype)
            lines += self.loop(x.shape, [(x, False), (part, True)], lambda refs: [f"{refs[1]} = {refs[0]};"])
            start = start + x.shape[axis]
        self._step(_describe(op), lines, xs, [out])
        return out

    def pool(self, op: TgOp, x: View) -> View:
        """Max and average pools over 1-D or 2-D windows (a 1-D pool is a 2-D one of height 1)."""
        info = op.result_infos()[0]
        kernel = list(op.attr("kernel"))
        nd = len(kernel)
        if nd not in (1, 2) or x.dtype != "f32" or any(d != 1 for d in (op.attr("dilations") or [1] * nd)):
            raise Unsupported("pools: 1-D or 2-D, f32, no dilation")
        if op.op_name == "avg_pool" and op.attr("ceil_mode"):
            raise Unsupported("avg_pool with ceil_mode")
        strides = list(op.attr("strides") or [1] * nd)
        pads = list(op.attr("pads") or [0] * (2 * nd))
        out = self._temp(info, like=x if self.is_channels_last(x) else None)
        channels_last = self.is_channels_last(x)
        out_view = out
        if nd == 1:  # (N, C, W) as (N, C, 1, W)
            x = View(x.buf, x.offset, x.shape[:2] + (1,) + x.shape[2:], x.strides[:2] + (0,) + x.strides[2:], x.dtype)
            out_view = View(out.buf, out.offset, out.shape[:2] + (1,) + out.shape[2:],
                            out.strides[:2] + (0,) + out.strides[2:], out.dtype)
            kernel, strides, pads = [1] + kernel, [1] + strides, [0, pads[0], 0, pads[1]]
        n, c, h, w = (self.ints(d) for d in x.shape)
        oh, ow = (self.ints(d) for d in out_view.shape[2:])
        sn, sc, sh, sw = (self.ints(st) for st in x.strides)
        yn, yc, yh, yw = (self.ints(st) for st in out_view.strides)
        # channels innermost when they are contiguous in memory
        axes = ([f"b < {n}", f"oy < {oh}", f"ox < {ow}", f"ch < {c}"] if channels_last else
                [f"b < {n}", f"ch < {c}", f"oy < {oh}", f"ox < {ow}"])
        is_max = op.op_name == "max_pool"
        include_pad = is_max or op.attr("count_include_pad")
        kh, kw = kernel
        # The divisor: the whole window, or (count_include_pad false) the taps inside the input.
        divisor = f"{kh * kw}.f" if include_pad else "(float)count"
        lines = [
            "{",
            f"    const float *x = {self.ptr(x)};",
            f"    float *y = {self.ptr(out, False)};",
            *("    " + line for line in self._parallel_for(numel(info.shape), 2)),
            *(f"    for (int64_t {a.split()[0]} = 0; {a}; {a.split()[0]}++)" for a in axes[:3]),
            f"    for (int64_t {axes[3].split()[0]} = 0; {axes[3]}; {axes[3].split()[0]}++) {{",
            # The window's taps inside the input, as bounds (GCC 12 at -O3 miscompiled the
            # loop that skipped the outside taps with `continue`: averages of 3 of 4 taps).
            f"        const int64_t y0 = oy * {strides[0]} - {pads[0]}, x0 = ox * {strides[1]} - {pads[1]};",
            f"        const int64_t ky0 = y0 < 0 ? -y0 : 0, ky1 = {h} - y0 < {kh} ? {h} - y0 : {kh};",
            f"        const int64_t kx0 = x0 < 0 ? -x0 : 0, kx1 = {w} - x0 < {kw} ? {w} - x0 : {kw};",
            f"        float acc = {'-INFINITY' if is_max else '0.f'};",
            "        for (int64_t ky = ky0; ky < ky1; ky++)",
            "            for (int64_t kx = kx0; kx < kx1; kx++) {",
            f"                float v = x[b * {sn} + ch * {sc} + (y0 + ky) * {sh} + (x0 + kx) * {sw}];",
            "                " + ("acc = v > acc || v != v ? v : acc;" if is_max else "acc += v;"),
            "            }",
            "        const int64_t count = (ky1 > ky0 ? ky1 - ky0 : 0) * (kx1 > kx0 ? kx1 - kx0 : 0);",
            f"        y[b * {yn} + ch * {yc} + oy * {yh} + ox * {yw}] = {'acc' if is_max else f'acc / {divisor}'};",
            "    }",
            "}",
        ]
        self._step(_describe(op), lines, [x], [out])
        return out

    def pad(self, op: TgOp, x: View) -> View:
        """Constant padding: the output filled with the value, then x copied into its interior."""
        pads = list(op.attr("pads"))
        if op.attr("mode") != "constant" or any(not (isinstance(p, int) and p >= 0) for p in pads):
            raise Unsupported("pad: constant mode, pads >= 0")
        info = op.result_infos()[0]
        out = self._temp(info, like=x)
        value = op.attr("value")
        literal = (c_float(value, info.dtype) if info.dtype in FLOATS
                   else f"(({CTYPES[info.dtype]}){int(value)})")
        fill = View(None, 0, out.shape, (sympy.Integer(0),) * out.rank, out.dtype, literal, value)
        interior = View(out.buf, out.offset + sum(p * st for p, st in zip(pads, out.strides)), x.shape, out.strides,
                        out.dtype)
        copy = lambda refs: [f"{refs[1]} = {refs[0]};"]  # noqa: E731
        lines = self.loop(out.shape, [(fill, False), (out, True)], copy) + \
            self.loop(x.shape, [(x, False), (interior, True)], copy)
        self._step(_describe(op), lines, [x], [out])
        return out

    # --- GEMMs and convolutions on oneDNN ------------------------------------------------

    def _posts(self, chain: list[TgOp], acc: SSAValue, env: dict, out_shape,
               geometry) -> tuple[list[str], list[View], int]:
        """oneDNN post-ops for the leading ops of `chain` that it can fuse: returns the C
        initialiser lines of a tg_post array, the views their binary operands read, and
        how many ops of the chain they cover. `geometry(view)` gives an operand, broadcast
        to the result's shape, as the primitive's destination sees it (dims, strides)."""
        posts, operands = [], []
        current = acc
        computed = {acc}  # values the primitive makes: no binary operand may be one
        for op in chain:
            name = op.op_name
            if op.operands[0] is not current and not (name in ("add", "mul") and op.operands[1] is current):
                break
            if info_of(op.results[0].type).dtype != "f32" or len(posts) == 8:
                break
            other = [v for v in op.operands if v is not current]
            if any(v in computed for v in other) or not _only_use(current, op):
                break  # the epilogue overwrites `current`: nothing else may read it
            if name in ("relu", "tanh", "exp", "sigmoid") and not other:
                posts.append(f"{{0, {DNNL_ELTWISE[name]}, 0.f, 0.f, 0, {{0}}, {{0}}}}")
            elif name == "gelu":
                alg = DNNL_ELTWISE["gelu_tanh" if op.attr("approximate") == "tanh" else "gelu_erf"]
                posts.append(f"{{0, {alg}, 0.f, 0.f, 0, {{0}}, {{0}}}}")
            elif name in ("max", "min") and len(other) == 1 and \
                    (env.get(other[0]) or self.view(other[0])).literal is not None:
                bound = (env.get(other[0]) or self.view(other[0])).literal  # relu6 is max then min: a clip each
                lo, hi = (bound, "INFINITY") if name == "max" else ("-INFINITY", bound)
                posts.append(f"{{0, {DNNL_ELTWISE['clip']}, {lo}, {hi}, 0, {{0}}, {{0}}}}")
            elif name in ("add", "mul", "sub") and len(other) == 1:
                o = env.get(other[0]) or self.view(other[0])
                if name == "sub" and op.operands[0] is not current:
                    break
                if o.dtype != "f32":
                    break
                if o.literal is not None:
                    alpha, beta = ("1.f", o.literal) if name == "add" else (o.literal, "0.f") if name == "mul" \
                        else ("1.f", f"-({o.literal})")
                    posts.append(f"{{0, {DNNL_ELTWISE['linear']}, {alpha}, {beta}, 0, {{0}}, {{0}}}}")
                else:
                    if o.rank > len(out_shape):
                        break
                    try:
                        dims, strides = geometry(self.broadcast(o, out_shape))
                    except Unsupported:
                        break
                    # Only a whole tensor or one value per column (a bias): oneDNN 3.2's
                    # GEMM kernels, cached by a key that omits the broadcast, gave wrong
                    # results for a per-row-vector operand (MiniLM's attention mask) once
                    # a kernel with a whole-tensor operand had been made. (A convolution's
                    # per-channel operand, a folded batch norm, sent the small CNN's first
                    # convolution to a kernel 20x slower: it runs as a loop after it.)
                    if not (all(_is_one(d) for d in dims[:-1]) or all(not _is_one(d) or _is_one(o_d)
                                                                      for d, o_d in zip(dims, out_shape))):
                        break
                    posts.append(f"{{1, {DNNL_BINARY[name]}, 0.f, 0.f, {len(dims)}, "
                                 f"{{{', '.join(self.ints(d) for d in dims)}}}, "
                                 f"{{{', '.join(self.ints(s) for s in strides)}}}}}")
                    operands.append(o)
            else:
                break
            current = op.results[0]
            computed.add(current)
            if not info_of(current.type).shape == tuple(out_shape) and \
                    not all(_eq(a, b) for a, b in zip(info_of(current.type).shape, out_shape)):
                posts.pop()
                break
        return posts, operands, len(posts)

    def fused_contraction(self, group: FusionOp, ops, env, yields) -> bool:
        """A GEMM or convolution, its epilogue on oneDNN where it fuses, the rest of the
        group op by op on the result (in place where elementwise)."""
        head, chain = ops[0], ops[1:]
        xs = [env.get(v) or self.view(v) for v in head.operands]
        self._check_dtypes(head, xs)
        if head.op_name == "matmul":
            result, covered = self.matmul(head, xs[0], xs[1], chain, env)
        else:
            result, covered = self.conv(head, xs, chain, env)
        env[chain[covered - 1].results[0] if covered else head.results[0]] = result
        rest = chain[covered:]
        if rest:
            last = rest[-1]
            if last.op_name in ("softmax", "layer_norm") and all(o.SPEC.category == "elementwise" for o in rest[:-1]) \
                    and self._row_prologue(rest, env, group, yields):
                pass
            elif not self._elementwise_rest(group, rest, env, yields):
                for op in rest:
                    self.op(op, env)
        return True

    def fused_siblings(self, group: FusionOp, ops, env, yields) -> bool:
        """Sibling GEMMs of one input (a gated MLP's gate and up projections), each on
        oneDNN, then the ops that combine them as one loop."""
        heads = [op for op in ops if op.op_name == "matmul"]
        rest = [op for op in ops if op.op_name != "matmul"]
        if any(v in {r for h in heads for r in h.results} for h in heads for v in h.operands):
            return False
        for head in heads:
            env[head.results[0]] = self.matmul(head, *(env.get(v) or self.view(v) for v in head.operands), [], env)[0]
        if rest and not self._elementwise_rest(group, rest, env, yields):
            for op in rest:
                self.op(op, env)
        return True

    def _elementwise_rest(self, group, rest, env, yields) -> bool:
        """The ops oneDNN's post-ops did not take, as one loop over the result (not a
        pass over memory per op) where they are all elementwise."""
        try:
            return self.fused_elementwise(group, rest, env, yields)
        except Unsupported:
            return False

    def _row_prologue(self, rest, env, group, yields) -> bool:
        """Elementwise ops then softmax or layer_norm after a GEMM: the ops as one loop into
        the row op's input (and into every value of theirs the group also yields), then the
        row op, in place where it is its input's one reader."""
        try:
            pro, last = rest[:-1], rest[-1]
            x = last.operands[0]
            if pro:
                inner = {o.results[0] for o in pro}
                shape = info_of(x.type).shape
                kept = [y for y in dict.fromkeys(yields) if y in inner and y is not x]
                if x not in inner or any(v in inner for v in last.operands[1:]) or any(
                        info_of(y.type).shape != shape for y in kept):
                    return False  # (checked before anything is emitted)
                inputs = {}
                for o in pro:
                    for v in o.operands:
                        if v not in inner and v not in inputs:
                            inputs[v] = env.get(v) or self.view(v)
                outs = [(v, self._temp(info_of(v.type))) for v in [x, *kept]]
                self.elementwise(pro, {r: None for r in inner}, inputs, outs, group)
                env.update(outs)
            env[last.results[0]] = self.row_op(last, [env.get(v) or self.view(v) for v in last.operands],
                                               in_place=_only_use(x, last))
            return True
        except Unsupported:
            return False

    def matmul(self, op: TgOp, a: View, b: View, chain: list[TgOp], env: dict,
               scales: View | None = None) -> tuple[View, int]:
        """A GEMM on oneDNN: f32, or integer (a i8/ui8, b i8) into i32, or into f32 times
        `scales` (one per column)."""
        info = op.result_infos()[0]
        if scales is not None:
            info = TensorInfo(info.shape, "f32")
        types = (a.dtype, b.dtype, info.dtype)
        if types not in (("f32", "f32", "f32"), ("i8", "i8", "i32"), ("ui8", "i8", "i32"), ("i8", "i8", "f32"),
                         ("ui8", "i8", "f32")):
            raise Unsupported(f"matmul of {a.dtype} x {b.dtype} -> {info.dtype}")
        # A broadcast scalar (an RNN's zero first state) becomes an array: GEMMs read memory.
        a, b = (self.materialize(v) if v.literal is not None else v for v in (a, b))
        a, b = self.for_onednn(a), self.for_onednn(b)
        if a.rank < 2 or b.rank < 2:
            raise Unsupported("matmul of a vector")
        if types == ("f32", "f32", "f32") and scales is None and all(
                sympy.sympify(d).is_number for d in info.shape + a.shape[-1:]) and \
                int(numel(info.shape)) * int(a.shape[-1]) <= SMALL_GEMM:
            return self._small_matmul(op, a, b, info), 0
        out = self._temp(info)
        weight = self.buffers[b.buf].kind in KNOWN and b.rank == 2
        rank = max(a.rank, b.rank)
        if weight and self._collapsible(a):
            # x[..., M, K] @ W[K, N] is one 2-D GEMM over all rows, which takes post-ops.
            rows = numel(a.shape[:-1])
            a = View(a.buf, a.offset, (rows, a.shape[-1]), (a.strides[-2], a.strides[-1]), a.dtype)
            c = View(out.buf, 0, (rows, info.shape[-1]), (info.shape[-1], 1), out.dtype)
            rank = 2

            def geometry(full: View):  # the operand over all rows, as (rows, N)
                row = _row_stride(full)
                if row is None:
                    raise Unsupported("an epilogue operand whose rows do not collapse")
                rows_bc = _eq(row, 0)
                dims = [1 if rows_bc else rows, 1 if _eq(full.strides[-1], 0) else info.shape[-1]]
                return dims, [row if not rows_bc else dims[1], full.strides[-1] if dims[1] != 1 else 1]
        else:
            c = out = self._laid_out_for_reader(op, out)

            def geometry(full: View):
                # Batched GEMMs take no binary post-ops: oneDNN 3.2 gave MiniLM's attention
                # scores plus a broadcast mask wrong results in some processes, not others.
                raise Unsupported("a binary post-op on a batched GEMM")
        posts, post_views, covered = self._posts(chain, op.results[0], env, info.shape, geometry)
        a = self._lead(a, rank)
        b = self._lead(b, rank)
        c = self._lead(c, rank)
        k = self._new_prim()
        arr = self._c_array
        state = [
            "{",
            f"    const int64_t ad[] = {arr(a.shape)}, as[] = {arr(a.strides)};",
            f"    const int64_t bd[] = {arr(b.shape)}, bs[] = {arr(b.strides)};",
            f"    const int64_t cd[] = {arr(c.shape)}, cs[] = {arr(c.strides)};",
            f"    const tg_post posts[] = {{{', '.join(posts) or '{0}'}}};",
            f"    const int types[] = {{{', '.join(DNNL_TYPES[t] for t in types)}}};",
            f"    if (tg_matmul_create(&st->prim[{k}], {rank}, ad, as, bd, bs, cd, cs, types, {int(scales is not None)}, "
            f"{self.ptr(b) if weight else 'NULL'}, &tg_packs[{k}], {len(posts)}, posts)) return 1;",
            "}",
        ]
        post_ptrs = ", ".join(self.ptr(v) for v in post_views) or "NULL"
        lines = ["{", f"    void *const post[] = {{{post_ptrs}}};",
                 f"    if (tg_prim_run(&st->prim[{k}], {self.ptr(a)}, {self.ptr(b)}, "
                 f"{self.ptr(scales) if scales is not None else 'NULL'}, {self.ptr(c, False)}, post)) return 1;", "}"]
        self._step(_describe(op), lines, [a, b, *post_views, *([scales] if scales is not None else [])], [out], state)
        return out, covered

    def _small_matmul(self, op: TgOp, a: View, b: View, info) -> View:
        """A GEMM too small for a library call to pay (an RNN step, a tiny model's heads) as
        loops: each row of the result accumulates rows of b, one simd loop over the columns."""
        out = self._laid_out_for_reader(op, self._temp(info))
        batch = tuple(info.shape[:-2])
        m, n, k = info.shape[-2], info.shape[-1], a.shape[-1]
        a_b, b_b = (self.broadcast(View(v.buf, v.offset, v.shape[:-2], v.strides[:-2], v.dtype), batch)
                    for v in (a, b))
        at = lambda view, batched: " + ".join([f"t{d} * {self.ints(st)}"  # noqa: E731
                                               for d, st in enumerate(batched.strides)] + ["0"])
        lines = ["{", f"    const float *A = {self.ptr(a)}, *B = {self.ptr(b)};", f"    float *C = {self.ptr(out, False)};"]
        lines += [f"    for (int64_t t{d} = 0; t{d} < {self.ints(n_)}; t{d}++)" for d, n_ in enumerate(batch)]
        lines += [
            f"    for (int64_t i = 0; i < {m}; i++) {{",
            f"        const float *ai = A + {at(a, a_b)} + i * {self.ints(a.strides[-2])};",
            f"        float *ci = C + {at(out, View(None, 0, batch, out.strides[:-2], 'f32'))} + "
            f"i * {self.ints(out.strides[-2])};",
            "        #pragma omp simd",
            f"        for (int64_t j = 0; j < {n}; j++) ci[j] = 0.f;",
            f"        for (int64_t p = 0; p < {k}; p++) {{",
            f"            const float aip = ai[p * {self.ints(a.strides[-1])}];",
            f"            const float *bp = B + {at(b, b_b)} + p * {self.ints(b.strides[-2])};",
            "            #pragma omp simd",
            f"            for (int64_t j = 0; j < {n}; j++) ci[j] += aip * bp[j * {self.ints(b.strides[-1])}];",
            "        }",
            "    }",
            "}",
        ]
        self._step(_describe(op), lines, [a, b], [out])
        return out

    def _collapsible(self, a: View) -> bool:
        """Whether a's leading dims and rows walk memory as one run of rows."""
        for i in range(a.rank - 2):
            if not (_is_one(a.shape[i]) or _eq(a.strides[i], a.strides[i + 1] * a.shape[i + 1])):
                return False
        return True

    @staticmethod
    def _lead(v: View, rank: int) -> View:
        # The new size-1 dims get the stride of a whole operand, not 0: oneDNN 3.x runs a matmul
        # with a zero batch stride (an activation times a gathered 2-D weight, issue 20's
        # per-device programs) on its reference kernel, ~2000x slower than brgemm.
        extra = rank - v.rank
        return View(v.buf, v.offset, (1,) * extra + v.shape, (numel(v.shape),) * extra + v.strides, v.dtype,
                    v.literal, v.value)

    def conv(self, op: TgOp, xs: list[View], chain: list[TgOp], env: dict) -> tuple[View, int]:
        info = op.result_infos()[0]
        x, w = (self.for_onednn(v) for v in xs[:2])
        if self.is_contiguous(x) and all(_is_one(d) for d in x.shape[2:]):  # (N, C, 1, 1): the same memory
            x = View(x.buf, x.offset, x.shape, channels_last_strides(x.shape), x.dtype)
        elif not self.is_channels_last(x):
            x = self.materialize(x, channels_last=True)
        bias = xs[2] if len(xs) > 2 else None
        if info.dtype != "f32" or w.literal is not None or x.literal is not None:
            raise Unsupported("conv: f32 tensors")
        constant_weight = self.buffers[w.buf].kind in KNOWN
        if bias is not None and (bias.literal is not None or not self.is_contiguous(bias)):
            raise Unsupported("conv bias")
        groups = op.attr("groups")
        out = self._temp(info)
        out = View(out.buf, out.offset, out.shape, channels_last_strides(out.shape), out.dtype)
        nd = x.rank
        sp = nd - 2
        strides = list(op.attr("strides") or [1] * sp)
        dil = list(op.attr("dilations") or [1] * sp)
        pads = list(op.attr("pads") or [0] * (2 * sp))
        if op in self.padding_convs:
            pads = [a + b for a, b in zip(pads, self.padding_convs[op][1])]
        if groups > 1:
            o, i = w.shape[0], w.shape[1]
            wd = (groups, sympy.sympify(o) / groups) + (i,) + tuple(w.shape[2:])
            ws = (w.strides[0] * (sympy.sympify(o) / groups),) + tuple(w.strides)
        else:
            wd, ws = w.shape, w.strides

        def geometry(full: View):
            dims = [1 if _eq(st, 0) else d for d, st in zip(full.shape, full.strides)]
            return dims, _plain_strides(dims, list(full.strides))
        posts, post_views, covered = self._posts(chain, op.results[0], env, info.shape, geometry)
        k = self._new_prim()
        arr = self._c_array
        state = [
            "{",
            f"    const int64_t xd[] = {arr(x.shape)}, xs[] = {arr(x.strides)};",
            f"    const int64_t wd[] = {arr(wd)}, ws[] = {arr(ws)};",
            f"    const int64_t yd[] = {arr(out.shape)}, ys[] = {arr(out.strides)};",
            f"    const int64_t str[] = {arr(strides)}, dil[] = {arr(dil)}, pad[] = {arr(pads)};",
            f"    const tg_post posts[] = {{{', '.join(posts) or '{0}'}}};",
            f"    if (tg_conv_create(&st->prim[{k}], {nd}, xd, xs, {len(wd)}, wd, ws, yd, ys, {int(bias is not None)}, "
            f"str, dil, pad, {self.ptr(w) if constant_weight else 'NULL'}, &tg_packs[{k}], {len(posts)}, posts)) "
            "return 1;",
            "}",
        ]
        post_ptrs = ", ".join(self.ptr(v) for v in post_views) or "NULL"
        lines = ["{", f"    void *const post[] = {{{post_ptrs}}};",
                 f"    if (tg_prim_run(&st->prim[{k}], {self.ptr(x)}, {self.ptr(w)}, "
                 f"{self.ptr(bias) if bias is not None else 'NULL'}, {self.ptr(out, False)}, post)) return 1;", "}"]
        self._step(_describe(op), lines, [x, w, *([bias] if bias is not None else []), *post_views], [out], state)
        return out, covered

    # --- outputs -------------------------------------------------------------------------

    def outputs(self) -> list[View]:
        return [self.view(v) for v in self.prog.outputs]


def _unit_dims_strided(shape, strides) -> tuple:
    """`strides` with each dim of size 1 given the stride it would have if contiguous, never 0
    (it addresses nothing, but oneDNN runs a matmul with a zero batch stride on its reference
    kernel, 100x slower)."""
    strides = list(strides)
    for k in reversed(range(len(shape))):
        if _is_one(shape[k]):
            strides[k] = strides[k + 1] * shape[k + 1] if k + 1 < len(shape) else sympy.Integer(1)
    return tuple(strides)


def _reshaped_strides(view: View, shape: tuple) -> tuple | None:
    """Strides that show `view` in `shape` without a copy, or None (NumPy's no-copy reshape):
    the dims are cut into runs of equal size, and each run of the old dims must walk memory
    as one run."""
    old = [(d, st) for d, st in zip(view.shape, view.strides) if not _is_one(d)]
    new = [k for k, d in enumerate(shape) if not _is_one(d)]
    strides: list = [sympy.Integer(0)] * len(shape)
    oi = ni = 0
    while oi < len(old) and ni < len(new):
        oj, nj = oi + 1, ni + 1
        po, pn = sympy.sympify(old[oi][0]), sympy.sympify(shape[new[ni]])
        while not _eq(po, pn):
            if not (po.is_number and pn.is_number):
                return None
            if po < pn and oj < len(old):
                po, oj = po * old[oj][0], oj + 1
            elif pn < po and nj < len(new):
                pn, nj = pn * shape[new[nj]], nj + 1
            else:
                return None
        if any(not _eq(old[k][1], old[k + 1][1] * old[k + 1][0]) for k in range(oi, oj - 1)):
            return None
        st = old[oj - 1][1]
        for k in reversed(new[ni:nj]):
            strides[k] = st
            st = st * shape[k]
        oi, ni = oj, nj
    if oi != len(old) or ni != len(new):
        return None
    return _unit_dims_strided(shape, strides)


def _row_stride(view: View):
    """The stride between consecutive rows when `view`'s leading dims are seen as one dim of
    rows (0 where it repeats along all of them), or None where they do not walk memory as one
    run. Dims of size 1 are skipped: their stride means nothing."""
    lead = [(d, st) for d, st in zip(view.shape[:-1], view.strides[:-1]) if not _is_one(d)]
    if all(_eq(st, 0) for _, st in lead):
        return sympy.Integer(0)
    if any(not _eq(outer[1], inner[1] * inner[0]) for outer, inner in zip(lead, lead[1:])):
        return None
    return lead[-1][1]


def _sole_reader(value: SSAValue):
    """The one op reading `value`, seen through the yield of its fusion group; else None."""
    uses = list(value.uses)
    while len(uses) == 1 and isinstance(uses[0].operation, YieldOp):
        group = uses[0].operation.parent_op()
        uses = list(group.results[uses[0].index].uses) if isinstance(group, FusionOp) else []
    return uses[0].operation if len(uses) == 1 else None


def _only_use(value: SSAValue, user) -> bool:
    """Whether `user` is the one reader of `value` (which a group may also yield): only
    then may it overwrite value's buffer."""
    return all(use.operation is user for use in value.uses)


def _plain_strides(dims, strides) -> list:
    """Strides for a oneDNN descriptor: a broadcast (size-1) dim gets the stride a dense
    layout would give it, as oneDNN checks strides even where it never steps."""
    return [numel(tuple(dims[i + 1:])) if _is_one(d) else st for i, (d, st) in enumerate(zip(dims, strides))]


def _describe(op) -> str:
    """One line of IR for a step's comment (escaped by the caller)."""
    if isinstance(op, FusionOp):
        return f"fusion {op.kind}: " + ", ".join(o.op_name for o in op.ops)
    return f"{op.op_name} -> {', '.join(str(i) for i in op.result_infos())}"


# --- the module ---------------------------------------------------------------------------


@dataclass
class CProgram:
    """An emitted module: its C source and what the runtime needs to call it."""

    source: str
    emitter: CEmitter
    plan: list[tuple[str, int]]  # ("segment", k) or ("host", step index), in order
    steps: list[Step]


def emit_program(model: Model, name: str | None = None, per_step: bool = False) -> CProgram:
    """The module; `per_step=True` makes every native step a segment of its own (one
    native call each), so a profiler or a debugger can look between steps."""
    em = CEmitter(model)
    em.run()
    lines = [f"/* tilegraph C backend: model {c_comment(name or _model_name(model))}. Generated code; edit the model, "
             "not this file.", " * inputs:"]
    lines += [f" *   p[{em.views[a].buf}] {c_comment(n)}: {c_comment(str(i))}"
              for a, n, i in zip(model.func.args, model.input_names, model.inputs)]
    lines += [" * outputs:"]
    lines += [f" *   {c_comment(n)}: {c_comment(str(i))}" for n, i in zip(model.output_names, model.outputs)]
    lines += [" */", *_gelu_defines(), '#include "runtime.h"', "#include <tgmath.h>", ""]
    nprim = max(em.gemm_count, 1)
    # A loaded model owns its packed weights (two models of one source share the library,
    # not their weights); each shape binding owns its primitives.
    lines += [f"typedef struct {{ tg_packed w[{nprim}]; }} tg_packs;  /* weights packed once, for every binding */",
              f"typedef struct {{ tg_prim prim[{nprim}]; tg_packs *packs; }} tg_state;  /* one shape binding */",
              "",
              "void *tg_packs_new(void) { return calloc(1, sizeof(tg_packs)); }",
              "",
              "static int tg_state_init(tg_state *st, const int64_t *s, void *const *p) {",
              "    tg_packed *tg_packs = st->packs->w;"]
    for step in em.steps:
        lines += ["    " + line for line in step.state]
    lines += ["    return 0;", "}", "",
              "void *tg_state_new(void *packs, const int64_t *s, void *const *p) {",
              "    tg_state *st = calloc(1, sizeof *st);",
              "    if (!st) return NULL;",
              "    st->packs = packs;",
              "    if (tg_state_init(st, s, p)) { free(st); return NULL; }",
              "    return st;", "}", ""]
    plan: list[tuple[str, int]] = []
    segments: list[list[int]] = []
    for i, step in enumerate(em.steps):
        if step.host_op is not None:
            plan.append(("host", i))
            continue
        lines += [f"/* step {i}: {c_comment(step.comment)} */",
                  f"static int tg_step_{i}(tg_state *st, const int64_t *s, void *const *p) {{"]
        lines += ["    " + line for line in step.lines] + ["    return 0;", "}", ""]
        if per_step or not plan or plan[-1][0] != "segment":
            plan.append(("segment", len(segments)))
            segments.append([])
        segments[-1].append(i)
    for k, members in enumerate(segments):
        lines += [f"int tg_segment_{k}(void *state, const int64_t *s, void *const *p) {{",
                  "    tg_state *st = state;"]
        lines += [f"    if (tg_step_{i}(st, s, p)) return 1;" for i in members]
        lines += ["    return 0;", "}", ""]
    return CProgram("\n".join(lines), em, plan, em.steps)


def _gelu_defines() -> list[str]:
    """kernels.py's float32 gelu fit, for runtime.h's tg_gelu_erf: one fit, two backends."""
    from tilegraph.ir import kernels

    lines = [f"#define TG_GELU_CLIP {kernels._GELU32_CLIP!r}f"]
    lines += [f"#define TG_GELU_P{i} {c!r}f" for i, c in enumerate(kernels._GELU32_EXP)]
    return lines


def _model_name(model: Model) -> str:
    name = getattr(model.module, "sym_name", None)
    return name.data if name is not None else "forward"
