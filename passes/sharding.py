"""Shardings, the ways each op can be split, and how a value moves between shardings.

Shared by the planner (`passes/shard.py`) and the partitioner (`passes/partition.py`),
so that what is costed is what is emitted.

A `Spec` is MLIR's `split_axes`: for each tensor dim, the mesh axes it is split over
(major first); `((), (0,))` splits dim 1 over mesh axis 0 and replicates dim 0.

Every op that can be split is described by its iteration space (`Loops`), as Alpa
and GSPMD describe einsums: loop dims with sizes, and for each operand and the
result which loop dim each tensor dim runs over (None: a broadcast dim of size 1,
or a dim no loop splits). A strategy assigns each mesh axis to at most one loop dim
(or none); that fixes every operand's and the result's spec. Splitting a
reduction loop (a matmul's k, a reduce_sum's axis) leaves each device a partial
result, combined by an all-reduce over those axes. Loops in `fixed` cannot be
split: a softmax's axis, a layer_norm's normalized dims, attention's key and head
dims, a gathered table's rows. An op without rules runs replicated.

Resharding a value from spec A to spec B (`reshard_steps`): axes a dim loses are
all-gathered (minor first, so each gather concatenates contiguous pieces), axes it
gains are sliced locally (free); one axis moving from one dim to another is one
all-to-all instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import sympy

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.shapes import Dim, TensorInfo, dims_equal, info_of, normalize_dim, numel

Spec = tuple[tuple[int, ...], ...]

# Reductions whose partial results combine with one all-reduce: op -> shard.partial kind.
REDUCE_KINDS = {"reduce_sum": "sum", "reduce_mean": "average", "reduce_max": "max", "reduce_min": "min",
                "reduce_prod": "product"}


def replicated(rank: int) -> Spec:
    return tuple(() for _ in range(rank))


def spec_axes(spec: Spec) -> set[int]:
    return {a for axes in spec for a in axes}


def shards(spec: Spec, mesh_shape: Sequence[int]) -> list[int]:
    """How many pieces each dim is cut into."""
    return [math.prod(mesh_shape[a] for a in axes) for axes in spec]


def local_shape(shape: Sequence[Dim], spec: Spec, mesh_shape: Sequence[int]) -> tuple[Dim, ...]:
    return tuple(normalize_dim(sympy.sympify(d) / n) if n > 1 else d for d, n in zip(shape, shards(spec, mesh_shape)))


def local_info(info: TensorInfo, spec: Spec, mesh_shape: Sequence[int]) -> TensorInfo:
    return TensorInfo(local_shape(info.shape, spec, mesh_shape), info.dtype)


def nbytes(info: TensorInfo) -> sympy.Expr:
    return sympy.sympify(numel(info.shape)) * dtypes.numpy_dtype(info.dtype).itemsize


def spec_str(spec: Spec) -> str:
    return "[" + ", ".join("[" + ", ".join(map(str, axes)) + "]" for axes in spec) + "]"


# --- iteration spaces --------------------------------------------------------------

@dataclass(frozen=True)
class Loops:
    sizes: tuple[Dim, ...]  # what a split of each loop must divide
    labels: tuple[str, ...]  # how the plan names them: m, n, k for a matmul; d0, d1, ... otherwise
    out: tuple[int | None, ...]  # result dim -> loop
    ins: tuple[tuple[int | None, ...], ...]  # operand dim -> loop
    reduce: frozenset[int] = frozenset()
    kind: str = "sum"  # how partial results of a split reduction loop combine
    fixed: frozenset[int] = frozenset()


def _aligned(info: TensorInfo, onto: Sequence[Dim], loops: Sequence[int]) -> tuple[int | None, ...]:
    """Broadcasting: operand dims right-aligned onto `onto`; a dim of another size (1) maps to no loop."""
    off = len(onto) - info.rank
    return tuple(loops[off + j] if off + j >= 0 and dims_equal(d, onto[off + j]) else None
                 for j, d in enumerate(info.shape))


def _nominal(d: Dim) -> float:
    return float(sympy.sympify(d).subs({s: 1000 for s in sympy.sympify(d).free_symbols}))


def _reshape_loops(x: TensorInfo, y: TensorInfo) -> Loops:
    """A reshape cuts the dims into segments of equal product; a split of a segment's major
    result dim is a split of its major operand dim when both divide (heads of [B, S, H*Dh])."""
    X, Y = x.shape, y.shape
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


def loops_of(op: TgOp) -> Loops | None:
    """The iteration space of `op`, or None when it only runs replicated."""
    name, category = op.op_name, op.SPEC.category
    ins = [info_of(v.type) for v in op.operands]
    if len(op.results) != 1:
        return None
    out = op.result_infos()[0]
    R = out.rank
    dims = tuple(range(R))
    labels = tuple(f"d{i}" for i in dims)
    if name == "weight":
        return Loops(out.shape, labels, dims, ())
    if (category == "elementwise" and name != "trilu") or name in ("gelu", "broadcast"):
        return Loops(out.shape, labels, dims, tuple(_aligned(i, out.shape, dims) for i in ins))
    if name in ("softmax", "layer_norm"):
        axis = op.attr("axis") % R
        fixed = {axis} if name == "softmax" else set(range(axis, R))
        return Loops(out.shape, labels, dims, tuple(_aligned(i, out.shape, dims) for i in ins), fixed=frozenset(fixed))
    if name in REDUCE_KINDS:
        x = ins[0]
        axes = {a % x.rank for a in op.attr("axes")}
        keep = op.attr("keepdims")
        out_map = tuple(None if i in axes else i for i in range(x.rank) if keep or i not in axes)
        return Loops(x.shape, tuple(f"d{i}" for i in range(x.rank)), out_map, (tuple(range(x.rank)),),
                     reduce=frozenset(axes), kind=REDUCE_KINDS[name])
    if name == "matmul" and ins[0].rank >= 2 and ins[1].rank >= 2:
        a, b = ins
        k = R
        batch = out.shape[:-2]
        amap = _aligned(TensorInfo(a.shape[:-2], a.dtype), batch, dims[:-2]) + (R - 2, k)
        bmap = _aligned(TensorInfo(b.shape[:-2], b.dtype), batch, dims[:-2]) + (k, R - 1)
        return Loops(out.shape + (a.shape[-1],), tuple(f"b{i}" for i in range(R - 2)) + ("m", "n", "k"),
                     dims, (amap, bmap), reduce=frozenset({k}))
    if name == "attention":
        q, kk, v = ins[:3]
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
        return Loops(out.shape + (kk.shape[-2], q.shape[-1]), labels[:-2] + ("q", "dv", "kv", "dh"), dims,
                     tuple(maps), fixed=frozenset({R - 2, R - 1, lk, d}))
    if name == "transpose":
        perm = op.attr("perm")
        return Loops(out.shape, labels, dims, (tuple(perm.index(j) for j in range(R)),))
    if name == "reshape":
        return _reshape_loops(ins[0], out)
    if name == "gather" and op.attr("axis") % ins[0].rank == 0:
        x, idx = ins
        rows = R
        return Loops(out.shape + (x.shape[0],), labels + ("rows",), dims,
                     ((rows,) + tuple(range(idx.rank, R)), tuple(range(idx.rank))), fixed=frozenset({rows}))
    return None


# --- strategies --------------------------------------------------------------------

@dataclass(frozen=True)
class Strategy:
    name: str  # "R" replicated; else loop@axis, e.g. "n@0" (a matmul split by columns over axis 0)
    out: Spec
    ins: tuple[Spec, ...]
    partial: tuple[int, ...] = ()  # mesh axes whose results are summed (all-reduced) afterwards
    kind: str = "sum"
    split: tuple[int, ...] = ()  # mesh axes the op's work is divided over
    scatter: int | None = None  # partial sums reduce-scattered onto this result dim, not all-reduced
    zero: int = 0  # a weight's ZeRO stage (1: optimizer state, 2: and gradients partitioned over the axes its
    #                spec leaves free); stage 3 is a weight stored split and all-gathered where it is used


def replicate_strategy(op_ranks: Sequence[int], out_rank: int) -> Strategy:
    return Strategy("R", replicated(out_rank), tuple(replicated(r) for r in op_ranks))


def _divides(size: Dim, n: int, sizes: dict[str, int]) -> bool:
    value = sympy.sympify(size)
    if value.free_symbols:
        value = value.subs({s: sizes.get(s.name, 0) for s in value.free_symbols})
    try:
        v = int(value)
    except TypeError:
        return False
    return v > 0 and v % n == 0


def strategies(op: TgOp, mesh_shape: Sequence[int], sizes: dict[str, int]) -> list[Strategy]:
    """Every way to split `op` on the mesh (the replicated one first); symbolic loop sizes are
    checked for divisibility at `sizes`."""
    ranks = [info_of(v.type).rank for v in op.operands]
    out_rank = op.result_infos()[0].rank if op.results else 0
    base = replicate_strategy(ranks, out_rank)
    loops = loops_of(op)
    if loops is None or len(op.results) != 1:
        return [base]
    free = [d for d in range(len(loops.sizes)) if d not in loops.fixed]
    result = [base]
    for axes_of in _splits(free, loops.sizes, mesh_shape, sizes):
        spec = lambda m: tuple(axes_of.get(l, ()) if l is not None else () for l in m)  # noqa: E731
        partial = tuple(sorted(a for d in loops.reduce for a in axes_of.get(d, ())))
        name = ",".join(f"{loops.labels[d]}@{'.'.join(map(str, ax))}" for d, ax in sorted(axes_of.items()))
        st = Strategy(name, spec(loops.out), tuple(spec(m) for m in loops.ins), partial, loops.kind,
                      tuple(sorted(a for ax in axes_of.values() for a in ax)))
        result.append(st)
        result += _scattered(st, loops, info_of(op.results[0].type).shape, mesh_shape, sizes)
    return result


def _scattered(st: Strategy, loops: Loops, shape, mesh_shape: Sequence[int], sizes: dict[str, int]) -> list[Strategy]:
    """Variants of a strategy with partial sums that reduce-scatter them onto one result dim (each
    device keeps its slice of the sum: Megatron's sequence parallelism) instead of all-reducing."""
    if not st.partial:
        return []
    out = []
    n = math.prod(mesh_shape[a] for a in st.partial)
    for d, axes in enumerate(st.out):
        if loops.out[d] is None or loops.out[d] in loops.fixed:
            continue
        if not _divides(shape[d], n * math.prod(mesh_shape[a] for a in axes), sizes):
            continue
        spec = tuple(ax + st.partial if i == d else ax for i, ax in enumerate(st.out))
        out.append(Strategy(f"{st.name}>d{d}", spec, st.ins, st.partial, st.kind, st.split, scatter=d))
    return out


def zero_variants(st: Strategy, mesh_shape: Sequence[int]) -> list[Strategy]:
    """A weight's strategy with ZeRO stages 1 and 2 over the mesh axes its spec does not split (the axes
    it is replicated on): the same forward program, less optimizer state (and gradient) per device."""
    free = [a for a in range(len(mesh_shape)) if a not in spec_axes(st.out) and mesh_shape[a] > 1]
    if not free:
        return []
    return [dataclasses.replace(st, name=f"{st.name}+z{k}", zero=k) for k in (1, 2)]


def base_name(name: str) -> str:
    """A strategy's name without its ZeRO stage: "R+z1" -> "R"."""
    return name.split("+z")[0]


def pre_scatter(st: Strategy) -> Spec:
    """The result's spec before a reduce-scatter strategy scatters it (its local compute shape)."""
    if st.scatter is None:
        return st.out
    return tuple(ax[:len(ax) - len(st.partial)] if i == st.scatter else ax for i, ax in enumerate(st.out))


def source_strategies(info: TensorInfo, mesh_shape: Sequence[int], sizes: dict[str, int]) -> list[Strategy]:
    """A model input: any dim split over any axes (the data loader hands each device its piece)."""
    result = [Strategy("R", replicated(info.rank), ())]
    for axes_of in _splits(range(info.rank), info.shape, mesh_shape, sizes):
        name = ",".join(f"d{d}@{'.'.join(map(str, ax))}" for d, ax in sorted(axes_of.items()))
        result.append(Strategy(name, tuple(axes_of.get(d, ()) for d in range(info.rank)), (),
                               split=tuple(sorted(a for ax in axes_of.values() for a in ax))))
    return result


def _splits(dims: Sequence[int], extents, mesh_shape: Sequence[int], sizes: dict[str, int]):
    """Every assignment of mesh axes to `dims` (each axis to one dim or to none, not all to
    none) under which each dim's extent divides by its axes' devices: {dim: mesh axes}."""
    for assign in itertools.product([None, *dims], repeat=len(mesh_shape)):
        if all(a is None for a in assign):
            continue
        axes_of: dict[int, tuple[int, ...]] = {}
        for axis, d in enumerate(assign):
            if d is not None:
                axes_of[d] = axes_of.get(d, ()) + (axis,)
        if all(_divides(extents[d], math.prod(mesh_shape[a] for a in ax), sizes) for d, ax in axes_of.items()):
            yield axes_of


# --- resharding ---------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    kind: str  # "all_gather", "all_slice", "all_to_all"
    axis: int  # the mesh axis
    dim: int  # gather/slice dim; all_to_all: the split dim
    concat: int = -1  # all_to_all: the concatenated dim


def reshard_steps(src: Spec, dst: Spec) -> list[Step]:
    """The collectives that turn a value sharded as `src` into one sharded as `dst`."""
    gathers: list[tuple[int, int]] = []
    slices: list[tuple[int, int]] = []
    for d, (s, t) in enumerate(zip(src, dst)):
        p = 0
        while p < min(len(s), len(t)) and s[p] == t[p]:
            p += 1
        gathers += [(a, d) for a in reversed(s[p:])]
        slices += [(a, d) for a in t[p:]]
    if len(gathers) == 1 and len(slices) == 1 and gathers[0][0] == slices[0][0] and gathers[0][1] != slices[0][1]:
        return [Step("all_to_all", gathers[0][0], slices[0][1], gathers[0][1])]
    return [Step("all_gather", a, d) for a, d in gathers] + [Step("all_slice", a, d) for a, d in slices]


def apply_step(spec: Spec, step: Step) -> Spec:
    """The spec after one step."""
    out = [list(axes) for axes in spec]
    if step.kind == "all_gather":
        out[step.dim].remove(step.axis)
    elif step.kind == "all_slice":
        out[step.dim].append(step.axis)
    else:
        out[step.concat].remove(step.axis)
        out[step.dim].append(step.axis)
    return tuple(tuple(a) for a in out)
