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

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import sympy
from xdsl.ir import SSAValue

from tilegraph.backends.c.generation import CACHE_OPS, Generation
from tilegraph.backends.c.groups import Groups
from tilegraph.backends.c.kernels import Kernels
from tilegraph.backends.c.loops import Loops
from tilegraph.backends.c.onednn import OneDNN, bf16_sources, chain_convolutions
from tilegraph.backends.c.quant import Quantized
from tilegraph.backends.c.tables import CTYPES, FLOATS, KNOWN, TOPK_MAX
from tilegraph.backends.c.views import (LOWER, Buffer, Ints, Step, Unsupported, View, Views, _describe, _eq, bf16_marker, bf16_read_marker, c_comment,
                                        c_float, feeds_gemm, lowers)
from tilegraph.backends.lowering import table
from tilegraph.backends.program import flatten
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.strides import is_channels_last, result_strides
from tilegraph.ir.model import Model, ModelError
from tilegraph.ir.shapes import info_of, numel
from tilegraph.ir.ops import Op, OPS

# What every op of the table does in this backend when it is not lowered to C: the
# host runs it with the op table's NumPy semantics between native segments. (An op
# lowered in C also runs on the host in a case its lowering refuses, a dtype without
# a C type or a layout it does not take; tests/test_c_backend.py checks each op
# lowered here runs natively on at least one of its examples.)
# The largest attention block the kernel takes: runtime.h's TG_MAX_BLOCK (which says why).
MAX_ATTENTION_BLOCK = 16384

# Query rows per block of attention_grad's kernel (attention_backward.c): its two working slabs
# are this many rows of Lk floats (64 KiB each at GPT-2's 256 keys, in a core's second-level
# cache), and its GEMMs are this tall.
ATTENTION_BACKWARD_ROWS = 64
HOST_FALLBACK = {
    "einsum": "NumPy's einsum on the host",
    "scatter_elements": "host", "scatter_nd": "C for set and add by i64/i32 indices, the host otherwise",
    "pad": "C for constant padding (canonicalize makes a zero pad a convolution reads its padding), the host "
           "for reflect/edge/wrap and negative pads",
    "cumprod": "host", "trilu": "host", "topk": f"C keeping up to {TOPK_MAX} of a row, the host otherwise",
    "reduce_prod": "host",
    "pow": "C for floats, the host for integers",
    "quantize": "C for integer formats, the host for float formats and block scales",
    "dequantize": "C for scales per tensor or channel, the host for block scales",
    "dynamic_quantize": "C for rows to i8, the host for other formats and MX blocks",
    "matmul_integer": "oneDNN for i8/ui8 x i8 (a zero point subtracted after, by b's column sums), else the host",
    "shift_left": "host", "shift_right": "host", "bitcast": "host",
    # Data-dependent sizes: the runtime finds them before planning (ir.interpreter.run_time_sizes).
    "nonzero": "host", "unique": "host", "narrow": "host", "non_max_suppression": "host",
    "rnn": "host (a loop over the steps, NumPy's matmul per step)", "assert_size": "host",
}
# Ops that only make a view (CEmitter.layout), and the leaves every program has.
VIEW_LOWERINGS = (Op.reshape, Op.transpose, Op.broadcast, Op.slice, Op.split, Op.weight, Op.constant)


class CEmitter(Views, Loops, Groups, Kernels, OneDNN, Quantized, Generation):
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
        self.donated: set[int] = set()  # input buffers a step updates in place (a KV cache)
        self.merged: set[FusionOp] = set()  # groups computed inside an earlier group's step
        self.early: set[TgOp] = set()  # views lowered ahead of their turn, for such a step
        self.concats: dict[int, tuple] = {}  # a concat's result buffer -> what Kernels.concat says of it
        for arg_i, (arg, info) in enumerate(zip(model.func.args, model.inputs)):
            self.views[arg] = self._new_buffer("input", info.dtype, info.shape, arg_i)


    # --- the program --------------------------------------------------------------

    def run(self) -> None:
        for op in self.prog.steps:
            if op in self.early:
                continue
            first = len(self.steps)
            if isinstance(op, FusionOp):
                self.group(op)
            else:
                self.op(op)
            for step in self.steps[first:]:
                step.kernel = op

    def op(self, op: TgOp, env: dict | None = None) -> None:
        """Lower one op (top level, or inside a group lowered op by op with `env`
        mapping its block arguments)."""
        views = self.views if env is None else env
        get = (lambda v: views[self.prog.canon(v)]) if env is None else (lambda v: env.get(v) or self.view(v))
        name = op.op_name
        if op in self.folded:
            views[op.results[0]] = self.folded.pop(op)
            return
        if env is None and name in (Op.weight, Op.constant) and op.results[0] in views:
            return  # made early, for a step that folded in its reader
        if name == Op.weight:
            info = op.result_infos()[0]
            views[op.results[0]] = self._new_buffer("weight", info.dtype, info.shape, op.attr("name"))
            return
        if name == Op.constant:
            views[op.results[0]] = self.constant(op)
            return
        try:
            operands = [get(v) for v in op.operands]
            outs = self.layout(op, operands)
            if outs is None:
                outs = self.compute(op, operands)
        except Unsupported:
            outs = self.host(op, [get(v) for v in op.operands])
        views.update(zip(op.results, outs))

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
        if name == Op.reshape:
            return [self.reshape(xs[0], outs[0].shape)]
        if name == Op.transpose:
            return [self.transpose(xs[0], op.attr("perm"))]
        if name == Op.broadcast:
            return [self.broadcast(xs[0], outs[0].shape)]
        if name == Op.slice:
            return [self.slice(xs[0], op.attr("starts"), op.attr("ends"), op.attr("steps"))]
        if name == Op.split:
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

    def _temp(self, info, strides: tuple | None = None) -> View:
        """A new intermediate, row-major or at `strides`."""
        view = self._new_buffer("temp", info.dtype, info.shape)
        return view if strides is None else View(view.buf, view.offset, view.shape, strides, view.dtype)

    def _result(self, op: TgOp, xs: Sequence[View], info=None) -> View:
        """A new buffer for `op`'s result (of `info`, its own by default), laid out where the C
        backend's one rule puts it given the views it reads (ir/strides.result_strides)."""
        strides = dict(zip(op.operands, ((None if x.literal is not None else x.strides) for x in xs)))
        return self._temp(info or op.result_infos()[0], result_strides(op.results[0], strides.get))

    def is_channels_last(self, view: View) -> bool:
        return view.literal is None and is_channels_last(view.shape, view.strides)

    def _check_dtypes(self, op: TgOp, xs: list[View]) -> None:
        for t in [*(x.dtype for x in xs), *(i.dtype for i in op.result_infos())]:
            if t not in CTYPES:
                raise Unsupported(f"{t} has no C type here")

    def compute(self, op: TgOp, xs: list[View]) -> list[View]:
        """`op` through its registered lowering (views.LOWER)."""
        if op.op_name not in LOWER:
            raise Unsupported(op.op_name)
        if op.op_name not in CACHE_OPS:  # an f16 cache has no C arithmetic: only those kernels read its bits
            self._check_dtypes(op, xs)
        method, spread = LOWER[op.op_name]
        out = method(self, op, *xs) if spread else method(self, op, xs)
        return [out] if isinstance(out, View) else out

    @lowers(Op.attention)
    def attention(self, op: TgOp, xs: list[View]) -> View:
        """runtime.h's flash-style kernel; q, k, v rows must be contiguous (copied if not)."""
        info = op.result_infos()[0]
        if info.dtype != "f32" or any(x.literal is not None for x in xs[:3]):
            raise Unsupported("attention in f32")
        # rows contiguous, row strides at least a row (what sgemm's leading dimensions take)
        q, k, v = (x if _eq(x.strides[-1], 1) and sympy.sympify(x.strides[-2] - x.shape[-1]).is_nonnegative
                   else self.materialize(x) for x in xs[:3])
        mask = xs[3] if len(xs) > 3 else None
        out = self._result(op, [q, k, v, *xs[3:]])
        group = op.parent_op()
        tile = group.tile() if isinstance(group, FusionOp) else {}  # the flash blocks `tile` chose
        blocks = [tile.get("block_q", 64), tile.get("block_kv", 64)]
        # Read from the IR (a .mlir file, a cache entry), not only written by `tile`: a zero
        # divides, a negative or a huge one overflows the kernel's working block.
        if not all(type(b) is int and 1 <= b <= MAX_ATTENTION_BLOCK for b in blocks):
            raise ModelError(f"attention's tile has block_q, block_kv = {blocks}; each must be an integer in "
                             f"[1, {MAX_ATTENTION_BLOCK}]")
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
        call = (f"tg_attention({len(batch)}, bd, qb, kb, vb, mb, ob, {self.ptr(q)}, {self.ptr(k)}, {self.ptr(v)}, "
                f"{mask_ptr}, {self.ptr(out, False)}, {self.ints(lq)}, {self.ints(lk)}, {self.ints(q.shape[-1])}, "
                f"{self.ints(v.shape[-1])}, {self.ints(q.strides[-2])}, {self.ints(k.strides[-2])}, "
                f"{self.ints(v.strides[-2])}, {self.ints(out.strides[-2])}, {mask_kind}, {self.ints(mr)}, "
                f"{self.ints(mc)}, {c_float(op.attr('scale'), 'f32')}, {int(bool(op.attr('causal')))}, {blocks[0]}, "
                f"{blocks[1]})")
        lines = [
            "{",
            f"    const int64_t bd[] = {arr(batch)}, qb[] = {arr(batch_strides(q, lq))}, kb[] = "
            f"{arr(batch_strides(k, lk))}, vb[] = {arr(batch_strides(v, lk))};",
            f"    const int64_t mb[] = {arr(mb)}, ob[] = {arr(out.strides[:-2])};",
        ]
        # Flags for this thread's next call (attention.c), each false until onednn.bf16_sources
        # marks its buffer. The result in bf16 where only GEMMs read it (a decoder's output
        # projection): its buffer is the result's own, every element written once. q, k and v
        # each in bf16 where their one writer writes them so (a projection read only here);
        # never a buffer the mask also lies in.
        bf16 = feeds_gemm(op.results[0])
        reads = {x.buf for x in (q, k, v) if self.buffers[x.buf].storage == "temp" and
                 (mask is None or mask.buf != x.buf)}
        flags = [f"tg_set_attention_out_bf16({bf16_marker(out.buf)})"] if bf16 else []
        if reads:
            flags.append("tg_set_attention_in_bf16(" + " | ".join(
                f"({bf16_read_marker(x.buf)} ? {bit} : 0)" for bit, x in ((1, q), (2, k), (4, v)) if x.buf in reads) + ")")
        if flags:
            lines += [f"    {f};" for f in flags] + [f"    int rc = {call};"] + \
                [f"    {f.split('(')[0]}(0);" for f in flags] + ["    if (rc) return 1;", "}"]
        else:
            lines += [f"    if ({call}) return 1;", "}"]
        self._step(_describe(op), lines, [q, k, v] + ([mask] if mask is not None else []), [out])
        self.steps[-1].bf16_reads |= reads
        if bf16:
            self.steps[-1].bf16_writes.add(out.buf)
        return out

    @lowers(Op.attention_grad)
    def attention_grad(self, op: TgOp, xs: list[View]) -> list[View]:
        """attention_backward.c's kernel: q, k, v and gy rows contiguous (copied if not), dq, dk
        and dv new buffers, each laid out as its reader wants it (ir/strides.result_strides: the
        heads merged back by a transpose and a reshape read them where they lie, no copy)."""
        infos = op.result_infos()
        if infos[0].dtype != "f32" or any(x.literal is not None for x in xs[:4]):
            raise Unsupported("attention_grad in f32")
        q, k, v, gy = (x if _eq(x.strides[-1], 1) and sympy.sympify(x.strides[-2] - x.shape[-1]).is_nonnegative
                       else self.materialize(x) for x in xs[:4])
        mask = xs[4] if len(xs) > 4 else None
        lie = dict(zip(op.operands, ((None if x.literal is not None else x.strides) for x in xs)))
        outs = [self._temp(i, result_strides(r, lie.get)) for i, r in zip(infos, op.results)]
        batch, (lq, lk) = tuple(gy.shape[:-2]), (q.shape[-2], k.shape[-2])
        mask_kind, mask_ptr, mr, mc, mb = 0, "NULL", 0, 0, [0] * len(batch)
        if mask is not None:
            if mask.literal is not None:
                raise Unsupported("a scalar attention mask")
            full = self.broadcast(mask, batch + (lq, lk))
            mask_kind = 1 if mask.dtype == "i1" else 2
            mask_ptr, mr, mc, mb = self.ptr(mask), full.strides[-2], full.strides[-1], list(full.strides[:-2])
        strides = [list(x.strides[:-2]) for x in (q, k, v, gy)] + [mb] + [list(o.strides[:-2]) for o in outs]
        call = (f"tg_attention_backward({len(batch)}, bd, bs, {self.ptr(q)}, {self.ptr(k)}, {self.ptr(v)}, "
                f"{self.ptr(gy)}, {mask_ptr}, {', '.join(self.ptr(o, False) for o in outs)}, {self.ints(lq)}, "
                f"{self.ints(lk)}, {self.ints(q.shape[-1])}, {self.ints(v.shape[-1])}, "
                + ", ".join(self.ints(x.strides[-2]) for x in (q, k, v, gy, *outs)) +
                f", {mask_kind}, {self.ints(mr)}, {self.ints(mc)}, {c_float(op.attr('scale'), 'f32')}, "
                f"{int(bool(op.attr('causal')))}, {ATTENTION_BACKWARD_ROWS})")
        lines = ["{", f"    const int64_t bd[] = {self._c_array(batch)}, bs[] = "
                      f"{self._c_array([s for per in strides for s in per])};",
                 f"    if ({call}) return 1;", "}"]
        self._step(_describe(op), lines, [q, k, v, gy] + ([mask] if mask is not None else []), outs)
        return outs

    def host(self, op: TgOp, xs: list[View]) -> list[View]:
        outs = [self._temp(info) for info in op.result_infos()]
        # A weight's dequantization (block scales, 4-bit formats) depends on no input: done once,
        # into buffers of its own that the GEMM then packs as it packs a weight.
        once = all(x.literal is not None or self.buffers[x.buf].storage in KNOWN for x in xs) and all(
            sympy.sympify(self.buffers[o.buf].elements).is_number for o in outs)
        for o in outs if once else []:
            self.buffers[o.buf].storage = "folded"
        self.steps.append(Step(f"{op.op_name} (host{', once' if once else ''})", host_op=op, host_in=xs,
                               host_out=outs, reads={x.buf for x in xs if x.buf is not None},
                               writes={o.buf for o in outs}, once=once))  # type: ignore[misc]
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
                               writes={v.buf for v in writes}, state=state or []))  # type: ignore[misc]

    # --- outputs -------------------------------------------------------------------------

    def outputs(self) -> list[View]:
        return [self.view(v) for v in self.prog.outputs]


# The C backend's lowering table, read off the lowerings that exist (an op HOST_FALLBACK
# names may have one that takes some of its cases: the fallback says which).
LOWERINGS = table(template=[op for op in OPS if (op in LOWER or op in VIEW_LOWERINGS) and op not in HOST_FALLBACK],
                  fallback={op: f"runs on the host between native segments ({why})"
                            for op, why in HOST_FALLBACK.items()})




# --- the module ---------------------------------------------------------------------------

# A module of this much work (FLOPs and elements written, its symbols at 1: `work`), a tenth of
# a second of one core or more, is cut into segments (native calls) of SEGMENT_STEPS steps. A
# training step of a 12-layer GPT-2 is 457 steps and seconds long: cut every 32 it is ~15 calls
# of 0.1-0.5 s, each a chance to follow the neighbours that came or went since the call began
# (runtime.RECHOOSE_S), for a few microseconds of ctypes a call. Shorter modules stay one call.
LONG_WORK, SEGMENT_STEPS = 10_000_000_000, 32


def work(model: Model):
    """The module's work, a sympy expression of its symbols: its FLOPs and the elements it writes
    (a pass over memory is work too)."""
    return sum((op.SPEC.flop_count([info_of(v.type) for v in op.operands], op.result_infos())
                + sum(numel(r.shape) for r in op.result_infos())
                for op in model.module.walk() if isinstance(op, TgOp)), sympy.Integer(0))


@dataclass
class CProgram:
    """An emitted module: its C source and what the runtime needs to call it."""

    source: str
    emitter: CEmitter
    plan: list[tuple[str, int]]  # ("segment", k) or ("host", step index), in order
    steps: list[Step]
    chained: int = 0  # buffers between convolutions left as their producer's kernel writes them
    bf16_sources: int = 0  # buffers only bf16 GEMMs read, written in bf16 at that precision


def emit_program(model: Model, name: str | None = None, per_step: bool = False) -> CProgram:
    """The module; `per_step=True` makes every native step a segment of its own (one
    native call each), so a profiler or a debugger can look between steps. Otherwise a long
    module's segment runs up to SEGMENT_STEPS native steps (LONG_WORK): between them the runtime
    may choose the call's threads again (runtime.RECHOOSE_S)."""
    em = CEmitter(model)
    em.run()
    chained = chain_convolutions(em.steps, em.buffers, em.outputs())
    sources = bf16_sources(em.steps, em.buffers, em.outputs())
    lines = [f"/* tilegraph C backend: model {c_comment(name or _model_name(model))}. Generated code; edit the model, "
             "not this file.", " * inputs:"]
    lines += [f" *   p[{em.views[a].buf}] {c_comment(n)}: {c_comment(str(i))}"
              for a, n, i in zip(model.func.args, model.input_names, model.inputs)]
    lines += [" * outputs:"]
    lines += [f" *   {c_comment(n)}: {c_comment(str(i))}" for n, i in zip(model.output_names, model.outputs)]
    lines += [" */", *_gelu_defines(), '#include "runtime.h"', '#include "blockq.h"', "#include <tgmath.h>", ""]
    nprim = max(em.gemm_count, 1)
    # A loaded model owns its packed weights (two models of one source share the library,
    # not their weights); each shape binding owns its primitives.
    lines += [f"typedef struct {{ tg_packed w[{nprim}]; }} tg_packs;  /* weights packed once, for every binding */",
              f"typedef struct {{ tg_prim prim[{nprim}]; tg_packs *packs; int bf16; }} tg_state;  "
              "/* one shape binding (bf16: its GEMMs multiply in bf16) */",
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
              "    st->bf16 = tg_bf16_on();",
              "    if (tg_state_init(st, s, p)) { free(st); return NULL; }",
              "    return st;", "}", "",
              "void tg_state_free(void *state) {  /* a binding the runtime evicts */",
              "    tg_state *st = state;",
              f"    for (int i = 0; i < {nprim}; i++) tg_prim_destroy(&st->prim[i]);",
              "    free(st);", "}", "",
              "size_t tg_state_own_bytes(void *state) {  /* reorder scratch the primitives hold outside the arena */",
              "    tg_state *st = state;",
              "    size_t n = 0;",
              f"    for (int i = 0; i < {nprim}; i++) n += st->prim[i].own_bytes;",
              "    return n;", "}", ""]
    plan: list[tuple[str, int]] = []
    segments: list[list[int]] = []
    total = sympy.sympify(work(model))
    cut = SEGMENT_STEPS if total.xreplace({x: 1 for x in total.free_symbols}) >= LONG_WORK else len(em.steps)
    for i, step in enumerate(em.steps):
        if step.host_op is not None:
            plan.append(("host", i))
            continue
        lines += [f"/* step {i}: {c_comment(step.comment)} */",
                  f"static int tg_step_{i}(tg_state *st, const int64_t *s, void *const *p) {{"]
        lines += ["    " + line for line in step.lines] + ["    return 0;", "}", ""]
        if per_step or not plan or plan[-1][0] != "segment" or len(segments[-1]) >= cut:
            plan.append(("segment", len(segments)))
            segments.append([])
        segments[-1].append(i)
    for k, members in enumerate(segments):
        lines += [f"int tg_segment_{k}(void *state, const int64_t *s, void *const *p) {{",
                  "    tg_state *st = state;"]
        lines += [f"    if (tg_step_{i}(st, s, p)) return 1;" for i in members]
        lines += ["    return 0;", "}", ""]
    return CProgram("\n".join(lines), em, plan, em.steps, chained, sources)


def _gelu_defines() -> list[str]:
    """kernels.py's float32 gelu fit, for runtime.h's tg_gelu_erf: one fit, two backends."""
    from tilegraph.ir import kernels

    lines = [f"#define TG_GELU_CLIP {kernels._GELU32_CLIP!r}f"]
    lines += [f"#define TG_GELU_P{i} {c!r}f" for i, c in enumerate(kernels._GELU32_EXP)]
    return lines


def _model_name(model: Model) -> str:
    name = getattr(model.module, "sym_name", None)
    return name.data if name is not None else "forward"
