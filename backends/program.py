"""What every backend needs to know about a model's program, whatever it emits.

`flatten` turns the model's function into the list of ops that compute (tg ops and
tg.fusion groups), looking through single-block region ops; `liveness` says when
each computed value is dead; `Namer` hands out Python identifiers. The NumPy and
Triton emitters both build on these. A model's strings enter their source only through
`ir/escape.py` (re-exported here): identifiers from `sanitize`, literals from
`str_literal`/`literal`, comments through `py_comment`.
"""

from __future__ import annotations

import builtins
import keyword
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from xdsl.dialects.func import ReturnOp
from xdsl.ir import Operation, SSAValue

from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir import dtypes
from tilegraph.ir.escape import identifier, py_comment, py_string  # noqa: F401 - the emitters' one escaping point
from tilegraph.ir.model import Model, ModelError
from tilegraph.ir.ops import Op, py_literal
from tilegraph.ir.shapes import TensorInfo

PYTHON_RESERVED = set(keyword.kwlist) | set(dir(builtins))


def sanitize(name: str, prefix: str = "v") -> str:
    """A Python identifier close to `name` (the one sanitiser, `ir/escape.py`)."""
    return identifier(name, prefix)


class Namer:
    """Hands out distinct identifiers, none of them reserved."""

    def __init__(self, reserved: set[str]):
        self.used = set(reserved)

    def fresh(self, base: str, prefix: str = "v") -> str:
        base = sanitize(base, prefix)
        name, i = base, 1
        while name in self.used:
            name, i = f"{base}_{i}", i + 1
        self.used.add(name)
        return name


@dataclass
class Program:
    """The model flattened to the ops that compute, with values renamed through regions."""

    steps: list[TgOp | FusionOp]
    outputs: list[SSAValue]
    alias: dict[SSAValue, SSAValue] = field(default_factory=dict)

    def canon(self, v: SSAValue) -> SSAValue:
        while v in self.alias:
            v = self.alias[v]
        return v


def flatten(model: Model) -> Program:
    prog = Program([], [])

    def walk(ops) -> list[SSAValue] | None:
        for op in ops:
            if isinstance(op, ReturnOp):
                return list(op.operands)
            if isinstance(op, (TgOp, FusionOp)):
                prog.steps.append(op)
            elif len(op.regions) == 1 and len(op.regions[0].blocks) == 1:
                block = op.regions[0].blocks[0]
                body = list(block.ops)
                if len(block.args) != len(op.operands) or not body or len(body[-1].operands) != len(op.results):
                    raise ModelError(f"cannot emit {op.name}: its region does not map "
                                     "operands to block arguments and results to the terminator")
                prog.alias.update(zip(block.args, op.operands))
                walk(body[:-1])
                prog.alias.update(zip(op.results, body[-1].operands))
            elif not _is_terminator(op):
                raise ModelError(f"cannot emit {op.name}: not a tg op")
        return None

    outputs = walk(model.func.body.block.ops)
    if outputs is None:
        raise ModelError("@forward has no func.return")
    prog.outputs = outputs
    return prog


def _is_terminator(op: Operation) -> bool:
    return op.parent_block() is not None and op is op.parent_block().last_op and not op.results


def liveness(steps: Sequence[TgOp | FusionOp], outputs: Sequence[SSAValue], canon=lambda v: v) -> list[list[SSAValue]]:
    """For each step, the computed values that are dead once it has run.

    A value dies at its last use (or at its definition, if nothing uses it);
    outputs never die. Only results of computing ops are listed: inputs belong to
    the caller, weights and constants to the compiled module.
    """
    last: dict[SSAValue, int] = {}
    computed: list[SSAValue] = []
    for i, op in enumerate(steps):
        for v in op.operands:
            last[canon(v)] = i
        if getattr(op, "op_name", None) not in (Op.weight, Op.constant):
            for r in op.results:
                last[r] = i
                computed.append(r)
    keep = {canon(v) for v in outputs}
    dies: list[list[SSAValue]] = [[] for _ in steps]
    for v in computed:
        if v not in keep:
            dies[last[v]].append(v)
    return dies


# --- Python literals for emitted modules ---


def str_literal(s: str) -> str:
    """A string literal in double quotes where that is plain (weight names), else repr."""
    return py_string(s)


def signature_rows(names: Sequence[str], infos: Sequence[TensorInfo]) -> list[str]:
    return [literal((n, tuple(d if isinstance(d, int) else str(d) for d in info.shape), info.dtype))
            for n, info in zip(names, infos)]


def literal(v: Any) -> str:
    """Python source for a str/int/tuple value, strings in double quotes where plain."""
    if isinstance(v, str):
        return str_literal(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(map(literal, v)) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


# A module-level tuple longer than this is written one item per line.
INDENT = "    "
LINE_WIDTH = 100


def tuple_lines(name: str, items: Sequence[str]) -> list[str]:
    one_line = f"{name} = (" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if len(one_line) <= LINE_WIDTH:
        return [one_line]
    return [f"{name} = ("] + [f"{INDENT}{item}," for item in items] + [")"]


def array_literal(array: np.ndarray, dtype: str) -> str:
    """Exact Python source for the values of a small array (nested lists; nan/inf by name)."""
    if dtypes.is_float(dtype):
        values = np.asarray(array, dtype=np.float64)  # every float dtype widens exactly
        scalar = lambda x: py_literal(float(x))  # noqa: E731
    elif dtype == "i1":
        values, scalar = np.asarray(array, dtype=bool), lambda x: repr(bool(x))  # noqa: E731
    else:
        values, scalar = np.asarray(array), lambda x: repr(int(x))  # noqa: E731

    def lit(a):
        if a.ndim == 0:
            return scalar(a)
        return "[" + ", ".join(lit(x) for x in a) + "]"

    return lit(values)
