"""GPU latency: tilegraph's Triton backend against torch eager and torch.compile (issue 4).

For each model, in one run on the same inputs on one GPU:
  * tilegraph-Triton: `tilegraph.compile(model, inputs, target="triton", autotune=True)`,
    timed through `forward_torch` (device tensors in and out, as the peers)
  * torch eager under torch.inference_mode
  * torch.compile(model), default mode (its compile time reported apart)
each timed with `triton.testing.do_bench` (CUDA events, median), the three timed in
turn twice so the spread between the two passes shows the noise; then ratios.
Every output is checked against eager's first (relative error <=
tilegraph.testing.PEER_RELATIVE_ERROR), so a fast wrong result cannot pass.
TF32 is off for every peer (torch.backends.*.allow_tf32 = False): tilegraph's fp32
GEMMs run in IEEE fp32, and so must the peers' for the times to compare.

Then, per tilegraph kernel (one profiled forward, each host launcher timed with
CUDA events): achieved FLOP/s (the kernel's FLOPs, from KERNELS) and bandwidth
(bytes of its tensor arguments and results) as fractions of this GPU's ceilings
measured in the same run: a 1 GiB device-to-device copy (bytes read + written) and
an 8192^3 fp32 matmul (TF32 off).

Models (tests/models.py): all-MiniLM-L6-v2 at batch 32, sequence 128 (eager
attention: tilegraph's `attention` pass folds it into one flash kernel) and the
GPT-2-small-shaped decoder (random init, batch 8, sequence 1024, sdpa attention).
Targets: faster than torch eager on both models, within 10% of torch.compile.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/triton_gpu.py [--models minilm,gpt2] [--quick]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/triton_gpu.py --dry-run   # no GPU: the pipeline on a
                                                                              # tiny MiniLM, interpreter times

With no GPU (and no --dry-run) it says so and exits 0: the CPU-side evidence is
`make test` (every kernel run in Triton's interpreter against the float64
reference, and built ahead of time for sm_90 and gfx942).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tilegraph  # noqa: E402,F401 - first: chooses Triton's interpreter when there is no GPU
from _common import format_table  # noqa: E402

MODELS = ("minilm", "gpt2")
COPY_BYTES = 1 << 30
GEMM_SIZE = 8192


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--quick", action="store_true", help="shorter timing (noisier)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU needed: a 1-layer MiniLM at batch 1, seq 8, "
                                                           "in Triton's interpreter, to check the script")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    return args


def cases(args):
    import models

    if args.dry_run:
        bert = models.minilm_model()
        bert.bert.encoder.layer = bert.bert.encoder.layer[:1]
        return [("MiniLM (1 layer) b1 s8", bert, models.minilm_inputs(1, 8))]
    out = []
    if "minilm" in args.models:
        out.append(("MiniLM b32 s128", models.minilm_model(), models.minilm_inputs(32, 128)))
    if "gpt2" in args.models:
        out.append(("GPT-2-small b8 s1024", models.gpt2_model(), models.gpt2_inputs(8, 1024)))
    return out


class Clock:
    """Median seconds of a call: CUDA events through do_bench on a GPU, perf_counter otherwise."""

    def __init__(self, cuda: bool, quick: bool):
        self.cuda, self.quick = cuda, quick

    def __call__(self, fn) -> float:
        import torch

        if self.cuda:
            import triton.testing

            rep = 100 if self.quick else 500
            return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e-3
        fn()
        times = []
        for _ in range(1 if self.quick else 3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        return sorted(times)[len(times) // 2]


def ceilings(device) -> tuple[float, float]:
    """(bytes/s of a device copy, fp32 FLOP/s of a large matmul), measured here."""
    import torch
    import triton.testing

    src = torch.empty(COPY_BYTES // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    copy_s = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, device=device)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, device=device)
    gemm_s = triton.testing.do_bench(lambda: a @ b, return_mode="median") * 1e-3
    return 2 * COPY_BYTES / copy_s, 2 * GEMM_SIZE ** 3 / gemm_s


def kernel_profile(compiled, inputs, clock_cuda: bool) -> list[tuple[str, str, float, float, float]]:
    """(kernel, what it computes, seconds, FLOPs, bytes) for each kernel of one forward."""
    import torch

    module = compiled._runner.module
    rows = []
    # Host launchers, each with the kernel it launches (layers share kernels).
    hosts = {h: next(k for k in module.KERNELS if f"{k}[" in inspect.getsource(getattr(module, h)))
             for h in dir(module) if h.endswith("_host")}
    originals = {h: getattr(module, h) for h in hosts}
    symbols = {}

    def wrap(host, kernel):
        def timed_host(*args):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            symbols.update({f"arg{i}": a for i, a in enumerate(args) if isinstance(a, int)})
            if clock_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                outs = originals[host](*args)
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) * 1e-3
            else:
                t0 = time.perf_counter()
                outs = originals[host](*args)
                seconds = time.perf_counter() - t0
            moved = sum(t.numel() * t.element_size() for t in [*tensors, *outs])
            env = dict(zip(_dim_names(originals[host]), [a for a in args if isinstance(a, int)]))
            flops = float(eval(module.KERNELS[kernel]["flops"], {"max": max, "min": min, "int": int}, env))  # noqa: S307
            rows.append((kernel, module.KERNELS[kernel]["group"], seconds, flops, moved))
            return outs
        return timed_host

    for host, kernel in hosts.items():
        setattr(module, host, wrap(host, kernel))
    try:
        compiled._runner.forward_torch(*inputs)
    finally:
        for host, fn in originals.items():
            setattr(module, host, fn)
    return rows


def _dim_names(host_fn) -> list[str]:
    """The host function's symbol parameters (they follow its tensor parameters, named d_<symbol>)."""
    code = host_fn.__code__
    return [n for n in code.co_varnames[:code.co_argcount] if n.startswith("d_")]


def main(args) -> int:
    import torch

    from tilegraph.testing import PEER_RELATIVE_ERROR, relative_error

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("benchmarks/triton_gpu.py needs a CUDA GPU (none here). The CPU-side evidence is `make test`: "
              "every Triton kernel run in Triton's interpreter against the float64 reference, and built ahead "
              "of time for sm_90 and gfx942 (tests/test_triton_build.py). --dry-run checks this script on the CPU.")
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    clock = Clock(cuda, args.quick or args.dry_run)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU (dry run: Triton interpreter times)'}; "
          f"torch {torch.__version__}; TF32 off for every peer")
    if cuda:
        bandwidth, flops_rate = ceilings(device)
        print(f"measured ceilings: copy {bandwidth / 1e9:.0f} GB/s, fp32 matmul {flops_rate / 1e12:.1f} TFLOP/s")
    else:
        bandwidth = flops_rate = float("nan")
    failed = False
    for label, model, example in cases(args):
        model = model.to(device).eval()
        inputs = tuple(x.to(device) for x in example)
        t0 = time.perf_counter()
        compiled = tilegraph.compile(model, inputs, target="triton", autotune=cuda)
        compile_s = time.perf_counter() - t0
        runners = {}
        with torch.inference_mode():
            reference = model(*inputs)
            runners["torch eager"] = lambda: model(*inputs)
            if cuda:
                t0 = time.perf_counter()
                fast = torch.compile(model)
                fast(*inputs)
                torch.cuda.synchronize()
                print(f"{label}: torch.compile's first call {time.perf_counter() - t0:.1f} s; "
                      f"tilegraph compile {compile_s:.1f} s (+ autotuning at its first call)")
                runners["torch.compile"] = lambda: fast(*inputs)
        runners["tilegraph triton"] = lambda: compiled._runner.forward_torch(*inputs)
        errors = {}
        with torch.inference_mode():
            for name, fn in runners.items():
                out = fn()
                out = out[0] if isinstance(out, (list, tuple)) else out
                errors[name] = relative_error(out.float().cpu().numpy(), reference.float().cpu().numpy())
            times = {name: [] for name in runners}
            for _ in range(2):  # two passes: their spread is the noise
                for name, fn in runners.items():
                    times[name].append(clock(fn))
        rows = []
        for name in runners:
            ok = errors[name] <= PEER_RELATIVE_ERROR
            failed |= not ok
            rows.append([name, f"{min(times[name]) * 1e3:.3f}", f"{max(times[name]) * 1e3:.3f}",
                         f"{errors[name]:.1e}" + ("" if ok else " WRONG")])
        print(f"\n{label}: milliseconds per forward (two passes), relative error vs eager")
        print(format_table(["", "ms (best pass)", "ms (other pass)", "rel. error"], rows))
        ours = min(times["tilegraph triton"])
        line = f"tilegraph / eager = {ours / min(times['torch eager']):.2f}x"
        if "torch.compile" in times:
            line += f"; tilegraph / torch.compile = {ours / min(times['torch.compile']):.2f}x"
        print(line + "   (targets: < 1.00x eager, <= 1.10x torch.compile)")
        with torch.inference_mode():
            profile = kernel_profile(compiled, inputs, cuda)
        total = sum(r[2] for r in profile)
        prow = []
        for kernel, group, seconds, kflops, moved in sorted(profile, key=lambda r: -r[2])[:15]:
            prow.append([kernel, group[:48], f"{seconds * 1e6:.0f}", f"{100 * seconds / total:.0f}%",
                         f"{kflops / seconds / flops_rate:.0%}" if kflops else "-",
                         f"{moved / seconds / bandwidth:.0%}"])
        print(f"\n{label}: tilegraph kernels, slowest first ({len(profile)} launches, "
              f"{total * 1e3:.2f} ms summed); rates as a fraction of the measured ceilings")
        print(format_table(["kernel", "computes", "us", "share", "of fp32 FLOP/s", "of copy GB/s"], prow))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
