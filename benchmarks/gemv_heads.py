"""Per one-row matmul shape (a fully connected layer at batch 1: image models' heads), the C
backend's GEMV (backends/c/gemv.c) against oneDNN's GEMM, in one process on the same inputs: the
measurement behind the emitter's rule (ir/hardware.py, gemv_wins).

    .venv/bin/python benchmarks/gemv_heads.py [--threads 1] [--repeat 15] [--cold-mib 64]

Each shape is x[1, K] @ W[K, N] + bias, then hardswish (MobileNetV3's head), or a squeeze-excitation's
1x1 convolution of a 1x1 image with its bias and relu, compiled with its
binding made once with gemv.c off (tg_set_gemv(0)) and once on (1). Warm: one weight called
over and over (it stays in the caches, as in a loop over one layer). Cold: as many copies of the
layer, each its own weight, as make up --cold-mib, called in turn, so each call reads its weight
from memory, as a whole model's call does (a head's 5 MB beside the rest of the model's weights).
The two paths are timed round-robin (benchmarks/_common.py); printed: each one's median per call,
the ratio gemv/onednn per round (median and quartiles), the weight's read rate, what the rule
picks and each one's relative error against the float64 interpreter. The load average is
printed: other work on the cores moves every number."""

from __future__ import annotations

import argparse
import os

import numpy as np

from _common import format_table, machine_lines, paired_calls  # noqa: E402

# (name, K, N): the heads of MobileNetV3-Large (960 -> 1280 -> 1000), MobileNetV2 and
# EfficientNet-B0 (1280 -> 1000), ResNet-50 (2048 -> 1000), MobileNetV3-Small (576 -> 1024), and
# smaller weights around the rule's threshold (1 MiB: 512x512, 256x1024; below: 384x384, 128x1000)
SHAPES = [("mbv3 fc1", 960, 1280), ("mbv3 fc2", 1280, 1000), ("resnet50 fc", 2048, 1000),
          ("mbv3-s fc1", 576, 1024), ("512x512", 512, 512), ("256x1024", 256, 1024), ("384x384", 384, 384),
          ("128x1000", 128, 1000), ("odd 1000x77", 1000, 77)]
# (name, C, K): squeeze-excitation's 1x1 convolutions of a 1x1 image, as 1x1 convolutions with a
# bias and relu: MobileNetV3-Large's (960 <-> 240, 672 <-> 168, 480 <-> 120, 120 -> 32, 72 -> 24)
# and EfficientNet-B0's (1152 <-> 48, 672 -> 28)
SE = [("se 960-240", 960, 240), ("se 240-960", 240, 960), ("se 672-168", 672, 168), ("se 168-672", 168, 672),
      ("se 480-120", 480, 120), ("se 120-32", 120, 32), ("se 72-24", 72, 24), ("se 1152-48", 1152, 48),
      ("se 48-1152", 48, 1152), ("se 672-28", 672, 28)]
# at most this many copies of a layer in the cold rows (each compiled on its own)
MAX_COPIES = 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--cold-mib", type=int, default=64, help="weights rotated through in the cold rows")
    ap.add_argument("--only", nargs="*", help="shape names to run (default: all)")
    args = ap.parse_args()
    import tilegraph
    from tilegraph.accuracy import relative_error
    from tilegraph.ir import Graph, interpret
    from tilegraph.ir.hardware import gemv_wins

    print("\n".join(machine_lines()))
    print(f"threads {args.threads}, cold: {args.cold_mib} MiB of weights in turn, load {os.getloadavg()}")
    rng = np.random.default_rng(0)
    header = ["shape", "K x N", "weights", "onednn ms", "gemv ms", "gemv/onednn", "GB/s o / g", "rule",
              "rel err o/g"]
    rows = []
    for name, k, n, conv in [(*shape, False) for shape in SHAPES] + [(*shape, True) for shape in SE]:
        if args.only and name not in args.only:
            continue
        copies = min(MAX_COPIES, max(1, (args.cold_mib << 20) // (4 * k * n)))
        xs = [rng.standard_normal((1, k, 1, 1) if conv else (1, k)).astype(np.float32)]
        models = []
        for _ in range(copies):
            g = Graph()
            x = g.input("x", xs[0].shape)
            w = (rng.standard_normal((n, k, 1, 1) if conv else (k, n)) / np.sqrt(k)).astype(np.float32)
            b = g.weight("b", rng.standard_normal(n).astype(np.float32))
            if conv:
                models.append(g.build(g.relu(g.op("conv", x, g.weight("w", w), b)), names=["y"]))
                continue
            y = x @ g.weight("w", w) + b
            hard_sigmoid = g.op("max", g.op("min", y * (1 / 6) + 0.5, g.lift(1.0, y)), g.lift(0.0, y))
            models.append(g.build(y * hard_sigmoid, names=["y"]))
        ref = interpret(models[0], xs)[0]
        for temp, group in (("warm", models[:1]), ("cold", models)):
            runs, errors = {}, {}
            for label, mode in (("onednn", 0), ("gemv", 1)):
                calls = []
                for model in group:
                    compiled = tilegraph.compile(model, target="c", threads=args.threads)
                    lib = compiled._runner._lib
                    lib.tg_set_gemv(mode)
                    out = compiled.run(*xs)[0]  # the binding: made now, under this mode
                    lib.tg_set_gemv(-1)
                    taken = any("gemv.c" in line for line in compiled._runner.primitives)
                    assert taken == (mode == 1), compiled._runner.primitives
                    calls.append(compiled.run)
                    if model is group[0]:
                        errors[label] = relative_error(out, ref)
                turn = iter(range(1 << 62))
                runs[label] = lambda calls=calls, turn=turn: calls[next(turn) % len(calls)](*xs)
            per, (med, q1, q3) = paired_calls(runs, args.repeat, "gemv", "onednn")
            rate = lambda s: 4 * k * n / s / 1e9  # noqa: E731
            rows.append([f"{name} {temp}", f"{k}x{n}", f"{len(group)} x {4 * k * n / 2**20:.1f} MiB",
                         f"{per['onednn'] * 1e3:.3f}", f"{per['gemv'] * 1e3:.3f}", f"{med:.2f} ({q1:.2f}-{q3:.2f})",
                         f"{rate(per['onednn']):.1f} / {rate(per['gemv']):.1f}",
                         "gemv" if gemv_wins(1) else "onednn",
                         f"{errors['onednn']:.1e} / {errors['gemv']:.1e}"])
            print(format_table(header, rows[-1:]), flush=True)
    print()
    print(format_table(header, rows))
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
