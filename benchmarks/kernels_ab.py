"""The NumPy backend's hot kernels (ir/kernels.py) of this checkout against another checkout's.

A change to a kernel is judged against the kernel it replaces, timed round-robin in one
process (benchmarks/_common.py) on the same inputs, so the shared machine's drift falls on
both alike. The peer is the `ir/kernels.py` of `--base`, e.g. a worktree of main:

    git worktree add --detach /tmp/base main
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/kernels_ab.py --base /tmp/base [--repeat N]

Kernels, at the shapes the transformer models of benchmarks/cpu_speed.py run them:
  * attention_tiled on MiniLM b8 s128 (12 heads of 32, strided views of one Q|K|V
    projection, a boolean padding mask), on all threads;
  * attention_tiled on MiniLM b1 s128 with the additive float mask the exported model
    computes (0 or float32's lowest), as the NumPy backend runs it;
  * attention_tiled on GPT-2 b1 s256 (12 heads of 64, causal, 128-query blocks);
  * softmax over MiniLM b8's eager attention scores (8x12x128x128);
  * gelu (erf) over MiniLM b8's FFN activations (1024x1536);
  * layer_norm over MiniLM b8's hidden states (1024x384);
  * conv: the small CNN's two, a ResNet stage's 3x3 and a depthwise 3x3 (CONVS).
Every output is compared with the base's (max relative difference printed).

Each kernel is timed two ways (benchmarks/_common.interleaved_samples): "settled",
after a 50 ms pause, and "back to back", right after an untimed call of the same
kernel, as kernels follow one another in a running model. After a pause this VM's
cores run cold (a 3 us GEMM takes 25 us), which dilutes what a kernel change gains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _common import format_table, interleaved_samples, load_kernels, machine_lines, paired_ratio  # noqa: E402  (puts the repo on sys.path)

import numpy as np  # noqa: E402

from tilegraph.backends.numpy.chunks import THREADS  # noqa: E402


def cases(rng: np.random.Generator) -> dict[str, tuple]:
    """name -> (function of a kernels module returning the output)."""
    def heads(batch, seq, n, d):  # strided views into one projection, as a transformer hands them over
        qkv = rng.standard_normal((batch, seq, 3, n, d), dtype=np.float32)
        return [qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]

    q8, k8, v8 = heads(8, 128, 12, 32)
    pad = rng.random((8, 1, 1, 128)) > 0.1
    q1, k1, v1 = heads(1, 128, 12, 32)
    additive = np.where(rng.random((1, 1, 1, 128)) > 0.1, 0, np.finfo(np.float32).min).astype(np.float32)
    q2, k2, v2 = heads(1, 256, 12, 64)
    scores = rng.standard_normal((8, 12, 128, 128), dtype=np.float32)
    ffn = rng.standard_normal((1024, 1536), dtype=np.float32)
    hidden = rng.standard_normal((1024, 384), dtype=np.float32)
    gamma, beta = rng.standard_normal(384, dtype=np.float32), rng.standard_normal(384, dtype=np.float32)
    outs = {name: np.empty(shape, np.float32) for name, shape in
            (("a8", q8.shape), ("a1", q1.shape), ("a2", q2.shape), ("s", scores.shape), ("g", ffn.shape),
             ("l", hidden.shape))}
    return {
        "attention MiniLM b8 s128, padding mask": lambda K: K.attention_tiled(
            q8, k8, v8, pad, 0.17, False, 128, 128, threads=THREADS, out=outs["a8"]),
        "attention MiniLM b1 s128, additive mask": lambda K: K.attention_tiled(
            q1, k1, v1, additive, 0.17, False, 128, 128, threads=THREADS, out=outs["a1"]),
        "attention GPT-2 b1 s256, causal": lambda K: K.attention_tiled(
            q2, k2, v2, None, 0.125, True, 128, 256, threads=THREADS, out=outs["a2"]),
        "softmax 8x12x128x128": lambda K: K.softmax(scores, -1, out=outs["s"]),
        "gelu (erf) 1024x1536": lambda K: K.gelu(ffn, "none", out=outs["g"]),
        "layer_norm 1024x384": lambda K: K.layer_norm(hidden, gamma, beta, -1, 1e-12, out=outs["l"]),
        **{f"conv {name}": conv_case(rng, *shapes) for name, shapes in CONVS.items()},
    }


# name -> (input, weight, pads, groups): the small CNN's two convs, a ResNet stage's
# 3x3 conv and a depthwise one. The base kernel may not take out=, so neither side gets it.
CONVS = {
    "small CNN conv1 32x3x16x16, 8 3x3": ((32, 3, 16, 16), (8, 3, 3, 3), (1, 1, 1, 1), 1),
    "small CNN conv2 32x8x8x8, 16 3x3": ((32, 8, 8, 8), (16, 8, 3, 3), (0, 0, 0, 0), 1),
    "2x64x56x56, 64 3x3": ((2, 64, 56, 56), (64, 64, 3, 3), (1, 1, 1, 1), 1),
    "depthwise 4x32x28x28, 3x3": ((4, 32, 28, 28), (32, 1, 3, 3), (1, 1, 1, 1), 32),
}


def conv_case(rng: np.random.Generator, x_shape, w_shape, pads, groups):
    x, w = rng.standard_normal(x_shape, dtype=np.float32), rng.standard_normal(w_shape, dtype=np.float32)
    bias = rng.standard_normal(w_shape[0], dtype=np.float32)
    return lambda K: K.conv(x, w, bias, (1, 1), pads, (1, 1), groups)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the checkout whose kernels are the peer")
    ap.add_argument("--repeat", type=int, default=21, help="timed rounds (default 21)")
    args = ap.parse_args(argv)
    base = load_kernels(args.base)
    kernels = load_kernels(Path(__file__).resolve().parent.parent, "this")
    for line in machine_lines():
        print(line)
    print(f"median of {args.repeat} round-robin rounds; peer: {args.base / 'ir' / 'kernels.py'}; {THREADS} threads\n")
    rows = []
    for name, run in cases(np.random.default_rng(0)).items():
        mine, theirs = np.array(run(kernels)), np.array(run(base))
        diff = float(np.max(np.abs(mine - theirs)) / max(np.max(np.abs(theirs)), 1e-30))
        for mode in ("settled", "back-to-back"):
            t = interleaved_samples({"this": lambda: run(kernels), "base": lambda: run(base)}, args.repeat,
                                    back_to_back=mode == "back-to-back")
            ratio, lo, hi = paired_ratio(t, "this", "base")
            rows.append([name, mode, f"{1e3 * np.median(t['base']):.2f}", f"{1e3 * np.median(t['this']):.2f}",
                         f"{ratio:.2f}x ({lo:.2f}-{hi:.2f})", f"{diff:.0e}"])
    print(format_table(["kernel", "timed", "base ms", "this ms", "this/base (quartiles)", "max rel diff"], rows))
    print("this/base: the median over rounds of the ratio within a round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
