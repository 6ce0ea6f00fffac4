"""The lowering protocol: how each backend lowers each op of the table, in one place.

As each of Inductor's backends implements its one ops protocol (`OpsHandler`), each
tilegraph backend declares, for every op of `ir/ops.py`, one of:

- `TEMPLATE`: the backend writes the op itself (a NumPy template, a Triton kernel
  or torch call, an ONNX node or a few, a C function);
- `DECOMPOSE`: the op is spelled out into other ops first, by the decomposition
  library (`passes/decompose.py`'s `DECOMPOSITIONS`), and those are lowered;
- `Fallback("reason")`: a stated fallback: where the op goes instead and why (the
  Triton backend's host NumPy template, the ONNX exporter's refusal naming it).

A backend names its table in its description (`backends/__init__.py`'s `BACKENDS`):
"module:attribute" of a dict {op name: TEMPLATE | DECOMPOSE | Fallback(...)}. The
module is imported only when the table is read (a registry entry costs nothing at
`import tilegraph`). Build the dict with `table()`:

    LOWERINGS = table(template=[...], decompose=["softmax"], fallback={"topk": "runs on the host"})

tests/test_backend_coverage.py fails when an op of the table has no entry in some
registered backend, so a new op cannot silently miss a lowering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

TEMPLATE = "template"
DECOMPOSE = "decompose"


@dataclass(frozen=True)
class Fallback:
    reason: str  # where the op runs instead, or why it is refused


Lowering = str | Fallback


def table(template: Iterable[str] = (), decompose: Iterable[str] = (),
          fallback: Mapping[str, str] | None = None) -> dict[str, Lowering]:
    """A lowering table; an op named twice is an error in the table itself."""
    out: dict[str, Lowering] = {}
    entries = [(n, TEMPLATE) for n in template] + [(n, DECOMPOSE) for n in decompose] + \
        [(n, Fallback(r)) for n, r in (fallback or {}).items()]
    for name, how in entries:
        if name in out:
            raise ValueError(f"tg.{name} is declared twice in a lowering table")
        out[name] = how
    return out


def lowerings(backend: str) -> dict[str, Lowering]:
    """The lowering table a backend declares."""
    from tilegraph.backends import BACKENDS, attribute

    return attribute(BACKENDS[backend].lowerings)


def missing(lowered: Mapping[str, Lowering]) -> list[str]:
    """The ops of the table with no lowering and no stated fallback in `lowered`."""
    from tilegraph.ir.ops import OPS

    return [name for name in OPS if name not in lowered]
