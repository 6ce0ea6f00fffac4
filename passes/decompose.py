"""`decompose`: composite ops (softmax, layer_norm, gelu, attention) into primitives.

What it decides: nothing clever. Frontends keep composites as single ops so the
mapping stays one-to-one; this pass spells each one out in reductions,
elementwise ops, transposes and matmuls, for the passes (fusion) and backends that
want primitives. `decompose{ops=softmax,gelu}` restricts it to some composites.

How: one rule per composite, written as the kernel in `ir/kernels.py` computes
it, in the same order of operations, so the decomposed graph evaluates to the
same numbers in the model's dtype (up to the rounding of the few constants, which
take the dtype of x as NumPy's weak Python scalars do):
  softmax    e = exp(x - max(x)); e / sum(e)            (max subtracted first)
  layer_norm c = x - mean(x); c / sqrt(mean(c*c) + eps) * scale + bias
  gelu       0.5*x * (1 + erf(x * 1/sqrt(2)))    or the tanh formula
  attention  softmax(q @ k^T * scale, masked) @ v; the causal mask is
             trilu(true, k = Lk - Lq), masked scores are -inf
An attention whose causal offset Lk - Lq is not a known integer is left whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.shapes import TensorInfo, normalize_dim
from tilegraph.passes.rewrite import Emit, Rule, info, run_rules

# The constants of ir.kernels.gelu.
SQRT_HALF = 0.7071067811865476  # 1/sqrt(2)
SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2/pi), tanh approximation (Hendrycks & Gimpel 2016)
GELU_CUBIC = 0.044715


def softmax(emit: Emit, x, axis: int):
    axis %= max(info(x).rank, 1)
    m = emit("reduce_max", x, axes=(axis,), keepdims=True)
    e = emit("exp", emit("sub", x, m))
    return emit("div", e, emit("reduce_sum", e, axes=(axis,), keepdims=True))


def _softmax(op, emit):
    return softmax(emit, op.operands[0], op.attr("axis"))


def _layer_norm(op, emit):
    x, *affine = op.operands
    t = info(x)
    axes = tuple(range(op.attr("axis") % t.rank, t.rank))
    mean = emit("reduce_mean", x, axes=axes, keepdims=True)
    centered = emit("sub", x, mean)
    var = emit("reduce_mean", emit("mul", centered, centered), axes=axes, keepdims=True)
    y = emit("div", centered, emit("sqrt", emit("add", var, emit.constant(op.attr("epsilon"), t.dtype))))
    if len(affine) >= 1:
        y = emit("mul", y, affine[0])
    if len(affine) == 2:
        y = emit("add", y, affine[1])
    return y


def _gelu(op, emit):
    x = op.operands[0]
    dt = info(x).dtype
    half_x = emit("mul", x, emit.constant(0.5, dt))
    if op.attr("approximate") == "tanh":
        cubic = emit("mul", emit("mul", emit("mul", x, emit.constant(GELU_CUBIC, dt)), x), x)
        inner = emit("tanh", emit("mul", emit("add", x, cubic), emit.constant(SQRT_2_OVER_PI, dt)))
    else:
        inner = emit("erf", emit("mul", x, emit.constant(SQRT_HALF, dt)))
    return emit("mul", half_x, emit("add", inner, emit.constant(1.0, dt)))


def _attention(op, emit):
    q, k, v, *mask = op.operands
    dt, rank = info(q).dtype, info(q).rank
    perm = tuple(range(rank - 2)) + (rank - 1, rank - 2)
    scores = emit("mul", emit("matmul", q, emit("transpose", k, perm=perm)), emit.constant(op.attr("scale"), dt))
    shape = info(scores).shape
    minus_inf = None
    if op.attr("causal"):
        offset = normalize_dim(sympy.sympify(shape[-1]) - sympy.sympify(shape[-2]))
        if not isinstance(offset, int):
            return None
        ones = emit("broadcast", emit.constant(True, "i1"), result=TensorInfo(shape[-2:], "i1"))
        keep = emit("trilu", ones, k=offset, upper=False)
        minus_inf = emit.constant(-math.inf, dt)
        scores = emit("where", keep, scores, minus_inf)
    if mask:
        if info(mask[0]).dtype == "i1":
            scores = emit("where", mask[0], scores, minus_inf or emit.constant(-math.inf, dt))
        else:
            scores = emit("add", scores, mask[0])
        if info(scores).shape != shape:
            return None  # a mask with more batch dims than q, k, v: kept whole
    return emit("matmul", softmax(emit, scores, -1), v)


DECOMPOSITIONS = {
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    "gelu": _gelu,
    "attention": _attention,
}


@dataclass(frozen=True)
class Decompose(ModulePass):
    name = "decompose"

    ops: tuple[str, ...] = tuple(DECOMPOSITIONS)

    def __post_init__(self) -> None:
        unknown = [name for name in self.ops if name not in DECOMPOSITIONS]
        if unknown:
            raise TilegraphError(f"decompose: no decomposition for {', '.join(unknown)}; "
                                 f"it decomposes {', '.join(DECOMPOSITIONS)}")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        rules = [Rule((name,), DECOMPOSITIONS[name], f"{name} -> primitives") for name in self.ops]
        run_rules(op, rules, ctx)
