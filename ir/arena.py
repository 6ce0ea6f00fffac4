"""How a program's temporaries share one arena: the layout the C runtime allocates (its
`_plan_arena`) and the recompute pass prices, one description for both.

Each buffer has a size in bytes and a lifetime (first step writing it, last step reading it, both
inclusive); buffers whose lifetimes overlap get disjoint bytes, the others may share. Largest
first, each at the lowest offset clear of the placed buffers it overlaps in time (first fit),
every size rounded up to ALIGN. The arena's size is the highest end: at least the peak of the
bytes live at once (the live-sum curve), more where first fit leaves gaps between buffers placed
at different times (fragmentation).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping

ALIGN = 64  # bytes: a cache line, and what oneDNN's vector loads like


def lay_out(sizes: Mapping[Hashable, int], lifetimes: Mapping[Hashable, tuple[int, int]],
            align: int = ALIGN) -> tuple[dict[Hashable, int], int]:
    """({buffer: byte offset}, arena bytes) for the buffers of `lifetimes`, `sizes[b]` bytes each."""
    order = sorted(lifetimes, key=lambda b: -sizes[b])
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first step, last step)
    offsets: dict[Hashable, int] = {}
    for b in order:
        nbytes = (sizes[b] + align - 1) // align * align
        a, z = lifetimes[b]
        off = 0
        for c_off, c_end in sorted((o, e) for o, e, s, t in placed if not (t < a or z < s)):
            if off + nbytes <= c_off:
                break
            off = max(off, c_end)
        offsets[b] = off
        placed.append((off, off + nbytes, a, z))
    return offsets, max((end for _, end, _, _ in placed), default=0)


# Backends whose calls hold their buffers in one arena register how a program, as they would run it
# (already fused for them), holds its bytes: hardware name -> f(module) -> the bytes one call holds
# at its peak. The recompute pass prices its budget with it (passes import no backend: the backend,
# once imported, registers itself here).
LAYOUTS: dict[str, Callable[[Any], int]] = {}


def register_layout(hardware: str, bytes_of: Callable[[Any], int]) -> None:
    LAYOUTS[hardware] = bytes_of
