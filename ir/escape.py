"""The one door through which a model's strings enter generated source.

A model file is untrusted: its tensor, node, weight and graph names, doc strings,
string attributes and fusion kinds are arbitrary Unicode. Emitters (NumPy and
Triton write Python, the C backend writes C) put such a string into their source
only through one of these functions:

* a literal: `py_string` / `c_string_literal` (quoted and escaped, so it is data);
* an identifier: `identifier` (ASCII letters, digits and `_` only, valid in both
  languages; callers make it unique and unreserved, `backends/program.Namer`);
* a comment or docstring: `py_comment` / `py_docstring` / `c_comment`, which never
  carry a line break of any kind (`\\n \\r \\v \\f \\x1c-\\x1e \\x85 \\u2028 \\u2029`),
  a NUL, or the comment's own terminator (`*/`), nor a trigraph in C.

Anything not printable (Unicode categories C* and Z* but the space) is written as
its escape (`\\n`, `\\x00`, `\\u2028`), so a reader of the generated file sees it.

The same holds for the terminal: messages that quote a model's strings (errors,
remarks, the cost table's group kinds) are printed through `terminal_text`.
"""

from __future__ import annotations

import re

_IDENTIFIER_JUNK = re.compile(r"[^0-9A-Za-z_]+")


def visible(text: str) -> str:
    """`text` with every unprintable character (line breaks, NUL, controls, lone
    surrogates) written as its Python escape; printable characters stay as they are."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def terminal_text(text: str) -> str:
    """`text` safe to print on a terminal (an error message quoting a model's strings): its
    line breaks (`\\n`) and tabs stay, every other unprintable character is written as its
    escape, so no escape sequence (ESC, CSI and the other C0 and C1 controls) reaches the
    terminal and no bidi control (U+202A-U+202E, U+2066-U+2069, marks) reorders what is shown."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else _escape(c) for c in text)


def _escape(c: str) -> str:
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
        f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")


def identifier(name: str, prefix: str = "v") -> str:
    """An ASCII identifier close to `name`: 'encoder.layer.0.w' -> 'encoder_layer_0_w';
    one starting with a digit, or empty once cleaned, gets `prefix`."""
    ident = _IDENTIFIER_JUNK.sub("_", name).strip("_") or prefix
    return f"{prefix}_{ident}" if ident[0].isdigit() else ident


# --- Python ---


def py_string(s: str) -> str:
    """A Python string literal of `s`: in double quotes where that is plain (weight names), else repr."""
    return f'"{s}"' if s.isprintable() and '"' not in s and "\\" not in s else repr(s)


def py_comment(text: str) -> str:
    """Text safe after a `#`: one line, nothing unprintable."""
    return visible(str(text))


def py_docstring(text: str) -> str:
    """A docstring (a string literal) saying `text`."""
    return py_string(visible(str(text)))


# --- C ---

_C_SIMPLE = {"\\": "\\\\", '"': '\\"', "?": "\\?", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def c_string_literal(s: str) -> str:
    """A C string literal holding the UTF-8 bytes of `s`: printable ASCII as itself, `?`
    escaped (no trigraph), every other byte as a three-digit octal escape (unlike a hex
    escape, it cannot swallow the character after it)."""
    out = []
    for b in s.encode("utf-8", "surrogatepass"):
        c = chr(b)
        if c in _C_SIMPLE:
            out.append(_C_SIMPLE[c])
        elif 0x20 <= b < 0x7F:
            out.append(c)
        else:
            out.append(f"\\{b:03o}")
    return '"' + "".join(out) + '"'


def c_comment(text: str) -> str:
    """A `/* ... */` comment saying `text` on one line: no line break, no `*/` or `/*`
    inside, no `??` (trigraphs), no backslash (a line splice)."""
    body = visible(str(text)).replace("\\", "\\\\")
    while "*/" in body or "/*" in body or "??" in body:
        body = body.replace("*/", "* /").replace("/*", "/ *").replace("??", "? ?")
    return f"/* {body} */"


__all__ = ["visible", "identifier", "py_string", "py_comment", "py_docstring", "c_string_literal", "c_comment"]
