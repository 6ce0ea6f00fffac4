"""ONNX decoder files shaped as optimum exports them, made offline for tests and benchmarks: a
transformers Llama or GPT-2 from its config (random weights), exported with torch.onnx's
TorchScript exporter (optimum's) through a wrapper that takes the past K/V tensors explicitly.

Inputs `input_ids` [batch_size, sequence_length], `attention_mask` [batch_size,
total_sequence_length], `position_ids` [batch_size, sequence_length] and
`past_key_values.N.key/.value` [batch_size, Hkv, past_sequence_length, D]; outputs `logits`
[batch_size, sequence_length, vocab] and `present.N.key/.value` [batch_size, Hkv,
total_sequence_length, D], each present the Concat of its past and the new rows along axis 2.
`run_onnxruntime` is the peer's own loop: each step feeds the previous step's present as past.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

EAGER: dict[str, Any] = {"attn_implementation": "eager"}  # MatMul/Softmax attention, optimum's export
TINY = {"vocab": 256, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "positions": 256}


def make_model(arch: str = "llama", seed: int = 0, **sizes: Any):
    """A transformers causal LM of `arch` ('llama', 'gpt2') with random weights, eager attention, eval mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    s = {**TINY, **sizes}
    config: Any
    model: Any
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                             num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                             num_key_value_heads=s["kv_heads"], max_position_embeddings=s["positions"], **EAGER)
        model = LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=s["vocab"], n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                            n_positions=s["positions"], **EAGER)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(f"arch '{arch}': 'llama' or 'gpt2'")
    return model.eval()


def export_decoder(path: str | Path, arch: str = "llama", seed: int = 0, opset: int = 17, **sizes: Any):
    """Write the decoder-with-past ONNX file of make_model(arch, seed, **sizes) to `path`; returns the model."""
    import torch
    from transformers import DynamicCache

    model = make_model(arch, seed, **sizes)
    config = model.config
    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads

    class WithPast(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=self.lm.config)
            for i, layer in enumerate(cache.layers[:layers]):
                # the past as the layer's contents (not an update of an empty layer, which traces a
                # Concat of the past alone)
                layer.lazy_initialization(past[2 * i], past[2 * i + 1])
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=cache, use_cache=True)
            result = [out.logits]
            for layer in out.past_key_values.layers[:layers]:
                result += [layer.keys, layer.values]
            return tuple(result)

    batch, steps, past_len = 1, 3, 5
    ids = torch.randint(0, config.vocab_size, (batch, steps))
    mask = torch.ones(batch, past_len + steps, dtype=torch.int64)
    positions = torch.arange(past_len, past_len + steps)[None]
    past = [torch.randn(batch, kv_heads, past_len, head_dim) for _ in range(2 * layers)]
    kv = [f"{i}.{k}" for i in range(layers) for k in ("key", "value")]
    inputs = ["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{n}" for n in kv]
    outputs = ["logits"] + [f"present.{n}" for n in kv]
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
            "position_ids": {0: "batch_size", 1: "sequence_length"},
            "logits": {0: "batch_size", 1: "sequence_length"}}
    axes.update({f"past_key_values.{n}": {0: "batch_size", 2: "past_sequence_length"} for n in kv})
    axes.update({f"present.{n}": {0: "batch_size", 2: "total_sequence_length"} for n in kv})
    wrapper = WithPast(model).eval()
    import warnings

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's notes on transformers' Python-side checks
        torch.onnx.export(wrapper, (ids, mask, positions, *past), str(path), input_names=inputs,
                          output_names=outputs, dynamic_axes=axes, opset_version=opset, dynamo=False)
    return model.eval()


def run_onnxruntime(session, prompt: list[int], new_tokens: int, on_logits=None) -> list[int]:
    """Greedy generation with onnxruntime's own past/present loop over a decoder-with-past file:
    the prompt in one call from an empty past, then one token per call, each step's present fed
    back as the next step's past. `on_logits(step, logits [vocab])` sees each step's last logits."""
    inputs = {i.name: i for i in session.get_inputs()}
    past_names = [n for n in inputs if n.startswith("past_key_values.")]
    shape = inputs[past_names[0]].shape
    kv = {n: np.zeros((1, shape[1], 0, shape[3]), np.float32) for n in past_names}
    out_names = [o.name for o in session.get_outputs()]
    tokens, made = list(prompt), []
    ids = np.array([tokens], np.int64)
    for step in range(new_tokens):
        total = len(tokens)
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64),
                 "position_ids": np.arange(total - ids.shape[1], total, dtype=np.int64)[None], **kv}
        outs = dict(zip(out_names, session.run(None, {k: v for k, v in feeds.items() if k in inputs})))
        logits = outs["logits"][0, -1]
        if on_logits is not None:
            on_logits(step, logits)
        token = int(np.argmax(logits))
        made.append(token)
        tokens.append(token)
        kv = {n: outs["present." + n[len("past_key_values."):]] for n in past_names}
        ids = np.array([[token]], np.int64)
    return made


def byte_tokenizer(vocab: int):
    """A byte-level BPE tokenizer (transformers' PreTrainedTokenizerFast) of GPT-2's 256 byte tokens
    and no merges, ids past 256 unused: what a model from config with random weights reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tilegraph.testing.gguf_files import _byte_tokens

    if vocab < 256:
        raise ValueError(f"a byte-level vocabulary needs 256 ids, not {vocab}")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(_byte_tokens())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=_byte_tokens()[0])


def write_hf_folder(folder: str | Path, arch: str = "llama", seed: int = 0, **sizes: Any):
    """make_model(arch, seed, **sizes) saved as a transformers folder (config.json, safetensors, the
    byte tokenizer): what onnxruntime-genai's model builder reads. Returns the model."""
    model = make_model(arch, seed, **sizes)
    model.generation_config.eos_token_id = model.config.eos_token_id = 0
    model.save_pretrained(str(folder))
    byte_tokenizer(model.config.vocab_size).save_pretrained(str(folder))
    return model
