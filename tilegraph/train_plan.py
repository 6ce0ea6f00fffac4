"""The plan a sharded training run executes (tilegraph/train_sharded.py): this machine's CPU as a
mesh joined by a gloo link, both measured by the processes together (`measure_device`,
`measure_link`, `measure_dispatch`), the layout each strategy pins (`layout`: ZeRO-3, Megatron's
tensor split, pipeline stages), and passes/shard.py's integer program solved with it (`plan_for`),
priced for what a rank runs (`optimizer_time`, `host_time`)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model

if TYPE_CHECKING:
    from tilegraph.train_sharded import _Compiled

STRATEGIES = ("zero3", "tensor", "pipeline")


class ShardedTrainError(TilegraphError):
    """A sharded training run that cannot be set up as asked; the message says why."""


# --- the plan ---------------------------------------------------------------------------


def cpu_mesh(shape: tuple[int, ...], alpha: float, beta: float, device=None):
    """A mesh of `device` (default: this machine's CPU profile, the NumPy backend's) joined by a gloo link."""
    from tilegraph.ir.hardware import Link, hardware

    from tilegraph.passes.cost.collectives import Mesh

    hw = dataclasses.replace(device or hardware("cpu"),
                             links={"gloo": Link("gloo", alpha, beta, "measured by the processes")})
    return Mesh(shape, hw, intra_node="gloo")


def measure_device(calibrate: bool, target: str = "numpy"):
    """One process's device: the `target` backend's CPU profile ("cpu" for NumPy, "c" for C: its loops
    and oneDNN) on the one thread a process runs (cores=1).
    `calibrate`: measured now, by the project's quick calibration run in every process at once (so
    it sees the cores shared as the step will: oversubscription and other load included), rank 0's
    profile taken by all (each rank plans alone: they must plan on the same numbers); else the
    profile cached for this machine."""
    import torch.distributed as dist

    from tilegraph.ir.hardware import hardware

    if calibrate:
        if target == "c":
            from tilegraph.backends.c.calibrate import measure
        else:
            from tilegraph.backends.numpy.calibrate import measure

        mine = [measure(quick=True, progress=False)]
        dist.broadcast_object_list(mine, src=0)
        hw = mine[0]
    else:
        hw = hardware("c" if target == "c" else "cpu")
    return dataclasses.replace(hw, cores=1)


def measure_dispatch(target: str, options: dict, repeats: int = 30) -> tuple[float, float]:
    """(seconds, seconds per input) a call of a compiled `target` module costs on the host besides
    its ops (binding its inputs, making its outputs, the call): fitted to the median calls of two
    one-element AdamW updates, one weight and four (6 and 18 inputs), in this process as it runs the
    step (its load included)."""
    import tilegraph
    from tilegraph.train import AdamW, build_update

    times, counts = [], []
    for n in (1, 4):
        weights = {f"w{i}": np.zeros(1, np.float32) for i in range(n)}
        m = tilegraph.compile(build_update(weights, AdamW()), target=target,
                              pipeline=None if target == "c" else "", **options)
        feed = {k: np.zeros(1 if k.startswith(("w", "grad_", "exp_")) else (), np.float32) for k in m.model.input_names}
        m.run(**feed)
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            m.run(**feed)
            samples.append(time.perf_counter() - t)
        times.append(float(np.median(samples)))
        counts.append(len(m.model.input_names))
    per = max(0.0, (times[1] - times[0]) / (counts[1] - counts[0]))
    return max(0.0, times[0] - per * counts[0]), per


def host_time(compiled: Sequence[_Compiled], update_inputs: int, dispatch: tuple[float, float], collectives: int,
              alpha: float, world: int) -> tuple[float, float]:
    """(per micro-batch, per step) seconds a rank spends outside the ops the cost model prices: its
    segments' calls (each forward but the loss segment's, which runs inside its backward, and each
    backward), the optimizer's call, and `collectives` tiny all-reduces a step (the clip's norm, a
    pipeline's loss) at the link's latency."""
    fixed, per = dispatch

    def call(m) -> float:
        return fixed + per * len(m.model.input_names)
    mb = sum((0.0 if c.seg.loss else call(c.forward)) + call(c.backward) for c in compiled)
    step = fixed + per * update_inputs + collectives * 2 * (world - 1) * alpha
    return mb, step


def optimizer_time(optimizer, hw) -> Callable[[int], float]:
    """elements -> the cost model's time of `optimizer`'s update module (train.build_update, the one
    a rank runs) over a weight of that many f32 elements, on `hw`."""
    import functools

    from tilegraph.passes.cost.model import at, module_cost
    from tilegraph.train import build_update

    @functools.lru_cache(maxsize=None)
    def cost(elements: int) -> float:
        return at(module_cost(build_update({"w": np.zeros(elements, np.float32)}, optimizer).module, hw).time)
    return cost


def layout(strategy: str) -> Callable:
    """The strategy names (passes/shard.py `only`) each node may take under `strategy`."""
    from tilegraph.ir.dialect import TgOp
    from tilegraph.ir.ops import Op

    if strategy == "zero3":
        def only(node):
            op = node.op
            names = {s.name for s in node.strategies}
            if op is None:
                return {"d0@0"}
            if op.op_name == Op.weight:  # stored split by its first dim, gathered where used (ZeRO-3)
                return {"d0@0"} if "d0@0" in names else {"R"}
            want = {Op.matmul: "b0@0", Op.attention: "d0@0", Op.gather: "d0@0"}.get(op.op_name)
            return {want} if want in names else None
        return only
    if strategy == "tensor":
        column, row = (".qkv.weight", ".qkv.bias", ".fc.weight", ".fc.bias"), (".proj.weight", ".out.weight")

        def only(node):  # Megatron: column-split qkv and fc (and their biases), row-split proj and out
            op = node.op
            if op is None:
                return {"R"}
            if op.op_name == Op.weight:
                return {"d0@0"} if node.label.endswith(column) else {"d1@0"} if node.label.endswith(row) else {"R"}
            w = _weight_behind(op)
            if op.op_name == Op.transpose and w:  # the (out, in) weight as (in, out): its split follows
                return {"d1@0"} if w.endswith(column) else {"d0@0"} if w.endswith(row) else {"R"}
            if op.op_name == Op.matmul and w:  # columns: no collective; rows: partial sums all-reduced
                return {"n@0"} if w.endswith(column) else {"k@0"} if w.endswith(row) else None
            if op.op_name == Op.attention:
                return {"d1@0"}  # heads
            # the column-split qkv's bias, its split into q, k and v and their view as heads stay split
            # (Megatron holds each rank's heads of q, k and v: a fused qkv is sliced by heads)
            names = {st.name for st in node.strategies}
            if "d2@0" in names and (op.op_name == Op.split or (op.op_name == Op.add and w.endswith(column)) or (
                    op.op_name == Op.reshape and isinstance(op.operands[0].owner, TgOp)
                    and op.operands[0].owner.op_name == Op.split)):
                return {"d2@0"}
            return None
        return only
    if strategy == "pipeline":
        def only(node):  # each stage's devices: data parallel (one device: replicated)
            op = node.op
            names = {s.name for s in node.strategies}
            if op is None:
                return {"d0@0"} if "d0@0" in names else {"R"}
            if op.op_name == Op.weight:
                return {"R"}
            want = {Op.matmul: "b0@0", Op.attention: "d0@0", Op.gather: "d0@0"}.get(op.op_name)
            return {want} if want in names else None
        return only
    raise ShardedTrainError(f"unknown strategy '{strategy}': {', '.join(STRATEGIES)}")


def _weight_behind(op) -> str:
    """The name of the weight `op` reads through views (a Linear's transposed weight), or ''."""
    from tilegraph.ir.dialect import TgOp
    from tilegraph.ir.ops import Op

    for v in op.operands:
        o = v.owner
        while isinstance(o, TgOp) and o.op_name in (Op.transpose, Op.reshape):
            o = o.operands[0].owner
        if isinstance(o, TgOp) and o.op_name == Op.weight:
            return o.attr("name")
    return ""


def plan_for(model: Model, strategy: str, world: int, alpha: float, beta: float, batch: int,
             micro_batches: int = 1, device=None, optimizer=None, schedule: str = "1f1b",
             workspace: float | Sequence[float] = 0.0, host: Any = (0.0, 0.0)):
    """passes/shard.py's plan of `model` (its batch dim symbolic, named B) for `strategy` on `world`
    processes: the mesh is every process (zero3, tensor) or one stage's (pipeline: 2 stages);
    `workspace`: the bytes a process's modules hold for their temporaries (per stage), as
    `workspace_bytes` predicts them; `host`: the seconds a process's runtime adds (per stage:
    `host_time`)."""
    from tilegraph.passes import shard

    stages = 2 if strategy == "pipeline" else 1
    if world % stages:
        raise ShardedTrainError(f"{stages} pipeline stages need an even number of processes, got {world}")
    mesh = cpu_mesh((world // stages,), alpha, beta, device)
    recompute: Any = "always"  # every segment's vjp recomputes its forward
    # at these sizes per-op overheads, not FLOPs, set a backward's time: priced from the VJPs'
    # ops; the optimizer's update priced from the module each rank runs
    return shard.plan(model.module, mesh, sizes={"B": batch}, names=model.input_names, only=layout(strategy),
                      stages=stages, micro_batches=micro_batches, recompute=recompute, zero=False, runner_up=False,
                      backward="vjp", schedule=schedule, workspace=workspace, repeat_collectives=False,
                      packed_units=True, host=host,
                      optimizer=optimizer_time(optimizer, mesh.hw) if optimizer is not None else None)


def stored_splits(plan) -> dict[str, int]:
    """weight name -> the dim the plan stores it split on over mesh axis 0 (weights it replicates: absent)."""
    from tilegraph.ir.ops import Op

    out = {}
    for c in plan.choices:
        if c.node.op is not None and c.node.op.op_name == Op.weight:
            dims = [d for d, axes in enumerate(c.strategy.out) if 0 in axes]
            if dims:
                out[c.node.label] = dims[0]
    return out


def chunk(a: np.ndarray, dim: int, rank: int, world: int) -> np.ndarray:
    if a.shape[dim] % world:
        raise ShardedTrainError(f"a dim of {a.shape[dim]} does not split over {world} processes")
    n = a.shape[dim] // world
    return np.ascontiguousarray(np.take(a, range(rank * n, (rank + 1) * n), axis=dim))


# --- the gloo link, measured --------------------------------------------------------------


def measure_link(repeats: int = 20) -> tuple[float, float]:
    """(alpha s, beta bytes/s) of this process group's all-reduce, fitted to the ring formula on a
    small and a large message (the slowest rank's mean; every rank gets the same numbers).

    Each collective is timed after a stretch of independent work, as a step's are: the processes
    reach it at different times when they share cores with each other and with other programs
    (a descheduled rank arrives a time slice late), and that wait is part of what a collective
    costs a step. Back-to-back collectives, the processes in lockstep, would not show it."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    times = []
    work = np.ones((96, 96), np.float32)
    for size in (1, 1 << 20):
        t = torch.zeros(size // 4 or 1)
        dist.all_reduce(t)
        samples = []
        for _ in range(repeats):
            for _ in range(20):  # about a segment's compute between two collectives
                work = np.tanh(work @ work * np.float32(1e-3))
            s = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - s)
        times.append(float(np.mean(samples)))
    agreed = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    small, large = agreed.tolist()
    if n <= 1:
        return 1e-6, 1e10
    alpha = max(small, 1e-7) / (2 * (n - 1))
    beta = (2 * (n - 1) / n) * (1 << 20) / max(large - small, 1e-9)
    return alpha, beta
