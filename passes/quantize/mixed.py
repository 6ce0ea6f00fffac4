"""Mixed precision: per layer the scheme (or float) the cost model predicts fastest on a target,
within an error budget measured on the calibration inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from tilegraph.ir.model import Model
from tilegraph.ir.shapes import info_of
from tilegraph.passes.quantize.schemes import FORMATS_SEPARATOR, SCHEMES, QuantizeError, layer_name, linear_layers


# --- mixed precision: which layers stay in higher precision --------------------------------------


def relative_error(model: Model, quantized: Model, batches: Sequence[Sequence[np.ndarray]]) -> float:
    """||y_q - y|| / ||y|| over every output and calibration batch (the interpreter, float32)."""
    return output_agreement(_outputs(model, batches), _outputs(quantized, batches))[0]


def _outputs(model: Model, batches) -> list[list[np.ndarray]]:
    from tilegraph.ir.interpreter import interpret

    return [[np.asarray(y, np.float64) for y in interpret(model, list(b), float64=False)] for b in batches]


def output_agreement(reference: list, got: list) -> tuple[float, float]:
    """(relative error ||y_q - y|| / ||y||, mean cosine similarity of the outputs' last-axis vectors) over
    every output and batch."""
    num = den = 0.0
    cosines = []
    for ys, qs in zip(reference, got):
        for y, yq in zip(ys, qs):
            num += float(np.sum((yq - y) ** 2))
            den += float(np.sum(y ** 2))
            a, b = y.reshape(-1, y.shape[-1] if y.ndim else 1), yq.reshape(-1, y.shape[-1] if y.ndim else 1)
            norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
            cosines.append(np.where(norms > 0, np.sum(a * b, axis=1) / np.where(norms > 0, norms, 1), 1.0))
    err = float(np.sqrt(num / den)) if den else float(np.sqrt(num))
    return err, float(np.mean(np.concatenate(cosines))) if cosines else 1.0


def layer_time(m: int, k: int, n: int, scheme: str, hw) -> float:
    """Predicted seconds of one linear layer [m, k] @ [k, n] on `hw` (passes/cost), in float (scheme
    'none') or quantized by `scheme`: the quantize pass's rewrite of that layer alone, costed op by op."""
    from tilegraph.ir import Graph
    from tilegraph.passes.cost.model import at, module_cost
    from tilegraph.passes.registry import run_pipeline

    g = Graph()
    x = g.input("x", (m, k))
    layer = g.build(x @ g.weight("w", np.zeros((k, n), np.float32)), names=["y"])
    if scheme != "none":
        layer = run_pipeline(layer, f"quantize{{scheme={scheme}}}")
    return at(module_cost(layer.func, hw).time)


@dataclass
class MixedPlan:
    """What `mixed_precision` chose."""

    pipeline: str  # quantize{... formats="layer=scheme,..."}
    formats: dict  # layer -> scheme, or "none" (float)
    remarks: list
    error: float  # measured on the calibration batches, everything together
    cosine: float
    predicted_f32: float  # s, the float model's linear layers on the target
    predicted: float  # s, the same layers as chosen
    shapes: dict  # layer -> (m, k, n) the predictions are for


def mixed_precision(model: Model, batches: Sequence[Sequence[np.ndarray]], schemes: Sequence[str],
                    max_error: float | None = None, min_cosine: float | None = None, hardware: str = "cpu",
                    sizes: dict | None = None, progress: Callable[[Iterable], Iterable] = iter,
                    memo: dict | None = None, **options) -> MixedPlan:
    """Choose each linear layer's format among `schemes` and float ("none") to minimize the predicted time
    of the model's linear layers on `hardware` (passes/cost: `layer_time` at `sizes`, by default the first
    calibration batch's), keeping the measured relative output error within `max_error` and the mean
    cosine similarity of the outputs at least `min_cosine` (on the calibration batches).

    1. Predicted saving of each (layer, scheme): float time minus quantized time. A scheme that saves
       nothing on the target is never chosen (on the NumPy CPU backend that may be every scheme).
    2. Sensitivity of each (layer, scheme) that saves time: the error with only that layer quantized.
    3. Moves, one per (layer, scheme), each layer's in order of its saving: taken greedily by
       marginal saving per marginal sensitivity (squared errors of independent roundings add); the
       longest prefix whose measured error (all its layers quantized together) is within the budget
       wins, by bisection (the error grows with the prefix in practice; each step is measured).
    A remark per layer (passes.remarks, and in the returned plan) says why it got its format.
    `memo`: measurements kept between calls on the same model and batches (another budget).
    """
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.ir.hardware import hardware as hardware_named
    from tilegraph.passes.cost.model import at
    from tilegraph.passes.registry import run_pipeline
    from tilegraph.passes.remarks import remark

    for sch in schemes:
        if sch not in SCHEMES:
            raise QuantizeError(f"unknown scheme '{sch}'; the schemes are: {', '.join(SCHEMES)}")
    if max_error is None and min_cosine is None:
        raise QuantizeError("mixed precision needs an accuracy budget: a maximum error or a minimum cosine")
    hw = hardware_named(hardware)
    options.setdefault("embeddings", "false")  # the search is over linear layers; tables stay as they are
    found = linear_layers(model.func.body.block.ops, model.weights)
    layers = [layer_name(w, i) for i, (_, w) in enumerate(found)]
    if sizes is None:
        sizes = bind_inputs(model, list(batches[0]))[1]
    shapes = {}
    for name, (mm, w) in zip(layers, found):
        a = info_of(mm.operands[0].type).shape
        m = int(np.prod([at(d, sizes) for d in a[:-1]]))
        shapes[name] = (m, *info_of(w.results[0].type).shape)
    times: dict = {}

    def predicted(name: str, sch: str) -> float:
        key = (shapes[name], sch)
        if key not in times:
            times[key] = layer_time(*shapes[name], sch, hw)  # type: ignore[call-arg]
        return times[key]

    saving = {(n, sch): predicted(n, "none") - predicted(n, sch) for n in layers for sch in schemes}
    extra = "".join(f" {k.replace('_', '-')}={v}" for k, v in options.items())

    def spec(formats: dict) -> str:
        given = FORMATS_SEPARATOR.join(f"{n}={formats.get(n, 'none')}" for n in layers)
        return f'quantize{{scheme={schemes[0]}{extra} formats="{given}"}}'

    memo = {} if memo is None else memo
    if "reference" not in memo:
        memo["reference"] = _outputs(model, batches)

    def measure(formats: dict) -> tuple[float, float]:
        key = spec(formats)
        if key not in memo:
            memo[key] = output_agreement(memo["reference"], _outputs(run_pipeline(model, key), batches))
        return memo[key]

    def within(err_cos: tuple[float, float]) -> bool:
        return (max_error is None or err_cos[0] <= max_error) and (min_cosine is None or err_cos[1] >= min_cosine)

    useful = [(n, sch) for n in layers for sch in schemes if saving[n, sch] > 0]
    sens = {key: measure({key[0]: key[1]}) for key in progress(useful)}
    moves = []
    for n in layers:
        prev_gain, prev_err = 0.0, 0.0
        for sch in sorted((s for m, s in useful if m == n), key=lambda s: saving[n, s]):
            gain, err = saving[n, sch] - prev_gain, sens[n, sch][0] ** 2 - prev_err
            moves.append((gain / max(err, 1e-30), n, sch))
            prev_gain, prev_err = saving[n, sch], max(prev_err, sens[n, sch][0] ** 2)
    moves.sort(key=lambda mv: -mv[0])

    def assignment(count: int) -> dict:
        chosen: dict = {}
        for _, n, sch in moves[:count]:
            if saving[n, sch] > saving.get((n, chosen.get(n)), 0.0):
                chosen[n] = sch
        return chosen

    lo, hi = 0, len(moves)
    result = measure(assignment(hi)) if moves else measure({})
    if moves and not within(result):
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if within(measure(assignment(mid))):
                lo = mid
            else:
                hi = mid
        result = measure(assignment(lo))
    else:
        lo = hi
    chosen = assignment(lo)
    budget = " and ".join(x for x in (f"relative error <= {max_error:g}" if max_error is not None else "",
                                      f"cosine >= {min_cosine:g}" if min_cosine is not None else "") if x)
    remarks = []
    for n in layers:
        got = chosen.get(n, "none")
        gains = ", ".join(f"{sch} {saving[n, sch] * 1e6:+.1f} us" for sch in schemes)
        alone = ", ".join(f"{sch} error {sens[n, sch][0]:.4f}" for sch in schemes if (n, sch) in sens)
        if got != "none":
            why = f"the most predicted saving kept within {budget}"
        elif not any(saving[n, sch] > 0 for sch in schemes):
            why = f"no scheme is predicted faster than float on {hw.name}"
        else:
            why = f"quantizing it too would break {budget}"
        msg = (f"{n} [{shapes[n][0]}x{shapes[n][1]}x{shapes[n][2]}]: {got} ({why}; predicted saving on "
               f"{hw.name}: {gains}" + (f"; alone: {alone}" if alone else "") + ")")
        remark("quantize", msg)
        remarks.append(msg)
    f32 = sum(predicted(n, "none") for n in layers)
    now = f32 - sum(saving[n, sch] for n, sch in chosen.items())
    summary = (f"all together: relative error {result[0]:.4f}, cosine {result[1]:.5f} ({budget}); "
               f"{len(chosen)} of {len(layers)} layers quantized; linear layers predicted on {hw.name}: "
               f"{f32 * 1e3:.3f} ms in float -> {now * 1e3:.3f} ms ({f32 / now:.2f}x)")
    remark("quantize", summary)
    remarks.append(summary)
    return MixedPlan(spec(chosen), {n: chosen.get(n, "none") for n in layers}, remarks, result[0], result[1],
                     f32, now, shapes)
