"""Decode of a Llama-shaped transformers model from config (random weights, about 0.5B parameters),
written as GGUF by `tilegraph quantize`'s writer in f32, q8_0 and q4_0 and compiled for the C
backend, one sequence, interleaved rounds, medians:

- in place: decode tokens/s with the cache filled to position 2000 against position 100 (target:
  within 15%), and the process's resident memory before and after each run of steps (flat: the
  cache is written in place, nothing is allocated per token);
- quantization pays: q8_0 and q4_0 decode tokens/s against f32 weights (target: >= 1.8x, >= 3x),
  each beside its bytes read per token x tokens/s.

The peer of each ratio is tilegraph itself on f32 weights (the issue's row compares formats).
Quantized formats decode with activation='q8' (int8 dot products, llama.cpp's numerics); f32 weights
multiply the float activations. Every row keeps its K/V cache in f16 (--cache-dtype; llama.cpp's
default): the best cache for each format, as it halves the bytes a deep step reads whatever the
weights (f32 weights with an f16 cache are faster at depth than with an f32 one, so the f32 row
is not handicapped by it). Cache positions are set directly (the cache's contents do not change
the work of a step: attention reads positions 0..pos whatever they hold).

    python benchmarks/decode_inplace_quant.py                 # ~0.5B: hidden 1536, 16 layers
    python benchmarks/decode_inplace_quant.py --layers 2 --steps 4 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import llama_shape_options


def rss_mb() -> float:
    """Resident memory of this process now (VmRSS), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    llama_shape_options(ap, hidden=1536, ffn=4096, layers=16, heads=12, kv_heads=4, vocab=32000)
    ap.add_argument("--formats", default="f32,q8_0,q4_0")
    ap.add_argument("--positions", default="100,2000")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-dtype", choices=["f16", "f32"], default="f16", help="the K/V cache's type, every row")
    ap.add_argument("--reuse", action="store_true", help="keep GGUF files already in --dir (same shape flags)")
    ap.add_argument("--dir", default=None, help="where the GGUF files go (default: a temporary folder)")
    args = ap.parse_args()
    import torch
    import transformers

    from tilegraph.frontends.gguf.writer import write_gguf
    from tilegraph.generation import LanguageModel

    formats = args.formats.split(",")
    positions = [int(p) for p in args.positions.split(",")]
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.no_grad():
        model = transformers.LlamaForCausalLM(config)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = sum(v.size for v in state.values())
    print(f"Llama from config: {params / 1e9:.2f}B parameters (hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads, MLP {args.ffn}, vocab {args.vocab}), random weights")
    folder = Path(args.dir or tempfile.mkdtemp(prefix="tg_decode_"))
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    lms, sizes = {}, {}
    cache_len = max(positions) + args.steps + 4
    for fmt in formats:
        path = folder / f"llama-{fmt}.gguf"
        start = time.perf_counter()
        if not (args.reuse and path.exists()):
            write_gguf(path, cfg, state, fmt)
        sizes[fmt] = path.stat().st_size
        lm = LanguageModel(path, target="c", cache_len=cache_len, threads=args.threads,
                           activation="f32" if fmt == "f32" else "q8", cache_dtype=args.cache_dtype)
        lm.entry(1, "decode")  # compile before timing
        lms[fmt] = lm
        print(f"{fmt}: {sizes[fmt] / 1e6:.0f} MB file, written and compiled in {time.perf_counter() - start:.0f} s",
              flush=True)
    del model, state
    token, last = np.array([[1]], np.int64), np.zeros(1, np.int64)
    rates: dict[tuple[str, int], list[float]] = {}
    memory: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for fmt in formats:
            lm = lms[fmt]
            for p in positions:
                lm.forward(token, np.array([p], np.int64), last, "decode")  # warm: pages of this position in
                before = rss_mb()
                start = time.perf_counter()
                for i in range(args.steps):
                    lm.forward(token, np.array([p + i], np.int64), last, "decode")
                rates.setdefault((fmt, p), []).append(args.steps / (time.perf_counter() - start))
                memory.setdefault((fmt, p), []).append((before, rss_mb()))
        print(f"round {r + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    elem = 2 if args.cache_dtype == "f16" else 4
    cache_bytes = {p: 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * (p + 1) * elem for p in positions}
    print(f"\ntokens/s, medians of {args.rounds} rounds x {args.steps} steps; threads "
          f"{args.threads or 'all'}; {args.cache_dtype} K/V cache; load average {os.getloadavg()[0]:.1f} (other agents share this machine)")
    print(f"{'format':8} {'position':>8} {'tok/s':>8} {'vs f32':>7} {'MB read/tok':>11} {'GB/s':>6} "
          f"{'RSS before -> after (MB)':>26}")
    for fmt in formats:
        for p in positions:
            rate = med[(fmt, p)]
            ratio = rate / med[("f32", p)] if ("f32", p) in med else float("nan")
            mb = (sizes[fmt] + cache_bytes[p]) / 1e6
            before, after = memory[(fmt, p)][-1]
            print(f"{fmt:8} {p:8d} {rate:8.2f} {ratio:6.2f}x {mb:11.0f} {mb * rate / 1e3:6.2f} "
                  f"{before:12.0f} -> {after:.0f}")
    print("\nin place: tokens/s at the deepest position over the shallowest (issue: >= 0.85)")
    for fmt in formats:
        lo, hi = min(positions), max(positions)
        grew = max(after - before for before, after in memory[(fmt, hi)] + memory[(fmt, lo)])
        print(f"  {fmt}: {med[(fmt, hi)] / med[(fmt, lo)]:.2f} (position {hi} / {lo}); RSS grew at most "
              f"{grew:.1f} MB over a run of {args.steps} steps")
    if "f32" in formats:
        print("quantization pays: tokens/s over f32 at each position (issue: q4_0 >= 3x, q8_0 >= 1.8x)")
        for fmt in formats:
            if fmt != "f32":
                print(f"  {fmt}: " + ", ".join(f"{med[(fmt, p)] / med[('f32', p)]:.2f}x at {p}" for p in positions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
