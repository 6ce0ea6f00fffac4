"""Loading and calling an emitted NumPy module.

`load` compiles the module source once, under a filename registered with
`linecache` so that a traceback shows the emitted line that failed, and calls its
`build(W)` with the weights. `CompiledModel` checks each call's inputs against the
signature the module carries (`INPUTS`) before running `forward`, with the one
input check of the project (`ir.signature`, which the interpreter uses too).
"""

from __future__ import annotations

import hashlib
import linecache
import traceback
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tilegraph.ir import dtypes
from tilegraph.ir.model import Model, ModelError
from tilegraph.ir.shapes import ShapeError
from tilegraph.ir.signature import Signature, SizeConditions, index_checks


# An emitted module's filename, as tracebacks and linecache show it: this, its digest, ">".
MODULE_FILENAME = "<tilegraph-numpy-"


class CompiledModel:
    """A loaded module: call it with the model inputs, get the list of outputs."""

    def __init__(self, forward: Callable[..., list], inputs, outputs, source: str, model: Model | None = None):
        self._forward = forward
        self._signature = Signature(inputs, index_checks(model) if model is not None else ())
        self.source = source
        self.model = model
        self.input_names = [row[0] for row in inputs]
        self.output_names = [row[0] for row in outputs]
        self.output_dtypes = [dtypes.numpy_dtype(row[2]) for row in outputs]
        self._conditions: SizeConditions | None = None
        self._checked_sizes: set[tuple] = set()

    def __call__(self, *inputs: Any, **named: Any) -> list[np.ndarray]:
        if named and inputs:
            raise ShapeError("give the inputs either all by position or all by name")
        arrays, sizes = self._signature.bind(named if named else inputs)
        key = tuple(sorted(sizes.items()))
        if self.model is not None and key not in self._checked_sizes:
            # every value's dims non-negative integers at these sizes, as the C backend checks
            if self._conditions is None:
                self._conditions = SizeConditions.of(self.model)
            self._conditions.check(sizes)
            if len(self._checked_sizes) < 1024:
                self._checked_sizes.add(key)
        try:
            return self._forward(*arrays)
        except MemoryError as e:
            # A shape the model computes may be absurd (a corrupted file's 2**40 padding):
            # name the emitted line, which names the value and its op, not NumPy's allocator.
            raise ModelError(f"out of memory running the model, at `{_emitted_line(e)}`: {e}") from None
        except (IndexError, ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
            # Inputs valid for the signature that the model's own computation cannot take (a
            # position past its table): the emitted line names the value and its op.
            if _emitted_line(e) == "?":
                raise
            raise ModelError(f"the model cannot run on these inputs, at `{_emitted_line(e)}`: "
                             f"{type(e).__name__}: {e}") from e  # the cause keeps the emitted frames

    def check(self, values: Sequence[Any] | Mapping[str, Any]) -> list[np.ndarray]:
        """The inputs as arrays of the declared dtypes; ShapeError/DTypeError naming the input otherwise."""
        return self._signature.bind(values)[0]

    def __repr__(self) -> str:
        return f"CompiledModel({', '.join(self.input_names)} -> {', '.join(self.output_names)})"


def _emitted_line(error: BaseException) -> str:
    """The last line of an emitted module that `error` passed through."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(MODULE_FILENAME)]
    return (frames[-1].line or "?").strip() if frames else "?"


def load(source: str, weights: Mapping[str, np.ndarray], model: Model | None = None) -> CompiledModel:
    """Compile an emitted module once and bind its weights; returns the callable model."""
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    filename = f"{MODULE_FILENAME}{digest}>"
    # Registered lines let tracebacks (and inspect) show the emitted source; an
    # mtime of None tells linecache.checkcache to keep the entry.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": f"tilegraph_numpy_{digest}"}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated module
    missing = [w for w in namespace["WEIGHTS"] if w not in weights]
    if missing:
        raise ModelError("weights missing for the compiled model: " + ", ".join(missing))
    forward = namespace["build"](weights)
    return CompiledModel(forward, namespace["INPUTS"], namespace["OUTPUTS"], source, model)
