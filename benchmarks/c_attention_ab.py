"""The C runtime's flash attention (tg_attention, f32) of two runtime builds, A against B.

A kernel change is judged against the kernel it replaces: both libraries are loaded into one
process and called in turn on the same inputs, so the shared machine's drift falls on both
alike; each row prints the fastest of `--repeat` calls of each and B/A. A runtime library's
path is what `build.runtime()` returns in a checkout (a worktree of main for the base):

    A=$(cd /tmp/base && .venv/bin/python -c "from tilegraph.backends.c import build; print(build.runtime())")
    B=$(.venv/bin/python -c "from tilegraph.backends.c import build; print(build.runtime())")
    .venv/bin/python benchmarks/c_attention_ab.py $A $B [--threads 1] [--repeat 15]

--backward: tg_attention_backward (attention_grad's kernel) instead, on the same shapes;
--a-without-row-strides: library A's tg_attention_backward predates the gradients' row strides
(dqr, dkr, dvr), so it is called without them (the gradients row-major either way).

Shapes: the attention of the full-size sweep's long-sequence models (benchmarks/full_size_sweep.py)
and of GPT-2's and MiniLM's training steps (MiniLM's with its float mask over the keys), with the blocks the C target's tile pass gives them on a core with 1 MiB of L2.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

# name -> (heads, tokens, head dim, causal)
SHAPES = {
    "wav2vec2-base (30 s)": (12, 1499, 64, False),
    "whisper-tiny encoder (30 s)": (6, 1500, 64, False),
    "bert-base s512": (12, 512, 64, False),
    "vit-b16": (12, 197, 64, False),
    "llama-0.3b prompt 1024": (16, 1024, 64, True),
    "gpt-2 training b4 (48 heads)": (48, 256, 64, True),  # issue 29's step: batch 4 x 12 heads
    "minilm training b8 (96 heads)": (96, 128, 32, False),  # and MiniLM's: batch 8 x 12 heads
}
# Shapes whose model adds a float mask over the keys, one row for every query (BERT's padding mask).
KEY_MASKED = {"minilm training b8 (96 heads)"}
# The backward's query rows per block: backends/c/emit.py's ATTENTION_BACKWARD_ROWS.
BACKWARD_ROWS = 64
BLOCKS = (128, 256)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="runtime library A (the base)")
    p.add_argument("b", help="runtime library B (the change)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--backward", action="store_true", help="time tg_attention_backward instead")
    p.add_argument("--a-without-row-strides", action="store_true",
                   help="call A's tg_attention_backward without the gradients' row strides")
    args = p.parse_args()
    libs = [ctypes.CDLL(path) for path in (args.a, args.b)]
    for lib in libs:
        lib.tg_set_threads(args.threads)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p

    def dims(*xs):
        return (i64 * len(xs))(*xs)

    rng = np.random.default_rng(0)
    print(f"threads {args.threads}; fastest of {args.repeat} calls each, A and B in turn")
    for name, (heads, n, d, causal) in SHAPES.items():
        q, k, v, gy = (rng.standard_normal((heads, n, d), dtype=np.float32) for _ in range(4))
        outs = [np.empty((3 if args.backward else 1, heads, n, d), np.float32) for _ in libs]
        bq, bk = (min(b, n) for b in BLOCKS)
        keys = rng.standard_normal(n).astype(np.float32) if name in KEY_MASKED else None
        mask = (keys.ctypes.data_as(ptr), 2, i64(0), i64(1)) if keys is not None else (None, 0, i64(0), i64(0))

        def backward(lib, o):
            status = lib.tg_attention_backward(
                1, dims(heads), dims(*[n * d] * 4, 0, *[n * d] * 3), *[x.ctypes.data_as(ptr) for x in (q, k, v, gy)],
                mask[0], *[x.ctypes.data_as(ptr) for x in o], i64(n), i64(n), i64(d), i64(d),
                *[i64(d)] * (4 if lib is libs[0] and args.a_without_row_strides else 7), *mask[1:],
                ctypes.c_float(d ** -0.5), int(causal), i64(BACKWARD_ROWS))
            assert status == 0, f"tg_attention_backward failed on {name}"

        def forward(lib, o):
            o = o[0]
            status = lib.tg_attention(
                1, dims(heads), dims(n * d), dims(n * d), dims(n * d), dims(0), dims(n * d),
                q.ctypes.data_as(ptr), k.ctypes.data_as(ptr), v.ctypes.data_as(ptr), mask[0], o.ctypes.data_as(ptr),
                i64(n), i64(n), i64(d), i64(d), i64(d), i64(d), i64(d), i64(d), *mask[1:],
                ctypes.c_float(d ** -0.5), int(causal), i64(bq), i64(bk))
            assert status == 0, f"tg_attention failed on {name}"

        call = backward if args.backward else forward

        best = [float("inf")] * 2
        for _ in range(args.repeat):
            for i, lib in enumerate(libs):
                start = time.perf_counter()
                call(lib, outs[i])
                best[i] = min(best[i], time.perf_counter() - start)
        diff = float(np.abs(outs[0] - outs[1]).max())
        print(f"{name:30s} A {best[0] * 1e3:8.2f} ms  B {best[1] * 1e3:8.2f} ms  B/A {best[1] / best[0]:.3f}"
              f"  max|A-B| {diff:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
