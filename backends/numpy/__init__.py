"""The NumPy backend: a model becomes one readable Python module that calls NumPy.

    source = emit(model)                      # the module's text (see emit.py)
    compiled = load(source, model.weights)    # compiled once; weights bound once
    outputs = compiled(x)                     # list of np.ndarray

`compile_model(model)` does both.
"""

from tilegraph.backends.numpy.emit import emit, liveness
from tilegraph.backends.numpy.runtime import CompiledModel, load


def compile_model(model, name=None) -> CompiledModel:
    """emit + load: the model's module, ready to call."""
    return load(emit(model, name), model.weights, model)


__all__ = ["emit", "load", "compile_model", "CompiledModel", "liveness"]
