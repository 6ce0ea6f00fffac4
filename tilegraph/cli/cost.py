"""`tilegraph cost`: the cost model's table and formulas."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tilegraph.cli.common import (_cost_symbols, _formula, _input_symbols, _time_unit, check_dims, describe_sizes,
                                  format_count, parse_dims, sizes_for)
from tilegraph.passes.registry import with_hardware


def _cost(args) -> int:
    import tilegraph
    from tilegraph.ir.hardware import hardware
    from tilegraph.passes.cost.model import module_cost
    from tilegraph.passes.registry import DEFAULT_PIPELINE, run_pipeline

    hw = hardware(args.hardware)  # an unknown hardware name or a bad --dim fails before any import work
    if getattr(args, "decode", False):
        return _decode_cost(args, hw)
    dims = parse_dims(args.dim)
    pipeline = with_hardware(DEFAULT_PIPELINE if args.pipeline is None else args.pipeline, hw.name)
    model = run_pipeline(tilegraph.import_model(args.model, trust_pickle=args.trust_pickle), pipeline)
    cost = module_cost(model.module, hw)
    symbols = _input_symbols(model) | _cost_symbols(cost)
    check_dims(dims, symbols)
    print(f"{Path(args.model).name} on {hw.name}" + (f" ({hw.source})" if hw.device == "cpu" else ""))
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


def _decode_cost(args, hw) -> int:
    """One decode step of a language model (a .gguf file, or an ONNX decoder-with-past file) at
    cache depth --depth: the bytes it must read (every weight once, as stored; the cache's K and V
    up to the depth, at --cache-dtype's size), the bound that memory bandwidth puts on tokens/s,
    and the cost model's prediction of the step."""
    from tilegraph.ir.errors import TilegraphError
    from tilegraph.passes.cost.model import at, module_cost
    from tilegraph.passes.registry import DEFAULT_PIPELINE, run_pipeline

    suffix = Path(args.model).suffix.lower()
    if suffix not in (".gguf", ".onnx"):
        raise TilegraphError(f"--decode prices a language model's decode step: it needs a .gguf file or an ONNX "
                             f"decoder-with-past .onnx file, not {args.model}")
    step = _gguf_step(args) if suffix == ".gguf" else _onnx_step(args)
    batch = args.batch
    elem = {"f32": 4, "f16": 2}[args.cache_dtype]
    cache_bytes = 2 * step.layers * batch * step.kv_heads * (args.depth + 1) * step.head_dim * elem
    per_step = step.weight_bytes + cache_bytes
    bound = hw.memory_bandwidth / per_step * batch
    predicted = float(at(module_cost(run_pipeline(step.model, DEFAULT_PIPELINE).module, hw).time, {}))
    print(f"{Path(args.model).name}: {step.arch}, {step.layers} layers, decode of {batch} sequence(s) at cache depth "
          f"{args.depth}, on {hw.name}" + (f" ({hw.source})" if hw.device == "cpu" else ""))
    print(f"bytes read per step: {format_count(step.weight_bytes)} of weights + {format_count(cache_bytes)} of "
          f"{args.cache_dtype} KV cache "
          f"= {format_count(per_step)}")
    print(f"memory bandwidth {hw.memory_bandwidth / 1e9:.1f} GB/s: at most {bound:.1f} tokens/s")
    print(f"cost model: {predicted * 1e3:.2f} ms per step, {batch / predicted:.1f} tokens/s "
          f"({100 * batch / predicted / bound:.0f}% of the bound)")
    return 0


@dataclass
class _DecodeStep:
    """A decode step's model (one token per sequence over a cache of depth + 1 positions), its
    cache's sizes, and the bytes of weights the step reads."""

    arch: str
    layers: int
    kv_heads: int
    head_dim: int
    weight_bytes: int
    model: Any


def _gguf_step(args) -> _DecodeStep:
    from tilegraph.frontends.gguf.llama import LlamaConfig, build, load_weights
    from tilegraph.frontends.gguf.reader import GGUFFile

    f = GGUFFile(args.model)
    c = LlamaConfig.of(f)
    _check_depth(args.depth, c.context)
    weights, formats = load_weights(f, c)
    model = build(c, weights, formats, args.batch, 1, args.depth + 1, cache_dtype=args.cache_dtype)
    return _DecodeStep(c.arch, c.layers, c.kv_heads, c.head_dim, _weight_bytes_read(model), model)


def _onnx_step(args) -> _DecodeStep:
    from tilegraph.frontends.onnx.kv_cache import OnnxDecoder

    decoder = OnnxDecoder(args.model)  # not ONNX, or no past/present pattern: a named error
    _check_depth(args.depth, decoder.context())
    model = decoder.build(args.batch, 1, args.depth + 1, cache_dtype=args.cache_dtype)
    p = decoder.plan
    return _DecodeStep("ONNX decoder", p.layers, p.kv_heads, p.head_dim, _weight_bytes_read(model), model)


def _check_depth(depth: int, context: int) -> None:
    from tilegraph.ir.errors import TilegraphError

    if depth + 1 > context:  # before the model is built at that depth
        raise TilegraphError(f"--depth {depth} is past the model's context of {context}")


def _weight_bytes_read(model) -> int:
    """Bytes of `model`'s weights one run reads, as the cost model counts them (`cold_bytes`)."""
    from tilegraph.ir.dialect import TgOp
    from tilegraph.passes.cost.model import cold_bytes

    return int(cold_bytes([op for op in model.ops() if isinstance(op, TgOp)]))
