"""tilegraph.compile / import_model: the public face imports any source, runs passes, builds a backend.

What holds: a compiled model computes what the interpreter computes on the same
model; torch tensors are accepted as inputs; one output comes back bare, several
as a tuple; a bad target, a missing file or an unsupported object is a
TilegraphError that says what was wrong; `import tilegraph` pulls in neither
torch nor onnx.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tilegraph
from tilegraph.ir import Graph, Model, ModelError, TilegraphError, hardware, interpret
from tilegraph.testing import assert_close

WIDTH = 8


def mlp(outputs=1):
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", ("B", WIDTH))
    h = g.relu(x @ g.weight("fc1.weight", rng.standard_normal((WIDTH, WIDTH)).astype(np.float32))
               + g.weight("fc1.bias", rng.standard_normal(WIDTH).astype(np.float32)))
    probs = g.softmax(h)
    return g.build(probs, h, names=["probs", "hidden"]) if outputs == 2 else g.build(probs, names=["probs"])


def inputs(batch=3):
    return np.random.default_rng(1).standard_normal((batch, WIDTH)).astype(np.float32)


def test_compile_a_built_graph_matches_the_interpreter():
    model = mlp()
    compiled = tilegraph.compile(model, target="numpy")
    x = inputs()
    got = compiled(x)
    assert isinstance(got, np.ndarray) and got.shape == (3, WIDTH)
    assert_close(got, interpret(model, [x])[0], "f32", reduction_length=WIDTH)
    assert "def forward(x):" in compiled.source
    assert isinstance(compiled.model, Model) and compiled.input_names == ["x"]


def test_several_outputs_come_back_as_a_tuple_and_run_gives_a_list():
    compiled = tilegraph.compile(mlp(outputs=2))
    x = inputs()
    got = compiled(x)
    assert isinstance(got, tuple) and len(got) == 2
    listed = compiled.run(x)
    assert isinstance(listed, list) and len(listed) == 2
    for a, b in zip(got, listed):
        np.testing.assert_array_equal(a, b)
    assert compiled.output_names == ["probs", "hidden"]


def test_torch_tensors_are_accepted_as_inputs():
    torch = pytest.importorskip("torch")
    compiled = tilegraph.compile(mlp())
    x = inputs()
    from_torch = compiled(torch.from_numpy(x).requires_grad_(False))
    np.testing.assert_array_equal(from_torch, compiled(x))
    assert isinstance(from_torch, np.ndarray)


def test_bf16_torch_tensors_are_accepted_as_their_values():
    """NumPy has no bfloat16: a bf16 tensor arrives as ml_dtypes' bfloat16 with the same bits."""
    torch = pytest.importorskip("torch")
    from tilegraph.ir import dtypes

    g = Graph()
    model = g.build(g.op("cast", g.input("x", ("B", WIDTH), "bf16"), to="f32"), names=["y"])
    x = torch.from_numpy(inputs()).to(torch.bfloat16)
    out = tilegraph.compile(model)(x)
    np.testing.assert_array_equal(out, x.float().numpy())
    np.testing.assert_array_equal(out, tilegraph.compile(model)(x.float().numpy().astype(dtypes.numpy_dtype("bf16"))))


def test_no_passes_when_the_pipeline_is_empty():
    model = mlp()
    compiled = tilegraph.compile(model, pipeline="")
    assert compiled.model is model


def test_an_mlir_file_compiles(tmp_path):
    model = mlp()
    path = model.save(tmp_path / "mlp.mlir")
    compiled = tilegraph.compile(str(path))
    x = inputs(2)
    assert_close(compiled(x), interpret(model, [x])[0], "f32", reduction_length=WIDTH)


def test_a_bad_target_lists_the_targets():
    with pytest.raises(TilegraphError, match=r"unknown target 'cuda'.*numpy"):
        tilegraph.compile(mlp(), target="cuda")


def test_a_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere" / "model.onnx"
    with pytest.raises(ModelError, match=re.escape(str(path))):
        tilegraph.compile(str(path))
    with pytest.raises(ModelError, match=r"unknown model file type '\.txt'.*\.onnx"):
        tilegraph.import_model(tmp_path / "model.txt")


def test_unsupported_objects_say_what_is_supported():
    g = Graph()
    g.input("x", (2,))
    with pytest.raises(TilegraphError, match=r"call \.build\(\.\.\.\) on the Graph first"):
        tilegraph.import_model(g)
    with pytest.raises(TilegraphError, match="ir.Model, an onnx.ModelProto, a torch.nn.Module"):
        tilegraph.import_model(42)


def test_a_torch_module_needs_example_inputs():
    torch = pytest.importorskip("torch")
    with pytest.raises(TilegraphError, match="Linear.*needs example_inputs"):
        tilegraph.compile(torch.nn.Linear(4, 2))


def test_a_torch_module_compiles_when_the_frontend_is_there():
    torch = pytest.importorskip("torch")
    pytest.importorskip("tilegraph.frontends.torch_export")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4), torch.nn.ReLU()).eval()
    x = torch.randn(3, WIDTH)
    compiled = tilegraph.compile(module, (x,))
    with torch.no_grad():
        expected = module(x).numpy()
    assert_close(compiled(x), expected, "f32", reduction_length=WIDTH)


def test_an_onnx_file_compiles_when_the_frontend_is_there(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("tilegraph.frontends.onnx")
    from onnx import TensorProto, helper

    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph([node], "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "relu.onnx"
    onnx.save(proto, path)
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    for source in (proto, str(path)):
        np.testing.assert_array_equal(tilegraph.compile(source)(x), np.maximum(x, 0))


def test_importing_tilegraph_imports_neither_torch_nor_onnx():
    code = "import sys, tilegraph; print(sorted(m for m in ('torch', 'onnx') if m in sys.modules))"
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert out.stdout.strip() == "[]"


def test_a_model_file_compiled_again_comes_from_the_compile_cache(tmp_path, monkeypatch):
    """The second compile of an unchanged file runs no import and no pass; a changed file, a
    changed weights file beside it, another pipeline or a damaged entry compile afresh."""
    monkeypatch.setenv("TILEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    path = mlp().save(tmp_path / "m.mlir")
    x = inputs()
    first = tilegraph.compile(path)
    passes = []
    real = tilegraph._run_passes
    monkeypatch.setattr(tilegraph, "_run_passes", lambda *a: passes.append(a) or real(*a))
    again = tilegraph.compile(path)
    assert passes == [] and again.source == first.source
    np.testing.assert_array_equal(again(x), first(x))

    tilegraph.compile(path, pipeline="canonicalize")  # another pipeline: another entry
    assert len(passes) == 1
    weights = dict(np.load(tmp_path / "m.weights.npz"))
    weights["fc1.bias"] = weights["fc1.bias"] + 1
    np.savez(tmp_path / "m.weights.npz", **weights)
    changed = tilegraph.compile(path)
    assert len(passes) == 2
    assert_close(changed(x), interpret(Model.load(path), [x])[0], "f32", WIDTH)

    for entry in (tmp_path / "cache" / "compiled").glob("*.mlir"):
        entry.write_text("not IR")
    assert_close(tilegraph.compile(path)(x), interpret(Model.load(path), [x])[0], "f32", WIDTH)
    assert len(passes) == 3
    monkeypatch.setenv("TILEGRAPH_COMPILE_CACHE", "0")
    tilegraph.compile(path)
    tilegraph.compile(path)
    assert len(passes) == 5


def test_a_compile_time_switch_or_another_processor_is_another_compile_cache_entry(tmp_path, monkeypatch):
    """The passes read TG_BLOCKED and the processor's profile: a model compiled under one
    is not served from the cache under another."""
    monkeypatch.setenv("TILEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    path = mlp().save(tmp_path / "m.mlir")
    tilegraph.compile(path)
    passes = []
    real = tilegraph._run_passes
    monkeypatch.setattr(tilegraph, "_run_passes", lambda *a: passes.append(a) or real(*a))
    tilegraph.compile(path)
    assert passes == []
    monkeypatch.setenv("TG_BLOCKED", "0")
    tilegraph.compile(path)
    assert len(passes) == 1
    monkeypatch.setattr(hardware, "cpu_model", lambda: "another processor")
    tilegraph.compile(path)
    assert len(passes) == 2


def test_the_compile_cache_key_holds_an_onnx_models_external_data(tmp_path, monkeypatch):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    monkeypatch.setenv("TILEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    x = np.ones((2, 3), np.float32)

    node = helper.make_node("Add", ["x", "b"], ["y"])
    graph = helper.make_graph([node], "add", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(np.full(3, 1.0, np.float32), "b")])
    path = tmp_path / "add.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path,
              save_as_external_data=True, location="add.data", size_threshold=0)
    assert tilegraph.compile(path)(x)[0, 0] == 2.0
    (tmp_path / "add.data").write_bytes(np.full(3, 5.0, np.float32).tobytes())  # the same .onnx bytes
    assert tilegraph.compile(path)(x)[0, 0] == 6.0


def test_the_default_target_is_the_native_backend_where_it_builds(monkeypatch):
    """No target: "c" where a C compiler and oneDNN are installed (they are here), else
    NumPy with one warning saying why."""
    from tilegraph import backends
    from tilegraph.backends.c import build

    model, x = mlp(), inputs()
    compiled = tilegraph.compile(model)
    assert compiled.target == "c" and "#include \"runtime.h\"" in compiled.source
    assert_close(compiled(x), interpret(model, [x])[0], "f32", reduction_length=WIDTH)

    def no_compiler():
        raise build.BuildError("the C backend needs a C compiler with OpenMP: install gcc")

    monkeypatch.setattr(build, "compiler", no_compiler)
    backends.default_cpu_target.cache_clear()
    try:
        with pytest.warns(UserWarning, match="target 'numpy', not the native 'c': the C backend needs a C compiler"):
            fallback = tilegraph.compile(model)
        assert fallback.target == "numpy"
        assert_close(fallback(x), interpret(model, [x])[0], "f32", reduction_length=WIDTH)
    finally:
        backends.default_cpu_target.cache_clear()
