"""Loading and calling an emitted Triton module.

`load` writes the module's source into the cache directory (Triton reads a kernel's
source from its file), imports it, moves the weights onto the device once and
returns a `CompiledModel`: NumPy arrays or torch tensors in, NumPy arrays out
(`.forward_torch` keeps everything on the device, for benchmarks).

The device is the GPU when torch sees one; otherwise the kernels run in Triton's
interpreter on the CPU (`TRITON_INTERPRET=1`, set by `backends.triton` before any
kernel is defined): the same kernels, for correctness, not speed.

The emitted module calls back into this one: `device`/`host` move arrays for ops
that run on the host, `pick` chooses a kernel's configuration (the cost model's
first choice, or the autotuner's winner).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np
import torch

from tilegraph.backends.triton.group_kernels import f32_dot_precision
from tilegraph.ir import dtypes
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model, ModelError
from tilegraph.ir.shapes import ShapeError
from tilegraph.ir.signature import Signature, index_checks

_INTERPRETER_LOCK = threading.RLock()
# The module being built: `host_tensor` puts its constants on this device.
_BUILD_DEVICE: list[torch.device] = [torch.device("cpu")]


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def f32_dot(dev: torch.device):
    """An emitted module's F32_DOT on `dev` (group_kernels.f32_dot_precision); "ieee" off a GPU."""
    import triton.language as tl

    if dev.type != "cuda":
        return tl.constexpr("ieee")
    major, minor = torch.cuda.get_device_capability(dev)
    return tl.constexpr(f32_dot_precision("hip" if torch.version.hip else "cuda", major * 10 + minor))


_TORCH_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")  # ml_dtypes names torch shares


def to_torch(array: Any, device: torch.device) -> torch.Tensor:
    """A NumPy array (bfloat16 from ml_dtypes included) or tensor as a tensor on `device`."""
    if isinstance(array, torch.Tensor):
        return array.to(device)
    array = np.asarray(array)
    contiguous = np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes a 0-d array 1-d
    # Torch tensors are writable: share no read-only memory. NumPy calls an array of one
    # element contiguous whatever its stride, and torch refuses a negative one (x[0:-2:-1]).
    if not contiguous.flags.writeable or any(s < 0 for s in contiguous.strides):
        contiguous = contiguous.copy()
    if array.dtype == dtypes.numpy_dtype("bf16"):
        return torch.from_numpy(contiguous.view(np.uint16)).view(torch.bfloat16).to(device)
    if array.dtype.type.__module__ != "numpy":  # ml_dtypes' 8-, 6- and 4-bit types (quantized values)
        bits = torch.from_numpy(contiguous.view(np.uint8))
        if array.dtype.name in _TORCH_FLOAT8:
            return bits.view(getattr(torch, array.dtype.name)).to(device)
        # torch has no int4 / fp4 / fp6 tensors to compute with: the bits travel as uint8 and
        # name their type, for the host ops (tg.dequantize) that read them back.
        tensor = bits.to(device)
        tensor.tg_dtype = array.dtype  # type: ignore[attr-defined]
        return tensor
    return torch.from_numpy(contiguous).to(device)


def pack_k(tensor: torch.Tensor) -> torch.Tensor:
    """(emitted code) A 2-D [K, N] tensor of 4-bit values (one a byte, `tg_dtype` naming their type)
    as [ceil(K/2), N] bytes holding two each, row 2i in the low nibble and 2i + 1 in the high one:
    how the quantized GEMMs read 4-bit weights (and tl.dot_scaled reads e2m1, "packed along K")."""
    k = tensor.shape[0]
    nibbles = tensor & 0x0F
    if k % 2:
        nibbles = torch.cat([nibbles, torch.zeros_like(nibbles[:1])])
    packed = (nibbles[0::2] | (nibbles[1::2] << 4)).contiguous()
    packed.tg_dtype, packed.tg_packed_rows = tensor.tg_dtype, k  # type: ignore[attr-defined]
    return packed


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    rows = getattr(tensor, "tg_packed_rows", None)
    if rows is not None:  # 4-bit values packed along K (pack_k): one a byte again, for the host
        packed = tensor.detach().cpu().numpy()
        nibbles = np.empty((packed.shape[0] * 2,) + packed.shape[1:], np.uint8)
        nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
        return nibbles[:rows].view(tensor.tg_dtype)  # type: ignore[attr-defined]
    tg_dtype = getattr(tensor, "tg_dtype", None)  # an attribute of this tensor object: .cpu() drops it
    tensor = tensor.detach().cpu() if tensor.device.type != "cpu" or tensor.requires_grad else tensor
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.uint16).numpy().view(dtypes.numpy_dtype("bf16"))
    if str(tensor.dtype)[6:] in _TORCH_FLOAT8:
        return tensor.contiguous().view(torch.uint8).numpy().view(np.dtype(getattr(ml_dtypes, str(tensor.dtype)[6:])))
    if tg_dtype is not None:
        return tensor.numpy().view(tg_dtype)
    return tensor.numpy()


def host(tensor: torch.Tensor) -> np.ndarray:
    """(emitted code) An op that runs on the host reads this copy."""
    return to_numpy(tensor)


def device(array: np.ndarray) -> torch.Tensor:
    """(emitted code) ... and its result goes back to the device."""
    return to_torch(array, _BUILD_DEVICE[0])


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """(emitted code) A constant, on the device of the module being built."""
    return to_torch(array, _BUILD_DEVICE[0])


def pick(tuner, name: str, key: tuple, configs: list[dict], launch: Callable[[dict], None]) -> dict:
    """(emitted code) The configuration to launch kernel `name` with for these shapes."""
    if tuner is None or len(configs) == 1:
        return configs[0]
    return tuner.pick(name, key, configs, launch)


class BoundTuner:
    """An `autotune.Autotuner` bound to one module's source hash and the device's name."""

    def __init__(self, tuner, source_hash: str, device_name: str):
        self.tuner, self.source_hash, self.device_name = tuner, source_hash, device_name

    def pick(self, name: str, key: tuple, configs: list[dict], launch: Callable[[dict], None]) -> dict:
        return self.tuner.pick(name, self.source_hash, key, self.device_name, configs, launch)


def module_dir() -> Path:
    """The cache folder of emitted modules: one only this user can write (ir/cache.py), as a
    module there is imported, so runs as code."""
    from tilegraph.ir.cache import private_dir

    return private_dir("triton")


def import_source(source: str):
    """Import an emitted module from a file named by its hash (Triton reads kernels' source from it).
    A file there that is not this source, byte for byte, with its digest (edited, planted,
    half-written) is written afresh before the import."""
    from tilegraph.ir import cache

    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    folder = module_dir()
    path = folder / f"tilegraph_triton_{digest}.py"
    if not cache.verified(path) or path.read_bytes() != source.encode():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(source.encode())
        cache.place(tmp, path)
    name = f"tilegraph_triton_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    module.SOURCE_HASH = digest  # type: ignore[attr-defined]
    return module


class CompiledModel:
    """A loaded Triton module: call it with the model inputs, get the list of outputs (NumPy)."""

    def __init__(self, module, weights: Mapping[str, np.ndarray], source: str, model: Model | None,
                 device: torch.device | None = None, autotune: bool = False):
        self.module, self.source, self.model = module, source, model
        self.device = device or default_device()
        missing = [w for w in module.WEIGHTS if w not in weights]
        if missing:
            raise ModelError("weights missing for the compiled model: " + ", ".join(missing))
        tuner = None
        if autotune:
            from tilegraph.backends.triton.autotune import Autotuner

            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu-interpreter"
            tuner = BoundTuner(Autotuner(enabled=True), module.SOURCE_HASH, name)
        module.TUNER = tuner
        _BUILD_DEVICE[0] = self.device
        self._forward = module.build({w: to_torch(weights[w], self.device) for w in module.WEIGHTS}, self.device)
        self._signature = Signature(module.INPUTS, index_checks(model) if model is not None else ())
        self.input_names = [row[0] for row in module.INPUTS]
        self.output_names = [row[0] for row in module.OUTPUTS]
        self.host_ops: dict[str, int] = dict(module.HOST_OPS)
        self.kernels: dict[str, dict] = dict(module.KERNELS)

    def forward_torch(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """Tensors on the device in, tensors on the device out (no checks, no copies)."""
        if self.device.type == "cuda":
            _BUILD_DEVICE[0] = self.device
            return self._forward(*inputs)
        # Triton's interpreter keeps per-launch state in globals (its builder, the grid):
        # two threads launching at once corrupted each other's kernels (InterpreterError).
        # On the CPU, calls run one at a time; on a GPU they run concurrently as streams allow.
        with _INTERPRETER_LOCK:
            _BUILD_DEVICE[0] = self.device
            return self._forward(*inputs)

    def __call__(self, *inputs: Any, **named: Any) -> list[np.ndarray]:
        if named:
            if inputs:
                raise ShapeError("give the inputs either all by position or all by name")
            arrays = self._signature.bind(named)[0]
        else:
            arrays = self._signature.bind([to_numpy(x) if isinstance(x, torch.Tensor) else x for x in inputs])[0]
        outs = self.forward_torch(*(to_torch(a, self.device) for a in arrays))
        # On the CPU a tensor may share memory with an input (an output that is an input, or a
        # view of one): the caller gets arrays of its own, as from the NumPy backend.
        return [np.array(to_numpy(o)) for o in outs]

    def __repr__(self) -> str:
        return f"CompiledModel(triton on {self.device}: {', '.join(self.input_names)} -> {', '.join(self.output_names)})"


def check_can_run() -> None:
    """A clear error when kernels can run neither on a GPU nor in the interpreter."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not interpreting and not torch.cuda.is_available():
        raise TilegraphError("the Triton backend needs a GPU, or TRITON_INTERPRET=1 to run its kernels in Triton's "
                             "interpreter on the CPU (set before torch or triton is imported)")
    if interpreting and type(importlib.import_module("triton.language").sum).__name__ == "JITFunction":
        raise TilegraphError("Triton was imported before TRITON_INTERPRET=1 was set, so its own functions cannot run "
                             "in the interpreter: import tilegraph (or set TRITON_INTERPRET=1) before torch models "
                             "or triton are loaded")
    if interpreting:
        _interpret_bf16_as_gpus_do()
        _interpret_fp8_as_gpus_do()


def _interpret_bf16_as_gpus_do() -> None:
    """Triton's interpreter (3.8) keeps bf16 values as their uint16 bits and converts only
    bf16 <-> fp32 itself, and that by truncation; every other cast to or from bf16 is NumPy's
    astype of the bits (int64 1 becomes the bf16 whose bits are 0x0001, 9e-41: MiniLM's
    attention mask, cast from its int64 input, came out all zeros), and tl.dot of bf16
    operands is np.matmul of the bits. A GPU converts by value, rounding to nearest even
    (cvt.rn.bf16), and multiplies bf16 tiles exactly into fp32. The interpreter's builder
    gets casts to and from bf16 through ml_dtypes' bfloat16 (by value, to nearest even) and
    a tl.dot that widens bf16 operands to fp32 first (exact: a product of two bf16 values
    fits fp32's mantissa). Kernels are unchanged: GPUs never see this."""
    import ml_dtypes
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder as builder
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    if getattr(builder.cast_impl, "bf16_as_gpus_do", False):
        return
    cast, dot = builder.cast_impl, builder.create_dot
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def cast_impl(self, src, dst_type):
        src_type, dst = src.dtype.scalar, dst_type.scalar
        if src_type == dst or tl.bfloat16 not in (src_type, dst) or src_type.is_fp8() or dst.is_fp8():
            return cast(self, src, dst_type)  # fp8 values are bits too: not NumPy's to convert
        value = np.asarray(src.data)
        value = value.view(bf16) if src_type == tl.bfloat16 else value
        if dst == tl.bfloat16:
            return TensorHandle(value.astype(bf16).view(np.uint16), dst)
        return TensorHandle(value.astype(_get_np_dtype(dst)), dst)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    cast_impl.bf16_as_gpus_do = True  # type: ignore[attr-defined]
    builder.cast_impl, builder.create_dot = cast_impl, create_dot


def _interpret_fp8_as_gpus_do() -> None:
    """Triton's interpreter (3.8) converts to fp8 by cutting the mantissa and adding its first
    dropped bit (1.9375 -> e4m3 gives 1, 17 gives 18: no carry into the exponent, no ties to
    even, no subnormals) and reads e5m2 subnormals wrongly (in tl.dot too). A GPU converts
    fp32 -> fp8 by value, to nearest even, saturating to the largest finite value
    (cvt.rn.satfinite.e4m3x2.f32), and widens fp8 exactly. The interpreter's builder gets
    those conversions through ml_dtypes (by value, to nearest even; finite values clipped to
    the format's range first, as satfinite does), and a tl.dot that widens fp8 operands to
    fp32 first (exact). Kernels are unchanged: GPUs never see this."""
    import ml_dtypes
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder as builder
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    if getattr(builder.create_fp_to_fp, "fp8_as_gpus_do", False):
        return
    fp_to_fp, dot = builder.create_fp_to_fp, builder.create_dot
    types = {tl.float8e4nv: np.dtype(ml_dtypes.float8_e4m3fn), tl.float8e5: np.dtype(ml_dtypes.float8_e5m2),
             tl.bfloat16: np.dtype(ml_dtypes.bfloat16)}

    def value(handle):
        kind = handle.dtype.scalar
        return np.asarray(handle.data).view(types[kind]) if kind in types else np.asarray(handle.data)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_type, dst = src.dtype.scalar, dst_type.scalar
        if dst not in (tl.float8e4nv, tl.float8e5) and src_type not in (tl.float8e4nv, tl.float8e5):
            return fp_to_fp(self, src, dst_type, rounding_mode)
        x = value(src)
        if dst in (tl.float8e4nv, tl.float8e5):
            top = float(ml_dtypes.finfo(types[dst]).max)
            x = np.where(np.isnan(x), x, np.clip(x.astype(np.float32), -top, top))
        y = x.astype(types.get(dst, _get_np_dtype(dst_type)))
        return TensorHandle(y.view(_get_np_dtype(dst_type)) if dst in types else y, dst)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar in (tl.float8e4nv, tl.float8e5) or b.dtype.scalar in (tl.float8e4nv, tl.float8e5):
            a, b = (TensorHandle(value(x).astype(np.float32), tl.float32) for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_fp_to_fp.fp8_as_gpus_do = True  # type: ignore[attr-defined]
    builder.create_fp_to_fp, builder.create_dot = create_fp_to_fp, create_dot


def load(source: str, weights: Mapping[str, np.ndarray], model: Model | None = None,
         device: torch.device | None = None, autotune: bool = False) -> CompiledModel:
    """Import an emitted module and bind its weights on the device; returns the callable model."""
    check_can_run()
    return CompiledModel(import_source(source), weights, source, model, device, autotune)


__all__ = ["load", "CompiledModel", "device", "host", "host_tensor", "pack_k", "pick", "to_torch", "to_numpy"]
