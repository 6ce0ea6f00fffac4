"""Remarks: what a pass decided against the cost model, and why.

A pass calls `remark("fuse", "...")` for every decision (what was chosen, what
else was considered, the predicted cost of each). Remarks go to the collectors
open at the time (`with collect() as remarks:`), so `tilegraph-opt --remarks`
and tests see them, and cost nothing when nobody listens.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Remark:
    pass_name: str
    message: str

    def __str__(self) -> str:
        return f"remark: [{self.pass_name}] {self.message}"


_COLLECTORS: list[list[Remark]] = []


def remark(pass_name: str, message: str) -> None:
    for collector in _COLLECTORS:
        collector.append(Remark(pass_name, message))


def listening() -> bool:
    """Whether anyone collects remarks (a pass may skip formatting them if not)."""
    return bool(_COLLECTORS)


@contextmanager
def collect() -> Iterator[list[Remark]]:
    remarks: list[Remark] = []
    _COLLECTORS.append(remarks)
    try:
        yield remarks
    finally:
        _COLLECTORS.remove(remarks)
