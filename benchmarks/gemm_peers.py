"""One GEMM, five ways: NumPy's BLAS (what the NumPy backend runs) vs onnxruntime's
MLAS vs torch.mm vs MKL on a prepacked weight vs oneDNN on a prepacked weight (what
the C backend runs), at the transformer shapes of benchmarks/cpu_speed.py.

GEMMs are most of MiniLM's and GPT-2's time, so this ratio bounds what the NumPy
backend can reach against onnxruntime however well it fuses and tiles. Each shape
is y = x @ W with W a constant (onnxruntime prepacks it when the session is made,
as it does for a model's weights), timed round-robin (benchmarks/_common.py), on
one thread and on all of them (NumPy: BLAS's own threads). The one-thread rows are the
libraries' kernels; on all threads a lone call also pays for waking each library's
pool (the round-robin pauses between calls let them sleep), which a whole model
running op after op does not, so those rows favour no one in particular.

"MKL packed" is torch's `mkl._mkl_linear` on a weight reordered once by
`mkl._mkl_reorder_linear_weight` (MKL's cblas_sgemm_pack), as TorchInductor runs
linear layers on the CPU after freezing: what a backend gains by packing its weights
once, as onnxruntime does, which OpenBLAS (NumPy's BLAS) cannot.

"oneDNN packed" is a one-matmul model compiled by tilegraph's C backend (target "c"):
oneDNN's matmul primitive on the weight reordered once into the layout the primitive
prefers, called through the backend's own runtime (input checks included), so it is
the GEMM as a compiled model runs it.

Every peer's product is checked against the float64 one (relative error <=
tilegraph.testing.PEER_RELATIVE_ERROR); the script exits 1 when one is off.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/gemm_peers.py [--repeat N]
"""

from __future__ import annotations

import argparse
import sys

from _common import format_table, interleaved_medians, machine_lines  # noqa: E402  (puts the repo on sys.path)

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

import tilegraph  # noqa: E402
from tilegraph.ir import Graph  # noqa: E402
from tilegraph.testing import PEER_RELATIVE_ERROR, relative_error  # noqa: E402

# (m, k, n): MiniLM at batch 1 and 8 (seq 128: 128 and 1024 rows; hidden 384, FFN 1536),
# GPT-2 small at seq 256 (hidden 768: Q/K/V 2304, FFN 3072).
SHAPES = ((128, 384, 384), (128, 384, 1536), (128, 1536, 384), (1024, 384, 1536), (1024, 1536, 384),
          (256, 768, 2304), (256, 768, 3072), (256, 3072, 768))
PEERS = ("numpy", "onnxruntime", "torch", "MKL packed", "oneDNN packed")


def ort_matmul(w: np.ndarray, m: int, threads: int) -> ort.InferenceSession:
    k, n = w.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "gemm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def onednn_matmul(w: np.ndarray, m: int, threads: int):
    """x @ w as tilegraph's C backend compiles it (oneDNN, w packed once)."""
    g = Graph()
    model = g.build(g.input("x", (m, w.shape[0])) @ g.weight("w", w), names=["y"])
    return tilegraph.compile(model, target="c", pipeline="", threads=threads)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=15, help="timed rounds per shape (default 15)")
    args = ap.parse_args(argv)
    cores = len(__import__("os").sched_getaffinity(0))
    for line in machine_lines(torch=torch.__version__, onnxruntime=ort.__version__):
        print(line)
    print(f"GFLOP/s, median of {args.repeat} round-robin rounds; ratios are NumPy's time / the peer's\n")
    rng = np.random.default_rng(0)
    mkl_packed = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    rows, wrong = [], []
    for threads in (1, cores):
        torch.set_num_threads(threads)
        for m, k, n in SHAPES:
            x = rng.standard_normal((m, k), dtype=np.float32)
            w = rng.standard_normal((k, n), dtype=np.float32)
            out = np.empty((m, n), np.float32)
            tx, tw, tout = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(out)
            session = ort_matmul(w, m, threads)
            peers = {"numpy": lambda: np.matmul(x, w, out=out),
                     "onnxruntime": lambda: session.run(None, {"x": x}),
                     "torch": lambda: torch.mm(tx, tw, out=tout)}
            if mkl_packed:
                tw_nk = tw.t().contiguous()  # (n, k), nn.Linear's layout
                packed = torch.ops.mkl._mkl_reorder_linear_weight(tw_nk, m)
                peers["MKL packed"] = lambda: torch.ops.mkl._mkl_linear(tx, packed, tw_nk, None, m)
            native = onednn_matmul(w, m, threads)
            peers["oneDNN packed"] = lambda: native(x)
            reference = x.astype(np.float64) @ w.astype(np.float64)
            for name, run in peers.items():  # a fast wrong product must not pass
                result = run()
                err = relative_error(np.asarray(result[0] if isinstance(result, list) else result), reference)
                if not err <= PEER_RELATIVE_ERROR:
                    wrong.append(f"{name} {m}x{k}x{n} on {threads} threads: {err:.1e}")
            with threadpool_limits(threads):
                t = interleaved_medians(peers, args.repeat)
            gflops = {name: 2 * m * k * n / s / 1e9 for name, s in t.items()}
            rows.append([threads, f"{m}x{k}x{n}"] + [f"{gflops[p]:.0f}" if p in t else "n/a" for p in PEERS]
                        + [f"{t['numpy'] / t[p]:.2f}x" if p in t else "n/a" for p in PEERS[1:]])
    print(format_table(["threads", "m x k x n", *PEERS, *(f"numpy/{p}" for p in PEERS[1:])], rows))
    if wrong:
        print(f"products off the float64 one by more than {PEER_RELATIVE_ERROR:.0e}: {'; '.join(wrong)}", file=sys.stderr)
        return 1
    print(f"every product within {PEER_RELATIVE_ERROR:.0e} of the float64 one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
