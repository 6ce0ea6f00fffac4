"""Quantization: the tg.quantize / tg.dequantize / tg.dynamic_quantize / tg.matmul_integer ops,
packed 4-bit weights, the number formats' rounding bounds, and the `quantize` pass.

* quantized IR prints and parses back to the same text; 4-bit weights save two to a byte
  and load back bit for bit; bad scales, zero points and storage types are named errors;
* per format (ml_dtypes is the reference conversion), dequantize(quantize(x)) is within
  half an ulp of the format times the scale of x;
* the MSE observer per channel (or group) never has a larger squared error than per tensor;
* matmul_integer is the exact integer product, past the float32-exact chunk of K too;
* the NumPy backend computes what the interpreter computes on quantized models;
* the quantize pass keeps its stated bound (tilegraph.testing.assert_within_quantization_bound).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tilegraph.ir import Graph, Model, ShapeError, interpret
from tilegraph.ir.model import WeightStore
from tilegraph.ir.quant import FORMATS, MX_BLOCK, dequantize, absmax_scale, matmul_integer, mx_scale, quantize
from tilegraph.testing import op_examples

from tilegraph.ir.ops import QUANTIZATION_OPS

QUANT_OPS = sorted(QUANTIZATION_OPS)
PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- the IR -------------------------------------------------------------------------


@pytest.mark.parametrize("example", [ex for op in QUANT_OPS for ex in op_examples()[op]],
                         ids=lambda ex: ex.id)
def test_quantized_ir_round_trips_exactly(example, tmp_path):
    text = example.model.text
    again = Model.parse(text, example.model.weights)
    again.verify()
    assert again.text == text
    saved = Model.load(example.model.save(tmp_path / "m.mlir"))
    assert saved.text == text
    for name, array in example.model.weights.items():
        assert saved.weights[name].dtype == array.dtype
        np.testing.assert_array_equal(saved.weights[name].view(np.uint8), array.view(np.uint8))


@pytest.mark.parametrize("dtype", [ml_dtypes.int4, ml_dtypes.float4_e2m1fn])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (64, 33)])
def test_4bit_weights_are_stored_two_to_a_byte_and_load_back_bit_for_bit(dtype, shape, tmp_path):
    rng = np.random.default_rng(0)
    values = rng.integers(-8, 8, shape).astype(dtype) if dtype == ml_dtypes.int4 else \
        rng.uniform(-6, 6, shape).astype(dtype)
    store = WeightStore({"w": values, "f": np.ones(4, np.float32)})
    store.save(tmp_path / "w.npz")
    with np.load(tmp_path / "w.npz") as raw:
        assert raw["w"].nbytes == (values.size + 1) // 2
    back = WeightStore.load(tmp_path / "w.npz")
    assert back["w"].dtype == values.dtype and back["w"].shape == values.shape
    np.testing.assert_array_equal(back["w"].view(np.uint8), values.view(np.uint8))
    assert store.nbytes() == (values.size + 1) // 2 + 16


def _bad(build):
    g = Graph()
    x = g.input("x", (4, 64))
    with pytest.raises(ShapeError) as info:
        build(g, x)
    return str(info.value)


def test_bad_quantization_operands_are_named_errors():
    assert "tg.quantize" in _bad(lambda g, x: g.op("quantize", x, g.constant(np.ones(3, np.float32)), to="i8"))
    assert "storage type 'i16'" in _bad(lambda g, x: g.op("quantize", x, g.constant(np.float32(1)), to="i16"))
    assert "no zero point" in _bad(lambda g, x: g.op("quantize", x, g.constant(np.float32(1)),
                                                     g.constant(np.array(0, np.float32).astype(ml_dtypes.float8_e4m3fn)),
                                                     to="f8E4M3FN"))
    assert "blocks of 32 must be (4, 2)" in _bad(
        lambda g, x: g.op("quantize", x, g.weight("s", np.ones((4, 3), np.float32)), to="i8", block_size=32))
    assert "tg.matmul_integer" in _bad(lambda g, x: g.op("matmul_integer", x, x))


# --- formats: the rounding bound -------------------------------------------------------

# float32 arithmetic around the rounding (x / scale, then q * scale) adds a few units of
# float32's roundoff, relative to |x|, on top of the format's half ulp.
F32_SLACK = 4 * 2.0 ** -24

FLOATS = hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=70),
                    elements=st.floats(-1e4, 1e4, width=32))


def _check_bound(x, q_deq, fmt_name, scale_full):
    fmt = FORMATS[fmt_name]
    v = x.astype(np.float64) / scale_full
    bound = fmt.half_ulp(v) * scale_full + F32_SLACK * np.abs(x) + 1e-45
    err = np.abs(q_deq.astype(np.float64) - x)
    worst = np.argmax(err - bound)
    assert (err <= bound).all(), f"{fmt_name}: x={x.flat[worst]} came back as {q_deq.flat[worst]}, " \
                                 f"error {err.flat[worst]} > bound {bound.flat[worst]}"


@pytest.mark.parametrize("fmt", ["i8", "i4", "f8E4M3FN", "f8E5M2", "f6E2M3FN", "f4E2M1FN"])
@PROPERTY
@given(x=FLOATS)
@example(x=np.array([[448.0, -0.0, 1e-30, 3.0]], np.float32))
@example(x=np.array([[4.29e-43]], np.float32))  # a subnormal scale lost bits (ir.quant.MIN_SCALE)
def test_per_channel_round_trip_is_within_half_an_ulp_times_the_scale(fmt, x):
    f = FORMATS[fmt]
    amax = np.abs(x).max(axis=0)
    scale = absmax_scale(amax, f)
    q = quantize(x, scale, None, 1, 0, fmt, f.numpy)
    assert q.dtype == f.numpy
    # ml_dtypes is the reference conversion: the stored values are its roundings of x / scale
    np.testing.assert_array_equal(q.view(np.uint8), np.clip(np.rint(x / scale) if f.integer else x / scale, f.lo,
                                                            f.hi).astype(f.numpy).view(np.uint8))
    _check_bound(x, dequantize(q, scale, None, 1, 0, np.float32), fmt, np.broadcast_to(scale, x.shape))


@pytest.mark.parametrize("fmt", ["f8E4M3FN", "f6E2M3FN", "f4E2M1FN", "i8"])
@PROPERTY
@given(x=FLOATS)
def test_mx_blocks_of_32_round_trip_within_half_an_ulp_times_the_block_scale(fmt, x):
    f = FORMATS[fmt]
    k = x.shape[0]
    blocks = -(-k // MX_BLOCK)
    padded = np.zeros((blocks * MX_BLOCK, x.shape[1]), np.float32)
    padded[:k] = np.abs(x)
    amax = padded.reshape(blocks, MX_BLOCK, -1).max(axis=1)
    scale = mx_scale(amax, f)
    assert scale.dtype == ml_dtypes.float8_e8m0fnu
    q = quantize(x, scale, None, 0, MX_BLOCK, fmt, f.numpy)
    full = np.repeat(scale.astype(np.float64), MX_BLOCK, axis=0)[:k]
    _check_bound(x, dequantize(q, scale, None, 0, MX_BLOCK, np.float32), fmt, full)


@PROPERTY
@given(x=FLOATS, to=st.sampled_from(["i8", "ui8", "i4"]))
def test_asymmetric_round_trip_is_within_half_a_step(x, to):
    f = FORMATS[to]
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = np.float32(max(hi - lo, 1e-30) / (f.hi - f.lo))
    zp = np.array(np.clip(np.rint(f.lo - lo / scale), f.lo, f.hi)).astype(f.numpy)
    q = quantize(x, scale, zp, 1, 0, to, f.numpy)
    back = dequantize(q, scale, zp, 1, 0, np.float32)
    assert (np.abs(back.astype(np.float64) - x) <= 0.5 * scale * (1 + 1e-5) + F32_SLACK * np.abs(x) + 1e-30).all()


# --- integer GEMM ------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 4), k=st.sampled_from([1, 7, 1024, 1025, 2100]), n=st.integers(1, 5),
       seed=st.integers(0, 2 ** 32 - 1), zero_point=st.one_of(st.none(), st.integers(0, 255)))
def test_matmul_integer_is_the_exact_integer_product(m, k, n, seed, zero_point):
    rng = np.random.default_rng(seed)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    if zero_point is None:
        a = rng.choice(np.array([-128, 127], np.int8), (m, k))  # the extremes: every chunk at its bound
        want = a.astype(np.int64) @ b.astype(np.int64)
        got = matmul_integer(a, b, None)
    else:
        a = rng.choice(np.array([0, 255], np.uint8), (m, k))
        want = (a.astype(np.int64) - zero_point) @ b.astype(np.int64)
        got = matmul_integer(a, b, np.uint8(zero_point))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


# --- per-channel vs per-tensor ------------------------------------------------------------


@PROPERTY
@given(w=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=40),
                    elements=st.floats(-100, 100, width=32)),
       fmt=st.sampled_from(["i8", "i4", "f8E4M3FN", "f4E2M1FN"]), group=st.sampled_from([0, 4, 32]))
@example(w=np.array([[1.0, 127.0], [3.0, 0.0]], np.float32), fmt="i8", group=0)  # per tensor exact on column 0
@example(w=np.array([[31.0, 38.0], [11.0, 11.0]], np.float32), fmt="i4", group=0)  # per tensor's clipping won
def test_finer_granularity_is_never_worse_than_per_tensor_with_the_mse_observer(w, fmt, group):
    from tilegraph.passes.quantize import _round_trip, weight_scale

    f = FORMATS[fmt]

    def sq_error(granularity, size=0):
        scale = weight_scale(w, f, granularity, size, False, "mse")
        return float(np.sum((_round_trip(w, scale, f, granularity, size).astype(np.float64) - w) ** 2))

    per_tensor = sq_error("tensor")
    finer = sq_error("group", group) if group else sq_error("channel")
    assert finer <= per_tensor * (1 + 1e-9) + 1e-30


# --- the quantize pass ---------------------------------------------------------------------

from tilegraph.passes.quantize import SCHEMES, Quantize, QuantizeError, observe_ranges, save_ranges  # noqa: E402
from tilegraph.passes.registry import run_pipeline  # noqa: E402
from tilegraph.testing import (assert_close, assert_within_quantization_bound, graphs,  # noqa: E402
                               rounding_violations)


def mlp(k=64, hidden=96, out=10, seed=0, first="fc1.weight"):
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", ("B", k))
    h = g.op("gelu", x @ g.weight(first, rng.standard_normal((k, hidden)).astype(np.float32) * 0.2)
             + g.weight("fc1.bias", rng.standard_normal(hidden).astype(np.float32) * 0.1))
    y = h @ g.weight("fc2.weight", rng.standard_normal((hidden, out)).astype(np.float32) * 0.2)
    return g.build(y, names=["logits"])


EXPECTED_OPS = {"w8": {"dequantize"}, "w4a16": {"dequantize"}, "mxfp4": {"dequantize"},
                "w8a8": {"dynamic_quantize", "matmul_integer", "dequantize"},
                "fp8": {"dynamic_quantize", "dequantize"}, "mxfp8": {"dynamic_quantize", "dequantize"}}
WEIGHT_TYPES = {"w8": "i8", "w4a16": "i4", "mxfp4": "f4E2M1FN", "w8a8": "i8", "fp8": "f8E4M3FN", "mxfp8": "f8E4M3FN"}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_each_scheme_stores_its_weight_type_and_keeps_its_bound(scheme):
    model = mlp()
    after = assert_within_quantization_bound(f"quantize{{scheme={scheme}}}", model,
                                             [np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)])
    ops = {op.op_name for op in after.func.walk() if hasattr(op, "op_name")}
    assert EXPECTED_OPS[scheme] <= ops
    assert ("matmul_integer" in ops) == (scheme == "w8a8")  # real int8 GEMM only where NumPy has one
    for name in ("fc1.weight", "fc2.weight"):
        assert name not in after.weights
        assert str(after.weights[name + ".q"].dtype) == str(np.dtype(
            __import__("tilegraph.ir.dtypes", fromlist=["x"]).numpy_dtype(WEIGHT_TYPES[scheme])))
    before, now = model.weights.nbytes(), after.weights.nbytes()
    assert now < before / (6 if scheme in ("w4a16", "mxfp4") else 3.5)  # scales and the f32 bias stay


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=graphs(ops=("matmul", "add", "mul", "relu", "gelu", "reshape", "transpose", "softmax"), max_ops=8))
def test_every_scheme_keeps_its_stated_bound_on_random_graphs(scheme, model):
    assert_within_quantization_bound(f"quantize{{scheme={scheme}}}", model)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_the_numpy_backend_computes_what_the_interpreter_computes_on_quantized_models(scheme):
    """The quantized values are the same in both (x / scale rounds in float32 in both); the
    arithmetic around them differs by float32 rounding only. One layer: its input quantizes
    identically in both, so nothing downstream can sit on the other side of a rounding edge."""
    import tilegraph

    g = Graph()
    x = g.input("x", ("B", 96))
    model = g.build(x @ g.weight("w", np.random.default_rng(2).standard_normal((96, 24)).astype(np.float32)))
    q = run_pipeline(model, f"quantize{{scheme={scheme}}}")
    xin = np.random.default_rng(3).standard_normal((7, 96)).astype(np.float32)
    got = tilegraph.compile(q)(xin)
    assert_close(got, interpret(q, [xin])[0], "f32", 96, name=f"{scheme} NumPy backend")


def test_embedding_tables_are_stored_in_int8_per_row_and_keep_the_bound():
    rng = np.random.default_rng(5)
    g = Graph()
    ids = g.input("ids", ("B", "S"), "i64")
    h = g.gather(g.weight("emb", rng.standard_normal((50, 16)).astype(np.float32)), ids)
    model = g.build(h @ g.weight("proj", rng.standard_normal((16, 8)).astype(np.float32)))
    inputs = [rng.integers(0, 50, (3, 5))]
    after = assert_within_quantization_bound("quantize{scheme=w4a16}", model, inputs)
    assert after.weights["emb.q"].dtype == np.int8 and after.weights["emb.scale"].shape == (50, 1)
    one = assert_within_quantization_bound("quantize{scheme=w8a8 granularity=tensor}", model, inputs)
    assert one.weights["emb.scale"].shape == ()
    kept = run_pipeline(model, "quantize{scheme=w4a16 embeddings=false}")
    assert kept.weights["emb"].dtype == np.float32
    # `formats` names a table or a layer: none keeps it float, a scheme overrides `scheme`.
    float_table = assert_within_quantization_bound('quantize{scheme=w4a16 formats="emb=none,proj=w8"}', model, inputs)
    assert float_table.weights["emb"].dtype == np.float32 and float_table.weights["proj.q"].dtype == np.int8
    float_layer = run_pipeline(model, 'quantize{scheme=w4a16 formats="proj=none"}')
    assert float_layer.weights["proj"].dtype == np.float32 and float_layer.weights["emb.q"].dtype == np.int8


def test_one_row_looked_up_by_a_scalar_index_is_dequantized_by_its_row_scale():
    """gather(T, i) with i a scalar drops the row axis: the row's one scale is a scalar."""
    rng = np.random.default_rng(6)
    g = Graph()
    table = g.weight("emb", rng.standard_normal((7, 5)).astype(np.float32))
    model = g.build(g.gather(table, g.constant(np.int64(3))) * g.input("x", (5,)))
    after = assert_within_quantization_bound("quantize{scheme=w8a8}", model, [rng.standard_normal(5).astype(np.float32)])
    assert after.weights["emb.q"].dtype == np.int8


def test_calibrated_w8a8_uses_static_scales_and_keeps_its_bound(tmp_path):
    model = mlp()
    rng = np.random.default_rng(4)
    batches = [[rng.standard_normal((8, 64)).astype(np.float32)] for _ in range(3)]
    for observer in ("minmax", "percentile", "mse"):
        ranges = observe_ranges(model, batches, observer)
        assert set(ranges) == {"fc1.weight", "fc2.weight"}
        path = save_ranges(tmp_path / f"{observer}.npz", ranges)
        for symmetric in ("false", "true"):
            spec = f'quantize{{scheme=w8a8 calib="{path}" symmetric={symmetric}}}'
            after = assert_within_quantization_bound(spec, model, batches[0])
            ops = [op.op_name for op in after.func.walk() if hasattr(op, "op_name")]
            assert "dynamic_quantize" not in ops and ops.count("matmul_integer") == 2
    lo, hi = observe_ranges(model, batches, "percentile", percentile=90.0)["fc1.weight"]
    mlo, mhi = observe_ranges(model, batches, "minmax")["fc1.weight"]
    assert mlo < lo < 0 < hi < mhi  # percentile clips what min/max keeps


def test_quantize_model_is_the_calibrated_pass_the_command_runs(tmp_path):
    """The library entry point: calibrating where the scheme quantizes activations gives the
    model the pass makes from a saved calibration, and a weight-only scheme calibrates nothing."""
    from tilegraph.passes.quantize import quantize_model

    model = mlp()
    rng = np.random.default_rng(5)
    batches = [[rng.standard_normal((8, 64)).astype(np.float32)] for _ in range(2)]
    got = quantize_model(model, "w8a8", batches=batches)
    assert got.layers == 2 and set(got.ranges) == {"fc1.weight", "fc2.weight"} and got.plan is None
    path = save_ranges(tmp_path / "calib.npz", observe_ranges(model, batches))
    by_pass = run_pipeline(model, f'quantize{{scheme=w8a8 calib="{path}"}}')
    assert str(got.model.module) == str(by_pass.module) and got.model.weights.keys() == by_pass.weights.keys()
    for name, w in by_pass.weights.items():
        np.testing.assert_array_equal(got.model.weights[name], w)
    assert quantize_model(model, "w8", batches=batches).ranges is None
    with pytest.raises(QuantizeError, match="need calibration batches"):
        quantize_model(model, "w8", rounding="gptq")


def test_a_broken_rounding_is_caught_by_the_bound_check():
    """The checks can fail: a dequantize reading another scale than its quantize breaks the
    half-ulp bound, and a stored weight off by one step breaks the match with the reference."""
    g = Graph()
    x = g.input("x", (2, 8))
    q = g.op("quantize", x, g.constant(np.float32(0.01)), to="i8")
    model = g.build(g.op("dequantize", q, g.constant(np.float32(0.02))))
    assert rounding_violations(model, [np.full((2, 8), 0.5, np.float32)])

    class Broken(Quantize):
        def apply(self, ctx, op):
            super().apply(ctx, op)
            store = __import__("tilegraph.ir.model", fromlist=["x"]).weights_of(op)
            store["fc2.weight.q"] = (store["fc2.weight.q"].astype(np.int16) // 2).astype(np.int8)

    with pytest.raises(AssertionError, match="against the fake-quantized reference"):
        assert_within_quantization_bound([Broken(scheme="w8")], mlp(), [np.ones((2, 64), np.float32)])


def test_bad_options_are_named_errors():
    from tilegraph.passes.registry import parse_pipeline

    for spec, words in [("quantize{scheme=int3}", "unknown scheme 'int3'"),
                        ("quantize{observer=percentile}", "percentile is for calibrated activations"),
                        ("quantize{scheme=mxfp4 group-size=64}", "MX blocks of 32"),
                        ('quantize{calib="/nonexistent.npz"}', "no calibration file"),
                        ('quantize{formats="proj=int3"}', "'proj=int3' is not layer=scheme")]:
        with pytest.raises(QuantizeError, match=words):
            Quantize.resolved(parse_pipeline(spec)[0])


# --- the command line ----------------------------------------------------------------------

EXAMPLE_ONNX = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "tiny_encoder.onnx"


def _cli(argv, capsys):
    from tilegraph.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_quantize_calibrates_with_a_progress_bar_and_compile_reports_weight_bytes(tmp_path, capsys):
    import tilegraph

    model = tilegraph.import_model(EXAMPLE_ONNX)
    rng = np.random.default_rng(0)
    samples = {}
    for name, info in zip(model.input_names, model.inputs):
        shape = (12,) + tuple(d if isinstance(d, int) else 6 for d in info.shape[1:])
        samples[name] = rng.integers(0, 2, shape).astype(np.int64) if info.dtype == "i64" else \
            rng.standard_normal(shape).astype(np.float32)
    np.savez(tmp_path / "samples.npz", **samples)
    out = tmp_path / "enc_q.mlir"
    code, stdout, err = _cli(["quantize", EXAMPLE_ONNX, "--calib", tmp_path / "samples.npz", "--scheme", "w8a8",
                              "--batch-size", "4", "-o", out], capsys)
    assert code == 0, err
    assert "calibrating" in err and "3/3" in err  # the progress bar, 12 samples in batches of 4
    assert "activations calibrated by minmax" in stdout
    quantized = Model.load(out)
    assert "tg.matmul_integer" in quantized.text and (tmp_path / "enc_q.calib.npz").is_file()
    code, stdout, err = _cli(["compile", out, "-o", tmp_path / "enc_q_np.py", "--report"], capsys)
    assert code == 0, err
    from tilegraph.cli.common import format_count

    line = next(l for l in stdout.splitlines() if l.startswith("weights:"))
    after, before = quantized.weights.nbytes(), model.weights.nbytes()
    assert f"{format_count(after)}B (before the passes" in line and after < 0.6 * before  # embeddings stay f32


def test_cli_quantize_bad_calibration_file_is_one_paragraph_and_writes_nothing(tmp_path, capsys):
    np.savez(tmp_path / "bad.npz", nothing=np.zeros((3, 4), np.float32))
    code, out, err = _cli(["quantize", EXAMPLE_ONNX, "--calib", tmp_path / "bad.npz", "-o", tmp_path / "q.mlir"],
                          capsys)
    assert code == 2 and "Traceback" not in err and "has no array for input(s)" in err
    assert not list(tmp_path.glob("q.*"))


@settings(max_examples=60, deadline=None)
@given(lo=st.floats(-1e3, 0.0, allow_subnormal=False), hi=st.floats(0.0, 1e3, allow_subnormal=False))
@example(lo=-0.99999, hi=0.99999)  # both ends half a step off the grid: they rounded out to 256
def test_an_asymmetric_activation_range_maps_its_ends_onto_the_ui8_range(lo, hi):
    """Static asymmetric int8 activations are ui8 with a zero point: the range's ends (and 0) must
    land in [0, 255] and come back within one step, as onnxruntime's static quantization maps them."""
    from tilegraph.passes.quantize.observers import activation_params

    if hi - lo < 1e-3:
        return
    scale, zp, storage = activation_params((lo, hi), "i8", symmetric=False)
    assert storage == "ui8" and zp is not None
    for x in (lo, 0.0, hi):
        q = np.rint(np.float64(x) / float(scale)) + int(zp)
        assert -0.5 <= q <= 255.5, (x, q)
        assert abs((np.clip(q, 0, 255) - int(zp)) * float(scale) - x) <= float(scale), x
