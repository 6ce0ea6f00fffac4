"""Properties of every pass on random graphs (hypothesis, `tilegraph.testing.graphs`).

- printed IR round-trips exactly: print -> parse -> print gives the same text;
- every pass in `passes.registry.PASSES` preserves semantics against the float64
  interpreter (a newly registered pass is covered without touching this file), a
  lossy one (quantize) within its stated bound, and what it prints still round-trips;
- so do the default pipeline, and decompose followed by it;
- the emitted NumPy (`tilegraph.compile`) computes what the interpreter computes.

A case hypothesis once found is kept below as an `@example`, so it runs every time.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tilegraph.ir import Graph, Model, interpret
from tilegraph.ir.interpreter import bind_inputs
from tilegraph.passes.registry import DEFAULT_PIPELINE, PASSES, UNFUSED_PIPELINE, get_pass_class, run_pipeline
from tilegraph.testing import (
    LAYOUT_OPS,
    assert_close,
    assert_preserves_semantics,
    assert_within_quantization_bound,
    graphs,
    narrowest_float,
    random_inputs,
    reduction_length,
)

# ~15 ms per example: 60 examples per property keep this file well under a minute.
EXAMPLES = 60
PROPERTY = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def folded_scalar() -> Model:
    """Found by hypothesis: constant-fold turned a rank-0 result into a 1-element vector
    (np.ascontiguousarray returns at least 1-d)."""
    g = Graph()
    x = g.input("x", ())
    return g.build(x * -g.weight("w", np.array(0.27, np.float32)))


def negated_conv_chunks() -> Model:
    """Found by hypothesis: a conv's epilogue cut along axis 2 of [1, 2, 4, 1] negates
    views whose stride NumPy 2.1-2.4's SIMD negative reads wrongly (ir/kernels.negative)."""
    g = Graph()
    x = g.input("x", (1, 2, 4, 1))
    w = g.weight("w", np.linspace(-1, 1, 4, dtype=np.float32).reshape(2, 2, 1, 1))
    b = g.weight("b", np.array([0.5, -0.25], np.float32))
    y = g.op("conv", x, w, b, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1))
    return g.build(-g.op("abs", y))


def unit_axis_dropped() -> Model:
    """Found by hypothesis: a flat group whose only result lost the widest value's unit
    axis ([1, 2, 4, 1] -> [2, 4, 1]) had no buffer to count its rows on."""
    g = Graph()
    x = g.input("x", (1, 2, 4, 1))
    y = (-x).reshape(2, 4, 1)
    return g.build(-y - y)


def identity_chain() -> Model:
    """0 - x, x ** 1 and a one-piece concat of a symbolic tensor, returned next to its input."""
    g = Graph()
    x = g.input("x", ("B", 3))
    y = g.concat([0.0 - x ** 1.0], axis=0)
    return g.build(y, x, y)


@PROPERTY
@given(model=graphs())
@example(model=folded_scalar())
def test_printed_ir_round_trips_exactly(model):
    text = model.text
    again = Model.parse(text, model.weights)
    again.verify()
    assert again.text == text


@pytest.mark.parametrize("pass_name", sorted(PASSES))
@PROPERTY
@given(model=graphs())
@example(model=folded_scalar())
@example(model=identity_chain())
def test_every_registered_pass_preserves_semantics(pass_name, model):
    """... or, for a lossy pass (quantize), keeps its stated error bound."""
    if getattr(get_pass_class(pass_name), "LOSSY", False):
        after = assert_within_quantization_bound(pass_name, model)
    else:
        after = assert_preserves_semantics(pass_name, model)
    assert Model.parse(after.text, after.weights).text == after.text


@pytest.mark.parametrize("pass_name", sorted(PASSES))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=graphs())
def test_every_registered_pass_decides_alike_on_every_copy(pass_name, model):
    """A pass's output depends on the module, never on where in memory its ops lie (the order
    of a set of ops or groups): `fuse` once grouped two clones of one step differently, and a
    pass pricing its own result (recompute) disagreed with itself."""
    assert run_pipeline(model, pass_name).text == run_pipeline(model.clone(), pass_name).text


@PROPERTY
@given(model=graphs(ops=("identity", "neg", "abs", "relu", "add", "sub", "mul", "where", "cast", "exp")
                    + LAYOUT_OPS, max_ops=16))
@example(model=identity_chain())
def test_canonicalize_preserves_semantics_on_rewrite_heavy_graphs(model):
    assert_preserves_semantics("canonicalize,cse,dce", model)


@PROPERTY
@given(model=graphs())
def test_the_default_pipeline_preserves_semantics(model):
    assert_preserves_semantics(DEFAULT_PIPELINE, model)


@PROPERTY
@given(model=graphs())
def test_decompose_then_the_default_pipeline_preserves_semantics(model):
    after = assert_preserves_semantics("decompose," + DEFAULT_PIPELINE, model)
    assert not {"softmax", "layer_norm", "gelu", "attention"} & {op.name.removeprefix("tg.") for op in after.func.walk()}


@PROPERTY
@given(model=graphs(dtype="f16", max_ops=8))
def test_the_default_pipeline_preserves_semantics_in_f16(model):
    assert_preserves_semantics(DEFAULT_PIPELINE, model)


# Fused groups cut into chunks of 1 and of 3 rows, or of columns, or with their GEMM
# whole on BLAS's threads, where a group allows them: every chunk boundary, partial last chunks and chunks on the thread pool, which
# the small random shapes would not reach with the tile sizes the cost model picks.
MANY_CHUNKS = [UNFUSED_PIPELINE + ",fuse,tile{max-rows=1}", UNFUSED_PIPELINE + ",fuse,tile{max-rows=3}",
               UNFUSED_PIPELINE + ",fuse,tile{max-cols=1}", UNFUSED_PIPELINE + ",fuse,tile{max-cols=3}",
               UNFUSED_PIPELINE + ",fuse,tile{blas-gemm=true max-rows=3}"]


@pytest.mark.parametrize("pipeline", ["", DEFAULT_PIPELINE, *MANY_CHUNKS])
@PROPERTY
@given(model=graphs())
@example(model=folded_scalar())
@example(model=negated_conv_chunks())
@example(model=unit_axis_dropped())
def test_emitted_numpy_computes_what_the_interpreter_computes(pipeline, model):
    import tilegraph

    # target named: compile's default is the C backend where it builds (its random graphs are
    # tests/test_c_backend.py's), and the chunk loops of MANY_CHUNKS are the NumPy backend's.
    compiled = tilegraph.compile(model, target="numpy", pipeline=pipeline)
    inputs = random_inputs(model, seed=1)
    got = compiled(*inputs)
    got = list(got) if isinstance(got, tuple) else [got]
    expected = interpret(model, inputs)
    _, sizes = bind_inputs(model, inputs)
    n = reduction_length(model, sizes)
    dtype = narrowest_float(model)
    assert len(got) == len(expected)
    for name, a, e in zip(model.output_names, got, expected):
        assert_close(np.asarray(a), e, dtype, n, name=f"output '{name}' of the NumPy backend, pipeline '{pipeline}'")


@st.composite
def regrouped_rows(draw):
    """An elementwise op with an operand broadcast along some leading axes (its rows 'partial'), a
    reshape that regroups the rows (the last axis kept, or merged too), then more elementwise ops:
    what `fuse` may run as one flat loop only when every input spans the rows or only the last axis.
    graphs() rarely draws this chain; fault seeding (benchmarks/fault_seeding.py) showed that guard
    unchecked. The scale is a weight named 's', as the chunk loop's slice is."""
    from tilegraph.ir import Graph

    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=3, max_size=4)))
    g = Graph()
    x = g.input("x", shape)
    keep = draw(st.lists(st.booleans(), min_size=len(shape) - 1, max_size=len(shape) - 1))
    partial = tuple(d if k else 1 for d, k in zip(shape[:-1], keep)) + (shape[-1] if draw(st.booleans()) else 1,)
    p = g.input("p", partial[draw(st.integers(0, len(shape) - 2)):])
    y = g.op(draw(st.sampled_from(["add", "mul", "sub"])), x, p)
    y = g.op(draw(st.sampled_from(["relu", "neg", "exp"])), y)
    lead = int(np.prod(shape[:-1]))
    regroup = draw(st.sampled_from([(lead, shape[-1]), (shape[0], lead // shape[0] * shape[-1]), (-1,)]))
    y = g.reshape(y, regroup)
    y = g.op(draw(st.sampled_from(["abs", "neg", "relu"])), y) * g.weight("s", np.float32(0.5))
    return g.build(y) if draw(st.booleans()) else g.build(y, x)


def weight_named_s() -> Model:
    """Found by hypothesis (regrouped_rows): a chunked group's parameter named `s` (the weight 's')
    was read as the chunk's slice, `np.multiply(t1, s, ...)` on a slice object."""
    g = Graph()
    x, p = g.input("x", (2, 3, 4)), g.input("p", (3, 1))
    y = g.reshape(g.op("relu", x + p), (6, 4))
    return g.build(-y * g.weight("s", np.float32(0.5)))


# The NumPy backend runs a fused group as `fuse` and `tile` made it (one flat loop over regrouped
# rows, or chunks): fault seeding's fault 24 (fuse's regrouped-rows guard dropped) escaped while
# this test ran on compile's default target only. The C backend plans its own loops and ignores
# tile's chunk sizes: the default pipeline covers it.
@pytest.mark.parametrize("target,pipeline", [("numpy", p) for p in [DEFAULT_PIPELINE, *MANY_CHUNKS]]
                         + [("c", DEFAULT_PIPELINE)])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=regrouped_rows())
@example(model=weight_named_s())
def test_fused_groups_with_regrouped_rows_compute_what_the_interpreter_computes(target, pipeline, model):
    import tilegraph

    inputs = random_inputs(model, seed=1)
    got = tilegraph.compile(model, target=target, pipeline=pipeline)(*inputs)
    got = list(got) if isinstance(got, tuple) else [got]
    for name, a, e in zip(model.output_names, got, interpret(model, inputs)):
        assert_close(np.asarray(a), e, "f32", 1, name=f"output '{name}', target {target}, pipeline '{pipeline}'")
