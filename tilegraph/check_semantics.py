"""`tilegraph-opt --check-semantics`: which pass (and which rule) changed what a model computes.

Before the pipeline, the float64 interpreter runs the model on seeded random inputs
that are valid for it (`valid_inputs`: token ids below the size of the table they
index, integer masks in {0, 1}); after each pass it runs again and every output is
compared with the reference within the project's tolerance (`tilegraph.testing`,
by dtype and reduction length). A lossy pass (`LOSSY = True`, quantize) is held to
its stated bound instead: its result must compute what its `reference()` (fake
quantization) computes, each rounding within half an ulp of its format, and that
reference becomes the baseline for the passes after it.

With `each_rewrite`, the check also runs after every single rewrite a rule-driven
pass makes (passes/rewrite.py), and a divergence names the rule.

On the first divergence: the pass (and rule), the output and its worst element are
named, the IR before and after is written to files, and `SemanticDivergence` is
raised (tilegraph-opt exits 1).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Mapping

import numpy as np

from tilegraph.ir import dtypes
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.ops import Op

# Symbolic dims not given with --dim: small, so that checking MiniLM after every pass stays quick,
# and above 1 so that broadcasting a size-1 dim is not mistaken for the real thing.
DEFAULT_SIZE = 3
# Integer inputs that index nothing are masks, flags or positions: {0, 1} is valid for all of them.
MASK_HIGH = 2


class SemanticDivergence(TilegraphError):
    """A pass changed what the model computes (tilegraph-opt exits 1)."""


def _index_bound(model) -> dict[int, int]:
    """For each integer input that (through casts and layout ops) indexes a gather, the smallest
    size of the dim it indexes: ids drawn below it are valid."""
    from tilegraph.ir.dialect import TgOp
    from tilegraph.ir.shapes import info_of

    bounds: dict[int, int] = {}
    for i, arg in enumerate(model.func.args):
        todo, seen, bound = [arg], set(), None
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            for use in v.uses:
                op = use.operation
                if not isinstance(op, TgOp):
                    continue
                if op.SPEC.indexed and use.index == 1:
                    table = info_of(op.operands[0].type).shape
                    axis = op.attr("axis") if "axis" in op.spec.attrs else 0
                    dim = table[axis % len(table)] if table else None
                    if isinstance(dim, int):
                        bound = dim if bound is None else min(bound, dim)
                elif op.SPEC.category == "layout" or op.op_name == Op.cast:
                    todo.extend(op.results)
        if bound is not None:
            bounds[i] = bound
    return bounds


def valid_inputs(model, seed: int = 0, sizes: Mapping[str, int] | None = None) -> list[np.ndarray]:
    """Random inputs the model is meant to get: `tilegraph.testing.random_inputs` (floats uniform in
    [-1, 1], booleans fair coins), with ids below their table's size and other integers (masks) in
    {0, 1}; symbolic dims `sizes`, else DEFAULT_SIZE."""
    from tilegraph.ir.shapes import free_symbols
    from tilegraph.accuracy import random_inputs

    symbols = set().union(*(free_symbols(t.shape) for t in model.inputs))
    arrays = random_inputs(model, seed, {s: dict(sizes or {}).get(s, DEFAULT_SIZE) for s in symbols})
    rng = np.random.default_rng(seed)
    bounds = _index_bound(model)
    for i, info in enumerate(model.inputs):
        if info.dtype != "i1" and not dtypes.is_float(info.dtype):
            arrays[i] = rng.integers(0, bounds.get(i, MASK_HIGH), arrays[i].shape).astype(arrays[i].dtype)
    return arrays


def worst_element(actual, expected) -> tuple[tuple[int, ...], float, float]:
    """(index, actual, expected) of the element farthest from its reference (NaN where a number was: worst)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.shape != e.shape or a.size == 0:
        return (), float("nan"), float("nan")
    err = np.abs(a - e)
    err = np.where(np.isnan(a) != np.isnan(e), np.inf, np.where(np.isnan(err), 0.0, err))
    i = np.unravel_index(int(np.argmax(err)), a.shape)
    return tuple(int(k) for k in i), float(a[i]), float(e[i])


class Checker:
    """Holds the reference outputs and checks a module against them; see the module doc."""

    def __init__(self, model, *, seed: int = 0, sizes: Mapping[str, int] | None = None,
                 out_dir: Path | str = ".", stem: str = "model"):
        from tilegraph.accuracy import narrowest_float, reduction_length
        from tilegraph.ir.interpreter import bind_inputs
        from tilegraph.ir import interpret

        self.inputs = valid_inputs(model, seed, sizes)
        _, self.sizes = bind_inputs(model, self.inputs)
        self.names = list(model.output_names)
        self.out_infos = list(model.outputs)
        self.n = reduction_length(model, self.sizes)
        self.coarsest = narrowest_float(model)
        self.expected = interpret(model, self.inputs)
        self.before_text = model.text
        self.out_dir, self.stem = Path(out_dir), stem
        self.seconds = 0.0
        self.checks = 0

    def _diverges(self, model) -> str | None:
        from tilegraph.ir import interpret
        from tilegraph.accuracy import assert_close

        t = time.perf_counter()
        try:
            got = interpret(model, self.inputs)
        except Exception as e:  # a pass that leaves IR the interpreter cannot run is a divergence too
            return f"the result cannot run: {type(e).__name__}: {e}"
        finally:
            self.seconds += time.perf_counter() - t
            self.checks += 1
        for name, info, a, e in zip(self.names, self.out_infos, got, self.expected):  # type: ignore[misc]
            dtype = self.coarsest if dtypes.is_float(info.dtype) and self.coarsest else info.dtype
            try:
                assert_close(a, e, dtype, self.n, name=f"output '{name}'")
            except AssertionError:
                idx, av, ev = worst_element(a, e)
                return (f"output '{name}' differs from the reference: worst element {list(idx)} is {av!r}, "
                        f"expected {ev!r} (tolerance: {dtype}, reductions over {self.n})")
        return None

    def check(self, model, what: str) -> None:
        """Raise SemanticDivergence naming `what` if `model` no longer computes the reference."""
        problem = self._diverges(model)
        if problem is None:
            self.before_text = model.text
            return
        self._fail(what, problem, model.text)

    def rebase(self, model) -> None:
        """After a lossy pass checked against its bound: its reference is the new baseline."""
        from tilegraph.ir import interpret

        self.expected = interpret(model, self.inputs)
        self.before_text = model.text

    def _fail(self, what: str, problem: str, after_text: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tag = "".join(c if c.isalnum() or c in "-_" else "_" for c in what)[:60]
        before = self.out_dir / f"{self.stem}.before-{tag}.mlir"
        after = self.out_dir / f"{self.stem}.after-{tag}.mlir"
        before.write_text(self.before_text)
        after.write_text(after_text)
        sizes = ", ".join(f"{k}={v}" for k, v in sorted(self.sizes.items()))
        raise SemanticDivergence(f"{what} changed what the model computes: {problem}\n"
                                 f"inputs: seeded random{' at ' + sizes if sizes else ''}; IR before: {before}; "
                                 f"IR after: {after}")


class PipelineCheck:
    """A pipeline checked as it runs: `before(p, model)` ahead of each pass, `after(p, model)` once it
    ran, on the module the pipeline itself rewrites (tilegraph-opt calls them from its pass callback,
    so the passes run once). `close()` stops observing rewrites, also when a pass raised."""

    def __init__(self, model, *, each_rewrite: bool = False, log=None, **checker_args):
        self.checker = Checker(model, **checker_args)
        self.each_rewrite, self.log = each_rewrite, log
        self._observer = None

    def before(self, p, model) -> None:
        from tilegraph.ir.model import Model, context, weights_of
        from tilegraph.passes import rewrite
        from tilegraph.accuracy import rounding_violations

        checker = self.checker
        if getattr(p, "LOSSY", False):
            ref = model.clone()
            p.reference().apply(context(), ref.module)
            ref = Model(ref.module, weights_of(ref.module))
            bad = rounding_violations(ref, checker.inputs)
            if bad:
                checker._fail(f"pass '{p.name}' (its fake-quantized reference)",
                              "a rounding breaks its bound: " + "; ".join(bad[:3]), ref.text)
            checker.rebase(ref)  # the pass must now compute what its reference computes
        if self.each_rewrite:
            def observer(rule, op_name, module=model.module):
                checker.check(Model(module, weights_of(module)), f"pass '{p.name}', rule '{rule.doc}' on tg.{op_name}")
            self._observer = observer  # type: ignore[assignment]
            rewrite.OBSERVERS.append(observer)

    def after(self, p, model) -> None:
        self.close()
        self.checker.check(model, f"pass '{p.name}'")
        if self.log:
            self.log(f"// check-semantics: after {p.name}: outputs agree")

    def close(self) -> None:
        from tilegraph.passes import rewrite

        if self._observer is not None:
            rewrite.OBSERVERS.remove(self._observer)
            self._observer = None


def check_pipeline(model, passes, *, seed: int = 0, sizes: Mapping[str, int] | None = None,
                   out_dir: Path | str = ".", stem: str = "model", each_rewrite: bool = False,
                   log=None) -> Checker:
    """Run `passes` on a copy of `model`, checking after each pass (and each rewrite); returns the
    Checker (its `seconds` are the interpreter's). Raises SemanticDivergence on the first divergence."""
    from tilegraph.ir.model import Model, context, weights_of
    from tilegraph.passes.registry import parse_pipeline

    passes = parse_pipeline(passes) if isinstance(passes, str) else list(passes)
    check = PipelineCheck(model, each_rewrite=each_rewrite, log=log, seed=seed, sizes=sizes, out_dir=out_dir,
                          stem=stem)
    current = model.clone()
    ctx = context()
    try:
        for p in passes:
            check.before(p, current)
            p.apply(ctx, current.module)
            current = Model(current.module, weights_of(current.module))
            check.after(p, current)
    finally:
        check.close()
    return check.checker
