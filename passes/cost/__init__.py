"""The cost model's inputs and formulas.

    hardware.py   what a machine can do: datasheet GPUs and this machine's measured CPU profile
    calibrate.py  measures this machine (`tilegraph calibrate`)

Nothing is imported here, so `import passes.cost.hardware` stays cheap.
"""
