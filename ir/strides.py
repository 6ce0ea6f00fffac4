"""Strides of a value in memory, and which layout ops make views of it and which copy.

A value a computing op writes lies in a buffer at some strides (contiguous, or channels-last
where a backend writes it so); reshape, transpose, broadcast, slice and split only look at it
differently, with new strides, until a reshape merges dims that do not walk memory as one run
(a transpose's dims): NumPy copies there, and so does the C backend (backends/c/views.py, which
reads its no-copy strides from here). Where a computing op's result lies in the C backend is
one rule, `result_strides`: its emitter lays out each fresh buffer by it, and the C target's
pricing (passes/targets/c.py) asks it of the IR.
"""

from __future__ import annotations

from typing import Callable, Sequence

import sympy
from xdsl.ir import BlockArgument, OpResult, SSAValue

from tilegraph.ir.dialect import FusionOp, TgOp, YieldOp
from tilegraph.ir.ops import Op
from tilegraph.ir.shapes import Dim, info_of

__all__ = ["contiguous_strides", "channels_last_strides", "is_channels_last", "unit_dims_strided",
           "reshaped_strides", "is_contiguous", "sole_reader", "laid_out_for_reader", "strides_of", "reshape_copies",
           "reduces_rows_of_channels", "rows_collapse", "strides_like", "result_strides"]


def _eq(a, b) -> bool:
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def _is_one(d) -> bool:
    return _eq(d, 1)


def contiguous_strides(shape: Sequence[Dim]) -> tuple:
    strides, acc = [], sympy.Integer(1)
    for d in reversed(shape):
        strides.append(acc)
        acc = acc * d
    return tuple(reversed(strides))


def channels_last_strides(shape: Sequence[Dim]) -> tuple:
    """Strides of (N, C, *spatial) laid out as (N, *spatial, C): what oneDNN's fast
    convolution kernels read and write on these processors (plain NCHW goes through
    im2col and a GEMM, several times slower at small channel counts)."""
    order = (0, *range(2, len(shape)), 1)
    dense = contiguous_strides(tuple(shape[i] for i in order))
    strides = [None] * len(shape)
    for pos, axis in enumerate(order):
        strides[axis] = dense[pos]
    return tuple(strides)


def is_channels_last(shape: Sequence[Dim], strides: Sequence) -> bool:
    """Whether `strides` lay `shape` (rank 3 or more) out channels-last and not also row-major."""
    return (len(shape) >= 3 and not is_contiguous(shape, strides)
            and all(_is_one(d) or _eq(s, w) for d, s, w in zip(shape, strides, channels_last_strides(shape))))


def reduces_rows_of_channels(shape: Sequence[Dim], strides: Sequence, axes: Sequence[int]) -> bool:
    """Whether a reduction over `axes` keeps an innermost dim that walks memory contiguously (a
    global average pool over channels-last data, a column sum): the C backend runs a sum or
    mean of such a value as rows of channels added into blocks of accumulators
    (backends/c/kernels.py), which its target's pricing calibrates as a kernel of its own."""
    keep = [i for i in range(len(shape)) if i not in axes]
    return bool(keep) and _eq(strides[keep[-1]], 1) and not _is_one(shape[keep[-1]])


def sole_reader(value: SSAValue):
    """The one op reading `value`, seen through the yield of its fusion group; else None."""
    uses = list(value.uses)
    while len(uses) == 1 and isinstance(uses[0].operation, YieldOp):
        group = uses[0].operation.parent_op()
        uses = list(group.results[uses[0].index].uses) if isinstance(group, FusionOp) else []
    return uses[0].operation if len(uses) == 1 else None


def laid_out_for_reader(value: SSAValue) -> tuple | None:
    """Strides for a fresh `value` that make its one reader, a transpose keeping the last axis
    (attention's heads merged back between the rows and the features), contiguous, so a
    reshape after it is free; None where its reader is anything else."""
    reader = sole_reader(value)
    perm = tuple(reader.attr("perm")) if isinstance(reader, TgOp) and reader.op_name == Op.transpose else None
    if perm is None or perm[-1] != len(perm) - 1:
        return None
    shape = info_of(value.type).shape
    moved = contiguous_strides(tuple(shape[p] for p in perm))
    return tuple(moved[perm.index(i)] for i in range(len(perm)))


def rows_collapse(shape: Sequence[Dim], strides: Sequence) -> bool:
    """Whether the leading dims and the rows of (shape, strides) walk memory as one run of rows."""
    return all(_is_one(shape[i]) or _eq(strides[i], strides[i + 1] * shape[i + 1]) for i in range(len(shape) - 2))


def strides_like(shape: Sequence[Dim], operands: Sequence[tuple[Sequence[Dim], Sequence | None]]) -> tuple:
    """A loop's result channels-last where an operand of its rank is ((shape, strides) each,
    strides None for a literal), so the loop walks them alike; else row-major."""
    if any(st is not None and len(sh) == len(shape) and is_channels_last(sh, st) for sh, st in operands):
        return channels_last_strides(shape)
    return contiguous_strides(shape)


def result_strides(value: SSAValue, operand_strides: Callable[[SSAValue], Sequence | None]) -> tuple:
    """Where the C backend writes `value`, computed by its op, given where the values it reads
    lie (`operand_strides`; None for a literal):
    - a convolution's result channels-last (oneDNN's fast kernels);
    - x[..., M, K] @ W[K, N] with x's rows in one run: one 2-D GEMM over all rows, row-major;
      another matmul's, an attention's or each of attention_grad's as its transposing reader wants it;
    - an elementwise op's, a pool's or a pad's as its operands (`strides_like`), and a layer_norm's
      over the last axis as its input (channels-last: normalized along the columns of channels);
    - a concat's channels-last where every operand is (DenseNet's blocks concatenate convolutions'
      outputs: row-major, each piece was a transposing copy, and its readers copied it back);
    - anything else row-major."""
    op, shape = value.owner, info_of(value.type).shape
    if isinstance(op, TgOp) and len(shape) >= 3:
        name = op.op_name
        if name == Op.conv:
            return channels_last_strides(shape)
        if name == Op.matmul and info_of(op.operands[1].type).rank == 2:
            x = op.operands[0]
            st = operand_strides(x)
            if st is not None and rows_collapse(info_of(x.type).shape, st):
                return contiguous_strides(shape)
        if name in (Op.matmul, Op.attention, Op.attention_grad):
            return laid_out_for_reader(value) or contiguous_strides(shape)
        if op.SPEC.pointwise or name in (Op.max_pool, Op.avg_pool, Op.pad):
            return strides_like(shape, [(info_of(x.type).shape, operand_strides(x)) for x in op.operands])
        if name == Op.layer_norm and op.attr("axis") % len(shape) == len(shape) - 1:
            return strides_like(shape, [(shape, operand_strides(op.operands[0]))])
        if name == Op.concat and all((st := operand_strides(x)) is not None and
                                     is_channels_last(info_of(x.type).shape, st) for x in op.operands):
            return channels_last_strides(shape)
    return contiguous_strides(shape)


def is_contiguous(shape: Sequence[Dim], strides: Sequence) -> bool:
    """Whether `strides` lay `shape` out row-major (dims of size 1 address nothing: any stride)."""
    return all(_is_one(d) or _eq(s, w) for d, s, w in zip(shape, strides, contiguous_strides(shape)))


def unit_dims_strided(shape, strides) -> tuple:
    """`strides` with each dim of size 1 given the stride it would have if contiguous, never 0
    (it addresses nothing, but oneDNN runs a matmul with a zero batch stride on its reference
    kernel, 100x slower)."""
    strides = list(strides)
    for k in reversed(range(len(shape))):
        if _is_one(shape[k]):
            strides[k] = strides[k + 1] * shape[k + 1] if k + 1 < len(shape) else sympy.Integer(1)
    return tuple(strides)


def reshaped_strides(shape: Sequence[Dim], strides: Sequence, new_shape: tuple) -> tuple | None:
    """Strides that show (shape, strides) in `new_shape` without a copy, or None (NumPy's
    no-copy reshape): the dims are cut into runs of equal size, and each run of the old dims
    must walk memory as one run."""
    old = [(d, st) for d, st in zip(shape, strides) if not _is_one(d)]
    new = [k for k, d in enumerate(new_shape) if not _is_one(d)]
    out: list = [sympy.Integer(0)] * len(new_shape)
    oi = ni = 0
    while oi < len(old) and ni < len(new):
        oj, nj = oi + 1, ni + 1
        po, pn = sympy.sympify(old[oi][0]), sympy.sympify(new_shape[new[ni]])
        while not _eq(po, pn):
            if not (po.is_number and pn.is_number):
                return None
            if po < pn and oj < len(old):
                po, oj = po * old[oj][0], oj + 1
            elif pn < po and nj < len(new):
                pn, nj = pn * new_shape[new[nj]], nj + 1
            else:
                return None
        if any(not _eq(old[k][1], old[k + 1][1] * old[k + 1][0]) for k in range(oi, oj - 1)):
            return None
        st = old[oj - 1][1]
        for k in reversed(new[ni:nj]):
            out[k] = st
            st = st * new_shape[k]
        oi, ni = oj, nj
    if oi != len(old) or ni != len(new):
        return None
    return unit_dims_strided(new_shape, out)


# The layout ops that make a view of their operand (the C backend's `layout`): split too,
# which the op table counts as a copy (other backends make one).
_VIEWING = (Op.reshape, Op.transpose, Op.broadcast, Op.slice, Op.split)


def strides_of(value: SSAValue, written: Callable[[SSAValue], tuple]) -> tuple:
    """The strides `value` has in its buffer: followed through the view ops above (and into
    and out of fusion groups) back to the op that computed it, whose result lies at
    `written(result)` (a backend's rule: contiguous, channels-last, ...). A reshape that
    cannot be a view is a copy, contiguous."""
    shape = info_of(value.type).shape
    if isinstance(value, BlockArgument):
        group = value.owner.parent_op()
        return strides_of(group.operands[value.index], written) if isinstance(group, FusionOp) else contiguous_strides(shape)
    op = value.owner
    if isinstance(op, FusionOp):
        ret = op.block.last_op
        return strides_of(ret.operands[value.index], written) if isinstance(ret, YieldOp) and isinstance(
            value, OpResult) else written(value)
    if not isinstance(op, TgOp) or op.op_name not in _VIEWING or not op.operands:
        return written(value)
    src = op.operands[0]
    old_shape, old = info_of(src.type).shape, strides_of(src, written)
    name = op.op_name
    if name == Op.reshape:
        if is_contiguous(old_shape, old):
            return contiguous_strides(shape)
        return reshaped_strides(old_shape, old, tuple(shape)) or contiguous_strides(shape)
    if name == Op.transpose:
        return tuple(old[p] for p in op.attr("perm"))
    if name == Op.broadcast:
        lead = len(shape) - len(old_shape)
        return tuple(sympy.Integer(0) if i < lead or (_is_one(old_shape[i - lead]) and not _is_one(d))
                     else old[i - lead] for i, d in enumerate(shape))
    if name == Op.slice:
        steps = op.attr("steps") or [1] * len(old)
        return tuple(st * k for st, k in zip(old, steps))
    return old  # split: each piece keeps the strides, at an offset


def reshape_copies(op: TgOp, written: Callable[[SSAValue], tuple]) -> bool:
    """Whether the reshape `op` copies its operand (module docstring)."""
    src = op.operands[0]
    shape, strides = info_of(src.type).shape, strides_of(src, written)
    if is_contiguous(shape, strides):
        return False
    return reshaped_strides(shape, strides, tuple(op.result_infos()[0].shape)) is None
