"""Semantic checks: random inputs, reduction lengths, a pipeline against the float64 interpreter,
and the quantization bound of lossy passes."""

from __future__ import annotations



from tilegraph.ir import dtypes
from tilegraph.accuracy import (EPS, assert_close, narrowest_float, random_inputs, reduction_length,  # noqa: F401
                                QUANT_F32_SLACK, rounding_violations)


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
