"""Speed of a training step: forward, loss, backward and AdamW of a MiniLM-shaped model (batch 8,
seq 128) and a GPT-2-small-shaped one (batch 4, seq 256), tilegraph's C step against torch eager
training and torch.compile training, interleaved in one process, at one thread and at all.

MiniLM is all-MiniLM-L6-v2 itself (tests/models.py `minilm_model`), its loss the mean of its last
hidden state; the GPT-2-small shape is tests/models.py's CharGPT at GPT-2 small's sizes (12 layers,
768 wide, 12 heads, 50257 symbols, an untied LM head, SDPA causal attention), its loss cross-entropy
over next tokens. `--models bert` adds BERT-base's shape (12 layers, 768 wide; random weights, eager
attention) at MiniLM's batch and loss. Every runner starts from the same weights and takes the same batch every step
(the weights move: each call is a real step). torch.compile compiles the module (AOTAutograd's joint
forward/backward); its AdamW runs eager, as torch.compile users run it.

Reported per model and thread count: each runner's median milliseconds per step, and the median over
rounds of tilegraph's time / the peer's in the same round (the issue's targets: <= 0.8x eager,
<= 1.0x torch.compile). --layers cuts each model to its first N layers (compile time and a loaded
machine: say so beside the numbers).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/train_speed.py [--models minilm,gpt2] [--threads 1,all]
        [--repeat 5] [--minilm-layers 6] [--gpt2-layers 12] [--bert-layers 12] [--no-compile] [--profile N]

--profile N: where tilegraph's step goes instead (benchmarks/c_steps.py's per-step module, at the
first of --threads): the N slowest native steps and the steps summed by kind, then torch's profiler
over one eager training step of the same module (its N ops of most self time); no peers are timed.

A 12-layer GPT-2 step takes many minutes to compile on a loaded machine, longer than a timed
run may hold the bench lock. So compile first, at a low priority, outside the lock, and time
after, under it:

    HF_HUB_OFFLINE=1 nice -n 15 .venv/bin/python benchmarks/train_speed.py --models gpt2 --step-dir /tmp/steps --warm-only
    HF_HUB_OFFLINE=1 flock /work/notes/bench.lock .venv/bin/python benchmarks/train_speed.py --models gpt2 --step-dir /tmp/steps

--step-dir DIR: tilegraph's step after its passes is saved there (Model.save) and read back by a
later run of the same model, layers and library source (its C library is in build.py's cache);
--warm-only: compile and run each runner's first step (torch.compile's caches fill too), time
nothing. --gpt2-step-from FILE / --minilm-step-from FILE: read that saved step whatever the
library's source (the key names a checkout's files by path: a copy of it has another).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402

import tilegraph  # noqa: E402
from tilegraph.train import AdamW  # noqa: E402

LR, DECAY = 1e-4, 0.01


def minilm(layers: int):
    from tests.models import minilm_inputs, minilm_model

    module = minilm_model()
    module.bert.encoder.layer = module.bert.encoder.layer[:layers]
    for p in module.parameters():
        p.requires_grad_(True)
    return module, minilm_inputs(8, 128), None, "mean"


def bert(layers: int):
    """BERT-base's shape (768 wide, 12 heads, 3072 inner, 30522 symbols) with random weights and
    eager attention, as all-MiniLM-L6-v2's wrapper runs it; MiniLM's batch and loss."""
    from transformers import BertConfig, BertModel

    from tests.models import MiniLM, minilm_inputs

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=layers, attn_implementation="eager")
    module = MiniLM(BertModel(config, add_pooling_layer=False).eval())
    return module, minilm_inputs(8, 128), None, "mean"


def gpt2(layers: int):
    from tests.models import char_gpt

    module = char_gpt(50257, layers=layers, hidden=768, heads=12, block=256)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50257, (4, 257), generator=g)
    return module, (ids[:, :-1],), ids[:, 1:], "cross_entropy"


MODELS = {"minilm": minilm, "gpt2": gpt2, "bert": bert}


def torch_trainer(model, forward, loss: str):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)

    def run(inputs, targets):
        opt.zero_grad(set_to_none=True)
        out = forward(*inputs)
        if loss == "mean":
            value = out.mean()
        else:
            value = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
        value.backward()
        opt.step()
        return float(value.detach())
    return run


def profile(step, inputs, targets, top: int, repeat: int, threads: int | None, module=None, loss: str = "") -> None:
    """The step's `top` slowest native steps (c_steps.py's per-step module) and their share, and
    the GEMMs' share of it; beside it torch's profiler over eager training of the same module."""
    import c_steps

    feed = {**dict(zip(step._data, [np.asarray(x) for x in (*inputs, *([targets] if targets is not None else []))])),
            **step.weights, **step.state, "lr": np.float32(LR), "step": np.float32(1)}
    optimized = step.compiled.model
    steps, whole = c_steps.step_times(optimized, [feed[n] for n in optimized.input_names], repeat, threads)
    total = sum(s[1] for s in steps)
    gemm = sum(t for c, t, _ in steps if "matmul" in c or "attention" in c)
    print(f"  per-step module {1e3 * whole:.0f} ms (steps sum {1e3 * total:.0f} ms), {len(steps)} steps, "
          f"threads {threads or 'all'}; steps with a matmul or attention: {1e3 * gemm:.0f} ms "
          f"({100 * gemm / total:.0f}%)")
    for comment, t, flops in sorted(steps, key=lambda s: -s[1])[:top]:
        print(f"  {1e3 * t:8.2f} ms {100 * t / total:5.1f}% {c_steps.gflops(flops, t)}  {comment[:200]}")
    c_steps.print_by_kind(steps, total)
    if module is None:
        return
    if threads:
        torch.set_num_threads(threads)
    eager = copy.deepcopy(module)
    run = torch_trainer(eager, eager, loss)
    run(inputs, targets)  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run(inputs, targets)
        wall = time.perf_counter() - t0
    rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    self_total = sum(e.self_cpu_time_total for e in rows)
    gemm_ops = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
                "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
    g = sum(e.self_cpu_time_total for e in rows if e.key in gemm_ops)
    print(f"  torch eager step under its profiler: {1e3 * wall:.0f} ms; self time {self_total / 1e3:.0f} ms, "
          f"GEMM and SDPA ops {g / 1e3:.0f} ms ({100 * g / max(self_total, 1):.0f}%)")
    for e in sorted(rows, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {e.self_cpu_time_total / 1e3:8.2f} ms {100 * e.self_cpu_time_total / self_total:5.1f}%  "
              f"x{e.count:<4d} {e.key}")


def tilegraph_step(name: str, layers: int, module, inputs, loss: str, step_dir: str | None,
                   step_from: str | None = None):
    """tilegraph's C training step of `module`: compiled now, or read from `step_dir` where an
    earlier run of the same model, layers and library source saved it after its passes."""
    from tilegraph.compile_cache import _library_digest
    from tilegraph.ir.model import Model
    from tilegraph.train import TrainStep

    optimizer = AdamW(lr=LR, weight_decay=DECAY)
    saved = Path(step_dir) / f"{name}-{layers}-{_library_digest()[:16]}.mlir" if step_dir else None
    if step_from:  # the caller vouches that it is this model's step
        saved = Path(step_from)
    t0 = time.perf_counter()
    if saved is not None and saved.is_file():
        optimized = Model.load(saved)
        compiled = tilegraph.compile(optimized, target="c", pipeline="")
        trained = dict(module.named_parameters())
        params = {n: trained[n].detach().numpy().copy() for n in optimized.input_names if n in trained}
        step = TrainStep(optimized, compiled, params, optimizer)
        print(f"tilegraph C step read from {saved} and built in {time.perf_counter() - t0:.1f} s "
              f"({len(optimized.ops())} tg ops after passes)")
        return step
    step = tilegraph.train_step(copy.deepcopy(module), loss, optimizer, example_inputs=inputs, target="c")
    print(f"tilegraph C step compiled in {time.perf_counter() - t0:.1f} s "
          f"({len(step.model.ops())} tg ops before passes, {len(step.compiled.model.ops())} after)")
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        step.compiled.model.save(saved)
        print(f"  saved to {saved}")
        return tilegraph_step(name, layers, module, inputs, loss, step_dir)  # its C library cached as read back
    return step


def bench(name: str, args, all_threads: int) -> list[tuple]:
    """One model's rows: tilegraph against each peer at each thread count."""
    rows: list[tuple] = []
    layers = getattr(args, f"{name}_layers")
    module, inputs, targets, loss = MODELS[name](layers)
    nparams = sum(p.numel() for p in module.parameters())
    print(f"\n{name}: {layers} layers, {nparams / 1e6:.1f}M parameters, inputs "
          f"{' '.join(str(tuple(x.shape)) for x in inputs)}, loss {loss}, AdamW lr {LR} weight decay {DECAY}")
    step = tilegraph_step(name, layers, module, inputs, loss, args.step_dir, getattr(args, f"{name}_step_from"))
    if args.profile:
        first = args.threads.split(",")[0]
        profile(step, inputs, targets, args.profile, args.repeat, None if first == "all" else int(first), module, loss)
        return rows
    runners_extra: dict = {}
    others = []
    for extra in args.also_step or []:  # an A/B: another saved step of this model, emitted by this checkout
        other = tilegraph_step(name, layers, module, inputs, loss, None, extra)
        runners_extra[f"tilegraph C ({Path(extra).stem})"] = lambda other=other: other(*inputs, targets=targets)
        others.append(other)
    if args.also_no_repack:  # an A/B of the runtime's repacking of a B whose rows alias (runtime.c)
        other = tilegraph_step(name, layers, module, inputs, loss, args.step_dir, getattr(args, f"{name}_step_from"))

        def unpacked(other=other):  # read where a call makes primitives (per binding and thread count)
            os.environ["TG_NO_REPACK"] = "1"
            try:
                return other(*inputs, targets=targets)
            finally:
                del os.environ["TG_NO_REPACK"]
        runners_extra["tilegraph C (no repack)"] = unpacked
        others.append(other)
    eager = copy.deepcopy(module)
    eager_run = torch_trainer(eager, eager, loss)
    team: list[int] = []  # the threads each native segment of tilegraph's timed steps ran on

    def ours():
        value = step(*inputs, targets=targets)
        team.extend(step.compiled._runner.segment_threads)
        return value
    runners = {"tilegraph C": ours, **runners_extra,
               "torch eager": lambda: eager_run(inputs, targets)}
    if not args.no_compile:
        compiled_module = copy.deepcopy(module)
        compiled_run = torch_trainer(compiled_module, torch.compile(compiled_module), loss)
        runners["torch.compile"] = lambda: compiled_run(inputs, targets)
    first = {}
    for runner, fn in runners.items():  # the first step of each: builds, compiles, plans
        t0 = time.perf_counter()
        value = fn()
        first[runner] = time.perf_counter() - t0
        print(f"  first step of {runner}: {first[runner]:.1f} s, loss {value:.6f}")
    kinds: dict[str, int] = {}
    for line in step.compiled.primitives:  # which oneDNN kernel each GEMM runs on
        kind = line.split(" source: ")[-1]
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"  tilegraph's oneDNN primitives: {kinds}; on the reference kernel: {step.compiled.reference_kernels or 'none'}")
    if args.warm_only:
        return rows
    for threads in args.threads.split(","):
        n = all_threads if threads == "all" else int(threads)
        torch.set_num_threads(n)
        for s in (step, *others):
            s.compiled._runner.set_threads(n)
        team.clear()
        samples = _common.interleaved_samples(runners, args.repeat, warmup=0, first=first)
        load = os.getloadavg()[0]
        # the runtime leaves a busy neighbour its core (runtime._uncontended_threads), segment by segment
        print(f"  tilegraph's segments on {n} threads: {sum(t == n for t in team)} of {len(team)}")
        for peer in runners:
            if peer == "tilegraph C":
                continue
            ratio, q1, q3 = _common.paired_ratio(samples, "tilegraph C", peer)
            rows.append((name, n, f"{np.median(samples['tilegraph C']) * 1e3:.0f}", peer,
                         f"{np.median(samples[peer]) * 1e3:.0f}", f"{ratio:.2f}x ({q1:.2f}-{q3:.2f})", f"{load:.1f}"))
            print("  " + "  ".join(str(c) for c in rows[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm,gpt2")
    ap.add_argument("--threads", default="1,all", help="comma-separated thread counts; 'all' = every core")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--minilm-layers", type=int, default=6)
    ap.add_argument("--gpt2-layers", type=int, default=12)
    ap.add_argument("--bert-layers", type=int, default=12)
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--profile", type=int, default=0, help="list tilegraph's N slowest steps, time no peers")
    ap.add_argument("--step-dir", help="save tilegraph's compiled step here, or read it from an earlier run")
    for name in MODELS:
        ap.add_argument(f"--{name}-step-from", metavar="FILE",
                        help=f"read {name}'s compiled step from this file (saved by --step-dir by another checkout)")
    ap.add_argument("--also-step", action="append", metavar="FILE",
                    help="time this saved step of the model too (an A/B against another checkout's passes)")
    ap.add_argument("--also-no-repack", action="store_true",
                    help="time the same step again with the runtime's repacking of aliased GEMM operands off")
    ap.add_argument("--warm-only", action="store_true", help="compile and take each runner's first step; time nothing")
    args = ap.parse_args()

    for line in _common.machine_lines(torch=torch.__version__):
        print(line)
    print(f"load average at start: {os.getloadavg()} (other agents share this machine)")
    all_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rows = []
    for name in args.models.split(","):
        rows += bench(name, args, all_threads)
    print()
    print(_common.format_table(("model", "threads", "tilegraph ms", "peer", "peer ms",
                                "tilegraph / peer (median per round, quartiles)", "load"), rows))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
