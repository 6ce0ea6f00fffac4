"""ONNX decoder-with-past files (optimum's export: past_key_values.N.* in, present.N.* = Concat(past,
new) out) run as in-place generation: the Concat becomes tg.cache_write into a preallocated
cache and the attention over it tg.cache_attention, so a step writes its rows where they go
instead of copying the whole cache. Greedy tokens equal onnxruntime's own past/present loop on
the same file; logits agree with it and with the float64 interpreter."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

import tilegraph  # noqa: E402
from tilegraph.frontends import FrontendError  # noqa: E402
from tilegraph.frontends.onnx import from_onnx  # noqa: E402
from tilegraph.frontends.onnx.kv_cache import KVCacheError, OnnxDecoder  # noqa: E402
from tilegraph.generation import LanguageModel, Sampling  # noqa: E402
from tilegraph.ir.errors import TilegraphError  # noqa: E402
from tilegraph.ir.interpreter import interpret  # noqa: E402
from tilegraph.ir.ops import Op  # noqa: E402
from tilegraph.ir.shapes import info_of  # noqa: E402
from tilegraph.testing import assert_close  # noqa: E402
from tilegraph.testing.onnx_decoders import TINY, export_decoder, run_onnxruntime, write_gqa_decoder  # noqa: E402

PROMPT = [5, 70, 71, 100, 3]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx_decoders")
    out = {}
    for arch in ("llama", "gpt2"):
        out[arch] = d / f"{arch}.onnx"
        export_decoder(out[arch], arch)
    # onnxruntime-genai's form (GroupQueryAttention), small: the quick file for the API tests
    (d / "gqa").mkdir()
    out["gqa"] = d / "gqa" / "model.onnx"
    write_gqa_decoder(out["gqa"], vocab=TINY["vocab"])
    return out


def _ops(model):
    return [op for op in model.ops() if hasattr(op, "op_name")]


def _greedy_as_onnxruntime(lm, path, steps: int, name: str, head_dim: int | None = None, dtype: str = "f32"):
    """lm's greedy decoding of PROMPT makes the tokens of onnxruntime's past/present loop over `path`,
    each step's logits within `dtype`'s tolerance of onnxruntime's."""
    got: list[np.ndarray] = []
    made = [t for _, t in lm.generate_ids([PROMPT], steps, Sampling(), stop=False,
                                          on_logits=lambda i, logits: got.append(logits[0].copy()))]
    want_logits: list[np.ndarray] = []
    want = run_onnxruntime(ort.InferenceSession(str(path)), PROMPT, steps, head_dim=head_dim,
                           on_logits=lambda i, logits: want_logits.append(logits))
    assert made == want
    for i, (g, ref) in enumerate(zip(got, want_logits)):
        assert_close(g, ref, dtype, TINY["hidden"], name=f"{name} step {i}")


@pytest.mark.parametrize("arch,target", [("llama", "numpy"), ("gpt2", "numpy")])
def test_greedy_generation_equals_onnxruntimes_past_present_loop(files, arch, target):
    path = files[arch]
    lm = LanguageModel(path, target=target, cache_len=32)
    assert (lm.config.layers, lm.config.kv_heads) == (2, 2 if arch == "llama" else 4)
    caches = list(lm.caches(1))
    _greedy_as_onnxruntime(lm, path, 10, arch)
    # written in place: the same buffers, 5 prompt + 9 decoded positions filled, the rest untouched
    assert all(a is b for a, b in zip(lm.caches(1), caches))
    assert all(c[:, :, :14].any() and not c[:, :, 14:].any() for c in caches)


def test_the_cache_is_written_not_concatenated_and_matches_the_float64_interpreter(files):
    decoder = OnnxDecoder(files["llama"])
    model = decoder.build(1, 1, 24)
    ops = _ops(model)
    names = [op.op_name for op in ops]
    assert names.count(Op.cache_write) == 4 and names.count(Op.cache_attention) == 2
    # rotate_half's Concats remain; none is as long as the cache (the past/present Concat is gone)
    concats = [info_of(r.type).shape for op in ops if op.op_name == Op.concat for r in op.results]
    assert concats and not any(24 in shape for shape in concats)
    assert model.aliases == {3: 1, 4: 2, 5: 3, 6: 4}
    # one decode step at position 4 over caches holding 4 random rows: the float64 interpreter and
    # onnxruntime given those rows as its past
    rng = np.random.default_rng(1)
    caches = [np.zeros((1, 2, 24, 16), np.float32) for _ in range(4)]
    for c in caches:
        c[:, :, :4] = rng.standard_normal((1, 2, 4, 16))
    token = np.array([[9]], np.int64)
    reference = interpret(model, [token, np.array([4]), np.array([0]), *[c.copy() for c in caches]])
    compiled = tilegraph.compile(model, target="numpy")
    got = compiled.run(token, np.array([4]), np.array([0]), *caches)
    assert_close(got[0], reference[0], "f32", TINY["hidden"])
    session = ort.InferenceSession(str(files["llama"]))
    past = {f"past_key_values.{i}.{k}": caches[2 * i + j][:, :, :4] for i in range(2)
            for j, k in enumerate(("key", "value"))}
    outs = session.run(None, {"input_ids": token, "attention_mask": np.ones((1, 5), np.int64),
                              "position_ids": np.array([[4]]), **past})
    assert_close(got[0][0], outs[0][0, -1], "f32", TINY["hidden"])
    assert_close(caches[0][:, :, :5], outs[1], "f32", TINY["hidden"], name="the cache, its new row written in place")


def test_prompts_decoded_together_give_what_each_gives_alone(files):
    lm = LanguageModel(files["gqa"], target="numpy", cache_len=32)
    prompts = [[5, 70, 71], [100, 3, 250, 9, 11], [7]]
    together: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for seq, token in lm.generate_ids(prompts, 5, Sampling(), stop=False):
        together[seq].append(token)
    for i, p in enumerate(prompts):
        assert together[i] == [t for _, t in lm.generate_ids([p], 5, Sampling(), stop=False)], i


def _edited(path, tmp_path, edit):
    proto = onnx.load(str(path))
    edit(proto.graph)
    out = tmp_path / "edited.onnx"
    onnx.save(proto, str(out))
    return out


def _concat_of(graph, name):
    return next(n for n in graph.node if n.op_type == "Concat" and name in n.input)


def _axis_1(graph):
    _concat_of(graph, "past_key_values.0.key").attribute[0].i = 1


def _past_length_read(graph):  # an extra output that reads the past's shape: the past length stays live
    shape = onnx.helper.make_node("Shape", ["past_key_values.1.value"], ["past_shape"], name="extra_shape")
    graph.node.append(shape)
    graph.output.append(onnx.helper.make_tensor_value_info("past_shape", onnx.TensorProto.INT64, [4]))


def _no_attention(graph):  # layer 0's keys feed no Softmax
    for n in graph.node:
        if n.op_type == "Softmax":
            n.op_type = "Sigmoid"
            del n.attribute[:]


def _renamed_value(graph):
    graph.input[4].name = "past_key_values.0.val"
    for n in graph.node:
        n.input[:] = ["past_key_values.0.val" if i == "past_key_values.0.value" else i for i in n.input]


@pytest.mark.parametrize("edit,message", [
    (_axis_1, "along axis 2"), (_past_length_read, "beyond the cache write"),
    (_no_attention, "no attention"), (_renamed_value, "each a key and a value")])
def test_a_malformed_past_present_pattern_is_a_named_error_and_the_plain_import_still_works(
        files, tmp_path, edit, message):
    path = _edited(files["llama"], tmp_path, edit)
    with pytest.raises(KVCacheError, match=message):
        LanguageModel(path, target="numpy")
    if edit is _axis_1:  # not a model at all (the rows differ in length off axis 1): named by the plain import
        with pytest.raises(FrontendError, match="differ off axis 1"):
            from_onnx(str(path))
    else:
        from_onnx(str(path))  # the file as it is: a symbolic past length, the Concat kept


def _prescaled(both: bool):
    """Each layer's scores scaled before their MatMul, not after: Q x s (OPT's, GPT-J's form), or
    Q x sqrt(s) and K^T x sqrt(s) (torch's decomposed SDPA)."""
    def edit(graph):
        from onnx import numpy_helper

        nodes = [onnx.NodeProto() for _ in graph.node]
        for copy, n in zip(nodes, graph.node):
            copy.CopyFrom(n)
        producer = {o: n for n in nodes for o in n.output}
        for softmax in [n for n in nodes if n.op_type == "Softmax"]:
            add = producer[softmax.input[0]]
            scaled = next(producer[i] for i in add.input if i in producer and producer[i].op_type == "Mul")
            qk = producer[scaled.input[0]]
            factor = float(numpy_helper.to_array(producer[scaled.input[1]].attribute[0].t))
            add.input[list(add.input).index(scaled.output[0])] = qk.output[0]
            nodes.remove(scaled)
            for side in (0, 1) if both else (0,):
                name = f"{qk.output[0]}_scale_{side}"
                graph.initializer.append(numpy_helper.from_array(
                    np.array(factor ** 0.5 if both else factor, np.float32), name))
                nodes.insert(nodes.index(qk), onnx.helper.make_node("Mul", [qk.input[side], name], [name + "d"]))
                qk.input[side] = name + "d"
        del graph.node[:]
        graph.node.extend(nodes)
    return edit


@pytest.mark.parametrize("both", [False, True], ids=["q", "q_and_k"])
def test_scores_scaled_before_their_matmul_decode_in_place(files, tmp_path, both):
    path = _edited(files["llama"], tmp_path, _prescaled(both))
    lm = LanguageModel(path, target="numpy", cache_len=32)
    head_dim = TINY["hidden"] // TINY["heads"]
    attentions = [op for op in _ops(lm._onnx.build(1, 1, 32)) if op.op_name == Op.cache_attention]
    # the query read is Q x s (or x sqrt(s)): what is left of 1/sqrt(D) is the attention's scale
    assert [op.attr("scale") for op in attentions] == pytest.approx([head_dim ** -0.25 if both else 1.0] * 2)
    _greedy_as_onnxruntime(lm, path, 6, "pre-scaled")


@pytest.fixture(scope="module")
def alibi_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("alibi_decoders")
    export_decoder(d / "llama_alibi.onnx", "llama", alibi=True)  # ALiBi added to the causal mask (one Add)
    export_decoder(d / "mpt.onnx", "mpt")  # MPT: scores + ALiBi, then masked_fill
    return {"llama_alibi": d / "llama_alibi.onnx", "mpt": d / "mpt.onnx"}


@pytest.mark.parametrize("name,message", [("llama_alibi", "ALiBi position bias"), ("mpt", "ALiBi")])
def test_a_decoder_with_an_alibi_bias_is_refused_in_place_and_runs_as_it_is(alibi_files, name, message):
    # in place, the bias would be dropped (tg.cache_attention is causal with no bias): refused by name
    path = alibi_files[name]
    with pytest.raises(KVCacheError, match=message):
        LanguageModel(path, target="numpy")
    # the plain import keeps it: a prefill of 2 tokens after 3 past rows, against the float64
    # interpreter and onnxruntime
    session = ort.InferenceSession(str(path))
    names = [i.name for i in session.get_inputs()]
    rng = np.random.default_rng(3)
    feeds = {"input_ids": np.array([[9, 40]], np.int64), "attention_mask": np.ones((1, 5), np.int64),
             "position_ids": np.array([[3, 4]], np.int64)}
    feeds.update({n: rng.standard_normal((1, TINY["heads"] if name == "mpt" else TINY["kv_heads"], 3,
                                          TINY["hidden"] // TINY["heads"])).astype(np.float32)
                  for n in names if n.startswith("past_key_values.")})
    args = [feeds[n] for n in names]
    want = session.run(None, {n: feeds[n] for n in names})
    proto = onnx.load(str(path))  # the plain import at this step's shapes (the past length fixed)
    for i in proto.graph.input:
        for d, n in zip(i.type.tensor_type.shape.dim, feeds[i.name].shape):
            d.dim_value = n
    model = from_onnx(proto)
    reference = interpret(model, args)
    got = tilegraph.compile(model, target="numpy").run(*args)
    for i, (g, r, w) in enumerate(zip(got, reference, want)):
        assert_close(g, r, "f32", TINY["hidden"], name=f"{name} output {i} vs the float64 interpreter")
        assert_close(g, w, "f32", TINY["hidden"], name=f"{name} output {i} vs onnxruntime")


@pytest.mark.slow
def test_an_sdpa_decoder_from_torchs_dynamo_exporter_decodes_in_place(tmp_path):
    """torch.onnx's dynamo exporter at opset 23: SDPA as ONNX Attention (K/V repeated per query head,
    a boolean mask), the rotary embedding as RotaryEmbedding, the batch read from a past's shape."""
    pytest.importorskip("onnxscript")
    path = tmp_path / "sdpa.onnx"
    export_decoder(path, "llama", opset=23, dynamo=True)
    kinds = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"Attention", "RotaryEmbedding"} <= kinds and "Softmax" not in kinds
    lm = LanguageModel(path, target="numpy", cache_len=32)
    _greedy_as_onnxruntime(lm, path, 8, "sdpa")
    model = lm._onnx.build(1, 2, 16)
    names = [op.op_name for op in _ops(model)]
    assert names.count(Op.cache_write) == 4 and names.count(Op.cache_attention) == 2
    rng = np.random.default_rng(4)
    caches = [np.zeros((1, 2, 16, 16), np.float32) for _ in range(4)]
    for c in caches:
        c[:, :, :5] = rng.standard_normal((1, 2, 5, 16))
    ids = np.array([[9, 40]], np.int64)
    reference = interpret(model, [ids, np.array([5]), np.array([1]), *[c.copy() for c in caches]])
    got = tilegraph.compile(model, target="numpy").run(ids, np.array([5]), np.array([1]), *caches)
    assert_close(got[0], reference[0], "f32", TINY["hidden"], name="two new rows vs the float64 interpreter")


def _inner_reshapes(graph):
    """The Reshapes that flatten K to [B*H, S, D] before torch's decomposed SDPA transposes it."""
    producer = {o: n for n in graph.node for o in n.output}
    return [producer[t.input[0]] for t in graph.node if t.op_type == "Transpose"
            and list(t.attribute[0].ints) == [0, 2, 1] and producer[t.input[0]].op_type == "Reshape"]


@pytest.mark.slow
def test_a_decomposed_sdpa_decoder_from_torchs_dynamo_exporter_at_opset_18_decodes_in_place(tmp_path):
    """torch.onnx's dynamo exporter at opset 18 writes SDPA out: Q and K^T each x sqrt(scale), K^T
    through a 3D Transpose between two computed Reshapes, Softmax then Where(IsNaN(p), 0, p)."""
    pytest.importorskip("onnxscript")
    path = tmp_path / "sdpa18.onnx"
    export_decoder(path, "llama", opset=18, dynamo=True)
    graph = onnx.load(str(path)).graph
    kinds = {n.op_type for n in graph.node}
    assert {"Softmax", "IsNaN"} <= kinds and "Attention" not in kinds and len(_inner_reshapes(graph)) == 2
    lm = LanguageModel(path, target="numpy", cache_len=32)
    _greedy_as_onnxruntime(lm, path, 8, "sdpa opset 18")
    ops = _ops(lm._onnx.build(1, 1, 16))
    assert [op.op_name for op in ops].count(Op.cache_write) == 4
    head_dim = TINY["hidden"] // TINY["heads"]  # K^T's sqrt(scale) is the attention's, Q's stays in the query
    assert [op.attr("scale") for op in ops if op.op_name == Op.cache_attention] == pytest.approx(
        [head_dim ** -0.25] * 2)

    def reshape_not_transpose(graph):  # the flattening Reshape to [B*H, D, S]: the Transpose undoes no transpose
        producer = {o: n for n in graph.node for o in n.output}
        target = producer[_inner_reshapes(graph)[0].input[1]]
        assert target.op_type == "Concat" and len(target.input) == 3
        target.input[1], target.input[2] = target.input[2], target.input[1]
    with pytest.raises(KVCacheError, match="no attention"):
        LanguageModel(_edited(path, tmp_path, reshape_not_transpose), target="numpy")


def test_a_plain_onnx_file_is_not_a_decoder(tmp_path):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "relu.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    with pytest.raises(KVCacheError, match="not a decoder-with-past"):
        LanguageModel(path)
    assert issubclass(KVCacheError, FrontendError)


def test_the_generate_command_refuses_a_non_decoder_onnx_file_by_name(tmp_path, capsys):
    from tilegraph.cli import main

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    assert main(["generate", str(bad), "-p", "hi"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not an ONNX model" in err


def test_onnxruntime_genai_group_query_attention_files_decode_in_place(files):
    """onnxruntime-genai's builder's form: com.microsoft GroupQueryAttention on packed QKV with its
    rotary embedding, the head dim a symbol in the past's shape, residual RMSNorms fused."""
    path = files["gqa"]
    lm = LanguageModel(path, target="c", cache_len=32)  # the C backend's cache kernels, as the benchmark runs
    assert (lm.config.heads, lm.config.kv_heads, lm.config.head_dim) == (4, 2, 16)
    caches = list(lm.caches(1))
    _greedy_as_onnxruntime(lm, path, 8, "gqa", head_dim=16)
    assert all(a is b for a, b in zip(lm.caches(1), caches))  # written where they are, by the C kernels
    assert all(c[:, :, :12].any() and not c[:, :, 12:].any() for c in caches)
    ops = [op.op_name for op in _ops(lm._onnx.build(1, 1, 32))]
    assert ops.count(Op.cache_write) == 4 and ops.count(Op.cache_attention) == 2


def test_a_group_query_attention_local_window_is_tg_cache_attentions_window(tmp_path):
    """local_window_size (Mistral's sliding window as onnxruntime-genai writes it): the query at
    position p sees keys p - L + 1..p, in the prompt and in decode, past the window's length."""
    path = tmp_path / "window.onnx"
    write_gqa_decoder(path, vocab=TINY["vocab"], local_window=3)
    lm = LanguageModel(path, target="c", cache_len=32)
    _greedy_as_onnxruntime(lm, path, 8, "windowed gqa", head_dim=16)
    model = lm._onnx.build(1, 3, 16)
    assert {op.attr("window") for op in _ops(model) if op.op_name == Op.cache_attention} == {3}
    # three new rows after 6 past rows, every row's logits: the float64 interpreter and onnxruntime
    rng = np.random.default_rng(2)
    past = {f"past_key_values.{i}.{k}": rng.standard_normal((1, 2, 6, 16)).astype(np.float32)
            for i in range(2) for k in ("key", "value")}
    ids = np.array([[9, 40, 7]], np.int64)
    want_rows = ort.InferenceSession(str(path)).run(
        None, {"input_ids": ids, "attention_mask": np.ones((1, 9), np.int64), **past})[0][0]
    caches = [np.zeros((1, 2, 16, 16), np.float32) for _ in past]
    for c, rows in zip(caches, past.values()):
        c[:, :, :6] = rows
    for last in range(3):
        got = interpret(model, [ids, np.array([6]), np.array([last]), *[c.copy() for c in caches]])[0][0]
        assert_close(got, want_rows[last], "f32", 64, name=f"row {last} vs onnxruntime")


def test_a_group_query_attention_it_cannot_rewrite_is_a_named_error(files, tmp_path):
    path = tmp_path / "gqa.onnx"
    proto = onnx.load(str(files["gqa"]))
    gqa = next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention")
    next(a for a in gqa.attribute if a.name == "rotary_interleaved").i = 1
    onnx.save(proto, str(path))
    with pytest.raises(KVCacheError, match="rotary_interleaved = 1"):
        LanguageModel(path, target="numpy")
    next(a for a in gqa.attribute if a.name == "rotary_interleaved").i = 0
    next(a for a in gqa.attribute if a.name == "local_window_size").i = 0  # a window of no keys
    onnx.save(proto, str(path))
    with pytest.raises(KVCacheError, match="local_window_size = 0"):
        LanguageModel(path, target="numpy")


def test_the_generate_command_streams_text_from_an_onnx_decoder_and_its_tokenizer(files, tmp_path, capsys):
    from tilegraph.cli import main
    from tilegraph.testing.onnx_decoders import byte_tokenizer

    folder = tmp_path / "genai"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(files["gqa"].read_bytes())
    byte_tokenizer(TINY["vocab"]).save_pretrained(str(folder))
    assert main(["generate", str(folder / "model.onnx"), "-p", "Hello", "-n", "6", "--target", "numpy",
                 "--cache-len", "32"]) == 0
    out = capsys.readouterr()
    prompt = [int(i) for i in byte_tokenizer(TINY["vocab"])("Hello")["input_ids"]]
    want = run_onnxruntime(ort.InferenceSession(str(files["gqa"])), prompt, 6, head_dim=16)
    # random weights make random bytes: an incomplete UTF-8 character at the end is held back
    assert out.out.rstrip("\n") == byte_tokenizer(TINY["vocab"]).decode(want).rstrip("\ufffd")
    assert "generation: 6 tokens" in out.err


@pytest.mark.parametrize("arch,head_dim", [("llama", None), ("gqa", 16)])
def test_an_f16_cache_decodes_as_onnxruntimes_loop(files, arch, head_dim):
    """cache_dtype="f16" (the half-size cache): the caches the model writes in place are f16 although
    the file declares its presents f32; greedy tokens are onnxruntime's, logits within f16's tolerance."""
    lm = LanguageModel(files[arch], target="numpy", cache_len=32, cache_dtype="f16")
    caches = list(lm.caches(1))
    assert all(c.dtype == np.float16 for c in caches)
    _greedy_as_onnxruntime(lm, files[arch], 6, f"{arch} f16-cache", head_dim=head_dim, dtype="f16")
    assert all(a is b for a, b in zip(lm.caches(1), caches)) and caches[0][:, :, :10].any()


def _report_line(out: str, start: str) -> str:
    return next(s for s in out.splitlines() if s.startswith(start))


def test_cost_decode_prices_an_onnx_decoders_step(files, capsys):
    """`tilegraph cost --decode` on an exported decoder: every weight once (the embedding table: the
    rows the batch gathers), the K/V cache up to the depth, the bandwidth bound and the prediction."""
    from tilegraph.cli import main
    from tilegraph.cli.common import format_count

    path = files["llama"]
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    embed = initializers["lm.model.embed_tokens.weight"]
    rest = sum(a.nbytes for n, a in initializers.items() if n != "lm.model.embed_tokens.weight")
    s = TINY
    head_dim = s["hidden"] // s["heads"]

    def run(*extra):
        assert main(["cost", str(path), "--decode", *extra]) == 0
        return capsys.readouterr().out

    for batch, depth, dtype in ((1, 7, "f32"), (2, 40, "f32"), (2, 40, "f16")):
        out = run("--depth", str(depth), "--batch", str(batch), "--cache-dtype", dtype)
        weights = rest + batch * embed.shape[1] * embed.itemsize
        cache = 2 * s["layers"] * batch * s["kv_heads"] * (depth + 1) * head_dim * {"f32": 4, "f16": 2}[dtype]
        line = _report_line(out, "bytes read per step")
        assert f"{format_count(weights)} of weights + {format_count(cache)} of {dtype} KV cache" in line, line
        assert f"{s['layers']} layers" in out and f"cache depth {depth}" in out
        bound = float(_report_line(out, "memory bandwidth").split()[-2])
        gbs = float(_report_line(out, "memory bandwidth").split()[2])
        assert bound == pytest.approx(gbs * 1e9 / (weights + cache) * batch, rel=1e-2)
        words = _report_line(out, "cost model").split()
        ms, tokens = float(words[2]), float(words[6])
        assert 0 < ms and tokens == pytest.approx(batch / (ms * 1e-3), rel=2e-2)  # ms has 2 decimals
        assert tokens <= bound  # the model's time of a step reads at least its bytes


@pytest.mark.parametrize("content,message", [(b"not onnx", "not an ONNX model"),
                                             ("relu", "not a decoder-with-past")])
def test_cost_decode_names_what_is_wrong_with_a_file(tmp_path, capsys, content, message):
    from tilegraph.cli import main

    path = tmp_path / "model.onnx"
    if content == "relu":
        x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
        graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                                       [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
        onnx.save(onnx.helper.make_model(graph), str(path))
    else:
        path.write_bytes(content)
    assert main(["cost", str(path), "--decode"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_files_rotary_tables_bound_its_context(files, capsys):
    """GroupQueryAttention's cos/sin caches have a row per position (64 in this file): the cache is no
    longer, generation past it is refused before it runs, and so is `cost --decode` at that depth
    (a position past the tables would index out of them)."""
    from tilegraph.cli import main

    lm = LanguageModel(files["gqa"], target="numpy", cache_len=128)
    assert lm.config.context == 64 and lm.cache_len == 64
    with pytest.raises(TilegraphError, match="cache positions"):
        next(iter(lm.generate_ids([[1] * 60], 10, Sampling(), stop=False)))
    assert main(["cost", str(files["gqa"]), "--decode", "--depth", "63"]) == 0
    assert main(["cost", str(files["gqa"]), "--decode", "--depth", "64"]) == 2
    assert "past the model's context of 64" in capsys.readouterr().err
    assert LanguageModel(files["llama"], target="numpy", cache_len=128).cache_len == 128  # rotary computed
