"""Suite-wide setup and reporting: Triton's interpreter chosen before any test imports triton;
one fixed CPU profile for the passes' decisions; the ONNX conformance pass count, printed
at the end of every run."""

# With no GPU, the Triton backend's kernels run in Triton's interpreter, which Triton
# decides when a function is decorated: TRITON_INTERPRET=1 must be set before any test
# module imports triton (loading a transformers model does), so here, first.
import atexit
import os
import shutil
import tempfile
from pathlib import Path

from tilegraph.backends import interpret_triton_without_gpu

interpret_triton_without_gpu()

from tilegraph.passes.cost.hardware import (PROFILE_FORMAT, c_profile_path, cpu_profile_path, load_profile,  # noqa: E402
                                            save_profile)

# The passes decide fusion and tiling against the CPU profile that hardware("cpu")
# measures on first use. On a shared VM that measurement moves from run to run (the
# chunk pool's fork/join 190-290 us, L2 bandwidth 39-115 GB/s in one morning), and under
# one such calibration a transformer block's FFN down-projection stopped fusing with its
# residual and layer_norm, failing a test that expects it. The suite decides against one
# fixed profile instead, measured on the 2-core dev VM (tests/cpu_profile.json; refresh it
# with `tilegraph calibrate` when the profile format changes), in a cache directory of its
# own. Tests of calibration itself point TILEGRAPH_CACHE_DIR elsewhere.
_CACHE = tempfile.mkdtemp(prefix="tilegraph-tests-")
atexit.register(shutil.rmtree, _CACHE, True)
os.environ["TILEGRAPH_CACHE_DIR"] = _CACHE
# The same for the C backend's decisions (target "c"): tests/c_profile.json, from
# `tilegraph calibrate --target c` on the same VM.
for _name, _path, _command in (("cpu_profile.json", cpu_profile_path(), "tilegraph calibrate"),
                               ("c_profile.json", c_profile_path(), "tilegraph calibrate --target c")):
    _fixed = load_profile(Path(__file__).with_name(_name))
    if _fixed is None:
        raise RuntimeError(f"tests/{_name} is not a profile of format {PROFILE_FORMAT}: "
                           f"run `{_command}` and copy the profile it writes there")
    save_profile(_fixed, _path)  # as the cache holds one: with its digest, which it checks when read

CONFORMANCE_TEST = "test_onnx_conformance.py::test_node_case_matches_the_onnx_reference"


def pytest_terminal_summary(terminalreporter):
    counts = {}
    for outcome in ("passed", "failed", "error"):
        counts[outcome] = sum(1 for r in terminalreporter.stats.get(outcome, [])
                              if CONFORMANCE_TEST in getattr(r, "nodeid", "") and r.when == "call")
    total = counts["passed"] + counts["failed"] + counts["error"]
    if total:
        from tests.test_onnx_conformance import CASES, SKIPPED

        terminalreporter.write_line(
            f"ONNX node conformance: {counts['passed']} passed, {counts['failed'] + counts['error']} failed "
            f"of {total} run; {len(SKIPPED)} of the {len(CASES)} node cases are excluded with a stated reason")
