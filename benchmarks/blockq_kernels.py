"""Decode's matmuls on GGUF block formats: integer dot products on q8 activations (blockq.c,
AVX512-VNNI and AVX2) against dequantizing the weight to float in registers, on the weights
of one SmolLM2-135M decode step (30 layers of q4_1 matrices, the q8_0 output head: ~96 MB,
more than the cores' caches), at 1 thread and all. Prints GB/s of weights read and the
ratio of each kernel to the float-dequantizing one, with the load average beside.

    python benchmarks/blockq_kernels.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

import numpy as np

from _common import format_table, machine_lines
from tilegraph.backends.c import blockq
from tilegraph.ir.block_formats import FORMATS

HIDDEN, FFN, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152  # SmolLM2-135M's shapes


def weights(rng):
    q41 = FORMATS["q4_1"]
    layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (FFN, HIDDEN), (FFN, HIDDEN),
             (HIDDEN, FFN)]
    mats = []
    for _ in range(LAYERS):
        for n, k in layer:
            mats.append(("q4_1", k, q41.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05)))
    mats.append(("q8_0", HIDDEN, FORMATS["q8_0"].quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))))
    return mats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    lib = blockq.library()
    lib.tg_block_matmul_f32dq.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    rng = np.random.default_rng(0)
    mats = weights(rng)
    total = sum(w.nbytes for _, _, w in mats)
    xs = {k: rng.standard_normal(k).astype(np.float32) for k in (HIDDEN, FFN)}
    y = np.empty(VOCAB, np.float32)

    def step(kind):
        def run():
            for fmt, k, w in mats:
                x = xs[k]
                if kind == "f32dq":
                    rc = lib.tg_block_matmul_f32dq(x.ctypes.data, k, w.ctypes.data, w.shape[0], w.shape[1],
                                                   blockq.FORMATS[fmt], y.ctypes.data)
                else:
                    rc = lib.tg_block_matmul(x.ctypes.data, 1, k, w.ctypes.data, w.shape[0], w.shape[1],
                                             blockq.FORMATS[fmt], y.ctypes.data, w.shape[0])
                assert rc == 0
        return run

    kernels = {"q8 x int8 (AVX512-VNNI)": "avx512_vnni", "q8 x int8 (AVX2 maddubs)": "avx2",
               "dequantized to f32 (AVX512 FMA)": "f32dq"}
    print("\n".join(machine_lines()))
    rows = []
    for threads in sorted({1, os.cpu_count() or 1}):
        lib.tg_set_threads(threads)
        best = {name: float("inf") for name in kernels}
        for _ in range(args.rounds):
            for name, kind in kernels.items():
                if kind != "f32dq":
                    blockq.isa(kind)
                run = step(kind)
                run()
                t0 = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - t0)
        for name in kernels:
            rows.append([threads, name, f"{best[name] * 1e3:.2f}", f"{total / best[name] / 1e9:.1f}",
                         f"{best['dequantized to f32 (AVX512 FMA)'] / best[name]:.2f}x"])
    blockq.isa(None)
    print(f"weights of one decode step: {total / 1e6:.1f} MB; load average {os.getloadavg()[0]:.2f} "
          "(other agents share this machine)")
    print(format_table(["threads", "kernel", "ms/step", "GB/s", "vs f32-dequant"], rows))


if __name__ == "__main__":
    main()
