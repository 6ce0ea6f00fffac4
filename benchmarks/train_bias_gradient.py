"""Bias gradients in their weight gradient's GEMM step against steps of their own, in one run: a
GPT-2-small-shaped training step (tests/models.py CharGPT at 768 wide, 12 heads, 50257 symbols,
batch 4 x seq 256, cross-entropy, AdamW) on the C backend built twice from the same weights: once
with each Linear's bias gradient (the column sum of dY) run in the step of its X^T dY GEMM
(backends/c/groups.py `_bias_partners`), once with each column sum a step of its own (as before);
timed interleaved; prints each median, the median per-round ratio with quartiles, and the load.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/train_bias_gradient.py [--layers 1] [--threads 1] [--repeat 5]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts the repository root on sys.path)


import tilegraph  # noqa: E402
from tilegraph.backends.c.groups import BIAS_GRADIENT, Groups  # noqa: E402
from tilegraph.frontends.torch_export import from_torch  # noqa: E402
from tilegraph.train import AdamW, TrainStep, build_step  # noqa: E402

LR, DECAY = 1e-4, 0.01


def main() -> None:
    args, module, inputs, targets = _common.gpt2_shaped_step_setup(__doc__)
    imported = from_torch(module, inputs)
    params = [n for n, _ in module.named_parameters()]
    optimizer = AdamW(lr=LR, weight_decay=DECAY)
    initial = {n: np.asarray(imported.weights[n]) for n in params}
    model = build_step(imported, "cross_entropy", optimizer, params)
    steps = {}
    for name, fused in (("bias in the dW GEMM step", True), ("bias sums as steps", False)):
        t0 = time.perf_counter()
        Groups.bias_in_gemm = fused
        try:
            compiled = tilegraph.compile(model.clone(), target="c")
        finally:
            Groups.bias_in_gemm = True
        merged = sum(s.comment.endswith(BIAS_GRADIENT) for s in compiled._runner.program.steps)
        step = TrainStep(model, compiled, initial, optimizer)
        step.compiled._runner.set_threads(args.threads)
        print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s, {merged} GEMM steps with their bias "
              f"gradient, first loss {step(*inputs, targets=targets):.6f}")
        steps[name] = step
    runners = {name: (lambda s=s: s(*inputs, targets=targets)) for name, s in steps.items()}
    samples = _common.interleaved_samples(runners, args.repeat, warmup=0)
    a, b = steps
    ratio, q1, q3 = _common.paired_ratio(samples, a, b)
    print(_common.format_table(("layers", "threads", f"{a} ms", f"{b} ms", "ratio (median per round, quartiles)",
                                "load"),
                               [(args.layers, args.threads, f"{np.median(samples[a]) * 1e3:.0f}",
                                 f"{np.median(samples[b]) * 1e3:.0f}", f"{ratio:.3f}x ({q1:.3f}-{q3:.3f})",
                                 f"{os.getloadavg()[0]:.1f}")]))


if __name__ == "__main__":
    main()
