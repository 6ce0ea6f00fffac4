"""Observers: the scales of weights, and the ranges of activations over calibration inputs."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from tilegraph.ir.model import Model
from tilegraph.ir.quant import FORMATS, Format, absmax_scale, dequantize, mx_scale, quantize
from tilegraph.passes.quantize.schemes import (DEFAULT_PERCENTILE, GRANULARITIES, MSE_RATIOS, OBSERVERS,
                                               OBSERVER_SAMPLE, QuantizeError, layer_name, linear_layers)


# --- observers: weights ---------------------------------------------------------------------


def _blocks(w: np.ndarray, size: int) -> np.ndarray:
    """|w| [K, N] as [ceil(K/size), size, N], zero-padded."""
    k, n = w.shape
    b = -(-k // size)
    padded = np.zeros((b * size, n), np.float32)
    padded[:k] = np.abs(w)
    return padded.reshape(b, size, n)


def _round_trip(w: np.ndarray, scale: np.ndarray, fmt: Format, granularity: str, size: int) -> np.ndarray:
    axis, block = (0, size) if granularity == "group" else (1, 0)
    return dequantize(quantize(w, scale, None, axis, block, fmt.name, fmt.numpy), scale, None, axis, block,
                      np.float32)


def _group_sq_error(w, scale, fmt, granularity, size) -> np.ndarray:
    """Squared error per scale entry."""
    err = (_round_trip(w, scale, fmt, granularity, size).astype(np.float64) - w) ** 2
    if granularity == "group":
        k, n = err.shape
        padded = np.zeros((-(-k // size) * size, n))
        padded[:k] = err
        return padded.reshape(-1, size, n).sum(axis=1)
    if granularity == "channel":
        return err.sum(axis=0)
    return np.asarray(err.sum())


def _amax(w: np.ndarray, granularity: str, size: int) -> np.ndarray:
    if granularity == "tensor":
        return np.asarray(np.abs(w).max(initial=0.0), np.float32)
    if granularity == "channel":
        return np.abs(w).max(axis=0, initial=0.0).astype(np.float32)
    return _blocks(w, size).max(axis=1)


def weight_scale(w: np.ndarray, fmt: Format, granularity: str, size: int, mx: bool, observer: str) -> np.ndarray:
    """The scale of a weight [K, N]: () per tensor, (N,) per channel, (ceil(K/size), N) per group."""
    w = np.asarray(w, np.float32)
    amax = _amax(w, granularity, size)
    make = (lambda a: mx_scale(a, fmt)) if mx else (lambda a: absmax_scale(a, fmt))
    best = make(amax)
    if observer == "minmax":
        return best
    if observer != "mse":
        raise QuantizeError(f"weights take the 'minmax' or 'mse' observer, not '{observer}'")
    best_err = _group_sq_error(w, best, fmt, granularity, size)
    # The scale chosen at the next coarser granularity is a candidate too (found by hypothesis:
    # per tensor's best clipping beat each channel's own grid): a finer one is never worse.
    coarser = []
    if granularity != "tensor":
        up = weight_scale(w, fmt, GRANULARITIES[GRANULARITIES.index(granularity) - 1], size, mx, observer)
        coarser = [np.broadcast_to(up, amax.shape).astype(best.dtype)]
    ratios = [make(amax * np.float32(r)) for r in MSE_RATIOS[1:]] if not mx else \
        [make(amax / 2)]  # MX scales are powers of two: the one below clips (the OCP rule)
    for cand in coarser + ratios:
        err = _group_sq_error(w, cand, fmt, granularity, size)
        better = err < best_err
        best = np.where(better, cand, best).astype(best.dtype)
        best_err = np.where(better, err, best_err)
    return best


# --- observers: activations (calibration) --------------------------------------------------------


class Observer:
    """Collects one activation's values over calibration batches; `range()` is the (lo, hi) to quantize."""

    def __init__(self, kind: str, percentile: float = DEFAULT_PERCENTILE, symmetric: bool = False,
                 storage: str = "i8", seed: int = 0):
        if kind not in OBSERVERS:
            raise QuantizeError(f"unknown observer '{kind}'; the observers are: {', '.join(OBSERVERS)}")
        if not 50 < percentile <= 100:
            raise QuantizeError(f"percentile {percentile} must be in (50, 100]")
        self.kind, self.percentile, self.symmetric, self.storage = kind, percentile, symmetric, storage
        self.lo, self.hi = np.inf, -np.inf
        self.sample: list[np.ndarray] = []
        self.seen = 0
        self.rng = np.random.default_rng(seed)

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float32).reshape(-1)
        x = x[np.isfinite(x)]
        if not x.size:
            return
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))
        if self.kind != "minmax":
            self.seen += x.size
            self.sample.append(x)
            kept = sum(s.size for s in self.sample)
            if kept > OBSERVER_SAMPLE:  # keep a uniform sample of everything seen
                allx = np.concatenate(self.sample)
                self.sample = [self.rng.choice(allx, OBSERVER_SAMPLE, replace=False)]

    def range(self) -> tuple[float, float]:
        if self.lo > self.hi:
            return (0.0, 0.0)
        lo, hi = min(self.lo, 0.0), max(self.hi, 0.0)
        if self.kind == "percentile":
            x = np.concatenate(self.sample)
            lo = min(float(np.percentile(x, 100 - self.percentile)), 0.0)
            hi = max(float(np.percentile(x, self.percentile)), 0.0)
        elif self.kind == "mse":
            x = np.concatenate(self.sample).astype(np.float64)
            best, best_err = (lo, hi), np.inf
            for r in MSE_RATIOS:
                cand = (lo * r, hi * r)
                scale, zp, storage = activation_params(cand, self.storage, self.symmetric)
                f = FORMATS[storage]
                q = quantize(x, scale, zp, 1, 0, storage, f.numpy)
                err = float(np.sum((dequantize(q, scale, zp, 1, 0, np.float64) - x) ** 2))
                if err < best_err:
                    best, best_err = cand, err
            lo, hi = best
        return (lo, hi)


def activation_params(rng: tuple[float, float], storage: str, symmetric: bool):
    """(scale, zero point or None, storage type) for an activation range (lo, hi). An asymmetric
    int8 range is stored as ui8 with a zero point (as onnxruntime's static quantization does)."""
    lo, hi = min(rng[0], 0.0), max(rng[1], 0.0)
    fmt = FORMATS[storage]
    if not fmt.integer or symmetric:
        return absmax_scale(np.float32(max(-lo, hi)), fmt), None, storage
    u8 = FORMATS["ui8"]
    steps = u8.hi - u8.lo
    for room in (steps, steps - 1):  # both ends half a step off the grid round outwards: one step of room
        scale = absmax_scale(np.float32((hi - lo) / room * u8.hi), u8)
        zp = np.asarray(np.clip(np.rint(u8.lo - lo / scale), u8.lo, u8.hi)).astype(np.uint8)
        ends = np.rint(np.array([lo, hi], np.float64) / float(scale)) + int(zp)
        if ends[0] >= u8.lo and ends[1] <= u8.hi:
            break
    return scale, zp, "ui8"


def observe_ranges(model: Model, batches: Iterable[Sequence[np.ndarray]], observer: str = "minmax", *,
              percentile: float = DEFAULT_PERCENTILE, symmetric: bool = False, storage: str = "i8",
              progress: Callable[[Iterable], Iterable] = iter) -> dict[str, tuple[float, float]]:
    """Run `model` (the interpreter, float32) on calibration batches and observe the activation of every
    linear layer the pass would quantize; returns {weight name: (lo, hi)}."""
    from tilegraph.ir.interpreter import interpret

    layers = linear_layers(model.func.body.block.ops, model.weights)
    if not layers:
        raise QuantizeError("the model has no matmul by a 2-D float weight to observe")
    names = [layer_name(w, i) for i, (_, w) in enumerate(layers)]
    observers = {n: Observer(observer, percentile, symmetric, storage) for n in names}
    count = 0
    for batch in progress(batches):
        values: dict = {}
        interpret(model, list(batch), float64=False, values=values)
        for n, (mm, _) in zip(names, layers):
            observers[n].update(values[mm.operands[0]])
        count += 1
    if not count:
        raise QuantizeError("no calibration batches")
    return {name: o.range() for name, o in observers.items()}
