"""The tg op table: every op's operands, attributes, shape rule and NumPy semantics.

This table is the one description of what an op means. The dialect generates its
xDSL op classes from it, the builder and the verifier run its shape rules, and the
reference interpreter and the NumPy emitter both render its `numpy` template (the
interpreter in float64, the emitter in the graph's dtypes). Each op also carries the
traits passes read instead of lists of op names (fusion pattern kind, reduction kind,
FLOPs, loop space). Adding an op is adding one `OpSpec` here, and one entry in each
backend's lowering table (backends/lowering.py; a test fails until there is one).

Templates name operands and attributes in braces: `np.sum({x}, axis={axes}, ...)`.
`{out_shape}` is the result shape as Python (symbolic dims are local variables of
the generated code), `{dtype}` the result's NumPy dtype. `K` is `ir.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tilegraph.ir import dtypes, loops
from tilegraph.ir.shapes import (
    Dim,
    ShapeError,
    TensorInfo,
    broadcast_shapes,
    dims_equal,
    normalize_dim,
    numel,
    shape_str,
)

REQUIRED = object()  # attribute default meaning "must be given"

# Fusion pattern kinds, after TVM's OpPatternKind (include/tvm/relax/op_attr_types.h):
# what a fused loop may do with the op. `fuse`, `tile` and the backends read these.
ELEMWISE = "elementwise"  # result[i] from operands[i] (broadcast included): fuses anywhere
INJECTIVE = "injective"  # each result element copies one operand element (layout ops, trilu)
REDUCE = "reduce"  # reads along an axis: reductions, scans, pools, softmax, layer_norm
ANCHOR = "anchor"  # TVM's out-elementwise-fusable: a GEMM-like op a group is built around
OPAQUE = "opaque"  # never fused: sources and number-format changes
PATTERNS = (ELEMWISE, INJECTIVE, REDUCE, ANCHOR, OPAQUE)
PATTERN_OF_CATEGORY = {"elementwise": ELEMWISE, "layout": INJECTIVE, "reduction": REDUCE, "composite": REDUCE,
                       "contraction": ANCHOR, "source": OPAQUE, "quantize": OPAQUE}


@dataclass(frozen=True)
class OpSpec:
    name: str
    # Operand names; "name?" is optional (trailing), "*name" takes any number (alone).
    operands: tuple[str, ...]
    attrs: dict[str, tuple[str, Any]]  # name -> (kind, default); kinds below
    infer: Callable[[list[TensorInfo], dict, Sequence[TensorInfo] | None], list[TensorInfo]]
    numpy: str | Callable[..., str]
    # What kind of op it is: elementwise, reduction, contraction, layout, composite,
    # source, quantize.
    category: str
    doc: str = ""
    # The result type is given by the user and checked, not derived (reshape, broadcast, cast).
    result_given: bool = False
    # --- traits: what passes and backends read instead of lists of op names ---
    # Fusion pattern kind (PATTERNS below); by default from the category.
    pattern: str = ""
    # Which reduction a reduce op computes: sum, mean, max, min or prod (None: not a reduce op).
    reduction: str | None = None
    # Moves or names data without computing: a NumPy view, indexing in a fused GPU kernel.
    view: bool = False
    # Normalizes each row along `axis` (softmax, layer_norm): reads a whole row before it
    # writes any of it, so a loop computes it one row at a time (a row kernel).
    row_normalizing: bool = False
    # Operand 1 holds indices into operand 0 along its `axis` attribute (gather, gather_elements):
    # each must lie in that dim (checked at the call, bounded by the fuzzers' inputs).
    indexed: bool = False
    # The GEMM an anchor makes, (ins, outs) -> (m, n, k) as sympy expressions, m counting every
    # batch row: what the cost model prices and a GPU tile covers. None: not a GEMM.
    gemm: Callable[..., Any] | None = None
    # FLOPs per result element (per operand element for a reduction), or a function
    # of the shapes (ins, outs) -> FLOPs for the ops whose count depends on more than one shape.
    flops: int | Callable[..., Any] = 1
    # The NumPy template's passes over its data on the CPU, as (calibrated ufunc, count)
    # per result element, and its NumPy calls where that is not one per pass (the cost
    # model prices them; read off the templates and ir/kernels.py). () = one simple pass.
    cpu_passes: tuple[tuple[str, int], ...] = ()
    numpy_calls: int = 0
    # The iteration space (ir/loops.py) the sharding planner splits; None: runs replicated.
    loops: Callable[..., Any] | None = None
    # Data-dependent size (nonzero, unique, narrow): the op's `size` attribute names a dim of
    # its results known only at run time; this gives its upper bound from the operands,
    # (ins, attrs) -> Dim. None: every result dim follows from the operands' shapes.
    bound: Callable[..., Any] | None = None

    def flop_count(self, ins: Sequence[TensorInfo], outs: Sequence[TensorInfo]):
        """FLOPs of one op at these shapes (multiply-add = 2), a sympy expression."""
        import sympy

        if callable(self.flops):
            return sympy.sympify(self.flops(ins, outs))
        return self.flops * sympy.sympify(numel((ins[0] if self.category == "reduction" else outs[0]).shape))

    def __post_init__(self):
        if not self.pattern:
            object.__setattr__(self, "pattern", PATTERN_OF_CATEGORY[self.category])
        assert self.pattern in PATTERNS, self.pattern

    def gemm_dims(self, ins: Sequence[TensorInfo], outs: Sequence[TensorInfo]) -> tuple[Any, Any, Any]:
        """(m, n, k) of the GEMM this anchor makes at these shapes (`gemm`)."""
        if self.gemm is None:
            raise ValueError(f"tg.{self.name} makes no GEMM")
        return self.gemm(ins, outs)

    @property
    def pointwise(self) -> bool:
        """result[i] from operands[i] alone (elementwise ops and gelu): an expression any loop
        over the result can compute where it needs it."""
        return self.pattern == ELEMWISE

    @property
    def variadic(self) -> bool:
        return len(self.operands) == 1 and self.operands[0].startswith("*")

    @property
    def operand_names(self) -> list[str]:
        return [o.strip("*?") for o in self.operands]

    def arity(self) -> tuple[int, int]:
        if self.variadic:
            return (1, 1 << 30)
        required = sum(1 for o in self.operands if not o.endswith("?"))
        return (required, len(self.operands))


OPS: dict[str, OpSpec] = {}


def _op(name, operands, infer, numpy, category, attrs=None, doc="", **kw) -> None:
    kw.setdefault("flops", 0 if category in ("layout", "source") else 1)  # copies compute nothing
    kw.setdefault("pattern", PATTERN_OF_CATEGORY[category])
    kw.setdefault("cpu_passes", CPU_PASSES.get(name, ()))
    if kw["pattern"] == ELEMWISE:
        kw.setdefault("loops", loops.elementwise)
    OPS[name] = OpSpec(name, tuple(operands), dict(attrs or {}), infer, numpy, category, doc, **kw)


def _fail(op: str, msg: str) -> ShapeError:
    return ShapeError(f"tg.{op}: {msg}")


# --- shape rules -------------------------------------------------------------


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


# Ops defined on integers only (NumPy, Triton and C have no float shift or bitwise and);
# the bitwise ones on i1 as well, as NumPy's logical and/or/xor/not.
INTS_ONLY = {"shift_left": False, "shift_right": False, "bitwise_and": True, "bitwise_or": True,
             "bitwise_xor": True, "bitwise_not": True}  # op: whether i1 operands are allowed


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
    return normalize_dim((sympy.ceiling(full / stride) if ceil_mode else sympy.floor(full / stride)) + 1)


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


def _render_slice(operands, attrs, **_):
    parts = []
    for s, e, st in zip(attrs["starts"], attrs["ends"], attrs["steps"]):
        if (s, e, st) == (0, (1 << 63) - 1, 1):
            parts.append(":")
        else:
            parts.append(f"{s}:{e}" + (f":{st}" if st != 1 else ""))
    return f"{operands['x']}[{', '.join(parts) or '...'}]"


def _signed_indices(idx: TensorInfo) -> bool:
    """Indices are signed integers (ONNX's int32/int64): an unsigned one past the signed range
    (uint64 2**64 - 1) reads as -1 in every kernel, a valid index counted from the end."""
    return dtypes.is_int(idx.dtype) and not idx.dtype.startswith("ui") and idx.dtype != "i1"


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
    _axes("gather_elements", [attrs["axis"]], x.rank)
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


# --- FLOPs of the ops whose count depends on more than their result's size ---

SOFTMAX_FLOPS = 5  # per element: max, subtract, exp, sum, divide (conventional counts)


def _matmul_flops(ins, outs):
    return 2 * numel(outs[0].shape) * ins[0].shape[-1]


def _conv_flops(ins, outs):
    return 2 * numel(outs[0].shape) * numel(ins[1].shape[1:])


def _attention_flops(ins, outs):
    import sympy

    q, k, v = ins[:3]
    batch_q = sympy.sympify(numel(outs[0].shape)) / v.shape[-1]  # batch * Lq
    return batch_q * k.shape[-2] * (2 * q.shape[-1] + 2 * v.shape[-1] + SOFTMAX_FLOPS)


def _einsum_flops(ins, outs):
    return 2 * max(numel(t.shape) for t in ins)  # (einsum shapes are concrete)


# --- the table ---------------------------------------------------------------

# The NumPy templates' passes per result element on the CPU (OpSpec.cpu_passes), for the
# ops made by the loops below; the ops defined one by one name theirs where they are.
CPU_PASSES: dict[str, tuple[tuple[str, int], ...]] = {
    "add": (("add", 1),), "sub": (("add", 1),), "mul": (("mul", 1),), "div": (("div", 1),),
    "max": (("maximum", 1),), "min": (("maximum", 1),), "relu": (("maximum", 1),),
    "exp": (("exp", 1),), "tanh": (("tanh", 1),), "sqrt": (("sqrt", 1),), "rsqrt": (("sqrt", 1), ("div", 1)),
    "reciprocal": (("div", 1),), "erf": (("erf", 1),), "where": (("where", 1),),
    "pow": (("exp", 1), ("log", 1)),  # float np.power: exp(y log x), at about their cost
    "sigmoid": (("exp", 1), ("add", 3), ("div", 2), ("where", 1)),
    **{f"reduce_{kind}": (("sum", 1),) for kind in ("sum", "mean", "max", "min", "prod")},
}
# FLOPs per element where not 1 (conventional counts; the cost model's FLOPs-only baseline).
UNARY_FLOPS = {"sigmoid": 4, "erf": 8, "rsqrt": 2}

# Unary elementwise: name -> template
UNARY = {
    "neg": "K.negative({x})",
    "abs": "np.abs({x})",
    "exp": "np.exp({x})",
    "log": "np.log({x})",
    "sqrt": "np.sqrt({x})",
    "rsqrt": "1 / np.sqrt({x})",
    "reciprocal": "1 / {x}",
    "tanh": "np.tanh({x})",
    "sigmoid": "K.sigmoid({x})",
    "relu": "np.maximum({x}, 0)",
    "erf": "K.erf({x})",
    "sin": "np.sin({x})",
    "cos": "np.cos({x})",
    "tan": "np.tan({x})",
    "asin": "np.arcsin({x})",
    "acos": "np.arccos({x})",
    "atan": "np.arctan({x})",
    "sinh": "np.sinh({x})",
    "cosh": "np.cosh({x})",
    "asinh": "np.arcsinh({x})",
    "acosh": "np.arccosh({x})",
    "atanh": "np.arctanh({x})",
    "floor": "np.floor({x})",
    "ceil": "np.ceil({x})",
    "round": "np.round({x})",  # half to even, as ONNX Round and torch.round
    "sign": "np.sign({x})",
    "bitwise_not": "np.invert({x})",
}
FLOAT_ONLY = {"exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "erf", "sin", "cos", "tan", "asin", "acos",
              "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "gelu"}
for _name, _tpl in UNARY.items():
    # K.erf evaluates its polynomial in 2 NumPy calls per coefficient (7) plus clip, square, multiply, tanh.
    _op(_name, ["x"], _unary(_name, floats_only=_name in FLOAT_ONLY), _tpl, "elementwise",
        flops=UNARY_FLOPS.get(_name, 1), numpy_calls=16 if _name == "erf" else 0)
# Composite (decompose spells it out), but elementwise to fusion, tiling and sharding.
# (f32, K.gelu) clip, square, the erf polynomial's 12 passes, multiply, exp, add, divide;
# 18 NumPy calls per block of ERF_BLOCK elements.
_op("gelu", ["x"], _unary("gelu", floats_only=True), "K.gelu({x}, {approximate})", "composite",
    {"approximate": ("str", "none")}, doc="x * Phi(x); approximate='tanh' uses the tanh formula",
    pattern=ELEMWISE, flops=8, cpu_passes=(("add", 15), ("exp", 1), ("add", 1), ("div", 1)), numpy_calls=18)
_op("not", ["x"], _unary("not", "i1"), "np.logical_not({x})", "elementwise")
_op("isnan", ["x"], _unary("isnan", "i1"), "np.isnan({x})", "elementwise")
_op("isinf", ["x"], _unary("isinf", "i1"), "K.isinf({x}, {detect_positive}, {detect_negative})", "elementwise",
    {"detect_positive": ("bool", True), "detect_negative": ("bool", True)})
_op("cast", ["x"], _cast, "{x}.astype({dtype})", "elementwise", {"to": ("str", REQUIRED)})


def _bitcast(ins, attrs, given):
    (x,) = ins
    if attrs["source"] != x.dtype:
        raise _fail("bitcast", f"source {attrs['source']} is not the operand's type {x}")
    bits = [dtypes.numpy_dtype(t).itemsize for t in (x.dtype, attrs["to"])]
    if bits[0] != bits[1] or dtypes.PACKED_4BIT.count(x.dtype) != dtypes.PACKED_4BIT.count(attrs["to"]):
        raise _fail("bitcast", f"{x.dtype} and {attrs['to']} differ in width")
    return [TensorInfo(x.shape, attrs["to"])]


# Both types are named (`source` repeats the operand's) because the reference interpreter holds
# floats widened to f64 and renders `{dtype}` as f64: the kernel narrows the operand back to its
# own type and reinterprets the bits as `to`, in every backend alike.
_op("bitcast", ["x"], _bitcast, "K.bitcast({x}, {source}, {to})", "layout",
    {"to": ("str", REQUIRED), "source": ("str", REQUIRED)},
    doc="the bits of each element reinterpreted as type `to` of the same width (ONNX BitCast)")

BINARY = {
    # (NumPy backend) ufunc calls rather than operators, so that a fused group can add `out=`.
    "add": "np.add({lhs}, {rhs})",
    "sub": "np.subtract({lhs}, {rhs})",
    "mul": "np.multiply({lhs}, {rhs})",
    "div": "K.div({lhs}, {rhs})",
    "pow": "K.pow({lhs}, {rhs})",
    "max": "np.maximum({lhs}, {rhs})",
    "min": "np.minimum({lhs}, {rhs})",
    "bitwise_and": "np.bitwise_and({lhs}, {rhs})",
    "bitwise_or": "np.bitwise_or({lhs}, {rhs})",
    "bitwise_xor": "np.bitwise_xor({lhs}, {rhs})",
    "shift_left": "np.left_shift({lhs}, {rhs})",
    "shift_right": "np.right_shift({lhs}, {rhs})",
}
for _name, _tpl in BINARY.items():
    _op(_name, ["lhs", "rhs"], _binary(_name), _tpl, "elementwise")
_op("mod", ["lhs", "rhs"], _binary("mod"), "K.mod({lhs}, {rhs}, {fmod})", "elementwise", {"fmod": ("bool", False)},
    doc="fmod=false: sign of the divisor (Python %); fmod=true: sign of the dividend (C fmod)")
LOGICAL = {"and": "np.logical_and", "or": "np.logical_or", "xor": "np.logical_xor"}
for _name, _fn in LOGICAL.items():
    _op(_name, ["lhs", "rhs"], _binary(_name, "i1"), _fn + "({lhs}, {rhs})", "elementwise")
COMPARE = {"eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal"}
for _name, _fn in COMPARE.items():
    _op(_name, ["lhs", "rhs"], _binary(_name, "i1"), f"np.{_fn}({{lhs}}, {{rhs}})", "elementwise")
_op("where", ["cond", "lhs", "rhs"], _where, "np.where({cond}, {lhs}, {rhs})", "elementwise")

# (NumPy backend) sum and prod name their dtype: NumPy would widen small integers to int64.
REDUCTION_TEMPLATES = {
    "sum": "np.sum({x}, axis={axes}, keepdims={keepdims}, dtype={dtype})",
    "mean": "np.mean({x}, axis={axes}, keepdims={keepdims})",
    "max": "np.max({x}, axis={axes}, keepdims={keepdims})",
    "min": "np.min({x}, axis={axes}, keepdims={keepdims})",
    "prod": "np.prod({x}, axis={axes}, keepdims={keepdims}, dtype={dtype})",
}
for _name, _tpl in REDUCTION_TEMPLATES.items():
    _op("reduce_" + _name, ["x"], _reduce("reduce_" + _name), _tpl, "reduction",
        {"axes": ("ints", REQUIRED), "keepdims": ("bool", False)}, reduction=_name, loops=loops.reduce(_name))
for _name in ("argmax", "argmin"):
    _op(_name, ["x"], _arg_reduce(_name), f"K.{_name}({{x}}, {{axis}}, {{keepdims}}, {{select_last_index}})",
        "reduction", {"axis": ("int", REQUIRED), "keepdims": ("bool", False), "select_last_index": ("bool", False)})

def _render_matmul(operands, attrs, out_shape, dtype):
    expr = f"np.matmul({operands['lhs']}, {operands['rhs']})"
    # NumPy has no bf16/fp8 matmul loop and computes those in f32: round back to the declared type.
    return f"{expr}.astype({dtype})" if dtype.startswith("ml_dtypes.") else expr


def _gemm_rows(out, per_row):
    """The rows of a result of `per_row` values each: none where a row is empty (not 0/0,
    which priced a zero-size batched matmul as NaN)."""
    import sympy

    return sympy.Integer(0) if per_row == 0 else sympy.sympify(numel(out.shape)) / per_row


def _gemm_of_matmul(ins, outs):
    import sympy

    out = outs[0]
    n = sympy.sympify(out.shape[-1]) if ins[1].rank > 1 else sympy.Integer(1)
    return _gemm_rows(out, n), n, sympy.sympify(ins[0].shape[-1])


def _gemm_of_conv(ins, outs):
    """im2col's GEMM: a row per output pixel (and batch), a column per filter, k = C/groups x window."""
    import sympy

    n = sympy.sympify(ins[1].shape[0])
    return _gemm_rows(outs[0], n), n, sympy.sympify(numel(ins[1].shape[1:]))


def _gemm_of_attention(ins, outs):
    """QK^T's GEMM: a row per query (and batch, head), a column per key, k = head dim."""
    import sympy

    q, k = ins[0], ins[1]
    return _gemm_rows(outs[0], sympy.sympify(q.shape[-1])), sympy.sympify(k.shape[-2]), sympy.sympify(q.shape[-1])


_op("matmul", ["lhs", "rhs"], _matmul, _render_matmul, "contraction",
    doc="NumPy matmul: batched, broadcasting, 1-D operands promoted and squeezed", flops=_matmul_flops,
    loops=loops.matmul, gemm=_gemm_of_matmul)
_op("einsum", ["*inputs"], _einsum, "np.einsum({equation}, *{inputs})", "contraction", {"equation": ("str", REQUIRED)},
    flops=_einsum_flops)
_op("conv", ["x", "w", "bias?"], _conv, "K.conv({x}, {w}, {bias}, {strides}, {pads}, {dilations}, {groups})",
    "contraction", {"strides": ("ints", ()), "pads": ("ints", ()), "dilations": ("ints", ()), "groups": ("int", 1)},
    doc="N-d convolution (conv2d when x is NCHW); pads are all begins, then all ends", flops=_conv_flops,
    gemm=_gemm_of_conv)
_POOL = {"kernel": ("ints", REQUIRED), "strides": ("ints", ()), "pads": ("ints", ()), "dilations": ("ints", ()),
         "ceil_mode": ("bool", False)}
_op("max_pool", ["x"], _pool("max_pool"),
    "K.max_pool({x}, {kernel}, {strides}, {pads}, {dilations}, {ceil_mode})", "reduction", _POOL)
_op("avg_pool", ["x"], _pool("avg_pool"),
    "K.avg_pool({x}, {kernel}, {strides}, {pads}, {dilations}, {ceil_mode}, {count_include_pad})", "reduction",
    {**_POOL, "count_include_pad": ("bool", False)})

# K.softmax: max, subtract, exp, sum, divide.
_op("softmax", ["x"], _softmax, "K.softmax({x}, {axis})", "composite", {"axis": ("int", -1)},
    flops=SOFTMAX_FLOPS, cpu_passes=(("sum", 2), ("add", 1), ("exp", 1), ("div", 1)), loops=loops.normalized(False),
    row_normalizing=True)
# K.layer_norm: mean, subtract, square, mean, add eps + sqrt + divide, scale, shift.
_op("layer_norm", ["x", "scale?", "bias?"], _layer_norm, "K.layer_norm({x}, {scale}, {bias}, {axis}, {epsilon})",
    "composite", {"axis": ("int", -1), "epsilon": ("float", 1e-5)}, doc="normalizes over dims axis.. of x",
    flops=8, cpu_passes=(("sum", 2), ("add", 2), ("mul", 2), ("sqrt", 1), ("div", 1)), loops=loops.normalized(True),
    row_normalizing=True)
# A GEMM-like anchor to fusion (its epilogue fuses on); composite to decompose.
_op("attention", ["q", "k", "v", "mask?"], _attention, "K.attention({q}, {k}, {v}, {mask}, {scale}, {causal})",
    "composite", {"scale": ("float", REQUIRED), "causal": ("bool", False)},
    doc="softmax(q @ k^T * scale + mask) @ v; an i1 mask keeps where true, a float mask is added",
    pattern=ANCHOR, flops=_attention_flops, loops=loops.attention, gemm=_gemm_of_attention)

_op("reshape", ["x"], _given("reshape", _check_reshape), "np.reshape({x}, {out_shape})", "layout", result_given=True,
    view=True, loops=loops.reshape)
_op("broadcast", ["x"], _given("broadcast", _check_broadcast), "np.broadcast_to({x}, {out_shape})", "layout",
    result_given=True, view=True, loops=loops.elementwise)
_op("transpose", ["x"], _transpose, "np.transpose({x}, {perm})", "layout", {"perm": ("ints", REQUIRED)}, view=True,
    loops=loops.transpose)
_op("concat", ["*inputs"], _concat, "np.concatenate({inputs}, axis={axis})", "layout", {"axis": ("int", REQUIRED)})
_op("split", ["x"], _split, "K.split({x}, {axis}, {sizes})", "layout",
    {"axis": ("int", REQUIRED), "sizes": ("ints", REQUIRED)})
_op("slice", ["x"], _slice, _render_slice, "layout",
    {"starts": ("ints", REQUIRED), "ends": ("ints", REQUIRED), "steps": ("ints", REQUIRED)},
    doc="Python slicing per dim: start, end (clamped), step", view=True)
_op("gather", ["x", "indices"], _gather, "np.take({x}, {indices}, axis={axis})", "layout", {"axis": ("int", 0)},
    doc="np.take: embedding lookup is gather on axis 0; negative indices count from the end", loops=loops.gather,
    indexed=True)
_op("gather_elements", ["x", "indices"], _gather_elements, "K.gather_elements({x}, {indices}, {axis})", "layout",
    {"axis": ("int", 0)}, indexed=True)
_op("pad", ["x"], _pad, "K.pad({x}, {pads}, {mode}, {value})", "layout",
    {"pads": ("ints", REQUIRED), "mode": ("str", "constant"), "value": ("float", 0.0)})
_op("tile", ["x"], _tile, "np.tile({x}, {repeats})", "layout", {"repeats": ("ints", REQUIRED)})
_op("cumsum", ["x"], _same_as_input("cumsum"), "K.cumsum({x}, {axis}, {exclusive}, {reverse})", "reduction",
    {"axis": ("int", REQUIRED), "exclusive": ("bool", False), "reverse": ("bool", False)})
# Elementwise, but which elements depends on the index: no row chunks, no splits.
_op("trilu", ["x"], _trilu, "K.trilu({x}, {k}, {upper})", "elementwise", {"k": ("int", 0), "upper": ("bool", True)},
    pattern=INJECTIVE)

_op("constant", [], _constant, "{value}", "source", {"value": ("dense", REQUIRED)}, result_given=True,
    doc="a small inline constant; large arrays go in the weight store", view=True)
_op("weight", [], _source, "{name}", "source", {"name": ("str", REQUIRED)}, result_given=True,
    doc="a named array of the weight store", view=True, loops=loops.source)


# --- ops added for the ONNX frontend ---


def _iota(ins, attrs, given):
    (out,) = _source(ins, attrs, given)
    _axes("iota", [attrs["axis"]], out.rank)
    if not (dtypes.is_int(out.dtype) or dtypes.is_float(out.dtype)):
        raise _fail("iota", f"result {out} must be of integer or float type")
    return [out]


_op("iota", [], _iota, "K.iota({out_shape}, {axis}, {dtype})", "source", {"axis": ("int", 0)}, result_given=True,
    doc="0, 1, ..., n-1 along axis, broadcast to the result shape (stablehlo.iota); ONNX Range, EyeLike, OneHot "
        "and slices to a symbolic length are built on it")

SCATTER_REDUCTIONS = ("none", "add", "mul", "max", "min")


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


_op("scatter_elements", ["x", "indices", "updates"], _scatter_elements,
    "K.scatter_elements({x}, {indices}, {updates}, {axis}, {reduction})", "layout",
    {"axis": ("int", 0), "reduction": ("str", "none")},
    doc="a copy of x with x[..., indices[p], ...] (along axis) set to, or combined with, updates[p]; "
        "the inverse of gather_elements (ONNX ScatterElements)")
_op("scatter_nd", ["x", "indices", "updates"], _scatter_nd, "K.scatter_nd({x}, {indices}, {updates}, {reduction})",
    "layout", {"reduction": ("str", "none")},
    doc="a copy of x with the slices x[indices[p]] (k = indices.shape[-1] leading dims) set to, or combined "
        "with, updates[p] (ONNX ScatterND)")
_op("cumprod", ["x"], _same_as_input("cumprod"), "K.cumprod({x}, {axis}, {exclusive}, {reverse})", "reduction",
    {"axis": ("int", REQUIRED), "exclusive": ("bool", False), "reverse": ("bool", False)},
    doc="running product along axis, as cumsum")


def _topk(ins, attrs, given):
    (x,) = ins
    (axis,) = _axes("topk", [attrs["axis"]], x.rank)
    k = attrs["k"]
    if k < 0 or (isinstance(x.shape[axis], int) and k > x.shape[axis]):
        raise _fail("topk", f"k={k} is out of range for dim {axis} of {x}")
    shape = x.shape[:axis] + (k,) + x.shape[axis + 1:]
    return [TensorInfo(shape, x.dtype), TensorInfo(shape, "i64")]


_op("topk", ["x"], _topk, "K.topk({x}, {k}, {axis}, {largest})", "reduction",
    {"k": ("int", REQUIRED), "axis": ("int", -1), "largest": ("bool", True)},
    doc="the k largest (or smallest) values along axis and their indices, sorted; equal values in index "
        "order (ONNX TopK, torch.topk)")


# --- ops added for the torch frontend ---
# exp(x) - 1 and log(1 + x) lose every significant digit for |x| below the dtype's
# epsilon (torch.expm1/log1p, ELU, softplus); NumPy has the accurate functions.
for _name in ("expm1", "log1p"):
    _op(_name, ["x"], _unary(_name, floats_only=True), f"np.{_name}({{x}})", "elementwise")



# --- data-dependent sizes ---
# A dim known only at run time ("unbacked" in torch's words: ONNX NonZero, Unique, a boolean
# mask, TopK with a computed k) is a named symbol like any other (`u0`), introduced by the one
# op whose result it sizes: its `size` attribute names it, and the shape rule puts it in the
# result type. Backends bind it from that result's shape right after the op runs, as they
# bind input symbols from the inputs; everything downstream is ordinary symbolic shapes.
# The cost model prices it at `expected` times the op's upper bound (OpSpec.bound), a fraction
# stated per op below (XLA and IREE keep such dims bounded; torch keeps only the symbol).


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


def _unique_bound(ins, attrs):
    return numel(ins[0].shape) if attrs["flatten"] else ins[0].shape[attrs["axis"] % ins[0].rank]


_SIZE = {"size": ("str", REQUIRED)}
# Half the elements of a mask are set: a guess with nothing better known (a MoE router's
# mask for one expert holds top_k/experts of its rows; a frontend that knows states it).
_op("nonzero", ["x"], _nonzero, "K.nonzero({x})", "reduction", {**_SIZE, "expected": ("float", 0.5)},
    doc="the indices of the nonzero elements, one column per element in row-major order (ONNX NonZero; "
        "torch.nonzero is its transpose)", pattern=OPAQUE, bound=lambda ins, attrs: numel(ins[0].shape))
# Unique values: priced as all distinct (the bound), the case a model's cost must cover.
_op("unique", ["x"], _unique, "K.unique({x}, {flatten}, {axis}, {sorted})", "reduction",
    {**_SIZE, "expected": ("float", 1.0), "flatten": ("bool", True), "axis": ("int", 0), "sorted": ("bool", True)},
    doc="the distinct values (or slices along axis), the index of each one's first occurrence, the inverse "
        "indices and the counts; sorted, or in order of first occurrence (ONNX Unique)", pattern=OPAQUE,
    bound=_unique_bound)
# A run-time length (TopK with a computed k, x[:n] with n from .item()): priced as the whole dim.
_op("narrow", ["x", "length"], _narrow, "K.narrow({x}, {length}, {axis})", "layout",
    {**_SIZE, "expected": ("float", 1.0), "axis": ("int", 0)},
    doc="x[..., :length] along axis, length a run-time integer clamped to [0, dim] (a view)", pattern=OPAQUE,
    view=True, bound=lambda ins, attrs: ins[0].shape[attrs["axis"] % ins[0].rank])


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


# Boxes kept: priced at half of every box of every class, as nonzero (a detector's own
# max_output_boxes_per_class usually caps it far lower).
_op("non_max_suppression", ["boxes", "scores", "max_output?", "iou_threshold?", "score_threshold?"],
    _non_max_suppression,
    "K.non_max_suppression({boxes}, {scores}, {max_output}, {iou_threshold}, {score_threshold}, {center_point_box})",
    "reduction", {**_SIZE, "expected": ("float", 0.5), "center_point_box": ("int", 0)},
    doc="ONNX NonMaxSuppression: per batch and class, boxes by falling score (above score_threshold, if "
        "given), each kept unless its IoU with a kept box exceeds iou_threshold, at most max_output; rows "
        "(batch, class, box)", pattern=OPAQUE,
    bound=lambda ins, attrs: numel(ins[1].shape), flops=lambda ins, outs: 0)


def _assert_size(ins, attrs, given):
    (x,) = ins
    (axis,) = _axes("assert_size", [attrs["axis"]], x.rank)
    if isinstance(x.shape[axis], int) and x.shape[axis] != attrs["size"]:
        raise _fail("assert_size", f"dim {axis} of {x} is not {attrs['size']}")
    return [TensorInfo(x.shape[:axis] + (attrs["size"],) + x.shape[axis + 1:], x.dtype)]


# What a traced model assumed of a run-time size (torch's TorchScript exporter unrolls a loop over
# a nonzero's rows at the count it saw; torch.export writes _assert_scalar(u0 == 4)): checked when
# it runs, a static dim after it.
_op("assert_size", ["x"], _assert_size, "K.assert_size({x}, {axis}, {size})", "layout",
    {"axis": ("int", REQUIRED), "size": ("int", REQUIRED)},
    doc="x itself, its dim `axis` (a run-time size) checked to be `size` when it runs", view=True)


# --- recurrences: a loop over a sequence of any length ---


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


def _rnn_flops(ins, outs):
    x, w, r = ins[:3]
    steps, batch, inputs = x.shape
    gh, hidden = r.shape
    # the input projection and the recurrent matmul per step, ~3 elementwise ops per gate value
    return steps * batch * (2 * gh * inputs + 2 * gh * hidden + 3 * gh)


# The sequence is a loop in the op (as onnxruntime's LSTM kernel): one op for any length, not
# an unrolled copy per step. Default activations (sigmoid, tanh), ONNX's gate order and formulas.
_op("rnn", ["x", "w", "r", "bias?", "h0?", "c0?", "peephole?"], _rnn,
    "K.rnn({x}, {w}, {r}, {bias}, {h0}, {c0}, {peephole}, {cell}, {reverse}, {clip}, {linear_before_reset})",
    "composite", {"cell": ("str", REQUIRED), "reverse": ("bool", False), "clip": ("float", 0.0),
                  "linear_before_reset": ("bool", False)},
    doc="one direction of ONNX RNN/GRU/LSTM over x (steps, batch, inputs): all hidden states, the last "
        "hidden (and cell) state; clip 0 means none", pattern=OPAQUE, flops=_rnn_flops)


def size_definitions(op) -> list[tuple[int, int, str]]:
    """(result index, axis, symbol name) of the run-time dim a tg op defines: its first
    appearance in the results (a backend binds the symbol from that result's shape)."""
    if getattr(op, "SPEC", None) is None or op.SPEC.bound is None:
        return []
    import sympy

    name = op.attr("size")
    for i, r in enumerate(op.result_infos()):
        for axis, d in enumerate(r.shape):
            if isinstance(d, sympy.Symbol) and d.name == name:
                return [(i, axis, name)]
    return []


def expected_sizes(ops) -> dict[str, Any]:
    """symbol name -> the size the cost model prices it at, for every run-time dim the ops define."""
    import sympy

    out = {}
    for op in ops:
        for _i, _axis, name in size_definitions(op):
            from tilegraph.ir.shapes import info_of

            ins = [info_of(v.type) for v in op.operands]
            fraction = sympy.nsimplify(op.attr("expected"))  # 0.5 as 1/2: sizes stay exact expressions
            out[name] = normalize_dim(fraction * sympy.sympify(op.SPEC.bound(ins, op.py_attrs())))
    return out


# --- quantization (ir/quant.py: formats, scale layouts, the kernels) ---
# category "quantize": ops that change number format; fusion leaves them alone.


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


_QUANT_ATTRS = {"to": ("str", REQUIRED), "axis": ("int", 1), "block_size": ("int", 0)}
_op("quantize", ["x", "scale", "zero_point?"], _quantize,
    "K.quantize({x}, {scale}, {zero_point}, {axis}, {block_size}, {to}, {dtype})", "quantize", _QUANT_ATTRS,
    doc="saturate(round(x / scale) + zero_point) in storage type `to` (i8, ui8, i4, f8E4M3FN, f8E5M2, "
        "f6E2M3FN, f4E2M1FN); scale per tensor, per channel (axis) or per block (axis, block_size): ir/quant.py")
_op("dequantize", ["x", "scale", "zero_point?"], _dequantize,
    "K.dequantize({x}, {scale}, {zero_point}, {axis}, {block_size}, {dtype})", "quantize",
    {**_QUANT_ATTRS, "to": ("str", "f32")},
    doc="(x - zero_point) * scale as float type `to`; x quantized, or an i32 accumulator")
_op("dynamic_quantize", ["x"], _dynamic_quantize, "K.dynamic_quantize({x}, {to}, {block_size}, {dtype})",
    "quantize", {"to": ("str", "i8"), "block_size": ("int", 0)},
    doc="symmetric quantization with scales from x itself: (q, scale), one f32 scale per row of the last "
        "axis, or with block_size one per block of it (f8E8M0FNU for float formats: MX)")
_op("matmul_integer", ["lhs", "rhs", "lhs_zero_point?"], _matmul_integer,
    "K.matmul_integer({lhs}, {rhs}, {lhs_zero_point})", "quantize",
    doc="(lhs - lhs_zero_point) @ rhs on integers, exact, accumulated in i32 (ONNX MatMulInteger with a "
        "symmetric rhs)", gemm=_gemm_of_matmul)

# --- generation (DESIGN.md "State across calls"): block-format weights, the KV cache ---
# A block-format weight is its raw bytes, ui8[N, row_bytes], read with the format named in
# `format` (ir/block_formats.py describes each); a cache is a donated input updated in place.


def _block_weight(op, w, attrs):
    from tilegraph.ir.block_formats import BlockFormatError, block_format

    try:
        row = block_format(attrs["format"]).row_bytes(attrs["k"])
    except BlockFormatError as e:
        raise _fail(op, str(e)) from None
    if w.dtype != "ui8" or w.rank != 2 or not dims_equal(w.shape[1], row):
        raise _fail(op, f"weight {w} must be ui8[N, {row}]: rows of {attrs['k']} {attrs['format']} values")


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


def _positions(op, pos, batch):
    if pos.dtype not in ("i32", "i64") or not (pos.rank == 0 or (pos.rank == 1 and dims_equal(pos.shape[0], batch))):
        raise _fail(op, f"pos {pos} must be an i64 scalar or one i64 per sequence ({shape_str((batch,))})")


def _cache_write(ins, attrs, given):
    cache, x, pos = ins
    if cache.rank != 4 or x.rank != 4 or x.dtype != cache.dtype or not all(
            dims_equal(a, b) for i, (a, b) in enumerate(zip(cache.shape, x.shape)) if i != 2):
        raise _fail("cache_write", f"x {x} must be [B, Hkv, T, D] of the cache {cache} ([B, Hkv, S, D])")
    _positions("cache_write", pos, cache.shape[0])
    return [cache]


def _cache_attention(ins, attrs, given):
    q, k, v, pos = ins
    if q.rank != 4 or k.rank != 4 or v.rank != 4 or not (q.dtype == k.dtype == v.dtype):
        raise _fail("cache_attention", f"q {q}, k_cache {k}, v_cache {v} must be rank 4 of one dtype")
    heads, kv_heads = q.shape[1], k.shape[1]
    if not (dims_equal(q.shape[0], k.shape[0]) and all(dims_equal(a, b) for a, b in zip(k.shape[:3], v.shape[:3]))
            and dims_equal(q.shape[3], k.shape[3])):
        raise _fail("cache_attention", f"q {q} [B, H, T, D], k_cache {k} [B, Hkv, S, D], v_cache {v} "
                                       "[B, Hkv, S, Dv] do not match")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise _fail("cache_attention", f"{heads} query heads are not a multiple of {kv_heads} K/V heads")
    _positions("cache_attention", pos, q.shape[0])
    return [TensorInfo(q.shape[:3] + (v.shape[3],), q.dtype)]


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


def _block_matmul_flops(ins, outs):
    return 2 * numel(outs[0].shape) * ins[0].shape[-1]


def _gemm_of_block_matmul(ins, outs):
    import sympy

    n = sympy.sympify(ins[1].shape[0])
    return sympy.sympify(numel(outs[0].shape)) / n, n, sympy.sympify(ins[0].shape[-1])


def _cache_attention_flops(ins, outs):
    # per query: scores and the weighted sum over the whole cache length (an upper bound: pos + T of S)
    q, k = ins[0], ins[1]
    return 4 * numel(q.shape) * k.shape[2]


_BLOCK = {"format": ("str", REQUIRED), "k": ("int", REQUIRED)}
_op("block_matmul", ["x", "w"], _block_matmul, "K.block_matmul({x}, {w}, {format}, {k}, activation={activation})",
    "quantize", {**_BLOCK, "activation": ("str", "f32")},
    doc="x[..., k] @ dequantize(w).T -> [..., N], w ui8[N, row_bytes] in a GGUF block format "
        "(ir/block_formats.py), read as stored: never widened to f32 whole. activation='q8' first rounds x "
        "to int8 per 32 values (block_formats.quantize_activations, ggml's vec_dot numerics: the integer dot "
        "products llama.cpp and the C backend's decode kernels take); 'f32' multiplies x as it is",
    flops=_block_matmul_flops, gemm=_gemm_of_block_matmul)
_op("block_gather", ["w", "indices"], _block_gather, "K.block_gather({w}, {indices}, {format}, {k})", "quantize",
    _BLOCK, doc="rows `indices` of dequantize(w) -> f32[*indices, k]: an embedding lookup in a block format")
_op("cache_write", ["cache", "x", "pos"], _cache_write, "K.cache_write({cache}, {x}, {pos})", "layout",
    doc="cache[b, :, pos_b : pos_b + T] = x[b], in place: the result aliases `cache` (a donated input); "
        "pos is an i64 scalar or one per sequence, and a position outside the cache is an error",
    pattern=OPAQUE, flops=0)
_op("cache_attention", ["q", "k_cache", "v_cache", "pos"], _cache_attention,
    "K.cache_attention({q}, {k_cache}, {v_cache}, {pos}, {scale})", "composite", {"scale": ("float", REQUIRED)},
    doc="causal attention of q[B, H, T, D] (positions pos_b..pos_b + T - 1) over cache positions "
        "[0, pos_b + T) of k_cache/v_cache[B, Hkv, S, D]; query head h reads K/V head h // (H / Hkv)",
    pattern=OPAQUE, flops=_cache_attention_flops)
_op("rms_norm", ["x", "scale?"], _rms_norm, "K.rms_norm({x}, {scale}, {axis}, {epsilon})", "composite",
    {"axis": ("int", -1), "epsilon": ("float", 1e-6)}, doc="x / sqrt(mean(x^2 over dims axis..) + epsilon) * scale",
    pattern=OPAQUE, flops=4)
_op("rope", ["x", "cos", "sin"], _rope, "K.rope({x}, {cos}, {sin})", "composite",
    doc="rotary embedding of the last dim as pairs (i, i + D/2) (GPT-NeoX, transformers' rotate_half): "
        "[x1 cos - x2 sin, x2 cos + x1 sin], cos/sin broadcasting to x[..., D/2]", pattern=OPAQUE, flops=3)


def normalize_attrs(spec: OpSpec, attrs: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and check names; raise a ShapeError naming the op otherwise."""
    unknown = set(attrs) - set(spec.attrs)
    if unknown:
        raise _fail(spec.name, f"unknown attribute(s) {sorted(unknown)}; it takes {sorted(spec.attrs) or 'none'}")
    out = {}
    for name, (kind, default) in spec.attrs.items():
        if name in attrs and attrs[name] is not None:
            out[name] = attrs[name]
        elif default is REQUIRED:
            raise _fail(spec.name, f"missing attribute '{name}'")
        else:
            out[name] = default
        if kind == "ints":
            out[name] = tuple(int(v) for v in out[name])
        elif kind == "floats":
            out[name] = tuple(float(v) for v in out[name])
        elif kind == "int":
            out[name] = int(out[name])
        elif kind == "float":
            out[name] = float(out[name])
        elif kind == "bool":
            out[name] = bool(out[name])
    return out


def infer(spec: OpSpec, ins: Sequence[TensorInfo], attrs: dict[str, Any],
          given: Sequence[TensorInfo] | None = None) -> list[TensorInfo]:
    lo, hi = spec.arity()
    if not lo <= len(ins) <= hi:
        raise _fail(spec.name, f"takes {lo if lo == hi else f'{lo} to {hi}'} operands, got {len(ins)}")
    return spec.infer(list(ins), attrs, given)


def py_literal(v: Any) -> str:
    """Python source for an attribute value in a template."""
    if isinstance(v, float):
        if v != v:
            return "np.nan"
        if v in (float("inf"), float("-inf")):
            return "np.inf" if v > 0 else "-np.inf"
        return repr(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(py_literal(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


def render(spec: OpSpec, operands: Sequence[str | None], attrs: dict[str, Any], out_shape: str, dtype: str) -> str:
    """The NumPy expression for one op, operands given as Python names (None: absent)."""
    names = spec.operand_names
    if spec.variadic:
        env = {names[0]: "[" + ", ".join(operands) + "]"}  # type: ignore[arg-type]
    else:
        env = {n: (operands[i] if i < len(operands) and operands[i] is not None else "None") for i, n in enumerate(names)}  # type: ignore[misc]
    lits = {k: py_literal(v) for k, v in attrs.items()}
    if callable(spec.numpy):
        return spec.numpy(env, attrs, out_shape=out_shape, dtype=dtype)
    return spec.numpy.format(**env, **lits, out_shape=out_shape, dtype=dtype)

# Ops that convert between number formats (quantize, dequantize, dynamic_quantize, matmul_integer):
# priced and grouped apart from float arithmetic.
QUANTIZATION_OPS = frozenset(name for name, spec in OPS.items() if spec.category == "quantize")
