"""Backends: each turns a tg model into source text and loads that source to run.

A backend module has `emit(model) -> str` and `load(source, weights, model=None)`
returning a callable (inputs in, list of NumPy arrays out). `TARGETS` maps each
target name that `tilegraph.compile` accepts to its module, imported only when used.
Each backend also declares how it lowers every op of the table, registered in
`backends/lowering.py`'s `BACKENDS` (the module docstring there says how).
"""

from __future__ import annotations

import functools
import glob
import importlib
import os
import warnings
from types import ModuleType

from tilegraph.ir.errors import TilegraphError

TARGETS: dict[str, str] = {
    "numpy": "tilegraph.backends.numpy",
    "triton": "tilegraph.backends.triton",
    "c": "tilegraph.backends.c",
}


@functools.lru_cache(maxsize=1)
def default_cpu_target() -> str:
    """The CPU backend `tilegraph.compile` uses when given no target: the native one ("c")
    where a C compiler and oneDNN are installed, else NumPy, saying why once."""
    from tilegraph.backends.c.build import BuildError, compiler, onednn

    try:
        compiler()
        onednn()
    except BuildError as e:
        warnings.warn(f"tilegraph compiles for target 'numpy', not the native 'c': {e}", stacklevel=3)
        return "numpy"
    return "c"


def backend(target: str) -> ModuleType:
    """The backend module for `target`; a TilegraphError listing the targets otherwise."""
    if target not in TARGETS:
        raise TilegraphError(f"unknown target '{target}'; tilegraph compiles for: {', '.join(TARGETS)}")
    return importlib.import_module(TARGETS[target])


def interpret_triton_without_gpu() -> None:
    """On a machine with no NVIDIA device, set TRITON_INTERPRET=1 (unless set): Triton
    reads it when a function is decorated, so this must run before anything imports
    triton; `import tilegraph` calls it. Device files, not torch: cheap to ask."""
    if "TRITON_INTERPRET" not in os.environ and not glob.glob("/dev/nvidia[0-9]*"):
        os.environ["TRITON_INTERPRET"] = "1"
