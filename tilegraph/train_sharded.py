"""The shard planner's training plans executed for real: ZeRO-3 data parallelism, Megatron tensor
parallelism and pipeline stages (1F1B or GPipe) on local processes (torch.multiprocessing + gloo).

Rank 0 plans first (tilegraph/train_plan.py `plan_for`: passes/shard.py's integer program with the strategy's layout
pinned, on a mesh of this machine's CPU profile and a gloo link measured by the processes together,
`measure_link`) and sends every rank the plan's decisions; each then executes what the plan says:

  zero3     each float weight the plan stores split (its spec splits dim d over the data axis) is held
            as this rank's slice of dim d, with its AdamW moments; the model runs as segments (FSDP
            units: tests/models.py `char_gpt_segments(..., "zero3")`, the embedding, each block, the
            head): a segment's slices are all-gathered (one packed collective) just before its
            forward and again before its backward, the whole weights freed after each, the next
            segment's gather started (asynchronous) before this one computes; a segment's gradients
            are reduce-scattered onto the slices after its backward (as an all-reduce of the packed
            gradients, each rank keeping its own part, as backends/distributed.py does: gloo's
            reduce-scatter of CPU tensors is slower, benchmarks/gloo_collectives.py) and the optimizer module steps on the slices alone
            (DeepSpeed ZeRO-3 / FSDP2).
  tensor    Megatron-LM's split: each weight the plan splits by columns or rows is held as this
            rank's slice (a fused qkv by heads: `Segments.slicer`); the model runs as segments
            (`Segments`, built per model: tests/models.py `char_gpt_segments`) between collectives:
            a parallel segment's outputs are partial sums, all-reduced (forward), and the cotangent
            of its inputs too (backward: Megatron's `f`), two all-reduces per block each way.
  pipeline  2 stages: stage k holds its segments (the plan's layers split evenly) and runs the
            micro-batches' forwards and backwards in the schedule's order (`pipeline_order`: 1F1B,
            the default, holds at most 2 - k micro-batches' activations; GPipe all of them; the
            plan is priced for the schedule run); stage 0 sends each boundary activation to stage
            1, which returns its cotangent (asynchronous sends: under 1F1B both stages send at
            once); gradients accumulate over the micro-batches; with 4 processes, two
            replicas of the pipeline average their gradients (data parallelism over the stage).

A segment's backward module recomputes its forward from its inputs (the vjp module takes the
inputs and the cotangents): full activation recomputation at segment granularity, as GPipe and
Megatron's `--recompute-granularity full` do, so every plan is priced with every layer recomputed
(`recompute="always"`). Gradient clipping uses the global norm (one more
all-reduce). Each process reports its step times and its memory: the arrays it holds between
steps (weights and optimizer state, `held`), its C modules' arena of temporaries (one per rank, a
runtime.Workspace the modules take turns on) and the peak of what a warm step allocates besides
(tracemalloc, which NumPy reports its buffers to), against the plan's bytes per device.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
import tracemalloc
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model

from tilegraph.train_plan import (STRATEGIES, ShardedTrainError, chunk, host_time, measure_device,  # noqa: F401
                                  measure_dispatch, measure_link, plan_for, stored_splits)


# --- executing a plan ---------------------------------------------------------------------


@dataclass
class Segment:
    """One piece of the model between collectives: a tg model (`model`, its weights this rank's pieces
    under the model's own names), the values it reads and writes (names in the step's environment), the
    weights it trains (model name -> global name)."""

    model: Model
    inputs: list[str]
    outputs: list[str]
    params: dict[str, str]
    partial: bool = False  # outputs are partial sums over the tensor-parallel group
    loss: bool = False  # the model's first output are the logits; the segment returns the loss

    # sent to the processes as text and weights (xDSL's IR does not pickle), as ModelAt's models are
    def __getstate__(self) -> dict:
        return {**self.__dict__, "model": (self.model.text, dict(self.model.weights))}

    def __setstate__(self, state: dict) -> None:
        text, weights = state["model"]
        self.__dict__.update(state, model=Model.parse(text, weights))


@dataclass
class Segments:
    """A model as segments (`build(rank, world, rows)` -> [Segment], each rank its pieces at `rows` rows) and how a fused
    weight is sliced (`slicer(name, array, dim, rank, world)`, default: contiguous chunks)."""

    build: Callable[[int, int, int], list[Segment]]  # (rank, world, rows of a batch) -> this rank's segments
    slicer: Callable[..., np.ndarray] | None = None
    stage_of: Callable[[Segment], int] | None = None  # pipeline: which stage runs a segment


@dataclass
class _Compiled:
    seg: Segment
    forward: Any
    backward: Any
    float_inputs: list[str] = field(default_factory=list)


def _compile_segment(seg: Segment, target: str, pipeline: Any, options: dict) -> _Compiled:
    import tilegraph
    from tilegraph.ir import dtypes
    from tilegraph.ir.autodiff import value_and_grad, vjp
    from tilegraph.ir.shapes import info_of
    from tilegraph.train import _with_loss, weights_to_inputs

    base = _with_loss(seg.model, "cross_entropy") if seg.loss else seg.model
    params = list(seg.params)
    with_inputs = weights_to_inputs(base, params)
    names = with_inputs.input_names
    floats = [n for n, a in zip(names, with_inputs.func.body.block.args)
              if n not in seg.params and dtypes.is_float(info_of(a.type).dtype)]
    back = (value_and_grad if seg.loss else vjp)(with_inputs.clone(), wrt=floats + params)
    forward = tilegraph.compile(with_inputs, target=target, pipeline=pipeline, **options)
    backward = tilegraph.compile(back, target=target, pipeline=pipeline, **options)
    return _Compiled(seg, forward, backward, floats)


# tracemalloc's domain for the torch-owned buffers of collectives (NumPy reports its arrays to
# tracemalloc, torch does not): a step's measured peak counts them where they are live
_TORCH_DOMAIN = 0x74670000


def _traced(t: Any, live: bool = True) -> Any:
    """`t` (a torch tensor a collective fills or sends) reported to tracemalloc as live, or no
    longer (`live=False`: the caller drops it), while tracing."""
    if tracemalloc.is_tracing():
        api = ctypes.pythonapi
        if live:
            api.PyTraceMalloc_Track(ctypes.c_uint(_TORCH_DOMAIN), ctypes.c_size_t(t.data_ptr()),
                                    ctypes.c_size_t(t.numel() * t.element_size()))
        else:
            api.PyTraceMalloc_Untrack(ctypes.c_uint(_TORCH_DOMAIN), ctypes.c_size_t(t.data_ptr()))
    return t


# Tensors handed to collectives while tracemalloc traces, referenced here until it stops. CPython
# 3.11's tracemalloc.stop() frees its traceback buffer while another thread may be inside its
# allocation hook, waiting there for the GIL (CPython gh-128679, fixed in 3.12.9 and 3.13.2). gloo's
# threads enter Python when they drop the last reference to a tensor whose Python object Python had
# already dropped (torch then keeps that object alive; freeing it takes the GIL, and a thread state
# allocated through that hook). A rank died this way in libpython, and its peer reported only
# "Connection reset by peer". While Python holds every such tensor until tracing stops
# (`_stop_tracing`), gloo's threads enter Python only when tracing is off.
_HELD_WHILE_TRACING: list = []


def _held(t: Any) -> Any:
    """`t`, kept referenced until tracing stops if a collective gets it while tracing."""
    if tracemalloc.is_tracing():
        _HELD_WHILE_TRACING.append(t)
    return t


def _stop_tracing() -> None:
    tracemalloc.stop()
    _HELD_WHILE_TRACING.clear()


def _comm_buffer(n: int, dtype: Any = None) -> Any:
    """An empty torch-owned buffer of `n` elements for a collective (torch-owned: see send() in
    ShardedStep._segments), counted by tracemalloc (`_traced`) until released."""
    import torch

    return _held(_traced(torch.empty(n, dtype=dtype or torch.float32)))


def rank_segments(strategy: str, segments: Segments | None, pieces: list[Segment] | None, rank: int, world: int,
                  rows: int) -> list[Segment]:
    """The segments `rank` runs: `pieces` (its tensor-parallel pieces, built by the caller) or built
    here, less the other pipeline stage's."""
    if segments is None:
        raise ShardedTrainError(f"{strategy} runs the model as segments: pass segments=")
    tp = world if strategy == "tensor" else 1
    segs = pieces if pieces is not None else segments.build(rank if strategy == "tensor" else 0, tp, rows)
    if strategy == "pipeline":
        assert segments.stage_of is not None
        stage = rank // (world // 2)
        segs = [s for s in segs if segments.stage_of(s) == stage]
    return segs


def workspace_bytes(compiled: Sequence[_Compiled], shared: bool = True, transient_gradients: bool = False) -> int:
    """The bytes of temporaries a rank's compiled segments will hold, as the C runtime lays their
    calls out (`call_bytes`: the binding's arena, before any call): one Workspace sized to the
    largest module's arena (`shared`), or each module's own; with `transient_gradients` (ZeRO-3,
    whose whole gradients are reduce-scattered onto slices; micro-batches after the first, whose
    gradients are added to the earlier ones'), also the largest backward's outputs, held beside
    the gradients the plan counts. 0 where a backend allocates per value (NumPy: its temporaries
    are a step's allocations, measured as such)."""
    from tilegraph.ir.arena import ALIGN

    arenas, outputs = [], [0]
    for c in compiled:
        for m in (c.forward, c.backward):
            program = getattr(m._runner, "program", None)
            if program is not None:
                from tilegraph.backends.c.runtime import call_bytes

                arena, out = call_bytes(program)
                arenas.append(arena + ALIGN)
                if m is c.backward:
                    outputs.append(out)
    return (max(arenas, default=0) if shared else sum(arenas)) + (max(outputs) if transient_gradients and arenas else 0)


def _all_reduce_arrays(arrays: list, clock: _Clock, group: Any = None) -> list[np.ndarray]:
    """`arrays` summed over the group's ranks, packed into one collective (gloo's per-call cost
    dominates small tensors); the sums are written back into `arrays` (the step's own arrays:
    no second copy of them) where they are writable, else into new ones."""
    import torch.distributed as dist

    packed = _comm_buffer(sum(a.size for a in arrays))
    flat, at, out = packed.numpy(), 0, []
    for a in arrays:
        flat[at:at + a.size] = np.ravel(a)
        at += a.size
    with clock("comm"):
        dist.all_reduce(packed, group=group)
    at = 0
    for a in arrays:
        got = flat[at:at + a.size].reshape(a.shape)
        if isinstance(a, np.ndarray) and a.flags.writeable and a.flags.c_contiguous and a.dtype == flat.dtype:
            np.copyto(a, got)
            out.append(a)
        else:
            out.append(got.copy())
        at += a.size
    _traced(packed, live=False)
    return out


def _scaled(g: Any, scale: float) -> np.ndarray:
    """`g` times `scale`, in place where `g` is a module's own writable result."""
    g = np.asarray(g)
    if g.flags.writeable and g.flags.owndata:
        g *= np.asarray(scale, g.dtype)
        return g
    return g * np.asarray(scale, g.dtype)


class _Clock:
    """Seconds a step spends per term: "compute" (compiled modules), "comm" (collectives and
    point-to-point, waiting for the peer included); the rest of a step is host glue."""

    def __init__(self):
        self.spent = {"compute": 0.0, "comm": 0.0}

    def __call__(self, term: str):
        return _Timed(self.spent, term)


class _Timed:
    def __init__(self, spent: dict, term: str):
        self.spent, self.term = spent, term

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.spent[self.term] += time.perf_counter() - self.start


def pipeline_order(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """The forwards ("F", j) and backwards ("B", j) of `m` micro-batches as stage `stage` of `stages`
    runs them. "gpipe": every forward, then every backward. "1f1b" (PipeDream-flush, Megatron-LM's
    schedule): stages - stage - 1 forwards to fill the pipeline, then one forward and one backward
    in turn, then the backwards left; a stage holds at most stages - stage micro-batches'
    activations, not m (the same m + p - 1 slots: the step time is GPipe's)."""
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
    if schedule != "1f1b":
        raise ShardedTrainError(f"unknown pipeline schedule '{schedule}': 1f1b, gpipe")
    warmup = min(stages - stage - 1, m)
    order = [("F", j) for j in range(warmup)]
    for j in range(m - warmup):
        order += [("F", warmup + j), ("B", j)]
    return order + [("B", j) for j in range(m - warmup, m)]


class ShardedStep:
    """One rank's training step under a plan (see the module docstring)."""

    def __init__(self, strategy: str, splits: dict[str, int], params: dict[str, np.ndarray], optimizer, rank: int,
                 world: int,
                 target: str, pipeline: Any, options: dict,
                 segments: Segments | None = None, micro_batches: int = 1, clip_norm: float | None = None,
                 rows: int = 0, pieces: list[Segment] | None = None, schedule: str = "1f1b",
                 compiled: list[_Compiled] | None = None):
        """`compiled`: this rank's segments already compiled (`rank_segments`, `_compile_segment`);
        else compiled here."""
        import torch.distributed as dist

        import tilegraph
        from tilegraph.ir.shapes import info_of
        from tilegraph.train import build_update

        self.strategy, self.optimizer, self.rank, self.world = strategy, optimizer, rank, world
        self.clip_norm, self.micro_batches, self.steps = clip_norm, micro_batches, 0
        self.schedule = schedule if strategy == "pipeline" else "gpipe"  # (one micro-batch: the same order)
        self.in_flight = 0  # the most micro-batches whose activations this rank held at once
        self.splits = splits  # weight name -> the dim it is stored split on (`stored_splits` of the plan)
        if segments is None:
            raise ShardedTrainError(f"{strategy} runs the model as segments: pass segments=")
        self.stages = 2 if strategy == "pipeline" else 1
        self.tp = world if strategy == "tensor" else 1
        self.dp = world // self.stages if strategy == "pipeline" else world if strategy == "zero3" else 1
        self.stage = rank // self.dp if strategy == "pipeline" else 0
        tp_rank = rank if strategy == "tensor" else 0
        # `pieces`: this rank's segments built by the caller (`Processes.train` builds them once, in
        # the parent, where torch.export is already imported: importing it costs each process seconds)
        if compiled is None:
            compiled = [_compile_segment(s, target, pipeline, options)
                        for s in rank_segments(strategy, segments, pieces, rank, world, rows)]
        segs = [c.seg for c in compiled]
        slicer = segments.slicer or (lambda name, a, dim, r, n: chunk(a, dim, r, n))
        self.weights = {}
        for s in segs:
            for local, name in s.params.items():
                if name in self.splits and strategy == "zero3":  # stored as this rank's slice
                    self.weights[name] = chunk(params[name], self.splits[name], rank, world)
                    continue
                if name in self.splits and self.tp > 1:
                    self.weights[name] = slicer(name, params[name], self.splits[name], tp_rank, self.tp)
                else:
                    self.weights[name] = np.array(params[name])
                expect = np.asarray(s.model.weights[local]).shape
                if self.weights[name].shape != expect:
                    raise ShardedTrainError(f"{name}: the plan gives this rank {self.weights[name].shape}, the "
                                            f"segment holds {expect}")
        self.compiled = compiled
        # the activation stage 1 receives: its first segment's first input, less the batch dim
        self._boundary_shape = tuple(int(d) for d in info_of(segs[0].model.func.body.block.args[0].type).shape[1:])
        if strategy == "pipeline" and self.dp > 1:
            # the ranks of one stage average their gradients; every rank creates every group
            groups = [dist.new_group([st * self.dp + r for r in range(self.dp)]) for st in range(self.stages)]
            self.stage_group = groups[self.stage]
        self.state = {f"{s}.{k}": np.zeros_like(v) for k, v in self.weights.items() for s in optimizer.state_names()}
        # on C the update is compiled with the default passes whatever `pipeline` says: its fused
        # loops write the weights and moments where they lie (donated inputs, Model.aliases); unfused,
        # each op's result is a new array copied back, a second copy of all this rank holds at the
        # step's peak
        self.update = tilegraph.compile(build_update(self.weights, optimizer), target=target,
                                        pipeline=None if target == "c" else pipeline, **options)
        names = self.update.model.input_names
        self._updates = {r: names[i] for i, r in self.update.model.aliases.items()}
        self.step_peak = 0
        self.gathered_peak = 0  # ZeRO-3: the most gathered (whole) weight bytes live at once
        self.clock = _Clock()

    def modules(self) -> list:
        """Every compiled module this rank runs (segments' forwards and backwards, the update)."""
        return [m for c in self.compiled for m in (c.forward, c.backward)] + [self.update]

    def arena_bytes(self) -> int:
        """Bytes of the C modules' arenas of temporaries this rank holds (its shared Workspace's, or
        each module's own); 0 on NumPy."""
        runners = [m._runner for m in self.modules()]
        spaces = {id(w): w for r in runners if (w := getattr(r, "workspace", None)) is not None}
        own = sum(b.arena.nbytes for r in runners if getattr(r, "workspace", None) is None
                  for b in getattr(r, "_bindings", {}).values())
        return own + sum(w.nbytes for w in spaces.values())

    def held(self) -> int:
        """Bytes this rank keeps between steps: its weights (or slices) and their optimizer state."""
        return sum(a.nbytes for a in self.weights.values()) + sum(a.nbytes for a in self.state.values())

    def __call__(self, ids: np.ndarray, targets: np.ndarray, lr: float | None = None) -> float:
        from tilegraph.train import _write_back

        self.steps += 1
        tracing = tracemalloc.is_tracing()
        if tracing:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
        if self.strategy == "zero3":
            loss, grads = self._zero3(ids, targets)
        else:
            loss, grads = self._segments(ids, targets)
        self._clip(grads)
        rate = self.optimizer.lr if lr is None else lr
        feed = {"grad_" + k: g for k, g in grads.items()}
        with self.clock("compute"):
            outs = self.update.run(**self.weights, **feed, **self.state, lr=np.float32(rate), step=np.float32(self.steps))
        _write_back(self._updates, outs, self.weights, self.state)
        del outs, feed, grads
        if tracing:
            self.step_peak = max(self.step_peak, tracemalloc.get_traced_memory()[1] - base)
        return loss

    # ZeRO-3 (FSDP): per segment, its weights gathered just before use and freed after, the next
    # segment's gather started before this one computes; its gradients reduce-scattered after its backward
    def _gather_start(self, c: _Compiled):
        """Start the all-gather of `c`'s split weights (one packed collective, asynchronous)."""
        import torch.distributed as dist

        split = [g for g in c.seg.params.values() if g in self.splits]
        if not split:
            return c, split, [], None
        # torch-owned (see `send` in _segments): the asynchronous gather may end on gloo's thread
        mine = _comm_buffer(sum(self.weights[g].size for g in split))
        flat, at = mine.numpy(), 0
        for g in split:
            flat[at:at + self.weights[g].size] = self.weights[g].ravel()
            at += self.weights[g].size
        pieces = [_comm_buffer(mine.numel()) for _ in range(self.world)]
        return c, split, [mine] + pieces, dist.all_gather(pieces, mine, async_op=True)

    def _gather_finish(self, handle) -> dict[str, np.ndarray]:
        """The gathered weights of a `_gather_start`: {global name: whole array} (unsplit ones as held)."""
        c, split, buffers, work = handle
        pieces = buffers[1:]
        if work is not None:
            with self.clock("comm"):
                work.wait()
        whole = {g: self.weights[g] for g in c.seg.params.values() if g not in self.splits}
        at = 0
        for g in split:
            n = self.weights[g].size
            whole[g] = np.concatenate([p.numpy()[at:at + n].reshape(self.weights[g].shape) for p in pieces],
                                      axis=self.splits[g])
            at += n
        for b in buffers:
            _traced(b, live=False)
        return whole

    def _reduce_scatter(self, grads: dict, names: list[str], extra: float = 0.0) -> float:
        """`grads[k]` (whole, this rank's) for `names` replaced by the ranks' mean of this rank's slice
        (whole where the weight is not split), one packed all-reduce (module docstring: gloo's
        reduce-scatter is slower); `extra` (the loss) averaged with them."""
        import torch.distributed as dist

        split = [k for k in names if k in self.splits]
        rest = [k for k in names if k not in self.splits]
        per_rank = sum(self.weights[k].size for k in split)
        # each rank's slices packed straight into the collective's buffer, each whole gradient
        # dropped once packed (no copy of the unit's gradients besides the buffer)
        packed = _comm_buffer(self.world * per_rank + sum(self.weights[k].size for k in rest) + 1)
        flat, at = packed.numpy(), 0
        whole = {k: grads.pop(k) for k in names}
        for r in range(self.world):
            for k in split:
                d, n = self.splits[k], self.weights[k].shape[self.splits[k]]
                piece = whole[k][(slice(None),) * d + (slice(r * n, (r + 1) * n),)]
                flat[at:at + piece.size].reshape(piece.shape)[...] = piece
                at += piece.size
        for k in rest:
            flat[at:at + whole[k].size] = whole[k].ravel()
            at += whole[k].size
        flat[at] = extra
        del whole
        with self.clock("comm"):
            dist.all_reduce(packed)
        flat /= self.world
        at = self.rank * per_rank
        for k in split:
            grads[k] = flat[at:at + self.weights[k].size].reshape(self.weights[k].shape).copy()
            at += self.weights[k].size
        at = self.world * per_rank
        for k in names:
            if k not in self.splits:
                grads[k] = flat[at:at + self.weights[k].size].reshape(self.weights[k].shape).copy()
                at += self.weights[k].size
        mean = float(flat[-1])
        _traced(packed, live=False)
        return mean

    def _unit_bytes(self, c: _Compiled | None) -> int:
        """Bytes of `c`'s split weights gathered whole."""
        return 0 if c is None else sum(self.weights[g].nbytes * self.world for g in c.seg.params.values()
                                       if g in self.splits)

    def _zero3(self, ids, targets) -> tuple[float, dict[str, np.ndarray]]:
        grads: dict[str, np.ndarray] = {}
        env = {"ids": ids, "targets": targets}
        order = [c for c in self.compiled if not c.seg.loss]  # the loss segment's forward runs in its backward
        handle = self._gather_start(order[0]) if order else None
        for i, c in enumerate(order):
            whole = self._gather_finish(handle)
            ahead = order[i + 1] if i + 1 < len(order) else None
            handle = self._gather_start(ahead) if ahead is not None else None  # prefetch
            self.gathered_peak = max(self.gathered_peak, self._unit_bytes(c) + self._unit_bytes(ahead))
            env.update(zip(c.seg.outputs, self._run_forward(c, env, whole)))
            del whole
        back = list(reversed(self.compiled))
        handle, cot, loss = self._gather_start(back[0]), {}, 0.0
        for i, c in enumerate(back):
            whole = self._gather_finish(handle)
            ahead = back[i + 1] if i + 1 < len(back) else None
            handle = self._gather_start(ahead) if ahead is not None else None
            self.gathered_peak = max(self.gathered_peak, self._unit_bytes(c) + self._unit_bytes(ahead))
            got, value = self._run_backward(c, env, cot, 1.0, grads, whole)
            del whole
            for k, g in got.items():
                cot[k] = g if k not in cot else cot[k] + g
            for k in c.seg.inputs:  # the activation and its cotangent are done with
                if k in cot and k != "ids":
                    env.pop(k, None)
            mean = self._reduce_scatter(grads, list(c.seg.params.values()), value or 0.0)
            if value is not None:
                loss = mean
        return loss, grads

    # tensor / pipeline: segments between collectives
    def _run_forward(self, c: _Compiled, env: dict, weights: dict | None = None) -> list:
        local = {k: (weights or self.weights)[g] for k, g in c.seg.params.items()}
        with self.clock("compute"):
            outs = c.forward.run(**{n: env[i] for n, i in zip(c.forward.model.input_names, c.seg.inputs)}, **local)
        return [np.asarray(o) for o in outs]

    def _run_backward(self, c: _Compiled, env: dict, cot: dict, scale: float, grads: dict,
                      weights: dict | None = None):
        """One segment's vjp: adds its weights' gradients into `grads`, returns {input name: cotangent}
        and the loss (loss segment)."""

        local = {k: (weights or self.weights)[g] for k, g in c.seg.params.items()}
        names = c.backward.model.input_names
        feed = {n: env[i] for n, i in zip(c.forward.model.input_names, c.seg.inputs)}
        if c.seg.loss:
            feed["targets"] = env["targets"]
        else:
            for out_name, value in zip(c.forward.model.output_names, c.seg.outputs):
                if "cotangent_" + out_name in names:
                    feed["cotangent_" + out_name] = cot[value] if value in cot else np.zeros_like(env[value])
        with self.clock("compute"):
            outs = c.backward.run(**feed, **local)
        n_out = len(c.backward.model.output_names) - len(c.float_inputs) - len(c.seg.params)
        loss = float(outs[0]) if c.seg.loss else None
        g_inputs = [_scaled(g, scale) if c.seg.loss else np.asarray(g) for g in outs[n_out:n_out + len(c.float_inputs)]]
        if c.seg.partial and self.tp > 1 and g_inputs:  # Megatron's f: the input's gradient summed over the group
            g_inputs = _all_reduce_arrays(g_inputs, self.clock)
        for k, g in zip(c.seg.params, outs[n_out + len(c.float_inputs):]):
            g = _scaled(g, scale) if c.seg.loss else np.asarray(g)
            name = c.seg.params[k]
            if name in grads:  # a later micro-batch's: added where the first one's lies
                grads[name] += g
            else:
                grads[name] = g
        names_in = dict(zip(c.forward.model.input_names, c.seg.inputs))
        return {names_in[n]: g for n, g in zip(c.float_inputs, g_inputs)}, loss

    def _segments(self, ids, targets) -> tuple[float, dict[str, np.ndarray]]:
        import torch
        import torch.distributed as dist

        grads: dict[str, np.ndarray] = {}
        m = self.micro_batches
        rows = ids.shape[0] // m
        envs: dict[int, dict] = {}  # micro-batch -> its environment, from its forward to its backward
        sends: list = []  # point-to-point sends in flight: under 1F1B both stages may send at once
        peer = None
        if self.strategy == "pipeline":
            peer = (1 - self.stage) * self.dp + self.rank % self.dp
        total = 0.0

        def send(a: np.ndarray) -> None:
            # a copy torch owns: gloo's thread may drop the last reference to a sent tensor, and one
            # made by torch.from_numpy then releases its NumPy array there, without the GIL (it
            # crashed the process in libpython, 2 of about 10 runs)
            t = _held(_traced(torch.tensor(a)))
            sends.append((dist.isend(t, dst=peer), t))

        def forward(j: int) -> None:  # each segment's outputs all-reduced where partial
            env = {"ids": ids[j * rows:(j + 1) * rows], "targets": targets[j * rows:(j + 1) * rows]}
            if self.strategy == "pipeline" and self.stage == 1:
                t = _held(torch.empty((rows,) + self._boundary_shape))
                with self.clock("comm"):
                    dist.recv(t, src=peer)
                env[self.compiled[0].seg.inputs[0]] = t.numpy().copy()  # NumPy's: counted by tracemalloc
            for c in self.compiled:
                if c.seg.loss:
                    continue  # its forward runs inside its backward (value_and_grad)
                outs = self._run_forward(c, env)
                if c.seg.partial and self.tp > 1:
                    outs = _all_reduce_arrays(outs, self.clock)
                env.update(zip(c.seg.outputs, outs))
            if self.strategy == "pipeline" and self.stage == 0:
                send(env[self.compiled[-1].seg.outputs[0]])
            envs[j] = env
            self.in_flight = max(self.in_flight, len(envs))

        def backward(j: int) -> float:
            env, cot, loss_j = envs.pop(j), {}, 0.0
            if self.strategy == "pipeline" and self.stage == 0:
                out = self.compiled[-1].seg.outputs[0]
                t = _held(torch.empty(env[out].shape))
                with self.clock("comm"):
                    dist.recv(t, src=peer)
                cot[out] = t.numpy().copy()
            for c in reversed(self.compiled):
                got, loss = self._run_backward(c, env, cot, 1.0 / m, grads)
                if loss is not None:
                    loss_j = loss / m
                for k, g in got.items():
                    cot[k] = g if k not in cot else cot[k] + g
                for v in c.seg.outputs:  # read by later segments only, whose backwards ran: done with
                    cot.pop(v, None)
                    env.pop(v, None)
            if self.strategy == "pipeline" and self.stage == 1:
                send(cot[self.compiled[0].seg.inputs[0]])
            return loss_j

        for kind, j in pipeline_order(self.schedule, self.stage, self.stages, m):
            if kind == "F":
                forward(j)
            else:
                total += backward(j)
        with self.clock("comm"):
            for work, t in sends:
                work.wait()
                _traced(t, live=False)
        if self.strategy == "pipeline":
            # the loss lives on the last stage; replicas of a stage average their gradients
            if self.dp > 1:
                names = sorted(grads)
                summed = _all_reduce_arrays([grads[k] for k in names], self.clock, group=self.stage_group)
                grads = {k: g for k, g in zip(names, summed)}
                for g in grads.values():
                    g /= self.dp
            t = _held(torch.tensor([total if self.stage == 1 else 0.0], dtype=torch.float64))
            with self.clock("comm"):
                dist.all_reduce(t)
            total = float(t.item()) / self.dp
        return total, grads

    def _clip(self, grads: dict[str, np.ndarray]) -> None:
        """torch's clip_grad_norm_ over the whole model's gradients: each rank's unique share of the
        squared norm summed over the ranks."""
        import torch
        import torch.distributed as dist

        if self.clip_norm is None:
            return
        own = 0.0
        for k, g in grads.items():
            r = np.ravel(g)
            sq = float(np.einsum("i,i->", r, r, dtype=np.float64))  # no float64 copy of g
            if self.strategy == "zero3":
                own += sq if k in self.splits else sq / self.world
            elif self.strategy == "tensor":
                own += sq if k in self.splits else sq / self.world
            else:
                own += sq / self.dp
        t = _held(torch.tensor([own], dtype=torch.float64))
        with self.clock("comm"):
            dist.all_reduce(t)
        coef = min(self.clip_norm / (float(np.sqrt(t.item())) + 1e-6), 1.0)
        for g in grads.values():  # in place: the step's own arrays (no scaled copy of every gradient)
            g *= np.asarray(coef, g.dtype)


# --- launching -----------------------------------------------------------------------------


class ModelAt:
    """A picklable `make_model(rows)`: tg models imported once by the caller, keyed by rows (None: the
    batch symbolic), sent to each process as text and weights."""

    def __init__(self, models: dict[int | None, Model]):
        self.texts = {k: (m.text, dict(m.weights)) for k, m in models.items()}

    def __call__(self, rows: int | None) -> Model:
        if rows not in self.texts:
            raise ShardedTrainError(f"no model imported at {rows} rows (have {sorted(map(str, self.texts))})")
        text, weights = self.texts[rows]
        return Model.parse(text, weights)


def train_sharded(strategy: str, make_model: Callable[[int | None], Model], params: Sequence[str],
                  batches: Sequence[tuple[Any, Any]], world: int, optimizer, clip_norm: float | None = None,
                  segments: Callable[[], Segments] | None = None, micro_batches: int = 2, target: str = "numpy",
                  pipeline: Any = None, timeout_s: float = 900.0, calibrate: bool = False,
                  schedule: str = "1f1b") -> dict:
    """Train with `strategy` on `world` local processes started for this run (`Processes.train`, which
    see: several runs on one set of processes pay its start-up once)."""
    _check(strategy, batches, world, micro_batches, schedule)
    with Processes(world, timeout_s) as group:
        return group.train(strategy, make_model, params, batches, optimizer, clip_norm=clip_norm, segments=segments,
                           micro_batches=micro_batches, target=target, pipeline=pipeline, calibrate=calibrate,
                           schedule=schedule)


def _check(strategy: str, batches: Sequence[tuple[Any, Any]], world: int, micro_batches: int, schedule: str) -> None:
    if strategy not in STRATEGIES:
        raise ShardedTrainError(f"unknown strategy '{strategy}': {', '.join(STRATEGIES)}")
    pipeline_order(schedule, 0, 2, 1)  # an unknown schedule: its error
    rows = world if strategy != "pipeline" else (world // 2) * micro_batches
    if any(int(x.shape[0]) % rows for x, _ in batches):
        raise ShardedTrainError(f"every batch's rows must split evenly into {rows} pieces")


class Processes:
    """`world` local processes (torch.multiprocessing, spawned) joined in one gloo group, one thread
    each, kept for any number of training runs (`train`); the gloo link is measured once, by the
    first run. A context manager: leaving it ends the processes."""

    def __init__(self, world: int, timeout_s: float = 900.0):
        self.world, self.timeout_s = world, timeout_s
        self._procs: Any = None

    def __enter__(self) -> Processes:
        import torch.multiprocessing as mp

        from tilegraph.backends.distributed import _free_port

        ctx = mp.get_context("spawn")
        self._jobs = [ctx.SimpleQueue() for _ in range(self.world)]
        self._results = ctx.Queue()
        with _one_thread_each():
            self._procs = mp.start_processes(_serve, args=(self.world, _free_port(), self._jobs, self._results,
                                                           self.timeout_s),
                                             nprocs=self.world, join=False, start_method="spawn")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._procs is None

    def _died(self, wait_s: float = 2.0) -> str:
        """The processes that ended without reporting, with their exit codes (a negative one is the
        signal that ended it), after waiting up to `wait_s` for them: a collective's error in one
        rank (gloo's "Connection reset by peer") is often another rank's death, said here."""
        assert self._procs is not None
        procs = self._procs.processes
        deadline = time.monotonic() + wait_s
        while all(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = [(i, p.exitcode) for i, p in enumerate(procs) if not p.is_alive()]
        return "".join(f"; process {i} ended with exit code {code}"
                       + (f" ({signal.Signals(-code).name})" if code is not None and code < 0 else "")
                       for i, code in dead)

    def close(self) -> None:
        if self._procs is None:
            return
        procs, self._procs = self._procs.processes, None
        for q, p in zip(self._jobs, procs):
            if p.is_alive():
                q.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # stuck in a collective whose peer failed
                p.terminate()
                p.join()

    def train(self, strategy: str, make_model: Callable[[int | None], Model], params: Sequence[str],
              batches: Sequence[tuple[Any, Any]], optimizer, clip_norm: float | None = None,
              segments: Callable[[], Segments] | None = None, micro_batches: int = 2, target: str = "numpy",
              pipeline: Any = None, calibrate: bool = False, schedule: str = "1f1b", shared_arena: bool = True) -> dict:
        """Train with `strategy` on these processes; `make_model(rows)`: the whole model as tg IR at
        `rows` rows of a batch (None: the batch dim symbolic, named B, as the plan wants it), weights
        the initial ones (`ModelAt`); `segments()`: the model as Segments (called in each process: a
        picklable function, e.g. functools.partial of tests/models.py char_gpt_segments);
        `calibrate`: the processes measure their device before planning (`measure_device`), else
        rank 0 plans on the cached profile; `schedule`: the pipeline's ("1f1b", "gpipe"); `shared_arena` (target "c"): a rank's modules lay their
        temporaries out in one arena (runtime.Workspace), not one each. Returns rank 0's {"losses", "seconds", "plan":
        {...predicted...}, "memory": [(held bytes, a step's peak bytes, compute s, collectives s,
        gathered peak bytes, the most micro-batches in flight, C arena bytes) per rank], "runners": the classes that ran its modules, "reference_kernels":
        (target "c") its GEMMs left on oneDNN's slow reference kernel, "arenas": (target "c") each of its
        modules' arena bytes}. A process's error is raised here as ShardedTrainError
        (the processes are ended: a peer may be waiting in a collective)."""
        import queue

        if self._procs is None:
            raise ShardedTrainError("the processes are not started (use Processes as a context manager)")
        _check(strategy, batches, self.world, micro_batches, schedule)
        pieces = None
        if segments is not None:  # each tensor-parallel rank's segments, built here once (see ShardedStep)
            _, _, tp, rows = _split(strategy, self.world, micro_batches, int(batches[0][0].shape[0]))
            built = segments()
            pieces = [built.build(r, tp, rows) for r in range(tp)]
        for rank, q in enumerate(self._jobs):
            q.put((strategy, make_model, list(params), list(batches), optimizer, clip_norm, segments,
                   pieces[rank % len(pieces)] if pieces else None, micro_batches, target, pipeline, calibrate,
                   schedule, shared_arena))
        out: dict = {}
        waiting = set(range(self.world))
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            try:
                rank, error, result = self._results.get(timeout=1.0)
            except queue.Empty:
                died = self._died(wait_s=0.0)
                if died or time.monotonic() > deadline:
                    self.close()
                    raise ShardedTrainError(f"no result{died}" if died
                                            else f"no result after {self.timeout_s:.0f} s") from None
                continue
            if error is not None:
                died = self._died()
                self.close()
                raise ShardedTrainError(f"process {rank}: {error}{died}")
            waiting.discard(rank)
            if rank == 0:
                out = result
        return out


@contextlib.contextmanager
def _one_thread_each():
    """The spawned processes' environment: one OpenMP/BLAS thread and one NumPy-backend thread each
    (read when they import tilegraph, before any code of ours runs there); the parent's is restored."""
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TILEGRAPH_NUM_THREADS")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(dict.fromkeys(names, "1"))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _serve(rank, world, port, jobs, results, timeout_s) -> None:
    """A process of `Processes`: joins the group, then runs the training jobs it is sent until None."""
    import traceback

    import torch.distributed as dist

    from tilegraph.backends.distributed import join_local_group

    join_local_group(rank, world, port, timeout_s)
    try:
        link = None
        while (job := jobs[rank].get()) is not None:
            try:
                if link is None:
                    link = measure_link()
                results.put((rank, None, _train(rank, world, link, *job)))
            except Exception as e:  # noqa: BLE001 (sent to the parent, which raises it)
                detail = str(e) if isinstance(e, TilegraphError) else traceback.format_exc()
                results.put((rank, f"{type(e).__name__}: {detail}", None))
    finally:
        dist.destroy_process_group()


@dataclass
class PlanSummary:
    """What the ranks need of rank 0's plan: the weights it stores split (`stored_splits`) and its
    predictions."""

    splits: dict[str, int]
    numbers: dict[str, float]


def _summary(plan, alpha: float, beta: float) -> PlanSummary:
    sm = list(plan.stage_memory) + [0.0, 0.0]
    terms = {f"stage{s}_{k}": v for s, t in enumerate(plan.memory_terms) for k, v in t.items()}
    numbers = {**terms, "time": plan.time, "compute": plan.compute, "comm": plan.comm, "memory": plan.memory,
               "zero": plan.zero, "stages": plan.stages, "micro_batches": plan.micro_batches,
               "recompute": plan.recompute, "host": plan.host, "alpha": alpha, "beta": beta, "stage0_memory": sm[0],
               "stage1_memory": sm[1]}
    return PlanSummary(stored_splits(plan), {k: float(v) for k, v in numbers.items()})


def _split(strategy: str, world: int, micro_batches: int, batch: int) -> tuple[int, int, int, int]:
    """(data-parallel ranks per stage, micro-batches, tensor-parallel ranks, rows a segment runs at)."""
    stages = 2 if strategy == "pipeline" else 1
    dp = world // stages if strategy != "tensor" else 1
    m = micro_batches if strategy == "pipeline" else 1
    return dp, m, world if strategy == "tensor" else 1, batch // dp // m


def _train(rank, world, link, strategy, make_model, params, batches, optimizer, clip_norm, segments, pieces,
           micro_batches, target, pipeline, calibrate, schedule, shared_arena=True) -> dict | None:
    """One rank's training run; rank 0 returns the result (`Processes.train`)."""
    import torch
    import torch.distributed as dist

    from tilegraph.train import _numpy

    alpha, beta = link
    batch = int(batches[0][0].shape[0])
    dp, m, _, rows = _split(strategy, world, micro_batches, batch)
    model = make_model(None)  # planned with its batch symbolic; each module compiled at this rank's rows
    device = measure_device(calibrate, target)
    options: dict = {}
    if target == "c":
        from tilegraph.backends.c.runtime import Workspace

        # the rank's modules run one after another: one arena for all their temporaries, the
        # largest module's, not one arena each held for the whole run
        options = {"threads": 1, **({"workspace": Workspace()} if shared_arena else {})}
    seg_obj = segments() if segments is not None else None
    # the segments compiled before the plan: it counts the temporaries their calls will hold (the
    # largest rank's of each stage), as the C runtime lays them out
    compiled = [_compile_segment(s, target, pipeline, options)
                for s in rank_segments(strategy, seg_obj, pieces, rank, world, rows)]
    # and the host's time per call, measured here (rank 0's, as the device profile), per rank
    dispatch = [measure_dispatch(target, {"threads": 1} if target == "c" else {})]
    dist.broadcast_object_list(dispatch, src=0)
    n_weights = len({g for c in compiled for g in c.seg.params.values()})
    update_inputs = (2 + len(optimizer.state_names())) * n_weights + 2  # each weight, its gradient and state; lr, step
    per_step = int(clip_norm is not None) + int(strategy == "pipeline")  # the clip's norm, the pipeline's loss
    mb_s, step_s = host_time(compiled, update_inputs, dispatch[0], per_step, alpha, world)
    mine_t = torch.zeros((world, 3), dtype=torch.float64)
    transient = strategy == "zero3" or m > 1  # a backward's gradients beside those kept (workspace_bytes)
    mine_t[rank] = torch.tensor([float(workspace_bytes(compiled, shared_arena, transient)), mb_s, step_s],
                                dtype=torch.float64)
    dist.all_reduce(mine_t)
    if strategy == "pipeline":
        by_stage = mine_t.view(2, -1, 3).amax(dim=1)
    else:
        by_stage = mine_t.amax(dim=0, keepdim=True)
    per_stage = by_stage[:, 0].tolist()
    hosts = [(float(a), float(b)) for a, b in by_stage[:, 1:].tolist()]
    # rank 0 plans (every rank would plan the same: the same model, device and link numbers) and
    # sends the others what they need of it
    summary: list[PlanSummary | None] = [None]
    if rank == 0:
        plan = plan_for(model, strategy, world, alpha, beta, batch, m, device, optimizer, schedule,
                        workspace=per_stage, host=hosts)
        summary = [_summary(plan, alpha, beta)]
    dist.broadcast_object_list(summary, src=0)
    planned = summary[0]
    assert planned is not None
    if strategy == "zero3" and planned.numbers["zero"] != 3:
        raise ShardedTrainError(f"the zero3 layout planned ZeRO stage {planned.numbers['zero']:.0f}")
    initial = {k: np.asarray(model.weights[k]) for k in params}
    step = ShardedStep(strategy, planned.splits, initial, optimizer, rank, world, target, pipeline, options,
                       segments=seg_obj, micro_batches=m, clip_norm=clip_norm, rows=rows, pieces=pieces,
                       schedule=schedule, compiled=compiled)
    replica = rank % dp if strategy == "pipeline" else rank if strategy == "zero3" else 0

    def mine(a):
        a = _numpy(a)
        if dp <= 1:
            return a
        n = a.shape[0] // dp
        return a[replica * n:(replica + 1) * n]

    # tracemalloc slows every allocation: the memory is traced over the second and third steps only
    # (caches warm, which the step times leave out); the first step makes each module's binding
    # (its arena, counted apart: `arena_bytes`, and the Python objects of its set-up, not a step's)
    losses, seconds, terms = [], [], []
    traced = range(1, 3) if len(batches) > 4 else range(min(1, len(batches) - 1), len(batches))
    for i, (x, y) in enumerate(batches):
        if i == traced.start:
            tracemalloc.start()
            step.step_peak = 0
        if i == traced.stop and tracemalloc.is_tracing():
            _stop_tracing()
        dist.barrier()
        before = dict(step.clock.spent)
        t = time.perf_counter()
        losses.append(step(mine(x), mine(y)))
        seconds.append(time.perf_counter() - t)
        terms.append([step.clock.spent[k] - before[k] for k in ("compute", "comm")])
    if tracemalloc.is_tracing():
        _stop_tracing()
    # per rank: held bytes, a step's peak, the median step's compute and collective seconds (the
    # first steps warm caches up: left out where there are enough), ZeRO-3's gathered peak bytes, the
    # most micro-batches whose activations it held at once, the bytes of its C arenas
    warm = np.array(terms[2:] if len(terms) > 4 else terms)
    mem = torch.tensor([[float(step.held()), float(step.step_peak), *np.median(warm, axis=0),
                         float(step.gathered_peak), float(step.in_flight), float(step.arena_bytes())]],
                       dtype=torch.float64)
    gathered = [torch.zeros_like(mem) for _ in range(world)]
    dist.all_gather(gathered, mem)
    secs = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    if rank != 0:
        return None
    # what ran rank 0's modules (the backends' runner classes), and (target "c") the GEMMs left on
    # oneDNN's slow reference kernel
    runners = sorted({f"{type(m._runner).__module__}.{type(m._runner).__name__}" for m in step.modules()})
    return {"losses": [float(v) for v in losses], "seconds": secs.tolist(),
            "memory": torch.cat(gathered).tolist(), "plan": planned.numbers, "runners": runners,
            "reference_kernels": [line for m in step.modules() for line in m.reference_kernels],
            "arenas": [b.arena_bytes for m in step.modules() for b in getattr(m._runner, "_bindings", {}).values()]}
