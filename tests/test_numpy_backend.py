"""The NumPy backend: emitted modules compute what the float64 interpreter computes, and read well.

* every op of the table, on its examples (`tilegraph.testing.op_examples`), agrees with
  the interpreter within the dtype's tolerance and returns the declared dtype;
* the emitted source is one line per op, names weights readably, holds no weight data
  and no eval/exec;
* one module serves every size of a symbolic dim; wrong inputs are clear errors;
* values are freed after their last use; outputs never alias the module's arrays.
"""

from __future__ import annotations

import math
import re
import traceback

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from xdsl.dialects.builtin import TensorType
from xdsl.ir import Block, Region
from xdsl.irdl import IRDLOperation, irdl_op_definition, region_def, var_operand_def, var_result_def
from xdsl.dialects.func import ReturnOp

import tilegraph
from tilegraph.backends.numpy import compile_model, emit, liveness, load
from tilegraph.backends.numpy.runtime import MODULE_FILENAME
from tilegraph.ir import Graph, ShapeError, interpret
from tilegraph.ir.interpreter import bind_inputs
from tilegraph.ir.model import ModelError
from tilegraph.ir.shapes import concrete, free_symbols
from tilegraph.ir.dtypes import DTypeError, numpy_dtype
from tilegraph.ir.ops import OPS
from tilegraph.testing import assert_close, op_examples

EXAMPLES = op_examples()


def test_every_op_of_the_table_has_an_example():
    missing = sorted(set(OPS) - set(EXAMPLES))
    assert not missing, f"ops without an example in tilegraph.testing.op_examples(): {', '.join(missing)}"


@pytest.mark.parametrize("op", sorted(OPS))
def test_op_agrees_with_the_float64_interpreter(op):
    assert op in EXAMPLES, f"tg.{op} has no example in tilegraph.testing.op_examples(); add one"
    for ex in EXAMPLES[op]:
        compiled = compile_model(ex.model)
        got = compiled(*ex.inputs)
        want = interpret(ex.model, list(ex.inputs))
        assert len(got) == len(want)
        _, sizes = bind_inputs(ex.model, list(ex.inputs))
        for name, info, a, e in zip(ex.model.output_names, ex.model.outputs, got, want):
            assert isinstance(a, np.ndarray), f"{ex.id}: {name} is a {type(a).__name__}"
            assert a.dtype == numpy_dtype(info.dtype), f"{ex.id}: {name} is {a.dtype}, declared {info.dtype}"
            # The template computes the shape its shape rule declares (the interpreter, the
            # reference, included): constant-fold and the backends' buffers rely on it. (A
            # size only the op knows, such as nonzero's count, is bound from its result.)
            if free_symbols(info.shape) <= set(sizes):
                assert np.shape(e) == concrete(info.shape, sizes), f"{ex.id}: {name} is {np.shape(e)}, declared {info}"
            assert_close(a, e, info.dtype, ex.reduction_length, name=f"{ex.id}: {name}")


def _pool_by_windows(x, op, kernel, strides, pads, dilations, count_include_pad, out_shape):
    """A pool as ONNX defines it, one window at a time in float64: window o starts at
    o * stride - pad_begin; max over its taps inside x (-inf for none), average over them
    (with count_include_pad, over its taps inside the explicit padding too, never the extra
    padding ceil_mode adds)."""
    nd = len(kernel)
    out = np.empty(out_shape, np.float64)
    for o in np.ndindex(*out_shape[2:]):
        taps = [[o[i] * strides[i] - pads[i] + j * dilations[i] for j in range(kernel[i])] for i in range(nd)]
        inside = [[p for p in t if 0 <= p < x.shape[2 + i]] for i, t in enumerate(taps)]
        window = x[(slice(None), slice(None), *np.ix_(*inside))].reshape(x.shape[:2] + (-1,)).astype(np.float64)
        if op == "max_pool":
            out[(..., *o)] = window.max(axis=-1, initial=-np.inf)
        else:
            counted = math.prod(sum(-pads[i] <= p < x.shape[2 + i] + pads[i + nd] for p in t)
                                for i, t in enumerate(taps)) if count_include_pad else window.shape[-1]
            with np.errstate(invalid="ignore"):
                out[(..., *o)] = window.sum(axis=-1) / counted
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data(), op=st.sampled_from(["max_pool", "avg_pool"]), nd=st.integers(1, 2),
       ceil_mode=st.booleans(), count_include_pad=st.booleans(), symbolic=st.booleans())
def test_pools_make_the_windows_their_shape_rule_counts(data, op, nd, ceil_mode, count_include_pad, symbolic):
    """With ceil_mode the last window must start inside the input or its left padding (ONNX,
    torch). An end pad wider than a window leaves more windows in the padded input than that:
    the kernel returned them all, one more than the op's type (the interpreter too, so only
    the declared shape shows it; the NumPy backend's buffer refused it), and the rule for a
    symbolic length did not drop that window at all. Found looking for a model that
    constant-fold's shape check (fault seeding's fault 21) matters for."""
    ints = lambda lo, hi: data.draw(st.lists(st.integers(lo, hi), min_size=nd, max_size=nd))  # noqa: E731
    spatial, kernel, strides = ints(1, 6), ints(1, 4), ints(1, 3)
    dilations = ints(1, 2) if op == "max_pool" else [1] * nd
    pads = data.draw(st.lists(st.integers(0, 4), min_size=2 * nd, max_size=2 * nd))
    attrs = {"kernel": tuple(kernel), "strides": tuple(strides), "pads": tuple(pads), "dilations": tuple(dilations),
             "ceil_mode": ceil_mode, **({"count_include_pad": count_include_pad} if op == "avg_pool" else {})}

    def pool(last):
        g = Graph()
        return g.build(g.op(op, g.input("x", (2, 3, *spatial[:-1], last)), **attrs))

    try:
        model = pool(spatial[-1])
    except ShapeError:  # a window wider than the padded input
        return
    declared = model.outputs[0].shape
    if symbolic:
        model = pool("L")
        assert concrete(model.outputs[0].shape, {"L": spatial[-1]}) == declared, f"{op} {attrs}: {model.outputs[0]}"
    x = np.random.default_rng(0).standard_normal((2, 3, *spatial)).astype(np.float32)
    want = interpret(model, [x])[0]
    assert want.shape == declared, f"{op} {attrs} on {x.shape}: declared {model.outputs[0]}"
    assert_close(want, _pool_by_windows(x, op, kernel, strides, pads, dilations, count_include_pad, want.shape),
                 "f64", math.prod(kernel))
    assert_close(compile_model(model)(x)[0], want, "f32", math.prod(kernel))


# --- the emitted source ---------------------------------------------------------

QUERY = "encoder.layer.0.attention.self.query.weight"
# Weight values no emitted text could contain by accident.
MAGIC = 0.123456789


def bert_like_block(width=16):
    g = Graph()
    x = g.input("hidden_states", ("B", "S", width))
    wq = g.weight(QUERY, np.full((width, width), MAGIC, np.float32))
    bq = g.weight("encoder.layer.0.attention.self.query.bias", np.full(width, -MAGIC, np.float32))
    h = g.op("gelu", x @ wq + bq)
    h = g.layer_norm(h * 0.5, epsilon=1e-12)
    y = g.reshape(h, ("B", -1))
    return g.build(y, g.mean(h, axes=(1,)), names=["flat", "pooled"])


def forward_body(source):
    return source[source.index("def forward("):]


def test_emitted_source_is_one_line_per_op_with_readable_weight_names():
    model = bert_like_block()
    source = emit(model)
    compute_ops = [op for op in model.ops() if op.name.startswith("tg.") and op.op_name not in ("weight", "constant")]
    op_lines = [line for line in forward_body(source).splitlines() if re.search(r"^\s+\w+ = .*  # ", line)]
    assert len(op_lines) == len(compute_ops)
    assert f'encoder_layer_0_attention_self_query_weight = W["{QUERY}"]' in source
    assert "def forward(hidden_states):" in source
    assert "B = hidden_states.shape[0]" in source and "S = hidden_states.shape[1]" in source
    assert "#   hidden_states: f32(B, S, 16)" in source  # the header's signature
    assert "np.reshape(" in source and "(B, 16*S)" in source  # shape code in the symbols
    assert re.search(r"\bdel\b", source)
    assert 'with np.errstate(all="ignore"):' in source  # as the interpreter: inf/nan are results, not warnings
    assert "eval(" not in source and "exec(" not in source


def test_emitted_source_holds_no_weight_data():
    small, large = emit(bert_like_block(16)), emit(bert_like_block(256))
    assert "12345" not in small
    # The text does not grow with the weights: 256x256 is 256 times more numbers than 16x16.
    assert abs(len(large) - len(small)) < 100


def test_tracebacks_show_the_emitted_line():
    g = Graph()
    table = g.input("table", (4, 3))
    ids = g.input("ids", (2,), "i64")
    model = g.build(g.gather(table, ids + ids))  # computed ids: not checked as an input is (ir.signature)
    compiled = compile_model(model)
    with pytest.raises(ModelError, match=r"at `gather_0 = np.take\(table, add_0") as info:
        compiled(np.zeros((4, 3), np.float32), np.array([0, 9]))
    cause = info.value.__cause__  # an IndexError raised in the emitted module
    frames = [f for f in traceback.extract_tb(cause.__traceback__) if f.filename.startswith(MODULE_FILENAME)]
    assert frames and "np.take(table, add_0" in frames[-1].line
    g = Graph()
    plain = g.build(g.gather(g.input("table", (4, 3)), g.input("ids", (2,), "i64")))
    assert "errstate" not in compile_model(plain).source  # layout ops only: nothing can warn


# --- running --------------------------------------------------------------------


def test_one_module_runs_at_two_batch_sizes():
    model = bert_like_block()
    compiled = compile_model(model)
    rng = np.random.default_rng(0)
    for batch, seq in ((2, 3), (5, 1)):
        x = rng.standard_normal((batch, seq, 16)).astype(np.float32)
        got = compiled(x)
        assert got[0].shape == (batch, seq * 16) and got[1].shape == (batch, 16)
        for a, e in zip(got, interpret(model, [x])):
            assert_close(a, e, "f32", reduction_length=16)


def two_input_model():
    g = Graph()
    x = g.input("x", ("B", 4))
    y = g.input("y", ("B", 4))
    return g.build(x * y)


def test_wrong_input_shape_is_a_shape_error_naming_the_input():
    compiled = compile_model(two_input_model())
    good = np.ones((3, 4), np.float32)
    with pytest.raises(ShapeError, match=r"input 'y' has shape \(3, 5\), the model expects \(B, 4\)"):
        compiled(good, np.ones((3, 5), np.float32))
    with pytest.raises(ShapeError, match=r"input 'y' has B = 2.*B = 3"):
        compiled(good, np.ones((2, 4), np.float32))
    with pytest.raises(ShapeError, match=r"input 'x' has shape \(4,\)"):
        compiled(np.ones(4, np.float32), good)
    with pytest.raises(ShapeError, match="takes 2 inputs"):
        compiled(good)
    with pytest.raises(DTypeError, match="input 'x' is float32, the model expects i64"):
        compile_model(int_input_model())(np.ones(3, np.float32))  # a float would lose its kind


def int_input_model():
    g = Graph()
    x = g.input("x", (3,), "i64")
    return g.build(x + 1)


def test_inputs_of_a_wider_or_same_kind_are_cast_and_named_inputs_work():
    compiled = compile_model(two_input_model())
    x = np.arange(12.0).reshape(3, 4)  # float64 into f32
    (got,) = compiled(x=x, y=[[1, 2, 3, 4]] * 3)  # a list of ints into f32
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, x * np.array([1, 2, 3, 4]))


def test_outputs_have_the_declared_dtypes_and_zero_d_outputs_are_arrays():
    g = Graph()
    x = g.input("x", ("B", 3), "f16")
    total = g.sum(x)  # 0-d
    ids = g.op("argmax", x, axis=1)
    positive = x > 0.0
    model = g.build(total, ids, positive, g.cast(x, "bf16"))
    got = compile_model(model)(np.arange(6, dtype=np.float16).reshape(2, 3) - 2)
    assert [a.dtype for a in got] == [numpy_dtype(info.dtype) for info in model.outputs]
    assert all(isinstance(a, np.ndarray) for a in got) and got[0].shape == ()


def test_outputs_never_alias_weights_or_inputs():
    g = Graph()
    x = g.input("x", (2, 3))
    w = g.weight("w", np.ones((2, 3), np.float32))
    model = g.build(w, g.transpose(w, (1, 0)), x, x + w)
    compiled = compile_model(model)
    x0 = np.zeros((2, 3), np.float32)
    first = compiled(x0)
    for out in first[:3]:
        out[...] = 7  # writing into an output ...
    second = compiled(x0)
    np.testing.assert_array_equal(second[0], np.ones((2, 3)))  # ... leaves the weight alone
    np.testing.assert_array_equal(second[3], np.ones((2, 3)))
    assert not x0.any()


def test_load_reports_missing_weights():
    model = bert_like_block()
    with pytest.raises(Exception, match="weights missing.*query.bias"):
        load(emit(model), {QUERY: model.weights[QUERY]})


# --- the memory plan ------------------------------------------------------------


def test_each_value_dies_once_after_its_last_use_and_outputs_never_die():
    model = bert_like_block()
    steps = [op for op in model.ops() if op.name.startswith("tg.")]
    outputs = list(model.func.body.block.last_op.operands)
    dies = liveness(steps, outputs)
    died = [v for dead in dies for v in dead]
    assert len(died) == len(set(died))
    computed = {r for op in steps if op.op_name not in ("weight", "constant") for r in op.results}
    assert set(died) == computed - set(outputs)
    for i, dead in enumerate(dies):
        for v in dead:
            assert all(v not in op.operands for op in steps[i + 1:])


# --- fusion groups ----------------------------------------------------------------


@irdl_op_definition
class GroupOp(IRDLOperation):
    """A stand-in for a fusion op: one region, block args = operands, terminator yields results."""

    name = "test.group"
    ins = var_operand_def(TensorType)
    outs = var_result_def(TensorType)
    body = region_def()


def test_ops_inside_a_region_are_emitted_inline():
    model = bert_like_block()
    reference = bert_like_block()
    block = model.func.body.block
    gelu = next(op for op in block.ops if op.name == "tg.gelu")
    # Move gelu into a group: its operand becomes the block argument.
    inner = Block(arg_types=[gelu.operands[0].type])
    group = GroupOp.create(operands=[gelu.operands[0]], result_types=[gelu.results[0].type],
                           regions=[Region(inner)])
    block.insert_op_before(group, gelu)
    gelu.results[0].replace_all_uses_with(group.results[0])
    gelu.detach()
    gelu.operands[0] = inner.args[0]
    inner.add_ops([gelu, ReturnOp(gelu.results[0])])
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    got = compile_model(model)(x)
    for a, e in zip(got, interpret(reference, [x])):
        assert_close(a, e, "f32", reduction_length=16)


def test_awkward_names_become_distinct_identifiers():
    g = Graph()
    a = g.input("input.1", ("K", 2))  # a symbol named like the kernels module
    b = g.input("class", ("K", 2))  # a Python keyword
    w1 = g.weight("a.b", np.full(2, 1.0, np.float32))
    w2 = g.weight("a_b", np.full(2, 2.0, np.float32))
    model = g.build(g.reshape(a * w1 + b * w2, (-1,)))
    source = emit(model)
    assert 'a_b = W["a.b"]' in source and 'a_b_1 = W["a_b"]' in source
    compiled = load(source, model.weights)
    x, y = np.ones((3, 2), np.float32), np.full((3, 2), 10, np.float32)
    np.testing.assert_array_equal(compiled(x, y)[0], np.full(6, 21, np.float32))


def test_values_named_like_a_fused_groups_own_names_keep_their_values():
    # Regression: a fused group's body is `def chunk(s)`; an input named "s" (an ONNX
    # BatchNormalization's scale in the conformance suite) read the row slice instead.
    g = Graph()
    s, chunk = g.input("s", (3,)), g.input("chunk", (3,))
    model = g.build(g.sqrt(s) * s + chunk)
    compiled = tilegraph.compile(model, target="numpy")  # the default pipeline fuses the three ops into one group
    assert "def chunk(s)" in compiled.source
    x = np.array([1.0, 4.0, 9.0], np.float32)
    np.testing.assert_array_equal(compiled.run(x, x)[0], np.array([2.0, 12.0, 36.0], np.float32))


# The float32 erf and gelu kernels (ir/kernels.py) are approximations with a stated
# bound: 1.4e-7 absolute for erf (erf(a) = tanh(a P(a^2))), and for gelu that bound
# carried through x * Phi(x); beyond the fitted range they must keep saturating.
ERF32_BOUND = 1.5e-7


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False) | st.floats(-10, 10, width=32), min_size=1, max_size=64),
       st.sampled_from(["sweep", "random"]))
@example(values=[0.0, -0.0, 1e-30, -1e-30, 4.0, -4.0, 5.66, -5.66, 3e38, -3e38], kind="random")
@example(values=[1.401298464324817e-45], kind="random")  # gelu rounds to 0: the smallest subnormal
def test_f32_erf_and_gelu_kernels_stay_within_their_bound(values, kind):
    from scipy.special import erf, ndtr

    from tilegraph.ir import kernels as K

    x = np.asarray(values, np.float32)
    if kind == "sweep":  # a dense sweep of the range where the polynomial matters
        x = np.concatenate([x, np.linspace(-8, 8, 20001, dtype=np.float32)])
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):  # exp overflows to inf on purpose (as in emitted modules)
        got_erf = K.erf(x, out=np.empty_like(x))
        got_gelu = K.gelu(x.copy(), "none", out=np.empty_like(x))
    assert np.abs(got_erf - erf(x64)).max() <= ERF32_BOUND
    expected = x64 * ndtr(x64)
    # |x| * (bound on Phi), plus the float32 rounding of the result itself (to a subnormal too)
    f32 = np.finfo(np.float32)
    bound = np.abs(x64) * ERF32_BOUND + np.abs(expected) * f32.eps * 4 + f32.smallest_subnormal
    assert (np.abs(got_gelu - expected) <= bound).all(), x[np.abs(got_gelu - expected) > bound][:5]


def test_f32_erf_and_gelu_kernels_keep_non_finite_values():
    from tilegraph.ir import kernels as K

    x = np.array([np.inf, -np.inf, np.nan], np.float32)
    with np.errstate(all="ignore"):
        erf, gelu = K.erf(x, out=np.empty_like(x)), K.gelu(x, "none", out=np.empty_like(x))
    assert erf.tolist()[:2] == [1.0, -1.0] and np.isnan(erf[2])
    assert gelu[0] == np.inf and np.isnan(gelu[1:]).all()  # -inf * Phi(-inf) = -inf * 0: NaN, as in float64


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64", "i8", "i32", "i64", "ui8", "ui32"])
@pytest.mark.parametrize("in_step, out_step", [(1, 1), (4, 2), (4, 4), (8, 4), (3, -1), (-1, 2), (-4, 1)])
def test_negative_is_exact_on_strided_views(dtype, in_step, out_step):
    """neg on every stride pair a chunk loop makes: NumPy 2.1-2.4's own SIMD negative
    reads a 4-element-strided input wrongly when the output is strided (ir/kernels.negative)."""
    from tilegraph.ir import kernels

    np_dtype = numpy_dtype(dtype)
    values = np.arange(-100, 100).astype(np_dtype)
    x = values[::in_step][:17]
    expected = np.array([-v for v in x.tolist()]).astype(np_dtype)  # Python's own negation, wrapped
    into = np.zeros(200, np_dtype)
    out = into[::out_step][:17]
    kernels.negative(x, out=out)
    np.testing.assert_array_equal(out.astype(np.float64), expected.astype(np.float64))
    kernels.negative(x, out=x)  # in place, as a chunk reuses a dying operand's memory
    np.testing.assert_array_equal(x.astype(np.float64), expected.astype(np.float64))


@pytest.mark.parametrize("kernel", ["conv", "depthwise conv", "max_pool", "avg_pool"])
def test_window_kernels_write_into_any_out_they_are_given(kernel):
    """The emitter hands conv and the pools their group's buffer (`out=`), so no copy
    follows them; a strided `out` (a window of a wider buffer) gets the same values."""
    from tilegraph.ir import kernels

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 7, 6)).astype(np.float32)
    run = {
        "conv": lambda **o: kernels.conv(x, rng_w, rng_b, (2, 1), (1, 0, 1, 2), (1, 2), 2, **o),
        "depthwise conv": lambda **o: kernels.conv(x, dw_w, None, (), (1, 1, 1, 1), (), 4, **o),
        "max_pool": lambda **o: kernels.max_pool(x, (3, 2), (2, 2), (1, 0, 1, 1), (1, 1), True, **o),
        "avg_pool": lambda **o: kernels.avg_pool(x, (2, 2), (1, 2), (1, 1, 0, 0), (), False, True, **o),
    }
    rng_w, rng_b = rng.standard_normal((6, 2, 3, 2)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    dw_w = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
    expected = run[kernel]()
    for into in (np.empty_like(expected), np.zeros(expected.shape[:-1] + (2 * expected.shape[-1],), np.float32)[..., ::2]):
        returned = run[kernel](out=into)
        assert returned is into
        np.testing.assert_array_equal(into, expected)


def test_running_out_of_memory_is_a_model_error_naming_the_emitted_line():
    # Found by corrupting an ONNX file's Conv pads to 2**40: the model compiled, and the
    # call died in NumPy's allocator. The error now names the line, so the value and its op.
    g = Graph()
    x = g.input("x", (2,))
    compiled = compile_model(g.build(g.pad(x, [2 ** 42, 0]) * 2.0))
    with pytest.raises(ModelError, match=r"out of memory running the model, at `.*K\.pad\(x.*Unable to allocate"):
        compiled(np.ones(2, np.float32))
