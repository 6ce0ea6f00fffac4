"""Per 3x3 stride-1 convolution shape, the C backend's Winograd F(4x4, 3x3) (backends/c/winograd.c)
against oneDNN's direct convolution, in one process on the same inputs: the measurement behind
the emitter's and the cost model's rule (ir/hardware.py, winograd_wins).

    .venv/bin/python benchmarks/winograd_convs.py [--threads 1] [--repeat 15] [--batch 1 8]

Each shape is one convolution (pad 1, bias, relu) compiled twice: its binding made once with
winograd.c turned off (tg_set_winograd(0)) and once on (1); the two are timed round-robin
(benchmarks/_common.py), a sample being enough calls to take ~20 ms. Printed: each one's median
per call, the ratio winograd/direct per round (median and quartiles), what the rule picks and
the relative error of each against the float64 interpreter. Shapes: ResNet-50's four stages,
DenseNet-121's four blocks, small ones the rule must refuse, and RegNetY-4GF's grouped 3x3s
(36 x groups GEMMs) with narrower groups, to place the rule's group width. The load average is printed: other work on the cores moves every number."""

from __future__ import annotations

import argparse
import os

import numpy as np

from _common import format_table, machine_lines, paired_calls  # noqa: E402

# (name, C, K, H=W, groups): ResNet-50's 3x3s (stage widths at 224), DenseNet-121's (128 -> 32
# in each of its four blocks), smaller and odd ones, then RegNetY-4GF's grouped 3x3s (64
# channels a group; its stride-1 ones at each stage's width) and narrower groups
SHAPES = [("resnet s1", 64, 64, 56, 1), ("resnet s2", 128, 128, 28, 1), ("resnet s3", 256, 256, 14, 1),
          ("resnet s4", 512, 512, 7, 1), ("densenet 56", 128, 32, 56, 1), ("densenet 28", 128, 32, 28, 1),
          ("densenet 14", 128, 32, 14, 1), ("densenet 7", 128, 32, 7, 1), ("c32 56", 32, 32, 56, 1),
          ("c16 28", 16, 16, 28, 1), ("c64 14", 64, 64, 14, 1), ("c128 7", 128, 128, 7, 1),
          ("c256 28", 256, 256, 28, 1), ("c96 20", 96, 96, 20, 1),
          ("regnet s1", 128, 128, 56, 2), ("regnet s2", 192, 192, 28, 3), ("regnet s3", 512, 512, 14, 8),
          ("regnet s4", 1088, 1088, 7, 17), ("g32 28", 256, 256, 28, 8), ("g32 14", 512, 512, 14, 16),
          ("g16 28", 256, 256, 28, 16), ("g8 28", 256, 256, 28, 32)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--only", nargs="*", help="shape names to run (default: all)")
    ap.add_argument("--chunk-kib", type=int, help="the emitter's WINOGRAD_CHUNK_BYTES, in KiB, for this run")
    args = ap.parse_args()
    import tilegraph
    from tilegraph.backends.c import onednn

    if args.chunk_kib:
        onednn.WINOGRAD_CHUNK_BYTES = args.chunk_kib << 10
    from tilegraph.accuracy import relative_error
    from tilegraph.ir.hardware import winograd_wins
    from tilegraph.ir import Graph, interpret

    print("\n".join(machine_lines()))
    print(f"threads {args.threads}, chunks of {onednn.WINOGRAD_CHUNK_BYTES >> 10} KiB, load {os.getloadavg()}")
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batch:
        for name, c, k, hw, groups in SHAPES:
            if args.only and name not in args.only:
                continue
            g = Graph()
            x = g.input("x", (batch, c, hw, hw))
            w = (rng.standard_normal((k, c // groups, 3, 3)) / np.sqrt(9 * c / groups)).astype(np.float32)
            y = g.relu(g.op("conv", x, g.weight("w", w), g.weight("b", rng.standard_normal(k).astype(np.float32)),
                            pads=(1, 1, 1, 1), groups=groups))
            model = g.build(y, names=["y"])
            xs = [rng.standard_normal((batch, c, hw, hw)).astype(np.float32)]
            runs, errors = {}, {}
            ref = interpret(model, xs)[0] if batch * c * k // groups * hw * hw <= 2 ** 26 else None
            for label, mode in (("direct", 0), ("winograd", 1)):
                compiled = tilegraph.compile(model, target="c", threads=args.threads)
                lib = compiled._runner._lib
                lib.tg_set_winograd(mode)
                out = compiled.run(*xs)[0]  # the binding: made now, under this mode
                lib.tg_set_winograd(-1)
                errors[label] = relative_error(out, ref) if ref is not None else float("nan")
                wino = any("winograd" in line for line in compiled._runner.primitives)
                assert wino == (mode == 1), compiled._runner.primitives
                runs[label] = lambda f=compiled.run, xs=xs: f(*xs)
            per, (med, q1, q3) = paired_calls(runs, args.repeat, "winograd", "direct")
            rows.append([f"{name} b{batch}", f"{c}->{k} {hw}x{hw}" + (f" g{groups}" if groups > 1 else ""), f"{per['direct'] * 1e3:.3f}",
                         f"{per['winograd'] * 1e3:.3f}", f"{med:.2f} ({q1:.2f}-{q3:.2f})",
                         "winograd" if winograd_wins(batch, c, k, hw, hw, groups) else "direct",
                         f"{errors['direct']:.1e} / {errors['winograd']:.1e}"])
            print(format_table(["shape", "conv", "direct ms", "winograd ms", "wino/direct", "rule", "rel err d/w"],
                               rows[-1:]), flush=True)
    print()
    print(format_table(["shape", "conv", "direct ms", "winograd ms", "wino/direct", "rule", "rel err d/w"], rows))
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
