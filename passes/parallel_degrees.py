"""`search`: the data, tensor, pipeline and sequence parallelism degrees of a training step on N devices.

What it decides, as Alpa's inter-operator pass does around its intra-operator ILP (Zheng et
al., OSDI 2022, section 5), in the enumerate-and-price form of Narayanan et al. (SC21,
section 3.3, "the degrees of parallelism interact"):

    for each pipeline degree p dividing the repeated layers and N,
      each tensor degree t in TENSOR_DEGREES (an inner mesh axis inside one node: tensor
      parallelism wants NVLink) dividing N / p, the data degree d = N / (p t),
        each micro-batch count m from `micro_batch_counts` (1F1B wants m >> p; each of
        the d replicas' micro-batch whole sequences),
          `shard.plan` plans one stage on the mesh (d, t): which mesh axis splits what
          (batch: data; tokens: sequence; heads, columns, rows: tensor), ZeRO stage,
          recomputation, under the device's memory
    the cheapest step time wins.

The mesh's axes are named by what the stage's plan does with them (`degrees`): an axis is
`data`, `sequence` or `tensor` as most of the matmul work on it is split by batch, by
tokens or by heads / columns / rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tilegraph.passes.cost.collectives import GPUS_PER_NODE, Mesh
from tilegraph.passes.cost.model import forward_flops
from tilegraph.passes.shard import FWD_BWD, LayoutError, Plan, ShardError, find_layers, plan
from tilegraph.passes.shard_strategies import base_name
from tilegraph.ir.ops import Op

# Tensor-parallel degrees tried: powers of two up to a node (Megatron-LM keeps tensor
# parallelism inside a node, Narayanan et al. 2021, takeaway #1).
TENSOR_DEGREES = (1, 2, 4, 8)


@dataclass
class Layout:
    plan: Plan  # one stage's plan (its mesh: data x tensor)
    pipeline: int
    micro_batches: int
    degrees: dict[str, int] = field(default_factory=dict)  # data, tensor, sequence, pipeline

    @property
    def time(self) -> float:
        return self.plan.time

    def describe(self) -> str:
        d = self.degrees
        return (f"dp{d['data']} tp{d['tensor']} pp{d['pipeline']} sp{d['sequence']} m{self.micro_batches} "
                f"zero{self.plan.zero}{recompute_tag(self.plan)}")


def recompute_tag(p: Plan) -> str:
    """' recompute' when every layer of a stage recomputes, ' recompute r/L' for r of L, else ''."""
    layers = p.layers[2] // max(1, p.stages)
    return "" if not p.recompute else " recompute" if p.recompute == layers else f" recompute {p.recompute}/{layers}"


def degrees(p: Plan, pipeline: int = 1) -> dict[str, int]:
    """What each mesh axis of `p` does, weighted by the matmuls' compute: batch split -> data, token
    rows -> sequence, anything else a matmul splits (columns, rows, heads) -> tensor."""
    work = [dict(data=0.0, sequence=0.0, tensor=0.0) for _ in p.mesh.shape]
    for c in p.choices:
        if c.node.op is None or c.node.op.op_name not in (Op.matmul, Op.attention):
            continue
        for part in base_name(c.strategy.name).split(">")[0].split(","):
            if "@" not in part:
                continue
            loop, axes = part.split("@")
            role = "data" if loop in ("b0", "d0") else "sequence" if loop in ("m", "q") else "tensor"
            for a in axes.split("."):
                work[int(a)][role] += c.compute + 1e-12
    out = dict(data=1, sequence=1, tensor=1, pipeline=pipeline)
    for size, w in zip(p.mesh.shape, work):
        if size > 1 and any(w.values()):
            out[max(w, key=w.get)] *= size
        elif size > 1:
            out["data"] *= size
    return out


def micro_batch_counts(batch: int, data: int, stages: int) -> list[int]:
    """Micro-batch counts to try, each replica's micro-batches whole sequences: without a pipeline
    one (no accumulation) and the most (one sequence per micro-batch: the least activation memory,
    gradient accumulation); with one the most (the smallest bubble) and half that."""
    most = batch // data
    tries = (1, most) if stages == 1 else (most, most // 2)
    return sorted({m for m in tries if m >= 1 and most % m == 0})


def model_flops(module, sizes: dict[str, int]) -> float:
    """FLOPs of one training step of the whole model (forward x FWD_BWD), no recomputation: the
    numerator of model-FLOPs utilisation (Chowdhery et al. 2022, appendix B)."""
    return forward_flops(module, sizes) * FWD_BWD


def search(module, devices: int, hw, sizes: dict[str, int], batch: str = "B", budget: float | None = None,
           tensor_degrees: Sequence[int] = TENSOR_DEGREES, pipelines: Sequence[int] | None = None,
           only=None, overlap: bool = True) -> tuple[Layout | None, list[Layout]]:
    """The cheapest layout of a training step of `module` on `devices` GPUs of `hw` (None when nothing
    fits), and every layout priced. `only`: a hand layout's strategy names (shard.plan's)."""
    func = next(f for f in module.walk() if getattr(f, "sym_name", None) and f.sym_name.data == "forward")
    from tilegraph.passes.shard import _nodes

    layers = find_layers(_nodes(func, [f"input{i}" for i in range(len(func.body.block.args))], (1,), sizes))[2]
    pipelines = pipelines or [p for p in range(1, devices + 1) if devices % p == 0 and (p == 1 or layers % p == 0)]
    tried: list[Layout] = []
    seen = set()
    for p in pipelines:
        for t in tensor_degrees:
            if (devices // p) % t or t > GPUS_PER_NODE:
                continue
            d = devices // p // t
            if sizes[batch] % d:
                continue
            shape = tuple(n for n in (d, t) if n > 1) or (1,)
            for m in micro_batch_counts(sizes[batch], d, p):
                if (p, shape, m) in seen:  # (d, 1) and (1, d) are one mesh
                    continue
                seen.add((p, shape, m))
                try:
                    pl = plan(module, Mesh(shape, hw), sizes=sizes, budget=budget, stages=p, micro_batches=m,
                              batch=batch, only=only, overlap=overlap, runner_up=False)
                except (ShardError, LayoutError):
                    continue
                tried.append(Layout(pl, p, m, degrees(pl, p)))
    best = min(tried, key=lambda lay: lay.time, default=None)
    return best, tried


def mfu(layout: Layout, flops: float, devices: int, dtype: str = "bf16") -> float:
    """Model-FLOPs utilisation: the model's FLOPs per step over what `devices` deliver at peak."""
    return flops / (layout.time * devices * layout.plan.mesh.hw.peak_flops[dtype])


# --- the stages as programs ------------------------------------------------------------------

def split_stages(model, stages: int) -> list:
    """`model` cut into `stages` models at layer boundaries (each stage an equal share of the repeated
    layers; the first also runs what comes before them, the last what comes after). Stage k's inputs
    are stage k-1's outputs: every value a later stage (or the model's result) still needs, model
    inputs passed along."""
    from tilegraph.passes.shard import _nodes

    func = model.func
    args = list(func.body.block.args)
    nodes = _nodes(func, [f"input{i}" for i in range(len(args))], (1,), {})
    start, period, copies = find_layers(nodes)
    if stages < 1 or copies < stages or copies % stages:
        raise LayoutError(f"{stages} pipeline stages need repeated layers they divide; found {copies} layers")
    if len(nodes) != len(args) + sum(1 for op in func.body.block.ops) - 1:
        raise LayoutError("pipeline stages need a @forward of tg ops only")
    return cut(model, [start + period * (copies // stages) * k - len(args) for k in range(1, stages)])


def cut(model, positions: Sequence[int]) -> list:
    """`model` cut before each of the op indices `positions` into a chain of models: piece k's inputs
    are piece k-1's outputs (every value a later piece or the model's result needs, inputs included)."""
    from xdsl.dialects.func import ReturnOp

    from tilegraph.ir.extract import extract

    func = model.func
    args = list(func.body.block.args)
    ops = [op for op in func.body.block.ops if not isinstance(op, ReturnOp)]
    ret = func.body.block.last_op
    cuts = [0] + sorted(positions) + [len(ops)]
    pieces = [ops[a:b] for a, b in zip(cuts, cuts[1:])]
    stage_of = {r: k for k, piece in enumerate(pieces) for op in piece for r in op.results}
    for a in args:
        stage_of[a] = -1
    live_in = list(args)
    result = []
    for k, piece in enumerate(pieces):
        later = [op for p in pieces[k + 1:] for op in p]
        live_out = list(dict.fromkeys(v for v in [o for op in later for o in op.operands] + list(ret.operands)
                                      if stage_of[v] <= k))
        result.append(extract(model, piece, live_in, live_out, func.arg_attrs if k == 0 else None,
                              func.res_attrs if k == len(pieces) - 1 else None))
        live_in = live_out
    return result


def stage_plans(model, p: Plan, sizes: dict[str, int] | None = None) -> list:
    """`model` cut into `p.stages` stage models (`split_stages`), each with the plan `p` made for the
    whole model (`plan(..., stages=p.stages)` prices every stage with one set of strategies), as
    [(stage model, its Plan)] to annotate and partition: an op keeps its strategy, a stage's input
    the sharding its producer's strategy gives it."""
    from tilegraph.passes.shard import _nodes, chosen_plan

    args = list(model.func.body.block.args)
    whole = _nodes(model.func, [f"input{i}" for i in range(len(args))], p.mesh.shape, sizes or {}, zero=True)
    start, period, copies = find_layers(whole)
    if p.stages < 1 or copies < p.stages or copies % p.stages:
        raise LayoutError(f"{p.stages} pipeline stages need repeated layers they divide; found {copies} layers")
    ops = [op for op in model.func.body.block.ops if op.name != "func.return"]
    node_of = {v: i for i, v in enumerate(args)}
    node_of.update({op.results[0]: len(args) + q for q, op in enumerate(ops) if op.results})
    per_stage = copies // p.stages
    first = [0] + [start + period * per_stage * k - len(args) for k in range(1, p.stages)]
    result = []
    producers = [node_of[v] for v in args]  # whole-model nodes of stage 0's inputs
    for k, stage in enumerate(split_stages(model, p.stages)):
        stage_ops = [op for op in stage.func.body.block.ops if op.name != "func.return"]
        index = producers + [len(args) + first[k] + j for j in range(len(stage_ops))]
        wanted = iter(index)

        def pick(node, wanted=wanted):
            chosen = p.choices[next(wanted)].strategy
            names = [s.name for s in node.strategies]
            if node.op is not None:
                return names.index(chosen.name)
            return next(i for i, s in enumerate(node.strategies) if s.out == chosen.out)

        result.append((stage, chosen_plan(stage.module, p.mesh, pick, sizes)))
        if k + 1 < p.stages:  # the next stage's inputs: this stage's outputs, in order
            ret = stage.func.body.block.last_op
            local = {v: index[i] for i, v in enumerate(list(stage.func.body.block.args) +
                                                        [op.results[0] for op in stage_ops if op.results])}
            producers = [local[v] for v in ret.operands]
    return result
