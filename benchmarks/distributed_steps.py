"""A sharded forward step on local gloo processes: overlap on vs off, compiled vs op by op,
against the whole model on one process, all in one run on the same inputs.

    python benchmarks/distributed_steps.py [--devices 2] [--layers 4] [--hidden 512] [--repeats 5]

The model: a GPT-shaped decoder (f32, random weights, sequence 128, batch 4 x devices)
sharded ZeRO-3 style: every weight stored split over the devices by its first dim and
all-gathered where it is used, the batch split (data parallelism). Its collectives (one
all-gather per weight) depend on no compute, so with overlap they are all issued before
the first op and waited for at first use (backends/distributed.py).

Rows, each the median over `--repeats` steps of the slowest process:
  compiled, overlap     each run of ops between collectives as a NumPy-backend module
  compiled, no overlap  the same, each collective waited for where it is issued
  op by op, overlap     every op through the op table's NumPy template (the interpreter's)
  op by op, no overlap
  one process           the unsharded model through the NumPy backend
"""

from __future__ import annotations

import argparse
import sys

from _common import format_table, machine_lines  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import time

    import numpy as np

    from tilegraph.backends import distributed
    from tilegraph.backends.numpy import compile_model
    from tilegraph.frontends.config import gpt
    from tilegraph.passes.cost.collectives import Mesh
    from tilegraph.passes.cost.hardware import hardware
    from tilegraph.passes.partition import partition
    from tilegraph.passes.shard import annotate, chosen_plan
    from tilegraph.testing import random_inputs
    from tests.models import zero3_pick

    print("\n".join(machine_lines()))
    n = args.devices
    sizes = {"B": 4 * n}
    model = gpt(args.layers, args.hidden, 8, seq=128, vocab=4096, dtype="f32", weights="random")

    annotated = model.clone()
    annotate(annotated.module, chosen_plan(annotated.module, Mesh((n,), hardware("h100")), zero3_pick, sizes))
    program = partition(annotated, sizes)
    gathers = program.model.text.count("shard.all_gather")
    inputs = random_inputs(model, seed=0, sizes=sizes)
    rows, medians = [], {}
    for compiled in (True, False):
        for overlap in (True, False):
            times: list[float] = []
            distributed.run(program, inputs, overlap=overlap, compiled=compiled, repeats=args.repeats + 1,
                            timings=times)
            name = f"{'compiled' if compiled else 'op by op'}, {'overlap' if overlap else 'no overlap'}"
            medians[name] = float(np.median(times[1:]))  # the first step warms caches and gloo's pairs
    one = compile_model(model)
    one(*inputs)
    single = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        one(*inputs)
        single.append(time.perf_counter() - t0)
    medians["one process"] = float(np.median(single))
    base = medians["compiled, overlap"]
    for name, t in medians.items():
        rows.append([name, f"{t * 1e3:.1f}", f"{t / base:.2f}"])
    print(f"GPT-shaped, {args.layers} layers, hidden {args.hidden}, batch {sizes['B']} x 128 tokens, "
          f"{n} gloo processes, {gathers} weight all-gathers per step")
    print(format_table(["run", "step ms", "/ compiled, overlap"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
