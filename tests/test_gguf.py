"""The GGUF frontend on a tiny file written by llama.cpp's own writer (the `gguf` package):
every block format reads back as its reference dequantization; the model's logits, prefill
and decode over the KV cache, agree with transformers' float64 forward of the same file;
several prompts decoded together give what each gives alone; and every malformed file or
template is one named error (exit 2 from the command line) before anything runs."""

import numpy as np
import pytest

import tilegraph
from tilegraph.cli import main
from tilegraph.frontends.gguf import (GGUFArchitectureError, GGUFBlockTypeError, GGUFDimsError, GGUFFile,
                                      GGUFHeaderError, GGUFOffsetError, GGUFOverlapError, GGUFTruncatedError,
                                      from_gguf)
from tilegraph.frontends.gguf.tokenizer import ChatTemplateError, render_chat_template
from tilegraph.generation import LanguageModel, Sampling
from tilegraph.ir.block_formats import FORMATS
from tilegraph.ir.model import Model
from tilegraph.testing import assert_close
from tilegraph.testing.gguf_files import (GEMMA3_TINY_WINDOW, TINY_FORMATS, patch, tensor_info_offsets,
                                         write_tiny_llama)

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.xdist_group("tiny_gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    values = write_tiny_llama(path)
    return path, values


def test_every_block_format_reads_back_as_its_reference_dequantization(tiny):
    path, values = tiny
    f = GGUFFile(path)
    assert set(TINY_FORMATS.values()) == set(FORMATS), "the tiny file covers every block format"
    reference = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name, t in f.tensors.items():
        assert t.format.name == TINY_FORMATS.get(name, "f32" if len(t.dims) == 1 else "q8_0")
        assert t.raw.dtype == np.uint8 and not t.raw.flags.owndata, f"{name} is a view of the file"
        ref = gguf.quants.dequantize(reference[name].data, reference[name].tensor_type)
        np.testing.assert_array_equal(t.dequantize(), values[name])
        np.testing.assert_array_equal(t.dequantize(), np.asarray(ref, np.float32).reshape(values[name].shape))


def test_the_model_keeps_block_formats_and_donates_its_caches(tiny):
    model = from_gguf(tiny[0], batch=1, steps=1, cache_len=16)
    names = model.input_names
    assert model.aliases == {names.index(f"{k}_cache.{i}"): 1 + 2 * i + (k == "v") for i in range(2) for k in "kv"}
    for name, fmt in TINY_FORMATS.items():
        assert model.weights[name].dtype == np.uint8, f"{name} ({fmt}) is kept as its bytes"
    ops = [op.op_name for op in model.ops() if hasattr(op, "op_name")]
    assert ops.count("block_matmul") == 2 * 7 + 1 and "matmul" not in ops and "dequantize" not in ops


def _transformers_logits(path, ids):
    """transformers' float64 forward of the whole sequence (no cache): logits of every position."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(  # dense, on the dequantized weights
        str(path.parent), gguf_file=path.name, dtype=torch.float64,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_prefill_and_decode_logits_match_transformers_in_float64(tiny):
    path, _ = tiny
    lm = LanguageModel(path, target="numpy", cache_len=32)
    prompt = [5, 70, 71, 100, 3, 250, 9]
    steps = []
    caches = list(lm.caches(1))
    made = [t for _, t in lm.generate_ids([prompt], 6, Sampling(), stop=False,
                                          on_logits=lambda i, logits: steps.append(logits[0].copy()))]
    # the same preallocated buffers, written in place: 7 prompt + 5 decoded positions, the rest untouched
    assert all(a is b for a, b in zip(lm.caches(1), caches))
    assert all(c[:, :, :12].any() and not c[:, :, 12:].any() for c in caches)
    want = _transformers_logits(path, prompt + made)
    for i, got in enumerate(steps):
        # step i's logits come from position len(prompt) - 1 + i (prefill, then decode over the cache)
        assert_close(got, want[len(prompt) - 1 + i], "f32", 256, name=f"step {i}")
        assert made[i] == int(np.argmax(want[len(prompt) - 1 + i]))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_files_match_transformers_in_float64(tmp_path, arch):
    """qwen2 (Q/K/V biases) and qwen3 (a norm on each Q/K head): GGUF keeps their rotary halves as
    transformers has them, where llama's are interleaved."""
    path = tmp_path / f"{arch}.gguf"
    write_tiny_llama(path, arch=arch, layers=1)
    lm = LanguageModel(path, target="numpy", cache_len=16)
    assert (lm.config.qkv_bias, lm.config.qk_norm) == (arch == "qwen2", arch == "qwen3")
    prompt, steps = [5, 70, 71, 100], []
    made = [t for _, t in lm.generate_ids([prompt], 3, Sampling(), stop=False,
                                          on_logits=lambda i, logits: steps.append(logits[0].copy()))]
    want = _transformers_logits(path, prompt + made)
    for i, got in enumerate(steps):
        assert_close(got, want[len(prompt) - 1 + i], "f32", 256, name=f"{arch} step {i}")


@pytest.mark.parametrize("target", ["numpy", "c"])
def test_gemma3_files_match_transformers_in_float64(tmp_path, target):
    """gemma3: the embedding scaled, norms after attention and the MLP too, Q/K norms, a GELU (tanh)
    MLP, and five local layers of six over a sliding window (4 here: the 10 positions run past it)
    with their own rotary base; on the C backend the windowed attention runs natively."""
    path = tmp_path / "gemma3.gguf"
    write_tiny_llama(path, arch="gemma3", layers=6)
    lm = LanguageModel(path, target=target, cache_len=16)
    assert [lm.config.local(i) for i in range(6)] == [True] * 5 + [False] and lm.config.window == GEMMA3_TINY_WINDOW
    prompt, steps = [5, 70, 71, 100, 3, 250], []
    made = [t for _, t in lm.generate_ids([prompt], 4, Sampling(), stop=False,
                                          on_logits=lambda i, logits: steps.append(logits[0].copy()))]
    want = _transformers_logits(path, prompt + made)
    for i, got in enumerate(steps):
        assert_close(got, want[len(prompt) - 1 + i], "f32", 512, name=f"gemma3 step {i}")
    if target == "c":  # windowed attention, q5_0, GELU: each entry point is one native call
        for kind in ("prefill", "decode"):
            assert [k for k, _ in lm.entry(1, kind)._runner.program.plan] == ["segment"], kind


def test_prompts_decoded_together_give_what_each_gives_alone(tiny):
    path, _ = tiny
    lm = LanguageModel(path, target="numpy", cache_len=32)
    prompts = [[5, 70, 71], [100, 3, 250, 9, 11, 12], [7]]
    alone = [[t for _, t in lm.generate_ids([p], 5, Sampling(), stop=False)] for p in prompts]
    together = [[] for _ in prompts]
    for seq, t in lm.generate_ids(prompts, 5, Sampling(), stop=False):
        together[seq].append(t)
    assert together == alone
    sampled = [list(lm.generate_ids([prompts[1]], 5, Sampling(temperature=0.8, top_k=20, top_p=0.9,
                                                                repetition_penalty=1.3, seed=s)))
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1], "one seed, one sequence"


def test_a_batch_decodes_natively_as_each_prompt_alone(tiny):
    """activation='q8' on the C backend: a batch's decode rows take the batch kernels (AMX tiles where
    the processor grants them, else the 8-row VBMI kernel), one row the single-row path; each
    sequence's logits at every step agree with its own decode alone, and with the NumPy backend's
    reference of the same numerics."""
    from tilegraph.backends.c import blockq

    path, _ = tiny
    best = blockq.isa(None)
    batch_kernel = {"amx": "amx", "avx512_vbmi": "zmm8", "avx512_vnni": "zmm"}.get(best, "blocks")
    assert all(blockq.kernel(f, 3) == batch_kernel for f in ("q4_0", "q4_1", "q8_0"))
    prompts = [[5, 70, 71], [100, 3, 250, 9, 11, 12], [7]]
    lm = LanguageModel(path, target="c", cache_len=32, activation="q8")
    steps: list = []
    made: list = [[] for _ in prompts]
    for seq, t in lm.generate_ids(prompts, 4, Sampling(), stop=False,
                                  on_logits=lambda i, logits: steps.append(logits.copy())):
        made[seq].append(t)
    assert [k for k, _ in lm.entry(3, "decode", Sampling())._runner.program.plan] == ["segment"]
    for b, p in enumerate(prompts):
        alone: list = []
        tokens = [t for _, t in lm.generate_ids([p], 4, Sampling(), stop=False,
                                                 on_logits=lambda i, logits: alone.append(logits[0].copy()))]
        assert tokens == made[b]
        for i, got in enumerate(alone):
            assert_close(steps[i][b], got, "f32", 512, name=f"sequence {b} step {i}: batch vs alone")


def test_compile_and_import_a_gguf_file(tiny, tmp_path):
    path, _ = tiny
    lm = tilegraph.compile(path, target="numpy", cache_len=32)
    assert isinstance(lm, LanguageModel) and lm.config.layers == 2
    text = "".join(tilegraph.generate(lm, "the", 4))
    assert isinstance(text, str)
    out = tmp_path / "tiny.mlir"
    assert main(["import", str(path), "-o", str(out)]) == 0
    back = Model.load(out)
    assert back.weights["blk.0.attn_v.weight"].dtype == np.uint8 and back.aliases


def test_the_tokenizer_and_chat_template_come_from_the_file(tiny):
    lm = LanguageModel(tiny[0], target="numpy", cache_len=32)
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}])
    assert text == "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    ids = lm.tokenizer.encode(text)
    assert lm.tokenizer.decode(ids) == text
    assert ids[0] == lm.tokenizer.tokens.index("<|im_start|>") and ids.count(ids[0]) == 2, "a control token is one"
    # the file's merges apply in order: " the" is Ġ t -> Ġt, h e -> he, Ġt he -> Ġthe
    assert [lm.tokenizer.tokens[i] for i in lm.tokenizer.encode(" the in")] == ["Ġthe", "Ġ", "in"]


# --- bad input: one named error each, exit 2, nothing runs ---------------------------------


def _corrupt(tiny, tmp_path, how):
    path = tmp_path / "bad.gguf"
    path.write_bytes(tiny[0].read_bytes())
    info = tensor_info_offsets(path)
    how(path, info)
    return path


def _truncate(path, info):
    last = max(info.values(), key=lambda t: t["data"])
    path.write_bytes(path.read_bytes()[:last["data"] + last["nbytes"] // 2])


def _offset_past_end(path, info):
    t = info["blk.1.ffn_up.weight"]
    patch(path, t["offset"], (path.stat().st_size // 32 + 1) * 32, 8)


def _overlap(path, info):
    a, b = info["blk.0.attn_q.weight"], info["blk.0.attn_k.weight"]
    patch(path, b["offset"], a["data"] - a["data_start"] + 32, 8)


def _dims_overflow(path, info):
    t = info["blk.0.attn_q.weight"]
    patch(path, t["dims"] + 8, 1 << 62, 8)  # 256 x 2^62 elements


def _unknown_type(path, info):
    patch(path, info["blk.0.attn_v.weight"]["type"], 13, 4)  # Q5_K: a ggml type tilegraph does not read


def _no_such_type(path, info):
    patch(path, info["blk.0.attn_v.weight"]["type"], 99, 4)


def _header_cut(path, info):
    path.write_bytes(path.read_bytes()[:info["token_embd.weight"]["dims"] - 3])


BAD_FILES = {"truncated": (_truncate, GGUFTruncatedError, "truncated"),
             "offset-past-the-end": (_offset_past_end, GGUFOffsetError, "past the end"),
             "overlapping": (_overlap, GGUFOverlapError, "overlap"),
             "dims-overflow": (_dims_overflow, GGUFDimsError, "overflows"),
             "unknown-block-type": (_unknown_type, GGUFBlockTypeError, "Q5_K"),
             "no-such-type": (_no_such_type, GGUFBlockTypeError, "no ggml type"),
             "header-cut-short": (_header_cut, GGUFHeaderError, "header")}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_malformed_file_is_one_named_error_and_exit_2(tiny, tmp_path, case, capsys):
    how, error, words = BAD_FILES[case]
    path = _corrupt(tiny, tmp_path, how)
    with pytest.raises(error, match=words):
        GGUFFile(path)
    assert main(["generate", str(path), "-p", "hi", "--target", "numpy"]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) <= 3


def test_an_unknown_architecture_is_named(tmp_path, capsys):
    path = tmp_path / "mamba.gguf"
    write_tiny_llama(path, arch="mamba", layers=1)
    with pytest.raises(GGUFArchitectureError, match="mamba"):
        from_gguf(path)
    assert main(["chat", str(path), "-p", "hi", "--target", "numpy"]) == 2
    err = capsys.readouterr().err
    assert "architecture 'mamba'" in err and "Traceback" not in err


@pytest.mark.parametrize("template", [
    "{{ messages.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for m in messages %}{{ m.update({'role': 'x'}) }}{% endfor %}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
])
def test_a_template_reaching_python_objects_is_refused(template):
    with pytest.raises(ChatTemplateError, match="sandbox|unsafe"):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


def test_a_hostile_template_in_a_file_exits_2(tmp_path, capsys):
    path = tmp_path / "hostile.gguf"
    write_tiny_llama(path, template="{{ messages.__class__.__base__.__subclasses__() }}", layers=1)
    assert main(["chat", str(path), "-p", "hi", "--target", "numpy"]) == 2
    err = capsys.readouterr().err
    assert "sandbox" in err and "Traceback" not in err


def test_cost_decode_prices_the_bytes_a_token_reads(tiny, capsys):
    path, _ = tiny
    assert main(["cost", str(path), "--decode", "--depth", "7"]) == 0
    out = capsys.readouterr().out
    f = GGUFFile(path)
    # every weight once (the untied embedding: one row), the cache's K and V for 8 positions
    weights = sum(t.nbytes for n, t in f.tensors.items() if n != "token_embd.weight") + \
        f.tensors["token_embd.weight"].raw.shape[1]
    cache = 2 * 2 * 2 * 8 * 64 * 4
    line = next(s for s in out.splitlines() if s.startswith("bytes read per step"))
    from tilegraph.cli.common import format_count
    assert format_count(weights) in line and format_count(cache) in line, line
    assert "tokens/s" in out and "% of the bound" in out
    # an f16 cache (generate --fast's): half the cache's bytes, so a higher bound
    assert main(["cost", str(path), "--decode", "--depth", "7", "--cache-dtype", "f16"]) == 0
    half = capsys.readouterr().out
    line16 = next(s for s in half.splitlines() if s.startswith("bytes read per step"))
    assert format_count(weights) in line16 and format_count(cache // 2) in line16 and "f16 KV cache" in line16, line16

    def bound(text):
        return float(next(s for s in text.splitlines() if s.startswith("memory bandwidth")).split()[-2])
    assert bound(half) > bound(out)


def test_generate_command_streams_several_prompts_and_prints_tokens_per_second(tiny, capsys):
    path, _ = tiny
    assert main(["generate", str(path), "-p", "the", "-p", "in a", "-n", "3", "--threads", "1",
                 "--target", "numpy", "--cache-len", "16", "--temperature", "0.5", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("[0] the") and "\n[1] in a" in captured.out
    assert "prompt: " in captured.err and "tokens/s" in captured.err and "generation: 6 tokens" in captured.err


def test_generate_fast_takes_llama_cpps_numerics(tiny, capsys):
    """--fast: int8 activations and an f16 KV cache (the model's caches are f16 arrays)."""
    path, _ = tiny
    assert main(["generate", str(path), "-p", "the", "-n", "3", "--target", "numpy", "--cache-len", "16",
                 "--fast"]) == 0
    assert "generation: 3 tokens" in capsys.readouterr().err
    from tilegraph.cli.generate import _model
    from tilegraph.cli.parser import _parser

    lm = _model(_parser().parse_args(["generate", str(path), "-p", "x", "--cache-len", "8", "--fast"]))
    assert lm.activation == "q8" and lm.caches(1)[0].dtype == np.float16
