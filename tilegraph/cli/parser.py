"""The command line: one argparse subcommand per command, with the options they share."""

from __future__ import annotations

import argparse

from tilegraph.cli.common import DEFAULT_DIM


def _parser() -> argparse.ArgumentParser:
    from tilegraph.backends import (
        TARGETS,  # the code generators tilegraph.compile knows
    )

    p = argparse.ArgumentParser(prog="tilegraph", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    imp = sub.add_parser("import", help="import an .onnx or .pt2 model into tg IR")
    _shared(imp, output="where to write the .mlir (weights go beside it)")

    comp = sub.add_parser("compile", help="compile a model and write the emitted source")
    _shared(comp, output="where to write the emitted source (.py)", pipeline=PIPELINE,
            dim="with --report: evaluate the planned peak at this size of a symbolic dimension")
    comp.add_argument("--target", default="numpy", choices=list(TARGETS),
                      help="code generator: numpy (readable NumPy), c (native C and oneDNN, what "
                           "tilegraph.compile uses by default where it builds) or triton (@triton.jit kernels for "
                           "a GPU, fused and tiled for it) (default: numpy, the readable one)")
    comp.add_argument("--report", action="store_true",
                      help="print kernel count, planned buffers, planned peak memory and weight bytes")

    check = sub.add_parser("check", help="run tilegraph and onnxruntime on the same random inputs and compare")
    _shared(check, model="model.onnx", pt2=False, pipeline=PIPELINE,
            dim="size of a symbolic dimension, e.g. --dim batch=2 (default: drawn from the seed)")
    check.add_argument("--seed", type=_non_negative, default=0)
    check.add_argument("--int-high", type=_positive, default=2, metavar="N",
                       help="integer inputs are drawn from [0, N) (default 2: masks and flags in {0, 1}); "
                            "ids of an embedding from its whole table")

    # --- quantize: calibrate activations, then the quantize pass (passes/quantize/) ---
    from tilegraph.ir.block_formats import FORMATS as BLOCK_FORMATS
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
                         "float, whichever is predicted fastest on --hardware, keeping the relative output error on "
                         "the calibration samples within this")
    qz.add_argument("--min-cosine", type=float, default=None,
                    help="mixed precision, as --max-error: keep the outputs' mean cosine similarity at least this")
    qz.add_argument("--fallback", default="w8", choices=["none", *SCHEMES],
                    help="with --max-error / --min-cosine: a second scheme a layer may get (default: w8)")
    _hardware(qz, "cpu", "with --max-error / --min-cosine: the hardware the speed is predicted for")
    qz.add_argument("--block-format", default=None, choices=list(BLOCK_FORMATS),
                    help="with -o x.gguf and a transformers model folder (config.json and its weights): write a "
                         "GGUF file, matrices in this GGUF block format (default: q8_0), read by tilegraph.compile "
                         "and llama.cpp alike")
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

    # --- generate, chat: a language model from a .gguf file or an ONNX decoder-with-past file
    # (optimum's, onnxruntime-genai's; its tokenizer.json beside it) (tilegraph/generation.py) ---
    for name, help_text in (("generate", "generate text from a prompt with a .gguf or ONNX decoder language model"),
                            ("chat", "chat with a .gguf or ONNX decoder language model through its chat template "
                                     "(stdin, or one -p prompt)")):
        gen = sub.add_parser(name, help=help_text)
        gen.add_argument("model", help="model.gguf, or an ONNX decoder with past_key_values.N.* inputs")
        gen.add_argument("-p", "--prompt", action="append", default=None,
                         help="the prompt (repeat it to decode several prompts together)" if name == "generate"
                         else "one user message: answer it and exit (default: read messages from stdin)")
        gen.add_argument("-n", "--max-new-tokens", type=_positive, default=128 if name == "chat" else 64)
        gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
        gen.add_argument("--top-k", type=_non_negative, default=0)
        gen.add_argument("--top-p", type=float, default=1.0)
        gen.add_argument("--repetition-penalty", type=float, default=1.0)
        gen.add_argument("--seed", type=_non_negative, default=0)
        gen.add_argument("--threads", type=_positive, default=None, help="CPU threads (target c)")
        gen.add_argument("--target", default=None, choices=("numpy", "c"),
                         help="backend (default: c where it builds, else numpy)")
        gen.add_argument("--cache-len", type=_positive, default=None,
                         help="KV cache positions per sequence (default: 2048 or the model's context)")
        gen.add_argument("--fast", action="store_true",
                         help="llama.cpp's numerics: activations rounded to int8 per 32 values, an f16 KV cache "
                              "(default: exact f32)")
        if name == "generate":
            gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")

    # --- cost: the cost model's prediction, kernel by kernel (passes/cost/model.py) ---
    cost = sub.add_parser("cost", help="predict FLOPs, bytes and time of every kernel on some hardware",
                          description="Run the pipeline, then print the cost model's prediction for every "
                                      "kernel (fused group or unfused op) and the totals. Passes with a "
                                      "`hardware` option (fuse, tile) decide for --hardware unless the pipeline "
                                      "names one, e.g. -p 'canonicalize,fuse{hardware=cpu}'.")
    _shared(cost, pipeline=PIPELINE,
            dim=f"size of a symbolic dimension, e.g. --dim batch=8 (default: {DEFAULT_DIM} each)")
    _hardware(cost, "cpu", "the hardware priced (cpu: this machine's calibrated profile for the NumPy backend; c: "
                           "the same for the C backend)")
    cost.add_argument("--symbolic", action="store_true",
                      help="print the formulas (FLOPs, bytes, time as functions of the symbolic dims)")
    cost.add_argument("--decode", action="store_true",
                      help="a .gguf language model or an ONNX decoder-with-past file: price one decode step (bytes "
                           "of weights and cache read per token against the target's memory bandwidth): predicted "
                           "tokens/s and the bound")
    cost.add_argument("--depth", type=_non_negative, default=0,
                      help="with --decode: positions already in the cache (default 0)")
    cost.add_argument("--batch", type=_positive, default=1, help="with --decode: sequences decoded together")
    cost.add_argument("--cache-dtype", choices=["f32", "f16"], default="f32",
                      help="with --decode: the K/V cache's type (f16: generate/chat --fast's, half the bytes)")

    # --- shard: the sharding planner's plan (passes/shard.py) ---
    shard = sub.add_parser("shard", help="plan how to split a model over a device mesh (predicted step time)",
                           description="Run the pipeline, then the `shard` pass's planner: for every op a "
                                       "sharding on the mesh, chosen by an integer program minimizing the "
                                       "predicted training step time (compute + collectives) under the "
                                       "per-device memory budget. Prints the plan per layer, the step time, "
                                       "its compute/communication split and the memory per device.")
    _shared(shard, pipeline="passes to run before planning (default: the unfused default pipeline)",
            dim=f"size of a symbolic dimension to plan at (default: {DEFAULT_DIM} each)", model_optional=True)
    shard.add_argument("--config", default=None,
                       help="plan the model a configuration describes instead of a model file: a transformers-style "
                            "config.json (GPT-2's or Llama's fields) or a named shape (llama-7b, llama-13b, "
                            "llama-70b, gpt2, gpt2-xl); its weights are never materialised")
    shard.add_argument("--mesh", default="8", help="device mesh: 8, or 2x4 (axes; the last inside a node)")
    _hardware(shard, "h100", "the devices", gpus=True)
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
    _hardware(dist, "h100", "the devices the plan is costed for", gpus=True)
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
TRUST_PICKLE = ("trust a .pt2 model (one you made): hand it to torch.export.load unchecked, which unpickles its "
                "pickled members and loads its shared libraries, so the file can run any code as you. Without "
                "it a .pt2 is read through an allow-list of torch's plain layout, and one holding anything that "
                "could run code (pickles, aotinductor/ libraries, the legacy layout) is refused by name "
                "(exit 2). Other model files ignore it")


def _shared(parser: argparse.ArgumentParser, model: str = MODEL, output: str | None = None,
            pipeline: str | None = None, dim: str | None = None, model_optional: bool = False,
            pt2: bool = True) -> None:
    """The options commands share, each added with the command's help text (None: it has none): the
    model file (optional where another option can name the model), --trust-pickle (where it
    may be a .pt2), -o/--output (required), -p/--pipeline and --dim NAME=SIZE (repeatable)."""
    parser.add_argument("model", help=model, nargs="?" if model_optional else None)
    if pt2:
        parser.add_argument("--trust-pickle", action="store_true", help=TRUST_PICKLE)
    if output:
        parser.add_argument("-o", "--output", required=True, help=output)
    if pipeline:
        parser.add_argument("-p", "--pipeline", default=None, help=pipeline)
    if dim:
        parser.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE", help=dim)


def _hardware(parser: argparse.ArgumentParser, default: str, help: str, gpus: bool = False) -> None:
    """--hardware: a target of ir/hardware.TARGETS (only its GPUs where `gpus`; the command names
    another one in its error)."""
    from tilegraph.ir.hardware import GPUS, TARGETS

    names = GPUS if gpus else TARGETS
    parser.add_argument("--hardware", default=default, help=f"{help}: {', '.join(names)} (default: {default})")


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
