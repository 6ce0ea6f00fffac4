"""An allow-list for `.pt2` archives: what torch's loader may see of a file from a stranger.

`torch.export.load` (torch 2.13) has more ways to run a file's code than to read its
tensors: it unpickles (`weights_only=False`) weights and constants marked `use_pickle`,
custom and opaque objects, the legacy (pre-2.8) layout's state dict and constants, and
sample inputs the restricted unpickler refuses; it `dlopen`s any shared library under
`data/aotinductor/`; its deserializer `eval`s every symbolic expression in the program
(`sympy.sympify` of `expr_str`), resolves node targets by `getattr` anywhere under `torch`,
`operator` and `math`, and keeps `guards_code` that `ExportedProgram.module()` compiles.

So tilegraph never hands torch the file. `checked_archive` reads it with Python's own zip
reader, accepts only the members torch's current plain layout writes (below), refuses the
rest by name, checks what each accepted member holds (payload configs with no pickle, raw
tensor records, sample inputs that `weights_only=True` reads, a program whose expressions
are sympy constructors of numbers and names and whose targets are ATen/prims ops or
integer arithmetic) and writes those members, and only those, into a new archive in memory:
torch reads the bytes that were checked, never a second zip reader's view of the file.

torch's deserializer still runs, on bytes that hold nothing but the above; `load_pt2(...,
trust_pickle=True)` skips all of this for a file the caller made (pickled tensor subclasses).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path
from typing import NoReturn

from tilegraph.frontends import FrontendError

# Members of torch 2.13's plain layout (torch/csrc/export/pt2_archive_constants.h), below the
# archive's one root folder; {m} is a model name, {i} a record number. Nothing else is read.
_MODEL = r"[A-Za-z0-9_]+"
MEMBERS = {
    "format": re.compile(r"archive_format"),
    "version": re.compile(r"archive_version"),
    "zip_version": re.compile(r"\.data/version"),
    "serialization_id": re.compile(r"\.data/serialization_id"),
    "byteorder": re.compile(r"byteorder"),
    "program": re.compile(rf"models/({_MODEL})\.json"),
    "weights_config": re.compile(rf"data/weights/({_MODEL})_weights_config\.json"),
    "weight": re.compile(r"data/weights/(weight_[0-9]+)"),
    "constants_config": re.compile(rf"data/constants/({_MODEL})_constants_config\.json"),
    "constant": re.compile(r"data/constants/(tensor_[0-9]+)"),
    "sample_inputs": re.compile(rf"data/sample_inputs/({_MODEL})\.pt"),
}
# What each refused kind is, for the message.
REFUSED = {"data/aotinductor/": "an AOTInductor shared library, which loading would dlopen",
           "extra/": "an extra file", "data/executorch/": "an ExecuTorch program",
           "data/mtia/": "an MTIA program", "xl_model_weights/": "XL weights",
           "version": "the legacy (pre-2.8) layout, whose state dict loading unpickles",
           "serialized_": "the legacy (pre-2.8) layout, whose state dict loading unpickles"}

# Node targets the deserializer may resolve: ATen and prims operator overloads, and the
# integer arithmetic torch.export writes for symbolic sizes. `operator.call`,
# `methodcaller` and anything reached by getattr under `torch` (torch.os...) are not.
_TARGET = re.compile(
    r"torch\.ops\.(aten|prims)\.[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*"
    r"|_operator\.(add|sub|mul|truediv|floordiv|mod|pow|neg|pos|abs|eq|ne|lt|le|gt|ge|and_|or_|not_|xor"
    r"|invert|getitem)"
    r"|math\.(ceil|floor|trunc|sqrt)"
    r"|torch\.(sym_float|sym_int|sym_max|sym_min|sym_not|sym_ite|sym_sqrt|sym_sum|_sym_sqrt)")

# A symbolic expression as torch writes it (sympy's srepr: `Mul(Integer(2), Symbol('s77',
# integer=True, positive=True))`): names, numbers, quoted names, parentheses, commas, `=`
# and arithmetic. No attribute access, subscripts, dunders or other quoting.
_EXPR_TOKEN = re.compile(r"\s+|(?P<name>[A-Za-z][A-Za-z0-9_]*)|[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?"
                         r"|'([A-Za-z][A-Za-z0-9_]*|[-+]?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?)'|[(),=\-]")


def _expr_names() -> frozenset[str]:
    """The names an expression may call: sympy's expression classes and singletons, torch's
    sympy functions, and the assumption keywords of `Symbol`."""
    import sympy
    from sympy.core.assumptions import _assume_defined
    from torch.utils._sympy import functions

    names = {"True", "False"} | set(_assume_defined)
    for module in (sympy, functions):
        for name in dir(module):
            value = getattr(module, name)
            if name[:1].isalpha() and (isinstance(value, type) and issubclass(value, sympy.Basic)
                                       or isinstance(value, sympy.Basic)):
                names.add(name)
    return frozenset(names)


_NAMES: frozenset[str] | None = None


def check_expression(text: str) -> None:
    """ValueError unless `text` is a sympy expression made of allowed names and literals."""
    global _NAMES
    if _NAMES is None:
        _NAMES = _expr_names()
    pos = 0
    while pos < len(text):
        m = _EXPR_TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"character {pos} ({text[pos:pos + 10]!r}) is not part of a sympy expression")
        if m.group("name") and m.group("name") not in _NAMES:
            raise ValueError(f"{m.group('name')!r} is not a sympy expression class")
        pos = m.end()


def _walk(value, found: list) -> None:
    """Every dict in a parsed JSON value, depth first."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            found.append(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _check_program(data: bytes) -> bytes:
    """The program JSON re-serialized, after its expressions and targets are checked; guards
    code (Python source `module()` compiles) dropped: tilegraph checks shapes itself."""
    program = json.loads(data)
    if not isinstance(program, dict):
        raise ValueError("the program is not a JSON object")
    dicts: list = []
    _walk(program, dicts)
    for d in dicts:
        expr = d.get("expr_str")
        if expr is not None:
            if not isinstance(expr, str):
                raise ValueError(f"expr_str {expr!r} is not a string")
            check_expression(expr)
        if "target" in d and "inputs" in d:  # a graph node
            if not isinstance(d["target"], str) or not _TARGET.fullmatch(d["target"]):
                raise ValueError(f"node target {str(d['target'])[:80]!r} is not an ATen/prims op or integer arithmetic")
    program["guards_code"] = []
    return json.dumps(program).encode()


def _check_config(data: bytes, kind: str, records: set[str]) -> bytes:
    """A payload config whose every entry is a raw tensor record present in the archive."""
    config = json.loads(data)
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise ValueError("no 'config' object")
    for fqn, meta in entries.items():
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
            raise ValueError(f"{fqn!r} is a pickled object, and unpickling runs code")
        if meta.get("path_name") not in records:
            raise ValueError(f"{fqn!r} names {str(meta.get('path_name'))[:80]!r}, not a {kind} record of the archive")
        if not isinstance(meta.get("tensor_meta"), dict):
            raise ValueError(f"{fqn!r} has no tensor_meta")
    return json.dumps(config).encode()


def _check_sample_inputs(data: bytes) -> bytes:
    """The sample inputs as read by the restricted unpickler, saved again by torch."""
    import torch

    value = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(value, (tuple, dict)):
        raise ValueError(f"a {type(value).__name__}, not a tuple or dict")
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def checked_archive(path: str | Path) -> io.BytesIO:
    """The .pt2 at `path` rebuilt in memory from its allowed members, each checked; a
    FrontendError naming the first member refused (unknown, legacy, compressed, pickled)."""
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    def refuse(why: str) -> NoReturn:
        raise FrontendError(f"refusing {path}: {why}; tilegraph reads .pt2 archives in torch's plain "
                            "layout (programs, raw tensors, sample inputs), and nothing that would run code")

    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        raise FrontendError(f"cannot load the exported program {path}: not a .pt2 archive ({e})") from None
    with archive:
        infos = archive.infolist()
        roots = {info.filename.split("/", 1)[0] for info in infos}
        if len(roots) != 1 or any("/" not in info.filename for info in infos):
            legacy = any(info.filename in ("version", "serialized_exported_program.json") for info in infos)
            refuse("it is " + REFUSED["version"] if legacy else "its members do not share one root folder")
        members: dict[str, tuple[str, str | None, bytes]] = {}
        for info in infos:
            name = info.filename.split("/", 1)[1]
            if info.is_dir() and not name:
                continue
            kind = next((k for k, rx in MEMBERS.items() if rx.fullmatch(name)), None)
            if kind is None:
                what = next((w for prefix, w in REFUSED.items() if name.startswith(prefix)), "a member torch's "
                            "plain layout does not have")
                refuse(f"{info.filename!r} is {what}")
            if name in members:
                refuse(f"{info.filename!r} appears twice")
            if info.compress_type != zipfile.ZIP_STORED:
                refuse(f"{info.filename!r} is compressed (torch writes records stored)")
            try:
                data = archive.read(info)
            except (OSError, zipfile.BadZipFile, ValueError, RuntimeError, NotImplementedError) as e:
                raise FrontendError(f"cannot load the exported program {path}: {info.filename} ({e})") from None
            members[name] = (kind, MEMBERS[kind].fullmatch(name).groups()[0] if MEMBERS[kind].groups else None, data)
    kinds = {kind for kind, _, _ in members.values()}
    if "program" not in kinds or "format" not in kinds:
        refuse("it has no models/<name>.json program or archive_format (not torch's current layout)")
    weights = {key for kind, key, _ in members.values() if kind == "weight"}
    constants = {key for kind, key, _ in members.values() if kind == "constant"}
    out = io.BytesIO()
    with PT2ArchiveWriter(out) as writer:
        for name, (kind, _, data) in members.items():
            if kind in ("zip_version", "byteorder", "serialization_id"):
                continue  # the writer writes its own
            try:
                if kind == "program":
                    data = _check_program(data)
                elif kind == "weights_config":
                    data = _check_config(data, "weight", weights)
                elif kind == "constants_config":
                    data = _check_config(data, "constant", constants)
                elif kind == "sample_inputs":
                    data = _check_sample_inputs(data)
                elif data != {"format": b"pt2", "version": b"0"}.get(kind, data):
                    raise ValueError(f"unknown value {data[:20]!r}")
            except Exception as e:  # noqa: BLE001 - whatever a member's check or parser refuses
                refuse(f"{name} is not what torch's plain layout holds ({type(e).__name__}: {str(e)[:300]})")
            writer.write_bytes(name, data)
    out.seek(0)
    return out
