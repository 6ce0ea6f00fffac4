"""Shape rules of the op table (ir/ops.py): each takes the operand types, the attributes and
the result types a caller gave (or None) and returns the result types, or raises ShapeError
naming the op. The builder, the verifier and the folder all call them through the table."""

from __future__ import annotations

from typing import Sequence

from tilegraph.ir import dtypes
from tilegraph.ir.shapes import (Dim, ShapeError, TensorInfo, broadcast_shapes, dims_equal, normalize_dim, numel,
                                 shape_str)


def _fail(op: str, msg: str) -> ShapeError:
    return ShapeError(f"tg.{op}: {msg}")


def _same_dtype(op: str, ins: Sequence[TensorInfo]) -> str:
    kinds = {t.dtype for t in ins}
    if len(kinds) != 1:
        raise _fail(op, "operands have different element types " + ", ".join(str(t) for t in ins))
    return ins[0].dtype


def _unary(op, result_dtype=None, floats_only=False):
    def infer(ins, attrs, given):
        (x,) = ins
        if floats_only and not dtypes.is_float(x.dtype):
            raise _fail(op, f"needs a float operand, got {x}")
        _check_ints(op, ins)
        return [TensorInfo(x.shape, result_dtype or x.dtype)]

    return infer


def _check_ints(op, ins: Sequence[TensorInfo]) -> None:
    if op not in INTS_ONLY:
        return
    for t in ins:
        if not (dtypes.is_int(t.dtype) or (INTS_ONLY[op] and dtypes.is_bool(t.dtype))):
            raise _fail(op, f"needs integer operands{' (or i1)' if INTS_ONLY[op] else ''}, got {t}")


def _binary(op, result_dtype=None):
    def infer(ins, attrs, given):
        dt = _same_dtype(op, ins)
        _check_ints(op, ins)
        try:
            shape = broadcast_shapes(*(t.shape for t in ins))
        except ShapeError as e:
            raise _fail(op, str(e)) from None
        return [TensorInfo(shape, result_dtype or dt)]

    return infer


def _where(ins, attrs, given):
    cond, a, b = ins
    if cond.dtype != "i1":
        raise _fail("where", f"condition must be i1, got {cond}")
    _same_dtype("where", [a, b])
    try:
        return [TensorInfo(broadcast_shapes(cond.shape, a.shape, b.shape), a.dtype)]
    except ShapeError as e:
        raise _fail("where", str(e)) from None


def _cast(ins, attrs, given):
    return [TensorInfo(ins[0].shape, attrs["to"])]


def _axes(op: str, axes: Sequence[int], rank: int) -> tuple[int, ...]:
    out = []
    for a in axes:
        if not -rank <= a < max(rank, 1):
            raise _fail(op, f"axis {a} is out of range for rank {rank}")
        out.append(a % rank if rank else 0)
    if len(set(out)) != len(out):
        raise _fail(op, f"repeated axis in {tuple(axes)}")
    return tuple(sorted(out))


def _reduce(op, result_dtype=None):
    def infer(ins, attrs, given):
        (x,) = ins
        axes = _axes(op, attrs["axes"], x.rank)
        if attrs["keepdims"]:
            shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
        else:
            shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
        return [TensorInfo(shape, result_dtype or x.dtype)]

    return infer


def _arg_reduce(op):
    def infer(ins, attrs, given):
        (x,) = ins
        (axis,) = _axes(op, [attrs["axis"]], x.rank)
        if attrs["keepdims"]:
            shape = tuple(1 if i == axis else d for i, d in enumerate(x.shape))
        else:
            shape = tuple(d for i, d in enumerate(x.shape) if i != axis)
        return [TensorInfo(shape, "i64")]

    return infer


def _matmul(ins, attrs, given):
    a, b = ins
    dt = _same_dtype("matmul", ins)
    if a.rank == 0 or b.rank == 0:
        raise _fail("matmul", f"operands must have rank >= 1, got {a} and {b}")
    ash = a.shape if a.rank > 1 else (1,) + a.shape
    bsh = b.shape if b.rank > 1 else b.shape + (1,)
    if not dims_equal(ash[-1], bsh[-2]):
        raise _fail("matmul", f"contracting dimensions differ: {a} @ {b}")
    try:
        batch = broadcast_shapes(ash[:-2], bsh[:-2])
    except ShapeError as e:
        raise _fail("matmul", str(e)) from None
    shape = batch + ((ash[-2],) if a.rank > 1 else ()) + ((bsh[-1],) if b.rank > 1 else ())
    return [TensorInfo(shape, dt)]


def _window_out(size: Dim, k: int, stride: int, pad_lo: int, pad_hi: int, dilation: int, ceil_mode: bool) -> Dim:
    span = dilation * (k - 1) + 1
    if isinstance(size, int):
        full = size + pad_lo + pad_hi - span
        if full < 0:
            raise ShapeError(f"window of {span} is larger than the padded input {size + pad_lo + pad_hi}")
        out = -(-full // stride) + 1 if ceil_mode else full // stride + 1
        if ceil_mode and (out - 1) * stride >= size + pad_lo:
            out -= 1
        return out
    import sympy

    full = size + pad_lo + pad_hi - span
    if not ceil_mode:
        return normalize_dim(sympy.floor(full / stride) + 1)
    out = sympy.ceiling(full / stride) + 1
    if pad_hi - span + stride <= 0:  # the last window starts before full + stride <= size + pad_lo
        return normalize_dim(out)
    # As above, one window fewer when the last starts past the input and its left padding
    # (out - 1 windows when out*stride would reach size + pad_lo, else out):
    return normalize_dim(sympy.Max(out - 1, sympy.Min(out, sympy.ceiling((size + pad_lo) / stride))))


def _spatial_attrs(op, x, attrs, kernel):
    nd = len(kernel)
    if x.rank != nd + 2:
        raise _fail(op, f"input {x} must have rank {nd + 2} (N, C and {nd} spatial dims)")
    strides = attrs.get("strides") or (1,) * nd
    dil = attrs.get("dilations") or (1,) * nd
    pads = attrs.get("pads") or (0,) * (2 * nd)
    if len(strides) != nd or len(dil) != nd or len(pads) != 2 * nd:
        raise _fail(op, f"strides {strides}, dilations {dil} and pads {pads} do not fit {nd} spatial dims")
    if any(p < 0 for p in pads):  # ONNX and torch pad windows; a crop is a slice, not a pad
        raise _fail(op, f"pads {tuple(pads)} must not be negative")
    if any(isinstance(v, int) and v < 1 for v in (*kernel, *strides, *dil)):  # an empty window has no value
        raise _fail(op, f"window {tuple(kernel)}, strides {tuple(strides)} and dilations {tuple(dil)} must be "
                        "at least 1")
    try:
        return tuple(
            _window_out(x.shape[2 + i], kernel[i], strides[i], pads[i], pads[i + nd], dil[i], attrs.get("ceil_mode", False))
            for i in range(nd)
        )
    except ShapeError as e:
        raise _fail(op, f"input {x}: {e}") from None


def _conv(ins, attrs, given):
    x, w = ins[0], ins[1]
    _same_dtype("conv", ins)
    if w.rank != x.rank:
        raise _fail("conv", f"weight {w} and input {x} differ in rank")
    groups = attrs["groups"]
    if not dims_equal(x.shape[1], w.shape[1] * groups) or w.shape[0] % groups:
        raise _fail("conv", f"input channels of {x} do not match weight {w} with groups={groups}")
    if len(ins) == 3 and (ins[2].rank != 1 or not dims_equal(ins[2].shape[0], w.shape[0])):
        raise _fail("conv", f"bias {ins[2]} does not match {w.shape[0]} output channels")
    out = _spatial_attrs("conv", x, attrs, w.shape[2:])
    return [TensorInfo((x.shape[0], w.shape[0]) + out, x.dtype)]


def _pool(op):
    def infer(ins, attrs, given):
        (x,) = ins
        out = _spatial_attrs(op, x, attrs, attrs["kernel"])
        return [TensorInfo(x.shape[:2] + out, x.dtype)]

    return infer


def _softmax(ins, attrs, given):
    _axes("softmax", [attrs["axis"]], ins[0].rank)
    return [ins[0]]


def _layer_norm(ins, attrs, given):
    x = ins[0]
    (axis,) = _axes("layer_norm", [attrs["axis"]], x.rank)
    norm_shape = x.shape[axis:]
    for t in ins[1:]:
        try:
            if broadcast_shapes(norm_shape, t.shape) != norm_shape:
                raise ShapeError("")
        except ShapeError:
            raise _fail("layer_norm", f"scale/bias {t} does not broadcast to the normalized shape {shape_str(norm_shape)}") from None
    _same_dtype("layer_norm", ins)
    return [x]


def _attention(ins, attrs, given):
    q, k, v = ins[:3]
    _same_dtype("attention", ins[:3])
    if q.rank < 2 or k.rank != q.rank or v.rank != q.rank:
        raise _fail("attention", f"q {q}, k {k}, v {v} must share a rank >= 2")
    if not dims_equal(q.shape[-1], k.shape[-1]) or not dims_equal(k.shape[-2], v.shape[-2]):
        raise _fail("attention", f"q {q}, k {k}, v {v}: head dims or key lengths differ")
    try:
        batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        scores = batch + (q.shape[-2], k.shape[-2])
        if len(ins) == 4 and broadcast_shapes(scores, ins[3].shape) != scores:
            raise ShapeError(f"mask {ins[3]} does not broadcast to the scores {shape_str(scores)}")
    except ShapeError as e:
        raise _fail("attention", str(e)) from None
    if len(ins) == 4 and ins[3].dtype not in ("i1", q.dtype):
        raise _fail("attention", f"mask {ins[3]} must be i1 (keep where true) or {q.dtype} (added)")
    return [TensorInfo(batch + (q.shape[-2], v.shape[-1]), q.dtype)]


def _attention_grad(ins, attrs, given):
    """(dq, dk, dv) of tg.attention(q, k, v, mask): each of its operand's type. q, k and v share
    their batch dims (a broadcast one's gradient would be a sum over the batch: the VJP rule
    keeps those spelled out); gy is the cotangent of the forward's result."""
    q, k, v, gy = ins[:4]
    try:
        (fwd,) = _attention([q, k, v, *ins[4:]], attrs, None)
    except ShapeError as e:
        raise _fail("attention_grad", str(e)) from None
    same = lambda a, b: a.rank == b.rank and all(dims_equal(x, y) for x, y in zip(a.shape, b.shape))  # noqa: E731
    if not same(gy, fwd) or gy.dtype != fwd.dtype:
        raise _fail("attention_grad", f"gy {gy} must be of attention's result {fwd}")
    if not all(same(TensorInfo(t.shape[:-2], t.dtype), TensorInfo(fwd.shape[:-2], t.dtype)) for t in (q, k, v)):
        raise _fail("attention_grad", f"q {q}, k {k}, v {v} must share the result's batch dims {fwd}")
    return [q, k, v]


def _given(op, check):
    def infer(ins, attrs, given):
        if not given or len(given) != 1:
            raise _fail(op, "needs its result type")
        check(ins, attrs, given[0])
        return [given[0]]

    return infer


def _check_reshape(ins, attrs, out):
    (x,) = ins
    if x.dtype != out.dtype:
        raise _fail("reshape", f"changes element type {x.dtype} -> {out.dtype}")
    if not dims_equal(numel(x.shape), numel(out.shape)):
        raise _fail("reshape", f"{x} has {numel(x.shape)} elements, result {out} has {numel(out.shape)}")


def _check_broadcast(ins, attrs, out):
    (x,) = ins
    try:
        ok = broadcast_shapes(x.shape, out.shape) == out.shape
    except ShapeError:
        ok = False
    if not ok or x.dtype != out.dtype:
        raise _fail("broadcast", f"{x} does not broadcast to {out}")


def _transpose(ins, attrs, given):
    (x,) = ins
    perm = tuple(attrs["perm"])
    if sorted(perm) != list(range(x.rank)):
        raise _fail("transpose", f"perm {perm} is not a permutation of the {x.rank} dims of {x}")
    return [TensorInfo(tuple(x.shape[p] for p in perm), x.dtype)]


def _concat(ins, attrs, given):
    dt = _same_dtype("concat", ins)
    rank = ins[0].rank
    (axis,) = _axes("concat", [attrs["axis"]], rank)
    total: Dim = 0
    for t in ins:
        if t.rank != rank or any(not dims_equal(a, b) for i, (a, b) in enumerate(zip(t.shape, ins[0].shape)) if i != axis):
            raise _fail("concat", "operands " + ", ".join(str(t) for t in ins) + f" differ off axis {axis}")
        total = normalize_dim(total + t.shape[axis])
    shape = list(ins[0].shape)
    shape[axis] = total
    return [TensorInfo(tuple(shape), dt)]


def _split(ins, attrs, given):
    (x,) = ins
    (axis,) = _axes("split", [attrs["axis"]], x.rank)
    sizes = attrs["sizes"]
    if not dims_equal(sum(sizes), x.shape[axis]):
        raise _fail("split", f"sizes {tuple(sizes)} do not add up to dim {axis} of {x}")
    return [TensorInfo(x.shape[:axis] + (s,) + x.shape[axis + 1:], x.dtype) for s in sizes]


def slice_length(dim: Dim, start: int, end: int, step: int) -> Dim:
    if isinstance(dim, int):
        return len(range(*slice(start, end, step).indices(dim)))
    import sympy

    # Symbolic dims: only the slices a model writes with them (from a start to the
    # end, or a non-negative window) are known in closed form.
    if step == 1 and start >= 0 and end >= (1 << 62):
        return normalize_dim(dim - start)
    if step == 1 and 0 <= start <= end < (1 << 62):
        return normalize_dim(sympy.Min(end, dim) - start)
    if step == 1 and start < 0 and end >= (1 << 62):
        return -start
    raise ShapeError(f"slice [{start}:{end}:{step}] of symbolic dim {dim} has no closed form")


def _slice(ins, attrs, given):
    (x,) = ins
    starts, ends, steps = attrs["starts"], attrs["ends"], attrs["steps"]
    if not len(starts) == len(ends) == len(steps) == x.rank:
        raise _fail("slice", f"starts/ends/steps need one entry per dim of {x}")
    if any(s == 0 for s in steps):
        raise _fail("slice", "step 0")
    try:
        shape = tuple(slice_length(d, *t) for d, t in zip(x.shape, zip(starts, ends, steps)))
    except ShapeError as e:
        raise _fail("slice", str(e)) from None
    return [TensorInfo(shape, x.dtype)]


def _gather(ins, attrs, given):
    x, idx = ins
    if not _signed_indices(idx):
        raise _fail("gather", f"indices {idx} must be signed integers")
    (axis,) = _axes("gather", [attrs["axis"]], x.rank)
    return [TensorInfo(x.shape[:axis] + idx.shape + x.shape[axis + 1:], x.dtype)]


def _gather_elements(ins, attrs, given):
    x, idx = ins
    if not _signed_indices(idx) or idx.rank != x.rank:
        raise _fail("gather_elements", f"indices {idx} must be signed integers of the rank of {x}")
    (axis,) = _axes("gather_elements", [attrs["axis"]], x.rank)
    # Off the axis, index position i reads the data's position i: one past the data's length has
    # no element (onnxruntime and torch.gather refuse it too). A symbolic length: the kernel's check.
    if any(i != axis and isinstance(n, int) and isinstance(d, int) and n > d
           for i, (n, d) in enumerate(zip(idx.shape, x.shape))):
        raise _fail("gather_elements", f"indices {idx} are longer than the data {x} in a dim other than axis {axis}")
    return [TensorInfo(idx.shape, x.dtype)]


def _pad(ins, attrs, given):
    (x,) = ins
    pads = attrs["pads"]
    if len(pads) != 2 * x.rank:
        raise _fail("pad", f"pads {tuple(pads)} need 2 entries per dim of {x}")
    shape = tuple(normalize_dim(d + pads[i] + pads[i + x.rank]) for i, d in enumerate(x.shape))
    if any(isinstance(d, int) and d < 0 for d in shape):
        raise _fail("pad", f"pads {tuple(pads)} cut {x} below zero")
    return [TensorInfo(shape, x.dtype)]


def _tile(ins, attrs, given):
    (x,) = ins
    reps = attrs["repeats"]
    if len(reps) != x.rank:
        raise _fail("tile", f"repeats {tuple(reps)} need one entry per dim of {x}")
    return [TensorInfo(tuple(normalize_dim(d * r) for d, r in zip(x.shape, reps)), x.dtype)]


def _same_as_input(op, check_axis=True):
    def infer(ins, attrs, given):
        if check_axis and "axis" in attrs:
            _axes(op, [attrs["axis"]], ins[0].rank)
        return [ins[0]]

    return infer


def _trilu(ins, attrs, given):
    if ins[0].rank < 2:
        raise _fail("trilu", f"needs rank >= 2, got {ins[0]}")
    return [ins[0]]


def _einsum(ins, attrs, given):
    import numpy as np

    for t in ins:
        if not all(isinstance(d, int) for d in t.shape):
            raise _fail("einsum", f"symbolic dims are not supported ({t})")
    try:
        out = np.einsum(attrs["equation"], *[np.empty(t.shape, dtype=np.int8) for t in ins])
    except ValueError as e:
        raise _fail("einsum", f"'{attrs['equation']}' on " + ", ".join(map(str, ins)) + f": {e}") from None
    return [TensorInfo(tuple(int(d) for d in out.shape), _same_dtype("einsum", ins))]


def _source(ins, attrs, given):
    if not given or len(given) != 1:
        raise ShapeError("source op needs its result type")
    return [given[0]]


def _constant(ins, attrs, given):
    (out,) = _source(ins, attrs, given)
    value = attrs["value"]
    if tuple(value.shape) != out.shape or dtypes.dtype_name(value.dtype) != out.dtype:
        raise _fail("constant", f"value is {dtypes.dtype_name(value.dtype)}{shape_str(value.shape)}, result type {out}")
    return [out]


def _bitcast(ins, attrs, given):
    (x,) = ins
    if attrs["source"] != x.dtype:
        raise _fail("bitcast", f"source {attrs['source']} is not the operand's type {x}")
    bits = [dtypes.numpy_dtype(t).itemsize for t in (x.dtype, attrs["to"])]
    if bits[0] != bits[1] or dtypes.PACKED_4BIT.count(x.dtype) != dtypes.PACKED_4BIT.count(attrs["to"]):
        raise _fail("bitcast", f"{x.dtype} and {attrs['to']} differ in width")
    return [TensorInfo(x.shape, attrs["to"])]


def _iota(ins, attrs, given):
    (out,) = _source(ins, attrs, given)
    _axes("iota", [attrs["axis"]], out.rank)
    if not (dtypes.is_int(out.dtype) or dtypes.is_float(out.dtype)):
        raise _fail("iota", f"result {out} must be of integer or float type")
    return [out]


def _scatter_common(op, x, updates, indices, attrs):
    if not _signed_indices(indices):
        raise _fail(op, f"indices {indices} must be signed integers")
    if updates.dtype != x.dtype:
        raise _fail(op, f"updates {updates} must have the element type of {x}")
    if attrs["reduction"] not in SCATTER_REDUCTIONS:
        raise _fail(op, f"reduction '{attrs['reduction']}' is not one of {SCATTER_REDUCTIONS}")


def _scatter_elements(ins, attrs, given):
    x, indices, updates = ins
    _scatter_common("scatter_elements", x, updates, indices, attrs)
    _axes("scatter_elements", [attrs["axis"]], x.rank)
    if indices.rank != x.rank or indices.shape != updates.shape:
        raise _fail("scatter_elements", f"indices {indices} and updates {updates} must share a shape of the rank of {x}")
    return [x]


def _scatter_nd(ins, attrs, given):
    x, indices, updates = ins
    _scatter_common("scatter_nd", x, updates, indices, attrs)
    k = indices.shape[-1] if indices.rank else None
    if not isinstance(k, int) or k > x.rank or updates.shape != indices.shape[:-1] + x.shape[k:]:
        raise _fail("scatter_nd", f"indices {indices} and updates {updates} do not index into {x}")
    return [x]


def _topk(ins, attrs, given):
    (x,) = ins
    (axis,) = _axes("topk", [attrs["axis"]], x.rank)
    k = attrs["k"]
    if k < 0 or (isinstance(x.shape[axis], int) and k > x.shape[axis]):
        raise _fail("topk", f"k={k} is out of range for dim {axis} of {x}")
    shape = x.shape[:axis] + (k,) + x.shape[axis + 1:]
    return [TensorInfo(shape, x.dtype), TensorInfo(shape, "i64")]


def _size_symbol(op: str, attrs) -> Dim:
    import keyword

    import sympy

    from tilegraph.ir.shapes import DIM_FUNCTIONS, parse_dim

    name = attrs["size"]
    # The symbol is a variable of generated code, next to these names: it may not take one.
    taken = name in ("np", "K", "ml_dtypes", *DIM_FUNCTIONS) or keyword.iskeyword(name)
    dim = parse_dim(name) if isinstance(name, str) and name.isidentifier() and not taken else None
    if not isinstance(dim, sympy.Symbol):
        raise _fail(op, f"size {name!r} must name a symbol (an identifier that is not a Python or "
                        "generated-code name)")
    if not 0.0 <= attrs["expected"] <= 1.0:
        raise _fail(op, f"expected fraction {attrs['expected']} of the bound is not in [0, 1]")
    return dim


def _nonzero(ins, attrs, given):
    (x,) = ins
    if x.rank == 0:
        raise _fail("nonzero", f"operand {x} must have rank >= 1")
    return [TensorInfo((x.rank, _size_symbol("nonzero", attrs)), "i64")]


def _unique(ins, attrs, given):
    (x,) = ins
    u = _size_symbol("unique", attrs)
    if attrs["flatten"]:
        return [TensorInfo((u,), x.dtype)] + [TensorInfo(s, "i64") for s in ((u,), (numel(x.shape),), (u,))]
    (axis,) = _axes("unique", [attrs["axis"]], x.rank)
    values = x.shape[:axis] + (u,) + x.shape[axis + 1:]
    return [TensorInfo(values, x.dtype)] + [TensorInfo(s, "i64") for s in ((u,), (x.shape[axis],), (u,))]


def _narrow(ins, attrs, given):
    x, length = ins
    (axis,) = _axes("narrow", [attrs["axis"]], x.rank)
    if length.rank != 0 or not dtypes.is_int(length.dtype):
        raise _fail("narrow", f"length {length} must be an integer scalar")
    return [TensorInfo(x.shape[:axis] + (_size_symbol("narrow", attrs),) + x.shape[axis + 1:], x.dtype)]


def _non_max_suppression(ins, attrs, given):
    boxes, scores = ins[:2]
    if boxes.rank != 3 or boxes.shape[2] != 4 or scores.rank != 3 or not (
            dims_equal(boxes.shape[0], scores.shape[0]) and dims_equal(boxes.shape[1], scores.shape[2])):
        raise _fail("non_max_suppression", f"boxes {boxes} must be (batch, boxes, 4) and scores {scores} "
                                           "(batch, classes, boxes)")
    if any(not dtypes.is_float(t.dtype) for t in (boxes, scores, *ins[3:])) or (
            len(ins) > 2 and not dtypes.is_int(ins[2].dtype)):
        raise _fail("non_max_suppression", "boxes, scores and thresholds must be floats, the box count an integer")
    if any(numel(t.shape) != 1 for t in ins[2:]):
        raise _fail("non_max_suppression", "the box count and thresholds must be one value each")
    return [TensorInfo((_size_symbol("non_max_suppression", attrs), 3), "i64")]


def _assert_size(ins, attrs, given):
    (x,) = ins
    (axis,) = _axes("assert_size", [attrs["axis"]], x.rank)
    if isinstance(x.shape[axis], int) and x.shape[axis] != attrs["size"]:
        raise _fail("assert_size", f"dim {axis} of {x} is not {attrs['size']}")
    return [TensorInfo(x.shape[:axis] + (attrs["size"],) + x.shape[axis + 1:], x.dtype)]


def _rnn(ins, attrs, given):
    x, w, r = ins[:3]
    cell = attrs["cell"]
    gates = {"rnn": 1, "gru": 3, "lstm": 4}.get(cell)
    if gates is None:
        raise _fail("rnn", f"cell '{cell}' is not one of rnn, gru, lstm")
    if x.rank != 3 or w.rank != 2 or r.rank != 2 or not isinstance(r.shape[0], int):
        raise _fail("rnn", f"x {x} must be (steps, batch, inputs), w {w} (gates*hidden, inputs), r {r} "
                           "(gates*hidden, hidden)")
    steps, batch, _ = x.shape
    hidden = r.shape[1]
    if not (dims_equal(w.shape[0], gates * hidden) and dims_equal(r.shape[0], gates * hidden)
            and dims_equal(w.shape[1], x.shape[2])):
        raise _fail("rnn", f"w {w} and r {r} do not hold {gates} gates of {hidden} for x {x}")
    _same_dtype("rnn", [t for t in ins if t is not None])
    want = {"bias": (2 * gates * hidden,), "h0": (batch, hidden), "c0": (batch, hidden), "peephole": (3 * hidden,)}
    for name, t in zip(("bias", "h0", "c0", "peephole"), ins[3:]):
        if not all(dims_equal(a, b) for a, b in zip(t.shape, want[name])) or t.rank != len(want[name]):
            raise _fail("rnn", f"{name} {t} must be {shape_str(want[name])}")
    if cell != "lstm" and len(ins) > 5:
        raise _fail("rnn", f"a {cell} cell has no cell state or peepholes")
    out = [TensorInfo((steps, batch, hidden), x.dtype), TensorInfo((batch, hidden), x.dtype)]
    return out + ([TensorInfo((batch, hidden), x.dtype)] if cell == "lstm" else [])


def _scale_operands(op, x, scale, zero_point, attrs, storage):
    from tilegraph.ir.quant import SCALE_TYPES, scale_layout

    if scale.dtype not in SCALE_TYPES:
        raise _fail(op, f"scale {scale} must be one of {', '.join(SCALE_TYPES)}")
    try:
        layout = scale_layout(x.rank, scale.shape, attrs["axis"], attrs["block_size"])
    except ValueError as e:
        raise _fail(op, f"scale {scale} for {x}: {e}") from None
    axis = attrs["axis"] % max(x.rank, 1)
    if layout == "channel" and not dims_equal(scale.shape[0], x.shape[axis]):
        raise _fail(op, f"per-channel scale {scale} needs one entry per index of dim {axis} of {x}")
    if layout == "block":
        blocks = x.shape[axis]
        if not isinstance(blocks, int):
            raise _fail(op, f"blocks along symbolic dim {axis} of {x} are not supported")
        want = tuple(-(-blocks // attrs["block_size"]) if i == axis else d for i, d in enumerate(x.shape))
        if not all(dims_equal(a, b) for a, b in zip(scale.shape, want)):
            raise _fail(op, f"block scale {scale} for {x} in blocks of {attrs['block_size']} must be "
                            f"{shape_str(want)}")
    if layout == "broadcast" and not all(d == 1 or dims_equal(d, e) for d, e in zip(scale.shape, x.shape)):
        raise _fail(op, f"scale {scale} does not broadcast to {x}")
    if zero_point is not None:
        if zero_point.dtype != storage:
            raise _fail(op, f"zero point {zero_point} must have the storage type {storage}")
        if zero_point.shape != scale.shape:
            raise _fail(op, f"zero point {zero_point} must have the shape of scale {scale}")
        if not dtypes.is_int(storage):
            raise _fail(op, f"a {storage} quantization has no zero point")


def _quantize(ins, attrs, given):
    from tilegraph.ir.quant import STORAGE_TYPES

    x, scale, zp = (list(ins) + [None])[:3]
    if not dtypes.is_float(x.dtype):
        raise _fail("quantize", f"needs a float operand, got {x}")
    if attrs["to"] not in STORAGE_TYPES:
        raise _fail("quantize", f"storage type '{attrs['to']}' is not one of {', '.join(STORAGE_TYPES)}")
    _scale_operands("quantize", x, scale, zp, attrs, attrs["to"])
    return [TensorInfo(x.shape, attrs["to"])]


def _dequantize(ins, attrs, given):
    from tilegraph.ir.quant import DEQUANTIZE_TYPES

    q, scale, zp = (list(ins) + [None])[:3]
    if q.dtype not in DEQUANTIZE_TYPES:
        raise _fail("dequantize", f"operand {q} is not one of {', '.join(DEQUANTIZE_TYPES)}")
    if attrs["to"] not in ("f32", "f16", "bf16", "f64"):
        raise _fail("dequantize", f"result type '{attrs['to']}' is not f32, f16, bf16 or f64")
    _scale_operands("dequantize", q, scale, zp, attrs, q.dtype)
    return [TensorInfo(q.shape, attrs["to"])]


def _dynamic_quantize(ins, attrs, given):
    from tilegraph.ir.quant import FORMATS, STORAGE_TYPES

    (x,) = ins
    to, block = attrs["to"], attrs["block_size"]
    if not dtypes.is_float(x.dtype) or x.rank == 0:
        raise _fail("dynamic_quantize", f"needs a float operand of rank >= 1, got {x}")
    if to not in STORAGE_TYPES or FORMATS[to].lo >= 0:
        raise _fail("dynamic_quantize", f"storage type '{to}' is not a signed one of {', '.join(STORAGE_TYPES)}")
    if block < 0 or (block and not isinstance(x.shape[-1], int)):
        raise _fail("dynamic_quantize", f"block_size {block} does not fit the last dim of {x}")
    if block:
        scale = TensorInfo(x.shape[:-1] + (-(-x.shape[-1] // block),), "f32" if dtypes.is_int(to) else "f8E8M0FNU")
    else:
        scale = TensorInfo(x.shape[:-1] + (1,), "f32")
    return [TensorInfo(x.shape, to), scale]


def _matmul_integer(ins, attrs, given):
    lhs, rhs, zp = (list(ins) + [None])[:3]
    for t in (lhs, rhs):
        if t.dtype not in ("i8", "ui8", "i4") or t.rank < 2:
            raise _fail("matmul_integer", f"operands must be i8, ui8 or i4 of rank >= 2, got {lhs} and {rhs}")
    if zp is not None and (zp.dtype != lhs.dtype or zp.rank != 0):
        raise _fail("matmul_integer", f"the zero point {zp} must be a {lhs.dtype} scalar")
    (out,) = _matmul([TensorInfo(lhs.shape, "f32"), TensorInfo(rhs.shape, "f32")], {}, None)
    return [TensorInfo(out.shape, "i32")]


def _block_matmul(ins, attrs, given):
    x, w = ins
    _block_weight("block_matmul", w, attrs)
    if attrs["activation"] not in ("f32", "q8") or (attrs["activation"] == "q8" and attrs["k"] % 32):
        raise _fail("block_matmul", f"activation={attrs['activation']!r} must be 'f32', or 'q8' with k a "
                                    "multiple of 32")
    if not dtypes.is_float(x.dtype) or x.rank < 1 or not dims_equal(x.shape[-1], attrs["k"]):
        raise _fail("block_matmul", f"x {x} must be float with last dim k = {attrs['k']}")
    return [TensorInfo(x.shape[:-1] + (w.shape[0],), x.dtype)]


def _block_gather(ins, attrs, given):
    w, indices = ins
    _block_weight("block_gather", w, attrs)
    if not dtypes.is_int(indices.dtype):
        raise _fail("block_gather", f"indices {indices} must be integers")
    return [TensorInfo(indices.shape + (attrs["k"],), "f32")]


# A KV cache narrower than its f32 rows (llama.cpp's default f16 cache: half the bytes a decode
# step reads at depth): cache_write rounds into it, cache_attention reads it widened.
CACHE_STORES = ("f16",)


def _cache_write(ins, attrs, given):
    cache, x, pos = ins
    store = attrs.get("store", "")
    if cache.rank != 4 or x.rank != 4 or x.dtype != cache.dtype and store != cache.dtype or not all(
            dims_equal(a, b) for i, (a, b) in enumerate(zip(cache.shape, x.shape)) if i != 2):
        raise _fail("cache_write", f"x {x} must be [B, Hkv, T, D] of the cache {cache} ([B, Hkv, S, D])")
    if store and (store != cache.dtype or store not in CACHE_STORES or x.dtype != "f32"):
        raise _fail("cache_write", f"store='{store}' rounds f32 rows into a cache of that type "
                                   f"({', '.join(CACHE_STORES)}); the cache is {cache}, x {x}")
    _positions("cache_write", pos, cache.shape[0])
    return [cache]


def _cache_attention(ins, attrs, given):
    q, k, v, pos = ins
    if q.rank != 4 or k.rank != 4 or v.rank != 4 or k.dtype != v.dtype or not (
            q.dtype == k.dtype or q.dtype == "f32" and k.dtype in CACHE_STORES):
        raise _fail("cache_attention", f"q {q}, k_cache {k}, v_cache {v} must be rank 4 of one dtype (or f32 "
                                       f"queries over a cache of {', '.join(CACHE_STORES)})")
    heads, kv_heads = q.shape[1], k.shape[1]
    if not (dims_equal(q.shape[0], k.shape[0]) and all(dims_equal(a, b) for a, b in zip(k.shape[:3], v.shape[:3]))
            and dims_equal(q.shape[3], k.shape[3])):
        raise _fail("cache_attention", f"q {q} [B, H, T, D], k_cache {k} [B, Hkv, S, D], v_cache {v} "
                                       "[B, Hkv, S, Dv] do not match")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise _fail("cache_attention", f"{heads} query heads are not a multiple of {kv_heads} K/V heads")
    if attrs.get("window", 0) < 0:
        raise _fail("cache_attention", f"window {attrs['window']} must be 0 (none) or a number of positions")
    _positions("cache_attention", pos, q.shape[0])
    return [TensorInfo(q.shape[:3] + (v.shape[3],), q.dtype)]


def _sample(ins, attrs, given):
    logits, seen, u = ins
    if (logits.rank != 2 or not dtypes.is_float(logits.dtype) or seen.dtype != "ui8" or seen.rank != 2
            or not all(dims_equal(a, b) for a, b in zip(logits.shape, seen.shape)) or u.rank != 1
            or not dtypes.is_float(u.dtype) or not dims_equal(u.shape[0], logits.shape[0])):
        raise _fail("sample", f"logits {logits} [B, vocab] float, seen {seen} ui8 [B, vocab], u {u} [B] float")
    if (attrs["temperature"] < 0 or attrs["top_k"] < 0 or not 0 < attrs["top_p"] <= 1
            or not attrs["repetition_penalty"] > 0):
        raise _fail("sample", "temperature >= 0, top_k >= 0, 0 < top_p <= 1 and repetition_penalty > 0, got "
                              + ", ".join(f"{k}={attrs[k]}" for k in ("temperature", "top_k", "top_p",
                                                                       "repetition_penalty")))
    return [TensorInfo(logits.shape[:1], "i64")]


def _rms_norm(ins, attrs, given):
    x = ins[0]
    (axis,) = _axes("rms_norm", [attrs["axis"]], x.rank)
    if len(ins) == 2 and (ins[1].dtype != x.dtype or broadcast_shapes(x.shape[axis:], ins[1].shape) != x.shape[axis:]):
        raise _fail("rms_norm", f"scale {ins[1]} must be {x.dtype} broadcasting to {shape_str(x.shape[axis:])}")
    return [x]


def _rope(ins, attrs, given):
    x, cos, sin = ins
    half = x.shape[-1] // 2 if x.rank and isinstance(x.shape[-1], int) and x.shape[-1] % 2 == 0 else None
    if half is None or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise _fail("rope", f"x {x} needs an even last dim, cos {cos} and sin {sin} its dtype")
    try:
        for t in (cos, sin):
            if broadcast_shapes(x.shape[:-1] + (half,), t.shape) != x.shape[:-1] + (half,):
                raise ShapeError("")
    except ShapeError:
        raise _fail("rope", f"cos {cos} and sin {sin} must broadcast to {shape_str(x.shape[:-1] + (half,))}") from None
    return [x]


def _dropout(ins, attrs, given):
    x, seed = ins
    if not dtypes.is_float(x.dtype) or seed.rank != 0 or not dtypes.is_int(seed.dtype) or seed.dtype == "i1":
        raise _fail("dropout", f"x {x} must be a float tensor and seed {seed} an integer scalar")
    if not 0 <= attrs["p"] < 1 or not 0 <= attrs["site"] < 1 << 32:
        raise _fail("dropout", f"p must lie in [0, 1) and site in [0, 2^32), got p={attrs['p']}, site={attrs['site']}")
    return [x]


# Ops defined on integers only (NumPy, Triton and C have no float shift or bitwise and);
# the bitwise ones on i1 as well, as NumPy's logical and/or/xor/not.
INTS_ONLY = {"shift_left": False, "shift_right": False, "bitwise_and": True, "bitwise_or": True,
             "bitwise_xor": True, "bitwise_not": True}  # op: whether i1 operands are allowed


def _signed_indices(idx: TensorInfo) -> bool:
    """Indices are signed integers (ONNX's int32/int64): an unsigned one past the signed range
    (uint64 2**64 - 1) reads as -1 in every kernel, a valid index counted from the end."""
    return dtypes.is_int(idx.dtype) and not idx.dtype.startswith("ui") and idx.dtype != "i1"


SCATTER_REDUCTIONS = ("none", "add", "mul", "max", "min")


def _block_weight(op, w, attrs):
    from tilegraph.ir.block_formats import BlockFormatError, block_format

    try:
        row = block_format(attrs["format"]).row_bytes(attrs["k"])
    except BlockFormatError as e:
        raise _fail(op, str(e)) from None
    if w.dtype != "ui8" or w.rank != 2 or not dims_equal(w.shape[1], row):
        raise _fail(op, f"weight {w} must be ui8[N, {row}]: rows of {attrs['k']} {attrs['format']} values")


def _positions(op, pos, batch):
    if pos.dtype not in ("i32", "i64") or not (pos.rank == 0 or (pos.rank == 1 and dims_equal(pos.shape[0], batch))):
        raise _fail(op, f"pos {pos} must be an i64 scalar or one i64 per sequence ({shape_str((batch,))})")
