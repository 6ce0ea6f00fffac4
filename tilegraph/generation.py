"""Text generation with a compiled language model (a GGUF file), after gpt-fast's generate.py.

    lm = tilegraph.compile("model.gguf")                      # a LanguageModel
    for piece in tilegraph.generate(lm, "Hello", max_new_tokens=32):
        print(piece, end="", flush=True)

One compiled model has two entry points over the same weights and the same KV cache:
prefill (all prompt tokens in one call, T symbolic) and decode (one token per sequence).
The caches are preallocated once per batch size ([B, Hkv, S, D] per layer, S = `cache_len`)
and donated to every call, which writes the new positions in place (tg.cache_write):
nothing is allocated per token beyond the backend's own arena. Several prompts decode
together, each with its own position and its own end (a finished sequence keeps its slot
but its tokens are dropped); prompts of different lengths are padded on the right for
prefill, and the padding's cache rows are overwritten by the first decode steps before
any query can see them (attention is causal in absolute positions).

Sampling (greedy, temperature, top-k, top-p, repetition penalty, a seed) runs inside the
compiled step (tg.sample, after the logits): a step returns each sequence's next token, and
Python only keeps the `seen` flags (for the penalty) and draws one uniform number per
sequence per step from the seeded generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from tilegraph.ir.errors import TilegraphError

if TYPE_CHECKING:
    from tilegraph.frontends.onnx.kv_cache import OnnxDecoder

DEFAULT_CACHE_LEN = 2048  # positions per sequence when neither the caller nor the file says less


@dataclass
class Token:
    """One generated token of sequence `seq`, and the text it adds (empty while a multi-byte
    character is incomplete)."""

    seq: int
    id: int
    text: str


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    steps: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generate_tps(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0

    def line(self) -> str:
        return (f"prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tokens/s; generation: "
                f"{self.generated_tokens} tokens, {self.generate_tps:.1f} tokens/s")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: all
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # as transformers': a seen token's logit / p if > 0, else * p
    seed: int | None = 0

    def check(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or self.repetition_penalty <= 0:
            raise TilegraphError(f"sampling settings out of range: {self}")

    def attrs(self) -> dict:
        """tg.sample's attributes."""
        return {"temperature": float(self.temperature), "top_k": int(self.top_k), "top_p": float(self.top_p),
                "repetition_penalty": float(self.repetition_penalty)}


class LanguageModel:
    """A GGUF language model (or an ONNX decoder-with-past file) compiled for `target`: prefill and decode entry points per batch
    size, sharing one weight store, and their caches."""

    def __init__(self, path: str | Path, target: str | None = None, cache_len: int | None = None,
                 threads: int | None = None, pipeline=None, activation: str = "f32", cache_dtype: str = "f32"):
        self.path = Path(path)
        self._onnx: OnnxDecoder | None = None
        if self.path.suffix.lower() == ".onnx":
            self._load_onnx(activation)
        else:
            self._load_gguf()
        self.cache_len = min(cache_len or DEFAULT_CACHE_LEN, self.config.context)
        self.target, self.threads, self.pipeline = target, threads, pipeline
        # 'f32': block-format matmuls multiply the float activations (exact, as transformers on the
        # dequantized weights); 'q8': activations rounded to int8 per 32 first, as llama.cpp does,
        # which the C backend runs as integer dot products
        self.activation = activation
        # 'f32' caches (exact); 'f16' as llama.cpp keeps them: half the bytes per decode step at depth,
        # each new K/V row rounded to f16 as it is written
        if cache_dtype not in ("f32", "f16"):
            raise TilegraphError(f"cache_dtype '{cache_dtype}': 'f32' or 'f16'")
        self.cache_dtype = cache_dtype
        self._compiled: dict[tuple, object] = {}
        self._caches: dict[int, list[np.ndarray]] = {}
        self.stats = Stats()

    def _load_gguf(self) -> None:
        from tilegraph.frontends.gguf.llama import LlamaConfig, load_weights
        from tilegraph.frontends.gguf.reader import GGUFFile
        from tilegraph.frontends.gguf.tokenizer import GGUFTokenizer

        f = GGUFFile(self.path)
        self.config = LlamaConfig.of(f)
        # a file tilegraph quantize wrote holds no tokenizer: token ids in (generate_ids), logits out
        self._tokenizer = GGUFTokenizer(f) if "tokenizer.ggml.model" in f.metadata else None
        self._stop_ids = self._tokenizer.stop_ids if self._tokenizer else set()
        self.weights, self.formats = load_weights(f, self.config)

    def _load_onnx(self, activation: str) -> None:
        """A decoder-with-past ONNX file (optimum's export): its past/present Concats become the same
        in-place caches (frontends/onnx/kv_cache.py); text through the tokenizer.json beside it, if any."""
        from tilegraph.frontends.onnx.kv_cache import OnnxDecoder

        if activation != "f32":
            raise TilegraphError(f"activation='{activation}' rounds the inputs of GGUF block-format matmuls; "
                                 f"{self.path.name} is an ONNX file of float weights")
        from tilegraph.frontends.onnx.folder_tokenizer import FolderTokenizer

        decoder = self._onnx = OnnxDecoder(self.path)
        self.config = decoder.config()  # type: ignore[assignment]  # LlamaConfig's names, what generation reads
        self._tokenizer = FolderTokenizer.beside(self.path)  # type: ignore[assignment]  # the GGUF one's interface
        self._stop_ids = self._tokenizer.stop_ids if self._tokenizer else set()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tilegraph.frontends.gguf.tokenizer import TokenizerError

            raise TokenizerError(f"{self.path} holds no tokenizer (tokenizer.ggml.* in a GGUF file, tokenizer.json "
                                 "beside an ONNX one): give token ids "
                                 "(LanguageModel.generate_ids)")
        return self._tokenizer

    def __repr__(self) -> str:
        c = self.config
        return (f"LanguageModel({self.path.name}: {c.arch}, {c.layers} layers, hidden {c.hidden}, {c.heads} heads / "
                f"{c.kv_heads} K/V heads, vocab {c.vocab}; cache {self.cache_len} positions)")

    # --- the two entry points -------------------------------------------------------------

    def entry(self, batch: int, kind: str, sampling: Sampling | None = None):
        """The compiled prefill ("prefill": T symbolic) or decode ("decode": T = 1) for `batch` sequences;
        with `sampling`, the step also draws the next tokens (inputs seen, u; result `next`)."""
        key = (batch, kind, sampling and tuple(sorted(sampling.attrs().items())))
        if key not in self._compiled:
            import tilegraph
            from tilegraph.frontends.gguf.llama import build

            steps = "T" if kind == "prefill" else 1
            attrs = None if sampling is None else sampling.attrs()
            if self._onnx is not None:
                model = self._onnx.build(batch, steps, self.cache_len, self.cache_dtype, attrs)
            else:
                model = build(self.config, self.weights, self.formats, batch, steps, self.cache_len,
                              self.activation, self.cache_dtype, attrs)
            options = {"threads": self.threads} if self.threads and self._target() == "c" else {}
            self._compiled[key] = tilegraph.compile(model, target=self._target(), pipeline=self.pipeline, **options)
        return self._compiled[key]

    def _target(self) -> str:
        if self.target is None:
            from tilegraph.backends import default_cpu_target

            self.target = default_cpu_target()
        return self.target

    def caches(self, batch: int) -> list[np.ndarray]:
        """The preallocated caches for `batch` sequences (k, v per layer), reused by every call."""
        if batch not in self._caches:
            c = self.config
            self._caches[batch] = [np.zeros((batch, c.kv_heads, self.cache_len, c.head_dim),
                                            np.float16 if self.cache_dtype == "f16" else np.float32)
                                   for _ in range(2 * c.layers)]
        return self._caches[batch]

    def forward(self, tokens: np.ndarray, pos: np.ndarray, last: np.ndarray, kind: str,
                sampling: Sampling | None = None, seen: np.ndarray | None = None,
                u: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """One call: (logits [B, vocab], the next tokens [B] if `sampling`, else None); the caches are
        updated (in place where the backend writes in place)."""
        batch = tokens.shape[0]
        caches = self.caches(batch)
        entry = self.entry(batch, kind, sampling)
        extra = [] if sampling is None else [seen, u]
        if self.threads and self._target() == "numpy":  # the C backend takes threads= at compile
            from threadpoolctl import threadpool_limits

            with threadpool_limits(limits=self.threads):
                outs = entry.run(tokens, pos, last, *caches, *extra)
        else:
            outs = entry.run(tokens, pos, last, *caches, *extra)
        for i, new in enumerate(outs[1:1 + len(caches)]):
            if new is not caches[i]:  # a backend that returned a copy: keep its result
                caches[i] = new
        return outs[0], (outs[-1] if sampling is not None else None)

    # --- generation -------------------------------------------------------------------

    def generate_ids(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                     sampling: Sampling = Sampling(), stop: bool = True,
                     on_logits=None) -> Iterator[tuple[int, int]]:
        """Yields (sequence, token id) as tokens are made; prompts are lists of token ids.
        `on_logits(step, logits)` sees every step's logits [B, vocab] (tests compare them)."""
        sampling.check()
        rows = [list(p) for p in prompts]
        if not rows or any(not p for p in rows):
            raise TilegraphError("generate needs at least one prompt, each of at least one token")
        batch, lengths = len(rows), [len(p) for p in rows]
        if max(lengths) + max_new_tokens > self.cache_len:
            raise TilegraphError(f"a prompt of {max(lengths)} tokens plus {max_new_tokens} new ones needs "
                                 f"{max(lengths) + max_new_tokens} cache positions; this model has {self.cache_len} "
                                 "(cache_len=)")
        vocab = self.config.vocab
        if any(not 0 <= t < vocab for p in rows for t in p):
            raise TilegraphError(f"a prompt token id is outside the vocabulary of {vocab}")
        rng = np.random.default_rng(sampling.seed)
        steps = max(lengths)
        pad = self._tokenizer.eos_id if self._tokenizer and self._tokenizer.eos_id is not None else 0
        tokens = np.array([p + [pad] * (steps - len(p)) for p in rows], np.int64)
        pos = np.zeros(batch, np.int64)
        last = np.array([b * steps + n - 1 for b, n in enumerate(lengths)], np.int64)
        seen = np.zeros((batch, vocab), np.uint8)  # which tokens each sequence has (the repetition penalty)
        for b, p in enumerate(rows):
            seen[b, p] = 1

        def draws() -> np.ndarray:  # one uniform number per sequence per step: the seeded randomness
            return rng.random(batch, dtype=np.float32)

        start = time.perf_counter()
        logits, ids = self.forward(tokens, pos, last, "prefill", sampling, seen, draws())
        self.stats.prompt_tokens += sum(lengths)
        self.stats.prompt_seconds += time.perf_counter() - start
        done = [False] * batch
        pos = np.array(lengths, np.int64)
        for step in range(max_new_tokens):
            start = time.perf_counter()
            if on_logits is not None:
                on_logits(step, logits)
            for b in range(batch):
                if done[b]:
                    continue
                seen[b, ids[b]] = 1
                self.stats.generated_tokens += 1
                yield b, int(ids[b])
                if stop and int(ids[b]) in self._stop_ids:
                    done[b] = True
            if all(done) or step == max_new_tokens - 1:
                self.stats.generate_seconds += time.perf_counter() - start
                break
            logits, ids = self.forward(ids.astype(np.int64).reshape(batch, 1), pos,
                                       np.arange(batch, dtype=np.int64), "decode", sampling, seen, draws())
            pos += 1
            self.stats.steps += 1
            self.stats.generate_seconds += time.perf_counter() - start

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 64, sampling: Sampling = Sampling(),
                 chat: bool = False, stop: bool = True) -> Iterator[Token]:
        """Streams Tokens for one prompt (a str) or several decoded together; `chat` wraps each
        prompt as a user message in the file's chat template."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if chat:
            texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        ids = [self.tokenizer.encode(t) for t in texts]
        made: list[list[int]] = [[] for _ in texts]
        shown = [""] * len(texts)
        for seq, token in self.generate_ids(ids, max_new_tokens, sampling, stop):
            made[seq].append(token)
            if stop and token in self.tokenizer.stop_ids:
                yield Token(seq, token, "")
                continue
            text = self.tokenizer.decode([t for t in made[seq] if t not in self.tokenizer.stop_ids])
            if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its next byte
                yield Token(seq, token, "")
                continue
            piece, shown[seq] = text[len(shown[seq]):], text
            yield Token(seq, token, piece)


def generate(model, prompt: str | Sequence[str], max_new_tokens: int = 64, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int | None = 0,
             chat: bool = False, stop: bool = True, target: str | None = None, threads: int | None = None,
             cache_len: int | None = None) -> Iterator[str] | Iterator[Token]:
    """Stream generated text: for one prompt (a str) the pieces of text; for a list of prompts,
    Token(seq, id, text) as each sequence makes them. `model` is a LanguageModel or a .gguf path."""
    lm = model if isinstance(model, LanguageModel) else LanguageModel(model, target=target, threads=threads,
                                                                     cache_len=cache_len)
    sampling = Sampling(temperature, top_k, top_p, repetition_penalty, seed)
    tokens = lm.generate(prompt, max_new_tokens, sampling, chat=chat, stop=stop)
    if isinstance(prompt, str):
        return (t.text for t in tokens if t.text)
    return tokens
