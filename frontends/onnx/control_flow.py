"""Converters: If, Loop and Scan, unrolled."""

from __future__ import annotations

import numpy as np

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import _axis, _conv
from tilegraph.frontends.onnx.values import Value, info


# --- control flow, unrolled ---

# Iterations a Loop or Scan is unrolled to at most: past it the graph would be mostly copies
# of one body, better served by a run-time loop tg does not have yet.
MAX_UNROLL = 1024


def _stack(n, values: list, axis: int = 0) -> Value:
    """values (same shape) stacked along a new `axis`."""
    parts = [n.unsqueeze(v, [axis]) for v in values]
    return parts[0] if len(parts) == 1 else n.op("concat", *parts, axis=axis)


@_conv("If")
def _if(n):
    """A condition known at import picks its branch; a run-time one runs both branches and
    selects with where, when they give values of one type (their ops have no side effects)."""
    cond = n.x(0)
    then, other = n.attr("then_branch").g, n.attr("else_branch").g
    if isinstance(cond, np.ndarray):
        return n.imp.run_subgraph(then if bool(cond.reshape(-1)[0]) else other, [], n.where())
    a, b = n.imp.run_subgraph(then, [], n.where()), n.imp.run_subgraph(other, [], n.where())
    if [info(v) for v in a] != [info(v) for v in b]:
        raise FrontendError(f"its condition is computed at run time and its branches give different types "
                            f"({[str(info(v)) for v in a]} and {[str(info(v)) for v in b]})")
    c = n.reshape(cond, ())
    return [n.op("where", c, x, y) for x, y in zip(a, b)]


@_conv("Loop")
def _loop(n):
    """Unrolled: the trip count and the condition must be known at import at every iteration."""
    body = n.attr("body").g
    trips = n.static(0)
    trips = None if trips is None else int(trips.reshape(-1)[0])
    cond = n.static(1)
    cond = True if cond is None else bool(cond.reshape(-1)[0])
    carried = list(n.inputs[2:])
    scans: list[list] = []
    i = 0
    while cond and (trips is None or i < trips):
        if i >= MAX_UNROLL:
            raise FrontendError(f"it runs more than {MAX_UNROLL} iterations; it is unrolled at import")
        outs = n.imp.run_subgraph(body, [np.array(i, np.int64), np.array(cond), *carried], n.where())
        c = outs[0]
        if not isinstance(c, np.ndarray):
            raise FrontendError("its condition is computed at run time; it is unrolled at import")
        cond = bool(c.reshape(-1)[0])
        carried = outs[1:1 + len(carried)]
        for k, v in enumerate(outs[1 + len(carried):]):
            if k >= len(scans):
                scans.append([])
            scans[k].append(v)
        i += 1
    n_scans = len(body.output) - 1 - len(carried)
    if n_scans and not scans:
        raise FrontendError("it runs no iteration, so its scan outputs have no known shape")
    return [*carried, *(_stack(n, vs) for vs in scans)]


@_conv("Scan")
def _scan(n):
    """Unrolled over the static length of its scan inputs (opset 9+ form)."""
    body = n.attr("body").g
    m = n.attr("num_scan_inputs")
    states, xs = list(n.inputs[:len(n.inputs) - m]), n.inputs[len(n.inputs) - m:]
    in_axes = [_axis(a, n.rank(x)) for a, x in zip(n.attr("scan_input_axes", [0] * m), xs)]
    in_dirs = n.attr("scan_input_directions", [0] * m)
    lengths = {n.shape(x)[a] for x, a in zip(xs, in_axes)}
    if len(lengths) != 1 or not isinstance(next(iter(lengths)), int):
        raise FrontendError(f"its scan inputs must have one static length, got {sorted(map(str, lengths))}")
    steps = lengths.pop()
    if steps > MAX_UNROLL:
        raise FrontendError(f"it runs {steps} iterations, more than {MAX_UNROLL}; it is unrolled at import")
    k = len(body.output) - len(states)
    out_axes = n.attr("scan_output_axes", [0] * k)
    out_dirs = n.attr("scan_output_directions", [0] * k)
    scans: list[list] = [[] for _ in range(k)]
    for t in range(steps):
        slices = []
        for x, a, d in zip(xs, in_axes, in_dirs):
            j = steps - 1 - t if d else t
            slices.append(n.reshape(n.slice(x, a, j, j + 1), [s for i, s in enumerate(n.shape(x)) if i != a]))
        outs = n.imp.run_subgraph(body, [*states, *slices], n.where())
        states = outs[:len(states)]
        for j, v in enumerate(outs[len(states):]):
            scans[j].append(v)
    if k and not steps:
        raise FrontendError("it runs no iteration, so its scan outputs have no known shape")
    stacked = []
    for vs, a, d in zip(scans, out_axes, out_dirs):
        vs = vs[::-1] if d else vs
        stacked.append(_stack(n, vs, _axis(a, n.rank(vs[0]) + 1)))
    return [*states, *stacked]
