"""The native CPU backend: a model becomes one C module, compiled and loaded in-process.

    source = emit(model)                      # C11 + OpenMP source (see emit.py)
    compiled = load(source, model.weights, model)
    outputs = compiled(x)                     # list of np.ndarray

GEMMs and convolutions run on oneDNN with weights packed once; everything else is
emitted loops. Ops it does not lower run on the host (emit.HOST_FALLBACK).
"""

from tilegraph.backends.c.build import build_ahead
from tilegraph.backends.c.emit import HOST_FALLBACK, emit_program
from tilegraph.backends.c.runtime import CompiledModel, Workspace, load, planned_bytes, remember
from tilegraph.ir.arena import register_layout

# fuse and tile decide against this backend's own calibrated kernels (backends/c/calibrate.py).
HARDWARE = "c"
# The recompute pass prices a budget on this hardware as an emitted call holds it: arena and outputs.
register_layout(HARDWARE, planned_bytes)


def emit(model, name=None) -> str:
    return remember(model, emit_program(model, name))


def compile_model(model, name=None) -> CompiledModel:
    return load(emit(model, name), model.weights, model)


__all__ = ["emit", "load", "compile_model", "build_ahead", "CompiledModel", "Workspace", "HOST_FALLBACK"]
