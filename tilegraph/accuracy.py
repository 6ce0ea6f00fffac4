"""How close is close enough, and on what: tolerances set once by dtype and reduction length (the
rule is in `tilegraph.testing`'s docstring), relative errors, the random inputs checks run on, and
the reduction length and float type of a model that pick its tolerance. `tilegraph check` and
`tilegraph run` use these as the tests do; nothing here needs the test-only packages."""

from __future__ import annotations

import math
import math as _math
from typing import Mapping

import numpy as np

from tilegraph.ir import dtypes
from tilegraph.ir.ops import Op

# Symbolic dims of random inputs (and of the random graphs, tilegraph.testing.generator) are drawn
# in 1..MAX_SYMBOL_SIZE: small, so a graph runs in microseconds, and 1 comes up (broadcasting).
MAX_SYMBOL_SIZE = 3


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



def random_inputs(model, seed: int = 0, sizes: Mapping[str, int] | None = None,
                  int_high: int | None = None) -> list[np.ndarray]:
    """Inputs for `model`: floats uniform in [-1, 1], integers in [0, 4), booleans fair coins.

    With `int_high` (the commands' valid inputs), integers are in [0, int_high) (2: masks and
    flags in {0, 1}), and those that index a table (an embedding's ids) below its size.

    Symbolic dims take `sizes` (e.g. {"B": 2}); a symbol not given is drawn in
    1..MAX_SYMBOL_SIZE from the seed, so that a size of 1 (broadcasting corner
    cases) comes up too.
    """
    from tilegraph.ir.shapes import concrete, free_symbols

    rng = np.random.default_rng(seed)
    sizes = dict(sizes or {})
    for name in sorted(set().union(*(free_symbols(t.shape) for t in model.inputs))):
        sizes.setdefault(name, int(rng.integers(1, MAX_SYMBOL_SIZE + 1)))
    arrays = []
    if int_high is not None and int_high < 1:
        from tilegraph.ir.errors import TilegraphError

        raise TilegraphError(f"integer inputs are drawn from [0, N): N must be at least 1, got {int_high}")
    tables: dict[int, int] = {}
    if int_high is not None:
        from tilegraph.ir.signature import index_checks

        for check in index_checks(model):
            tables[check.input] = min(tables.get(check.input, check.size), check.size)
    for i, info in enumerate(model.inputs):
        shape = concrete(info.shape, sizes)
        dt = dtypes.numpy_dtype(info.dtype)
        if info.dtype == "i1":
            arrays.append(rng.random(shape) < 0.5)
        elif dtypes.is_float(info.dtype):
            arrays.append(rng.uniform(-1.0, 1.0, shape).astype(dt))
        else:
            high = tables.get(i, 4 if int_high is None else int_high)
            arrays.append(rng.integers(0, high, shape).astype(dt))
    return arrays


def reduction_length(model, sizes: Mapping[str, int] | None = None) -> int:
    """The longest chain of rounded sums in `model`: the tolerance's `reduction_length`.

    Along every path from the inputs to an output, add up the terms of each sum
    it passes through (a reduce_sum over 384, then a matmul contracting 64: 448;
    max/min reductions round nothing and count 0), and take the largest. Symbolic
    dims take `sizes`.
    """
    from tilegraph.ir.dialect import TgOp
    from tilegraph.ir.shapes import concrete, info_of

    sizes = dict(sizes or {})

    def n(dims) -> int:
        return _math.prod(concrete(tuple(dims), sizes)) if dims else 1

    def own(op) -> int:
        name, ins = op.op_name, [info_of(v.type).shape for v in op.operands]
        a = op.py_attrs()
        if op.SPEC.reduction in ("sum", "mean", "prod"):  # rounding grows with the length reduced
            return n([ins[0][ax] for ax in a["axes"]])
        if name == Op.cumsum:
            return n(ins[0][a["axis"]:][:1])  # a rank-0 operand scans its one element
        if name == Op.matmul:
            return n([ins[0][-1]])
        if name == Op.einsum:
            lhs, _, out = a["equation"].replace(" ", "").partition("->")
            dims = {}
            for term, shape in zip(lhs.split(","), ins):
                dims.update(zip(term, shape))
            return n([dims[c] for c in dims if c not in out])
        if name == Op.conv:
            return n(ins[1][1:])
        if name == Op.avg_pool:
            return _math.prod(a["kernel"])
        if name == Op.softmax:
            return n(ins[0][a["axis"]:][:1])  # a rank-0 operand scans its one element
        if name == Op.layer_norm:
            return 2 * n(ins[0][a["axis"]:])  # the mean, then the variance
        if name == Op.attention:
            return n([ins[0][-1]]) + 2 * n([ins[1][-2]])  # q.k, then the softmax and p@v over the keys
        return 0

    terms: dict = {}
    longest = 1
    for op in model.func.walk():
        if not isinstance(op, TgOp):
            if op.name == "func.return":
                longest = max([longest] + [terms.get(v, 0) for v in op.operands])
            continue
        t = max([terms.get(v, 0) for v in op.operands], default=0) + own(op)
        for r in op.results:
            terms[r] = t
        if op.SPEC.bound is not None:  # a dim known only at run time: at its upper bound
            sizes[op.attr("size")] = n([op.SPEC.bound([info_of(v.type) for v in op.operands], op.py_attrs())])
    return max(1, longest)


def narrowest_float(model) -> str | None:
    """The float type of the model with the largest rounding error (None without floats)."""
    from tilegraph.ir.shapes import info_of

    from tilegraph.ir.dialect import TgOp

    def storage(op) -> bool:
        # Quantized values (tg.quantize results, weights only dequantize reads) are exact in both
        # the interpreter and a backend (ir/quant.py): the arithmetic around them sets the precision.
        if not isinstance(op, TgOp):
            return False
        if op.SPEC.category == Op.quantize and op.op_name not in (Op.dequantize,):
            return True
        return op.op_name == Op.weight and all(isinstance(u.operation, TgOp) and u.operation.SPEC.category ==
                                              Op.quantize for r in op.results for u in r.uses)

    types = {info_of(a.type).dtype for a in model.func.args}
    types |= {info_of(r.type).dtype for op in model.func.walk() if not storage(op) for r in op.results}
    floats = [t for t in types if dtypes.is_float(t)]
    return max(floats, key=lambda t: EPS[t]) if floats else None


# float32 arithmetic around a rounding (x / scale, then q * scale) adds a few units of
# float32's roundoff, relative to |x|, to the format's half ulp.
QUANT_F32_SLACK = 4 * 2.0 ** -24


def rounding_violations(model, inputs) -> list[str]:
    """Run `model` (the float64 interpreter) and check every dequantize(quantize(x)) pair in it:
    |result - x| <= half an ulp of the format times the scale, plus how far x lies beyond the
    representable range [(lo - zero point) * scale, (hi - zero point) * scale] (a calibrated
    clipping). Returns one line per pair that breaks its bound."""
    from tilegraph.ir import interpret
    from tilegraph.ir.dialect import TgOp
    from tilegraph.ir.quant import FORMATS, expand_scale

    values: dict = {}
    interpret(model, inputs, values=values)
    bad = []
    for op in model.func.walk():
        if not (isinstance(op, TgOp) and op.op_name == Op.dequantize):
            continue
        src = op.operands[0].owner
        if not (isinstance(src, TgOp) and src.op_name in (Op.quantize, Op.dynamic_quantize)):
            continue
        fmt = FORMATS[src.result_infos()[0].dtype]
        x = np.asarray(values[src.operands[0]], np.float64)
        axis, block = op.attr("axis"), op.attr("block_size")
        scale = expand_scale(np.asarray(values[op.operands[1]]).astype(np.float64), x.shape, axis, block)
        zp = 0.0 if len(op.operands) < 3 else expand_scale(np.asarray(values[op.operands[2]]).astype(np.float64),
                                                            x.shape, axis, block)
        scale = np.broadcast_to(scale, x.shape)
        lo, hi = (fmt.lo - zp) * scale, (fmt.hi - zp) * scale
        beyond = np.maximum(np.maximum(lo - x, x - hi), 0.0)
        bound = fmt.half_ulp(np.clip(x / scale + zp, fmt.lo, fmt.hi)) * scale + beyond + \
            QUANT_F32_SLACK * np.abs(x) + 1e-300
        err = np.abs(np.asarray(values[op.results[0]], np.float64) - x)
        if not (err <= bound).all():
            i = int(np.argmax(err - bound))
            bad.append(f"{src.name} -> {op.name} ({fmt.name}): x={x.flat[i]!r} came back as "
                       f"{np.asarray(values[op.results[0]]).flat[i]!r}, error {err.flat[i]:.3g} > bound "
                       f"{bound.flat[i]:.3g}")
    return bad
