"""Caches nobody else can plant into (ir/cache.py): folders 0700, entries 0600 with a digest
checked before use, a folder others can write to refused (compiling into a private
temporary folder instead), a damaged or edited entry rebuilt; a compiled model keeps a
bounded number of shape bindings; the compile cache's key reads no file outside the model's
folder. On the code before these, a planted .so ran its constructor, an edited cached IR
changed what an unchanged model computed, and a truncated module failed every compile.
"""

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper, save_model

import tilegraph
from tilegraph.backends.c import build as c_build
from tilegraph.backends.c import runtime as c_runtime
from tilegraph.ir import interpret
from tilegraph.testing import assert_close


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of this test's own, and no module loaded from an earlier one."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("TILEGRAPH_CACHE_DIR", str(folder))
    monkeypatch.setattr(c_runtime, "_LOADED", {})
    return folder


def _model_file(tmp_path, name="m.onnx", scale=2.0) -> Path:
    w = numpy_helper.from_array(np.full((4, 4), scale, np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    path = tmp_path / name
    save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _check(f, path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    model = tilegraph.import_model(str(path))
    out = f(x)
    assert_close(out if isinstance(out, np.ndarray) else out[0], interpret(model, [x])[0], "f32", 4)


RUN = """
import sys, warnings
import numpy as np, tilegraph
from tilegraph.ir import interpret
from tilegraph.testing import assert_close
warnings.simplefilter("always")
path = sys.argv[1]
x = np.arange(12, dtype=np.float32).reshape(3, 4)
out = tilegraph.compile(path, target="c")(x)
assert_close(out if isinstance(out, np.ndarray) else out[0], interpret(tilegraph.import_model(path), [x])[0], "f32", 4)
print("RIGHT")
"""


def _compile_elsewhere(path: Path, cache: Path) -> str:
    """Compiles and checks `path` in a fresh process (as the next run of a user's program
    would: nothing loaded yet), returning what it printed and warned."""
    env = {**os.environ, "TILEGRAPH_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", RUN, str(path)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0 and "RIGHT" in done.stdout, done.stderr[-3000:]
    return done.stdout + done.stderr


def _plant(path: Path, data: bytes) -> None:
    tmp = path.with_name(".planted")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_cache_folders_are_0700_and_entries_0600_with_digests(cache, tmp_path):
    path = _model_file(tmp_path)
    _check(tilegraph.compile(str(path), target="c"), path)
    entries = [p for p in cache.rglob("*") if p.is_file()]
    folders = [cache, *(p for p in cache.rglob("*") if p.is_dir())]
    assert any(p.suffix == ".so" for p in entries) and any(p.suffix == ".mlir" for p in entries)
    for p in folders:
        assert _mode(p) == 0o700, p
    for p in entries:
        if p.parent.name in ("c", "compiled"):
            assert _mode(p) == 0o600, p
            if not p.name.endswith(".sha256"):
                assert p.with_name(p.name + ".sha256").is_file(), p


def _constructor_so(tmp_path, marker: Path) -> bytes:
    src = tmp_path / "evil.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) { '
                   f'FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    so = tmp_path / "evil.so"
    subprocess.run([c_build.compiler(), "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    return so.read_bytes()


def test_a_library_planted_over_a_cached_module_is_rebuilt_never_loaded(cache, tmp_path):
    path = _model_file(tmp_path)
    _compile_elsewhere(path, cache)
    marker = tmp_path / "planted-ran"
    evil = _constructor_so(tmp_path, marker)
    for so in (cache / "c").glob("*.so"):  # every cached library: the module and the runtime it links
        _plant(so, evil)
    _compile_elsewhere(path, cache)
    assert not marker.exists()


def test_a_truncated_module_is_rebuilt(cache, tmp_path):
    path = _model_file(tmp_path)
    _compile_elsewhere(path, cache)
    for so in (cache / "c").glob("tg_*.so"):
        _plant(so, so.read_bytes()[:100])
    _compile_elsewhere(path, cache)


def test_an_edited_compile_cache_entry_is_compiled_afresh(cache, tmp_path):
    path = _model_file(tmp_path)
    tilegraph.compile(str(path), target="numpy")
    (entry,) = (cache / "compiled").glob("*.mlir")
    text = entry.read_text()
    assert "dense<2.000000e+00>" in text  # the weight, folded to a splat constant
    entry.write_text(text.replace("dense<2.000000e+00>", "dense<5.000000e+00>"))  # valid IR, another answer
    _check(tilegraph.compile(str(path), target="numpy"), path)


def test_an_entry_whose_weights_were_edited_is_compiled_afresh(cache, tmp_path):
    """The weights are half of an entry: valid arrays of the right names and shapes, other values,
    under an untouched .mlir, must not change what the model computes. (64 x 64: large enough to
    stay in the weight store rather than inline in the IR.)"""
    path = tmp_path / "m.onnx"
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    tilegraph.compile(str(path), target="numpy")
    (entry,) = (cache / "compiled").glob("*.weights.npz")
    with np.load(entry) as stored:
        arrays = {name: stored[name] for name in stored.files}
    assert arrays["w"].shape == (64, 64), "the weight stayed in the weight store"
    np.savez(entry, **{**arrays, "w": arrays["w"] + 1})  # a well-formed file, other values
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    out = tilegraph.compile(str(path), target="numpy")(x)
    want = interpret(tilegraph.import_model(str(path)), [x])[0]
    assert_close(out if isinstance(out, np.ndarray) else out[0], want, "f32", 64)


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "another user's"])
def test_an_entry_others_could_have_written_is_compiled_afresh_even_with_a_matching_digest(cache, tmp_path, how):
    """Digests catch damage; who could write an entry is what says it is ours: one that is
    group- or world-writable, or owned by another user (planted while the folder was open),
    is not used, however well its digest matches."""
    import hashlib

    path = _model_file(tmp_path)
    tilegraph.compile(str(path), target="numpy")
    (entry,) = (cache / "compiled").glob("*.mlir")
    entry.write_text(entry.read_text().replace("dense<2.000000e+00>", "dense<5.000000e+00>"))
    entry.with_name(entry.name + ".sha256").write_text(hashlib.sha256(entry.read_bytes()).hexdigest())
    if how == "another user's":
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(entry, 12345, -1)
    else:
        os.chmod(entry, 0o620 if how == "group-writable" else 0o602)
    _check(tilegraph.compile(str(path), target="numpy"), path)


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "another user's"])
def test_a_cache_folder_others_can_write_to_is_refused_with_a_warning(cache, tmp_path, how):
    import hashlib

    path = _model_file(tmp_path)
    _compile_elsewhere(path, cache)
    marker = tmp_path / "planted-ran"
    evil = _constructor_so(tmp_path, marker)
    if how == "another user's":
        if os.getuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(cache / "c", 12345, -1)
    else:
        os.chmod(cache / "c", 0o777 if how == "world-writable" else 0o770)
    for so in (cache / "c").glob("*.so"):  # a planter who can write there rewrites entry and digest alike
        _plant(so, evil)
        so.with_name(so.name + ".sha256").write_text(hashlib.sha256(evil).hexdigest())
    said = _compile_elsewhere(path, cache)
    assert "not using the cache folder" in said
    assert not marker.exists()


def test_the_compile_cache_key_reads_no_file_outside_the_models_folder(tmp_path, monkeypatch):
    """External data naming a file outside the model's folder: the importer refuses it,
    and the cache key must not read it first."""
    from tilegraph import compile_cache

    folder = tmp_path / "model"
    folder.mkdir()
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.zeros(16, np.float32).tobytes())
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4, 4], data_location=TensorProto.EXTERNAL)
    w.external_data.add(key="location", value="../secret.bin")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    path = folder / "m.onnx"
    save_model(helper.make_model(graph), path)
    read = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self.resolve()) or real(self))
    assert compile_cache.key(path, None, "cpu") is None
    assert secret.resolve() not in read


def test_a_compiled_model_keeps_a_bounded_number_of_shape_bindings(cache, tmp_path):
    path = _model_file(tmp_path)
    f = tilegraph.compile(str(path), target="c")
    model = tilegraph.import_model(str(path))
    for batch in range(1, 3 * c_runtime.MAX_BINDINGS):
        x = np.full((batch, 4), batch, np.float32)
        out = f(x)
        assert_close(out if isinstance(out, np.ndarray) else out[0], interpret(model, [x])[0], "f32", 4)
    bindings = f._runner._bindings  # the C CompiledModel under tilegraph.Compiled
    assert len(bindings) == c_runtime.MAX_BINDINGS
    x = np.ones((1, 4), np.float32)  # evicted long ago: remade
    assert_close(_one(f(x)), interpret(model, [x])[0], "f32", 4)


def _one(out):
    return out if isinstance(out, np.ndarray) else out[0]



# --- the other caches: calibration profiles, Triton's emitted modules, autotuning tables ---------


def test_an_edited_calibration_profile_is_measured_again_not_trusted(cache, monkeypatch):
    """The passes decide fusion, tiling and threads by the profile in the cache: one edited
    there (or planted, or written without its digest) is measured afresh."""
    import json

    from tilegraph.ir import hardware

    fixed = hardware.load_profile(Path(__file__).with_name("c_profile.json"))
    path = hardware.c_profile_path()
    hardware.save_profile(fixed, path)
    measured = []
    monkeypatch.setattr(hardware, "_measure_noting_load", lambda native: measured.append(native) or fixed)
    monkeypatch.setattr(hardware, "others_running", lambda: 0)
    hardware._cpu_profile.cache_clear()
    assert hardware._cpu_profile(str(path), True) == fixed and measured == []  # ours, with its digest: used
    assert _mode(path) == 0o600
    data = json.loads(path.read_text())
    data["hardware"]["peak_flops"]["f32"] *= 1000
    path.write_text(json.dumps(data))
    hardware._cpu_profile.cache_clear()
    try:
        assert hardware._cpu_profile(str(path), True) == fixed and measured == [True]  # measured, not read
        assert hardware.load_profile(path) == fixed  # and written back with its digest
        hardware._cpu_profile.cache_clear()
        assert hardware._cpu_profile(str(path), True) == fixed and measured == [True]
    finally:
        hardware._cpu_profile.cache_clear()


def test_an_edited_autotuning_entry_is_tuned_again(cache):
    import json
    import warnings

    from tilegraph.backends.triton.autotune import Autotuner

    configs = [{"block": 16}, {"block": 32}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the interpreter's timings are not a GPU's
        first = Autotuner()
        best = first.pick("k", "h", (8,), "cpu-interpreter", configs, lambda cfg: None)
        (path,) = (cache / "autotune").glob("k-h-*.json")
        assert _mode(path) == 0o600 and _mode(cache / "autotune") == 0o700
        assert Autotuner().pick("k", "h", (8,), "cpu-interpreter", configs, lambda cfg: None) == best
        table = json.loads(path.read_text())
        other = configs[1 - configs.index(best)]
        table[repr((8,))]["best"] = other  # a candidate, but not the one this user's tuning chose
        path.write_text(json.dumps(table))
        again = Autotuner()
        again.pick("k", "h", (8,), "cpu-interpreter", configs, lambda cfg: None)
    assert again.timed == len(configs)  # tuned afresh, the edit not trusted


def test_triton_modules_are_imported_only_from_a_private_folder(cache, tmp_path):
    """An emitted Triton module is imported, so run: a folder others can write is not used, and
    a module edited in the cache is written afresh before the import."""
    import warnings

    from tilegraph.backends.triton.runtime import import_source

    marker = tmp_path / "payload-ran"
    source = "VALUE = 1\n"
    module = import_source(source)
    (path,) = (cache / "triton").glob("tilegraph_triton_*.py")
    assert module.VALUE == 1 and _mode(path) == 0o600 and _mode(cache / "triton") == 0o700
    path.write_text(f"open({str(marker)!r}, 'w').close()\nVALUE = 2\n")
    assert import_source(source).VALUE == 1 and not marker.exists()
    os.chmod(cache / "triton", 0o777)
    path.write_text(f"open({str(marker)!r}, 'w').close()\nVALUE = 2\n")
    path.with_name(path.name + ".sha256").write_text(__import__("hashlib").sha256(path.read_bytes()).hexdigest())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert import_source(source).VALUE == 1
    assert not marker.exists() and any("not using the cache folder" in str(w.message) for w in said)
