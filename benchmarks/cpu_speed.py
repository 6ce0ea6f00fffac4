"""CPU latency: tilegraph NumPy against onnxruntime and torch eager (issue 3, "Speed on the CPU").

For each model, in one run on the same inputs, the median latency of
  * tilegraph NumPy, default pipeline        (passes.registry.DEFAULT_PIPELINE)
  * tilegraph NumPy without fusion/tiling    (passes.registry.UNFUSED_PIPELINE)
  * onnxruntime, default optimizations, CPUExecutionProvider, default threads
    (the model exported with tests/models.py's export_onnx)
  * torch eager under torch.inference_mode, default threads
  * "NumPy GEMMs": the model's matrix products alone (every tg.matmul of the unfused
    graph, its weights the model's own arrays, its activations random arrays of the
    same shapes), one np.matmul each on BLAS's own threads. No NumPy backend can run
    the model faster than its BLAS runs these, so GEMMs/ORT says how close to the
    target the BLAS NumPy links (OpenBLAS here) lets tilegraph come at all.
timed round-robin (benchmarks/_common.py) so load on the shared machine hits all
of them alike, in two ways: "settled", each timed call after a 50 ms pause (every
library's threads asleep, as for a lone request), and "back to back", each timed call
right after an untimed one of the same peer (pools awake, weights in cache, as in a
serving loop). On the 2-core dev VM the two differ by up to 2x for onnxruntime, whose
pool and prepacked weights gain most from staying warm. Ratios (tilegraph/ORT, ...)
are medians over rounds of the ratio within each round, with the quartiles of those
ratios: the machine's speed drifts 20-40% over minutes, far less within one round.
Every output is checked against onnxruntime's (relative error <=
tilegraph.testing.PEER_RELATIVE_ERROR) and printed beside the time, so a fast wrong
result cannot pass: the script exits 1 when one is off.

Models (tests/models.py): all-MiniLM-L6-v2 at batch 1 and 8, sequence 128 (eager
attention, as benchmarks/compile_minilm.py); a GPT-2-small-shaped decoder
(random init from GPT2Config, batch 1, sequence 256); the small CNN at batch 32.
Issue 3's target: tilegraph at or below onnxruntime on the transformer models.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cpu_speed.py [--models minilm,gpt2,cnn] [--repeat N] [--quick]
                                                              [--threads N] [--mode settled|back-to-back|both]

--threads N gives every peer N threads (NumPy's BLAS, torch, onnxruntime's
intra-op pool) instead of each library's default: on a machine shared with other
jobs, thread pools that wait for a descheduled worker make multi-threaded times
swing several-fold, and --threads 1 measures the code rather than the scheduler.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MODELS = ("minilm", "gpt2", "cnn")
REPEAT, QUICK_REPEAT = 15, 3


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--repeat", type=int, default=None, help=f"timed rounds per model (default {REPEAT})")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_REPEAT} rounds: a smoke run, noisy numbers")
    ap.add_argument("--threads", type=int, default=None, help="threads for every peer (default: each library's own)")
    ap.add_argument("--mode", choices=("settled", "back-to-back", "both"), default="both",
                    help="how calls are timed (default both; see the module docstring)")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    args.repeat = args.repeat or (QUICK_REPEAT if args.quick else REPEAT)
    return args


# The arguments are read before NumPy is imported: OpenBLAS sizes its thread pool
# from the environment when it loads.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.threads:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TILEGRAPH_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Run as a script, this directory is on sys.path; _common is imported by its own
# name because `benchmarks` is taken (xdsl installs a top-level package of that
# name). _common puts the repository root on sys.path too.
from _common import format_table, interleaved_samples, machine_lines, paired_ratio, timed  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

import tilegraph  # noqa: E402
from tilegraph.passes.registry import DEFAULT_PIPELINE, UNFUSED_PIPELINE  # noqa: E402
from tilegraph.ir.shapes import info_of  # noqa: E402
from tilegraph.testing import PEER_RELATIVE_ERROR, relative_error  # noqa: E402
from tests import models  # noqa: E402

MINILM_SEQ, MINILM_BATCHES = 128, (1, 8)  # issue 3
GPT2_BATCH, GPT2_SEQ = 1, 256  # issue 3
# The small CNN is tiny (16x16 inputs, ~0.2 MFLOP per image): batch 32 gives its
# convolutions a few MFLOP per call, so the time is not per-call overhead alone.
CNN_BATCH = 32
TRANSFORMERS = ("minilm", "gpt2")  # the models the target is about
PEERS = ("tilegraph", "tilegraph unfused", "onnxruntime", "torch eager", "NumPy GEMMs")
RATIOS = (("tilegraph", "onnxruntime"), ("tilegraph", "torch eager"), ("tilegraph unfused", "tilegraph"),
          ("NumPy GEMMs", "onnxruntime"))
RATIO_LABELS = (("tg", "ORT"), ("tg", "eager"), ("unfused", "tg"), ("GEMMs", "ORT"))


@dataclass
class Case:
    model: str  # key for --models
    label: str
    module: Callable[[], torch.nn.Module]  # built once per model, shared by its cases
    inputs: tuple
    input_names: list[str]


def cases(selected: list[str]) -> list[Case]:
    out = []
    if "minilm" in selected:
        out += [Case("minilm", f"MiniLM b{b} s{MINILM_SEQ}", models.minilm_model, models.minilm_inputs(b, MINILM_SEQ),
                     ["input_ids", "attention_mask"]) for b in MINILM_BATCHES]
    if "gpt2" in selected:
        out.append(Case("gpt2", f"GPT-2 small b{GPT2_BATCH} s{GPT2_SEQ}", models.gpt2_model,
                        models.gpt2_inputs(GPT2_BATCH, GPT2_SEQ), ["input_ids"]))
    if "cnn" in selected:
        out.append(Case("cnn", f"small CNN b{CNN_BATCH}", models.small_cnn, models.small_cnn_inputs(CNN_BATCH),
                        ["x"]))
    return out


def ort_session(module, inputs, names, tmp: Path, threads: int | None) -> ort.InferenceSession:
    path = models.export_onnx(module, inputs, tmp / "model.onnx", input_names=names, output_names=["y"])
    # Default SessionOptions: ORT_ENABLE_ALL graph optimizations, one intra-op thread per core.
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def gemm_floor(model) -> Callable[[], None]:
    """A runner doing only the matrix products of `model` (a tilegraph Model at concrete
    sizes), in graph order: the floor any NumPy backend of it stands on."""
    rng = np.random.default_rng(0)
    calls = []
    for op in model.ops():
        if getattr(op, "op_name", None) != "matmul":
            continue
        operands = []
        for v in op.operands:
            owner = v.owner
            if getattr(owner, "op_name", None) == "weight":
                operands.append(np.asarray(model.weights[owner.attr("name")]))
            else:
                info = info_of(v.type)
                operands.append(rng.standard_normal(tuple(int(d) for d in info.shape)).astype(np.float32))
        out = np.matmul(*operands)
        calls.append((operands[0], operands[1], out))

    def run():
        for a, b, out in calls:
            np.matmul(a, b, out=out)
    return run


def measure(case: Case, module, repeat: int, threads: int | None, modes: list[str]) -> dict:
    """Build every peer for `case`, check its output against onnxruntime's, time them all."""
    arrays = [t.numpy() for t in case.inputs]
    torch_inputs = tuple(torch.from_numpy(a) for a in arrays)  # the same memory as `arrays`
    feeds = dict(zip(case.input_names, arrays))

    with tempfile.TemporaryDirectory() as tmp:
        session, t_ort = timed(lambda: ort_session(module, case.inputs, case.input_names, Path(tmp), threads))
    imported, t_import = timed(lambda: tilegraph.import_model(module, case.inputs))
    fused, t_fused = timed(lambda: tilegraph.compile(imported, pipeline=DEFAULT_PIPELINE))
    unfused, t_unfused = timed(lambda: tilegraph.compile(imported, pipeline=UNFUSED_PIPELINE))
    floor = gemm_floor(unfused.model)
    print(f"  {case.label}: ONNX export+session {t_ort:.1f} s, torch.export+import {t_import:.1f} s, "
          f"passes+emit {t_fused:.1f} s (default) / {t_unfused:.1f} s (unfused)", flush=True)

    def eager():
        with torch.inference_mode():
            return module(*torch_inputs)

    runners = {"tilegraph": lambda: fused(*arrays), "tilegraph unfused": lambda: unfused(*arrays),
               "onnxruntime": lambda: session.run(None, feeds), "torch eager": eager, "NumPy GEMMs": floor}
    reference = session.run(None, feeds)[0]
    outputs = {"tilegraph": fused(*arrays), "tilegraph unfused": unfused(*arrays), "torch eager": eager().numpy()}
    errors = {name: relative_error(out, reference) for name, out in outputs.items()}
    samples = {mode: interleaved_samples(runners, repeat, back_to_back=mode == "back-to-back") for mode in modes}
    return {"samples": samples, "errors": errors}


def main(args: argparse.Namespace) -> int:
    repeat = args.repeat
    if args.threads:
        torch.set_num_threads(args.threads)
    ort_threads = f"{args.threads} intra-op thread{'s' * (args.threads != 1)}" if args.threads else "default threads"
    for line in machine_lines(torch=f"{torch.__version__} (threads: {torch.get_num_threads()})",
                              onnxruntime=f"{ort.__version__} ({ort_threads})"):
        print(line)
    print(f"tilegraph default pipeline: {DEFAULT_PIPELINE}")
    if DEFAULT_PIPELINE == UNFUSED_PIPELINE:
        print("  (the same as the unfused one: fuse and tile are not in the default pipeline yet)")
    else:
        print(f"tilegraph unfused pipeline: {UNFUSED_PIPELINE}")
    print(f"median of {repeat} round-robin rounds after one warm-up each, per timing mode; errors are "
          f"max|a-o|/max|o| against "
          f"onnxruntime's output o (bound {PEER_RELATIVE_ERROR:.0e})\n", flush=True)

    modes = ["settled", "back-to-back"] if args.mode == "both" else [args.mode]
    rows, failures, target = [], [], []
    built: dict[str, torch.nn.Module] = {}
    for case in cases(args.models):
        if case.model not in built:
            built[case.model] = case.module()
        r = measure(case, built[case.model], repeat, args.threads, modes)
        e = r["errors"]
        failures += [f"{case.label}: {name} {err:.1e}" for name, err in e.items() if not err <= PEER_RELATIVE_ERROR]
        for mode, samples in r["samples"].items():
            ratio = {pair: paired_ratio(samples, *pair) for pair in RATIOS}
            if case.model in TRANSFORMERS:
                target.append(ratio[("tilegraph", "onnxruntime")][0] <= 1.0)
            rows.append([case.label, mode] + [f"{1e3 * np.median(samples[p]):.1f}" for p in PEERS]
                        + [f"{m:.2f}x ({lo:.2f}-{hi:.2f})" for m, lo, hi in ratio.values()]
                        + [f"{e[p]:.0e}" for p in ("tilegraph", "tilegraph unfused", "torch eager")])

    header = (["model", "timed"] + [f"{p} ms" for p in PEERS] + [f"{a}/{b}" for a, b in RATIO_LABELS]
              + ["err tg", "err unfused", "err eager"])
    print("\n" + format_table(header, rows))
    print("\nratios: median over rounds of the ratio within a round (quartiles in brackets)")
    if target:
        print(f"target (issue 3) tilegraph <= onnxruntime on the transformer models: "
              f"{'met' if all(target) else 'not met'} ({sum(target)} of {len(target)} model x timing rows)")
    if failures:
        print("\nOUTPUT CHECK FAILED (relative error above the bound): " + "; ".join(failures))
        return 1
    print(f"all outputs within {PEER_RELATIVE_ERROR:.0e} of onnxruntime")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
