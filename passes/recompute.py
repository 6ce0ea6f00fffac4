"""`recompute`: trade FLOPs for memory, recomputing cheap values near their late uses.

What it decides: which values a function keeps alive across a long stretch of the
program (a training step's forward activations, kept for its backward) are recomputed
instead, so that the predicted peak of live intermediates fits `budget`, a fraction of the
save-everything peak. In two rounds, each only while the budget is not met:

1. As AOTAutograd's partitioner under `activation_memory_budget`: pointwise ops and GEMMs
   only, rebuilt from operands a few ops deep; never a reduction (softmax, layer_norm,
   sums), whose result would cost its whole input to rebuild.
2. As activation checkpointing (torch.utils.checkpoint, JAX's remat of a whole layer): any
   op, reductions and normalisations included, rebuilt from whatever is still live, however
   far back that is (a layer's input, when the rest of the layer was dropped). A value
   rebuilt once is reused by the next rebuild that needs it while it is still live, so a
   layer's backward recomputes the layer's forward about once, not once per value.

How: a liveness walk over the function's order prices the peak (each op's result bytes
from its static shape; a view shares its operand's buffer and keeps it alive; inputs,
weights and constants are resident and not counted; while an op runs, the full-size temporaries
its NumPy kernel holds, `numpy_temporaries`, count too: a gelu rebuilt near the backward's peak
holds four more activations there). A candidate is a value whose
consecutive uses are more than `min_gap` ops apart: its uses after the largest gap read a
copy of its op inserted right before the first of them, with copies of the producers of
operands that are dead by then. Candidates are tried greedily by bytes freed per FLOP
spent (a knapsack's greedy order); one is kept only if the predicted peak does not grow
and the bytes held over time fall. It stops when the peak fits the budget or nothing more
helps. Remarks name each recomputed value, its bytes and FLOPs (its rebuilt producers'
included), and the peak before and after.

What the budget is of (`hardware`, `priced_bytes`): on a backend whose call allocates each value
on its own (NumPy), the live-bytes peak above. On the C backend, the arena its runtime lays the
fused program's buffers out in (ir/arena.py, the layout the runtime allocates: alignment and
first-fit gaps included, each fused group one buffer per result): the search still steers by the
live-bytes peak, and its goal is tightened while the priced arena misses the budget. The final
remark also prints the floor no recomputation goes below: at each op its operands and results,
and the outputs (a step's gradients) made before it.

Run it after cse (which would merge the copies back) and before fuse.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import sympy
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.func import FuncOp
from xdsl.ir import Block, OpResult, SSAValue
from xdsl.passes import ModulePass

from tilegraph.ir import dtypes
from tilegraph.ir.arena import LAYOUTS, lay_out
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.shapes import info_of, numel
from tilegraph.passes.remarks import remark
from tilegraph.ir.ops import Op

NAME = "recompute"


# How deep each round rebuilds a value's dead operands: a few ops (round 1), or back to
# whatever is live (round 2; bounded only so a malformed chain cannot run away).
SHALLOW, DEEP = 3, 100_000
# Times the search's live-bytes goal is tightened when the priced bytes still miss the budget.
TIGHTEN = 4
# Backends that lay a call's intermediates out in one arena (backends/c/runtime.py): their bytes are
# the layout's, fragmentation included, of the fused program they run.
ARENA_HARDWARE = ("c",)


def recomputable(op: TgOp) -> bool:
    """Round 1: pointwise ops, and the GEMMs (matmul, conv, attention) whose operands a backward
    keeps anyway (a layer's input and its weight): last in the greedy order, as they cost the
    most FLOPs per byte (AOTAutograd's knapsack recomputes matmuls too when the budget asks)."""
    return len(op.results) == 1 and (op.SPEC.pointwise or op.SPEC.gemm is not None)


def rebuildable(op: TgOp) -> bool:
    """Round 2: any op that is a pure function of its operands with static sizes (not a weight or
    constant, which are resident anyway, nor a data-dependent size); a split's results too, each
    a candidate of its own (rebuilding one rebuilds the op)."""
    return not op.SPEC.view and op.SPEC.bound is None and op.op_name not in (Op.weight, Op.constant)


def value_bytes(v: SSAValue) -> int:
    return _type_bytes(v.type)


@functools.lru_cache(maxsize=4096)
def _type_bytes(ty) -> int:
    t = info_of(ty)
    n = numel(t.shape)
    if not isinstance(n, int):  # a symbolic dim priced at 1: the pass plans static training steps
        n = int(sympy.sympify(n).subs({s: 1 for s in sympy.sympify(n).free_symbols}))
    return dtypes.storage_bytes(t.dtype, n)


def _resident(v: SSAValue) -> bool:
    """Inputs, weights and constants: held whether or not the function runs."""
    return not isinstance(v, OpResult) or (isinstance(v.owner, TgOp) and v.owner.op_name in (Op.weight, Op.constant))


def peak_bytes(block: Block, kernels: bool = True) -> int:
    """The predicted peak of live intermediate bytes over the block's order; with `kernels`, the
    temporaries NumPy's kernels hold while they run too (none where fused loops run the ops)."""
    return _liveness(block, kernels=kernels)[0]


def _liveness(block: Block, detail: bool = False, ignore: frozenset = frozenset(), kernels: bool = True):
    """(peak bytes, bytes x ops: the area under the live-bytes curve, with `kernels` each op's
    `numpy_temporaries` while it runs); with detail, also each
    value's buffer (a view's is its operand's) and each buffer's last use, leaving out the
    uses in `ignore` ((op, operand index) pairs: those about to read a copy)."""
    ops = list(block.ops)
    root: dict[SSAValue, SSAValue] = {}
    last: dict[SSAValue, int] = {}
    born: dict[SSAValue, int] = {}
    for i, op in enumerate(ops):
        for k, v in enumerate(op.operands):
            if _resident(v) or (op, k) in ignore:
                continue
            r = root.get(v, v)
            last[r] = max(last.get(r, -1), i)
        if isinstance(op, TgOp) and op.SPEC.view and op.operands and not _resident(op.operands[0]):
            root[op.results[0]] = root.get(op.operands[0], op.operands[0])  # a view: its operand's buffer
            continue
        for r in op.results:
            if not _resident(r):
                born[r] = i
                last.setdefault(r, i)
    end = len(ops)
    for v in block.last_op.operands if block.last_op is not None else ():
        if not _resident(v):
            last[root.get(v, v)] = end  # outputs live to the end
    delta = np.zeros(end + 2, dtype=np.int64)
    for i, op in enumerate(ops if kernels else ()):  # what a kernel holds while it runs (a gelu's erf)
        if isinstance(op, TgOp) and op.SPEC.numpy_temporaries:
            held = op.SPEC.numpy_temporaries * sum(value_bytes(r) for r in op.results)
            delta[i] += held
            delta[i + 1] -= held
    for r, b in born.items():
        size = value_bytes(r)
        delta[b] += size
        delta[last[r] + 1] -= size
    live = np.cumsum(delta)
    if detail == "born":
        return born, root, last
    if detail:
        return int(live.max(initial=0)), int(live.sum()), root, last
    return int(live.max(initial=0)), int(live.sum())


def arena_bytes(block: Block) -> int:
    """The bytes the block's intermediates take laid out as the C runtime lays out its arena
    (ir/arena.py: each buffer from the op writing it to the last op reading it, a view's reads
    its operand's, outputs to the end; 64-byte aligned, first fit): the live-bytes peak plus
    what alignment and fragmentation add."""
    born, _, last = _liveness(block, detail="born")
    return lay_out({r: value_bytes(r) for r in born}, {r: (b, last[r]) for r, b in born.items()})[1]


def floor_bytes(block: Block) -> int:
    """The least any recomputation can bring the peak to: at each op, the buffers it reads and
    writes, and the function's outputs made before it (a training step's gradients, kept to the
    end); the largest such sum over the order. Everything else could, in principle, be rebuilt."""
    ops = list(block.ops)
    _, _, root, _ = _liveness(block, detail=True)
    outs = {root.get(v, v) for v in (block.last_op.operands if block.last_op is not None else ()) if not _resident(v)}
    born = {r: i for i, op in enumerate(ops) for r in op.results if r in outs}
    floor = 0
    for i, op in enumerate(ops):
        if isinstance(op, TgOp) and op.SPEC.view:
            continue
        here = {root.get(v, v) for v in op.operands if not _resident(v)} | {r for r in op.results if not _resident(r)}
        here |= {r for r in outs if born.get(r, len(ops)) < i}
        floor = max(floor, sum(value_bytes(r) for r in here))
    return floor


def _chain(op: TgOp, at: int, root: dict, last: dict, stand_in, extend, depth: int) -> list[TgOp]:
    """The ops to copy to recompute op's result at position `at`: op, and the producers (views,
    and ops `extend` accepts, up to `depth` deep) of operands whose buffers are dead by then
    and for which no copy is live then (`stand_in(v)`: such a copy, or None)."""
    out, seen = [], set()
    todo = [(op, depth)]
    while todo:
        o, d = todo.pop()
        if o in seen:
            continue
        seen.add(o)
        out.append(o)
        for v in o.operands:
            if _resident(v) or last.get(root.get(v, v), -1) >= at or stand_in(v) is not None:
                continue  # there anyway
            owner = v.owner if isinstance(v, OpResult) else None
            if isinstance(owner, TgOp) and d > 0 and (owner.SPEC.view or extend(owner)):
                todo.append((owner, d - 1))
    return out


def _candidates(block: Block, min_gap: int, accept) -> list[tuple[float, TgOp, SSAValue, list]]:
    ops = list(block.ops)
    pos = {op: i for i, op in enumerate(ops)}
    out: list[tuple[float, TgOp, SSAValue, list]] = []
    for op in ops:
        # a view of a value stands for it: its late uses, rebuilt with the value behind them
        # (an attention's output is read by its backward through a transpose and a reshape)
        view = isinstance(op, TgOp) and op.SPEC.view and bool(op.operands) and not _resident(op.operands[0])
        if not isinstance(op, TgOp) or not (accept(op) or view):
            continue
        for v in op.results:
            uses = sorted(((pos[u.operation], u) for u in v.uses if u.operation in pos), key=lambda t: t[0])
            if not uses or uses[-1][0] == pos[op] + 1:
                continue
            points = [pos[op]] + [p for p, _ in uses]
            gaps = [b - a for a, b in zip(points, points[1:])]
            k = int(np.argmax(gaps))
            if gaps[k] <= min_gap:
                continue
            late = [u for p, u in uses if p >= points[k + 1]]
            out.append((value_bytes(v) / max(_flops([op]), 1.0), op, v, late))
    out.sort(key=lambda t: -t[0])
    return out


def _flops(ops) -> float:
    return float(sum(o.SPEC.flop_count([info_of(x.type) for x in o.operands], [info_of(r.type) for r in o.results])
                     for o in ops))


@dataclass
class _State:
    peak: int
    area: int
    kernels: bool  # NumPy's kernel temporaries priced (_liveness)
    chosen: list = field(default_factory=list)
    original: dict = field(default_factory=dict)  # a copy's value -> the value it copies


def recompute(block: Block, budget: float, min_gap: int = 8, checkpoint: bool = True,
              price: Callable[[Block], int] | None = None, kernels: bool = True) -> dict:
    """Rewrite `block` so its predicted peak fits budget x the save-everything peak (as far as
    recomputing values can; without `checkpoint`, round 1 only); returns what it did. `price`: the
    bytes a block takes as its backend holds them (default: the live-bytes peak, `peak_bytes`); the
    search steers by the live-bytes peak, its goal tightened while the priced bytes miss the budget;
    `kernels`: the steering prices NumPy's kernel temporaries (a backend running each op on its own)."""
    price = price or functools.partial(peak_bytes, kernels=kernels)
    before, area = _liveness(block, kernels=kernels)
    floor = floor_bytes(block)
    reference = price(block)
    target = budget * reference
    goal = budget * before
    state = _State(before, area, kernels)
    rounds = [(recomputable, SHALLOW)] + ([(rebuildable, DEEP)] if checkpoint else [])
    priced = reference
    for _ in range(TIGHTEN):
        for accept, depth in rounds:
            if state.peak <= goal:
                break
            _round(block, goal, min_gap, accept, depth, state)
        priced = price(block) if state.chosen else reference
        if priced <= target or state.peak > goal:  # met, or the search found nothing more
            break
        goal *= target / priced  # what the layout adds above the live bytes, taken off the goal
    chosen = state.chosen
    remark(NAME, f"predicted peak of intermediates {reference / 1e6:.3f} MB -> {priced / 1e6:.3f} MB (budget "
                 f"{budget:.0%} = {target / 1e6:.3f} MB{'' if priced <= target else ', not reached'}; live bytes "
                 f"{before / 1e6:.3f} -> {state.peak / 1e6:.3f} MB, floor {floor / 1e6:.3f} MB = "
                 f"{floor / max(before, 1):.0%} of them: each op's operands and results with the outputs made "
                 f"before it), {len(chosen)} values recomputed, {sum(float(f) for *_, f in chosen):.3g} FLOPs more")
    return {"before": reference, "after": priced, "target": target, "floor": floor, "live": (before, state.peak),
            "recomputed": chosen}


def priced_bytes(block: Block, hardware: str = "") -> int:
    """The bytes `block`'s intermediates and outputs take at the peak of a call on `hardware`'s
    backend. A backend that holds a call's buffers in one arena and registered how (ir/arena.py
    LAYOUTS: the C backend) prices the block as it runs it: fused as `fuse{hardware=...}` groups it,
    its buffers as its emitter makes them, laid out as its runtime lays them out. Elsewhere each
    value is an allocation of its own, and the live-bytes peak is what a call holds (`peak_bytes`)."""
    if not _arena(hardware):
        return peak_bytes(block)
    from tilegraph.ir.model import context
    from tilegraph.passes.fuse import Fuse
    from tilegraph.passes.tile import Tile

    func = block.parent_op()
    module = func.parent_op() if func is not None else None
    if not isinstance(func, FuncOp) or not isinstance(module, ModuleOp):
        return arena_bytes(block)
    fused = module.clone()
    for p in (Fuse(hardware=hardware), Tile(hardware=hardware)):
        p.apply(context(), fused)
    if hardware in LAYOUTS:
        return LAYOUTS[hardware](fused)
    # the backend not loaded: its fused values laid out (a group's inner buffers left out)
    return arena_bytes(list(fused.ops)[list(module.ops).index(func)].body.block)  # type: ignore[attr-defined]


def _arena(hardware: str) -> bool:
    """Whether `hardware`'s backend lays a call's buffers out in one arena (ir/arena.py)."""
    return bool(hardware) and hardware in ARENA_HARDWARE + tuple(LAYOUTS)


def _round(block: Block, target: float, min_gap: int, accept, depth: int, state: _State) -> None:
    """One round of the greedy: candidates `accept` takes, their dead operands rebuilt `depth` deep."""
    original: dict[SSAValue, SSAValue] = state.original
    tried: set = set()
    while state.peak > target:
        progress = False
        for _ratio, op, v, late in _candidates(block, min_gap, accept):
            if v in tried:
                continue
            tried.add(v)
            order = {o: i for i, o in enumerate(block.ops)}
            first = min((u.operation for u in late), key=order.__getitem__)
            at = order[first]
            # the buffers live at `at` once the late uses read the copy (a view's late use
            # otherwise keeps the value it views alive, and nothing would be rebuilt)
            _, _, root, last = _liveness(block, detail=True,
                                         ignore=frozenset((u.operation, u.index) for u in late))
            # copies made earlier stand in for their originals: the latest made before `at` (a
            # dead one is kept alive up to here, when that holds less than rebuilding it: the k
            # and v of a split rebuilt for its q)
            live_copy = {original[c]: c for c in sorted((c for c in original if order[c.owner] < at),
                                                        key=lambda c: order[c.owner])}

            def stand_in(x: SSAValue, live_copy: dict = live_copy) -> SSAValue | None:
                c = live_copy.get(original.get(x, x))
                return c if c is not None and c is not x else None

            chain = sorted(_chain(op, at, root, last, stand_in, accept, depth), key=order.__getitem__)
            copies: dict[SSAValue, SSAValue] = {}
            made = []
            for o in chain:  # producers first, each copy reading the copies before it
                c = o.clone()
                for k, operand in enumerate(c.operands):
                    if operand in copies:
                        c.operands[k] = copies[operand]
                    elif last.get(root.get(operand, operand), -1) < at:
                        c.operands[k] = stand_in(operand) or operand
                block.insert_op_before(c, first)
                copies.update(zip(o.results, c.results))
                made.append(c)
            # the late uses read the copy; so do the uses from `at` on of a rebuilt op's other
            # results (the k and v of a split rebuilt for its q), which are otherwise rebuilt again
            moved = [(u.operation, u.index, a) for a in copies for u in list(a.uses)
                     if u.operation in order and order[u.operation] >= at]
            for user, k, a in moved:
                user.operands[k] = copies[a]
            new_peak, new_area = _liveness(block, kernels=state.kernels)
            # kept when the peak does not grow and less is held for less long: a value live
            # only away from the peak now lowers the next peak, once others have come down
            if new_peak <= state.peak and new_area < state.area:
                state.peak, state.area = new_peak, new_area
                for o, c in zip(chain, made):
                    for a, b in zip(o.results, c.results):
                        original[b] = original.get(a, a)
                flops = _flops(chain)
                state.chosen.append((op.op_name, value_bytes(v), flops))
                others = [o for o in chain if o is not op]
                via = ""
                if len(others) > 4:
                    via = f" (with {len(others)} ops before it, back to values still live)"
                elif others:
                    via = f" (with {', '.join('tg.' + o.op_name for o in others)})"
                remark(NAME, f"recomputes tg.{op.op_name}{via} ({value_bytes(v) / 1e6:.3f} MB, {flops:.3g} FLOPs) "
                             f"before its late use by {first.name}: peak {new_peak / 1e6:.3f} MB")
                progress = True
                break
            for user, k, a in moved:  # no better: put the originals back
                user.operands[k] = a
            for c in reversed(made):
                block.erase_op(c)
        if not progress:
            break


@dataclass(frozen=True)
class Recompute(ModulePass):
    name = NAME

    budget: float = 1.0
    min_gap: int = 8
    checkpoint: bool = True  # round 2 (any op, back to live values) when round 1 falls short
    hardware: str = ""  # whose memory the budget is of (priced_bytes): "c", the C backend's arena

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        price = functools.partial(priced_bytes, hardware=self.hardware)
        for func in op.ops:
            if isinstance(func, FuncOp):
                recompute(func.body.block, self.budget, self.min_gap, self.checkpoint, price,
                          kernels=not _arena(self.hardware))
