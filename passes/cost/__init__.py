"""The cost model's formulas (model.py) and collectives (collectives.py).

What a machine can do lives below passes and backends, in `ir/hardware.py`
(`passes.cost.hardware` is the same module); the NumPy backend measures this
machine's CPU profile (`backends/numpy/calibrate.py`, `tilegraph calibrate`).
Nothing is imported here, so importing a submodule stays cheap.
"""
