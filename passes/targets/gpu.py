"""A GPU, the Triton backend: what an op and a fused group cost, and how a group is tiled.

Cost: one kernel per group, launch overhead + max(flops / peak(dtype), bytes / HBM bandwidth);
matmuls at `Hardware.matmul_rate` (tile quantization). Quantization ops as the kernels a
low-precision GEMM is made of (cuBLASLt, Triton's `tl.dot` on int8 and fp8): a dequantize
feeding only GEMMs is that GEMM's prologue (no kernel of its own; the GEMM reads the stored
type's bytes and the scales), a GEMM whose operands are both dequantized from 8-bit (or
narrower) types runs at the peak of that type (`Hardware.flops`, which falls back where a
part lacks it: fp8 on A100 -> bf16), and tg.matmul_integer at the i8 peak, as
backends/triton/quant.py emits them.

Tiles (read by the Triton backend): attention in FlashAttention-2's blocks; for GEMM groups
`block_m/n/k`, `num_warps`, `num_stages` within the shared-memory and register limits, chosen
by predicted time (waves of tiles over the SMs), the best few handed to the autotuner; for
row groups one `block` covering a row.
"""

from __future__ import annotations

import math

import sympy

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.fusion import ANCHORS, VIEW_OPS, widest
from tilegraph.ir.ops import Op
from tilegraph.ir.shapes import info_of
from tilegraph.passes.cost.model import (Cost, at_nominal, dequantized, element_count, free, gemm_rate, group_traffic,
                                         matmul_shape, op_bytes, op_flops, quant_flops, storage_bytes)
from tilegraph.passes.remarks import listening, remark
from tilegraph.passes.targets import attention_tile

# The scores block is held in registers: 128 queries x 64 keys of fp32 is 64 registers per
# thread over 4 warps, as FlashAttention-2's Triton kernel (Dao 2023; Triton's tutorial 06)
# uses for head dims up to 128 (8 warps above 64).
FLASH_BLOCK_Q = 128
FLASH_BLOCK_KV = 64
# GPU GEMM candidates (the usual Triton matmul configurations, as in Triton's tutorial 03).
GPU_BLOCKS = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 32, 4, 4), (64, 128, 32, 4, 4),
              (64, 64, 32, 4, 4), (128, 64, 32, 4, 4), (64, 256, 32, 4, 4), (32, 64, 32, 4, 5)]


# How many of the best-predicted GEMM configurations the tile pass hands the autotuner.
AUTOTUNE_CANDIDATES = 3

# Registers a thread may spend on its accumulator slice: 255 per thread is the hardware
# limit (CUDA occupancy guide); half of it leaves room for addresses and operands.
ACCUMULATOR_REGISTERS_PER_THREAD = 128


def op_cost(op: TgOp, hw) -> Cost:
    """One op alone: a kernel of its own (a view is index arithmetic in its consumer's kernel)."""
    name = op.op_name
    if name in VIEW_OPS:
        return free(name)
    flops, bytes_ = op_flops(op), op_bytes(op)
    memory = bytes_ / hw.memory_bandwidth
    compute = flops / (gemm_rate(hw, op) if name in ANCHORS else hw.flops(op.result_infos()[0].dtype))
    overhead = sympy.Float(hw.launch_overhead)
    return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=name,
                ops=[name])


def _prologue(op: TgOp) -> bool:
    """A dequantize whose every use is a GEMM operand: it runs inside that GEMM."""
    uses = [u.operation for u in op.results[0].uses]
    return bool(uses) and all(isinstance(u, TgOp) and u.op_name in (Op.matmul, Op.matmul_integer) for u in uses)


def quant_cost(op: TgOp, hw) -> Cost:
    """A quantization op, or a GEMM reading dequantized operands (module docstring)."""
    name, zero = op.op_name, sympy.Integer(0)
    if name == Op.dequantize and _prologue(op):
        return free(name)
    flops, out = quant_flops(op), op.result_infos()[0]
    reads = []
    for v in op.operands:
        dq = dequantized(v) if name == Op.matmul else None
        if dq is not None and _prologue(dq):  # the GEMM reads what the dequantize would have
            reads += [storage_bytes(info_of(x.type)) for x in dq.operands]
        else:
            reads.append(storage_bytes(info_of(v.type)))
    bytes_ = sum(reads, zero) + storage_bytes(out)
    memory = bytes_ / hw.memory_bandwidth
    if name in (Op.matmul, Op.matmul_integer):
        narrow = [info_of(d.operands[0].type).dtype for v in op.operands if (d := dequantized(v)) is not None]
        dtype = "i8" if name == Op.matmul_integer else (
            min(narrow, key=lambda t: dtypes.numpy_dtype(t).itemsize) if len(narrow) == 2 else out.dtype)
        m, n, k = (max(1, int(at_nominal(d))) for d in matmul_shape(op))
        compute = flops / hw.matmul_rate(m, n, k, dtype)
    else:
        compute = element_count(out) / hw.flops("f32")
    overhead = sympy.Float(hw.launch_overhead)
    return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=name,
                ops=[name])


def group_cost(ops, anchors, rest, inputs, outputs, hw, label: str = "", **_tile) -> Cost:
    """One kernel: its GEMMs at their tile-quantized rate, the rest at the peak, against its traffic."""
    flops, bytes_ = group_traffic(ops, inputs, outputs)
    memory = bytes_ / hw.memory_bandwidth
    compute = sum((op_flops(op) / gemm_rate(hw, op) for op in anchors), sympy.Integer(0))
    compute += sum((op_flops(op) for op in rest), sympy.Integer(0)) / hw.flops(outputs[0].dtype)
    overhead = sympy.Float(hw.launch_overhead)
    return Cost(flops, bytes_, sympy.Max(compute, memory) + overhead, compute, memory, overhead, label=label,
                ops=[op.op_name for op in ops])


def choose_tile(group: FusionOp, hw, *_options) -> dict[str, int]:
    """Attention's blocks alone, else the GEMM's or the row block."""
    attention = [op for op in group.ops if op.op_name == Op.attention]
    if attention:
        return attention_tile(attention[0], FLASH_BLOCK_Q, FLASH_BLOCK_KV, lambda d: {"num_warps": 4 if d <= 64 else 8})
    return _gemm_or_row_tile(group, hw)


def _gemm_or_row_tile(group: FusionOp, hw) -> dict[str, int]:
    anchors = [op for op in group.ops if op.op_name in (Op.matmul, Op.conv)]
    ref = widest(group)
    if not anchors:
        width = int(at_nominal(ref.shape[-1])) if ref.rank else 1
        block = 1 << max(4, (width - 1).bit_length())
        return {"block": block, "num_warps": 4 if block <= 2048 else 8}
    op = anchors[0]
    out = info_of(op.results[0].type)
    m, n, k = (at_nominal(d) for d in op.SPEC.gemm_dims([info_of(v.type) for v in op.operands], [out]))
    size = dtypes.numpy_dtype(out.dtype).itemsize
    priced = []
    for bm, bn, bk, warps, stages in GPU_BLOCKS:
        # Sibling matmuls (Q, K, V) share the lhs tile but each has its operand tiles and accumulator.
        smem = stages * (bm * bk + len(anchors) * bk * bn) * size
        registers = len(anchors) * bm * bn / (32 * warps)
        if smem > (hw.shared_memory_per_block or hw.shared_memory_per_core) or registers > ACCUMULATOR_REGISTERS_PER_THREAD:
            continue
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        waves = math.ceil(tiles / hw.cores)
        # One wave runs a tile per SM at the SM's share of the peak.
        time = waves * 2 * bm * bn * k / (hw.flops(out.dtype) / hw.cores)
        priced.append((time, -bm * bn, (bm, bn, bk, warps, stages)))
    ranked = sorted(priced)
    time, _, (bm, bn, bk, warps, stages) = ranked[0]
    if listening():
        remark("tile", f"{group.kind} GEMM {m:.0f}x{n:.0f}x{k:.0f}: block {bm}x{bn}x{bk}, {warps} warps, {stages} "
                       f"stages: predicted {time * 1e6:.1f} us ({len(priced)} configurations fit; the next "
                       f"{AUTOTUNE_CANDIDATES - 1} are the autotuner's other candidates)")
    # The best few, for the Triton backend's autotuner to time on a GPU (the first is the default).
    configs = [{"BLOCK_M": c[0], "BLOCK_N": c[1], "BLOCK_K": c[2], "num_warps": c[3], "num_stages": c[4]}
               for _, _, c in ranked[:AUTOTUNE_CANDIDATES]]
    return {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
            "configs": configs}  # type: ignore[dict-item]
