"""Per convolution, tilegraph's C module against onnxruntime, in context: the time of each of
tilegraph's oneDNN convolutions (ONEDNN_VERBOSE=profile_exec, in a child process running the
real module) beside onnxruntime's own per-node profile (SessionOptions.enable_profiling) of the
same model, summed per convolution shape (groups, in/out channels, in/out height, kernel,
stride) and printed worst gap first, with the implementation and layouts oneDNN chose.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/conv_profile.py [--model resnet50] [--threads 1] [--repeat 10]

--model: a benchmarks/full_size_sweep.py model. Both run at --threads; medians over --repeat
calls. The whole forward's ratio is printed too (it includes what is not a convolution), with
the load average: other work on the machine moves every number. onnxruntime's NCHWc nodes
report channels padded to its block of 8 or 16: a model with other channel counts
(MobileNetV2's 24, 144) shows those shapes on two rows, one per library; ResNet-50's match.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import ROOT  # noqa: E402

SHAPE = re.compile(r"ic(\d+)oc(\d+)_ih(\d+)oh(\d+)kh(\d+)sh(\d+)")


def child(model: str, threads: int, repeat: int) -> None:
    """Runs the compiled module; oneDNN prints each primitive's time between the @@RUN marks."""
    import torch

    import full_size_sweep
    import tilegraph

    torch.set_num_threads(threads)
    module, names, inputs = full_size_sweep.build(model, 1)
    arrays = [t.numpy() for t in inputs]
    with torch.no_grad():
        program = torch.export.export(module, tuple(inputs))
    compiled = tilegraph.compile(program, target="c", threads=threads)
    for _ in range(3):
        compiled.run(*arrays)
    times = []
    for _ in range(repeat):
        print("@@RUN", flush=True)
        t = time.perf_counter()
        compiled.run(*arrays)
        times.append(time.perf_counter() - t)
        sys.stdout.flush()
    print(f"@@TOTAL {1e3 * float(np.median(times))}", flush=True)


def tilegraph_side(model: str, threads: int, repeat: int):
    """(whole forward ms, {shape: ms per forward}, {shape: implementation and layouts})."""
    env = dict(os.environ, ONEDNN_VERBOSE="profile_exec")
    out = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--threads", str(threads),
                          "--repeat", str(repeat)], env=env, capture_output=True, text=True, check=True).stdout
    per: dict[tuple, list[float]] = collections.defaultdict(list)
    impls = {}
    for run in out.split("@@RUN")[1:]:
        acc: dict[tuple, float] = collections.defaultdict(float)
        for line in run.splitlines():
            f = line.split(",")
            if not line.startswith("onednn_verbose,exec") or f[3] != "convolution":
                continue
            # oneDNN writes a grouped convolution's groups first: g8mb1_ic64oc64_...
            m, g = SHAPE.search(f[-2]), re.match(r"g(\d+)mb\d+_", f[-2])
            if m is None:
                continue
            shape = (int(g.group(1)) if g else 1,) + tuple(int(x) for x in m.groups())
            acc[shape] += float(f[-1])
            impls[shape] = f"{f[4]} {f[6]}"
        for k, v in acc.items():
            per[k].append(v)
    total = re.search(r"@@TOTAL ([\d.]+)", out)
    return float(total.group(1)) if total else float("nan"), {k: float(np.median(v)) for k, v in per.items()}, impls


def onnxruntime_side(model: str, threads: int, repeat: int):
    """(whole forward ms, {shape: ms per forward}, {other op type: ms per forward})."""
    import onnxruntime as ort

    import full_size_sweep
    from tests.models import export_onnx

    module, names, inputs = full_size_sweep.build(model, 1)
    feeds = dict(zip(names, [t.numpy() for t in inputs]))
    with tempfile.TemporaryDirectory() as d:
        path = export_onnx(module, tuple(inputs), Path(d) / "m.onnx", names, ["out"])
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as full_size_sweep.py
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(d) / "profile")
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        for _ in range(3):
            sess.run(None, feeds)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t)
        events = json.loads(Path(sess.end_profiling()).read_text())
    nodes: dict[str, tuple[tuple, list[float]]] = {}
    others: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        args = e["args"]
        if "Conv" in args.get("op_name", ""):
            x, w = (list(s.values())[0] for s in args["input_type_shape"][:2])
            y = list(args["output_type_shape"][0].values())[0]
            shape = (x[1] // w[1] if w[1] else 1, x[1], w[0], x[2], y[2], w[2], round(x[2] / y[2]) if y[2] else 1)
            nodes.setdefault(e["name"], (shape, []))[1].append(e["dur"] / 1e3)
        else:
            others[args.get("op_name", "?")] += e["dur"] / 1e3 / (repeat + 3)
    per: dict[tuple, float] = collections.defaultdict(float)
    for shape, durations in nodes.values():
        per[shape] += float(np.median(durations[-repeat:]))
    return 1e3 * float(np.median(times)), dict(per), dict(others)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", help="a benchmarks/full_size_sweep.py model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.model, args.threads, args.repeat)
        return 0
    sys.path.insert(0, str(ROOT))
    ort_ms, ort_conv, ort_other = onnxruntime_side(args.model, args.threads, args.repeat)
    tg_ms, tg_conv, impls = tilegraph_side(args.model, args.threads, args.repeat)
    print(f"{args.model}, batch 1, {args.threads} thread(s), medians of {args.repeat} calls; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"whole forward: tilegraph {tg_ms:.1f} ms, onnxruntime {ort_ms:.1f} ms, tilegraph/onnxruntime "
          f"{tg_ms / ort_ms:.2f}")
    print(f"convolutions: tilegraph {sum(tg_conv.values()):.1f} ms, onnxruntime {sum(ort_conv.values()):.1f} ms")
    print(f"{'g, ic, oc, ih, oh, k, s':30s} {'tilegraph ms':>12s} {'onnxruntime ms':>14s} {'ratio':>6s}  oneDNN")
    for shape in sorted(set(tg_conv) | set(ort_conv), key=lambda s: ort_conv.get(s, 0) - tg_conv.get(s, 0)):
        a, b = tg_conv.get(shape, 0.0), ort_conv.get(shape, 0.0)
        print(f"{str(shape):30s} {a:12.2f} {b:14.2f} {a / b if b else float('nan'):6.2f}  {impls.get(shape, '')}")
    print("onnxruntime's other nodes (ms per forward):",
          ", ".join(f"{k} {v:.2f}" for k, v in sorted(ort_other.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
