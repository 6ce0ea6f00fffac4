"""The shard pass's plan written into the IR and read back: the grid (`shard.grid`), one
`shard.sharding` per distinct spec, a `shard.shard` after every value and before each use
that wants another sharding (MLIR's shard dialect conventions, ir/shard.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xdsl.dialects.builtin import ArrayAttr, BytesAttr, DenseArrayBase, FlatSymbolRefAttr, ModuleOp, StringAttr, \
    i16, i64
from xdsl.dialects.func import FuncOp
from xdsl.ir import SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from tilegraph.ir.shard import GridOp, ShardAxesArrayAttr, ShardingOp, ShardingType, ShardOp
from tilegraph.passes.shard_strategies import Spec, replicated

if TYPE_CHECKING:
    from tilegraph.passes.shard import Plan

GRID = "mesh"  # the shard.grid symbol the annotations name


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


def sharding_op(spec: Spec) -> ShardingOp:  # type: ignore[valid-type]
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
            specs[spec] = op.results[0]  # type: ignore[attr-defined]
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
