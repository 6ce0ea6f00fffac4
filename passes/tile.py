"""`tile`: choose tile sizes for every fused group and write them on it.

What it decides, per `tg.fusion` group, against the cost model of the target:

* CPU (the NumPy backend): the group runs over chunks of `rows` on all cores. With
  `flat`, its values are seen as [rows, last axis] and a chunk is a block of rows,
  GEMM rows included (their epilogue runs while they are in cache); that needs
  every input to span the rows or only the last axis (a bias). Otherwise a chunk is
  a slice along `axis` (the outermost leading axis with rows for every core) and
  anchors run whole first. Candidates
  are powers of two, each priced by the cost model (a GEMM of fewer rows runs
  slower; a chunk whose working set, the values live at once times the rows,
  exceeds the core's cache streams from memory; more chunks cost more NumPy
  calls); the cheapest wins. `chunks` records how many that makes at the sizes
  priced. A flat GEMM group has two more ways to run, priced the same way and
  kept if cheaper: `blas`, the GEMM whole on BLAS's own threads and then the
  epilogue in row chunks (how well BLAS's threads scale is calibrated: on one
  machine they beat our chunks, on another they fight the epilogue for the
  cores); and `cols` (a GEMM with an elementwise epilogue), chunks of columns
  that each multiply all the rows by a slice of the weight.
* Attention (any target): flash-style tiling, `block_q` query rows against
  `block_kv` keys with an online softmax, so the scores never exist whole and
  memory grows with N·d, not N². A sequence that fits one block is computed whole.
* CPU, the C backend (target "c"): attention's `block_q` and `block_kv`, the largest
  blocks whose scores, accumulator and K/V rows fit one core's cache with two tasks
  per core. Its other loops and oneDNN's GEMMs block themselves and read no tile;
  those groups get an empty one (they run whole, as the cost model prices them for "c").
* GPU (read by the Triton backend): for GEMM groups `block_m/n/k`, `num_warps`,
  `num_stages` within the shared-memory and register limits, chosen by predicted
  time (waves of tiles over the SMs); for row groups one `block` covering a row.

Symbolic dims are priced at `NOMINAL_DIM` (passes/cost/model.py). Every choice
leaves a remark with the alternatives and their predicted times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
from xdsl.context import Context
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, IntegerAttr, ModuleOp, i64
from xdsl.passes import ModulePass

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import FusionOp
from tilegraph.ir.shapes import info_of
from tilegraph.ir.fusion import ANCHORS, VIEW_OPS, cols_ok, flat_rows_ok, live_row_bytes, row_gemm, row_local, widest
from tilegraph.passes.cost.model import at_nominal, group_cost, nominal_sizes
from tilegraph.ir.hardware import check_target, hardware
from tilegraph.passes.remarks import listening, remark
from tilegraph.ir.ops import Op

# Attention: keys per block. 128 query rows x 512 keys of f32 scores is 256 KB, half of
# a 512 KB L2 (the smallest per-core L2 of the CPUs this runs on), leaving room for the
# q, k, v blocks.
FLASH_BLOCK_Q = 128
FLASH_BLOCK_KV = 512
# On a GPU the scores block is held in registers: 128 queries x 64 keys of fp32 is 64
# registers per thread over 4 warps, as FlashAttention-2's Triton kernel (Dao 2023;
# Triton's tutorial 06) uses for head dims up to 128 (8 warps above 64).
# The C backend's flash blocks (queries, keys), tried largest first.
C_FLASH_BLOCKS = ((128, 256), (128, 128), (64, 128), (64, 64), (32, 64))
GPU_FLASH_BLOCK_Q = 128
GPU_FLASH_BLOCK_KV = 64
# A chunk's working set may outgrow the core's L2 into the shared L3 before its passes
# slow down: MiniLM's FFN group (GEMM rows + bias + gelu) ran fastest with 5-10x an L2
# live, slower at both a quarter and twice that (a one-off timing, not calibrated: the
# calibration measures L2 only).
SPILL_FACTOR = 8
# Column chunks are at least this wide: BLAS's register blocking wants a few dozen
# columns, and the calibrated skinny-GEMM curve starts at 4.
MIN_GEMM_COLS = 32
# GPU GEMM candidates (the usual Triton matmul configurations, as in Triton's tutorial 03).
GPU_BLOCKS = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 32, 4, 4), (64, 128, 32, 4, 4),
              (64, 64, 32, 4, 4), (128, 64, 32, 4, 4), (64, 256, 32, 4, 4), (32, 64, 32, 4, 5)]
# How many of the best-predicted GEMM configurations the tile pass hands the autotuner.
AUTOTUNE_CANDIDATES = 3
# Registers a thread may spend on its accumulator slice: 255 per thread is the hardware
# limit (CUDA occupancy guide); half of it leaves room for addresses and operands.
ACCUMULATOR_REGISTERS_PER_THREAD = 128


@dataclass(frozen=True)
class Tile(ModulePass):
    """Write tile sizes on every tg.fusion group (see the module docstring)."""

    name = "tile"

    target: str = "cpu"
    # At most this many rows per chunk (0: no limit): to see or test many chunks.
    max_rows: int = 0
    # Chunks of at most this many columns wherever a group allows them (0: the cost
    # model decides between rows and columns): to see or test column chunks.
    max_cols: int = 0
    # GEMMs whole on BLAS's threads wherever the machine was measured for it (else the
    # cost model decides): to see or test that way of running a group.
    blas_gemm: bool = False

    def __post_init__(self) -> None:
        check_target(self.target)
        for name in ("max_rows", "max_cols"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be 0 (no limit) or more, got {getattr(self, name)}")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        hw = hardware(self.target)
        for group in [g for g in op.walk() if isinstance(g, FusionOp)]:
            # Written even when empty (the group runs whole, as one chunk): the cost model
            # then prices it so, not as the best way it might have been tiled.
            with nominal_sizes():  # tiles are chosen by costs at the nominal size: numbers, not formulas
                tile = choose_tile(group, hw, self.max_rows, self.max_cols, self.blas_gemm)
            group.attributes["tile"] = tile_attr(tile)


def tile_attr(tile: dict) -> DictionaryAttr:
    """The tile as an IR attribute: ints, and `configs` as an array of dicts of ints."""
    def attr(v):
        if isinstance(v, list):
            return ArrayAttr([attr(x) for x in v])
        if isinstance(v, dict):
            return DictionaryAttr({k: attr(x) for k, x in v.items()})
        return IntegerAttr(v, i64)

    return attr(tile)


def choose_tile(group: FusionOp, hw, max_rows: int = 0, max_cols: int = 0, blas_gemm: bool = False) -> dict[str, int]:
    """The tile of `group` for the way code runs on `hw` (`Hardware.execution`: TILERS)."""
    return TILERS[hw.execution](group, hw, max_rows, max_cols, blas_gemm)


def _gpu_tiler(group: FusionOp, hw, *_) -> dict[str, int]:
    """Triton's kernels: attention's blocks alone, else the GEMM's or the row block."""
    attention = [op for op in group.ops if op.op_name == Op.attention]
    if attention:  # the scores block lives in registers: FlashAttention-2's blocks
        return _attention_tile(attention[0], GPU_FLASH_BLOCK_Q, GPU_FLASH_BLOCK_KV,
                               lambda d: {"num_warps": 4 if d <= 64 else 8})
    return _gpu_tile(group, hw)


def _c_tiler(group: FusionOp, hw, *_) -> dict[str, int]:
    """The C backend reads only attention's blocks (module docstring)."""
    attention = [op for op in group.ops if op.op_name == Op.attention]
    return _c_attention_tile(attention[0], hw) if attention else {}


def _numpy_tiler(group: FusionOp, hw, max_rows: int, max_cols: int, blas_gemm: bool) -> dict[str, int]:
    """NumPy calls over chunks of rows (or columns), attention in flash blocks first."""
    attention = [op for op in group.ops if op.op_name == Op.attention]
    tile = _attention_tile(attention[0], FLASH_BLOCK_Q, FLASH_BLOCK_KV) if attention else {}
    if max_cols and cols_ok(group):
        width = int(at_nominal(info_of(group.ops[0].results[0].type).shape[-1]))
        return tile | {"flat": 1, "cols": min(max_cols, width), "chunks": math.ceil(width / min(max_cols, width))}
    return tile | _cpu_rows(group, hw, max_rows, blas_gemm)


def _attention_tile(op, block_q: int, block_kv: int, more=lambda d: {}) -> dict[str, int]:
    lq = at_nominal(info_of(op.operands[0].type).shape[-2])
    lk = at_nominal(info_of(op.operands[1].type).shape[-2])
    d = at_nominal(info_of(op.operands[2].type).shape[-1])
    tile = {"block_q": int(min(block_q, lq)), "block_kv": int(min(block_kv, lk))} | more(d)
    if listening():
        remark("tile", f"attention {lq:.0f}x{lk:.0f}: blocks of {tile['block_q']} queries x {tile['block_kv']} keys "
                       f"(online softmax): scores {tile['block_q'] * tile['block_kv']} values per head at a time "
                       f"instead of {lq * lk:.0f}; memory grows with N*d = {lq * d:.0f}")
    return tile


def _c_attention_tile(op, hw) -> dict[str, int]:
    """The C backend's flash kernel: blocks of `block_q` queries against `block_kv` keys
    per task, each block's scores, accumulator and K/V rows within one core's cache, as
    large as that allows (each block is two sgemm calls), with at least two tasks per
    core while the queries allow it (tasks are a batch row times a block of queries)."""
    q, k, v = (info_of(x.type).shape for x in op.operands[:3])
    lq, lk, d, dv = (int(at_nominal(x)) for x in (q[-2], k[-2], q[-1], v[-1]))
    tasks_per_block = int(at_nominal(math.prod(q[:-2]))) if len(q) > 2 else 1
    best = (C_FLASH_BLOCKS[0][0], C_FLASH_BLOCKS[0][1])
    for bq, bk in C_FLASH_BLOCKS:  # largest first
        live = 4 * (bq * bk + bq * (d + dv) + bk * (d + dv))
        if live <= hw.cache_bytes and (tasks_per_block * math.ceil(lq / bq) >= 2 * hw.cores or bq == C_FLASH_BLOCKS[-1][0]):
            best = (bq, bk)
            break
    tile = {"block_q": min(best[0], max(lq, 1)), "block_kv": min(best[1], max(lk, 1))}
    if listening():
        remark("tile", f"attention {lq}x{lk}, head dims {d}/{dv} on the C backend: blocks of {tile['block_q']} "
                       f"queries x {tile['block_kv']} keys ({4 * (best[0] * best[1] + best[0] * (d + dv) + best[1] * (d + dv)) // 1024} "
                       f"KiB live of {hw.cache_bytes // 1024} KiB of cache per core)")
    return tile


def _cpu_rows(group: FusionOp, hw, max_rows: int = 0, blas_gemm: bool = False) -> dict[str, int]:
    chunked = [op for op in group.ops if op.op_name not in VIEW_OPS]
    ref = widest(group)
    if not chunked or ref.rank < 2 or not all(row_local(op) for op in group.ops):
        return {}
    flat = flat_rows_ok(group)
    if flat:  # rows of the values seen as [rows, last axis]
        axis, total, outer = 0, int(at_nominal(sympy.sympify(math.prod(ref.shape[:-1])))), 1.0
    else:  # slices along the outermost leading axis long enough to feed every core, others whole
        axis = next((a for a in range(ref.rank - 1) if at_nominal(ref.shape[a]) >= 2 * hw.cores), ref.rank - 2)
        total = int(at_nominal(ref.shape[axis]))
        outer = at_nominal(sympy.sympify(math.prod(ref.shape[:axis])) if axis else 1)
    # Bytes of one row of the values live at once in a chunk (GEMM rows read their lhs row too).
    row_bytes = outer * live_row_bytes(group.ops, set(group.block.last_op.operands), at_nominal)
    priced = _price_rows(group, hw, total, row_bytes, max_rows, gemm_rows=flat)
    time, _, rows, chunks = min(priced)
    what = f"{group.kind} group ({len(group.ops)} ops)"
    gemms = [op for op in group.ops if op.op_name in ANCHORS]
    # The other ways a flat GEMM group can run: (time, tile, what the remark says).
    others = []
    if flat and gemms and all(row_gemm(op) for op in gemms) and (
            blas_gemm or (hw.cores > 1 and hw.blas_parallel_efficiency and not max_rows)):
        t, _, r, c = min(_price_rows(group, hw, total, row_bytes, max_rows, blas_gemm=True))
        others.append((t, {"flat": 1, "blas": 1} | ({"rows": r, "chunks": c} if c > 1 else {}),
                       f"its GEMM whole on BLAS's threads, then {c} chunks of {r} rows: predicted {t * 1e6:.1f} us"))
    columns = _cpu_cols(group, hw, total, row_bytes) if flat and hw.cores > 1 and cols_ok(group) and not max_rows \
        else None
    if columns and not blas_gemm:
        t, c, n = columns
        others.append((t, {"flat": 1, "cols": c, "chunks": n},
                       f"chunks of {c} columns, all {total} rows each ({n} chunks): predicted {t * 1e6:.1f} us"))
    best = min(others, key=lambda o: o[0], default=None)
    if best and (best[0] < time or blas_gemm):  # (tile{blas-gemm=true}: the only other candidate, taken)
        _, tile, why = best
        if listening():
            remark("tile", f"{what}: {why}; next best: the GEMM in chunks of {rows} rows, {time * 1e6:.1f} us")
        return tile
    if chunks == 1:  # the whole group in one go: a fork/join would cost more than it saves
        if listening():
            remark("tile", f"{what}: one chunk, on one core: predicted "
                           f"{time * 1e6:.1f} us; {len(priced) - 1} smaller chunk sizes priced higher")
        return {"flat": 1} if flat else {}
    if listening():
        alternatives = ", ".join(f"{r} rows {t * 1e6:.1f} us" for t, _, r, _ in sorted(priced)[1:4])
        where = "of the values seen as [rows, last axis]" if flat else f"along axis {axis}"
        remark("tile", f"{what}: chunks of {rows} rows {where} "
                       f"({chunks} chunks, {rows * row_bytes / 1024:.0f} KiB live per chunk): predicted "
                       f"{time * 1e6:.1f} us; next best: {alternatives}")
    return ({"flat": 1} if flat else {"axis": axis}) | {"rows": rows, "chunks": chunks}


def _price_rows(group: FusionOp, hw, total: int, row_bytes: float, max_rows: int = 0, gemm_rows: bool = True,
                blas_gemm: bool = False) -> list[tuple[float, int, int, int]]:
    """(time, -rows, rows, chunks) for chunks of 1, 2, 4, ... rows (at most max_rows, if set)."""
    inputs = [info_of(v.type) for v in group.operands]
    outputs = [info_of(r.type) for r in group.results]
    priced = []
    rows = 1
    while True:
        chunks = math.ceil(total / rows)
        cost = group_cost(group.ops, inputs, outputs, hw, chunks=chunks, gemm_rows=rows if gemm_rows else None,
                          blas_gemm=blas_gemm)
        priced.append((at_nominal(cost.time) + _spill(rows * row_bytes, cost, hw), -rows, rows, chunks))
        if rows >= total or (max_rows and rows * 2 > max_rows):
            return priced
        rows = min(rows * 2, total)


def _spill(live_bytes: float, cost, hw) -> float:
    """What a chunk whose values outgrow the cache pays: its passes stream from memory."""
    if live_bytes <= SPILL_FACTOR * hw.cache_bytes:
        return 0.0
    return at_nominal(cost.compute_time) * (hw.cache_bandwidth / hw.memory_bandwidth - 1) / hw.cores


def _cpu_cols(group: FusionOp, hw, rows: int, row_bytes: float) -> tuple | None:
    """(time, columns, chunks) of the best column chunking of a `cols_ok` group: at least one
    chunk per core, down to MIN_GEMM_COLS columns; None if the width allows no split."""
    inputs = [info_of(v.type) for v in group.operands]
    outputs = [info_of(r.type) for r in group.results]
    width = int(at_nominal(info_of(group.ops[0].results[0].type).shape[-1]))
    priced = []
    cols = -(-width // hw.cores)
    while cols >= MIN_GEMM_COLS:
        chunks = math.ceil(width / cols)
        cost = group_cost(group.ops, inputs, outputs, hw, chunks=chunks, gemm_cols=cols)
        priced.append((at_nominal(cost.time) + _spill(rows * row_bytes * cols / width, cost, hw), cols, chunks))
        if chunks >= width:
            break
        cols = -(-cols // 2)
    return min(priced) if priced else None


def _gpu_tile(group: FusionOp, hw) -> dict[str, int]:
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


# Each way code runs (ir/hardware.Hardware.execution) tiles its own way.
TILERS = {"gpu": _gpu_tiler, "c": _c_tiler, "numpy": _numpy_tiler}
