"""Semantic checks: random inputs, reduction lengths, a pipeline against the float64 interpreter,
and the quantization bound of lossy passes."""

from __future__ import annotations

import math as _math
from typing import Mapping

import numpy as np

from tilegraph.ir import dtypes
from tilegraph.testing.generator import MAX_SYMBOL_SIZE
from tilegraph.testing.tolerances import EPS, assert_close


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
        if name == "cumsum":
            return n([ins[0][a["axis"]]])
        if name == "matmul":
            return n([ins[0][-1]])
        if name == "einsum":
            lhs, _, out = a["equation"].replace(" ", "").partition("->")
            dims = {}
            for term, shape in zip(lhs.split(","), ins):
                dims.update(zip(term, shape))
            return n([dims[c] for c in dims if c not in out])
        if name == "conv":
            return n(ins[1][1:])
        if name == "avg_pool":
            return _math.prod(a["kernel"])
        if name == "softmax":
            return n([ins[0][a["axis"]]])
        if name == "layer_norm":
            return 2 * n(ins[0][a["axis"]:])  # the mean, then the variance
        if name == "attention":
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
        if op.SPEC.category == "quantize" and op.op_name not in ("dequantize",):
            return True
        return op.op_name == "weight" and all(isinstance(u.operation, TgOp) and u.operation.SPEC.category ==
                                              "quantize" for r in op.results for u in r.uses)

    types = {info_of(a.type).dtype for a in model.func.args}
    types |= {info_of(r.type).dtype for op in model.func.walk() if not storage(op) for r in op.results}
    floats = [t for t in types if dtypes.is_float(t)]
    return max(floats, key=lambda t: EPS[t]) if floats else None


def assert_preserves_semantics(pipeline, model, inputs=None, *, seed: int = 0) -> "object":
    """Run `pipeline` on `model` and assert the result computes what the model did.

    pipeline: a pipeline string ("canonicalize,cse"), a ModulePass, or a list of them.
    Checks, on `inputs` (default: random_inputs(model, seed)):
      1. the signature (input and output names and types) is unchanged;
      2. the float64 interpreter gives the same outputs before and after;
      3. the transformed model run in its own dtypes (what a backend computes) is
         within `tolerance(dtype, reduction_length(model))` of the float64 reference,
         dtype being the coarsest float type of the model (an f16 intermediate makes
         an f32 output f16-accurate).
    Fails with an AssertionError naming the pipeline and showing the IR before and
    after. Returns the transformed model.
    """
    from tilegraph.ir import interpret
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.passes.registry import run_pipeline

    name = pipeline if isinstance(pipeline, str) else ",".join(
        str(p) for p in (pipeline if isinstance(pipeline, (list, tuple)) else [pipeline]))
    passes = pipeline if isinstance(pipeline, (str, list, tuple)) else [pipeline]
    if inputs is None:
        inputs = random_inputs(model, seed)
    _, sizes = bind_inputs(model, inputs)
    before_text = model.text

    def fail(what: str, after_text: str | None = None) -> AssertionError:
        msg = f"pipeline '{name}' does not preserve semantics: {what}\n--- IR before ---\n{before_text}"
        if after_text is not None:
            msg += f"--- IR after '{name}' ---\n{after_text}"
        return AssertionError(msg)

    expected = interpret(model, inputs)
    try:
        after = run_pipeline(model, passes)
    except Exception as e:  # a crash in a pass is a failure of this property too, shown with the IR
        raise fail(f"running it raised {type(e).__name__}: {e}") from e
    after_text = after.text
    if model.text != before_text:
        raise fail("it modified the input model in place", after_text)
    if (after.input_names, after.inputs, after.output_names, after.outputs) != (
            model.input_names, model.inputs, model.output_names, model.outputs):
        raise fail(f"the signature changed: {model.inputs} -> {model.outputs} became "
                   f"{after.inputs} -> {after.outputs}", after_text)
    n = reduction_length(model, sizes)
    coarsest = narrowest_float(model)
    try:
        got64 = interpret(after, inputs)
        got = interpret(after, inputs, float64=False)
    except Exception as e:  # the transformed model cannot even run: show it
        raise fail(f"running the result raised {type(e).__name__}: {e}", after_text) from e
    for i, (out_name, info) in enumerate(zip(model.output_names, model.outputs)):
        # A float output is only as precise as the coarsest float type it passed through.
        dtype = coarsest if dtypes.is_float(info.dtype) and coarsest else info.dtype
        for label, values in (("float64 interpreter", got64), (f"{info.dtype} run", got)):
            try:
                assert_close(values[i], expected[i], dtype, n, name=f"output '{out_name}'")
            except AssertionError as e:
                raise fail(f"{label}, output '{out_name}':\n{e}", after_text) from None
    return after


# --- lossy passes: quantization within its stated bound ------------------------------------
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
        if not (isinstance(op, TgOp) and op.op_name == "dequantize"):
            continue
        src = op.operands[0].owner
        if not (isinstance(src, TgOp) and src.op_name in ("quantize", "dynamic_quantize")):
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


def assert_within_quantization_bound(pipeline, model, inputs=None, *, seed: int = 0) -> "object":
    """Check a pipeline holding lossy passes (`LOSSY = True`: quantize) within their stated bound.

    1. the signature is unchanged;
    2. the result computes (float64 interpreter) what the reference pipeline computes, each lossy
       pass replaced by its `reference()` (fake quantization: the float model with each quantized
       tensor x replaced by dequantize(quantize(x))), within the shared tolerance of the model's
       dtype and reduction length: integer GEMMs, folded scales and stored weights are exact;
    3. in the reference, every dequantize(quantize(x)) is within half an ulp of its format times
       its scale of x (`rounding_violations`).
    Returns the transformed model.
    """
    from tilegraph.ir import interpret
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.passes.registry import parse_pipeline, run_pipeline

    passes = parse_pipeline(pipeline) if isinstance(pipeline, str) else list(
        pipeline if isinstance(pipeline, (list, tuple)) else [pipeline])
    reference = [p.reference() if getattr(p, "LOSSY", False) else p for p in passes]
    name = ",".join(str(p) for p in passes)
    if inputs is None:
        inputs = random_inputs(model, seed)
    _, sizes = bind_inputs(model, inputs)
    before_text = model.text
    after = run_pipeline(model, passes)
    ref = run_pipeline(model, reference)

    def fail(what: str) -> AssertionError:
        return AssertionError(f"pipeline '{name}' breaks its stated quantization bound: {what}\n"
                              f"--- IR before ---\n{before_text}--- IR after ---\n{after.text}"
                              f"--- reference (fake quantization) ---\n{ref.text}")

    if model.text != before_text:
        raise fail("it modified the input model in place")
    if (after.input_names, after.inputs, after.output_names, after.outputs) != (
            model.input_names, model.inputs, model.output_names, model.outputs):
        raise fail("the signature changed")
    n = reduction_length(model, sizes)
    coarsest = narrowest_float(model)
    got, want = interpret(after, inputs), interpret(ref, inputs)
    for out_name, info, a, e in zip(model.output_names, model.outputs, got, want):
        dtype = coarsest if dtypes.is_float(info.dtype) and coarsest else info.dtype
        try:
            assert_close(a, e, dtype, n, name=f"output '{out_name}' against the fake-quantized reference")
        except AssertionError as err:
            raise fail(str(err)) from None
    bad = rounding_violations(ref, inputs)
    if bad:
        raise fail("\n".join(bad))
    return after
