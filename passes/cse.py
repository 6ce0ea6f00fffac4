"""`cse`: common subexpression elimination; two ops computing the same value become one.

What it decides: that two tg ops with the same name, operands, attributes and
result types compute the same value, so the later one's uses are pointed at the
earlier one. Every tg op is pure (the `Pure` trait on `ir.dialect.TgOp`: weights are
read-only, nothing has side effects), so this is xDSL's CSE driver unchanged. Two
`tg.weight` ops naming the same array, and equal inline constants, merge too.
Run `canonicalize` first to find more: it spells constants and attributes one way.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.transforms.common_subexpression_elimination import cse


@dataclass(frozen=True)
class CommonSubexpressionElimination(ModulePass):
    name = "cse"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        cse(op)
