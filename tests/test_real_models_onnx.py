"""Real models through ONNX: exported by torch, imported and compiled by tilegraph, checked against torch eager.

all-MiniLM-L6-v2 is exported twice, with static shapes and with dynamic batch/seq
axes (whose Shape -> Gather -> Concat -> Reshape chains must fold at import into
symbolic reshapes); the small CNN once. Each export happens once per module.
"""

from __future__ import annotations

import pytest
import torch

import tilegraph
from tilegraph.frontends.onnx import from_onnx
from tilegraph.ir.shapes import symbol
from tilegraph.testing import PEER_RELATIVE_ERROR, relative_error
from tests.models import (
    export_onnx,
    minilm_bert,
    minilm_inputs,
    minilm_model,
    small_cnn,
    small_cnn_inputs,
)

pytestmark = pytest.mark.slow


BATCH, SEQ = 2, 16


@pytest.fixture(scope="module")
def minilm():
    return minilm_model()


@pytest.fixture(scope="module")
def minilm_files(minilm, tmp_path_factory):
    d = tmp_path_factory.mktemp("minilm_onnx")
    ids, mask = minilm_inputs(BATCH, SEQ)
    names = dict(input_names=["input_ids", "attention_mask"], output_names=["hidden"])
    static = export_onnx(minilm, (ids, mask), d / "static.onnx", **names)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            "hidden": {0: "batch", 1: "seq"}}
    dynamic = export_onnx(minilm, (ids, mask), d / "dynamic.onnx", dynamic_axes=axes, **names)
    return static, dynamic


def eager(model, *inputs):
    with torch.no_grad():
        return model(*inputs).numpy()


def assert_matches_at_two_sizes(compiled, module):
    for b, s in [(BATCH, SEQ), (3, 9)]:
        ids, mask = minilm_inputs(b, s)
        out = compiled(ids.numpy(), mask.numpy())
        assert out.shape == (b, s, 384)
        assert relative_error(out, eager(module, ids, mask)) <= PEER_RELATIVE_ERROR


def test_minilm_static_export_matches_torch(minilm, minilm_files):
    ids, mask = minilm_inputs(BATCH, SEQ)
    compiled = tilegraph.compile(minilm_files[0])
    assert relative_error(compiled(ids.numpy(), mask.numpy()), eager(minilm, ids, mask)) <= PEER_RELATIVE_ERROR


def test_minilm_dynamic_export_is_symbolic_and_matches_torch_at_two_sizes(minilm, minilm_files):
    model = from_onnx(minilm_files[1])
    batch, seq = symbol("batch"), symbol("seq")
    assert model.inputs[0].shape == (batch, seq) and model.outputs[0].shape == (batch, seq, 384)
    # The shape subgraphs folded away: no op of the IR computes on shapes.
    assert "Shape" not in model.text and "tg.concat" not in model.text
    assert_matches_at_two_sizes(tilegraph.compile(model), minilm)


class BertHidden(torch.nn.Module):
    """transformers' own BertModel.forward, mask building included (no wrapper simplifying it)."""

    def __init__(self):
        super().__init__()
        self.bert = minilm_bert()

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def test_transformers_own_bert_exported_with_dynamic_axes_imports_and_matches_torch(tmp_path):
    """transformers 5.x builds the mask from Range(batch) * seq and scalar Gathers of Shape: the
    0-d values stay 0-d at import, and the symbolic ones are computed at run time."""
    bert = BertHidden().eval()
    ids, mask = minilm_inputs(BATCH, SEQ)
    axes = {n: {0: "batch", 1: "seq"} for n in ("input_ids", "attention_mask", "hidden")}
    path = export_onnx(bert, (ids, mask), tmp_path / "bert.onnx", ["input_ids", "attention_mask"], ["hidden"],
                       dynamic_axes=axes)
    assert_matches_at_two_sizes(tilegraph.compile(path), bert)


def test_small_cnn_matches_torch(tmp_path):
    cnn = small_cnn()
    (x,) = small_cnn_inputs()
    path = export_onnx(cnn, (x,), tmp_path / "cnn.onnx", input_names=["x"], output_names=["logits"])
    model = from_onnx(path)
    assert any(op.name == "tg.conv" for op in model.func.body.block.ops)
    assert relative_error(tilegraph.compile(model)(x.numpy()), eager(cnn, x)) <= PEER_RELATIVE_ERROR
