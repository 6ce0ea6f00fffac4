"""ONNX's backend API (`onnx.backend.base`) over tilegraph, so `onnx.backend.test` runs through it.

    rep = Backend.prepare(model_proto)      # imports (frontends.onnx) and compiles (tilegraph.compile)
    outputs = rep.run([x, y])              # NumPy in, NumPy out, in the dtypes ONNX declares

What it decides: a model is imported once at `prepare`, which is where an
unsupported model fails (one `FrontendError` listing every unsupported op). A
model that needs some inputs' values at import time (a Reshape whose shape is a
graph input, as many node tests have) raises `StaticInputNeeded` naming them;
the rep then imports it again at each `run` with those inputs folded in as
`constant_inputs`, and caches the result by their values. Execution is one
function, `executable`.
"""

from __future__ import annotations

import os

from typing import Any, Callable, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend as _OnnxBackend
from onnx.backend.base import BackendRep as _OnnxBackendRep
from onnx.backend.base import Device, DeviceType, namedtupledict

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx import StaticInputNeeded, from_onnx, load_model
from tilegraph.ir import dtypes
from tilegraph.ir.model import Model


# The pass pipeline conformance runs through: None is tilegraph's default pipeline.
PIPELINE = None
# The backend the cases run on ("numpy", the reference, or "c").
TARGET = os.environ.get("TILEGRAPH_ONNX_BACKEND_TARGET", "numpy")


def executable(model: Model) -> Callable[[Sequence[np.ndarray]], list[np.ndarray]]:
    """The one place that turns an imported model into something that runs: NumPy in, NumPy out.

    Outputs come back in the model's declared dtypes, which the import checked
    against ONNX's.
    """
    import tilegraph

    compiled = tilegraph.compile(model, target=TARGET, pipeline=PIPELINE)
    out_dtypes = [dtypes.numpy_dtype(t.dtype) for t in model.outputs]

    def run(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        outs = compiled.run(*inputs)
        return [np.asarray(o).astype(dt, copy=False) for o, dt in zip(outs, out_dtypes)]

    return run


class BackendRep(_OnnxBackendRep):
    """A prepared model: `run(inputs)` returns the outputs as a namedtuple, in graph order."""

    def __init__(self, proto: onnx.ModelProto):
        self.proto = proto
        initializers = {t.name for t in proto.graph.initializer}
        self.input_names = [i.name for i in proto.graph.input if i.name not in initializers]
        self.output_names = [o.name for o in proto.graph.output]
        self.static_inputs: tuple[str, ...] = ()  # inputs the import needs the values of
        self._models: dict[tuple, Callable] = {}
        try:
            self._models[()] = self._compile(from_onnx(proto))  # type: ignore[assignment]
        except StaticInputNeeded as e:
            self.static_inputs = tuple(sorted(e.inputs))
            if not self.static_inputs:
                raise

    def run(self, inputs: Any, **kwargs: Any):
        arrays = self._bind(inputs)
        model, run = self._model_for(arrays)
        outs = run([arrays[n] for n in model.input_names])
        return namedtupledict("Outputs", self.output_names)(*outs)

    def _bind(self, inputs: Any) -> dict[str, np.ndarray]:
        if isinstance(inputs, dict):
            arrays = {k: np.asarray(v) for k, v in inputs.items()}
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            inputs = list(inputs)
            if len(inputs) != len(self.input_names):
                raise FrontendError(f"the model takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                                    f"got {len(inputs)}")
            arrays = {n: np.asarray(v) for n, v in zip(self.input_names, inputs)}
        missing = [n for n in self.input_names if n not in arrays]
        if missing:
            raise FrontendError(f"missing inputs {missing}")
        return arrays

    @staticmethod
    def _compile(model: Model) -> tuple[Model, Callable]:
        return model, executable(model)

    def _model_for(self, arrays: dict[str, np.ndarray]) -> tuple[Model, Callable]:
        while True:
            key = tuple((n, arrays[n].dtype.str, arrays[n].shape, arrays[n].tobytes()) for n in self.static_inputs)
            if key in self._models:
                return self._models[key]  # type: ignore[return-value]
            try:
                model = from_onnx(self.proto, constant_inputs={n: arrays[n] for n in self.static_inputs})
            except StaticInputNeeded as e:
                more = set(e.inputs) - set(self.static_inputs)
                if not more:
                    raise
                self.static_inputs = tuple(sorted(set(self.static_inputs) | more))
                continue
            self._models[key] = self._compile(model)  # type: ignore[assignment]
            return self._models[key]  # type: ignore[return-value]


class Backend(_OnnxBackend):
    """tilegraph as an ONNX backend: CPU only."""

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> BackendRep:
        if not cls.supports_device(device):
            raise FrontendError(f"tilegraph's ONNX backend runs on CPU, not {device}")
        return BackendRep(load_model(model))

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return Device(device).type == DeviceType.CPU


prepare = Backend.prepare
run_model = Backend.run_model
supports_device = Backend.supports_device
