"""Run a partitioned (SPMD) program for real: N local processes, torch.distributed collectives.

`run(partitioned, inputs)` saves the per-device program (`passes/partition.py`) and
each device's weight slices, starts one process per device with
`torch.multiprocessing.spawn`, joins them into a gloo process group (NCCL needs a GPU
per process; gloo runs on CPU), and has each run the program on its piece of the
inputs: tg ops through the op table's NumPy templates in the program's own dtypes
(`ir.interpreter.evaluate`, as the reference interpreter renders them, not widened),
the shard collectives through torch.distributed on the group of the mesh axes they
name. Rank 0 all-gathers every output's pieces and returns the whole tensors.

gloo has all_reduce and all_gather but no all_to_all or reduce_scatter on CPU
tensors: those two run as all_gather + local slice, and all_reduce + local slice
(the same result; more bytes on the wire than NCCL would move).
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.shard import piece

# Seconds a process waits for the others to join the group before giving up (a
# crashed peer otherwise hangs the launch forever).
JOIN_TIMEOUT_S = 120


class DistributedError(TilegraphError):
    """A distributed run that failed; the message names the rank and what it raised."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(p, inputs: Sequence[Any], timeout_s: float = JOIN_TIMEOUT_S) -> list[np.ndarray]:
    """Run `p` (a passes.partition.Partitioned) on len(devices) local processes; the gathered outputs."""
    import torch.multiprocessing as mp

    world = math.prod(p.mesh)
    with tempfile.TemporaryDirectory(prefix="tilegraph-dist-") as tmp:
        tmp = Path(tmp)
        p.model.save(tmp / "program.mlir")
        for rank, store in enumerate(p.weights):
            store.save(tmp / f"weights{rank}.npz")
        pieces = [[np.array(piece(np.asarray(x), spec, p.mesh, rank)) for x, spec in zip(inputs, p.in_specs)]
                  for rank in range(world)]
        for rank, arrays in enumerate(pieces):
            np.savez(tmp / f"inputs{rank}.npz", *arrays)
        try:
            mp.spawn(_worker, args=(world, _free_port(), str(tmp), tuple(p.mesh), p.out_specs, timeout_s),
                     nprocs=world, join=True)
        except mp.ProcessRaisedException as e:
            raise DistributedError(f"a process of the {world}-device run failed:\n{e}") from None
        with np.load(tmp / "outputs.npz") as data:
            return [data[f"arr_{i}"] for i in range(len(data.files))]


def _worker(rank: int, world: int, port: int, tmp: str, mesh: tuple[int, ...], out_specs, timeout_s: float) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from tilegraph.backends.simulated_mesh import gather, groups
    from tilegraph.ir.dialect import TgOp
    from tilegraph.ir.interpreter import GLOBALS, evaluate
    from tilegraph.ir.model import Model, WeightStore

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        tmp_path = Path(tmp)
        program = Model.load(tmp_path / "program.mlir")
        weights = WeightStore.load(tmp_path / f"weights{rank}.npz")
        with np.load(tmp_path / f"inputs{rank}.npz") as data:
            inputs = [data[f"arr_{i}"] for i in range(len(data.files))]
        # Every rank creates every group, in the same order (torch.distributed's rule).
        handles: dict[tuple[int, ...], tuple[Any, int, int]] = {}
        for axes in sorted({tuple(op.grid_axes.get_values()) for op in program.func.walk()
                            if op.name.startswith("shard.") and hasattr(op, "grid_axes")}):
            for members in groups(mesh, axes):
                handle = dist.new_group(members)
                if rank in members:
                    handles[axes] = (handle, members.index(rank), len(members))
        env: dict = dict(zip(program.func.args, inputs))
        for op in program.func.body.block.ops:
            if op.name == "func.return":
                outs = [np.asarray(env[v]) for v in op.operands]
                break
            if isinstance(op, TgOp):
                env.update(zip(op.results, evaluate(op, [env[v] for v in op.operands], weights, dict(GLOBALS),
                                                    float64=False)))
                continue
            handle, pos, n = handles[tuple(op.grid_axes.get_values())]
            env[op.results[0]] = _collective(op, np.asarray(env[op.operands[0]]), handle, pos, n, torch, dist)
        gathered = []
        for x, spec in zip(outs, out_specs):
            t = torch.from_numpy(np.ascontiguousarray(x).reshape(x.shape))
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t)
            gathered.append(gather([q.numpy() for q in parts], spec, mesh))
        if rank == 0:
            np.savez(Path(tmp) / "outputs.npz", *gathered)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _collective(op, x: np.ndarray, group, pos: int, n: int, torch, dist) -> np.ndarray:
    t = torch.from_numpy(np.array(x))  # a writable copy: collectives work in place
    if op.name in ("shard.all_reduce", "shard.reduce_scatter"):
        kind = op.reduction.data.value
        reduce_op = {"sum": dist.ReduceOp.SUM, "average": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                     "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}[kind]
        dist.all_reduce(t, op=reduce_op, group=group)
        out = t.numpy() / n if kind == "average" else t.numpy()
        if op.name == "shard.reduce_scatter":
            out = np.array_split(out, n, axis=op.scatter_axis.value.data)[pos]
        return out.astype(x.dtype)
    if op.name == "shard.all_slice":
        return np.array_split(x, n, axis=op.slice_axis.value.data)[pos]
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t, group=group)
    xs = [q.numpy() for q in parts]
    if op.name == "shard.all_gather":
        return np.concatenate(xs, axis=op.gather_axis.value.data)
    if op.name == "shard.all_to_all":
        split, concat = op.split_axis.value.data, op.concat_axis.value.data
        return np.concatenate([np.array_split(q, n, axis=split)[pos] for q in xs], axis=concat)
    raise DistributedError(f"no torch.distributed lowering for {op.name}")
