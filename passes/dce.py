"""`dce`: dead code elimination; ops whose results reach no output are dropped.

What it decides: an op is live if it is `func.return` (the model's outputs) or
feeds a live op; everything else goes, weights included. Block arguments are the
model's inputs and stay even when unused: the signature is the user's. Liveness is
xDSL's `region_dce` (tg ops are `Pure`); after it, arrays of the weight store that
no `tg.weight` names any more are dropped from the store as well.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.transforms.dead_code_elimination import region_dce

from tilegraph.ir.dialect import TgOp
from tilegraph.ir.model import weights_of
from tilegraph.ir.ops import Op


def referenced_weights(module: ModuleOp) -> set[str]:
    return {op.attr("name") for op in module.walk() if isinstance(op, TgOp) and op.op_name == Op.weight}


def prune_weights(module: ModuleOp) -> None:
    """Drop the arrays of the module's store that its IR no longer names."""
    store = weights_of(module)
    for name in set(store) - referenced_weights(module):
        del store[name]


@dataclass(frozen=True)
class DeadCodeElimination(ModulePass):
    name = "dce"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        region_dce(op.body)
        prune_weights(op)
