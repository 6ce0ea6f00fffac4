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
from enum import StrEnum
from typing import Any, Callable, Sequence

from tilegraph.ir import loops
from tilegraph.ir.shape_rules import (
    _arg_reduce, _assert_size, _attention, _attention_grad, _binary, _bitcast, _block_gather,
    _block_matmul, _cache_attention, _cache_write, _cast, _check_broadcast, _check_reshape,
    _concat, _constant, _conv, _dequantize, _dropout, _dynamic_quantize, _einsum,
    _fail, _gather, _gather_elements, _given, _iota, _layer_norm,
    _matmul, _matmul_integer, _narrow, _non_max_suppression, _nonzero, _pad,
    _pool, _quantize, _reduce, _rms_norm, _rnn, _rope, _sample,
    _same_as_input, _scatter_elements, _scatter_nd, _slice, _softmax, _source,
    _split, _tile, _topk, _transpose, _trilu, _unary,
    _unique, _where)
from tilegraph.ir.shapes import TensorInfo, normalize_dim, numel

REQUIRED = object()  # attribute default meaning "must be given"
# dropout's work per element: Philox2x32-10's ten rounds, a multiply and two xors each, then a
# compare and a select (Random123's Philox, Salmon et al., SC'11).
DROPOUT_FLOPS = 32

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
    # Full-size temporaries the NumPy template holds at once beside its result while it runs, in
    # result sizes (read off ir/kernels.py's out-of-place f32 paths): what a NumPy call holds for
    # the op's duration only, which the recompute pass's peak prices where it rebuilds the op.
    numpy_temporaries: int = 0
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




# --- shape rules -------------------------------------------------------------






















































def _render_slice(operands, attrs, **_):
    parts = []
    for s, e, st in zip(attrs["starts"], attrs["ends"], attrs["steps"]):
        if (s, e, st) == (0, (1 << 63) - 1, 1):
            parts.append(":")
        else:
            parts.append(f"{s}:{e}" + (f":{st}" if st != 1 else ""))
    return f"{operands['x']}[{', '.join(parts) or '...'}]"






















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


def _attention_grad_flops(ins, outs):
    """The scores again, dP = gy v^T, dV = P^T gy, dQ = dS k, dK = dS^T q, and the softmax's and
    dS's elementwise work, over every (query, key) pair (a causal mask's half included)."""
    import sympy

    q, k, v = ins[:3]
    batch_q = sympy.sympify(numel(q.shape)) / q.shape[-1]
    return batch_q * k.shape[-2] * (6 * q.shape[-1] + 4 * v.shape[-1] + SOFTMAX_FLOPS + 3)


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
# Full-size temporaries of K.erf out of place (f32: the clipped square; the polynomial is made in
# its result) and of K.gelu (x / sqrt(2), held while its erf holds its square and its result).
ERF_TEMPORARIES, GELU_TEMPORARIES = 1, 2

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
        flops=UNARY_FLOPS.get(_name, 1), numpy_calls=16 if _name == "erf" else 0,
        numpy_temporaries=ERF_TEMPORARIES if _name == "erf" else 0)
# Composite (decompose spells it out), but elementwise to fusion, tiling and sharding.
# (f32, K.gelu) clip, square, the erf polynomial's 12 passes, multiply, exp, add, divide;
# 18 NumPy calls per block of ERF_BLOCK elements.
_op("gelu", ["x"], _unary("gelu", floats_only=True), "K.gelu({x}, {approximate})", "composite",
    {"approximate": ("str", "none")}, doc="x * Phi(x); approximate='tanh' uses the tanh formula",
    pattern=ELEMWISE, flops=8, cpu_passes=(("add", 15), ("exp", 1), ("add", 1), ("div", 1)), numpy_calls=18,
    numpy_temporaries=GELU_TEMPORARIES)
_op("not", ["x"], _unary("not", "i1"), "np.logical_not({x})", "elementwise")
_op("isnan", ["x"], _unary("isnan", "i1"), "np.isnan({x})", "elementwise")
_op("isinf", ["x"], _unary("isinf", "i1"), "K.isinf({x}, {detect_positive}, {detect_negative})", "elementwise",
    {"detect_positive": ("bool", True), "detect_negative": ("bool", True)})
_op("cast", ["x"], _cast, "{x}.astype({dtype})", "elementwise", {"to": ("str", REQUIRED)})




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
# K.layer_norm: mean, subtract, square (its one full-size temporary), mean, add eps + sqrt + divide,
# scale, shift.
_op("layer_norm", ["x", "scale?", "bias?"], _layer_norm, "K.layer_norm({x}, {scale}, {bias}, {axis}, {epsilon})",
    "composite", {"axis": ("int", -1), "epsilon": ("float", 1e-5)}, doc="normalizes over dims axis.. of x",
    flops=8, cpu_passes=(("sum", 2), ("add", 2), ("mul", 2), ("sqrt", 1), ("div", 1)), loops=loops.normalized(True),
    row_normalizing=True, numpy_temporaries=1)
# A GEMM-like anchor to fusion (its epilogue fuses on); composite to decompose.
_op("attention", ["q", "k", "v", "mask?"], _attention, "K.attention({q}, {k}, {v}, {mask}, {scale}, {causal})",
    "composite", {"scale": ("float", REQUIRED), "causal": ("bool", False)},
    doc="softmax(q @ k^T * scale + mask) @ v; an i1 mask keeps where true, a float mask is added",
    pattern=ANCHOR, flops=_attention_flops, loops=loops.attention, gemm=_gemm_of_attention)

# Attention's backward as one op (its VJP rule makes it): a backend with a kernel for it computes
# the scores once per query block and skips a causal mask's blocks; the others spell it out
# (ir/attention_backward.py: the whole-row form, or FlashAttention-2's blockwise one past a block).
_op("attention_grad", ["q", "k", "v", "gy", "mask?"], _attention_grad,
    "K.attention_grad({q}, {k}, {v}, {gy}, {mask}, {scale}, {causal})", "composite",
    {"scale": ("float", REQUIRED), "causal": ("bool", False)},
    doc="(dq, dk, dv) of attention(q, k, v, mask, scale, causal) given gy, its result's cotangent; a float "
        "mask's own cotangent is not a result (the VJP rule spells that one out)",
    pattern=OPAQUE, flops=_attention_grad_flops)

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




_op("iota", [], _iota, "K.iota({out_shape}, {axis}, {dtype})", "source", {"axis": ("int", 0)}, result_given=True,
    doc="0, 1, ..., n-1 along axis, broadcast to the result shape (stablehlo.iota); ONNX Range, EyeLike, OneHot "
        "and slices to a symbolic length are built on it")









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




# What a traced model assumed of a run-time size (torch's TorchScript exporter unrolls a loop over
# a nonzero's rows at the count it saw; torch.export writes _assert_scalar(u0 == 4)): checked when
# it runs, a static dim after it.
_op("assert_size", ["x"], _assert_size, "K.assert_size({x}, {axis}, {size})", "layout",
    {"axis": ("int", REQUIRED), "size": ("int", REQUIRED)},
    doc="x itself, its dim `axis` (a run-time size) checked to be `size` when it runs", view=True)


# --- recurrences: a loop over a sequence of any length ---




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

# --- generation: block-format weights, the KV cache (state a compiled model keeps across calls) ---
# A block-format weight is its raw bytes, ui8[N, row_bytes], read with the format named in
# `format` (ir/block_formats.py describes each); a cache is a donated input updated in place.


















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
_op("cache_write", ["cache", "x", "pos"], _cache_write, "K.cache_write({cache}, {x}, {pos}, {store})", "layout",
    {"store": ("str", "")},
    doc="cache[b, :, pos_b : pos_b + T] = x[b], in place: the result aliases `cache` (a donated input); "
        "pos is an i64 scalar or one per sequence, and a position outside the cache is an error. "
        "store='f16': f32 rows rounded (to nearest even) into an f16 cache; named, as the reference "
        "interpreter holds the cache widened to f64 and must round as the kernels do",
    pattern=OPAQUE, flops=0)
_op("cache_attention", ["q", "k_cache", "v_cache", "pos"], _cache_attention,
    "K.cache_attention({q}, {k_cache}, {v_cache}, {pos}, {scale}, {window})", "composite",
    {"scale": ("float", REQUIRED), "window": ("int", 0)},
    doc="causal attention of q[B, H, T, D] (positions pos_b..pos_b + T - 1) over cache positions "
        "[0, pos_b + T) of k_cache/v_cache[B, Hkv, S, D]; query head h reads K/V head h // (H / Hkv). "
        "window > 0: a sliding window, the query at position p reads only positions (p - window, p] "
        "(Gemma's and Mistral's local layers); f32 queries may read an f16 cache (widened exactly)",
    pattern=OPAQUE, flops=_cache_attention_flops)
_op("sample", ["logits", "seen", "u"], _sample,
    "K.sample({logits}, {seen}, {u}, {temperature}, {top_k}, {top_p}, {repetition_penalty})", "composite",
    {"temperature": ("float", 0.0), "top_k": ("int", 0), "top_p": ("float", 1.0),
     "repetition_penalty": ("float", 1.0)},
    doc="one token per row of logits[B, vocab] -> i64[B]: a seen token's logit (seen != 0) divided by "
        "repetition_penalty if > 0, else multiplied (transformers'); temperature 0: the first largest; else "
        "logits / temperature, only the top_k largest (0: all), softmax, only the smallest most-likely set "
        "reaching top_p (ties by index), and the first token whose running sum in vocabulary order passes "
        "u[b] of the kept total (u uniform in [0, 1): the random numbers are an input, drawn from a seed)",
    pattern=OPAQUE, flops=8)
_op("rms_norm", ["x", "scale?"], _rms_norm, "K.rms_norm({x}, {scale}, {axis}, {epsilon})", "composite",
    {"axis": ("int", -1), "epsilon": ("float", 1e-6)}, doc="x / sqrt(mean(x^2 over dims axis..) + epsilon) * scale",
    pattern=OPAQUE, flops=4)
_op("rope", ["x", "cos", "sin"], _rope, "K.rope({x}, {cos}, {sin})", "composite",
    doc="rotary embedding of the last dim as pairs (i, i + D/2) (GPT-NeoX, transformers' rotate_half): "
        "[x1 cos - x2 sin, x2 cos + x1 sin], cos/sin broadcasting to x[..., D/2]", pattern=OPAQUE, flops=3)
# A pure function of (seed, site, index): the backward recomputes the mask rather than saving it.
_op("dropout", ["x", "seed"], _dropout, "K.dropout({x}, {seed}, {p}, {site})", "composite",
    {"p": ("float", REQUIRED), "site": ("int", 0)},
    doc="x / (1 - p) where a counter-based random number keeps the element, 0 elsewhere: element i (row-major) "
        "is kept when Philox2x32-10(counter = (i mod 2^32, site ^ (i >> 32) << 16), key = seed's two 32-bit "
        "halves xored) >= floor(p 2^32); seed an integer scalar, site (< 2^32) tells a model's dropouts apart",
    pattern=OPAQUE, flops=DROPOUT_FLOPS)


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


# Every op's name, as a member mypy and the interpreter check: code outside the op table names
# an op as `Op.matmul`, never as the string "matmul", so a misspelled or removed op fails the
# type check (and at import where a module uses it at top level). Members are str: they equal,
# hash and print as the names themselves. (A list literal: "not", "and", "or" are names too,
# reached as Op["not"].)
Op = StrEnum("Op", [
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid", "relu", "erf", "sin",
    "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "floor", "ceil",
    "round", "sign", "bitwise_not", "gelu", "not", "isnan", "isinf", "cast", "bitcast", "add", "sub", "mul",
    "div", "pow", "max", "min", "bitwise_and", "bitwise_or", "bitwise_xor", "shift_left", "shift_right",
    "mod", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge", "where", "reduce_sum", "reduce_mean",
    "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "matmul", "einsum", "conv", "max_pool",
    "avg_pool", "softmax", "layer_norm", "attention", "attention_grad", "reshape", "broadcast", "transpose",
    "concat", "split", "slice", "gather", "gather_elements", "pad", "tile", "cumsum", "trilu", "constant", "weight",
    "iota", "scatter_elements", "scatter_nd", "cumprod", "topk", "expm1", "log1p", "nonzero", "unique", "narrow",
    "non_max_suppression", "assert_size", "rnn", "quantize", "dequantize", "dynamic_quantize",
    "matmul_integer", "block_matmul", "block_gather", "cache_write", "cache_attention", "rms_norm", "rope",
    "sample", "dropout"
])
if set(Op) != set(OPS):
    raise ImportError(f"ir/ops.py: Op and the op table differ: {sorted(set(Op) ^ set(OPS))}")
