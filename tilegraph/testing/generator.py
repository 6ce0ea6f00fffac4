"""The random graph generator: `graphs()`, a hypothesis strategy of valid tg models."""

from __future__ import annotations

import math as _math
from typing import Callable, Sequence

import numpy as np

from tilegraph.accuracy import MAX_SYMBOL_SIZE
from tilegraph.ir import dtypes
from tilegraph.ir.ops import Op, OPS


# --- property-based testing: random graphs, inputs, semantic checks ----------
# The user-facing half of this module (see the module docstring): `graphs()`
# draws random valid tg models, `random_inputs` feeds them, and
# `assert_preserves_semantics` runs a pass pipeline and checks it against the
# float64 interpreter, with the tolerance above and an honest reduction length.


# Graph sizes: dims of 1..MAX_DIM, at most MAX_ELEMENTS elements per tensor (with
# every symbol at MAX_SYMBOL_SIZE), so that a graph runs in microseconds and
# hypothesis can afford hundreds of them.
MAX_DIM = 4
MAX_RANK = 3
MAX_ELEMENTS = 512
SYMBOLS = ("B",)

# Value ranges. Inputs and weights are uniform in [-1, 1]. Every intermediate is
# kept within [-VALUE_LIMIT, VALUE_LIMIT] (tracked by interval arithmetic, scaled
# down by an exact power of two past it), so that cancellation in a later add
# loses no more than a few ulps of the output's scale; log, sqrt, rsqrt and
# division only see values >= MIN_POSITIVE, where their derivative is at most
# 1/MIN_POSITIVE**2 = 4; exp only sees values <= EXP_LIMIT. With these, float32 and
# float64 differ by rounding alone and `tolerance` applies.
VALUE_LIMIT = 8.0
MIN_POSITIVE = 0.5
EXP_LIMIT = 2.0
# layer_norm divides by sqrt(var + eps): eps >= 1e-2 bounds that amplification to
# 10x even when a row is (nearly) constant.
LAYER_NORM_EPSILONS = (1e-2, 1e-1)

# The op kinds `graphs(ops=...)` can draw. Discontinuous ops (floor, ceil, round,
# sign, comparisons as outputs) are left out: float32 and float64 legitimately
# disagree next to a jump. Comparisons appear only as `where` conditions, against
# fresh random values (ties have probability ~1e-7) or, for eq/ne, between
# operands that are exactly equal or not.
UNARY_OPS = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid", "relu", "erf",
             "sin", "cos", "atan", "gelu")
BINARY_OPS = ("add", "sub", "mul", "div", "pow", "max", "min")
REDUCE_OPS = tuple(name for name, spec in OPS.items() if spec.reduction)
LAYOUT_OPS = ("reshape", "transpose", "slice", "concat", "broadcast", "split")
COMPOSITE_OPS = ("softmax", "layer_norm", "gelu", "attention")
# Windowed ops on NCHW values (a fresh rank-4 input or weight is made when the
# pool has none), and the indexing layout ops.
SPATIAL_OPS = ("conv", "max_pool", "avg_pool")
INDEX_OPS = ("gather", "pad")
# Each draws `where(<comparison>, x, y)`: lt/le/gt/ge compare a value with fresh
# random values; eq/ne compare operands whose elements are exactly equal or not
# (weights sharing elements, integer constants), so no rounding decides them.
COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
OTHER_OPS = ("where", "matmul", "cast", "identity", "weight")
OP_FAMILIES = (UNARY_OPS, BINARY_OPS, ("where",) + COMPARE_OPS, REDUCE_OPS, ("matmul",), LAYOUT_OPS,
               COMPOSITE_OPS, SPATIAL_OPS, INDEX_OPS, ("cast", "identity"), ("weight",))
ALL_OPS = tuple(dict.fromkeys(UNARY_OPS + BINARY_OPS + REDUCE_OPS + LAYOUT_OPS + COMPOSITE_OPS + SPATIAL_OPS
                              + INDEX_OPS + COMPARE_OPS + OTHER_OPS))
# NCHW values the spatial family makes: spatial dims of 1..MAX_SPATIAL (a bit
# over MAX_DIM so that 3x3 windows with stride 2 have room), kernels of
# 1..MAX_KERNEL, strides and dilations of 1..2.
MAX_SPATIAL = 5
MAX_KERNEL = 3


def _sym_size(d) -> int:
    """The largest value a dim takes with every symbol at MAX_SYMBOL_SIZE."""
    if isinstance(d, int):
        return d
    import sympy

    return int(sympy.sympify(d).subs({s: MAX_SYMBOL_SIZE for s in sympy.sympify(d).free_symbols}))


def _size(shape) -> int:
    return _math.prod(_sym_size(d) for d in shape)


def _static_tail(shape, n: int) -> bool:
    return len(shape) >= n and all(isinstance(d, int) for d in shape[len(shape) - n:])


# What the first operand of an op must look like for its generator to use it.
_OPERAND_FITS: dict[str, Callable[[tuple], bool]] = {
    "matmul": lambda s: _static_tail(s, 1),
    "attention": lambda s: _static_tail(s, 2),
    "layer_norm": lambda s: _static_tail(s, 1),
    "softmax": lambda s: len(s) >= 1,
    "concat": lambda s: len(s) >= 1,
    "transpose": lambda s: len(s) >= 2,
    "slice": lambda s: any(isinstance(d, int) for d in s),
    "split": lambda s: any(isinstance(d, int) and d >= 2 for d in s),
    # Reductions of rank-1 values would collapse most graphs to scalars within a few ops.
    **{name: (lambda s: len(s) >= 2) for name in REDUCE_OPS},
    # N may be symbolic; the channels and spatial dims must be static.
    **{name: (lambda s: len(s) == 4 and all(isinstance(d, int) for d in s[1:])) for name in SPATIAL_OPS},
    "gather": lambda s: len(s) >= 1,
    "pad": lambda s: len(s) >= 1,
}


class _Val:
    """A tensor of the graph being drawn and an interval holding all its values."""

    __slots__ = ("t", "lo", "hi")

    def __init__(self, t, lo: float, hi: float):
        self.t, self.lo, self.hi = t, float(lo), float(hi)

    @property
    def bound(self) -> float:
        return max(abs(self.lo), abs(self.hi))

    @property
    def shape(self):
        return self.t.shape


class _GraphDrawer:
    """Draws one graph, op by op, from a pool of the values made so far."""

    def __init__(self, draw, dtype: str, symbolic: bool, ops: Sequence[str]):
        from tilegraph.ir import Graph

        self.draw, self.dtype, self.symbolic, self.ops = draw, dtype, symbolic, list(ops)
        self.g = Graph()
        self.pool: list[_Val] = []
        seed = draw(st.integers(0, 2 ** 32 - 1), label="values seed")
        self.rng = np.random.default_rng(seed)
        self.n_inputs = 0
        self.n_weights = 0

    # --- drawing helpers ---------------------------------------------------

    def choice(self, options, label=None):
        return self.draw(st.sampled_from(list(options)), label=label)

    def flag(self, p_true_label: str) -> bool:
        return self.draw(st.booleans(), label=p_true_label)

    def pick(self, candidates: list[_Val] | None = None) -> _Val | None:
        """A value from the pool, the most recent ones more likely (chains form)."""
        pool = self.pool if candidates is None else candidates
        if not pool:
            return None
        back = self.draw(st.integers(0, len(pool) - 1), label="operand (0 = newest)")
        back = min(back, self.draw(st.integers(0, len(pool) - 1), label="operand bias"))
        return pool[len(pool) - 1 - back]

    def shape(self, rank_max=MAX_RANK, allow_symbol=True) -> tuple:
        # Rank 0 is a corner case, not the usual one (most ops have nothing to do on a scalar).
        rank = 0 if self.flag("scalar") else self.draw(st.integers(1, rank_max), label="rank")
        dims = [self.draw(st.integers(1, MAX_DIM), label="dim") for _ in range(rank)]
        if rank and allow_symbol and self.symbolic and self.flag("symbolic leading dim"):
            dims[0] = self.choice(SYMBOLS)
        return tuple(dims)

    # --- sources -----------------------------------------------------------

    def input(self, shape) -> _Val:
        t = self.g.input(f"x{self.n_inputs}", shape, self.dtype)
        self.n_inputs += 1
        return self.add(_Val(t, -1.0, 1.0))

    def weight(self, shape, lo=-1.0, hi=1.0) -> _Val:
        array = self.rng.uniform(lo, hi, [int(d) for d in shape]).astype(dtypes.numpy_dtype(self.dtype))
        self.n_weights += 1
        return _Val(self.g.weight(f"w{self.n_weights - 1}", array), lo, hi)

    def constant(self, value, shape=()) -> _Val:
        array = np.full(shape, value, dtype=dtypes.numpy_dtype(self.dtype))
        return _Val(self.g.constant(array), float(value), float(value))

    def fresh(self, shape, lo=-1.0, hi=1.0) -> _Val:
        """A new weight (static shape) or input (symbolic shape) of `shape`."""
        if all(isinstance(d, int) for d in shape) and not (self.flag("fresh input?") and self.n_inputs < 4):
            return self.weight(shape, lo, hi)
        v = self.input(shape)
        self.pool.pop()  # inputs are [-1, 1]; affinely moved to [lo, hi] below
        if (lo, hi) != (-1.0, 1.0):
            mid, half = (lo + hi) / 2, (hi - lo) / 2
            t = v.t * self.g.constant(np.array(half, dtypes.numpy_dtype(self.dtype))) + mid
            v = _Val(t, lo, hi)
        return v

    def add(self, v: _Val) -> _Val:
        self.pool.append(v)
        return v

    # --- keeping values in range -------------------------------------------------

    def bounded(self, v: _Val, limit: float = VALUE_LIMIT) -> _Val:
        """v, scaled down by an exact power of two until |v| <= limit."""
        if v.bound <= limit:
            return v
        k = _math.ceil(_math.log2(v.bound / limit))
        s = 2.0 ** -k
        return _Val(v.t * s, v.lo * s, v.hi * s)

    def positive(self, v: _Val) -> _Val:
        """v if it is >= MIN_POSITIVE, else |v| + 1 (or exp(v) when v is small)."""
        if v.lo >= MIN_POSITIVE:
            return v
        if v.bound <= 0.5 and self.flag("positive via exp"):
            return _Val(self.g.exp(v.t), _math.exp(v.lo), _math.exp(v.hi))
        v = self.bounded(v)
        lo = 0.0 if v.lo <= 0 <= v.hi else min(abs(v.lo), abs(v.hi))
        return _Val(self.g.abs(v.t) + 1.0, lo + 1.0, v.bound + 1.0)

    def broadcastable_shape(self, shape) -> tuple:
        """A shape that broadcasts against `shape` to `shape` (a suffix, some dims 1)."""
        k = self.draw(st.integers(0, len(shape)), label="suffix rank")
        out = list(shape[len(shape) - k:])
        for i, _d in enumerate(out):
            if self.flag("unit dim"):
                out[i] = 1
        return tuple(out)

    def partner(self, x: _Val, lo=-1.0, hi=1.0, positive=False) -> _Val:
        """A second operand for x: from the pool when shapes broadcast, else fresh."""
        from tilegraph.ir.shapes import ShapeError, broadcast_shapes

        how = self.choice(["pool", "fresh", "scalar", "self"], label="partner")
        if how == "self" and not positive:
            return x
        if how == "pool":
            fits = []
            for v in self.pool:
                try:
                    if v.t.dtype == self.dtype and _size(broadcast_shapes(v.shape, x.shape)) <= MAX_ELEMENTS:
                        fits.append(v)
                except ShapeError:
                    pass
            v = self.pick(fits)  # type: ignore[assignment]
            if v is not None:
                return self.positive(v) if positive else v
        if how == "scalar":
            special = [0.0, 1.0, 2.0, 0.5, -1.5] if not positive else [1.0, 2.0, 0.75]
            return self.constant(self.choice(special, label="scalar"))
        shape = self.broadcastable_shape(x.shape)
        return self.fresh(shape, MIN_POSITIVE if positive else lo, 2.0 if positive else hi)

    # --- ops -----------------------------------------------------------------------

    def step(self) -> None:
        # A family first, then an op of it, so that the 15 unary ops do not crowd out matmul.
        families = [f for f in (tuple(o for o in fam if o in self.ops) for fam in OP_FAMILIES) if f]
        kind = self.choice(self.choice(families, label="op family"), label="op")
        if kind == "weight":  # a new weight in the pool: ops on weights alone are constant-folding material
            like = self.pick()
            shape = self.shape(allow_symbol=False) if like is None or self.flag("new shape") else like.shape
            if all(isinstance(d, int) for d in shape):
                self.add(self.weight(shape))
            return
        fits = _OPERAND_FITS.get(kind, lambda v: True)
        x = self.pick([v for v in self.pool if fits(v.shape)])
        if kind in SPATIAL_OPS and (x is None or self.flag("fresh NCHW value")):
            x = self.nchw()  # few drawn values have rank 4
        if x is None:
            return
        made = getattr(self, "op_" + kind, None)
        if made is None:
            # Families drawn by one method that takes the op's name.
            family = self.op_reduce if kind in REDUCE_OPS else self.op_compare if kind in COMPARE_OPS else \
                self.op_binary if kind in BINARY_OPS else self.op_unary
            v = family(kind, x)
        else:
            v = made(x)
        if v is not None:
            self.add(self.bounded(v))

    def op_unary(self, name, x):
        g = self.g
        if name in (Op.log, Op.sqrt, Op.rsqrt, Op.reciprocal):
            p = self.positive(x)
            f = {"log": _math.log, "sqrt": _math.sqrt, "rsqrt": lambda a: 1 / _math.sqrt(a),
                 "reciprocal": lambda a: 1 / a}[name]
            a, b = f(p.lo), f(p.hi)
            return _Val(g.op(name, p.t), min(a, b), max(a, b))
        if name == Op.exp:
            x = self.bounded(x, EXP_LIMIT)
            return _Val(g.exp(x.t), _math.exp(x.lo), _math.exp(x.hi))
        if name == Op.gelu:
            approximate = self.choice(["none", "tanh"], label="gelu approximation")
            return _Val(g.gelu(x.t, approximate=approximate), min(x.lo, -0.2), max(x.hi, 0.0))
        if name == Op.neg:
            return _Val(-x.t, -x.hi, -x.lo)
        if name == Op.abs:
            lo = 0.0 if x.lo <= 0 <= x.hi else min(abs(x.lo), abs(x.hi))
            return _Val(g.abs(x.t), lo, x.bound)
        if name == Op.relu:
            return _Val(g.relu(x.t), max(x.lo, 0.0), max(x.hi, 0.0))
        monotone = {"tanh": _math.tanh, "sigmoid": lambda a: 1 / (1 + _math.exp(-a)), "erf": _math.erf,
                    "atan": _math.atan}
        if name in monotone:
            return _Val(g.op(name, x.t), monotone[name](x.lo), monotone[name](x.hi))
        if name in (Op.sin, Op.cos):
            return _Val(g.op(name, x.t), -1.0, 1.0)
        raise AssertionError(f"graphs(): no generator for op '{name}'")

    def op_binary(self, name, x):
        """add, sub, mul, max, min of x and a partner, with the bounds interval arithmetic gives."""
        from tilegraph.ir.shapes import broadcast_shapes

        y = self.partner(x)
        if _size(broadcast_shapes(x.shape, y.shape)) > MAX_ELEMENTS:
            return None
        if self.flag("swap operands"):
            x, y = y, x
        ends = [a * b for a in (x.lo, x.hi) for b in (y.lo, y.hi)]
        lo, hi = {
            "add": (x.lo + y.lo, x.hi + y.hi),
            "sub": (x.lo - y.hi, x.hi - y.lo),
            "mul": (min(ends), max(ends)),
            "max": (max(x.lo, y.lo), max(x.hi, y.hi)),
            "min": (min(x.lo, y.lo), min(x.hi, y.hi)),
        }[name]
        return _Val(self.g.op(name, x.t, y.t), lo, hi)

    def op_div(self, x):
        from tilegraph.ir.shapes import broadcast_shapes

        y = self.partner(x, positive=True)
        if _size(broadcast_shapes(x.shape, y.shape)) > MAX_ELEMENTS:
            return None
        q = [a / b for a in (x.lo, x.hi) for b in (y.lo, y.hi)]
        return _Val(x.t / y.t, min(q), max(q))

    def op_pow(self, x):
        e = self.choice([1.0, 2.0, 3.0, 0.5, -1.0, "tensor"], label="exponent")
        if e == "tensor":
            base = self.bounded(self.positive(x), 4.0)
            y = self.partner(base, lo=-2.0, hi=2.0)
            y = self.bounded(y, 2.0)
            from tilegraph.ir.shapes import broadcast_shapes

            if _size(broadcast_shapes(base.shape, y.shape)) > MAX_ELEMENTS:
                return None
            ends = [a ** b for a in (base.lo, base.hi) for b in (y.lo, y.hi)]
            return _Val(base.t ** y.t, min(ends), max(ends))
        if e in (0.5, -1.0):
            x = self.positive(x)
        elif e == 3.0:
            x = self.bounded(x, 2.0)
        ends = [x.lo ** e, x.hi ** e]
        lo, hi = min(ends), max(ends)
        if e == 2.0 and x.lo <= 0 <= x.hi:
            lo = 0.0
        return _Val(x.t ** e, lo, hi)

    def op_where(self, x):
        # cond compares a pool value with fresh random values: no structural ties.
        c = self.pick()
        if c is None or c.t.dtype != self.dtype:
            return None
        cmp = self.choice(["lt", "gt", "le", "ge"], label="comparison")
        cond = self.g.op(cmp, c.t, self.fresh(self.broadcastable_shape(c.shape)).t)
        y = x if self.flag("where(c, x, x)") and self.flag("really") else self.partner(x)
        from tilegraph.ir.shapes import ShapeError, broadcast_shapes

        try:
            if _size(broadcast_shapes(cond.shape, x.shape, y.shape)) > MAX_ELEMENTS:
                return None
        except ShapeError:
            return None
        return _Val(self.g.where(cond, x.t, y.t), min(x.lo, y.lo), max(x.hi, y.hi))

    def _axes(self, rank):
        axes = [a for a in range(rank) if self.flag("reduce this axis")]
        if len(axes) == rank and rank and not self.flag("reduce every axis"):
            axes.pop(self.draw(st.integers(0, rank - 1), label="axis kept"))
        if not axes and rank and not self.flag("reduce over no axes"):
            axes = [self.draw(st.integers(0, rank - 1), label="axis")]
        return tuple(a - rank if self.flag("negative axis") else a for a in axes)

    def op_reduce(self, name, x):
        axes = self._axes(x.t.rank)
        keepdims = self.flag("keepdims")
        n = _math.prod(_sym_size(x.shape[a]) for a in axes)
        if name == Op.reduce_prod:
            x = self.bounded(x, 1.0)  # a product of factors in [-1, 1] stays there
            lo, hi = (-1.0, 1.0) if x.lo < 0 else (0.0, x.hi ** n)
        elif name == Op.reduce_sum:
            lo, hi = x.lo * n, x.hi * n
        else:
            lo, hi = x.lo, x.hi
        return _Val(self.g.op(name, x.t, axes=axes, keepdims=keepdims), min(lo, hi), max(lo, hi))


    def op_matmul(self, x):
        from tilegraph.ir.shapes import dims_equal

        if x.t.rank == 0:
            return None
        k = x.shape[-1]
        if not isinstance(k, int):
            return None
        n = self.draw(st.integers(1, MAX_DIM), label="matmul n")
        how = self.choice(["weight", "batched", "vector", "pool"], label="matmul rhs")
        if how == "pool":
            fits = [v for v in self.pool if v.t.rank >= 2 and v.t.dtype == self.dtype and dims_equal(v.shape[-2], k)]
            y = self.pick(fits) if fits else None
            if y is None:
                return None
        elif how == "batched" and x.t.rank >= 3:
            y = self.fresh(x.shape[:-2] + (k, n))
        elif how == "vector":
            y = self.fresh((k,))
        else:
            y = self.fresh((k, n))
        from tilegraph.ir.shapes import ShapeError

        try:
            t = x.t @ y.t
        except ShapeError:
            return None
        if _size(t.shape) > MAX_ELEMENTS:
            return None
        b = k * x.bound * y.bound
        return _Val(t, -b, b)

    def op_cast(self, x):
        # Through a wider type and back: exact, and canonicalize has something to fold.
        wide = self.g.cast(x.t, "f64")
        return _Val(self.g.cast(wide, self.dtype), x.lo, x.hi)

    def op_reshape(self, x):
        shape = x.shape
        lead = 1 if shape and not isinstance(shape[0], int) else 0
        tail = [d for d in shape[lead:]]
        if not all(isinstance(d, int) for d in tail):
            return None
        n = _math.prod(tail)
        dims = []
        while n > 1 and len(dims) < MAX_RANK:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            d = self.choice(divisors, label="reshape factor")
            dims.append(d)
            n //= d
        if n > 1:
            dims.append(n)
        if self.flag("insert a unit dim"):
            dims.insert(self.draw(st.integers(0, len(dims)), label="unit dim at"), 1)
        new = tuple(shape[:lead]) + tuple(dims)
        t = self.g.reshape(x.t, new)
        if self.flag("reshape again"):
            t = self.g.reshape(t, shape)
        return _Val(t, x.lo, x.hi)

    def op_transpose(self, x):
        rank = x.t.rank
        perm = self.draw(st.permutations(list(range(rank))), label="perm")
        t = self.g.transpose(x.t, perm)
        if self.flag("transpose again"):
            t = self.g.transpose(t, self.draw(st.permutations(list(range(rank))), label="perm 2"))
        return _Val(t, x.lo, x.hi)

    def op_slice(self, x):
        static = [i for i, d in enumerate(x.shape) if isinstance(d, int)]
        if not static:
            return None
        axis = self.choice(static, label="slice axis")
        size = x.shape[axis]
        step = self.choice([1, 2, -1], label="step")
        first = self.draw(st.integers(0, size - 1), label="first element")
        count = self.draw(st.integers(1, len(range(first, size if step > 0 else -1, step))), label="elements")
        start = first - size if self.flag("negative start") else first
        end = first + step * count
        if end < 0:
            end = -size - 1 if step < 0 else end  # a negative end would count from the back
        return _Val(self.g.slice(x.t, [start], [end], axes=[axis], steps=[step]), x.lo, x.hi)

    def op_concat(self, x):
        if x.t.rank == 0:
            return None
        axis = self.draw(st.integers(0, x.t.rank - 1), label="concat axis")
        parts = [x]
        for _ in range(self.draw(st.integers(0, 2), label="more parts")):
            shape = list(x.shape)
            if isinstance(shape[axis], int):
                shape[axis] = self.draw(st.integers(1, MAX_DIM), label="part size")
            parts.append(x if self.flag("concat x again") else self.fresh(tuple(shape)))
        t = self.g.concat([p.t for p in parts], axis=axis)
        if _size(t.shape) > MAX_ELEMENTS:
            return None
        return _Val(t, min(p.lo for p in parts), max(p.hi for p in parts))

    def op_broadcast(self, x):
        shape = [d if not (isinstance(d, int) and d == 1 and self.flag("expand")) else
                 self.draw(st.integers(1, MAX_DIM), label="expanded") for d in x.shape]
        lead = [self.draw(st.integers(1, MAX_DIM), label="new dim")
                for _ in range(self.draw(st.integers(0, 1), label="new dims"))]
        new = tuple(lead + shape)
        if _size(new) > MAX_ELEMENTS or len(new) > MAX_RANK + 1:
            return None
        return _Val(self.g.broadcast(x.t, new), x.lo, x.hi)

    def op_split(self, x):
        static = [i for i, d in enumerate(x.shape) if isinstance(d, int) and d >= 2]
        if not static:
            return None
        axis = self.choice(static, label="split axis")
        size = x.shape[axis]
        cut = self.draw(st.integers(1, size - 1), label="split at")
        a, b = self.g.split(x.t, (cut, size - cut), axis=axis)
        self.add(_Val(a, x.lo, x.hi))
        return _Val(b, x.lo, x.hi)

    def op_softmax(self, x):
        if x.t.rank == 0:
            return None
        axis = self.draw(st.integers(-x.t.rank, x.t.rank - 1), label="softmax axis")
        return _Val(self.g.softmax(x.t, axis=axis), 0.0, 1.0)

    def op_layer_norm(self, x):
        rank = x.t.rank
        axes = [a for a in range(rank) if all(isinstance(d, int) for d in x.shape[a:])]
        if not axes:
            return None
        axis = self.choice(axes, label="layer_norm axis")
        norm = tuple(x.shape[axis:])
        # A fresh random term makes every row vary: see LAYER_NORM_EPSILONS.
        xv = self.bounded(x, 4.0)
        y = xv.t + self.weight(norm).t
        n = _math.prod(norm)
        scale = self.weight(norm, 0.5, 1.5) if self.flag("scale") else None
        bias = self.weight(self.broadcastable_shape(norm)) if scale is not None and self.flag("bias") else None
        eps = self.choice(LAYER_NORM_EPSILONS, label="epsilon")
        out = self.g.layer_norm(y, scale.t if scale else None, bias.t if bias else None,
                                axis=axis - rank if self.flag("negative axis") else axis, epsilon=eps)
        b = _math.sqrt(n) * (1.5 if scale else 1.0) + (1.0 if bias else 0.0)
        return _Val(out, -b, b)

    def op_attention(self, x):
        if x.t.rank < 2 or not isinstance(x.shape[-1], int) or not isinstance(x.shape[-2], int):
            return None
        q = self.bounded(x, 2.0)
        batch, lq, d = x.shape[:-2], x.shape[-2], x.shape[-1]
        causal = self.flag("causal")
        lk = self.draw(st.integers(lq if causal else 1, max(lq, MAX_DIM)), label="keys")
        dv = self.draw(st.integers(1, MAX_DIM), label="value dim")
        k = self.fresh(batch + (lk, d))
        v = self.fresh(batch + (lk, dv))
        mask = None
        how = self.choice(["none", "bool", "float"], label="mask")
        if how == "bool":
            keep = self.rng.random((lq, lk)) < 0.7
            keep[np.arange(lq), self.rng.integers(0, lk, lq)] = True  # no row fully masked
            if causal:
                keep[:, 0] = True  # the first key is visible to every query under the causal mask too
            mask = self.g.weight(f"mask{self.n_weights}", keep)
            self.n_weights += 1
        elif how == "float":
            mask = self.weight((lq, lk), -1.0, 0.0).t
        scale = self.choice([None, 0.5, 1.0], label="scale")
        if _size(batch + (lq, lk)) > MAX_ELEMENTS or _size(batch + (lq, dv)) > MAX_ELEMENTS:
            return None
        out = self.g.attention(q.t, k.t, v.t, mask, scale=scale, causal=causal)
        return _Val(out, v.lo, v.hi)

    # --- spatial ops, gather/pad, comparisons as where conditions -----------------

    def nchw(self) -> _Val:
        """A fresh NCHW value in the pool: an input (N may be symbolic) or a weight."""
        n = self.choice(SYMBOLS) if self.symbolic and self.flag("symbolic batch") else \
            self.draw(st.integers(1, 2), label="batch")
        c = self.draw(st.integers(1, MAX_DIM), label="channels")
        hw = tuple(self.draw(st.integers(1, MAX_SPATIAL), label="spatial dim") for _ in range(2))
        shape = (n, c) + hw
        if isinstance(n, int) and self.flag("NCHW weight"):
            return self.add(self.weight(shape))
        return self.input(shape)

    def _window(self, x, kernel, pool: bool):
        """strides, pads, dilations and ceil_mode for a 2-D window over x, or None when it does not fit.

        Pools keep dilation 1 and pads below the kernel (the ONNX rule), so that
        every window covers at least one element of x: max_pool never sees a
        window of padding alone (-inf) and avg_pool never divides by zero.
        """
        strides = tuple(self.draw(st.integers(1, 2), label="stride") for _ in kernel)
        dil = (1, 1) if pool else tuple(self.draw(st.integers(1, 2), label="dilation") for _ in kernel)
        pads = tuple(self.draw(st.integers(0, (k - 1) if pool else 2), label="pad") for k in kernel * 2)
        ceil_mode = pool and self.flag("ceil_mode")
        for i, k in enumerate(kernel):
            if x.shape[2 + i] + pads[i] + pads[i + 2] < dil[i] * (k - 1) + 1:
                return None
        return strides, pads, dil, ceil_mode

    def op_conv(self, x):
        c = x.shape[1]
        groups = self.choice([1, 2], label="groups") if c % 2 == 0 else 1
        m = groups * self.draw(st.integers(1, MAX_DIM // groups), label="out channels per group")
        kernel = tuple(self.draw(st.integers(1, MAX_KERNEL), label="kernel") for _ in range(2))
        window = self._window(x, kernel, pool=False)
        if window is None:
            return None
        strides, pads, dil, _ = window
        xv = self.bounded(x, 2.0)
        w = self.fresh((m, c // groups) + kernel)
        bias = None if self.flag("no conv bias") else self.fresh((m,))
        operands = (xv.t, w.t) + ((bias.t,) if bias else ())
        t = self.g.op("conv", *operands, strides=strides, pads=pads, dilations=dil, groups=groups)
        if _size(t.shape) > MAX_ELEMENTS:
            return None
        b = (c // groups) * _math.prod(kernel) * xv.bound * w.bound + (bias.bound if bias else 0.0)
        return _Val(t, -b, b)

    def _pool(self, name, x):
        kernel = tuple(self.draw(st.integers(1, MAX_KERNEL), label="pool kernel") for _ in range(2))
        window = self._window(x, kernel, pool=True)
        if window is None:
            return None
        strides, pads, _, ceil_mode = window
        attrs = dict(kernel=kernel, strides=strides, pads=pads, ceil_mode=ceil_mode)
        lo, hi = x.lo, x.hi
        if name == Op.avg_pool:
            attrs["count_include_pad"] = self.flag("count_include_pad")
            if attrs["count_include_pad"] and any(pads):  # the padding's zeros are averaged in
                lo, hi = min(lo, 0.0), max(hi, 0.0)
        return _Val(self.g.op(name, x.t, **attrs), lo, hi)

    def op_max_pool(self, x):
        return self._pool("max_pool", x)

    def op_avg_pool(self, x):
        return self._pool("avg_pool", x)

    def op_gather(self, x):
        rank = x.t.rank
        axis = self.draw(st.integers(0, rank - 1), label="gather axis")
        size = x.shape[axis]
        # A symbolic axis is at least 1 long: only 0 and -1 are in range for every size.
        lo, hi = (-size, size - 1) if isinstance(size, int) else (-1, 0)
        idx_rank = self.draw(st.integers(0, 2), label="indices rank")
        idx_shape = tuple(self.draw(st.integers(1, 3), label="indices dim") for _ in range(idx_rank))
        if rank - 1 + idx_rank > MAX_RANK + 1:
            return None
        idx = self.rng.integers(lo, hi + 1, idx_shape).astype(self.choice([np.int64, np.int32], label="index type"))
        out = self.g.gather(x.t, self.g.constant(idx), axis=axis - rank if self.flag("negative axis") else axis)
        if _size(out.shape) > MAX_ELEMENTS:
            return None
        return _Val(out, x.lo, x.hi)

    def op_pad(self, x):
        rank = x.t.rank
        mode = self.choice(["constant", "reflect", "edge"], label="pad mode")
        pads = []
        for d in x.shape * 2:
            # reflect needs pads below the dim (a symbolic one may be 1); edge and constant take any
            most = 2 if mode != "reflect" else (min(2, d - 1) if isinstance(d, int) else 0)
            pads.append(self.draw(st.integers(0, most), label="pad width"))
        value = self.choice([0.0, 1.5, -0.5], label="pad value") if mode == "constant" else 0.0
        t = self.g.pad(x.t, pads[:rank] + pads[rank:], mode=mode, value=value)
        if _size(t.shape) > MAX_ELEMENTS:
            return None
        lo, hi = (min(x.lo, value), max(x.hi, value)) if mode == "constant" and any(pads) else (x.lo, x.hi)
        return _Val(t, lo, hi)

    def _condition(self, cmp: str, x: _Val):
        """An i1 tensor that broadcasts against x: `cmp` of two operands no rounding can flip."""
        g = self.g
        if cmp in ("eq", "ne"):
            how = self.choice(["weights", "integers", "self"], label="equality operands")
            shape = tuple(d if isinstance(d, int) else 1 for d in self.broadcastable_shape(x.shape))
            if how == "self":  # x == x: all true (x is finite), a fold canonicalize may know
                return g.op(cmp, x.t, x.t)
            if how == "integers":
                a = self.rng.integers(0, 3, shape)
                b = self.rng.integers(0, 3, shape[len(shape) - self.draw(st.integers(0, len(shape)),
                                                                           label="rhs rank"):])
                return g.op(cmp, g.constant(a.astype(np.int32)), g.constant(b.astype(np.int32)))
            a = self.weight(shape)  # type: ignore[assignment]
            array = self.g.weights[f"w{self.n_weights - 1}"]
            changed = self.rng.random(array.shape) < 0.5
            other = np.where(changed, self.rng.uniform(-1, 1, array.shape), array).astype(array.dtype)
            self.n_weights += 1
            b = g.weight(f"w{self.n_weights - 1}", other)  # type: ignore[assignment]
            return g.op(cmp, a.t, b) if self.flag("swap") else g.op(cmp, b, a.t)  # type: ignore[attr-defined]
        c = self.pick()
        if c is None or c.t.dtype != self.dtype:
            return None
        how = self.choice(["fresh", "scalar"], label="compared with")
        if how == "scalar":  # a random threshold: ties with computed values have probability ~1e-7
            r = self.constant(float(np.float32(self.rng.uniform(c.lo, c.hi) if c.hi > c.lo else 0.25)))
        else:
            r = self.fresh(self.broadcastable_shape(c.shape))
        return g.op(cmp, c.t, r.t) if self.flag("swap") else g.op(cmp, r.t, c.t)

    def op_compare(self, cmp: str, x):
        """where(cmp(a, b), x, y), sometimes with the condition combined by not/and/or/xor."""
        from tilegraph.ir.shapes import ShapeError, broadcast_shapes

        cond = self._condition(cmp, x)
        if cond is None:
            return None
        how = self.choice(["plain", "not", "and", "or", "xor"], label="combine condition")
        if how == "not":
            cond = self.g.op("not", cond)
        elif how != "plain":
            other = self._condition(self.choice(COMPARE_OPS, label="second comparison"), x)
            if other is not None:
                try:
                    if _size(broadcast_shapes(cond.shape, other.shape)) <= MAX_ELEMENTS:
                        cond = self.g.op(how, cond, other)
                except ShapeError:
                    pass
        y = self.partner(x)
        try:
            if _size(broadcast_shapes(cond.shape, x.shape, y.shape)) > MAX_ELEMENTS:
                return None
        except ShapeError:
            return None
        if self.flag("swap branches"):
            x, y = y, x
        return _Val(self.g.where(cond, x.t, y.t), min(x.lo, y.lo), max(x.hi, y.hi))


    def op_identity(self, x):
        """A rewrite canonicalize should remove: x+0, x*1, x-0, x/1, x**1, -(-x), concat([x]), ..."""
        g = self.g
        form = self.choice(["add0", "mul1", "sub0", "div1", "pow1", "negneg", "concat1", "slice_all",
                            "transpose_id", "reshape_id", "zero_minus", "one_times"], label="identity form")
        t = x.t
        if form == "negneg":
            return _Val(-(-t), x.lo, x.hi)  # noqa: B002
        if form == "zero_minus":
            return _Val(0.0 - t, -x.hi, -x.lo)
        if form == "one_times":
            return _Val(1.0 * t, x.lo, x.hi)
        if form == "concat1":
            return _Val(g.concat([t], axis=0), x.lo, x.hi) if t.rank else None
        if form == "slice_all":
            return _Val(g.slice(t, [0] * t.rank, [(1 << 63) - 1] * t.rank), x.lo, x.hi) if t.rank else None
        if form == "transpose_id":
            return _Val(g.transpose(t, tuple(range(t.rank))), x.lo, x.hi)
        if form == "reshape_id":
            return _Val(g.reshape(t, t.shape), x.lo, x.hi)
        op, value = {"add0": ("add", 0.0), "mul1": ("mul", 1.0), "sub0": ("sub", 0.0), "div1": ("div", 1.0),
                     "pow1": ("pow", 1.0)}[form]
        shape = self.broadcastable_shape(t.shape) if self.flag("shaped constant") else ()
        c = self.constant(value, tuple(d if isinstance(d, int) else 1 for d in shape))
        return _Val(g.op(op, t, c.t), x.lo, x.hi)


try:
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is in the dev extra
    st = None  # type: ignore[assignment]


def graphs(*, ops: Sequence[str] | None = None, max_ops: int = 12, dtype: str = "f32", symbolic: bool = True,
           max_outputs: int = 3):
    """A hypothesis strategy drawing random, valid, verified tg Models (`ir.Model`).

    ops:        the op kinds to draw from (default ALL_OPS; see UNARY_OPS, BINARY_OPS,
                REDUCE_OPS, LAYOUT_OPS, COMPOSITE_OPS, SPATIAL_OPS (conv, pools on
                NCHW values), INDEX_OPS (gather, pad), COMPARE_OPS (where on a
                comparison), "where", "matmul", "cast", "identity" = a rewrite
                canonicalize should remove)
    max_ops:    how many ops to draw at most (layout helpers and range keepers come on top)
    dtype:      the float type of inputs, weights and results
    symbolic:   whether inputs may have a symbolic leading dim `B`
    max_outputs: the model returns 1..max_outputs values: the ones nothing else uses,
                newest first, sometimes one more (an input, or a value used inside)

    Values stay in ranges where float32 and float64 differ by rounding alone (see
    VALUE_LIMIT): pair with `random_inputs`, which draws inputs in [-1, 1].
    """
    if st is None:
        raise ImportError("tilegraph.testing.graphs needs hypothesis (pip install 'tilegraph[dev]')")
    ops = tuple(ALL_OPS if ops is None else ops)
    unknown = [o for o in ops if o not in ALL_OPS]
    if unknown:
        raise ValueError(f"graphs(): unknown op kind(s) {unknown}; known: {', '.join(ALL_OPS)}")

    @st.composite
    def draw_graph(draw):
        d = _GraphDrawer(draw, dtype, symbolic, ops)
        for _ in range(draw(st.integers(1, 3), label="inputs")):
            d.input(d.shape(allow_symbol=True))
        for _ in range(draw(st.integers(1, max_ops), label="ops")):
            d.step()
        floats = [v for v in d.pool if v.t.dtype == dtype]
        # The values nothing uses come first, so that few of the drawn ops are dead code.
        sinks = [v for v in reversed(floats) if v.t.value.first_use is None] or [floats[-1]]
        count = draw(st.integers(1, max_outputs), label="outputs")
        outputs = sinks[:count]
        if len(outputs) < count or draw(st.booleans(), label="an output also used inside"):
            outputs.append(d.pick(floats))  # an input, or a value that also feeds other ops
        return d.g.build(*[v.t for v in outputs], names=[f"y{i}" for i in range(len(outputs))])

    return draw_graph()
