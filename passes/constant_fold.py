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
- an op that makes more elements than it reads is folded while the result stays
  inline-small; a view among them (broadcast) not beyond that: a broadcast weight
  costs memory and saves nothing, as XLA's folder also reasons. Any other such op
  (a gather of a relative-position bias table, an outer difference, a compare and
  select over one: Swin's and MaxViT's attention biases and Swin's shift mask) writes
  its whole result every call at run time, so reading it folded costs a call no more
  than computing it did; it is folded up to `EXPANDING_FOLD_LIMIT` elements, which
  bounds the memory it adds.
An op whose evaluation fails (an index out of range) is left for run time, where
the error names it. `tg.dequantize` is never folded: it keeps quantized weights quantized.

It applies canonicalize's where(true, x, y) -> x and x + 0 -> x to conditions and zeros that
only folding made known (`known_selects`): an attention mask of all true positions is then none.

It also folds a known per-output-channel scale or shift into the contraction before
it (`scale_folds`): conv(x, W, b) * s + t becomes conv(x, W*s, b*s + t), and
matmul(x, W) * s becomes matmul(x, W*s), the new weights folded as above. This is a
batch norm or a layer scale after a convolution or a linear layer, which then costs
nothing at run time (onnxruntime's ConvBNFusion and ConvMulFusion do the same). It
rounds differently (each product is rounded once, not twice), and applies only for
finite scales, so that no inf * 0 appears that the unfolded model did not compute.
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
from tilegraph.passes.canonicalize import identity_operand, where_uniform
from tilegraph.passes.dce import prune_weights
from tilegraph.passes.rewrite import Rule, RuleSet, info, producer
from tilegraph.ir.ops import Op

SOURCES = ("constant", "weight")
# Ops never folded: a dequantized weight folded back would be stored in float again,
# undoing `quantize` (weights stay in their storage type and dequantize at run time).
NOT_FOLDED = ("dequantize",)
DEFAULT_MAX_ELEMENTS = 1 << 24
# Elements up to which an op that is not a view and makes more elements than it reads
# is folded: 4 MiB of f32. It takes Swin-T's largest constant, its first stage's
# relative-position bias plus shift mask over the scores (64 windows x 3 heads x 49 x 49
# = 460,992), with room for its batch-independent peers, and stays below a tenth of the
# weights of the models where such tables appear (Swin-T and MaxViT-T: 110 and 123 MiB).
EXPANDING_FOLD_LIMIT = 1 << 20


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
        if made > self.max_elements or (made > read and not all(_inline(r) for r in results) and (
                op.spec.view or made > EXPANDING_FOLD_LIMIT)):
            return
        if any(s.op_name == Op.weight and s.attr("name") not in self.store for s in sources):
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
        base = next((s.attr("name") for s in sources if s.op_name == Op.weight), "folded") + "." + op.op_name
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
        if source.op_name == Op.weight:
            return np.asarray(self.store[source.attr("name")])
        return source.attr("value")


# --- a known per-channel scale or shift into the contraction's weights ------------------


def _known(value) -> bool:
    return producer(value, *SOURCES) is not None and is_static(info(value).shape)


def _contraction_of(op, names: tuple[str, ...]):
    """(contraction, the other operand) where one operand of `op` is the only use of a
    contraction among `names` whose weight (and bias) is known."""
    for side in (0, 1):
        head = producer(op.operands[side], *names)
        if head is not None and sum(1 for _ in head.results[0].uses) == 1 and all(_known(v) for v in head.operands[1:]):
            return head, op.operands[1 - side]
    return None, None


def scale_folds(store: WeightStore) -> list[Rule]:
    """The rules folding a known per-output-channel scale or shift into a contraction."""

    def per_channel(value, out_rank: int, axis: int, channels) -> tuple[int, ...] | None:
        """`value`'s shape as a vector over the result's channel `axis` (size 1 or
        `channels`), when it is a known finite float array varying along no other axis."""
        if not _known(value) or not dtypes.is_float(info(value).dtype) or info(value).rank > out_rank:
            return None
        full = (1,) * (out_rank - info(value).rank) + tuple(info(value).shape)
        axis %= out_rank
        if any(d != 1 for i, d in enumerate(full) if i != axis) or full[axis] not in (1, channels):
            return None
        source = producer(value)
        array = source.attr("value") if source.op_name == Op.constant else store.get(source.attr("name"))
        if array is None or not np.all(np.isfinite(np.asarray(array, dtype=np.float64))):
            return None
        return (full[axis],)

    def fold_scale(op, emit):
        head, s = _contraction_of(op, ("conv", "matmul"))
        if head is None:
            return None
        out, w = info(head.results[0]), info(head.operands[1])
        if head.op_name == Op.conv:
            vector = per_channel(s, out.rank, 1, w.shape[0])
            if vector is None:
                return None
            weight = emit("mul", head.operands[1],
                          emit("reshape", s, result=TensorInfo(vector + (1,) * (w.rank - 1), out.dtype)))
            rest = [emit("mul", b, emit("reshape", s, result=TensorInfo(vector, out.dtype)))
                    for b in head.operands[2:]]
        else:
            vector = per_channel(s, out.rank, -1, w.shape[-1]) if w.rank == 2 else None
            if vector is None:
                return None
            weight, rest = emit("mul", head.operands[1], emit("reshape", s, result=TensorInfo(vector, out.dtype))), []
        return emit.op(head.op_name, [head.operands[0], weight, *rest], head.py_attrs()).results[0]

    def fold_shift(op, emit):
        head, t = _contraction_of(op, ("conv",))
        if head is None:
            return None
        out = info(head.results[0])
        channels = info(head.operands[1]).shape[0]
        vector = per_channel(t, out.rank, 1, channels)
        if vector is None:
            return None
        shift = emit("reshape", t, result=TensorInfo(vector, out.dtype))
        # With a bias, the add broadcasts a single shift itself: an explicit broadcast, a view,
        # is not folded, so the add after it would be left to run every call (a hardsigmoid's
        # + 0.5 after MobileNetV3's squeeze-excitation convolutions).
        bias = emit("add", head.operands[2], shift) if len(head.operands) > 2 else \
            emit("broadcast", shift, result=TensorInfo((channels,), out.dtype))
        return emit.op("conv", [head.operands[0], head.operands[1], bias], head.py_attrs()).results[0]

    return [
        Rule(("mul",), fold_scale, "conv(x, W, b) * s -> conv(x, W*s, b*s), matmul(x, W) * s -> matmul(x, W*s) "
                                   "(s known, finite, one value per output channel)"),
        Rule(("add",), fold_shift, "conv(x, W, b) + t -> conv(x, W, b + t) (t known, finite, one value per "
                                   "output channel)"),
    ]


# --- a select whose condition folding made known ---------------------------------


def known_selects(store: WeightStore) -> list[Rule]:
    """canonicalize's where(true, x, y) -> x and x + 0 -> x, for a condition or a zero that
    only folding made known, as a weight, seen through the reshapes and broadcasts (which
    keep its set of values) between: the attention mask an image or audio encoder builds
    from a run of true positions (ViT's, wav2vec2's 1499 x 1499) is then no mask, where it
    was selected every call and added to every head's scores."""

    def array_of(value):
        source = value.owner
        while isinstance(source, TgOp) and source.op_name in (Op.reshape, Op.broadcast):
            source = source.operands[0].owner
        if not isinstance(source, TgOp) or not is_static(info(value).shape):
            return None
        if source.op_name == Op.constant:
            return np.asarray(source.attr("value"))
        return store.get(source.attr("name")) if source.op_name == Op.weight else None

    return [Rule(("where",), where_uniform(array_of), "where(c, x, y) -> x (or y) for a known c all true (false)"),
            Rule(("add",), identity_operand(0, (1, 0), array_of), "x + 0 -> x, 0 + x -> x for a known 0")]


@dataclass(frozen=True)
class ConstantFold(ModulePass):
    name = "constant-fold"

    max_elements: int = DEFAULT_MAX_ELEMENTS

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        applier = GreedyRewritePatternApplier([FoldOp(weights_of(op), self.max_elements), RuleSet(scale_folds(weights_of(op)) + known_selects(weights_of(op)))],
                                              ctx=ctx)
        PatternRewriteWalker(applier, post_walk_func=region_dce).rewrite_module(op)
        prune_weights(op)  # the arrays folded away are no longer named by the IR
