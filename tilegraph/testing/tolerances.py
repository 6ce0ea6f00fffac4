"""Tolerances, set once by dtype and reduction length (the rule is in `tilegraph.testing`'s docstring)."""

from __future__ import annotations

import math

import numpy as np

from tilegraph.ir import dtypes


# Unit roundoff of each float type (half the distance from 1.0 to the next number).
EPS = {"f64": 2.0 ** -53, "f32": 2.0 ** -24, "f16": 2.0 ** -11, "bf16": 2.0 ** -8,
       "f8E4M3FN": 2.0 ** -4, "f8E5M2": 2.0 ** -3, "f6E2M3FN": 2.0 ** -4, "f4E2M1FN": 2.0 ** -2,
       "f8E8M0FNU": 2.0 ** -1}
# How many roundings a chain of ops may accumulate before it counts as wrong: a
# dozen elementwise ops each adding ~1 ulp, with headroom of 2x for transcendental
# functions that NumPy evaluates to within 1-2 ulp.
ROUNDING_BUDGET = 64


def tolerance(dtype: str, reduction_length: int = 1) -> tuple[float, float]:
    """(rtol, atol-scale) for comparing a `dtype` result to the float64 reference."""
    if not dtypes.is_float(dtype):
        return (0.0, 0.0)  # integers and booleans are exact
    rtol = ROUNDING_BUDGET * EPS[dtype] * math.sqrt(max(1, reduction_length))
    return (rtol, rtol)


# What the issue asks of a whole fp32 model against its framework's own fp32 output
# (torch eager, onnxruntime): both sides round, so this is a peer-to-peer bound,
# not a bound against the float64 reference.
PEER_RELATIVE_ERROR = 1e-4


def relative_error(actual, expected) -> float:
    """max|a - e| / max|e| over the finite entries of `expected`: one number for 'how far apart'."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape {a.shape} != reference {e.shape}")
    finite = np.isfinite(e)
    scale = float(np.max(np.abs(e[finite]), initial=0.0))
    err = float(np.max(np.abs(a - e)[finite], initial=0.0))
    return err / scale if scale else err


def assert_close(actual, expected, dtype: str, reduction_length: int = 1, name: str = "output") -> None:
    """Assert a result agrees with the float64 reference within the dtype's tolerance."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {actual.shape} != reference {expected.shape}")
    if not dtypes.is_float(dtype):
        np.testing.assert_array_equal(actual, expected, err_msg=name)
        return
    rtol, atol = tolerance(dtype, reduction_length)
    a = actual.astype(np.float64)
    e = expected.astype(np.float64)
    finite = np.isfinite(e)
    scale = float(np.max(np.abs(e[finite]), initial=0.0))
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * max(1.0, scale), equal_nan=True,
                               err_msg=f"{name} ({dtype}, reductions over {reduction_length})")
