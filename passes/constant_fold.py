"""`constant-fold`: ops whose operands are all known arrays are computed at compile time.

What it decides: an op whose every operand is a `tg.constant` or a `tg.weight` is
evaluated once, here, and replaced by its value: an inline `tg.constant` when it
is small (`ir.builder.INLINE_CONSTANT_LIMIT` elements), else a new array in the
module's weight store (`ir.model.weights_of`) named after its source, e.g.
`fc.weight.transpose` for a transposed weight.

How: the op is evaluated by `ir.interpreter.evaluate` in the model's own dtypes
(float64=False), which renders the same op-table template the NumPy backend
emits, so a folded value is bit for bit what the compiled model would have
computed at run time. Two bounds keep the work and the store in check:
- `max-elements` (default 1<<24, 64 MiB of f32): larger results are not folded;
- an op that makes more elements than it reads (broadcast, tile, an outer
  product) is folded only while the result stays inline-small: a broadcast weight
  costs memory and saves nothing, as XLA's folder also reasons.
An op whose evaluation fails (an index out of range) is left for run time, where
the error names it. `tg.dequantize` is never folded: it keeps quantized weights quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import GreedyRewritePatternApplier, PatternRewriter, PatternRewriteWalker, RewritePattern
from xdsl.transforms.dead_code_elimination import region_dce

from tilegraph.ir import dtypes
from tilegraph.ir.builder import INLINE_CONSTANT_LIMIT
from tilegraph.ir.dialect import TgOp, make_op
from tilegraph.ir.interpreter import GLOBALS, evaluate
from tilegraph.ir.model import WeightStore, weights_of
from tilegraph.ir.shapes import TensorInfo, is_static, numel
from tilegraph.passes.dce import prune_weights
from tilegraph.passes.rewrite import info

SOURCES = ("constant", "weight")
# Ops never folded: a dequantized weight folded back would be stored in float again,
# undoing `quantize` (weights stay in their storage type and dequantize at run time).
NOT_FOLDED = ("dequantize",)
DEFAULT_MAX_ELEMENTS = 1 << 24


def _inline(result: TensorInfo) -> bool:
    d = result.dtype
    return numel(result.shape) <= INLINE_CONSTANT_LIMIT and (dtypes.is_float(d) or dtypes.is_int(d) or d == "i1")


def _fresh_name(store: WeightStore, base: str) -> str:
    if base not in store:
        return base
    n = 1
    while f"{base}{n}" in store:
        n += 1
    return f"{base}{n}"


class FoldOp(RewritePattern):
    def __init__(self, store: WeightStore, max_elements: int):
        self.store = store
        self.max_elements = max_elements

    def match_and_rewrite(self, op, rewriter: PatternRewriter, /) -> None:
        if not isinstance(op, TgOp) or op.op_name in SOURCES + NOT_FOLDED or not op.operands:
            return
        sources = [v.owner for v in op.operands]
        if not all(isinstance(s, TgOp) and s.op_name in SOURCES for s in sources):
            return
        results = op.result_infos()
        if not all(is_static(r.shape) for r in results):
            return
        made = sum(numel(r.shape) for r in results)
        read = sum(numel(info(v).shape) for v in op.operands)
        if made > self.max_elements or (made > read and not all(_inline(r) for r in results)):
            return
        if any(s.op_name == "weight" and s.attr("name") not in self.store for s in sources):
            return  # the verifier reports the missing weight; folding would hide it
        try:
            values = evaluate(op, [self._value(s) for s in sources], self.store, dict(GLOBALS), float64=False)
        except (ValueError, IndexError, FloatingPointError, ZeroDivisionError):
            # What the values can make NumPy refuse (an index out of range, an integer
            # division by zero): left unfolded, so running the model reports it. A
            # TilegraphError or a TypeError here is a bug, and propagates.
            return
        arrays = [np.asarray(v) for v in values]
        if any(a.shape != r.shape for a, r in zip(arrays, results)):
            return
        base = next((s.attr("name") for s in sources if s.op_name == "weight"), "folded") + "." + op.op_name
        new_ops = []
        for a, r in zip(arrays, results):
            # (np.ascontiguousarray would make a 0-d result 1-d: found by hypothesis)
            a = np.asarray(a, dtype=dtypes.numpy_dtype(r.dtype), order="C")
            if _inline(r):
                new_ops.append(make_op("constant", [], {"value": a}, r))
            else:
                name = _fresh_name(self.store, base)
                self.store[name] = a
                new_ops.append(make_op("weight", [], {"name": name}, r))
        rewriter.replace(op, new_ops, [o.results[0] for o in new_ops])

    def _value(self, source: TgOp) -> np.ndarray:
        if source.op_name == "weight":
            return np.asarray(self.store[source.attr("name")])
        return source.attr("value")


@dataclass(frozen=True)
class ConstantFold(ModulePass):
    name = "constant-fold"

    max_elements: int = DEFAULT_MAX_ELEMENTS

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        applier = GreedyRewritePatternApplier([FoldOp(weights_of(op), self.max_elements)], ctx=ctx)
        PatternRewriteWalker(applier, post_walk_func=region_dce).rewrite_module(op)
        prune_weights(op)  # the arrays folded away are no longer named by the IR
