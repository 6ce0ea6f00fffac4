"""tilegraph: a compiler for machine-learning models, written in Python on xDSL.

    import tilegraph
    f = tilegraph.compile("model.onnx")           # or an nn.Module + example inputs, a .pt2, an ir.Model
    y = f(x)                                      # NumPy arrays or torch tensors in, NumPy out
    print(f.source)                               # the emitted code

`import_model` brings any supported source to an `ir.Model`; `compile` imports,
runs the pass pipeline and hands the result to a backend. Importing tilegraph
imports neither torch nor onnx: each frontend is imported when a model needs it.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Sequence

# Installed, `tilegraph.ir` (and passes, backends, frontends) lie inside this package,
# as the wheel's package-dir mapping puts them. In a checkout they are the repository's
# top-level folders; the subpackages are found there, and under no other name.
_CHECKOUT = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "ir").is_dir() and (_CHECKOUT / "ir" / "ops.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821  (a package's __path__)

import numpy as np  # noqa: E402

from tilegraph.backends import interpret_triton_without_gpu  # noqa: E402
from tilegraph.ir import Model  # noqa: E402
from tilegraph.ir.errors import TilegraphError  # noqa: E402
from tilegraph.ir.model import ModelError  # noqa: E402
# A .gguf file, or an ONNX decoder-with-past file (optimum's), as in-place generation.
from tilegraph.generation import LanguageModel  # noqa: E402

__all__ = ["compile", "import_model", "generate", "LanguageModel", "Compiled", "TilegraphError", "grad", "value_and_grad", "vjp",
           "train_step"]

# With no GPU, the Triton backend runs its kernels in Triton's interpreter, which
# must be chosen before anything (a transformers model) imports triton.
interpret_triton_without_gpu()


def _register_backend_passes() -> None:
    """Each backend's preparation passes, runnable by name in any pipeline (imported when first
    run): registered here, the layer above both the backends and the pass registry."""
    from tilegraph.backends import BACKENDS, attribute
    from tilegraph.passes import registry

    for description in BACKENDS.values():
        for name, path in description.passes:
            registry.PASSES[name] = functools.partial(attribute, path)


_register_backend_passes()

# File suffixes import_model reads, and what reads them.
SUFFIXES = {".onnx": "ONNX (frontends.onnx)", ".mlir": "tg IR text (Model.load)",
            ".pt2": "torch.export archive (frontends.torch_export)",
            ".gguf": "llama.cpp model file (frontends.gguf): its decode step, one token, the KV cache as inputs"}


def import_model(source: Any, example_inputs: Sequence[Any] | None = None, dynamic_shapes: Any = None, *,
                 trust_pickle: bool = False) -> Model:
    """An `ir.Model` from a Model, an onnx.ModelProto, a .onnx/.mlir/.pt2 path, an nn.Module or an ExportedProgram.

    `example_inputs` (a tuple of tensors) is needed for an nn.Module, which is traced
    with torch.export, as is `dynamic_shapes` (torch.export's argument: which input
    dims are symbolic); both are ignored for the other sources.
    `trust_pickle=True`: a .pt2 goes to torch.export.load unchecked, which can run any code
    the file carries (frontends/pt2_archive.py); only for a file you made. The default reads
    a .pt2 through the allow-list, which refuses such files by name. Other files ignore it.
    """
    if isinstance(source, Model):
        return source
    if isinstance(source, (str, os.PathLike)):
        return _import_file(Path(source), trust_pickle=trust_pickle)
    onnx = sys.modules.get("onnx")  # an onnx object exists only if onnx was imported
    if onnx is not None and isinstance(source, onnx.ModelProto):
        from tilegraph.frontends.onnx import from_onnx

        return from_onnx(source)
    torch = sys.modules.get("torch")  # likewise for torch
    if torch is not None:
        export = sys.modules.get("torch.export")
        if isinstance(source, torch.nn.Module):
            if example_inputs is None:
                raise TilegraphError(f"importing a torch.nn.Module ({type(source).__name__}) needs example_inputs, "
                                     "a tuple of tensors to trace it with torch.export")
            if not isinstance(example_inputs, (tuple, list)):
                example_inputs = (example_inputs,)
            from tilegraph.frontends.torch_export import from_torch

            return from_torch(source, tuple(example_inputs), dynamic_shapes=dynamic_shapes)
        if export is not None and isinstance(source, export.ExportedProgram):
            from tilegraph.frontends.torch_export import from_exported_program

            return from_exported_program(source)
    hint = " (call .build(...) on the Graph first)" if type(source).__name__ == "Graph" else ""
    raise TilegraphError(f"cannot import a {type(source).__module__}.{type(source).__qualname__}{hint}; tilegraph "
                         "imports an ir.Model, an onnx.ModelProto, a torch.nn.Module, a torch.export.ExportedProgram "
                         f"or a file: {', '.join(f'{s} ({k})' for s, k in SUFFIXES.items())}")


def _import_file(path: Path, trust_pickle: bool = False) -> Model:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ModelError(f"{path}: unknown model file type '{path.suffix}'; tilegraph reads "
                         + ", ".join(f"{s} ({k})" for s, k in SUFFIXES.items()))
    if not path.is_file():
        raise ModelError(f"no such model file: {path}")
    if suffix == ".onnx":
        from tilegraph.frontends.onnx import from_onnx

        return from_onnx(path)
    if suffix == ".pt2":
        from tilegraph.frontends.torch_export import load_pt2

        return load_pt2(path, trust_pickle=trust_pickle)
    if suffix == ".gguf":
        from tilegraph.frontends.gguf import from_gguf

        return from_gguf(path, batch=1, steps=1)
    return Model.load(path)


def generate(model: Any, prompt: Any, max_new_tokens: int = 64, **options: Any):
    """Stream text generated by a language model (a .gguf path or `compile("model.gguf")`'s
    LanguageModel): see tilegraph.generation.generate for the sampling options."""
    from tilegraph.generation import generate as _generate

    return _generate(model, prompt, max_new_tokens, **options)


def _run_passes(model: Model, pipeline: str | Sequence | None, hardware: str = "cpu",
                precision: str = "f32") -> Model:
    try:
        registry = importlib.import_module("tilegraph.passes.registry")
    except ModuleNotFoundError as e:
        if e.name != "tilegraph.passes.registry":
            raise
        # The pass registry is not part of this checkout (yet): the default is then
        # no passes; an explicit pipeline cannot be honoured and says so.
        if pipeline:
            raise TilegraphError(f"cannot run pipeline {pipeline!r}: passes.registry is not available") from None
        return model
    if pipeline is None:
        pipeline = registry.default_pipeline(hardware, precision)
    elif isinstance(pipeline, str) and pipeline and hardware != "cpu":
        pipeline = registry.with_hardware(pipeline, hardware)  # fuse/tile decide for the backend's GPU
    if not pipeline:
        return model
    return registry.run_pipeline(model, pipeline)


class Compiled:
    """A compiled model: call it with the inputs (NumPy arrays or torch tensors).

    Returns one array for a one-output model, a tuple for several. `.run` always
    returns the list. `.source` is the emitted code, `.model` the IR after passes.
    """

    def __init__(self, model: Model, runner: Any, target: str):
        self.model = model
        self.target = target
        self._runner = runner
        self.source: str = runner.source
        self.input_names: list[str] = list(model.input_names)
        self.output_names: list[str] = list(model.output_names)

    def run(self, *inputs: Any, **named: Any) -> list[np.ndarray]:
        return self._runner(*inputs, **named)

    @property
    def reference_kernels(self) -> list[str]:
        """(target "c") The GEMMs and convolutions left on oneDNN's slow reference kernel,
        one line each: none is the rule (they are made at a shape's first call)."""
        return list(getattr(self._runner, "reference_kernels", []))

    @property
    def primitives(self) -> list[str]:
        """(target "c") Every oneDNN GEMM and convolution made so far, one line each with the
        implementation oneDNN chose for it (brgconv:avx512_core_amx, ...)."""
        return list(getattr(self._runner, "primitives", []))

    def __call__(self, *inputs: Any, **named: Any):
        outs = self._runner(*inputs, **named)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def __repr__(self) -> str:
        return (f"Compiled(target={self.target!r}, inputs={self.input_names}, outputs={self.output_names}, "
                f"{len(self.source.splitlines())} lines)")


def compile(model: Any, example_inputs: Sequence[Any] | None = None, target: str | None = None,
            pipeline: str | Sequence | None = None, dynamic_shapes: Any = None, **options: Any) -> Compiled:  # noqa: A001
    """Import `model` (see import_model), run `pipeline` on it and build it for `target`.

    target: "c" (the local CPU, native: emitted C with OpenMP, GEMMs on oneDNN),
    "numpy" (the local CPU, the readable reference) or "triton" (a GPU; without one,
    Triton's interpreter on the CPU). None: "c" where a C compiler and oneDNN are
    installed, else "numpy" (with a warning saying why). `options` go to the backend's loader
    (triton: `autotune=True` times the tile pass's candidate configurations;
    c: `threads=N` caps its OpenMP threads).
    A .gguf file compiles to a `tilegraph.generation.LanguageModel` (`.generate(...)`, options
    threads= and cache_len=).
    pipeline: None runs the default pipeline; a pipeline string
    (`"canonicalize,cse"`) or list of passes runs those; "" or [] runs none.
    """
    from tilegraph.backends import backend, default_cpu_target

    if isinstance(model, (str, os.PathLike)) and Path(model).suffix.lower() == ".gguf":
        # A language model: prefill and decode entry points over one weight store and KV cache.
        from tilegraph.generation import LanguageModel

        unknown = sorted(set(options) - {"threads", "cache_len"})
        if unknown or example_inputs is not None:
            raise TilegraphError(f"a .gguf model takes the options threads= and cache_len=, not "
                                 f"{', '.join(unknown) or 'example_inputs'}")
        return LanguageModel(model, target=target, pipeline=pipeline, **options)  # type: ignore[return-value]
    if target is None:
        target = default_cpu_target()
    codegen = backend(target)  # an unknown target fails before any import work
    if pipeline is not None and not isinstance(pipeline, (str, list, tuple)):
        raise TilegraphError(f"pipeline must be a string like 'canonicalize,cse' or a list of passes, "
                             f"got {type(pipeline).__name__} {pipeline!r}")
    import inspect

    accepted = set(inspect.signature(codegen.load).parameters) - {"source", "weights", "model"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TilegraphError(f"target {target!r} takes no option {', '.join(unknown)}"
                             + (f" (its options: {', '.join(sorted(accepted))})" if accepted else ""))
    if hasattr(codegen, "build_ahead"):  # what the backend can build (the C runtime) while the passes run
        codegen.build_ahead()
    hardware = getattr(codegen, "HARDWARE", "cpu")  # fusion and tiling decide for what the backend runs on
    precision = options.get("precision", "f32")  # the default pipeline may differ by it (registry.default_pipeline)
    cache_key = None
    if isinstance(model, (str, os.PathLike)) and not isinstance(pipeline, (list, tuple)):
        from tilegraph import compile_cache

        cache_key = compile_cache.key(Path(model), pipeline, hardware if precision == "f32" else f"{hardware}/{precision}")
    optimized = compile_cache.lookup(cache_key) if cache_key else None
    if optimized is None:
        imported = import_model(model, example_inputs, dynamic_shapes)
        imported.verify()  # passes assume verified IR (a Model parsed from text has not been)
        optimized = _run_passes(imported, pipeline, hardware, precision)
        optimized.verify()
        if cache_key:
            compile_cache.store(cache_key, optimized)
    runner = codegen.load(codegen.emit(optimized), optimized.weights, optimized, **options)
    return Compiled(optimized, runner, target)


def grad(model: Any, wrt: Sequence[str] | None = None, example_inputs: Sequence[Any] | None = None) -> Model:
    """The gradients of `model`'s first output, a scalar loss, against `wrt` (input and weight
    names; default every float weight), as a new model @forward(inputs) -> (grad_<name>...):
    ordinary tg IR, for `compile` like any model (ir/autodiff.py)."""
    from tilegraph.ir import autodiff

    return autodiff.grad(import_model(model, example_inputs), wrt)


def value_and_grad(model: Any, wrt: Sequence[str] | None = None, example_inputs: Sequence[Any] | None = None) -> Model:
    """As `grad`, the model's own outputs first: @forward(inputs) -> (outputs..., grad_<name>...)."""
    from tilegraph.ir import autodiff

    return autodiff.value_and_grad(import_model(model, example_inputs), wrt)


def vjp(model: Any, wrt: Sequence[str] | None = None, example_inputs: Sequence[Any] | None = None) -> Model:
    """The vector-Jacobian product: @forward(inputs, cotangent_<output>...) -> (outputs..., grad_<name>...)."""
    from tilegraph.ir import autodiff

    return autodiff.vjp(import_model(model, example_inputs), wrt)


def train_step(model: Any, loss: str = "cross_entropy", optimizer: Any = None, **kw: Any):
    """One compiled training step (forward, loss, backward, optimizer update, weights and optimizer
    state updated in place): see tilegraph.train.train_step."""
    from tilegraph.train import train_step as _train_step

    return _train_step(model, loss, optimizer, **kw)
