"""Each rewrite of the first passes, on printed IR: what it does, and what it must not do.

The checks are filecheck-style (`CHECK:` lines in order, `CHECK-NEXT:` on the
next line, `CHECK-NOT:` absent between its neighbours; `{{re}}` is a regex), and
every rewritten model is also run against the float64 interpreter, so a rule that
prints right but computes wrong fails too. Random graphs are in test_properties.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from xdsl.passes import ModulePass

from tilegraph.ir import Graph, Model, TensorInfo, interpret
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import ModelError
from tilegraph.ir.ops import OPS
from tilegraph.passes.registry import DEFAULT_PIPELINE, PASSES, PipelineError, get_pass_class, parse_pipeline, run_pipeline
from tilegraph.testing import assert_close, assert_preserves_semantics, random_inputs


def filecheck(text: str, checks: str) -> None:
    """A small FileCheck: CHECK / CHECK-NEXT / CHECK-NOT lines, substrings with {{regex}} parts."""
    lines = text.splitlines()
    pos = 0  # the next line a CHECK may match
    last = -1  # the line the last CHECK matched
    pending_not: list[tuple[str, re.Pattern]] = []

    def compile_(pattern: str) -> re.Pattern:
        parts = re.split(r"\{\{(.*?)\}\}", pattern.strip())
        return re.compile("".join(p if i % 2 else re.escape(p) for i, p in enumerate(parts)))

    def check_nots(upto: int) -> None:
        for raw, rx in pending_not:
            for i in range(last + 1, upto):
                if rx.search(lines[i]):
                    raise AssertionError(f"CHECK-NOT: '{raw}' found on line {i + 1}: {lines[i]}\n{text}")
        pending_not.clear()

    for check in checks.strip().splitlines():
        kind, _, pattern = check.strip().partition(":")
        rx = compile_(pattern)
        if kind == "CHECK-NOT":
            pending_not.append((pattern.strip(), rx))
            continue
        if kind == "CHECK-NEXT":
            candidates = [last + 1] if last + 1 < len(lines) else []
        elif kind == "CHECK":
            candidates = range(pos, len(lines))
        else:
            raise ValueError(f"unknown check kind {kind!r}")
        found = next((i for i in candidates if rx.search(lines[i])), None)
        if found is None:
            raise AssertionError(f"{kind}: '{pattern.strip()}' not found after line {last + 1}\n{text}")
        check_nots(found)
        last = pos = found
        pos = found + 1
    check_nots(len(lines))


def after(pipeline: str, model: Model, checks: str) -> Model:
    """Run `pipeline` (semantics checked against the interpreter), filecheck the result's IR."""
    out = assert_preserves_semantics(pipeline, model)
    filecheck(out.text, checks)
    assert Model.parse(out.text, out.weights).text == out.text  # what a pass makes still round-trips
    return out


def graph_with(*shapes, dtype="f32"):
    g = Graph()
    return g, [g.input(f"x{i}", s, dtype) for i, s in enumerate(shapes)]


# --- canonicalize -------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda g, x: x + 0.0, lambda g, x: 0.0 + x, lambda g, x: x - 0.0, lambda g, x: x * 1.0,
    lambda g, x: 1.0 * x, lambda g, x: x / 1.0, lambda g, x: x ** 1.0, lambda g, x: -(-x),
    lambda g, x: g.transpose(x, (0, 1)), lambda g, x: g.reshape(x, x.shape), lambda g, x: g.broadcast(x, x.shape),
    lambda g, x: g.cast(g.cast(x, "f64"), "f32"), lambda g, x: g.slice(x, [0, 0], [(1 << 63) - 1, 3]),
    lambda g, x: g.concat([x], axis=1), lambda g, x: g.split(x, (3,), axis=1)[0],
    lambda g, x: g.transpose(g.transpose(x, (1, 0)), (1, 0)), lambda g, x: g.where(x > 0.5, x, x),
    lambda g, x: g.sum(x, axes=(), keepdims=False), lambda g, x: x + g.constant(np.zeros((1, 3), np.float32)),
], ids=["x+0", "0+x", "x-0", "x*1", "1*x", "x/1", "x**1", "neg-neg", "transpose-id", "reshape-id",
        "broadcast-id", "cast-f64-f32", "slice-all", "concat-one", "split-one", "transpose-inverse",
        "where-same", "sum-no-axes", "x+zeros-same-shape"])
def test_canonicalize_removes_identities(make):
    g, (x,) = graph_with(("B", 3))
    after("canonicalize", g.build(g.exp(make(g, x))), """
        CHECK: %0 = tg.exp %x0
        CHECK-NEXT: func.return %0
    """)


def test_canonicalize_keeps_a_zero_add_that_broadcasts():
    # x (3,) + zeros (2, 3) is (2, 3): dropping the add would change the shape.
    g, (x,) = graph_with((3,))
    after("canonicalize", g.build(x + g.constant(np.zeros((2, 3), np.float32))), """
        CHECK: tg.add %x0, %0 : tensor<2x3xf32>
    """)


@pytest.mark.parametrize("make, op", [
    (lambda g, x: x * 0.0, "tg.mul"),  # inf * 0 is nan, not 0
    (lambda g, x: x - x, "tg.sub"),  # inf - inf is nan
    (lambda g, x: x / x, "tg.div"),  # 0 / 0 is nan
    (lambda g, x: x ** 0.5, "tg.pow"),  # pow(-inf, 0.5) = inf but sqrt(-inf) = nan
    (lambda g, x: g.cast(g.cast(x, "f16"), "f32"), "tg.cast"),  # f16 rounds: not the identity
])
def test_canonicalize_leaves_rewrites_that_change_nonfinite_or_rounded_results(make, op):
    g, (x,) = graph_with((4,))
    model = g.build(make(g, x))
    out = after("canonicalize", model, f"CHECK: {op}")
    special = np.array([np.inf, -np.inf, np.nan, 1e-6], np.float32)
    np.testing.assert_array_equal(interpret(out, [special], float64=False)[0],
                                  interpret(model, [special], float64=False)[0])


def test_canonicalize_square_becomes_a_multiply():
    g, (x,) = graph_with((4,))
    after("canonicalize", g.build(x ** 2.0), """
        CHECK-NOT: tg.pow
        CHECK: tg.mul %x0, %x0 : tensor<4xf32>
    """)


def test_canonicalize_keeps_a_float_cube_and_multiplies_out_an_integer_one():
    # x*x*x rounds twice where pow rounds once: z3 refutes it on every float type (tilegraph/proofs.py);
    # on integers both wrap the same way.
    g, (x,) = graph_with((4,))
    after("canonicalize", g.build(x ** 3.0), "CHECK: tg.pow")
    g = Graph()
    i = g.input("i", (4,), "i32")
    after("canonicalize", g.build(i ** g.constant(np.full((4,), 3, np.int32))), """
        CHECK-NOT: tg.pow
        CHECK: %0 = tg.mul %i, %i : tensor<4xi32>
        CHECK: tg.mul %0, %i : tensor<4xi32>
    """)


def test_canonicalize_negations_fold_into_add_and_sub():
    g, (x, y) = graph_with((4,), (4,))
    after("canonicalize", g.build(x - (-y), x + (-y), (-y) + x, 0.0 - x), """
        CHECK-NOT: tg.neg %x1
        CHECK: tg.add %x0, %x1
        CHECK: tg.sub %x0, %x1
        CHECK: tg.neg %x0
    """)


def test_canonicalize_composes_transposes_and_merges_reshapes():
    g, (x,) = graph_with((2, 3, 4))
    t = g.transpose(g.transpose(x, (0, 2, 1)), (1, 0, 2))  # (4, 2, 3): reads x at (2, 0, 1)
    r = g.reshape(g.reshape(x, (6, 4)), (4, 6))
    after("canonicalize", g.build(t, r), """
        CHECK: tg.transpose %x0 {perm = array<i64: 2, 0, 1>} : tensor<4x2x3xf32>
        CHECK-NOT: tg.transpose
        CHECK: tg.reshape %x0 : tensor<4x6xf32>
        CHECK-NOT: tg.reshape
    """)


def test_canonicalize_folds_casts_only_through_lossless_types():
    g, (x,) = graph_with((4,), dtype="f16")
    wide = g.cast(g.cast(x, "f32"), "f64")  # f16 -> f32 is exact: one cast f16 -> f64
    g2, (y,) = graph_with((4,), dtype="i8")
    ints = g2.cast(g2.cast(y, "i32"), "f32")  # i8 -> i32 exact: one cast i8 -> f32
    after("canonicalize", g.build(wide), """
        CHECK: tg.cast %x0 {to = "f64"} : tensor<4xf64>
        CHECK-NOT: tg.cast
    """)
    after("canonicalize", g2.build(ints), """
        CHECK: tg.cast %x0 {to = "f32"} : tensor<4xf32>
        CHECK-NOT: tg.cast
    """)
    from tilegraph.passes.canonicalize import lossless_cast

    assert lossless_cast("bf16", "f32") and lossless_cast("i1", "f16") and lossless_cast("i16", "f32")
    assert not any([lossless_cast("f32", "f16"), lossless_cast("f16", "bf16"), lossless_cast("i32", "f32"),
                    lossless_cast("i64", "f64"), lossless_cast("i8", "ui8"), lossless_cast("f32", "i64")])


def test_canonicalize_idempotent_ops_and_constant_conditions():
    g, (x,) = graph_with((4,))
    keep = g.constant(np.array([True, True, True, True]))
    drop = g.constant(np.array(False))
    after("canonicalize", g.build(g.abs(g.abs(-x)), g.relu(g.relu(x)), g.where(keep, x, 2.0),
                                  g.where(drop, x, 2.0)), """
        CHECK: %0 = tg.abs %x0
        CHECK-NEXT: %1 = tg.relu %x0
        CHECK-NEXT: %2 = tg.constant {value = dense<2.000000e+00> : tensor<f32>}
        CHECK-NEXT: %3 = tg.broadcast %2 : tensor<4xf32>
        CHECK-NEXT: func.return %0, %1, %x0, %3
    """)


def test_canonicalize_a_mixed_where_condition_stays():
    g, (x,) = graph_with((2,))
    after("canonicalize", g.build(g.where(g.constant(np.array([True, False])), x, 2.0)), "CHECK: tg.where")


def test_canonicalize_reductions_over_unit_dims_become_reshapes():
    g, (x,) = graph_with((3, 1, 4))
    after("canonicalize", g.build(g.sum(x, axes=1), g.amax(x, axes=1, keepdims=True), g.sum(x, axes=2)), """
        CHECK: tg.reshape %x0 : tensor<3x4xf32>
        CHECK: tg.reduce_sum %x0 {axes = array<i64: 2>} : tensor<3x1xf32>
        CHECK-NOT: tg.reduce_max
        CHECK: func.return %0, %x0, %1
    """)


def test_canonicalize_puts_constants_on_the_right_so_cse_merges():
    g, (x,) = graph_with((4,))
    out = after("canonicalize,cse", g.build((2.0 * x) + (x * 2.0)), """
        CHECK: %1 = tg.mul %x0, %0
        CHECK-NEXT: %2 = tg.add %1, %1
    """)
    assert sum(op.name == "tg.mul" for op in out.ops()) == 1


def test_canonicalize_flattens_concats_and_drops_default_attributes():
    text = """builtin.module {
  func.func @forward(%x: tensor<2x3xf32>, %y: tensor<2x1xf32>) -> (tensor<2x7xf32>, tensor<2xf32>) {
    %0 = tg.concat %x, %y {axis = 1 : i64} : tensor<2x4xf32>
    %1 = tg.concat %0, %x {axis = -1 : i64} : tensor<2x7xf32>
    %2 = tg.reduce_sum %x {axes = array<i64: 1>, keepdims = false} : tensor<2xf32>
    func.return %1, %2 : tensor<2x7xf32>, tensor<2xf32>
  }
}
"""
    after("canonicalize", Model.parse(text), """
        CHECK: tg.concat %x, %y, %x {axis = -1 : i64} : tensor<2x7xf32>
        CHECK: tg.reduce_sum %x {axes = array<i64: 1>} : tensor<2xf32>
    """)


# --- cse, dce -------------------------------------------------------------------


def test_cse_merges_equal_ops_weights_and_constants_but_not_different_attributes():
    g, (x,) = graph_with((3, 4))
    w = np.ones((4,), np.float32)
    a = g.exp(x) + g.weight("w", w)
    b = g.exp(x) + g.op("weight", name="w", result=TensorInfo((4,), "f32"))  # a second tg.weight "w"
    c, d = g.sum(x, axes=1), g.sum(x, axes=0)
    out = after("cse", g.build(a, b, c, d), """
        CHECK: %0 = tg.exp %x0
        CHECK-NEXT: %1 = tg.weight {name = "w"}
        CHECK-NEXT: %2 = tg.add %0, %1
        CHECK: tg.reduce_sum %x0 {axes = array<i64: 1>}
        CHECK: tg.reduce_sum %x0 {axes = array<i64: 0>}
        CHECK: func.return %2, %2
    """)
    assert sum(op.name == "tg.exp" for op in out.ops()) == 1


def test_dce_drops_dead_ops_and_weights_keeps_inputs_and_outputs():
    g, (x, unused) = graph_with((3,), (5,))
    g.exp(x * g.weight("dead.w", np.ones(3, np.float32)))  # dead on purpose
    y = x + g.weight("live.w", np.ones(3, np.float32))
    model = g.build(y, y, x)
    out = after("dce", model, """
        CHECK: func.func @forward(%x0: tensor<3xf32> {tg.name = "x0"}, %x1: tensor<5xf32> {tg.name = "x1"})
        CHECK-NOT: tg.exp
        CHECK: tg.weight {name = "live.w"}
        CHECK: func.return %1, %1, %x0
    """)
    assert set(out.weights) == {"live.w"} and set(model.weights) == {"dead.w", "live.w"}


# --- constant-fold ----------------------------------------------------------------


def test_constant_fold_turns_a_transposed_weight_into_a_new_weight():
    rng = np.random.default_rng(0)
    g, (x,) = graph_with(("B", 8))
    w = rng.standard_normal((6, 8)).astype(np.float32)
    model = g.build(x @ g.transpose(g.weight("fc.weight", w), (1, 0)))
    out = after("constant-fold", model, """
        CHECK: %0 = tg.weight {name = "fc.weight.transpose"} : tensor<8x6xf32>
        CHECK-NEXT: tg.matmul %x0, %0
        CHECK-NOT: tg.transpose
    """)
    assert list(out.weights) == ["fc.weight.transpose"]
    np.testing.assert_array_equal(out.weights["fc.weight.transpose"], w.T)
    assert out.weights["fc.weight.transpose"].flags.c_contiguous


def test_constant_fold_small_results_inline_in_the_model_dtype():
    g, (x,) = graph_with((3,), dtype="f16")
    c = g.constant(np.array([1.0, 2.0, 3.0], np.float16))
    folded = g.exp(c) * g.constant(np.array(0.1, np.float16))  # computed in f16, as at run time
    out = after("constant-fold", g.build(x + folded), """
        CHECK: %0 = tg.constant {value = dense<[{{.*}}]> : tensor<3xf16>} : tensor<3xf16>
        CHECK-NEXT: tg.add %x0, %0
    """)
    expected = np.exp(np.array([1, 2, 3], np.float16)) * np.float16(0.1)
    np.testing.assert_array_equal(out.ops()[0].attr("value"), expected)


def test_constant_fold_of_a_scalar_keeps_rank_zero():
    # Found by hypothesis: np.ascontiguousarray made a folded 0-d value 1-d.
    g, (x,) = graph_with(())
    after("constant-fold", g.build(x + (-g.weight("s", np.array(0.5, np.float32)))), """
        CHECK: tg.constant {value = dense<-5.000000e-01> : tensor<f32>} : tensor<f32>
    """)


def test_constant_fold_respects_max_elements_and_does_not_materialize_broadcasts():
    g, (x,) = graph_with((64, 64))
    w = g.weight("w", np.ones((64, 64), np.float32))
    big = g.broadcast(g.weight("b", np.ones((64,), np.float32)), (64, 64))
    model = g.build(x + g.exp(w) + big)
    after("constant-fold{max-elements=1000}", model, """
        CHECK: tg.broadcast
        CHECK: tg.exp
    """)
    out = after("constant-fold", model, """
        CHECK: tg.broadcast
        CHECK-NOT: tg.exp
        CHECK: tg.weight {name = "w.exp"}
    """)
    assert set(out.weights) == {"w.exp", "b"}


def test_constant_fold_folds_what_a_weight_only_attention_bias_expands_to_but_no_view_and_nothing_past_the_bound():
    """Swin's and MaxViT's relative-position biases gather a small table into a larger
    array, and Swin's shift mask is an outer difference, compared and selected: weights
    only, computed every call unless folded. Each is folded (its result is written every
    call anyway); a broadcast, a view, is still not materialized, nor a result past
    EXPANDING_FOLD_LIMIT."""
    from tilegraph.passes.constant_fold import EXPANDING_FOLD_LIMIT

    rng = np.random.default_rng(0)
    g, (x,) = graph_with((2, 49, 49))
    table = g.weight("table", rng.standard_normal((13, 2)).astype(np.float32))
    index = g.weight("index", rng.integers(0, 13, 49 * 49).astype(np.int64))
    bias = g.transpose(g.reshape(g.gather(table, index), (49, 49, 2)), (2, 0, 1))
    ids = g.weight("ids", rng.integers(0, 3, (49,)).astype(np.float32))
    diff = g.reshape(ids, (1, 49)) - g.reshape(ids, (49, 1))
    mask = g.where(g.op("ne", diff, g.constant(0.0, "f32")), g.constant(-100.0, "f32"), diff)
    wide = g.broadcast(g.weight("b", np.ones((49,), np.float32)), (49, 49))
    out = after("constant-fold", g.build(x + bias + mask + wide), """
        CHECK-NOT: tg.gather
        CHECK-NOT: tg.where
        CHECK: tg.broadcast
    """)
    assert sorted(out.weights) == ["b", "ids.reshape.sub.ne.where", "table.gather.reshape.transpose"]
    rows = EXPANDING_FOLD_LIMIT // 512 + 1  # one row past the bound
    g, (x,) = graph_with((rows, 512))
    big = g.gather(g.weight("t", np.ones((4, 512), np.float32)), g.weight("i", np.zeros(rows, np.int64)))
    after("constant-fold", g.build(x + big), "CHECK: tg.gather")


@pytest.mark.parametrize("first", [0, 5])
def test_constant_fold_drops_an_attention_mask_that_folding_shows_selects_nothing(first):
    """An encoder's attention mask built from its positions (ViT's, wav2vec2's: where(positions
    >= 0, 0, -max) broadcast over the scores) is known once the compare is folded: a condition
    all true selects the zero, and adding zero is nothing, so no mask is selected every call
    nor added to every head's scores. A condition that is not all true keeps its mask."""
    g, (x,) = graph_with((1, 2, 32, 32))
    positions = g.weight("positions", np.arange(32, dtype=np.int64).reshape(1, 1, 32, 1))
    keep = g.broadcast(g.op("ge", positions, g.constant(first, "i64")), (1, 1, 32, 32))
    mask = g.where(keep, g.constant(0.0, "f32"), g.constant(-3.4028234663852886e38, "f32"))
    checks = ("CHECK-NOT: tg.where\nCHECK-NOT: tg.add\nCHECK: tg.softmax %x0" if first == 0 else
              "CHECK: tg.where\nCHECK: tg.add %x0")
    after("constant-fold", g.build(g.softmax(x + mask)), checks)


def test_constant_fold_folds_a_batch_norm_into_the_convolution_before_it():
    rng = np.random.default_rng(0)
    g, (x,) = graph_with(("N", 3, 9, 7))
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, (5, 1, 1)).astype(np.float32)
    shift = rng.uniform(-1, 1, (5, 1, 1)).astype(np.float32)
    y = g.conv(x, g.weight("conv.weight", w), g.weight("conv.bias", rng.standard_normal(5).astype(np.float32)),
               pads=(1, 1, 1, 1))
    out = after("constant-fold", g.build(g.relu(y * g.constant(scale) + g.constant(shift))), """
        CHECK: tg.weight {name = "conv.weight.mul"} : tensor<5x3x3x3xf32>
        CHECK: tg.conv %x0
        CHECK-NOT: tg.mul
        CHECK-NOT: tg.add
        CHECK: tg.relu
    """)
    np.testing.assert_allclose(out.weights["conv.weight.mul"], w * scale[:, :, :, None], rtol=1e-6)


def test_constant_fold_folds_one_shift_for_every_channel_into_the_convolutions_bias():
    """A hardsigmoid after a convolution with a bias (MobileNetV3's squeeze-excitation gate:
    conv * (1/6) + 0.5, clamped) leaves one bias weight: the single shift, broadcast over the
    channels, is added to the bias here, not left as an add of the bias and a broadcast
    shift that ran every call."""
    rng = np.random.default_rng(0)
    g, (x,) = graph_with((1, 24, 1, 1))
    y = g.conv(x, g.weight("fc2.weight", rng.standard_normal((72, 24, 1, 1)).astype(np.float32)),
               g.weight("fc2.bias", rng.standard_normal(72).astype(np.float32)))
    out = after("constant-fold", g.build(y * g.constant(np.float32(1 / 6)) + g.constant(np.float32(0.5))), """
        CHECK-NOT: tg.add
        CHECK-NOT: tg.broadcast
        CHECK: tg.conv %x0
        CHECK-NOT: tg.mul
    """)
    assert len(out.weights) == 2


def test_constant_fold_folds_a_per_column_scale_into_a_linear_weight_and_no_other_scale():
    rng = np.random.default_rng(1)
    g, (x,) = graph_with(("B", 8))
    w = g.weight("fc.weight", rng.standard_normal((8, 6)).astype(np.float32))
    gamma = g.weight("gamma", rng.uniform(0.5, 1.5, 6).astype(np.float32))
    after("constant-fold", g.build((x @ w) * gamma), """
        CHECK: tg.weight {name = "fc.weight.mul"} : tensor<8x6xf32>
        CHECK: tg.matmul %x0
        CHECK-NOT: tg.mul
    """)
    # Not folded: a scale per row (it varies along the rows), a scale that is not finite
    # (inf * 0 where the weight is 0 would make a nan the model never computed), and a
    # product whose contraction has another user.
    weight = rng.standard_normal((8, 6)).astype(np.float32)

    def scaled(scale: np.ndarray, other_user: bool = False) -> Model:
        g, (x,) = graph_with((4, 8))
        y = x @ g.weight("fc.weight", weight)
        return g.build(y * g.constant(scale), *([g.relu(y)] if other_user else []))

    for model in (scaled(rng.uniform(0.5, 1.5, (4, 1)).astype(np.float32)),
                  scaled(np.array([1, 2, np.inf, 1, 1, 1], np.float32)),
                  scaled(np.full(6, 2, np.float32), other_user=True)):
        filecheck(run_pipeline(model, "constant-fold").text, """
            CHECK: tg.matmul %x0
            CHECK: tg.mul
        """)


def test_constant_fold_leaves_ops_on_inputs_and_ops_that_fail():
    g, (x,) = graph_with((3,))
    table = g.weight("table", np.ones((4, 2), np.float32))
    bad = g.gather(table, g.constant(np.array([7], np.int64)))  # out of range: the error is for run time
    filecheck(run_pipeline(g.build(g.exp(x), bad), "constant-fold").text, """
        CHECK: tg.gather
        CHECK: tg.exp %x0
    """)


# --- simplify-shapes ----------------------------------------------------------------


def test_simplify_shapes_bypasses_broadcasts_into_elementwise_ops():
    g, (x,) = graph_with(("B", 4))
    b = g.weight("bias", np.arange(4, dtype=np.float32))
    y = x + g.broadcast(b, ("B", 4))
    z = g.where(x > 0.0, g.broadcast(g.reshape(b, (1, 4)), ("B", 4)), x)
    after("simplify-shapes", g.build(y, z), """
        CHECK: %0 = tg.weight {name = "bias"}
        CHECK-NEXT: tg.add %x0, %0 : tensor<?x4xf32, ["B"]>
        CHECK-NOT: tg.broadcast
        CHECK: tg.where %{{[0-9]+}}, %{{[0-9]+}}, %x0
        CHECK-NOT: tg.broadcast
    """)


def test_simplify_shapes_keeps_a_broadcast_that_makes_the_result_shape():
    g, (x,) = graph_with((4,))
    after("simplify-shapes", g.build(x + g.broadcast(g.weight("b", np.ones((4,), np.float32)), (3, 4))), """
        CHECK: tg.broadcast %0 : tensor<3x4xf32>
        CHECK: tg.add
    """)


def test_simplify_shapes_bypasses_the_broadcast_that_can_go_when_the_other_cannot():
    # Each operand is tried alone: dropping the (4,) -> (3, 4) broadcast keeps the add's type, dropping
    # the (1,) one as well would make it (4,). One broadcast goes, the one that makes the shape stays.
    g, (a, b) = graph_with((4,), (1,))
    after("simplify-shapes", g.build(g.broadcast(a, (3, 4)) + g.broadcast(b, (3, 4))), """
        CHECK: %0 = tg.broadcast %x1 : tensor<3x4xf32>
        CHECK-NEXT: tg.add %x0, %0 : tensor<3x4xf32>
        CHECK-NOT: tg.broadcast
    """)


def test_simplify_shapes_turns_data_free_layout_ops_into_reshapes():
    g, (x,) = graph_with((3, 1, 4))
    t = g.transpose(x, (1, 0, 2))  # moves only the unit dim
    moved = g.transpose(x, (2, 1, 0))  # really moves data
    b = g.broadcast(g.reshape(x, (12,)), (1, 12))
    after("simplify-shapes", g.build(t, moved, b), """
        CHECK: tg.reshape %x0 : tensor<1x3x4xf32>
        CHECK: tg.transpose %x0 {perm = array<i64: 2, 1, 0>}
        CHECK: tg.reshape %x0 : tensor<1x12xf32>
        CHECK-NOT: tg.broadcast
    """)


def test_simplify_shapes_respells_symbolic_dims():
    text = """builtin.module {
  func.func @forward(%x: tensor<?x4xf32, ["B*4/4"]> {tg.name = "x"}) -> (tensor<?xf32, ["(B + B)*2"]> {tg.name = "y"}) {
    %0 = tg.reshape %x : tensor<?xf32, ["4*B"]>
    %1 = tg.exp %0 : tensor<?xf32, ["(B + B)*2"]>
    func.return %1 : tensor<?xf32, ["(B + B)*2"]>
  }
}
"""
    model = Model.parse(text)
    model.verify()
    after("simplify-shapes", model, """
        CHECK: func.func @forward(%x: tensor<?x4xf32, ["B"]> {tg.name = "x"}) -> (tensor<?xf32, ["4*B"]> {tg.name = "y"})
        CHECK: tg.exp %0 : tensor<?xf32, ["4*B"]>
    """)


# --- decompose --------------------------------------------------------------------------

COMPOSITES = {name for name, spec in OPS.items() if spec.category == "composite"}


def composite_ops(model: Model) -> set[str]:
    return {op.name.removeprefix("tg.") for op in model.ops()} & COMPOSITES


def test_decompose_leaves_no_composite_ops():
    rng = np.random.default_rng(1)
    g, (x, q) = graph_with(("B", 5, 8), ("B", 2, 5, 8))
    w = lambda *s: g.weight(f"w{rng.integers(1 << 30)}", rng.uniform(-1, 1, s).astype(np.float32))  # noqa: E731
    h = g.layer_norm(x, w(8), w(8), epsilon=1e-5)
    h = g.gelu(h) + g.gelu(h, approximate="tanh") + g.softmax(h, axis=1)
    bool_mask = g.weight("keep", rng.random((5, 5)) < 0.8)
    a1 = g.attention(q, w(1, 2, 6, 8), w(1, 2, 6, 3), causal=True)
    a2 = g.attention(q, q, q, bool_mask, scale=0.25)
    a3 = g.attention(q, q, q, w(1, 5, 5), scale=0.5, causal=True)
    model = g.build(h, a1, a2, a3)
    assert composite_ops(model) == {"layer_norm", "gelu", "softmax", "attention"}
    out = after("decompose", model, """
        CHECK: tg.reduce_mean
        CHECK: tg.sqrt
        CHECK: tg.erf
        CHECK: tg.tanh
        CHECK: tg.reduce_max
        CHECK: tg.trilu %{{[0-9]+}} {k = 1 : i64, upper = false} : tensor<5x6xi1>
        CHECK: tg.constant {value = dense<"0x000080FF"> : tensor<f32>}
        CHECK: tg.transpose %x1 {perm = array<i64: 0, 1, 3, 2>}
    """)
    assert composite_ops(out) == set()
    # Same order of operations as ir.kernels: the f32 run matches the composite op's f32 run closely.
    xs = random_inputs(model, seed=3)
    for a, b in zip(interpret(out, xs, float64=False), interpret(model, xs, float64=False)):
        assert_close(a, b, "f32", 16)


def test_decompose_spells_out_a_causal_band_whose_offset_is_symbolic():
    # Lk - Lq = T - S is known only at run time: the band comes from indices counted then.
    g, (q, k, v) = graph_with(("S", 8), ("T", 8), ("T", 3))
    model = g.build(g.attention(q, k, v, causal=True))
    out = after("decompose", model, """
        CHECK: tg.cumsum %{{[0-9]+}} {axis = 1 : i64, exclusive = true, reverse = true} : tensor<1x?xi64, ["T"]>
        CHECK: tg.cumsum %{{[0-9]+}} {axis = 0 : i64, exclusive = true, reverse = true} : tensor<?x1xi64, ["S"]>
        CHECK: tg.ge
    """)
    assert composite_ops(out) == set()
    for sizes in ({"S": 2, "T": 5}, {"S": 5, "T": 5}):
        xs = random_inputs(model, seed=0, sizes=sizes)
        # in f32, as above: the decomposition's scale constant is rounded to the model's dtype
        assert_close(interpret(out, xs, float64=False)[0], interpret(model, xs, float64=False)[0], "f32", 8)


def test_decompose_can_be_restricted_and_rejects_unknown_ops():
    g, (x,) = graph_with((2, 3))
    out = after("decompose{ops=softmax}", g.build(g.gelu(g.softmax(x))), """
        CHECK: tg.exp
        CHECK: tg.gelu
    """)
    assert composite_ops(out) == {"gelu"}
    with pytest.raises(TilegraphError, match="no decomposition for conv.*softmax, layer_norm, gelu, attention"):
        parse_pipeline("decompose{ops=conv}")


# --- registry and pipelines ---------------------------------------------------------------


def test_every_registered_pass_has_its_name_and_default_options():
    for name in PASSES:
        cls = get_pass_class(name)
        assert issubclass(cls, ModulePass) and cls.name == name
        assert cls() == parse_pipeline(name)[0]
    assert [p.name for p in parse_pipeline(DEFAULT_PIPELINE)] == DEFAULT_PIPELINE.split(",")


def test_pipeline_options_parse_into_pass_fields():
    fold, dec = parse_pipeline("constant-fold{max-elements=1000},decompose{ops=softmax,gelu}")
    assert fold.max_elements == 1000 and dec.ops == ("softmax", "gelu")


@pytest.mark.parametrize("text, message", [
    ("canonicalise", r"unknown pass 'canonicalise' in 'canonicalise'; the passes are: attention, canonicalize, "
                     r"constant-fold, cse, dce, decompose, fuse, quantize, recompute, shard, simplify-shapes, tile"),
    ("cse,fuze,tiles", r"unknown passes 'fuze', 'tiles'"),
    ("fuse{hardware=tpu}", r"pass 'fuse': unknown hardware target 'tpu': choose one of h100, h200, a100, cpu"),
    ("fuse{max-ops=0}", r"pass 'fuse': max-ops must be at least 1, got 0"),
    ("tile{max-rows=-3}", r"pass 'tile': max-rows must be 0 \(no limit\) or more, got -3"),
    ("constant-fold{max-elements=many}", r"pass 'constant-fold': .*its options: max-elements"),
    ("cse{aggressive=true}", r"pass 'cse': .*aggressive"),
    ("cse{", r"cannot read the pipeline 'cse\{'"),
])
def test_bad_pipelines_are_reported_by_name(text, message):
    with pytest.raises(PipelineError, match=message):
        parse_pipeline(text)
    assert issubclass(PipelineError, TilegraphError)


def test_registry_imports_passes_lazily():
    code = ("import sys, tilegraph.passes.registry as r; assert 'tilegraph.passes.decompose' not in sys.modules; "
            "r.PASSES['decompose'](); assert 'tilegraph.passes.decompose' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


def test_run_pipeline_copies_the_model_and_drops_unreferenced_weights():
    g, (x,) = graph_with((3,))
    model = g.build(x + g.transpose(g.weight("w", np.ones((1, 3), np.float32)), (0, 1)) * 1.0)
    text, weights = model.text, dict(model.weights)
    out = run_pipeline(model, DEFAULT_PIPELINE)
    assert model.text == text and model.weights.keys() == weights.keys()
    assert out.module is not model.module and set(out.weights) <= {"w"}


def test_run_pipeline_names_the_pass_that_broke_the_ir():
    @dataclass(frozen=True)
    class Vandal(ModulePass):
        name = "vandal"

        def apply(self, ctx, op) -> None:
            from xdsl.dialects.builtin import TensorType, f32

            for o in op.walk():
                if o.name == "tg.exp":
                    from xdsl.rewriter import Rewriter

                    Rewriter.replace_value_with_new_type(o.results[0], TensorType(f32, [7]))

    g, (x,) = graph_with((3,))
    with pytest.raises(ModelError, match="after pass 'vandal' does not verify: .*tg.exp"):
        run_pipeline(g.build(g.exp(x) + 1.0), [Vandal()])


def test_assert_preserves_semantics_names_the_pipeline_and_shows_the_ir():
    @dataclass(frozen=True)
    class ExpToTanh(ModulePass):
        """A wrong pass: replaces exp by tanh."""

        name = "exp-to-tanh"

        def apply(self, ctx, op) -> None:
            from tilegraph.passes.rewrite import Rule, run_rules

            run_rules(op, [Rule(("exp",), lambda o, emit: emit("tanh", o.operands[0]))])

    g, (x,) = graph_with((3,))
    with pytest.raises(AssertionError) as e:
        assert_preserves_semantics([ExpToTanh()], g.build(g.exp(x)))
    message = str(e.value)
    assert "pipeline 'exp-to-tanh' does not preserve semantics" in message
    assert "--- IR before ---" in message and "tg.exp %x0" in message
    assert "--- IR after 'exp-to-tanh' ---" in message and "tg.tanh %x0" in message


# --- a real model -----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_default_pipeline_and_decompose_keep_minilm_within_tolerance():
    """all-MiniLM-L6-v2 through torch.export, symbolic batch and sequence: the passes keep it exact
    within the f32 tolerance at another (batch, seq) than the one it was exported with."""
    torch = pytest.importorskip("torch")
    from tilegraph.frontends.torch_export import from_torch
    from tests.models import minilm_inputs, minilm_model

    ids, mask = minilm_inputs(2, 16)
    b, s = torch.export.Dim("B"), torch.export.Dim("S", max=512)
    model = from_torch(minilm_model(), (ids, mask), dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}))
    ids, mask = minilm_inputs(3, 7, seed=1)
    inputs = [ids.numpy(), mask.numpy()]
    optimized = assert_preserves_semantics(DEFAULT_PIPELINE, model, inputs)
    # Folding transposed weights, merging equal masks, dropping identity reshapes: fewer ops.
    assert len(optimized.ops()) < len(model.ops())
    assert not any(op.name == "tg.transpose" and op.operands[0].owner.name == "tg.weight" for op in optimized.ops())
    decomposed = assert_preserves_semantics("decompose," + DEFAULT_PIPELINE, model, inputs)
    assert composite_ops(decomposed) == set()


# --- attention: matmul-softmax-matmul chains folded into tg.attention ----------


def _spelled_out_attention(scale_op: str = "mul", mask: bool = True, extra_use: bool = False):
    rng = np.random.default_rng(3)
    g = Graph()
    q = g.input("q", ("B", 2, 6, 8))
    k = g.input("k", ("B", 2, 10, 8))
    v = g.input("v", ("B", 2, 10, 4))
    outs = []
    scores = q @ k.transpose(0, 1, 3, 2)
    scaled = scores * 0.35 if scale_op == "mul" else scores / 2.5
    if mask:
        scaled = scaled + g.weight("mask", np.where(rng.random((10,)) < 0.3, -1e9, 0.0).astype(np.float32))
    probs = g.softmax(scaled, -1)
    outs.append(probs @ v)
    if extra_use:
        outs.append(probs)
    model = g.build(*outs, names=[f"y{i}" for i in range(len(outs))])
    inputs = [rng.standard_normal((3, 2, n, d)).astype(np.float32) for n, d in ((6, 8), (10, 8), (10, 4))]
    return model, inputs


@pytest.mark.parametrize("scale_op, mask", [("mul", True), ("div", False)])
def test_attention_folds_spelled_out_attention(scale_op, mask):
    model, inputs = _spelled_out_attention(scale_op, mask)
    out = assert_preserves_semantics("attention", model, inputs)
    names = [op.name for op in out.module.walk()]
    assert names.count("tg.attention") == 1 and "tg.softmax" not in names


def test_attention_leaves_scores_that_are_used_elsewhere():
    model, inputs = _spelled_out_attention(extra_use=True)
    out = run_pipeline(model, "attention")
    assert [op.name for op in out.module.walk()].count("tg.attention") == 0
