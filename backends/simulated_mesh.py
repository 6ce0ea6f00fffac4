"""A device mesh simulated in NumPy: runs a partitioned (SPMD) program on every device.

`run(partitioned, inputs)` cuts the inputs into each device's pieces, runs the
per-device program (`passes/partition.py`) on all devices in lock step, one op at a
time: tg ops through the reference interpreter's `evaluate` (float64 by default),
collectives (`shard.all_reduce`, `all_gather`, `all_slice`, `all_to_all`,
`reduce_scatter`) as NumPy over each group of devices, then gathers every output
from its pieces. The result must equal the single-device result; that is what the
tests check.

A group: the devices whose coordinates differ only on the collective's grid axes,
ordered row-major over those axes (the first axis major), as `partition.piece` cuts.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import numpy as np

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.interpreter import GLOBALS, evaluate
from tilegraph.ir.shapes import info_of
from tilegraph.ir.shard import coords, piece

REDUCE = {"sum": np.add.reduce, "max": np.maximum.reduce, "min": np.minimum.reduce,
          "product": np.multiply.reduce, "average": lambda xs: np.add.reduce(xs) / len(xs)}


class MeshError(TilegraphError):
    """Inputs that do not fit the partitioned program; the message says which."""


def groups(mesh: Sequence[int], axes: Sequence[int]) -> list[list[int]]:
    """Device ids of every group over `axes`, each ordered by its members' position (row-major over `axes`)."""
    others = [a for a in range(len(mesh)) if a not in axes]
    result = []
    for fixed in itertools.product(*(range(mesh[a]) for a in others)):
        members = []
        for inner in itertools.product(*(range(mesh[a]) for a in axes)):
            c = [0] * len(mesh)
            for a, v in zip(others, fixed):
                c[a] = v
            for a, v in zip(axes, inner):
                c[a] = v
            members.append(int(np.ravel_multi_index(c, tuple(mesh))))
        result.append(members)
    return result


def _collective(op, values: list[Any], mesh: Sequence[int]) -> list[Any]:
    axes = list(op.grid_axes.get_values())
    out: list[Any] = [None] * len(values)
    for members in groups(mesh, axes):
        xs = [values[d] for d in members]
        n = len(members)
        for pos, d in enumerate(members):
            if op.name == "shard.all_reduce":
                out[d] = REDUCE[op.reduction.data.value](np.stack(xs))  # type: ignore[operator]
            elif op.name == "shard.all_gather":
                out[d] = np.concatenate(xs, axis=op.gather_axis.value.data)
            elif op.name == "shard.all_slice":
                out[d] = np.array_split(xs[pos], n, axis=op.slice_axis.value.data)[pos]
            elif op.name == "shard.reduce_scatter":
                total = REDUCE[op.reduction.data.value](np.stack(xs))  # type: ignore[operator]
                out[d] = np.array_split(total, n, axis=op.scatter_axis.value.data)[pos]
            elif op.name == "shard.all_to_all":
                split, concat = op.split_axis.value.data, op.concat_axis.value.data
                out[d] = np.concatenate([np.array_split(x, n, axis=split)[pos] for x in xs], axis=concat)
            else:
                raise MeshError(f"the simulated mesh cannot run {op.name}")
    return out


def gather(pieces: list[np.ndarray], spec, mesh: Sequence[int]) -> np.ndarray:
    """The whole tensor from every device's piece."""
    n = math.prod(mesh)
    shape = [p * k for p, k in zip(pieces[0].shape, [math.prod(mesh[a] for a in axes) for axes in spec])]
    whole = np.empty(shape, dtype=pieces[0].dtype)
    for dev in range(n):
        index = []
        c = coords(dev, mesh)
        for d, axes in enumerate(spec):
            k = 0
            for a in axes:
                k = k * mesh[a] + c[a]
            size = pieces[dev].shape[d]
            index.append(slice(k * size, (k + 1) * size))
        whole[tuple(index)] = pieces[dev]
    return whole


def run(p, inputs: Sequence[Any], float64: bool = True) -> list[np.ndarray]:
    """Run the SPMD program (a `passes.partition.Partitioned`) on every device of the simulated mesh;
    returns the gathered outputs."""
    mesh = p.mesh
    n = math.prod(mesh)
    func = p.model.func
    if len(inputs) != len(func.args):
        raise MeshError(f"the program takes {len(func.args)} inputs, got {len(inputs)}")
    widen = (lambda a: a.astype(np.float64) if dtypes.is_float(dtypes.dtype_name(a.dtype)) else a) if float64 \
        else (lambda a: a)
    envs: list[dict] = [{} for _ in range(n)]
    for arg, x, spec in zip(func.args, inputs, p.in_specs):
        x = np.asarray(x)
        want = info_of(arg.type).shape
        for dev in range(n):
            local = piece(x, spec, mesh, dev)
            if local.shape != want:
                raise MeshError(f"input {arg.name_hint}: shape {x.shape} does not give the planned piece {want} "
                                f"(the program was partitioned at {p.sizes})")
            envs[dev][arg] = widen(local)
    for op in func.body.block.ops:
        if op.name == "func.return":
            pieces = [[envs[d][v] for d in range(n)] for v in op.operands]
            return [gather([np.asarray(x) for x in ps], spec, mesh) for ps, spec in zip(pieces, p.out_specs)]
        if isinstance(op, TgOp):
            for dev in range(n):
                outs = evaluate(op, [envs[dev][v] for v in op.operands], p.weights[dev], dict(GLOBALS), float64, widen)
                envs[dev].update(zip(op.results, outs))
        else:
            values = _collective(op, [envs[d][op.operands[0]] for d in range(n)], mesh)
            for dev in range(n):
                envs[dev][op.results[0]] = values[dev]
    raise MeshError("the program has no func.return")
