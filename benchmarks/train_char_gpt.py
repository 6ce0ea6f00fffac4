"""It learns: a small GPT trained character-level by tilegraph.train_step, step for step beside
torch eager (and torch.compile) from the same initial weights and batches.

The text is one that ships with Python itself (the standard library's textwrap.py). Every
step runs tilegraph's compiled step (forward, cross-entropy, backward, AdamW, gradient
clipping) and torch eager's, interleaved, so both see the same machine load; the loss of
each is printed every few steps with their relative difference, then the median step time
of each and their ratio, paired per step. With --compile, a third model trained by a
torch.compile'd forward + backward (AdamW eager, as torch.compile users run it) joins the
same loop.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/train_char_gpt.py [--steps 300] [--layers 4] [--hidden 128]
        [--heads 4] [--block 64] [--batch 8] [--target c] [--threads N] [--compile] [--float64]
        [--losses-out FILE] [--lockstep]

The verdict line compares tilegraph's loss with torch eager's at every step against the float32
tolerance of tilegraph.testing for the step's reduction length (`tolerance("f32",
reduction_length(step))`: the rounding one step may add); with --float64 it also prints, per
stretch of steps, how far each float32 run is from exact arithmetic, the scale the two float32
runs' difference grows to as training compounds each step's rounding.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402

import tilegraph  # noqa: E402
from tests.models import CharGPT, char_batches, char_corpus  # noqa: E402
from tilegraph.accuracy import reduction_length, tolerance  # noqa: E402
from tilegraph.train import AdamW  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    _common.char_gpt_options(ap, layers=4, hidden=128, heads=4, block=64, batch=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--target", default="c")
    ap.add_argument("--threads", type=int, default=None, help="torch's and the C module's threads (default: all)")
    ap.add_argument("--compile", action="store_true", help="also train with torch.compile")
    ap.add_argument("--float64", action="store_true",
                    help="also train torch eager in float64: how far each float32 run strays from exact arithmetic")
    ap.add_argument("--losses-out", default=None, help="write every runner's loss per step to this JSON file")
    ap.add_argument("--lockstep", action="store_true",
                    help="before each step, give tilegraph torch eager's weights and AdamW moments: every step's "
                         "loss then compares one step from the same state, not two trainings that drift apart")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    for line in _common.machine_lines(torch=torch.__version__):
        print(line)
    print(f"load average at start: {os.getloadavg()} (other agents share this machine)")
    text = char_corpus()
    chars, batches = char_batches(text, args.steps, args.batch, args.block)
    torch.manual_seed(0)
    module = CharGPT(len(chars), args.layers, args.hidden, args.heads, args.block)
    eager = copy.deepcopy(module)
    params = sum(p.numel() for p in module.parameters())
    print(f"corpus: {Path(__import__('textwrap').__file__).name}, {len(text)} characters, {len(chars)} symbols; "
          f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, {params / 1e6:.2f}M parameters; "
          f"batch {args.batch} x {args.block}; AdamW lr {args.lr} weight decay 0.1, clip 1.0; {args.steps} steps")

    options = {"threads": args.threads} if args.threads and args.target == "c" else {}
    t0 = time.perf_counter()
    step = tilegraph.train_step(module, "cross_entropy", AdamW(lr=args.lr, weight_decay=0.1),
                                example_inputs=(batches[0][0],), clip_norm=1.0, target=args.target, **options)
    print(f"tilegraph ({args.target}) step compiled in {time.perf_counter() - t0:.1f} s, "
          f"{len(step.model.ops())} tg ops before passes")

    optimizers = {}

    def torch_trainer(model, forward):
        opt = optimizers[id(model)] = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

        def run(x, y):
            opt.zero_grad(set_to_none=True)
            logits = forward(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return float(loss.detach())
        return run

    def tilegraph_step(x, y):
        if args.lockstep:  # torch eager's state, copied into the arrays the compiled step updates in place
            opt = optimizers[id(eager)]
            for name, p in eager.named_parameters():
                np.copyto(step.weights[name], p.detach().numpy())
                for s in ("exp_avg", "exp_avg_sq"):
                    if p in opt.state:
                        np.copyto(step.state[f"{s}.{name}"], opt.state[p][s].numpy())
        return step(x, targets=y)

    runners = {"tilegraph": tilegraph_step, "torch eager": torch_trainer(eager, eager)}
    if args.compile:
        compiled_model = copy.deepcopy(module)
        forward = torch.compile(compiled_model)
        runners["torch.compile"] = torch_trainer(compiled_model, forward)
    if args.float64:
        exact = copy.deepcopy(module).double()
        runners["torch eager f64"] = torch_trainer(exact, exact)
    losses = {name: [] for name in runners}
    times = {name: [] for name in runners}
    names = list(runners)
    for i, (x, y) in enumerate(batches):
        shift = i % len(names)  # rotate the order, so no runner always follows the same one
        # in lockstep tilegraph must see torch eager's state before torch steps past it
        order = names if args.lockstep else names[shift:] + names[:shift]
        for name in order:
            t = time.perf_counter()
            losses[name].append(runners[name](x, y))
            times[name].append(time.perf_counter() - t)
        if i % max(1, args.steps // 15) == 0 or i == args.steps - 1:
            rel = abs(losses["tilegraph"][-1] - losses["torch eager"][-1]) / abs(losses["torch eager"][-1])
            extra = f"  torch.compile {losses['torch.compile'][-1]:.5f}" if args.compile else ""
            extra += f"  torch eager f64 {losses['torch eager f64'][-1]:.5f}" if args.float64 else ""
            print(f"step {i:4d}  tilegraph {losses['tilegraph'][-1]:.5f}  torch eager {losses['torch eager'][-1]:.5f}"
                  f"  relative difference {rel:.1e}{extra}", flush=True)
            if args.losses_out:  # as it goes, so a run cut short still leaves its losses
                Path(args.losses_out).write_text(json.dumps(losses))
    ours, theirs = np.array(losses["tilegraph"]), np.array(losses["torch eager"])
    rel = np.abs(ours - theirs) / np.abs(theirs)
    if args.losses_out:
        Path(args.losses_out).write_text(json.dumps(losses))
    rtol = tolerance("f32", reduction_length(step.model))[0]
    within = rel <= rtol
    outside = np.flatnonzero(~within)
    print(f"float32 tolerance (tilegraph.testing, reduction length {reduction_length(step.model)}): rtol {rtol:.1e}; "
          f"steps within it: {int(within.sum())} of {len(rel)}"
          + (f"; first outside: step {int(outside[0])} ({rel[outside[0]]:.1e})" if len(outside) else "")
          + f"; final loss {ours[-1]:.4f} vs first {ours[0]:.4f} ({ours[-1] / ours[0]:.2f}x)")
    print(f"loss: first {ours[0]:.4f}, last {ours[-1]:.4f} (torch eager {theirs[0]:.4f} -> {theirs[-1]:.4f}); "
          f"relative difference to torch eager: max {rel.max():.1e} (step {int(rel.argmax())}), "
          f"median {np.median(rel):.1e}, first 20 steps max {rel[:20].max():.1e}")
    if args.compile:
        # how far two torch runs of the same training drift apart in float32: the peers' own spread
        other = np.array(losses["torch.compile"])
        rel2 = np.abs(other - theirs) / np.abs(theirs)
        print(f"torch.compile against torch eager, for scale: max {rel2.max():.1e}, median {np.median(rel2):.1e}, "
              f"first 20 steps max {rel2[:20].max():.1e}")
    stride = max(1, args.steps // 6)
    stretches = [(a, min(a + stride, args.steps)) for a in range(0, args.steps, stride)]
    print("tilegraph against torch eager, max relative difference per stretch: "
          + ", ".join(f"steps {a}-{b}: {rel[a:b].max():.1e}" for a, b in stretches))
    if args.float64:
        # float32 rounding differs between any two implementations (summation orders); training
        # amplifies a difference step by step (AdamW's m / sqrt(v) turns gradient noise into
        # steps of lr's size), so each float32 run walks away from the exact one and from each other
        exact = np.array(losses["torch eager f64"])
        for name in [n for n in names if n != "torch eager f64"]:
            dev = np.abs(np.array(losses[name]) - exact) / np.abs(exact)
            marks = ", ".join(f"steps {a}-{b}: {dev[a:b].max():.1e}" for a, b in stretches)
            print(f"{name} against torch eager float64, max relative difference per stretch: {marks}")
    skip = min(5, args.steps // 2)  # the first calls build, plan and warm caches: not steps
    rows = []
    for name in names:
        med = float(np.median(times[name][skip:]))
        ratio = np.median(np.array(times["tilegraph"][skip:]) / np.array(times[name][skip:]))
        rows.append((name, f"{med * 1e3:.1f}", f"{ratio:.2f}x"))
    print(_common.format_table(("per training step", "median ms", "tilegraph / this (paired)"), rows))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
