"""ONNX decoder files shaped as optimum exports them, made offline for tests and benchmarks: a
transformers Llama or GPT-2 from its config (random weights), exported with torch.onnx's
TorchScript exporter (optimum's) through a wrapper that takes the past K/V tensors explicitly.

Inputs `input_ids` [batch_size, sequence_length], `attention_mask` [batch_size,
total_sequence_length], `position_ids` [batch_size, sequence_length] and
`past_key_values.N.key/.value` [batch_size, Hkv, past_sequence_length, D]; outputs `logits`
[batch_size, sequence_length, vocab] and `present.N.key/.value` [batch_size, Hkv,
total_sequence_length, D], each present the Concat of its past and the new rows along axis 2.
`run_onnxruntime` is the peer's own loop: each step feeds the previous step's present as past.
`export_onnx` is the exporter wrapper every test and benchmark writes its ONNX files with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

EAGER: dict[str, Any] = {"attn_implementation": "eager"}  # MatMul/Softmax attention, optimum's export
TINY = {"vocab": 256, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "positions": 256}


def export_onnx(module, inputs, path: str | Path, input_names, output_names, dynamic_axes=None,
                opset: int = 17) -> Path:
    """`module(*inputs)` as a self-contained ONNX file at `path`, by the legacy TorchScript exporter
    (`dynamo=False`, deprecated but present in torch 2.13): plain opset ops, the weights as
    initializers in the one file, constants folded. `dynamic_axes`: {name: {axis: "dim_name"}}."""
    import warnings

    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's notes on Python-side checks, the exporter's deprecation
        torch.onnx.export(module.eval(), inputs, str(path), input_names=list(input_names),
                          output_names=list(output_names), dynamic_axes=dynamic_axes, opset_version=opset,
                          do_constant_folding=True, dynamo=False)
    return path


def make_model(arch: str = "llama", seed: int = 0, **sizes: Any):
    """A transformers causal LM of `arch` ('llama', 'gpt2', 'mpt': ALiBi) with random weights, eager
    attention, eval mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MptConfig, MptForCausalLM

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
    elif arch == "mpt":
        config = MptConfig(vocab_size=s["vocab"], d_model=s["hidden"], n_layers=s["layers"], n_heads=s["heads"],
                           max_seq_len=s["positions"], expansion_ratio=s["ffn"] // s["hidden"], **EAGER)
        model = MptForCausalLM(config)
    else:
        raise ValueError(f"arch '{arch}': 'llama', 'gpt2' or 'mpt'")
    return model.eval()


def alibi_slopes(heads: int):
    """ALiBi's per-head slopes (BLOOM's and MPT's, for a power-of-two head count): 2^(-8 h / heads)."""
    return 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)


def export_decoder(path: str | Path, arch: str = "llama", seed: int = 0, opset: int = 17, alibi: bool = False,
                   dynamo: bool = False, **sizes: Any):
    """Write the decoder-with-past ONNX file of make_model(arch, seed, **sizes) to `path`; returns the model.
    `alibi`: the file adds an ALiBi position bias (slope_h x key position, per head) to the causal
    mask, as BLOOM and MPT do: the wrapper builds the 4D float mask [B, H, T, S] the model adds to
    its scores (transformers takes a 4D mask as it is). `dynamo`: SDPA attention exported by torch's
    dynamo exporter (needs onnxscript): at opset >= 23 ONNX Attention (a boolean mask) and
    RotaryEmbedding / RMSNormalization nodes; below, SDPA written out in plain ops."""
    import torch
    from transformers import DynamicCache

    model = make_model(arch, seed, **sizes)
    config = model.config
    if dynamo:
        config._attn_implementation = "sdpa"
    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads

    class WithPast(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask, position_ids, *past):
            if alibi:
                attention_mask = self.alibi_mask(attention_mask, input_ids.shape[1])
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

        def alibi_mask(self, attention_mask, steps):
            total = attention_mask.shape[1]
            keys = torch.arange(total)
            queries = keys[total - steps:]  # the new rows' positions: the last `steps` of the total
            allowed = (keys[None, :] <= queries[:, None])[None, None] & attention_mask[:, None, None, :].bool()
            causal = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
            slopes = torch.tensor(alibi_slopes(config.num_attention_heads), dtype=torch.float32)
            return causal + slopes[None, :, None, None] * keys.float()[None, None, None, :]

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
    if not dynamo:
        export_onnx(wrapper, (ids, mask, positions, *past), path, inputs, outputs, axes, opset)
        return model.eval()
    import warnings

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's notes on transformers' Python-side checks
        b, t, p, s = (torch.export.Dim(n) for n in ("batch", "sequence", "past", "total"))
        shapes = {"input_ids": {0: b, 1: t}, "attention_mask": {0: b, 1: s}, "position_ids": {0: b, 1: t},
                  "past": tuple({0: b, 2: p} for _ in kv)}
        torch.onnx.export(wrapper, (ids, mask, positions, *past), str(path), input_names=inputs,
                          output_names=outputs, dynamic_shapes=shapes, opset_version=opset, dynamo=True)
    return model.eval()


def run_onnxruntime(session, prompt: list[int], new_tokens: int, on_logits=None,
                    head_dim: int | None = None) -> list[int]:
    """Greedy generation with onnxruntime's own past/present loop over a decoder-with-past file:
    the prompt in one call from an empty past, then one token per call, each step's present fed
    back as the next step's past. `on_logits(step, logits [vocab])` sees each step's last logits;
    `head_dim` where the file's past leaves it a symbol (onnxruntime-genai's kv_cache_dim)."""
    inputs = {i.name: i for i in session.get_inputs()}
    past_names = [n for n in inputs if n.startswith("past_key_values.")]
    shape = inputs[past_names[0]].shape
    kv = {n: np.zeros((1, shape[1], 0, head_dim or shape[3]), np.float32) for n in past_names}
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


def write_gqa_decoder(path: str | Path, seed: int = 0, vocab: int = 64, hidden: int = 64, heads: int = 4,
                      kv_heads: int = 2, layers: int = 2, positions: int = 64, local_window: int = -1) -> None:
    """A decoder-with-past file in onnxruntime-genai's builder's form, written with onnx.helper:
    com.microsoft GroupQueryAttention on packed QKV with its rotary embedding (cos/sin tables),
    seqlens_k and total_sequence_length derived from attention_mask, RMSNorms as
    SimplifiedLayerNormalization / com.microsoft.SkipSimplifiedLayerNormalization (residual in
    output 3), past `past_key_values.N.key/.value` [batch, kv_heads, past, kv_cache_dim].
    `local_window` >= 0: the attention's local_window_size (Mistral's sliding window as the builder writes it)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    d = hidden // heads
    inits, nodes = [], []

    def weight(name, *shape, scale=0.2):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    angles = np.arange(positions)[:, None] * inv[None, :]
    inits += [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
              numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache")]
    nodes += [helper.make_node("ReduceSum", ["attention_mask", const("one_axis", np.array([1], np.int64))],
                               ["mask_sum"], keepdims=0),
              helper.make_node("Sub", ["mask_sum", const("one", np.array(1, np.int64))], ["seqlens64"]),
              helper.make_node("Cast", ["seqlens64"], ["seqlens_k"], to=TensorProto.INT32),
              helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
              helper.make_node("Gather", ["mask_shape", const("one_index", np.array(1, np.int64))], ["total64"]),
              helper.make_node("Cast", ["total64"], ["total_len"], to=TensorProto.INT32),
              helper.make_node("Gather", [weight("embed", vocab, hidden, scale=1.0), "input_ids"], ["h0"])]
    h, residual = "h0", ""  # no residual before the first norm
    for i in range(layers):
        p = f"l{i}."
        if not residual:
            nodes.append(helper.make_node("SimplifiedLayerNormalization", [h, weight(p + "norm1", hidden)],
                                          [p + "a"], epsilon=1e-5, axis=-1))
            residual = h
        else:
            nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [h, residual, weight(p + "norm1", hidden)],
                                          [p + "a", "", "", p + "res1"], epsilon=1e-5, domain="com.microsoft"))
            residual = p + "res1"
        kv_names = [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        nodes += [helper.make_node("MatMul", [p + "a", weight(p + "qkv", hidden, (heads + 2 * kv_heads) * d)],
                                   [p + "qkv_out"]),
                  helper.make_node("GroupQueryAttention", [p + "qkv_out", "", "", *kv_names, "seqlens_k", "total_len",
                                                           "cos_cache", "sin_cache"],
                                   [p + "attn", f"present.{i}.key", f"present.{i}.value"], domain="com.microsoft",
                                   num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0,
                                   scale=float(1 / np.sqrt(d)), local_window_size=local_window),
                  helper.make_node("MatMul", [p + "attn", weight(p + "o", heads * d, hidden)], [p + "o_out"]),
                  helper.make_node("SkipSimplifiedLayerNormalization", [p + "o_out", residual,
                                                                         weight(p + "norm2", hidden)],
                                   [p + "f", "", "", p + "res2"], epsilon=1e-5, domain="com.microsoft"),
                  helper.make_node("MatMul", [p + "f", weight(p + "up", hidden, 2 * hidden)], [p + "up_out"]),
                  helper.make_node("Sigmoid", [p + "up_out"], [p + "sig"]),
                  helper.make_node("Mul", [p + "up_out", p + "sig"], [p + "act"]),
                  helper.make_node("MatMul", [p + "act", weight(p + "down", 2 * hidden, hidden)], [p + "down_out"])]
        h, residual = p + "down_out", p + "res2"
    nodes += [helper.make_node("SkipSimplifiedLayerNormalization", [h, residual, weight("final_norm", hidden)],
                               ["final"], epsilon=1e-5, domain="com.microsoft"),
              helper.make_node("MatMul", ["final", weight("lm_head", hidden, vocab)], ["logits"])]
    kv_shape = ["batch_size", kv_heads, "past_sequence_length", "kv_cache_dim"]
    present_shape = ["batch_size", kv_heads, "total_sequence_length", "kv_cache_dim"]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])]
    for i in range(layers):
        for k in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{k}", TensorProto.FLOAT, kv_shape))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{k}", TensorProto.FLOAT, present_shape))
    graph = helper.make_graph(nodes, "gqa_decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    onnx.save(model, str(path))
