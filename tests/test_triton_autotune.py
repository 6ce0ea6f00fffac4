"""The autotuner times only the tile pass's candidates, keeps the winner and caches it on disk.

Without a GPU the kernels run in Triton's interpreter: its times are real (of the
interpreter), which is enough to check the mechanism end to end on real launches.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tilegraph
from backends.triton.autotune import Autotuner
from ir import Graph
from ir.interpreter import interpret
from tilegraph.testing import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:autotuning in Triton's interpreter")


def _gemm_model():
    rng = np.random.default_rng(11)
    g = Graph()
    x = g.input("x", ("B", 64))
    w = g.weight("w", rng.standard_normal((64, 48)).astype(np.float32))
    return g.build(g.relu(x @ w), names=["y"])


def _compiled(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGRAPH_CACHE_DIR", str(tmp_path))
    return tilegraph.compile(_gemm_model(), target="triton", autotune=True)


def test_autotune_picks_a_candidate_caches_it_and_reuses_it(tmp_path, monkeypatch):
    x = np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)
    first = _compiled(tmp_path, monkeypatch)
    (name, entry), = [(n, e) for n, e in first._runner.kernels.items() if len(e["configs"]) > 1]
    assert_close(first(x), interpret(first.model, [x])[0], "f32", 64)
    tuner = first._runner.module.TUNER.tuner
    assert tuner.timed == len(entry["configs"])  # every candidate, once
    (cache,) = (tmp_path / "autotune").glob(f"{name}-*.json")
    table = json.loads(cache.read_text())
    (record,) = table.values()
    assert record["best"] in entry["configs"]
    assert [t["config"] for t in record["timings"]] == entry["configs"]
    assert all(t["seconds"] > 0 for t in record["timings"])
    # A new process (a new tuner) reads the winner back and times nothing.
    second = _compiled(tmp_path, monkeypatch)
    second(x)
    assert second._runner.module.TUNER.tuner.timed == 0
    # Other shapes are tuned again.
    second(x[:17])
    assert second._runner.module.TUNER.tuner.timed == len(entry["configs"])


def test_a_corrupt_cache_is_tuned_again(tmp_path, monkeypatch):
    x = np.ones((8, 64), np.float32)
    first = _compiled(tmp_path, monkeypatch)
    first(x)
    for path in (tmp_path / "autotune").glob("*.json"):
        path.write_text("{not json")
    again = _compiled(tmp_path, monkeypatch)
    again(x)
    assert again._runner.module.TUNER.tuner.timed > 0


def test_disabled_or_single_candidate_takes_the_first_without_timing(tmp_path):
    calls = []
    tuner = Autotuner(enabled=False, cache_dir=tmp_path)
    assert tuner.pick("k", "h", (1,), "cpu-interpreter", [{"a": 1}, {"a": 2}], calls.append) == {"a": 1}
    assert Autotuner(cache_dir=tmp_path).pick("k", "h", (1,), "cpu-interpreter", [{"a": 3}], calls.append) == {"a": 3}
    assert calls == [] and not list(tmp_path.iterdir())


def test_candidates_that_fail_are_skipped_and_all_failing_is_an_error(tmp_path):
    def launch(cfg):
        if cfg["a"] != 2:
            raise RuntimeError("out of resource: shared memory")

    tuner = Autotuner(cache_dir=tmp_path)
    assert tuner.pick("k", "h", (1,), "cpu-interpreter", [{"a": 1}, {"a": 2}], launch) == {"a": 2}
    with pytest.raises(RuntimeError, match="no candidate configuration launches"):
        tuner.pick("k2", "h", (1,), "cpu-interpreter", [{"a": 1}, {"a": 3}], launch)
