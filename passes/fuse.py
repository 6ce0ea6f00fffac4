"""`fuse`: group ops into `tg.fusion` kernels, best predicted saving first.

What it decides: which ops run as one kernel. Every compute op starts in a group
of its own; views (reshape, transpose, ...) and sources (weights, constants) stay
outside groups, gather/scatter-like ops too. Then, as XLA's priority fusion does:

    candidates = every producer->consumer edge between two groups, and every pair
                 of sibling matmuls reading the same input (Q, K, V projections)
    priority   = predicted time saved = cost(a) + cost(b) - cost(a ∪ b)
                 (passes/cost: the intermediate no longer goes through memory,
                 one kernel launch / NumPy dispatch fewer)
    loop:  pop the best candidate; if it is still legal and still saves time,
           merge, and re-price the candidates of the merged group

A merge is legal when (each rule a `_why_not` case, with its reason in the remark):
  - the merged group keeps one anchor (matmul, conv, einsum, attention), except
    sibling matmuls that share their left operand and take weights on the right
    (horizontal fusion: one wider GEMM);
  - an anchor reads nothing computed inside its own group (epilogues fuse,
    prologues do not: a GEMM reads its operands from memory);
  - every op of the group keeps the same rows: its result has the group's rank
    and leading dims (the last axis may differ only for keepdims reductions over
    it), so the group runs as one loop over row chunks (`tile`);
  - no cycle: no path between the two groups through a third one;
  - at most `max-ops` ops, and one row of every value fits in the cache
    (the working-set limit).

Every merge, and every rejected candidate that would have saved time, leaves a
remark with the predicted costs. The result is visible in printed IR.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Iterable

import networkx as nx
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.func import FuncOp
from xdsl.ir import SSAValue

from tilegraph.ir.dialect import TgOp
from tilegraph.ir.shapes import info_of
from tilegraph.ir.fusion import (ANCHORS, VIEW_OPS, GroupKind, flat_ok, live_row_bytes, operand_rows, outline, row_reshape,
                                 siblings)
from tilegraph.ir.ops import Op, OPAQUE
from tilegraph.passes.cost.model import at_nominal, group_cost, nominal_sizes, op_cost
from tilegraph.ir.hardware import check_target, hardware
from tilegraph.passes.remarks import listening, remark
from xdsl.passes import ModulePass

# Ops that stay outside groups: they move data by index (gather, scatter, concat)
# or make it (sources); a fused loop over row chunks cannot express them simply.
UNFUSABLE_CATEGORIES = {"layout", "source", "quantize"}
# A merge must save at least this much predicted time: a tenth of one NumPy call
# (~1 us, calibrated), below which the prediction is noise.
MIN_SAVING = 1e-7


@dataclass(eq=False)
class Group:
    ops: list[TgOp]
    index: int  # program position of its first op: keeps the emitted order stable
    version: int = 0

    @property
    def anchors(self) -> list[TgOp]:
        return [op for op in self.ops if op.op_name in ANCHORS]


def fusable(op) -> bool:
    # One result per fused op: a group's chunk loop gives each op one home (topk has two).
    # A reshape that keeps the last dim joins a group: on [rows, last] views it is nothing.
    if isinstance(op, TgOp) and row_reshape(op):
        return True
    return isinstance(op, TgOp) and op.SPEC.category not in UNFUSABLE_CATEGORIES and op.op_name not in VIEW_OPS \
        and len(op.results) == 1 and op.SPEC.pattern != OPAQUE  # (opaque: tg.nonzero, its size known only after)


@dataclass(frozen=True)
class Fuse(ModulePass):
    """Fuse ops into tg.fusion groups by predicted time saved (see the module docstring)."""

    name = "fuse"

    hardware: str = "cpu"  # whose cost model decides: h100, h200, a100, cpu (the NumPy backend) or c
    max_ops: int = 32

    def __post_init__(self) -> None:
        check_target(self.hardware)
        if self.max_ops < 1:
            raise ValueError(f"max-ops must be at least 1, got {self.max_ops}")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        hw = hardware(self.hardware)
        with nominal_sizes():  # it ranks merges by costs at the nominal size: numbers, not formulas
            for func in [f for f in op.walk() if isinstance(f, FuncOp)]:
                _Fuser(func, hw, self.max_ops).run()


class _Fuser:
    def __init__(self, func: FuncOp, hw, max_ops: int):
        self.func, self.hw, self.max_ops = func, hw, max_ops
        self.block = func.body.block
        self.order = {op: i for i, op in enumerate(self.block.ops)}
        self.group_of: dict[TgOp, Group] = {}
        for op in self.block.ops:
            if fusable(op):
                self.group_of[op] = Group([op], self.order[op])
        self._times: dict[frozenset, float] = {}
        self.graph = self._graph()

    # --- the group graph --------------------------------------------------------

    def _node(self, op):
        return self.group_of.get(op, op)

    def _graph(self) -> nx.DiGraph:
        """Nodes: groups and unfused ops; an edge where a value flows."""
        g = nx.DiGraph()
        for op in self.block.ops:
            g.add_node(self._node(op))
            for v in op.operands:
                if v.owner in self.order:
                    a, b = self._node(v.owner), self._node(op)
                    if a is not b:
                        g.add_edge(a, b)
        return g

    def _merge_nodes(self, a: Group, b: Group) -> Group:
        merged = Group(sorted(a.ops + b.ops, key=self.order.__getitem__), min(a.index, b.index),
                       max(a.version, b.version) + 1)
        for op in merged.ops:
            self.group_of[op] = merged
        # in graph order, never a set's: ties in the heap fall to the push order, and an order by
        # object address would fuse two clones of one module differently
        preds = [n for n in dict.fromkeys([*self.graph.predecessors(a), *self.graph.predecessors(b)]) if n not in (a, b)]
        succs = [n for n in dict.fromkeys([*self.graph.successors(a), *self.graph.successors(b)]) if n not in (a, b)]
        self.graph.remove_nodes_from([a, b])
        self.graph.add_node(merged)
        self.graph.add_edges_from((p, merged) for p in preds)
        self.graph.add_edges_from((merged, s) for s in succs)
        return merged

    # --- costs --------------------------------------------------------------------

    def _io(self, ops: list[TgOp]) -> tuple[list[SSAValue], list[SSAValue]]:
        inside = set(ops)
        inputs: list[SSAValue] = []
        outputs: list[SSAValue] = []
        for op in ops:
            for v in op.operands:
                if v.owner not in inside and v not in inputs:
                    inputs.append(v)
            for r in op.results:
                if any(use.operation not in inside for use in r.uses):
                    outputs.append(r)
        return inputs, outputs

    def time(self, ops: list[TgOp]) -> float:
        key = frozenset(map(id, ops))
        if key not in self._times:
            inputs, outputs = self._io(ops)
            cost = group_cost(ops, [info_of(v.type) for v in inputs], [info_of(v.type) for v in outputs], self.hw)
            self._times[key] = at_nominal(cost.time)
        return self._times[key]

    # --- legality -------------------------------------------------------------------

    def _why_not(self, a: Group, b: Group) -> str | None:
        """Why a and b may not be merged; None when they may."""
        ops = a.ops + b.ops
        if len(ops) > self.max_ops:
            return f"the group would hold {len(ops)} ops, more than max-ops={self.max_ops}"
        anchors = [op for op in ops if op.op_name in ANCHORS]
        if len(anchors) > 1 and not _horizontal(anchors):
            return f"it would put {len(anchors)} anchors ({', '.join(o.op_name for o in anchors)}) in one group"
        inside = set(ops)
        for anchor in anchors:
            if any(v.owner in inside for v in anchor.operands):
                return f"{anchor.op_name} would read a value computed in its own group (prologue)"
        ref = anchors[0].result_infos()[0] if anchors else max(
            (op.result_infos()[0] for op in ops), key=lambda i: i.rank)
        regrouped = False  # rows regrouped (a row reshape, or ranks that differ): only a flat loop runs it
        for op in ops:
            if op in anchors:
                continue
            out = op.result_infos()[0]
            if operand_rows(out, ref, flat=True) != "full":
                return f"{op.op_name} {out} does not keep the rows of {ref}"
            regrouped |= operand_rows(out, ref) != "full"
            regrouped |= op.op_name == Op.reshape
        if regrouped:
            inputs, outputs = self._io(ops)
            if any(isinstance(v.owner, TgOp) and v.owner.op_name == Op.reshape for v in outputs):
                return "a reshape's result would leave the group (its rows exist only inside the loop)"
            uses = [(op, i, info_of(v.type)) for op in ops for i, v in enumerate(op.operands) if v in inputs]
            if not flat_ok(ops, uses, ref):
                return "its rows are regrouped, and not every input spans the rows or only the last axis"
        if self._row_bytes(ops) > self.hw.cache_bytes:
            return "one row of every value would not fit in the cache"
        if self._has_detour(a, b) or self._has_detour(b, a):
            return "a path between them runs through another kernel (a cycle)"
        return None

    def _row_bytes(self, ops: list[TgOp]) -> float:
        return live_row_bytes(ops, set(self._io(ops)[1]), at_nominal)

    def _has_detour(self, a, b) -> bool:
        """Whether a reaches b through some node other than a direct edge."""
        for s in self.graph.successors(a):
            if s is not b and nx.has_path(self.graph, s, b):
                return True
        return False

    # --- the priority loop --------------------------------------------------------------

    def _candidates(self, g: Group) -> Iterable[tuple[Group, Group]]:
        for n in itertools.chain(self.graph.predecessors(g), self.graph.successors(g)):
            if isinstance(n, Group):
                yield (n, g) if self.graph.has_edge(n, g) else (g, n)
        for anchor in g.anchors:  # siblings: other matmuls reading the same left operand
            if anchor.op_name != Op.matmul:
                continue
            for use in anchor.operands[0].uses:
                other = self.group_of.get(use.operation)
                if other is not None and other is not g and use.index == 0 and use.operation.op_name == Op.matmul:
                    yield (g, other) if g.index < other.index else (other, g)

    def _push(self, heap: list, a: Group, b: Group, counter) -> None:
        saving = self.time(a.ops) + self.time(b.ops) - self.time(a.ops + b.ops)
        heapq.heappush(heap, (-saving, next(counter), a, b, a.version, b.version))

    def run(self) -> None:
        counter = itertools.count()
        heap: list = []
        seen: set = set()
        for g in sorted(set(self.group_of.values()), key=lambda g: g.index):
            for a, b in self._candidates(g):
                if (a, b) not in seen:
                    seen.add((a, b))
                    self._push(heap, a, b, counter)
        rejected: set = set()
        while heap:
            neg_saving, _, a, b, va, vb = heapq.heappop(heap)
            if a.version != va or b.version != vb or a not in self.graph or b not in self.graph:
                continue  # stale: one side merged since
            saving = -neg_saving
            before = self.time(a.ops) + self.time(b.ops)
            if saving <= MIN_SAVING:
                continue
            why = self._why_not(a, b)
            if why is not None:
                key = (id(a), id(b))
                if key not in rejected and listening():
                    rejected.add(key)
                    remark("fuse", f"not fused: {_describe(a)} with {_describe(b)}: {why} "
                                   f"(would have saved {_us(saving)})")
                continue
            after = self.time(a.ops + b.ops)
            merged = self._merge_nodes(a, b)
            if listening():
                remark("fuse", f"fused {_describe(a)} + {_describe(b)} -> {GroupKind.of(merged.ops).value} group of "
                               f"{len(merged.ops)} ops: predicted {_us(before)} -> {_us(after)}, saves {_us(saving)}")
            for x, y in self._candidates(merged):
                self._push(heap, x, y, counter)
        self._rewrite()

    # --- the rewrite ------------------------------------------------------------------

    def _rewrite(self) -> None:
        """Rebuild the body in a topological order of groups, each group a tg.fusion."""
        ret = self.block.last_op
        order = list(nx.lexicographical_topological_sort(
            self.graph, key=lambda n: n.index if isinstance(n, Group) else self.order[n]))
        for node in order:
            if node is ret:
                continue
            if isinstance(node, Group):
                self._emit_group(node, ret)
            else:
                node.detach()
                self.block.insert_op_before(node, ret)
        if listening():
            groups = [n for n in order if isinstance(n, Group)]
            unfused = sum(at_nominal(op_cost(op, self.hw).time) for g in groups for op in g.ops)
            remark("fuse", f"{sum(len(g.ops) for g in groups)} ops in {len(groups)} groups; predicted "
                           f"{_us(unfused)} as separate ops -> {_us(sum(self.time(g.ops) for g in groups))} fused")

    def _emit_group(self, group: Group, before) -> None:
        inputs, outputs = self._io(group.ops)
        # Dead code is dce's business, and a reshape alone is no kernel: both left as they were.
        if not outputs or all(op.op_name == Op.reshape for op in group.ops):
            for op in group.ops:
                op.detach()
                self.block.insert_op_before(op, before)
            return
        outline(group.ops, GroupKind.of(group.ops), inputs, outputs, before)


def _horizontal(anchors: list[TgOp]) -> bool:
    """Sibling matmuls, each with a 2-D weight on the right (build concatenates them once)."""
    return siblings(anchors) and all(_is_weight(op.operands[1]) for op in anchors)


def _is_weight(v: SSAValue) -> bool:
    owner = v.owner
    return isinstance(owner, TgOp) and owner.op_name == Op.weight and info_of(v.type).rank == 2


def _describe(g: Group) -> str:
    names = [op.op_name for op in g.ops]
    return names[0] if len(names) == 1 else f"[{GroupKind.of(g.ops).value}: {' '.join(names)}]"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"
