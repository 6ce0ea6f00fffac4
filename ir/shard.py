"""The `shard` dialect: xDSL's (MLIR's) device grids, sharding annotations and collectives,
plus the collectives xDSL 0.74 does not ship yet, written in its style.

xDSL has `shard.grid`, `shard.sharding`, `shard.shard`, `shard.all_reduce` (and
broadcast, gather, scatter, send, recv, reduce, shift). MLIR's Shard dialect also has
the four below, which a partitioned program needs; their syntax is MLIR's:

    %1 = shard.all_gather %0 on @mesh grid_axes = [0] gather_axis = 1 : tensor<2x4xf32> -> tensor<2x16xf32>
    %2 = shard.reduce_scatter %1 on @mesh grid_axes = [0] scatter_axis = 0 : tensor<8x4xf32> -> tensor<2x4xf32>
    %3 = shard.all_to_all %2 on @mesh grid_axes = [0] split_axis = 1 concat_axis = 0 : ...
    %4 = shard.all_slice %3 on @mesh grid_axes = [0] slice_axis = 1 : ...   (no communication)

Semantics, for the devices that differ only in their coordinates on `grid_axes`
(a group, ordered row-major over those axes, the first axis major):
all_gather concatenates the group's tensors along gather_axis; reduce_scatter
reduces them and keeps the device's slice along scatter_axis; all_to_all cuts the
tensor along split_axis into one piece per member, sends piece j to member j and
concatenates what arrives along concat_axis; all_slice keeps the device's slice.
`backends/simulated_mesh.py` runs them in NumPy exactly so.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from xdsl.dialects import shard as _xshard
from xdsl.dialects.builtin import IndexTypeConstr, IntegerAttr, MemRefType, TensorType
from xdsl.dialects.shard import CollectiveCommunicationOp, ReductionKind, ReductionKindAttr
from xdsl.ir import Dialect
from xdsl.irdl import irdl_op_definition, operand_def, prop_def, result_def, traits_def
from xdsl.traits import Pure

_TENSOR = MemRefType.constr() | TensorType.constr()
_AXIS = IntegerAttr.constr(IndexTypeConstr)


def _collective(cls_name: str, name: str, doc: str, anchor: str, *axes: str, reduction: bool = False) -> type:
    """A collective of MLIR's shape: one tensor in, one out, on `grid` over `grid_axes`, with the
    index properties `axes` (and a reduction kind); its syntax is MLIR's, derived from those fields."""
    fields = {"__doc__": f"{doc}\n\n    See [MLIR](https://mlir.llvm.org/docs/Dialects/Shard/#{anchor}).",
              "__module__": __name__, "__qualname__": cls_name, "name": name, "input": operand_def(_TENSOR)}
    if reduction:
        fields["reduction"] = prop_def(ReductionKindAttr, default_value=ReductionKindAttr(ReductionKind.SUM))
    fields.update({axis: prop_def(_AXIS) for axis in axes})
    fields.update(result=result_def(_TENSOR), traits=traits_def(Pure()))
    fields["assembly_format"] = " ".join(
        ["$input `on` $grid (`grid_axes` `=` $grid_axes^)?", *(["(`reduction` `=` $reduction^)?"] if reduction else []),
         *(f"`{axis}` `=` ${axis}" for axis in axes), "attr-dict `:` type($input) `->` type($result)"])
    return irdl_op_definition(type(cls_name, (CollectiveCommunicationOp,), fields))


AllGatherOp = _collective(
    "AllGatherOp", "shard.all_gather", "Concatenate the group's tensors along `gather_axis`, on every member.",
    "shardall_gather-shardallgatherop", "gather_axis")
ReduceScatterOp = _collective(
    "ReduceScatterOp", "shard.reduce_scatter",
    "Reduce the group's tensors and keep this member's slice along `scatter_axis`.",
    "shardreduce_scatter-shardreducescatterop", "scatter_axis", reduction=True)
AllToAllOp = _collective(
    "AllToAllOp", "shard.all_to_all",
    "Piece j of the tensor cut along `split_axis` goes to member j; arrivals concatenate along `concat_axis`.",
    "shardall_to_all-shardalltoallop", "split_axis", "concat_axis")
AllSliceOp = _collective(
    "AllSliceOp", "shard.all_slice",
    "Keep this member's slice along `slice_axis` of a tensor the group holds alike (no communication).",
    "shardall_slice-shardallsliceop", "slice_axis")


ADDED = [AllGatherOp, ReduceScatterOp, AllToAllOp, AllSliceOp]

SHARD = Dialect("shard", [*_xshard.Shard.operations, *ADDED], list(_xshard.Shard.attributes))

GridOp, ShardingOp, ShardOp, AllReduceOp = _xshard.GridOp, _xshard.ShardingOp, _xshard.ShardOp, _xshard.AllReduceOp
ShardingType, ShardAxesArrayAttr = _xshard.ShardingType, _xshard.ShardAxesArrayAttr

# --- where each device's piece of a sharded tensor is (the partitioner and the simulated mesh) ---

def coords(device: int, mesh: Sequence[int]) -> tuple[int, ...]:
    """A device's coordinates on the mesh (row-major numbering)."""
    return tuple(int(c) for c in np.unravel_index(device, tuple(mesh)))


def piece(array: np.ndarray, spec: tuple[tuple[int, ...], ...], mesh: Sequence[int], device: int) -> np.ndarray:
    """The part of `array` that `device` holds under `spec`."""
    c = coords(device, mesh)
    index = []
    for d, axes in enumerate(spec):
        if not axes:
            index.append(slice(None))
            continue
        n = math.prod(mesh[a] for a in axes)
        k = 0
        for a in axes:  # the first axis is the major one
            k = k * mesh[a] + c[a]
        size = array.shape[d] // n
        index.append(slice(k * size, (k + 1) * size))
    return array[tuple(index)]



__all__ = ["coords", "piece", "SHARD", "GridOp", "ShardingOp", "ShardOp", "AllReduceOp", "AllGatherOp", "ReduceScatterOp",
           "AllToAllOp", "AllSliceOp", "ShardingType", "ShardAxesArrayAttr", "ReductionKind", "ReductionKindAttr"]
