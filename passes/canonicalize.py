"""`canonicalize`: algebraic simplifications that never change a result beyond rounding.

What it decides: which ops are redundant (x+0, x*1, neg(neg x), identity layout
ops, chains of transposes/reshapes/casts that collapse into one) and which
spelling of an op is canonical (constants on the right of + and *, attributes at
their default left out), so that `cse` later sees equal ops as equal.

How: `RULES` below is the whole pass, a list of small rules (see passes/rewrite.py)
driven to a fixed point by xDSL's PatternRewriteWalker, dead ops dropped on the
way as xDSL's own canonicalize does. Each rule replaces an op only by a value of
exactly its type, so broadcasting never changes (x + zeros(2, 3) with x of shape
(3,) stays). Rules that would change non-finite results are absent on purpose:
x*0 -> 0 and x-x -> 0 are wrong for inf and nan, x**0.5 -> sqrt(x) differs at -inf
and -0. Rewrites that flip only the sign of a zero result (x+0 -> x, 0-x -> -x)
are kept, as compilers do under no-signed-zeros (LLVM's `nsz`): -0 == +0.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from tilegraph.ir import dtypes
from tilegraph.ir.decompositions import einsum_as_matmul
from tilegraph.ir.ops import OPS, REQUIRED
from tilegraph.passes.rewrite import ANY_OP, Rule, constant_array, info, is_splat, producer, run_rules, static_dim

REDUCTIONS = tuple(name for name, spec in OPS.items() if spec.reduction)


# --- identities: op(x, c) -> x --------------------------------------------------


def identity_operand(value: float, sides: tuple[int, ...], array_of=constant_array):
    """x op c -> x where c is all `value`, c on one of `sides` (0 = lhs, 1 = rhs); `array_of`
    gives c's array where it is known (by default: an inline constant's)."""

    def apply(op, emit):
        for side in sides:
            c = array_of(op.operands[side])
            if c is not None and c.size > 0 and bool(np.all(c == value)):
                return op.operands[1 - side]  # the driver checks the type is unchanged
        return None

    return apply


def _square(op, emit):
    x, e = op.operands
    return emit("mul", x, x) if is_splat(e, 2) else None


def _cube(op, emit):
    # Integers only: on floats x*x*x rounds twice where pow rounds once (z3 refutes it in every
    # float type, tilegraph/proofs.py: f16 x = -0.00729 gives -4.17e-07 for -3.58e-07).
    x, e = op.operands
    if dtypes.is_float(info(x).dtype):
        return None
    return emit("mul", emit("mul", x, x), x) if is_splat(e, 3) else None


def _sub_neg(op, emit):
    x, y = op.operands
    n = producer(y, "neg")
    return emit("add", x, n.operands[0]) if n else None


def _add_neg(op, emit):
    x, y = op.operands
    if n := producer(y, "neg"):
        return emit("sub", x, n.operands[0])
    if n := producer(x, "neg"):
        return emit("sub", y, n.operands[0])
    return None


def _zero_minus(op, emit):
    return emit("neg", op.operands[1]) if is_splat(op.operands[0], 0) else None


def _involution(op, emit):
    """f(f(x)) -> x for f in neg, not."""
    inner = producer(op.operands[0], op.op_name)
    return inner.operands[0] if inner else None


def _idempotent(op, emit):
    """f(f(x)) -> f(x) for f in abs, relu."""
    return op.operands[0] if producer(op.operands[0], op.op_name) else None


def _abs_neg(op, emit):
    # Not on unsigned integers, where neg wraps: abs(neg 1) is 255 in ui8 (refuted by tilegraph/proofs.py).
    if info(op.operands[0]).dtype.startswith("ui"):
        return None
    inner = producer(op.operands[0], "neg")
    return emit("abs", inner.operands[0]) if inner else None


def _constant_to_rhs(op, emit):
    """c + x -> x + c, c * x -> x * c: one spelling for cse (IEEE + and * commute exactly)."""
    x, y = op.operands
    if constant_array(x) is not None and constant_array(y) is None:
        return emit(op.op_name, y, x)
    return None


# --- layout ---------------------------------------------------------------------


def _same_type_as_operand(op, emit):
    """reshape/broadcast/cast/concat-of-one/split-into-one whose result is its operand."""
    return op.operands[0] if len(op.operands) == 1 else None


def _identity_transpose(op, emit):
    return op.operands[0] if tuple(op.attr("perm")) == tuple(range(len(op.attr("perm")))) else None


def _transpose_transpose(op, emit):
    inner = producer(op.operands[0], "transpose")
    if inner is None:
        return None
    p1, p2 = inner.attr("perm"), op.attr("perm")
    # y = x.transpose(p1): y.shape[i] = x.shape[p1[i]]; z = y.transpose(p2) reads x at p1[p2[j]].
    perm = tuple(p1[j] for j in p2)
    x = inner.operands[0]
    return x if perm == tuple(range(len(perm))) else emit("transpose", x, perm=perm)


def _identity_slice(op, emit):
    # With step 1, a result as long as the operand on every dim is the whole operand.
    return op.operands[0] if all(s == 1 for s in op.attr("steps")) else None


def _reshape_reshape(op, emit):
    inner = producer(op.operands[0], "reshape")
    return emit("reshape", inner.operands[0], result=info(op.results[0])) if inner else None


def _broadcast_broadcast(op, emit):
    inner = producer(op.operands[0], "broadcast")
    return emit("broadcast", inner.operands[0], result=info(op.results[0])) if inner else None


def _einsum_matmul(op, emit):
    return einsum_as_matmul(emit, *op.operands, op.attr("equation")) if len(op.operands) == 2 else None


def _concat_concat(op, emit):
    axis = op.attr("axis") % info(op.results[0]).rank
    flat, changed = [], False
    for v in op.operands:
        inner = producer(v, "concat")
        if inner is not None and inner.attr("axis") % info(v).rank == axis:
            flat.extend(inner.operands)
            changed = True
        else:
            flat.append(v)
    return emit("concat", *flat, axis=op.attr("axis")) if changed else None


def _split_into_one(op, emit):
    return op.operands[0] if len(op.results) == 1 else None


def _conv_of_zero_pad(op, emit):
    """A convolution reading a zero pad of its input's spatial dims pads itself instead
    (its own zero padding, which kernels skip rather than read: MobileNet's explicit pads)."""
    pad = producer(op.operands[0], "pad")
    if pad is None or pad.attr("mode") != "constant" or pad.attr("value") != 0:
        return None
    pads, nd = list(pad.attr("pads")), info(op.operands[0]).rank
    if any(pads[i] or pads[nd + i] for i in (0, 1)) or any(p < 0 for p in pads):
        return None
    own = list(op.attr("pads") or [0] * (2 * (nd - 2)))
    attrs = {**op.py_attrs(), "pads": tuple(a + b for a, b in zip(own, pads[2:nd] + pads[nd + 2:]))}
    return list(emit.op(op.op_name, [pad.operands[0], *op.operands[1:]], attrs, None).results)


# --- casts ----------------------------------------------------------------------


def lossless_cast(src: str, dst: str) -> bool:
    """Does every value of `src` survive a cast to `dst` exactly?"""
    if src == dst or src == "i1":
        return True
    if dst == "i1" or dtypes.is_float(src) and not dtypes.is_float(dst):
        return False
    s, d = dtypes.numpy_dtype(src), dtypes.numpy_dtype(dst)
    if dtypes.is_float(src):
        fs, fd = ml_dtypes.finfo(s), ml_dtypes.finfo(d)
        return fd.nmant >= fs.nmant and fd.maxexp >= fs.maxexp and fd.minexp <= fs.minexp
    si = ml_dtypes.iinfo(s)  # (np.iinfo refuses ml_dtypes.int4: found by tilegraph/proofs.py)
    if dtypes.is_float(dst):
        fd = ml_dtypes.finfo(d)
        bits = max(abs(int(si.min)), int(si.max)).bit_length()
        return fd.nmant + 1 >= bits and bits < fd.maxexp
    di = ml_dtypes.iinfo(d)
    return di.min <= si.min and di.max >= si.max


def _cast_cast(op, emit):
    inner = producer(op.operands[0], "cast")
    if inner is None:
        return None
    x = inner.operands[0]
    # Through a lossless middle type the value is unchanged, so one cast does the same.
    if not lossless_cast(info(x).dtype, info(inner.results[0]).dtype):
        return None
    to = op.attr("to")
    return x if info(x).dtype == to else emit("cast", x, to=to)


# --- where, reductions ----------------------------------------------------------


def _where_same(op, emit):
    _, a, b = op.operands
    return a if a == b else None


def where_uniform(array_of=constant_array):
    """where(c, x, y) -> x where c is all true, y where all false; `array_of` gives c's array
    where it is known (by default: an inline constant's)."""

    def apply(op, emit):
        cond = array_of(op.operands[0])
        if cond is None or cond.size == 0:
            return None
        if cond.all() or not cond.any():
            chosen = op.operands[1] if cond.all() else op.operands[2]
            out = info(op.results[0])
            # The chosen side may be smaller than the result: broadcasting it is exact.
            return chosen if info(chosen) == out else emit("broadcast", chosen, result=out)
        return None

    return apply


_where_constant = where_uniform()


def _reduce_nothing(op, emit):
    """A reduction over no axes, or over dims of size 1 only, is its operand (reshaped)."""
    x = op.operands[0]
    shape = info(x).shape
    axes = [a % len(shape) for a in op.attr("axes")] if shape else []
    if not all(static_dim(shape[a], 1) for a in axes):
        return None
    if op.attr("keepdims") or not axes:
        return x
    return emit("reshape", x, result=info(op.results[0]))


# --- attributes -----------------------------------------------------------------


def _drop_default_attrs(op, emit):
    """An attribute spelled out at its default value is left out, as the builder does."""
    spec = op.spec
    defaults = [n for n in op.attributes
                if n in spec.attrs and spec.attrs[n][0] != "dense" and spec.attrs[n][1] is not REQUIRED
                and op.attr(n) == spec.attrs[n][1]]
    if not defaults:
        return None
    result = [info(r) for r in op.results] if spec.result_given else None
    attrs = {n: v for n, v in op.py_attrs().items() if n not in defaults}
    new = emit.op(op.op_name, list(op.operands), attrs, result)
    return list(new.results)


ALGEBRA: list[Rule] = [
    Rule(("add",), identity_operand(0, (1, 0)), "x + 0 -> x, 0 + x -> x"),
    Rule(("sub",), identity_operand(0, (1,)), "x - 0 -> x"),
    Rule(("mul",), identity_operand(1, (1, 0)), "x * 1 -> x, 1 * x -> x"),
    Rule(("div",), identity_operand(1, (1,)), "x / 1 -> x"),
    Rule(("pow",), identity_operand(1, (1,)), "x ** 1 -> x"),
    Rule(("pow",), _square, "x ** 2 -> x * x"),
    Rule(("pow",), _cube, "x ** 3 -> x * x * x (integers)"),
    Rule(("sub",), _sub_neg, "x - (-y) -> x + y"),
    Rule(("add",), _add_neg, "x + (-y) -> x - y, (-y) + x -> x - y"),
    Rule(("sub",), _zero_minus, "0 - x -> -x"),
    Rule(("add", "mul"), _constant_to_rhs, "c + x -> x + c, c * x -> x * c"),
    Rule(("neg", "not"), _involution, "neg(neg x) -> x, not(not x) -> x"),
    Rule(("abs", "relu"), _idempotent, "abs(abs x) -> abs x, relu(relu x) -> relu x"),
    Rule(("abs",), _abs_neg, "abs(neg x) -> abs x (signed and float types)"),
    Rule(("where",), _where_same, "where(c, x, x) -> x"),
    Rule(("where",), _where_constant, "where(true, x, y) -> x, where(false, x, y) -> y (broadcast to the result)"),
    Rule(REDUCTIONS, _reduce_nothing, "reduce over no axes or size-1 axes -> x (or its reshape)"),
    Rule(("cast",), _cast_cast, "cast(cast(x, a), b) -> cast(x, b) when x -> a is lossless"),
    Rule(("einsum",), _einsum_matmul, "einsum('bik,bkj->bij', x, y) and any batched matrix product -> transposes, "
         "reshapes and one matmul"),
]

# The layout rules are shared with simplify-shapes.
LAYOUT: list[Rule] = [
    Rule(("reshape", "broadcast", "cast", "concat"), _same_type_as_operand,
         "reshape/broadcast/cast to x's own type -> x, concat(x) -> x"),
    Rule(("transpose",), _identity_transpose, "transpose(x, identity) -> x"),
    Rule(("transpose",), _transpose_transpose, "transpose(transpose x) -> one transpose, or x"),
    Rule(("slice",), _identity_slice, "slice of everything -> x"),
    Rule(("split",), _split_into_one, "split into one piece -> x"),
    Rule(("reshape",), _reshape_reshape, "reshape(reshape x) -> reshape x"),
    Rule(("broadcast",), _broadcast_broadcast, "broadcast(broadcast x) -> broadcast x"),
    Rule(("concat",), _concat_concat, "concat(concat(a, b), c) on one axis -> concat(a, b, c)"),
    Rule(("conv",), _conv_of_zero_pad, "conv(pad(x, zeros around spatial dims)) -> conv(x) padding itself"),
]

SPELLING: list[Rule] = [
    Rule((ANY_OP,), _drop_default_attrs, "attributes at their default are left out"),
]

RULES: list[Rule] = ALGEBRA + LAYOUT + SPELLING


@dataclass(frozen=True)
class Canonicalize(ModulePass):
    name = "canonicalize"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        run_rules(op, RULES, ctx)
