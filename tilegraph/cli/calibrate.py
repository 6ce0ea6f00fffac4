"""`tilegraph calibrate`: measure this machine for the cost model."""

from __future__ import annotations

import importlib


def _calibrate(args) -> int:
    backend = "c" if args.target == "c" else "numpy"
    calibrate = importlib.import_module(f"tilegraph.backends.{backend}.calibrate")
    calibrate.run(quick=args.quick, output=args.output)
    return 0
