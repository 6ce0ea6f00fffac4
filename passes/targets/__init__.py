"""Targets: one module per way code runs (`ir/hardware.Hardware.execution`), each answering
the same questions, so that the cost model and the `tile` pass hold no branch on a backend:

    op_cost(op, hw) -> Cost           one op run on its own
    quant_cost(op, hw) -> Cost        a quantization op, or a GEMM on dequantized operands
    group_cost(ops, anchors, rest, inputs, outputs, hw, label=, chunks=, gemm_rows=,
               gemm_cols=, blas_gemm=) -> Cost     a fused group (the chunk options are the
                                                   NumPy backend's; the others run it whole)
    choose_tile(group, hw, max_rows, max_cols, blas_gemm) -> dict    the tile the backend reads

`gpu` (the Triton backend), `numpy` (the NumPy backend's chunked calls) and `c` (the C
backend's compiled steps). passes/cost/model.py picks one (`target`) and holds what they share.
"""

from __future__ import annotations

from tilegraph.ir.shapes import info_of
from tilegraph.passes.cost.model import at_nominal
from tilegraph.passes.remarks import listening, remark


def attention_tile(op, block_q: int, block_kv: int, more=lambda d: {}) -> dict[str, int]:
    """Flash-style tiling: `block_q` query rows against `block_kv` keys with an online softmax, so
    the scores never exist whole and memory grows with N·d, not N² (a sequence that fits one block
    is computed whole); `more(head dim)` adds a target's own entries."""
    lq = at_nominal(info_of(op.operands[0].type).shape[-2])
    lk = at_nominal(info_of(op.operands[1].type).shape[-2])
    d = at_nominal(info_of(op.operands[2].type).shape[-1])
    tile = {"block_q": int(min(block_q, lq)), "block_kv": int(min(block_kv, lk))} | more(d)
    if listening():
        remark("tile", f"attention {lq:.0f}x{lk:.0f}: blocks of {tile['block_q']} queries x {tile['block_kv']} keys "
                       f"(online softmax): scores {tile['block_q'] * tile['block_kv']} values per head at a time "
                       f"instead of {lq * lk:.0f}; memory grows with N*d = {lq * d:.0f}")
    return tile
