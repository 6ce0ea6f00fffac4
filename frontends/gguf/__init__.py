"""The GGUF frontend: llama.cpp's model files (frontends/gguf/reader.py reads and checks them;
llama.py builds the Llama family with a KV cache; tokenizer.py brings the BPE tokenizer and
the chat template from the metadata)."""

from __future__ import annotations

from pathlib import Path

from tilegraph.frontends.gguf.reader import (  # noqa: F401 - the errors are the frontend's API
    GGUFArchitectureError, GGUFBlockTypeError, GGUFDimsError, GGUFError, GGUFFile, GGUFHeaderError,
    GGUFMetadataError, GGUFOffsetError, GGUFOverlapError, GGUFTruncatedError)


def from_gguf(path: str | Path, batch: int = 1, steps="T", cache_len: int | None = None):
    """The tg model of a GGUF file: `steps` new tokens per call (a symbol: prefill; 1: decode)
    over caches of `cache_len` positions (the model's context length by default)."""
    from tilegraph.frontends.gguf.llama import LlamaConfig, build, load_weights

    f = GGUFFile(path)
    config = LlamaConfig.of(f)
    weights, formats = load_weights(f, config)
    return build(config, weights, formats, batch, steps, cache_len or config.context)
