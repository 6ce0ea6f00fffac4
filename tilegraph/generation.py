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

Sampling (greedy, temperature, top-k, top-p, repetition penalty, a seed) runs on the host
on each step's logits [B, vocab].
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from tilegraph.ir.errors import TilegraphError

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


def sample(logits: np.ndarray, seen: Sequence[Sequence[int]], s: Sampling, rng: np.random.Generator) -> np.ndarray:
    """One token per row of logits [B, vocab]."""
    logits = np.array(logits, dtype=np.float64)
    if s.repetition_penalty != 1.0:
        for b, ids in enumerate(seen):
            u = np.unique(np.asarray(ids, np.int64))
            u = u[(u >= 0) & (u < logits.shape[1])]
            v = logits[b, u]
            logits[b, u] = np.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
    if s.temperature == 0:
        return logits.argmax(axis=-1)
    logits /= s.temperature
    if s.top_k and s.top_k < logits.shape[1]:
        kth = np.partition(logits, -s.top_k, axis=-1)[:, -s.top_k][:, None]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if s.top_p < 1.0:
        order = np.argsort(-probs, axis=-1)
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < s.top_p  # the smallest set reaching top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(probs.shape[1], p=p) for p in probs])


class LanguageModel:
    """A GGUF language model compiled for `target`: prefill and decode entry points per batch
    size, sharing one weight store, and their caches."""

    def __init__(self, path: str | Path, target: str | None = None, cache_len: int | None = None,
                 threads: int | None = None, pipeline=None, activation: str = "f32"):
        from tilegraph.frontends.gguf.llama import LlamaConfig, load_weights
        from tilegraph.frontends.gguf.reader import GGUFFile
        from tilegraph.frontends.gguf.tokenizer import GGUFTokenizer

        self.path = Path(path)
        f = GGUFFile(self.path)
        self.config = LlamaConfig.of(f)
        # a file tilegraph quantize wrote holds no tokenizer: token ids in (generate_ids), logits out
        self._tokenizer = GGUFTokenizer(f) if "tokenizer.ggml.model" in f.metadata else None
        self._stop_ids = self._tokenizer.stop_ids if self._tokenizer else set()
        self.weights, self.formats = load_weights(f, self.config)
        self.cache_len = min(cache_len or DEFAULT_CACHE_LEN, self.config.context)
        self.target, self.threads, self.pipeline = target, threads, pipeline
        # 'f32': block-format matmuls multiply the float activations (exact, as transformers on the
        # dequantized weights); 'q8': activations rounded to int8 per 32 first, as llama.cpp does,
        # which the C backend runs as integer dot products
        self.activation = activation
        self._compiled: dict[tuple[int, str], object] = {}
        self._caches: dict[int, list[np.ndarray]] = {}
        self.stats = Stats()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tilegraph.frontends.gguf.tokenizer import TokenizerError

            raise TokenizerError(f"{self.path} holds no tokenizer (tokenizer.ggml.*): give token ids "
                                 "(LanguageModel.generate_ids)")
        return self._tokenizer

    def __repr__(self) -> str:
        c = self.config
        return (f"LanguageModel({self.path.name}: {c.arch}, {c.layers} layers, hidden {c.hidden}, {c.heads} heads / "
                f"{c.kv_heads} K/V heads, vocab {c.vocab}; cache {self.cache_len} positions)")

    # --- the two entry points -------------------------------------------------------------

    def entry(self, batch: int, kind: str):
        """The compiled prefill ("prefill": T symbolic) or decode ("decode": T = 1) for `batch` sequences."""
        key = (batch, kind)
        if key not in self._compiled:
            import tilegraph
            from tilegraph.frontends.gguf.llama import build

            model = build(self.config, self.weights, self.formats, batch, "T" if kind == "prefill" else 1,
                          self.cache_len, self.activation)
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
            self._caches[batch] = [np.zeros((batch, c.kv_heads, self.cache_len, c.head_dim), np.float32)
                                   for _ in range(2 * c.layers)]
        return self._caches[batch]

    def forward(self, tokens: np.ndarray, pos: np.ndarray, last: np.ndarray, kind: str) -> np.ndarray:
        """One call: logits [B, vocab]; the caches are updated (in place where the backend writes in place)."""
        batch = tokens.shape[0]
        caches = self.caches(batch)
        entry = self.entry(batch, kind)
        if self.threads and self._target() == "numpy":  # the C backend takes threads= at compile
            from threadpoolctl import threadpool_limits

            with threadpool_limits(limits=self.threads):
                outs = entry.run(tokens, pos, last, *caches)
        else:
            outs = entry.run(tokens, pos, last, *caches)
        for i, new in enumerate(outs[1:]):
            if new is not caches[i]:  # a backend that returned a copy: keep its result
                caches[i] = new
        return outs[0]

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
        start = time.perf_counter()
        logits = self.forward(tokens, pos, last, "prefill")
        self.stats.prompt_tokens += sum(lengths)
        self.stats.prompt_seconds += time.perf_counter() - start
        seen = [list(p) for p in rows]
        done = [False] * batch
        pos = np.array(lengths, np.int64)
        for step in range(max_new_tokens):
            start = time.perf_counter()
            if on_logits is not None:
                on_logits(step, logits)
            ids = sample(logits, seen, sampling, rng)
            for b in range(batch):
                if done[b]:
                    continue
                seen[b].append(int(ids[b]))
                self.stats.generated_tokens += 1
                yield b, int(ids[b])
                if stop and int(ids[b]) in self._stop_ids:
                    done[b] = True
            if all(done) or step == max_new_tokens - 1:
                self.stats.generate_seconds += time.perf_counter() - start
                break
            logits = self.forward(ids.astype(np.int64).reshape(batch, 1), pos, np.arange(batch, dtype=np.int64),
                                  "decode")
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
