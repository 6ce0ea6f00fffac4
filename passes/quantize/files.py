"""Calibration ranges and GPTQ Hessians on disk (.npz), as the pass reads them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tilegraph.passes.quantize.schemes import QuantizeError


def save_ranges(path: str | Path, ranges: dict[str, tuple[float, float]]) -> Path:
    np.savez(path, **{k: np.array(v, np.float64) for k, v in ranges.items()})
    return Path(path)


def save_hessians(path: str | Path, hessians: dict[str, np.ndarray]) -> Path:
    """Each layer's X^T X (passes.gptq.hessians) for rounding=gptq, in float32."""
    np.savez(path, **{k: np.asarray(v, np.float32) for k, v in hessians.items()})
    return Path(path)


def load_ranges(path: str | Path) -> dict[str, tuple[float, float]]:
    from tilegraph.ir.model import read_npz

    if not Path(path).is_file():
        raise QuantizeError(f"quantize: no calibration file {path}")
    out = {}
    for k, v in read_npz(path, "a calibration ranges file").items():
        if v.shape != (2,):
            raise QuantizeError(f"quantize: calibration entry '{k}' in {path} is not a (lo, hi) pair")
        out[k] = (float(v[0]), float(v[1]))
    return out
