"""Backends: each turns a tg model into source text and loads that source to run.

Each backend is described once, in `BACKENDS` below: its name, the package that emits
(`emit(model) -> str`) and loads (`load(source, weights, model=None)`, a callable from
inputs to NumPy arrays), its lowering table (`backends/lowering.py` says what one
declares), how it measures the hardware profile its passes decide by, and whether it
can run on this machine. The compile targets, the lowering-table registry, the profile
calibrators of `ir/hardware.py` and the differential fuzzer's backends are read off it;
a module is imported only when used.
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from tilegraph.ir import hardware as _hardware
from tilegraph.ir.errors import TilegraphError


@dataclass(frozen=True)
class Backend:
    name: str
    package: str | None  # emit + load: a target of tilegraph.compile; None for an exporter
    lowerings: str  # "module:attribute" of its lowering table
    profile: str | None = None  # the hardware profile (ir/hardware.py) its own kernels are measured into
    calibrate: str | None = None  # "module:function" measuring that profile (quick=True: in seconds)
    available: str | None = None  # "module:function" saying whether it runs here; None: it always does
    # Its preparation pipeline: the IR rewrites it needs before it emits, as passes (name,
    # "module:class"), run in order by its emitter; `import tilegraph` registers them by name.
    passes: tuple[tuple[str, str], ...] = ()


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("numpy", "tilegraph.backends.numpy", "tilegraph.backends.numpy.emit:LOWERINGS",
            profile="cpu", calibrate="tilegraph.backends.numpy.calibrate:measure"),
    Backend("c", "tilegraph.backends.c", "tilegraph.backends.c.emit:LOWERINGS",
            profile="c", calibrate="tilegraph.backends.c.calibrate:measure",
            available="tilegraph.backends.c.build:builds_here"),
    Backend("triton", "tilegraph.backends.triton", "tilegraph.backends.triton.lowering:LOWERINGS",
            available="tilegraph.backends:triton_installed",
            passes=(("triton-quantized-groups", "tilegraph.backends.triton.prepare:QuantizedGroups"),
                    ("triton-kernel-groups", "tilegraph.backends.triton.prepare:KernelGroups"))),
    Backend("onnx", None, "tilegraph.backends.onnx_export:LOWERINGS"),
)}

# The targets tilegraph.compile accepts.
TARGETS: tuple[str, ...] = tuple(name for name, b in BACKENDS.items() if b.package)


def attribute(path: str) -> Any:
    """The object a "module:attribute" path names (imported now)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def runs_here(name: str) -> bool:
    """Whether backend `name` can run on this machine."""
    check = BACKENDS[name].available
    return check is None or bool(attribute(check)())


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _calibration(path: str):
    return lambda quick=True: attribute(path)(quick=quick)


# Each backend that measures its own kernels measures the profile it is named for, on
# first use (ir/hardware.py sits below the backends and is handed the function).
for _b in BACKENDS.values():
    if _b.calibrate:
        _hardware.register_calibration(_b.profile, _calibration(_b.calibrate))


@functools.lru_cache(maxsize=1)
def default_cpu_target() -> str:
    """The CPU backend `tilegraph.compile` uses when given no target: the native one ("c")
    where a C compiler and oneDNN are installed, else NumPy, saying why once."""
    from tilegraph.backends.c.build import BuildError, check_builds

    try:
        check_builds()
    except BuildError as e:
        warnings.warn(f"tilegraph compiles for target 'numpy', not the native 'c': {e}", stacklevel=3)
        return "numpy"
    return "c"


def backend(target: str) -> ModuleType:
    """The backend module for `target`; a TilegraphError listing the targets otherwise."""
    if target not in TARGETS:
        raise TilegraphError(f"unknown target '{target}'; tilegraph compiles for: {', '.join(TARGETS)}")
    return importlib.import_module(BACKENDS[target].package)  # type: ignore[arg-type]


def interpret_triton_without_gpu() -> None:
    """On a machine with no NVIDIA device, set TRITON_INTERPRET=1 (unless set): Triton
    reads it when a function is decorated, so this must run before anything imports
    triton; `import tilegraph` calls it. Device files, not torch: cheap to ask."""
    if "TRITON_INTERPRET" not in os.environ and not glob.glob("/dev/nvidia[0-9]*"):
        os.environ["TRITON_INTERPRET"] = "1"
