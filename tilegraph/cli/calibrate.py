"""`tilegraph calibrate`: measure this machine for the cost model."""

from __future__ import annotations


def _calibrate(args) -> int:
    if args.target == "c":
        from tilegraph.backends.c import calibrate
    else:
        from tilegraph.backends.numpy import calibrate

    calibrate.run(quick=args.quick, output=args.output)
    return 0
