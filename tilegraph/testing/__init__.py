"""Testing tilegraph and passes written for it: tolerances, strategies, semantic checks.

Tolerances are set here, once, by dtype and reduction length; tests never pick
their own. A float result computed in dtype `d` with reductions over `n` terms is
compared to the float64 interpreter with

    rtol = ROUNDING_BUDGET * eps(d) * sqrt(n),   atol = rtol * max(1, max|expected|)

sqrt(n) is the expected growth of rounding error in a sum of n terms (random-walk
accumulation, Higham, "Accuracy and Stability of Numerical Algorithms", ch. 4);
the absolute part scales with the output so values that cancel to near zero are
judged against the size of what cancelled.

Testing your own pass (property-based, with hypothesis):

    from dataclasses import dataclass
    from hypothesis import given, settings
    from xdsl.passes import ModulePass
    from tilegraph.testing import graphs, assert_preserves_semantics

    @dataclass(frozen=True)
    class MyPass(ModulePass):
        name = "my-pass"
        def apply(self, ctx, module): ...          # rewrite the tg IR in place

    @settings(max_examples=50, deadline=None)
    @given(graphs(ops=("add", "mul", "exp", "reshape", "matmul")))
    def test_my_pass_preserves_semantics(model):
        assert_preserves_semantics([MyPass()], model)   # or "canonicalize,my-pass"

`graphs()` draws random valid models (elementwise ops with broadcasting,
reductions, matmuls, layout ops, gather/pad, conv and pooling on NCHW values,
softmax/layer_norm/gelu/attention, comparisons as where conditions, weights,
constants, a symbolic batch dim), values kept where float32 and float64 differ by
rounding only; `random_inputs(model)` feeds one; `assert_preserves_semantics`
runs the pipeline on a copy and compares against the float64 interpreter, with
the tolerance above and `reduction_length(model)`, and on failure shows the
pipeline and the IR before and after. Register the pass in
`passes/registry.py` and tests/test_properties.py checks it on every run.

The package, by job: `tolerances` (the rule above, `assert_close`), `examples` (one or more
small graphs per op of the table), `generator` (`graphs()`), `checks` (`random_inputs`,
`reduction_length`, `assert_preserves_semantics`, the quantization bound).
"""

from tilegraph.testing.checks import (QUANT_F32_SLACK, assert_preserves_semantics, assert_within_quantization_bound,
                                      narrowest_float, random_inputs, reduction_length, rounding_violations)
from tilegraph.testing.examples import OpExample, op_examples
from tilegraph.testing.generator import (ALL_OPS, BINARY_OPS, COMPARE_OPS, COMPOSITE_OPS, EXP_LIMIT, INDEX_OPS,
                                         LAYER_NORM_EPSILONS, LAYOUT_OPS, MAX_DIM, MAX_ELEMENTS, MAX_KERNEL, MAX_RANK,
                                         MAX_SPATIAL, MAX_SYMBOL_SIZE, MIN_POSITIVE, OP_FAMILIES, OTHER_OPS,
                                         REDUCE_OPS, SPATIAL_OPS, SYMBOLS, UNARY_OPS, VALUE_LIMIT, graphs)
from tilegraph.accuracy import EPS, PEER_RELATIVE_ERROR, ROUNDING_BUDGET, assert_close, relative_error, tolerance

__all__ = ["ALL_OPS", "BINARY_OPS", "COMPARE_OPS", "COMPOSITE_OPS", "EPS", "EXP_LIMIT", "INDEX_OPS",
           "LAYER_NORM_EPSILONS", "LAYOUT_OPS", "MAX_DIM", "MAX_ELEMENTS", "MAX_KERNEL", "MAX_RANK", "MAX_SPATIAL",
           "MAX_SYMBOL_SIZE", "MIN_POSITIVE", "OP_FAMILIES", "OTHER_OPS", "OpExample", "PEER_RELATIVE_ERROR",
           "QUANT_F32_SLACK", "REDUCE_OPS", "ROUNDING_BUDGET", "SPATIAL_OPS", "SYMBOLS", "UNARY_OPS", "VALUE_LIMIT",
           "assert_close", "assert_preserves_semantics", "assert_within_quantization_bound", "graphs",
           "narrowest_float", "op_examples", "random_inputs", "reduction_length", "relative_error",
           "rounding_violations", "run_on_c_path", "tolerance", "traced_peak"]


def traced_peak(run) -> int:
    """The most bytes Python and NumPy (which reports its arrays to tracemalloc) hold at once
    while `run()` runs, beyond what was held when it started: a kernel's or a module call's
    peak, for memory tests and benchmarks."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        run()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def run_on_c_path(compiled, inputs, path: str, mode: int = -1):
    """One call of a model compiled for the C backend with its native path `path` set by
    tg_set_<path>(mode) (-1: the emitter's choice, 0: never, 1: wherever it can), restored
    after; (its outputs, how many times that path ran: tg_<path>_count), for tests that a
    fast path is taken."""
    lib = compiled._runner._lib
    getattr(lib, f"tg_set_{path}")(mode)
    try:
        before = getattr(lib, f"tg_{path}_count")()
        outs = compiled.run(*inputs)
        return outs, getattr(lib, f"tg_{path}_count")() - before
    finally:
        getattr(lib, f"tg_set_{path}")(-1)
