"""The recompute pass under memory budgets on the C backend, beside torch.compile's
`activation_memory_budget` (torch._functorch.config) at the same budgets, in one run: a character
GPT's gradient step (forward, cross-entropy, backward; no optimizer, which neither side
recomputes) at 100%, 50% and 25%.

tilegraph: the default C pipeline with `recompute{budget=b hardware=c}` after dce (before fuse); memory
is the pass's predicted peak (the program fused as `fuse{hardware=c}` groups it, its buffers as the
C emitter makes them, laid out as the runtime lays out its arena: ir/arena.py, plus the outputs'
arrays) and what the compiled module holds at the end of a call: its arena (every temporary of the
fused, emitted step) and what a warm call allocates besides (tracemalloc: the outputs). The floor: the least recomputation
could reach (each op's operands and results with the outputs made before it).
torch.compile: the module compiled under `activation_memory_budget=b` (the min-cut partitioner's
knapsack); memory is the peak of live CPU allocations during one step above what was live before
it (torch.profiler's memory timeline, profile_memory=True).
Each budget's pair of step times is interleaved round-robin; prints the load average beside them.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/train_memory_c.py [--layers 2] [--hidden 256] [--block 64]
        [--batch 8] [--threads 1] [--repeat 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402

import tilegraph  # noqa: E402
import tilegraph.backends.c  # noqa: E402,F401  (registers the C arena's layout, which the pass prices)
from tests.models import char_batches, char_corpus, char_gpt  # noqa: E402
from tilegraph.passes.recompute import priced_bytes  # noqa: E402
from tilegraph.passes.registry import UNFUSED_PIPELINE, run_pipeline  # noqa: E402
from tilegraph.passes.remarks import collect  # noqa: E402
from tilegraph.train import build_gradients  # noqa: E402

BUDGETS = (1.0, 0.5, 0.25)


def torch_step(module, x, y):
    module.zero_grad(set_to_none=True)
    logits = module(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    return loss


def torch_peak_bytes(run) -> int:
    """Peak live CPU bytes during `run()` above those live when it starts (the profiler's memory
    timeline: every allocation and free of torch's CPU allocator, by category)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        run()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    totals = np.asarray(sizes, dtype=np.int64).sum(axis=1)
    return int(totals.max() - totals[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.char_gpt_options(ap, layers=2, hidden=256, heads=4, block=64, batch=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for line in _common.machine_lines(torch=torch.__version__):
        print(line)
    print(f"load average at start: {os.getloadavg()} (other agents share this machine)")
    chars, batches = char_batches(char_corpus(), 1, args.batch, args.block)
    module = char_gpt(len(chars), args.layers, args.hidden, args.heads, args.block)
    x, y = batches[0]
    model = tilegraph.import_model(module, example_inputs=(x,))
    params = [n for n, _ in module.named_parameters()]
    step = build_gradients(model, "cross_entropy", params)
    inputs = [x.numpy(), y.numpy()] + [np.asarray(model.weights[p]) for p in params]
    rows, runners = [], {}
    for budget in BUDGETS:
        t0 = time.perf_counter()
        with collect() as remarks:
            planned = run_pipeline(step.clone(), f"{UNFUSED_PIPELINE},recompute{{budget={budget} hardware=c}}")
        summary = str(remarks[-1]).split("] ", 1)[1]
        compiled = tilegraph.compile(planned.clone(), target="c", pipeline="fuse{hardware=c},tile{hardware=c}",
                                     threads=args.threads)
        loss = float(compiled.run(*inputs)[0])
        # a call's peak: the arena its binding holds (laid out at the first call; less the slack kept
        # to align its start) and what a warm call allocates besides (tracemalloc: its outputs'
        # arrays, written straight or copied out of the arena)
        arena = sum(b.arena_bytes for b in compiled._runner._bindings.values())
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        compiled.run(*inputs)
        held = arena + tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        print(f"tilegraph {budget:.0%}: compiled in {time.perf_counter() - t0:.1f} s, loss {loss:.6f}; {summary}")
        predicted = priced_bytes(planned.func.body.block, "c")
        rows.append([f"{budget:.0%}", "tilegraph C (recompute pass)", f"{predicted / 1e6:.3f}",
                     f"{held / 1e6:.3f} ({held / predicted - 1:+.1%}; arena {arena / 1e6:.3f})"])
        runners[("tilegraph", budget)] = lambda c=compiled: c.run(*inputs)
    for budget in BUDGETS:
        # A fresh compile per budget (dynamo otherwise serves every module instance the first
        # budget's graph); each budget's pair is timed right after it, interleaved, before the
        # next reset would send this module back to the compiler.
        torch._dynamo.reset()
        t0 = time.perf_counter()
        peer = copy.deepcopy(module)
        with torch._functorch.config.patch(activation_memory_budget=budget):
            compiled_peer = torch.compile(peer)
            loss = float(torch_step(compiled_peer, x, y).detach())  # compiles forward and backward
        measured = torch_peak_bytes(lambda m=compiled_peer: torch_step(m, x, y))
        print(f"torch.compile {budget:.0%}: compiled in {time.perf_counter() - t0:.1f} s, loss {loss:.6f}")
        ours, theirs = f"tilegraph {budget:.0%}", f"torch.compile {budget:.0%}"
        samples = _common.interleaved_samples({ours: runners[("tilegraph", budget)],
                                               theirs: lambda m=compiled_peer: torch_step(m, x, y)}, args.repeat)
        ratio, q1, q3 = _common.paired_ratio(samples, ours, theirs)
        tg_row = next(r for r in rows if r[0] == f"{budget:.0%}")
        tg_row += [f"{np.median(samples[ours]) * 1e3:.1f}", f"{ratio:.2f}x ({q1:.2f}-{q3:.2f})"]
        rows.append([f"{budget:.0%}", "torch.compile (activation_memory_budget)", "-",
                     f"{measured / 1e6:.2f} (profiler peak)", f"{np.median(samples[theirs]) * 1e3:.1f}", ""])
    print(_common.format_table(("budget", "runner", "predicted MB", "measured MB", "step ms",
                                "tilegraph / torch.compile (median per round, quartiles)"), rows, "llrrrr"))
    print(f"threads {args.threads}; load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
