"""The decomposition library: each composite op (softmax, layer_norm, gelu, attention)
spelled out in primitive tg ops, written once.

The `decompose` pass (passes/decompose.py) runs these as rewrite rules, and a backend
that declares DECOMPOSE for an op (backends/lowering.py) expands it with `expand`:
both below passes and backends, so a backend needs no pass to do it.

One function per composite, written as the kernel in `ir/kernels.py` computes
it, in the same order of operations, so the decomposed graph evaluates to the
same numbers in the model's dtype (up to the rounding of the few constants, which
take the dtype of x as NumPy's weak Python scalars do):
  softmax    e = exp(x - max(x)); e / sum(e)            (max subtracted first)
  layer_norm c = x - mean(x); c / sqrt(mean(c*c) + eps) * scale + bias
  gelu       0.5*x * (1 + erf(x * 1/sqrt(2)))    or the tanh formula
  attention  softmax(q @ k^T * scale, masked) @ v, the softmax as its op; the causal mask is
             trilu(true, k = Lk - Lq), masked scores are -inf; where Lk - Lq is
             symbolic, the same band from indices counted at run time

Below them, the composites both frontends build for ops tg has none of (Elu, Softplus,
Mish, HardSigmoid, HardSwish, LeakyReLU/PReLU, Swish/SiLU, BatchNorm, GroupNorm, RMSNorm),
each spelled once; a frontend passes what its op's definition says (torch's softplus
threshold, elu's scales, ONNX's exp(x) - 1 where torch has expm1) through a `Builder` over
its own op maker.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import sympy
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import Rewriter

from tilegraph.ir.dialect import TgOp, make_op
from tilegraph.ir.shapes import ShapeError, TensorInfo, info_of, normalize_dim, numel


def info(value) -> TensorInfo:
    return info_of(value.type)


class Inapplicable(Exception):
    """The shape rules refused an op a rewrite made: the rewrite does not apply here (a
    finding about the IR, not an error; any other exception inside a rule is a bug)."""


class Emit:
    """Makes tg ops for one rewrite; they enter the IR only if the rewrite is applied.
    An op the shape rules refuse raises Inapplicable."""

    def __init__(self) -> None:
        self.ops: list[Operation] = []

    def __call__(self, name: str, *operands: SSAValue, result: TensorInfo | None = None, **attrs: Any) -> SSAValue:
        return self.op(name, operands, attrs, result).results[0]

    def op(self, name: str, operands: Sequence[SSAValue], attrs: dict | None = None,
           result: TensorInfo | list[TensorInfo] | None = None) -> TgOp:
        try:
            op = make_op(name, list(operands), attrs, result)
        except ShapeError as e:
            raise Inapplicable(str(e)) from e
        self.ops.append(op)
        return op

    def constant(self, value: Any, dtype: str) -> SSAValue:
        from tilegraph.ir import dtypes

        array = np.asarray(value, dtype=dtypes.numpy_dtype(dtype))
        return self("constant", value=array, result=TensorInfo(tuple(array.shape), dtype))

    def discard(self) -> None:
        # A made op already counts as a use of its operands: drop those uses.
        for op in reversed(self.ops):
            op.drop_all_references()
        self.ops.clear()


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
    probs = attention_probabilities(emit, q, k, mask[0] if mask else None, op.attr("scale"), op.attr("causal"))
    return emit("matmul", probs, v)


def _attention_grad(op, emit):
    """Attention's backward in tg ops: the whole-row form up to ATTENTION_BACKWARD_BLOCK keys,
    FlashAttention-2's blockwise form past it (ir/attention_backward.py, both), which reads the
    forward's result: recomputed here, as a flash attention (O(N d) memory)."""
    from tilegraph.ir.attention_backward import attention_backward, attention_backward_blockwise
    from tilegraph.ir.vjp import ATTENTION_BACKWARD_BLOCK, Backward

    q, k, v, gy, *mask = op.operands
    b = Backward()
    lk = info(k).shape[-2]
    try:
        if isinstance(lk, int) and lk > ATTENTION_BACKWARD_BLOCK:
            out = b("attention", q, k, v, *mask, scale=op.attr("scale"), causal=op.attr("causal"))
            dq, dk, dv, _ = attention_backward_blockwise(b, q, k, v, mask[0] if mask else None, op.attr("scale"),
                                                         op.attr("causal"), out, gy, ATTENTION_BACKWARD_BLOCK)
        else:
            dq, dk, dv, _ = attention_backward(b, q, k, v, mask[0] if mask else None, op.attr("scale"),
                                               op.attr("causal"), gy)
    except ShapeError as e:
        for made in reversed(b.ops):
            made.drop_all_references()
        raise Inapplicable(str(e)) from e
    emit.ops.extend(b.ops)
    return [dq, dk, dv]


def attention_probabilities(emit, q, k, mask, scale: float, causal: bool):
    """softmax(q @ k^T * scale, masked): attention's weights (its VJP recomputes them from here)."""
    dt, rank = info(q).dtype, info(q).rank
    perm = tuple(range(rank - 2)) + (rank - 1, rank - 2)
    scores = emit("mul", emit("matmul", q, emit("transpose", k, perm=perm)), emit.constant(scale, dt))
    shape = info(scores).shape
    minus_inf = None
    if causal:
        lq, lk = shape[-2:]
        offset = normalize_dim(sympy.sympify(lk) - sympy.sympify(lq))
        if isinstance(offset, int):
            ones = emit("broadcast", emit.constant(True, "i1"), result=TensorInfo((lq, lk), "i1"))
            keep = emit("trilu", ones, k=offset, upper=False)
        else:  # j - i <= Lk - Lq as (Lk - 1 - j) >= (Lq - 1 - i): counted at run time, no size needed
            keep = emit("ge", _count_after(emit, lk, 1), _count_after(emit, lq, 0))
        minus_inf = emit.constant(-math.inf, dt)
        scores = emit("where", keep, scores, minus_inf)
    if mask is not None:
        if info(mask).dtype == "i1":
            scores = emit("where", mask, scores, minus_inf or emit.constant(-math.inf, dt))
        else:
            scores = emit("add", scores, mask)
    # the softmax op, which a backend that has one keeps (ONNX Softmax) and `decompose` spells out too
    return emit("softmax", scores, axis=-1)


def _count_after(emit, n, axis: int):
    """n - 1 - index along `axis` of a (n, 1) or (1, n) i64 tensor: an exclusive reverse cumsum of ones."""
    shape = (n, 1) if axis == 0 else (1, n)
    ones = emit("broadcast", emit.constant(1, "i64"), result=TensorInfo(shape, "i64"))
    return emit("cumsum", ones, axis=axis, exclusive=True, reverse=True)


# --- composites the frontends build ---------------------------------------------------


class Builder:
    """What the composites below build with: emit(name, *operands, **attrs), emit.constant(value,
    dtype) and emit.info(value), over a frontend's own op maker (its values may be arrays it folds)."""

    def __init__(self, op, constant, info):
        self.op, self.constant, self.info = op, constant, info

    def __call__(self, name: str, *operands, **attrs):
        return self.op(name, *operands, **attrs)


def _scalar(emit, like, value):
    return emit.constant(value, emit.info(like).dtype)


def _times(emit, x, factor):
    return x if factor == 1 else emit("mul", x, _scalar(emit, x, factor))


def elu(emit, x, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0, expm1: bool = True):
    """x > 0 ? scale * x : alpha * scale * (exp(input_scale * x) - 1), by expm1 (torch) or, as ONNX
    defines Elu (and can export it), by exp and a subtraction."""
    inner = _times(emit, x, input_scale)
    e = emit("expm1", inner) if expm1 else emit("sub", emit("exp", inner), _scalar(emit, x, 1.0))
    neg = emit("mul", e, _scalar(emit, x, alpha * scale))
    return emit("where", emit("gt", x, _scalar(emit, x, 0.0)), _times(emit, x, scale), neg)


def leaky_relu(emit, x, slope):
    """x where x > 0, else x * slope (a number, or a tensor that broadcasts: PReLU)."""
    s = _scalar(emit, x, slope) if isinstance(slope, (int, float)) else slope
    return emit("where", emit("gt", x, _scalar(emit, x, 0.0)), x, emit("mul", x, s))


def swish(emit, x, alpha: float = 1.0):
    """x * sigmoid(alpha * x); torch's SiLU is alpha = 1."""
    return emit("mul", x, emit("sigmoid", _times(emit, x, alpha)))


def softplus(emit, x, beta: float = 1.0, threshold: float | None = None, log1p: bool = True):
    """log(1 + exp(beta * x)) / beta, x itself where beta * x > threshold (torch's; ONNX has none);
    by log1p (torch) or, as ONNX defines Softplus (and can export it), by log of a sum."""
    bx = _times(emit, x, beta)
    e = emit("exp", bx)
    soft = emit("log1p", e) if log1p else emit("log", emit("add", e, _scalar(emit, x, 1.0)))
    if beta != 1:
        soft = emit("div", soft, _scalar(emit, x, beta))
    if threshold is None:
        return soft
    return emit("where", emit("gt", bx, _scalar(emit, x, threshold)), x, soft)


def mish(emit, x, threshold: float | None = None, log1p: bool = True):
    return emit("mul", x, emit("tanh", softplus(emit, x, 1.0, threshold, log1p)))


def hard_sigmoid(emit, x, alpha: float, beta: float):
    """max(min(alpha * x + beta, 1), 0); torch's relu6(x + 3) / 6 is alpha = 1/6, beta = 1/2."""
    y = emit("add", emit("mul", x, _scalar(emit, x, alpha)), _scalar(emit, x, beta))
    return emit("max", emit("min", y, _scalar(emit, x, 1.0)), _scalar(emit, x, 0.0))


def hard_swish(emit, x):
    return emit("mul", x, hard_sigmoid(emit, x, 1 / 6, 0.5))


def rms_norm(emit, x, axes: Sequence[int], eps: float):
    """x / sqrt(mean(x * x) + eps) over axes, as x * rsqrt(...) (torch's spelling)."""
    ms = emit("reduce_mean", emit("mul", x, x), axes=tuple(axes), keepdims=True)
    return emit("mul", x, emit("rsqrt", emit("add", ms, _scalar(emit, x, eps))))


def channel(emit, v, rank: int):
    """A per-channel (C,) vector shaped (C, 1, ...) to broadcast against (N, C, ...)."""
    t = emit.info(v)
    shape = (t.shape[0],) + (1,) * (rank - 2)
    return v if shape == t.shape else emit("reshape", v, result=TensorInfo(shape, t.dtype))


def affine(emit, y, weight, bias):
    """y * weight + bias, per channel; either may be None."""
    rank = emit.info(y).rank
    if weight is not None:
        y = emit("mul", y, channel(emit, weight, rank))
    if bias is not None:
        y = emit("add", y, channel(emit, bias, rank))
    return y


def batch_norm(emit, x, weight, bias, mean, var, eps: float):
    """With running statistics: x * a + b, a = weight / sqrt(var + eps), b = bias - mean * a, as
    torch's CPU kernel computes it; a and b depend on weights only, so constant folding leaves
    one multiply-add."""
    a = emit("rsqrt", emit("add", var, _scalar(emit, var, eps)))
    if weight is not None:
        a = emit("mul", a, weight)
    b = emit("neg", emit("mul", mean, a))
    if bias is not None:
        b = emit("add", b, bias)
    rank = emit.info(x).rank
    return emit("add", emit("mul", x, channel(emit, a, rank)), channel(emit, b, rank))


def batch_norm_training(emit, x, weight, bias, eps: float):
    """Normalized by this batch's statistics (per channel, biased variance), as in training;
    returns y and the batch mean and variance (kept dims)."""
    rank = emit.info(x).rank
    axes = (0,) + tuple(range(2, rank))
    mean = emit("reduce_mean", x, axes=axes, keepdims=True)
    centered = emit("sub", x, mean)
    var = emit("reduce_mean", emit("mul", centered, centered), axes=axes, keepdims=True)
    y = emit("mul", centered, emit("rsqrt", emit("add", var, _scalar(emit, x, eps))))
    return affine(emit, y, weight, bias), mean, var


def group_norm(emit, x, groups: int, weight, bias, eps: float):
    """layer_norm over each group of channels (with what follows them), then per-channel scale and bias."""
    t = emit.info(x)
    rest = normalize_dim(sympy.sympify(numel(t.shape[1:])) / groups)
    grouped = emit("reshape", x, result=TensorInfo((t.shape[0], groups, rest), t.dtype))
    y = emit("reshape", emit("layer_norm", grouped, axis=-1, epsilon=float(eps)), result=t)
    return affine(emit, y, weight, bias)


def einsum_as_matmul(emit, x, y, equation: str):
    """A two-operand einsum that is a batched matrix product (every index kept in the output,
    or summed over both operands; no ellipsis, no repeated or broadcast index) as one matmul:
    each operand transposed to (batch, rows, summed) and (batch, summed, columns), the grouped
    dims merged by reshapes, the product reshaped and transposed to the output's order.
    (torchvision's MaxViT and Swin spell attention as einsums; as a matmul it is the GEMM that
    fusion, the attention folding and every backend know.) None where it is not such a product."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1 or "." in eq or eq.count(",") != 1:
        return None
    ins, out = eq.split("->")
    a, b = ins.split(",")
    ta, tb = info(x), info(y)
    if any(len(set(s)) != len(s) for s in (a, b, out)) or (len(a), len(b)) != (ta.rank, tb.rank) or \
            ta.dtype != tb.dtype or any(c not in a + b for c in out) or \
            any(c not in out and not (c in a and c in b) for c in a + b):
        return None
    size: dict[str, Any] = {}
    for c, d in zip(a + b, (*ta.shape, *tb.shape)):
        if size.setdefault(c, d) != d:
            return None  # (einsum broadcasts no index but through an ellipsis)
    batch = [c for c in out if c in a and c in b]
    rows, cols = [c for c in out if c not in b], [c for c in out if c not in a]
    summed = [c for c in a if c not in out]
    lead = tuple(size[c] for c in batch)

    def grouped(v, spec: str, order: list[str], shape: tuple):
        perm = tuple(spec.index(c) for c in order)
        if perm != tuple(range(len(perm))):
            v = emit("transpose", v, perm=perm)
        if tuple(size[c] for c in order) != shape:
            v = emit("reshape", v, result=TensorInfo(shape, ta.dtype))
        return v

    m, k, n = (numel(tuple(size[c] for c in g)) for g in (rows, summed, cols))
    product = emit("matmul", grouped(x, a, batch + rows + summed, (*lead, m, k)),
                   grouped(y, b, batch + summed + cols, (*lead, k, n)))
    order = batch + rows + cols
    full = tuple(size[c] for c in order)
    if full != (*lead, m, n):
        product = emit("reshape", product, result=TensorInfo(full, ta.dtype))
    perm = tuple(order.index(c) for c in out)
    return product if perm == tuple(range(len(perm))) else emit("transpose", product, perm=perm)


DECOMPOSITIONS = {
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    "gelu": _gelu,
    "attention": _attention,
    "attention_grad": _attention_grad,
}


def expand(op: TgOp) -> list[SSAValue] | None:
    """Replace `op` in place by its decomposition and return the values that replace its results;
    None (the op kept) where the shape rules refuse a step or the spelled-out type would differ."""
    emit = Emit()
    try:
        new = DECOMPOSITIONS[op.op_name](op, emit)
    except Inapplicable:
        new = None
    values = [] if new is None else [new] if isinstance(new, SSAValue) else list(new)
    if new is None or len(values) != len(op.results) or any(v.type != r.type for v, r in zip(values, op.results)):
        emit.discard()
        return None
    Rewriter.replace_op(op, emit.ops, values)
    return values
