"""Per-step A/B of the C runtime's repacking of GEMM operands whose rows lie a multiple of 4 KiB
apart (runtime.c tg_aliased_rows): one saved training step (train_speed.py --step-dir), its
per-step module (c_steps.py) made twice in one process, once with TG_NO_REPACK=1 while its
primitives are made, the two called in alternating rounds. Prints each round's whole time, the
steps that moved most, and the ratio of the steps' sums (repack / no repack).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/train_repack_steps.py STEP.mlir [--threads 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_speed  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402

from tilegraph.backends.c.build import build  # noqa: E402
from tilegraph.backends.c.emit import emit_program  # noqa: E402
from tilegraph.backends.c.runtime import CompiledModel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", help="a saved GPT-2-shaped step (train_speed.py --step-dir)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()} (other agents share this machine)")
    module, inputs, targets, loss = train_speed.gpt2(args.layers)
    step = train_speed.tilegraph_step("gpt2", args.layers, module, inputs, loss, None, args.step)
    feed = {**dict(zip(step._data, [np.asarray(x) for x in (*inputs, targets)])), **step.weights, **step.state,
            "lr": np.float32(train_speed.LR), "step": np.float32(1)}
    optimized = step.compiled.model
    arrays = [feed[n] for n in optimized.input_names]
    program = emit_program(optimized, per_step=True)
    lib = ctypes.CDLL(str(build(program.source)))
    samples: dict[tuple[str, int], list[float]] = {}
    models = {}
    for mode in ("repack", "no repack"):
        model = CompiledModel(program, lib, optimized.weights, optimized, "f32")
        model.set_threads(args.threads)
        if mode == "no repack":
            os.environ["TG_NO_REPACK"] = "1"
        try:
            model(*arrays)  # binds: makes the primitives
        finally:
            os.environ.pop("TG_NO_REPACK", None)
        for k, i in {k: i for i, (kind, k) in enumerate(program.plan) if kind == "segment"}.items():
            def timed(*a, fn=model._segments[k], key=(mode, i)):
                t = time.perf_counter()
                rc = fn(*a)
                samples.setdefault(key, []).append(time.perf_counter() - t)
                return rc
            model._segments[k] = timed
        models[mode] = model
        print(f"{mode}: {sum('reordered' in p for p in model.primitives)} primitives with a B reordered each run")
    for r in range(args.rounds):
        for mode, model in models.items():
            t = time.perf_counter()
            model(*arrays)
            print(f"  round {r} {mode}: {time.perf_counter() - t:.2f} s, load {os.getloadavg()[0]:.1f}")
    steps = sorted({i for _, i in samples})
    med = {(m, i): float(np.median(samples[(m, i)][-args.rounds:])) for m in models for i in steps}
    moved = sorted(steps, key=lambda i: med[("repack", i)] - med[("no repack", i)])
    for title, part in (("faster with the repack", moved[:args.top]), ("slower with the repack", moved[-4:])):
        print(title)
        for i in part:
            print(f"  {1e3 * med[('repack', i)]:8.1f} vs {1e3 * med[('no repack', i)]:8.1f} ms  step {i}: "
                  f"{program.steps[i].comment[:100]}")
    on, off = (sum(med[(m, i)] for i in steps) for m in models)
    print(f"steps sum: repack {on:.2f} s, no repack {off:.2f} s: repack / no repack {on / off:.2f}x, "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
