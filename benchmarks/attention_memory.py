"""Attention's peak memory: flash-style tiling against the naive version and onnxruntime
(12 heads, sequence 4096, head dim 64, batch 1, f32).

Variants, all on the same seeded q, k, v of shape [1, 12, N, 64]:
  naive          K.attention: materialises the [12, N, N] scores (805 MB at N = 4096)
  tiled t1/tN    attention_tiled (backends/numpy/attention.py) in the tile pass's blocks (passes/targets/numpy.py FLASH_BLOCK_Q x
                 FLASH_BLOCK_KV), on 1 and on all cores: online softmax over key blocks
  tilegraph      a graph of one tg.attention compiled by tilegraph.compile (default
                 pipeline, NumPy backend): what a user of tilegraph gets end to end
  tilegraph C    the same graph on the C backend (target "c"): its flash-style kernel
  torch SDPA     torch.nn.functional.scaled_dot_product_attention (torch's CPU flash kernel)
  ort matmul     onnxruntime (default optimizations, CPU) on the graph an exporter
                 writes for eager attention: MatMul(Q, Transpose(K)) * scale, Softmax, MatMul V
  ort Attention  onnxruntime on the ONNX Attention op (opset 23), ORT's own fused kernel

Peak memory, each variant in a fresh subprocess (so nothing one variant freed, cached
or mapped counts for the next):
  * RSS growth: the peak RSS during one call minus the RSS after imports, input
    creation and session building or compiling; the only measure that sees
    onnxruntime's allocations. Linux's VmHWM, reset through /proc/self/clear_refs
    (ru_maxrss carries the parent's peak into a child: see reset_peak_rss);
  * tracemalloc peak (NumPy variants): NumPy reports its data buffers to
    tracemalloc, so this is the bytes NumPy held at the worst moment of the call.
Both include the result itself (12 N 64 x 4 B = 12.6 MB at N = 4096): O(N d).

Latency: the median of repeated calls, all variants round-robin in this process
(benchmarks/_common.py), at each N. Correctness: every variant's result against
the naive one, relative error within tilegraph.testing.tolerance("f32", N); the
script exits 1 when one is off.

    .venv/bin/python benchmarks/attention_memory.py [--seq 1024,2048,4096] [--repeat N] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

HEADS, HEAD_DIM, BATCH = 12, 64, 1  # the shape
SEQS = (1024, 2048, 4096)
QUICK_SEQS = (512, 1024)
REPEAT, QUICK_REPEAT = 3, 1
NUMPY_VARIANTS = ("naive", "tiled t1", "tiled tN", "tilegraph")
ORT_VARIANTS = ("ort matmul", "ort Attention")
NATIVE_VARIANTS = ("tilegraph C", "torch SDPA")
VARIANTS = NUMPY_VARIANTS + NATIVE_VARIANTS + ORT_VARIANTS
# ONNX's own Attention op arrived in opset 23; the installed onnxruntime reads IR
# version 10 models at that opset (onnx.helper would stamp its newest IR, 11+).
ONNX_ATTENTION_OPSET, ONNX_IR_VERSION = 23, 10
ONNX_MATMUL_OPSET = 17  # what tests/models.py exports at


def inputs(seq: int):
    # Drawn in float32 directly: a float64 draw cast down would leave freed heap pages
    # resident that a variant's first allocations reuse unseen by RSS.
    rng = np.random.default_rng(0)
    return [rng.standard_normal((BATCH, HEADS, seq, HEAD_DIM), dtype=np.float32) for _ in range(3)]


def scale() -> float:
    return 1.0 / HEAD_DIM ** 0.5


def onnx_model(seq: int, fused: bool):
    """The attention as ONNX: one Attention op (opset 23), or MatMul/Softmax as exporters write it."""
    from onnx import TensorProto, helper

    shape = [BATCH, HEADS, seq, HEAD_DIM]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "qkv"]
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
    if fused:
        nodes = [helper.make_node("Attention", ["q", "k", "v"], ["y"], scale=scale())]
        opset = ONNX_ATTENTION_OPSET
    else:
        nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
                 helper.make_node("MatMul", ["q", "kt"], ["s"]),
                 helper.make_node("Mul", ["s", "scale"], ["ss"]),
                 helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
                 helper.make_node("MatMul", ["p", "v"], ["y"])]
        opset = ONNX_MATMUL_OPSET
    init = [] if fused else [helper.make_tensor("scale", TensorProto.FLOAT, [], [scale()])]
    graph = helper.make_graph(nodes, "attention", ins, out, initializer=init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ONNX_IR_VERSION)


# tilegraph's variants: the target, what its source shows when the attention got its kernel, and else why not
COMPILED = {
    "tilegraph": ("numpy", "attention_tiled",
                  "tilegraph.compile did not tile the attention: the default pipeline lacks `tile`?"),
    "tilegraph C": ("c", "tg_attention(", "the C backend did not lower the attention to its kernel"),
}


def make_runner(variant: str, seq: int, blocks: tuple[int, int]):
    """A zero-argument callable computing the attention of `inputs(seq)` one way."""
    from tilegraph.backends.numpy.attention import attention_tiled
    from tilegraph.backends.numpy.chunks import THREADS
    from tilegraph.ir import kernels as K

    q, k, v = inputs(seq)
    s = scale()
    if variant == "naive":
        return lambda: K.attention(q, k, v, None, s, False)
    if variant in ("tiled t1", "tiled tN"):
        threads = 1 if variant == "tiled t1" else THREADS
        return lambda: attention_tiled(q, k, v, None, s, False, *blocks, threads=threads)
    if variant in COMPILED:
        import tilegraph
        from tilegraph.ir import Graph

        target, marker, missing = COMPILED[variant]
        g = Graph()
        tq, tk, tv = (g.input(n, (BATCH, HEADS, seq, HEAD_DIM), "f32") for n in "qkv")
        compiled = tilegraph.compile(g.build(g.attention(tq, tk, tv, None, s, False), names=["y"]), target=target)
        if marker not in compiled.source:
            raise SystemExit(missing)
        return lambda: compiled(q, k, v)
    if variant == "torch SDPA":
        import torch

        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

        def sdpa():
            with torch.inference_mode():
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, scale=s).numpy()
        return sdpa
    if variant in ORT_VARIANTS:
        import onnxruntime as ort

        model = onnx_model(seq, fused=variant == "ort Attention")
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {"q": q, "k": k, "v": v}
        return lambda: session.run(None, feeds)[0]
    raise ValueError(variant)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise OSError(field)


def reset_peak_rss() -> tuple[int, str]:
    """Start a fresh peak-RSS window; returns (resident bytes now, the method in use).

    ru_maxrss cannot be reset, and on Linux it starts a spawned child at its parent's
    high-water mark (exec keeps the old address space's peak in the process's
    rusage): measured here, children of this script started 20-145 MB "high", which
    hid the growth of every variant under 100 MB. Linux's VmHWM is the same peak but
    per address space, and writing 5 to /proc/self/clear_refs resets it to the
    current RSS. Elsewhere, ru_maxrss minus its value now."""
    try:  # hand freed heap pages back first, or a variant's allocations reuse them unseen
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_bytes("VmRSS"), "VmHWM"
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"


def peak_rss(method: str) -> int:
    if method == "VmHWM":
        return _status_bytes("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(variant: str, seq: int, blocks: tuple[int, int], out_path: str) -> None:
    """Measure one variant's peak memory in this fresh process; print JSON, save the result."""
    run = make_runner(variant, seq, blocks)
    base, method = reset_peak_rss()
    y = run()
    rss = peak_rss(method) - base
    np.save(out_path, np.asarray(y))
    traced = None
    if variant in NUMPY_VARIANTS:
        del y
        from tilegraph.testing import traced_peak

        traced = traced_peak(run)
    print(json.dumps({"rss": rss, "traced": traced, "method": method}))


def measure_memory(variant: str, seq: int, blocks: tuple[int, int], out_path: str) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--seq", str(seq),
           "--block-q", str(blocks[0]), "--block-kv", str(blocks[1]), "--out", out_path]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default=None, help=f"comma-separated sequence lengths (default {','.join(map(str, SEQS))})")
    ap.add_argument("--repeat", type=int, default=None, help=f"timed rounds per length (default {REPEAT})")
    ap.add_argument("--quick", action="store_true",
                    help=f"sequences {','.join(map(str, QUICK_SEQS))}, {QUICK_REPEAT} round: a smoke run")
    ap.add_argument("--block-q", type=int, default=None, help="query block (default: the tile pass's)")
    ap.add_argument("--block-kv", type=int, default=None, help="key/value block (default: the tile pass's)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    from tilegraph.passes.targets.numpy import FLASH_BLOCK_KV, FLASH_BLOCK_Q

    blocks = (args.block_q or FLASH_BLOCK_Q, args.block_kv or FLASH_BLOCK_KV)
    if args.child:
        child(args.child, int(args.seq), blocks, args.out)
        return 0

    import onnxruntime as ort

    # By its own name: `benchmarks` is taken (xdsl installs a top-level package so called).
    from _common import format_table, interleaved_medians, machine_lines
    from tilegraph.backends.numpy.chunks import THREADS
    from tilegraph.testing import relative_error, tolerance

    seqs = [int(s) for s in args.seq.split(",")] if args.seq else list(QUICK_SEQS if args.quick else SEQS)
    repeat = args.repeat or (QUICK_REPEAT if args.quick else REPEAT)
    print("\n".join(machine_lines(onnxruntime=ort.__version__)))
    print(f"attention: batch {BATCH}, {HEADS} heads, head dim {HEAD_DIM}, f32; tiled blocks "
          f"{blocks[0]} queries x {blocks[1]} keys; tN = {THREADS} threads; ort = onnxruntime default CPU session")
    print(f"ort matmul: MatMul/Transpose/Mul/Softmax/MatMul at opset {ONNX_MATMUL_OPSET}; "
          f"ort Attention: the ONNX Attention op at opset {ONNX_ATTENTION_OPSET}\n")

    failed = False
    results: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="attention-memory-") as tmp:
        for seq in seqs:
            for variant in VARIANTS:
                path = os.path.join(tmp, f"{variant.replace(' ', '_')}_{seq}.npy")
                r = measure_memory(variant, seq, blocks, path)
                if "error" not in r:
                    r["relerr"] = None
                    if variant != "naive":
                        r["relerr"] = relative_error(np.load(path), np.load(os.path.join(tmp, f"naive_{seq}.npy")))
                        os.remove(path)
                results[variant, seq] = r
                print(f"  measured {variant} at N={seq}: " + (r["error"] if "error" in r else
                      f"peak RSS +{mb(r['rss'])} MB ({r['method']}), traced {mb(r['traced'])} MB"),
                      file=sys.stderr, flush=True)
            os.remove(os.path.join(tmp, f"naive_{seq}.npy"))
            runners = {v: make_runner(v, seq, blocks) for v in VARIANTS if "error" not in results[v, seq]}
            for variant, seconds in interleaved_medians(runners, repeat).items():
                results[variant, seq]["median_s"] = seconds

    bound = {seq: tolerance("f32", reduction_length=seq)[0] for seq in seqs}
    for seq in seqs:
        rows = []
        ort_rss = results.get(("ort matmul", seq), {}).get("rss")
        naive = results["naive", seq]
        result_bytes = BATCH * HEADS * seq * HEAD_DIM * 4
        for variant in VARIANTS:
            r = results[variant, seq]
            if "error" in r:
                rows.append([variant, "error: " + r["error"][:60]] + [""] * 9)
                failed = True
                continue
            ok = r["relerr"] is None or r["relerr"] <= bound[seq]
            failed |= not ok
            rows.append([variant, mb(r["rss"]), mb(r["traced"]), ratio(r["rss"], result_bytes),
                         ratio(r["rss"], naive.get("rss")), ratio(r["rss"], ort_rss), f"{r['median_s'] * 1e3:,.0f}",
                         ratio(r["median_s"], naive.get("median_s")),
                         ratio(r["median_s"], results.get(("ort matmul", seq), {}).get("median_s")),
                         ratio(r["median_s"], results.get(("torch SDPA", seq), {}).get("median_s")),
                         "ref" if r["relerr"] is None else f"{r['relerr']:.1e} {'ok' if ok else 'FAIL'}"])
        print(f"N = {seq}: scores would be {HEADS * seq * seq * 4 / 1e6:,.0f} MB; result {HEADS * seq * HEAD_DIM * 4 / 1e6:.1f} MB; "
              f"median of {repeat}; error bound {bound[seq]:.1e}")
        print(format_table(["variant", "RSS MB", "traced MB", "RSS/result", "RSS/naive", "RSS/ort", "ms", "t/naive",
                            "t/ort", "t/SDPA", "rel err vs naive"], rows))
        print()

    if len(seqs) > 1:  # how each grows: tiled ~ N (N d, plus fixed blocks), naive and ort ~ N^2
        first = seqs[0]
        rows = []
        for variant in VARIANTS:
            for measure in ("rss", "traced"):
                if results[variant, first].get(measure) is None:
                    continue
                rows.append([variant, {"rss": "RSS", "traced": "traced"}[measure]]
                            + [f"{mb(results[variant, seq].get(measure))} MB "
                               f"({ratio(results[variant, seq].get(measure), results[variant, first][measure])}x)"
                               for seq in seqs])
        print(f"peak memory by N, and relative to N = {first}; N grows {' / '.join(str(s // first) for s in seqs)}x: "
              f"O(N^2) grows as its square; the tiled kernels' O(N d) part (the result) as N, "
              f"beside a fixed block part")
        print(format_table(["variant", "measure"] + [f"N={s}" for s in seqs], rows, align="ll" + "r" * len(seqs)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
