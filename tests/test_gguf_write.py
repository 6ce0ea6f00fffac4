"""`tilegraph quantize model_dir -o x.gguf --block-format F` (frontends/gguf/writer.py): a transformers
Llama / Qwen3 folder written as a GGUF file in a block format, read back by the GGUF frontend. In f32 the
file's model is the transformers model (the names, metadata and llama's interleaved Q/K rows are
right: logits within the f32 tolerance of transformers' float64 forward); in a block format the
weights are the format's reference quantization (what transformers reads from the same file), rows
that are not whole blocks of it fall back to q8_0; a model it cannot write is a named error, exit 2."""

import json

import numpy as np
import pytest

from tilegraph.cli import main
from tilegraph.frontends.gguf import GGUFFile
from tilegraph.generation import LanguageModel, Sampling
from tilegraph.ir.block_formats import FORMATS
from tilegraph.testing import assert_close

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("tiny_gguf")


def _folder(tmp_path, kind="llama"):
    """A random transformers model saved as a folder: hidden 256 (whole q4_k blocks), MLP 288 (not)."""
    common = dict(vocab_size=96, hidden_size=256, intermediate_size=288, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=64))
    with torch.no_grad():  # norms away from 1, so a norm written in the wrong place shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path / kind
    model.save_pretrained(folder)
    return folder, model.double().eval()


def _ours(path, prompt, steps=3):
    lm = LanguageModel(path, target="numpy", cache_len=16)
    logits = []
    made = [t for _, t in lm.generate_ids([prompt], steps, Sampling(), stop=False,
                                          on_logits=lambda i, x: logits.append(x[0].copy()))]
    return made, logits


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_an_f32_file_is_the_transformers_model(tmp_path, kind, capsys):
    folder, model = _folder(tmp_path, kind)
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(folder), "-o", str(out), "--block-format", "f32"]) == 0
    assert "wrote" in capsys.readouterr().out
    prompt = [5, 17, 3, 88, 40]
    made, logits = _ours(out, prompt)
    with torch.no_grad():
        want = model(torch.tensor([prompt + made])).logits[0].numpy()
    for i, got in enumerate(logits):
        assert_close(got, want[len(prompt) - 1 + i], "f32", 288, name=f"{kind} step {i}")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k"])
def test_a_block_format_file_holds_the_reference_quantization(tmp_path, fmt):
    folder, model = _folder(tmp_path)
    out = tmp_path / f"m.{fmt}.gguf"
    assert main(["quantize", str(folder), "-o", str(out), "--block-format", fmt]) == 0
    f = GGUFFile(out)
    state = model.state_dict()
    q = f.tensors["blk.0.attn_v.weight"]
    assert q.format.name == fmt and q.raw.dtype == np.uint8
    np.testing.assert_array_equal(q.dequantize(), FORMATS[fmt].dequantize(
        FORMATS[fmt].quantize(state["model.layers.0.self_attn.v_proj.weight"].float().numpy()), q.shape))
    # rows of 288 are not whole 256-value blocks: q4_k falls back to q8_0 there
    assert f.tensors["blk.0.ffn_down.weight"].format.name == ("q8_0" if fmt == "q4_k" else fmt)
    assert f.tensors["blk.0.attn_norm.weight"].format.name == "f32"
    prompt = [5, 17, 3, 88, 40]
    made, logits = _ours(out, prompt)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(out.parent), gguf_file=out.name, dtype=torch.float64,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    with torch.no_grad():
        want = theirs(torch.tensor([prompt + made])).logits[0].numpy()
    for i, got in enumerate(logits):
        assert_close(got, want[len(prompt) - 1 + i], "f32", 288, name=f"{fmt} step {i}")


def test_a_file_without_a_tokenizer_takes_token_ids_only(tmp_path, capsys):
    folder, _ = _folder(tmp_path)
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(folder), "-o", str(out), "--block-format", "q8_0"]) == 0
    lm = LanguageModel(out, target="numpy", cache_len=16)
    assert len(list(lm.generate_ids([[1, 2]], 2, Sampling(), stop=False))) == 2
    assert main(["generate", str(out), "-p", "hi", "--target", "numpy"]) == 2
    assert "holds no tokenizer" in capsys.readouterr().err


def test_what_cannot_be_written_is_named(tmp_path, capsys):
    folder, _ = _folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    json.dump({**config, "architectures": ["MambaForCausalLM"]}, (folder / "config.json").open("w"))
    assert main(["quantize", str(folder), "-o", str(tmp_path / "m.gguf"), "--block-format", "q4_0"]) == 2
    err = capsys.readouterr().err
    assert "MambaForCausalLM" in err and "Traceback" not in err
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "m.gguf.partial").exists()
    json.dump({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, (folder / "config.json").open("w"))
    assert main(["quantize", str(folder), "-o", str(tmp_path / "m.gguf")]) == 2
    assert "llama3" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path), "-o", str(tmp_path / "m.gguf")]) == 2
    assert "config.json" in capsys.readouterr().err
