"""Compiled models on disk: a model file compiled again skips its import and its passes.

`tilegraph.compile(path)` spends nearly all its time importing and running the passes
(fusion and tiling price every candidate with the cost model, symbolically where dims
are). Their result depends only on what the key holds:
  - the bytes of the model file and of every file it reads beside it (an ONNX model's
    external data, a `.mlir` file's weights);
  - the pipeline and the hardware it decides for (and `hardware.decision_context()`: the
    processor and the compile-time switches);
  - the library's own source, so a changed pass never reuses an old result.
The value is the model after the passes, as `.mlir` text and weights (`Model.save`), read
back with `Model.load`, which parses and verifies it: nothing in the cache is run as code.
Entries live in a folder only this user can write (`ir/cache.py`), each with a digest
checked before it is read: an edited or damaged entry is compiled afresh, never used.
TILEGRAPH_COMPILE_CACHE=0 turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

from tilegraph.ir import cache
from tilegraph.ir.cache import private_dir
from tilegraph.ir.hardware import decision_context
from tilegraph.ir.model import Model, weights_path

MAX_BYTES = 2 << 30
PACKAGES = ("tilegraph", "tilegraph.ir", "tilegraph.passes", "tilegraph.backends", "tilegraph.frontends")


@functools.lru_cache(maxsize=1)
def _library_digest() -> str:
    """A hash of every source file of the library, wherever its packages live (a checkout
    keeps ir/ beside tilegraph/, a wheel inside it)."""
    files = set()
    for name in PACKAGES:  # each package's own folder (tilegraph's __path__ also holds the checkout root)
        files.update(Path(importlib.util.find_spec(name).origin).resolve().parent.rglob("*.py"))
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(str(f).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _companions(path: Path, data: bytes) -> list[Path] | None:
    """The files `path` (holding `data`) reads besides itself, or None when that cannot be
    told (then nothing is cached)."""
    suffix = path.suffix.lower()
    if suffix == ".mlir":
        w = weights_path(path)
        return [w] if w.is_file() else []
    # An ONNX tensor kept in another file names it under the key "location"; a file without
    # those bytes has none (parsing a large model just to find that out would cost more).
    if suffix != ".onnx" or b"location" not in data:
        return []
    try:
        import onnx
        from onnx.external_data_helper import _get_all_tensors, uses_external_data

        files = set()
        for t in _get_all_tensors(onnx.load_model_from_string(data)):
            if uses_external_data(t):
                location = next((e.value for e in t.external_data if e.key == "location"), "")
                file = (path.parent / location).resolve()
                if path.parent.resolve() not in file.parents:  # outside the model's folder: the importer
                    return None  # refuses it, and the key must not read it first
                files.add(file)
    except Exception:  # noqa: BLE001 - a file onnx cannot read is the importer's to report
        return None
    return sorted(files)


def key(path: Path, pipeline: str | None, hardware: str) -> str | None:
    """The cache key of compiling `path`, or None when it is not cached."""
    if os.environ.get("TILEGRAPH_COMPILE_CACHE", "1") == "0" or not path.is_file():
        return None
    data = path.read_bytes()
    others = _companions(path, data)
    if others is None or not all(f.is_file() for f in others):
        return None
    context = decision_context()
    h = hashlib.sha256(f"{pipeline!r}\0{hardware}\0{context}\0{_library_digest()}\0".encode())
    h.update(hashlib.sha256(data).digest())
    for f in others:
        h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:32]


def _entry(k: str) -> Path:
    return private_dir("compiled") / f"{k}.mlir"


def lookup(k: str) -> Model | None:
    path = _entry(k)
    if not (cache.verified(path) and cache.verified(weights_path(path))):  # absent, damaged or edited
        return None
    try:
        model = Model.load(path)
        os.utime(path)  # recently used: _trim keeps it
        return model
    except Exception:  # noqa: BLE001 - a damaged entry is recompiled, not reported
        return None


def store(k: str, model: Model) -> None:
    path = _entry(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        saved = model.save(Path(tmp) / path.name)
        # The weights first: an entry exists once its .mlir does.
        cache.place(weights_path(saved), weights_path(path))
        cache.place(saved, path)
    _trim(path.parent)


def _trim(folder: Path) -> None:
    """Drops the least recently written entries past MAX_BYTES (every library change makes
    new keys, and a model's weights are in each entry)."""
    entries = []
    for f in folder.glob("*.mlir"):
        try:
            entries.append((f.stat().st_mtime, f.stat().st_size + weights_path(f).stat().st_size, f))
        except OSError:
            continue
    total = sum(size for _, size, _ in entries)
    for _, size, f in sorted(entries):
        if total <= MAX_BYTES:
            break
        for part in (f, weights_path(f)):
            cache.remove(part)
        total -= size
