"""`tilegraph`: import, compile and check models from the command line.

    tilegraph import model.onnx -o model.mlir          # IR text + model.weights.npz
    tilegraph compile model.onnx --target numpy -o model_np.py
    tilegraph compile model.onnx --target triton -o model_triton.py --report
    tilegraph check model.onnx                         # tilegraph vs onnxruntime
    tilegraph calibrate                                # measure this CPU for the cost model
    tilegraph calibrate --target c                     # ... as the native C backend runs on it
    tilegraph cost model.onnx --target h100 --dim batch=8   # predicted time, kernel by kernel
    tilegraph cost model.onnx --target cpu --symbolic       # ... as formulas of the symbolic dims
    tilegraph compile model.onnx -o model_np.py --report    # + kernels, buffers, planned peak memory
    tilegraph shard model.onnx --mesh 8 --target h100       # how to split it over 8 GPUs, predicted step time
    tilegraph run model.onnx --devices 4 --dim batch=4      # the sharded program on 4 local processes (gloo)
    tilegraph quantize model.onnx --calib samples.npz --scheme w8a8 -o model_q.mlir   # calibrate, quantize
    tilegraph export model_q.mlir -o model_q.onnx      # to ONNX (QDQ form if quantized) for onnxruntime

Every mistake in the input (a missing file, a malformed model, an unsupported op,
a shape mismatch) is one paragraph on stderr and exit status 2; `check` exits 1
when the outputs disagree.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from tilegraph.passes.registry import with_target  # noqa: F401 - tilegraph.opt and tests import it from here
from tilegraph.reporting import run_reporting_errors

EXIT_MISMATCH = 1
# A symbolic dim the user gave no --dim for is costed at this size (and the output
# says so): a batch or sequence of a hundred-odd rows, where the bundled models run.
DEFAULT_DIM = 128


def _parser() -> argparse.ArgumentParser:
    from tilegraph.backends import TARGETS  # the code generators tilegraph.compile knows

    p = argparse.ArgumentParser(prog="tilegraph", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    imp = sub.add_parser("import", help="import an .onnx or .pt2 model into tg IR")
    _shared(imp, output="where to write the .mlir (weights go beside it)")

    comp = sub.add_parser("compile", help="compile a model and write the emitted source")
    _shared(comp, output="where to write the emitted source (.py)", pipeline=PIPELINE,
            dim="with --report: evaluate the planned peak at this size of a symbolic dimension")
    comp.add_argument("--target", default="numpy", choices=list(TARGETS),
                      help="code generator: numpy, or triton (@triton.jit kernels for a GPU, fused and tiled "
                           "for it) (default: numpy)")
    comp.add_argument("--report", action="store_true",
                      help="print kernel count, planned buffers, planned peak memory and weight bytes")

    check = sub.add_parser("check", help="run tilegraph and onnxruntime on the same random inputs and compare")
    _shared(check, model="model.onnx", pipeline=PIPELINE,
            dim="size of a symbolic dimension, e.g. --dim batch=2 (default: drawn from the seed)")
    check.add_argument("--seed", type=_non_negative, default=0)
    check.add_argument("--int-high", type=_positive, default=2, metavar="N",
                       help="integer inputs are drawn from [0, N) (default 2: masks and flags in {0, 1}); "
                            "ids of an embedding from its whole table")

    # --- quantize: calibrate activations, then the quantize pass (passes/quantize.py) ---
    from tilegraph.passes.quantize import OBSERVERS, SCHEMES

    qz = sub.add_parser("quantize", help="calibrate on sample inputs and quantize the linear layers",
                        description="Import the model, simplify it (the unfused default pipeline), run it on "
                                    "the calibration samples to observe every linear layer's activation range, "
                                    "and quantize by the scheme. Writes the quantized IR, its weights (4-bit "
                                    "ones two to a byte) and the activation ranges (.calib.npz) beside it.")
    _shared(qz, output="where to write the quantized .mlir")
    qz.add_argument("--scheme", default="w8a8", choices=list(SCHEMES), help="(default: w8a8)")
    qz.add_argument("--calib", default=None, metavar="SAMPLES.npz",
                    help="calibration inputs, one array per model input named as it is, samples along the "
                         "first axis; without it, activation scales come from the data at run time")
    qz.add_argument("--observer", default="minmax", choices=OBSERVERS, help="activation ranges (default: minmax)")
    qz.add_argument("--percentile", type=float, default=None, help="with --observer percentile (default 99.99)")
    qz.add_argument("--weight-observer", default="minmax", choices=("minmax", "mse"), help="(default: minmax)")
    qz.add_argument("--symmetric", action="store_true", help="int8 activations as i8 without a zero point")
    qz.add_argument("--rounding", default="nearest", choices=("nearest", "gptq"),
                    help="weights: round to nearest, or GPTQ (needs --calib: rounds each layer to keep its output "
                         "on the calibration samples; passes/gptq.py) (default: nearest)")
    qz.add_argument("--act-order", action="store_true", help="with --rounding gptq: largest inputs first")
    qz.add_argument("--batch-size", type=int, default=8, help="calibration samples per run (default: 8)")
    qz.add_argument("--max-error", type=float, default=None,
                    help="mixed precision (needs --calib): each linear layer gets --scheme, --fallback or stays "
                         "float, whichever is predicted fastest on --target, keeping the relative output error on "
                         "the calibration samples within this")
    qz.add_argument("--min-cosine", type=float, default=None,
                    help="mixed precision, as --max-error: keep the outputs' mean cosine similarity at least this")
    qz.add_argument("--fallback", default="w8", choices=["none", *SCHEMES],
                    help="with --max-error / --min-cosine: a second scheme a layer may get (default: w8)")
    qz.add_argument("--target", default="cpu", help="with --max-error / --min-cosine: the hardware the speed is "
                                                   "predicted for: h100, h200, a100 or cpu (default)")
    qz.add_argument("--export-onnx", default=None, metavar="OUT.onnx",
                    help="also write the quantized model as ONNX in QDQ form (backends/onnx_export.py)")

    # --- export: ONNX for onnxruntime (backends/onnx_export.py) ---
    exp = sub.add_parser("export", help="export a model to ONNX; a quantized one (tilegraph quantize) in QDQ form",
                         description="Import the model, run the pipeline (default: the unfused default pipeline; "
                                     "fused groups are exported as their ops) and write ONNX (opset 21) that "
                                     "onnxruntime runs: quantized weights as int8/uint8/int4/float8 initializers "
                                     "with QuantizeLinear/DequantizeLinear/MatMulInteger nodes; MX formats "
                                     "widened exactly to float8 elements and float32 scales.")
    _shared(exp, model=f"{MODEL} (e.g. from tilegraph quantize)", output="the .onnx to write",
            pipeline="pass pipeline before export (default: the unfused default pipeline)")

    # --- calibrate: the measured CPU profile the cost model uses (backends/numpy/calibrate.py) ---
    cal = sub.add_parser("calibrate", help="measure this machine for the cost model (under a minute)")
    cal.add_argument("--target", default="numpy", choices=("numpy", "c"),
                     help="whose kernels to measure: the NumPy backend's (default; the profile of hardware "
                          "target cpu) or the C backend's (the profile of hardware target c)")
    cal.add_argument("--quick", action="store_true", help="a rougher measurement in a couple of seconds")
    cal.add_argument("-o", "--output", default=None,
                     help="where to write the profile (default: the cache file the cost model reads for "
                          "hardware target cpu, or c with --target c)")

    # --- cost: the cost model's prediction, kernel by kernel (passes/cost/model.py) ---
    cost = sub.add_parser("cost", help="predict FLOPs, bytes and time of every kernel on a target",
                          description="Run the pipeline, then print the cost model's prediction for every "
                                      "kernel (fused group or unfused op) and the totals. Passes with a "
                                      "`target` option (fuse, tile) decide for --target unless the pipeline "
                                      "names one, e.g. -p 'canonicalize,fuse{target=cpu}'.")
    _shared(cost, pipeline=PIPELINE,
            dim=f"size of a symbolic dimension, e.g. --dim batch=8 (default: {DEFAULT_DIM} each)")
    cost.add_argument("--target", default="cpu",
                      help="hardware: h100, h200, a100, cpu (this machine's calibrated profile for the NumPy "
                           "backend; default) or c (the same for the C backend)")
    cost.add_argument("--symbolic", action="store_true",
                      help="print the formulas (FLOPs, bytes, time as functions of the symbolic dims)")

    # --- shard: the sharding planner's plan (passes/shard.py) ---
    shard = sub.add_parser("shard", help="plan how to split a model over a device mesh (predicted step time)",
                           description="Run the pipeline, then the `shard` pass's planner: for every op a "
                                       "sharding on the mesh, chosen by an integer program minimizing the "
                                       "predicted training step time (compute + collectives) under the "
                                       "per-device memory budget. Prints the plan per layer, the step time, "
                                       "its compute/communication split and the memory per device.")
    _shared(shard, pipeline="passes to run before planning (default: the unfused default pipeline)",
            dim=f"size of a symbolic dimension to plan at (default: {DEFAULT_DIM} each)")
    shard.add_argument("--mesh", default="8", help="device mesh: 8, or 2x4 (axes; the last inside a node)")
    shard.add_argument("--target", default="h100", help="the devices: h100, h200 or a100")
    shard.add_argument("--memory", default="", help="memory budget per device, e.g. 40GB (default: the device's)")
    shard.add_argument("--inference", action="store_true", help="plan a forward pass, not a training step")
    shard.add_argument("--symbolic", action="store_true",
                       help="also print the plan's step time as a formula of the symbolic dims")
    shard.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="show what the planner is doing and for how long on stderr (default: when stderr "
                            "is a terminal)")

    # --- run: the sharded program on N local processes (backends/distributed.py) ---
    dist = sub.add_parser("run", help="run the sharded model on N local processes (torch.distributed, gloo) and "
                                      "compare with one device",
                          description="Plan a sharding for --devices devices (the `shard` pass, forward pass), "
                                      "partition the model into the per-device program, run it on that many "
                                      "local processes joined by torch.distributed (gloo), and compare the "
                                      "gathered outputs with the single-device float64 interpreter on random "
                                      "inputs. Exit 1 when they differ beyond the dtype's tolerance.")
    _shared(dist, pipeline="passes before sharding (default: the unfused default pipeline)",
            dim="size of a symbolic dimension (default: the number of devices)")
    dist.add_argument("--devices", type=int, required=True, help="how many processes (the mesh, unless --mesh)")
    dist.add_argument("--mesh", default=None, help="mesh shape, e.g. 2x2 (default: --devices on one axis)")
    dist.add_argument("--target", default="h100", help="the hardware the plan is costed for (default h100)")
    dist.add_argument("--seed", type=_non_negative, default=0)
    dist.add_argument("--backend", default="numpy", choices=["numpy", "c"],
                      help="the backend that compiles each device's ops between its collectives (default numpy; "
                           "c: the native C backend, one thread per process)")
    dist.add_argument("--op-by-op", action="store_true",
                      help="run each device's ops through the op table's NumPy templates one at a time instead of "
                           "the --backend's emitted modules between collectives")
    dist.add_argument("--no-overlap", action="store_true",
                      help="wait for every collective where it is issued (default: asynchronous, waited at first use)")
    dist.add_argument("--compare", action="store_true",
                      help="also time the op-by-op run (interleaved with this one) and the whole model on one "
                           "process (--backend)")
    dist.add_argument("--repeats", type=int, default=3, help="timed steps per run (the median is reported)")
    return p


MODEL = "model.onnx, model.pt2 or model.mlir"
PIPELINE = "pass pipeline (default: the default pipeline)"


def _shared(parser: argparse.ArgumentParser, model: str = MODEL, output: str | None = None,
            pipeline: str | None = None, dim: str | None = None) -> None:
    """The options commands share, each added with the command's help text (None: it has none): the
    model file, -o/--output (required), -p/--pipeline and --dim NAME=SIZE (repeatable)."""
    parser.add_argument("model", help=model)
    if output:
        parser.add_argument("-o", "--output", required=True, help=output)
    if pipeline:
        parser.add_argument("-p", "--pipeline", default=None, help=pipeline)
    if dim:
        parser.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE", help=dim)


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def refuse_overwriting(model: str | Path, *outputs: str | Path) -> None:
    """A TilegraphError when a file a command writes is the model it reads (or its weights)."""
    from tilegraph.ir.errors import TilegraphError

    inputs = {Path(model).resolve(): "the model being read"}
    if Path(model).suffix == ".mlir":  # its weights are read from beside it
        inputs[Path(model).with_suffix(".weights.npz").resolve()] = "the weights of the model being read"
    for out in outputs:
        if out is not None and Path(out).resolve() in inputs:
            what = inputs[Path(out).resolve()]
            if Path(out).name.endswith(".weights.npz"):  # the weights a command writes beside its output
                raise TilegraphError(f"the output's weights file {out} would overwrite {what} ({model}): "
                                     f"name the output differently from the model")
            raise TilegraphError(f"-o {out} would overwrite {what} ({model}); write elsewhere")


def _import(args) -> int:
    import tilegraph

    refuse_overwriting(args.model, args.output, Path(args.output).with_suffix(".weights.npz"))
    model = tilegraph.import_model(args.model)
    out = Path(args.output)
    model.save(out)
    print(f"wrote {out} ({len(model.ops())} ops) and {out.with_suffix('.weights.npz').name} "
          f"({len(model.weights)} weights)")
    return 0


def _compile(args) -> int:
    import tilegraph
    from tilegraph.backends import backend

    dims = parse_dims(args.dim)
    refuse_overwriting(args.model, args.output, Path(args.output).with_suffix(".weights.npz"))
    # Fusion and tiling are decided for the target's hardware (backends.triton.HARDWARE for
    # triton): the default pipeline does so, and a given one too where it names no target.
    hardware = getattr(backend(args.target), "HARDWARE", "cpu")
    pipeline = None if args.pipeline is None else with_target(args.pipeline, hardware)
    imported = tilegraph.import_model(args.model)
    compiled = tilegraph.compile(imported, target=args.target, pipeline=pipeline)
    report = _report(compiled, dims, hardware, imported) if args.report else []  # a bad --dim fails before anything is written
    out = Path(args.output)
    weights = out.with_suffix(".weights.npz")
    out.write_text(compiled.source)
    compiled.model.weights.save(weights)
    print(f"wrote {out} ({len(compiled.source.splitlines())} lines) and {weights.name}")
    for line in report:
        print(line)
    return 0


def _quantize(args) -> int:
    import tilegraph
    from tilegraph.ir.errors import TilegraphError
    from tilegraph.passes.quantize import SCHEMES, linear_layers, quantize_model, save_calibration
    from tilegraph.passes.registry import UNFUSED_PIPELINE, run_pipeline

    if args.batch_size < 1:
        raise TilegraphError(f"--batch-size must be at least 1, got {args.batch_size}")
    refuse_overwriting(args.model, args.output, Path(args.output).with_suffix(".weights.npz"), args.export_onnx)
    if args.export_onnx and not Path(args.export_onnx).parent.is_dir():
        raise TilegraphError(f"--export-onnx {args.export_onnx}: no such directory {Path(args.export_onnx).parent}")
    # Flags that cannot work are refused before the import and the calibration run.
    mixed = args.max_error is not None or args.min_cosine is not None
    if mixed and args.calib is None:
        raise TilegraphError("--max-error and --min-cosine need --calib: the error is measured on the calibration "
                             "samples")
    if args.max_error is not None and not args.max_error >= 0:
        raise TilegraphError(f"--max-error must be a relative error >= 0, got {args.max_error}")
    if args.min_cosine is not None and not -1 <= args.min_cosine <= 1:
        raise TilegraphError(f"--min-cosine must be a cosine similarity in [-1, 1], got {args.min_cosine}")
    if mixed:
        from tilegraph.ir.hardware import check_target

        try:
            check_target(args.target)
        except ValueError as e:
            raise TilegraphError(str(e)) from None
    if args.rounding == "gptq" and args.calib is None:
        raise TilegraphError("--rounding gptq needs --calib: it rounds each layer against its inputs on the "
                             "calibration samples")
    model = run_pipeline(tilegraph.import_model(args.model), UNFUSED_PIPELINE)
    if not linear_layers(model.func.body.block.ops, model.weights):
        raise TilegraphError(f"{args.model} has no matmul by a 2-D float weight: nothing to quantize")
    out = Path(args.output)
    calib_path = out.with_suffix(".calib.npz")
    batches = _calibration_batches(Path(args.calib), model, args.batch_size) if args.calib is not None else None
    if batches is not None and not SCHEMES[args.scheme].activation and not mixed and args.rounding == "nearest":
        print(f"{args.scheme} is weight-only: --calib is not needed (ignored)", file=sys.stderr)
        batches = None
    from tqdm import tqdm

    units = {"calibrating": "batch", "gptq inputs": "batch", "sensitivity": "layer"}
    result = quantize_model(
        model, args.scheme, batches=batches, observer=args.observer, percentile=args.percentile,
        weight_observer=args.weight_observer, symmetric=args.symmetric, rounding=args.rounding,
        act_order=args.act_order, max_error=args.max_error, min_cosine=args.min_cosine, fallback=args.fallback,
        target=args.target, progress=lambda it, what: tqdm(it, desc=what, unit=units[what], file=sys.stderr))
    quantized, ranges, plan = result.model, result.ranges, result.plan
    for line in plan.remarks if plan else []:
        print(line)
    proto = None
    if args.export_onnx:  # before anything is written: an op ONNX cannot hold stops it all
        from tilegraph.backends.onnx_export import to_onnx

        proto = to_onnx(quantized, Path(args.export_onnx).stem)
    quantized.save(out)
    if ranges is not None:
        save_calibration(calib_path, ranges)
    layers = result.layers
    what, how = f"{layers} linear layers ({args.scheme}", ""
    if mixed:  # say what the search chose, not what it was offered
        from collections import Counter

        got = Counter(plan.formats.values())
        floats = got.pop("none", 0)
        what = f"{layers - floats} of {layers} linear layers ("
        how = ", ".join([f"{n} {scheme}" for scheme, n in got.most_common()] + ([f"{floats} float"] if floats else [])
                        ) + f"; chosen for {args.target}"
    print(f"quantized {what}{how}"
          + (f", activations calibrated by {args.observer} on {args.calib}" if ranges else
             ", activation scales from the data at run time" if SCHEMES[args.scheme].activation else "")
          + ")")
    print(f"weights: {format_count(model.weights.nbytes())}B -> {format_count(quantized.weights.nbytes())}B")
    print(f"wrote {out} and {out.with_suffix('.weights.npz').name}" + (f" and {calib_path.name}" if ranges else ""))
    if proto is not None:
        from tilegraph.backends.onnx_export import summary, write_onnx

        print(f"wrote {write_onnx(proto, args.export_onnx)}: {summary(proto)}")
    return 0


def _export(args) -> int:
    import tilegraph
    from tilegraph.ir.errors import TilegraphError
    from tilegraph.backends.onnx_export import summary, to_onnx, write_onnx
    from tilegraph.passes.registry import UNFUSED_PIPELINE, run_pipeline

    out = Path(args.output)
    if not out.parent.is_dir():
        raise TilegraphError(f"-o {out}: no such directory {out.parent}")
    refuse_overwriting(args.model, out)
    model = run_pipeline(tilegraph.import_model(args.model), UNFUSED_PIPELINE if args.pipeline is None
                         else args.pipeline)
    proto = to_onnx(model, out.stem)
    write_onnx(proto, out)
    print(f"wrote {out}: {summary(proto)}")
    return 0


def _calibration_batches(path: Path, model, batch_size: int) -> list[list]:
    """The samples of an .npz (one array per model input, samples along axis 0) in batches."""
    import numpy as np

    from tilegraph.ir.errors import TilegraphError
    from tilegraph.ir.model import read_npz

    if not path.is_file():
        raise TilegraphError(f"no such calibration file: {path}")
    data = read_npz(path, "a calibration .npz")
    missing = [n for n in model.input_names if n not in data]
    if missing:
        raise TilegraphError(f"{path} has no array for input(s) {', '.join(missing)} (it has: "
                             f"{', '.join(sorted(data)) or 'nothing'}); give one per model input, samples along "
                             "axis 0")
    counts = {n: len(data[n]) if data[n].ndim else 0 for n in model.input_names}
    if len(set(counts.values())) != 1 or not next(iter(counts.values())):
        raise TilegraphError(f"{path}: the inputs must hold the same number (> 0) of samples along axis 0, "
                             f"got {counts}")
    for n in model.input_names:
        if data[n].dtype.kind in "fc" and not np.all(np.isfinite(data[n])):
            bad = int(np.sum(~np.isfinite(data[n])))
            raise TilegraphError(f"{path}: input {n} holds {bad} NaN or infinite value(s); calibration ranges "
                                 "come from the samples, so every sample must be finite")
    total = next(iter(counts.values()))
    return [[data[n][i:i + batch_size] for n in model.input_names] for i in range(0, total, batch_size)]


def _report(compiled, dims: dict[str, int], hardware: str = "cpu", before=None) -> list[str]:
    """What the backend planned, read back from the PLAN the emitted module carries."""
    import sympy

    from tilegraph.ir.errors import TilegraphError
    from tilegraph.ir.shapes import parse_dim

    if compiled.target == "triton":
        return _triton_report(compiled, hardware)
    plan = _module_constant(compiled.source, "PLAN")
    if plan is None:
        raise TilegraphError(f"the {compiled.target} backend does not report a memory plan (no PLAN in its module)")
    # Parsed as a dim is (names stay symbols: sympify reads a dim named S as sympy's S registry).
    peak = sympy.sympify(parse_dim(plan["peak_bytes"]))
    check_dims(dims, {s.name for s in peak.free_symbols} | _input_symbols(compiled.model))
    peak = _subs(peak, dims)
    if peak.free_symbols:
        peak_text = f"{peak} bytes (--dim NAME=SIZE evaluates it)"
    else:
        at = ", ".join(f"{k}={v}" for k, v in sorted(dims.items()))
        peak_text = f"{format_count(float(peak))}B" + (f" at {at}" if at else "")
    weights = compiled.model.weights.nbytes()  # as saved: 4-bit types two to a byte
    was = "" if before is None else f" (before the passes: {len(before.weights)} arrays, " \
                                    f"{format_count(before.weights.nbytes())}B)"
    return [f"kernels: {plan['kernels']}",
            f"planned buffers: {plan['buffers']} (reused by liveness)",
            f"planned peak of intermediates (inputs and weights not counted): {peak_text}",
            f"weights: {len(compiled.model.weights)} arrays, {format_count(weights)}B{was}"]


def _triton_report(compiled, hardware: str) -> list[str]:
    """The Triton module's kernels (what each computes, its first configuration) and host ops."""
    kernels = _module_constant(compiled.source, "KERNELS") or {}
    host = _module_constant(compiled.source, "HOST_OPS") or {}
    lines = [f"fused and tiled for: {hardware}", f"kernels: {len(kernels)}"]
    for name, entry in kernels.items():
        blocks = ", ".join(f"{k}={v}" for k, v in entry["builds"][0]["constexprs"].items())
        lines.append(f"  {name}: {entry['group']}  [{blocks}; {len(entry['configs'])} candidate(s)]")
    lines.append("ops on the host (no kernel covers them): "
                 + (", ".join(f"{op} x{n}" for op, n in sorted(host.items())) if host else "none"))
    split = _module_constant(compiled.source, "SPLIT_GROUPS") or ()
    lines += [f"fused groups run op by op: {len(split)}"] + [f"  {why}" for why in split]
    return lines


def _module_constant(source: str, name: str):
    """The literal value of `name = ...` at the top level of an emitted module, or None."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def _check(args) -> int:
    import numpy as np

    import tilegraph
    from tilegraph.ir.errors import TilegraphError
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.testing import random_inputs, reduction_length, relative_error, tolerance

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


# Random integer inputs of `run`: masks and flags in {0, 1} (ids of an embedding span its table).
VALID_INT_HIGH = 2


def nonfinite_differ(actual, expected) -> bool:
    """Whether NaN or inf stand in different places (the same NaN in both is agreement)."""
    import numpy as np

    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    finite = np.isfinite(e)
    return a.shape != e.shape or not np.array_equal(np.isnan(a), np.isnan(e)) or \
        not np.array_equal(a[~finite], e[~finite])


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


def _calibrate(args) -> int:
    if args.target == "c":
        from tilegraph.backends.c import calibrate
    else:
        from tilegraph.backends.numpy import calibrate

    calibrate.run(quick=args.quick, output=args.output)
    return 0


# --- cost: the cost model's table and formulas --------------------------------------

def _cost(args) -> int:
    import tilegraph
    from tilegraph.ir.hardware import hardware
    from tilegraph.passes.cost.model import module_cost
    from tilegraph.passes.registry import DEFAULT_PIPELINE, run_pipeline

    hw = hardware(args.target)  # an unknown target or a bad --dim fails before any import work
    dims = parse_dims(args.dim)
    pipeline = with_target(DEFAULT_PIPELINE if args.pipeline is None else args.pipeline, hw.name)
    model = run_pipeline(tilegraph.import_model(args.model), pipeline)
    cost = module_cost(model.module, hw)
    symbols = _input_symbols(model) | _cost_symbols(cost)
    check_dims(dims, symbols)
    print(f"{Path(args.model).name} on {hw.name}" + (f" ({hw.source})" if hw.kind == "cpu" else ""))
    print(f"pipeline: {pipeline or '(none)'}")
    if args.symbolic:
        _print_formulas(cost, dims)
    else:
        sizes, defaulted = sizes_for(symbols, dims)
        if sizes:
            print(f"sizes: {describe_sizes(sizes, defaulted)}")
        _print_table(cost, sizes)
    return 0


def _print_table(cost, sizes: dict[str, int]) -> None:
    from tilegraph.ir.escape import terminal_text
    from tilegraph.passes.cost.model import at

    total = at(cost.time, sizes)
    unit, scale = _time_unit(total)
    labels = [terminal_text(label) for label, _ in cost.rows]  # a .mlir file names its groups' kinds
    width = max([len("kernel"), *map(len, labels)])
    print(f"{'#':>3}  {'kernel':<{width}}  {'FLOPs':>9}  {'bytes':>9}  {'FLOP/B':>7}  {f'time ({unit})':>10}  "
          f"{'%':>5}  {'bound':<8}  ops")
    for i, (label, (_, c)) in enumerate(zip(labels, cost.rows)):
        flops, nbytes, time = at(c.flops, sizes), at(c.bytes, sizes), at(c.time, sizes)
        intensity = f"{flops / nbytes:.3g}" if nbytes else "-"
        ops = " ".join(c.ops) if label.startswith("fusion") else ""
        print(f"{i:>3}  {label:<{width}}  {format_count(flops):>9}  {format_count(nbytes):>9}  {intensity:>7}  "
              f"{time * scale:>10.3f}  {100 * time / total if total else 0:>5.1f}  {c.bound(sizes):<8}  {ops}".rstrip())
    print(f"total: {cost.kernels} kernels, {format_count(at(cost.flops, sizes))} FLOPs, "
          f"{format_count(at(cost.bytes, sizes))} bytes, {total * scale:.3f} {unit} predicted")


def _print_formulas(cost, dims: dict[str, int]) -> None:
    """Totals and per-kernel cost as sympy formulas of the symbolic dims (those without a --dim)."""
    from tilegraph.ir.escape import terminal_text

    if dims:
        print(f"with {', '.join(f'{k}={v}' for k, v in sorted(dims.items()))}")
    print(f"FLOPs = {_formula(cost.flops, dims)}")
    print(f"bytes = {_formula(cost.bytes, dims)}")
    print(f"time [s] = {_formula(cost.time, dims)}")
    print(f"kernels = {cost.kernels}")
    print("per kernel:")
    for i, (label, c) in enumerate(cost.rows):
        ops = f" ({' '.join(c.ops)})" if label.startswith("fusion") else ""
        print(f"{i:>3}  {terminal_text(label)}{ops}")
        print(f"       FLOPs = {_formula(c.flops, dims)}; bytes = {_formula(c.bytes, dims)}; "
              f"time [s] = {_formula(c.time, dims)}")


# Significant digits of the coefficients in a printed formula: the calibrated rates
# behind them are good to a few percent, more digits would be noise.
FORMULA_DIGITS = 4


# sympy.simplify's time grows exponentially in Piecewise/Min/Max/ceiling terms (the CPU cost
# model's regimes: `cost --target cpu --symbolic` sat in piecewise_fold for 14 minutes on
# MiniLM); past this size, or with such terms, the formula is only expanded (about 1 s).
SIMPLIFY_MAX_OPS = 200


def _formula(expr, dims: dict[str, int]) -> str:
    import sympy

    expr = _subs(sympy.sympify(expr), dims)
    regimes = expr.has(sympy.Piecewise, sympy.Min, sympy.Max, sympy.floor, sympy.ceiling)
    if not regimes and sympy.count_ops(expr) <= SIMPLIFY_MAX_OPS:
        expr = sympy.simplify(expr)  # cancels
    expr = sympy.expand(expr)  # lists terms
    return str(expr.xreplace({f: sympy.Float(f, FORMULA_DIGITS) for f in expr.atoms(sympy.Float)}))


def _time_unit(seconds: float) -> tuple[str, float]:
    """The unit that shows `seconds` as a number >= 1: s, ms or us."""
    for unit, scale in (("s", 1.0), ("ms", 1e3)):
        if seconds >= 1 / scale:
            return unit, scale
    return "us", 1e6


def format_time(seconds: float) -> str:
    unit, scale = _time_unit(seconds)
    return f"{seconds * scale:.4g} {unit}"


def format_count(x: float) -> str:
    """12.3G, 4.56M, 789: a count with a decimal SI prefix."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{prefix}"
    return f"{x:.4g}"


# --- shared by cost, compile --report and tilegraph-opt ---------------------------------

def parse_dims(items: Sequence[str]) -> dict[str, int]:
    """`["batch=8", "seq=128"]` -> {"batch": 8, "seq": 128}; a TilegraphError for anything else."""
    from tilegraph.ir.errors import TilegraphError

    sizes: dict[str, int] = {}
    for item in items:
        name, _, size = item.partition("=")
        if not name.strip() or not (size.strip().isdecimal() and size.strip().isascii()) or int(size) < 1:
            raise TilegraphError(f"--dim takes NAME=SIZE with a positive integer size, got '{item}'")
        if name.strip() in sizes:
            raise TilegraphError(f"--dim {name.strip()} is given twice ({name.strip()}={sizes[name.strip()]} and "
                                 f"{item}); give each dimension once")
        sizes[name.strip()] = int(size)
    return sizes


def sizes_for(symbols: set[str], dims: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """A size for every symbol: the --dim given, else DEFAULT_DIM; and the names defaulted."""
    defaulted = sorted(symbols - dims.keys())
    return {**{name: DEFAULT_DIM for name in defaulted}, **dims}, defaulted


def describe_sizes(sizes: dict[str, int], defaulted: Sequence[str]) -> str:
    """'batch=8, seq=128 (seq: default 128; set with --dim NAME=SIZE)'."""
    note = f" ({', '.join(defaulted)}: default {DEFAULT_DIM}; set with --dim NAME=SIZE)" if defaulted else ""
    return ", ".join(f"{k}={v}" for k, v in sorted(sizes.items())) + note


def check_dims(dims: dict[str, int], symbols: set[str]) -> None:
    from tilegraph.ir.errors import TilegraphError

    unknown = sorted(dims.keys() - symbols)
    if unknown:
        known = ", ".join(sorted(symbols)) or "none: every dimension is static"
        raise TilegraphError(f"--dim {', '.join(unknown)}: not a symbolic dimension of the model "
                             f"(its symbolic dimensions: {known})")


def _input_symbols(model) -> set[str]:
    import sympy

    return {s.name for info in model.inputs for d in info.shape if isinstance(d, sympy.Expr)
            for s in d.free_symbols}


def _cost_symbols(cost) -> set[str]:
    import sympy

    return {s.name for _, c in cost.rows for e in (c.flops, c.bytes, c.time)
            for s in sympy.sympify(e).free_symbols}


def _subs(expr, dims: dict[str, int]):
    """`expr` with the symbols named in `dims` (matched by name: assumptions may differ) replaced."""
    return expr.subs({s: dims[s.name] for s in expr.free_symbols if s.name in dims})


# --- shard: the sharding plan ---------------------------------------------------------

def _shard(args) -> int:
    import tilegraph
    from tilegraph.ir.errors import TilegraphError
    from tilegraph.passes.cost.collectives import Mesh, parse_mesh
    from tilegraph.ir.hardware import GPUS, hardware
    from tilegraph.passes.registry import UNFUSED_PIPELINE, run_pipeline
    from tilegraph.passes.shard import parse_memory, plan

    try:
        shape, budget = parse_mesh(args.mesh), parse_memory(args.memory)
    except ValueError as e:
        raise TilegraphError(str(e)) from None
    if str(args.target).lower() not in GPUS:  # (before hardware(): "cpu" would calibrate this machine)
        raise TilegraphError(f"--target {args.target}: sharding plans are for GPUs ({', '.join(GPUS)})")
    hw = hardware(args.target)
    dims = parse_dims(args.dim)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    with StatusLine("tilegraph shard") if show else contextlib.nullcontext() as status:
        if status:
            status("importing the model")
        model = run_pipeline(tilegraph.import_model(args.model),
                             UNFUSED_PIPELINE if args.pipeline is None else args.pipeline)
        symbols = _input_symbols(model)
        check_dims(dims, symbols)
        sizes, defaulted = sizes_for(symbols, dims)
        p = plan(model.module, Mesh(shape, hw), budget=budget, sizes=sizes, training=not args.inference,
                 names=model.input_names, progress=status)
    print(f"{Path(args.model).name} on {p.mesh} x {hw.name} ({p.mesh.devices} devices), "
          f"{'forward pass' if args.inference else 'training step'}")
    if sizes:
        print(f"sizes: {describe_sizes(sizes, defaulted)}")
    _print_plan(p)
    if args.symbolic:
        print(f"step time [s] = {_formula(p.formula, dims)}")
    return 0


# How often a status line on a terminal is redrawn (its elapsed time ticks while a stage runs).
STATUS_REFRESH_S = 0.5


class StatusLine:
    """A long command's progress on stderr: the stage it is in and how long it has run.

    On a terminal, one line redrawn in place (by a thread, so the time ticks while one call,
    such as the integer program's solve, runs) and cleared at the end. Elsewhere (--progress
    into a file or a pipe), one line per stage, so a log is not filled with redraws."""

    def __init__(self, tool: str, stream=None):
        self.tool, self.stream = tool, stream or sys.stderr
        self.live = self.stream.isatty()
        self.stage, self.started = "", time.perf_counter()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, stage: str) -> None:
        with self._lock:
            self.stage = stage
            if self.live:
                self._draw()
            else:
                print(f"{self.tool}: {stage} ({time.perf_counter() - self.started:.1f} s)", file=self.stream,
                      flush=True)

    def _draw(self) -> None:
        self.stream.write(f"\r\x1b[K{self.tool}: {self.stage} ({time.perf_counter() - self.started:.0f} s)")
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(STATUS_REFRESH_S):
            with self._lock:
                self._draw()

    def __enter__(self) -> "StatusLine":
        if self.live:
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.stream.write("\r\x1b[K")  # the line goes: the plan (or the error) is printed next
            self.stream.flush()


def _print_plan(p) -> None:
    from tilegraph.passes.shard import SOLVE_TIME_LIMIT, recompute_text

    start, period, copies = p.layers
    parts = [("", 0, len(p.choices))] if not copies else [
        ("before the layers", 0, start),
        (f"each of {copies} repeated blocks (ops {start}..{start + period - 1}, the same plan in every block; "
         "ops that differ are listed before and after)", start, start + period),
        ("after the layers", start + period * copies, len(p.choices))]
    for title, lo, hi in parts:
        rows = p.choices[lo:hi]
        if not rows:
            continue
        if title:
            print(f"-- {title}")
        width = max(len(c.node.label) for c in rows)
        for c in rows:
            if c.node.op is None or c.node.op.op_name in ("weight", "constant") or not (c.compute or c.comm):
                continue
            print(f"  {c.node.label:<{width}}  {c.strategy.name:<12}  compute {format_time(c.compute):>10}  "
                  f"comm {format_time(c.comm):>10}")
        split = [f"{c.node.label} {spec_text(c.strategy.out)}" for c in rows
                 if c.node.op is not None and c.node.op.op_name == "weight" and c.strategy.name != "R"]
        inputs = [f"{c.node.label} {spec_text(c.strategy.out)}" for c in rows if c.node.op is None]
        if inputs:
            print(f"  inputs: {', '.join(inputs)}")
        if split:
            print(f"  weights split: {', '.join(split)}")
    print(f"forward collectives per step: {len(p.forward)} "
          f"({', '.join(sorted(set(k for k, _, _ in p.forward))) or 'none'})")
    share = p.comm / p.time if p.time else 0.0
    print(f"predicted step time: {format_time(p.time)} = compute {format_time(p.compute)} + communication "
          f"{format_time(p.comm)} ({100 * share:.1f}% communication)")
    budget = p.budget or p.mesh.hw.memory_bytes
    print(f"memory per device: {p.memory / 1e9:.4g} GB (budget {budget / 1e9:.4g} GB"
          + (f" of {p.mesh.hw.memory_bytes / 1e9:.4g} GB" if budget != p.mesh.hw.memory_bytes else "") + "); "
          f"ZeRO stage {p.zero}, {recompute_text(p)} in the backward")
    if p.runner_up is not None:
        tie = " (a different layout, predicted as fast)" if p.runner_up.time <= p.time * (1 + 1e-9) else ""
        print(f"runner-up: {format_time(p.runner_up.time)} (compute {format_time(p.runner_up.compute)} + "
              f"communication {format_time(p.runner_up.comm)}){tie}")
    cut = f"; stopped at the {SOLVE_TIME_LIMIT:g} s limit: the best plan found, not proven best" if p.cut_short else ""
    print(f"solved in {p.solve_time:.2f} s ({p.variables} variables{cut})")


def _run(args) -> int:
    import numpy as np

    import tilegraph
    from tilegraph.backends import distributed
    from tilegraph.ir import interpret
    from tilegraph.ir.errors import TilegraphError
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.passes.cost.collectives import parse_mesh
    from tilegraph.passes.partition import partition
    from tilegraph.passes.registry import UNFUSED_PIPELINE, run_pipeline
    from tilegraph.testing import narrowest_float, random_inputs, reduction_length, relative_error, tolerance

    try:
        shape = parse_mesh(args.mesh if args.mesh else args.devices)
    except ValueError as e:
        raise TilegraphError(str(e)) from None
    if int(np.prod(shape)) != args.devices or args.devices < 1:
        raise TilegraphError(f"--mesh {args.mesh} has {int(np.prod(shape))} devices, --devices says {args.devices}")
    model = run_pipeline(tilegraph.import_model(args.model),
                         UNFUSED_PIPELINE if args.pipeline is None else args.pipeline)
    symbols = _input_symbols(model)
    dims = parse_dims(args.dim)
    check_dims(dims, symbols)
    sizes = {**{s: args.devices for s in symbols}, **dims}
    given = ",".join(f"{k}={v}" for k, v in sorted(sizes.items()))
    mesh = "x".join(map(str, shape))
    annotated = run_pipeline(model, f'shard{{mesh={mesh} target={args.target} inference=true sizes="{given}"}}')
    program = partition(annotated, sizes)
    inputs = random_inputs(model, seed=args.seed, sizes=sizes, int_high=VALID_INT_HIGH)
    repeats = max(1, args.repeats)
    overlap = not args.no_overlap
    # --compare: the other run interleaved with this one in the same processes (distributed.compare).
    modes = [(None if args.op_by_op else args.backend, overlap)]
    if args.compare:
        modes.append((args.backend if args.op_by_op else None, overlap))
    runs, times = distributed.compare([program], inputs, modes, repeats)
    got = runs[0]
    expected = interpret(model, inputs)
    n = reduction_length(model, bind_inputs(model, inputs)[1])
    collectives = sum(1 for op in program.model.func.walk() if op.name.startswith("shard."))
    print(f"{Path(args.model).name}: {args.devices} processes (mesh {mesh}, gloo), {collectives} collectives per "
          f"device; sizes {given}")
    step = float(np.median(times[0]))
    backend_name = {"numpy": "NumPy", "c": "C"}[args.backend]
    how = "op by op" if args.op_by_op else f"compiled ({backend_name} backend between collectives)"
    print(f"step: {step * 1e3:.2f} ms {how}, median of {repeats}, the slowest process"
          f"{'' if args.no_overlap else ', collectives overlapped'}")
    if args.compare:
        import time

        one = distributed.compile_for(model, args.backend)
        one(*inputs)  # binds: the C backend packs its weights on the first call
        single = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            one(*inputs)
            single.append(time.perf_counter() - t0)
        other = float(np.median(times[1]))
        print(f"{f'compiled ({backend_name})' if args.op_by_op else 'op by op'}: {other * 1e3:.2f} ms "
              f"({other / step:.2f}x this run); one process, {backend_name} backend: "
              f"{float(np.median(single)) * 1e3:.2f} ms ({float(np.median(single)) / step:.2f}x this run)")
    ok = True
    for name, a, e in zip(model.output_names, got, expected):
        dtype = narrowest_float(model) or "f32"
        rtol, _ = tolerance(dtype, n)
        err = relative_error(a, e)
        good = a.shape == e.shape and not nonfinite_differ(a, e) and err <= rtol
        ok &= good
        print(f"{name}: shape {a.shape}, relative error vs one device (float64) {err:.3e} "
              f"(tolerance {rtol:.1e}) {'ok' if good else 'MISMATCH'}")
    for a, e in ((a, e) for other in runs[1:] for a, e in zip(other, expected)):
        if not (a.shape == e.shape and not nonfinite_differ(a, e) and relative_error(a, e) <= rtol):
            ok = False
            print(f"the compared run differs from one device: relative error {relative_error(a, e):.3e}")
    print("agree" if ok else "the distributed run differs from one device")
    return 0 if ok else EXIT_MISMATCH


def spec_text(spec) -> str:
    from tilegraph.passes.shard_strategies import spec_str

    return spec_str(spec)


COMMANDS = {"import": _import, "compile": _compile, "check": _check, "calibrate": _calibrate, "cost": _cost,
            "quantize": _quantize, "shard": _shard, "run": _run, "export": _export}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_reporting_errors(f"tilegraph {args.command}", lambda: COMMANDS[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
