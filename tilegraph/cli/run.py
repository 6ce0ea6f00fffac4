"""`tilegraph run`: the sharded program on local processes, checked against one process."""

from __future__ import annotations

from pathlib import Path

from tilegraph.cli.common import EXIT_MISMATCH, VALID_INT_HIGH, _input_symbols, check_dims, nonfinite_differ, parse_dims


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
    from tilegraph.accuracy import (
        narrowest_float,
        random_inputs,
        reduction_length,
        relative_error,
        tolerance,
    )

    try:
        shape = parse_mesh(args.mesh if args.mesh else args.devices)
    except ValueError as e:
        raise TilegraphError(str(e)) from None
    if int(np.prod(shape)) != args.devices or args.devices < 1:
        raise TilegraphError(f"--mesh {args.mesh} has {int(np.prod(shape))} devices, --devices says {args.devices}")
    model = run_pipeline(tilegraph.import_model(args.model, trust_pickle=args.trust_pickle),
                         UNFUSED_PIPELINE if args.pipeline is None else args.pipeline)
    symbols = _input_symbols(model)
    dims = parse_dims(args.dim)
    check_dims(dims, symbols)
    sizes = {**{s: args.devices for s in symbols}, **dims}
    given = ",".join(f"{k}={v}" for k, v in sorted(sizes.items()))
    mesh = "x".join(map(str, shape))
    annotated = run_pipeline(model, f'shard{{mesh={mesh} hardware={args.hardware} inference=true sizes="{given}"}}')
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
    for name, a, want in zip(model.output_names, got, expected):
        dtype = narrowest_float(model) or "f32"
        rtol, _ = tolerance(dtype, n)
        err = relative_error(a, want)
        good = a.shape == want.shape and not nonfinite_differ(a, want) and err <= rtol
        ok &= good
        print(f"{name}: shape {a.shape}, relative error vs one device (float64) {err:.3e} "
              f"(tolerance {rtol:.1e}) {'ok' if good else 'MISMATCH'}")
    for a, want in ((a, w) for other in runs[1:] for a, w in zip(other, expected)):
        if not (a.shape == want.shape and not nonfinite_differ(a, want) and relative_error(a, want) <= rtol):
            ok = False
            print(f"the compared run differs from one device: relative error {relative_error(a, want):.3e}")
    print("agree" if ok else "the distributed run differs from one device")
    return 0 if ok else EXIT_MISMATCH
