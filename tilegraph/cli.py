"""`tilegraph`: import, compile and check models from the command line.

    tilegraph import model.onnx -o model.mlir          # IR text + model.weights.npz
    tilegraph compile model.onnx --target numpy -o model_np.py
    tilegraph check model.onnx                         # tilegraph vs onnxruntime
    tilegraph calibrate                                # measure this CPU for the cost model

Every mistake in the input (a missing file, a malformed model, an unsupported op,
a shape mismatch) is one paragraph on stderr and exit status 2; `check` exits 1
when the outputs disagree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from tilegraph.errors import run_reporting_errors

EXIT_MISMATCH = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tilegraph", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    imp = sub.add_parser("import", help="import an .onnx or .pt2 model into tg IR")
    imp.add_argument("model", help="model.onnx, model.pt2 or model.mlir")
    imp.add_argument("-o", "--output", required=True, help="where to write the .mlir (weights go beside it)")

    comp = sub.add_parser("compile", help="compile a model and write the emitted source")
    comp.add_argument("model", help="model.onnx, model.pt2 or model.mlir")
    comp.add_argument("--target", default="numpy", help="code generator (default: numpy)")
    comp.add_argument("-p", "--pipeline", default=None, help="pass pipeline (default: the default pipeline)")
    comp.add_argument("-o", "--output", required=True, help="where to write the emitted source (.py)")

    check = sub.add_parser("check", help="run tilegraph and onnxruntime on the same random inputs and compare")
    check.add_argument("model", help="model.onnx")
    check.add_argument("-p", "--pipeline", default=None, help="pass pipeline (default: the default pipeline)")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                       help="size of a symbolic dimension, e.g. --dim batch=2 (default: drawn from the seed)")
    check.add_argument("--int-high", type=int, default=2, metavar="N",
                       help="integer inputs are drawn from [0, N) (default 2: valid ids, masks and flags)")

    # --- calibrate: the measured CPU profile the cost model uses (passes/cost/calibrate.py) ---
    cal = sub.add_parser("calibrate", help="measure this machine for the cost model (under a minute)")
    cal.add_argument("--quick", action="store_true", help="a rougher measurement in a couple of seconds")
    cal.add_argument("-o", "--output", default=None,
                     help="where to write the profile (default: the cache file `--target cpu` reads)")
    return p


def _import(args) -> int:
    import tilegraph

    model = tilegraph.import_model(args.model)
    out = Path(args.output)
    model.save(out)
    print(f"wrote {out} ({len(model.ops())} ops) and {out.with_suffix('.weights.npz').name} "
          f"({len(model.weights)} weights)")
    return 0


def _compile(args) -> int:
    import tilegraph

    compiled = tilegraph.compile(args.model, target=args.target, pipeline=args.pipeline)
    out = Path(args.output)
    weights = out.with_suffix(".weights.npz")
    out.write_text(compiled.source)
    compiled.model.weights.save(weights)
    print(f"wrote {out} ({len(compiled.source.splitlines())} lines) and {weights.name}")
    return 0


def _check(args) -> int:
    import numpy as np

    import tilegraph
    from ir.errors import TilegraphError
    from ir.interpreter import bind_inputs
    from tilegraph.testing import random_inputs, reduction_length, relative_error, tolerance

    path = Path(args.model)
    if path.suffix != ".onnx":
        raise TilegraphError(f"check compares against onnxruntime and needs an .onnx file, got {path}")
    compiled = tilegraph.compile(str(path), pipeline=args.pipeline)
    sizes = {}
    for item in args.dim:
        name, _, size = item.partition("=")
        if not size.isdigit():
            raise TilegraphError(f"--dim takes NAME=SIZE, got '{item}'")
        sizes[name] = int(size)
    imported = tilegraph.import_model(str(path))
    inputs = [a % args.int_high if a.dtype.kind in "iu" else a
              for a in random_inputs(imported, seed=args.seed, sizes=sizes)]
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
        if not np.array_equal(np.isnan(a64), np.isnan(e64)) or not np.array_equal(a64[~finite], e64[~finite]):
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
        from ir.errors import TilegraphError

        raise TilegraphError("tilegraph check needs onnxruntime: pip install 'tilegraph[onnx]'") from None
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, dict(zip(names, inputs)))


def _calibrate(args) -> int:
    from passes.cost import calibrate

    calibrate.run(quick=args.quick, output=args.output)
    return 0


COMMANDS = {"import": _import, "compile": _compile, "check": _check, "calibrate": _calibrate}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_reporting_errors(f"tilegraph {args.command}", lambda: COMMANDS[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
