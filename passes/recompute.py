"""`recompute`: trade FLOPs for memory, recomputing cheap values near their late uses.

What it decides: which values a function keeps alive across a long stretch of the
program (a training step's forward activations, kept for its backward) are recomputed
instead, so that the predicted peak of live intermediates fits `budget`, a fraction of the
save-everything peak. As AOTAutograd's partitioner under `activation_memory_budget`,
only some ops are recomputed: pointwise ones (AOTAutograd's) and GEMMs, never a reduction (softmax, layer_norm, sums), whose result would cost its whole input
to rebuild.

How: a liveness walk over the function's order prices the peak (each op's result bytes
from its static shape; a view shares its operand's buffer and keeps it alive; inputs,
weights and constants are resident and not counted). A candidate is a value whose
consecutive uses are more than `min_gap` ops apart: its uses after the largest gap read a
copy of its op inserted right before the first of them, with copies of the producers of
operands that are dead by then (views, elementwise ops, matmuls, a few deep). Candidates are tried greedily by
bytes freed per FLOP spent (a knapsack's greedy order); one is kept only if the predicted
peak does not grow and the bytes held over time fall. It stops when the peak fits the budget or nothing more helps. Remarks name
each recomputed value, its bytes and FLOPs, and the peak before and after.

Run it after cse (which would merge the copies back) and before fuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.func import FuncOp
from xdsl.ir import Block, OpResult, SSAValue
from xdsl.passes import ModulePass

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.shapes import info_of, numel
from tilegraph.passes.remarks import remark
from tilegraph.ir.ops import Op

NAME = "recompute"


def recomputable(op: TgOp) -> bool:
    """Pointwise ops, and the GEMMs (matmul, conv, attention) whose operands a backward keeps
    anyway (a layer's input and its weight): last in the greedy order, as they cost the most
    FLOPs per byte (AOTAutograd's knapsack recomputes matmuls too when the budget asks)."""
    return len(op.results) == 1 and (op.SPEC.pointwise or op.SPEC.gemm is not None)


def value_bytes(v: SSAValue) -> int:
    t = info_of(v.type)
    n = numel(t.shape)
    if not isinstance(n, int):  # a symbolic dim priced at 1: the pass plans static training steps
        n = int(sympy.sympify(n).subs({s: 1 for s in sympy.sympify(n).free_symbols}))
    return dtypes.storage_bytes(t.dtype, n)


def _resident(v: SSAValue) -> bool:
    """Inputs, weights and constants: held whether or not the function runs."""
    return not isinstance(v, OpResult) or (isinstance(v.owner, TgOp) and v.owner.op_name in (Op.weight, Op.constant))


def peak_bytes(block: Block) -> int:
    """The predicted peak of live intermediate bytes over the block's order."""
    return _liveness(block)[0]


def _liveness(block: Block, detail: bool = False):
    """(peak bytes, bytes x ops: the area under the live-bytes curve); with detail, also each
    value's buffer (a view's is its operand's) and each buffer's last use."""
    ops = list(block.ops)
    root: dict[SSAValue, SSAValue] = {}
    last: dict[SSAValue, int] = {}
    born: dict[SSAValue, int] = {}
    for i, op in enumerate(ops):
        for v in op.operands:
            if _resident(v):
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
    for r, b in born.items():
        size = value_bytes(r)
        delta[b] += size
        delta[last[r] + 1] -= size
    live = np.cumsum(delta)
    if detail:
        return int(live.max(initial=0)), int(live.sum()), root, last
    return int(live.max(initial=0)), int(live.sum())


def _chain(op: TgOp, at: int, root: dict, last: dict, depth: int = 3) -> list[TgOp]:
    """The ops to copy to recompute op's result at position `at`: op, and the producers (views,
    recomputable ops, up to `depth` deep) of operands whose buffers are dead by then."""
    out = [op]
    for o in op.operands:
        if _resident(o) or last.get(root.get(o, o), -1) >= at:
            continue  # there anyway
        owner = o.owner if isinstance(o, OpResult) else None
        if isinstance(owner, TgOp) and len(owner.results) == 1 and depth > 0 and (owner.SPEC.view or recomputable(owner)):
            out += _chain(owner, at, root, last, depth - 1)
    return out


def _candidates(block: Block, min_gap: int) -> list[tuple[float, TgOp, SSAValue, list]]:
    ops = list(block.ops)
    pos = {op: i for i, op in enumerate(ops)}
    out: list[tuple[float, TgOp, SSAValue, list]] = []
    for op in ops:
        if not isinstance(op, TgOp) or not recomputable(op):
            continue
        v: SSAValue = op.results[0]
        uses = sorted(((pos[u.operation], u) for u in v.uses if u.operation in pos), key=lambda t: t[0])
        if not uses or uses[-1][0] == pos[op] + 1:
            continue
        points = [pos[op]] + [p for p, _ in uses]
        gaps = [b - a for a, b in zip(points, points[1:])]
        k = int(np.argmax(gaps))
        if gaps[k] <= min_gap:
            continue
        late = [u for p, u in uses if p >= points[k + 1]]
        flops = float(op.SPEC.flop_count([info_of(o.type) for o in op.operands], [info_of(v.type)]))
        out.append((value_bytes(v) / max(flops, 1.0), op, v, late))
    out.sort(key=lambda t: -t[0])
    return out


def recompute(block: Block, budget: float, min_gap: int = 8) -> dict:
    """Rewrite `block` so its predicted peak fits budget x the save-everything peak (as far as
    recomputing elementwise values can); returns what it did."""
    before, area = _liveness(block)
    target = budget * before
    peak = before
    chosen = []
    tried: set = set()
    while peak > target:
        progress = False
        for _ratio, op, v, late in _candidates(block, min_gap):
            if op in tried:
                continue
            tried.add(op)
            order = {o: i for i, o in enumerate(block.ops)}
            first = min((u.operation for u in late), key=order.__getitem__)
            _, _, root, last = _liveness(block, detail=True)
            chain = sorted(set(_chain(op, order[first], root, last)), key=order.__getitem__)
            copies: dict[SSAValue, SSAValue] = {}
            made = []
            for o in chain:  # producers first, each copy reading the copies before it
                c = o.clone()
                for k, operand in enumerate(c.operands):
                    if operand in copies:
                        c.operands[k] = copies[operand]
                block.insert_op_before(c, first)
                copies[o.results[0]] = c.results[0]
                made.append(c)
            copy = made[-1] if chain[-1] is op else next(c for o, c in zip(chain, made) if o is op)
            for u in late:
                u.operation.operands[u.index] = copy.results[0]
            new_peak, new_area = _liveness(block)
            # kept when the peak does not grow and less is held for less long: a value live
            # only away from the peak now lowers the next peak, once others have come down
            if new_peak <= peak and new_area < area:
                peak, area = new_peak, new_area
                flops = sum(o.SPEC.flop_count([info_of(x.type) for x in o.operands], [info_of(o.results[0].type)])
                            for o in chain)
                chosen.append((op.op_name, value_bytes(v), flops))
                via = f" (with {', '.join('tg.' + o.op_name for o in chain if o is not op)})" if len(chain) > 1 else ""
                remark(NAME, f"recomputes tg.{op.op_name}{via} ({value_bytes(v) / 1e6:.3f} MB, {flops} FLOPs) before "
                             f"its late use by {first.name}: peak {new_peak / 1e6:.3f} MB")
                progress = True
                break
            for u in late:  # no better: put the original back
                u.operation.operands[u.index] = v
            for c in reversed(made):
                block.erase_op(c)
        if not progress:
            break
    remark(NAME, f"predicted peak of intermediates {before / 1e6:.3f} MB -> {peak / 1e6:.3f} MB (budget "
                 f"{budget:.0%} = {target / 1e6:.3f} MB{'' if peak <= target else ', not reached'}), "
                 f"{len(chosen)} values recomputed, {sum(float(f) for *_, f in chosen):.3g} FLOPs more")
    return {"before": before, "after": peak, "target": target, "recomputed": chosen}


@dataclass(frozen=True)
class Recompute(ModulePass):
    name = NAME

    budget: float = 1.0
    min_gap: int = 8

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for func in op.ops:
            if isinstance(func, FuncOp):
                recompute(func.body.block, self.budget, self.min_gap)
