"""How strong is the property suite? Seed known faults, one at a time, and count the ones it catches.

Each fault is a source patch (a line of a pass, a rule, a kernel or the chunk loop changed the way
a compiler engineer's slip changes it: a flipped comparison, an off-by-one block bound, a dropped
guard, swapped operands, a wrong reduction axis, an ignored mask, a wrong remainder). For each,
the tree is copied to a temporary directory, the patch applied there, and the property suite run
on the copy at its `make test` budget (the same hypothesis settings). A fault is caught when the
suite fails. The untouched tree must pass first.

    python benchmarks/fault_seeding.py                  # every fault
    python benchmarks/fault_seeding.py --only 1-8,12    # some of them (a loaded machine)
    python benchmarks/fault_seeding.py --list

Prints one line per fault (caught by which test, or escaped) and the share caught. Faults in
ir/kernels.py's float64 paths and in ir/ops.py templates change the oracle too (the interpreter
renders the same templates), so the differential suite cannot see them: they are left out here and
are the ONNX conformance suite's and the peers' job.
"""

from __future__ import annotations

import argparse
import os
import re
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
SUITE = ["tests/test_rule_proofs.py", "tests/test_passes.py", "tests/test_numpy_backend.py", "tests/test_properties.py"]


@dataclass(frozen=True)
class Fault:
    path: str
    old: str
    new: str
    what: str


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
          "        if inner is not None:", "concat(concat): axis guard dropped"),
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
          "if x.shape != out.shape:", "broadcast -> reshape: element-count guard dropped"),
    Fault("passes/simplify_shapes.py", "if k > 0 and all(static_dim(d, 1) for d in out[:k]) and",
          "if k > 0 and", "unbroadcast: leading-ones guard dropped"),
    Fault("passes/simplify_shapes.py", "        if infer(op.spec, [info(t) for t in trial], op.py_attrs()) == want:",
          "        if True:", "bypass broadcast: result-type guard dropped"),
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
          "chunks: flipped comparison (harmless: one chunk either way)"),
    Fault("ir/kernels.py", "    np.multiply(p, x, out=p)  # x, not the clipped x", "    np.multiply(p, x2, out=p)  # x, not the clipped x",
          "erf float32: wrong operand"),
    Fault("ir/kernels.py", "        p *= xs  # (not t:", "        p *= t  # (not t:", "gelu float32: the clipped x used"),
    Fault("ir/kernels.py", "            drop(~block)", "            pass", "flash attention: boolean mask ignored"),
    Fault("ir/kernels.py", "            s += block", "            s -= block", "flash attention: additive mask subtracted"),
    Fault("ir/kernels.py", "    if causal and j1 - 1 > i0 + (lk - lq):", "    if causal and j1 - 1 > i1 + (lk - lq):",
          "flash attention: causal block test off by a block"),
]


def copy_tree(dst: Path) -> None:
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build"))


def run_suite(tree: Path, timeout: float) -> tuple[bool, str]:
    """True if the suite passes on `tree`; else the first failing test's name."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-m", "not slow", *SUITE]
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    if p.returncode == 0:
        return True, ""
    failed = re.findall(r"^FAILED (\S+)", p.stdout, re.M)
    return False, failed[0] if failed else p.stdout.strip().splitlines()[-1:][0] if p.stdout.strip() else "error"


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
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per suite run")
    ap.add_argument("--skip-baseline", action="store_true")
    args = ap.parse_args()
    if args.list:
        for i, f in enumerate(FAULTS, 1):
            print(f"{i:2d} {f.path}: {f.what}")
        return 0
    stale = [i for i, f in enumerate(FAULTS, 1) if (ROOT / f.path).read_text().count(f.old) != 1]
    if stale:
        print(f"faults whose source line is gone or ambiguous (update them): {stale}")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        if not args.skip_baseline:
            t = time.perf_counter()
            ok, why = run_suite(tree, args.timeout)
            print(f"baseline: {'passes' if ok else 'FAILS: ' + why} ({time.perf_counter() - t:.0f} s)", flush=True)
            if not ok:
                return 2
        caught = total = 0
        for i in parse_only(args.only):
            if i in stale:
                continue
            f = FAULTS[i - 1]
            path = tree / f.path
            original = path.read_text()
            path.write_text(original.replace(f.old, f.new, 1))
            t = time.perf_counter()
            try:
                ok, why = run_suite(tree, args.timeout)
            finally:
                path.write_text(original)
            total += 1
            caught += not ok
            print(f"{i:2d} {'caught ' if not ok else 'ESCAPED'} {f.what} [{f.path}]"
                  f"{' by ' + why if not ok else ''} ({time.perf_counter() - t:.0f} s)", flush=True)
        if total:
            print(f"caught {caught} of {total} seeded faults ({100 * caught / total:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
