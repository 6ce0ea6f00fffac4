"""Cross-entropy's own gradient against autodiff's, in one run: a GPT-2-small-shaped training step
(tests/models.py CharGPT at 768 wide, 12 heads, 50257 symbols, batch 4 x seq 256, AdamW) on the C
backend built twice from the same weights: once with the loss differentiated by autodiff (the max
shift's gradient included: 4 passes and 3 exps per logit over each 50257-wide row) and once with
tilegraph.train's cross-entropy VJP ((softmax - one_hot) / rows: the backward's one pass and one exp),
timed interleaved; prints each median and the median per-round ratio with quartiles.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/train_cross_entropy.py [--layers 1] [--threads 1] [--repeat 5]
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts the repository root on sys.path)


import tilegraph  # noqa: E402
from tilegraph.frontends.torch_export import from_torch  # noqa: E402
from tilegraph.ir.autodiff import value_and_grad  # noqa: E402
from tilegraph.train import (AdamW, TrainStep, _with_loss, _with_update, build_step,  # noqa: E402
                             weights_to_inputs)

LR, DECAY = 1e-4, 0.01


def autodiff_step(model, params, optimizer):
    """build_step as it was before cross-entropy had a VJP of its own: autodiff through the loss."""
    m = value_and_grad(weights_to_inputs(_with_loss(model, "cross_entropy"), params), wrt=list(params))
    loss, *grads = m.func.body.block.last_op.operands
    return _with_update(m, params, grads, optimizer, None, [("loss", loss)])


def main() -> None:
    args, module, inputs, targets = _common.gpt2_shaped_step_setup(__doc__)
    imported = from_torch(copy.deepcopy(module), inputs)
    params = [n for n, _ in module.named_parameters()]
    optimizer = AdamW(lr=LR, weight_decay=DECAY)
    initial = {n: np.asarray(imported.weights[n]) for n in params}
    steps = {}
    for name, build in (("cross-entropy VJP", lambda: build_step(imported, "cross_entropy", optimizer, params)),
                        ("autodiff through the loss", lambda: autodiff_step(imported, params, optimizer))):
        t0 = time.perf_counter()
        model = build()
        step = TrainStep(model, tilegraph.compile(model, target="c"), initial, optimizer)
        step.compiled._runner.set_threads(args.threads)
        print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s, first loss {step(*inputs, targets=targets):.6f}")
        steps[name] = step
    runners = {name: (lambda s=s: s(*inputs, targets=targets)) for name, s in steps.items()}
    samples = _common.interleaved_samples(runners, args.repeat, warmup=0)
    ratio, q1, q3 = _common.paired_ratio(samples, "cross-entropy VJP", "autodiff through the loss")
    load = os.getloadavg()[0]
    print(_common.format_table(("layers", "threads", "cross-entropy VJP ms", "autodiff through the loss ms",
                                "VJP / autodiff (median per round, quartiles)", "load"),
                               [(args.layers, args.threads, f"{np.median(samples['cross-entropy VJP']) * 1e3:.0f}",
                                 f"{np.median(samples['autodiff through the loss']) * 1e3:.0f}",
                                 f"{ratio:.2f}x ({q1:.2f}-{q3:.2f})", f"{load:.1f}")]))


if __name__ == "__main__":
    main()
