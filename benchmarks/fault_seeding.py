"""How strong is the property suite? Seed known faults, one at a time, and count the ones it catches.

Each fault is a source patch (a line of a pass, a rule, a kernel or the chunk loop changed the way
a compiler engineer's slip changes it: a flipped comparison, an off-by-one block bound, a dropped
guard, swapped operands, a wrong reduction axis, an ignored mask, a wrong remainder). For each,
the tree is copied to a temporary directory, the patch applied there, and the property suite (SUITE:
files of `make test`, at their own hypothesis settings, slow tests left out) run on the copy. A fault
is caught when the suite fails. The untouched tree must pass first.

Affordable on one core: each fault runs only the tests of SUITE that can see it. The baseline run
records, with coverage.py, which test executes which line of the faulted files; a fault then runs
the tests that executed the body of the function around its line (the whole file's tests for a line
that runs at import, such as a rule table), in suite order, with -x. Every run uses one hypothesis
seed (--seed) and no example database, so a test runs the same code up to the faulted line as it
did in the baseline: a test that never reached that function cannot fail because of the fault.
Selection by coverage is the usual test selection of mutation testing; no test is written for a
fault's text.

    python benchmarks/fault_seeding.py                  # every fault
    python benchmarks/fault_seeding.py --only 1-8,12    # some of them
    python benchmarks/fault_seeding.py --list

Prints one line per fault (caught by which test, or escaped) and the share caught. A fault proven
not to change any result (`equivalent`, the proof beside it) still runs but is left out of the
score. Faults in ir/kernels.py's float64 paths and in ir/ops.py templates change the oracle too (the
interpreter renders the same templates), so the differential suite cannot see them: they are left
out here and are the ONNX conformance suite's and the peers' job.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The property suite: every pass on random graphs, the emitted NumPy against the interpreter,
# the per-op examples, and the rule proofs.
SUITE = ["tests/test_rule_proofs.py", "tests/test_passes.py", "tests/test_numpy_backend.py", "tests/test_properties.py",
         "tests/test_fusion.py", "tests/test_attention_tiling.py"]


@dataclass(frozen=True)
class Fault:
    path: str
    old: str
    new: str
    what: str
    # Why the fault cannot change what the pass or backend produces (an equivalent mutant), proven
    # from the code around it. It still runs; escaped, it is left out of the score (caught, it counts).
    equivalent: str = ""


FAULTS = [
    # --- canonicalize's rules ---------------------------------------------------------------
    Fault("passes/canonicalize.py", "            if is_splat(op.operands[side], value):",
          "            if constant_array(op.operands[side]) is not None:", "identity rule: guard dropped (x + c -> x)"),
    Fault("passes/canonicalize.py", 'Rule(("sub",), _identity_operand(0, (1,)), "x - 0 -> x")',
          'Rule(("sub",), _identity_operand(0, (1, 0)), "x - 0 -> x")', "0 - x -> x: wrong side accepted"),
    Fault("passes/canonicalize.py", 'return emit("mul", x, x) if is_splat(e, 2) else None',
          'return emit("mul", x, x) if is_splat(e, 3) else None', "x ** 3 -> x * x: wrong constant"),
    Fault("passes/canonicalize.py", 'return emit("add", x, n.operands[0]) if n else None',
          'return emit("sub", x, n.operands[0]) if n else None', "x - (-y) -> x - y: flipped op"),
    Fault("passes/canonicalize.py", '        return emit("sub", y, n.operands[0])',
          '        return emit("sub", n.operands[0], y)', "(-y) + x -> y - x: swapped operands"),
    Fault("passes/canonicalize.py", 'return emit("neg", op.operands[1]) if is_splat(op.operands[0], 0) else None',
          'return emit("neg", op.operands[1]) if constant_array(op.operands[0]) is not None else None',
          "c - x -> -x: guard dropped"),
    Fault("passes/canonicalize.py", "    perm = tuple(p1[j] for j in p2)", "    perm = tuple(p2[j] for j in p1)",
          "transpose composition: permutations swapped"),
    Fault("passes/canonicalize.py", 'return op.operands[0] if all(s == 1 for s in op.attr("steps")) else None',
          "return op.operands[0]", "slice of everything: step guard dropped"),
    Fault("passes/canonicalize.py", '    if not lossless_cast(info(x).dtype, info(inner.results[0]).dtype):',
          '    if False:', "cast(cast(x)): lossless guard dropped"),
    Fault("passes/canonicalize.py", "        return fd.nmant >= fs.nmant and fd.maxexp >= fs.maxexp and fd.minexp <= fs.minexp",
          "        return fd.nmant + 3 >= fs.nmant and fd.maxexp >= fs.maxexp", "lossless_cast: off by 3 mantissa bits"),
    Fault("passes/canonicalize.py", "        chosen = op.operands[1] if cond.all() else op.operands[2]",
          "        chosen = op.operands[2] if cond.all() else op.operands[1]", "where(true, x, y) -> y: sides swapped"),
    Fault("passes/canonicalize.py", '        if inner is not None and inner.attr("axis") % info(v).rank == axis:',
          "        if inner is not None:", "concat(concat): axis guard dropped",
          equivalent="the rewrite driver keeps only a replacement of the same type. Inner concat of k parts on "
                     "axis a, outer on b != a: the flat concat is well typed only if the parts agree on dim a (d "
                     "each), so the outer result has k*d there and the flat one d; equal types force k = 1 (an "
                     "identity concat: the rewrite is right) or d = 0 (an empty result: every value is equal)"),
    Fault("passes/canonicalize.py", "    if cond.all() or not cond.any():", "    if cond.any():",
          "where on a constant condition: all -> any"),
    Fault("passes/canonicalize.py", '    inner = producer(op.operands[0], op.op_name)\n    return inner.operands[0] if inner else None',
          '    inner = producer(op.operands[0])\n    return inner.operands[0] if inner else None',
          "f(f(x)) -> x: the inner op's kind not checked"),
    Fault("passes/canonicalize.py", '    if info(op.operands[0]).dtype.startswith("ui"):\n        return None\n', "",
          "abs(neg x) -> abs x: unsigned guard dropped"),
    # --- the rewrite driver and simplify-shapes -----------------------------------------------
    Fault("passes/rewrite.py", "any(v.type != r.type for v, r in zip(values, op.results))", "False",
          "rewrite driver: type check dropped"),
    Fault("passes/simplify_shapes.py", 'if moved == sorted(moved) else None', "",
          "transpose -> reshape: order guard dropped"),
    Fault("passes/simplify_shapes.py", "if x.shape != out.shape and dims_equal(numel(x.shape), numel(out.shape)):",
          "if x.shape != out.shape:", "broadcast -> reshape: element-count guard dropped",
          equivalent="the guard is tg.reshape's own shape rule (ir/ops.py _check_reshape, the same dims_equal of "
                     "the same numel): without it Emit raises Inapplicable and the rule does not apply"),
    Fault("passes/simplify_shapes.py", "if k > 0 and all(static_dim(d, 1) for d in out[:k]) and",
          "if k > 0 and", "unbroadcast: leading-ones guard dropped",
          equivalent="every tg.reshape keeps its element count (its shape rule): with the trailing dims equal to "
                     "x's, the prepended dims multiply to 1, so they are all 1 (or x is empty: so is the result)"),
    Fault("passes/simplify_shapes.py", "            fits = infer(op.spec, [info(t) for t in trial], op.py_attrs()) == want",
          "            fits = True", "bypass broadcast: result-type guard dropped"),
    # --- constant-fold, dce -------------------------------------------------------------------
    Fault("passes/constant_fold.py", "        if any(a.shape != r.shape for a, r in zip(arrays, results)):",
          "        if False:", "constant-fold: shape check dropped"),
    Fault("passes/constant_fold.py", 'values = evaluate(op, [self._value(s) for s in sources], self.store, dict(GLOBALS), float64=False)',
          'values = evaluate(op, [self._value(s) for s in sources][::-1], self.store, dict(GLOBALS), float64=False)',
          "constant-fold: operands reversed"),
    # --- fusion legality ----------------------------------------------------------------------
    Fault("passes/fuse.py", "        if self._has_detour(a, b) or self._has_detour(b, a):",
          "        if False:", "fuse: cycle check dropped"),
    Fault("passes/fuse.py", "            if not flat_ok(ops, uses, ref):", "            if False:",
          "fuse: regrouped-rows guard dropped"),
    # --- the NumPy backend's float32 kernels and chunk loop ----------------------------------
    Fault("backends/numpy/chunks.py", "    slices = [slice(i, min(i + rows, length)) for i in range(0, length, rows)]",
          "    slices = [slice(i, min(i + rows, length - 1)) for i in range(0, length, rows)]",
          "chunks: off-by-one last block bound"),
    Fault("backends/numpy/chunks.py", "    slices = [slice(i, min(i + rows, length)) for i in range(0, length, rows)]",
          "    slices = [slice(i, i + rows) for i in range(0, length - length % rows, rows)]",
          "chunks: the remainder block dropped"),
    Fault("backends/numpy/chunks.py", "    if rows <= 0 or rows >= length:", "    if rows <= 0 or rows > length:",
          "chunks: flipped comparison", equivalent="rows == length makes one chunk, slice(0, length), either way"),
    Fault("ir/kernels.py", "    np.multiply(p, x, out=p)  # x, not the clipped x", "    np.multiply(p, x2, out=p)  # x, not the clipped x",
          "erf float32: wrong operand"),
    Fault("ir/kernels.py", "        p *= xs  # (not t:", "        p *= t  # (not t:", "gelu float32: the clipped x used"),
    Fault("backends/numpy/attention.py", "            drop(~block)", "            pass", "flash attention: boolean mask ignored"),
    Fault("backends/numpy/attention.py", "            s += block", "            s -= block",
          "flash attention: additive mask subtracted"),
    Fault("backends/numpy/attention.py", "    if causal and j1 - 1 > i0 + (lk - lq):", "    if causal and j1 - 1 > i1 + (lk - lq):",
          "flash attention: causal block test off by a block"),
    # --- added in the second session: a wrong reduction axis, chunk-axis slips in fused groups ---
    Fault("passes/canonicalize.py", '    axes = [a % len(shape) for a in op.attr("axes")] if shape else []',
          '    axes = [(a + 1) % len(shape) for a in op.attr("axes")] if shape else []',
          "reduce over size-1 axes -> reshape: the wrong axis checked"),
    Fault("backends/numpy/groups.py", "return f\"{self._flat(buf.name, 'full')}.shape[{1 if self.cols else 0}]\"",
          "return f\"{self._flat(buf.name, 'full')}.shape[{0 if self.cols else 1}]\"",
          "fused group: the chunk count read off the wrong axis"),
    Fault("backends/numpy/groups.py", "        if axis < 0 or (isinstance(info.shape[axis], int) and info.shape[axis] == 1):",
          "        if axis < 0:", "fused group: a size-1 (broadcast) axis cut into chunks"),
    Fault("backends/numpy/groups.py", '                attrs["axis"] = -1', '                attrs["axis"] = 0',
          "fused group (flat): softmax/layer_norm over the wrong axis"),
    # --- decompose (ir/decompositions.py: the decompose pass and the Triton emitter's expansions) ---
    Fault("ir/decompositions.py", 'emit("reduce_sum", e, axes=(axis,), keepdims=True)',
          'emit("reduce_sum", e, axes=(0,), keepdims=True)', "softmax decomposition: the sum over the wrong axis"),
    Fault("ir/decompositions.py", 'emit("mul", centered, centered)', 'emit("mul", x, x)',
          "layer_norm decomposition: the variance of x, not of x - mean"),
    Fault("ir/decompositions.py", 'emit("mul", x, emit.constant(SQRT_HALF, dt))', 'emit("mul", x, emit.constant(0.5, dt))',
          "gelu decomposition: a wrong constant"),
]


def copy_tree(dst: Path) -> None:
    # No .hypothesis: make test on a fresh checkout has no database of earlier failures either.
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build",
                                                             ".hypothesis"))


# A pytest plugin, loaded with -p into every suite run. "map": per-test line coverage of the
# faulted files (coverage.py, one dynamic context per test id). "select": run only the tests
# listed in a file, in collection order.
PLUGIN = """
import json, os
import pytest

MODE = os.environ["FAULT_SEEDING_MODE"]
if MODE == "map":
    import coverage
    _cov = coverage.Coverage(data_file=None, config_file=False, include=json.loads(os.environ["FAULT_SEEDING_FILES"]))
    _cov.start()


def pytest_collection_modifyitems(config, items):
    if MODE == "select":
        with open(os.environ["FAULT_SEEDING_TESTS"]) as f:
            keep = set(json.load(f))
        items[:] = [i for i in items if i.nodeid in keep]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if MODE == "map":
        _cov.switch_context(item.nodeid)
    yield


def pytest_sessionfinish(session):
    if MODE == "map":
        _cov.stop()
        data = _cov.get_data()
        out = {f: {n: sorted(c for c in cs if c) for n, cs in data.contexts_by_lineno(f).items()}
               for f in data.measured_files()}
        with open(os.environ["FAULT_SEEDING_MAP"], "w") as f:
            json.dump(out, f)
"""


def run_suite(tree: Path, timeout: float, seed: int, env_extra: dict) -> tuple[bool, str]:
    """True if the suite passes on `tree`; else the first failing test's name."""
    shutil.rmtree(tree / ".hypothesis", ignore_errors=True)  # no failing examples carried from fault to fault
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree.parent}", "HF_HUB_OFFLINE": "1", **env_extra}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "_fault_plugin",
           f"--hypothesis-seed={seed}", "-m", "not slow", *SUITE]
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    if p.returncode == 0:
        return True, ""
    if p.returncode == 5:  # no tests collected: nothing was selected
        return True, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", p.stdout, re.M)
    return False, failed[0] if failed else p.stdout.strip().splitlines()[-1:][0] if p.stdout.strip() else "error"


def lines_that_see(path: Path, old: str) -> range:
    """The lines a test must run for a fault at `old` to change what it computes: the body of the
    innermost function around it, or the whole file when the line runs at import (a rule table)."""
    text = path.read_text()
    first = text[:text.index(old)].count("\n") + 1
    last = first + old.count("\n")
    around = None
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body[0].lineno <= first \
                and last <= node.end_lineno:
            if around is None or node.body[0].lineno > around.body[0].lineno:
                around = node
    if around is None:
        return range(1, text.count("\n") + 2)
    return range(around.body[0].lineno, around.end_lineno + 1)


def tests_that_see(coverage_map: dict, path: Path, old: str) -> list[str]:
    lines = coverage_map.get(str(path), {})
    return sorted({t for n in lines_that_see(path, old) for t in lines.get(str(n), ())})


def parse_only(text: str | None) -> list[int]:
    if not text:
        return list(range(1, len(FAULTS) + 1))
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="fault numbers, e.g. 1-8,12")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per suite run")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed, the same for every run")
    args = ap.parse_args()
    if args.list:
        for i, f in enumerate(FAULTS, 1):
            print(f"{i:2d} {f.path}: {f.what}")
        return 0
    stale = [i for i, f in enumerate(FAULTS, 1) if (ROOT / f.path).read_text().count(f.old) != 1]
    if stale:
        print(f"faults whose source line is gone or ambiguous (update them): {stale}")
    chosen = [i for i in parse_only(args.only) if i not in stale]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        (Path(tmp) / "_fault_plugin.py").write_text(PLUGIN)
        files = sorted({str(tree / FAULTS[i - 1].path) for i in chosen})
        t = time.perf_counter()
        ok, why = run_suite(tree, 4 * args.timeout, args.seed, {
            "FAULT_SEEDING_MODE": "map", "FAULT_SEEDING_FILES": json.dumps(files),
            "FAULT_SEEDING_MAP": str(Path(tmp) / "map.json")})
        print(f"baseline (with per-test coverage of the faulted files): {'passes' if ok else 'FAILS: ' + why} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        if not ok:
            return 2
        coverage_map = json.loads((Path(tmp) / "map.json").read_text())
        caught = total = equivalent = 0
        for i in chosen:
            f = FAULTS[i - 1]
            path = tree / f.path
            original = path.read_text()
            tests = tests_that_see(coverage_map, path, f.old)
            (Path(tmp) / "tests.json").write_text(json.dumps(tests))
            path.write_text(original.replace(f.old, f.new, 1))
            t = time.perf_counter()
            try:
                ok, why = run_suite(tree, args.timeout, args.seed, {
                    "FAULT_SEEDING_MODE": "select", "FAULT_SEEDING_TESTS": str(Path(tmp) / "tests.json")})
            finally:
                path.write_text(original)
            if f.equivalent and ok:
                equivalent += 1
                verdict = "equivalent"
            else:  # a caught fault is not equivalent, whatever its note says
                total += 1
                caught += not ok
                verdict = "caught " if not ok else "ESCAPED"
            print(f"{i:2d} {verdict} {f.what} [{f.path}]"
                  f"{' by ' + why if not ok else ''} ({len(tests)} tests see it; {time.perf_counter() - t:.0f} s)",
                  flush=True)
        cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(f"CPU time of the suite runs: {cpu.ru_utime + cpu.ru_stime:.0f} s")
        if total:
            print(f"caught {caught} of {total} seeded faults ({100 * caught / total:.0f}%); "
                  f"{equivalent} equivalent faults (they compute the same) left out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
