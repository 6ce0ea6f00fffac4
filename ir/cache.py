"""Cache entries nobody else can plant or spoil: what the C modules and the compile cache keep on disk.

A cached shared library is loaded (its constructors run) and a cached model is what an
unchanged model file computes, so a cache is trusted as much as the code: like ssh with
~/.ssh, tilegraph uses a cache folder only if it is the user's own and nobody else can
write to it (created 0700; one it owns that others can read is closed to 0700), and
otherwise warns once and works in a private temporary folder for the rest of the process.
Every entry is written 0600, atomically, with a SHA-256 digest beside it (`<name>.sha256`);
`verified` checks owner, mode and digest before an entry is used, so a damaged, truncated
or edited entry is rebuilt rather than loaded.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path

from tilegraph.ir.hardware import cache_dir

DIGEST = ".sha256"


def _unsafe(path: Path) -> str | None:
    """Why `path` (an existing folder) cannot hold trusted entries, or None; a folder of ours
    that others may read but not write is closed to 0700 on the way."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} (mode {st.st_mode & 0o777:o})"
    if st.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as e:
            return f"not closable to mode 700 ({e.strerror})"
    return None


@functools.lru_cache(maxsize=None)
def _private_fallback() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="tilegraph-cache-"))  # 0700, ours
    atexit.register(shutil.rmtree, tmp, True)
    return tmp


_warned: set[str] = set()


def private_dir(*parts: str) -> Path:
    """cache_dir()/parts, every level checked (or created 0700); a private temporary folder,
    with a warning, where one is not safe to use."""
    root = cache_dir()
    folder = root.joinpath(*parts)
    level = root
    why: str | None
    for name in ("", *parts):
        level = level / name if name else level
        try:
            level.mkdir(mode=0o700, parents=not name, exist_ok=True)
        except OSError as e:
            why = f"not creatable ({e.strerror})"
        else:
            why = _unsafe(level)
        if why:
            if str(level) not in _warned:
                _warned.add(str(level))
                warnings.warn(f"tilegraph: not using the cache folder {level}: it is {why}; a cache others can "
                              f"write to could make this process run their code. Compiling into a private "
                              f"temporary folder instead.", stacklevel=3)
            fallback = _private_fallback().joinpath(*parts)
            fallback.mkdir(mode=0o700, parents=True, exist_ok=True)
            return fallback
    return folder


def _digest_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST)


def place(made: Path, path: Path) -> None:
    """Moves the file `made` (in path's folder) to `path`, mode 0600, its digest beside it."""
    os.chmod(made, 0o600)
    digest = _digest_of(made)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".digest-")  # 0600
    with os.fdopen(fd, "w") as f:
        f.write(digest)
    os.replace(tmp, _digest_path(path))
    os.replace(made, path)


def verified(path: Path) -> bool:
    """`path` is an entry this user wrote, nobody else can write, whose bytes match its digest."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return False
        return _digest_path(path).read_text().strip() == _digest_of(path)
    except (OSError, ValueError):
        return False


def remove(path: Path) -> None:
    """An entry and its digest gone (a damaged one, before it is rebuilt)."""
    for p in (path, _digest_path(path)):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
