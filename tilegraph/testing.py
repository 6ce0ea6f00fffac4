"""Testing tilegraph and passes written for it: tolerances, strategies, semantic checks.

Tolerances are set here, once, by dtype and reduction length; tests never pick
their own. A float result computed in dtype `d` with reductions over `n` terms is
compared to the float64 interpreter with

    rtol = ROUNDING_BUDGET * eps(d) * sqrt(n),   atol = rtol * max(1, max|expected|)

sqrt(n) is the expected growth of rounding error in a sum of n terms (random-walk
accumulation, Higham, "Accuracy and Stability of Numerical Algorithms", ch. 4);
the absolute part scales with the output so values that cancel to near zero are
judged against the size of what cancelled.

Testing your own pass (property-based, with hypothesis):

    from dataclasses import dataclass
    from hypothesis import given, settings
    from xdsl.passes import ModulePass
    from tilegraph.testing import graphs, assert_preserves_semantics

    @dataclass(frozen=True)
    class MyPass(ModulePass):
        name = "my-pass"
        def apply(self, ctx, module): ...          # rewrite the tg IR in place

    @settings(max_examples=50, deadline=None)
    @given(graphs(ops=("add", "mul", "exp", "reshape", "matmul")))
    def test_my_pass_preserves_semantics(model):
        assert_preserves_semantics([MyPass()], model)   # or "canonicalize,my-pass"

`graphs()` draws random valid models (elementwise ops with broadcasting,
reductions, matmuls, layout ops, gather/pad, conv and pooling on NCHW values,
softmax/layer_norm/gelu/attention, comparisons as where conditions, weights,
constants, a symbolic batch dim), values kept where float32 and float64 differ by
rounding only; `random_inputs(model)` feeds one; `assert_preserves_semantics`
runs the pipeline on a copy and compares against the float64 interpreter, with
the tolerance above and `reduction_length(model)`, and on failure shows the
pipeline and the IR before and after. Register the pass in
`passes/registry.py` and tests/test_properties.py checks it on every run.
"""

from __future__ import annotations

import math

import numpy as np

from tilegraph.ir import dtypes

# Unit roundoff of each float type (half the distance from 1.0 to the next number).
EPS = {"f64": 2.0 ** -53, "f32": 2.0 ** -24, "f16": 2.0 ** -11, "bf16": 2.0 ** -8,
       "f8E4M3FN": 2.0 ** -4, "f8E5M2": 2.0 ** -3, "f6E2M3FN": 2.0 ** -4, "f4E2M1FN": 2.0 ** -2,
       "f8E8M0FNU": 2.0 ** -1}
# How many roundings a chain of ops may accumulate before it counts as wrong: a
# dozen elementwise ops each adding ~1 ulp, with headroom of 2x for transcendental
# functions that NumPy evaluates to within 1-2 ulp.
ROUNDING_BUDGET = 64


def tolerance(dtype: str, reduction_length: int = 1) -> tuple[float, float]:
    """(rtol, atol-scale) for comparing a `dtype` result to the float64 reference."""
    if not dtypes.is_float(dtype):
        return (0.0, 0.0)  # integers and booleans are exact
    rtol = ROUNDING_BUDGET * EPS[dtype] * math.sqrt(max(1, reduction_length))
    return (rtol, rtol)


# What the issue asks of a whole fp32 model against its framework's own fp32 output
# (torch eager, onnxruntime): both sides round, so this is a peer-to-peer bound,
# not a bound against the float64 reference.
PEER_RELATIVE_ERROR = 1e-4


def relative_error(actual, expected) -> float:
    """max|a - e| / max|e| over the finite entries of `expected`: one number for 'how far apart'."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape {a.shape} != reference {e.shape}")
    finite = np.isfinite(e)
    scale = float(np.max(np.abs(e[finite]), initial=0.0))
    err = float(np.max(np.abs(a - e)[finite], initial=0.0))
    return err / scale if scale else err


def assert_close(actual, expected, dtype: str, reduction_length: int = 1, name: str = "output") -> None:
    """Assert a result agrees with the float64 reference within the dtype's tolerance."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {actual.shape} != reference {expected.shape}")
    if not dtypes.is_float(dtype):
        np.testing.assert_array_equal(actual, expected, err_msg=name)
        return
    rtol, atol = tolerance(dtype, reduction_length)
    a = actual.astype(np.float64)
    e = expected.astype(np.float64)
    finite = np.isfinite(e)
    scale = float(np.max(np.abs(e[finite]), initial=0.0))
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * max(1.0, scale), equal_nan=True,
                               err_msg=f"{name} ({dtype}, reductions over {reduction_length})")


# --- per-op examples (NumPy backend; the Triton backend reuses them) ---------
# One or more small graphs for every op of the table, with inputs inside the op's
# domain and the longest chain of summed terms in it (for `tolerance`). The NumPy
# backend's test runs each against the float64 interpreter and fails, naming the
# op, when an op of `ir.ops.OPS` has no example here: adding an op means adding
# its example below.

from dataclasses import dataclass  # noqa: E402 - kept inside this block
from typing import Any  # noqa: E402


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

    def add(op, build, inputs, reduction_length=1, label="", shapes=None):
        """`build(g, *tensors)` makes the output(s) from inputs x0, x1, ... (shapes may name symbols)."""
        g = Graph()
        ts = [g.input(f"x{i}", (shapes[i] if shapes else a.shape), dtypes.dtype_name(a.dtype))
              for i, a in enumerate(inputs)]
        result = build(g, *ts)
        model = g.build(*(result if isinstance(result, tuple) else (result,)))
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

    # --- ops added for the torch frontend ---
    tiny = np.array([1e-9, -3e-8, 1e-4, -0.5, 2.0], np.float32)  # where exp(x)-1 and log(1+x) cancel
    unary("expm1", tiny, "tiny-and-large")
    unary("log1p", tiny, "tiny-and-large")
    return out


# --- property-based testing: random graphs, inputs, semantic checks ----------
# The user-facing half of this module (see the module docstring): `graphs()`
# draws random valid tg models, `random_inputs` feeds them, and
# `assert_preserves_semantics` runs a pass pipeline and checks it against the
# float64 interpreter, with the tolerance above and an honest reduction length.

import math as _math  # noqa: E402 - this block is self-contained
from typing import Callable, Mapping, Sequence  # noqa: E402

from tilegraph.ir.ops import OPS  # noqa: E402

# Graph sizes: dims of 1..MAX_DIM, at most MAX_ELEMENTS elements per tensor (with
# every symbol at MAX_SYMBOL_SIZE), so that a graph runs in microseconds and
# hypothesis can afford hundreds of them.
MAX_DIM = 4
MAX_RANK = 3
MAX_ELEMENTS = 512
MAX_SYMBOL_SIZE = 3
SYMBOLS = ("B",)

# Value ranges. Inputs and weights are uniform in [-1, 1]. Every intermediate is
# kept within [-VALUE_LIMIT, VALUE_LIMIT] (tracked by interval arithmetic, scaled
# down by an exact power of two past it), so that cancellation in a later add
# loses no more than a few ulps of the output's scale; log, sqrt, rsqrt and
# division only see values >= MIN_POSITIVE, where their derivative is at most
# 1/MIN_POSITIVE**2 = 4; exp only sees values <= EXP_LIMIT. With these, float32 and
# float64 differ by rounding alone and `tolerance` applies.
VALUE_LIMIT = 8.0
MIN_POSITIVE = 0.5
EXP_LIMIT = 2.0
# layer_norm divides by sqrt(var + eps): eps >= 1e-2 bounds that amplification to
# 10x even when a row is (nearly) constant.
LAYER_NORM_EPSILONS = (1e-2, 1e-1)

# The op kinds `graphs(ops=...)` can draw. Discontinuous ops (floor, ceil, round,
# sign, comparisons as outputs) are left out: float32 and float64 legitimately
# disagree next to a jump. Comparisons appear only as `where` conditions, against
# fresh random values (ties have probability ~1e-7) or, for eq/ne, between
# operands that are exactly equal or not.
UNARY_OPS = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid", "relu", "erf",
             "sin", "cos", "atan", "gelu")
BINARY_OPS = ("add", "sub", "mul", "div", "pow", "max", "min")
REDUCE_OPS = tuple(name for name, spec in OPS.items() if spec.reduction)
LAYOUT_OPS = ("reshape", "transpose", "slice", "concat", "broadcast", "split")
COMPOSITE_OPS = ("softmax", "layer_norm", "gelu", "attention")
# Windowed ops on NCHW values (a fresh rank-4 input or weight is made when the
# pool has none), and the indexing layout ops.
SPATIAL_OPS = ("conv", "max_pool", "avg_pool")
INDEX_OPS = ("gather", "pad")
# Each draws `where(<comparison>, x, y)`: lt/le/gt/ge compare a value with fresh
# random values; eq/ne compare operands whose elements are exactly equal or not
# (weights sharing elements, integer constants), so no rounding decides them.
COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
OTHER_OPS = ("where", "matmul", "cast", "identity", "weight")
OP_FAMILIES = (UNARY_OPS, BINARY_OPS, ("where",) + COMPARE_OPS, REDUCE_OPS, ("matmul",), LAYOUT_OPS,
               COMPOSITE_OPS, SPATIAL_OPS, INDEX_OPS, ("cast", "identity"), ("weight",))
ALL_OPS = tuple(dict.fromkeys(UNARY_OPS + BINARY_OPS + REDUCE_OPS + LAYOUT_OPS + COMPOSITE_OPS + SPATIAL_OPS
                              + INDEX_OPS + COMPARE_OPS + OTHER_OPS))
# NCHW values the spatial family makes: spatial dims of 1..MAX_SPATIAL (a bit
# over MAX_DIM so that 3x3 windows with stride 2 have room), kernels of
# 1..MAX_KERNEL, strides and dilations of 1..2.
MAX_SPATIAL = 5
MAX_KERNEL = 3


def _sym_size(d) -> int:
    """The largest value a dim takes with every symbol at MAX_SYMBOL_SIZE."""
    if isinstance(d, int):
        return d
    import sympy

    return int(sympy.sympify(d).subs({s: MAX_SYMBOL_SIZE for s in sympy.sympify(d).free_symbols}))


def _size(shape) -> int:
    return _math.prod(_sym_size(d) for d in shape)


def _static_tail(shape, n: int) -> bool:
    return len(shape) >= n and all(isinstance(d, int) for d in shape[len(shape) - n:])


# What the first operand of an op must look like for its generator to use it.
_OPERAND_FITS: dict[str, Callable[[tuple], bool]] = {
    "matmul": lambda s: _static_tail(s, 1),
    "attention": lambda s: _static_tail(s, 2),
    "layer_norm": lambda s: _static_tail(s, 1),
    "softmax": lambda s: len(s) >= 1,
    "concat": lambda s: len(s) >= 1,
    "transpose": lambda s: len(s) >= 2,
    "slice": lambda s: any(isinstance(d, int) for d in s),
    "split": lambda s: any(isinstance(d, int) and d >= 2 for d in s),
    # Reductions of rank-1 values would collapse most graphs to scalars within a few ops.
    **{name: (lambda s: len(s) >= 2) for name in REDUCE_OPS},
    # N may be symbolic; the channels and spatial dims must be static.
    **{name: (lambda s: len(s) == 4 and all(isinstance(d, int) for d in s[1:])) for name in SPATIAL_OPS},
    "gather": lambda s: len(s) >= 1,
    "pad": lambda s: len(s) >= 1,
}


class _Val:
    """A tensor of the graph being drawn and an interval holding all its values."""

    __slots__ = ("t", "lo", "hi")

    def __init__(self, t, lo: float, hi: float):
        self.t, self.lo, self.hi = t, float(lo), float(hi)

    @property
    def bound(self) -> float:
        return max(abs(self.lo), abs(self.hi))

    @property
    def shape(self):
        return self.t.shape


class _GraphDrawer:
    """Draws one graph, op by op, from a pool of the values made so far."""

    def __init__(self, draw, dtype: str, symbolic: bool, ops: Sequence[str]):
        from tilegraph.ir import Graph

        self.draw, self.dtype, self.symbolic, self.ops = draw, dtype, symbolic, list(ops)
        self.g = Graph()
        self.pool: list[_Val] = []
        seed = draw(st.integers(0, 2 ** 32 - 1), label="values seed")
        self.rng = np.random.default_rng(seed)
        self.n_inputs = 0
        self.n_weights = 0

    # --- drawing helpers ---------------------------------------------------

    def choice(self, options, label=None):
        return self.draw(st.sampled_from(list(options)), label=label)

    def flag(self, p_true_label: str) -> bool:
        return self.draw(st.booleans(), label=p_true_label)

    def pick(self, candidates: list[_Val] | None = None) -> _Val | None:
        """A value from the pool, the most recent ones more likely (chains form)."""
        pool = self.pool if candidates is None else candidates
        if not pool:
            return None
        back = self.draw(st.integers(0, len(pool) - 1), label="operand (0 = newest)")
        back = min(back, self.draw(st.integers(0, len(pool) - 1), label="operand bias"))
        return pool[len(pool) - 1 - back]

    def shape(self, rank_max=MAX_RANK, allow_symbol=True) -> tuple:
        # Rank 0 is a corner case, not the usual one (most ops have nothing to do on a scalar).
        rank = 0 if self.flag("scalar") else self.draw(st.integers(1, rank_max), label="rank")
        dims = [self.draw(st.integers(1, MAX_DIM), label="dim") for _ in range(rank)]
        if rank and allow_symbol and self.symbolic and self.flag("symbolic leading dim"):
            dims[0] = self.choice(SYMBOLS)
        return tuple(dims)

    # --- sources -----------------------------------------------------------

    def input(self, shape) -> _Val:
        t = self.g.input(f"x{self.n_inputs}", shape, self.dtype)
        self.n_inputs += 1
        return self.add(_Val(t, -1.0, 1.0))

    def weight(self, shape, lo=-1.0, hi=1.0) -> _Val:
        array = self.rng.uniform(lo, hi, [int(d) for d in shape]).astype(dtypes.numpy_dtype(self.dtype))
        self.n_weights += 1
        return _Val(self.g.weight(f"w{self.n_weights - 1}", array), lo, hi)

    def constant(self, value, shape=()) -> _Val:
        array = np.full(shape, value, dtype=dtypes.numpy_dtype(self.dtype))
        return _Val(self.g.constant(array), float(value), float(value))

    def fresh(self, shape, lo=-1.0, hi=1.0) -> _Val:
        """A new weight (static shape) or input (symbolic shape) of `shape`."""
        if all(isinstance(d, int) for d in shape) and not (self.flag("fresh input?") and self.n_inputs < 4):
            return self.weight(shape, lo, hi)
        v = self.input(shape)
        self.pool.pop()  # inputs are [-1, 1]; affinely moved to [lo, hi] below
        if (lo, hi) != (-1.0, 1.0):
            mid, half = (lo + hi) / 2, (hi - lo) / 2
            t = v.t * self.g.constant(np.array(half, dtypes.numpy_dtype(self.dtype))) + mid
            v = _Val(t, lo, hi)
        return v

    def add(self, v: _Val) -> _Val:
        self.pool.append(v)
        return v

    # --- keeping values in range -------------------------------------------------

    def bounded(self, v: _Val, limit: float = VALUE_LIMIT) -> _Val:
        """v, scaled down by an exact power of two until |v| <= limit."""
        if v.bound <= limit:
            return v
        k = _math.ceil(_math.log2(v.bound / limit))
        s = 2.0 ** -k
        return _Val(v.t * s, v.lo * s, v.hi * s)

    def positive(self, v: _Val) -> _Val:
        """v if it is >= MIN_POSITIVE, else |v| + 1 (or exp(v) when v is small)."""
        if v.lo >= MIN_POSITIVE:
            return v
        if v.bound <= 0.5 and self.flag("positive via exp"):
            return _Val(self.g.exp(v.t), _math.exp(v.lo), _math.exp(v.hi))
        v = self.bounded(v)
        lo = 0.0 if v.lo <= 0 <= v.hi else min(abs(v.lo), abs(v.hi))
        return _Val(self.g.abs(v.t) + 1.0, lo + 1.0, v.bound + 1.0)

    def broadcastable_shape(self, shape) -> tuple:
        """A shape that broadcasts against `shape` to `shape` (a suffix, some dims 1)."""
        k = self.draw(st.integers(0, len(shape)), label="suffix rank")
        out = list(shape[len(shape) - k:])
        for i, d in enumerate(out):
            if self.flag("unit dim"):
                out[i] = 1
        return tuple(out)

    def partner(self, x: _Val, lo=-1.0, hi=1.0, positive=False) -> _Val:
        """A second operand for x: from the pool when shapes broadcast, else fresh."""
        from tilegraph.ir.shapes import ShapeError, broadcast_shapes

        how = self.choice(["pool", "fresh", "scalar", "self"], label="partner")
        if how == "self" and not positive:
            return x
        if how == "pool":
            fits = []
            for v in self.pool:
                try:
                    if v.t.dtype == self.dtype and _size(broadcast_shapes(v.shape, x.shape)) <= MAX_ELEMENTS:
                        fits.append(v)
                except ShapeError:
                    pass
            v = self.pick(fits)
            if v is not None:
                return self.positive(v) if positive else v
        if how == "scalar":
            special = [0.0, 1.0, 2.0, 0.5, -1.5] if not positive else [1.0, 2.0, 0.75]
            return self.constant(self.choice(special, label="scalar"))
        shape = self.broadcastable_shape(x.shape)
        return self.fresh(shape, MIN_POSITIVE if positive else lo, 2.0 if positive else hi)

    # --- ops -----------------------------------------------------------------------

    def step(self) -> None:
        # A family first, then an op of it, so that the 15 unary ops do not crowd out matmul.
        families = [f for f in (tuple(o for o in fam if o in self.ops) for fam in OP_FAMILIES) if f]
        kind = self.choice(self.choice(families, label="op family"), label="op")
        if kind == "weight":  # a new weight in the pool: ops on weights alone are constant-folding material
            like = self.pick()
            shape = self.shape(allow_symbol=False) if like is None or self.flag("new shape") else like.shape
            if all(isinstance(d, int) for d in shape):
                self.add(self.weight(shape))
            return
        fits = _OPERAND_FITS.get(kind, lambda v: True)
        x = self.pick([v for v in self.pool if fits(v.shape)])
        if kind in SPATIAL_OPS and (x is None or self.flag("fresh NCHW value")):
            x = self.nchw()  # few drawn values have rank 4
        if x is None:
            return
        made = getattr(self, "op_" + kind, None)
        if made is None:
            # Families drawn by one method that takes the op's name.
            family = self.op_reduce if kind in REDUCE_OPS else self.op_compare if kind in COMPARE_OPS else self.op_unary
            v = family(kind, x)
        else:
            v = made(x)
        if v is not None:
            self.add(self.bounded(v))

    def op_unary(self, name, x):
        g = self.g
        if name in ("log", "sqrt", "rsqrt", "reciprocal"):
            p = self.positive(x)
            f = {"log": _math.log, "sqrt": _math.sqrt, "rsqrt": lambda a: 1 / _math.sqrt(a),
                 "reciprocal": lambda a: 1 / a}[name]
            a, b = f(p.lo), f(p.hi)
            return _Val(g.op(name, p.t), min(a, b), max(a, b))
        if name == "exp":
            x = self.bounded(x, EXP_LIMIT)
            return _Val(g.exp(x.t), _math.exp(x.lo), _math.exp(x.hi))
        if name == "gelu":
            approximate = self.choice(["none", "tanh"], label="gelu approximation")
            return _Val(g.gelu(x.t, approximate=approximate), min(x.lo, -0.2), max(x.hi, 0.0))
        if name == "neg":
            return _Val(-x.t, -x.hi, -x.lo)
        if name == "abs":
            lo = 0.0 if x.lo <= 0 <= x.hi else min(abs(x.lo), abs(x.hi))
            return _Val(g.abs(x.t), lo, x.bound)
        if name == "relu":
            return _Val(g.relu(x.t), max(x.lo, 0.0), max(x.hi, 0.0))
        monotone = {"tanh": _math.tanh, "sigmoid": lambda a: 1 / (1 + _math.exp(-a)), "erf": _math.erf,
                    "atan": _math.atan}
        if name in monotone:
            return _Val(g.op(name, x.t), monotone[name](x.lo), monotone[name](x.hi))
        if name in ("sin", "cos"):
            return _Val(g.op(name, x.t), -1.0, 1.0)
        raise AssertionError(f"graphs(): no generator for op '{name}'")

    def _binary(self, name, x, y):
        from tilegraph.ir.shapes import broadcast_shapes

        if _size(broadcast_shapes(x.shape, y.shape)) > MAX_ELEMENTS:
            return None
        if self.flag("swap operands"):
            x, y = y, x
        ends = [a * b for a in (x.lo, x.hi) for b in (y.lo, y.hi)]
        lo, hi = {
            "add": (x.lo + y.lo, x.hi + y.hi),
            "sub": (x.lo - y.hi, x.hi - y.lo),
            "mul": (min(ends), max(ends)),
            "max": (max(x.lo, y.lo), max(x.hi, y.hi)),
            "min": (min(x.lo, y.lo), min(x.hi, y.hi)),
        }[name]
        return _Val(self.g.op(name, x.t, y.t), lo, hi)

    def op_add(self, x):
        return self._binary("add", x, self.partner(x))

    def op_sub(self, x):
        return self._binary("sub", x, self.partner(x))

    def op_mul(self, x):
        return self._binary("mul", x, self.partner(x))

    def op_max(self, x):
        return self._binary("max", x, self.partner(x))

    def op_min(self, x):
        return self._binary("min", x, self.partner(x))

    def op_div(self, x):
        from tilegraph.ir.shapes import broadcast_shapes

        y = self.partner(x, positive=True)
        if _size(broadcast_shapes(x.shape, y.shape)) > MAX_ELEMENTS:
            return None
        q = [a / b for a in (x.lo, x.hi) for b in (y.lo, y.hi)]
        return _Val(x.t / y.t, min(q), max(q))

    def op_pow(self, x):
        e = self.choice([1.0, 2.0, 3.0, 0.5, -1.0, "tensor"], label="exponent")
        if e == "tensor":
            base = self.bounded(self.positive(x), 4.0)
            y = self.partner(base, lo=-2.0, hi=2.0)
            y = self.bounded(y, 2.0)
            from tilegraph.ir.shapes import broadcast_shapes

            if _size(broadcast_shapes(base.shape, y.shape)) > MAX_ELEMENTS:
                return None
            ends = [a ** b for a in (base.lo, base.hi) for b in (y.lo, y.hi)]
            return _Val(base.t ** y.t, min(ends), max(ends))
        if e in (0.5, -1.0):
            x = self.positive(x)
        elif e == 3.0:
            x = self.bounded(x, 2.0)
        ends = [x.lo ** e, x.hi ** e]
        lo, hi = min(ends), max(ends)
        if e == 2.0 and x.lo <= 0 <= x.hi:
            lo = 0.0
        return _Val(x.t ** e, lo, hi)

    def op_where(self, x):
        # cond compares a pool value with fresh random values: no structural ties.
        c = self.pick()
        if c is None or c.t.dtype != self.dtype:
            return None
        cmp = self.choice(["lt", "gt", "le", "ge"], label="comparison")
        cond = self.g.op(cmp, c.t, self.fresh(self.broadcastable_shape(c.shape)).t)
        y = x if self.flag("where(c, x, x)") and self.flag("really") else self.partner(x)
        from tilegraph.ir.shapes import ShapeError, broadcast_shapes

        try:
            if _size(broadcast_shapes(cond.shape, x.shape, y.shape)) > MAX_ELEMENTS:
                return None
        except ShapeError:
            return None
        return _Val(self.g.where(cond, x.t, y.t), min(x.lo, y.lo), max(x.hi, y.hi))

    def _axes(self, rank):
        axes = [a for a in range(rank) if self.flag("reduce this axis")]
        if len(axes) == rank and rank and not self.flag("reduce every axis"):
            axes.pop(self.draw(st.integers(0, rank - 1), label="axis kept"))
        if not axes and rank and not self.flag("reduce over no axes"):
            axes = [self.draw(st.integers(0, rank - 1), label="axis")]
        return tuple(a - rank if self.flag("negative axis") else a for a in axes)

    def op_reduce(self, name, x):
        axes = self._axes(x.t.rank)
        keepdims = self.flag("keepdims")
        n = _math.prod(_sym_size(x.shape[a]) for a in axes)
        if name == "reduce_prod":
            x = self.bounded(x, 1.0)  # a product of factors in [-1, 1] stays there
            lo, hi = (-1.0, 1.0) if x.lo < 0 else (0.0, x.hi ** n)
        elif name == "reduce_sum":
            lo, hi = x.lo * n, x.hi * n
        else:
            lo, hi = x.lo, x.hi
        return _Val(self.g.op(name, x.t, axes=axes, keepdims=keepdims), min(lo, hi), max(lo, hi))


    def op_matmul(self, x):
        from tilegraph.ir.shapes import dims_equal

        if x.t.rank == 0:
            return None
        k = x.shape[-1]
        if not isinstance(k, int):
            return None
        n = self.draw(st.integers(1, MAX_DIM), label="matmul n")
        how = self.choice(["weight", "batched", "vector", "pool"], label="matmul rhs")
        if how == "pool":
            fits = [v for v in self.pool if v.t.rank >= 2 and v.t.dtype == self.dtype and dims_equal(v.shape[-2], k)]
            y = self.pick(fits) if fits else None
            if y is None:
                return None
        elif how == "batched" and x.t.rank >= 3:
            y = self.fresh(x.shape[:-2] + (k, n))
        elif how == "vector":
            y = self.fresh((k,))
        else:
            y = self.fresh((k, n))
        from tilegraph.ir.shapes import ShapeError

        try:
            t = x.t @ y.t
        except ShapeError:
            return None
        if _size(t.shape) > MAX_ELEMENTS:
            return None
        b = k * x.bound * y.bound
        return _Val(t, -b, b)

    def op_cast(self, x):
        # Through a wider type and back: exact, and canonicalize has something to fold.
        wide = self.g.cast(x.t, "f64")
        return _Val(self.g.cast(wide, self.dtype), x.lo, x.hi)

    def op_reshape(self, x):
        shape = x.shape
        lead = 1 if shape and not isinstance(shape[0], int) else 0
        tail = [d for d in shape[lead:]]
        if not all(isinstance(d, int) for d in tail):
            return None
        n = _math.prod(tail)
        dims = []
        while n > 1 and len(dims) < MAX_RANK:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            d = self.choice(divisors, label="reshape factor")
            dims.append(d)
            n //= d
        if n > 1:
            dims.append(n)
        if self.flag("insert a unit dim"):
            dims.insert(self.draw(st.integers(0, len(dims)), label="unit dim at"), 1)
        new = tuple(shape[:lead]) + tuple(dims)
        t = self.g.reshape(x.t, new)
        if self.flag("reshape again"):
            t = self.g.reshape(t, shape)
        return _Val(t, x.lo, x.hi)

    def op_transpose(self, x):
        rank = x.t.rank
        perm = self.draw(st.permutations(list(range(rank))), label="perm")
        t = self.g.transpose(x.t, perm)
        if self.flag("transpose again"):
            t = self.g.transpose(t, self.draw(st.permutations(list(range(rank))), label="perm 2"))
        return _Val(t, x.lo, x.hi)

    def op_slice(self, x):
        static = [i for i, d in enumerate(x.shape) if isinstance(d, int)]
        if not static:
            return None
        axis = self.choice(static, label="slice axis")
        size = x.shape[axis]
        step = self.choice([1, 2, -1], label="step")
        first = self.draw(st.integers(0, size - 1), label="first element")
        count = self.draw(st.integers(1, len(range(first, size if step > 0 else -1, step))), label="elements")
        start = first - size if self.flag("negative start") else first
        end = first + step * count
        if end < 0:
            end = -size - 1 if step < 0 else end  # a negative end would count from the back
        return _Val(self.g.slice(x.t, [start], [end], axes=[axis], steps=[step]), x.lo, x.hi)

    def op_concat(self, x):
        if x.t.rank == 0:
            return None
        axis = self.draw(st.integers(0, x.t.rank - 1), label="concat axis")
        parts = [x]
        for _ in range(self.draw(st.integers(0, 2), label="more parts")):
            shape = list(x.shape)
            if isinstance(shape[axis], int):
                shape[axis] = self.draw(st.integers(1, MAX_DIM), label="part size")
            parts.append(x if self.flag("concat x again") else self.fresh(tuple(shape)))
        t = self.g.concat([p.t for p in parts], axis=axis)
        if _size(t.shape) > MAX_ELEMENTS:
            return None
        return _Val(t, min(p.lo for p in parts), max(p.hi for p in parts))

    def op_broadcast(self, x):
        shape = [d if not (isinstance(d, int) and d == 1 and self.flag("expand")) else
                 self.draw(st.integers(1, MAX_DIM), label="expanded") for d in x.shape]
        lead = [self.draw(st.integers(1, MAX_DIM), label="new dim")
                for _ in range(self.draw(st.integers(0, 1), label="new dims"))]
        new = tuple(lead + shape)
        if _size(new) > MAX_ELEMENTS or len(new) > MAX_RANK + 1:
            return None
        return _Val(self.g.broadcast(x.t, new), x.lo, x.hi)

    def op_split(self, x):
        static = [i for i, d in enumerate(x.shape) if isinstance(d, int) and d >= 2]
        if not static:
            return None
        axis = self.choice(static, label="split axis")
        size = x.shape[axis]
        cut = self.draw(st.integers(1, size - 1), label="split at")
        a, b = self.g.split(x.t, (cut, size - cut), axis=axis)
        self.add(_Val(a, x.lo, x.hi))
        return _Val(b, x.lo, x.hi)

    def op_softmax(self, x):
        if x.t.rank == 0:
            return None
        axis = self.draw(st.integers(-x.t.rank, x.t.rank - 1), label="softmax axis")
        return _Val(self.g.softmax(x.t, axis=axis), 0.0, 1.0)

    def op_layer_norm(self, x):
        rank = x.t.rank
        axes = [a for a in range(rank) if all(isinstance(d, int) for d in x.shape[a:])]
        if not axes:
            return None
        axis = self.choice(axes, label="layer_norm axis")
        norm = tuple(x.shape[axis:])
        # A fresh random term makes every row vary: see LAYER_NORM_EPSILONS.
        xv = self.bounded(x, 4.0)
        y = xv.t + self.weight(norm).t
        n = _math.prod(norm)
        scale = self.weight(norm, 0.5, 1.5) if self.flag("scale") else None
        bias = self.weight(self.broadcastable_shape(norm)) if scale is not None and self.flag("bias") else None
        eps = self.choice(LAYER_NORM_EPSILONS, label="epsilon")
        out = self.g.layer_norm(y, scale.t if scale else None, bias.t if bias else None,
                                axis=axis - rank if self.flag("negative axis") else axis, epsilon=eps)
        b = _math.sqrt(n) * (1.5 if scale else 1.0) + (1.0 if bias else 0.0)
        return _Val(out, -b, b)

    def op_attention(self, x):
        if x.t.rank < 2 or not isinstance(x.shape[-1], int) or not isinstance(x.shape[-2], int):
            return None
        q = self.bounded(x, 2.0)
        batch, lq, d = x.shape[:-2], x.shape[-2], x.shape[-1]
        causal = self.flag("causal")
        lk = self.draw(st.integers(lq if causal else 1, max(lq, MAX_DIM)), label="keys")
        dv = self.draw(st.integers(1, MAX_DIM), label="value dim")
        k = self.fresh(batch + (lk, d))
        v = self.fresh(batch + (lk, dv))
        mask = None
        how = self.choice(["none", "bool", "float"], label="mask")
        if how == "bool":
            keep = self.rng.random((lq, lk)) < 0.7
            keep[np.arange(lq), self.rng.integers(0, lk, lq)] = True  # no row fully masked
            if causal:
                keep[:, 0] = True  # the first key is visible to every query under the causal mask too
            mask = self.g.weight(f"mask{self.n_weights}", keep)
            self.n_weights += 1
        elif how == "float":
            mask = self.weight((lq, lk), -1.0, 0.0).t
        scale = self.choice([None, 0.5, 1.0], label="scale")
        if _size(batch + (lq, lk)) > MAX_ELEMENTS or _size(batch + (lq, dv)) > MAX_ELEMENTS:
            return None
        out = self.g.attention(q.t, k.t, v.t, mask, scale=scale, causal=causal)
        return _Val(out, v.lo, v.hi)

    # --- spatial ops, gather/pad, comparisons as where conditions -----------------

    def nchw(self) -> _Val:
        """A fresh NCHW value in the pool: an input (N may be symbolic) or a weight."""
        n = self.choice(SYMBOLS) if self.symbolic and self.flag("symbolic batch") else \
            self.draw(st.integers(1, 2), label="batch")
        c = self.draw(st.integers(1, MAX_DIM), label="channels")
        hw = tuple(self.draw(st.integers(1, MAX_SPATIAL), label="spatial dim") for _ in range(2))
        shape = (n, c) + hw
        if isinstance(n, int) and self.flag("NCHW weight"):
            return self.add(self.weight(shape))
        return self.input(shape)

    def _window(self, x, kernel, pool: bool):
        """strides, pads, dilations and ceil_mode for a 2-D window over x, or None when it does not fit.

        Pools keep dilation 1 and pads below the kernel (the ONNX rule), so that
        every window covers at least one element of x: max_pool never sees a
        window of padding alone (-inf) and avg_pool never divides by zero.
        """
        strides = tuple(self.draw(st.integers(1, 2), label="stride") for _ in kernel)
        dil = (1, 1) if pool else tuple(self.draw(st.integers(1, 2), label="dilation") for _ in kernel)
        pads = tuple(self.draw(st.integers(0, (k - 1) if pool else 2), label="pad") for k in kernel * 2)
        ceil_mode = pool and self.flag("ceil_mode")
        for i, k in enumerate(kernel):
            if x.shape[2 + i] + pads[i] + pads[i + 2] < dil[i] * (k - 1) + 1:
                return None
        return strides, pads, dil, ceil_mode

    def op_conv(self, x):
        c = x.shape[1]
        groups = self.choice([1, 2], label="groups") if c % 2 == 0 else 1
        m = groups * self.draw(st.integers(1, MAX_DIM // groups), label="out channels per group")
        kernel = tuple(self.draw(st.integers(1, MAX_KERNEL), label="kernel") for _ in range(2))
        window = self._window(x, kernel, pool=False)
        if window is None:
            return None
        strides, pads, dil, _ = window
        xv = self.bounded(x, 2.0)
        w = self.fresh((m, c // groups) + kernel)
        bias = None if self.flag("no conv bias") else self.fresh((m,))
        operands = (xv.t, w.t) + ((bias.t,) if bias else ())
        t = self.g.op("conv", *operands, strides=strides, pads=pads, dilations=dil, groups=groups)
        if _size(t.shape) > MAX_ELEMENTS:
            return None
        b = (c // groups) * _math.prod(kernel) * xv.bound * w.bound + (bias.bound if bias else 0.0)
        return _Val(t, -b, b)

    def _pool(self, name, x):
        kernel = tuple(self.draw(st.integers(1, MAX_KERNEL), label="pool kernel") for _ in range(2))
        window = self._window(x, kernel, pool=True)
        if window is None:
            return None
        strides, pads, _, ceil_mode = window
        attrs = dict(kernel=kernel, strides=strides, pads=pads, ceil_mode=ceil_mode)
        lo, hi = x.lo, x.hi
        if name == "avg_pool":
            attrs["count_include_pad"] = self.flag("count_include_pad")
            if attrs["count_include_pad"] and any(pads):  # the padding's zeros are averaged in
                lo, hi = min(lo, 0.0), max(hi, 0.0)
        return _Val(self.g.op(name, x.t, **attrs), lo, hi)

    def op_max_pool(self, x):
        return self._pool("max_pool", x)

    def op_avg_pool(self, x):
        return self._pool("avg_pool", x)

    def op_gather(self, x):
        rank = x.t.rank
        axis = self.draw(st.integers(0, rank - 1), label="gather axis")
        size = x.shape[axis]
        # A symbolic axis is at least 1 long: only 0 and -1 are in range for every size.
        lo, hi = (-size, size - 1) if isinstance(size, int) else (-1, 0)
        idx_rank = self.draw(st.integers(0, 2), label="indices rank")
        idx_shape = tuple(self.draw(st.integers(1, 3), label="indices dim") for _ in range(idx_rank))
        if rank - 1 + idx_rank > MAX_RANK + 1:
            return None
        idx = self.rng.integers(lo, hi + 1, idx_shape).astype(self.choice([np.int64, np.int32], label="index type"))
        out = self.g.gather(x.t, self.g.constant(idx), axis=axis - rank if self.flag("negative axis") else axis)
        if _size(out.shape) > MAX_ELEMENTS:
            return None
        return _Val(out, x.lo, x.hi)

    def op_pad(self, x):
        rank = x.t.rank
        mode = self.choice(["constant", "reflect", "edge"], label="pad mode")
        pads = []
        for d in x.shape * 2:
            # reflect needs pads below the dim (a symbolic one may be 1); edge and constant take any
            most = 2 if mode != "reflect" else (min(2, d - 1) if isinstance(d, int) else 0)
            pads.append(self.draw(st.integers(0, most), label="pad width"))
        value = self.choice([0.0, 1.5, -0.5], label="pad value") if mode == "constant" else 0.0
        t = self.g.pad(x.t, pads[:rank] + pads[rank:], mode=mode, value=value)
        if _size(t.shape) > MAX_ELEMENTS:
            return None
        lo, hi = (min(x.lo, value), max(x.hi, value)) if mode == "constant" and any(pads) else (x.lo, x.hi)
        return _Val(t, lo, hi)

    def _condition(self, cmp: str, x: _Val):
        """An i1 tensor that broadcasts against x: `cmp` of two operands no rounding can flip."""
        g = self.g
        if cmp in ("eq", "ne"):
            how = self.choice(["weights", "integers", "self"], label="equality operands")
            shape = tuple(d if isinstance(d, int) else 1 for d in self.broadcastable_shape(x.shape))
            if how == "self":  # x == x: all true (x is finite), a fold canonicalize may know
                return g.op(cmp, x.t, x.t)
            if how == "integers":
                a = self.rng.integers(0, 3, shape)
                b = self.rng.integers(0, 3, shape[len(shape) - self.draw(st.integers(0, len(shape)),
                                                                           label="rhs rank"):])
                return g.op(cmp, g.constant(a.astype(np.int32)), g.constant(b.astype(np.int32)))
            a = self.weight(shape)
            array = self.g.weights[f"w{self.n_weights - 1}"]
            changed = self.rng.random(array.shape) < 0.5
            other = np.where(changed, self.rng.uniform(-1, 1, array.shape), array).astype(array.dtype)
            self.n_weights += 1
            b = g.weight(f"w{self.n_weights - 1}", other)
            return g.op(cmp, a.t, b) if self.flag("swap") else g.op(cmp, b, a.t)
        c = self.pick()
        if c is None or c.t.dtype != self.dtype:
            return None
        how = self.choice(["fresh", "scalar"], label="compared with")
        if how == "scalar":  # a random threshold: ties with computed values have probability ~1e-7
            r = self.constant(float(np.float32(self.rng.uniform(c.lo, c.hi) if c.hi > c.lo else 0.25)))
        else:
            r = self.fresh(self.broadcastable_shape(c.shape))
        return g.op(cmp, c.t, r.t) if self.flag("swap") else g.op(cmp, r.t, c.t)

    def op_compare(self, cmp: str, x):
        """where(cmp(a, b), x, y), sometimes with the condition combined by not/and/or/xor."""
        from tilegraph.ir.shapes import ShapeError, broadcast_shapes

        cond = self._condition(cmp, x)
        if cond is None:
            return None
        how = self.choice(["plain", "not", "and", "or", "xor"], label="combine condition")
        if how == "not":
            cond = self.g.op("not", cond)
        elif how != "plain":
            other = self._condition(self.choice(COMPARE_OPS, label="second comparison"), x)
            if other is not None:
                try:
                    if _size(broadcast_shapes(cond.shape, other.shape)) <= MAX_ELEMENTS:
                        cond = self.g.op(how, cond, other)
                except ShapeError:
                    pass
        y = self.partner(x)
        try:
            if _size(broadcast_shapes(cond.shape, x.shape, y.shape)) > MAX_ELEMENTS:
                return None
        except ShapeError:
            return None
        if self.flag("swap branches"):
            x, y = y, x
        return _Val(self.g.where(cond, x.t, y.t), min(x.lo, y.lo), max(x.hi, y.hi))


    def op_identity(self, x):
        """A rewrite canonicalize should remove: x+0, x*1, x-0, x/1, x**1, -(-x), concat([x]), ..."""
        g = self.g
        form = self.choice(["add0", "mul1", "sub0", "div1", "pow1", "negneg", "concat1", "slice_all",
                            "transpose_id", "reshape_id", "zero_minus", "one_times"], label="identity form")
        t = x.t
        if form == "negneg":
            return _Val(-(-t), x.lo, x.hi)
        if form == "zero_minus":
            return _Val(0.0 - t, -x.hi, -x.lo)
        if form == "one_times":
            return _Val(1.0 * t, x.lo, x.hi)
        if form == "concat1":
            return _Val(g.concat([t], axis=0), x.lo, x.hi) if t.rank else None
        if form == "slice_all":
            return _Val(g.slice(t, [0] * t.rank, [(1 << 63) - 1] * t.rank), x.lo, x.hi) if t.rank else None
        if form == "transpose_id":
            return _Val(g.transpose(t, tuple(range(t.rank))), x.lo, x.hi)
        if form == "reshape_id":
            return _Val(g.reshape(t, t.shape), x.lo, x.hi)
        op, value = {"add0": ("add", 0.0), "mul1": ("mul", 1.0), "sub0": ("sub", 0.0), "div1": ("div", 1.0),
                     "pow1": ("pow", 1.0)}[form]
        shape = self.broadcastable_shape(t.shape) if self.flag("shaped constant") else ()
        c = self.constant(value, tuple(d if isinstance(d, int) else 1 for d in shape))
        return _Val(g.op(op, t, c.t), x.lo, x.hi)


try:
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is in the dev extra
    st = None


def graphs(*, ops: Sequence[str] | None = None, max_ops: int = 12, dtype: str = "f32", symbolic: bool = True,
           max_outputs: int = 3):
    """A hypothesis strategy drawing random, valid, verified tg Models (`ir.Model`).

    ops:        the op kinds to draw from (default ALL_OPS; see UNARY_OPS, BINARY_OPS,
                REDUCE_OPS, LAYOUT_OPS, COMPOSITE_OPS, SPATIAL_OPS (conv, pools on
                NCHW values), INDEX_OPS (gather, pad), COMPARE_OPS (where on a
                comparison), "where", "matmul", "cast", "identity" = a rewrite
                canonicalize should remove)
    max_ops:    how many ops to draw at most (layout helpers and range keepers come on top)
    dtype:      the float type of inputs, weights and results
    symbolic:   whether inputs may have a symbolic leading dim `B`
    max_outputs: the model returns 1..max_outputs values: the ones nothing else uses,
                newest first, sometimes one more (an input, or a value used inside)

    Values stay in ranges where float32 and float64 differ by rounding alone (see
    VALUE_LIMIT): pair with `random_inputs`, which draws inputs in [-1, 1].
    """
    if st is None:
        raise ImportError("tilegraph.testing.graphs needs hypothesis (pip install 'tilegraph[dev]')")
    ops = tuple(ALL_OPS if ops is None else ops)
    unknown = [o for o in ops if o not in ALL_OPS]
    if unknown:
        raise ValueError(f"graphs(): unknown op kind(s) {unknown}; known: {', '.join(ALL_OPS)}")

    @st.composite
    def draw_graph(draw):
        d = _GraphDrawer(draw, dtype, symbolic, ops)
        for _ in range(draw(st.integers(1, 3), label="inputs")):
            d.input(d.shape(allow_symbol=True))
        for _ in range(draw(st.integers(1, max_ops), label="ops")):
            d.step()
        floats = [v for v in d.pool if v.t.dtype == dtype]
        # The values nothing uses come first, so that few of the drawn ops are dead code.
        sinks = [v for v in reversed(floats) if v.t.value.first_use is None] or [floats[-1]]
        count = draw(st.integers(1, max_outputs), label="outputs")
        outputs = sinks[:count]
        if len(outputs) < count or draw(st.booleans(), label="an output also used inside"):
            outputs.append(d.pick(floats))  # an input, or a value that also feeds other ops
        return d.g.build(*[v.t for v in outputs], names=[f"y{i}" for i in range(len(outputs))])

    return draw_graph()


def random_inputs(model, seed: int = 0, sizes: Mapping[str, int] | None = None,
                  int_high: int | None = None) -> list[np.ndarray]:
    """Inputs for `model`: floats uniform in [-1, 1], integers in [0, 4), booleans fair coins.

    With `int_high` (the commands' valid inputs), integers are in [0, int_high) (2: masks and
    flags in {0, 1}), and those that index a table (an embedding's ids) below its size.

    Symbolic dims take `sizes` (e.g. {"B": 2}); a symbol not given is drawn in
    1..MAX_SYMBOL_SIZE from the seed, so that a size of 1 (broadcasting corner
    cases) comes up too.
    """
    from tilegraph.ir.shapes import concrete, free_symbols

    rng = np.random.default_rng(seed)
    sizes = dict(sizes or {})
    for name in sorted(set().union(*(free_symbols(t.shape) for t in model.inputs))):
        sizes.setdefault(name, int(rng.integers(1, MAX_SYMBOL_SIZE + 1)))
    arrays = []
    if int_high is not None and int_high < 1:
        from tilegraph.ir.errors import TilegraphError

        raise TilegraphError(f"integer inputs are drawn from [0, N): N must be at least 1, got {int_high}")
    tables: dict[int, int] = {}
    if int_high is not None:
        from tilegraph.ir.signature import index_checks

        for check in index_checks(model):
            tables[check.input] = min(tables.get(check.input, check.size), check.size)
    for i, info in enumerate(model.inputs):
        shape = concrete(info.shape, sizes)
        dt = dtypes.numpy_dtype(info.dtype)
        if info.dtype == "i1":
            arrays.append(rng.random(shape) < 0.5)
        elif dtypes.is_float(info.dtype):
            arrays.append(rng.uniform(-1.0, 1.0, shape).astype(dt))
        else:
            high = tables.get(i, 4 if int_high is None else int_high)
            arrays.append(rng.integers(0, high, shape).astype(dt))
    return arrays


def reduction_length(model, sizes: Mapping[str, int] | None = None) -> int:
    """The longest chain of rounded sums in `model`: the tolerance's `reduction_length`.

    Along every path from the inputs to an output, add up the terms of each sum
    it passes through (a reduce_sum over 384, then a matmul contracting 64: 448;
    max/min reductions round nothing and count 0), and take the largest. Symbolic
    dims take `sizes`.
    """
    from tilegraph.ir.dialect import TgOp
    from tilegraph.ir.shapes import concrete, info_of

    sizes = dict(sizes or {})

    def n(dims) -> int:
        return _math.prod(concrete(tuple(dims), sizes)) if dims else 1

    def own(op) -> int:
        name, ins = op.op_name, [info_of(v.type).shape for v in op.operands]
        a = op.py_attrs()
        if op.SPEC.reduction in ("sum", "mean", "prod"):  # rounding grows with the length reduced
            return n([ins[0][ax] for ax in a["axes"]])
        if name == "cumsum":
            return n([ins[0][a["axis"]]])
        if name == "matmul":
            return n([ins[0][-1]])
        if name == "einsum":
            lhs, _, out = a["equation"].replace(" ", "").partition("->")
            dims = {}
            for term, shape in zip(lhs.split(","), ins):
                dims.update(zip(term, shape))
            return n([dims[c] for c in dims if c not in out])
        if name == "conv":
            return n(ins[1][1:])
        if name == "avg_pool":
            return _math.prod(a["kernel"])
        if name == "softmax":
            return n([ins[0][a["axis"]]])
        if name == "layer_norm":
            return 2 * n(ins[0][a["axis"]:])  # the mean, then the variance
        if name == "attention":
            return n([ins[0][-1]]) + 2 * n([ins[1][-2]])  # q.k, then the softmax and p@v over the keys
        return 0

    terms: dict = {}
    longest = 1
    for op in model.func.walk():
        if not isinstance(op, TgOp):
            if op.name == "func.return":
                longest = max([longest] + [terms.get(v, 0) for v in op.operands])
            continue
        t = max([terms.get(v, 0) for v in op.operands], default=0) + own(op)
        for r in op.results:
            terms[r] = t
        if op.SPEC.bound is not None:  # a dim known only at run time: at its upper bound
            sizes[op.attr("size")] = n([op.SPEC.bound([info_of(v.type) for v in op.operands], op.py_attrs())])
    return max(1, longest)


def narrowest_float(model) -> str | None:
    """The float type of the model with the largest rounding error (None without floats)."""
    from tilegraph.ir.shapes import info_of

    from tilegraph.ir.dialect import TgOp

    def storage(op) -> bool:
        # Quantized values (tg.quantize results, weights only dequantize reads) are exact in both
        # the interpreter and a backend (ir/quant.py): the arithmetic around them sets the precision.
        if not isinstance(op, TgOp):
            return False
        if op.SPEC.category == "quantize" and op.op_name not in ("dequantize",):
            return True
        return op.op_name == "weight" and all(isinstance(u.operation, TgOp) and u.operation.SPEC.category ==
                                              "quantize" for r in op.results for u in r.uses)

    types = {info_of(a.type).dtype for a in model.func.args}
    types |= {info_of(r.type).dtype for op in model.func.walk() if not storage(op) for r in op.results}
    floats = [t for t in types if dtypes.is_float(t)]
    return max(floats, key=lambda t: EPS[t]) if floats else None


def assert_preserves_semantics(pipeline, model, inputs=None, *, seed: int = 0) -> "object":
    """Run `pipeline` on `model` and assert the result computes what the model did.

    pipeline: a pipeline string ("canonicalize,cse"), a ModulePass, or a list of them.
    Checks, on `inputs` (default: random_inputs(model, seed)):
      1. the signature (input and output names and types) is unchanged;
      2. the float64 interpreter gives the same outputs before and after;
      3. the transformed model run in its own dtypes (what a backend computes) is
         within `tolerance(dtype, reduction_length(model))` of the float64 reference,
         dtype being the coarsest float type of the model (an f16 intermediate makes
         an f32 output f16-accurate).
    Fails with an AssertionError naming the pipeline and showing the IR before and
    after. Returns the transformed model.
    """
    from tilegraph.ir import interpret
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.passes.registry import run_pipeline

    name = pipeline if isinstance(pipeline, str) else ",".join(
        str(p) for p in (pipeline if isinstance(pipeline, (list, tuple)) else [pipeline]))
    passes = pipeline if isinstance(pipeline, (str, list, tuple)) else [pipeline]
    if inputs is None:
        inputs = random_inputs(model, seed)
    _, sizes = bind_inputs(model, inputs)
    before_text = model.text

    def fail(what: str, after_text: str | None = None) -> AssertionError:
        msg = f"pipeline '{name}' does not preserve semantics: {what}\n--- IR before ---\n{before_text}"
        if after_text is not None:
            msg += f"--- IR after '{name}' ---\n{after_text}"
        return AssertionError(msg)

    expected = interpret(model, inputs)
    try:
        after = run_pipeline(model, passes)
    except Exception as e:  # a crash in a pass is a failure of this property too, shown with the IR
        raise fail(f"running it raised {type(e).__name__}: {e}") from e
    after_text = after.text
    if model.text != before_text:
        raise fail("it modified the input model in place", after_text)
    if (after.input_names, after.inputs, after.output_names, after.outputs) != (
            model.input_names, model.inputs, model.output_names, model.outputs):
        raise fail(f"the signature changed: {model.inputs} -> {model.outputs} became "
                   f"{after.inputs} -> {after.outputs}", after_text)
    n = reduction_length(model, sizes)
    coarsest = narrowest_float(model)
    try:
        got64 = interpret(after, inputs)
        got = interpret(after, inputs, float64=False)
    except Exception as e:  # the transformed model cannot even run: show it
        raise fail(f"running the result raised {type(e).__name__}: {e}", after_text) from e
    for i, (out_name, info) in enumerate(zip(model.output_names, model.outputs)):
        # A float output is only as precise as the coarsest float type it passed through.
        dtype = coarsest if dtypes.is_float(info.dtype) and coarsest else info.dtype
        for label, values in (("float64 interpreter", got64), (f"{info.dtype} run", got)):
            try:
                assert_close(values[i], expected[i], dtype, n, name=f"output '{out_name}'")
            except AssertionError as e:
                raise fail(f"{label}, output '{out_name}':\n{e}", after_text) from None
    return after


# --- lossy passes: quantization within its stated bound ------------------------------------
# float32 arithmetic around a rounding (x / scale, then q * scale) adds a few units of
# float32's roundoff, relative to |x|, to the format's half ulp.
QUANT_F32_SLACK = 4 * 2.0 ** -24


def rounding_violations(model, inputs) -> list[str]:
    """Run `model` (the float64 interpreter) and check every dequantize(quantize(x)) pair in it:
    |result - x| <= half an ulp of the format times the scale, plus how far x lies beyond the
    representable range [(lo - zero point) * scale, (hi - zero point) * scale] (a calibrated
    clipping). Returns one line per pair that breaks its bound."""
    from tilegraph.ir import interpret
    from tilegraph.ir.dialect import TgOp
    from tilegraph.ir.quant import FORMATS, expand_scale

    values: dict = {}
    interpret(model, inputs, values=values)
    bad = []
    for op in model.func.walk():
        if not (isinstance(op, TgOp) and op.op_name == "dequantize"):
            continue
        src = op.operands[0].owner
        if not (isinstance(src, TgOp) and src.op_name in ("quantize", "dynamic_quantize")):
            continue
        fmt = FORMATS[src.result_infos()[0].dtype]
        x = np.asarray(values[src.operands[0]], np.float64)
        axis, block = op.attr("axis"), op.attr("block_size")
        scale = expand_scale(np.asarray(values[op.operands[1]]).astype(np.float64), x.shape, axis, block)
        zp = 0.0 if len(op.operands) < 3 else expand_scale(np.asarray(values[op.operands[2]]).astype(np.float64),
                                                            x.shape, axis, block)
        scale = np.broadcast_to(scale, x.shape)
        lo, hi = (fmt.lo - zp) * scale, (fmt.hi - zp) * scale
        beyond = np.maximum(np.maximum(lo - x, x - hi), 0.0)
        bound = fmt.half_ulp(np.clip(x / scale + zp, fmt.lo, fmt.hi)) * scale + beyond + \
            QUANT_F32_SLACK * np.abs(x) + 1e-300
        err = np.abs(np.asarray(values[op.results[0]], np.float64) - x)
        if not (err <= bound).all():
            i = int(np.argmax(err - bound))
            bad.append(f"{src.name} -> {op.name} ({fmt.name}): x={x.flat[i]!r} came back as "
                       f"{np.asarray(values[op.results[0]]).flat[i]!r}, error {err.flat[i]:.3g} > bound "
                       f"{bound.flat[i]:.3g}")
    return bad


def assert_within_quantization_bound(pipeline, model, inputs=None, *, seed: int = 0) -> "object":
    """Check a pipeline holding lossy passes (`LOSSY = True`: quantize) within their stated bound.

    1. the signature is unchanged;
    2. the result computes (float64 interpreter) what the reference pipeline computes, each lossy
       pass replaced by its `reference()` (fake quantization: the float model with each quantized
       tensor x replaced by dequantize(quantize(x))), within the shared tolerance of the model's
       dtype and reduction length: integer GEMMs, folded scales and stored weights are exact;
    3. in the reference, every dequantize(quantize(x)) is within half an ulp of its format times
       its scale of x (`rounding_violations`).
    Returns the transformed model.
    """
    from tilegraph.ir import interpret
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.passes.registry import parse_pipeline, run_pipeline

    passes = parse_pipeline(pipeline) if isinstance(pipeline, str) else list(
        pipeline if isinstance(pipeline, (list, tuple)) else [pipeline])
    reference = [p.reference() if getattr(p, "LOSSY", False) else p for p in passes]
    name = ",".join(str(p) for p in passes)
    if inputs is None:
        inputs = random_inputs(model, seed)
    _, sizes = bind_inputs(model, inputs)
    before_text = model.text
    after = run_pipeline(model, passes)
    ref = run_pipeline(model, reference)

    def fail(what: str) -> AssertionError:
        return AssertionError(f"pipeline '{name}' breaks its stated quantization bound: {what}\n"
                              f"--- IR before ---\n{before_text}--- IR after ---\n{after.text}"
                              f"--- reference (fake quantization) ---\n{ref.text}")

    if model.text != before_text:
        raise fail("it modified the input model in place")
    if (after.input_names, after.inputs, after.output_names, after.outputs) != (
            model.input_names, model.inputs, model.output_names, model.outputs):
        raise fail("the signature changed")
    n = reduction_length(model, sizes)
    coarsest = narrowest_float(model)
    got, want = interpret(after, inputs), interpret(ref, inputs)
    for out_name, info, a, e in zip(model.output_names, model.outputs, got, want):
        dtype = coarsest if dtypes.is_float(info.dtype) and coarsest else info.dtype
        try:
            assert_close(a, e, dtype, n, name=f"output '{out_name}' against the fake-quantized reference")
        except AssertionError as err:
            raise fail(str(err)) from None
    bad = rounding_violations(ref, inputs)
    if bad:
        raise fail("\n".join(bad))
    return after
