"""tilegraph's passes: one module per pass, named as on the command line.

    canonicalize     passes/canonicalize.py     algebraic simplification, rules as data
    cse              passes/cse.py              common subexpression elimination
    dce              passes/dce.py              dead code (and dead weights) elimination
    constant-fold    passes/constant_fold.py    ops on known arrays computed at compile time
    simplify-shapes  passes/simplify_shapes.py  fewer layout ops, simpler symbolic dims
    decompose        passes/decompose.py        softmax/layer_norm/gelu/attention -> primitives
    attention        passes/attention.py        matmul-softmax-matmul chains -> tg.attention
    fuse             passes/fuse.py             ops -> tg.fusion groups, by predicted time saved
    tile             passes/tile.py             tile sizes per group, against the cost model

`passes.registry` holds the registry (`PASSES`), the pipeline syntax and
`run_pipeline`; `passes.rewrite` the small rule vocabulary the rewrites share.
"""

from tilegraph.passes.registry import DEFAULT_PIPELINE, PASSES, get_pass_class, parse_pipeline, run_pipeline

__all__ = ["DEFAULT_PIPELINE", "PASSES", "get_pass_class", "parse_pipeline", "run_pipeline"]
