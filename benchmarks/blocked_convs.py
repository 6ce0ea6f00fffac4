"""Convolution chains in oneDNN's blocked layout (nChw16c/nChw8c, ir/hardware.blocked_conv)
against the same model compiled channels-last (TG_BLOCKED=0 while it is emitted), with
onnxruntime in the same rounds, on full_size_sweep.py's image models.

    .venv/bin/python benchmarks/blocked_convs.py --only mobilenet-v2,mobilenet-v3-large --batch 8 --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from _common import interleaved_samples, machine_lines, paired_ratio  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run_one(name: str, batch: int, threads: int, repeat: int) -> str:
    import onnxruntime as ort
    import torch

    import tilegraph
    from full_size_sweep import build
    from tilegraph.testing import relative_error

    sys.path.insert(0, str(ROOT))
    from tests.models import export_onnx

    torch.set_num_threads(threads)
    module, names, inputs = build(name, batch)
    arrays = [t.numpy() for t in inputs]
    with torch.no_grad():
        ref = module(*inputs).numpy().astype(np.float64)
        program = torch.export.export(module, inputs)
    runners, notes = {}, []
    for key, flag in (("channels-last", "0"), ("blocked", "1")):
        os.environ["TG_BLOCKED"] = flag  # (read while the program is emitted)
        compiled = tilegraph.compile(program, target="c", threads=threads)
        del os.environ["TG_BLOCKED"]
        err = relative_error(np.asarray(compiled.run(*arrays)[0], dtype=np.float64), ref)
        lines = compiled._runner.primitives
        notes.append(f"{key}: err {err:.1e}, {sum('nChw' in line for line in lines)} of {len(lines)} primitives "
                     f"blocked, {len(compiled.reference_kernels)} on ref")
        runners[key] = (lambda c: lambda: c.run(*arrays))(compiled)
    with tempfile.TemporaryDirectory() as d:
        path = export_onnx(module, inputs, Path(d) / "m.onnx", names, ["out"])
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.intra_op_num_threads = threads
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        feeds = dict(zip(names, arrays))
        runners["onnxruntime"] = lambda: sess.run(None, feeds)
        samples = interleaved_samples(runners, repeat)
    ms = {k: 1e3 * float(np.median(v)) for k, v in samples.items()}
    ratios = [paired_ratio(samples, a, b)[0] for a, b in
              (("blocked", "channels-last"), ("blocked", "onnxruntime"), ("channels-last", "onnxruntime"))]
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{name:20s} b{batch} {ms['blocked']:8.1f} {ms['channels-last']:8.1f} {ms['onnxruntime']:8.1f}   "
            + "  ".join(f"{r:5.2f}" for r in ratios) + f"   load {load}\n" + "\n".join("    " + n for n in notes))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="mobilenet-v2,mobilenet-v3-large,efficientnet-b0")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    print("\n".join(machine_lines()))
    print(f"threads {args.threads}; medians of {args.repeat} round-robin rounds; ratios: medians of per-round ratios")
    print(f"{'model':20s} batch blocked ms  ch-last ms  onnxruntime ms   blocked/ch-last  blocked/ort  ch-last/ort")
    for name in args.only.split(","):
        print(run_one(name, args.batch, args.threads, args.repeat), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
