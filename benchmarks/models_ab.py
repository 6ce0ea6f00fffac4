"""Whole models compiled by this checkout against the same models compiled by another.

A change to the passes, the cost model or the calibration (fuse, tile, group pricing,
profile format) is judged by the modules the two builds emit, timed round-robin in
one process (benchmarks/_common.py) on the same inputs, so the shared machine's drift
falls on both alike; separate runs of cpu_speed.py differ by more than most such
changes gain. Each side compiles in a process of its own (its checkout first on
sys.path, its own cost-model profile); this process then loads both emitted modules.
Both run this checkout's kernels (`ir/kernels.py`, the chunk pool): what is compared
is what the passes decided. With `--base-kernels` the base's module runs the base's
`ir/kernels.py` instead (a kernel change, seen in whole models; the kernels' own
signatures must still fit what each side emits). benchmarks/kernels_ab.py compares
single kernels.

    git worktree add --detach /tmp/base main
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/models_ab.py --base /tmp/base
        [--models minilm1,minilm8,gpt2,cnn] [--repeat N] [--base-kernels]

Printed per model: kernel counts, the maximum relative difference of the outputs,
and this/base timed settled and back to back (median over rounds of the ratio within
a round, quartiles in brackets).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, format_table, interleaved_samples, load_kernels, machine_lines, paired_ratio  # noqa: E402

import numpy as np  # noqa: E402

MODELS = {  # key: (label, the tests.models expression of the module, of its inputs)
    "minilm1": ("MiniLM b1 s128", "models.minilm_model()", "models.minilm_inputs(1, 128)"),
    "minilm8": ("MiniLM b8 s128", "models.minilm_model()", "models.minilm_inputs(8, 128)"),
    "gpt2": ("GPT-2 small b1 s256", "models.gpt2_model()", "models.gpt2_inputs(1, 256)"),
    "cnn": ("small CNN b32", "models.small_cnn()", "models.small_cnn_inputs(32)"),
}

# Run in the checkout being built, with only that checkout importable as the project.
EMIT = """
import sys
import tilegraph
from tests import models
compiled = tilegraph.compile({module}, {inputs}, target="numpy")
open(sys.argv[1], "w").write(compiled.source)
compiled.model.weights.save(sys.argv[2])
"""


def emit(checkout: Path, key: str, out: Path) -> tuple[Path, Path]:
    """The source and weights `checkout` emits for model `key`, written under `out`."""
    _, module, inputs = MODELS[key]
    source, weights = out / f"{key}.py", out / f"{key}.weights.npz"
    env = dict(os.environ, PYTHONPATH=str(checkout), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", EMIT.format(module=module, inputs=inputs), str(source), str(weights)],
                          cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"compiling {key} in {checkout} failed:\n{done.stderr[-3000:]}")
    return source, weights


def load(source: Path, weights: Path, kernels=None):
    """The forward function of an emitted module (imports resolve to this checkout; `K`
    to `kernels` when given)."""
    from tilegraph.ir.model import WeightStore

    namespace: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)  # noqa: S102 - our own emitted code
    if kernels is not None:
        namespace["K"] = kernels
    return namespace["build"](WeightStore.load(weights))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the checkout whose build is the peer")
    ap.add_argument("--models", default="minilm1,minilm8,gpt2", help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--repeat", type=int, default=11, help="timed rounds per model and timing (default 11)")
    ap.add_argument("--base-kernels", action="store_true", help="run the base's module on the base's ir/kernels.py")
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = sorted(set(keys) - set(MODELS))
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if not (args.base / "tilegraph" / "__init__.py").is_file():
        ap.error(f"--base {args.base}: not a tilegraph checkout (no tilegraph/__init__.py)")

    from tests import models

    base_kernels = load_kernels(args.base) if args.base_kernels else None
    for line in machine_lines():
        print(line)
    print(f"this: {ROOT}; base: {args.base}{' (its kernels too)' if base_kernels else ''}; "
          f"{args.repeat} round-robin rounds per timing\n", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in keys:
            label, _, inputs = MODELS[key]
            arrays = [t.numpy() for t in eval(inputs, {"models": models})]  # noqa: S307 - our own table
            runners, outputs, kernels = {}, {}, {}
            for side, checkout in (("this", ROOT), ("base", args.base)):
                out = Path(tmp) / side
                out.mkdir(exist_ok=True)
                source, weights = emit(checkout, key, out)
                forward = load(source, weights, base_kernels if side == "base" else None)
                runners[side] = (lambda f: lambda: f(*arrays))(forward)
                outputs[side] = np.asarray(forward(*arrays)[0])
                kernels[side] = source.read_text().count("\n    def fusion_")
            scale = max(float(np.max(np.abs(outputs["base"]))), 1e-30)
            diff = float(np.max(np.abs(outputs["this"] - outputs["base"]))) / scale
            for mode in ("settled", "back-to-back"):
                t = interleaved_samples(runners, args.repeat, back_to_back=mode == "back-to-back")
                ratio, lo, hi = paired_ratio(t, "this", "base")
                rows.append([label, mode, f"{kernels['base']} / {kernels['this']}", f"{1e3 * np.median(t['base']):.1f}",
                             f"{1e3 * np.median(t['this']):.1f}", f"{ratio:.3f}x ({lo:.3f}-{hi:.3f})", f"{diff:.0e}"])
            print(f"  {label} done", flush=True)
    print("\n" + format_table(["model", "timed", "groups base / this", "base ms", "this ms", "this/base (quartiles)",
                               "max rel diff"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
