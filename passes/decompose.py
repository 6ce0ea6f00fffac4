"""`decompose`: composite ops (softmax, layer_norm, gelu, attention) into primitives.

What it decides: nothing clever. Frontends keep composites as single ops so the
mapping stays one-to-one; this pass spells each one out in reductions,
elementwise ops, transposes and matmuls, for the passes (fusion) and backends that
want primitives. `decompose{ops=softmax,gelu}` restricts it to some composites
(attention spells out into a softmax op among others: `ops=attention` leaves that one).

How: one rule per composite, from the decomposition library (ir/decompositions.py),
which the backends that lack an op use too.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from tilegraph.ir.decompositions import DECOMPOSITIONS
from tilegraph.ir.errors import TilegraphError
from tilegraph.passes.rewrite import Rule, run_rules


@dataclass(frozen=True)
class Decompose(ModulePass):
    name = "decompose"

    ops: tuple[str, ...] = tuple(DECOMPOSITIONS)

    def __post_init__(self) -> None:
        unknown = [name for name in self.ops if name not in DECOMPOSITIONS]
        if unknown:
            raise TilegraphError(f"decompose: no decomposition for {', '.join(unknown)}; "
                                 f"it decomposes {', '.join(DECOMPOSITIONS)}")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        rules = [Rule((name,), DECOMPOSITIONS[name], f"{name} -> primitives") for name in self.ops]
        run_rules(op, rules, ctx)
