"""The Triton backend: a model becomes @triton.jit kernels and a host program over torch.

    source = emit(model)                      # the module's text (see emit.py, group_kernels.py)
    compiled = load(source, model.weights)    # imported once; weights on the device once
    outputs = compiled(x)                     # list of np.ndarray (.forward_torch: tensors)

With no GPU, the kernels run in Triton's interpreter on the CPU. Triton decides
that when a function is decorated, so TRITON_INTERPRET=1 must be set before
anything imports triton (loading a transformers model does): `import tilegraph`
sets it on a machine with no NVIDIA device (`interpret_without_gpu`), and this
package says clearly when it came too late. `aot.build` compiles every kernel of
a module for sm_90 and gfx942 without a GPU.
"""

from __future__ import annotations

import os

from tilegraph.backends import interpret_triton_without_gpu

interpret_triton_without_gpu()
import torch  # noqa: E402

from tilegraph.backends.triton.emit import emit  # noqa: E402
from tilegraph.backends.triton.runtime import CompiledModel, load  # noqa: E402

# The hardware description (ir/hardware.py) fusion and tiling are decided for:
# the attached GPU when it is one described there, else an H100.
GPUS = {"H100": "h100", "H200": "h200", "A100": "a100"}
HARDWARE = next((target for name, target in GPUS.items()
                 if torch.cuda.is_available() and name in torch.cuda.get_device_name()), "h100")


def compile_model(model, name=None, autotune: bool = False) -> CompiledModel:
    """emit + load: the model's module, ready to call."""
    return load(emit(model, name), model.weights, model, autotune=autotune)


def interpreted() -> bool:
    """Whether kernels run in Triton's interpreter (no GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


__all__ = ["emit", "load", "compile_model", "CompiledModel", "HARDWARE", "interpreted"]
