"""The schemes, and which matmuls and tables they quantize."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
from xdsl.ir import Operation

from tilegraph.ir.dialect import TgOp
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.quant import MX_BLOCK
from tilegraph.ir.shapes import info_of
from tilegraph.ir.ops import Op


class QuantizeError(TilegraphError):
    """A scheme, observer or calibration file the quantize pass cannot use; the message says which."""


@dataclass(frozen=True)
class Scheme:
    weight: str  # storage type of weights
    granularity: str  # "tensor", "channel" (output channel) or "group" (blocks along K)
    group_size: int  # for "group"
    mx: bool  # f8E8M0FNU power-of-two scales (OCP MX)
    activation: str | None = None  # storage type of activations; None: weight-only
    integer_gemm: bool = False  # int x int -> i32 for real (tg.matmul_integer)


SCHEMES = {
    "w8": Scheme("i8", "channel", 0, False),
    # 128: the group size of GPTQ and AWQ's int4 checkpoints.
    "w4a16": Scheme("i4", "group", 128, False),
    "mxfp4": Scheme("f4E2M1FN", "group", MX_BLOCK, True),
    "w8a8": Scheme("i8", "channel", 0, False, "i8", integer_gemm=True),
    "fp8": Scheme("f8E4M3FN", "channel", 0, False, "f8E4M3FN"),
    "mxfp8": Scheme("f8E4M3FN", "group", MX_BLOCK, True, "f8E4M3FN"),
}
OBSERVERS = ("minmax", "percentile", "mse")
# Between the items of `formats`: ONNX names hold ':' (onnx::MatMul_655), not ','.
FORMATS_SEPARATOR = ","
GRANULARITIES = ("tensor", "channel", "group")
ROUNDINGS = ("nearest", "gptq")
# Clipping ratios the MSE observer tries: 1 (no clipping) down to 0.5 of the largest
# magnitude in steps of 2.5%, the grid of NVIDIA's and Intel's MSE calibrators (TensorRT
# and Neural Compressor search a similar range); below half, int8 outliers dominate.
MSE_RATIOS = tuple(1.0 - 0.025 * i for i in range(21))
# The percentile observer's default: ignore the 0.01% most extreme activations
# (onnxruntime's and PyTorch's HistogramObserver defaults are 99.99 / 99.999).
DEFAULT_PERCENTILE = 99.99
# Values kept per tensor for the percentile and MSE observers (a uniform sample beyond).
OBSERVER_SAMPLE = 1 << 20


# --- which matmuls ----------------------------------------------------------------------


def linear_layers(func_ops: Iterable[Operation], store) -> list[tuple[TgOp, TgOp]]:
    """(matmul, weight op) for every matmul of an activation (rank >= 2) by a 2-D float weight
    (a tg.weight, or a small tg.constant: the builder keeps tiny weights inline)."""
    found = []
    for op in func_ops:
        if not (isinstance(op, TgOp) and op.op_name == Op.matmul):
            continue
        a, w = op.operands
        owner = w.owner
        if not (isinstance(owner, TgOp) and owner.op_name in (Op.weight, Op.constant)):
            continue
        if owner.op_name == Op.weight and owner.attr("name") not in store:
            continue
        wi, ai = info_of(w.type), info_of(a.type)
        if wi.rank != 2 or ai.rank < 2 or wi.dtype not in ("f32", "f16", "bf16"):
            continue
        found.append((op, owner))
    return found


def embedding_tables(func_ops: Iterable[Operation], store) -> list[tuple[TgOp, TgOp]]:
    """(gather, table weight op) for every row lookup (gather on axis 0) in a 2-D float weight."""
    found = []
    for op in func_ops:
        if not (isinstance(op, TgOp) and op.op_name == Op.gather and op.attr("axis") == 0):
            continue
        owner = op.operands[0].owner
        if isinstance(owner, TgOp) and owner.op_name == Op.weight and owner.attr("name") in store and \
                info_of(op.operands[0].type).rank == 2 and info_of(op.operands[0].type).dtype in ("f32", "f16", "bf16"):
            found.append((op, owner))
    return found


def layer_name(w: TgOp, index: int) -> str:
    """What a layer is called: its weight's name (an inline constant weight: `linear<index>`)."""
    return w.attr("name") if w.op_name == Op.weight else f"linear{index}"


def weight_value(w: TgOp, store) -> np.ndarray:
    return np.asarray(store[w.attr("name")] if w.op_name == Op.weight else w.attr("value"), np.float32)
