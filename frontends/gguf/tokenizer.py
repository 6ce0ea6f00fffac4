"""The tokenizer and chat template a GGUF file carries in its metadata.

BPE (`tokenizer.ggml.model = "gpt2"`) runs on the `tokenizers` library: the vocabulary and
merges from the file, the pre-tokenizer by `tokenizer.ggml.pre` (the split llama.cpp's
llama-vocab.cpp names so: digits, GPT-2's or Llama 3's regex), byte-level decoding, and
control tokens (type 3) as special tokens, so `<|im_start|>` in a template is one token.
SentencePiece (`llama`, Gemma's) is BPE too: its merges are not in the file but follow from
the scores, as transformers' SentencePieceExtractor and llama.cpp's SPM tokenizer take them
(every split of a piece into two pieces of the vocabulary is a merge, ranked by the whole
piece's score); spaces become "▁" first, and a character outside the vocabulary falls back
to its bytes (<0xNN>). Control and user-defined tokens (Gemma's "\n", runs of spaces) match
the raw text before the model, as llama.cpp's special-token partition does.

The chat template is untrusted text from the file: it is rendered by jinja2's
ImmutableSandboxedEnvironment (as transformers renders chat templates), where reaching a
Python object's internals (`__class__`, `__globals__`, ...) or mutating a value is a
SecurityError; that, and any template that fails to render, is a ChatTemplateError.
"""

from __future__ import annotations

from typing import Sequence

from tilegraph.frontends.gguf.reader import GGUFError, GGUFFile, GGUFMetadataError

NORMAL = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL
CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
USER_DEFINED = 4

# tokenizer.ggml.pre -> the split regex before byte-level BPE (llama-vocab.cpp), None: GPT-2's own.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"gpt2": None, "default": None, "smollm": "digits", "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
                  "qwen2": _QWEN2}


class TokenizerError(GGUFError):
    """The file's tokenizer is one tilegraph cannot build (not BPE, an unknown pre-tokenizer)."""


class ChatTemplateError(GGUFError):
    """The file's chat template fails to render, or tries to reach Python objects (the sandbox refused)."""


class GGUFTokenizer:
    def __init__(self, f: GGUFFile):
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        kind = f.get("tokenizer.ggml.model", str)
        if kind not in ("gpt2", "llama"):
            raise TokenizerError(f"{f.path}: tokenizer '{kind}' is not supported (tilegraph builds BPE, 'gpt2', "
                                 "and SentencePiece, 'llama')")
        tokens = f.get("tokenizer.ggml.tokens", list)
        types = f.get("tokenizer.ggml.token_type", list, [NORMAL] * len(tokens))
        if not all(isinstance(t, str) for t in tokens) or len(types) != len(tokens) \
                or not all(isinstance(t, int) for t in types):
            raise GGUFMetadataError(f"{f.path}: tokenizer.ggml.tokens / token_type are not lists of strings / "
                                    "numbers of one length")
        vocab = {t: i for i, t in enumerate(tokens)}
        if kind == "gpt2":
            pre = f.get("tokenizer.ggml.pre", str, "default")
            if pre not in PRE_TOKENIZERS:
                raise TokenizerError(f"{f.path}: pre-tokenizer '{pre}' is not one tilegraph knows "
                                     f"({', '.join(PRE_TOKENIZERS)})")
            merges = f.get("tokenizer.ggml.merges", list)
            if not all(isinstance(m, str) and " " in m for m in merges):
                raise GGUFMetadataError(f"{f.path}: tokenizer.ggml.merges is not a list of 'a b' strings")
            model = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=False)
            tok = Tokenizer(model)
            split = PRE_TOKENIZERS[pre]
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                  use_regex=split is None or split == "digits")
            if split is None:
                tok.pre_tokenizer = byte_level
            elif split == "digits":
                tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                             byte_level])
            else:
                tok.pre_tokenizer = pre_tokenizers.Sequence(
                    [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
            tok.decoder = decoders.ByteLevel()
        else:
            tok = _sentencepiece(f, tokens, types, vocab)
        tok.add_special_tokens([AddedToken(t, special=kind == CONTROL, normalized=False)
                                for t, kind in zip(tokens, types) if kind in (CONTROL, USER_DEFINED)])
        self.tokenizer = tok
        self.vocab_size = len(tokens)
        self.tokens = tokens
        self.bos_id = f.get("tokenizer.ggml.bos_token_id", int, None)
        self.eos_id = f.get("tokenizer.ggml.eos_token_id", int, None)
        self.add_bos = f.get("tokenizer.ggml.add_bos_token", bool, False)
        self.chat_template = f.get("tokenizer.chat_template", str, None)
        if self.chat_template is None and f.get("general.architecture", str, "") in BUILTIN_TEMPLATES:
            self.chat_template = BUILTIN_TEMPLATES[f.get("general.architecture", str)]
        # end-of-turn tokens stop generation as the end of text does (<|im_end|>, <|eot_id|>)
        self.stop_ids = {i for i in (self.eos_id, f.get("tokenizer.ggml.eot_token_id", int, None)) if i is not None}
        for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
            if name in vocab:
                self.stop_ids.add(vocab[name])

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_text(self, i: int) -> str:
        return self.tokens[i] if 0 <= i < len(self.tokens) else ""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ChatTemplateError("the model file has no chat template (tokenizer.chat_template)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.token_text(self.bos_id) if self.bos_id is not None else "",
                                    eos_token=self.token_text(self.eos_id) if self.eos_id is not None else "")


def _sentencepiece(f: GGUFFile, tokens: list[str], types: list[int], vocab: dict[str, int]):
    """A SentencePiece BPE vocabulary (tokens and scores) as a `tokenizers` BPE: the merges
    every normal piece's two-piece splits give, best score first."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = f.get("tokenizer.ggml.scores", list)
    if len(scores) != len(tokens) or not all(isinstance(x, (int, float)) for x in scores):
        raise GGUFMetadataError(f"{f.path}: tokenizer.ggml.scores is not one number per token")
    merges = []
    for piece, kind, score in zip(tokens, types, scores):
        if kind != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: m[:3])
    unk = f.get("tokenizer.ggml.unknown_token_id", int, None)
    model = models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], ignore_merges=False,
                       unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
                       fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    replace = [normalizers.Replace(" ", "▁")]
    if f.get("tokenizer.ggml.add_space_prefix", bool, True):
        replace.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(replace)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if f.get("tokenizer.ggml.add_space_prefix", bool,
                                                                            True) else []))
    return tok


# Chat templates for files that carry none, by architecture: Gemma's GGUF files leave it out
# (llama.cpp then uses its built-in "gemma" template, the same turns). No BOS here: encode adds it.
BUILTIN_TEMPLATES = {
    "gemma3": ("{% set first = namespace(prefix='') %}"
               "{% for m in messages %}"
               "{% if m['role'] == 'system' %}{% set first.prefix = m['content'] + '\n\n' %}"
               "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
               "{{ first.prefix }}{{ m['content'] | trim }}<end_of_turn>\n{% set first.prefix = '' %}"
               "{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
}


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
    """Render an untrusted chat template in jinja2's immutable sandbox."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template raised: {message}")

    class Sandbox(ImmutableSandboxedEnvironment):
        # The sandbox's own answer to `x.__class__` is an Undefined that renders as "" and fails
        # only when used further; here any reach for an unsafe attribute fails at once.
        def unsafe_undefined(self, obj, attribute):
            raise jinja2.exceptions.SecurityError(
                f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **extra)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template tried to reach Python objects, which the sandbox refuses: {e}"
                                ) from None
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError,
            ZeroDivisionError, RecursionError, OverflowError) as e:
        raise ChatTemplateError(f"the chat template does not render: {type(e).__name__}: {e}") from None
