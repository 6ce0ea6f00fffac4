"""Vector-Jacobian products: each op's derivative rule, declared once, keyed by its name in the op table.

`ir/autodiff.py` walks a tg function backwards and calls, for every op on a path from
what is differentiated to what is differentiated against, the rule registered here:

    @vjp("mul")
    def _mul(b, op, g):          # b: a Backward emitter, op: the forward op, g: its results' cotangents
        x, y = op.operands
        return [b("mul", g[0], y), b("mul", g[0], x)]     # one cotangent (or None) per operand

The rules emit ordinary tg ops (the backward is tg IR: canonicalize, fuse, tile and every
backend apply to it), broadcasting undone by `b.sum_to`. `vjp("name")` fails at import
for a name the op table does not have, as JAX's `ad.defjvp` is attached to its primitive.
An op with no rule states why in `NO_GRADIENT` (integer and index results, quantization,
data-dependent sizes); tests/test_autodiff.py fails when an op of the table has neither.

Composites get rules of their own, not their decompositions' (softmax's y * (g - sum(g y)),
layer_norm's three-term formula, gelu's Phi + x phi, attention's probabilities recomputed
from q and k rather than saved: one tg.attention_grad, which a backend runs as a kernel or
spells out, a block of keys at a time past ATTENTION_BACKWARD_BLOCK;
dropout's mask recomputed from its seed); layout ops that copy elements (pad's reflect and edge
modes, strided slices, tile, pools) share one rule: the op applied to the flat indices of
its operand, then the cotangent scatter-added at those indices.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import sympy
from xdsl.ir import SSAValue

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import TgOp, make_op
from tilegraph.ir.ops import Op, OPS
from tilegraph.ir.attention_backward import attention_backward, attention_backward_blockwise, swap_last
from tilegraph.ir.shapes import TensorInfo, dims_equal, info_of, normalize_dim, numel

Rule = Callable[["Backward", TgOp, list], list]
VJPS: dict[str, Rule] = {}

# Ops with no VJP, and why. Integer, boolean and index results carry no gradient; the
# others say what is missing.
_INDEX = "its results are integers, booleans or indices: no gradient flows through them"
NO_GRADIENT: dict[str, str] = {
    **{name: _INDEX for name in ("not", "isnan", "isinf", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge",
                                 "argmax", "argmin", "nonzero", "unique", "non_max_suppression", "bitwise_not",
                                 "bitwise_and", "bitwise_or", "bitwise_xor", "shift_left", "shift_right", "iota")},
    "bitcast": "reinterprets bits: not a differentiable function of the value",
    "constant": "a source: constants are not differentiated against",
    "weight": "a source: autodiff differentiates against weights by name (autodiff.grad's wrt), not through them",
    **{name: "quantized storage has no gradient (quantization-aware training's straight-through estimator is not "
             "built)" for name in ("quantize", "dequantize", "dynamic_quantize", "matmul_integer")},
    "narrow": "a run-time length: its VJP would pad by a data-dependent amount, which no op of the table does",
    "rnn": "a recurrence in one op: its backward through time is not written (unroll it to differentiate)",
    **{name: "weights in a GGUF block format are frozen storage for inference; fine-tuning needs them "
             "dequantized to a float weight first" for name in ("block_matmul", "block_gather")},
    **{name: "generation's cache state: decoding is not differentiated (training runs attention over whole "
             "sequences)" for name in ("cache_write", "cache_attention")},
    "sample": "a token drawn from logits: an integer choice has no gradient",
    "attention_grad": "attention's backward, made by its VJP rule: second derivatives of attention are not "
                      "written (train_step differentiates once)",
}


def vjp(*names: str):
    """Register a rule for ops `names`; a name the op table lacks fails here, at import."""
    for name in names:
        if name not in OPS:
            raise KeyError(f"vjp: tg has no op '{name}' (ir/ops.py)")
        if name in VJPS or name in NO_GRADIENT:
            raise KeyError(f"vjp: tg.{name} already has a rule or a reason it has none")

    def register(rule: Rule) -> Rule:
        for name in names:
            VJPS[name] = rule
        return rule

    return register


def info(v: SSAValue) -> TensorInfo:
    return info_of(v.type)


class Backward:
    """Makes the backward's tg ops, in order; autodiff inserts them into the function."""

    def __init__(self) -> None:
        self.ops: list[TgOp] = []

    def op(self, name: str, operands: Sequence[SSAValue], attrs: dict | None = None,
           result: TensorInfo | list[TensorInfo] | None = None) -> TgOp:
        op = make_op(name, list(operands), attrs, result)
        self.ops.append(op)
        return op

    def __call__(self, name: str, *operands: SSAValue, result: TensorInfo | None = None, **attrs) -> SSAValue:
        return self.op(name, operands, attrs, result).results[0]

    def const(self, value, dtype: str) -> SSAValue:
        array = np.asarray(value, dtype=dtypes.numpy_dtype(dtype))
        return self("constant", value=array, result=TensorInfo(tuple(array.shape), dtype))

    constant = const  # the decomposition library's spelling (attention's probabilities are built by it)

    def full(self, value, like: TensorInfo) -> SSAValue:
        return self("broadcast", self.const(value, like.dtype), result=like)

    def zeros(self, like: TensorInfo) -> SSAValue:
        return self.full(0, like)

    def reshape(self, x: SSAValue, shape) -> SSAValue:
        if tuple(info(x).shape) == tuple(shape):
            return x
        return self("reshape", x, result=TensorInfo(tuple(shape), info(x).dtype))

    def transpose(self, x: SSAValue, perm) -> SSAValue:
        perm = tuple(perm)
        return x if perm == tuple(range(len(perm))) else self("transpose", x, perm=perm)

    def sum(self, x: SSAValue, axes, keepdims=False) -> SSAValue:
        axes = tuple(sorted(axes))
        return self("reduce_sum", x, axes=axes, keepdims=keepdims) if axes else x

    def sum_to(self, g: SSAValue, shape) -> SSAValue:
        """Undo broadcasting: g summed down to `shape` (NumPy's broadcasting rules backwards)."""
        gshape = info(g).shape
        lead = len(gshape) - len(shape)
        axes = list(range(lead)) + [lead + i for i, d in enumerate(shape)
                                    if dims_equal(d, 1) and not dims_equal(gshape[lead + i], 1)]
        return self.reshape(self.sum(g, axes, keepdims=True), shape)

    def broadcast_to(self, x: SSAValue, shape) -> SSAValue:
        if tuple(info(x).shape) == tuple(shape):
            return x
        return self("broadcast", x, result=TensorInfo(tuple(shape), info(x).dtype))

    def scalar(self, x: SSAValue, value: float) -> SSAValue:
        return self.const(value, info(x).dtype)


def forward_values_read(op: TgOp) -> tuple[frozenset[int], bool]:
    """What `op`'s backward reads of its forward, read off its rule: the indices of the operands
    it reads and whether it reads a result. A training step keeps exactly these for the backward
    (the sharding planner prices them). The rule runs on placeholder cotangents; an op with no
    gradient reads nothing, and one its rule refuses is taken to read every operand."""
    from xdsl.ir import Block

    rule = VJPS.get(op.op_name)
    if rule is None:
        return frozenset(), False
    b = Backward()
    try:
        grads = rule(b, op, list(Block(arg_types=[r.type for r in op.results]).args))
    except Exception:  # noqa: BLE001 - a rule that cannot run at these shapes (symbolic ones) reads every operand
        return frozenset(range(len(op.operands))), False
    finally:
        for new in b.ops:  # the probe's ops are not kept: the forward's values lose their uses by them
            new.drop_all_references()
    read = {id(v) for new in b.ops for v in new.operands} | {id(v) for v in grads if v is not None}
    return (frozenset(i for i, v in enumerate(op.operands) if id(v) in read),
            any(id(r) in read for r in op.results))


def _dtype(op, i=0) -> str:
    return info(op.results[i]).dtype


def _unbroadcast_all(b: Backward, op: TgOp, grads: list) -> list:
    return [None if gr is None else b.sum_to(gr, info(x).shape) for gr, x in zip(grads, op.operands)]


# --- elementwise ---------------------------------------------------------------

def _unary(fn):
    """A rule dy/dx = fn(b, x, y) for a one-operand elementwise op."""
    def rule(b, op, g):
        (x,), y = op.operands, op.results[0]
        return [b("mul", g[0], fn(b, x, y))]
    return rule


def _c(b, x, v):
    return b.scalar(x, v)


_DERIVATIVES = {
    "exp": lambda b, x, y: y,
    "log": lambda b, x, y: b("reciprocal", x),
    "sqrt": lambda b, x, y: b("div", _c(b, x, 0.5), y),
    "rsqrt": lambda b, x, y: b("mul", _c(b, x, -0.5), b("div", y, x)),
    "tanh": lambda b, x, y: b("sub", _c(b, x, 1.0), b("mul", y, y)),
    "sigmoid": lambda b, x, y: b("mul", y, b("sub", _c(b, x, 1.0), y)),
    "erf": lambda b, x, y: b("mul", _c(b, x, 2 / math.sqrt(math.pi)), b("exp", b("neg", b("mul", x, x)))),
    "sin": lambda b, x, y: b("cos", x),
    "cos": lambda b, x, y: b("neg", b("sin", x)),
    "tan": lambda b, x, y: b("add", _c(b, x, 1.0), b("mul", y, y)),
    "asin": lambda b, x, y: b("rsqrt", b("sub", _c(b, x, 1.0), b("mul", x, x))),
    "acos": lambda b, x, y: b("neg", b("rsqrt", b("sub", _c(b, x, 1.0), b("mul", x, x)))),
    "atan": lambda b, x, y: b("reciprocal", b("add", _c(b, x, 1.0), b("mul", x, x))),
    "sinh": lambda b, x, y: b("cosh", x),
    "cosh": lambda b, x, y: b("sinh", x),
    "asinh": lambda b, x, y: b("rsqrt", b("add", b("mul", x, x), _c(b, x, 1.0))),
    "acosh": lambda b, x, y: b("rsqrt", b("sub", b("mul", x, x), _c(b, x, 1.0))),
    "atanh": lambda b, x, y: b("reciprocal", b("sub", _c(b, x, 1.0), b("mul", x, x))),
    "expm1": lambda b, x, y: b("add", y, _c(b, x, 1.0)),
    "log1p": lambda b, x, y: b("reciprocal", b("add", x, _c(b, x, 1.0))),
    "abs": lambda b, x, y: b("sign", x),
    # torch's and JAX's convention at 0: the derivative of relu there is 0.
    "relu": lambda b, x, y: b("cast", b("gt", x, _c(b, x, 0.0)), to=info(x).dtype),
}
for _name, _fn in _DERIVATIVES.items():
    vjp(_name)(_unary(_fn))


@vjp("neg")
def _neg(b, op, g):
    return [b("neg", g[0])]


@vjp("reciprocal")
def _reciprocal(b, op, g):
    y = op.results[0]
    return [b("neg", b("mul", g[0], b("mul", y, y)))]


@vjp("floor", "ceil", "round", "sign")
def _piecewise_constant(b, op, g):
    return [None]  # zero almost everywhere (torch and JAX say the same)


@vjp("cast")
def _cast(b, op, g):
    src = info(op.operands[0]).dtype
    return [b("cast", g[0], to=src) if dtypes.is_float(src) else None]


@vjp("assert_size")
def _assert_size(b, op, g):
    return [b.reshape(g[0], info(op.operands[0]).shape)]


@vjp("add")
def _add(b, op, g):
    return _unbroadcast_all(b, op, [g[0], g[0]])


@vjp("sub")
def _sub(b, op, g):
    return _unbroadcast_all(b, op, [g[0], b("neg", g[0])])


@vjp("mul")
def _mul(b, op, g):
    x, y = op.operands
    return _unbroadcast_all(b, op, [b("mul", g[0], y), b("mul", g[0], x)])


@vjp("div")
def _div(b, op, g):
    x, y = op.operands
    gx = b("div", g[0], y)
    return _unbroadcast_all(b, op, [gx, b("neg", b("mul", gx, op.results[0]))])


@vjp("pow")
def _pow(b, op, g):
    x, y = op.operands
    out = op.results[0]
    gx = b("mul", g[0], b("mul", y, b("pow", x, b("sub", y, _c(b, x, 1.0)))))
    # d/dy x^y = x^y log x, taken as 0 where x <= 0 (as JAX does at x = 0)
    positive = b("gt", x, _c(b, x, 0.0))
    safe = b("where", positive, x, _c(b, x, 1.0))
    gy = b("mul", g[0], b("mul", out, b("log", safe)))
    return _unbroadcast_all(b, op, [gx, gy])


@vjp("max", "min")
def _max_min(b, op, g):
    x, y = op.operands
    out = op.results[0]
    # Ties split the cotangent evenly (torch's maximum/minimum do the same).
    xs = b("cast", b("eq", x, out), to=_dtype(op))
    ys = b("cast", b("eq", y, out), to=_dtype(op))
    share = b("div", g[0], b("add", xs, ys))
    return _unbroadcast_all(b, op, [b("mul", share, xs), b("mul", share, ys)])


@vjp("mod")
def _mod(b, op, g):
    x, y = op.operands
    q = b("div", x, y)
    whole = b("where", b("lt", q, _c(b, q, 0.0)), b("ceil", q), b("floor", q)) if op.attr("fmod") else b("floor", q)
    return _unbroadcast_all(b, op, [g[0], b("neg", b("mul", g[0], whole))])


@vjp("where")
def _where(b, op, g):
    cond, x, y = op.operands
    zero = b.scalar(g[0], 0.0)
    return [None] + _unbroadcast_all(b, op, [None, b("where", cond, g[0], zero), b("where", cond, zero, g[0])])[1:]


@vjp("trilu")
def _trilu(b, op, g):
    return [b("trilu", g[0], k=op.attr("k"), upper=op.attr("upper"))]


@vjp("gelu")
def _gelu(b, op, g):
    (x,) = op.operands
    if op.attr("approximate") == "tanh":
        from tilegraph.ir.decompositions import GELU_CUBIC, SQRT_2_OVER_PI
        x3 = b("mul", b("mul", x, x), x)
        t = b("tanh", b("mul", b("add", x, b("mul", x3, _c(b, x, GELU_CUBIC))), _c(b, x, SQRT_2_OVER_PI)))
        dinner = b("mul", b("add", _c(b, x, 1.0), b("mul", b("mul", x, x), _c(b, x, 3 * GELU_CUBIC))),
                   _c(b, x, SQRT_2_OVER_PI))
        # 0.5 (1 + t) + 0.5 x (1 - t^2) inner'
        d = b("add", b("mul", _c(b, x, 0.5), b("add", _c(b, x, 1.0), t)),
              b("mul", b("mul", _c(b, x, 0.5), x), b("mul", b("sub", _c(b, x, 1.0), b("mul", t, t)), dinner)))
    else:
        from tilegraph.ir.decompositions import SQRT_HALF
        cdf = b("mul", _c(b, x, 0.5), b("add", _c(b, x, 1.0), b("erf", b("mul", x, _c(b, x, SQRT_HALF)))))
        pdf = b("mul", _c(b, x, 1 / math.sqrt(2 * math.pi)), b("exp", b("mul", b("mul", x, x), _c(b, x, -0.5))))
        d = b("add", cdf, b("mul", x, pdf))
    return [b("mul", g[0], d)]


# --- reductions ------------------------------------------------------------------

def _reduced(op) -> tuple[int, ...]:
    """A reduction's axes, non-negative."""
    rank = info(op.operands[0]).rank
    return tuple(sorted(a % max(rank, 1) for a in op.attr("axes")))


def _keep_shape(op) -> tuple:
    """The reduction's result shape with its reduced axes kept as 1s."""
    x = info(op.operands[0])
    axes = set(_reduced(op))
    return tuple(1 if i in axes else d for i, d in enumerate(x.shape))


def _spread(b, op, g):
    """A reduction's cotangent broadcast back over the reduced axes."""
    return b.broadcast_to(b.reshape(g, _keep_shape(op)), info(op.operands[0]).shape)


@vjp("reduce_sum")
def _reduce_sum(b, op, g):
    return [_spread(b, op, g[0])]


@vjp("reduce_mean")
def _reduce_mean(b, op, g):
    x = info(op.operands[0])
    count = numel([x.shape[a] for a in _reduced(op)])
    if not isinstance(count, int):
        raise NotImplementedError("reduce_mean over a symbolic dim: its VJP divides by a run-time count")
    return [_spread(b, op, b("mul", g[0], b.scalar(g[0], 1.0 / count)))]


@vjp("reduce_max", "reduce_min")
def _reduce_extreme(b, op, g):
    (x,) = op.operands
    y = b.broadcast_to(b.reshape(op.results[0], _keep_shape(op)), info(x).shape)
    hit = b("cast", b("eq", x, y), to=info(x).dtype)
    # ties share the cotangent evenly (torch's amax/amin)
    count = b.broadcast_to(b.sum(hit, _reduced(op), keepdims=True), info(x).shape)
    return [b("div", b("mul", _spread(b, op, g[0]), hit), count)]


@vjp("reduce_prod")
def _reduce_prod(b, op, g):
    """Each element's cotangent times the product of the others, from exclusive running
    products both ways (exact where x holds zeros, unlike prod / x)."""
    (x,) = op.operands
    t = info(x)
    axes = _reduced(op)
    rest = tuple(i for i in range(t.rank) if i not in axes)
    if not axes:
        return [g[0]]
    moved = b.transpose(x, rest + axes)
    count = numel([t.shape[a] for a in axes])
    flat = b.reshape(moved, tuple(t.shape[i] for i in rest) + (count,))
    last = len(rest)
    before = b("cumprod", flat, axis=last, exclusive=True)
    after = b("cumprod", flat, axis=last, exclusive=True, reverse=True)
    others = b.reshape(b("mul", before, after), info(moved).shape)
    others = b.transpose(others, tuple(int(i) for i in np.argsort(rest + axes)))
    return [b("mul", _spread(b, op, g[0]), others)]


@vjp("cumsum")
def _cumsum(b, op, g):
    return [b("cumsum", g[0], axis=op.attr("axis"), exclusive=op.attr("exclusive"), reverse=not op.attr("reverse"))]


@vjp("cumprod")
def _cumprod(b, op, g):
    (x,) = op.operands
    # d y_j / d x_i = y_j / x_i for the j whose product includes i (x nonzero)
    s = b("cumsum", b("mul", g[0], op.results[0]), axis=op.attr("axis"), exclusive=op.attr("exclusive"),
          reverse=not op.attr("reverse"))
    return [b("div", s, x)]


@vjp("softmax")
def _softmax(b, op, g):
    y = op.results[0]
    axis = op.attr("axis") % info(y).rank
    gy = b("mul", g[0], y)
    return [b("sub", gy, b("mul", y, b.broadcast_to(b.sum(gy, (axis,), keepdims=True), info(y).shape)))]


@vjp("layer_norm")
def _layer_norm(b, op, g):
    x, *affine = op.operands
    t = info(x)
    axes = tuple(range(op.attr("axis") % t.rank, t.rank))
    count = numel([t.shape[a] for a in axes])
    inv_n = b.scalar(x, 1.0 / count)
    mean = b("reduce_mean", x, axes=axes, keepdims=True)
    centered = b("sub", x, mean)
    var = b("reduce_mean", b("mul", centered, centered), axes=axes, keepdims=True)
    rstd = b("rsqrt", b("add", var, b.scalar(x, op.attr("epsilon"))))
    xhat = b("mul", centered, rstd)
    gy = g[0]
    grads = [None] * len(op.operands)
    if affine:
        grads[1] = b.sum_to(b("mul", gy, xhat), info(affine[0]).shape)
        gy = b("mul", gy, affine[0])
    if len(affine) == 2:
        grads[2] = b.sum_to(g[0], info(affine[1]).shape)
    gy = b.broadcast_to(gy, t.shape)
    # dx = rstd (g - mean(g) - xhat mean(g xhat))
    m1 = b("mul", b.sum(gy, axes, keepdims=True), inv_n)
    m2 = b("mul", b.sum(b("mul", gy, xhat), axes, keepdims=True), inv_n)
    grads[0] = b("mul", rstd, b("sub", b("sub", gy, m1), b("mul", xhat, m2)))
    return grads


@vjp("rms_norm")
def _rms_norm(b, op, g):
    x, *scale = op.operands
    t = info(x)
    axes = tuple(range(op.attr("axis") % t.rank, t.rank))
    rstd = b("rsqrt", b("add", b("reduce_mean", b("mul", x, x), axes=axes, keepdims=True),
                          b.scalar(x, op.attr("epsilon"))))
    xhat = b("mul", x, rstd)
    gy = g[0]
    grads = [None] * len(op.operands)
    if scale:
        grads[1] = b.sum_to(b("mul", gy, xhat), info(scale[0]).shape)
        gy = b.broadcast_to(b("mul", gy, scale[0]), t.shape)
    # y = x r with r = (mean(x^2) + eps)^-1/2, dr/dx = -r^3 x / n: dx = r (g - xhat mean(g xhat))
    m = b("reduce_mean", b("mul", gy, xhat), axes=axes, keepdims=True)
    grads[0] = b("mul", rstd, b("sub", gy, b("mul", xhat, m)))
    return grads


@vjp("rope")
def _rope(b, op, g):
    # A rotation by angle theta per pair: its transpose is the rotation by -theta, rope with -sin.
    x, cos, sin = op.operands
    half = info(x).shape[-1] // 2
    axis = info(x).rank - 1
    gx = b("rope", g[0], cos, b("neg", sin))
    x1, x2 = b.op("split", [x], {"axis": axis, "sizes": (half, half)}).results
    g1, g2 = b.op("split", [g[0]], {"axis": axis, "sizes": (half, half)}).results
    gcos = b("add", b("mul", g1, x1), b("mul", g2, x2))
    gsin = b("sub", b("mul", g2, x1), b("mul", g1, x2))
    return [gx, b.sum_to(gcos, info(cos).shape), b.sum_to(gsin, info(sin).shape)]


@vjp("dropout")
def _dropout(b, op, g):
    # Linear in x with the mask a pure function of (seed, site, index): the same dropout of the
    # cotangent is the VJP, its mask recomputed, never saved.
    x, seed = op.operands
    return [b("dropout", g[0], seed, p=op.attr("p"), site=op.attr("site")), None]


# --- contractions ------------------------------------------------------------------

@vjp("matmul")
def _matmul(b, op, g):
    a, w = op.operands
    ta, tw = info(a), info(w)
    gy = g[0]
    # 1-D operands as NumPy promotes them: a vector lhs is a row, a vector rhs a column.
    a2 = b.reshape(a, (1,) + ta.shape) if ta.rank == 1 else a
    w2 = b.reshape(w, tw.shape + (1,)) if tw.rank == 1 else w
    yshape = list(info(gy).shape)
    if ta.rank == 1:
        yshape.insert(len(yshape) - (0 if tw.rank == 1 else 1), 1)
    if tw.rank == 1:
        yshape.append(1)
    gy = b.reshape(gy, tuple(yshape))
    ga = b("matmul", gy, swap_last(b, w2))
    ta2 = info(a2)
    if info(w2).rank == 2 and ta2.rank > 2:
        # a weight shared by every batch row (a linear layer): one GEMM over all rows, not a
        # batched product summed afterwards (which holds batch x the weight's size)
        k, n = info(w2).shape
        rows = numel(ta2.shape[:-1])
        x2, gy2 = b.reshape(a2, (rows, k)), b.reshape(gy, (rows, n))
        if isinstance(w.owner, TgOp) and w.owner.op_name == Op.transpose:
            # a weight kept as [out, in] (torch's Linear): its gradient made in that layout,
            # dY^T @ X, so what reads it (the optimizer) reads it contiguously, not down columns
            gw = swap_last(b, b("matmul", swap_last(b, gy2), x2))
        else:
            gw = b("matmul", swap_last(b, x2), gy2)
    else:
        gw = b("matmul", swap_last(b, a2), gy)
    ga = b.sum_to(ga, info(a2).shape) if info(ga).rank > info(a2).rank or info(ga).shape != info(a2).shape else ga
    gw = b.sum_to(gw, info(w2).shape) if info(gw).rank > info(w2).rank or info(gw).shape != info(w2).shape else gw
    return [b.reshape(ga, ta.shape), b.reshape(gw, tw.shape)]


@vjp("einsum")
def _einsum(b, op, g):
    eq = op.attr("equation").replace(" ", "")
    lhs, _, out = eq.partition("->")
    subs = lhs.split(",")
    if "." in eq or not _ or any(len(set(s)) != len(s) for s in subs):
        raise NotImplementedError(f"einsum '{eq}': VJPs of ellipses, implicit outputs and repeated indices are not "
                                  "written")
    grads = []
    for i, x in enumerate(op.operands):
        others = [(s, v) for j, (s, v) in enumerate(zip(subs, op.operands)) if j != i]
        have = set(out).union(*(set(s) for s, _v in others))
        kept = "".join(c for c in subs[i] if c in have)
        gi = b("einsum", g[0], *(v for _s, v in others), equation=",".join([out] + [s for s, _v in others]) + "->" + kept)
        if kept != subs[i]:  # an index only this operand has was summed away: its cotangent is constant along it
            t = info(x)
            gi = b.reshape(gi, tuple(t.shape[k] if c in have else 1 for k, c in enumerate(subs[i])))
            gi = b.broadcast_to(gi, t.shape)
        grads.append(gi)
    return grads


def _flip(b, x, axes):
    r = info(x).rank
    big = (1 << 63) - 1
    starts = tuple(-1 if a in axes else 0 for a in range(r))
    ends = tuple(-big if a in axes else big for a in range(r))
    steps = tuple(-1 if a in axes else 1 for a in range(r))
    return b("slice", x, starts=starts, ends=ends, steps=steps)


def _dilate(b, x, strides):
    """Insert stride-1 zeros between the spatial elements of x (N, C, *S): (N, C, *((S-1)*s+1))."""
    t = info(x)
    nd = len(strides)
    if all(s == 1 for s in strides):
        return x
    spatial = t.shape[2:]
    inter = tuple(t.shape[:2]) + tuple(d for s in spatial for d in (s, 1))
    x = b.reshape(x, inter)
    pads = [0] * len(inter) * 2
    for i, s in enumerate(strides):
        pads[len(inter) + 3 + 2 * i] = s - 1  # the end of each inserted unit axis
    x = b("pad", x, pads=tuple(pads))
    x = b.reshape(x, tuple(t.shape[:2]) + tuple(d * s for d, s in zip(spatial, strides)))
    return b("slice", x, starts=(0,) * (2 + nd), ends=tuple(t.shape[:2]) + tuple((d - 1) * s + 1 for d, s in
                                                                          zip(spatial, strides)), steps=(1,) * (2 + nd))


def _pad_or_crop(b, x, begins, ends):
    """Spatial pads of x (N, C, *S); negative amounts crop."""
    t = info(x)
    nd = len(begins)
    if any(p > 0 for p in (*begins, *ends)):
        x = b("pad", x, pads=(0, 0) + tuple(max(p, 0) for p in begins) + (0, 0) + tuple(max(p, 0) for p in ends))
        t = info(x)
    if any(p < 0 for p in (*begins, *ends)):
        starts = (0, 0) + tuple(max(-p, 0) for p in begins)
        stops = tuple(t.shape[:2]) + tuple(t.shape[2 + i] - max(-ends[i], 0) for i in range(nd))
        x = b("slice", x, starts=starts, ends=stops, steps=(1,) * (2 + nd))
    return x


@vjp("conv")
def _conv(b, op, g):
    x, w, *bias = op.operands
    tx, tw = info(x), info(w)
    nd = tx.rank - 2
    strides = tuple(op.attr("strides")) or (1,) * nd
    pads = tuple(op.attr("pads")) or (0,) * (2 * nd)
    dil = tuple(op.attr("dilations")) or (1,) * nd
    groups = op.attr("groups")
    gy = g[0]
    ty = info(gy)
    n, c = tx.shape[:2]
    o = tw.shape[0]
    kernel = tw.shape[2:]
    # dx: the cotangent dilated by the strides, correlated with the flipped weights, channels swapped
    gd = _dilate(b, gy, strides)
    span = [dil[i] * (kernel[i] - 1) for i in range(nd)]
    begins = [span[i] - pads[i] for i in range(nd)]
    ends = [tx.shape[2 + i] - info(gd).shape[2 + i] - begins[i] + span[i] for i in range(nd)]
    wt = b.reshape(w, (groups, o // groups, c // groups) + tuple(kernel))
    wt = b.transpose(wt, (0, 2, 1) + tuple(range(3, 3 + nd)))
    wt = _flip(b, b.reshape(wt, (c, o // groups) + tuple(kernel)), set(range(2, 2 + nd)))
    gx = b("conv", _pad_or_crop(b, gd, begins, ends), wt, dilations=dil, groups=groups)
    # dw: per group, x's channels as the batch correlated with the cotangent as the kernel
    parts = []
    for k in range(groups):
        xg = x if groups == 1 else b("slice", x, starts=(0, k * (c // groups)) + (0,) * nd,
                                       ends=(n, (k + 1) * (c // groups)) + tuple(tx.shape[2:]), steps=(1,) * (2 + nd))
        gg = gy if groups == 1 else b("slice", gy, starts=(0, k * (o // groups)) + (0,) * nd,
                                        ends=(n, (k + 1) * (o // groups)) + tuple(ty.shape[2:]), steps=(1,) * (2 + nd))
        xt = b.transpose(xg, (1, 0) + tuple(range(2, 2 + nd)))
        gt = b.transpose(gg, (1, 0) + tuple(range(2, 2 + nd)))
        dw = b("conv", xt, gt, strides=dil, dilations=strides, pads=pads)  # (C/g, O/g, *K')
        dw = b("slice", dw, starts=(0,) * (2 + nd), ends=tuple(info(dw).shape[:2]) + tuple(kernel),
               steps=(1,) * (2 + nd))
        parts.append(b.transpose(dw, (1, 0) + tuple(range(2, 2 + nd))))
    gw = parts[0] if groups == 1 else b("concat", *parts, axis=0)
    grads = [gx, gw]
    if bias:
        grads.append(b.sum(gy, (0,) + tuple(range(2, 2 + nd))))
    return grads


# Keys per block of the blockwise attention backward: its scores, probabilities and their
# gradients exist one (Lq x block) slab at a time, O(Lq block) memory per head instead of
# O(Lq Lk). FlashAttention-2's backward uses blocks of 64-128 in SRAM; these slabs live in
# cache-sized CPU memory, and at or below one block the whole row is one slab (no slicing).
ATTENTION_BACKWARD_BLOCK = 256


@vjp("attention")
def _attention(b, op, g):
    q, k, v, *mask = op.operands
    scale, causal = op.attr("scale"), op.attr("causal")
    batch = info(op.results[0]).shape[:-2]
    if all(len(info(x).shape[:-2]) == len(batch) and all(dims_equal(a, c) for a, c in zip(info(x).shape[:-2], batch))
           for x in (q, k, v)):
        # one op a backend may run as a kernel (ir/ops.py's attention_grad); a float mask's own
        # cotangent, where something differentiates it, spelled out beside it
        grad = b.op("attention_grad", [q, k, v, g[0], *mask], {"scale": scale, "causal": causal})
        grads: list = list(grad.results)
        if mask:
            grads.append(None if info(mask[0]).dtype == "i1" else _float_mask_grad(b, op, g))
        return grads
    lq, lk = info(q).shape[-2], info(k).shape[-2]
    if isinstance(lq, int) and isinstance(lk, int) and lk > ATTENTION_BACKWARD_BLOCK:
        dq, dk, dv, dmask = attention_backward_blockwise(b, q, k, v, mask[0] if mask else None, scale, causal,
                                                         op.results[0], g[0], ATTENTION_BACKWARD_BLOCK)
        grads = [b.sum_to(dq, info(q).shape), b.sum_to(dk, info(k).shape), b.sum_to(dv, info(v).shape)]
        if mask:
            grads.append(None if dmask is None else b.sum_to(dmask, info(mask[0]).shape))
        return grads
    dq, dk, dv, ds = attention_backward(b, q, k, v, mask[0] if mask else None, scale, causal, g[0])
    grads = [b.sum_to(dq, info(q).shape), b.sum_to(dk, info(k).shape), b.sum_to(dv, info(v).shape)]
    if mask:
        # a float mask is added to the scores: its cotangent is the scores' (scaled back)
        grads.append(None if info(mask[0]).dtype == "i1" else
                     b.sum_to(b("div", ds, b.scalar(q, scale)), info(mask[0]).shape))
    return grads


def _float_mask_grad(b, op, g):
    """A float mask's cotangent (the scores'), by the spelled-out backward; its dq, dk and dv go
    unused (dce drops them, and all of it where nothing differentiates the mask)."""
    q, k, v, mask = op.operands
    scale, causal = op.attr("scale"), op.attr("causal")
    lq, lk = info(q).shape[-2], info(k).shape[-2]
    if isinstance(lq, int) and isinstance(lk, int) and lk > ATTENTION_BACKWARD_BLOCK:
        dmask = attention_backward_blockwise(b, q, k, v, mask, scale, causal, op.results[0], g[0],
                                             ATTENTION_BACKWARD_BLOCK)[3]
        return b.sum_to(dmask, info(mask).shape)
    ds = attention_backward(b, q, k, v, mask, scale, causal, g[0])[3]
    return b.sum_to(b("div", ds, b.scalar(q, scale)), info(mask).shape)


# --- layout ------------------------------------------------------------------------

@vjp("reshape")
def _reshape(b, op, g):
    return [b.reshape(g[0], info(op.operands[0]).shape)]


@vjp("broadcast")
def _broadcast(b, op, g):
    return [b.sum_to(g[0], info(op.operands[0]).shape)]


@vjp("transpose")
def _transpose(b, op, g):
    perm = op.attr("perm")
    inverse = tuple(int(i) for i in np.argsort(perm))
    return [b.transpose(g[0], inverse)]


@vjp("concat")
def _concat(b, op, g):
    axis = op.attr("axis") % info(op.results[0]).rank
    sizes = [info(x).shape[axis] for x in op.operands]
    if len(sizes) == 1:
        return [g[0]]
    parts = b.op("split", [g[0]], {"axis": axis, "sizes": tuple(sizes)}).results
    return list(parts)


@vjp("split")
def _split(b, op, g):
    parts = [gi if gi is not None else b.zeros(info(r)) for gi, r in zip(g, op.results)]
    return [parts[0] if len(parts) == 1 else b("concat", *parts, axis=op.attr("axis"))]


@vjp("tile")
def _tile(b, op, g):
    """Each result element copies one element of x: the cotangent scatter-added back at the
    flat indices the op reads, found by running the op on indices."""
    (x,) = op.operands
    t = info(x)
    size = numel(t.shape)
    if not isinstance(size, int):
        raise NotImplementedError("tile of a symbolic shape: its VJP needs static index maps")
    read = np.tile(np.arange(size, dtype=np.int64).reshape(tuple(t.shape)), op.attr("repeats"))
    return [_scatter_back(b, g[0], read, t)]


def _scatter_back(b, gy, read: np.ndarray, t: TensorInfo, scale: np.ndarray | None = None):
    """dx (flat over t) = sum of gy's elements at positions reading each index (-1: none)."""
    size = numel(t.shape)
    flat = b.reshape(gy, (int(read.size),))
    if scale is not None:
        flat = b("mul", flat, b.const(scale.reshape(-1), t.dtype))
    idx = np.where(read < 0, size, read).reshape(-1, 1)  # pad reads land in an extra slot, dropped
    acc = b("scatter_nd", b.zeros(TensorInfo((size + 1,), t.dtype)), b.const(idx, "i64"), flat, reduction="add")
    acc = b("slice", acc, starts=(0,), ends=(size,), steps=(1,))
    return b.reshape(acc, t.shape)


@vjp("slice")
def _slice(b, op, g):
    (x,) = op.operands
    t = info(x)
    steps = op.attr("steps")
    gy = g[0]
    if all(isinstance(d, int) for d in t.shape) and any(s != 1 for s in steps):
        index = np.arange(numel(t.shape), dtype=np.int64).reshape(tuple(t.shape))
        read = index[tuple(slice(s, e, st) for s, e, st in zip(op.attr("starts"), op.attr("ends"), steps))]
        return [_scatter_back(b, gy, read, t)]
    pads = [0] * (2 * t.rank)
    for i, (d, s, e) in enumerate(zip(t.shape, op.attr("starts"), op.attr("ends"))):
        if not isinstance(d, int):
            if (s, e) != (0, (1 << 63) - 1):
                raise NotImplementedError("a slice of a symbolic dim: its VJP pads by a symbolic amount")
            continue
        lo, hi, _ = slice(s, e).indices(d)
        hi = max(hi, lo)
        pads[i], pads[t.rank + i] = lo, d - hi
    return [b("pad", gy, pads=tuple(pads)) if any(pads) else gy]


@vjp("pad")
def _pad(b, op, g):
    (x,) = op.operands
    t = info(x)
    pads = op.attr("pads")
    if op.attr("mode") == "constant":
        r = t.rank
        outs = info(op.results[0]).shape
        starts = tuple(pads[:r])
        ends = tuple(outs[i] - pads[r + i] for i in range(r))
        if any(p < 0 for p in pads):  # a negative pad crops: pad the cotangent back where it did
            crop = tuple(max(-p, 0) for p in pads)
            gy = b("pad", g[0], pads=crop)
            starts = tuple(max(p, 0) for p in pads[:r])
            ends = tuple(info(gy).shape[i] - max(pads[r + i], 0) for i in range(r))
            return [b("slice", gy, starts=starts, ends=ends, steps=(1,) * r)]
        return [b("slice", g[0], starts=starts, ends=ends, steps=(1,) * r)]
    size = numel(t.shape)
    if not isinstance(size, int):
        raise NotImplementedError("pad in reflect or edge mode of a symbolic shape: its VJP needs static index maps")
    from tilegraph.ir import kernels
    read = kernels.pad(np.arange(size, dtype=np.int64).reshape(tuple(t.shape)), pads, op.attr("mode"), 0)
    return [_scatter_back(b, g[0], read, t)]


def _window_reads(op, t: TensorInfo, fill: int = -1):
    """(spatial out..., kernel...) flat indices into one (H, W...) plane each window tap reads; -1 for padding."""
    from tilegraph.ir import kernels
    kernel = op.attr("kernel")
    nd = len(kernel)
    strides, pads, dil = kernels._window_defaults(nd, op.attr("strides"), op.attr("pads"), op.attr("dilations"))
    shape = (1, 1) + tuple(t.shape[2:])
    grown, counts = kernels._pool_pads(np.empty(shape), kernel, strides, pads, dil, op.attr("ceil_mode"))
    plane = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    windows = kernels._window_view(kernels._pad_spatial(plane, grown, fill), kernel, strides, dil, counts)
    out = windows.shape[2:2 + nd]
    return np.ascontiguousarray(windows[0, 0]).reshape(math.prod(out), math.prod(kernel)), out


@vjp("max_pool")
def _max_pool(b, op, g):
    """The cotangent goes to the first maximum of each window (torch's max_pool2d picks it too)."""
    gy = g[0]
    (x,) = op.operands
    t = info(x)
    if not all(isinstance(d, int) for d in t.shape[1:]):
        raise NotImplementedError("max_pool with symbolic channels or spatial dims: its VJP needs static windows")
    reads, out = _window_reads(op, t)
    plane = math.prod(t.shape[2:])
    rows = normalize_dim(sympy.sympify(t.shape[0]) * t.shape[1])
    xr = b.reshape(x, (rows, plane))
    low = b.full(-np.inf, TensorInfo((rows, 1), t.dtype))
    xr = b("concat", xr, low, axis=1)  # padding reads the extra -inf column
    reads = np.where(reads < 0, plane, reads)
    taps = b("gather", xr, b.const(reads, "i64"), axis=1)  # (rows, windows, kernel)
    best = b("argmax", taps, axis=2, keepdims=True)
    chosen = b("gather_elements", b.broadcast_to(b.const(reads, "i64"), info(taps).shape[:2] + (reads.shape[1],)),
               best, axis=2)
    chosen = b.reshape(chosen, (rows, reads.shape[0]))
    acc = b("scatter_elements", b.zeros(TensorInfo((rows, plane + 1), t.dtype)), chosen,
            b.reshape(gy, (rows, reads.shape[0])), axis=1, reduction="add")
    acc = b("slice", acc, starts=(0, 0), ends=(rows, plane), steps=(1, 1))
    return [b.reshape(acc, t.shape)]


@vjp("avg_pool")
def _avg_pool(b, op, g):
    (x,) = op.operands
    t = info(x)
    if not all(isinstance(d, int) for d in t.shape[1:]):
        raise NotImplementedError("avg_pool with symbolic channels or spatial dims: its VJP needs static windows")
    from tilegraph.ir import kernels
    reads, out = _window_reads(op, t)
    ones = np.ones((1, 1) + tuple(t.shape[2:]))
    taps = (reads >= 0).sum(axis=1).reshape(out)
    mean_of_ones = kernels.avg_pool(ones, op.attr("kernel"), op.attr("strides"), op.attr("pads"),
                                    op.attr("dilations"), op.attr("ceil_mode"), op.attr("count_include_pad"))[0, 0]
    weight = np.where(taps > 0, mean_of_ones / np.maximum(taps, 1), 0.0)  # 1 / the window's divisor
    plane = math.prod(t.shape[2:])
    rows = normalize_dim(sympy.sympify(t.shape[0]) * t.shape[1])
    gy = b("mul", g[0], b.const(weight.reshape((1, 1) + out), t.dtype))
    spread = b.broadcast_to(b.reshape(gy, (rows, reads.shape[0], 1)), (rows,) + reads.shape)
    idx = b.broadcast_to(b.const(np.where(reads < 0, plane, reads), "i64"), (rows,) + reads.shape)
    acc = b("scatter_elements", b.zeros(TensorInfo((rows, plane + 1), t.dtype)),
            b.reshape(idx, (rows, reads.size)), b.reshape(spread, (rows, reads.size)), axis=1, reduction="add")
    acc = b("slice", acc, starts=(0, 0), ends=(rows, plane), steps=(1, 1))
    return [b.reshape(acc, t.shape)]


def _move_first(b, x, axis):
    r = info(x).rank
    return b.transpose(x, (axis,) + tuple(i for i in range(r) if i != axis))


def _move_back(b, x, axis):
    r = info(x).rank
    perm = (axis,) + tuple(i for i in range(r) if i != axis)
    return b.transpose(x, tuple(int(i) for i in np.argsort(perm)))


@vjp("gather")
def _gather(b, op, g):
    x, idx = op.operands
    t, ti = info(x), info(idx)
    axis = op.attr("axis") % t.rank
    # embedding's backward: the cotangent rows scatter-added into a zero table (axis first)
    gy = g[0]
    ri = ti.rank
    gperm = tuple(range(axis, axis + ri)) + tuple(range(axis)) + tuple(range(axis + ri, info(gy).rank))
    gy = b.transpose(gy, gperm)  # (idx..., x dims but axis)
    moved = (t.shape[axis],) + tuple(d for i, d in enumerate(t.shape) if i != axis)
    acc = b("scatter_nd", b.zeros(TensorInfo(moved, t.dtype)), b.reshape(idx, tuple(ti.shape) + (1,)), gy,
            reduction="add")
    return [_move_back(b, acc, axis), None]


def one_hot(b, idx: SSAValue, t: TensorInfo, axis: int) -> SSAValue:
    """1 where the position along `axis` is the row's index (negative counting from the end),
    0 elsewhere, in t's shape and dtype; idx has t's shape with 1 at `axis`. Elementwise over a
    constant arange broadcast, so a fused loop computes it in place rather than reading a mask."""
    ti = info(idx)
    kind = dtypes.numpy_dtype(ti.dtype)
    n = b.const(np.asarray(t.shape[axis], kind), ti.dtype)
    idx = b("where", b("lt", idx, b.const(np.asarray(0, kind), ti.dtype)), b("add", idx, n), idx)
    along = tuple(t.shape[axis] if i == axis else 1 for i in range(t.rank))
    positions = b.const(np.arange(t.shape[axis], dtype=kind).reshape(along), ti.dtype)
    return b("cast", b("eq", b.broadcast_to(positions, t.shape), b.broadcast_to(idx, t.shape)), to=t.dtype)


@vjp("gather_elements")
def _gather_elements(b, op, g):
    x, idx = op.operands
    t, ti = info(x), info(idx)
    axis = op.attr("axis") % t.rank
    if dims_equal(ti.shape[axis], 1) and all(dims_equal(a, c) for i, (a, c) in enumerate(zip(ti.shape, t.shape))
                                             if i != axis):
        # One index per row (cross-entropy's picked logit): the cotangent where a one-hot mask
        # of the index is, elementwise (it fuses with the softmax's gradient), not a scatter.
        if isinstance(t.shape[axis], int):
            return [b("mul", one_hot(b, idx, t, axis), b.broadcast_to(g[0], t.shape)), None]
    return [b("scatter_elements", b.zeros(info(x)), idx, g[0], axis=op.attr("axis"), reduction="add"), None]


@vjp("scatter_elements", "scatter_nd")
def _scatter(b, op, g):
    x, idx, upd = op.operands
    red = op.attr("reduction")
    if red not in ("none", "add"):
        raise NotImplementedError(f"tg.{op.op_name} with reduction '{red}': its VJP is not written")
    if op.op_name == Op.scatter_elements:
        axis = op.attr("axis")
        gu = b("gather_elements", g[0], idx, axis=axis)
        gx = g[0] if red == "add" else b("scatter_elements", g[0], idx, b.zeros(info(upd)), axis=axis)
    else:
        k = info(idx).shape[-1]
        flat = b.reshape(g[0], (numel(info(x).shape[:k]),) + tuple(info(x).shape[k:]))
        strides = np.cumprod((1,) + tuple(info(x).shape[1:k])[::-1])[::-1].astype(np.int64)
        lin = b.sum(b("mul", idx, b.const(strides, info(idx).dtype)), (info(idx).rank - 1,))
        gu = b("gather", flat, lin, axis=0)
        gx = g[0] if red == "add" else b("scatter_nd", g[0], idx, b.zeros(info(upd)))
    # (reduction none) later updates to one index win: such duplicates are the caller's to avoid, as in torch
    return [gx, None, gu]


@vjp("topk")
def _topk(b, op, g):
    (x,) = op.operands
    if g[0] is None:
        return [None]
    return [b("scatter_elements", b.zeros(info(x)), op.results[1], g[0], axis=op.attr("axis"), reduction="add")]


def missing() -> list[str]:
    """Ops of the table with neither a VJP nor a stated reason they have none."""
    return [name for name in OPS if name not in VJPS and name not in NO_GRADIENT]
