"""Testing tilegraph and passes written for it: tolerances, strategies, semantic checks.

Tolerances are set here, once, by dtype and reduction length; tests never pick
their own. A float result computed in dtype `d` with reductions over `n` terms is
compared to the float64 interpreter with

    rtol = ROUNDING_BUDGET * eps(d) * sqrt(n),   atol = rtol * max(1, max|expected|)

sqrt(n) is the expected growth of rounding error in a sum of n terms (random-walk
accumulation, Higham, "Accuracy and Stability of Numerical Algorithms", ch. 4);
the absolute part scales with the output so values that cancel to near zero are
judged against the size of what cancelled.
"""

from __future__ import annotations

import math

import numpy as np

from ir import dtypes

# Unit roundoff of each float type (half the distance from 1.0 to the next number).
EPS = {"f64": 2.0 ** -53, "f32": 2.0 ** -24, "f16": 2.0 ** -11, "bf16": 2.0 ** -8,
       "f8E4M3FN": 2.0 ** -4, "f8E5M2": 2.0 ** -3}
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
