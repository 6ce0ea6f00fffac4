"""`shard`: choose how every op is split over a device mesh, as an integer program (Alpa).

What it decides: for every value of @forward, a sharding (MLIR `split_axes`: which
mesh axes each dim is split over), written into the IR as `shard.grid`,
`shard.sharding` and `shard.shard` annotations (xDSL's shard dialect, `ir/shard.py`);
`passes/partition.py` lowers an annotated module to the per-device program.

How (Zheng et al., "Alpa", OSDI 2022, section 4; alpa/shard_parallel/auto_sharding.py):

    1. per op, its strategies (`passes/sharding.py`): replicated, or mesh axes
       assigned to loop dims (a matmul's rows m, columns n, or contraction k, whose
       partial sums are all-reduced, or reduce-scattered onto a result dim)
    2. per strategy, on each device, for one training step (forward + backward):
         compute    the cost model's time of the op at its local shapes (`passes/cost`)
                    x FWD_BWD (backward costs twice the forward)
         collective the all-reduce (or reduce-scatter, and its all-gather backward) of a
                    split contraction's partial sums (forward), and
                    of the gradient of an operand replicated over an axis the op is
                    split on (backward: Megatron's `f`, data parallelism's gradient sync,
                    weights' gradients bucketed as DDP does)
         memory     its local result, kept for the backward pass (no recomputation;
                    for a forward pass an upper bound: every value counted as live);
                    a weight's local part with its gradient and Adam state
    3. per edge producer -> consumer, the resharding between the producer's sharding
       and the one the consumer wants (`reshard_steps`, priced by
       `passes/cost/collectives.py`), forward and its adjoint backward
    4. minimize  sum(node costs) + sum(edge costs)  subject to  one strategy per op,
       memory per device <= budget,  with scipy's milp (HiGHS); edge choices are
       linearized as in Alpa (e[i,j] sums to x_producer[i] over j, to x_consumer[j]
       over i)

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
from typing import Sequence

import numpy as np
import sympy
from xdsl.context import Context
from xdsl.dialects.builtin import ArrayAttr, BytesAttr, DenseArrayBase, FlatSymbolRefAttr, ModuleOp, StringAttr, \
    i16, i64
from xdsl.dialects.func import FuncOp
from xdsl.ir import Block, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import TgOp, make_op
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.shapes import TensorInfo, info_of, type_of
from tilegraph.ir.shard import GridOp, ShardAxesArrayAttr, ShardingOp, ShardingType, ShardOp
from tilegraph.passes.cost.collectives import Mesh, parse_mesh
from tilegraph.ir.hardware import check_target, hardware
from tilegraph.passes.cost.model import at, op_cost
from tilegraph.passes.remarks import remark
from tilegraph.passes.sharding import (Spec, Strategy, apply_step, local_info, nbytes, pre_scatter, replicated, reshard_steps,
                             source_strategies, spec_axes, spec_str, strategies)

# Backward of a layer costs about twice its forward (two GEMMs per forward GEMM: the
# input and the weight gradient): the "6N FLOPs per token" of Kaplan et al. 2020 and
# Narayanan et al. 2021 (Megatron-LM, eq. 3) against 2N forward.
FWD_BWD = 3
# Bytes of optimizer state per parameter kept beside weight and gradient: Adam's two
# moments in f32, plus an f32 master copy when weights are narrower (ZeRO, Rajbhandari
# et al. 2020, section 3.1: 16 bytes per parameter for mixed-precision Adam).
ADAM_MOMENTS = 8
MASTER_COPY = 4
# A symbolic dim the pass is given no size for is planned at this size (a batch or
# sequence of a hundred-odd, as `tilegraph cost` assumes).
DEFAULT_DIM = 128
GRID = "mesh"  # the shard.grid symbol the annotations name
# HiGHS's relative MIP gap: plans within 0.1% of the best are not worth more search.
MIP_GAP = 1e-3
US = 1e6  # the objective in microseconds keeps HiGHS's absolute tolerances meaningful


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

    @property
    def time(self) -> float:
        return self.compute + self.comm

    def strategy(self, label: str) -> Strategy:
        return next(c.strategy for c in self.choices if c.node.label == label)

    def describe(self) -> str:
        ops = [f"{c.node.label}: {c.strategy.name}" for c in self.choices
               if c.node.op is not None and c.node.op.op_name != "weight" and c.strategy.name != "R"]
        return ("; ".join(ops[:6]) + (" ..." if len(ops) > 6 else "")) or "all replicated"


def _label(op: TgOp, index: int) -> str:
    if op.op_name == "weight":
        return op.attr("name")
    weights = [o.owner.attr("name") for o in op.operands
               if isinstance(o.owner, TgOp) and o.owner.op_name == "weight"]
    return f"{op.op_name} %{index}" + (f" ({weights[0]})" if weights else "")


def _nodes(func: FuncOp, names: Sequence[str], mesh_shape, sizes) -> list[Node]:
    index: dict[SSAValue, int] = {}
    nodes: list[Node] = []
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
        sts = strategies(op, mesh_shape, sizes)
        if op.op_name == "constant":  # a value printed inline is the same on every device
            sts = sts[:1]
        nodes.append(Node(op.results[0], op, _label(op, len(nodes)), op.result_infos()[0], sts,
                          [index[v] for v in op.operands]))
    return nodes


# --- costs --------------------------------------------------------------------------

def _local_time(op: TgOp, st: Strategy, mesh: Mesh, hw) -> sympy.Expr:
    """The cost model's time of `op` at the local shapes `st` gives it on one device."""
    if op.op_name in ("weight", "constant"):
        return sympy.Integer(0)
    block = Block(arg_types=[type_of(local_info(info_of(v.type), s, mesh.shape)) for v, s in zip(op.operands, st.ins)])
    result = [local_info(i, pre_scatter(st), mesh.shape) for i in op.result_infos()] if op.SPEC.result_given else None
    local = make_op(op.op_name, list(block.args), op.py_attrs(), result)
    return op_cost(local, hw).time


def _needs_grad(node: Node) -> bool:
    return node.op is not None and node.op.op_name != "constant" and dtypes.is_float(node.info.dtype)


def _node_cost(node: Node, st: Strategy, nodes: list[Node], mesh: Mesh, hw, training: bool):
    """(compute, collectives, memory) of one strategy, as sympy expressions."""
    compute = _local_time(node.op, st, mesh, hw) if node.op is not None else sympy.Integer(0)
    out_bytes = nbytes(local_info(node.info, st.out, mesh.shape))
    comm = sympy.Integer(0)
    if st.scatter is not None:  # forward reduce-scatter; backward its adjoint, an all-gather of the gradient
        summed = nbytes(local_info(node.info, pre_scatter(st), mesh.shape))
        comm = mesh.collective("reduce_scatter", st.partial, summed)
        if training:
            comm += mesh.collective("all_gather", st.partial, summed)
    elif st.partial:
        comm = mesh.collective("all_reduce", st.partial, out_bytes)
    memory = out_bytes
    if training:
        compute = compute * FWD_BWD if dtypes.is_float(node.info.dtype) else compute
        for i, spec in zip(node.operands, st.ins):
            missing = [a for a in st.split if a not in spec_axes(spec)]
            if missing and _needs_grad(nodes[i]):
                # A value's gradient is summed over its uses on each device and all-reduced once:
                # each use pays its share (exact when they agree, as Q, K and V projections do).
                uses = sum(1 for u in nodes[i].value.uses if isinstance(u.operation, TgOp))
                grad = nbytes(local_info(nodes[i].info, spec, mesh.shape))
                # weight gradients go in buckets (collectives.GRADIENT_BUCKET); activations' one at a time
                sync = mesh.bucketed if nodes[i].op.op_name == "weight" else mesh.collective
                comm += sync("all_reduce", missing, grad) / max(1, uses)
        if node.op is not None and node.op.op_name == "weight" and dtypes.is_float(node.info.dtype):
            per_param = 2 * dtypes.numpy_dtype(node.info.dtype).itemsize + ADAM_MOMENTS + \
                (MASTER_COPY if dtypes.numpy_dtype(node.info.dtype).itemsize < 4 else 0)
            memory = out_bytes * sympy.Rational(per_param, dtypes.numpy_dtype(node.info.dtype).itemsize)
    return compute, comm, memory


@lru_cache(maxsize=1 << 16)  # a plan asks about the same few (shape, spec, spec) many times
def reshard_cost(info: TensorInfo, src: Spec, dst: Spec, mesh: Mesh) -> sympy.Expr:
    """Seconds to move a value from sharding `src` to `dst` (slices are free)."""
    total, spec = sympy.Integer(0), src
    for step in reshard_steps(src, dst):
        after = apply_step(spec, step)
        if step.kind == "all_gather":
            total += mesh.collective("all_gather", [step.axis], nbytes(local_info(info, after, mesh.shape)))
        elif step.kind == "all_to_all":
            total += mesh.collective("all_to_all", [step.axis], nbytes(local_info(info, spec, mesh.shape)))
        spec = after
    return total


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


# --- the integer program ---------------------------------------------------------------

def _solve(cost, mem, edges, budget, allowed, exclude=None):
    """min c.x over one-hot x per class; edges (P, C, matrix) linearized; `exclude`: a choice to cut off
    (the runner-up). Returns (strategy index per class or None when infeasible, variable count)."""
    from scipy.optimize import LinearConstraint, Bounds, milp
    from scipy.sparse import coo_array

    offsets, n = [], 0
    for c in cost:
        offsets.append(n)
        n += len(c)
    nx = n
    e_off = []
    for P, C, M in edges:
        e_off.append(n)
        n += M.size
    obj = np.zeros(n)
    for k, c in enumerate(cost):
        obj[offsets[k]:offsets[k] + len(c)] = c
    for (P, C, M), off in zip(edges, e_off):
        obj[off:off + M.size] = M.ravel()
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add(entries, low, high):
        nonlocal r
        for col, v in entries:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        lo.append(low)
        hi.append(high)
        r += 1

    for k, c in enumerate(cost):
        add([(offsets[k] + s, 1.0) for s in range(len(c))], 1, 1)
    for (P, C, M), off in zip(edges, e_off):
        kp, kc = M.shape
        for sp in range(kp):
            add([(off + sp * kc + sc, 1.0) for sc in range(kc)] + [(offsets[P] + sp, -1.0)], 0, 0)
        for sc in range(kc):
            add([(off + sp * kc + sc, 1.0) for sp in range(kp)] + [(offsets[C] + sc, -1.0)], 0, 0)
    add([(offsets[k] + s, float(m)) for k, ms in enumerate(mem) for s, m in enumerate(ms)], -np.inf, budget)
    if exclude is not None:
        multi = [k for k, c in enumerate(cost) if len(c) > 1]
        add([(offsets[k] + exclude[k], 1.0) for k in multi], -np.inf, len(multi) - 1)
    A = coo_array((vals, (rows, cols)), shape=(r, n)).tocsr()
    upper = np.ones(n)
    for k, ok in enumerate(allowed):
        for s in range(len(cost[k])):
            if not ok[s]:
                upper[offsets[k] + s] = 0
    integrality = np.zeros(n)
    integrality[:nx] = 1
    res = milp(obj, constraints=[LinearConstraint(A, lo, hi)], integrality=integrality,
               bounds=Bounds(np.zeros(n), upper), options={"mip_rel_gap": MIP_GAP})
    if res.x is None:
        return None, n
    return [int(np.argmax(res.x[offsets[k]:offsets[k] + len(c)])) for k, c in enumerate(cost)], n


def plan(module: ModuleOp, mesh: Mesh, *, budget: float | None = None, sizes: dict[str, int] | None = None,
         training: bool = True, constraints: dict[SSAValue, Spec] | None = None, names: Sequence[str] = (),
         only=None, reduce_scatter: bool = True) -> Plan:
    """The cheapest sharding of @forward on `mesh` under `budget` bytes per device (default: the device's memory).

    `only(node)`: the strategy names a node may take, or None for any (a hand layout to price:
    benchmarks/shard_plans.py pins Megatron's and data parallelism's this way). `reduce_scatter=False`:
    partial sums are only all-reduced (Megatron-LM without sequence parallelism)."""
    started = _time.perf_counter()
    func = next(f for f in module.walk() if isinstance(f, FuncOp) and f.sym_name.data == "forward")
    hw = mesh.hw
    budget = float(hw.memory_bytes if budget is None else budget)
    sizes = dict(sizes or {})
    symbols = {s.name for a in func.body.block.args for d in info_of(a.type).shape
               for s in sympy.sympify(d).free_symbols}
    for s in symbols:
        sizes.setdefault(s, DEFAULT_DIM)
    names = list(names) or [f"input{i}" for i in range(len(func.body.block.args))]
    nodes = _nodes(func, names, mesh.shape, sizes)
    if not reduce_scatter:
        for node in nodes:
            node.strategies = [st for st in node.strategies if st.scatter is None]
    constraints = constraints or {}

    start, period, copies = find_layers(nodes)
    cls = list(range(len(nodes)))
    for i in range(start + period, start + period * copies):
        cls[i] = start + (i - start) % period
    classes = sorted(set(cls))
    slot = {c: k for k, c in enumerate(classes)}

    # Node costs, computed once per class and counted once per member.
    exprs: dict[int, list[tuple]] = {}
    for c in classes:
        node = nodes[c]
        try:
            exprs[c] = [_node_cost(node, st, nodes, mesh, hw, training) for st in node.strategies]
        except TilegraphError:  # a split the op's shape rule rejects at local shapes: keep what works
            ok = []
            for st in node.strategies:
                try:
                    ok.append((st, _node_cost(node, st, nodes, mesh, hw, training)))
                except TilegraphError:
                    pass
            node.strategies = [st for st, _ in ok]
            exprs[c] = [e for _, e in ok]
    for i, c in enumerate(cls):
        nodes[i].strategies = nodes[c].strategies
    count = {c: cls.count(c) for c in classes}
    cost = [np.array([at(cp + cm, sizes) * US for cp, cm, _ in exprs[c]]) * count[c] for c in classes]
    mem = [np.array([at(m, sizes) for _, _, m in exprs[c]]) * count[c] for c in classes]

    values: dict[sympy.Expr, float] = {}

    def value(e) -> float:
        if e not in values:
            values[e] = at(e, sizes)
        return values[e]

    # Edges, aggregated per (producer class, consumer class, operand).
    edge_cache: dict[tuple, tuple[np.ndarray, list]] = {}
    agg: dict[tuple[int, int], np.ndarray] = {}
    edge_list = []
    for j, node in enumerate(nodes):
        for pos, i in enumerate(node.operands):
            key = (cls[i], cls[j], pos, str(nodes[i].info))
            if key not in edge_cache:
                prod, cons = nodes[i], node
                back = training and _needs_grad(prod)
                ex = [[reshard_cost(prod.info, sp.out, sc.ins[pos], mesh) +
                       (reshard_cost(prod.info, sc.ins[pos], sp.out, mesh) if back else 0)
                       for sc in cons.strategies] for sp in prod.strategies]
                edge_cache[key] = (np.array([[value(e) * US for e in row] for row in ex]), ex)
            edge_list.append((i, j, pos, key))
            M = edge_cache[key][0]
            P, C = slot[cls[i]], slot[cls[j]]
            agg[(P, C)] = agg.get((P, C), 0) + M
    edges = []
    for (P, C), M in agg.items():
        if not M.any():
            continue
        if P == C:
            cost[P] = cost[P] + np.diag(M)
        elif M.shape[0] == 1:
            cost[C] = cost[C] + M[0]
        elif M.shape[1] == 1:
            cost[P] = cost[P] + M[:, 0]
        else:
            edges.append((P, C, M))

    allowed = [np.ones(len(cost[k]), bool) for k in range(len(classes))]
    for value, spec in constraints.items():
        i = next((k for k, n in enumerate(nodes) if n.value == value), None)
        if i is None:
            continue
        k = slot[cls[i]]
        ok = np.array([st.out == spec for st in nodes[i].strategies])
        if not ok.any():
            raise ShardError(f"the annotation {spec_str(spec)} on {nodes[i].label} ({nodes[i].info}) is not a "
                             f"sharding the op can produce on mesh {mesh}")
        allowed[k] &= ok

    for i, node in enumerate(nodes):
        names_ok = only(node) if only is not None else None
        if names_ok is not None:
            ok = np.array([st.name in names_ok for st in node.strategies])
            if not ok.any():
                raise LayoutError(f"{node.label}: none of the strategies {sorted(names_ok)} is possible on mesh "
                                 f"{mesh} (it has {[st.name for st in node.strategies]})")
            allowed[slot[cls[i]]] &= ok

    choice, nvars = _solve(cost, mem, edges, budget, allowed)
    if choice is None:
        least = sum(min(m) for m in mem)
        raise ShardError(f"no sharding on mesh {mesh} fits {budget / 1e9:.3g} GB per device (with the annotations "
                         f"given): the smallest plan needs {least / 1e9:.3g} GB")
    second, _ = _solve(cost, mem, edges, budget, allowed, exclude=choice)
    solve_time = _time.perf_counter() - started

    def build(ch) -> Plan:
        picked = [ch[slot[cls[i]]] for i in range(len(nodes))]
        choices, formula_c, formula_m = [], sympy.Integer(0), sympy.Integer(0)
        forward = []
        for i, node in enumerate(nodes):
            cp, cm, m = exprs[cls[i]][picked[i]]
            st = node.strategies[picked[i]]
            incoming = sympy.Integer(0)
            for pos, p in enumerate(node.operands):
                key = (cls[p], cls[i], pos, str(nodes[p].info))
                incoming += edge_cache[key][1][picked[p]][picked[i]]
                for step in reshard_steps(nodes[p].strategies[picked[p]].out, st.ins[pos]):
                    if step.kind != "all_slice":
                        forward.append((step.kind, (step.axis,), node.label))
            if st.partial:
                forward.append(("all_reduce" if st.scatter is None else "reduce_scatter", st.partial, node.label))
            formula_c += cp
            formula_m += cm + incoming
            choices.append(Choice(node, st, at(cp, sizes), at(cm + incoming, sizes), at(m, sizes)))
        return Plan(mesh, choices, sum(c.compute for c in choices), sum(c.comm for c in choices),
                    sum(c.memory for c in choices), formula_c + formula_m, solve_time, (start, period, copies),
                    forward=forward, variables=nvars)

    best = build(choice)
    if second is not None:
        best.runner_up = build(second)
    return best


def chosen_plan(module: ModuleOp, mesh: Mesh, pick, sizes: dict[str, int] | None = None) -> Plan:
    """A plan of given choices (`pick(node) -> strategy index`), not costed: to annotate any valid
    plan, as the tests of the partitioner do."""
    func = next(f for f in module.walk() if isinstance(f, FuncOp) and f.sym_name.data == "forward")
    nodes = _nodes(func, [f"input{i}" for i in range(len(func.body.block.args))], mesh.shape, sizes or {})
    choices = [Choice(n, n.strategies[pick(n)], 0.0, 0.0, 0.0) for n in nodes]
    return Plan(mesh, choices, 0.0, 0.0, 0.0, sympy.Integer(0), 0.0, (0, 0, 0))


# --- annotations in the IR --------------------------------------------------------------

def read_annotations(module: ModuleOp) -> tuple[tuple[int, ...] | None, dict[SSAValue, Spec]]:
    """The grid shape and the user's shard.shard annotations (value -> spec) already in `module`."""
    grid = next((op for op in module.ops if isinstance(op, GridOp)), None)
    shape = tuple(grid.shape.get_values()) if grid is not None else None
    found: dict[SSAValue, Spec] = {}
    for op in module.walk():
        if isinstance(op, ShardOp):
            sharding = op.sharding.owner
            found[op.src] = tuple(tuple(a.get_values()) for a in sharding.split_axes.axes.data)
    return shape, found


def strip_annotations(module: ModuleOp) -> None:
    for op in list(module.walk()):
        if isinstance(op, ShardOp):
            op.result.replace_all_uses_with(op.src)
            Rewriter.erase_op(op)
    for op in list(module.walk()):
        if isinstance(op, (ShardingOp, GridOp)):
            Rewriter.erase_op(op)


def sharding_op(spec: Spec) -> ShardingOp:
    axes = ShardAxesArrayAttr(ArrayAttr([DenseArrayBase(i16, BytesAttr(i16.pack(list(a)))) for a in spec]))
    return ShardingOp.build(operands=[[], []], result_types=[ShardingType()],
                            properties={"grid": FlatSymbolRefAttr(GRID), "split_axes": axes})


def annotate(module: ModuleOp, p: Plan) -> None:
    """Write the plan into the IR: the grid, one shard.sharding per spec, a shard.shard after every
    value (its sharding) and before every use that wants another (`annotate_for_users`)."""
    func = next(f for f in module.walk() if isinstance(f, FuncOp) and f.sym_name.data == "forward")
    block = func.body.block
    grid = GridOp.create(properties={"sym_name": StringAttr(GRID),
                                     "shape": DenseArrayBase.from_list(i64, list(p.mesh.shape))})
    module.body.block.insert_op_before(grid, module.body.block.first_op)
    specs: dict[Spec, SSAValue] = {}
    first = block.first_op

    def sharding(spec: Spec) -> SSAValue:
        if spec not in specs:
            op = sharding_op(spec)
            block.insert_op_before(op, first)
            specs[spec] = op.results[0]
        return specs[spec]

    annotated: dict[SSAValue, SSAValue] = {}
    by_value = {c.node.value: c for c in p.choices}
    for c in p.choices:
        v = c.node.value
        if c.node.info.rank == 0:
            continue
        uses = [u for u in v.uses]
        ann = ShardOp(v, sharding(c.strategy.out), None)
        if c.node.op is None:
            block.insert_op_before(ann, first)
        else:
            Rewriter.insert_op(ann, InsertPoint.after(c.node.op))
        for u in uses:
            u.operation.operands[u.index] = ann.result
        annotated[v] = ann.result
    for c in p.choices:
        if c.node.op is None:
            continue
        for pos, (operand, want) in enumerate(zip(c.node.op.operands, c.strategy.ins)):
            src = operand.owner.src if isinstance(operand.owner, ShardOp) else operand
            have = by_value[src].strategy.out if src in by_value else replicated(len(want))
            if have != want and len(want):
                user = ShardOp(operand, sharding(want), None)
                user.annotate_for_users = _unit()
                Rewriter.insert_op(user, InsertPoint.before(c.node.op))
                c.node.op.operands[pos] = user.result


def _unit():
    from xdsl.dialects.builtin import UnitAttr

    return UnitAttr()


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
    memory: str = ""  # per-device budget, e.g. 80GB (default: the target's memory)
    target: str = "h100"
    sizes: str = ""  # symbolic dims to plan at, e.g. B=8,S=1024 (default: 128 each)
    inference: bool = False  # price a forward pass only (default: a training step)
    reduce_scatter: bool = True  # may reduce-scatter partial sums (sequence parallelism), not only all-reduce

    def __post_init__(self) -> None:
        parse_mesh(self.mesh)
        parse_memory(self.memory)
        parse_sizes(self.sizes)
        check_target(self.target)

    def make_mesh(self) -> Mesh:
        return Mesh(parse_mesh(self.mesh), hardware(self.target))

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
                    f"{p.memory / 1e9:.4g} GB per device; plan: {p.describe()}")
    if p.runner_up is not None:
        r = p.runner_up
        diff = [f"{b.node.label}: {b.strategy.name} instead of {a.strategy.name}"
                for a, b in zip(p.choices, r.choices) if a.strategy != b.strategy]
        remark("shard", f"runner-up: {r.time * 1e3:.4g} ms (compute {r.compute * 1e3:.4g} + communication "
                        f"{r.comm * 1e3:.4g}), {r.memory / 1e9:.4g} GB; differs in {'; '.join(diff[:4])}"
                        + (" ..." if len(diff) > 4 else ""))
