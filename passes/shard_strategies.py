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
from tilegraph.ir.loops import Loops
from tilegraph.ir.shapes import Dim, TensorInfo, info_of, normalize_dim, numel

Spec = tuple[tuple[int, ...], ...]


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


# --- iteration spaces: the op table's `loops` trait (ir/loops.py) ---------------

def loops_of(op: TgOp) -> Loops | None:
    """The iteration space of `op`, or None when it only runs replicated."""
    if len(op.results) != 1 or op.SPEC.loops is None:
        return None
    return op.SPEC.loops([info_of(v.type) for v in op.operands], op.result_infos()[0], op.py_attrs())


# --- strategies --------------------------------------------------------------------

@dataclass(frozen=True)
class Strategy:
    name: str  # "R" replicated; else loop@axis, e.g. "n@0" (a matmul split by columns over axis 0)
    out: Spec
    ins: tuple[Spec, ...]
    partial: tuple[int, ...] = ()  # mesh axes whose results are summed (all-reduced) afterwards
    combine: str = "sum"  # how the partial results combine (a shard.partial kind)
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
        spec = lambda m: tuple(axes_of.get(l, ()) if l is not None else () for l in m)  # noqa: B023, E731
        partial = tuple(sorted(a for d in loops.reduce for a in axes_of.get(d, ())))
        name = ",".join(f"{loops.labels[d]}@{'.'.join(map(str, ax))}" for d, ax in sorted(axes_of.items()))
        st = Strategy(name, spec(loops.out), tuple(spec(m) for m in loops.ins), partial, loops.combine,
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
        out.append(Strategy(f"{st.name}>d{d}", spec, st.ins, st.partial, st.combine, st.split, scatter=d))
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
    collective: str  # "all_gather", "all_slice", "all_to_all"
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
    if step.collective == "all_gather":
        out[step.dim].remove(step.axis)
    elif step.collective == "all_slice":
        out[step.dim].append(step.axis)
    else:
        out[step.concat].remove(step.axis)
        out[step.dim].append(step.axis)
    return tuple(tuple(a) for a in out)
