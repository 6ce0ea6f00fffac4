"""CPU latency: tilegraph's C backend against onnxruntime, torch eager and torch.compile.

For each model, in one run on the same inputs, the median latency of
  * tilegraph C, default pipeline            (target "c": emitted C + OpenMP, GEMMs on
    oneDNN with weights packed once; passes.registry.DEFAULT_PIPELINE)
  * tilegraph C without fusion/tiling        (passes.registry.UNFUSED_PIPELINE): what
    the fusion decisions buy on this backend
  * tilegraph NumPy, default pipeline        (the readable reference backend)
  * onnxruntime, default optimizations, CPUExecutionProvider
    (the model exported with tests/models.py's export_onnx)
  * torch eager under torch.inference_mode
  * torch.compile (Inductor's CPU C++ backend), timed after its warm-up calls
    (--no-compile leaves it out: its first call compiles for a minute on big models)
timed round-robin (benchmarks/_common.py) so load on the shared machine hits all
of them alike, in two ways: "settled", each timed call after a 50 ms pause (every
library's threads asleep, as for a lone request), and "back to back", each timed call
right after an untimed one of the same peer (pools awake, weights in cache, as in a
serving loop). Ratios (C/ORT, ...) are medians over rounds of the ratio within each
round, with the quartiles of those ratios: the machine's speed drifts 20-40% over
minutes, far less within one round. Every output is checked against onnxruntime's
(relative error <= tilegraph.testing.PEER_RELATIVE_ERROR) and printed beside the
time, so a fast wrong result cannot pass: the script exits 1 when one is off.

Models (tests/models.py): all-MiniLM-L6-v2 at batch 1 and 8, sequence 128 (eager
attention, as benchmarks/compile_minilm.py); a GPT-2-small-shaped decoder
(random init from GPT2Config, batch 1, sequence 256); the small CNN at batch 32.
The native CPU backend's target: tilegraph C at or below 0.9x onnxruntime and 0.8x
torch eager on every model, with default threads and with --threads 1.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cpu_speed.py [--models minilm,gpt2,cnn] [--repeat N] [--quick]
                                                              [--threads N] [--mode settled|back-to-back|both]
                                                              [--no-compile]

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
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
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
from tilegraph.testing import PEER_RELATIVE_ERROR, relative_error  # noqa: E402
from tests import models  # noqa: E402

MINILM_SEQ, MINILM_BATCHES = 128, (1, 8)
GPT2_BATCH, GPT2_SEQ = 1, 256
# The small CNN is tiny (16x16 inputs, ~0.2 MFLOP per image): batch 32 gives its
# convolutions a few MFLOP per call, so the time is not per-call overhead alone.
CNN_BATCH = 32
PEERS = ("tilegraph C", "C unfused", "tilegraph NumPy", "onnxruntime", "torch eager", "torch.compile")
RATIOS = (("tilegraph C", "onnxruntime"), ("tilegraph C", "torch eager"), ("tilegraph C", "torch.compile"),
          ("C unfused", "tilegraph C"), ("tilegraph NumPy", "tilegraph C"))
RATIO_LABELS = (("C", "ORT"), ("C", "eager"), ("C", "compile"), ("unfused", "C"), ("NumPy", "C"))
# The native CPU backend's targets (latency ratios, per model and timing mode).
TARGET_ORT, TARGET_EAGER = 0.9, 0.8


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


def ort_session(module, inputs, names, tmp: Path, threads: int | None, profile: bool = False) -> ort.InferenceSession:
    path = models.export_onnx(module, inputs, tmp / "model.onnx", input_names=names, output_names=["y"])
    # Default SessionOptions: ORT_ENABLE_ALL graph optimizations, one intra-op thread per core.
    opts = ort.SessionOptions()
    if profile:
        opts.enable_profiling = True
        # Outside tmp: the profile is written at end_profiling(), after the caller's tmp is gone.
        opts.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort_profile")
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def measure(case: Case, module, repeat: int, threads: int | None, modes: list[str], peers: list[str]) -> dict:
    """Build every peer for `case`, check its output against onnxruntime's, time them all."""
    arrays = [t.numpy() for t in case.inputs]
    torch_inputs = tuple(torch.from_numpy(a) for a in arrays)  # the same memory as `arrays`
    feeds = dict(zip(case.input_names, arrays))

    with tempfile.TemporaryDirectory() as tmp:
        session, t_ort = timed(lambda: ort_session(module, case.inputs, case.input_names, Path(tmp), threads))
    imported, t_import = timed(lambda: tilegraph.import_model(module, case.inputs))
    native, t_c = timed(lambda: tilegraph.compile(imported, target="c", pipeline=DEFAULT_PIPELINE))
    unfused = tilegraph.compile(imported, target="c", pipeline=UNFUSED_PIPELINE)
    numpy_backend = tilegraph.compile(imported, target="numpy", pipeline=DEFAULT_PIPELINE)
    if threads:
        for compiled in (native, unfused):
            compiled._runner.set_threads(threads)

    def eager():
        with torch.inference_mode():
            return module(*torch_inputs)

    runners = {"tilegraph C": lambda: native(*arrays), "C unfused": lambda: unfused(*arrays),
               "tilegraph NumPy": lambda: numpy_backend(*arrays), "onnxruntime": lambda: session.run(None, feeds),
               "torch eager": eager}
    outputs = {"tilegraph C": native(*arrays), "C unfused": unfused(*arrays),
               "tilegraph NumPy": numpy_backend(*arrays), "torch eager": eager().numpy()}
    t_compile = 0.0
    if "torch.compile" in peers:
        compiled_module = torch.compile(module)

        def inductor():
            with torch.inference_mode():
                return compiled_module(*torch_inputs)
        out, t_compile = timed(inductor)  # the first call compiles
        inductor()
        runners["torch.compile"] = inductor
        outputs["torch.compile"] = out.numpy()
    print(f"  {case.label}: ONNX export+session {t_ort:.1f} s, torch.export+import {t_import:.1f} s, "
          f"tilegraph C passes+emit+build {t_c:.1f} s, torch.compile first call {t_compile:.1f} s", flush=True)
    reference = session.run(None, feeds)[0]
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
    print(f"tilegraph unfused pipeline: {UNFUSED_PIPELINE}")
    print(f"median of {repeat} round-robin rounds after one warm-up each, per timing mode; errors are "
          f"max|a-o|/max|o| against onnxruntime's output o (bound {PEER_RELATIVE_ERROR:.0e})\n", flush=True)

    modes = ["settled", "back-to-back"] if args.mode == "both" else [args.mode]
    peers = [p for p in PEERS if p != "torch.compile" or not args.no_compile]
    ratios = [pair for pair in RATIOS if set(pair) <= set(peers)]
    labels = [lab for pair, lab in zip(RATIOS, RATIO_LABELS) if pair in ratios]
    rows, failures, target = [], [], []
    built: dict[str, torch.nn.Module] = {}
    for case in cases(args.models):
        if case.model not in built:
            built[case.model] = case.module()
        r = measure(case, built[case.model], repeat, args.threads, modes, peers)
        e = r["errors"]
        failures += [f"{case.label}: {name} {err:.1e}" for name, err in e.items() if not err <= PEER_RELATIVE_ERROR]
        for mode, samples in r["samples"].items():
            ratio = {pair: paired_ratio(samples, *pair) for pair in ratios}
            target.append(ratio[("tilegraph C", "onnxruntime")][0] <= TARGET_ORT
                          and ratio[("tilegraph C", "torch eager")][0] <= TARGET_EAGER)
            rows.append([case.label, mode] + [f"{1e3 * np.median(samples[p]):.2f}" for p in peers]
                        + [f"{m:.2f}x ({lo:.2f}-{hi:.2f})" for m, lo, hi in ratio.values()]
                        + [f"{e[p]:.0e}" for p in peers if p in e])

    header = (["model", "timed"] + [f"{p} ms" for p in peers] + [f"{a}/{b}" for a, b in labels]
              + [f"err {p}" for p in peers if p != "onnxruntime"])
    print("\n" + format_table(header, rows))
    print("\nratios: median over rounds of the ratio within a round (quartiles in brackets)")
    print(f"target: tilegraph C <= {TARGET_ORT}x onnxruntime and <= {TARGET_EAGER}x torch eager: "
          f"{'met' if all(target) else 'not met'} ({sum(target)} of {len(target)} model x timing rows)")
    if failures:
        print("\nOUTPUT CHECK FAILED (relative error above the bound): " + "; ".join(failures))
        return 1
    print(f"all outputs within {PEER_RELATIVE_ERROR:.0e} of onnxruntime")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
