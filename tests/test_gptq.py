"""GPTQ rounding (passes/gptq.py, `quantize{rounding=gptq}`):

* its weights are on the format's grid: dequantize(quantize(W_gptq)) == W_gptq, for every
  weight scheme's format and granularity, so the storage format is unchanged;
* it never does worse than round to nearest on the layer's calibration output error
  trace((W - Q)^T H (W - Q)), and on correlated inputs it does much better;
* its fast row rounding is ml_dtypes' round to nearest even;
* the Ledoit-Wolf estimate of X^T X / n is scikit-learn's;
* the pass with rounding=gptq keeps its stated bound (the model equals its fake-quantized
  reference) and lowers the model's output error on the calibration inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tilegraph.ir.quant import FORMATS, MX_BLOCK, dequantize, quantize
from tilegraph.passes.gptq import _round_rows, gptq, hessians, ledoit_wolf, output_error
from tilegraph.passes.quantize import SCHEMES, QuantizeError, Quantize, relative_error, save_hessians, weight_scale
from tilegraph.passes.registry import run_pipeline
from tests.test_quantize import mlp
from tilegraph.testing import assert_within_quantization_bound

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WEIGHT_SCHEMES = sorted(SCHEMES)


def _layer(seed: int, k: int, n: int, rows: int, correlated: float):
    """A weight [k, n] and the H of `rows` inputs whose features share `correlated` of a few common factors
    and have scales spread over two decades (as transformer activations do)."""
    rng = np.random.default_rng(seed)
    factors = rng.standard_normal((rows, 4)) @ rng.standard_normal((4, k))
    x = (correlated * factors + rng.standard_normal((rows, k))) * np.exp(rng.uniform(-2.3, 0, k))
    w = (rng.standard_normal((k, n)) * rng.choice([0.02, 0.2], (k, n), p=[0.9, 0.1])).astype(np.float32)
    return w, x.T @ x / rows


def _run(scheme: str, w, h, observer="minmax", act_order=False):
    s = Quantize(scheme).resolved()
    fmt = FORMATS[s.weight]
    out, scale = gptq(w, h, fmt, s.granularity, s.group_size,
                      lambda x, gran: weight_scale(x, fmt, gran, s.group_size, s.mx, observer), act_order=act_order)
    return s, fmt, out, scale


def _nearest(s, fmt, w, observer="minmax"):
    scale = weight_scale(w, fmt, s.granularity, s.group_size, s.mx, observer)
    axis, bs = (0, s.group_size) if s.granularity == "group" else (1, 0)
    return dequantize(quantize(w, scale, None, axis, bs, fmt.name, fmt.numpy), scale, None, axis, bs, np.float32)


@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
@PROPERTY
@given(seed=st.integers(0, 2**31), k=st.integers(1, 160), n=st.integers(1, 12), rows=st.integers(1, 80),
       correlated=st.sampled_from([0.0, 1.0, 5.0]), act_order=st.booleans(), observer=st.sampled_from(["minmax", "mse"]))
def test_gptq_weights_are_on_the_grid_and_never_worse_than_round_to_nearest(scheme, seed, k, n, rows, correlated,
                                                                           act_order, observer):
    w, h = _layer(seed, k, n, rows, correlated)
    s, fmt, out, scale = _run(scheme, w, h, observer, act_order)
    axis, bs = (0, s.group_size) if s.granularity == "group" else (1, 0)
    q = quantize(out, scale, None, axis, bs, fmt.name, fmt.numpy)
    np.testing.assert_array_equal(dequantize(q, scale, None, axis, bs, np.float32), out)
    if s.mx:
        assert np.asarray(scale).shape == (-(-k // MX_BLOCK), n) and str(np.asarray(scale).dtype) == "float8_e8m0fnu"
    assert output_error(w, out, h) <= output_error(w, _nearest(s, fmt, w, observer), h)


@pytest.mark.parametrize("scheme", ["mxfp4", "w4a16", "w8"])
def test_gptq_halves_the_output_error_of_round_to_nearest_on_correlated_inputs(scheme):
    w, h = _layer(3, 256, 64, 512, 5.0)
    s, fmt, out, _ = _run(scheme, w, h)
    assert output_error(w, out, h) < 0.5 * output_error(w, _nearest(s, fmt, w), h)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), fmt=st.sampled_from(sorted(FORMATS)), spread=st.sampled_from([1.0, 1e3, 1e6]))
def test_fast_row_rounding_is_round_to_nearest_even_of_ml_dtypes(seed, fmt, spread):
    f = FORMATS[fmt]
    if f.lo >= 0:  # ui8 is for activations with a zero point; weights are symmetric
        return
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, 33)) * spread ** rng.uniform(-1, 1, (4, 33))).astype(np.float32)
    x[0, :6] = [0.25, 0.75, 1.25, 2.5, 5.0, -3.5]  # ties of the 4-bit grids
    scale = np.abs(x).max(axis=0).astype(np.float32) / np.float32(f.hi) * np.float32(0.8)
    scale[:2] = 1.0
    want = dequantize(quantize(x, scale, None, 1, 0, fmt, f.numpy), scale, None, 1, 0, np.float32)
    np.testing.assert_array_equal(_round_rows(x, scale, f), want)


def test_ledoit_wolf_is_scikit_learns_shrinkage():
    from sklearn.covariance import ledoit_wolf as sk_ledoit_wolf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((30, 50)) * np.linspace(0.1, 3, 50)
    ours = ledoit_wolf(x.T @ x, 30, float(np.sum(np.einsum("ij,ij->i", x, x) ** 2)))
    theirs, _ = sk_ledoit_wolf(x, assume_centered=True)
    np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)


def test_the_pass_with_gptq_keeps_its_bound_and_lowers_the_calibration_error(tmp_path):
    model = mlp(k=64, hidden=96)
    rng = np.random.default_rng(4)
    base = rng.standard_normal((8, 64))
    batches = [[(rng.standard_normal((64, 8)) @ base + 0.3 * rng.standard_normal((64, 64))).astype(np.float32)]
               for _ in range(3)]
    path = save_hessians(tmp_path / "h.npz", hessians(model, batches))
    for scheme in ("mxfp4", "w4a16"):
        spec = f'quantize{{scheme={scheme} rounding=gptq hessians="{path}"}}'
        q = assert_within_quantization_bound(spec, model, batches[0])
        nearest = relative_error(model, run_pipeline(model, f"quantize{{scheme={scheme}}}"), batches)
        assert relative_error(model, q, batches) < 0.8 * nearest


def test_gptq_without_or_with_a_wrong_hessians_file_is_a_named_error(tmp_path):
    with pytest.raises(QuantizeError, match="needs hessians"):
        Quantize("mxfp4", rounding="gptq")
    with pytest.raises(QuantizeError, match="unknown rounding"):
        Quantize("mxfp4", rounding="stochastic")
    np.savez(tmp_path / "h.npz", **{"fc1.weight": np.eye(3, dtype=np.float32)})
    with pytest.raises(QuantizeError, match="fc1.weight.*its weight has 64 rows"):
        run_pipeline(mlp(), f'quantize{{scheme=mxfp4 rounding=gptq hessians="{tmp_path / "h.npz"}"}}')


def test_cli_quantize_rounds_by_gptq_from_the_calibration_samples_and_refuses_without_them(tmp_path, capsys):
    import tilegraph
    from tilegraph.ir import Model
    from tests.test_quantize import EXAMPLE_ONNX, _cli

    model = tilegraph.import_model(EXAMPLE_ONNX)
    rng = np.random.default_rng(0)
    samples = {name: rng.integers(0, 2, (8,) + tuple(d if isinstance(d, int) else 6 for d in info.shape[1:]))
               .astype(np.int64) if info.dtype == "i64" else
               rng.standard_normal((8,) + tuple(d if isinstance(d, int) else 6 for d in info.shape[1:]))
               .astype(np.float32) for name, info in zip(model.input_names, model.inputs)}
    np.savez(tmp_path / "samples.npz", **samples)
    code, out, err = _cli(["quantize", EXAMPLE_ONNX, "--scheme", "mxfp4", "--rounding", "gptq", "-o",
                           tmp_path / "q.mlir"], capsys)
    assert code == 2 and "--rounding gptq needs --calib" in err and not list(tmp_path.glob("q.*"))
    code, out, err = _cli(["quantize", EXAMPLE_ONNX, "--scheme", "mxfp4", "--rounding", "gptq", "--act-order",
                           "--calib", tmp_path / "samples.npz", "-o", tmp_path / "q.mlir"], capsys)
    assert code == 0, err
    assert "gptq inputs" in err and "tg.dequantize" in Model.load(tmp_path / "q.mlir").text
