"""Per strided 1-D convolution shape, the C backend's matmuls over views of the source
(backends/c/strided_conv.c) against oneDNN's direct convolution, in one process on the same
inputs: the measurement behind the emitter's and the cost model's rule (ir/hardware.py,
strided_conv_wins).

    .venv/bin/python benchmarks/strided_convs.py [--threads 1] [--repeat 9] [--batch 1]

Each shape is one convolution (no padding, no bias, gelu) compiled twice: its binding made once
with strided_conv.c turned off (tg_set_strided_conv(0)) and once on (1); the two are timed
round-robin (benchmarks/_common.py), a sample being enough calls to take ~20 ms. Printed: each
one's median per call, the ratio matmuls/direct per round (median and quartiles), what the rule
picks. Shapes: wav2vec 2.0's feature encoder (512 channels, k 3 stride 2, k 2 stride 2) at 30 s
of audio and at 1 s, and narrower or shorter ones to place the rule's bounds. The load average is
printed: other work on the cores moves every number."""

from __future__ import annotations

import argparse
import os

import numpy as np

from _common import format_table, machine_lines, paired_calls  # noqa: E402

# (name, C = K, source length, k, stride)
SHAPES = [("w2v k3 30s", 512, 95999, 3, 2), ("w2v k3 47999", 512, 47999, 3, 2), ("w2v k3 11999", 512, 11999, 3, 2),
          ("w2v k2 5999", 512, 5999, 2, 2), ("w2v k2 2999", 512, 2999, 2, 2), ("w2v k3 1s", 512, 3199, 3, 2),
          ("w2v k2 1s", 512, 99, 2, 2), ("c256 k3", 256, 8001, 3, 2), ("c128 k3", 128, 8001, 3, 2),
          ("c64 k3", 64, 8001, 3, 2), ("c32 k3", 32, 8001, 3, 2), ("c512 short", 512, 257, 3, 2),
          ("c512 k10 s5", 512, 8005, 10, 5), ("c384 k3", 384, 8001, 3, 2), ("c768 k3", 768, 8001, 3, 2),
          ("c1024 k3", 1024, 4001, 3, 2), ("c256 k3 long", 256, 32001, 3, 2), ("c512 k3 1001", 512, 1001, 3, 2),
          ("c512 k3 513", 512, 513, 3, 2), ("c512 k4 s3", 512, 6001, 4, 3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--only", nargs="*", help="shape names to run (default: all)")
    args = ap.parse_args()
    import tilegraph
    from tilegraph.ir import Graph
    from tilegraph.ir.hardware import strided_conv_wins

    print("\n".join(machine_lines()))
    print(f"threads {args.threads}, load {os.getloadavg()}")
    rng = np.random.default_rng(0)
    rows = []
    head = ["shape", "conv", "direct ms", "matmuls ms", "matmuls/direct", "rule"]
    for batch in args.batch:
        for name, c, length, k, stride in SHAPES:
            if args.only and name not in args.only:
                continue
            g = Graph()
            w = (rng.standard_normal((c, c, k)) / np.sqrt(k * c)).astype(np.float32)
            y = g.op("gelu", g.op("conv", g.input("x", (batch, c, length)), g.weight("w", w), strides=(stride,)),
                     approximate="none")
            model = g.build(y, names=["y"])
            xs = [rng.standard_normal((batch, c, length)).astype(np.float32)]
            runs = {}
            for label, mode in (("direct", 0), ("matmuls", 1)):
                compiled = tilegraph.compile(model, target="c", threads=args.threads)
                lib = compiled._runner._lib
                lib.tg_set_strided_conv(mode)
                compiled.run(*xs)  # the binding: made now, under this mode
                lib.tg_set_strided_conv(-1)
                taken = any("strided (k" in line for line in compiled._runner.primitives)
                assert taken == (mode == 1), compiled._runner.primitives
                runs[label] = lambda f=compiled.run, xs=xs: f(*xs)
            per, (med, q1, q3) = paired_calls(runs, args.repeat, "matmuls", "direct")
            rows.append([f"{name} b{batch}", f"{c}->{c} L{length} k{k} s{stride}", f"{per['direct'] * 1e3:.3f}",
                         f"{per['matmuls'] * 1e3:.3f}", f"{med:.2f} ({q1:.2f}-{q3:.2f})",
                         "matmuls" if strided_conv_wins(batch, c, c, (length - k) // stride + 1, k, stride) else "direct"])
            print(format_table(head, rows[-1:]), flush=True)
    print()
    print(format_table(head, rows))
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
