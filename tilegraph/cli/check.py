"""`tilegraph check`: tilegraph's outputs against onnxruntime's on random inputs."""

from __future__ import annotations

from pathlib import Path

from tilegraph.cli.common import EXIT_MISMATCH, nonfinite_differ, parse_dims


def _check(args) -> int:
    import numpy as np

    import tilegraph
    from tilegraph.ir.errors import TilegraphError
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.accuracy import (
        random_inputs,
        reduction_length,
        relative_error,
        tolerance,
    )

    path = Path(args.model)
    if path.suffix != ".onnx":
        raise TilegraphError(f"check compares against onnxruntime and needs an .onnx file, got {path}")
    sizes = parse_dims(args.dim)
    compiled = tilegraph.compile(str(path), pipeline=args.pipeline)
    imported = tilegraph.import_model(str(path))
    inputs = random_inputs(imported, seed=args.seed, sizes=sizes, int_high=args.int_high)
    ours = compiled.run(*inputs)
    theirs = _onnxruntime(path, imported.input_names, inputs)
    n = reduction_length(imported, bind_inputs(imported, inputs)[1])
    ok = True
    print(f"{'output':<24} {'dtype':<6} {'max abs err':>12} {'max rel err':>12} {'tolerance':>10}")
    for name, info, a, e in zip(imported.output_names, imported.outputs, ours, theirs):
        a64, e64 = np.asarray(a, dtype=np.float64), np.asarray(e, dtype=np.float64)
        if a64.shape != e64.shape:
            print(f"{name:<24} shape {a64.shape} != onnxruntime's {e64.shape}")
            ok = False
            continue
        finite = np.isfinite(e64)
        if nonfinite_differ(a64, e64):
            print(f"{name:<24} NaN/inf where onnxruntime has none (or the reverse)")
            ok = False
            continue
        abs_err = float(np.max(np.abs(a64 - e64)[finite], initial=0.0))
        rel_err = relative_error(a64, e64)
        # Two float computations are compared here, not one against float64, so the
        # budget is the dtype's tolerance on each side.
        rtol, _ = tolerance(info.dtype, n)
        good = rel_err <= 2 * rtol
        ok &= good
        print(f"{name:<24} {info.dtype:<6} {abs_err:>12.3e} {rel_err:>12.3e} {2 * rtol:>10.1e} "
              f"{'ok' if good else 'MISMATCH'}")
    print("agree" if ok else "outputs differ from onnxruntime")
    return 0 if ok else EXIT_MISMATCH




def _onnxruntime(path: Path, names, inputs):
    try:
        import onnxruntime as ort
    except ImportError:
        from tilegraph.ir.errors import TilegraphError

        raise TilegraphError("tilegraph check needs onnxruntime: pip install 'tilegraph[onnx]'") from None
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, dict(zip(names, inputs)))
