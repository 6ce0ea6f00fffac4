"""The tokenizer beside an ONNX decoder file: optimum's and onnxruntime-genai's folders hold
transformers' `tokenizer.json` (run by the `tokenizers` library), `tokenizer_config.json` (chat
template, special tokens) and a config naming the end-of-text id(s). The same interface as the
GGUF tokenizer, so tilegraph.generation.LanguageModel streams text from either; the chat
template runs in jinja2's sandbox (frontends/gguf/tokenizer.py), never as code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tilegraph.frontends.gguf.tokenizer import ChatTemplateError, TokenizerError, render_chat_template

CONFIGS = ("generation_config.json", "config.json", "genai_config.json")


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not readable as JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _ids(value) -> set[int]:
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}


class FolderTokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises its own exception type for a bad file
            raise TokenizerError(f"{folder / 'tokenizer.json'}: not a tokenizer ({e})") from None
        config = _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
        template = config.get("chat_template")
        self.chat_template = template if isinstance(template, str) else None
        self.stop_ids: set[int] = set()
        for name in CONFIGS:
            if (folder / name).exists():
                data = _json(folder / name)
                self.stop_ids |= _ids(data.get("eos_token_id", data.get("model", {}).get("eos_token_id")))
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and self.tokenizer.token_to_id(eos) is not None:
            self.stop_ids.add(self.tokenizer.token_to_id(eos))
        self.eos_id = min(self.stop_ids) if self.stop_ids else None
        bos = config.get("bos_token")
        self.bos_token = bos.get("content") if isinstance(bos, dict) else bos if isinstance(bos, str) else ""
        self.eos_token = eos if isinstance(eos, str) else ""

    @classmethod
    def beside(cls, model: Path) -> "FolderTokenizer | None":
        """The tokenizer in the model file's folder, or None when there is no tokenizer.json."""
        return cls(model.parent) if (model.parent / "tokenizer.json").exists() else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ChatTemplateError("the model's folder has no chat template (tokenizer_config.json chat_template)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)
