"""The command line: each command works on the bundled model, and every bad input is
one paragraph on stderr with exit status 2, never a traceback."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tilegraph.ir import Graph, Model
from tilegraph.cli import main as tilegraph_main
from tilegraph.opt import main as opt_main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_encoder.onnx"


def small_model(tmp_path) -> Path:
    g = Graph()
    x = g.input("x", ("B", 4))
    w = g.weight("w", np.eye(4, dtype=np.float32))
    y = g.softmax(g.relu(x @ w + 0.0))
    return g.build(y, names=["y"]).save(tmp_path / "small.mlir")


def run(main, argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(code, err, *needles):
    assert code == 2
    assert "Traceback" not in err
    assert err.startswith("tilegraph")
    for n in needles:
        assert n in err, err


def test_import_writes_ir_and_weights_beside_it(tmp_path, capsys):
    code, out, _ = run(tilegraph_main, ["import", EXAMPLE, "-o", tmp_path / "enc.mlir"], capsys)
    assert code == 0
    text = (tmp_path / "enc.mlir").read_text()
    assert "tg.matmul" in text and '"batch"' in text  # symbolic dims survive
    assert (tmp_path / "enc.weights.npz").is_file()
    assert len(text) < 50_000  # weights never land in the text
    Model.load(tmp_path / "enc.mlir")


def test_compile_writes_readable_numpy(tmp_path, capsys):
    code, _, _ = run(tilegraph_main, ["compile", EXAMPLE, "--target", "numpy", "-o", tmp_path / "enc_np.py"], capsys)
    assert code == 0
    source = (tmp_path / "enc_np.py").read_text()
    assert "np.matmul" in source and "def forward" in source


def test_compile_writes_a_triton_module_that_runs(tmp_path, capsys):
    out_path = tmp_path / "enc_triton.py"
    code, out, _ = run(tilegraph_main, ["compile", EXAMPLE, "--target", "triton", "-o", out_path, "--report"], capsys)
    assert code == 0
    source = out_path.read_text()
    assert source.count("@triton.jit") >= 5 and "KERNELS = {" in source and "def forward" in source
    kernels = [line for line in out.splitlines() if line.startswith("  fusion_")]
    assert len(kernels) == source.count("@triton.jit")  # the report names every kernel
    assert "attention: attention" in out  # the encoder's attention became one flash kernel
    assert "ops on the host (no kernel covers them): none" in out
    # The written module runs as is (here in Triton's interpreter) and agrees with the interpreter.
    from tilegraph.backends.triton import load
    from tilegraph.ir.interpreter import interpret
    from tilegraph.ir.model import WeightStore
    from tilegraph.testing import assert_close, random_inputs

    import tilegraph

    reference = tilegraph.import_model(EXAMPLE)
    ids, _ = random_inputs(reference, sizes={"batch": 2, "seq": 8})
    mask = np.ones((2, 8), np.int64)
    mask[1, 5:] = 0  # a padded sequence: the mask is 0 or 1
    inputs = [ids, mask]
    compiled = load(source, WeightStore.load(out_path.with_suffix(".weights.npz")))
    for got, want, info in zip(compiled(*inputs), interpret(reference, inputs), reference.outputs):
        assert_close(got, want, info.dtype, 64)


# --- compile --target triton: the written file, and explicit pipelines ---

def test_written_triton_file_imports_and_runs_as_a_plain_module(tmp_path, capsys):
    """`-o model_triton.py` is an ordinary Python module: imported from its path (tilegraph
    first, which picks Triton's interpreter without a GPU), it holds one @triton.jit function
    per KERNELS entry, and build() + forward() over the saved weights agree with the interpreter."""
    import importlib.util

    import torch

    import tilegraph  # noqa: F401 - before the module imports triton
    from tilegraph.backends.triton.runtime import to_torch
    from tilegraph.ir.interpreter import interpret
    from tilegraph.ir.model import WeightStore
    from tilegraph.testing import assert_close, random_inputs

    out_path = tmp_path / "model_triton.py"
    code, _, _ = run(tilegraph_main, ["compile", EXAMPLE, "--target", "triton", "-o", out_path], capsys)
    assert code == 0
    spec = importlib.util.spec_from_file_location(f"model_triton_{tmp_path.name}", out_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    jitted = {name for name, value in vars(module).items() if name.endswith("_kernel") and hasattr(value, "fn")}
    assert jitted and jitted == set(module.KERNELS)
    weights = WeightStore.load(out_path.with_suffix(".weights.npz"))
    cpu = torch.device("cpu")
    forward = module.build({name: to_torch(weights[name], cpu) for name in module.WEIGHTS}, cpu)
    reference = tilegraph.import_model(EXAMPLE)
    ids, _ = random_inputs(reference, seed=1, sizes={"batch": 1, "seq": 6})
    mask = np.ones((1, 6), np.int64)
    mask[0, 4:] = 0
    outs = forward(torch.from_numpy(ids), torch.from_numpy(mask))
    for got, want, info in zip(outs, interpret(reference, [ids, mask]), reference.outputs):
        assert_close(got.numpy(), want, info.dtype, 64)


def test_explicit_pipeline_for_triton_still_fuses_and_tiles_for_the_gpu(tmp_path, capsys):
    """`-p` without a target option: fuse and tile decide for the Triton backend's GPU (several
    ranked candidates per GEMM for the autotuner), not for the CPU (one configuration)."""
    from tilegraph.backends.triton import HARDWARE

    argv = ["compile", EXAMPLE, "--target", "triton", "-p", "canonicalize,cse,fuse,tile", "-o",
            tmp_path / "enc.py", "--report"]
    code, out, _ = run(tilegraph_main, argv, capsys)
    assert code == 0
    assert f"fused and tiled for: {HARDWARE}" in out
    candidates = [int(line.rsplit(";", 1)[1].split()[0]) for line in out.splitlines() if line.startswith("  fusion_")]
    assert max(candidates) > 1


def test_unknown_target_is_a_clean_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        tilegraph_main(["compile", str(EXAMPLE), "--target", "cuda", "-o", str(tmp_path / "x.py")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'cuda'" in err and "triton" in err and "Traceback" not in err
    assert not (tmp_path / "x.py").exists()


def test_check_agrees_with_onnxruntime(capsys):
    code, out, _ = run(tilegraph_main, ["check", EXAMPLE, "--dim", "batch=2", "--dim", "seq=8"], capsys)
    assert code == 0, out
    assert "last_hidden_state" in out and "agree" in out


def test_opt_prints_ir_after_each_change(tmp_path, capsys):
    path = small_model(tmp_path)
    code, out, _ = run(opt_main, [path, "-p", "canonicalize,decompose", "--print-ir-after-change"], capsys)
    assert code == 0
    assert "IR after decompose" in out
    assert "tg.softmax" not in out.split("IR after decompose")[1]  # decomposed
    assert "tg.reduce_max" in out


def test_opt_prints_ir_after_every_pass_changed_or_not(tmp_path, capsys):
    path = small_model(tmp_path)
    code, out, _ = run(opt_main, [path, "-p", "cse,dce,decompose", "--print-ir-after-all"], capsys)
    assert code == 0
    assert [line for line in out.splitlines() if "IR after" in line] == [
        f"// -----// IR after {name} //----- //" for name in ("cse", "dce", "decompose")]


def test_opt_writes_output_with_weights(tmp_path, capsys):
    path = small_model(tmp_path)
    code, _, _ = run(opt_main, [path, "-p", "decompose", "-o", tmp_path / "out.mlir"], capsys)
    assert code == 0
    assert Model.load(tmp_path / "out.mlir").weights.keys() == {"w"}


@pytest.mark.parametrize("command", [["import", "{missing}", "-o", "{tmp}/x.mlir"],
                                     ["compile", "{missing}", "-o", "{tmp}/x.py"],
                                     ["check", "{missing}"]])
def test_missing_file_is_a_clean_error(tmp_path, capsys, command):
    argv = [a.format(missing=tmp_path / "nope.onnx", tmp=tmp_path) for a in command]
    code, _, err = run(tilegraph_main, argv, capsys)
    assert_clean_error(code, err, "nope.onnx")


def test_malformed_mlir_is_a_clean_error(tmp_path, capsys):
    bad = tmp_path / "bad.mlir"
    bad.write_text("builtin.module {\n  func.func @forward( {\n}\n")
    code, _, err = run(opt_main, [bad, "-o", tmp_path / "out.mlir"], capsys)
    assert_clean_error(code, err, "bad.mlir")
    assert not (tmp_path / "out.mlir").exists()
    code, _, err = run(tilegraph_main, ["compile", bad, "-o", tmp_path / "x.py"], capsys)
    assert_clean_error(code, err, "bad.mlir")
    assert not (tmp_path / "x.py").exists()


def test_shape_mismatch_in_mlir_names_the_op(tmp_path, capsys):
    path = small_model(tmp_path)
    lines = path.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if "tg.matmul" in line)
    lines[i] = lines[i].replace("?x4xf32", "?x5xf32")
    path.write_text("\n".join(lines))
    code, _, err = run(opt_main, [path], capsys)
    assert_clean_error(code, err, "tg.matmul")


def test_unsupported_onnx_ops_are_listed_together(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("DeformConv", ["x", "x", "x"], ["a"], name="deform0"),
             helper.make_node("RoiAlign", ["x", "x", "x"], ["b"], name="roi0")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    path = tmp_path / "unsupported.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    code, _, err = run(tilegraph_main, ["import", path, "-o", tmp_path / "u.mlir"], capsys)
    assert_clean_error(code, err, "DeformConv", "RoiAlign")
    assert not (tmp_path / "u.mlir").exists()


def test_unknown_pass_is_a_clean_error(tmp_path, capsys):
    code, _, err = run(opt_main, [small_model(tmp_path), "-p", "canonicalize,no-such-pass"], capsys)
    assert_clean_error(code, err, "no-such-pass")


def test_entry_points_are_installed():
    bindir = Path(sys.executable).parent
    for tool in ("tilegraph", "tilegraph-opt"):
        result = subprocess.run([bindir / tool, "--help"], capture_output=True, text=True)
        assert result.returncode == 0 and "usage" in result.stdout


def test_shard_plans_from_a_configuration_without_weights(tmp_path, capsys):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=512)))
    code, out, err = run(tilegraph_main, ["shard", "--config", config, "--mesh", "8", "--hardware", "h100",
                                          "--dim", "B=8", "--dim", "S=1024", "--no-progress"], capsys)
    assert code == 0, err
    assert "config.json on" in out and "predicted step time" in out


def test_shard_config_bad_input_is_a_named_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    code, _, err = run(tilegraph_main, ["shard", "--config", bad], capsys)
    assert_clean_error(code, err, "not an object")
    code, _, err = run(tilegraph_main, ["shard", "--config", "llama-9000"], capsys)
    assert_clean_error(code, err, "not a named shape", "llama-7b")
    code, _, err = run(tilegraph_main, ["shard", small_model(tmp_path), "--config", "llama-7b"], capsys)
    assert_clean_error(code, err, "give exactly one")
    code, _, err = run(tilegraph_main, ["shard"], capsys)
    assert_clean_error(code, err, "give exactly one")
