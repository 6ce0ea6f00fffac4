"""Mixed precision against the cost model (passes.quantize.mixed_precision):

* the cost model prices quantized layers as each target runs them: on the GPUs an 8-bit GEMM
  (w8a8 on int8, fp8) is predicted faster than the float one, weight-only schemes never slower;
  on the NumPy CPU backend dequantizing every call is predicted slower than float;
* the chosen formats keep the measured error within the budget (max error, min cosine), and
  a tighter budget never predicts a faster model; each layer gets a remark saying why.
"""

from __future__ import annotations

import numpy as np
import pytest

from tilegraph.passes.cost.hardware import hardware
from tilegraph.passes.quantize import QuantizeError, Quantize, layer_time, mixed_precision
from tilegraph.passes.registry import run_pipeline
from tilegraph.passes.remarks import collect
from tests.test_quantize import mlp


def test_the_cost_model_prices_low_precision_gemms_by_target():
    h100, a100 = hardware("h100"), hardware("a100")
    for hw in (h100, a100):
        f32 = layer_time(8192, 1024, 4096, "none", hw)  # compute-bound (small ones: kernel launches)
        assert layer_time(8192, 1024, 4096, "w8a8", hw) < 0.5 * f32  # i8 tensor cores against f32
        assert layer_time(8192, 1024, 4096, "fp8", hw) < 0.5 * f32  # (A100: as bf16)
    # weight-only: the dequantize is the GEMM's prologue (no kernel of its own, fewer bytes read)
    assert layer_time(1, 4096, 4096, "w4a16", h100) <= layer_time(1, 4096, 4096, "none", h100)
    cpu = hardware("cpu")
    for scheme in ("mxfp4", "w4a16", "fp8"):  # the NumPy backend dequantizes the weight every call
        assert layer_time(256, 384, 1536, scheme, cpu) > layer_time(256, 384, 1536, "none", cpu)


def _data(seed=6):
    rng = np.random.default_rng(seed)
    return (mlp(k=256, hidden=512, out=256, first="onnx::MatMul_655"),
            [[rng.standard_normal((16, 256)).astype(np.float32)] for _ in range(2)])


@pytest.mark.parametrize("target", ["h100", "cpu"])
def test_mixed_precision_keeps_its_budget_and_says_why_each_layer_got_its_format(target):
    model, batches = _data()
    loose, tight = None, None
    for budget in (10.0, 0.02, 1e-9):
        with collect() as seen:
            # predicted at a serving batch (the GEMMs then outweigh kernel launches), measured on the batches
            plan = mixed_precision(model, batches, ["mxfp4", "w8a8"], max_error=budget, hardware=target,
                                   sizes={"B": 4096})
        assert plan.error <= budget or not any(f != "none" for f in plan.formats.values())
        assert len(plan.remarks) == 3 and plan.remarks[-1].startswith("all together")
        assert [r.message for r in seen] == plan.remarks
        assert all(("onnx::MatMul_655" in r or "fc2.weight" in r) for r in plan.remarks[:2])
        assert plan.predicted <= plan.predicted_f32
        q = run_pipeline(model, plan.pipeline)  # the pipeline is what was measured
        assert ("fc2.weight" in q.weights) == (plan.formats["fc2.weight"] == "none")
        loose = plan if loose is None else loose
        tight = plan
    if target == "h100":  # int8 and fp8 GEMMs save time there: the loose budget takes them
        assert loose.predicted < loose.predicted_f32 and "w8a8" in loose.formats.values()
    else:  # nothing is predicted faster on the NumPy backend: every layer stays float, and says so
        assert set(loose.formats.values()) == {"none"} and "no scheme is predicted faster" in loose.remarks[0]
    assert tight.predicted >= loose.predicted and set(tight.formats.values()) == {"none"}


def test_min_cosine_is_a_budget_too_and_bad_requests_are_named_errors():
    model, batches = _data()
    plan = mixed_precision(model, batches, ["mxfp4", "w8a8"], min_cosine=0.9999999, hardware="h100")
    assert plan.cosine >= 0.9999999 or set(plan.formats.values()) == {"none"}
    with pytest.raises(QuantizeError, match="accuracy budget"):
        mixed_precision(model, batches, ["w8a8"], hardware="h100")
    with pytest.raises(QuantizeError, match="unknown scheme"):
        mixed_precision(model, batches, ["int3"], max_error=0.1)
    with pytest.raises(QuantizeError, match="not layer=scheme"):
        Quantize("w8", formats="fc1.weight=int3")


def test_cli_mixed_precision_prints_why_and_refuses_an_unknown_target(tmp_path, capsys):
    import tilegraph
    from tests.test_quantize import EXAMPLE_ONNX, _cli

    model = tilegraph.import_model(EXAMPLE_ONNX)
    rng = np.random.default_rng(0)
    shape = {name: (8,) + tuple(d if isinstance(d, int) else 6 for d in info.shape[1:])
             for name, info in zip(model.input_names, model.inputs)}
    np.savez(tmp_path / "s.npz", **{name: rng.integers(0, 2, shape[name]).astype(np.int64) if info.dtype == "i64"
                                    else rng.standard_normal(shape[name]).astype(np.float32)
                                    for name, info in zip(model.input_names, model.inputs)})
    args = ["quantize", EXAMPLE_ONNX, "--calib", tmp_path / "s.npz", "--scheme", "mxfp4", "--fallback", "w8a8",
            "--min-cosine", "0.99", "-o", tmp_path / "q.mlir"]
    code, out, err = _cli(args + ["--hardware", "tpu"], capsys)
    assert code == 2 and "unknown hardware target 'tpu'" in err and not list(tmp_path.glob("q.*"))
    code, out, err = _cli(args + ["--hardware", "h100"], capsys)
    assert code == 0, err
    assert "all together:" in out and "predicted saving on h100" in out and (tmp_path / "q.mlir").is_file()


@pytest.mark.parametrize("flags, message", [
    (["--max-error", "0.1"], "--max-error and --min-cosine need --calib"),
    (["--rounding", "gptq"], "--rounding gptq needs --calib"),
    (["--calib", "s.npz", "--max-error", "-0.1"], "--max-error must be a relative error >= 0, got -0.1"),
    (["--calib", "s.npz", "--min-cosine", "1.5"], "--min-cosine must be a cosine similarity in [-1, 1], got 1.5"),
])
def test_cli_refuses_mixed_precision_and_gptq_flags_that_cannot_work_before_any_work(tmp_path, capsys, flags,
                                                                                     message):
    # s.npz does not exist: the flags are refused before the samples are read or the model imported.
    from tests.test_quantize import EXAMPLE_ONNX, _cli

    flags = [str(tmp_path / f) if f == "s.npz" else f for f in flags]
    code, out, err = _cli(["quantize", EXAMPLE_ONNX, "-o", tmp_path / "q.mlir", *flags], capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert not list(tmp_path.glob("q.*"))
