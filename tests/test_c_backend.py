"""The native C backend (target "c") computes what the float64 interpreter computes.

What holds: every op of the table, on its examples, agrees with the interpreter
(lowered in C or run by the stated host fallback); random graphs agree, unfused and
after the default pipeline, symbolic dims included (one compiled module serves
every binding); real models match torch; a wrong call is a TilegraphError before any
C runs.
"""

from __future__ import annotations

import math
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegraph
from tilegraph.backends.c import HOST_FALLBACK, compile_model
from tilegraph.ir import interpret
from tilegraph.ir.dtypes import numpy_dtype
from tilegraph.ir.interpreter import bind_inputs
from tilegraph.ir.ops import OPS
from tilegraph.passes.registry import DEFAULT_PIPELINE
from tilegraph.testing import (assert_close, graphs, narrowest_float, op_examples, random_inputs,
                               reduction_length)

EXAMPLES = op_examples()
PARTLY_NATIVE = {op for op, why in HOST_FALLBACK.items() if why.startswith(("C ", "oneDNN "))}
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("op", sorted(OPS))
def test_op_agrees_with_the_float64_interpreter(op):
    native = False
    for ex in EXAMPLES[op]:
        compiled = compile_model(ex.model)
        native |= all(kind == "segment" for kind, _ in compiled.program.plan)
        got = compiled(*ex.inputs)
        want = interpret(ex.model, list(ex.inputs))
        assert len(got) == len(want)
        for name, info, a, e in zip(ex.model.output_names, ex.model.outputs, got, want):
            assert a.dtype == numpy_dtype(info.dtype), f"{ex.id}: {name} is {a.dtype}, declared {info.dtype}"
            assert_close(a, e, info.dtype, ex.reduction_length, name=f"{ex.id}: {name}")
    # An op the backend claims to lower, wholly or in some cases, runs natively on at
    # least one of its examples.
    assert native or op in HOST_FALLBACK and op not in PARTLY_NATIVE or op in ("weight", "constant"), \
        f"tg.{op} never ran in C"


def test_the_lowering_table_is_the_dispatch():
    """An op the C lowering table calls partly native has a registered lowering, one it
    sends wholly to the host has none, and every other op of the table has one."""
    from tilegraph.backends.c.emit import VIEW_LOWERINGS
    from tilegraph.backends.c.views import LOWER

    for op in OPS:
        lowered = op in LOWER or op in VIEW_LOWERINGS
        assert lowered == (op not in HOST_FALLBACK or op in PARTLY_NATIVE), op


@settings(max_examples=25, deadline=None)
@given(lq=st.integers(1, 70), lk=st.integers(1, 140), d=st.sampled_from([1, 8, 33]), heads=st.integers(1, 3),
       causal=st.booleans(), mask=st.sampled_from(["none", "bool", "float"]))
def test_flash_attention_matches_the_interpreter_at_odd_sizes(lq, lk, d, heads, causal, mask):
    """Query and key counts that leave partial blocks, causal with lq != lk, masks that
    broadcast over heads and rows; a row with every key masked is NaN in both."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(lq * 1000 + lk)
    g = Graph()
    q, k, v = g.input("q", (2, heads, lq, d)), g.input("k", (2, heads, lk, d)), g.input("v", (2, heads, lk, 5))
    inputs = [rng.standard_normal(s).astype(np.float32) for s in ((2, heads, lq, d), (2, heads, lk, d),
                                                                    (2, heads, lk, 5))]
    if mask == "none":
        y = g.attention(q, k, v, causal=causal)
    else:
        m = g.input("m", (2, 1, 1, lk), "i1" if mask == "bool" else "f32")
        y = g.attention(q, k, v, m, causal=causal)
        inputs.append(rng.random((2, 1, 1, lk)) < 0.8 if mask == "bool" else
                      rng.standard_normal((2, 1, 1, lk)).astype(np.float32))
    model = g.build(y, names=["y"])
    compiled = compile_model(model)
    assert all(kind == "segment" for kind, _ in compiled.program.plan)
    got, want = compiled(*inputs)[0], interpret(model, inputs)[0]
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert_close(np.nan_to_num(got), np.nan_to_num(want), "f32", reduction_length=lk + d)


def _check(model, pipeline):
    compiled = tilegraph.compile(model, target="c", pipeline=pipeline)
    for seed in (1, 2):
        inputs = random_inputs(model, seed=seed)
        got = compiled.run(*inputs)
        expected = interpret(model, inputs)
        _, sizes = bind_inputs(model, inputs)
        n = reduction_length(model, sizes)
        for name, a, e in zip(model.output_names, got, expected):
            assert_close(np.asarray(a), e, narrowest_float(model), n, name=f"output '{name}', pipeline '{pipeline}'")


@pytest.mark.parametrize("pipeline", ["", DEFAULT_PIPELINE])
@PROPERTY
@given(model=graphs())
def test_random_graphs_agree_with_the_interpreter(pipeline, model):
    _check(model, pipeline)


def test_a_gemm_epilogue_of_a_scale_then_a_mask_then_softmax_matches():
    """Attention scores as MiniLM computes them: (q @ k^T) * c + mask, softmax. oneDNN
    runs the scale and the mask add as post-ops; the mask is the second post-op but the
    first with an operand (MiniLM came out wrong when its pointer was looked up by
    post-op position)."""
    from tilegraph.ir import Graph

    g = Graph()
    q = g.transpose(g.input("q", ("B", 16, 4, 8)), (0, 2, 1, 3))
    k = g.transpose(g.input("k", ("B", 16, 4, 8)), (0, 2, 3, 1))
    mask = g.input("mask", ("B", 1, 1, 16))
    model = g.build(g.softmax(q @ k * g.constant(np.float32(0.35)) + mask), names=["p"])
    compiled = tilegraph.compile(model, target="c")
    assert "dnnl_eltwise_linear" in compiled.source
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((2, 16, 4, 8)).astype(np.float32) for _ in range(2)]
    inputs.append(np.where(rng.random((2, 1, 1, 16)) < 0.3, np.float32(-1e30), np.float32(0)))
    assert_close(compiled(*inputs), interpret(model, inputs)[0], "f32", reduction_length=16)


def test_a_row_op_never_overwrites_a_value_its_group_also_yields():
    """GPT-2's residual stream: h = x @ W + b + r feeds the next layer and layer_norm(h).
    The C backend normalises in place only where layer_norm is h's one reader (it once
    normalised the residual itself)."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    x, r = g.input("x", ("S", 16)), g.input("r", ("S", 16))
    h = x @ g.weight("w", rng.standard_normal((16, 16)).astype(np.float32)) + \
        g.weight("b", rng.standard_normal(16).astype(np.float32)) + r
    model = g.build(h, g.layer_norm(h, epsilon=1e-5), g.softmax(h), names=["h", "ln", "p"])
    compiled = tilegraph.compile(model, target="c")
    inputs = [rng.standard_normal((8, 16)).astype(np.float32) for _ in range(2)]
    for got, want, name in zip(compiled.run(*inputs), interpret(model, inputs), model.output_names):
        assert_close(got, want, "f32", reduction_length=16, name=name)


def test_two_models_of_one_source_keep_their_own_packed_weights():
    """Models that differ only in their weights emit the same C source and share one
    library; each packs its own weights (they were once packed per library, and the
    second model multiplied by the first one's weights)."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    for seed in (1, 2):
        g = Graph()
        w = np.random.default_rng(seed).standard_normal((32, 64)).astype(np.float32)
        model = g.build(g.input("x", ("B", 32)) @ g.weight("w", w), names=["y"])
        assert_close(tilegraph.compile(model, target="c")(x), interpret(model, [x])[0], "f32", reduction_length=32)


def test_a_reduction_over_no_axes_reduces_nothing():
    """np.sum(x, axis=()) is x: the C loop once took an empty axes list for all of them
    (found by the random-graph property above)."""
    from tilegraph.ir import Graph

    g = Graph()
    x = g.input("x", (1, 1, 1, 2))
    model = g.build(g.op("reduce_sum", x, axes=(), keepdims=False), names=["y"])
    xs = np.array([[[[-0.5, 2.0]]]], np.float32)
    np.testing.assert_array_equal(compile_model(model)(xs)[0], interpret(model, [xs])[0])


def test_a_module_emitted_under_a_name_loads():
    """load() takes the program emit() made (with its name in the header), not a re-emission
    under the default name, which would not match the source it is given."""
    from tilegraph.backends.c import emit, load
    from tilegraph.ir import Graph

    g = Graph()
    model = g.build(g.relu(g.input("x", ("B", 4))), names=["y"])
    source = emit(model, name="my_model")
    assert "my_model" in source
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(load(source, model.weights, model)(x)[0], np.maximum(x, 0))


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(m=st.integers(1, 40), k=st.integers(1, 300), n=st.integers(1, 70), batch=st.sampled_from([(), (2,)]),
       scheme=st.sampled_from(["w8a8", "w8a8 calibrated symmetric", "w8a8 calibrated", "w8", "fp8", "mxfp4"]),
       seed=st.integers(0, 2**16))
def test_a_quantized_linear_layer_matches_the_interpreter(m, k, n, batch, scheme, seed, tmp_path_factory):
    """Quantized layers run in C where they can (w8a8: int8 rows, oneDNN's int8 GEMM with the
    weight scales folded in) and agree with the interpreter at sizes no kernel block divides.
    One layer, so its input quantizes identically in both (see test_quantize.py)."""
    from tilegraph.ir import Graph
    from tilegraph.passes.quantize import observe_ranges, save_ranges
    from tilegraph.passes.registry import run_pipeline

    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", ("B", *batch, k))
    model = g.build(x @ g.weight("w", rng.standard_normal((k, n)).astype(np.float32)), names=["y"])
    xs = rng.standard_normal((m, *batch, k)).astype(np.float32)
    spec = "quantize{scheme=%s}" % scheme.split()[0]
    if "calibrated" in scheme:
        path = save_ranges(tmp_path_factory.mktemp("calib") / "c.npz", observe_ranges(model, [[xs]]))
        spec = f'quantize{{scheme=w8a8 calib="{path}" symmetric={str("symmetric" in scheme).lower()}}}'
    q = run_pipeline(model, spec + "," + DEFAULT_PIPELINE)
    compiled = compile_model(q)
    if scheme in ("w8a8", "w8a8 calibrated symmetric"):
        assert all(kind == "segment" for kind, _ in compiled.program.plan), scheme
    assert_close(compiled(xs)[0], interpret(q, [xs])[0], "f32", k, name=scheme)


@pytest.mark.parametrize("contraction", ["matmul", "conv"])
def test_an_epilogue_that_reads_the_raw_product_again_matches(contraction):
    """silu(x @ w) = p * sigmoid(p): the sigmoid may not run as oneDNN's post-op in place,
    since the mul reads p itself (found by the ONNX conformance cases on this backend)."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    if contraction == "matmul":
        x = g.input("x", ("B", 12))
        p = x @ g.weight("w", rng.standard_normal((12, 5)).astype(np.float32))
        xs = rng.standard_normal((3, 12)).astype(np.float32)
    else:
        x = g.input("x", ("B", 3, 9))
        p = g.op("conv", x, g.weight("w", rng.standard_normal((4, 3, 2)).astype(np.float32)))
        xs = rng.standard_normal((2, 3, 9)).astype(np.float32)
    model = g.build(g.op("mul", p, g.op("sigmoid", p)), names=["y"])
    q = tilegraph.compile(model, target="c")
    assert_close(q(xs), interpret(model, [xs])[0], "f32", 12, name=contraction)


@pytest.mark.parametrize("c", ["scalar", "row"])
@pytest.mark.parametrize("side", ["product - c", "c - product"])
def test_a_subtraction_after_a_gemm_keeps_its_sign(side, c):
    """x @ w - c runs as the GEMM's oneDNN post-op (a linear one for a scalar, a binary one for
    a row); c - x @ w is no such post-op: either way the difference keeps its sign."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", ("B", 12))
    p = x @ g.weight("w", rng.standard_normal((12, 5)).astype(np.float32))
    cv = g.constant(np.float32(0.75)) if c == "scalar" else g.weight("b", rng.standard_normal(5).astype(np.float32))
    model = g.build(g.op("sub", p, cv) if side == "product - c" else g.op("sub", cv, p), names=["y"])
    xs = rng.standard_normal((3, 12)).astype(np.float32)
    assert_close(tilegraph.compile(model, target="c")(xs), interpret(model, [xs])[0], "f32", 12, name=side)


def test_the_vectorised_erf_holds_the_float32_tolerance_everywhere():
    """tg_erff (a rational approximation, not libm) across magnitudes, signed zeros, the
    saturated tails, infinities and NaN."""
    from tilegraph.ir import Graph

    g = Graph()
    model = g.build(g.op("erf", g.input("x", ("N",))), names=["y"])
    x = np.concatenate([np.linspace(-6, 6, 4001), np.geomspace(1e-38, 1.0, 400), -np.geomspace(1e-38, 1.0, 400),
                        [0.0, -0.0, np.inf, -np.inf, np.nan]]).astype(np.float32)
    got = compile_model(model)(x)[0]
    assert_close(got, interpret(model, [x])[0], "f32", 1, name="erf")
    assert np.signbit(got[-4]) and np.isnan(got[-1])


def test_bitwise_not_of_a_bool_is_its_negation():
    """~mask on a bool (DeBERTa's attention mask through torch.export) is logical not:
    C's ~ on the byte once gave 0xFE/0xFF, both true (found by benchmarks/arch_sweep.py)."""
    from tilegraph.ir import Graph

    g = Graph()
    x, a = g.input("m", ("B", 6), dtype="i1"), g.input("a", ("B", 6))
    model = g.build(g.op("where", g.op("bitwise_not", x), a, g.constant(np.float32(-1))), names=["y"])
    ms = np.array([[True, False, True, True, False, False]] * 2)
    xs = np.arange(12, dtype=np.float32).reshape(2, 6)
    np.testing.assert_array_equal(compile_model(model)(ms, xs)[0], interpret(model, [ms, xs])[0])


def test_a_sum_of_bools_is_their_or():
    """NumPy's bool + bool is True + True = True; C's + on the bytes gave 2, which a
    cast to float then read as 2.0."""
    from tilegraph.ir import Graph

    g = Graph()
    x, y = g.input("x", (4,), dtype="i1"), g.input("y", (4,), dtype="i1")
    model = g.build(g.op("cast", g.op("add", x, y), to="f32"), names=["o"])
    xs, ys = np.array([1, 1, 0, 0], bool), np.array([1, 0, 1, 0], bool)
    np.testing.assert_array_equal(compile_model(model)(xs, ys)[0], interpret(model, [xs, ys])[0])


def _natively(model):
    compiled = compile_model(model)
    assert all(kind == "segment" for kind, _ in compiled.program.plan), "a step ran on the host"
    return compiled


INT_TYPES = ["i8", "i16", "i32", "i64", "ui8", "ui16", "ui32", "ui64"]


@pytest.mark.parametrize("dtype", INT_TYPES)
def test_integer_division_and_modulo_run_in_c_with_numpys_results_where_cs_are_undefined(dtype):
    """x / 0, x % 0 and INT_MIN / -1 trap or are undefined in C; NumPy gives 0, 0 and INT_MIN
    (kernels.div truncates after np.abs, which leaves INT_MIN negative). They ran on the host;
    MoE routing (experts picked by token index div and mod) and ConvBERT met them."""
    from tilegraph.ir import Graph

    info = np.iinfo(numpy_dtype(dtype))
    signed = [-1, -2, -7, info.min, info.min + 1] if info.min < 0 else []
    values = np.array(sorted({0, 1, 2, 3, 7, info.max, info.max - 1, *signed}), dtype=numpy_dtype(dtype))
    a, b = (v.ravel().copy() for v in np.meshgrid(values, values))
    for name, attrs in (("div", {}), ("mod", {"fmod": False}), ("mod", {"fmod": True})):
        g = Graph()
        x, y = g.input("a", a.shape, dtype=dtype), g.input("b", b.shape, dtype=dtype)
        model = g.build(g.op(name, x, y, **attrs), names=["o"])
        with np.errstate(divide="ignore", invalid="ignore"):
            want = interpret(model, [a, b])[0]
        np.testing.assert_array_equal(_natively(model)(a, b)[0], want, err_msg=f"{name} {attrs}")


@pytest.mark.parametrize("dtype,reduction", [("i64", "none"), ("i32", "add"), ("ui8", "none")])
def test_integer_scatter_nd_runs_in_c_in_order_and_names_an_index_out_of_range(dtype, reduction):
    """MoE routing writes each token's position into an integer buffer (index_put_ of an arange):
    the C scatter took float slices only, so it ran on the host between segments."""
    from tilegraph.ir import Graph, TilegraphError

    g = Graph()
    x, ids = g.input("x", (6, 3), dtype=dtype), g.input("ids", ("N", 1), dtype="i64")
    model = g.build(g.op("scatter_nd", x, ids, g.input("u", ("N", 3), dtype=dtype), reduction=reduction),
                    names=["o"])
    xs = np.arange(18).reshape(6, 3).astype(numpy_dtype(dtype))
    index = np.array([[4], [-1], [0], [4]])  # negative from the end, 4 twice: in order
    updates = (np.arange(12).reshape(4, 3) * 7 + 1).astype(numpy_dtype(dtype))
    compiled = _natively(model)
    np.testing.assert_array_equal(compiled(xs, index, updates)[0], interpret(model, [xs, index, updates])[0])
    with pytest.raises(TilegraphError, match="scatter_nd: index 6 is out of range"):
        compiled(xs, np.array([[6]]), updates[:1])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), data=st.data())
def test_topk_runs_in_c_with_ties_in_index_order_and_nan_ranked_as_numpys_sort_does(shape, data):
    """MoE routing picks each token's top experts; topk ran on the host. Ties keep their index
    order and a NaN ranks above every number for the largest, below for the smallest."""
    from tilegraph.ir import Graph

    dtype = data.draw(st.sampled_from(["f32", "f64", "i64", "i32", "ui8"]))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    k = data.draw(st.integers(1, shape[axis]))
    largest = data.draw(st.booleans())
    xs = data.draw(st.lists(st.sampled_from([0, 1, 2, 3, -1, 7, 200]), min_size=math.prod(shape),
                            max_size=math.prod(shape)))
    x = np.array(xs).reshape(shape).astype(numpy_dtype(dtype))
    if dtype.startswith("f"):
        x.flat[data.draw(st.lists(st.integers(0, x.size - 1), max_size=3))] = np.nan
    g = Graph()
    values, indices = g.op("topk", g.input("x", shape, dtype=dtype), k=k, axis=axis, largest=largest)
    model = g.build(values, indices, names=["v", "i"])
    got, want = _natively(model)(x), interpret(model, [x])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0].astype(x.dtype))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), data=st.data())
def test_argmax_and_argmin_run_in_c_with_numpys_ties_and_nans(shape, data):
    """The first (or last) index of a row's extreme, a NaN winning over every number for both,
    as np.argmax and np.argmin; both ran on the host."""
    from tilegraph.ir import Graph

    dtype = data.draw(st.sampled_from(["f32", "f64", "i64", "ui8"]))
    name = data.draw(st.sampled_from(["argmax", "argmin"]))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    attrs = dict(axis=axis, keepdims=data.draw(st.booleans()), select_last_index=data.draw(st.booleans()))
    xs = data.draw(st.lists(st.sampled_from([0, 1, 3, 7]), min_size=math.prod(shape), max_size=math.prod(shape)))
    x = np.array(xs).reshape(shape).astype(numpy_dtype(dtype))
    if dtype.startswith("f"):
        x.flat[data.draw(st.lists(st.integers(0, x.size - 1), max_size=3))] = np.nan
    g = Graph()
    model = g.build(g.op(name, g.input("x", shape, dtype=dtype), **attrs), names=["i"])
    np.testing.assert_array_equal(_natively(model)(x)[0], interpret(model, [x])[0])


@pytest.mark.parametrize("shape,axis", [((6, 5, 1), 1), ((2, 3, 4, 1, 1), 2), ((3, 7), 1)])
def test_a_softmax_whose_later_dims_are_ones_runs_on_rows_in_c(shape, axis):
    """ConvBERT's dynamic kernels are a softmax over dim 1 of (tokens, kernel, 1): rows all the
    same, which ran on the host as a softmax over a leading axis."""
    from tilegraph.ir import Graph

    g = Graph()
    y = g.op("add", g.op("softmax", g.input("x", shape), axis=axis), g.constant(np.float32(1)))
    model = g.build(y, names=["y"])
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert_close(_natively(model)(x)[0], interpret(model, [x])[0], "f32", shape[axis], name="softmax")


@pytest.mark.parametrize("op", ["layer_norm", "softmax"])
def test_a_row_op_over_a_transposed_view_copies_its_rows_out_and_stays_in_c(op):
    """MobileViT normalizes its patches through a transposed view: the row kernels take
    contiguous rows, and the op ran on the host; its rows are now copied out first."""
    from tilegraph.ir import Graph

    g = Graph()
    t = g.input("x", (3, 16, 5)).transpose(0, 2, 1)
    if op == "layer_norm":
        scale, shift = (g.weight(n, np.linspace(lo, 1.5, 16).astype(np.float32)) for n, lo in (("w", 0.5), ("b", -1)))
        y = g.op("layer_norm", t, scale, shift, axis=-1, epsilon=1e-5)
    else:
        y = g.op("softmax", t, axis=-1)
    model = g.build(y, names=["y"])
    x = np.random.default_rng(0).standard_normal((3, 16, 5)).astype(np.float32)
    assert_close(_natively(model)(x)[0], interpret(model, [x])[0], "f32", 16, name=op)


@pytest.mark.parametrize("source", ["f32", "f64"])
def test_floats_to_integers_and_float_modulo_run_in_c_with_numpys_results(source):
    """A float to int cast is undefined in C out of range; NumPy's on x86 gives INT_MIN (int32
    and int64) and the narrower types that int32 modulo their width. np.mod of floats takes the
    divisor's sign. All ran on the host (WavLM's position buckets, MPNet's)."""
    from tilegraph.ir import Graph

    x = np.array([np.nan, np.inf, -np.inf, 3e9, -3e9, 1e19, -1e19, 2.5, -2.5, 2147483647.0, -2147483648.0, 9.3e18,
                  -9.3e18, 0.99, -0.99, 200.7, -200.7, 70000.2, -70000.2, 0.0, -0.0], numpy_dtype(source))
    with np.errstate(invalid="ignore"):
        for to in ("i64", "i32", "i16", "i8", "ui16", "ui8"):
            g = Graph()
            model = g.build(g.op("cast", g.input("x", x.shape, dtype=source), to=to), names=["o"])
            np.testing.assert_array_equal(_natively(model)(x)[0], interpret(model, [x])[0], err_msg=to)
        a, b = (v.ravel().copy() for v in np.meshgrid(x[[0, 1, 2, 7, 8, 13, 14, 15, 19, 20]], x[[1, 2, 7, 8, 13, 19, 20]]))
        for fmod in (False, True):
            g = Graph()
            model = g.build(g.op("mod", g.input("a", a.shape, dtype=source), g.input("b", b.shape, dtype=source),
                                 fmod=fmod), names=["o"])
            got, want = _natively(model)(a, b)[0], interpret(model, [a, b])[0].astype(x.dtype)
            np.testing.assert_array_equal(got, want, err_msg=f"fmod={fmod}")
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want), err_msg=f"fmod={fmod}: a zero's sign")


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), data=st.data())
def test_indexing_ops_along_any_axis_match_the_interpreter(shape, data):
    """gather, gather_elements and cumsum in C, on every axis, with negative indices."""
    from tilegraph.ir import Graph

    rank = len(shape)
    axis = data.draw(st.integers(-rank, rank - 1), label="axis")
    n = shape[axis]
    rng = np.random.default_rng(data.draw(st.integers(0, 99), label="seed"))
    x = rng.standard_normal(shape).astype(np.float32)
    ids = rng.integers(-n, n, size=data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))).astype(np.int64)
    elements = rng.integers(-n, n, size=shape).astype(np.int64)
    g = Graph()
    xv, iv, ev = g.input("x", tuple(shape)), g.input("i", ids.shape, dtype="i64"), g.input("e", shape, dtype="i64")
    flags = dict(exclusive=data.draw(st.booleans()), reverse=data.draw(st.booleans()))
    model = g.build(g.op("gather", xv, iv, axis=axis), g.op("gather_elements", xv, ev, axis=axis),
                    g.op("cumsum", xv, axis=axis % rank, **flags), names=["g", "ge", "cs"])
    inputs = [x, ids, elements]
    for got, want, name in zip(_natively(model)(*inputs), interpret(model, inputs), model.output_names):
        assert_close(got, want, "f32", reduction_length=n, name=name)
    bad = elements.copy()
    bad.reshape(-1)[0] = n  # one past the end: an error naming the op, not a read outside x
    with pytest.raises(tilegraph.TilegraphError, match="gather_elements"):
        _natively(model)(x, ids, bad)


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_concat_and_reductions_over_any_axes_match_the_interpreter(shape, data):
    """concat in C on every axis (each part lands at its offset along the axis, in elements of
    that axis's stride), and sums and means over any set of axes (a set keeping the contiguous
    innermost dim runs as rows of channels, the others as a loop nest per output)."""
    from tilegraph.ir import Graph

    rank = len(shape)
    axis = data.draw(st.integers(-rank, rank - 1), label="axis")
    axes = tuple(sorted(data.draw(st.sets(st.integers(0, rank - 1), min_size=1), label="axes")))
    other = list(shape)
    other[axis] = data.draw(st.integers(1, 4), label="other part's length")
    rng = np.random.default_rng(data.draw(st.integers(0, 99), label="seed"))
    x, y = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(other).astype(np.float32)
    g = Graph()
    xv, yv = g.input("x", tuple(shape)), g.input("y", tuple(other))
    model = g.build(g.op("concat", xv, yv, xv, axis=axis), g.op("reduce_mean", xv, axes=axes, keepdims=False),
                    g.op("reduce_sum", xv, axes=axes, keepdims=True), names=["c", "mean", "sum"])
    n = int(np.prod([shape[a] for a in axes]))
    for got, want, name in zip(_natively(model)(x, y), interpret(model, [x, y]), model.output_names):
        assert_close(got, want, "f32", reduction_length=n, name=name)


def test_a_zero_pad_before_a_convolution_is_its_padding():
    """MobileNet's explicit zero pads: after canonicalize the convolution pads itself (no
    pad step); a pad of another value, or one that is also an output, is computed in C."""
    from tilegraph.ir import Graph
    from tilegraph.passes.registry import run_pipeline

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    for value, also_output, pad_steps in ((0.0, False, 0), (0.5, False, 1), (0.0, True, 1)):
        g = Graph()
        padded = g.op("pad", g.input("x", ("N", 3, 7, 6)), pads=(0, 0, 1, 2, 0, 0, 2, 0), value=value)
        y = g.op("conv", padded, g.weight("w", w), strides=(2, 1))
        model = g.build(y, *([padded] if also_output else []))
        compiled = _natively(run_pipeline(model, "canonicalize"))
        assert sum(s.comment.startswith("pad") for s in compiled.program.steps) == pad_steps
        for got, want in zip(compiled(x), interpret(model, [x])):
            assert_close(got, want, "f32", reduction_length=27)


@pytest.mark.parametrize("batch, channels, rest", [(1, 512, (70,)), (2, 5, (3, 67)), (3, 16, (2, 40))])
def test_a_group_norm_along_time_after_a_convolution_runs_down_its_channels_last_columns(batch, channels, rest):
    """wav2vec 2.0's first group norm (one channel a group: a layer_norm over time of each
    channel, then a scale and shift per channel, then GELU) reads a convolution's channels-last
    result. The layer_norm ran on the host, in NumPy (a sixth of the model's time at 30 s of
    audio), and the three ops after it as three passes. It is tg_layer_norm_cols, writing
    channels-last as its input lies, then one loop in place: one step for the fused group."""
    from tilegraph.ir import Graph
    from tilegraph.passes.registry import default_pipeline, run_pipeline

    rng = np.random.default_rng(1)
    g = Graph()
    x = g.input("x", (batch, 3, *(d + 2 for d in rest)))
    w = g.weight("w", rng.standard_normal((channels, 3, *(3 for _ in rest))).astype(np.float32))
    conv = g.op("conv", x, w)
    scale = g.weight("s", rng.standard_normal(rest[-1]).astype(np.float32))
    per_channel = (channels, *(1 for _ in rest))
    gamma, beta = (g.weight(n, rng.standard_normal(per_channel).astype(np.float32)) for n in ("gamma", "beta"))
    normed = g.op("layer_norm", conv, scale, None, axis=-1, epsilon=1e-5)
    model = g.build(g.gelu(normed * gamma + beta), names=["y"])
    compiled = _natively(run_pipeline(model, default_pipeline("c")))
    norm = [s for s in compiled.program.steps if "tg_layer_norm" in "".join(s.lines or ())]
    assert len(norm) == 1 and "layer_norm, mul, add, gelu" in norm[0].comment
    calls = [ln for ln in norm[0].lines or () if "tg_layer_norm" in ln]
    assert len(calls) == 1 and calls[0].strip().startswith("tg_layer_norm_cols(")
    # [outer][n][inner]: the batch and the other spatial dims, time, the channels
    assert calls[0].split(", ")[4:7] == [str(batch * int(np.prod(rest[:-1]))), str(rest[-1]), str(channels)]
    xs = rng.standard_normal((batch, 3, *(d + 2 for d in rest))).astype(np.float32) * 3 + 1
    assert_close(compiled(xs)[0], interpret(model, [xs])[0], "f32", reduction_length=27 * rest[-1])


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(1, 70), seed=st.integers(0, 99))
def test_a_group_of_row_reductions_is_one_pass_over_the_rows(rows, width, seed):
    """An RMS norm and a softmax spelled out in ops (Llama's, a hand-written one): each
    fused group is one native step, whatever the row width, and matches the interpreter."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", ("S", width))
    w = g.weight("w", rng.standard_normal(width).astype(np.float32))
    rms = x * g.rsqrt(g.reduce_mean(x * x, axes=(-1,), keepdims=True) + g.constant(np.float32(1e-6))) * w
    e = g.exp(x - g.reduce_max(x, axes=(-1,), keepdims=True))
    model = g.build(rms, e / g.reduce_sum(e, axes=(-1,), keepdims=True), names=["rms", "softmax"])
    compiled = tilegraph.compile(model, target="c", pipeline="fuse")
    assert [s.comment.split(":")[0] for s in compiled._runner.program.steps] == ["fusion reduction"] * 2
    xs = rng.standard_normal((rows, width)).astype(np.float32)
    for got, want, name in zip(compiled.run(xs), interpret(model, [xs]), model.output_names):
        assert_close(got, want, "f32", reduction_length=width, name=name)


def test_a_row_reduction_is_a_simd_loop_and_keeps_a_nan():
    """A fused row reduction (a cross-entropy's max and sum of exps over 50257 logits) runs as
    OpenMP simd reductions (the C compiler leaves a double accumulator's loop scalar otherwise);
    a NaN anywhere in a row still makes its max NaN, as NumPy's does (lanes combine as max,
    which alone would drop one lane's NaN). Rows of other widths and values match the interpreter."""
    from tilegraph.ir import Graph

    g = Graph()
    x = g.input("x", ("S", 203))
    m = g.reduce_max(x, axes=(-1,), keepdims=True)
    lse = g.log(g.reduce_sum(g.exp(x - m), axes=(-1,), keepdims=True)) + m
    model = g.build(x - lse, m, names=["log_softmax", "max"])
    compiled = tilegraph.compile(model, target="c", pipeline="fuse")
    assert "#pragma omp simd reduction(max:acc) reduction(|:nan)" in compiled.source
    assert "#pragma omp simd reduction(+:acc)" in compiled.source
    xs = np.random.default_rng(0).standard_normal((5, 203)).astype(np.float32) * 4
    xs[1, 77] = np.nan
    xs[3, 202] = np.nan
    xs[4] = -np.inf
    xs[4, 9] = 1.0
    for got, want, name in zip(compiled.run(xs), interpret(model, [xs]), model.output_names):
        got = np.asarray(got)
        assert np.array_equal(np.isnan(got), np.isnan(want)), name
        assert np.isnan(got[1]).all() and np.isnan(got[3]).all() and not np.isnan(got[[0, 2, 4]]).any(), name
        assert_close(np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want), "f32",
                     reduction_length=203, name=name)
    # a reduction outside any group (a layer norm's backward in a GEMM's epilogue): its
    # innermost reduced loop the same simd reduction, over one axis or two
    g = Graph()
    x = g.input("x", (3, 40, 50))
    model = g.build(g.reduce_sum(x, axes=(1, 2)), g.reduce_mean(x, axes=(-1,), keepdims=True), names=["s", "m"])
    compiled = tilegraph.compile(model, target="c", pipeline="")
    assert compiled.source.count("#pragma omp simd reduction(+:acc)") == 2
    xs = np.random.default_rng(1).standard_normal((3, 40, 50)).astype(np.float32)
    for got, want, name, n in zip(compiled.run(xs), interpret(model, [xs]), model.output_names, (2000, 50)):
        assert_close(np.asarray(got), want, "f32", reduction_length=n, name=name)


def test_a_gated_mlp_runs_its_sibling_gemms_then_one_loop():
    """Llama's MLP: silu(x @ Wg) * (x @ Wu): one GEMM, then the other with what combines
    them as one step (its oneDNN epilogue where the gate comes second: swish, then a binary
    mul by the first; it once fell back to a step per op)."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", ("B", 16, 32))
    gate = x @ g.weight("wg", rng.standard_normal((32, 64)).astype(np.float32))
    up = x @ g.weight("wu", rng.standard_normal((32, 64)).astype(np.float32))
    model = g.build(gate * g.sigmoid(gate) * up, names=["h"])
    compiled = tilegraph.compile(model, target="c")
    steps = [s.comment for s in compiled._runner.program.steps]
    # both GEMMs and the loop as one horizontal group, or the second GEMM with the combination
    # as its epilogue: never a step per op
    assert (steps[0].startswith("fusion horizontal_matmul: matmul, matmul") if len(steps) == 1 else
            [c.split(" ")[0] for c in steps] in (["matmul", "fusion"], ["matmul", "matmul"])), steps
    xs = rng.standard_normal((2, 16, 32)).astype(np.float32)
    assert_close(compiled(xs), interpret(model, [xs])[0], "f32", reduction_length=32)


def test_a_gemm_whose_result_is_also_yielded_runs_its_pointwise_epilogue_as_one_loop():
    """A training step's MLP: the pre-activation h = x W + b, which the backward reads, yielded
    beside gelu(h) and erf(h / sqrt 2) (gelu's derivative): the bias on oneDNN, then both as one
    loop over h (not a pass over memory per op, and no buffer for h / sqrt 2), all three right."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (256, 64))
    h = x @ g.weight("w", rng.standard_normal((64, 128)).astype(np.float32)) + \
        g.weight("b", rng.standard_normal(128).astype(np.float32))
    model = g.build(h, g.gelu(h), g.erf(h * g.constant(np.float32(math.sqrt(0.5)))), names=["h", "y", "e"])
    compiled = tilegraph.compile(model, target="c")
    (step,) = compiled._runner.program.steps
    assert step.comment.startswith("fusion matmul_epilogue: matmul, add, gelu, mul, erf"), step.comment
    body = "\n".join(step.lines)
    assert body.count("tg_prim_run(") == 1 and body.count("for (int64_t j = ") == 1, body
    xs = rng.standard_normal((256, 64)).astype(np.float32)
    for got, want in zip(compiled.run(xs), interpret(model, [xs])):
        assert_close(got, want, "f32", reduction_length=64)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_a_reshape_is_a_view_exactly_where_numpy_makes_one(shape, data):
    """The emitter's no-copy reshape (the split Q, K and V heads of a fused projection)
    agrees with NumPy on whether a strided view can be reshaped without a copy, and on
    the strides it then has."""
    from tilegraph.ir.strides import reshaped_strides

    base = np.arange(int(np.prod(shape)) * 2, dtype=np.float32).reshape(*shape[:-1], shape[-1] * 2)
    view = np.transpose(base, data.draw(st.permutations(range(len(shape)))))
    view = view[tuple(slice(None) if data.draw(st.booleans()) else slice(None, None, 2) for _ in shape)]
    sizes = [int(d) for d in view.shape]
    new = data.draw(st.sampled_from([[int(np.prod(sizes))], sizes[::-1], [*sizes, 1], [1, *sizes]]
                                    + ([[sizes[0] * sizes[1], *sizes[2:]]] if len(sizes) > 1 else [])))
    strides = reshaped_strides(tuple(sizes), tuple(s // 4 for s in view.strides), tuple(new))
    try:
        reshaped = view.view()
        reshaped.shape = new  # raises where NumPy needs a copy
    except AttributeError:
        assert strides is None
        return
    assert strides is not None
    assert [s for d, s in zip(new, strides) if d != 1] == [s // 4 for d, s in zip(new, reshaped.strides) if d != 1]


def test_attention_heads_split_from_one_projection_and_merged_back_need_no_copy():
    """GPT-2's attention: Q, K, V split from one fused projection and reshaped into heads
    are strided views the kernel reads as they are; its output is written in the layout of
    the transpose that merges the heads back, so no step copies."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", ("S", 32))
    qkv = g.reshape(x @ g.weight("w", rng.standard_normal((32, 96)).astype(np.float32)), (1, "S", 96))
    heads = [g.transpose(g.reshape(part, (1, "S", 4, 8)), (0, 2, 1, 3)) for part in g.split(qkv, (32, 32, 32), 2)]
    att = g.op("attention", *heads, scale=0.35, causal=True)
    model = g.build(g.reshape(g.transpose(att, (0, 2, 1, 3)), ("S", 32)), names=["y"])
    compiled = tilegraph.compile(model, target="c")
    assert not any("copy" in s.comment for s in compiled._runner.program.steps)
    xs = rng.standard_normal((11, 32)).astype(np.float32)
    assert_close(compiled(xs), interpret(model, [xs])[0], "f32", reduction_length=32)


@pytest.mark.parametrize("case", ["fits", "spills", "few keys"])
def test_f32_spelled_out_attention_is_the_flash_kernel_once_its_scores_outgrow_a_cores_cache(case):
    """Eager attention as exported (softmax(q @ k^T * scale + mask) @ v) at f32: where its
    scores outgrow one core's L2 (the C profile's cache_bytes; Whisper's encoder, 6 x 1500 x
    1500) the default pipeline folds it into the flash kernel's one step, which never writes
    them; where they fit (BERT, ViT), or spill over fewer than C_F32_FOLD_MIN_KEYS keys (many
    short windows), it stays oneDNN's GEMMs and the row softmax. Either way within f32's
    tolerance of the interpreter."""
    from tilegraph.ir import Graph
    from tilegraph.ir.hardware import hardware
    from tilegraph.passes.registry import C_F32_FOLD_MIN_KEYS

    cache, d = hardware("c").cache_bytes, 16
    if case == "few keys":  # heads enough for the scores to spill, each over half the minimum of keys
        keys = C_F32_FOLD_MIN_KEYS // 2
        heads = int(np.ceil(cache / (4 * keys * keys)))
    else:  # two heads' square scores: the shortest that spills, or half as long
        heads = 2
        side = max(int(np.ceil(np.sqrt(cache / (4 * heads)))), C_F32_FOLD_MIN_KEYS)
        keys = side if case == "spills" else side // 2
    rng = np.random.default_rng(keys)
    g = Graph()
    q, k, v = (g.input(n, (1, heads, keys, d)) for n in "qkv")
    scores = g.matmul(q, k.transpose(0, 1, 3, 2)) * g.constant(np.float32(0.25)) + g.input("m", (1, 1, 1, keys))
    model = g.build(g.matmul(g.softmax(scores, axis=-1), v), names=["y"])
    xs = [rng.standard_normal((1, heads, keys, d)).astype(np.float32) for _ in range(3)]
    xs.append(np.where(rng.random((1, 1, 1, keys)) < 0.8, 0.0, -1e4).astype(np.float32))
    compiled = tilegraph.compile(model, target="c")
    steps = [s.comment for s in compiled._runner.program.steps]
    folded = case == "spills"
    assert compiled.source.count("tg_attention(") == folded
    assert len(steps) == 1 if folded else not any("attention" in c for c in steps), steps
    assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], "f32", reduction_length=keys + d)


@pytest.mark.parametrize("op", ["avg_pool", "max_pool"])
def test_a_pool_window_partly_in_the_padding_counts_only_its_taps_inside(op):
    """Found by hypothesis: GCC 12 at -O3 miscompiled the pool loop that skipped taps in
    the padding with `continue` (an average of 4 taps came out as 3 of them); the window's
    bounds are now computed, not tested per tap."""
    from tilegraph.ir import Graph

    g = Graph()
    model = g.build(g.op(op, g.input("x", ("B", 2, 5, 4)), kernel=(2, 2), strides=(1, 2), pads=(1, 0, 0, 0)))
    xs = np.random.default_rng(0).standard_normal((3, 2, 5, 4)).astype(np.float32)
    assert_close(compile_model(model)(xs)[0], interpret(model, [xs])[0], "f32", reduction_length=4)


@pytest.mark.parametrize("op", ["avg_pool", "max_pool"])
def test_a_ceil_mode_pool_over_a_symbolic_length_drops_a_window_that_starts_in_the_end_pad(op):
    """ONNX and torch: with ceil_mode the last window starts inside the input or its left
    padding. Over a symbolic length the shape rule kept a window starting in the end pad
    (a 4-long row in windows of 2 with stride 2 and an end pad of 1 made 3 windows, the last
    all padding: -inf for max); a static length had 2."""
    from tilegraph.ir import Graph

    g = Graph()
    model = g.build(g.op(op, g.input("x", (1, 2, "L")), kernel=(2,), strides=(2,), pads=(0, 1), ceil_mode=True))
    for length in (3, 4, 5):
        xs = np.random.default_rng(length).standard_normal((1, 2, length)).astype(np.float32)
        got = compile_model(model)(xs)[0]
        assert got.shape == (1, 2, (length + 1) // 2)
        assert_close(got, interpret(model, [xs])[0], "f32", reduction_length=2)


def test_a_loop_over_regrouped_rows_reads_a_broadcast_operand_once_per_row():
    """Found by hypothesis (test_properties' regrouped rows): relu(x + p) reshaped from
    (2, 1, 1, 1) to (2, 1) runs as one loop over rows, and p, broadcast along the rows, was
    read with the stride of a size-1 dim (a new row each row)."""
    from tilegraph.ir import Graph

    g = Graph()
    x, p = g.input("x", (2, 1, 1, 1)), g.input("p", (1, 1))
    y = g.reshape(g.op("relu", x + p), (2, 1))
    model = g.build(g.op("abs", y) * g.weight("s", np.float32(0.5)), x)
    inputs = random_inputs(model, seed=1)
    got = tilegraph.compile(model, target="c", pipeline="fuse").run(*inputs)
    assert_close(got[0], interpret(model, inputs)[0], "f32", reduction_length=1)


def test_a_weights_block_dequantization_runs_once_and_its_gemm_packs_the_result():
    """A 4-bit weight with a scale per block of rows (w4a16, MXFP4) is dequantized on the
    host once per shape binding, before the GEMM packs it as it packs any weight: later
    calls run only native steps, whatever the batch."""
    import ml_dtypes

    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    w = g.op("dequantize", g.weight("w.i4", rng.integers(-8, 8, (64, 48)).astype(ml_dtypes.int4)),
             g.weight("w.scale", rng.uniform(0.01, 0.1, (2, 48)).astype(np.float32)), axis=0, block_size=32)
    model = g.build(g.relu(g.input("x", ("B", 64)) @ w), names=["y"])
    compiled = compile_model(model)
    once = [s for s in compiled.program.steps if s.host_op is not None]
    assert [s.once for s in once] == [True]
    calls = []
    host = compiled._host
    compiled._host = lambda step, *rest: calls.append(step) or host(step, *rest)
    for batch in (3, 5, 3, 5):
        xs = rng.standard_normal((batch, 64)).astype(np.float32)
        assert_close(compiled(xs)[0], interpret(model, [xs])[0], "f32", reduction_length=64)
    assert len(calls) == 2  # once per binding


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 7), k=st.integers(1, 300), n=st.integers(1, 40), zero=st.integers(0, 255),
       seed=st.integers(0, 99))
def test_an_integer_gemm_with_an_activation_zero_point_is_exact(rows, k, n, zero, seed):
    """(a - z) @ b for uint8 a, int8 weight b, z a run-time input: oneDNN's GEMM, then the
    zero point times b's column sums subtracted, in C and exactly as the interpreter's."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(seed)
    g = Graph()
    a, z = g.input("a", ("R", k), dtype="ui8"), g.input("z", (), dtype="ui8")
    model = g.build(g.op("matmul_integer", a, g.weight("b", rng.integers(-128, 128, (k, n)).astype(np.int8)), z))
    compiled = _natively(model)
    xs = [rng.integers(0, 256, (rows, k)).astype(np.uint8), np.uint8(zero)]
    np.testing.assert_array_equal(compiled(*xs)[0], interpret(model, xs)[0])


def test_a_small_forward_runs_on_one_thread_and_leaves_the_thread_count_as_it_was():
    """A forward of little work runs on one thread (waking sleeping threads for each of
    its kernels costs more than they save); a large one on all; the count is restored."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    model = g.build(g.input("x", ("B", 1024)) @ g.weight("w", rng.standard_normal((1024, 1024)).astype(np.float32)))
    compiled = compile_model(model)
    before = compiled._lib.tg_max_threads()
    for batch, serial in ((2, True), (16, False)):
        xs = rng.standard_normal((batch, 1024)).astype(np.float32)
        assert_close(compiled(xs)[0], interpret(model, [xs])[0], "f32", reduction_length=1024)
        assert compiled._bindings[(("B", batch),)].serial is serial
        assert compiled._lib.tg_max_threads() == before


def test_a_gemm_group_yielding_a_value_of_its_row_op_prologue_keeps_it():
    """Found by hypothesis (test_c_asan's random graphs): a GEMM, elementwise ops, then
    layer_norm, the group also yielding one of the elementwise values. The prologue loop
    wrote only the row op's input, and the yielded value had no buffer."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    a, b = g.input("a", ("B", 2, 4, 3)), g.input("b", ("B", 2, 3, 4))
    h = g.op("neg", g.op("where", g.op("lt", g.constant(np.float32(0.1)), a @ b), a @ b, g.constant(np.float32(0))))
    model = g.build(g.op("layer_norm", h + g.weight("w", rng.standard_normal((2, 4, 4)).astype(np.float32)),
                         axis=1, epsilon=1e-2), h, names=["ln", "h"])
    inputs = random_inputs(model, seed=0)
    for pipeline in ("fuse", DEFAULT_PIPELINE):
        got = tilegraph.compile(model, target="c", pipeline=pipeline).run(*inputs)
        for name, a_, e in zip(model.output_names, got, interpret(model, inputs)):
            assert_close(a_, e, "f32", reduction_length=32, name=name)


def test_modules_sharing_a_workspace_hold_the_largest_arena_and_compute_the_same():
    """Modules that run one after another (a training step's segments) lay their temporaries out in
    one Workspace: it holds the largest module's arena, not their sum; when a larger module grows it,
    the smaller ones lay out again in the new arena (their old views dropped) and still compute what
    they compute alone."""
    from tilegraph.backends.c.runtime import ALIGN, Workspace
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    models, inputs = [], []
    for rows, width in ((4, 32), (64, 96)):
        g = Graph()
        w1 = rng.standard_normal((16, width)).astype(np.float32)
        w2 = rng.standard_normal((width, 8)).astype(np.float32)
        h = g.relu(g.input("x", (rows, 16)) @ g.weight("w1", w1))
        models.append(g.build(g.softmax(h @ g.weight("w2", w2)), names=["y"]))
        inputs.append(rng.standard_normal((rows, 16)).astype(np.float32))
    alone = [tilegraph.compile(m.clone(), target="c") for m in models]
    expected = [a(x)[0] for a, x in zip(alone, inputs)]
    arenas = [next(iter(a._runner._bindings.values())).arena_bytes for a in alone]
    assert 0 < arenas[0] < arenas[1]
    w = Workspace()
    shared = [tilegraph.compile(m.clone(), target="c", workspace=w) for m in models]
    for k in (0, 1, 0, 1, 0):  # the small one binds first; the large one grows the arena under it
        np.testing.assert_array_equal(shared[k](inputs[k])[0], expected[k])
        b = next(iter(shared[k]._runner._bindings.values()))
        assert b.arena is w.array and b.generation == w.generation
    assert w.nbytes == arenas[1] + ALIGN  # the largest arena, once
    with pytest.raises(tilegraph.TilegraphError, match="workspace="):
        tilegraph.compile(models[0].clone(), target="c", workspace=bytearray(8))
