"""`tilegraph import` and `tilegraph compile` (with --report)."""

from __future__ import annotations

import ast
from pathlib import Path

from tilegraph.cli.common import (_input_symbols, _subs, check_dims, format_count, parse_dims, refuse_overwriting,
                                  write_together)
from tilegraph.ir.model import weights_path
from tilegraph.passes.registry import with_hardware


def _import(args) -> int:
    import tilegraph

    refuse_overwriting(args.model, args.output, Path(args.output).with_suffix(".weights.npz"))
    model = tilegraph.import_model(args.model, trust_pickle=args.trust_pickle)
    out = Path(args.output)
    write_together({weights_path(out): model.weights.save, out: lambda p: p.write_text(model.text)})
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
    pipeline = None if args.pipeline is None else with_hardware(args.pipeline, hardware)
    imported = tilegraph.import_model(args.model, trust_pickle=args.trust_pickle)
    compiled = tilegraph.compile(imported, target=args.target, pipeline=pipeline)
    report = _report(compiled, dims, hardware, imported) if args.report else []  # a bad --dim fails before anything is written
    out = Path(args.output)
    weights = out.with_suffix(".weights.npz")
    write_together({weights: compiled.model.weights.save, out: lambda p: p.write_text(compiled.source)})
    print(f"wrote {out} ({len(compiled.source.splitlines())} lines) and {weights.name}")
    for line in report:
        print(line)
    return 0


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
