"""`tilegraph cost`: the cost model's table and formulas."""

from __future__ import annotations

from pathlib import Path

from tilegraph.cli.common import (
    _cost_symbols,
    _formula,
    _input_symbols,
    _time_unit,
    check_dims,
    describe_sizes,
    format_count,
    parse_dims,
    sizes_for,
)
from tilegraph.passes.registry import with_target


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
