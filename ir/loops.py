"""Iteration spaces: each op's loops, as the op table's `loops` trait.

As Alpa and GSPMD describe einsums: loop dims with sizes, and for each operand and
the result which loop dim each tensor dim runs over (None: a broadcast dim of size
1, or a dim no loop splits). `reduce` names the loops whose split leaves partial
results (a matmul's k, a reduce_sum's axes), combined as `combine`; loops in `fixed`
cannot be split (a softmax's axis, attention's key and head dims, a gathered table's
rows). The sharding planner (`passes/shard_strategies.py`) splits these; an op whose `loops`
is None, or whose function returns None, runs replicated.

Each function takes (operand infos, result info, attributes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import sympy

from tilegraph.ir.shapes import Dim, TensorInfo, dims_equal


@dataclass(frozen=True)
class Loops:
    sizes: tuple[Dim, ...]  # what a split of each loop must divide
    labels: tuple[str, ...]  # how the plan names them: m, n, k for a matmul; d0, d1, ... otherwise
    out: tuple[int | None, ...]  # result dim -> loop
    ins: tuple[tuple[int | None, ...], ...]  # operand dim -> loop
    reduce: frozenset[int] = frozenset()
    combine: str = "sum"  # how partial results of a split reduction loop combine (a shard.partial kind)
    fixed: frozenset[int] = frozenset()


# The op table's reduction kinds as MLIR shard.partial kinds (one all-reduce combines partials).
PARTIAL_KINDS = {"sum": "sum", "mean": "average", "max": "max", "min": "min", "prod": "product"}


def _aligned(info: TensorInfo, onto: Sequence[Dim], loops: Sequence[int]) -> tuple[int | None, ...]:
    """Broadcasting: operand dims right-aligned onto `onto`; a dim of another size (1) maps to no loop."""
    off = len(onto) - info.rank
    return tuple(loops[off + j] if off + j >= 0 and dims_equal(d, onto[off + j]) else None
                 for j, d in enumerate(info.shape))


def _nominal(d: Dim) -> float:
    return float(sympy.sympify(d).subs({s: 1000 for s in sympy.sympify(d).free_symbols}))


def _labels(out: TensorInfo) -> tuple[str, ...]:
    return tuple(f"d{i}" for i in range(out.rank))


def source(ins, out: TensorInfo, attrs) -> Loops:
    return Loops(out.shape, _labels(out), tuple(range(out.rank)), ())


def elementwise(ins, out: TensorInfo, attrs) -> Loops:
    dims = tuple(range(out.rank))
    return Loops(out.shape, _labels(out), dims, tuple(_aligned(i, out.shape, dims) for i in ins))


def normalized(to_end: bool):
    """softmax (its axis fixed) and layer_norm (to_end: the normalized dims axis.. fixed)."""

    def loops(ins, out: TensorInfo, attrs) -> Loops:
        axis = attrs["axis"] % out.rank
        fixed = set(range(axis, out.rank)) if to_end else {axis}
        return Loops(out.shape, _labels(out), tuple(range(out.rank)), elementwise(ins, out, attrs).ins,
                     fixed=frozenset(fixed))

    return loops


def reduce(kind: str):
    def loops(ins, out: TensorInfo, attrs) -> Loops:
        x = ins[0]
        axes = {a % x.rank for a in attrs["axes"]}
        keep = attrs["keepdims"]
        out_map = tuple(None if i in axes else i for i in range(x.rank) if keep or i not in axes)
        return Loops(x.shape, tuple(f"d{i}" for i in range(x.rank)), out_map, (tuple(range(x.rank)),),
                     reduce=frozenset(axes), combine=PARTIAL_KINDS[kind])

    return loops


def matmul(ins, out: TensorInfo, attrs) -> Loops | None:
    a, b = ins
    if a.rank < 2 or b.rank < 2:
        return None
    R = out.rank
    dims = tuple(range(R))
    k = R
    batch = out.shape[:-2]
    amap = _aligned(TensorInfo(a.shape[:-2], a.dtype), batch, dims[:-2]) + (R - 2, k)
    bmap = _aligned(TensorInfo(b.shape[:-2], b.dtype), batch, dims[:-2]) + (k, R - 1)
    return Loops(out.shape + (a.shape[-1],), tuple(f"b{i}" for i in range(R - 2)) + ("m", "n", "k"),
                 dims, (amap, bmap), reduce=frozenset({k}))


def attention(ins, out: TensorInfo, attrs) -> Loops:
    q, kk, v = ins[:3]
    R = out.rank
    dims = tuple(range(R))
    lk, d = R, R + 1
    batch = out.shape[:-2]
    bdims = dims[:-2]
    qmap = _aligned(TensorInfo(q.shape[:-2], q.dtype), batch, bdims) + (R - 2, d)
    kmap = _aligned(TensorInfo(kk.shape[:-2], kk.dtype), batch, bdims) + (lk, d)
    vmap = _aligned(TensorInfo(v.shape[:-2], v.dtype), batch, bdims) + (lk, R - 1)
    maps = [qmap, kmap, vmap]
    if len(ins) == 4:
        maps.append(_aligned(ins[3], batch + (q.shape[-2], kk.shape[-2]), bdims + (R - 2, lk)))
    # Only batch and head dims split: a causal mask is built from local positions.
    return Loops(out.shape + (kk.shape[-2], q.shape[-1]), _labels(out)[:-2] + ("q", "dv", "kv", "dh"), dims,
                 tuple(maps), fixed=frozenset({R - 2, R - 1, lk, d}))


def transpose(ins, out: TensorInfo, attrs) -> Loops:
    perm = attrs["perm"]
    return Loops(out.shape, _labels(out), tuple(range(out.rank)), (tuple(perm.index(j) for j in range(out.rank)),))


def reshape(ins, out: TensorInfo, attrs) -> Loops:
    """A reshape cuts the dims into segments of equal product; a split of a segment's major
    result dim is a split of its major operand dim when both divide (heads of [B, S, H*Dh])."""
    X, Y = ins[0].shape, out.shape
    in_map: list[int | None] = [None] * len(X)
    sizes = list(Y)
    splittable: set[int] = set()
    i = j = 0
    while i < len(X) and j < len(Y):
        i0, j0 = i, j
        px, py = sympy.sympify(X[i]), sympy.sympify(Y[j])
        i, j = i + 1, j + 1
        while not dims_equal(px, py):
            if (_nominal(px) < _nominal(py) and i < len(X)) or j >= len(Y):
                if i >= len(X):
                    break
                px, i = px * X[i], i + 1
            else:
                py, j = py * Y[j], j + 1
        a, b = X[i0], Y[j0]
        if isinstance(a, int) and isinstance(b, int):
            sizes[j0] = math.gcd(a, b)
        elif not dims_equal(a, b):
            continue
        in_map[i0] = j0
        splittable.add(j0)
    fixed = frozenset(range(len(Y))) - splittable
    return Loops(tuple(sizes), tuple(f"d{k}" for k in range(len(Y))), tuple(range(len(Y))), (tuple(in_map),),
                 fixed=fixed)


def gather(ins, out: TensorInfo, attrs) -> Loops | None:
    """An embedding lookup (axis 0): the table's rows are one fixed loop."""
    x, idx = ins
    if attrs["axis"] % x.rank != 0:
        return None
    R = out.rank
    return Loops(out.shape + (x.shape[0],), _labels(out) + ("rows",), tuple(range(R)),
                 ((R,) + tuple(range(idx.rank, R)), tuple(range(idx.rank))), fixed=frozenset({R}))
