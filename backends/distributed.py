"""Run a partitioned (SPMD) program for real: N local processes, torch.distributed collectives.

`run(partitioned, inputs)` saves the per-device program (`passes/partition.py`) and
each device's weight slices, starts one process per device with
`torch.multiprocessing.spawn`, joins them into a gloo process group (NCCL needs a GPU
per process; gloo runs on CPU), and has each run the program on its piece of the
inputs: tg ops through the op table's NumPy templates in the program's own dtypes
(`ir.interpreter.evaluate`, as the reference interpreter renders them, not widened),
the shard collectives through torch.distributed on the group of the mesh axes they
name. Rank 0 all-gathers every output's pieces and returns the whole tensors.

Overlap (`overlap=True`): every collective is issued asynchronously (`async_op=True`) as
soon as its operand exists (a weight a collective reads is read first, so its all-gather
starts before any compute) and waited for where its result is first used; gloo runs it on
its own thread while this one computes. `timings` collects each repetition's step time
(the slowest rank's).

Compiled (`backend="numpy"` or `"c"`): each run of tg ops between two collectives is cut
out of the per-device program (`ir.extract`) and emitted as a module by that backend
(`tilegraph.backends.backend(target)`: its public emit/load), compiled once per process
(the C backend with one OpenMP thread: the processes share the cores); the collectives
stay calls between those modules. `backend=None` runs op by op.

`compare(stages, inputs, modes)` runs several (backend, overlap) modes in one launch,
interleaved: every repetition runs each mode once, the order reversed every other
repetition (ABBA), so a burst of load on the shared machine lands on all modes alike.

Pipelines (`run_stages`): stage k's program runs on its own devices (ranks numbered
stage after stage), on each of `micro_batches` micro-batches in turn; a stage gathers its
outputs inside its devices and sends them (`dist.send`) to the next stage's devices, which
take their pieces; the last stage concatenates the micro-batches' outputs.

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
from tilegraph.ir.ops import Op

# Seconds a process waits for the others to join the group before giving up (a
# crashed peer otherwise hangs the launch forever).
JOIN_TIMEOUT_S = 120


class DistributedError(TilegraphError):
    """A distributed run that failed; the message names the rank and what it raised."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(p, inputs: Sequence[Any], timeout_s: float = JOIN_TIMEOUT_S, overlap: bool = True, repeats: int = 1,
        timings: list | None = None, backend: str | None = None) -> list[np.ndarray]:
    """Run `p` (a passes.partition.Partitioned) on len(devices) local processes; the gathered outputs."""
    return run_stages([p], inputs, 1, timeout_s, overlap, repeats, timings, backend)


def run_stages(stages: Sequence[Any], inputs: Sequence[Any], micro_batches: int = 1,
               timeout_s: float = JOIN_TIMEOUT_S, overlap: bool = True, repeats: int = 1,
               timings: list | None = None, backend: str | None = None) -> list[np.ndarray]:
    """Run pipeline stages (each a Partitioned: stage k's outputs are stage k+1's inputs) on
    sum(devices) local processes, the inputs cut into `micro_batches` along dim 0."""
    outputs, times = compare(stages, inputs, [(backend, overlap)], repeats, micro_batches, timeout_s)
    if timings is not None:
        timings.extend(times[0])
    return outputs[0]


def compare(stages: Sequence[Any], inputs: Sequence[Any], modes: Sequence[tuple[str | None, bool]],
            repeats: int = 1, micro_batches: int = 1,
            timeout_s: float = JOIN_TIMEOUT_S) -> tuple[list[list[np.ndarray]], list[list[float]]]:
    """Run the stages in every (backend, overlap) mode of `modes`, interleaved in one launch:
    (each mode's gathered outputs, each mode's step times: one per repetition, the slowest rank's)."""
    import torch.multiprocessing as mp

    from tilegraph.backends import backend as backend_module

    modes = [(b, bool(o)) for b, o in modes]
    for b, _ in modes:
        if b is not None:
            backend_module(b)  # an unknown target fails here, not in every process

    sizes = [math.prod(s.mesh) for s in stages]
    world = sum(sizes)
    inputs = [np.asarray(x) for x in inputs]
    if micro_batches < 1 or any(x.ndim == 0 or x.shape[0] % micro_batches for x in inputs):
        raise DistributedError(f"{micro_batches} micro-batches do not divide the inputs' first dims "
                               f"{[x.shape[:1] for x in inputs]}")
    with tempfile.TemporaryDirectory(prefix="tilegraph-dist-") as tmp:
        tmp = Path(tmp)  # type: ignore[assignment]
        config = []
        for k, s in enumerate(stages):
            s.model.save(tmp / f"program{k}.mlir")  # type: ignore[operator]
            for local, store in enumerate(s.weights):
                store.save(tmp / f"weights{k}_{local}.npz")  # type: ignore[operator]
            axes = sorted({tuple(op.grid_axes.get_values()) for op in s.model.func.walk()
                           if op.name.startswith("shard.") and hasattr(op, "grid_axes")})
            config.append(dict(mesh=tuple(s.mesh), offset=sum(sizes[:k]), in_specs=s.in_specs,
                               out_specs=s.out_specs, axes=axes))
        for m, batch in enumerate(zip(*(np.split(x, micro_batches) for x in inputs)) if inputs else []):
            for local in range(sizes[0]):
                np.savez(tmp / f"inputs{local}_{m}.npz",  # type: ignore[operator]
                         *[np.array(piece(x, spec, stages[0].mesh, local)) for x, spec in zip(batch, stages[0].in_specs)])
        try:
            mp.spawn(_worker, args=(world, _free_port(), str(tmp), config, micro_batches, modes, repeats,
                                    timeout_s), nprocs=world, join=True)
        except mp.ProcessRaisedException as e:
            raise DistributedError(f"a process of the {world}-device run failed:\n{e}") from None
        times = np.load(tmp / "times.npy")  # type: ignore[operator]
        outputs = []
        for i in range(len(modes)):
            with np.load(tmp / f"outputs{i}.npz") as data:  # type: ignore[operator]
                outputs.append([data[f"arr_{j}"] for j in range(len(data.files))])
        return outputs, [times[:, i].tolist() for i in range(len(modes))]


def compile_for(model, target: str):
    """`model` built by the backend `target` through its public emit/load (the C backend on one
    OpenMP thread: each process is one device, and the processes share the machine's cores)."""
    import inspect

    from tilegraph.backends import backend

    codegen = backend(target)
    options = {"threads": 1} if "threads" in inspect.signature(codegen.load).parameters else {}
    return codegen.load(codegen.emit(model), model.weights, model, **options)


def _steps(program, weights, backend: str | None) -> list[tuple]:
    """The program as steps: ("op", tg op) run through the op table's NumPy template, ("segment", a
    compiled model, its input values, its output values) for each run of tg ops between collectives
    (the backend's emitted module; backend=None: none, every op a step), ("collective", op).

    A weight that a collective reads comes first (so, overlapped, its gather, ZeRO-3's, starts
    before any compute), as an op of its own: a compiled segment would copy it out. Other weights
    stay in the segments that read them (the C backend packs them once)."""
    from tilegraph.ir.dialect import TgOp
    from tilegraph.ir.extract import extract, live_after
    from tilegraph.ir.model import Model

    ops = [op for op in program.func.body.block.ops if op.name != "func.return"]
    ret = program.func.body.block.last_op
    fed = {op.operands[0] for op in ops if not isinstance(op, TgOp)}
    early = [op for op in ops if getattr(op, "op_name", "") == Op.weight and op.results[0] in fed]
    ops = [op for op in ops if op not in early]
    steps = [("op", op) for op in early]
    if backend is None:
        return steps + [("op" if isinstance(op, TgOp) else "collective", op) for op in ops]
    source = Model(program.module, weights)
    run = []

    def close(i):
        if run:
            defined = {r for op in run for r in op.results}
            ins = list(dict.fromkeys(v for op in run for v in op.operands if v not in defined))
            outs = live_after(run, ops[i:], ret.operands)
            steps.append(("segment", compile_for(extract(source, run, ins, outs), backend), ins, outs))
            run.clear()

    for i, op in enumerate(ops):
        if isinstance(op, TgOp):
            run.append(op)
        else:
            close(i)
            steps.append(("collective", op))
    close(len(ops))
    return steps


def _execute(program, steps, weights, inputs, handles, overlap: bool, torch, dist) -> list[np.ndarray]:
    """One device's program: its steps in order; collectives synchronous, or (overlap) issued as soon
    as their operand is ready and waited for at their result's first use."""
    from tilegraph.ir.interpreter import GLOBALS, evaluate

    env: dict = dict(zip(program.func.args, inputs))
    pending: dict = {}
    consumers: dict = {}
    for kind, op, *_ in steps:
        if kind == "collective":
            consumers.setdefault(op.operands[0], []).append(op)

    def value(v):
        if v in pending:
            work, finish = pending.pop(v)
            work.wait()
            env[v] = finish()
        return env[v]

    issued = set()

    def issue_users(results):
        for user in (u for r in results for u in consumers.get(r, [])):
            issue(user)
            issued.add(user)

    def issue(op):
        handle, pos, n = handles[tuple(op.grid_axes.get_values())]
        work, finish = _collective(op, np.asarray(value(op.operands[0])), handle, pos, n, torch, dist, overlap)
        if work is None or not overlap:
            if work is not None:
                work.wait()
            env[op.results[0]] = finish()
        else:
            pending[op.results[0]] = (work, finish)

    for kind, op, *rest in steps:
        if kind == "op":
            env.update(zip(op.results, evaluate(op, [value(v) for v in op.operands], weights, dict(GLOBALS),
                                                float64=False)))
            results = op.results
        elif kind == "segment":
            ins, results = rest
            env.update(zip(results, op(*[value(v) for v in ins])))
        else:
            if op not in issued:
                issue(op)
            continue
        if overlap:
            issue_users(results)
    return [np.asarray(value(v)) for v in program.func.body.block.last_op.operands]


_DTYPES = ("float32", "float64", "float16", "int64", "int32", "bool", "int8", "uint8")
_HEADER = 10  # dtype, rank, up to 8 dims


def _send(x: np.ndarray, dst: int, torch, dist) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(x.dtype.name), x.ndim
    header[2:2 + x.ndim] = torch.tensor(x.shape, dtype=torch.int64)
    dist.send(header, dst)
    dist.send(torch.tensor(np.ascontiguousarray(x)), dst)  # torch-owned: see _collective


def _recv(src: int, torch, dist) -> np.ndarray:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    dist.recv(header, src)
    shape = tuple(int(d) for d in header[2:2 + int(header[1])])
    t = torch.from_numpy(np.empty(shape, dtype=_DTYPES[int(header[0])])).clone()
    dist.recv(t, src)
    return t.numpy()


def join_local_group(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join the gloo group of `world` processes on this machine as `rank`, on one thread. Each
    process is one device and the processes share the cores: one thread each (OpenMP, torch,
    BLAS, the NumPy backend's chunk pool, which reads TILEGRAPH_NUM_THREADS when first
    imported), else every process's threads spin on cores the others need."""
    import datetime

    import torch
    import torch.distributed as dist
    from threadpoolctl import threadpool_limits

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TILEGRAPH_NUM_THREADS", "1")
    torch.set_num_threads(1)
    threadpool_limits(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _worker(rank: int, world: int, port: int, tmp: str, config: list, micro_batches: int, modes: list,
            repeats: int, timeout_s: float) -> None:
    import time

    import torch
    import torch.distributed as dist

    from tilegraph.backends.simulated_mesh import gather, groups
    from tilegraph.ir.model import Model, WeightStore

    join_local_group(rank, world, port, timeout_s)
    try:
        k = max(i for i, c in enumerate(config) if c["offset"] <= rank)
        stage, local = config[k], rank - config[k]["offset"]
        mesh = stage["mesh"]
        n = math.prod(mesh)
        tmp_path = Path(tmp)
        program = Model.load(tmp_path / f"program{k}.mlir")
        weights = WeightStore.load(tmp_path / f"weights{k}_{local}.npz")
        # Every rank creates every group, in the same order (torch.distributed's rule).
        handles: dict[tuple[int, ...], tuple[Any, int, int]] = {}
        whole = None
        for i, c in enumerate(config):
            for axes in c["axes"]:
                for members in groups(c["mesh"], axes):
                    handle = dist.new_group([c["offset"] + m for m in members])
                    if i == k and local in members:
                        handles[axes] = (handle, members.index(local), len(members))
            group = dist.new_group(list(range(c["offset"], c["offset"] + math.prod(c["mesh"])))) \
                if len(config) > 1 else None
            if i == k:
                whole = group
        batches = []
        if k == 0:
            for m in range(micro_batches):
                with np.load(tmp_path / f"inputs{local}_{m}.npz") as data:
                    batches.append([data[f"arr_{i}"] for i in range(len(data.files))])
        steps = {b: _steps(program, weights, b) for b in dict.fromkeys(b for b, _ in modes)}

        def step(steps, overlap) -> list:
            """One step over every micro-batch; the last stage's gathered outputs per micro-batch."""
            results = []
            for m in range(micro_batches):
                if k == 0:
                    inputs = batches[m]
                else:
                    before = config[k - 1]
                    src = before["offset"] + local % math.prod(before["mesh"])
                    inputs = [np.array(piece(_recv(src, torch, dist), spec, mesh, local)) for spec in stage["in_specs"]]
                outs = _execute(program, steps, weights, inputs, handles, overlap, torch, dist)
                full = []
                for x, spec in zip(outs, stage["out_specs"]):
                    t = torch.tensor(np.ascontiguousarray(x).reshape(x.shape))
                    parts = [torch.empty_like(t) for _ in range(n)]
                    dist.all_gather(parts, t, group=whole)
                    full.append(gather([q.numpy() for q in parts], spec, mesh))
                if k + 1 < len(config):
                    after = config[k + 1]
                    for j in range(math.prod(after["mesh"])):
                        if j % n == local:
                            for x in full:
                                _send(x, after["offset"] + j, torch, dist)
                else:
                    results.append(full)
            return results

        times = np.zeros((repeats, len(modes)))
        results: list = [[] for _ in modes]
        for r in range(repeats):
            order = list(range(len(modes)))
            for i in order if r % 2 == 0 else order[::-1]:  # ABBA: drift lands on every mode alike
                dist.barrier()
                started = time.perf_counter()
                results[i] = step(steps[modes[i][0]], modes[i][1])
                times[r, i] = time.perf_counter() - started
        slowest = torch.tensor(times)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if k == len(config) - 1 and local == 0:
            for i, per_batch in enumerate(results):
                np.savez(tmp_path / f"outputs{i}.npz", *[np.concatenate(parts) if len(parts) > 1 else parts[0]
                                                         for parts in zip(*per_batch)])
            np.save(tmp_path / "times.npy", slowest.numpy())
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _collective(op, x: np.ndarray, group, pos: int, n: int, torch, dist, async_op: bool = False):
    """Start `op` on `group`: (work or None, finish) where finish() gives the result once work is done."""
    # A writable copy that torch owns: collectives work in place, and an asynchronous one may
    # release its tensor on gloo's thread, where a NumPy-owned buffer would need the GIL.
    t = torch.tensor(np.asarray(x))
    if op.name in ("shard.all_reduce", "shard.reduce_scatter"):
        kind = op.reduction.data.value
        reduce_op = {"sum": dist.ReduceOp.SUM, "average": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                     "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}[kind]
        work = dist.all_reduce(t, op=reduce_op, group=group, async_op=async_op)

        def finish():
            out = t.numpy() / n if kind == "average" else t.numpy()
            if op.name == "shard.reduce_scatter":
                out = np.array_split(out, n, axis=op.scatter_axis.value.data)[pos]
            return out.astype(x.dtype)

        return work, finish
    if op.name == "shard.all_slice":
        return None, lambda: np.array_split(x, n, axis=op.slice_axis.value.data)[pos]
    if op.name not in ("shard.all_gather", "shard.all_to_all"):
        raise DistributedError(f"no torch.distributed lowering for {op.name}")
    parts = [torch.empty_like(t) for _ in range(n)]
    work = dist.all_gather(parts, t, group=group, async_op=async_op)

    def finish():  # type: ignore[no-redef]
        xs = [q.numpy() for q in parts]
        if op.name == "shard.all_gather":
            return np.concatenate(xs, axis=op.gather_axis.value.data)
        split, concat = op.split_axis.value.data, op.concat_axis.value.data
        return np.concatenate([np.array_split(q, n, axis=split)[pos] for q in xs], axis=concat)

    return work, finish
