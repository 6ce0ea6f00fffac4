"""Data-parallel training on local processes (torch.distributed, gloo): the loss of 1, 2 and 4
processes at every step from the same weights and batches, and each one's time per step.

Every process compiles the step's backward module and its optimizer module for its slice
of the batch; the gradients are all-reduced between them (tilegraph.train.train_data_parallel).
The processes share this machine's cores (one thread each), so the time per step says what
the gradient exchange and the smaller slices cost here, not what N machines would give.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/train_data_parallel.py [--steps 50] [--worlds 1,2,4]
        [--layers 2] [--hidden 64] [--batch 8] [--block 32] [--target numpy]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts the repository root on sys.path)


import tilegraph  # noqa: E402
from tilegraph.ir import Model  # noqa: E402
from tilegraph.train import AdamW, train_data_parallel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--worlds", default="1,2,4")
    _common.char_gpt_options(ap, layers=2, hidden=64, heads=4, block=32, batch=8)
    ap.add_argument("--target", default="numpy")
    ap.add_argument("--pipeline", default=None, help="passes each process compiles with (default: the default)")
    args = ap.parse_args()
    chars, batches, module = _common.char_gpt_run(args)
    optimizer = AdamW(lr=3e-3, weight_decay=0.1)
    runs = {}
    for world in (int(w) for w in args.worlds.split(",")):
        # each process gets the model as tg IR at its slice of the batch
        piece = tilegraph.import_model(module, example_inputs=(batches[0][0][:args.batch // world],))
        make = functools.partial(Model.parse, piece.text, dict(piece.weights))
        t = time.perf_counter()
        runs[world] = train_data_parallel(make, batches, world, optimizer, clip_norm=1.0, target=args.target,
                                          pipeline=args.pipeline)
        print(f"{world} process(es): {time.perf_counter() - t:.1f} s in all (start, compile, {args.steps} steps)")
    base = np.array(runs[min(runs)]["losses"])
    rows = []
    for world, r in runs.items():
        losses = np.array(r["losses"])
        rel = np.abs(losses - base) / np.abs(base)
        rows.append((world, f"{losses[0]:.4f}", f"{losses[-1]:.4f}", f"{rel.max():.1e}",
                     f"{np.median(r['seconds'][2:]) * 1e3:.1f}"))
    print(_common.format_table(("processes", "first loss", "last loss", f"max rel. diff to {min(runs)}",
                                "median ms/step"), rows))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
