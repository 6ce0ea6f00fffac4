"""all-MiniLM-L6-v2: compile time and CPU latency, tilegraph side by side with its peers.

Prints two tables, every number measured in this one run on the same inputs:
  1. compile time: tilegraph (import + passes + emit + load, from torch.export and
     from ONNX; the C backend cold, its C compiler included, and from its module cache)
     vs torch.compile's first call (Inductor, default mode);
  2. latency (median of round-robin runs, benchmarks/_common.py) at batch 1 and 8, sequence 128: tilegraph
     NumPy vs torch eager vs onnxruntime (default optimizations), with ratios.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/compile_minilm.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A fresh Inductor cache, so its first call compiles for real rather than loading
# kernels an earlier run left on disk.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
# Likewise tilegraph's caches (compiled models, C modules), so that "cold" is cold.
os.environ["TILEGRAPH_CACHE_DIR"] = tempfile.mkdtemp(prefix="tilegraph-")
# This directory is on sys.path when run as a script; _common adds the repository root.
from _common import interleaved_medians, machine_lines, timed  # noqa: E402

import torch  # noqa: E402

import tilegraph  # noqa: E402
from tilegraph.testing import relative_error  # noqa: E402
from tests.models import export_onnx, minilm_inputs, minilm_model  # noqa: E402

SEQ = 128
BATCHES = (1, 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    model = minilm_model()
    example = minilm_inputs(1, SEQ)
    print("\n".join(machine_lines()))
    print(f"all-MiniLM-L6-v2, sequence {SEQ}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")

    # --- compile time ---
    compiled_torch, t_tg_torch = timed(lambda: tilegraph.compile(model, example_inputs=example, target="numpy"))
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "minilm.onnx"
        export_onnx(model, example, onnx_path, input_names=["input_ids", "attention_mask"],
                    output_names=["last_hidden_state"],
                    dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                                  "last_hidden_state": {0: "batch", 1: "seq"}})
        compiled_onnx, t_tg_onnx = timed(lambda: tilegraph.compile(str(onnx_path), target="numpy"))
        # The C backend cold (empty caches: the passes and the C compiler run) and from the
        # caches (tilegraph/compile_cache.py: no import, no passes; the C module built).
        # The CPU profile the passes read is already loaded in this process.
        os.environ["TILEGRAPH_CACHE_DIR"] = tempfile.mkdtemp(prefix="tilegraph-c-")
        compiled_c, t_c_cold = timed(lambda: tilegraph.compile(str(onnx_path), target="c"))
        _, t_c_cached = timed(lambda: tilegraph.compile(str(onnx_path), target="c"))
        import onnxruntime as ort

        session, t_ort = timed(lambda: ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]))

    inductor = torch.compile(model)
    with torch.no_grad():
        _, t_inductor = timed(lambda: inductor(*example))

    print("compile time                                   seconds   vs torch.compile")
    for name, t in [("tilegraph, from torch.export (export+import+passes+emit)", t_tg_torch),
                    ("tilegraph, from ONNX (import+passes+emit)", t_tg_onnx),
                    ("tilegraph C, from ONNX, cold (import+passes+emit+cc)", t_c_cold),
                    ("tilegraph C, from ONNX, cached (compile cache + module)", t_c_cached),
                    ("onnxruntime InferenceSession (graph optimization)", t_ort),
                    ("torch.compile first call (Inductor)", t_inductor)]:
        print(f"  {name:<58} {t:7.2f}   {t / t_inductor:6.2f}x")

    # --- latency ---
    print(f"\nlatency, median of {args.repeats} (round-robin)  ms      vs torch eager   vs onnxruntime")
    for batch in BATCHES:
        ids, mask = minilm_inputs(batch, SEQ)
        feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
        with torch.no_grad():
            reference = model(ids, mask).numpy()
        ours = compiled_onnx(feeds["input_ids"], feeds["attention_mask"])
        err = relative_error(ours, reference)
        err_c = relative_error(compiled_c(feeds["input_ids"], feeds["attention_mask"]), reference)

        def no_grad(fn):
            def run():
                with torch.no_grad():
                    return fn(ids, mask)
            return run

        t = interleaved_medians({"ours": lambda: compiled_onnx(feeds["input_ids"], feeds["attention_mask"]),
                                 "c": lambda: compiled_c(feeds["input_ids"], feeds["attention_mask"]),
                                 "eager": no_grad(model), "inductor": no_grad(inductor),
                                 "ort": lambda: session.run(None, feeds)}, args.repeats)
        t_ours, t_eager, t_inductor, t_ort = t["ours"], t["eager"], t["inductor"], t["ort"]
        print(f"batch {batch} (max rel err vs eager: tilegraph NumPy {err:.1e}, C {err_c:.1e})")
        for name, t in [("tilegraph NumPy", t_ours), ("tilegraph C", t["c"]), ("torch eager", t_eager),
                        ("torch.compile (steady state)", t_inductor), ("onnxruntime", t_ort)]:
            print(f"  {name:<30} {1e3 * t:9.2f}   {t / t_eager:8.2f}x   {t / t_ort:12.2f}x")


if __name__ == "__main__":
    main()
