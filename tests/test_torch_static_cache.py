"""A static KV cache through torch.export (gpt-fast's `k_cache[:, :, pos] = k`, transformers'
StaticCache `index_copy_`): the buffers the program writes become donated inputs, and each
write an in-place tg.cache_write, so a step costs the same at every position instead of copying
the whole cache (a functional scatter would)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tilegraph  # noqa: E402
from tilegraph.ir.interpreter import interpret  # noqa: E402
from tilegraph.testing import assert_close  # noqa: E402


class CachedAttention(torch.nn.Module):
    """One attention layer over a static cache, written both ways torch code writes one."""

    def __init__(self, heads=2, length=16, dim=8):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, heads, length, dim))
        self.register_buffer("v_cache", torch.zeros(1, heads, length, dim))
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim)

    def forward(self, x, cache_position):
        self.k_cache.index_copy_(2, cache_position, self.k(x))  # transformers' StaticCache.update
        self.v_cache[:, :, cache_position] = self.v(x)  # gpt-fast's KVCache.update
        length = self.k_cache.shape[2]
        visible = torch.arange(length)[None, :] <= cache_position[:, None]  # causal in absolute positions
        return torch.nn.functional.scaled_dot_product_attention(x, self.k_cache, self.v_cache, attn_mask=visible)


def test_cache_writes_become_in_place_cache_writes():
    torch.manual_seed(0)
    module = CachedAttention().eval()
    x, pos = torch.randn(1, 2, 3, 8), torch.arange(0, 3)
    steps = torch.export.Dim("T", min=1, max=16)  # one module for prefill (T = prompt) and decode (T = 1)
    model = tilegraph.import_model(torch.export.export(module, (x, pos), dynamic_shapes={
        "x": {2: steps}, "cache_position": {0: steps}}))
    ops = [op.op_name for op in model.ops() if hasattr(op, "op_name")]
    assert ops.count("cache_write") == 2 and "scatter_nd" not in ops
    assert model.input_names[:2] == ["k_cache", "v_cache"] and model.aliases == {0: 1, 1: 2}
    f = tilegraph.compile(model, target="numpy")
    caches = [np.zeros((1, 2, 16, 8), np.float32) for _ in range(2)]
    with torch.no_grad():
        for start, steps in ((0, 3), (3, 1), (4, 1)):  # a prefill, then two decode steps
            x = torch.randn(1, 2, steps, 8)
            pos = torch.arange(start, start + steps)
            want = module(x, pos).numpy()
            inputs = [*caches, x.numpy(), pos.numpy()]
            reference = interpret(model, [a.copy() for a in inputs])
            outs = f.run(*inputs)
            assert outs[1] is caches[0] and outs[2] is caches[1], "the caches are written where they are"
            assert_close(outs[0], reference[0], "f32", 16)
            np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(caches[0], module.k_cache.numpy(), rtol=1e-5, atol=1e-6)


def test_a_transformers_llama_with_a_static_cache_decodes_in_place():
    """LlamaForCausalLM (random weights, GQA) exported by transformers' own ExecuTorch wrapper
    with a StaticCache: one token per call, the caches donated and written in place, logits
    equal to transformers' forward of the whole sequence."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from tilegraph.testing import PEER_RELATIVE_ERROR, relative_error

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config).eval()
    llama.generation_config.cache_implementation = "static"
    llama.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 32}
    ep = TorchExportableModuleForDecoderOnlyLM(llama).export(input_ids=torch.tensor([[1]]),
                                                             cache_position=torch.tensor([0]))
    model = tilegraph.import_model(ep)
    ops = [op.op_name for op in model.ops() if hasattr(op, "op_name")]
    assert ops.count("cache_write") == 4 and len(model.aliases) == 4
    caches = {n: np.zeros(tuple(i.shape), np.float32) for n, i in zip(model.input_names, model.inputs)
              if n.startswith(("key_cache", "value_cache"))}
    f = tilegraph.compile(model, target="numpy")
    ids = [5, 17, 99, 3, 42]
    with torch.no_grad():
        want = llama(torch.tensor([ids])).logits[0].numpy()
    for position, token in enumerate(ids):
        feed = dict(caches, input_ids=np.array([[token]], np.int64), cache_position=np.array([position], np.int64))
        outs = f.run(*[feed[n] for n in model.input_names])
        assert outs[1] is caches[model.input_names[0]]
        assert relative_error(outs[0][0, -1], want[position]) <= PEER_RELATIVE_ERROR
