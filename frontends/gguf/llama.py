"""The Llama family (llama, qwen2, qwen3, gemma3) from a GGUF file, as tg IR with a KV cache.

One builder makes both entry points of a compiled model:
prefill (T = the prompt's length, a symbol) and decode (T = 1), over the same weight store
and the same caches. Inputs: `tokens` i64[B, T], `pos` i64[B] (where each sequence's T new
tokens go in the cache), `last` i64[B] (which of the B*T positions each sequence's logits
come from: its last real token), then each layer's `k_cache.i` and `v_cache.i`
f32 (or f16) [B, Hkv, S, D], donated: results 1.. are the same buffers, written in place by
tg.cache_write. Result 0: logits f32[B, vocab].

Weights stay in their block formats (ui8 rows read by tg.block_matmul / tg.block_gather);
only the small 1-D tensors (norms, biases) are widened to f32. llama.cpp's converter
interleaves the two rotary halves of each Q/K head for the `llama` architecture
(convert_hf_to_gguf.py, LlamaModel.permute); the builder puts the byte rows back into
transformers' order once, so every architecture uses one rotary layout (tg.rope's halves).

gemma3 differs from llama as llama.cpp's `llm_build_gemma3` and transformers' Gemma3TextModel:
the embedding scaled by sqrt(hidden); RMSNorm after attention and after the MLP too
(post_attention_norm, post_ffw_norm) besides before; a per-head RMSNorm of Q and K; a
GELU (tanh) gated MLP; attention scaled by 1/sqrt(head_dim); and five of every six layers
local: a sliding window (tg.cache_attention's window) with their own rotary base (10000),
every sixth global with the file's base. Gemma's RMSNorm multiplies by (1 + w); llama.cpp's
converter stores 1 + w in the file (transformers subtracts 1 again on load), so the norms
here multiply by the stored weight as every other architecture's do. Neither the window
pattern nor the local base is in the file's metadata: llama.cpp fixes them for gemma3
(LLM_ARCH_GEMMA3: set_swa_pattern(6), rope_freq_base_train_swa = 10000), as here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tilegraph.frontends.gguf.reader import GGUFArchitectureError, GGUFFile, GGUFMetadataError
from tilegraph.ir import Graph
from tilegraph.ir.model import Model, WeightStore
from tilegraph.ir.shapes import TensorInfo

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
GEMMA3_SWA_PATTERN = 6  # every sixth layer global, the rest local (llama.cpp's LLM_ARCH_GEMMA3)
GEMMA3_LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class LlamaConfig:
    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_base: float
    eps: float
    qkv_bias: bool  # qwen2
    qk_norm: bool  # qwen3, gemma3
    window: int = 0  # gemma3's sliding window of its local layers (0: every layer global)
    local_rope_base: float = 0.0  # the local layers' rotary base

    @property
    def gemma(self) -> bool:
        return self.arch == "gemma3"

    def local(self, layer: int) -> bool:
        """Whether `layer` attends over a sliding window (gemma3's five local layers of six)."""
        return self.window > 0 and (layer + 1) % GEMMA3_SWA_PATTERN != 0

    @classmethod
    def of(cls, f: GGUFFile) -> "LlamaConfig":
        arch = f.get("general.architecture", str)
        if arch not in ARCHITECTURES:
            raise GGUFArchitectureError(f"{f.path}: architecture '{arch}' is not one the GGUF frontend builds "
                                        f"({', '.join(ARCHITECTURES)})")

        def key(name, kind=int, default=...):
            return f.get(f"{arch}.{name}", kind, default)

        hidden, heads = key("embedding_length"), key("attention.head_count")
        head_dim = key("attention.key_length", int, hidden // heads if heads else 0)
        vocab = f.tensor("token_embd.weight").shape[0]
        config = cls(arch, key("block_count"), hidden, key("feed_forward_length"), heads,
                     key("attention.head_count_kv", int, heads), head_dim, vocab, key("context_length"),
                     key("rope.freq_base", float, 10000.0), key("attention.layer_norm_rms_epsilon", float),
                     "blk.0.attn_q.bias" in f.tensors, "blk.0.attn_q_norm.weight" in f.tensors,
                     key("attention.sliding_window", int, 0) if arch == "gemma3" else 0,
                     GEMMA3_LOCAL_ROPE_BASE)
        if arch == "gemma3" and not 0 <= config.window < 1 << 20:
            raise GGUFMetadataError(f"{f.path}: gemma3.attention.sliding_window = {config.window} is out of range")
        for name, value in (("block_count", config.layers), ("embedding_length", hidden), ("head_count", heads),
                            ("head_count_kv", config.kv_heads), ("key_length", head_dim),
                            ("feed_forward_length", config.ffn), ("context_length", config.context)):
            if not 0 < value < 1 << 20:
                raise GGUFMetadataError(f"{f.path}: {arch}.{name} = {value} is out of range")
        if heads % config.kv_heads or head_dim % 2:
            raise GGUFMetadataError(f"{f.path}: {heads} heads over {config.kv_heads} K/V heads of dim {head_dim}: "
                                    "heads must be a multiple of K/V heads, the head dim even")
        rope_dims = f.get(f"{arch}.rope.dimension_count", int, head_dim)
        if rope_dims != head_dim or f.get(f"{arch}.rope.scaling.type", str, "none") not in ("none", "linear") \
                or f.get(f"{arch}.rope.scaling.factor", float, 1.0) != 1.0:
            raise GGUFMetadataError(f"{f.path}: partial or scaled rotary embeddings are not supported yet")
        return config


def load_weights(f: GGUFFile, c: LlamaConfig) -> tuple[WeightStore, dict[str, str]]:
    """The weight store: block-format rows as views of the file's map (Q/K of `llama` rows reordered),
    norms and biases as f32, the rotary tables for the model's context length; and the block format
    of each block-format weight."""
    w = WeightStore()
    q_dim, kv_dim = c.heads * c.head_dim, c.kv_heads * c.head_dim

    def matrix(name, rows, k, heads_to_unpermute=0):
        t = f.tensor(name, (rows, k))
        raw = t.raw
        if heads_to_unpermute:
            # GGUF row 2i + half of a head is transformers' row half * D/2 + i
            raw = np.ascontiguousarray(raw.reshape(heads_to_unpermute, c.head_dim // 2, 2, -1).swapaxes(1, 2)
                                       ).reshape(raw.shape)
        w[name] = raw
        return t.format.name

    def vector(name, n):
        w[name] = f.tensor(name, (n,)).dequantize()

    formats = {"token_embd.weight": matrix("token_embd.weight", c.vocab, c.hidden)}
    if "output.weight" in f.tensors:
        formats["output.weight"] = matrix("output.weight", c.vocab, c.hidden)
    vector("output_norm.weight", c.hidden)
    unpermute = c.arch == "llama"
    for i in range(c.layers):
        p = f"blk.{i}."
        formats[p + "attn_q.weight"] = matrix(p + "attn_q.weight", q_dim, c.hidden, c.heads if unpermute else 0)
        formats[p + "attn_k.weight"] = matrix(p + "attn_k.weight", kv_dim, c.hidden, c.kv_heads if unpermute else 0)
        formats[p + "attn_v.weight"] = matrix(p + "attn_v.weight", kv_dim, c.hidden)
        formats[p + "attn_output.weight"] = matrix(p + "attn_output.weight", c.hidden, q_dim)
        formats[p + "ffn_gate.weight"] = matrix(p + "ffn_gate.weight", c.ffn, c.hidden)
        formats[p + "ffn_up.weight"] = matrix(p + "ffn_up.weight", c.ffn, c.hidden)
        formats[p + "ffn_down.weight"] = matrix(p + "ffn_down.weight", c.hidden, c.ffn)
        vector(p + "attn_norm.weight", c.hidden)
        vector(p + "ffn_norm.weight", c.hidden)
        if c.qkv_bias:
            for n, size in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                vector(p + f"attn_{n}.bias", size)
        if c.qk_norm:
            vector(p + "attn_q_norm.weight", c.head_dim)
            vector(p + "attn_k_norm.weight", c.head_dim)
        if c.gemma:
            vector(p + "post_attention_norm.weight", c.hidden)
            vector(p + "post_ffw_norm.weight", c.hidden)
    for table, base in (("rope", c.rope_base), ("rope_local", c.local_rope_base if c.window else 0.0)):
        if base:
            inv = 1.0 / (base ** (np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim))
            angles = np.arange(c.context, dtype=np.float64)[:, None] * inv[None, :]
            w[f"{table}.cos"] = np.cos(angles).astype(np.float32)
            w[f"{table}.sin"] = np.sin(angles).astype(np.float32)
    return w, formats


def build(c: LlamaConfig, weights: WeightStore, formats: dict[str, str], batch: int, steps, cache_len: int,
          activation: str = "f32", cache_dtype: str = "f32", sampling: dict | None = None) -> Model:
    """The model for `batch` sequences of `steps` new tokens (an int, or a symbol name for prefill)
    over caches of `cache_len` positions; `formats`: load_weights' block format of each weight.
    activation='q8': every block-format matmul first rounds its input to int8 per 32 values
    (tg.block_matmul's activation, ggml's numerics), what the C backend's integer kernels take;
    'f32' multiplies the float activations as they are. cache_dtype='f16': the K/V caches hold f16
    (llama.cpp's default, half the bytes a decode step reads at depth), each new row rounded in.
    sampling (tg.sample's attributes): the step also draws each sequence's next token, from inputs
    `seen` ui8[B, vocab] (tokens so far, for the repetition penalty) and `u` f32[B] (uniform draws);
    it is the last result, `next` i64[B]."""
    g = Graph(weights)
    B, T, S, D = batch, steps, cache_len, c.head_dim
    tokens = g.input("tokens", (B, T), "i64")
    pos = g.input("pos", (B,), "i64")
    last = g.input("last", (B,), "i64")
    caches = [(g.input(f"k_cache.{i}", (B, c.kv_heads, S, D), cache_dtype),
               g.input(f"v_cache.{i}", (B, c.kv_heads, S, D), cache_dtype)) for i in range(c.layers)]
    store = {} if cache_dtype == "f32" else {"store": cache_dtype}

    def weight(name):
        array = weights[name]
        return g.op("weight", name=name, result=TensorInfo(tuple(array.shape), "ui8" if array.dtype == np.uint8
                                                           else "f32"))

    def linear(x, name, k, bias=None):
        y = g.op("block_matmul", x, weight(name), format=formats[name], k=k, activation=activation)
        return y if bias is None else y + weight(bias)

    def heads(x, n):  # [B, T, n*D] -> [B, n, T, D]
        return g.transpose(g.reshape(x, (B, T, n, D)), (0, 2, 1, 3))

    # positions pos_b + t of the new tokens, and their rotary angles [B, 1, T, D/2]
    where = g.op("add", g.reshape(pos, (B, 1)), g.op("iota", result=TensorInfo((1, T), "i64"), axis=1))

    def rotary(table):
        return (g.reshape(g.gather(weight(f"{table}.cos"), where), (B, 1, T, D // 2)),
                g.reshape(g.gather(weight(f"{table}.sin"), where), (B, 1, T, D // 2)))
    angles = {"rope": rotary("rope")}
    if c.window:
        angles["rope_local"] = rotary("rope_local")
    h = g.op("block_gather", weight("token_embd.weight"), tokens, format=formats["token_embd.weight"], k=c.hidden)
    if c.gemma:
        h = h * float(np.sqrt(c.hidden))

    def norm(x, name):
        return g.op("rms_norm", x, weight(name), epsilon=c.eps)
    new_caches = []
    for i, (kc, vc) in enumerate(caches):
        p = f"blk.{i}."
        local = c.local(i)
        cos, sin = angles["rope_local" if local else "rope"]
        a = norm(h, p + "attn_norm.weight")
        bias = {n: p + f"attn_{n}.bias" if c.qkv_bias else None for n in "qkv"}
        q = heads(linear(a, p + "attn_q.weight", c.hidden, bias["q"]), c.heads)
        k = heads(linear(a, p + "attn_k.weight", c.hidden, bias["k"]), c.kv_heads)
        v = heads(linear(a, p + "attn_v.weight", c.hidden, bias["v"]), c.kv_heads)
        if c.qk_norm:
            q, k = norm(q, p + "attn_q_norm.weight"), norm(k, p + "attn_k_norm.weight")
        q, k = g.op("rope", q, cos, sin), g.op("rope", k, cos, sin)
        kc, vc = g.op("cache_write", kc, k, pos, **store), g.op("cache_write", vc, v, pos, **store)
        new_caches += [kc, vc]
        o = g.op("cache_attention", q, kc, vc, pos, scale=1.0 / float(np.sqrt(D)), window=c.window if local else 0)
        o = linear(g.reshape(g.transpose(o, (0, 2, 1, 3)), (B, T, c.heads * D)), p + "attn_output.weight",
                   c.heads * D)
        h = h + (norm(o, p + "post_attention_norm.weight") if c.gemma else o)
        f = norm(h, p + "ffn_norm.weight")
        gate = linear(f, p + "ffn_gate.weight", c.hidden)
        up = linear(f, p + "ffn_up.weight", c.hidden)
        act = g.op("gelu", gate, approximate="tanh") if c.gemma else gate * g.op("sigmoid", gate)
        f = linear(act * up, p + "ffn_down.weight", c.ffn)
        h = h + (norm(f, p + "post_ffw_norm.weight") if c.gemma else f)
    h = norm(h, "output_norm.weight")
    h = g.gather(g.reshape(h, (-1, c.hidden)), last)  # [B, hidden]: each sequence's last real token
    head = "output.weight" if "output.weight" in formats else "token_embd.weight"  # tied embeddings
    logits = linear(h, head, c.hidden)
    names = ["logits"] + [f"{kind}_cache.{i}.out" for i in range(c.layers) for kind in ("k", "v")]
    aliases = {f"{kind}_cache.{i}": f"{kind}_cache.{i}.out" for i in range(c.layers) for kind in ("k", "v")}
    if sampling is None:
        return g.build(logits, *new_caches, names=names, aliases=aliases)
    seen, u = g.input("seen", (B, c.vocab), "ui8"), g.input("u", (B,))
    chosen = g.op("sample", logits, seen, u, **sampling)
    return g.build(logits, *new_caches, chosen, names=names + ["next"], aliases=aliases)
