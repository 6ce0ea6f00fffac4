"""The autotuner times only the tile pass's candidates, keeps the winner and caches it on disk.

Without a GPU the kernels run in Triton's interpreter: its times are real (of the
interpreter), which is enough to check the mechanism end to end on real launches.
The first tests go through `tilegraph.compile(..., autotune=True)`; the last ones
drive an `Autotuner` around one hand-written kernel whose every launch is counted
and checked.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import tilegraph  # noqa: I001 - first: on a machine without a GPU it sets TRITON_INTERPRET=1 before triton loads
import torch
import triton
import triton.language as tl

import tilegraph.backends.triton as tilegraph_triton
from tilegraph.backends.triton.autotune import Autotuner
from tilegraph.ir import Graph
from tilegraph.ir.interpreter import interpret
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


# --- the Autotuner on its own, around a real kernel: every launch below runs it -------------

@triton.jit
def _add_one_kernel(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, tl.load(x + offs, mask=offs < n) + 1.0, mask=offs < n)


CUDA = torch.cuda.is_available() and not tilegraph_triton.interpreted()
DEVICE = torch.cuda.get_device_name() if CUDA else "cpu-interpreter"
CONFIGS = [{"BLOCK": 16, "num_warps": 1}, {"BLOCK": 64, "num_warps": 2}, {"BLOCK": 256, "num_warps": 4}]
N = 512


class Kernel:
    """A launch closure that counts its launches and checks each one's result."""

    def __init__(self):
        self.x = torch.arange(N, dtype=torch.float32, device="cuda" if CUDA else "cpu")
        self.launches = 0

    def __call__(self, cfg):
        out = torch.zeros_like(self.x)
        _add_one_kernel[(triton.cdiv(N, cfg["BLOCK"]),)](self.x, out, N, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
        self.launches += 1
        assert torch.equal(out, self.x + 1), f"launch under {cfg} computed the wrong values"


def _files(folder):
    return sorted(p.name for p in folder.glob("*.json"))


def test_disabled_takes_the_cost_models_first_choice_and_launches_nothing(tmp_path):
    launch = Kernel()
    assert Autotuner(enabled=False, cache_dir=tmp_path).pick("add", "h1", (N,), DEVICE, CONFIGS, launch) == CONFIGS[0]
    assert launch.launches == 0 and _files(tmp_path) == []


def test_the_winner_is_the_fastest_candidate_and_a_new_tuner_reads_it_back_without_launching(tmp_path):
    launch = Kernel()
    tuner = Autotuner(enabled=True, cache_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        best = tuner.pick("add", "h1", (N, "f32"), DEVICE, CONFIGS, launch)
        assert tuner.pick("add", "h1", (N, "f32"), DEVICE, CONFIGS, launch) == best  # from memory
    interpreter_warnings = [w for w in caught if "interpreter" in str(w.message)]
    assert len(interpreter_warnings) == (0 if CUDA else 1)
    assert best in CONFIGS and launch.launches >= len(CONFIGS) and tuner.timed == len(CONFIGS)
    (name,) = _files(tmp_path)
    assert name.startswith("add-h1-")
    record = json.loads((tmp_path / name).read_text())[repr((N, "f32"))]
    assert [t["config"] for t in record["timings"]] == CONFIGS
    assert all(t["seconds"] > 0 and t["error"] == "" for t in record["timings"])
    assert record["best"] == best == min(record["timings"], key=lambda t: t["seconds"])["config"]

    launched = launch.launches
    again = Autotuner(enabled=True, cache_dir=tmp_path)
    assert again.pick("add", "h1", (N, "f32"), DEVICE, CONFIGS, launch) == best
    assert launch.launches == launched and again.timed == 0

    # Other shapes, or another module (source hash), are tuned again; the file keeps both shapes.
    again.pick("add", "h1", (N // 2, "f32"), DEVICE, CONFIGS, launch)
    assert again.timed == len(CONFIGS) and launch.launches > launched
    assert set(json.loads((tmp_path / name).read_text())) == {repr((N, "f32")), repr((N // 2, "f32"))}
    again.pick("add", "h2", (N, "f32"), DEVICE, CONFIGS, launch)
    assert again.timed == 2 * len(CONFIGS) and len(_files(tmp_path)) == 2


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({repr((N,)): 7}),
                                     json.dumps({repr((N,)): {"best": {"BLOCK": 4096, "num_warps": 1}}})],
                         ids=["not-json", "not-a-table", "not-an-entry", "stale-winner"])
def test_a_corrupt_or_stale_cache_file_is_tuned_again(tmp_path, content):
    launch = Kernel()
    Autotuner(enabled=True, cache_dir=tmp_path).pick("add", "h1", (N,), DEVICE, CONFIGS[:2], launch)
    (path,) = tmp_path.glob("*.json")
    path.write_text(content)
    tuner = Autotuner(enabled=True, cache_dir=tmp_path)
    assert tuner.pick("add", "h1", (N,), DEVICE, CONFIGS[:2], launch) in CONFIGS[:2]
    assert tuner.timed == 2
    assert json.loads(path.read_text())[repr((N,))]["best"] in CONFIGS[:2]  # rewritten whole


def test_a_candidate_that_does_not_compile_is_skipped_with_its_error(tmp_path):
    launch = Kernel()
    bad = {"BLOCK": 24, "num_warps": 1}  # tl.arange needs a power of two
    tuner = Autotuner(enabled=True, cache_dir=tmp_path)
    assert tuner.pick("add", "h1", (N,), DEVICE, [bad, CONFIGS[1]], launch) == CONFIGS[1]
    (path,) = tmp_path.glob("*.json")
    first, second = json.loads(path.read_text())[repr((N,))]["timings"]
    assert first["seconds"] is None and "power of 2" in first["error"]
    assert second["seconds"] > 0 and second["error"] == ""
