"""A sharded forward step on local gloo processes, every variant in one launch, interleaved:
overlap on vs off, the C backend vs the NumPy backend vs op by op, against one process.

    python benchmarks/distributed_steps.py [--devices 2] [--layers 2] [--hidden 1024] [--batch 1] [--repeats 15]

The model: a GPT-shaped decoder (f32, random weights, sequence 128, `--batch` sequences per
device) sharded ZeRO-3 style: every weight stored split over the devices by its first dim and
all-gathered where it is used, the batch split (data parallelism). Its collectives (one
all-gather per weight: at hidden 1024, 2 layers, each device receives ~50 MB a step) depend on
no compute, so with overlap they are all issued before the first op and waited for at first use
(backends/distributed.py).

How it is timed (a 2-core machine shared with other work): every mode runs in the same
processes, one step each per repetition, the order reversed every other repetition (ABBA),
so a burst of load lands on all modes alike; the first two repetitions are warm-up. A step's
time is the slowest process's. The overlap effect is the per-repetition ratio on/off (a pair
of steps taken a fraction of a second apart), reported as its median and quartiles.

"compute alone" is the whole model at one device's batch on one process through the C backend
(one thread): what each device computes, with no collective; "communication alone" is then
estimated as (C, no overlap) - compute. Perfect overlap would take max(compute, communication).

On 2 cores with 2 processes, an overlapped all-gather runs on gloo's thread and the kernel's
TCP copies, which need a core while both cores compute: overlap can win only the time the
cores sit idle waiting on each other in the synchronous run (latency, the slower rank).
"""

from __future__ import annotations

import argparse
import os
import sys

from _common import format_table, machine_lines  # noqa: E402

MODES = [("c", True), ("c", False), ("numpy", True), (None, True)]
WARMUP = 2


def _name(backend, overlap) -> str:
    how = {"c": "C backend", "numpy": "NumPy backend", None: "op by op"}[backend]
    return f"{how}, {'overlap' if overlap else 'no overlap'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1, help="sequences per device")
    ap.add_argument("--repeats", type=int, default=15, help="timed repetitions (after 2 warm-up ones)")
    ap.add_argument("--overlap-only", action="store_true", help="only the C backend with overlap on and off")
    args = ap.parse_args(argv)

    import time

    import numpy as np

    from tilegraph.backends import distributed
    from tilegraph.frontends.config import gpt
    from tilegraph.passes.cost.collectives import Mesh
    from tilegraph.passes.cost.hardware import hardware
    from tilegraph.passes.partition import partition
    from tilegraph.passes.shard import annotate, chosen_plan
    from tilegraph.testing import random_inputs
    from tests.models import zero3_pick

    print("\n".join(machine_lines()))
    n = args.devices
    sizes = {"B": args.batch * n}
    model = gpt(args.layers, args.hidden, 8, seq=128, vocab=4096, dtype="f32", weights="random")

    annotated = model.clone()
    annotate(annotated.module, chosen_plan(annotated.module, Mesh((n,), hardware("h100")), zero3_pick, sizes))
    program = partition(annotated, sizes)
    gathers = program.model.text.count("shard.all_gather")
    gathered = sum(np.asarray(w).nbytes for w in model.weights.values()) * (n - 1) / n
    inputs = random_inputs(model, seed=0, sizes=sizes)
    modes = MODES[:2] if args.overlap_only else MODES
    load_before = os.getloadavg()
    outputs, times = distributed.compare([program], inputs, modes, repeats=args.repeats + WARMUP)
    load_after = os.getloadavg()
    samples = {_name(*m): np.asarray(t[WARMUP:]) for m, t in zip(modes, times)}
    for m, out in zip(modes, outputs[1:]):
        for a, b in zip(outputs[0], out):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4, err_msg=f"{_name(*m)} differs")

    # Compute alone: one device's share of the work (the whole model at its batch), one process.
    one = distributed.compile_for(model, "c")
    local = random_inputs(model, seed=0, sizes={"B": args.batch})
    one(*local)
    compute = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        one(*local)
        compute.append(time.perf_counter() - t0)
    compute = float(np.median(compute))

    base = float(np.median(samples[_name("c", True)]))
    rows = []
    for name, s in samples.items():
        q1, med, q3 = np.percentile(s, [25, 50, 75])
        rows.append([name, f"{med * 1e3:.1f}", f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f}", f"{med / base:.2f}"])
    rows.append(["compute alone (one process, C, one device's batch)", f"{compute * 1e3:.1f}", "", ""])
    print(f"GPT-shaped, {args.layers} layers, hidden {args.hidden}, batch {sizes['B']} x 128 tokens, "
          f"{n} gloo processes (one thread each), ZeRO-3: {gathers} weight all-gathers, "
          f"{gathered / 1e6:.0f} MB received per device per step")
    print(f"load average before / after the launch: {load_before[0]:.2f} / {load_after[0]:.2f} "
          f"(1 min), {os.cpu_count()} cores")
    print(format_table(["run (median of %d interleaved steps)" % args.repeats, "step ms", "quartiles",
                        "/ C, overlap"], rows))
    on, off = samples[_name("c", True)], samples[_name("c", False)]
    ratios = on / off
    q1, med, q3 = np.percentile(ratios, [25, 50, 75])
    off_med = float(np.median(off))
    comm = max(off_med - compute, 0.0)
    print(f"overlap on / off (C backend), per repetition: median {med:.3f}, quartiles {q1:.3f}-{q3:.3f}, "
          f"min {ratios.min():.3f}, max {ratios.max():.3f} ({len(ratios)} pairs)")
    print(f"estimated communication alone: {comm * 1e3:.1f} ms (no-overlap step - compute); perfect overlap "
          f"would give {max(compute, comm) / off_med:.2f} of the no-overlap step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
