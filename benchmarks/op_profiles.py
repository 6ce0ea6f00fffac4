"""Where the time goes, side by side: onnxruntime's own per-node profile (by op type)
and tilegraph's per-kernel profile (by fused group), on the same model and inputs.

The whole-model ratio (benchmarks/cpu_speed.py) says how far apart the two are; this
says where: e.g. onnxruntime's Gelu against the gelu in tilegraph's FFN group, its
Gemm total against tilegraph's GEMM groups. Both profiles add a little timing
overhead of their own, so compare kernels, not the totals with cpu_speed.py's.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/op_profiles.py [--model minilm1|minilm8|gpt2] [--repeat N]
                                                                [--threads N]

--threads 1 compares the kernels themselves: on this 2-core VM a thread woken from
sleep takes 0.1-0.3 ms to run, which multi-threaded profiles of both sides include.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["minilm1", "minilm8", "gpt2"], default="minilm8")
    ap.add_argument("--repeat", type=int, default=10, help="profiled runs of each (default 10)")
    ap.add_argument("--threads", type=int, default=None, help="threads for both (default: each library's own)")
    return ap.parse_args(argv)


# Read before NumPy is imported: OpenBLAS sizes its thread pool from the environment when it loads.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.threads:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "TILEGRAPH_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from _common import format_table, machine_lines  # noqa: E402  (puts the repo on sys.path)
from cost_model_accuracy import label_of, profile  # noqa: E402

import onnxruntime as ort  # noqa: E402

import tilegraph  # noqa: E402
from tilegraph.backends.numpy.emit import emit_profiled  # noqa: E402
from tilegraph.passes.registry import DEFAULT_PIPELINE, run_pipeline  # noqa: E402
from tests import models  # noqa: E402

CASES = {"minilm1": ("MiniLM b1 s128", lambda: (models.minilm_model(), models.minilm_inputs(1, 128)),
                     ["input_ids", "attention_mask"]),
         "minilm8": ("MiniLM b8 s128", lambda: (models.minilm_model(), models.minilm_inputs(8, 128)),
                     ["input_ids", "attention_mask"]),
         "gpt2": ("GPT-2 small b1 s256", lambda: (models.gpt2_model(), models.gpt2_inputs(1, 256)), ["input_ids"])}
TOP = 12  # rows per side


def ort_profile(module, inputs, names, repeat: int, threads: int | None = None) -> dict[str, tuple[float, int]]:
    """op type -> (seconds per run, nodes per run), from onnxruntime's profiler."""
    with tempfile.TemporaryDirectory() as tmp:
        path = models.export_onnx(module, inputs, Path(tmp) / "model.onnx", input_names=names, output_names=["y"])
        opts = ort.SessionOptions()
        opts.enable_profiling = True
        if threads:
            opts.intra_op_num_threads = threads
        opts.profile_file_prefix = str(Path(tmp) / "profile")
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        feeds = {n: t.numpy() for n, t in zip(names, inputs)}
        session.run(None, feeds)  # warm-up (also profiled: dropped below by dividing by repeat + 1)
        for _ in range(repeat):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            totals[e["args"]["op_name"]][0] += e["dur"] * 1e-6
            totals[e["args"]["op_name"]][1] += 1
    runs = repeat + 1
    return {op: (t / runs, n // runs) for op, (t, n) in totals.items()}


def tilegraph_profile(module, inputs, repeat: int) -> tuple[dict[str, tuple[float, int]], float]:
    """kernel label -> (seconds per run, copies), and the forward's median seconds."""
    compiled = run_pipeline(tilegraph.import_model(module, inputs), DEFAULT_PIPELINE)
    source, kernel_ops = emit_profiled(compiled)
    medians, forward = profile(source, compiled.weights, [t.numpy() for t in inputs], repeat)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, seconds in medians.items():
        label = label_of(kernel_ops[name])[1]
        totals[label][0] += seconds
        totals[label][1] += 1
    return {label: (t, n) for label, (t, n) in totals.items()}, forward


def main(args: argparse.Namespace) -> int:
    label, build, names = CASES[args.model]
    module, inputs = build()
    threads = f"{args.threads} intra-op thread{'s' * (args.threads != 1)}" if args.threads else "default threads"
    for line in machine_lines(onnxruntime=f"{ort.__version__} ({threads})"):
        print(line)
    ours, forward = tilegraph_profile(module, inputs, args.repeat)
    theirs = ort_profile(module, inputs, names, args.repeat, args.threads)
    print(f"\n{label}: tilegraph kernels {1e3 * sum(t for t, _ in ours.values()):.1f} ms "
          f"(forward {1e3 * forward:.1f} ms), onnxruntime nodes {1e3 * sum(t for t, _ in theirs.values()):.1f} ms")
    print("\ntilegraph, by kernel (default pipeline)")
    print(format_table(["ms", "copies", "kernel"], [[f"{1e3 * t:.2f}", n, k[:110]] for k, (t, n) in
                                                    sorted(ours.items(), key=lambda kv: -kv[1][0])[:TOP]], "rrl"))
    print("\nonnxruntime, by op type (default optimizations)")
    print(format_table(["ms", "nodes", "op"], [[f"{1e3 * t:.2f}", n, op] for op, (t, n) in
                                               sorted(theirs.items(), key=lambda kv: -kv[1][0])[:TOP]], "rrl"))
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
