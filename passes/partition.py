"""Lower a module annotated by `shard` to one program every device runs (SPMD).

What it does: reads the `shard.shard` annotations (a value's sharding after its
definition; `annotate_for_users` for the sharding a consumer wants) and writes a
new @forward at local shapes, for concrete sizes of the symbolic dims:

  - a model input or weight becomes its local piece (each device's weight store
    holds its slice of every weight: `Partitioned.weights[device]`);
  - an op runs on its operands' local pieces; when its strategy split a
    reduction loop (a matmul's k), a `shard.all_reduce` of the partial result
    follows, over those mesh axes, with the op's reduction kind, or a
    `shard.reduce_scatter` when the result's annotation is split over them too;
  - where a consumer wants another sharding than the producer gave, the
    collectives of `passes.shard_strategies.reshard_steps` go between
    (`shard.all_gather`, `shard.all_slice`, `shard.all_to_all`);
  - results are returned as local pieces, with their shardings in
    `Partitioned.out_specs` (`backends/simulated_mesh.py` gathers them).

The same steps price the plan (`passes/shard.py`), so what is costed is what runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from xdsl.dialects.builtin import BytesAttr, DenseArrayBase, FlatSymbolRefAttr, FunctionType, IndexType, \
    IntegerAttr, ModuleOp, StringAttr, i16, i64
from xdsl.dialects.func import FuncOp, ReturnOp
from xdsl.ir import Block, Region, SSAValue

from tilegraph.ir.dialect import TgOp, make_op
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model, WeightStore
from tilegraph.ir.shapes import TensorInfo, info_of, tensor_type, type_of
from tilegraph.ir.shard import AllGatherOp, AllReduceOp, AllSliceOp, AllToAllOp, GridOp, ReduceScatterOp, ReductionKind, \
    ReductionKindAttr, ShardingOp, ShardOp, piece
from tilegraph.passes.shard_annotations import GRID, read_annotations
from tilegraph.passes.shard_strategies import Spec, apply_step, loops_of, replicated, reshard_steps, shards
from tilegraph.ir.ops import Op


class PartitionError(TilegraphError):
    """A module that cannot be partitioned (no plan, sizes that do not divide); the message says which."""


@dataclass
class Partitioned:
    model: Model  # the per-device program (its weights: device 0's)
    weights: list[WeightStore]  # each device's slices
    mesh: tuple[int, ...]
    in_specs: list[Spec]
    out_specs: list[Spec]
    sizes: dict[str, int]


def _spec(sharding: ShardingOp) -> Spec:  # type: ignore[valid-type]
    return tuple(tuple(a.get_values()) for a in sharding.split_axes.axes.data)  # type: ignore[attr-defined]


def _axes_attr(axes: Sequence[int]) -> DenseArrayBase:
    return DenseArrayBase(i16, BytesAttr(i16.pack(list(axes))))


def _index(v: int) -> IntegerAttr:
    return IntegerAttr(v, IndexType())


def _concrete(info: TensorInfo, sizes: Mapping[str, int]) -> TensorInfo:
    import sympy

    dims = []
    for d in info.shape:
        e = sympy.sympify(d)
        if e.free_symbols:
            missing = [s.name for s in e.free_symbols if s.name not in sizes]
            if missing:
                raise PartitionError(f"give a size for {', '.join(sorted(missing))} to partition at")
            e = e.subs({s: sizes[s.name] for s in e.free_symbols})
        dims.append(int(e))
    return TensorInfo(tuple(dims), info.dtype)


def _local(info: TensorInfo, spec: Spec, mesh: Sequence[int], what: str) -> TensorInfo:
    out = []
    for d, n in zip(info.shape, shards(spec, mesh)):
        if d % n:
            raise PartitionError(f"{what}: dim of size {d} does not split into {n} pieces on mesh "
                                 f"{'x'.join(map(str, mesh))}")
        out.append(d // n)
    return TensorInfo(tuple(out), info.dtype)


def partition(model: Model, sizes: Mapping[str, int] | None = None) -> Partitioned:
    """The per-device program of a module `shard` annotated, at `sizes` of its symbolic dims."""
    mesh, _ = read_annotations(model.module)
    if mesh is None:
        raise PartitionError("the module has no shard.grid: run the `shard` pass first")
    sizes = dict(sizes or {})
    func = model.func
    block = Block()
    emit = block.add_op
    grid = FlatSymbolRefAttr(GRID)
    env: dict[SSAValue, tuple[SSAValue, Spec, TensorInfo]] = {}  # global value -> (local value, spec, global info)

    def spec_after(value: SSAValue, rank: int) -> Spec:
        for use in value.uses:
            if isinstance(use.operation, ShardOp) and use.operation.annotate_for_users is None:
                return _spec(use.operation.sharding.owner)
        return replicated(rank)

    in_specs = []
    for arg in func.body.block.args:
        info = _concrete(info_of(arg.type), sizes)
        spec = spec_after(arg, info.rank)
        local = block.insert_arg(tensor_type(info.dtype, _local(info, spec, mesh, f"input {arg.name_hint}").shape),
                                 len(block.args))
        local.name_hint = arg.name_hint
        env[arg] = (local, spec, info)
        in_specs.append(spec)

    def reshard(value: SSAValue, spec: Spec, want: Spec, info: TensorInfo) -> SSAValue:
        for step in reshard_steps(spec, want):
            after = apply_step(spec, step)
            out_type = tensor_type(info.dtype, _local(info, after, mesh, "resharded value").shape)
            props = {"grid": grid, "grid_axes": _axes_attr([step.axis])}
            if step.collective == "all_gather":
                op = AllGatherOp.create(operands=[value], result_types=[out_type],  # type: ignore[attr-defined]
                                        properties=props | {"gather_axis": _index(step.dim)})
            elif step.collective == "all_slice":
                op = AllSliceOp.create(operands=[value], result_types=[out_type],  # type: ignore[attr-defined]
                                       properties=props | {"slice_axis": _index(step.dim)})
            else:
                op = AllToAllOp.create(operands=[value], result_types=[out_type],  # type: ignore[attr-defined]
                                       properties=props | {"split_axis": _index(step.dim),
                                                           "concat_axis": _index(step.concat)})
            emit(op)
            value, spec = op.results[0], after
        return value

    weights = [WeightStore() for _ in range(math.prod(mesh))]
    out_specs: list[Spec] = []
    for op in func.body.block.ops:
        if isinstance(op, (ShardingOp, GridOp)):
            continue
        if isinstance(op, ShardOp):
            local, spec, info = env[op.src]  # type: ignore[assignment]
            want = _spec(op.sharding.owner)
            env[op.result] = (reshard(local, spec, want, info), want, info)
            continue
        if isinstance(op, ReturnOp):
            outs = [env[v] for v in op.operands]
            emit(ReturnOp(*[v for v, _, _ in outs]))
            out_specs = [s for _, s, _ in outs]
            break
        if not isinstance(op, TgOp):
            raise PartitionError(f"cannot partition {op.name}")
        info = _concrete(op.result_infos()[0], sizes)
        operands = [env[v] for v in op.operands]
        in_specs_op = [s for _, s, _ in operands]
        out_spec = spec_after(op.results[0], info.rank)
        what = f"tg.{op.op_name} ({op.attr('name') if op.op_name == Op.weight else info})"
        local_out = _local(info, out_spec, mesh, what)
        attrs = op.py_attrs()
        if op.op_name == Op.weight:
            array = model.weights[attrs["name"]]
            for dev, store in enumerate(weights):
                # np.array: a copy that keeps rank 0 (np.ascontiguousarray makes it 1-d)
                store[attrs["name"]] = np.array(piece(np.asarray(array), out_spec, mesh, dev))
        result = local_out if op.SPEC.result_given or op.op_name == Op.weight else None
        new = make_op(op.op_name, [v for v, _, _ in operands], attrs, result)
        emit(new)
        value = new.results[0]
        partial, kind, computed = _partial(op, in_specs_op)
        if partial:
            props = {"grid": grid, "grid_axes": _axes_attr(partial),
                     "reduction": ReductionKindAttr(ReductionKind(kind))}
            scatter = _scatter_dim(computed, out_spec, partial)
            if scatter is None:
                red = AllReduceOp.create(operands=[value], result_types=[value.type], properties=props)
            else:  # each device keeps its slice of the sum
                red = ReduceScatterOp.create(operands=[value], result_types=[type_of(local_out)],  # type: ignore[attr-defined]
                                             properties=props | {"scatter_axis": _index(scatter)})
            emit(red)
            value = red.results[0]
        if info_of(value.type).shape != local_out.shape:
            raise PartitionError(f"{what}: its operands' shardings give a local result of "
                                 f"{info_of(value.type)}, the plan says {local_out}")
        env[op.results[0]] = (value, out_spec, info)
        for old, extra in list(zip(op.results, new.results))[1:]:  # several results (split): replicated
            env[old] = (extra, replicated(info_of(extra.type).rank), _concrete(info_of(old.type), sizes))

    in_types = [a.type for a in block.args]
    out_types = [o.type for o in block.last_op.operands]
    new_func = FuncOp("forward", FunctionType.from_lists(in_types, out_types), Region(block))
    new_func.arg_attrs = func.arg_attrs
    new_func.res_attrs = func.res_attrs
    grid_op = GridOp.create(properties={"sym_name": StringAttr(GRID),
                                        "shape": DenseArrayBase.from_list(i64, list(mesh))})
    local_model = Model(ModuleOp([grid_op, new_func]), weights[0])
    local_model.module.verify()
    return Partitioned(local_model, weights, mesh, in_specs, out_specs, sizes)


def _partial(op: TgOp, in_specs: Sequence[Spec]) -> tuple[tuple[int, ...], str, Spec]:
    """Mesh axes over which the op's local result is a partial one (a split reduction loop), how
    partials combine, and the result's spec as computed (before any reduce-scatter)."""
    loops = loops_of(op)
    if loops is None or not loops.reduce:
        return (), "sum", ()
    axes_of: dict[int, tuple[int, ...]] = {}
    for spec, mapping in zip(in_specs, loops.ins):
        for dim_axes, loop in zip(spec, mapping):
            if loop is not None and dim_axes:
                axes_of[loop] = dim_axes
    partial = tuple(sorted(a for d in loops.reduce for a in axes_of.get(d, ())))
    computed = tuple(axes_of.get(l, ()) if l is not None else () for l in loops.out)
    return partial, loops.combine, computed


def _scatter_dim(computed: Spec, wanted: Spec, partial: tuple[int, ...]) -> int | None:
    """The dim a reduce-scatter strategy scatters the sums onto (its spec gains the partial axes), or
    None for an all-reduce."""
    if wanted == computed:
        return None
    for d, (c, w) in enumerate(zip(computed, wanted)):
        if w == c + partial and all(x == y for i, (x, y) in enumerate(zip(computed, wanted)) if i != d):
            return d
    raise PartitionError(f"the annotated sharding {wanted} is neither the computed {computed} nor it "
                         f"reduce-scattered over axes {partial}")
