"""Models described by their configuration alone: planned from shapes, never materialised.

`from_config(config)` builds the tg model a transformers-style configuration describes
(a dict or a `transformers` config object): GPT-2's fields (`n_embd`, `n_layer`,
`n_head`, `vocab_size`) give `gpt`, Llama's (`hidden_size`, `intermediate_size`,
`num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `vocab_size`) give
`llama`. Weights are zero-strided views of one zero (`np.broadcast_to`): a 70B model
costs a few bytes per weight, and the `shard` pass, which reads only shapes and
dtypes, plans it on a laptop. `weights="random"` gives small normal values instead, so
that a small configuration runs (and the partitioned program can be checked).

Left out of `llama`, on purpose: rotary position embeddings (elementwise on Q and K,
under 1% of a layer's FLOPs and no weights); the planner's choices do not depend on them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tilegraph.ir.errors import TilegraphError

# RMSNorm's epsilon in Llama's configurations (rms_norm_eps).
RMS_EPS = 1e-5


class ConfigError(TilegraphError):
    """A configuration that names no model this module builds; the message lists the fields wanted."""


def _weights(g, kind: str, dtype: str, seed: int):
    from tilegraph.ir.dtypes import numpy_dtype

    np_dtype = numpy_dtype(dtype)
    rng = np.random.default_rng(seed)

    def w(name, *shape):
        if kind == "zeros":
            return g.weight(name, np.broadcast_to(np.zeros((), np_dtype), shape))
        return g.weight(name, (rng.standard_normal(shape) * 0.2).astype(np_dtype))

    return w


def gpt(layers: int, d_model: int, heads: int, batch="B", seq: int | str = "S", vocab: int | None = None,
        dtype: str = "bf16", weights: str = "zeros", seed: int = 0, mlp_only: bool = False,
        attention_only: bool = False):
    """A GPT-2-style pre-LN decoder as a tg model: per layer LN -> Q, K, V projections -> causal
    attention -> output projection -> residual, LN -> 4x MLP (gelu) -> residual. With `vocab`,
    token and position embeddings in front and a final LN + LM head behind; else the input is
    the hidden state x (batch, seq, d_model)."""
    from tilegraph.ir import Graph

    g = Graph()
    w = _weights(g, weights, dtype, seed)
    if vocab is not None:
        ids = g.input("ids", (batch, seq), "i64")
        x = g.embedding(w("wte", vocab, d_model), ids) + w("wpe", seq, d_model)
    else:
        x = g.input("x", (batch, seq, d_model), dtype)
    dh = d_model // heads

    def split_heads(t):
        return t.reshape(batch, seq, heads, dh).transpose(0, 2, 1, 3)

    for i in range(layers):
        p = f"h{i}."
        if not mlp_only:
            h = g.layer_norm(x, w(p + "ln1.g", d_model), w(p + "ln1.b", d_model))
            q, k, v = (split_heads(h @ w(p + f"attn.w{c}", d_model, d_model) + w(p + f"attn.b{c}", d_model))
                       for c in "qkv")
            a = g.attention(q, k, v, causal=True).transpose(0, 2, 1, 3).reshape(batch, seq, d_model)
            x = x + (a @ w(p + "attn.wo", d_model, d_model) + w(p + "attn.bo", d_model))
        if not attention_only:
            h = g.layer_norm(x, w(p + "ln2.g", d_model), w(p + "ln2.b", d_model))
            h = g.gelu(h @ w(p + "mlp.fc1", d_model, 4 * d_model) + w(p + "mlp.b1", 4 * d_model))
            x = x + (h @ w(p + "mlp.fc2", 4 * d_model, d_model) + w(p + "mlp.b2", d_model))
    if vocab is not None:
        x = g.layer_norm(x, w("ln_f.g", d_model), w("ln_f.b", d_model)) @ w("lm_head", d_model, vocab)
    return g.build(x, names=["logits" if vocab is not None else "hidden"])


def llama(layers: int, d_model: int, heads: int, ffn: int, kv_heads: int | None = None, vocab: int = 32000,
          batch="B", seq: int | str = "S", dtype: str = "bf16", weights: str = "zeros", seed: int = 0):
    """A Llama-style decoder: RMSNorm, grouped-query attention (`kv_heads` K/V heads, each shared by
    heads / kv_heads query heads), a SwiGLU MLP of width `ffn`, no biases, untied LM head."""
    from tilegraph.ir import Graph

    kv_heads = kv_heads or heads
    if heads % kv_heads or d_model % heads:
        raise ConfigError(f"llama: {heads} heads must divide hidden size {d_model} and be a multiple of "
                          f"{kv_heads} key/value heads")
    g = Graph()
    w = _weights(g, weights, dtype, seed)
    dh, group = d_model // heads, heads // kv_heads

    def rms(x, name):
        return x * g.rsqrt(g.mean(x * x, axes=[-1], keepdims=True) + RMS_EPS) * w(name, d_model)

    def heads_of(t, n):
        return t.reshape(batch, seq, n, dh).transpose(0, 2, 1, 3)

    def shared(t):  # [B, kv, S, dh] -> [B, heads, S, dh]: each K/V head serves `group` query heads
        if group == 1:
            return t
        t = g.broadcast(t.reshape(batch, kv_heads, 1, seq, dh), (batch, kv_heads, group, seq, dh))
        return t.reshape(batch, heads, seq, dh)

    ids = g.input("ids", (batch, seq), "i64")
    x = g.embedding(w("embed", vocab, d_model), ids)
    for i in range(layers):
        p = f"h{i}."
        h = rms(x, p + "attn_norm")
        q = heads_of(h @ w(p + "attn.wq", d_model, d_model), heads)
        k = shared(heads_of(h @ w(p + "attn.wk", d_model, kv_heads * dh), kv_heads))
        v = shared(heads_of(h @ w(p + "attn.wv", d_model, kv_heads * dh), kv_heads))
        a = g.attention(q, k, v, causal=True).transpose(0, 2, 1, 3).reshape(batch, seq, d_model)
        x = x + a @ w(p + "attn.wo", d_model, d_model)
        h = rms(x, p + "mlp_norm")
        gate = h @ w(p + "mlp.w1", d_model, ffn)
        x = x + (gate * g.sigmoid(gate) * (h @ w(p + "mlp.w3", d_model, ffn))) @ w(p + "mlp.w2", ffn, d_model)
    return g.build(rms(x, "norm") @ w("lm_head", d_model, vocab), names=["logits"])


def _field(config: Any, name: str):
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


# Named shapes `tilegraph shard --config NAME` plans: the published configurations' fields.
NAMED_CONFIGS: dict[str, dict[str, int]] = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000),  # Llama-2-7B's config.json
    "llama-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=40, vocab_size=32000),
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=32000),
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257),
    "gpt2-xl": dict(n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=50257),
}


def read_config(path) -> dict:
    """A config.json as a dict; a ConfigError naming the file for anything that is not one
    (a missing file, bytes that are not UTF-8 JSON, JSON that is not an object)."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file, and not a named shape ({', '.join(NAMED_CONFIGS)})")
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path} is not a JSON configuration: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object of configuration fields")
    return config


def from_config(config: Any, batch="B", seq: int | str | None = None, dtype: str = "bf16",
                weights: str = "zeros"):
    """The model a GPT-2 or Llama configuration describes (see the module docstring); `seq` defaults
    to the configuration's context length for GPT-2 (its learned positions need one) and to the
    symbol S for Llama."""
    f = lambda name: _field(config, name)  # noqa: E731
    try:
        if f("n_embd") is not None:
            return gpt(int(f("n_layer")), int(f("n_embd")), int(f("n_head")), batch=batch,
                       seq=seq if seq is not None else int(f("n_positions")), vocab=int(f("vocab_size")),
                       dtype=dtype, weights=weights)
        if f("intermediate_size") is not None:
            return llama(int(f("num_hidden_layers")), int(f("hidden_size")), int(f("num_attention_heads")),
                         int(f("intermediate_size")), int(f("num_key_value_heads") or f("num_attention_heads")),
                         int(f("vocab_size")), batch=batch, seq="S" if seq is None else seq, dtype=dtype,
                         weights=weights)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the configuration has a missing or non-integer field: {e}") from None
    raise ConfigError("the configuration describes neither GPT-2 (n_embd, n_layer, n_head, n_positions, "
                      "vocab_size) nor Llama (hidden_size, intermediate_size, num_hidden_layers, "
                      "num_attention_heads, num_key_value_heads, vocab_size)")
