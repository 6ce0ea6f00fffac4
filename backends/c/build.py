"""Compiling an emitted C module: the system C compiler, oneDNN from its wheel, a cache.

Two shared libraries, each cached on disk under a key of everything that decides its
bytes: the compiler's identity, the flags and the processor's features (a library
built with -march=native on one CPU must never be loaded on another: these machines
change between AVX-512 and older processors), and its sources.
  - The runtime (runtime.c with runtime.h: oneDNN's glue and the row kernels; attention.c:
    flash attention), compiled once per toolchain and flags: `runtime()`.
  - Each model's module (its emitted source), linked against that runtime, which it
    finds beside itself in the cache folder ($ORIGIN): `build()`. Its key holds the
    runtime's, so a changed runtime or header makes new modules.
A model's build thus compiles only its own code.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from tilegraph.ir import cache
from tilegraph.ir.errors import TilegraphError

RUNTIME_H = Path(__file__).with_name("runtime.h")
RUNTIME_C = Path(__file__).with_name("runtime.c")
# Compiled into the runtime beside runtime.c: convolutions (conv.c), flash attention and its
# backward (attention.c, attention_backward.c), Winograd convolutions (winograd.c),
# strided 1-D convolutions as matmuls (strided_conv.c), one-row matmuls (gemv.c), the
# block-format and KV-cache kernels (blockq.c, with its header, the SIMD variants and decode.c it includes).
RUNTIME_EXTRA = [Path(__file__).with_name(n) for n in ("conv.c", "attention.c", "attention_backward.c", "winograd.c",
                                                     "strided_conv.c", "gemv.c", "blockq.h", "blockq_simd.h", "blockq.c", "decode.c")]
INCLUDED = ("conv.c", "attention.c", "attention_backward.c", "winograd.c", "strided_conv.c", "gemv.c", "blockq.c")  # (blockq.c includes the rest)
# -fwrapv: signed integer overflow wraps, as NumPy's does. -fno-math-errno lets the
# compiler inline and vectorise math functions (errno is never read). No -ffast-math:
# NaN, infinities and signed zeros keep their IEEE meaning.
# A call to an undeclared function is an error: implicit, a function the linked oneDNN lacks
# compiled and returned garbage (warnings are not silenced with -w, which would hide it too).
CFLAGS = ["-std=gnu11", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fwrapv", "-fno-math-errno",
          "-Werror=implicit-function-declaration"]
# TILEGRAPH_C_SANITIZE=address builds modules with AddressSanitizer (tests/test_c_asan.py
# runs them in a process with libasan preloaded); the flags are part of the cache key.
SANITIZERS = {"address": ["-fsanitize=address", "-fno-omit-frame-pointer"]}
# A model's module is compiled with these after CFLAGS (the last -O wins); the runtime,
# compiled once, keeps -O3. Measured (benchmarks/c_opt_levels.py, MiniLM, one thread,
# 2026-11-24): -O1 compiles the module in half the time (0.56 vs 1.08 s) and runs as fast
# (0.98x and 0.99x -O3 at batch 1 and 8; its 47 `omp simd` loops are vectorised at both
# levels), but the CNN's pooling loops over channels, which carry no `omp simd`, are
# vectorised only at -O3; so -O3 until the emitter marks them.
MODULE_OPT = ["-O3"]


class BuildError(TilegraphError):
    """The C backend cannot build here (no compiler, no oneDNN, a compiler error)."""


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("the C backend needs a C compiler with OpenMP: install gcc (Debian/Ubuntu: "
                         "`apt-get install gcc`), or set CC; target='numpy' runs without one")
    return cc


@functools.lru_cache(maxsize=1)
def onednn() -> tuple[Path, Path]:
    """(include dir, lib dir) of oneDNN as the onednn-cpu-gomp wheels install it."""
    try:
        files = importlib.metadata.files("onednn-devel-cpu-gomp") or []
        header = next(f for f in files if str(f).endswith("oneapi/dnnl/dnnl.h"))
        lib_files = importlib.metadata.files("onednn-cpu-gomp") or []
        lib = next(f for f in lib_files if str(f).endswith("libdnnl.so"))
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        raise BuildError("the C backend needs oneDNN: pip install onednn-cpu-gomp onednn-devel-cpu-gomp "
                         "(the 'c' extra of tilegraph)") from None
    include = Path(header.locate()).resolve().parents[2]
    return include, Path(lib.locate()).resolve().parent


def check_builds() -> None:
    """A BuildError saying what is missing, unless the C backend can build here."""
    compiler()
    onednn()


def builds_here() -> bool:
    try:
        check_builds()
    except BuildError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _toolchain_id() -> str:
    cc = compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"the C compiler {cc} does not run: {e}") from None
    cpu = ""
    try:
        cpu = "\n".join(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith(("flags", "model name")))[:4096]
    except OSError:
        pass
    native = subprocess.run([cc, "-march=native", "-Q", "--help=target"], capture_output=True, text=True).stdout
    return "\n".join([cc, version, cpu, native])


def sanitizer() -> str:
    """The sanitizer TILEGRAPH_C_SANITIZE names, or "" (read per build, so a test can set it)."""
    name = os.environ.get("TILEGRAPH_C_SANITIZE", "")
    if name and name not in SANITIZERS:
        raise BuildError(f"TILEGRAPH_C_SANITIZE={name!r} is not one of {sorted(SANITIZERS)}")
    return name


def flags() -> list[str]:
    return CFLAGS + SANITIZERS.get(sanitizer(), [])


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


_runtime_lock = threading.Lock()  # one build of the runtime at a time; a second caller waits for it


def runtime(cflags: list[str] | None = None) -> Path:
    """The runtime's shared library for these flags, compiled now or found in the cache."""
    cflags = flags() if cflags is None else cflags
    with _runtime_lock:
        # oneDNN's directories are part of the key: the library records its lib dir as its run
        # path, and a runtime built against another environment's oneDNN (since removed) fails to load.
        key = _key(_toolchain_id(), " ".join(cflags), *map(str, onednn()), RUNTIME_H.read_text(), RUNTIME_C.read_text(),
                   *(p.read_text() for p in RUNTIME_EXTRA))
        target = cache.private_dir("c") / f"tgrt_{key}.so"
        if not cache.verified(target):  # absent, or damaged, edited or planted: built afresh
            source = RUNTIME_C.read_text() + "".join(f'\n#include "{n}"' for n in INCLUDED) + "\n"
            # The soname is the file's name: a module records it and finds it beside itself.
            _compile(source, target, cflags, [f"-Wl,-soname,{target.name}"],
                     "the runtime (runtime.c)")
    return target


def build_ahead() -> None:
    """Starts finding or building the runtime in a background thread: `tilegraph.compile`
    calls it before its import and passes, which run in Python on one core while the C
    compiler takes another, so a first build on a machine overlaps them. A failure is
    left for `build` to raise where it is reported."""
    def work(cflags):
        try:
            runtime(cflags)
        except Exception:  # noqa: BLE001 - build() meets it again and says what it is
            pass

    try:
        cflags = flags()
    except BuildError:
        return
    threading.Thread(target=work, args=(cflags,), name="tilegraph-c-runtime", daemon=True).start()


def build(source: str) -> Path:
    """The shared library of `source`, compiled now or found in the cache."""
    cflags = flags()
    rt = runtime(cflags)  # (also when the module is cached: it is the module's dependency)
    cflags = cflags + MODULE_OPT
    # rt.name holds the runtime's key: the toolchain, the base flags, runtime.h and runtime.c.
    target = rt.parent / f"tg_{_key(rt.name, ' '.join(cflags), source)}.so"
    if not cache.verified(target):
        # Always a dependency (the caller reads tg_error and tg_set_threads through the module),
        # even where the module calls nothing of it and the linker drops unused libraries.
        link = ["-Wl,--push-state,--no-as-needed", str(rt), "-Wl,--pop-state", "-Wl,-rpath,$ORIGIN"]
        _compile(source, target, cflags, link, "the emitted module")
    return target


def _compile(source: str, target: Path, cflags: list[str], link: list[str], what: str) -> None:
    include, libdir = onednn()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "module.c"
        src.write_text(source)
        out = Path(tmp) / "module.so"
        cmd = [compiler(), *cflags, f"-I{RUNTIME_H.parent}", f"-I{include}", str(src), "-o", str(out), *link,
               f"-L{libdir}", "-ldnnl", f"-Wl,-rpath,{libdir}", "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"the C compiler failed on {what}:\n{done.stderr[-4000:]}")
        cache.place(out, target)  # atomic, 0600, with its digest: a concurrent build of the same key is harmless
