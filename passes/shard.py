"""`shard`: choose how every op is split over a device mesh, as an integer program (Alpa).

What it decides: for every value of @forward, a sharding (MLIR `split_axes`: which
mesh axes each dim is split over), written into the IR as `shard.grid`,
`shard.sharding` and `shard.shard` annotations (xDSL's shard dialect, `ir/shard.py`);
`passes/partition.py` lowers an annotated module to the per-device program.

How (Zheng et al., "Alpa", OSDI 2022, section 4; alpa/shard_parallel/auto_sharding.py):

    1. per op, its strategies (`passes/shard_strategies.py`): replicated, or mesh axes
       assigned to loop dims (a matmul's rows m, columns n, or contraction k, whose
       partial sums are all-reduced, or reduce-scattered onto a result dim)
    2. per strategy, on each device, for one training step (forward + backward), as components
       the program weighs differently (`COMPONENTS`):
         compute    the cost model's time of the op at its local shapes (`passes/cost`)
                    x FWD_BWD (backward costs twice the forward)
         collective the all-reduce (or reduce-scatter, and its all-gather backward) of a
                    split contraction's partial sums, and of the gradient of an activation
                    replicated over an axis the op is split on (Megatron's `f`); a weight's
                    gradient (data parallelism's sync, reduce-scattered under ZeRO) and
                    the gathers of a weight stored split (ZeRO-3) are priced on its edge, as
                    collectives that do not depend on the compute beside them: overlapped
                    (T3, DDP's buckets), they cost what the backward cannot hide plus
                    OVERLAP_INTERFERENCE of themselves
         memory     a weight with its gradient and Adam state (16 bytes per bf16 parameter;
                    ZeRO-1/2 variants of its strategy partition the optimizer state and the
                    gradient over the axes it is replicated on); an activation only if the
                    backward reads it (`saved_for_backward`: 32 bytes per token and hidden
                    unit for a GPT layer, Korthikanti et al. 2022 without dropout)
    3. per edge producer -> consumer, the resharding between the producer's sharding
       and the one the consumer wants (`reshard_steps`, priced by
       `passes/cost/collectives.py`), forward and its adjoint backward
    4. minimize the step time  (m + p - 1) x (compute + collectives of one micro-batch)
       + exposed overlapped collectives + recomputation, subject to one strategy per op and
       weights + in-flight activations <= budget, with scipy's milp (HiGHS); edge choices are
       linearized as in Alpa (e[i,j] sums to x_producer[i] over j, to x_consumer[j] over i).
       Recomputation is an integer r of the program: r of a stage's layers keep only their
       input and re-run their forward in the backward (binary digits of r times the layers'
       activations, checkpoints and forward time, linearized with big-M rows). `stages` > 1
       prices p pipeline stages under 1F1B: m micro-batches take m + p - 1 slots (the bubble
       (p-1)/m of the work); the first stage holds the ops before the layers (embedding) and
       min(p, m) micro-batches' activations, the last the ops after them (head) and one
       micro-batch's, each its share of the layers; the slower sets the step and both must
       fit; each micro-batch's boundary activation and its gradient cross to the next stage
       (`passes/parallel_degrees.py` searches the degrees).

Repeated layers: ops are matched by signature (op, attributes, types); the longest
stretch that repeats with one period is a stack of layers, and the ops at the same
place in every layer share one set of variables (their costs add up), so a 48-layer
model has the integer program of one layer. User annotations (`shard.shard` ops
already in the input, GSPMD-style) fix their value's sharding; the solver
propagates the rest around them. `inference=true` prices a forward pass only.

Remarks: the chosen plan's predicted step time, compute vs communication, memory per
device, and the runner-up (the best plan that differs from it) with its time.
"""

from __future__ import annotations

import time as _time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Sequence

import sympy
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.func import FuncOp
from xdsl.ir import Block, SSAValue
from xdsl.passes import ModulePass

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import TgOp, make_op
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.shapes import TensorInfo, info_of, type_of
from tilegraph.ir.vjp import forward_values_read
from tilegraph.passes.cost.collectives import Mesh, parse_mesh
from tilegraph.passes.cost.hardware import check_target, hardware  # type: ignore[attr-defined]
from tilegraph.passes.cost.model import at, op_cost
from tilegraph.passes.remarks import remark
from tilegraph.passes.shard_milp import CUT_SHORT, SOLVE_TIME_LIMIT, solve
from tilegraph.passes.shard_annotations import annotate, read_annotations, strip_annotations
from tilegraph.passes.shard_strategies import (Spec, Strategy, apply_step, local_info, nbytes, pre_scatter,
                                      reshard_steps, source_strategies, spec_axes, strategies, zero_variants)
from tilegraph.ir.ops import Op

# Backward of a layer costs about twice its forward (two GEMMs per forward GEMM: the
# input and the weight gradient): the "6N FLOPs per token" of Kaplan et al. 2020 and
# Narayanan et al. 2021 (Megatron-LM, eq. 3) against 2N forward.
FWD_BWD = 3
# Bytes of optimizer state per parameter kept beside weight and gradient: Adam's two
# moments in f32, plus an f32 master copy when weights are narrower (ZeRO, Rajbhandari
# et al. 2020, section 3.1: 16 bytes per parameter for mixed-precision Adam).
ADAM_MOMENTS = 8
MASTER_COPY = 4
# Communication overlapped with compute is not free: NCCL's kernels take SMs and memory bandwidth
# from the GEMMs they run beside (Pati et al., "T3", ASPLOS 2024, section 2.3, measure such
# slowdowns of 10-20%). A hidden collective costs this share of its own time.
OVERLAP_INTERFERENCE = 0.1
# A symbolic dim the pass is given no size for is planned at this size (a batch or
# sequence of a hundred-odd, as `tilegraph cost` assumes).
DEFAULT_DIM = 128
US = 1e6  # the objective in microseconds keeps HiGHS's absolute tolerances meaningful
GB = 1e9  # memory rows in GB, for the same reason


class ShardError(TilegraphError):
    """A sharding request that cannot be met (memory, annotations); the message says why."""


class LayoutError(ShardError):
    """A layout asked for (`plan(only=...)`) that the model's shapes do not allow on the mesh."""


@dataclass
class Node:
    value: SSAValue
    op: TgOp | None  # None: a model input
    label: str
    info: TensorInfo
    strategies: list[Strategy]
    operands: list[int] = field(default_factory=list)  # node index of each operand


@dataclass
class Choice:
    """The plan's decision for one node, with its predicted costs at the planned sizes."""

    node: Node
    strategy: Strategy
    compute: float  # s per device per step
    comm: float  # s: its own collectives and the resharding of its operands
    memory: float  # bytes per device


@dataclass
class Plan:
    mesh: Mesh
    choices: list[Choice]
    compute: float
    comm: float
    memory: float
    formula: sympy.Expr  # the step time as a function of the symbolic dims
    solve_time: float
    layers: tuple[int, int, int]  # (first node, nodes per layer, layers); (0, 0, 0) without repeats
    runner_up: "Plan | None" = None
    forward: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)  # (collective, axes, where)
    variables: int = 0
    budget: float = 0.0  # bytes per device the plan had to fit
    cut_short: bool = False  # the solver hit SOLVE_TIME_LIMIT: the best plan found, not proven best
    stages: int = 1  # pipeline stages (the mesh is one of them)
    micro_batches: int = 1
    recompute: int = 0  # layers of a stage that recompute their forward in the backward (0: none)
    stage_times: tuple = ()  # s: each priced stage's step (one; or the first and the last)
    stage_memory: tuple = ()  # bytes per device of each priced stage
    memory_terms: tuple = ()  # per priced stage: {"weights", "activations", "gathered", "workspace": bytes}
    host: float = 0.0  # s of the slowest stage's step its runtime spends outside the priced ops (in compute)
    zero: int = 0  # the ZeRO stage (`zero_stage`)
    bubble: float = 0.0  # s of the step the 1F1B schedule's bubble idles

    @property
    def time(self) -> float:
        return self.compute + self.comm

    def strategy(self, label: str) -> Strategy:
        return next(c.strategy for c in self.choices if c.node.label == label)

    def describe(self) -> str:
        ops = [f"{c.node.label}: {c.strategy.name}" for c in self.choices
               if c.node.op is not None and c.node.op.op_name != Op.weight and c.strategy.name != "R"]
        return ("; ".join(ops[:6]) + (" ..." if len(ops) > 6 else "")) or "all replicated"


def _label(op: TgOp, index: int) -> str:
    if op.op_name == Op.weight:
        return op.attr("name")
    weights = [o.owner.attr("name") for o in op.operands
               if isinstance(o.owner, TgOp) and o.owner.op_name == Op.weight]
    return f"{op.op_name} %{index}" + (f" ({weights[0]})" if weights else "")


def _nodes(func: FuncOp, names: Sequence[str], mesh_shape, sizes, zero: bool = False) -> list[Node]:
    index: dict[SSAValue, int] = {}
    nodes: list[Node] = []
    seen: dict[tuple, list[Strategy]] = {}
    for arg, name in zip(func.body.block.args, names):
        info = info_of(arg.type)
        index[arg] = len(nodes)
        nodes.append(Node(arg, None, name, info, source_strategies(info, mesh_shape, sizes)))
    for op in func.body.block.ops:
        if not isinstance(op, TgOp):
            continue
        index[op.results[0]] = len(nodes)
        for extra in op.results[1:]:
            index[extra] = len(nodes)
        key = (op.name, str(op.attributes) if op.op_name != Op.weight else "", tuple(str(v.type) for v in op.operands),
               str(op.results[0].type))
        if key not in seen:  # the strategies of an op depend only on its kind, attributes and types
            seen[key] = strategies(op, mesh_shape, sizes)
        sts = seen[key]
        if op.op_name == Op.constant:  # a value printed inline is the same on every device
            sts = sts[:1]
        if zero and op.op_name == Op.weight and dtypes.is_float(op.result_infos()[0].dtype):
            sts = sts + [v for st in sts for v in zero_variants(st, mesh_shape)]
        nodes.append(Node(op.results[0], op, _label(op, len(nodes)), op.result_infos()[0], sts,
                          [index[v] for v in op.operands]))
    return nodes


# --- costs --------------------------------------------------------------------------
#
# Every cost is a dict of components (sympy expressions in the symbolic dims), because the
# integer program weighs them differently:
#   C    compute of one micro-batch (forward + backward)        x (m + p - 1) slots of 1F1B
#   F    its forward alone (what a recomputed layer runs again; not added to the step by itself)
#   Cst  compute once per step: the optimizer's update of the weight (plan(optimizer=...); else 0)
#   B    collectives on the critical path, per micro-batch      x (m + p - 1)
#   Omb  collectives independent of the compute beside them, per micro-batch (ZeRO-3's weight
#        gathers, ZeRO-2/3's gradient reduce-scatters): hidden behind the backward when overlapped
#   Ost  the same once per step (gradient all-reduce after accumulation, ZeRO-1/2's all-gather of
#        updated weights)
#   W    bytes per device once per step: a weight with its gradient and optimizer state
#   A    bytes per device per micro-batch: an activation the backward needs (live at its peak)

COMPONENTS = ("C", "F", "Cst", "B", "Omb", "Ost", "W", "A", "G")


def _local_op(op: TgOp, st: Strategy, mesh: Mesh, sizes: dict[str, int] | None = None) -> TgOp:
    """`op` at the local shapes `st` gives it on one device (its operands new block arguments);
    with `sizes`, its symbolic dims at those sizes."""
    def local(info: TensorInfo, spec) -> TensorInfo:
        out = local_info(info, spec, mesh.shape)
        return out if sizes is None else TensorInfo(tuple(int(at(d, sizes)) for d in out.shape), out.dtype)

    block = Block(arg_types=[type_of(local(info_of(v.type), s)) for v, s in zip(op.operands, st.ins)])
    result = [local(i, pre_scatter(st)) for i in op.result_infos()] if op.SPEC.result_given else None
    return make_op(op.op_name, list(block.args), op.py_attrs(), result)


def _local_time(op: TgOp, st: Strategy, mesh: Mesh, hw) -> sympy.Expr:
    """The cost model's time of `op` at the local shapes `st` gives it on one device."""
    if op.op_name in (Op.weight, Op.constant):
        return sympy.Integer(0)
    return op_cost(_local_op(op, st, mesh), hw).time


def _backward_time(op: TgOp, st: Strategy, mesh: Mesh, hw, sizes: dict[str, int]) -> sympy.Expr | None:
    """The cost model's time of the ops `op`'s VJP (ir/vjp.py, what autodiff emits) builds at the
    local shapes, every operand's gradient made; None where the op has no rule. Priced at `sizes`
    (a number, not a formula of the symbolic dims: pricing dozens of ops' formulas per op is slow)."""
    from tilegraph.ir.vjp import VJPS, Backward

    rule = VJPS.get(op.op_name)
    if rule is None or op.op_name in (Op.weight, Op.constant):
        return None
    b = Backward()
    try:
        local = _local_op(op, st, mesh, sizes)
        seeds = Block(arg_types=[r.type for r in local.results])
        rule(b, local, list(seeds.args))
    except (NotImplementedError, TilegraphError):
        return None
    return sum((op_cost(o, hw).time for o in b.ops if o.op_name != Op.constant), sympy.Integer(0))


def _needs_grad(node: Node) -> bool:
    return node.op is not None and node.op.op_name != Op.constant and dtypes.is_float(node.info.dtype)


def _is_weight(node: Node) -> bool:
    return node.op is not None and node.op.op_name == Op.weight


def saved_for_backward(nodes: list[Node]) -> list[bool]:
    """Which values a training step keeps from the forward for the backward: the operands and
    results each op's VJP rule reads (ir/vjp.forward_values_read), a view's (ir/ops' `view`
    trait: its storage is its input's) through to the value it views."""
    needed = [False] * len(nodes)
    for j in reversed(range(len(nodes))):
        op = nodes[j].op
        if op is None:
            continue
        if op.SPEC.view:
            for i in nodes[j].operands:
                needed[i] = needed[i] or needed[j]
            continue
        operands, result = forward_values_read(op)
        needed[j] = needed[j] or result
        for k in operands:
            needed[nodes[j].operands[k]] = True
    return [needed[i] and (n.op is None or not n.op.SPEC.view)
            for i, n in enumerate(nodes)]


def weight_bytes(info: TensorInfo, st: Strategy, mesh: Mesh) -> sympy.Expr:
    """A float weight's bytes per device in training: itself, its gradient, Adam's two f32 moments and
    an f32 master copy when narrower (ZeRO, section 3.1: 16 bytes per parameter in mixed precision);
    ZeRO-1 partitions the optimizer state, ZeRO-2 the gradient too, over the axes the spec leaves free."""
    local = nbytes(local_info(info, st.out, mesh.shape))
    size = dtypes.numpy_dtype(info.dtype).itemsize
    optimizer = local * sympy.Rational(ADAM_MOMENTS + (MASTER_COPY if size < 4 else 0), size)
    free = mesh.group_size([a for a in range(len(mesh.shape)) if a not in spec_axes(st.out)])
    grad = local / free if st.zero >= 2 else local
    return local + grad + (optimizer / free if st.zero >= 1 else optimizer)


def _node_cost(node: Node, st: Strategy, nodes: list[Node], mesh: Mesh, hw, training: bool, saved: bool,
               backward: str = "flops", optimizer: Callable[[int], float] | None = None,
               sizes: dict[str, int] | None = None, units: dict[int, int] | None = None) -> dict:
    """The components of one strategy (see COMPONENTS). `units`: node -> how many weights share its
    unit's collectives (`_weight_units`)."""
    zero = sympy.Integer(0)
    cost = dict.fromkeys(COMPONENTS, zero)
    compute = _local_time(node.op, st, mesh, hw) if node.op is not None else zero
    out_bytes = nbytes(local_info(node.info, st.out, mesh.shape))
    comm = zero
    if st.scatter is not None:  # forward reduce-scatter; backward its adjoint, an all-gather of the gradient
        summed = nbytes(local_info(node.info, pre_scatter(st), mesh.shape))
        comm = mesh.collective("reduce_scatter", st.partial, summed)
        if training:
            comm += mesh.collective("all_gather", st.partial, summed)
    elif st.partial:
        comm = mesh.collective("all_reduce", st.partial, out_bytes)
    if not training:
        cost.update(C=compute, B=comm, A=out_bytes)
        return cost
    cost["F"] = compute
    if dtypes.is_float(node.info.dtype):
        back = _backward_time(node.op, st, mesh, hw, sizes or {}) if backward == "vjp" and node.op is not None else None
        compute = compute + back if back is not None else compute * FWD_BWD
    for i, spec in zip(node.operands, st.ins):
        missing = [a for a in st.split if a not in spec_axes(spec)]
        if missing and _needs_grad(nodes[i]) and not _is_weight(nodes[i]):
            # An activation's gradient is summed over its uses on each device and all-reduced once:
            # each use pays its share (exact when they agree, as Q, K and V projections do). A
            # weight's is priced on its edge (`_weight_edge`): it depends on the weight's ZeRO stage.
            uses = sum(1 for u in nodes[i].value.uses if isinstance(u.operation, TgOp))
            grad = nbytes(local_info(nodes[i].info, spec, mesh.shape))
            if _views_weight(nodes[i]):  # a weight's gradient (through its view): reduced with its unit's
                comm += _shared(mesh.collective("all_reduce", missing, grad), mesh.collective(
                    "all_reduce", missing, 0), (units or {}).get(i, 1)) / max(1, uses)
            else:
                comm += mesh.collective("all_reduce", missing, grad) / max(1, uses)
    cost.update(C=compute, B=comm)
    if _is_weight(node) and dtypes.is_float(node.info.dtype):
        cost["W"] = weight_bytes(node.info, st, mesh)
        if optimizer is not None:  # the optimizer steps on the elements this device updates
            replicas = mesh.group_size([a for a in range(len(mesh.shape)) if a not in spec_axes(st.out)])
            elements = at(nbytes(local_info(node.info, st.out, mesh.shape))) / dtypes.numpy_dtype(node.info.dtype).itemsize
            cost["Cst"] = sympy.Float(optimizer(int(elements // replicas if st.zero >= 1 else elements)))
        if st.zero:  # the updated slices all-gathered after the optimizer step
            free = [a for a in range(len(mesh.shape)) if a not in spec_axes(st.out)]
            cost["Ost"] = mesh.collective("all_gather", free, out_bytes)
    elif _is_weight(node):
        cost["W"] = out_bytes
    elif saved:
        cost["A"] = out_bytes
    return cost


# Node costs by (signature, mesh, ...) and strategy: formulas of the symbolic dims, so a search
# planning one model many times (passes/parallel_degrees.py) prices each op once per mesh.
_NODE_COSTS: dict[tuple, dict | None] = {}


def _shared(cost: sympy.Expr, latency: sympy.Expr, unit: int) -> sympy.Expr:
    """`cost` of one weight's collective when `unit` weights share one packed collective (FSDP's
    flat parameters, a unit's gradients reduced at once): its bytes, 1/unit of the latency."""
    return cost - latency + latency / max(1, unit)


def _reshard_latency(src: Spec, dst: Spec, mesh: Mesh) -> sympy.Expr:
    """The per-call part of `reshard_cost(.., src, dst, ..)`: its collectives at zero bytes."""
    total, spec = sympy.Integer(0), src
    for step in reshard_steps(src, dst):
        if step.collective in ("all_gather", "all_to_all"):
            total += mesh.collective(step.collective, [step.axis], 0)
        spec = apply_step(spec, step)
    return total


def _weight_units(nodes: list[Node], start: int, period: int, copies: int) -> dict[int, int]:
    """Weight node (and view of one) -> how many float weights its unit has: a unit (ZeRO-3's, FSDP's)
    is one layer, or the weights before the layers, or those after; its weights are gathered in one
    packed collective and their gradients reduced in one."""
    def unit(i: int) -> int:
        return -1 if i < start or not copies else (i - start) // period if i < start + period * copies else copies
    weights = [i for i, n in enumerate(nodes) if _is_weight(n) and _needs_grad(n)]
    size: dict[int, int] = {}
    for i in weights:
        size[unit(i)] = size.get(unit(i), 0) + 1
    out = {i: size[unit(i)] for i in weights}
    for i, n in enumerate(nodes):
        op: Any = n.op
        while isinstance(op, TgOp) and op.SPEC.view and op.operands and i not in out:
            o = op.operands[0].owner
            w = next((j for j in weights if nodes[j].op is o), None)
            if w is not None:
                out[i] = out[w]
            op = o
    return out


@lru_cache(maxsize=1 << 16)
def _weight_edge(info: TensorInfo, sp: Strategy, want: Spec, split: tuple[int, ...], mesh: Mesh, uses: int,
                 unit: int = 1) -> dict:
    """A training step's collectives between a float weight and one use of it: the all-gather of a
    weight stored split (ZeRO-3 / FSDP: forward, and again in the backward, the gathered copy being
    freed between), and the gradient's reduction over the axes the consumer splits its work on but
    the weight is not split on: reduce-scattered onto the stored slices where the weight was gathered,
    else all-reduced once per step (gradients accumulate over micro-batches) or, at ZeRO-1/2,
    reduce-scattered onto the optimizer's partition (per micro-batch at ZeRO-2, whose gradient is
    kept partitioned). Weight gradients are bucketed (collectives.GRADIENT_BUCKET); a gathered weight's
    gather and reduce-scatter are its `unit`'s packed collectives (`_shared`)."""
    gather = _shared(reshard_cost(info, sp.out, want, mesh), _reshard_latency(sp.out, want, mesh), unit)
    gathered = spec_axes(sp.out) - spec_axes(want)
    missing = [a for a in split if a not in spec_axes(want)]
    grad = nbytes(local_info(info, want, mesh.shape))
    scatter = [a for a in missing if a in gathered]
    reduce = [a for a in missing if a not in gathered]
    per_mb = 2 * gather  # backward: gathered again (or the gradient moved back to the stored layout)
    per_step = sympy.Integer(0)
    # ZeRO-3's gathered copy, live while its unit computes (G: counted once per weight, not per use)
    held = nbytes(local_info(info, want, mesh.shape)) if mesh.group_size(sorted(gathered)) > 1 else sympy.Integer(0)
    if scatter:
        per_mb += _shared(mesh.collective("reduce_scatter", scatter, grad), mesh.collective("reduce_scatter", scatter, 0),
                          unit)
    if reduce:
        kind = "all_reduce" if sp.zero == 0 else "reduce_scatter"
        if sp.zero >= 2:
            per_mb += mesh.bucketed(kind, reduce, grad)
        else:
            per_step += mesh.bucketed(kind, reduce, grad)
    return {"Omb": per_mb / uses, "Ost": per_step / uses, "G": held / uses}


@lru_cache(maxsize=1 << 16)  # a plan asks about the same few (shape, spec, spec) many times
def reshard_cost(info: TensorInfo, src: Spec, dst: Spec, mesh: Mesh) -> sympy.Expr:
    """Seconds to move a value from sharding `src` to `dst` (slices are free)."""
    total, spec = sympy.Integer(0), src
    for step in reshard_steps(src, dst):
        after = apply_step(spec, step)
        if step.collective == "all_gather":
            total += mesh.collective("all_gather", [step.axis], nbytes(local_info(info, after, mesh.shape)))
        elif step.collective == "all_to_all":
            total += mesh.collective("all_to_all", [step.axis], nbytes(local_info(info, spec, mesh.shape)))
        spec = after
    return total


def _edge_cost(prod: Node, sp: Strategy, cons: Node, sc: Strategy, pos: int, mesh: Mesh, training: bool,
               unit: int = 1) -> dict:
    """`unit`: how many weights share `prod`'s unit's collectives, where it is a weight or views one."""
    if training and _is_weight(prod) and _needs_grad(prod):
        uses = max(1, sum(1 for u in prod.value.uses if isinstance(u.operation, TgOp)))
        return {"B": sympy.Integer(0), **_weight_edge(prod.info, sp, sc.ins[pos], sc.split, mesh, uses, unit)}
    fwd = reshard_cost(prod.info, sp.out, sc.ins[pos], mesh)
    back = reshard_cost(prod.info, sc.ins[pos], sp.out, mesh) if training and _needs_grad(prod) else 0
    if training and _views_weight(prod) and mesh.group_size(sorted(spec_axes(sp.out) - spec_axes(sc.ins[pos]))) > 1:
        # a weight stored split, gathered after a view of it (a Linear's transpose): ZeRO-3's copy,
        # priced as a weight's own gather (`_weight_edge`): with its unit's weights, overlapped (the
        # next unit's gather runs ahead), again for the backward (freed between)
        uses = max(1, sum(1 for u in prod.value.uses if isinstance(u.operation, TgOp)))
        gather = _shared(fwd, _reshard_latency(sp.out, sc.ins[pos], mesh), unit)
        return {"B": back, "Omb": 2 * gather, "Ost": sympy.Integer(0),
                "G": nbytes(local_info(prod.info, sc.ins[pos], mesh.shape)) / uses}
    return {"B": fwd + back, "Omb": sympy.Integer(0), "Ost": sympy.Integer(0), "G": sympy.Integer(0)}


def _views_weight(node: Node) -> bool:
    """Whether `node` is a view (transpose, reshape) of a weight, through any number of views."""
    op: Any = node.op
    while isinstance(op, TgOp) and op.SPEC.view and op.operands:
        op = op.operands[0].owner
    return node.op is not op and isinstance(op, TgOp) and op.op_name == Op.weight


# --- repeated layers ------------------------------------------------------------------

def _signature(node: Node) -> tuple:
    if node.op is None:
        return ("input", str(node.info))
    attrs = {k: str(v) for k, v in node.op.attributes.items() if k != "name"}
    return (node.op.name, tuple(sorted(attrs.items())), str(node.info),
            tuple(str(nd.type) for nd in node.op.operands))


def find_layers(nodes: list[Node]) -> tuple[int, int, int]:
    """(start, period, copies) of the longest stretch of nodes that repeats, or (0, 0, 0)."""
    sigs = [_signature(n) for n in nodes]
    best = (0, 0, 0)
    n = len(sigs)
    for p in range(1, n // 2 + 1):
        run = 0
        for i in range(n - p + 1):
            if i < n - p and sigs[i] == sigs[i + p]:
                run += 1
                continue
            copies = (run + p) // p
            if copies >= 2 and copies * p > best[1] * best[2]:
                best = (i - run, p, copies)
            run = 0
    return best


def plan(module: ModuleOp, mesh: Mesh, *, budget: float | None = None, sizes: dict[str, int] | None = None,
         training: bool = True, constraints: dict[SSAValue, Spec] | None = None, names: Sequence[str] = (),
         only=None, reduce_scatter: bool = True, stages: int = 1, micro_batches: int = 1, batch: str = "B",
         overlap: bool = True, recompute: bool = True, zero: bool = True, runner_up: bool = True,
         progress: Callable[[str], object] | None = None, backward: str = "flops",
         optimizer: Callable[[int], float] | None = None, schedule: str = "1f1b",
         workspace: float | Sequence[float] = 0.0, repeat_collectives: bool = True, packed_units: bool = False,
         host: tuple[float, float] | Sequence[tuple[float, float]] = (0.0, 0.0)) -> Plan:
    """The cheapest sharding of @forward on `mesh` under `budget` bytes per device (default: the device's memory).

    `only(node)`: the strategy names (without ZeRO stage) a node may take, or None for any (a hand
    layout to price: benchmarks/shard_plans.py pins Megatron's and data parallelism's this way).
    `reduce_scatter=False`: partial sums are only all-reduced (Megatron-LM without sequence parallelism).
    `stages`, `micro_batches`: the mesh is one of `stages` pipeline stages, each holding that share of
    the repeated layers, the global batch (`sizes[batch]`) run as `micro_batches` micro-batches in a
    1F1B schedule. `overlap`, `recompute`, `zero`: whether independent collectives hide behind the
    backward, layers may be recomputed ("always": must be, as a published configuration did), weights
    may take ZeRO stages 1-2. `progress(stage)`: told what the planner is doing (tilegraph shard's status line).
    `backward`: "flops" prices an op's backward as FWD_BWD - 1 forwards (GEMM-bound layers); "vjp" as the
    cost model's time of the ops its VJP rule builds (where per-op overheads, not FLOPs, set the time).
    `optimizer(elements)`: seconds of the optimizer's update of that many elements of a weight, counted
    once per step on each device's share (None: the update is not priced). `schedule`: the pipeline's,
    "1f1b" or "gpipe" (the same m + p - 1 slots; every stage keeps all m micro-batches' activations).
    `workspace`: bytes per device (or per priced stage) the backend holds for its calls' temporaries
    besides the values the plan counts, e.g. a C arena sized to its largest call (backends/c/runtime's
    `call_bytes`): the recomputed layer's activations are then inside it, not counted again.
    `repeat_collectives`: a recomputed layer re-runs its forward's collectives and keeps only its
    input (Megatron-LM's full recomputation), or keeps their results and re-runs none (a runtime
    that recomputes between collectives: tilegraph.train_sharded's segments). `packed_units`: a weight
    stored split is gathered, and its gradient reduced, in one packed collective with the rest of its
    unit (`_weight_units`: FSDP's flat parameters), each weight paying its share of the latency; else
    one collective per weight. `host`: (seconds per micro-batch, seconds per step) a stage's runtime
    spends besides the ops the cost model prices (one per stage, or one for all): dispatching its
    calls, its per-step collectives (a gradient clip's norm); counted in the step's compute."""
    if backward not in ("flops", "vjp") or schedule not in ("1f1b", "gpipe"):
        raise ShardError(f"backward '{backward}' (flops, vjp) or schedule '{schedule}' (1f1b, gpipe) unknown")
    from tilegraph.passes.shard_program import _build, _count_gathered, _gathered_over, _read_back

    say = progress or (lambda stage: None)
    started = _time.perf_counter()
    prog = _build(module, mesh, budget=budget, sizes=sizes, training=training, constraints=constraints, names=names, only=only, reduce_scatter=reduce_scatter, stages=stages, micro_batches=micro_batches, batch=batch, overlap=overlap, recompute=recompute, zero=zero, say=say, backward=backward, optimizer=optimizer, schedule=schedule, workspace=workspace, repeat_collectives=repeat_collectives, packed_units=packed_units, host=host)
    counts = [len(a) for a in prog.comp["C"]]
    CUT_SHORT.clear()
    say(f"solving the integer program (at most {SOLVE_TIME_LIMIT:.0f} s)")
    choice, extra_values, nvars = solve(prog.objective, prog.rows, counts, prog.edges, prog.extras, prog.allowed)
    if choice is not None and _gathered_over(prog, choice, extra_values):
        # the gathered units (rows of their own, added only where they bind: a program without
        # them solves as before) push a stage past the budget: solved again with them
        say(f"solving again with ZeRO-3's gathered units counted (at most {SOLVE_TIME_LIMIT:.0f} s)")
        _count_gathered(prog)
        choice, extra_values, nvars = solve(prog.objective, prog.rows, counts, prog.edges, prog.extras, prog.allowed)
    if choice is None:
        least = max(sum(float(m.min()) for m in mem.nodes.values()) * GB for mem in prog.memories)
        raise ShardError(f"no sharding on mesh {mesh} fits {prog.budget / 1e9:.3g} GB per device (with the annotations "
                         f"given): the smallest plan needs {least / 1e9:.3g} GB")
    second, second_extra = None, []
    if runner_up:
        say(f"solving for the runner-up plan (at most {SOLVE_TIME_LIMIT:.0f} s)")
        second, second_extra, _ = solve(prog.objective, prog.rows, counts, prog.edges, prog.extras, prog.allowed, exclude=choice)
    solve_time = _time.perf_counter() - started

    best = _read_back(prog, choice, extra_values, solve_time, nvars)
    if second is not None:
        best.runner_up = _read_back(prog, second, second_extra, solve_time, nvars)
    return best




def recompute_text(p: Plan) -> str:
    layers = p.layers[2] // max(1, p.stages)
    return f"{p.recompute} of {layers} layers recomputed" if p.recompute else "no recomputation"


def zero_stage(p: Plan) -> int:
    """The plan's ZeRO stage: 3 when a weight is stored split and gathered where used, else the highest
    stage a weight takes (0: every weight's optimizer state whole on each device it is replicated on)."""
    for u in p.choices:
        for pos, o in enumerate(u.node.operands):
            w = p.choices[o]
            if _is_weight(w.node) and spec_axes(w.strategy.out) - spec_axes(u.strategy.ins[pos]):
                return 3
    return max((c.strategy.zero for c in p.choices), default=0)


def chosen_plan(module: ModuleOp, mesh: Mesh, pick, sizes: dict[str, int] | None = None) -> Plan:
    """A plan of given choices (`pick(node) -> strategy index`), not costed: to annotate any valid
    plan, as the tests of the partitioner do (ZeRO variants included)."""
    func = next(f for f in module.walk() if isinstance(f, FuncOp) and f.sym_name.data == "forward")
    nodes = _nodes(func, [f"input{i}" for i in range(len(func.body.block.args))], mesh.shape, sizes or {}, zero=True)
    choices = [Choice(n, n.strategies[pick(n)], 0.0, 0.0, 0.0) for n in nodes]
    return Plan(mesh, choices, 0.0, 0.0, 0.0, sympy.Integer(0), 0.0, (0, 0, 0))


def parse_memory(text: str) -> float | None:
    """'80GB' -> 80e9, '512MiB' -> 536870912.0, '' -> None (the device's own memory)."""
    import re

    if not str(text).strip():
        return None
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?i?b?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"cannot read memory '{text}': write e.g. 80GB or 512MiB")
    unit = m.group(2).rstrip("b") or ""
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    return float(m.group(1)) * scale[unit]


def parse_sizes(text: str) -> dict[str, int]:
    """'B=8,S=128' -> {'B': 8, 'S': 128}."""
    out = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        name, _, value = part.replace(":", "=").partition("=")
        if not value.strip().isdigit():
            raise ValueError(f"cannot read size {part!r}: write NAME=SIZE or NAME:SIZE, e.g. B:8")
        out[name.strip()] = int(value)
    return out


@dataclass(frozen=True)
class Shard(ModulePass):
    """Choose a sharding of every op on a device mesh (see the module docstring)."""

    name = "shard"

    mesh: str | int = 2  # axis sizes: 8, 2x4
    memory: str = ""  # per-device budget, e.g. 80GB (default: the device's memory)
    hardware: str = "h100"
    sizes: str = ""  # symbolic dims to plan at, e.g. B=8,S=1024 (default: 128 each)
    inference: bool = False  # price a forward pass only (default: a training step)
    reduce_scatter: bool = True  # may reduce-scatter partial sums (sequence parallelism), not only all-reduce

    def __post_init__(self) -> None:
        parse_mesh(self.mesh)
        parse_memory(self.memory)
        parse_sizes(self.sizes)
        check_target(self.hardware)

    def make_mesh(self) -> Mesh:
        return Mesh(parse_mesh(self.mesh), hardware(self.hardware))  # type: ignore[operator]

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        mesh = self.make_mesh()
        grid, found = read_annotations(op)
        if grid is not None and grid != mesh.shape:
            raise ShardError(f"the module's shard.grid has shape {'x'.join(map(str, grid))} but the pass was "
                             f"given mesh={self.mesh}")
        strip_annotations(op)
        result = plan(op, mesh, budget=parse_memory(self.memory), sizes=parse_sizes(self.sizes),
                      training=not self.inference, constraints=found, reduce_scatter=self.reduce_scatter)
        annotate(op, result)
        report(result)


def report(p: Plan) -> None:
    remark("shard", f"mesh {p.mesh} ({p.mesh.hw.name}): predicted step {p.time * 1e3:.4g} ms = compute "
                    f"{p.compute * 1e3:.4g} ms + communication {p.comm * 1e3:.4g} ms, memory "
                    f"{p.memory / 1e9:.4g} GB per device (ZeRO stage {p.zero}, "
                    f"{recompute_text(p)}); plan: {p.describe()}")
    if p.runner_up is not None:
        r = p.runner_up
        diff = [f"{b.node.label}: {b.strategy.name} instead of {a.strategy.name}"
                for a, b in zip(p.choices, r.choices) if a.strategy != b.strategy]
        remark("shard", f"runner-up: {r.time * 1e3:.4g} ms (compute {r.compute * 1e3:.4g} + communication "
                        f"{r.comm * 1e3:.4g}), {r.memory / 1e9:.4g} GB; differs in {'; '.join(diff[:4])}"
                        + (" ..." if len(diff) > 4 else ""))
