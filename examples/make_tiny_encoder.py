"""Regenerates examples/tiny_encoder.onnx, the model `make demo` compiles.

A 2-layer, 64-wide BERT encoder with random weights (seeded), exported with
dynamic batch and sequence axes, so the demo shows symbolic dimensions. Run from
the repository root: `PYTHONPATH=. .venv/bin/python examples/make_tiny_encoder.py`.
"""

from pathlib import Path

import torch
from transformers import BertConfig, BertModel

from tests.models import MiniLM, export_onnx, minilm_inputs

OUT = Path(__file__).with_name("tiny_encoder.onnx")


def main() -> None:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, attn_implementation="eager")
    model = MiniLM(BertModel(config, add_pooling_layer=False).eval()).eval()
    ids, mask = minilm_inputs(batch=2, seq=16)
    ids = ids % config.vocab_size
    export_onnx(model, (ids, mask), OUT, input_names=["input_ids", "attention_mask"],
                output_names=["last_hidden_state"],
                dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                              "last_hidden_state": {0: "batch", 1: "seq"}})
    print(f"wrote {OUT} ({OUT.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
