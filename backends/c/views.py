"""Buffers, views and steps of the C emitter: a value is a view (buffer, offset, strides) of a buffer; layout ops make new views, never copies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np
import sympy
from xdsl.ir import SSAValue

from tilegraph.backends.c.tables import CTYPES, STORAGE
from tilegraph.ir import escape
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.model import Model
from tilegraph.ir.ops import Op
from tilegraph.ir.shapes import numel
from tilegraph.ir.strides import (_eq, _is_one, channels_last_strides, contiguous_strides, is_contiguous, reshaped_strides,
                                  unit_dims_strided)  # _eq, _is_one: the other emitter modules import them here


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
    storage: str  # input, weight, constant, temp, or folded (made once from weights, kept)
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
    # The top-level op (a tg.fusion group, or an op outside one) the step computes part or all
    # of: what a per-step profile charges its time to (benchmarks/cost_model_accuracy.py).
    kernel: Any = None
    # A convolution step on its own: what onednn.chain_convolutions reads.
    conv: ConvStep | None = None
    # What onednn.bf16_sources reads: the GEMMs of a constant weight whose source (a whole
    # buffer, rows contiguous) they may read as bf16, (primitive index, source view); and the
    # buffers this step writes whole in one loop that can write them in bf16 instead.
    gemm_sources: list[tuple[int, View]] = field(default_factory=list)
    bf16_writes: set[int] = field(default_factory=set)
    # Buffers the step may read in bf16 throughout (attention's q, k and v: bf16_read_marker in its lines).
    bf16_reads: set[int] = field(default_factory=set)


class ConvStep(NamedTuple):
    """A step's convolution, as onednn.chain_convolutions decides its buffers by."""

    prim: int  # its primitive's index in the state
    src: View
    out: View  # its result (the residual's buffer where it accumulates into it)
    alone: bool  # no other operand of it (weight, bias, post-op operand) lies in src's buffer
    out_alone: bool  # nor in out's
    depthwise: bool  # computes in f32 at bf16 (runtime.c)
    constant_weight: bool  # packed once: at bf16, bf16 x bf16 (runtime.c, tg_bf16_weights)
    block: int = 0  # nonzero: ir/hardware.blocked_conv finds it faster blocked (chain_convolutions decides)


class Unsupported(Exception):
    """This op or group has no C lowering here; the caller falls back (host or per-op)."""


# The C lowering of each op outside a group: op name -> (the emitter method, whether it
# takes the operand views one by one rather than as a list). The method returns the
# result's view (or the list of them). This registry is the C backend's lowering table
# (emit.py derives LOWERINGS from it), so a lowering cannot be declared without existing.
LOWER: dict[str, tuple[Callable, bool]] = {}


def lowers(*ops: str, spread: bool = False) -> Callable[[Callable], Callable]:
    """Registers the decorated emitter method as the C lowering of `ops`."""
    def register(method: Callable) -> Callable:
        for op in ops:
            if op in LOWER:
                raise ValueError(f"tg.{op} has two C lowerings")
            LOWER[op] = (method, spread)
        return method
    return register


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




class EmitterParts:
    """What every part of the C emitter (the mixins CEmitter is made of) shares: its state,
    and for the type checker, each other's methods (a part calls what another defines)."""

    model: Model
    prog: Any
    ints: Ints
    buffers: list[Buffer]
    views: dict[SSAValue, View]
    steps: list[Step]
    gemm_count: int
    constants: list[np.ndarray]
    folded: dict[TgOp, View]
    donated: set[int]
    merged: set[Any]  # tg.fusion groups computed inside an earlier group's step
    early: set[TgOp]  # views lowered ahead of their turn, for such a step

    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...


class Views(EmitterParts):
    """Buffers and the layout ops that only make views."""

    # --- buffers and views ------------------------------------------------------

    def _new_buffer(self, storage: str, dtype: str, shape, index=None) -> View:
        self.buffers.append(Buffer(storage, dtype, sympy.sympify(numel(tuple(shape))), index))
        return View(len(self.buffers) - 1, sympy.Integer(0), tuple(shape), contiguous_strides(shape), dtype)

    def view(self, v: SSAValue) -> View:
        return self.views[self.prog.canon(v)]

    def ptr(self, view: View, const: bool = True) -> str:
        """A C pointer expression to a view's first element."""
        ctype = STORAGE[view.dtype]
        off = self.ints(view.offset)
        base = f"(({'const ' if const else ''}{ctype} *)p[{view.buf}])"
        return base if off == "0" else f"({base} + {off})"

    def is_contiguous(self, view: View) -> bool:
        return view.literal is None and is_contiguous(view.shape, view.strides)

    def _whole_temp(self, v: View) -> bool:
        """Whether `v` is an f32 temporary, all of it, row-major from its start."""
        return v.literal is None and v.dtype == "f32" and self.buffers[v.buf].storage == "temp" and \
            _eq(v.offset, 0) and self.is_contiguous(v) and \
            sympy.expand(sympy.sympify(numel(v.shape)) - self.buffers[v.buf].elements) == 0

    # --- view ops (no data moves) ------------------------------------------------

    def reshape(self, view: View, shape) -> View:
        if view.literal is not None:
            return View(None, 0, tuple(shape), (0,) * len(shape), view.dtype, view.literal, view.value)
        if self.is_contiguous(view):
            return View(view.buf, view.offset, tuple(shape), contiguous_strides(shape), view.dtype)
        strides = reshaped_strides(view.shape, view.strides, tuple(shape))
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
        return View(view.buf, view.offset, view.shape, unit_dims_strided(view.shape, view.strides), view.dtype,
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


def _only_use(value: SSAValue, user) -> bool:
    """Whether `user` is the one reader of `value` (which a group may also yield): only
    then may it overwrite value's buffer."""
    return all(use.operation is user for use in value.uses)


def bf16_marker(buf: int) -> str:
    """The condition of a step's bf16 write of buffer `buf`: false until onednn.bf16_sources
    finds that only bf16 GEMMs read the buffer, then the binding's precision."""
    return f"/*bf16 b{buf}*/0"


def bf16_read_marker(buf: int) -> str:
    """The condition of a step's bf16 read of buffer `buf`: false until onednn.bf16_sources
    finds that its one writer writes it in bf16, then the binding's precision."""
    return f"/*bf16 read b{buf}*/0"


def feeds_gemm(value: SSAValue, depth: int = 8) -> bool:
    """Whether `value` reaches a GEMM's left operand or attention's q, k or v (its bf16
    products read them as bf16), through views, group boundaries and a group's yield: only
    such a loop is given a bf16 twin (onednn.bf16_sources)."""
    if depth == 0:
        return False
    for use in value.uses:
        op = use.operation
        if isinstance(op, FusionOp):
            if feeds_gemm(op.block.args[use.index], depth - 1):
                return True
        elif isinstance(op, TgOp):
            if (op.op_name == Op.matmul and use.index == 0) or (op.op_name == Op.attention and use.index < 3) or \
                    (op.SPEC.view and feeds_gemm(op.results[0], depth - 1)):
                return True
        elif isinstance(op.parent_op(), FusionOp) and op is op.parent_block().last_op:  # the group's yield
            if feeds_gemm(op.parent_op().results[use.index], depth - 1):
                return True
    return False


def _plain_strides(dims, strides) -> list:
    """Strides for a oneDNN descriptor: a broadcast (size-1) dim gets the stride a dense
    layout would give it, as oneDNN checks strides even where it never steps."""
    return [numel(tuple(dims[i + 1:])) if _is_one(d) else st for i, (d, st) in enumerate(zip(dims, strides))]


def _describe(op) -> str:
    """One line of IR for a step's comment (escaped by the caller)."""
    if isinstance(op, FusionOp):
        return f"fusion {op.kind}: " + ", ".join(o.op_name for o in op.ops)
    return f"{op.op_name} -> {', '.join(str(i) for i in op.result_infos())}"
