"""Which activation layout oneDNN's convolutions run fastest in on this processor: each
shape in channels-last (the C backend's), nChw16c and nChw8c (onnxruntime's NCHWc), timed
interleaved in one process on the same data, with the implementation oneDNN picked.

    .venv/bin/python benchmarks/onednn_layouts.py [--set resnet50|depthwise] [--post relu|sum|swish|hardswish]
        [--threads 1] [--repeat 31]

--set resnet50: ResNet-50's 1x1 and 3x3 shapes; depthwise: MobileNetV2's and EfficientNet-B0's
depthwise shapes. --post: the fused epilogue (relu; sum then relu, a residual block's end;
swish, EfficientNet's; hardswish, MobileNetV3's). The C source is onednn_layouts.c, built against the oneDNN the C
backend links (backends/c/build.onednn).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import machine_lines  # noqa: E402

# (depthwise, in channels, out channels, input height, kernel, stride)
SETS = {
    "resnet50": [(0, 64, 256, 56, 1, 1), (0, 256, 64, 56, 1, 1), (0, 64, 64, 56, 3, 1), (0, 128, 512, 28, 1, 1),
                 (0, 512, 128, 28, 1, 1), (0, 128, 128, 28, 3, 1), (0, 256, 1024, 14, 1, 1), (0, 1024, 256, 14, 1, 1),
                 (0, 256, 256, 14, 3, 1), (0, 512, 2048, 7, 1, 1), (0, 2048, 512, 7, 1, 1), (0, 512, 512, 7, 3, 1)],
    "depthwise": [(1, 32, 32, 112, 3, 1), (1, 96, 96, 112, 3, 2), (1, 144, 144, 56, 3, 1), (1, 144, 144, 56, 5, 2),
                  (1, 192, 192, 28, 3, 1), (1, 240, 240, 28, 5, 1), (1, 384, 384, 14, 3, 1), (1, 480, 480, 14, 3, 1),
                  (1, 480, 480, 14, 5, 1), (1, 672, 672, 14, 5, 1), (1, 960, 960, 7, 3, 1), (1, 1152, 1152, 7, 5, 1)],
    # MobileNetV2's (transformers') first stages, pointwise and depthwise, where at batch 8 its steps
    # were slower than onnxruntime's NCHWc ones (benchmarks/c_steps.py --in-order --ort-profile)
    "mobilenet-v2": [(0, 32, 16, 112, 1, 1), (0, 16, 96, 112, 1, 1), (1, 96, 96, 112, 3, 2), (0, 96, 24, 56, 1, 1),
                     (0, 24, 144, 56, 1, 1), (1, 144, 144, 56, 3, 1), (0, 144, 24, 56, 1, 1), (1, 144, 144, 56, 3, 2),
                     (0, 144, 32, 28, 1, 1), (0, 32, 192, 28, 1, 1), (1, 192, 192, 28, 3, 1), (0, 192, 32, 28, 1, 1)],
}
POSTS = {"relu": 0, "sum": 1, "swish": 2, "hardswish": 3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", default="resnet50", choices=sorted(SETS))
    p.add_argument("--post", default="relu", choices=sorted(POSTS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeat", type=int, default=31)
    args = p.parse_args()
    from tilegraph.backends.c.build import onednn

    include, lib = onednn()
    src = Path(__file__).with_name("onednn_layouts.c")
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "layouts"
        subprocess.run([os.environ.get("CC", "cc"), "-O2", f"-I{include}", str(src), "-o", str(exe), f"-L{lib}",
                        "-ldnnl", f"-Wl,-rpath,{lib}"], check=True)
        shapes = [str(x) for s in SETS[args.set] for x in s]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TG_LAYOUTS_BATCH=str(args.batch))
        out = subprocess.run([str(exe), str(args.repeat), str(POSTS[args.post]), *shapes], env=env, check=True,
                             capture_output=True, text=True).stdout
    print("\n".join(machine_lines()))
    print(f"{args.set}, batch {args.batch}, post-op {args.post}, {args.threads} thread(s), medians of {args.repeat}; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(out, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
