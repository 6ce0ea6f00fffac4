"""`make demo`: compile the bundled tiny BERT encoder and show every step.

1. import examples/tiny_encoder.onnx (dynamic batch and sequence) into tg IR;
2. print the IR, run the default pass pipeline, print the IR again;
3. build it for the default CPU target (the native C backend where a C compiler is
   installed) and for NumPy, the readable reference; write both sources to out/;
4. compare each with the float64 reference interpreter and onnxruntime, and time them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tilegraph  # noqa: E402
from tilegraph.ir import interpret  # noqa: E402
from tilegraph.passes.registry import DEFAULT_PIPELINE  # noqa: E402
from tilegraph.testing import PEER_RELATIVE_ERROR, relative_error  # noqa: E402

MODEL = ROOT / "examples" / "tiny_encoder.onnx"
OUT = ROOT / "out"
SUFFIX = {"c": ".c", "numpy": "_np.py"}
BATCH, SEQ, VOCAB = 4, 32, 512
REPEATS = 50


def banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


def median_ms(fn, repeats: int = REPEATS) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> int:
    banner(f"import {MODEL.relative_to(ROOT)}")
    model = tilegraph.import_model(str(MODEL))
    print(model.text)

    banner(f"compile with the default pipeline: {DEFAULT_PIPELINE}")
    t0 = time.perf_counter()
    compiled = tilegraph.compile(model)  # the default target: "c" here if it builds
    print(f"passes + emit + build + load for target {compiled.target!r}: {1e3 * (time.perf_counter() - t0):.0f} ms; "
          f"{len(model.ops())} ops before, {len(compiled.model.ops())} after")
    print(compiled.model.text)
    targets = {compiled.target: compiled}
    if compiled.target != "numpy":
        targets["numpy"] = tilegraph.compile(model, target="numpy")

    OUT.mkdir(exist_ok=True)
    for target, c in targets.items():
        path = OUT / f"tiny_encoder{SUFFIX.get(target, '.txt')}"
        banner(f"emitted {target} -> {path.relative_to(ROOT)}")
        path.write_text(c.source)
        lines = c.source.splitlines()
        start = next((i for i, line in enumerate(lines) if "def forward" in line or "step 0:" in line), 0)
        print("\n".join(lines[start:start + 40]))
        print(f"... ({len(lines)} lines)")

    banner(f"run at batch {BATCH}, sequence {SEQ}")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(BATCH, SEQ), dtype=np.int64)
    mask = np.ones((BATCH, SEQ), dtype=np.int64)
    mask[1:, SEQ // 2:] = 0  # padded rows
    (reference,) = interpret(model, [ids, mask])
    err = 0.0
    for target, c in targets.items():
        e = relative_error(c(ids, mask), reference)
        err = max(err, e)
        print(f"tilegraph {target:<6} vs float64 reference: max relative error {e:.2e}")

    import onnxruntime as ort

    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": mask}
    (theirs,) = session.run(None, feeds)
    print(f"onnxruntime      vs float64 reference: max relative error "
          f"{relative_error(theirs, reference):.2e}")

    ort_ms = median_ms(lambda: session.run(None, feeds))
    for target, c in targets.items():
        ms = median_ms(lambda: c(ids, mask))
        print(f"latency (median of {REPEATS}): tilegraph {target} {ms:.2f} ms, onnxruntime {ort_ms:.2f} ms "
              f"(ratio {ms / ort_ms:.2f}x)")
    return 0 if err <= PEER_RELATIVE_ERROR else 1


if __name__ == "__main__":
    sys.exit(main())
