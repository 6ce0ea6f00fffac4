"""Suite-wide setup and reporting: Triton's interpreter chosen before any test imports triton;
the ONNX conformance pass count, printed at the end of every run."""

# With no GPU, the Triton backend's kernels run in Triton's interpreter, which Triton
# decides when a function is decorated: TRITON_INTERPRET=1 must be set before any test
# module imports triton (loading a transformers model does), so here, first.
from backends import interpret_triton_without_gpu

interpret_triton_without_gpu()

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
