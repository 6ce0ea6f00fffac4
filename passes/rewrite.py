"""The small vocabulary tg rewrites are written in: rules as data, and queries on values.

A `Rule` names the tg ops it looks at, a function and a one-line doc. The function
gets the matched op and an `Emit` (which makes new tg ops, shape rules run); it
returns the value(s) that replace the op's results, or None when it does not apply.
A `RuleSet` drives a list of rules as one xDSL `RewritePattern`, so passes hand it
to xDSL's `PatternRewriteWalker`; rule lists compose with `+`.

The driver, not each rule, guards the one property every rewrite must keep: a
replacement has exactly the type of what it replaces (same shape, same dtype, same
spelling of symbolic dims). A rule whose result would differ is not applied, and
the ops it made are dropped again, so rules can be written plainly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.pattern_rewriter import GreedyRewritePatternApplier, PatternRewriter, PatternRewriteWalker, RewritePattern
from xdsl.transforms.dead_code_elimination import region_dce

from tilegraph.ir.decompositions import Emit, Inapplicable
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.shapes import TensorInfo, info_of

ANY_OP = "*"  # a rule that looks at every tg op
# Called as f(rule, op_name) after each applied rewrite: `tilegraph-opt --check-semantics
# --check-each-rewrite` runs the interpreter there to name the rule that changed a result.
OBSERVERS: list[Callable[["Rule", str], None]] = []


@dataclass(frozen=True)
class Rule:
    ops: tuple[str, ...]
    apply: Callable[[TgOp, "Emit"], SSAValue | Sequence[SSAValue] | None]
    doc: str = ""


class RuleSet(RewritePattern):
    """Applies the first rule (in list order) that matches an op."""

    def __init__(self, rules: Iterable[Rule]):
        self.rules = list(rules)
        self.by_op: dict[str, list[Rule]] = {}
        for rule in self.rules:
            for name in rule.ops:
                self.by_op.setdefault(name, []).append(rule)

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter, /) -> None:
        if not isinstance(op, TgOp):
            return
        for rule in self.by_op.get(op.op_name, []) + self.by_op.get(ANY_OP, []):
            if apply_rule(rule, op, rewriter):
                return


def apply_rule(rule: Rule, op: TgOp, rewriter: PatternRewriter) -> bool:
    emit = Emit()
    try:
        new = rule.apply(op, emit)
    except Inapplicable:
        new = None  # the rule built something the shape rules refuse: it does not apply (a bug propagates)
    if new is None:
        emit.discard()
        return False
    values = [new] if isinstance(new, SSAValue) else list(new)
    if len(values) != len(op.results) or any(v.type != r.type for v, r in zip(values, op.results)):
        emit.discard()
        return False
    name = op.op_name
    rewriter.replace(op, emit.ops, values)
    for observe in OBSERVERS:
        observe(rule, name)
    return True


def run_rules(module: ModuleOp, rules: Iterable[Rule], ctx: Context | None = None) -> bool:
    """Apply `rules` to a fixed point, dropping dead ops as it goes; True if the IR changed."""
    applier = GreedyRewritePatternApplier([RuleSet(rules)], ctx=ctx)
    return PatternRewriteWalker(applier, post_walk_func=region_dce).rewrite_module(module)


# --- queries ------------------------------------------------------------------


def info(value: SSAValue) -> TensorInfo:
    return info_of(value.type)


def producer(value: SSAValue, *names: str) -> TgOp | None:
    """The tg op defining `value` (one of `names`, if given), else None."""
    owner = value.owner
    if isinstance(owner, TgOp) and (not names or owner.op_name in names):
        return owner
    return None


def constant_array(value: SSAValue) -> np.ndarray | None:
    """The array of an inline `tg.constant`, else None."""
    op = producer(value, "constant")
    return None if op is None else op.attr("value")


def is_splat(value: SSAValue, scalar: float) -> bool:
    """Is `value` a constant whose every element equals `scalar`?"""
    array = constant_array(value)
    return array is not None and array.size > 0 and bool(np.all(array == scalar))


def static_dim(d: Any, n: int) -> bool:
    return isinstance(d, int) and d == n
