"""`tile`: choose tile sizes for every fused group and write them on it.

What it decides, per `tg.fusion` group, against the cost model of its `hardware`, is that
hardware's way of running code (`choose_tile` in passes/targets/: gpu, numpy, c): the NumPy backend's chunks of rows or
columns and its GEMMs on BLAS's threads, the C backend's attention blocks, a GPU's GEMM and row
blocks and the configurations its autotuner tries. Attention is tiled flash-style everywhere
(passes/targets/attention_tile).

Symbolic dims are priced at `NOMINAL_DIM` (passes/cost/model.py). Every choice
leaves a remark with the alternatives and their predicted times.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, IntegerAttr, ModuleOp, i64
from xdsl.passes import ModulePass

from tilegraph.ir.dialect import FusionOp
from tilegraph.ir.hardware import check_target, hardware
from tilegraph.passes.cost import model


@dataclass(frozen=True)
class Tile(ModulePass):
    """Write tile sizes on every tg.fusion group (see the module docstring)."""

    name = "tile"

    hardware: str = "cpu"
    # At most this many rows per chunk (0: no limit): to see or test many chunks.
    max_rows: int = 0
    # Chunks of at most this many columns wherever a group allows them (0: the cost
    # model decides between rows and columns): to see or test column chunks.
    max_cols: int = 0
    # GEMMs whole on BLAS's threads wherever the machine was measured for it (else the
    # cost model decides): to see or test that way of running a group.
    blas_gemm: bool = False

    def __post_init__(self) -> None:
        check_target(self.hardware)
        for name in ("max_rows", "max_cols"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be 0 (no limit) or more, got {getattr(self, name)}")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        hw = hardware(self.hardware)
        for group in [g for g in op.walk() if isinstance(g, FusionOp)]:
            # Written even when empty (the group runs whole, as one chunk): the cost model
            # then prices it so, not as the best way it might have been tiled.
            with model.nominal_sizes():  # tiles are chosen by costs at the nominal size: numbers, not formulas
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
    """The tile of `group` for the way code runs on `hw` (its module in passes/targets/)."""
    return model.target(hw).choose_tile(group, hw, max_rows, max_cols, blas_gemm)
