"""`simplify-shapes`: fewer layout ops and simpler symbolic dims, same values.

What it does, exactly:
1. Types: every symbolic dim of every value is simplified by sympy and spelled the
   one canonical way (a hand-written `["(B*4)/4"]` becomes `["B"]`); the function
   signature follows.
2. Layout ops that move no data become reshapes: a broadcast that only adds dims
   of size 1 (as many elements out as in), a transpose that only moves dims of
   size 1 (the other dims keep their order).
3. Chains merge: reshape(reshape x) and broadcast(broadcast x) become one op, and
   a layout op whose result is its operand goes (canonicalize's layout rules).
4. A broadcast, or a reshape that only prepends dims of size 1, feeding a
   broadcasting elementwise op (add, mul, where, a comparison, ...) is bypassed
   when the op's own NumPy broadcasting gives the same result type; it is dropped
   once no use is left. `x + broadcast(b, (B, 384))` becomes `x + b`.
Left alone: reshapes that squeeze or unsqueeze dims in the middle of a shape
around elementwise ops (moving them would change the shapes fusion sees, for no
saving), and slices, concats and gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import FunctionType, ModuleOp, TensorType
from xdsl.dialects.func import FuncOp, ReturnOp
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from tilegraph.ir.ops import OPS, infer
from tilegraph.ir.shapes import ShapeError, dims_equal, info_of, numel, type_of
from tilegraph.passes.canonicalize import LAYOUT
from tilegraph.passes.rewrite import Rule, info, producer, run_rules, static_dim

# Elementwise ops of two or more operands broadcast NumPy-style (ir.ops).
BROADCASTING = tuple(n for n, s in OPS.items() if s.category == "elementwise" and len(s.operands) >= 2)


def _broadcast_as_reshape(op, emit):
    x, out = info(op.operands[0]), info(op.results[0])
    if x.shape != out.shape and dims_equal(numel(x.shape), numel(out.shape)):
        return emit("reshape", op.operands[0], result=out)
    return None


def _transpose_as_reshape(op, emit):
    shape = info(op.operands[0]).shape
    moved = [p for p in op.attr("perm") if not static_dim(shape[p], 1)]
    return emit("reshape", op.operands[0], result=info(op.results[0])) if moved == sorted(moved) else None


def _unbroadcast_source(value):
    """x if `value` is x broadcast, or x reshaped with only leading 1s prepended."""
    if b := producer(value, "broadcast"):
        return b.operands[0]
    if r := producer(value, "reshape"):
        x, out = info(r.operands[0]).shape, info(value).shape
        k = len(out) - len(x)
        if k > 0 and all(static_dim(d, 1) for d in out[:k]) and all(dims_equal(a, b) for a, b in zip(out[k:], x)):
            return r.operands[0]
    return None


def _bypass_broadcasts(op, emit):
    operands = list(op.operands)
    want = op.result_infos()
    changed = False
    for i, v in enumerate(operands):
        x = _unbroadcast_source(v)
        if x is None:
            continue
        trial = operands[:i] + [x] + operands[i + 1:]
        try:
            fits = infer(op.spec, [info(t) for t in trial], op.py_attrs()) == want
        except ShapeError:  # x does not broadcast against the other operands
            fits = False
        if fits:
            operands, changed = trial, True
    return list(emit.op(op.op_name, operands, op.py_attrs()).results) if changed else None


RULES: list[Rule] = LAYOUT + [
    Rule(("broadcast",), _broadcast_as_reshape, "broadcast adding only size-1 dims -> reshape"),
    Rule(("transpose",), _transpose_as_reshape, "transpose moving only size-1 dims -> reshape"),
    Rule(BROADCASTING, _bypass_broadcasts, "add(x, broadcast b) -> add(x, b) when the result type is unchanged"),
]


def canonical_types(module: ModuleOp) -> None:
    """Re-spell every tensor type from its simplified dims; the signature follows."""
    for func in [op for op in module.walk() if isinstance(op, FuncOp)]:
        values = list(func.body.block.args) + [r for op in func.body.walk() for r in op.results]
        for v in values:
            if not isinstance(v.type, TensorType):
                continue
            canonical = type_of(info_of(v.type))
            if canonical != v.type:
                Rewriter.replace_value_with_new_type(v, canonical)
        ret = func.body.block.last_op
        if isinstance(ret, ReturnOp):
            func.function_type = FunctionType.from_lists([a.type for a in func.body.block.args],
                                                         [v.type for v in ret.operands])


@dataclass(frozen=True)
class SimplifyShapes(ModulePass):
    name = "simplify-shapes"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        canonical_types(op)
        run_rules(op, RULES, ctx)
