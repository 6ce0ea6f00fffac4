"""`shard`'s integer program (passes/shard.py `plan`): its variables built from the nodes'
strategies and the edges between them (`_build`), the rows for ZeRO-3's gathered units where
they bind (`_count_gathered`), and a solution read back as a `Plan` (`_read_back`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import sympy
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.func import FuncOp

from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.shapes import info_of, symbol
from tilegraph.passes.cost.collectives import GPUS_PER_NODE, Mesh
from tilegraph.passes.cost.model import at, expected_sizes
from tilegraph.passes.shard import (COMPONENTS, DEFAULT_DIM, FWD_BWD, GB, OVERLAP_INTERFERENCE, US, _NODE_COSTS, Choice,
                                    LayoutError, Node, Plan, ShardError, _edge_cost, _is_weight, _needs_grad, _node_cost,
                                    _nodes, _signature, _weight_units, find_layers, saved_for_backward, zero_stage)
from tilegraph.passes.shard_milp import CUT_SHORT, Linear
from tilegraph.passes.shard_strategies import base_name, local_info, nbytes, reshard_steps, spec_str


@dataclass
class _Program:
    """plan()'s integer program as built: what its variables mean (classes of nodes, their strategies,
    the edges between classes), the objective and rows `solve` takes, and what reading a solution
    back needs."""

    mesh: Mesh
    sizes: dict[str, int]
    budget: float
    training: bool
    stages: int
    micro_batches: int
    nodes: list[Node]
    cls: list[int]  # per node: its class (the first node at its place in the repeated layers)
    slot: dict[int, int]  # class -> its index among the program's classes
    count: list[int]  # per class index: the nodes it stands for (a stage's layers: one each)
    layer: set[int]  # the class indices of one layer
    start: int  # the repeated layers: first node, nodes per layer, layers
    period: int
    copies: int
    per_stage: int  # layers per pipeline stage
    exprs: dict[int, list[dict]]  # class -> per strategy, its cost expressions
    comp: dict[str, list[np.ndarray]]  # cost component -> per class index, its value per strategy
    edges: list[tuple[int, int]]
    edge_cache: dict[tuple, tuple[dict, list]]
    stage_sets: list[tuple[set, int]]  # per stage: its class indices, the micro-batches it holds
    slots: int
    eta: float
    p2p_link: Any  # the link a pipeline stage sends its boundary activation over
    ckpt: list[int]
    ckpt_bytes: dict[int, np.ndarray]
    kept_bytes: dict[int, np.ndarray]  # what a recomputed layer keeps: its checkpoint, all-reduced results
    r: int | None  # the extra variable counting recomputed layers
    objective: Linear
    rows: list[tuple[Linear, float, float]]
    extras: list[tuple[float, float, int]]
    allowed: list[np.ndarray]
    memories: list[Linear]
    totals: dict[str, Linear]  # each cost component over the whole program
    units: list[list[tuple[Linear, float]]]  # per stage: each ZeRO-3 unit's gathered bytes (and their scale)
    workspace: list[float]  # per stage: bytes of the backend's working memory (`plan(workspace=)`)
    repeat_collectives: bool  # a recomputed layer re-runs its forward collectives (`plan`)
    host: list[float]  # per stage: seconds of the runtime's own per step (`plan(host=)`)

    def in_layers(self, i: int) -> bool:
        return bool(self.copies) and self.start <= i < self.start + self.period * self.copies


def _build(module: ModuleOp, mesh: Mesh, *, budget, sizes, training, constraints, names, only, reduce_scatter,
           stages, micro_batches, batch, overlap, recompute, zero, say, backward="flops", optimizer=None,
           schedule="1f1b", workspace: float | Sequence[float] = 0.0, repeat_collectives: bool = True,
           packed_units: bool = False, host: Any = (0.0, 0.0)) -> _Program:
    """plan()'s integer program: nodes grouped into classes (one per place in the repeated layers),
    each class's and edge's costs per strategy, the recomputation's variables, each stage's step and
    memory as rows; the objective the slowest stage's step."""
    func = next(f for f in module.walk() if isinstance(f, FuncOp) and f.sym_name.data == "forward")
    hw = mesh.hw
    budget = float(hw.memory_bytes if budget is None else budget)
    sizes = dict(sizes or {})
    symbols = {s.name for a in func.body.block.args for d in info_of(a.type).shape
               for s in sympy.sympify(d).free_symbols}
    for s in symbols:
        sizes.setdefault(s, DEFAULT_DIM)
    for s, e in expected_sizes(module).items():  # dims known only at run time: at their expected size
        sizes.setdefault(s, max(1, round(float(sympy.sympify(e).subs({symbol(k): v for k, v in sizes.items()})))))
    if micro_batches > 1:
        if batch not in sizes or sizes[batch] % micro_batches:
            raise LayoutError(f"{micro_batches} micro-batches need a batch dim '{batch}' that they divide "
                              f"(sizes {sizes})")
        sizes[batch] //= micro_batches
    slots = micro_batches + stages - 1 if training else 1  # 1F1B: m micro-batches and p - 1 of bubble
    gpipe = schedule == "gpipe"
    inflight = (micro_batches if gpipe else min(stages, micro_batches)) if training else 1  # micro-batches stage 0 holds activations of
    names = list(names) or [f"input{i}" for i in range(len(func.body.block.args))]
    nodes = _nodes(func, names, mesh.shape, sizes, zero=training and zero)
    if not reduce_scatter:
        for node in nodes:
            node.strategies = [st for st in node.strategies if st.scatter is None]
    constraints = constraints or {}

    start, period, copies = find_layers(nodes)
    if stages > 1 and (copies < stages or copies % stages):
        raise LayoutError(f"{stages} pipeline stages need repeated layers they divide; found {copies} layers")
    per_stage = copies // stages if copies else 0
    cls = list(range(len(nodes)))
    for i in range(start + period, start + period * copies):
        cls[i] = start + (i - start) % period
    classes = sorted(set(cls))
    slot = {c: k for k, c in enumerate(classes)}
    layer = {slot[c] for c in range(start, start + period)} if copies else set()
    def in_layers(i: int) -> bool:
        return bool(copies) and start <= i < start + period * copies

    saved = saved_for_backward(nodes) if training else [True] * len(nodes)
    unit_sizes = _weight_units(nodes, start, period, copies) if packed_units else {}

    # Node costs, computed once per class and counted once per member (layers: those of one stage).
    exprs: dict[int, list[dict]] = {}
    for done, c in enumerate(classes):
        say(f"pricing each op's shardings: {done + 1} of {len(classes)} ops")
        node = nodes[c]
        ok = []
        key = (_signature(node), mesh, training, saved[c], backward, optimizer,
               tuple(sorted(sizes.items())) if backward == "vjp" else (), tuple(
            (_needs_grad(nodes[i]), _is_weight(nodes[i]), sum(1 for _ in nodes[i].value.uses), unit_sizes.get(i, 1))
            for i in node.operands))
        for st in node.strategies:
            if (key, st) not in _NODE_COSTS:
                try:
                    _NODE_COSTS[key, st] = _node_cost(node, st, nodes, mesh, hw, training, saved[c], backward, optimizer,
                                                      sizes, unit_sizes)
                except TilegraphError:  # a split the op's shape rule rejects at local shapes: keep what works
                    _NODE_COSTS[key, st] = None
            if _NODE_COSTS[key, st] is not None:
                ok.append((st, _NODE_COSTS[key, st]))
        node.strategies = [st for st, _ in ok]
        exprs[c] = [e for _, e in ok]  # type: ignore[misc]
    for i, c in enumerate(cls):
        nodes[i].strategies = nodes[c].strategies
    count = [per_stage if k in layer else cls.count(c) for k, c in enumerate(classes)]
    comp = {name: [np.array([at(e[name], sizes) for e in exprs[c]]) for c in classes] for name in COMPONENTS}

    values: dict[sympy.Expr, float] = {}

    def value(e) -> float:
        if e not in values:
            values[e] = at(e, sizes)
        return values[e]

    # Edges, aggregated per (producer class, consumer class); an edge inside the layers counts once
    # per layer of a stage.
    edge_cache: dict[tuple, tuple[dict, list]] = {}
    agg: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    for j, node in enumerate(nodes):
        say(f"pricing the resharding between ops: into {j + 1} of {len(nodes)} ops")
        for pos, i in enumerate(node.operands):
            key = (cls[i], cls[j], pos, str(nodes[i].info))  # type: ignore[assignment]
            if key not in edge_cache:
                prod = nodes[i]
                ex = [[_edge_cost(prod, sp, node, sc, pos, mesh, training, unit_sizes.get(i, 1)) for sc in node.strategies]
                      for sp in prod.strategies]
                edge_cache[key] = ({k: np.array([[value(e[k]) for e in row] for row in ex]) for k in ex[0][0]}, ex)
            weight = per_stage / copies if in_layers(j) else 1
            slot_pair = agg.setdefault((slot[cls[i]], slot[cls[j]]), {})
            for k, M in edge_cache[key][0].items():
                slot_pair[k] = slot_pair.get(k, 0) + M * weight
    edges, edge_comp = [], {k: {} for k in ("B", "Omb", "Ost", "G")}
    for (P, C), ms in agg.items():
        if not any(M.any() for M in ms.values()):
            continue
        if P == C or ms["B"].shape[0] == 1 or ms["B"].shape[1] == 1:  # folds into a node's own costs
            for k, M in ms.items():
                if P == C:
                    comp[k][P] = comp[k][P] + np.diag(M)
                elif M.shape[0] == 1:
                    comp[k][C] = comp[k][C] + M[0]
                else:
                    comp[k][P] = comp[k][P] + M[:, 0]
            continue
        for k, M in ms.items():
            edge_comp[k][len(edges)] = M
        edges.append((P, C))

    def total(name: str, classes_=None, scale=None) -> Linear:
        ks = range(len(classes)) if classes_ is None else classes_
        nodes_ = {k: comp[name][k] * (count[k] if scale is None else scale) for k in ks}
        return Linear(nodes_, dict(edge_comp.get(name, {})) if classes_ is None else {})

    # Which stage holds what. One stage holds everything; of several, the first holds the ops before
    # the layers (the embedding) and the last those after them (the head), each its share of the
    # layers; the slower of the two sets the pace (a middle stage holds layers only: never slower).
    # A weight outside the layers goes with its users (a tied embedding is on both, as in Megatron).
    users: dict[int, list[int]] = {}
    for j, node in enumerate(nodes):
        for i in node.operands:
            users.setdefault(i, []).append(j)

    def side(i: int) -> set:
        if in_layers(i):
            return {"layer"}
        if _is_weight(nodes[i]) and users.get(i):
            return set().union(*(side(j) for j in users[i]))
        return {"pre" if i < start else "post"}

    parts: dict[int, set] = {}
    for i in range(len(nodes)):
        parts.setdefault(slot[cls[i]], set()).update(side(i))
    if stages == 1:
        stage_sets = [(set(range(len(classes))), inflight)]
    else:  # 1F1B: the first stage holds min(p, m) micro-batches' activations, the last one's;
        # GPipe: every stage all m (each runs every forward before any backward)
        stage_sets = [({k for k, ps in parts.items() if ps & {"pre", "layer"}}, inflight),
                      ({k for k, ps in parts.items() if ps & {"layer", "post"}}, inflight if gpipe else 1)]

    extras: list[tuple[float, float, int]] = []
    rows: list[tuple[Linear, float, float]] = []

    def var(low: float = 0, high: float = np.inf, integer: int = 0) -> int:
        extras.append((low, high, integer))
        return len(extras) - 1

    # Recomputation: r of a stage's L layers (its first r, Megatron's `--recompute-method block`) keep
    # only their input (the checkpoint) and re-run their forward in the backward. The backward reaches
    # them after the other L - r layers freed their activations, so a recomputing layer's activations
    # add to the peak only when r = L: peak = held x ((L - r) A + r K) + [r = L] A. r is an integer of
    # the program, r = sum_j 2^j b_j over binaries b_j, and each product of b_j with an expression of
    # the strategies is linearized with big-M bounds: u_j = b_j A (one layer's activations, GB),
    # v_j = b_j K (its checkpoint, GB), e_j = b_j F (its forward, us); w = A when g = [r = L].
    ckpt = sorted({slot[cls[i]] for j in range(start + period, start + 2 * period) for i in nodes[j].operands
                   if start <= i < start + period}) if copies >= 2 else []
    ckpt_bytes = {k: np.array([value(nbytes(local_info(nodes[classes[k]].info, st.out, mesh.shape)))
                               for st in nodes[classes[k]].strategies]) for k in ckpt}
    # What a recomputed layer keeps: its input (the checkpoint); where its collectives are not
    # repeated (`repeat_collectives=False`) also each partial sum's all-reduced result: its
    # backward re-runs the forward between collectives only
    kept_bytes = dict(ckpt_bytes)
    for k in sorted(layer) if not repeat_collectives else ():
        reduced = np.array([value(nbytes(local_info(nodes[classes[k]].info, st.out, mesh.shape))) if st.partial else 0.0
                            for st in nodes[classes[k]].strategies])
        if reduced.any():
            kept_bytes[k] = kept_bytes.get(k, 0) + reduced
    # a recomputed layer's forward: its compute, and its forward collectives where they are repeated
    again = 0.5 if repeat_collectives else 0.0
    forward = {k: (comp["F"][k] + comp["B"][k] * again) * US for k in layer}
    r = None
    bits: list[tuple[int, int, int, int]] = []  # (2^j, u_j, v_j, e_j)
    w_var = None
    if training and recompute is not False and copies >= 2 and per_stage:
        fixed = per_stage if recompute == "always" else recompute if not isinstance(recompute, bool) else None
        if fixed is not None and not 0 <= fixed <= per_stage:
            raise LayoutError(f"recompute={fixed}: a stage has {per_stage} layers")
        r = var(*((fixed, fixed) if fixed is not None else (0, per_stage)), 1)
        act = {k: comp["A"][k] / GB for k in layer}
        big_a = sum(float(a.max()) for a in act.values())
        big_k = sum(float(b.max()) for b in kept_bytes.values()) / GB
        big_f = sum(float(f.max()) for f in forward.values())
        g, w_var = var(0, 1, 1), var()
        rows.append((Linear(act, {}, {w_var: -1.0, g: big_a}), -np.inf, big_a))  # w >= A - big_a (1 - g)
        rows.append((Linear({}, {}, {r: 1.0, g: -1.0}), -np.inf, per_stage - 1))  # g >= r - L + 1
        link = {r: 1.0}
        for j in range(per_stage.bit_length()):
            b, u, v, e = var(0, 1, 1), var(), var(), var()
            link[b] = -float(2 ** j)
            bits.append((2 ** j, u, v, e))
            rows.append((Linear({k: -a for k, a in act.items()}, {}, {u: 1.0}), -np.inf, 0))  # u_j <= A
            rows.append((Linear({}, {}, {u: 1.0, b: -big_a}), -np.inf, 0))  # u_j <= big_a b_j
            rows.append((Linear({k: kb / GB for k, kb in kept_bytes.items()}, {}, {v: -1.0, b: big_k}),
                         -np.inf, big_k))  # v_j >= K - big_k (1 - b_j)
            rows.append((Linear(forward, {}, {e: -1.0, b: big_f}), -np.inf, big_f))  # e_j >= F - big_f (1 - b_j)
        rows.append((Linear({}, {}, link), 0, 0))  # r = sum 2^j b_j

    # Each stage's step (us): (m + p - 1) x (compute + blocking collectives + exposed overlapped ones
    # of a micro-batch + recomputed forwards + the boundary activation and its gradient) + the exposed
    # per-step collectives.
    eta = (FWD_BWD - 1) / FWD_BWD if overlap and training else 0.0  # the backward's share of compute
    compute, blocking = total("C"), total("B")
    p2p_link = mesh.hw.links["infiniband" if mesh.devices >= GPUS_PER_NODE else mesh.intra_node]
    stage_times = []
    for ks, _ in stage_sets:
        t = Linear()
        t.add(compute.restricted(ks, edges), slots * US)
        t.add(total("Cst").restricted(ks, edges), US)
        t.add(blocking.restricted(ks, edges), slots * US)
        for name, per in (("Omb", slots), ("Ost", 1)):
            o = total(name).restricted(ks, edges)
            if not any(np.any(a) for a in o.nodes.values()) and not any(np.any(M) for M in o.edges.values()):
                continue
            h = var()
            t.extra[h] = per * US
            row = Linear({}, {}, {h: -1.0})
            row.add(o)
            row.add(compute.restricted(ks, edges), -eta)
            rows.append((row, -np.inf, 0))  # h >= overlapped - what the backward hides
            if eta:  # even hidden, a collective slows the compute it overlaps
                t.add(o, per * US * OVERLAP_INTERFERENCE)
        for scale, _, _, e in bits:
            t.extra[e] = slots * scale
        if stages > 1:  # each micro-batch's activation sent to the next stage, its gradient back
            for k in ckpt:
                t.nodes[k] = t.nodes.get(k, 0) + slots * 2 * US * ckpt_bytes[k] / p2p_link.beta
        stage_times.append(t)
    pairs = [host] * len(stage_sets) if np.isscalar(host[0]) else list(host)
    if len(pairs) != len(stage_sets):
        raise ShardError(f"host: one (per micro-batch, per step) pair, or one per priced stage ({len(stage_sets)})")
    hosts = [slots * float(mb) + float(st) for mb, st in pairs]
    if len(stage_times) == 1:
        objective = stage_times[0]
    else:  # the slowest stage sets the pace: T (ms) >= every stage's step
        pace = var()
        objective = Linear({}, {}, {pace: US / 1e3})
        for t, own in zip(stage_times, hosts):
            row = Linear({}, {}, {pace: -1.0})
            row.add(t, 1e3 / US)
            rows.append((row, -np.inf, -own * 1e3))  # the runtime's own seconds, in ms

    # Memory per stage (GB: bytes next to 0/1 variables scale badly in HiGHS): weights with their
    # gradients and optimizer state, the activations of the micro-batches in flight, the
    # recomputation's trade (see above).
    # ZeRO-3 (FSDP) holds a unit's gathered weights while it computes and the next unit's as they
    # arrive (prefetched): 2 x the largest unit a stage runs, a unit being one layer, or the weights
    # before the layers (embedding) or after them (head). g_s >= each unit's gathered bytes (GB).
    def unit_g(ks_unit: set, scale: float) -> Linear:
        return Linear({k: comp["G"][k] / GB * scale for k in ks_unit if np.any(comp["G"][k])},
                      {e: M / GB * scale for e, M in edge_comp["G"].items() if edges[e][0] in ks_unit and np.any(M)})
    unit_sets = {"layer": (set(layer), 1.0 / max(1, per_stage)),
                 "pre": ({k for k, ps in parts.items() if k not in layer and "pre" in ps}, 1.0),
                 "post": ({k for k, ps in parts.items() if k not in layer and "post" in ps}, 1.0)}
    on_stage = [("pre", "layer", "post")] if stages == 1 else [("pre", "layer"), ("layer", "post")]
    units = [[(unit_g(*unit_sets[u]), unit_sets[u][1]) for u in names_ if unit_sets[u][0]] for names_ in on_stage]
    units = [[(lin, sc) for lin, sc in us if lin.nodes or lin.edges] for us in units]
    spaces = [float(workspace)] * len(stage_sets) if np.isscalar(workspace) else [float(w) for w in workspace]  # type: ignore[arg-type]
    if len(spaces) != len(stage_sets):
        raise ShardError(f"workspace: one number, or one per priced stage ({len(stage_sets)}), not {len(spaces)}")
    memories = []
    for (ks, held), space in zip(stage_sets, spaces):
        mem = Linear({k: (comp["W"][k] * count[k] + comp["A"][k] * (per_stage if k in layer else 1) * held) / GB
                      for k in ks})
        if bits:
            mem.extra[w_var] = 0.0 if space else 1.0  # the recomputed layer's activations: in the workspace
            for scale, u, v, _ in bits:
                mem.extra[u] = -held * scale
                mem.extra[v] = held * scale
        rows.append((mem, -np.inf, (budget - space) / GB))
        memories.append(mem)

    allowed = [np.ones(len(comp["C"][k]), bool) for k in range(len(classes))]
    for val, spec in constraints.items():
        i = next((k for k, n in enumerate(nodes) if n.value == val), None)  # type: ignore[assignment]
        if i is None:
            continue
        ok = np.array([st.out == spec for st in nodes[i].strategies])  # type: ignore[assignment]
        if not ok.any():  # type: ignore[attr-defined]
            raise ShardError(f"the annotation {spec_str(spec)} on {nodes[i].label} ({nodes[i].info}) is not a "
                             f"sharding the op can produce on mesh {mesh}")
        allowed[slot[cls[i]]] &= ok
    for i, node in enumerate(nodes):
        names_ok = only(node) if only is not None else None
        if names_ok is not None:
            ok = np.array([base_name(st.name) in names_ok for st in node.strategies])  # type: ignore[assignment]
            if not ok.any():  # type: ignore[attr-defined]
                raise LayoutError(f"{node.label}: none of the strategies {sorted(names_ok)} is possible on mesh "
                                  f"{mesh} (it has {[st.name for st in node.strategies]})")
            allowed[slot[cls[i]]] &= ok
    totals = {name: total(name) for name in ("C", "Cst", "B", "Omb", "Ost")}
    return _Program(mesh=mesh, sizes=sizes, budget=budget, training=training, stages=stages, micro_batches=micro_batches, nodes=nodes, cls=cls, slot=slot, count=count, layer=layer, start=start, period=period, copies=copies, per_stage=per_stage, exprs=exprs, comp=comp, edges=edges, edge_cache=edge_cache, stage_sets=stage_sets, slots=slots, eta=eta, p2p_link=p2p_link, ckpt=ckpt, ckpt_bytes=ckpt_bytes, kept_bytes=kept_bytes, r=r, objective=objective, rows=rows, extras=extras, allowed=allowed, memories=memories, totals=totals, units=units, workspace=spaces, repeat_collectives=repeat_collectives, host=hosts)


def _gathered_over(prog: _Program, ch: list[int], xs: Sequence[float]) -> bool:
    """Whether a solution's stage, its gathered units counted, is over the budget."""
    return any(mem.value(ch, prog.edges, xs) * GB + 2 * GB * max((lin.value(ch, prog.edges) for lin, _ in us), default=0.0)
               > prog.budget - space for mem, us, space in zip(prog.memories, prog.units, prog.workspace))


def _count_gathered(prog: _Program) -> None:
    """Adds the gathered units to each stage's memory row: g_s >= every unit's gathered bytes, the
    row holding 2 g_s (the unit computing and the one prefetched)."""
    for mem, us in zip(prog.memories, prog.units):
        if not us:
            continue
        prog.extras.append((0, np.inf, 0))
        gz = len(prog.extras) - 1
        mem.extra[gz] = 2.0
        for lin, _ in us:
            prog.rows.append((Linear(dict(lin.nodes), dict(lin.edges), {gz: -1.0}), -np.inf, 0))


def _read_back(prog: _Program, ch: list[int], xs: list[float], solve_time: float, nvars: int) -> Plan:
    """The plan a solution of the program stands for: each node's strategy, the predicted step (the
    slowest stage's, as a formula of the symbolic dims too), its compute, communication and memory."""
    nodes, cls, slot, count, layer, start, period, copies, per_stage = \
        prog.nodes, prog.cls, prog.slot, prog.count, prog.layer, prog.start, prog.period, prog.copies, prog.per_stage
    exprs, comp, edges, edge_cache, stage_sets, slots, eta, p2p_link, ckpt = \
        prog.exprs, prog.comp, prog.edges, prog.edge_cache, prog.stage_sets, prog.slots, prog.eta, prog.p2p_link, prog.ckpt
    ckpt_bytes, r, totals, mesh, sizes, budget, training, stages, micro_batches = \
        prog.ckpt_bytes, prog.r, prog.totals, prog.mesh, prog.sizes, prog.budget, prog.training, prog.stages, prog.micro_batches
    in_layers = prog.in_layers
    compute, blocking = totals["C"], totals["B"]
    picked = [ch[slot[cls[i]]] for i in range(len(nodes))]
    re = int(round(xs[r])) if r is not None else 0
    felt = OVERLAP_INTERFERENCE if eta else 0.0
    again = 0.5 if prog.repeat_collectives else 0.0
    redo = slots * re * sum(float(comp["F"][k][ch[k]]) + float(comp["B"][k][ch[k]]) * again
                            for k in layer)
    p2p = slots * 2 * sum(p2p_link.alpha + float(ckpt_bytes[k][ch[k]]) / p2p_link.beta
                          for k in ckpt) if stages > 1 else 0.0
    one_layer = sum(float(comp["A"][k][ch[k]]) for k in layer)
    kept_ckpt = sum(float(kb[ch[k]]) for k, kb in prog.kept_bytes.items())
    # Per stage: (step, compute, communication, compute + blocking per micro-batch, memory).
    per, terms = [], []
    for (ks, held), us, space, h in zip(stage_sets, prog.units, prog.workspace, prog.host):
        c_s, b_s = compute.restricted(ks, edges).value(ch, edges), blocking.restricted(ks, edges).value(ch, edges)
        c_step = totals["Cst"].restricted(ks, edges).value(ch, edges)
        exposed = {}
        for name in ("Omb", "Ost"):
            o = totals[name].restricted(ks, edges).value(ch, edges)
            exposed[name] = max(0.0, o - eta * c_s) + felt * o
        comm_s = slots * b_s + slots * exposed["Omb"] + exposed["Ost"] + p2p
        weights = sum(float(comp["W"][k][ch[k]]) * count[k] for k in ks)
        acts = sum(float(comp["A"][k][ch[k]]) for k in ks if k not in layer)
        kept = (per_stage - re) * held * one_layer + re * held * kept_ckpt + (
            one_layer if re == per_stage and not space else 0.0)
        gathered = 2 * GB * max((lin.value(ch, edges) for lin, _ in us), default=0.0)
        terms.append({"weights": weights, "activations": held * acts + kept, "gathered": gathered, "workspace": space})
        per.append((slots * c_s + c_step + redo + h + comm_s, slots * c_s + c_step + redo + h, comm_s, c_s + b_s,
                    weights + held * acts + kept + gathered + space))
    slowest = max(range(len(per)), key=lambda s: per[s][0])
    ks_slow = stage_sets[slowest][0]
    choices, forward = [], []
    fc, fb, fo, fcst = sympy.Integer(0), sympy.Integer(0), {"Omb": sympy.Integer(0), "Ost": sympy.Integer(0)}, sympy.Integer(0)
    for i, node in enumerate(nodes):
        ex = exprs[cls[i]][picked[i]]
        st = node.strategies[picked[i]]
        w = per_stage / copies if in_layers(i) else 1
        incoming = {"B": sympy.Integer(0), "Omb": sympy.Integer(0), "Ost": sympy.Integer(0), "G": sympy.Integer(0)}
        for pos, p in enumerate(node.operands):
            key = (cls[p], cls[i], pos, str(nodes[p].info))
            for k, v in edge_cache[key][1][picked[p]][picked[i]].items():
                incoming[k] += v
            for step in reshard_steps(nodes[p].strategies[picked[p]].out, st.ins[pos]):
                if step.collective != "all_slice":
                    forward.append((step.collective, (step.axis,), node.label))
        if st.partial:
            forward.append(("all_reduce" if st.scatter is None else "reduce_scatter", st.partial, node.label))
        if slot[cls[i]] in ks_slow:  # the formula is the slowest stage's
            fc += ex["C"] * w
            fcst += ex["Cst"] * w
            fb += (ex["B"] + incoming["B"]) * w
            for k in fo:
                fo[k] += (ex[k] + incoming[k]) * w
        comm = ex["B"] + incoming["B"] + ex["Omb"] + incoming["Omb"] + ex["Ost"] + incoming["Ost"]
        choices.append(Choice(node, st, at(ex["C"] + ex["Cst"], sizes), at(comm, sizes), at(ex["W"] + ex["A"], sizes)))
    formula = fcst + slots * (fc + fb) + sum((slots if k == "Omb" else 1) * (sympy.Max(0, fo[k] - eta * fc) + felt * fo[k])
                                      for k in fo)
    _, c_time, comm_time, slot_time, _ = per[slowest]
    p = Plan(mesh, choices, c_time, comm_time, max(s[4] for s in per), formula + redo + p2p + prog.host[slowest],
             solve_time,  # type: ignore[assignment]
             (start, period, copies), forward=forward, variables=nvars, budget=budget, cut_short=bool(CUT_SHORT))
    p.stages, p.micro_batches, p.recompute = stages, micro_batches, re  # type: ignore[attr-defined]
    p.stage_times = tuple(s[0] for s in per)  # type: ignore[attr-defined]
    p.stage_memory = tuple(s[4] for s in per)  # type: ignore[attr-defined]
    p.memory_terms = tuple(terms)  # type: ignore[attr-defined]
    p.host = prog.host[slowest]  # type: ignore[attr-defined]
    p.bubble = (stages - 1) * slot_time if training else 0.0  # type: ignore[attr-defined]
    p.zero = zero_stage(p)  # type: ignore[attr-defined]
    return p  # type: ignore[return-value]
