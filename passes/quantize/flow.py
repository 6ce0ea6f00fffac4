"""The library entry point of `tilegraph quantize`: observe activation ranges (where the scheme quantizes
activations), collect GPTQ's Hessians (rounding=gptq), choose per-layer formats (an error
budget), and run the pass. The command reads files, prints and writes; this decides."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from tilegraph.ir.model import Model
from tilegraph.passes.quantize.files import save_ranges, save_hessians
from tilegraph.passes.quantize.mixed import MixedPlan, mixed_precision
from tilegraph.passes.quantize.observers import observe_ranges
from tilegraph.passes.quantize.schemes import DEFAULT_PERCENTILE, SCHEMES, QuantizeError, linear_layers


@dataclass
class Quantized:
    """What `quantize_model` made: the model, the activation ranges it calibrated (None when
    activations are quantized from the data at run time), and the mixed-precision plan (None
    without an error budget)."""

    model: Model
    ranges: dict | None
    plan: MixedPlan | None
    layers: int


def quantize_model(model: Model, scheme: str = "w8a8", *, batches: Sequence[Sequence[np.ndarray]] | None = None,
                   observer: str = "minmax", percentile: float | None = None, weight_observer: str = "minmax",
                   symmetric: bool = False, rounding: str = "nearest", act_order: bool = False,
                   max_error: float | None = None, min_cosine: float | None = None, fallback: str | None = None,
                   hardware: str = "cpu",
                   progress: Callable[[Iterable, str], Iterable] = lambda it, what: it) -> Quantized:
    """Quantize the linear layers of `model` (run the unfused pipeline on it first) by `scheme`.

    batches: calibration inputs (each one array per model input); needed for rounding="gptq"
    and for an error budget (max_error, min_cosine: the layers are then quantized by `scheme`,
    or `fallback`, or left float, as `mixed_precision` chooses for `hardware`); used for activation
    ranges where the scheme quantizes activations. progress(iterable, what) wraps each long loop.
    """
    from tilegraph.passes.registry import run_pipeline

    mixed = max_error is not None or min_cosine is not None
    if batches is None and (mixed or rounding == "gptq"):
        raise QuantizeError("an error budget and rounding=gptq need calibration batches")
    layers = len(linear_layers(model.func.body.block.ops, model.weights))
    if not layers:
        raise QuantizeError("the model has no matmul by a 2-D float weight: nothing to quantize")
    ranges = plan = None
    if batches is not None and SCHEMES[scheme].activation:
        ranges = observe_ranges(model, batches, observer, percentile=percentile or DEFAULT_PERCENTILE,
                           symmetric=symmetric, progress=lambda it: progress(it, "calibrating"))
    spec = f"scheme={scheme} observer={weight_observer} symmetric={str(symmetric).lower()}"
    with tempfile.TemporaryDirectory() as tmp:  # the pass reads ranges and Hessians from files
        options = {"observer": weight_observer, "symmetric": str(symmetric).lower()}
        if ranges is not None:
            options["calib"] = f'"{save_ranges(Path(tmp) / "calib.npz", ranges)}"'
        if rounding == "gptq":
            from tilegraph.passes.gptq import hessians

            found = hessians(model, batches, progress=lambda it: progress(it, "gptq inputs"))
            options.update(rounding="gptq", hessians=f'"{save_hessians(Path(tmp) / "hessians.npz", found)}"',
                           act_order=str(act_order).lower())
            spec += f" rounding=gptq hessians={options['hessians']} act-order={options['act_order']}"
        spec += f" calib={options['calib']}" if "calib" in options else ""
        pipeline = f"quantize{{{spec}}}"
        if mixed:
            schemes = [scheme] + ([fallback] if fallback not in (None, "none", scheme) else [])
            plan = mixed_precision(model, batches, schemes, max_error, min_cosine, hardware,
                                   progress=lambda it: progress(it, "sensitivity"), **options)
            pipeline = plan.pipeline
        return Quantized(run_pipeline(model, pipeline), ranges, plan, layers)
