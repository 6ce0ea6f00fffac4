"""The C backend's module optimization level: compile time against run time, on MiniLM.

The runtime library (backends/c/runtime.c: oneDNN's glue, softmax, layer_norm, flash
attention) is compiled once at -O3 whatever the level; this chooses the level of each
model's own emitted loops (backends/c/build.MODULE_OPT). One MiniLM module (from ONNX,
dynamic batch and sequence, the default pipeline) is compiled at each level (the C
compiler's time, best of --builds), and the modules are timed side by side in this one
process on one thread (round-robin, benchmarks/_common.py), at batch 1 and 8, sequence 128;
each level's time over the last level's is the median of the ratio within each round
(quartiles in brackets).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/c_opt_levels.py [--repeat 9] [--levels -O1,-O2,-O3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from _common import interleaved_samples, machine_lines, paired_ratio  # noqa: E402

import tilegraph  # noqa: E402
from tilegraph.backends.c import build, emit, load  # noqa: E402
from tilegraph.testing import relative_error  # noqa: E402
from tests.models import export_onnx, minilm_inputs, minilm_model  # noqa: E402

SEQ = 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--builds", type=int, default=3, help="compiles per level (the best is reported)")
    ap.add_argument("--levels", default="-O1,-O2,-O3", help="comma-separated flag sets, the reference last")
    args = ap.parse_args()
    levels = args.levels.split(",")
    print("\n".join(machine_lines()))
    model = minilm_model()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "minilm.onnx"
        export_onnx(model, minilm_inputs(1, SEQ), path, input_names=["input_ids", "attention_mask"],
                    output_names=["last_hidden_state"],
                    dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                                  "last_hidden_state": {0: "batch", 1: "seq"}})
        optimized = tilegraph.compile(str(path), target="c").model
        source = emit(optimized)
        rt = build.runtime()
        compiled, cc = {}, {}
        for level in levels:
            best = float("inf")
            for i in range(args.builds):  # each into a file of its own: the C compiler runs every time
                target = Path(tmp) / f"module{level}-{i}.so"
                t = time.perf_counter()
                build._compile(source, target, build.flags() + level.split(),
                               ["-Wl,--push-state,--no-as-needed", str(rt), "-Wl,--pop-state"],
                               "the emitted module")
                best = min(best, time.perf_counter() - t)
            cc[level] = best
            build.MODULE_OPT = level.split()
            compiled[level] = load(source, optimized.weights, optimized, threads=1)
    print(f"all-MiniLM-L6-v2 from ONNX (dynamic batch, seq), sequence {SEQ}, one thread; "
          f"the C compiler's time per module: best of {args.builds}\n")
    times = {}
    for batch in (1, 8):
        ids, mask = (t.numpy() for t in minilm_inputs(batch, SEQ))
        with_torch = model(*minilm_inputs(batch, SEQ)).detach().numpy()
        for level, c in compiled.items():
            err = relative_error(c(ids, mask)[0], with_torch)
            assert err < 1e-4, f"{level}: error {err:.1e} against torch"
        times[batch] = interleaved_samples({lv: (lambda c=c: c(ids, mask)) for lv, c in compiled.items()},
                                           args.repeat)
    ref = levels[-1]
    width = max(map(len, levels))
    print(f"{'flags':<{width}}  {'cc s':>5}" + "".join(f"  {f'b{b} ms':>8}  {'vs ' + ref:>{len(ref) + 15}}"
                                                       for b in (1, 8)))
    for level in levels:
        cells = ""
        for b in (1, 8):
            r, q1, q3 = paired_ratio(times[b], level, ref)
            cells += f"  {1e3 * float(np.median(times[b][level])):8.2f}  {f'{r:.2f}x ({q1:.2f}-{q3:.2f})':>{len(ref) + 15}}"
        print(f"{level:<{width}}  {cc[level]:5.2f}{cells}")


if __name__ == "__main__":
    main()
