"""The recompute pass under memory budgets: a character GPT's gradient step (forward + backward)
at 100%, 50% and 25% of its save-everything peak, the pass's predicted peak of intermediates
beside the NumPy module's measured one (tracemalloc: every array NumPy allocates during a
call), and the step's time at each budget, interleaved.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/train_memory.py [--layers 2] [--hidden 256] [--block 32]
        [--batch 8] [--repeat 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts the repository root on sys.path)

import tilegraph  # noqa: E402
from tests.models import char_batches, char_corpus, char_gpt  # noqa: E402
from tilegraph.passes.recompute import peak_bytes  # noqa: E402
from tilegraph.passes.registry import run_pipeline  # noqa: E402
from tilegraph.passes.remarks import collect  # noqa: E402
from tilegraph.train import build_gradients  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.char_gpt_options(ap, layers=2, hidden=256, heads=2, block=32, batch=8)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    for line in _common.machine_lines():
        print(line)
    print(f"load average at start: {os.getloadavg()} (other agents share this machine)")
    chars, batches = char_batches(char_corpus(), 1, args.batch, args.block)
    module = char_gpt(len(chars), args.layers, args.hidden, args.heads, args.block)
    model = tilegraph.import_model(module, example_inputs=(batches[0][0],))
    params = [n for n, _ in module.named_parameters()]
    step = run_pipeline(build_gradients(model, "cross_entropy", params), "canonicalize,cse,dce")
    x, y = batches[0]
    inputs = [x.numpy(), y.numpy()] + [np.asarray(model.weights[p]) for p in params]
    rows, runners = [], {}
    for budget in (1.0, 0.5, 0.25):
        with collect() as remarks:
            m = run_pipeline(step.clone(), f"recompute{{budget={budget}}}")
        compiled = tilegraph.compile(m, target="numpy", pipeline="")
        compiled.run(*inputs)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        compiled.run(*inputs)
        measured = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        predicted = peak_bytes(m.func.body.block)
        summary = str(remarks[-1]).split("] ", 1)[1]
        rows.append([f"{budget:.0%}", f"{predicted / 1e6:.2f}", f"{measured / 1e6:.2f}",
                     f"{(measured - predicted) / predicted:+.1%}", summary])
        runners[f"{budget:.0%}"] = lambda c=compiled: c.run(*inputs)
    times = _common.interleaved_medians(runners, args.repeat)
    for row in rows:
        row.insert(4, f"{times[row[0]] * 1e3:.1f}")
    print(_common.format_table(("budget", "predicted MB", "measured MB", "measured vs predicted", "step ms",
                                "the pass's remark"), rows, "rrrrrl"))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
