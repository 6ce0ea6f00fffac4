"""The C backend while other processes take cores: its thread choice (a forward starts no
more threads than the cores other runnable threads leave free) against a fixed team of all
threads, beside onnxruntime, with and without busy child processes of our own.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/contention.py [--model mobilenet-v2] [--busy 0,1] [--repeat 9]

For each --busy count, that many child processes spin (one core each) while the runners are
timed round-robin: tilegraph as it runs by default ("adaptive"), the same module forced to
keep every thread ("fixed team"), and onnxruntime at its default threads. Printed: medians,
per-round ratios against onnxruntime, and the load average (other work on the machine counts
too: say so when quoting the numbers).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import ROOT, format_table, interleaved_samples, machine_lines, paired_ratio  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mobilenet-v2", help="a benchmarks/full_size_sweep.py model")
    p.add_argument("--busy", default="0,1", help="comma-separated counts of busy child processes")
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args()
    import onnxruntime as ort
    import torch

    import full_size_sweep
    import tilegraph
    import tilegraph.backends.c.runtime as c_runtime

    sys.path.insert(0, str(ROOT))
    from tests.models import export_onnx

    module, names, inputs = full_size_sweep.build(args.model, 1)
    arrays = [t.numpy() for t in inputs]
    with torch.no_grad():
        program = torch.export.export(module, inputs)
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
        path = export_onnx(module, inputs, Path(d) / "m.onnx", names, ["out"])
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feeds = dict(zip(names, arrays))
    runners = {"tilegraph adaptive": lambda: compiled.run(*arrays), "tilegraph fixed team": fixed_team,
               "onnxruntime": lambda: sess.run(None, feeds)}
    print("\n".join(machine_lines()))
    rows = []
    for busy in (int(b) for b in args.busy.split(",")):
        children = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(0.5)
            samples = interleaved_samples(runners, args.repeat)
            load = os.getloadavg()
        finally:
            for child in children:
                child.kill()
                child.wait()
        med = {k: 1e3 * float(np.median(v)) for k, v in samples.items()}
        rows.append([str(busy)] + [f"{med[k]:.1f}" for k in runners]
                    + [f"{paired_ratio(samples, k, 'onnxruntime')[0]:.2f}" for k in list(runners)[:2]]
                    + [" ".join(f"{x:.1f}" for x in load)])
    print(f"{args.model}, batch 1, default threads; medians of {args.repeat} round-robin rounds")
    print(format_table(["busy children"] + [f"{k} ms" for k in runners]
                       + ["adaptive/onnxruntime", "fixed team/onnxruntime", "load avg"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
