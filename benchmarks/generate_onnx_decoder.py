"""Decode tokens/s on an ONNX decoder-with-past file (optimum's shape: past_key_values.N.* in,
present.N.* = Concat(past, new) out), tilegraph against onnxruntime on the very same file:

- tilegraph: `tilegraph.LanguageModel("model.onnx")`, the Concats turned into in-place writes of a
  preallocated cache (frontends/onnx/kv_cache.py), C backend;
- onnxruntime: its own past/present loop over the file (each step's present fed back as the next
  past: a new, longer cache per step);
- onnxruntime-genai (if installed with its model builder's dependency onnx-ir): its builder's
  GroupQueryAttention file of the same weights (a transformers folder written from the same model),
  its own generator with past and present sharing one buffer; beside it tilegraph on that same
  file ("tilegraph gqa": the fused attention rewritten into the same cache ops).

The model: a transformers Llama from config with random weights (default ~40M parameters: hidden
512, 8 layers, 8 heads / 4 K/V heads, MLP 1536, vocabulary 16000), exported with torch.onnx's
TorchScript exporter (optimum's). Decode only (the prompt's prefill untimed), greedy, after a short
prompt and at a depth, same thread count for all, rounds interleaved with the order rotated, medians
and per-round ratios; the greedy tokens of the runners are compared first.

    python benchmarks/generate_onnx_decoder.py
    python benchmarks/generate_onnx_decoder.py --layers 2 --rounds 1 --steps 8   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import SETTLE_S, format_table, llama_shape_options, machine_lines


def ort_runner(session, prompt, steps):
    """onnxruntime's loop: the prompt from an empty past, then `steps` timed one-token calls."""
    inputs = [i.name for i in session.get_inputs()]
    past_names = [n for n in inputs if n.startswith("past_key_values.")]
    shape = session.get_inputs()[inputs.index(past_names[0])].shape
    outs_names = [o.name for o in session.get_outputs()]

    def run():
        kv = {n: np.zeros((1, shape[1], 0, shape[3]), np.float32) for n in past_names}
        ids, total, made, seconds = np.array([prompt], np.int64), len(prompt), [], 0.0
        for step in range(steps + 1):
            start = time.perf_counter()
            outs = dict(zip(outs_names, session.run(None, {
                "input_ids": ids, "attention_mask": np.ones((1, total), np.int64),
                "position_ids": np.arange(total - ids.shape[1], total, dtype=np.int64)[None], **kv})))
            token = int(np.argmax(outs["logits"][0, -1]))
            kv = {n: outs["present." + n[len("past_key_values."):]] for n in past_names}
            if step:  # the prompt's call is the prefill: untimed
                seconds += time.perf_counter() - start
            made.append(token)
            ids, total = np.array([[token]], np.int64), total + 1
        return steps / seconds, made
    return run


def tilegraph_runner(lm, prompt, steps):
    from tilegraph.generation import Sampling

    def run():
        before_steps, before_s = lm.stats.steps, lm.stats.generate_seconds
        made = [t for _, t in lm.generate_ids([prompt], steps + 1, Sampling(), stop=False)]
        return (lm.stats.steps - before_steps) / (lm.stats.generate_seconds - before_s), made
    return run


def genai_runner(og, model, prompt, steps):
    def run():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + steps + 2, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(prompt)  # the prefill, untimed
        gen.generate_next_token()  # samples the prompt's token: no model call
        made = [int(gen.get_next_tokens()[0])]
        start = time.perf_counter()
        for _ in range(steps):
            gen.generate_next_token()
            made.append(int(gen.get_next_tokens()[0]))
        return steps / (time.perf_counter() - start), made
    return run


def genai_folder(hf: Path, out: Path, threads: int, precision: str = "fp32") -> Path | None:
    """onnxruntime-genai's builder on the transformers folder `hf` (`precision`: fp32, or int4 as
    its MatMulNBits; cpu), its session set to `threads`; None (said why) when the builder is missing
    or fails."""
    if not (out / "genai_config.json").exists():
        proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
                               str(out), "-p", precision, "-e", "cpu", "-c", str(out.parent / "genai_cache")],
                              capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                              cwd=out.parent)  # not benchmarks/: its quantization.py shadows the builder's module
        if proc.returncode:
            print(f"onnxruntime-genai's builder failed: {proc.stderr.strip().splitlines()[-1:]}")
            return None
    config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    (out / "genai_config.json").write_text(json.dumps(config, indent=4))
    return out


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    llama_shape_options(ap, hidden=512, ffn=1536, layers=8, heads=8, kv_heads=4, vocab=16000)
    ap.add_argument("--depths", default="16,512", help="prompt lengths: the cache depth decode starts from")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default=None, help="thread counts, e.g. 1,2 (default: 1 and all)")
    ap.add_argument("--dir", default=None, help="where the model files go (default: a temporary folder)")
    args = ap.parse_args()

    import onnxruntime as ort
    import torch

    import tilegraph
    from tilegraph.testing.onnx_decoders import export_decoder, write_hf_folder

    try:
        import onnxruntime_genai as og
    except ImportError:
        og = None
    folder = Path(args.dir or tempfile.mkdtemp(prefix="tg_onnx_decoder_"))
    folder.mkdir(parents=True, exist_ok=True)
    depths = [int(d) for d in args.depths.split(",")]
    sizes = {"hidden": args.hidden, "ffn": args.ffn, "layers": args.layers, "heads": args.heads,
             "kv_heads": args.kv_heads, "vocab": args.vocab, "positions": max(depths) + args.steps + 8}
    path = folder / "model.onnx"
    if not path.exists():
        model = export_decoder(path, "llama", **sizes)
        write_hf_folder(folder / "hf", "llama", **sizes)  # the same seed: the same weights
    else:
        from tilegraph.testing.onnx_decoders import make_model
        model = make_model("llama", **sizes)
    params = sum(p.numel() for p in model.parameters())
    cpus = len(os.sched_getaffinity(0))
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cpus})
    for line in machine_lines(onnxruntime=ort.__version__, torch=torch.__version__,
                              **({"onnxruntime_genai": og.__version__} if og else {})):
        print(line)
    print(f"model: transformers Llama from config, {params / 1e6:.1f}M parameters (f32), {sizes}; file {path}")
    print(f"load average before: {os.getloadavg()[0]:.2f} (other agents share this machine)")
    rng = np.random.default_rng(0)
    rows = []
    with_genai = False
    for n_threads in threads:
        lm = tilegraph.LanguageModel(path, target="c", threads=n_threads, cache_len=max(depths) + args.steps + 8)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = n_threads
        opts.inter_op_num_threads = 1
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        genai, lm_gqa = None, None
        if og is not None:
            gfolder = genai_folder(folder / "hf", folder / "genai", n_threads)
            genai = og.Model(str(gfolder)) if gfolder else None
            if gfolder:  # tilegraph on the builder's GroupQueryAttention file too
                lm_gqa = tilegraph.LanguageModel(gfolder / "model.onnx", target="c", threads=n_threads,
                                                 cache_len=max(depths) + args.steps + 8)
        for depth in depths:
            prompt = [int(t) for t in rng.integers(1, args.vocab, depth)]
            runners = {"tilegraph": tilegraph_runner(lm, prompt, args.steps),
                       "onnxruntime": ort_runner(session, prompt, args.steps)}
            if genai is not None and lm_gqa is not None:
                with_genai = True
                runners["tilegraph gqa"] = tilegraph_runner(lm_gqa, prompt, args.steps)
                runners["onnxruntime-genai"] = genai_runner(og, genai, prompt, args.steps)
            made = {name: run()[1] for name, run in runners.items()}  # warm-up, and the tokens
            same = {name: tokens == made["onnxruntime"] for name, tokens in made.items()}
            samples: dict[str, list[float]] = {name: [] for name in runners}
            names = list(runners)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    time.sleep(SETTLE_S)
                    samples[name].append(runners[name]()[0])
            med = {name: statistics.median(s) for name, s in samples.items()}
            ratio = statistics.median(a / b for a, b in zip(samples["tilegraph"], samples["onnxruntime"]))
            row = [n_threads, f"tg{args.steps}@d{depth}", f"{med['tilegraph']:.1f}", f"{med['onnxruntime']:.1f}",
                   f"{ratio:.2f}x"]
            if "onnxruntime-genai" in runners:
                g_ratio = statistics.median(a / b for a, b in zip(samples["tilegraph gqa"],
                                                                  samples["onnxruntime-genai"]))
                row += [f"{med['tilegraph gqa']:.1f}", f"{med['onnxruntime-genai']:.1f}", f"{g_ratio:.2f}x"]
            row.append(", ".join(name for name, ok in same.items() if not ok) or "all same")
            rows.append(row)
            print(f"  threads {n_threads}, depth {depth}: {row} (load {os.getloadavg()[0]:.2f})", flush=True)
    header = ["threads", "test", "tilegraph tok/s", "onnxruntime tok/s", "tg / ort"]
    if with_genai:
        header += ["tilegraph gqa tok/s", "ort-genai tok/s", "tg gqa / genai"]
    print(format_table(header + ["greedy tokens vs onnxruntime"], rows))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
