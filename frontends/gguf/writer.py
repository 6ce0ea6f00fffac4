"""A transformers decoder (Llama, Qwen2, Qwen3) written as a GGUF file, its matrices in
a block format (`tilegraph quantize model_dir -o model.gguf --block-format q4_0`).

The file is what llama.cpp's convert_hf_to_gguf.py writes for these architectures: its tensor
names, its metadata keys, and, for `llama`, Q and K rows of each head interleaved (its
LlamaModel.permute, which the reader undoes), so tilegraph (`tilegraph.compile("x.gguf")`)
and llama.cpp read the same file. Matrices take the format asked for (block_formats' reference
quantization); a matrix whose rows are not whole blocks of it falls back to q8_0 (32-value
blocks) or f32, as llama.cpp's quantizer falls back; norms and biases stay f32. The file holds
the model alone, no tokenizer: token ids in, logits out (LanguageModel.generate_ids).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from tilegraph.frontends.gguf.reader import GGUFArchitectureError, GGUFError
from tilegraph.ir.block_formats import FORMATS, block_format

# transformers' architecture -> the GGUF architecture it is written as
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
FALLBACKS = ("q8_0", "f32")  # for rows that are not whole blocks of the format asked for


class GGUFWriteError(GGUFError):
    """A model that cannot be written as a GGUF file (an architecture, tensor or setting it has no place for)."""


def _config_value(config: Mapping, *names, default=...):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if default is ...:
        raise GGUFWriteError(f"the model's config has no {' / '.join(names)}")
    return default


def _rope(config: Mapping) -> float:
    """The rotary base; scaled or partial rotary embeddings are refused (the reader builds plain RoPE)."""
    for key in ("rope_scaling", "rope_parameters"):  # transformers 4's name and 5's
        params = config.get(key) or {}
        kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, Mapping) else "default"
        if kind not in ("default", None):
            raise GGUFWriteError(f"rotary scaling '{kind}' has no place in the files tilegraph writes")
    params = config.get("rope_parameters") or {}
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise GGUFWriteError("partial rotary embeddings have no place in the files tilegraph writes")
    return float(params.get("rope_theta") if isinstance(params, Mapping) and params.get("rope_theta") is not None
                 else _config_value(config, "rope_theta", default=10000.0))


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: str | Path, config: Mapping, state: Mapping[str, np.ndarray], fmt: str = "q8_0"
               ) -> dict[str, str]:
    """Write `state` (transformers' parameter names -> float arrays) of a model with `config`
    (its config.json as a dict) to `path`; returns each GGUF tensor's format."""
    import gguf

    block_format(fmt)  # a BlockFormatError names the formats
    archs = config.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise GGUFArchitectureError(f"architecture {archs or 'unnamed'} is not one tilegraph writes as GGUF "
                                    f"({', '.join(ARCHITECTURES)})")
    layers = int(_config_value(config, "num_hidden_layers"))
    hidden = int(_config_value(config, "hidden_size"))
    heads = int(_config_value(config, "num_attention_heads"))
    kv_heads = int(_config_value(config, "num_key_value_heads", default=heads))
    head_dim = int(_config_value(config, "head_dim", default=hidden // heads))
    if config.get("attention_bias") and arch == "llama":
        raise GGUFWriteError("a llama model with attention biases has no place in the files tilegraph writes")
    if config.get("use_sliding_window"):
        raise GGUFWriteError("a sliding window has no place in the qwen2 files tilegraph writes")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(str(config.get("_name_or_path") or arch))
    w.add_block_count(layers)
    w.add_context_length(int(_config_value(config, "max_position_embeddings")))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(int(_config_value(config, "intermediate_size")))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(_rope(config))
    w.add_layer_norm_rms_eps(float(_config_value(config, "rms_norm_eps")))
    w.add_file_type(FORMATS[fmt].ggml_type)
    vocab = int(np.shape(state["model.embed_tokens.weight"])[0]) if "model.embed_tokens.weight" in state else 0
    w.add_vocab_size(vocab)  # no tokenizer to count: readers (transformers) take the vocabulary's size from here
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                 "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for i in range(layers):
        names.update({f"model.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in per_layer.items()})
    tied = config.get("tie_word_embeddings", False)
    unknown = [n for n in state if n not in names and not n.endswith("rotary_emb.inv_freq")]
    if unknown:
        raise GGUFWriteError(f"parameters with no place in a {arch} GGUF file: {', '.join(sorted(unknown)[:5])}")
    formats: dict[str, str] = {}
    for name, target in names.items():
        if name not in state or (name == "lm_head.weight" and tied):
            continue
        x = np.asarray(state[name], np.float32)
        if arch == "llama" and target.endswith(("attn_q.weight", "attn_k.weight")):
            x = _permute(x, heads if "attn_q" in target else kv_heads)
        if x.ndim == 1:
            w.add_tensor(target, np.ascontiguousarray(x))
            formats[target] = "f32"
            continue
        chosen = next(f for f in (fmt, *FALLBACKS) if x.shape[-1] % FORMATS[f].block == 0)
        raw = FORMATS[chosen].quantize(x)
        w.add_tensor(target, raw, raw_dtype=gguf.GGMLQuantizationType(FORMATS[chosen].ggml_type))
        formats[target] = chosen
    if "token_embd.weight" not in formats:
        raise GGUFWriteError("the model has no model.embed_tokens.weight")
    if vocab and not tied and "output.weight" not in formats:
        raise GGUFWriteError("the model's embeddings are not tied, and it has no lm_head.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return formats
