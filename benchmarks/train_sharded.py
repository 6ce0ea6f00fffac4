"""The shard planner's training plans executed on local processes (torch.distributed, gloo): ZeRO-3
data parallelism, Megatron tensor parallelism and 2 pipeline stages, 1F1B (tilegraph.train_sharded)
on the character GPT, against one process (plain data parallelism over 1 process:
tilegraph.train.train_data_parallel) from the same weights and batches.

Per plan and process count: the loss after the last step and its largest relative difference to
one process's at any step; the plan's predicted step time (passes/shard.py on this machine's CPU
profile and the gloo link the processes measured) against the measured median step (the slowest
rank's), the cost model's error (predicted / measured); the plan's bytes per process against the
measured ones (the arrays a rank holds between steps, its C modules' arena, and the peak a warm step
allocates besides, tracemalloc).

The processes share this machine's cores (one thread each) with whatever else runs on it: the
measured times say what the exchange and the split work cost here, not what N machines would give.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/train_sharded.py [--steps 50] [--worlds 2,4]
        [--strategies zero3,tensor,pipeline] [--target numpy|c] [--schedule 1f1b|gpipe] [--layers 2]
        [--hidden 32] [--heads 4] [--block 16] [--batch 8]

The sharded runs of one process count share one set of processes (train_sharded.Processes); the
1-process baseline runs on the same target.
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

import torch  # noqa: E402

import tilegraph  # noqa: E402
from tests.models import char_gpt_segments  # noqa: E402
from tilegraph.train import AdamW, train_data_parallel  # noqa: E402
from tilegraph.train_sharded import ModelAt, Processes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--strategies", default="zero3,tensor,pipeline")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--target", default="numpy", choices=("numpy", "c"))
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    _common.char_gpt_options(ap, layers=2, hidden=32, heads=4, block=16, batch=8)
    args = ap.parse_args()
    chars, batches, module = _common.char_gpt_run(args)
    params = [n for n, _ in module.named_parameters()]
    optimizer = AdamW(lr=3e-3, weight_decay=0.1)
    worlds = [int(w) for w in args.worlds.split(",")]
    row_counts = {args.batch} | {args.batch // w for w in worlds}
    dyn = ({0: torch.export.Dim("B")},)
    models = {None: tilegraph.import_model(module, example_inputs=(batches[0][0],), dynamic_shapes=dyn)}
    models.update({r: tilegraph.import_model(module, example_inputs=(batches[0][0][:r],)) for r in row_counts})
    make = ModelAt(models)
    t = time.perf_counter()
    one = train_data_parallel(functools.partial(make, args.batch), batches, 1, optimizer, clip_norm=1.0, pipeline="",
                              target=args.target)
    print(f"1 process: {time.perf_counter() - t:.1f} s in all; median step {np.median(one['seconds'][2:]) * 1e3:.1f} ms")
    base = np.array(one["losses"])
    rows = []
    # the same cost model on one process (no link): how far its compute alone is from a measured step
    from tilegraph.passes import shard
    from tilegraph.train_plan import cpu_mesh, optimizer_time

    from tilegraph.ir.hardware import hardware

    mesh = cpu_mesh((1,), 1e-6, 1e10, hardware("c" if args.target == "c" else "cpu"))
    alone = shard.plan(models[None].module, mesh, sizes={"B": args.batch}, names=models[None].input_names,
                       zero=False, recompute=False, runner_up=False, backward="vjp",
                       optimizer=optimizer_time(optimizer, mesh.hw))
    measured = float(np.median(one["seconds"][2:]))
    rows.append(("plain (1 process)", 1, "-", f"{base[-1]:.5f}", f"{base[-1]:.5f}", "0", f"{alone.time * 1e3:.2f}",
                 f"{measured * 1e3:.1f}", f"{alone.time / measured:.3f}", f"{alone.compute * 1e3:.2f} / 0", "-",
                 f"{alone.memory / 1e6:.3f}", "-", "-", "-", "-", "-"))
    runs = {}
    for world in worlds:
        with Processes(world) as group:
            for strategy in args.strategies.split(","):
                t = time.perf_counter()
                segs = functools.partial(char_gpt_segments, module, strategy)
                runs[strategy, world] = group.train(strategy, make, params, batches, optimizer, clip_norm=1.0,
                                                    segments=segs, micro_batches=args.micro_batches, pipeline="",
                                                    calibrate=True, target=args.target, schedule=args.schedule)
                print(f"{strategy} on {world} processes: {time.perf_counter() - t:.1f} s in all; "
                      f"load {os.getloadavg()}; ran on {runs[strategy, world]['runners']}")
    for strategy in args.strategies.split(","):
        for world in worlds:
            r = runs[strategy, world]
            losses = np.array(r["losses"])
            rel = np.abs(losses - base) / np.abs(base)
            measured = float(np.median(r["seconds"][2:]))
            p = r["plan"]
            # per rank: held between steps, a warm step's peak allocation, ..., the C arena (column 6)
            mem = np.array(r["memory"])
            total = mem[:, 0] + mem[:, 1] + mem[:, 6]
            stages = 2 if strategy == "pipeline" else 1
            dp = world // stages
            planned = [p[f"stage{s}_memory"] for s in range(stages)]
            got = [total[s * dp:(s + 1) * dp].max() for s in range(stages)]
            predicted_mem = " / ".join(f"{b / 1e6:.3f}" for b in planned)
            measured_mem = " / ".join(f"{b / 1e6:.3f}" for b in got)
            ratio_mem = " / ".join(f"{g / b:.2f}" for g, b in zip(got, planned))
            terms = " | ".join(" / ".join(f"{p[f'stage{s}_{k}'] / 1e6:.3f}" for k in
                                          ("weights", "activations", "gathered", "workspace")) for s in range(stages))
            extra = f"ZeRO-{int(p['zero'])}" + (
                f", m={int(p['micro_batches'])} {args.schedule}, held {mem[:, 5].astype(int).tolist()}"
                if strategy == "pipeline" else "") + (
                f", {int(p['recompute'])} layer(s)/stage recomputed" if p["recompute"] else "")
            rows.append((strategy, world, extra, f"{losses[-1]:.5f}", f"{base[-1]:.5f}", f"{rel.max():.1e}",
                         f"{p['time'] * 1e3:.2f}", f"{measured * 1e3:.1f}", f"{p['time'] / measured:.3f}",
                         f"{p['compute'] * 1e3:.2f} ({p['host'] * 1e3:.2f} host) / {p['comm'] * 1e3:.2f}",
                         f"{mem[:, 2].mean() * 1e3:.2f} / {mem[:, 3].mean() * 1e3:.2f} / "
                         f"{(measured - mem[:, 2].mean() - mem[:, 3].mean()) * 1e3:.2f}",
                         predicted_mem, terms, measured_mem, ratio_mem,
                         f"{mem[:, 0].max() / 1e6:.3f} / {mem[:, 6].max() / 1e6:.3f} / {mem[:, 1].max() / 1e6:.3f}",
                         f"{p['alpha'] * 1e6:.0f} us, {p['beta'] / 1e6:.0f} MB/s"))
    print(_common.format_table(
        ("plan", "processes", "as planned", f"loss after {args.steps}", "1 process", "max rel. diff (any step)",
         "predicted ms", "measured ms", "predicted/measured", "predicted compute (its host part) / comm ms",
         "measured compute / comm / host ms", "predicted MB/process (stage 0 / 1)",
         "planned weights / activations / gathered / workspace MB", "measured MB/process", "measured/planned",
         "held / C arena / step MB", "gloo link (measured)"), rows))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
