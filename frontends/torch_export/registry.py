"""The converter table: ATen overload name -> converter, filled by the family modules with `@converts`."""


from __future__ import annotations

from typing import Any, Callable

import torch

from tilegraph.frontends import FrontendError

aten = torch.ops.aten



# --- converters ---------------------------------------------------------------------
#
# One table: ATen op (as str(OpOverload)) -> converter(importer, node, args). `args`
# holds the op's schema arguments by name, tensors already tg Tensors.

Converter = Callable[[Any, Any, Any], Any]
CONVERTERS: dict[str, Converter] = {}


# Names given to `converts` that this torch does not have (a typo, or an overload
# another torch version lacks); the tests keep it empty for the pinned torch.
UNKNOWN_NAMES: list[str] = []


def converts(*names: str):
    def register(fn):
        for n in names:
            packet, _, overload = n.partition(".")
            if overload not in getattr(getattr(aten, packet, None), "overloads", lambda: [])():
                UNKNOWN_NAMES.append(n)
                continue
            CONVERTERS["aten." + n] = fn
        return fn

    return register


def _axis(d: int, rank: int) -> int:
    if not -max(rank, 1) <= d < max(rank, 1):
        raise FrontendError(f"dim {d} is out of range for rank {rank}")
    return d % max(rank, 1)


def _axes(dim: Any, rank: int) -> tuple[int, ...]:
    """torch's dim argument (None, [], int, list) as sorted axes; None and [] mean all."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(rank))
    if isinstance(dim, int):
        dim = [dim]
    return tuple(sorted({_axis(d, rank) for d in dim}))


def _ntuple(v: Any, n: int) -> tuple:
    if isinstance(v, (list, tuple)):
        v = list(v)
        if len(v) == 1:
            return tuple(v * n)
        if len(v) != n:
            raise FrontendError(f"{v} does not give one value per spatial dim ({n})")
        return tuple(v)
    return (v,) * n


# identity and type conversion --------------------------------------------------


# .item() and its kin, run before the graph's other nodes: (importer, node, args) -> a run-time size.
RUN_TIME_SCALARS: dict[str, Converter] = {}
