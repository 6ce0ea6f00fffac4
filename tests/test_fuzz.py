"""The fuzzer as a standing check: a few hundred mutated inputs of each kind (tilegraph/fuzz.py:
.mlir text, ONNX protobuf fields, .npz weights and samples, command lines) succeed or fail with
an error meant for a user; the long run is `python -m tilegraph.fuzz` (10,000 of each)."""

import pytest

from tilegraph.fuzz import Fuzzer

# Cases per kind here: what fits in about a minute for all four on the 2-core dev VM.
CASES = {"mlir": 300, "onnx": 150, "npz": 150, "cli": 150, "shapes": 150, "shapes_c": 60}


@pytest.mark.parametrize("kind", list(CASES))
def test_mutated_inputs_never_crash(kind, tmp_path):
    crashes = Fuzzer(tmp_path).run(kind, CASES[kind], seed=17)
    assert not crashes, "\n".join(crashes)
