"""The differential fuzzer: a backend that computes something else is found, shrunk, saved and replayed."""

import numpy as np

from tilegraph import differential as fuzz


def _off_by_a_bit(model, inputs):
    # a backend with a bug: every float output a little off (well beyond rounding)
    return [o * 1.01 if o.dtype.kind == "f" else o for o in fuzz.BACKENDS["interpreter"].run(model, inputs)]


def test_a_wrong_backend_is_found_shrunk_and_saved_with_a_replay(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(fuzz.BACKENDS, "wrong", fuzz.Backend("wrong", _off_by_a_bit))
    stats = fuzz.fuzz(0.05, tmp_path, ["interpreter", "wrong"], log=lambda s: None)
    assert stats.graphs > 0 and stats.cases
    case, found = stats.cases[0]
    assert any(d.backend == "wrong" for d in found)
    assert (case / "model.mlir").is_file() and (case / "inputs.npz").is_file()
    assert "--replay" in (case / "replay.sh").read_text()
    # shrunk: hypothesis minimizes the graph that still diverges
    assert (case / "model.mlir").read_text().count(" = tg.") <= 3
    assert fuzz.main(["--replay", str(case / "model.mlir"), "--backends", "interpreter,wrong"]) == 1
    assert fuzz.main(["--replay", str(case / "model.mlir"), "--backends", "interpreter,numpy"]) == 0


def test_the_backends_here_agree_on_random_graphs(tmp_path):
    stats = fuzz.fuzz(0.1, tmp_path, ["interpreter", "numpy", "onnxruntime"], log=lambda s: None)
    assert stats.graphs > 0
    assert not stats.cases, [str(c) for c, _ in stats.cases]
