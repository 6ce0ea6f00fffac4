"""Why sharded training reduce-scatters its gradients with an all-reduce: gloo's two collectives on
the same CPU buffer, timed in the same processes.

    python benchmarks/gloo_collectives.py [--worlds 2,4] [--mb 40] [--repeats 5]

Each world size is one set of local gloo processes. Per repetition, after a barrier, rank 0 times
`all_reduce` of the whole buffer and `reduce_scatter_tensor` of it into a 1/world slice, the order
alternating (ABBA). Printed: each one's median and their ratio. tilegraph/train_sharded.py keeps the
all-reduce (each rank then keeps its own slice) while the ratio stays above 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import format_table, machine_lines


def _run(rank: int, world: int, numel: int, repeats: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    whole, part = torch.randn(numel), torch.empty(numel // world)
    calls = {"all_reduce": lambda: dist.all_reduce(whole),
             "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, whole)}
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(repeats + 1):  # the first repetition warms gloo's connections up, untimed
        for name in (list(calls) if i % 2 else list(calls)[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            calls[name]()
            if i:
                seconds[name].append(time.perf_counter() - t0)
    if rank == 0:
        queue.put({name: statistics.median(s) for name, s in seconds.items()})
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--mb", type=float, default=40.0, help="the buffer's size in MB (f32)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    print("\n".join(machine_lines(torch=torch.__version__)))
    numel = int(args.mb * 1e6 / 4) // 4 * 4
    rows = []
    for n, world in enumerate(int(w) for w in args.worlds.split(",")):
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_run, args=(world, numel - numel % world, args.repeats, 29600 + n, queue), nprocs=world)
        t = queue.get()
        rows.append([world, f"{t['all_reduce'] * 1e3:.1f}", f"{t['reduce_scatter_tensor'] * 1e3:.1f}",
                     f"{t['reduce_scatter_tensor'] / t['all_reduce']:.2f}"])
    print(format_table(["processes", "all_reduce ms", "reduce_scatter_tensor ms", "reduce-scatter / all-reduce"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
