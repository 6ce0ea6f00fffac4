"""Per-op examples: one or more small graphs for every op of the table, with inputs in its domain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tilegraph.ir import dtypes


# --- per-op examples (NumPy backend; the Triton backend reuses them) ---------
# One or more small graphs for every op of the table, with inputs inside the op's
# domain and the longest chain of summed terms in it (for `tolerance`). The NumPy
# backend's test runs each against the float64 interpreter and fails, naming the
# op, when an op of `ir.ops.OPS` has no example here: adding an op means adding
# its example below.


@dataclass(frozen=True)
class OpExample:
    """A graph exercising `op`, inputs for it, and its reduction length (terms summed per output)."""

    op: str
    label: str
    model: Any
    inputs: tuple
    reduction_length: int = 1

    @property
    def id(self) -> str:
        return f"{self.op}-{self.label}" if self.label else self.op


def op_examples() -> dict[str, list[OpExample]]:
    """op name -> its examples; fresh models on every call, fixed inputs (seeded)."""
    from tilegraph.ir import Graph, TensorInfo

    rng = np.random.default_rng(20240601)
    out: dict[str, list[OpExample]] = {}

    def f32(*shape, lo=-2.0, hi=2.0):
        return rng.uniform(lo, hi, shape).astype(np.float32)

    def ints(*shape, lo=-20, hi=20, dtype=np.int32):
        return rng.integers(lo, hi, shape).astype(dtype)

    def bools(*shape):
        return rng.random(shape) < 0.5

    def add(op, build, inputs, reduction_length=1, label="", shapes=None, aliases=None):
        """`build(g, *tensors)` makes the output(s) from inputs x0, x1, ... (shapes may name symbols);
        `aliases` (input name -> output name) donates inputs the model updates in place."""
        g = Graph()
        ts = [g.input(f"x{i}", (shapes[i] if shapes else a.shape), dtypes.dtype_name(a.dtype))
              for i, a in enumerate(inputs)]
        result = build(g, *ts)
        model = g.build(*(result if isinstance(result, tuple) else (result,)), aliases=aliases)
        out.setdefault(op, []).append(OpExample(op, label, model, tuple(inputs), reduction_length))

    def unary(op, x, label="", **attrs):
        add(op, lambda g, a: g.op(op, a, **attrs), [x], label=label)

    def binary(op, a, b, label=""):
        add(op, lambda g, x, y: g.op(op, x, y), [a, b], label=label)

    # Elementwise unary, each on its domain.
    domains = {"log": (0.1, 4), "sqrt": (0.1, 4), "rsqrt": (0.1, 4), "asin": (-0.95, 0.95),
               "acos": (-0.95, 0.95), "atanh": (-0.95, 0.95), "acosh": (1.05, 4), "tan": (-1.4, 1.4),
               "sigmoid": (-12, 12), "exp": (-4, 4), "sinh": (-4, 4), "cosh": (-4, 4)}
    for op in ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "erf", "sin", "cos",
               "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "floor", "ceil"):
        unary(op, f32(3, 5, lo=domains.get(op, (-3, 3))[0], hi=domains.get(op, (-3, 3))[1]), "f32")
    for op in ("neg", "abs", "sign"):
        unary(op, ints(3, 5), "i32")
    unary("reciprocal", f32(3, 5, lo=0.25, hi=2) * np.where(bools(3, 5), 1, -1).astype(np.float32), "f32")
    halves = np.array([[-2.5, -1.5, -0.5, 0.5, 1.5], [2.5, 0.49, -0.51, 3.7, -3.2]], dtype=np.float32)
    unary("round", halves, "half-to-even")
    unary("sign", np.array([-2.0, -0.0, 0.0, 1e-30, 3.0], dtype=np.float32), "f32")
    unary("bitwise_not", ints(3, 5), "i32")
    unary("gelu", f32(3, 5, lo=-4, hi=4), "erf")
    unary("gelu", f32(3, 5, lo=-4, hi=4), "tanh", approximate="tanh")
    unary("not", bools(3, 5), "i1")
    special = np.array([1.0, np.nan, np.inf, -np.inf, -2.0, 0.0], dtype=np.float32)
    unary("isnan", special, "f32")
    unary("isinf", special, "both")
    unary("isinf", special, "negative-only", detect_positive=False)
    unary("cast", f32(3, 5, lo=-100, hi=100), "f32-to-i32", to="i32")
    unary("cast", ints(3, 5, dtype=np.int64), "i64-to-f32", to="f32")
    unary("cast", f32(3, 5), "f32-to-f16", to="f16")
    unary("cast", f32(3, 5), "f32-to-i1", to="i1")
    special_bits = np.array([[1.0, -0.0, np.inf, np.nan, 3.5e-41]], dtype=np.float32)  # a subnormal among them
    unary("bitcast", special_bits, "f32-to-i32", to="i32", source="f32")
    unary("bitcast", ints(3, 5, dtype=np.int16), "i16-to-f16", to="f16", source="i16")

    # Elementwise binary: broadcasting (3, 4) with (4,).
    for op in ("add", "sub", "mul", "max", "min"):
        binary(op, f32(3, 4), f32(4), "f32")
        binary(op, ints(3, 4), ints(4), "i32")
    binary("add", f32(3, 4).astype(np.float16), f32(4).astype(np.float16), "f16")
    binary("div", f32(3, 4), f32(4, lo=0.5, hi=2) * np.float32(-1), "f32")
    binary("div", ints(3, 4, lo=-50, hi=50), np.array([3, -3, 7, -1], np.int32), "i32-truncates")
    binary("pow", f32(3, 4, lo=0.5, hi=2), f32(4, lo=-2, hi=2), "f32")
    binary("pow", ints(3, 4, lo=-4, hi=5), np.array([0, 1, 2, 3], np.int32), "i32")
    for fmod in (False, True):
        add("mod", lambda g, a, b, fmod=fmod: g.op("mod", a, b, fmod=fmod),
            [f32(3, 4, lo=-5, hi=5), np.array([1.5, -1.5, 2.0, -0.7], np.float32)], label=f"f32-fmod={fmod}")
        add("mod", lambda g, a, b, fmod=fmod: g.op("mod", a, b, fmod=fmod),
            [ints(3, 4), np.array([3, -3, 7, -2], np.int32)], label=f"i32-fmod={fmod}")
    for op in ("bitwise_and", "bitwise_or", "bitwise_xor"):
        binary(op, ints(3, 4, lo=-100, hi=100), ints(4, lo=-100, hi=100), "i32")
    for op in ("shift_left", "shift_right"):
        binary(op, ints(3, 4, lo=0, hi=1000, dtype=np.uint32), ints(4, lo=0, hi=8, dtype=np.uint32), "ui32")
    for op in ("and", "or", "xor"):
        binary(op, bools(3, 4), bools(4), "i1")
    coarse = lambda *s: np.round(f32(*s) * 2) / 2  # noqa: E731 - repeated values, so eq/ne/le/ge see ties
    for op in ("eq", "ne", "lt", "le", "gt", "ge"):
        binary(op, coarse(3, 4), coarse(4), "f32")
        binary(op, ints(3, 4, lo=-3, hi=3), ints(4, lo=-3, hi=3), "i32")
    add("where", lambda g, c, a, b: g.where(c, a, b), [bools(3, 4), f32(3, 4), f32(4)], label="f32")

    # Reductions; the reduction length is the number of terms per output.
    x = f32(3, 4, 5)
    for kind in ("sum", "mean", "max", "min"):
        add("reduce_" + kind, lambda g, a, k=kind: g.op("reduce_" + k, a, axes=(0, 2)), [x], 15, "axes=0,2")
        add("reduce_" + kind, lambda g, a, k=kind: g.op("reduce_" + k, a, axes=(-1,), keepdims=True), [x], 5,
            "keepdims")
    add("reduce_prod", lambda g, a: g.op("reduce_prod", a, axes=(1,)), [f32(3, 6, lo=0.5, hi=1.5)], 6, "f32")
    for kind in ("sum", "max", "prod"):
        add("reduce_" + kind, lambda g, a, k=kind: g.op("reduce_" + k, a, axes=(1,)), [ints(3, 4, lo=-5, hi=5)],
            label="i32")
    add("reduce_sum", lambda g, a: g.op("reduce_sum", a, axes=(1,)), [ints(3, 4, lo=-5, hi=5, dtype=np.int8)],
        label="i8")
    add("reduce_sum", lambda g, a: g.op("reduce_sum", a, axes=(1,)), [f32(3, 8).astype(np.float16)], 8, "f16")
    ties = rng.integers(0, 3, (3, 6)).astype(np.float32)
    for op in ("argmax", "argmin"):
        add(op, lambda g, a, op=op: g.op(op, a, axis=1), [ties], label="first")
        add(op, lambda g, a, op=op: g.op(op, a, axis=0, keepdims=True, select_last_index=True), [ties],
            label="last-keepdims")
    add("cumsum", lambda g, a: g.op("cumsum", a, axis=1), [f32(3, 6)], 6, "f32")
    add("cumsum", lambda g, a: g.op("cumsum", a, axis=1, exclusive=True, reverse=True), [f32(3, 6)], 6,
        "exclusive-reverse")
    add("cumsum", lambda g, a: g.op("cumsum", a, axis=0), [ints(4, 3)], label="i32")
    # A scan of a scalar is the scalar (torch; the rule takes axis 0 of a rank-0 operand): np.cumsum
    # made it 1-d.
    add("cumsum", lambda g, a: g.op("cumsum", a, axis=0, exclusive=True), [f32()], label="scalar")

    # Contractions.
    add("matmul", lambda g, a, b: a @ b, [f32(2, 3, 8), f32(8, 5)], 8, "batched")
    add("matmul", lambda g, a, b: a @ b, [f32(8), f32(2, 8, 3)], 8, "vector")
    add("matmul", lambda g, a, b: a @ b, [ints(3, 4, lo=-5, hi=5), ints(4, 2, lo=-5, hi=5)], label="i32")
    add("einsum", lambda g, a, b: g.op("einsum", a, b, equation="bij,bjk->bik"), [f32(2, 3, 6), f32(2, 6, 4)], 6,
        "bmm")
    add("conv", lambda g, a, w, b: g.op("conv", a, w, b, strides=(2, 2), pads=(1, 1, 1, 1)),
        [f32(1, 3, 7, 7), f32(4, 3, 3, 3), f32(4)], 27, "2d")
    add("conv", lambda g, a, w: g.op("conv", a, w, groups=2, dilations=(2,), pads=(0, 1)),
        [f32(2, 4, 9), f32(6, 2, 3)], 6, "1d-groups-dilation")
    add("max_pool", lambda g, a: g.op("max_pool", a, kernel=(2, 2), strides=(2, 2)), [f32(1, 2, 6, 6)], label="2x2")
    add("max_pool", lambda g, a: g.op("max_pool", a, kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1),
                                      ceil_mode=True), [f32(1, 2, 6, 6)], label="ceil-pads")
    add("avg_pool", lambda g, a: g.op("avg_pool", a, kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)),
        [f32(1, 2, 6, 6)], 9, "pads-excluded")
    add("avg_pool", lambda g, a: g.op("avg_pool", a, kernel=(2,), count_include_pad=True, pads=(1, 1)),
        [f32(1, 2, 6)], 2, "1d-pads-included")

    # Composites.
    add("softmax", lambda g, a: g.softmax(a, axis=-1), [f32(3, 7, lo=-5, hi=5)], 7, "last")
    add("softmax", lambda g, a: g.softmax(a, axis=0), [f32(3, 7, lo=-5, hi=5)], 3, "first")
    add("layer_norm", lambda g, a, s, b: g.layer_norm(a, s, b), [f32(2, 3, 8), f32(8), f32(8)], 8, "affine")
    add("layer_norm", lambda g, a: g.layer_norm(a, axis=1, epsilon=1e-3), [f32(2, 3, 4)], 12, "axis=1")
    q, k, v = f32(1, 2, 4, 8), f32(1, 2, 6, 8), f32(1, 2, 6, 8)
    # q.k sums 8 terms, the softmax and p@v 6 more each along the keys.
    add("attention", lambda g, a, b, c, m: g.attention(a, b, c, m), [q, k, v, f32(4, 6)], 8 + 2 * 6, "float-mask")
    add("attention", lambda g, a, b, c, m: g.attention(a, b, c, m, scale=0.5),
        [q, k, v, np.tril(np.ones((4, 6), bool), 2)], 8 + 2 * 6, "bool-mask")
    add("attention", lambda g, a, b, c: g.attention(a, b, c, causal=True), [q, k, v], 8 + 2 * 6, "causal")

    # its backward: the scores (8 terms), the softmax's row (6), dP (8 along v's dim), rowsum(P dP) (6),
    # then dq's sum over keys (6) and dk's over queries (4)
    gy, grads = f32(1, 2, 4, 8), 8 + 2 * 6 + 8 + 6

    def backward(**attrs):
        return lambda g, a, b, c, d, *m: g.op("attention_grad", a, b, c, d, *m, **{"scale": 0.35, **attrs})
    add("attention_grad", backward(), [q, k, v, gy], grads, "plain")
    add("attention_grad", backward(causal=True), [q, k, v, gy], grads, "causal")
    add("attention_grad", backward(), [q, k, v, gy, f32(4, 6)], grads, "float-mask")
    add("attention_grad", backward(scale=0.5, causal=True), [q, k, v, gy, np.tril(np.ones((4, 6), bool), 2)],
        grads, "causal-bool-mask")

    # Layout; symbolic dims where the op's shape code uses them.
    add("reshape", lambda g, a: g.reshape(a, ("B", -1)), [f32(2, 3, 6)], label="symbolic",
        shapes=[("B", "S", 6)])
    add("broadcast", lambda g, a: g.broadcast(a, ("B", 4, 5)), [f32(3, 1, 5)], label="symbolic",
        shapes=[("B", 1, 5)])
    add("transpose", lambda g, a: g.transpose(a, (2, 0, 1)), [f32(2, 3, 4)])
    add("concat", lambda g, a, b, c: g.concat([a, b, c], axis=1), [f32(2, 1), f32(2, 3), f32(2, 2)])
    add("split", lambda g, a: g.split(a, (2, 3, 1), axis=1), [f32(2, 6)], label="three")
    add("slice", lambda g, a: g.slice(a, starts=(1, 6), ends=(5, -100), steps=(2, -2)), [f32(6, 7)],
        label="steps")
    add("slice", lambda g, a: g.slice(a, starts=(1,), ends=((1 << 63) - 1,), axes=(1,)), [f32(3, 5)],
        label="symbolic", shapes=[("B", "S")])
    add("gather", lambda g, t, i: g.gather(t, i), [f32(10, 4), np.array([[0, 9, -1], [3, 3, -10]], np.int64)],
        label="embedding")
    add("gather", lambda g, t, i: g.gather(t, i, axis=1), [f32(3, 5), np.array([4, 0], np.int32)], label="axis=1")
    add("gather_elements", lambda g, t, i: g.op("gather_elements", t, i, axis=1),
        [f32(3, 4), np.array([[0, 3], [-1, 2], [1, -4]], np.int64)])
    # Indices shorter than the data in a dim other than the axis read that dim's first entries
    # (ONNX, torch.gather): np.take_along_axis broadcast them to the data's length instead.
    add("gather_elements", lambda g, t, i: g.op("gather_elements", t, i, axis=0),
        [f32(3, 4), np.array([[2, 0], [-1, 1]], np.int64)], label="shorter-indices")
    add("pad", lambda g, a: g.pad(a, (1, 0, 2, 3), value=1.5), [f32(2, 3)], label="constant")
    add("pad", lambda g, a: g.pad(a, (0, 2, 0, 1), mode="reflect"), [f32(2, 4)], label="reflect")
    add("pad", lambda g, a: g.pad(a, (1, 1, 1, 1), mode="edge"), [ints(2, 3)], label="edge-i32")
    add("tile", lambda g, a: g.op("tile", a, repeats=(2, 1, 3)), [f32(2, 3, 1)])
    add("trilu", lambda g, a: g.op("trilu", a, k=1), [f32(2, 4, 5)], label="upper")
    add("trilu", lambda g, a: g.op("trilu", a, k=-1, upper=False), [f32(4, 5)], label="lower")

    # Sources: inline constants (with a non-finite value) and weights.
    add("constant", lambda g, a: a * g.constant(np.array([1.5, -np.inf, 0.25], np.float32)), [f32(2, 3)],
        label="f32")
    add("constant", lambda g, a: a + g.constant(np.array(7, np.int64)), [ints(3, dtype=np.int64)], label="i64")
    bias, table = f32(3), f32(2, 3)
    add("weight", lambda g, a: (a + g.weight("layer.0.bias", bias), g.weight("table", table)), [f32(2, 3)],
        label="f32")

    # --- ops added for the ONNX frontend ---
    add("iota", lambda g, a: a + g.op("iota", result=TensorInfo(("B", 4), "i64"), axis=0),
        [ints(3, 4, dtype=np.int64)], label="symbolic", shapes=[("B", 4)])
    add("iota", lambda g, a: a * g.op("iota", result=TensorInfo((3, 5), "f32"), axis=1), [f32(3, 5)], label="f32")
    # duplicate indices only under a reduction: plain assignment leaves their order open
    add("scatter_elements", lambda g, a, i, u: g.op("scatter_elements", a, i, u, axis=1),
        [f32(3, 5), np.array([[4, 0], [1, -1], [2, 3]], np.int64), f32(3, 2)], label="none")
    add("scatter_elements", lambda g, a, i, u: g.op("scatter_elements", a, i, u, axis=0, reduction="add"),
        [f32(3, 4), np.array([[0, 2, 0, 1], [0, 2, 2, 1]], np.int64), f32(2, 4)], 3, label="add-duplicates")
    add("scatter_nd", lambda g, a, i, u: g.op("scatter_nd", a, i, u),
        [f32(4, 3, 2), np.array([[3], [0]], np.int64), f32(2, 3, 2)], label="slices")
    add("scatter_nd", lambda g, a, i, u: g.op("scatter_nd", a, i, u, reduction="max"),
        [ints(3, 4), np.array([[0, 1], [2, 3], [0, 1]], np.int32), ints(3)], label="max-duplicates")
    add("cumprod", lambda g, a: g.op("cumprod", a, axis=1), [f32(3, 6, lo=0.5, hi=1.5)], 6, "f32")
    add("cumprod", lambda g, a: g.op("cumprod", a, axis=0, exclusive=True, reverse=True), [ints(4, 3, lo=-3, hi=4)],
        label="i32-exclusive-reverse")
    add("cumprod", lambda g, a: g.op("cumprod", a, axis=0, reverse=True), [f32()], label="scalar")
    ties = np.array([[3, 1, 3, 2, 1, 3], [0, 0, 5, 5, -1, 2]], np.int32)  # equal values come out in index order
    add("topk", lambda g, a: g.op("topk", a, k=4, axis=1), [ties], label="largest-ties")
    add("topk", lambda g, a: g.op("topk", a, k=2, axis=0, largest=False), [f32(5, 3)], label="smallest")
    # --- data-dependent sizes: a dim known only at run time (u0), used downstream ---
    add("nonzero", lambda g, a: g.op("transpose", g.op("nonzero", g.op("gt", a, g.constant(np.float32(0.5))),
                                                        size="u0"), perm=[1, 0]), [f32(3, 4)], label="mask")
    picked = lambda g, a: (lambda i: g.op("gather", g.reshape(a, [-1]), g.reshape(i, ["u0"])))(  # noqa: E731
        g.op("nonzero", g.op("ne", g.reshape(a, [-1]), g.constant(np.int32(0))), size="u0"))
    add("nonzero", lambda g, a: g.op("reduce_sum", picked(g, a), axes=[0], keepdims=True),
        [ints(2, 5, lo=-2, hi=3)], 10, label="masked-sum-symbolic", shapes=[("B", 5)])
    dupes = np.array([[2.0, 1.0, 2.0, 0.5], [1.0, 3.0, 0.5, 2.0]], np.float32)
    add("unique", lambda g, a: g.op("unique", a, size="u0"), [dupes], label="sorted-flat")
    add("unique", lambda g, a: g.op("unique", a, size="u0", flatten=False, axis=1, sorted=False),
        [np.array([[1, 2, 1, 3], [4, 0, 4, 0]], np.int64)], label="first-occurrence-axis1")
    corners = np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, -0.1, 1, 0.9], [0, 10, 1, 11], [1, 1, 0, 0]]],
                       np.float32)  # overlapping pairs, a far box, a box given by its other corners
    add("non_max_suppression", lambda g, b, s: g.op("non_max_suppression", b, s, g.constant(np.array([3])),
                                                    g.constant(np.array([0.5], np.float32)), size="u0"),
        [corners, np.array([[[0.9, 0.75, 0.6, 0.95, 0.5], [0.1, 0.2, 0.3, 0.4, 0.5]]], np.float32)],
        label="two-classes")
    # Recurrences over a symbolic number of steps T (one op, a loop inside)
    lstm_w, lstm_r = f32(4 * 3, 2, lo=-1, hi=1), f32(4 * 3, 3, lo=-1, hi=1)
    add("rnn", lambda g, x, b, h, c, p: g.op("rnn", x, g.weight("lstm.w", lstm_w), g.weight("lstm.r", lstm_r),
                                          b, h, c, p, cell="lstm", clip=2.0),
        [f32(4, 2, 2), f32(24, lo=-0.5, hi=0.5), f32(2, 3), f32(2, 3), f32(9, lo=-0.5, hi=0.5)], 12,
        label="lstm-peepholes-clip", shapes=[("T", 2, 2), (24,), (2, 3), (2, 3), (9,)])
    gru_w, gru_r = f32(3 * 3, 2, lo=-1, hi=1), f32(3 * 3, 3, lo=-1, hi=1)
    add("rnn", lambda g, x, b, h: g.op("rnn", x, g.weight("gru.w", gru_w), g.weight("gru.r", gru_r), b, h,
                                       cell="gru", reverse=True, linear_before_reset=True),
        [f32(5, 2, 2), f32(18, lo=-0.5, hi=0.5), f32(2, 3)], 12, label="gru-reverse",
        shapes=[("T", 2, 2), (18,), (2, 3)])
    add("rnn", lambda g, x: g.op("rnn", x, g.weight("rnn.w", gru_w[:3]), g.weight("rnn.r", gru_r[:3]), cell="rnn"),
        [f32(3, 2, 2)], 12, label="tanh")
    add("assert_size", lambda g, a: g.op("assert_size", g.op("nonzero", g.op("ne", a, g.constant(np.int32(0))),
                                                             size="u0"), axis=1, size=4) * 3,
        [np.array([0, 5, 0, 1, 2, 3], np.int32)], label="nonzero-count-as-traced")
    add("narrow", lambda g, a, k: g.op("narrow", g.op("topk", a, k=6, axis=1)[0], k, axis=1, size="u0") * 2.0,
        [f32(3, 6), np.array(4, np.int64)], label="topk-computed-k")


    # --- quantization (ir/quant.py) ---
    # The quantized values are the same in both: x / scale is rounded in float32 by both.
    import ml_dtypes

    add("quantize", lambda g, a: g.op("quantize", a, g.constant(np.float32(0.02)), g.constant(np.uint8(128)),
                                      to="ui8"), [f32(3, 5, lo=-3, hi=3)], label="ui8-asymmetric-saturating")
    add("quantize", lambda g, a: g.op("quantize", a, g.constant(np.array([0.1, 0.01, 0.5], np.float32)),
                                      to="i8", axis=0), [f32(3, 5)], label="i8-per-channel")
    add("quantize", lambda g, a: g.op("quantize", a, g.constant(np.array([0.3, 0.05, 0.2], np.float32)),
                                      to="i4", axis=0), [f32(3, 5)], label="i4-per-channel")
    add("quantize", lambda g, a: g.op("quantize", a, g.constant(np.float32(0.01)), to="f8E5M2"),
        [f32(3, 5, lo=-1000, hi=1000)], label="f8E5M2-saturating")
    mx_scales = np.array([[0.25, 1.0], [2.0, 0.5]], np.float32).astype(ml_dtypes.float8_e8m0fnu)
    add("quantize", lambda g, a: g.op("quantize", a, g.weight("mx.scale", mx_scales), to="f4E2M1FN", axis=1,
                                      block_size=4), [f32(2, 7, lo=-4, hi=4)], label="mxfp4-blocks-of-4")
    codes = rng.integers(-128, 128, (3, 5)).astype(np.int8)
    add("dequantize", lambda g, a: g.op("dequantize", a, g.constant(np.array([0.1, 0.02, 1.5], np.float32)),
                                        g.constant(np.array([3, -2, 0], np.int8)), axis=0), [codes],
        label="i8-per-channel-zero-point")
    add("dequantize", lambda g, a: g.op("dequantize", a, g.constant(np.array([[0.5], [0.25], [2e-3]], np.float32))),
        [ints(3, 4, lo=-(1 << 30), hi=1 << 30)], label="i32-accumulator-per-row")
    fp4 = rng.uniform(-6, 6, (8, 3)).astype(ml_dtypes.float4_e2m1fn)
    add("dequantize", lambda g, a: a @ g.op("dequantize", g.weight("w.fp4", fp4),
                                            g.weight("w.scale", np.full((1, 3), 4.0, np.float32).astype(
                                                ml_dtypes.float8_e8m0fnu)), axis=0, block_size=32),
        [f32(2, 8)], 8, label="mxfp4-weight")
    int4 = rng.integers(-8, 8, (6, 4)).astype(ml_dtypes.int4)
    add("dequantize", lambda g, a: a @ g.op("dequantize", g.weight("w.i4", int4),
                                            g.weight("w.i4.scale", f32(2, 4, lo=0.01, hi=0.1)), axis=0,
                                            block_size=3), [f32(2, 6)], 6, label="int4-groups-of-3")
    add("dynamic_quantize", lambda g, a: g.op("dynamic_quantize", a), [f32(2, 3, 8, lo=-5, hi=5)],
        label="i8-per-row")
    add("dynamic_quantize", lambda g, a: g.op("dynamic_quantize", a, to="f8E4M3FN", block_size=4),
        [f32(3, 10, lo=-50, hi=50)], label="mxfp8-blocks-of-4")
    add("matmul_integer", lambda g, a, b: g.op("matmul_integer", a, b),
        [ints(2, 3, 16, lo=-128, hi=128, dtype=np.int8), ints(16, 5, lo=-128, hi=128, dtype=np.int8)],
        label="i8")
    # (ui8 - zero point) x i8 over 1100 terms: more than one float32-exact chunk of K (ir/quant.py)
    add("matmul_integer", lambda g, a, b: g.op("matmul_integer", a, b, g.constant(np.uint8(131))),
        [ints(3, 1100, lo=0, hi=256, dtype=np.uint8), ints(1100, 4, lo=-128, hi=128, dtype=np.int8)],
        label="ui8-zero-point-long-k")

    # --- generation: block-format weights, the KV cache, RMSNorm, RoPE ---
    from tilegraph.ir.block_formats import FORMATS

    for fmt, k in (("q4_1", 64), ("q8_0", 64), ("q4_k", 256), ("q6_k", 256), ("bf16", 8)):
        raw = FORMATS[fmt].quantize(f32(5, k))
        add("block_matmul", lambda g, a, raw=raw, fmt=fmt, k=k: g.op("block_matmul", a, g.weight(f"w.{fmt}", raw),
                                                                       format=fmt, k=k),
            [f32(2, 3, k)], k, label=fmt)
        # activation='q8': x rounded to int8 per 32 first (the integer dot products the C backend runs)
        if k % 32 == 0:
            add("block_matmul", lambda g, a, raw=raw, fmt=fmt, k=k: g.op(
                "block_matmul", a, g.weight(f"w.{fmt}", raw), format=fmt, k=k, activation="q8"),
                [f32(2, 3, k)], k, label=f"{fmt}-q8")
    table = FORMATS["q4_0"].quantize(f32(10, 64))
    add("block_gather", lambda g, i: g.op("block_gather", g.weight("embed.q4_0", table), i, format="q4_0", k=64),
        [ints(2, 3, lo=0, hi=10, dtype=np.int64)], label="q4_0-embedding")
    # Writing the same rows again gives the same cache: the in-place write may run twice on one input.
    add("cache_write", lambda g, c, x, p: g.op("cache_write", c, x, p),
        [f32(2, 2, 8, 4), f32(2, 2, 3, 4), np.int64(2)], label="prefill-at-2")
    add("cache_write", lambda g, c, x, p: g.op("cache_write", c, x, p),
        [f32(2, 2, 8, 4), f32(2, 2, 1, 4), np.array([0, 7], np.int64)], label="decode-per-sequence")
    # A donated cache (a compiled decoder's): written where it lies.
    add("cache_write", lambda g, c, x, p: g.op("cache_write", c, x, p),
        [f32(2, 2, 8, 4), f32(2, 2, 1, 4), np.array([3, 5], np.int64)], label="decode-donated",
        aliases={"x0": "output0"})
    add("cache_attention", lambda g, q, k, v, p: g.op("cache_attention", q, k, v, p, scale=0.35),
        [f32(2, 4, 3, 8), f32(2, 2, 10, 8), f32(2, 2, 10, 8), np.array([0, 7], np.int64)], 10, label="gqa-2-per-kv")
    add("cache_attention", lambda g, q, k, v, p: g.op("cache_attention", q, k, v, p, scale=0.5),
        [f32(1, 3, 1, 4), f32(1, 3, 6, 4), f32(1, 3, 6, 4), np.int64(5)], 6, label="decode-last-position")
    # an f16 cache (llama.cpp's default): rows rounded in as they are written, read widened
    add("cache_write", lambda g, c, x, p: g.op("cache_write", c, x, p, store="f16"),
        [f32(2, 2, 8, 4).astype(np.float16), f32(2, 2, 1, 4), np.array([3, 5], np.int64)], label="f16-donated",
        aliases={"x0": "output0"})
    add("cache_attention", lambda g, q, k, v, p: g.op("cache_attention", q, k, v, p, scale=0.5),
        [f32(1, 3, 1, 64), f32(1, 1, 20, 64).astype(np.float16), f32(1, 1, 20, 64).astype(np.float16),
         np.int64(19)], 20, label="f16-cache")
    # sampling: greedy, and temperature / top-k / top-p / penalty with fixed uniform draws
    seen = (ints(3, 40, lo=0, hi=2, dtype=np.int64)).astype(np.uint8)
    add("sample", lambda g, x, s_, u: g.op("sample", x, s_, u), [f32(3, 40), seen, f32(3, lo=0, hi=1)],
        label="greedy")
    add("sample", lambda g, x, s_, u: g.op("sample", x, s_, u, temperature=0.7, top_k=5, top_p=0.8,
                                           repetition_penalty=1.3),
        [f32(3, 40, lo=-4, hi=4), seen, f32(3, lo=0, hi=1)], label="top-k-top-p-penalty")
    add("cache_attention", lambda g, q, k, v, p: g.op("cache_attention", q, k, v, p, scale=0.5, window=3),
        [f32(2, 2, 2, 4), f32(2, 1, 9, 4), f32(2, 1, 9, 4), np.array([1, 6], np.int64)], 3,
        label="sliding-window")
    add("rms_norm", lambda g, a, w: g.op("rms_norm", a, w, epsilon=1e-5), [f32(3, 5, 16), f32(16)], 16,
        label="scaled")
    add("rms_norm", lambda g, a: g.op("rms_norm", a), [f32(4, 8)], 8, label="unscaled")
    add("rope", lambda g, a, c, s_: g.op("rope", a, c, s_), [f32(2, 3, 4, 8), f32(2, 1, 4, 4, lo=-1, hi=1),
                                                            f32(2, 1, 4, 4, lo=-1, hi=1)], 2, label="per-batch")
    add("dropout", lambda g, a, s_: g.op("dropout", a, s_, p=0.25, site=3), [f32(4, 6, 5), np.array(12345, np.int64)],
        label="seeded")
    add("dropout", lambda g, a, s_: g.op("dropout", a, s_, p=0.6), [f32(7, 33), np.array(-7, np.int64)],
        label="negative-seed")

    # --- ops added for the torch frontend ---
    tiny = np.array([1e-9, -3e-8, 1e-4, -0.5, 2.0], np.float32)  # where exp(x)-1 and log(1+x) cancel
    unary("expm1", tiny, "tiny-and-large")
    unary("log1p", tiny, "tiny-and-large")
    # an embedding's gradient: rows added into a table, one row twice, one by a negative index
    add("scatter_nd", lambda g, a, i, u: g.op("scatter_nd", a, i, u, reduction="add"),
        [f32(5, 3), np.array([[1], [4], [1], [-2]], np.int64), f32(4, 3)], label="add-duplicates")
    return out
