"""Building C modules (backends/c/build.py): the runtime library is compiled once per
toolchain and flags and every module links against it; modules and runtime are found
in the cache, which may move; a cached module is never compiled again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tilegraph.backends.c import build, compile_model
from tilegraph.ir import Graph, interpret
from tilegraph.testing import assert_close

ROOT = Path(__file__).resolve().parents[1]


def _model(scale: float):
    g = Graph()
    x = g.input("x", ("B", 8))
    w = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    return g.build(g.softmax(g.relu(x @ g.weight("w", w)) * g.constant(np.float32(scale))), names=["y"])


def _check(compiled, model):
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    assert_close(compiled(x)[0], interpret(model, [x])[0], "f32", 8)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _compiles(monkeypatch) -> list[str]:
    """The names of the libraries the C compiler makes from now on."""
    made: list[str] = []
    real = build._compile

    def counting(source, target, *args):
        made.append(target.name)
        return real(source, target, *args)

    monkeypatch.setattr(build, "_compile", counting)
    return made


def test_two_models_share_one_runtime_built_once(cache, monkeypatch):
    made = _compiles(monkeypatch)
    for scale in (0.5, 2.0):
        model = _model(scale)
        _check(compile_model(model), model)
    assert [n.split("_")[0] for n in made] == ["tgrt", "tg", "tg"]
    assert sorted(p.name for p in (cache / "c").glob("tgrt_*.so")) == [made[0]]


def test_a_moved_cache_loads_without_compiling(cache, tmp_path):
    """A module finds its runtime beside itself ($ORIGIN), wherever the cache folder is: in
    a new process (this one has the runtime loaded already), from the moved folder only."""
    compile_model(_model(1.5))
    moved = tmp_path / "moved"
    shutil.copytree(cache, moved)
    shutil.rmtree(cache)
    child = """if True:
        from tilegraph.backends.c import build, compile_model
        from tests.test_c_build import _check, _model
        def refuse(*a):
            raise AssertionError("a cached module was compiled again")
        build._compile = refuse
        model = _model(1.5)
        _check(compile_model(model), model)
        print("ok")
    """
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TILEGRAPH_CACHE_DIR": str(moved)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert not cache.exists()


def test_the_runtime_is_rebuilt_when_missing_and_keyed_by_flags(cache, monkeypatch):
    model = _model(1.0)
    compile_model(model)
    (rt,) = (cache / "c").glob("tgrt_*.so")
    rt.unlink()  # the module is cached, its dependency is not: build() makes it again
    assert build.build(compile_model(model).source).exists() and rt.exists()
    monkeypatch.setenv("TILEGRAPH_C_SANITIZE", "address")
    assert build.runtime() != rt  # other flags, another library


def test_prepare_builds_the_runtime_once_beside_a_build(cache, monkeypatch):
    made = _compiles(monkeypatch)
    build.build_ahead()  # in a thread; build() waits for it rather than compiling it again
    model = _model(3.0)
    _check(compile_model(model), model)
    assert sorted(n.split("_")[0] for n in made) == ["tg", "tgrt"]
