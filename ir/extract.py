"""A run of ops of a model's @forward as a model of its own.

`extract(model, ops, inputs, outputs)`: a new @forward whose arguments are `inputs`
(values defined before `ops`), whose body is a copy of `ops`, and which returns
`outputs`, with the weights those ops read. Pipeline stages (passes/parallel_degrees.py) and the
compiled segments between a per-device program's collectives (backends/distributed.py)
are made this way.
"""

from __future__ import annotations

from typing import Sequence

from xdsl.dialects.builtin import FunctionType, ModuleOp
from xdsl.dialects.func import FuncOp, ReturnOp
from xdsl.ir import Block, Operation, Region, SSAValue

from tilegraph.ir.model import Model, WeightStore


def extract(model: Model, ops: Sequence[Operation], inputs: Sequence[SSAValue], outputs: Sequence[SSAValue],
            arg_attrs=None, res_attrs=None) -> Model:
    block = Block(arg_types=[v.type for v in inputs])
    mapping = dict(zip(inputs, block.args))
    for v, new in zip(inputs, block.args):
        new.name_hint = v.name_hint
    for op in ops:
        new = op.clone(value_mapper=mapping)  # type: ignore[assignment]
        block.add_op(new)
        mapping.update(zip(op.results, new.results))  # type: ignore[attr-defined]
    block.add_op(ReturnOp(*[mapping[v] for v in outputs]))
    func = FuncOp("forward", FunctionType.from_lists([v.type for v in inputs], [v.type for v in outputs]),
                  Region(block))
    if arg_attrs is not None:
        func.arg_attrs = arg_attrs
    if res_attrs is not None:
        func.res_attrs = res_attrs
    used = {op.attributes["name"].data for op in ops if op.name == "tg.weight"}  # type: ignore[attr-defined]
    return Model(ModuleOp([func]), WeightStore({n: model.weights[n] for n in used}))


def live_after(ops: Sequence[Operation], later: Sequence[Operation], results: Sequence[SSAValue]) -> list[SSAValue]:
    """Values defined by `ops` that `later` ops or the function's `results` read, in first-use order."""
    defined = {r for op in ops for r in op.results}
    used = [v for op in later for v in op.operands] + list(results)
    return list(dict.fromkeys(v for v in used if v in defined))
