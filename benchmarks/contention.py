"""The C backend while another process takes a core: tilegraph's time over onnxruntime's with
one busy child process, against the same ratio without it, both in one run, interleaved.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/contention.py [--model resnet50] [--batch 1] [--busy 1]
        [--repeat 9] [--fixed-team] [--nice N]

--model: a benchmarks/full_size_sweep.py model, or `minilm` (all-MiniLM-L6-v2, sequence 128,
tests/models.py). --busy children spin (one core each) for the whole run, but are stopped
(SIGSTOP) during the quiet half of every round and resumed (SIGCONT) for the busy half: each
round times every runner quiet, then busy, so the two conditions see the same drift of the
shared machine. Runners: tilegraph as it runs by default (its thread choice:
backends/c/runtime._uncontended_threads), onnxruntime at its default threads (no spinning
pool, as full_size_sweep.py), and with --fixed-team the same tilegraph module forced to keep
every thread. Printed: medians, per-round ratios against onnxruntime, the busy ratio over the
quiet one (target: at most 1.3), the threads tilegraph's calls started on in each
condition, and the load average (other work on the machine counts too: say so when quoting
the numbers). --nice N: the children run N steps of niceness below this process (whether
a niced neighbour takes a core from a team of threads too: with --fixed-team, the team's
time beside the adaptive one's).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import ROOT, format_table, interleaved_samples, machine_lines, paired_ratio  # noqa: E402

TARGET = 1.3  # busy ratio within 1.3x of the quiet one
SETTLE_S = 0.3  # after stopping or resuming the children, before timing: the scheduler catches up
MINILM_SEQ = 128


def build(name: str, batch: int):
    """(torch module, input names, input tensors) of --model at --batch."""
    import full_size_sweep

    if name != "minilm":
        return full_size_sweep.build(name, batch)
    sys.path.insert(0, str(ROOT))
    from tests import models

    return models.minilm_model(), ["input_ids", "attention_mask"], models.minilm_inputs(batch, MINILM_SEQ)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", help="a benchmarks/full_size_sweep.py model, or minilm")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--busy", type=int, default=1, help="busy child processes in the busy half of each round")
    p.add_argument("--repeat", type=int, default=9, help="rounds (each: every runner quiet, then busy)")
    p.add_argument("--fixed-team", action="store_true", help="also time tilegraph on a fixed team of all threads")
    p.add_argument("--nice", type=int, default=0, help="the busy children's niceness above this process's")
    args = p.parse_args()
    import onnxruntime as ort
    import torch

    import tilegraph
    import tilegraph.backends.c.runtime as c_runtime

    sys.path.insert(0, str(ROOT))
    from tests.models import export_onnx

    module, names, inputs = build(args.model, args.batch)
    arrays = [t.numpy() for t in inputs]
    with torch.no_grad():
        program = torch.export.export(module, tuple(inputs))
    compiled = tilegraph.compile(program, target="c")
    compiled.run(*arrays)
    adaptive = c_runtime._uncontended_threads

    def fixed_team():
        c_runtime._uncontended_threads = lambda threads: threads
        try:
            compiled.run(*arrays)
        finally:
            c_runtime._uncontended_threads = adaptive

    with tempfile.TemporaryDirectory() as d:
        path = export_onnx(module, tuple(inputs), Path(d) / "m.onnx", names, ["out"])
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feeds = dict(zip(names, arrays))
    threads: list[int] = []  # the threads each tilegraph call started with, in the condition now running

    def tilegraph_call():
        compiled.run(*arrays)
        threads.append(compiled._runner.last_threads)

    runners = {"tilegraph": tilegraph_call, "onnxruntime": lambda: sess.run(None, feeds)}
    if args.fixed_team:
        runners["tilegraph fixed team"] = fixed_team
    print("\n".join(machine_lines()))

    nice = os.getpriority(os.PRIO_PROCESS, 0) + args.nice
    children = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                 preexec_fn=(lambda: os.setpriority(os.PRIO_PROCESS, 0, nice)) if args.nice else None)
                for _ in range(args.busy)]
    started: dict[str, list[int]] = {"quiet": [], "busy": []}
    quiet: dict[str, list[float]] = {k: [] for k in runners}
    busy: dict[str, list[float]] = {k: [] for k in runners}
    loads = []
    try:
        for child in children:
            os.kill(child.pid, signal.SIGSTOP)
        interleaved_samples(runners, 0, warmup=2)
        for _ in range(args.repeat):
            for state, into, label in ((signal.SIGSTOP, quiet, "quiet"), (signal.SIGCONT, busy, "busy")):
                for child in children:
                    os.kill(child.pid, state)
                time.sleep(SETTLE_S)
                threads.clear()
                for k, v in interleaved_samples(runners, 1, warmup=0).items():
                    into[k] += v
                started[label] += threads
            loads.append(os.getloadavg()[0])
    finally:
        for child in children:
            child.kill()
            child.wait()

    rows, ratios = [], {}
    for label, samples in (("quiet", quiet), (f"{args.busy} busy" + (f" (nice +{args.nice})" if args.nice else ""),
                                               busy)):
        med = {k: 1e3 * float(np.median(v)) for k, v in samples.items()}
        r = {k: paired_ratio(samples, k, "onnxruntime")[0] for k in runners if k != "onnxruntime"}
        ratios[label] = r
        rows.append([label] + [f"{med[k]:.1f}" for k in runners] + [f"{x:.2f}" for x in r.values()])
    mine = [k for k in runners if k != "onnxruntime"]
    print(f"{args.model}, batch {args.batch}, default threads; medians of {args.repeat} rounds, each timing every "
          f"runner quiet then with {args.busy} busy child process(es); load average (1 min) "
          f"{min(loads):.1f}..{max(loads):.1f}, {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    print(format_table(["condition"] + [f"{k} ms" for k in runners] + [f"{k}/onnxruntime" for k in mine], rows))
    for label, counts in started.items():
        print(f"tilegraph's calls {label}: started on {', '.join(f'{n} thread(s) {counts.count(n)}x' for n in sorted(set(counts)))}")
    q, b = ratios["quiet"]["tilegraph"], list(ratios.values())[1]["tilegraph"]
    print(f"tilegraph/onnxruntime busy over quiet: {b / q:.2f} (target <= {TARGET}: "
          f"{'met' if b / q <= TARGET else 'not met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
