"""`tilegraph generate` and `tilegraph chat`: stream text from a .gguf language model (or an ONNX
decoder-with-past file with its tokenizer.json beside it) and print
prompt and generation tokens/s (on stderr, so the text on stdout stays clean)."""

from __future__ import annotations

import sys


def _model(args):
    from tilegraph.generation import LanguageModel

    fast = {"activation": "q8", "cache_dtype": "f16"} if args.fast else {}
    return LanguageModel(args.model, target=args.target, threads=args.threads, cache_len=args.cache_len, **fast)


def _sampling(args):
    from tilegraph.generation import Sampling

    return Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed)


def _generate(args) -> int:
    from tilegraph.ir.errors import TilegraphError

    if not args.prompt:
        raise TilegraphError("tilegraph generate needs a prompt: -p \"...\"")
    lm = _model(args)
    several = len(args.prompt) > 1
    texts: list[list[str]] = [[] for _ in args.prompt]
    for token in lm.generate(args.prompt if several else args.prompt[0], args.max_new_tokens, _sampling(args),
                             chat=args.chat):
        if several:
            texts[token.seq].append(token.text)
        else:
            print(token.text, end="", flush=True)
    if several:
        for i, (prompt, text) in enumerate(zip(args.prompt, texts)):
            print(f"[{i}] {prompt}{''.join(text)}")
    else:
        print()
    print(lm.stats.line(), file=sys.stderr)
    return 0


def _chat(args) -> int:
    lm = _model(args)
    messages: list[dict] = []
    turns = args.prompt if args.prompt else _stdin_lines()
    for user in turns:
        messages.append({"role": "user", "content": user})
        prompt = lm.tokenizer.apply_chat_template(messages)
        if args.prompt:
            print(f"> {user}")
        pieces = []
        for token in lm.generate(prompt, args.max_new_tokens, _sampling(args)):
            pieces.append(token.text)
            print(token.text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(pieces)})
        print(lm.stats.line(), file=sys.stderr)
    return 0


def _stdin_lines():
    while True:
        if sys.stdin.isatty():
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()
