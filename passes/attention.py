"""`attention`: fold softmax(q @ k^T * scale + mask) @ v back into one `tg.attention`.

What it decides: where a model spelled attention out (BERT's eager attention,
ONNX exports) rather than calling a fused op, so that backends with a flash kernel
(the Triton backend's online softmax) never write the scores to memory, as
TorchInductor's attention pattern matcher does. The pattern, from the output:

    matmul(softmax(S', axis=-1), v)   with  S' = S * c  |  S / c  |  S   (c a scalar constant)
                                            then  + mask             (optional, additive)
                                      and   S  = matmul(q, kt),  kt = q-side keys transposed

Every intermediate must have no other use (the scores are not needed elsewhere);
the keys become transpose(kt) (a view). The shape rule of tg.attention checks the
rest: a chain it refuses is left alone. Masks given as booleans through `where`
stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from tilegraph.ir.hardware import check_target, hardware
from tilegraph.passes.rewrite import Rule, constant_array, info, producer, run_rules
from tilegraph.ir.ops import Op


def _only_use(value) -> bool:
    return sum(1 for _ in value.uses) == 1


def _scalar(value) -> float | None:
    array = constant_array(value)
    if array is None or array.size != 1:
        return None
    return float(np.asarray(array, dtype=np.float64).reshape(()))


def _fold(op, emit, min_keys: int = 0, min_score_bytes: int = 0):
    probs, v = op.operands
    softmax = producer(probs, "softmax")
    if softmax is None or not _only_use(probs) or softmax.attr("axis") % info(probs).rank != info(probs).rank - 1:
        return None
    scores, mask = softmax.operands[0], None
    add = producer(scores, "add")
    if add is not None and _only_use(scores):
        # The mask is the side that is not the scaled q @ k^T.
        for side in (0, 1):
            inner = add.operands[side]
            if producer(inner, "mul", "div", "matmul") is not None and _only_use(inner):
                scores, mask = inner, add.operands[1 - side]
                break
    scale = 1.0
    scaled = producer(scores, "mul", "div")
    if scaled is not None and _only_use(scores):
        c = _scalar(scaled.operands[1])
        if c is None or c == 0:
            return None
        scale = c if scaled.op_name == Op.mul else 1.0 / c
        scores = scaled.operands[0]
    qk = producer(scores, "matmul")
    if qk is None or not _only_use(scores):
        return None
    q, kt = qk.operands
    rank = info(kt).rank
    if rank < 2 or info(q).rank < 2 or info(v).rank < 2:
        return None
    keys = info(kt).shape[-1]
    if min_keys and isinstance(keys, int) and keys < min_keys:  # a symbolic length may be long: folded
        return None
    score_shape = info(qk.results[0]).shape
    # (f32 scores; a symbolic size keeps the chain, as before the rule: not known to spill)
    if min_score_bytes and not (all(isinstance(n, int) for n in score_shape) and 4 * int(np.prod(score_shape)) >= min_score_bytes):
        return None
    k = emit("transpose", kt, perm=tuple(range(rank - 2)) + (rank - 1, rank - 2))
    operands = [q, k, v] + ([mask] if mask is not None else [])
    return emit("attention", *operands, scale=scale, causal=False)


RULES = [Rule(("matmul",), _fold, "softmax(q @ k^T * scale + mask) @ v -> attention")]


@dataclass(frozen=True)
class FoldAttention(ModulePass):
    """`min-keys`: fold only chains over at least this many keys (0: all). Over a few keys the
    C backend's oneDNN GEMMs with its row softmax keep pace with its flash kernel, whose fixed
    work per call (packing k and v) the short rows do not repay (registry.C_BF16_FOLD_MIN_KEYS).

    `beyond-cache`: fold only chains whose scores (q @ k^T, f32) outgrow that target's cache
    (`Hardware.cache_bytes`, one core's L2 on a CPU). While they fit, the chain's three passes
    over them (written by the first GEMM, the softmax's, read by the second) stay in cache and
    oneDNN's GEMMs over whole rows outrun the flash kernel's GEMM per key block; once they
    spill, each pass goes to memory and the flash kernel, which never writes them, wins (the C
    backend's f32 rule, registry.default_pipeline). Not named `hardware`: registry.with_hardware
    gives that to every pass that has it, and a pipeline's plain `attention` folds every chain."""

    name = "attention"
    min_keys: int = 0
    beyond_cache: str = ""

    def __post_init__(self) -> None:
        if self.beyond_cache:
            check_target(self.beyond_cache)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        min_bytes = hardware(self.beyond_cache).cache_bytes if self.beyond_cache else 0
        rules = RULES if not (self.min_keys or min_bytes) else [
            Rule(r.ops, lambda o, emit: _fold(o, emit, self.min_keys, min_bytes), r.doc) for r in RULES]
        run_rules(op, rules, ctx)
