"""`tilegraph quantize`: observe activation ranges on sample inputs, choose schemes, write the quantized model."""

from __future__ import annotations

import sys
from pathlib import Path

from tilegraph.cli.common import format_count, refuse_overwriting, write_together
from tilegraph.ir.model import weights_path


def _quantize(args) -> int:
    import tilegraph
    from tilegraph.ir.errors import TilegraphError

    if Path(args.output).suffix == ".gguf" or args.block_format is not None:
        return _quantize_to_gguf(args)
    from tilegraph.passes.quantize import (
        SCHEMES,
        linear_layers,
        quantize_model,
        save_ranges,
    )
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
            check_target(args.hardware)
        except ValueError as e:
            raise TilegraphError(str(e)) from None
    if args.rounding == "gptq" and args.calib is None:
        raise TilegraphError("--rounding gptq needs --calib: it rounds each layer against its inputs on the "
                             "calibration samples")
    model = run_pipeline(tilegraph.import_model(args.model, trust_pickle=args.trust_pickle), UNFUSED_PIPELINE)
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
        hardware=args.hardware, progress=lambda it, what: tqdm(it, desc=what, unit=units[what], file=sys.stderr))
    quantized, ranges, plan = result.model, result.ranges, result.plan
    for line in plan.remarks if plan else []:
        print(line)
    proto = None
    if args.export_onnx:  # before anything is written: an op ONNX cannot hold stops it all
        from tilegraph.backends.onnx_export import to_onnx

        proto = to_onnx(quantized, Path(args.export_onnx).stem)
    write_together({weights_path(out): quantized.weights.save, out: lambda p: p.write_text(quantized.text)})
    if ranges is not None:
        save_ranges(calib_path, ranges)
    layers = result.layers
    what, how = f"{layers} linear layers ({args.scheme}", ""
    if mixed:  # say what the search chose, not what it was offered
        from collections import Counter

        got = Counter(plan.formats.values())
        floats = got.pop("none", 0)
        what = f"{layers - floats} of {layers} linear layers ("
        how = ", ".join([f"{n} {scheme}" for scheme, n in got.most_common()] + ([f"{floats} float"] if floats else [])
                        ) + f"; chosen for {args.hardware}"
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


def _quantize_to_gguf(args) -> int:
    """A transformers model folder (config.json, *.safetensors or pytorch_model.bin) -> a GGUF file."""
    import json

    import numpy as np

    from tilegraph.frontends.gguf.writer import write_gguf
    from tilegraph.ir.errors import TilegraphError

    folder, out = Path(args.model), Path(args.output)
    if out.suffix != ".gguf":
        raise TilegraphError(f"--block-format writes a GGUF file: -o {out} must end in .gguf")
    if not (folder / "config.json").is_file():
        raise TilegraphError(f"{folder}: a GGUF file is written from a transformers model folder (config.json and "
                             "its weights)")
    refuse_overwriting(folder / "config.json", out)
    config = json.loads((folder / "config.json").read_text())
    state = _state_dict(folder)
    fmt = args.block_format or "q8_0"
    tmp = out.with_name(out.name + ".partial")
    try:
        formats = write_gguf(tmp, config, state, fmt)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    floats = sum(int(np.asarray(v).size) * 4 for v in state.values())
    counts: dict[str, int] = {}
    for f in formats.values():
        counts[f] = counts.get(f, 0) + 1
    print(f"wrote {out}: {len(formats)} tensors ({', '.join(f'{n} {f}' for f, n in sorted(counts.items()))}); "
          f"{format_count(floats)}B as f32 -> {format_count(out.stat().st_size)}B")
    return 0


def _state_dict(folder: Path) -> dict:
    """The folder's weights as NumPy arrays, from safetensors (every *.safetensors) or pytorch_model.bin."""
    from tilegraph.ir.errors import TilegraphError

    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        from safetensors import safe_open

        state = {}
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:  # pt: bfloat16 weights, which NumPy has not
                for key in f.keys():
                    state[key] = f.get_tensor(key).float().numpy()
        return state
    path = folder / "pytorch_model.bin"
    if not path.is_file():
        raise TilegraphError(f"{folder} has no *.safetensors and no pytorch_model.bin")
    import torch

    return {k: v.float().numpy() for k, v in torch.load(path, map_location="cpu", weights_only=True).items()}
