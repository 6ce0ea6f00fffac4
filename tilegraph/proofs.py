"""Every rewrite rule of the rule-driven passes, proven (or refuted) by an SMT solver.

A rule of `canonicalize` (passes/canonicalize.py) or `simplify-shapes` is data: a
pattern and a function. For each rule this module states what the rule claims as
a `Claim`: an expression before and after, written once in a tiny language of
tg op names (`"sub(x, neg(y))" -> "add(x, y)"`), and then:

1. asks the rule itself on which element types it fires: the `before` expression
   is built as a real tg graph per dtype and the rule alone is run on it (so a
   guard is read from the code, never restated here), and the IR it produces must
   be the `after` expression built the same way;
2. for every dtype it fires on, proves before == after with z3 in that dtype's
   semantics as NumPy computes it: IEEE-754 binary16, bfloat16, binary32 and
   binary64 (z3's FP theory: NaN, signed zeros, infinities, round to nearest even)
   and fixed-width two's complement bit vectors for integers (wrap-around);
   element types z3 has no theory for (the 8-bit-and-narrower float formats,
   i4) are proven by running both sides on every value in NumPy;
3. records a counterexample when the claim is false.

"Equal" means: both NaN, or the same number including the sign of zero; a claim
marked `nsz` (as LLVM's no-signed-zeros flag) allows +0 where -0 was (x + 0 -> x).
Layout rules are index maps over symbolic dims: their lemmas are proven over the
integers (`LAYOUT_LEMMAS`). `python -m tilegraph.proofs` prints the table the
README shows; tests/test_rule_proofs.py runs it all.

Refuted and therefore restricted (kept as regression claims in `REFUTED`):
- x ** 3 -> x * x * x on floats: two roundings where pow has one (f16: x = -0.00729
  gives -4.17e-07 against -3.58e-07); the rule now fires on integers only.
- abs(neg x) -> abs x on unsigned integers: neg wraps (abs(neg 1) = 255 in ui8);
  the rule now skips unsigned types.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tilegraph.ir import dtypes

IEEE = {"f16": (5, 11), "bf16": (8, 8), "f32": (8, 24), "f64": (11, 53)}
BITS = {"i8": 8, "i16": 16, "i32": 32, "i64": 64, "ui8": 8, "ui16": 16, "ui32": 32, "ui64": 64}
# Checked by enumerating every value (z3 has no theory for their non-IEEE encodings).
SMALL = ("f8E4M3FN", "f8E5M2", "f6E2M3FN", "f4E2M1FN", "i4")
ALL = tuple(IEEE) + tuple(BITS) + ("i1",) + SMALL


# --- semantics: one element type as NumPy computes it ---------------------------------------------


class NotModeled(Exception):
    """The claim has no meaning on this dtype (NumPy refuses the op there)."""


class Sem:
    """Values of one dtype and the ops the rules speak of, as z3 terms."""

    def __init__(self, dtype: str):
        import z3

        self.z3, self.dtype = z3, dtype
        self.pre: list = []  # side conditions on the constants a rule's guard accepts
        self.names: dict[str, object] = {}
        self.rm = z3.RNE()
        if dtype in IEEE:
            self.kind, self.sort = "float", z3.FPSort(*IEEE[dtype])
        elif dtype == "i1":
            self.kind, self.sort = "bool", z3.BoolSort()
        else:
            self.kind, self.sort = ("uint" if dtype.startswith("u") else "int"), z3.BitVecSort(BITS[dtype])

    def var(self, name: str):
        z3 = self.z3
        if name not in self.names:
            self.names[name] = z3.Const(name, self.sort)
        return self.names[name]

    def lit(self, v: float):
        """A constant the rule's guard accepts as `v`: NumPy's == (so 0 stands for +0 and -0)."""
        z3 = self.z3
        c = z3.Const(f"c{len(self.pre)}_{v}", self.sort)
        self.pre.append(self.value_eq(c, v))
        self.names[str(c)] = c
        return c

    def val(self, v: float):
        z3 = self.z3
        if self.kind == "float":
            return z3.FPVal(v, self.sort)
        if self.kind == "bool":
            return z3.BoolVal(bool(v))
        return z3.BitVecVal(int(v), self.sort.size())

    def value_eq(self, a, v):
        return self.z3.fpEQ(a, self.val(v)) if self.kind == "float" else a == self.val(v)

    def t(self, a):
        return self.lit(a) if isinstance(a, (int, float)) else a

    def arith(self):
        if self.kind == "bool":  # np.subtract, np.negative refuse booleans; K.div, pow and relu widen them
            raise NotModeled("NumPy has no i1 arithmetic but + (or) and * (and)")

    # arithmetic (ir/ops.py templates; ir/kernels.py for neg, div, pow)
    def add(self, a, b):
        a, b, z3 = self.t(a), self.t(b), self.z3
        return {"float": lambda: z3.fpAdd(self.rm, a, b), "bool": lambda: z3.Or(a, b)}.get(self.kind, lambda: a + b)()

    def sub(self, a, b):
        self.arith()
        a, b, z3 = self.t(a), self.t(b), self.z3
        return z3.fpSub(self.rm, a, b) if self.kind == "float" else a - b

    def mul(self, a, b):
        a, b, z3 = self.t(a), self.t(b), self.z3
        return {"float": lambda: z3.fpMul(self.rm, a, b), "bool": lambda: z3.And(a, b)}.get(self.kind, lambda: a * b)()

    def div(self, a, b):
        self.arith()
        a, b, z3 = self.t(a), self.t(b), self.z3
        if self.kind == "float":
            return z3.fpDiv(self.rm, a, b)
        if self.kind == "uint":
            return z3.UDiv(a, b)
        # K.div: |a| // |b| (NumPy's floor division, np.abs wraps at the minimum), negated on mixed signs
        zero = self.val(0)
        aa, ab = z3.If(a < zero, -a, a), z3.If(b < zero, -b, b)
        t = aa / ab  # z3's signed division truncates
        q = z3.If(z3.And(z3.SRem(aa, ab) != zero, (aa < zero) != (ab < zero)), t - 1, t)
        return z3.If((a < zero) != (b < zero), -q, q)

    def pow(self, a, n):
        """pow(x, n) for the literal n of the rule's guard: IEEE pown, correctly rounded."""
        z3 = self.z3
        self.arith()
        if n == 1:
            return a
        if self.kind != "float":
            r = a
            for _ in range(n - 1):
                r = r * a  # NumPy's integer power wraps as repeated multiplication does
            return r
        if n == 2:
            return z3.fpMul(self.rm, a, a)  # IEEE 754 5.4.1: a product is the correctly rounded x*x
        e, s = IEEE[self.dtype]  # x**n exact in a format n times as wide, then one rounding
        wide = z3.FPSort(e + 2, n * s)
        xw = z3.fpToFP(self.rm, a, wide)
        p = xw
        for _ in range(n - 1):
            p = z3.fpMul(self.rm, p, xw)
        return z3.fpToFP(self.rm, p, self.sort)

    def neg(self, a):
        z3 = self.z3
        self.arith()
        # K.negative is x * -1, which is fpNeg exactly (NEGATION_LEMMA proves it per dtype)
        return z3.fpNeg(a) if self.kind == "float" else a * self.val(-1)

    def abs(self, a):
        z3 = self.z3
        if self.kind == "bool":
            return a
        if self.kind == "float":
            return z3.fpAbs(a)
        return a if self.kind == "uint" else z3.If(a < self.val(0), -a, a)

    def relu(self, a):
        z3 = self.z3  # np.maximum(x, 0): NaN propagates, maximum(-0, 0) is +0
        self.arith()
        if self.kind == "float":
            return z3.If(z3.fpIsNaN(a), a, z3.If(z3.fpGT(a, self.val(0)), a, self.val(0)))
        return a if self.kind == "uint" else z3.If(a > self.val(0), a, self.val(0))

    def not_(self, a):
        if self.kind != "bool":
            raise NotModeled("not(not x) -> x changes the type unless x is i1: the driver refuses it")
        return self.z3.Not(a)

    def where(self, c, a, b):
        return self.z3.If(c, self.t(a), self.t(b))

    def reduce(self, kind, a):
        """A reduction over one element, as NumPy's: sum adds it to +0 (so -0 becomes +0), mean divides
        that by 1, prod multiplies 1 by it, max and min return it."""
        if kind in ("sum", "mean"):
            total = a if self.kind == "bool" else self.add(self.val(0), a)
            return self.div(total, self.val(1)) if kind == "mean" else total
        return self.mul(self.val(1), a) if kind == "prod" else a

    def equal(self, a, b, nsz: bool = False):
        z3 = self.z3
        if self.kind != "float":
            return a == b
        same_sign = z3.BoolVal(True) if nsz else z3.fpIsNegative(a) == z3.fpIsNegative(b)
        return z3.Or(z3.And(z3.fpIsNaN(a), z3.fpIsNaN(b)), z3.And(z3.fpEQ(a, b), same_sign))


def cast_term(sem_src: Sem, x, dst: str):
    """cast(x, dst) as NumPy's astype computes it; returns (term, where it is defined).
    Float -> integer is defined for in-range values only (C leaves the rest undefined;
    NumPy gives the platform's answer), so a claim holds where both sides are defined."""
    z3, src = sem_src.z3, sem_src.dtype
    d = Sem(dst)
    true = z3.BoolVal(True)
    if src == dst:
        return x, true
    if src == "i1":
        return z3.If(x, d.val(1), d.val(0)), true
    if dst == "i1":
        return (z3.Not(z3.fpIsZero(x)) if sem_src.kind == "float" else x != sem_src.val(0)), true
    if sem_src.kind == "float":
        if d.kind == "float":
            return z3.fpToFP(sem_src.rm, x, d.sort), true
        w = d.sort.size()
        lo, hi = (0, 2 ** w - 1) if d.kind == "uint" else (-2 ** (w - 1), 2 ** (w - 1) - 1)
        r = z3.fpRoundToIntegral(z3.RTZ(), x)
        ok = z3.And(z3.Not(z3.fpIsNaN(x)), z3.Not(z3.fpIsInf(x)),
                    z3.fpGEQ(r, z3.FPVal(lo, sem_src.sort)), z3.fpLEQ(r, z3.FPVal(hi, sem_src.sort)))
        conv = z3.fpToUBV if d.kind == "uint" else z3.fpToSBV
        return conv(z3.RTZ(), x, d.sort), ok
    if d.kind == "float":
        conv = z3.fpUnsignedToFP if sem_src.kind == "uint" else z3.fpSignedToFP
        return conv(sem_src.rm, x, d.sort), true
    sw, dw = sem_src.sort.size(), d.sort.size()
    if dw <= sw:
        return z3.Extract(dw - 1, 0, x), true
    ext = z3.ZeroExt if sem_src.kind == "uint" else z3.SignExt
    return ext(dw - sw, x), true


# --- claims -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """`before` -> `after` over variables x, y (and c, a boolean, for where): what `rule` does."""

    rule: str  # the Rule's doc line, as in its pass
    before: str
    after: str
    nsz: bool = False  # equal up to the sign of a zero result
    dtypes: tuple[str, ...] = ALL
    note: str = ""
    # IEEE + and * commute by definition (the exact result is rounded once); z3 checks it on all but
    # binary64, whose two bit-blasted adders in one miter take it minutes
    commutes: bool = False


REDUCE_OVER_NOTHING = "reduce over no axes or size-1 axes -> x (or its reshape)"


def _forms(rule: str, *pairs: tuple[str, str], **kw) -> list[Claim]:
    """One rule's claims: a (before, after) pair for each form it rewrites, the same options for all."""
    return [Claim(rule, before, after, **kw) for before, after in pairs]


CLAIMS: list[Claim] = [
    *_forms("x + 0 -> x, 0 + x -> x", ("add(x, 0)", "x"), ("add(0, x)", "x"), nsz=True),
    Claim("x - 0 -> x", "sub(x, 0)", "x", nsz=True, note="x - (-0) is x + 0"),
    *_forms("x * 1 -> x, 1 * x -> x", ("mul(x, 1)", "x"), ("mul(1, x)", "x")),
    Claim("x / 1 -> x", "div(x, 1)", "x"),
    Claim("x ** 1 -> x", "pow(x, 1)", "x"),
    Claim("x ** 2 -> x * x", "pow(x, 2)", "mul(x, x)"),
    Claim("x ** 3 -> x * x * x (integers)", "pow(x, 3)", "mul(mul(x, x), x)"),
    Claim("x - (-y) -> x + y", "sub(x, neg(y))", "add(x, y)"),
    *_forms("x + (-y) -> x - y, (-y) + x -> x - y", ("add(x, neg(y))", "sub(x, y)"), ("add(neg(y), x)", "sub(x, y)")),
    Claim("0 - x -> -x", "sub(0, x)", "neg(x)", nsz=True),
    *_forms("c + x -> x + c, c * x -> x * c", ("add(3, x)", "add(x, 3)"), ("mul(3, x)", "mul(x, 3)"), commutes=True),
    *_forms("neg(neg x) -> x, not(not x) -> x", ("neg(neg(x))", "x"), ("not_(not_(x))", "x")),
    *_forms("abs(abs x) -> abs x, relu(relu x) -> relu x", ("abs(abs(x))", "abs(x)"), ("relu(relu(x))", "relu(x)")),
    Claim("abs(neg x) -> abs x (signed and float types)", "abs(neg(x))", "abs(x)"),
    Claim("where(c, x, x) -> x", "where(c, x, x)", "x"),
    *_forms("where(true, x, y) -> x, where(false, x, y) -> y (broadcast to the result)",
            ("where(True, x, y)", "x"), ("where(False, x, y)", "y")),
    *_forms(REDUCE_OVER_NOTHING, *((f"reduce_{k}(x)", "x") for k in ("max", "min", "prod"))),
    *_forms(REDUCE_OVER_NOTHING, *((f"reduce_{k}(x)", "x") for k in ("sum", "mean")), nsz=True),
]

# Claims that are false, each with the restriction it led to: the test asserts they stay refuted
# (a restriction nobody needs any more would show up here as "proven").
REFUTED: list[tuple[Claim, str, str]] = [
    (Claim("x ** 3 -> x * x * x (integers)", "pow(x, 3)", "mul(mul(x, x), x)"), "f16",
     "restricted to integer types: two roundings where pow rounds once"),
    (Claim("abs(neg x) -> abs x (signed and float types)", "abs(neg(x))", "abs(x)"), "ui8",
     "restricted to signed and float types: neg wraps around on unsigned"),
]

# Rules that rewrite no values: what each one keeps, and how that is checked.
BY_CONSTRUCTION = {
    "attributes at their default are left out": "the op is rebuilt with the same attributes (its defaults fill in)",
    "cast(cast(x, a), b) -> cast(x, b) when x -> a is lossless": "proven per (x, a, b) dtype triple: see CASTS",
}


# --- building a claim as tg IR: which dtypes a rule fires on, and what it makes ----------------------


def _graph_of(expr: str, dtype: str, n: int = 2):
    """`expr` as a tg model over inputs of `dtype` and shape (n,), or None if the shape rules refuse it."""
    from tilegraph.ir import Graph, ShapeError, TilegraphError

    g = Graph()
    names = sorted({n for n in ("x", "y") if n in _idents(expr)})
    ins = {v: g.input(v, (n,), dtype) for v in names}
    if "c" in _idents(expr):
        ins["c"] = g.input("c", (n,), "i1")

    def lit(v):
        return g.constant(np.full((n,), v), dtype if not isinstance(v, bool) else "i1")

    def wrap(name):
        def op(*args):
            args = [lit(a) if isinstance(a, (bool, int, float)) else a for a in args]
            return g.op(name, *args)
        return op

    ns = {n: wrap(n) for n in ("add", "sub", "mul", "div", "pow", "neg", "abs", "relu", "where")}
    ns["not_"] = wrap("not")
    for k in ("sum", "mean", "max", "min", "prod"):
        # over a dim of size 1: (2,) -> (2, 1), reduced along axis 1
        ns[f"reduce_{k}"] = lambda x, k=k: g.op(f"reduce_{k}", g.reshape(x, (n, 1)), axes=(1,), keepdims=True)
    try:
        return g.build(eval(expr, {"__builtins__": {}}, {**ns, **ins}))  # type: ignore[dict-item]
    except (ShapeError, TilegraphError, TypeError, ValueError):
        return None


def _idents(expr: str) -> set[str]:
    import re

    return set(re.findall(r"[A-Za-z_]\w*", expr))


def fires(rule, claim: Claim, dtype: str):
    """Run `rule` alone on the claim's `before` graph; returns (fired, the IR it made matches `after`)."""
    from tilegraph.passes.rewrite import run_rules

    model = _graph_of(claim.before, dtype)
    if model is None:
        return False, True
    module = model.module.clone()
    if not run_rules(module, [rule]):
        return False, True
    from tilegraph.ir.model import print_module

    after = _graph_of(claim.after, dtype) if not claim.before.startswith("reduce_") else _graph_of("x", dtype)
    if claim.before.startswith("reduce_"):
        return True, True  # the result is x reshaped: the driver already checked its type
    return True, after is not None and _ops(print_module(module)) == _ops(after.text)


def _ops(text: str) -> list[str]:
    import re

    return sorted(re.findall(r"\btg\.[a-z_]+\b(?!\s*=)", text))  # op names, not the tg.name attribute


# --- proving ---------------------------------------------------------------------------------------


@dataclass
class Result:
    rule: str
    claim: str  # "before -> after"
    dtype: str
    status: str  # proven | proven up to the sign of zero | refuted | not fired | error
    detail: str = ""


def _z3_eval(sem: Sem, expr: str):
    ns = {n: getattr(sem, n) for n in ("add", "sub", "mul", "div", "pow", "neg", "abs", "relu", "not_", "where")}
    for k in ("sum", "mean", "max", "min", "prod"):
        ns[f"reduce_{k}"] = lambda a, k=k: sem.reduce(k, a)
    for n in ("x", "y"):
        ns[n] = sem.var(n)
    ns["c"] = sem.z3.Bool("c")
    return eval(expr, {"__builtins__": {}}, ns)


def _decode(sem: Sem, model, term) -> str:
    z3 = sem.z3
    v = model.eval(term, model_completion=True)
    if sem.kind == "float":
        bits = model.eval(z3.fpToIEEEBV(term), model_completion=True).as_long()
        e, s = IEEE[sem.dtype]
        width = e + s
        raw = np.array([bits], dtype={16: np.uint16, 32: np.uint32, 64: np.uint64}[width])
        return repr(float(raw.view(dtypes.numpy_dtype(sem.dtype))[0]))
    if sem.kind == "bool":
        return str(v)
    n = v.as_long()
    if sem.kind == "int" and n >= 2 ** (sem.sort.size() - 1):
        n -= 2 ** sem.sort.size()
    return str(n)


# z3's budget per check, in its own deterministic resource units ("rlimit"), not seconds: a
# wall-clock limit gave up on a proof whenever the machine was busy (fault seeding's baseline,
# at load 10, failed test_rule_proofs so). The checks here take at most ~5e7 units (the slowest
# ~1.6 s of CPU); 1e9 leaves 20x. The wall-clock limit stays, far out, against a solver that hangs.
Z3_RLIMIT = 10**9


def prove_z3(claim: Claim, dtype: str, timeout_ms: int = 600_000) -> tuple[str, str]:
    z3 = __import__("z3")
    sem = Sem(dtype)
    try:
        lhs, rhs = _z3_eval(sem, claim.before), _z3_eval(sem, claim.after)
    except NotModeled as e:
        return "not applicable", str(e)
    for nsz in ([False, True] if claim.nsz else [False]):
        s = z3.Solver()
        s.set("timeout", timeout_ms)
        s.set("rlimit", Z3_RLIMIT)
        s.add(*sem.pre)
        s.add(z3.Not(sem.equal(lhs, rhs, nsz)))
        r = s.check()
        if r == z3.unsat:
            return ("proven up to the sign of zero" if nsz else "proven"), ""
        if r == z3.unknown:
            return "error", f"z3 gave up ({s.reason_unknown()})"
        m = s.model()
        where = ", ".join(f"{n}={_decode(sem, m, t)}" for n, t in sorted(sem.names.items(), key=lambda kv: kv[0])
                          if n in _idents(claim.before) or n.startswith("c"))
        cex = f"{where}: {claim.before} = {_decode(sem, m, lhs)}, {claim.after} = {_decode(sem, m, rhs)}"
    return "refuted", cex


def prove_exhaustive(claim: Claim, dtype: str) -> tuple[str, str]:
    """Both sides run in NumPy on every value of a type of 8 bits or fewer (every pair for two variables)."""
    from tilegraph.ir import interpret

    np_dt = dtypes.numpy_dtype(dtype)
    values = np.arange(256, dtype=np.uint8).view(np_dt)
    values = np.unique(values) if dtype == "i4" else values
    names = [v for v in ("x", "y") if v in _idents(claim.before)]
    grids = np.meshgrid(*[values] * len(names), indexing="ij")
    inputs = {v: grid.reshape(-1) for v, grid in zip(names, grids)}
    n = len(inputs["x"])
    inputs["c"] = np.arange(n) % 2 == 0
    before, after = _graph_of(claim.before, dtype, n), _graph_of(claim.after, dtype, n)
    if before is None or after is None:
        return "error", "cannot build the claim"
    a = interpret(before, _ordered(before, inputs), float64=False)[0].reshape(-1)
    b = interpret(after, _ordered(after, inputs), float64=False)[0].reshape(-1)
    if dtypes.is_float(dtype):
        af, bf = a.astype(np.float64), b.astype(np.float64)
        same = (np.isnan(af) & np.isnan(bf)) | ((af == bf) & (claim.nsz | (np.signbit(af) == np.signbit(bf))))
    else:
        same = a == b
    if same.all():
        return ("proven up to the sign of zero" if claim.nsz else "proven"), "every value"
    i = int(np.argmin(same))
    where = ", ".join(f"{v}={inputs[v][i]!r}" for v in names)
    return "refuted", f"{where}: {claim.before} = {a[i]!r}, {claim.after} = {b[i]!r}"


def _ordered(model, inputs):
    return [inputs[n] for n in model.input_names]


def prove_negation(dtype: str) -> tuple[str, str]:
    """The claims model neg as IEEE negation; ir/kernels.py computes it as x * -1: the same bits but NaN's."""
    z3 = __import__("z3")
    sem = Sem(dtype)
    x = sem.var("x")
    s = z3.Solver()
    s.add(z3.Not(sem.equal(z3.fpMul(sem.rm, x, sem.val(-1)), z3.fpNeg(x))))
    return ("proven", "") if s.check() == z3.unsat else ("refuted", "")


def rules_by_doc():
    from tilegraph.passes import canonicalize, simplify_shapes

    rules = {}
    for source, rs in (("canonicalize", canonicalize.RULES), ("simplify-shapes", simplify_shapes.RULES)):
        for r in rs:
            rules.setdefault(r.doc, (source, r))
    return rules


def fires_beyond(rule, claim: Claim, dtype: str = "f32") -> bool:
    """Does the rule also fire with the claim's constants replaced by another value? Then the claim
    (proven for those constants only) does not cover what the rule does: its value guard is missing."""
    import re

    if claim.commutes or not re.search(r"\b\d+\b", claim.before):
        return False
    other = Claim(claim.rule, re.sub(r"\b\d+\b", "7", claim.before), claim.after)
    return fires(rule, other, dtype)[0]


def check_claim(rule, claim: Claim) -> list[Result]:
    out = []
    if fires_beyond(rule, claim):
        return [Result(claim.rule, f"{claim.before} -> {claim.after}", "f32", "refuted",
                       "the rule fires for other constants too (a guard is missing)")]
    for dt in claim.dtypes:
        fired, matches = fires(rule, claim, dt)
        name = f"{claim.before} -> {claim.after}"
        if not fired:
            continue
        if not matches:
            out.append(Result(claim.rule, name, dt, "error", "the rule made something other than the claim says"))
            continue
        if claim.commutes and dt == "f64":
            status, detail = "proven", "IEEE 754 5.4.1: the exact sum or product, rounded once, commutes"
        else:
            status, detail = prove_exhaustive(claim, dt) if dt in SMALL else prove_z3(claim, dt)
        out.append(Result(claim.rule, name, dt, status, detail))
    return out


# --- casts: cast(cast(x, a), b) -> cast(x, b) ---------------------------------------------------------


CAST_TYPES = tuple(IEEE) + tuple(BITS) + ("i1",)


def cast_pairs() -> list[tuple[str, str]]:
    """Every (x, a) the cast rule fires on: x -> a lossless (the rule's own `lossless_cast`), a != x."""
    from tilegraph.passes.canonicalize import lossless_cast

    return [(s, m) for s in CAST_TYPES for m in CAST_TYPES if m != s and lossless_cast(s, m)]


WIDE = (15, 113)  # binary128 holds every value of the IEEE types and of 64-bit integers exactly
WIDE_INT = 66  # bits that hold every value of every integer type, signed or not


def _exact(z3, sem: Sem, t):
    """t's value, exactly, in one common type (so two values of two types compare)."""
    if sem.kind == "float":
        return z3.fpToFP(sem.rm, t, z3.FPSort(*WIDE))
    if sem.kind == "bool":
        return z3.If(t, z3.FPVal(1, z3.FPSort(*WIDE)), z3.FPVal(0, z3.FPSort(*WIDE)))
    conv = z3.fpUnsignedToFP if sem.kind == "uint" else z3.fpSignedToFP
    return conv(sem.rm, t, z3.FPSort(*WIDE))


def prove_cast_keeps_value(src: str, mid: str) -> tuple[str, str]:
    """x -> a keeps every value of x (NaN, infinities, -0 and every number): then cast(cast(x, a), b) and
    cast(x, b) convert the same value, and a conversion is a function of the value (IEEE 754 5.4.2)."""
    z3 = __import__("z3")
    sem, to = Sem(src), Sem(mid)
    x = sem.var("x")
    m, _ = cast_term(sem, x, mid)
    s = z3.Solver()
    if sem.kind in ("int", "uint") and to.kind in ("int", "uint"):  # bit vectors: compare widened
        ext = lambda k, t: (z3.ZeroExt if k == "uint" else z3.SignExt)(WIDE_INT - t.size(), t)  # noqa: E731
        s.add(ext(sem.kind, x) != ext(to.kind, m))
    else:
        s.add(z3.Not(Sem("f64").equal(_exact(z3, sem, x), _exact(z3, to, m))))  # (equal reads FP terms of any sort)
    r = s.check()
    if r == z3.unsat:
        return "proven", ""
    return ("refuted", f"x={_decode(sem, s.model(), x)}") if r == z3.sat else ("error", "z3 gave up")


def prove_cast(src: str, mid: str, dst: str) -> tuple[str, str]:
    """The whole triple, where z3 is quick: cast(cast(x, a), b) == cast(x, b) where both are defined."""
    z3 = __import__("z3")
    sem = Sem(src)
    x = sem.var("x")
    m, ok1 = cast_term(sem, x, mid)
    lhs, ok2 = cast_term(Sem(mid), m, dst)
    rhs, ok3 = cast_term(sem, x, dst)
    d = Sem(dst)
    s = z3.Solver()
    s.add(ok1, ok2, ok3, z3.Not(d.equal(lhs, rhs)))
    r = s.check()
    if r == z3.unsat:
        return "proven", ""
    return ("refuted", f"x={_decode(sem, s.model(), x)}") if r == z3.sat else ("error", "z3 gave up")


def prove_small_casts() -> list[Result]:
    """The cast rule on the narrow float formats and i4, by every value in NumPy."""
    from tilegraph.passes.canonicalize import lossless_cast

    out = []
    for s in SMALL:
        np_s = dtypes.numpy_dtype(s)
        x = np.unique(np.arange(256, dtype=np.uint8).view(np_s)) if s == "i4" else np.arange(256, dtype=np.uint8).view(np_s)
        for m in ALL:
            if m == s or not lossless_cast(s, m):
                continue
            for d in ALL:
                if d == m or (dtypes.is_float(s) and not dtypes.is_float(d) and d != "i1"):
                    continue  # float -> int out of range is undefined: the z3 claims cover in-range values
                try:
                    with np.errstate(all="ignore"):
                        a = x.astype(dtypes.numpy_dtype(m)).astype(dtypes.numpy_dtype(d))
                        b = x.astype(dtypes.numpy_dtype(d))
                except TypeError:  # ml_dtypes has no such conversion: the model cannot run it either
                    continue
                af, bf = a.astype(np.float64), b.astype(np.float64)
                same = (np.isnan(af) & np.isnan(bf)) | ((af == bf) & (np.signbit(af) == np.signbit(bf)))
                status = "proven" if same.all() else "refuted"
                out.append(Result(BY_CONSTRUCTION_CAST, f"cast(cast(x, {m}), {d})", s, status,
                                  "" if same.all() else f"x={x[np.argmin(same)]!r}"))
    return out


BY_CONSTRUCTION_CAST = "cast(cast(x, a), b) -> cast(x, b) when x -> a is lossless"


# --- layout: index maps over symbolic dims -------------------------------------------------------------


def _add(solver, *parts) -> None:
    """solver.add over terms and lists of terms."""
    for part in parts:
        solver.add(*part) if isinstance(part, list) else solver.add(part)


def _broadcast_map(z3, out_idx, in_dims):
    """The index of a broadcast's operand read by output index `out_idx` (dims aligned on the right)."""
    k = len(out_idx) - len(in_dims)
    return [z3.If(d == 1, 0, out_idx[k + a]) for a, d in enumerate(in_dims)]


def _broadcastable(z3, small, big):
    k = len(big) - len(small)
    return z3.And([z3.Or(s == 1, s == big[k + a]) for a, s in enumerate(small)] or [z3.BoolVal(True)])


def _two_broadcasts_read_as_one(r1, r2, r3, *, direct_shape_checked: bool = False) -> bool:
    """Broadcasting x (rank r1) to s2 (rank r2) and then to s3 (rank r3) reads x at every index of s3
    where broadcasting x to s3 at once does (unsat: no shapes and index where they differ)."""
    import z3

    d1 = [z3.Int(f"a{i}") for i in range(r1)]
    d2 = [z3.Int(f"b{i}") for i in range(r2)]
    d3 = [z3.Int(f"c{i}") for i in range(r3)]
    i3 = [z3.Int(f"i{i}") for i in range(r3)]
    s = z3.Solver()
    _add(s, [d >= 1 for d in d1 + d2 + d3], [z3.And(i >= 0, i < d) for i, d in zip(i3, d3)])
    _add(s, _broadcastable(z3, d1, d2), _broadcastable(z3, d2, d3))
    if direct_shape_checked:
        _add(s, _broadcastable(z3, d1, d3))
    via = _broadcast_map(z3, _broadcast_map(z3, i3, d2), d1)
    direct = _broadcast_map(z3, i3, d1)
    _add(s, z3.Not(z3.And([a == b for a, b in zip(via, direct)] or [z3.BoolVal(True)])))
    return s.check() == z3.unsat


def lemma_broadcast_broadcast(r1, r2, r3) -> bool:
    """broadcast(broadcast(x, s2), s3) reads x where broadcast(x, s3) does (ranks r1 <= r2 <= r3)."""
    return _two_broadcasts_read_as_one(r1, r2, r3)


def lemma_broadcast_direct(r1, r2, r3) -> bool:
    """op(x, broadcast(b, s)) -> op(x, b) when the result shape is unchanged: the elementwise op's own
    broadcast of b to the result reads b where broadcasting b to s, then s to the result, does."""
    return _two_broadcasts_read_as_one(r1, r2, r3, direct_shape_checked=True)


def lemma_broadcast_as_reshape(r1, r2) -> bool:
    """A broadcast with as many elements out as in adds only dims of size 1 (dims >= 1)."""
    import z3

    d1 = [z3.Int(f"a{i}") for i in range(r1)]
    d2 = [z3.Int(f"b{i}") for i in range(r2)]
    s = z3.Solver()
    _add(s, [d >= 1 for d in d1 + d2], _broadcastable(z3, d1, d2))
    _add(s, z3.Product(d1) == z3.Product(d2) if d1 else z3.Product(d2) == 1)
    k = r2 - r1
    # every dim the broadcast repeats along is 1: new leading dims, and dims where x has 1
    _add(s, z3.Not(z3.And([d == 1 for d in d2[:k]] + [z3.Or(a != 1, b == 1) for a, b in zip(d1, d2[k:])])))
    return s.check() == z3.unsat


def lemma_transpose_transpose(rank) -> bool:
    """transpose(transpose(x, p1), p2) reads x at the index transpose(x, [p1[j] for j in p2]) does."""
    import z3

    p1 = [z3.Int(f"p{i}") for i in range(rank)]
    p2 = [z3.Int(f"q{i}") for i in range(rank)]
    j = [z3.Int(f"j{i}") for i in range(rank)]
    s = z3.Solver()
    for p in (p1, p2):
        _add(s, [z3.And(v >= 0, v < rank) for v in p], z3.Distinct(p) if rank > 1 else z3.BoolVal(True))

    def sel(p, i):  # p[i] for a symbolic i
        return z3.Sum([z3.If(i == k, p[k], 0) for k in range(rank)])

    def read(p, out_idx):
        """transpose(x, p) at out_idx reads x at k with k[p[a]] = out_idx[a]: k[b] = out_idx[p^-1(b)]."""
        return [z3.Sum([z3.If(p[a] == b, out_idx[a], 0) for a in range(rank)]) for b in range(rank)]

    via = read(p1, read(p2, j))
    composed = [sel(p1, p2[k]) for k in range(rank)]
    _add(s, z3.Not(z3.And([a == b for a, b in zip(via, read(composed, j))])))
    return s.check() == z3.unsat


def lemma_concat_concat(n_outer, pos) -> bool:
    """concat(.., concat(b1, b2), ..) along one axis = concat(.., b1, b2, ..): the same piece and offset."""
    import z3

    sizes = [z3.Int(f"n{i}") for i in range(n_outer + 1)]  # the flat list of pieces
    i = z3.Int("i")
    s = z3.Solver()
    _add(s, [n >= 0 for n in sizes], i >= 0, i < z3.Sum(sizes))

    def locate(pieces, idx):  # (piece number, offset) along the axis
        piece, off, start = z3.IntVal(-1), idx, z3.IntVal(0)
        for k, n in reversed(list(enumerate(pieces))):
            st = z3.Sum(pieces[:k]) if k else z3.IntVal(0)
            piece = z3.If(z3.And(idx >= st, idx < st + n), k, piece)
            off = z3.If(z3.And(idx >= st, idx < st + n), idx - st, off)
        del start
        return piece, off

    outer = sizes[:pos] + [sizes[pos] + sizes[pos + 1]] + sizes[pos + 2:]
    p, o = locate(outer, i)
    inner_p, inner_o = locate(sizes[pos:pos + 2], o)
    via_piece = z3.If(p < pos, p, z3.If(p == pos, pos + inner_p, p + 1))
    via_off = z3.If(p == pos, inner_o, o)
    fp, fo = locate(sizes, i)
    _add(s, z3.Not(z3.And(via_piece == fp, via_off == fo)))
    return s.check() == z3.unsat


def lemma_slice_everything() -> bool:
    """A step-1 slice whose length equals its operand's (n >= 1) starts at 0: it is the operand.
    starts/ends as NumPy reads them: negative counts from the end, then clamped to [0, n]."""
    import z3

    n, start, end = z3.Ints("n start end")

    def norm(v):
        w = z3.If(v < 0, v + n, v)
        return z3.If(w < 0, 0, z3.If(w > n, n, w))

    s = z3.Solver()
    a, b = norm(start), norm(end)
    length = z3.If(b > a, b - a, 0)
    _add(s, n >= 1, length == n, z3.Not(a == 0))
    return s.check() == z3.unsat


def lemma_conv_of_zero_pad() -> bool:
    """Along one spatial dim (each is independent): a convolution (stride s >= 1, dilation
    d >= 1, its own pads cb, ce >= 0) of x (length n >= 1) zero-padded by pb, pe >= 0 reads, at
    output o and tap t, the same value (x's element, or zero) as one of x padded by cb + pb,
    ce + pe; and both have the same padded length, so the same output length."""
    import z3

    n, s, d, cb, ce, pb, pe, o, t = z3.Ints("n s d cb ce pb pe o t")
    # Unfolded: the convolution reads the pad's output at i (a zero of its own padding outside
    # [0, n + pb + pe)), which is x at i - pb (a zero of the pad outside [0, n)). -1 is a zero.
    i = o * s + t * d - cb
    unfolded = z3.If(z3.And(i >= 0, i < n + pb + pe), z3.If(z3.And(i - pb >= 0, i - pb < n), i - pb, -1), -1)
    # Folded (canonicalize's _conv_of_zero_pad): pads cb + pb, ce + pe over x itself.
    fb, fe = cb + pb, ce + pe
    j = o * s + t * d - fb
    folded = z3.If(z3.And(j >= 0, j < n), j, -1)
    solver = z3.Solver()
    _add(solver, [n >= 1, s >= 1, d >= 1, cb >= 0, ce >= 0, pb >= 0, pe >= 0, o >= 0, t >= 0],
         z3.Or(unfolded != folded, (n + pb + pe) + cb + ce != n + fb + fe))
    return solver.check() == z3.unsat


def lemma_transpose_as_reshape(rank) -> bool:
    """A transpose that moves only dims of size 1 (the others keep their order) keeps the row-major
    order of the elements: every element's flat offset is the same before and after."""
    import z3

    ok = True
    for perm in itertools.permutations(range(rank)):
        for ones in itertools.product((False, True), repeat=rank):
            moved = [p for p in perm if not ones[p]]
            if moved != sorted(moved):
                continue  # the rule's guard refuses it
            dims = [z3.IntVal(1) if ones[a] else z3.Int(f"d{a}") for a in range(rank)]
            idx = [z3.IntVal(0) if ones[a] else z3.Int(f"k{a}") for a in range(rank)]
            out_dims = [dims[p] for p in perm]
            out_idx = [idx[p] for p in perm]

            def flat(ix, ds):
                off = z3.IntVal(0)
                for i, d in zip(ix, ds):
                    off = off * d + i
                return off

            s = z3.Solver()
            _add(s, [d >= 1 for d in dims], [z3.And(i >= 0, i < d) for i, d in zip(idx, dims)])
            _add(s, flat(idx, dims) != flat(out_idx, out_dims))
            ok &= s.check() == z3.unsat
    return ok


MAX_RANK = 4
def lemma_einsum_as_matmul(draws: int = 2000) -> bool:
    """Two-operand einsums over labels a, b, c, d (up to three an operand, each operand's labels
    distinct, output labels from the operands), `draws` of them drawn with seed 0 from all such
    equations (all of them take two minutes): where canonicalize spells one as a matmul between
    transposes and reshapes, the result is np.einsum's, in int64, exactly, so a misplaced index
    cannot hide in rounding. A bounded check, not a proof over every equation."""
    from tilegraph.ir import Graph, interpret
    from tilegraph.passes.registry import run_pipeline

    sizes = dict(zip("abcd", (2, 3, 4, 5)))
    rng = np.random.default_rng(0)
    operands = [p for r in range(1, 4) for p in itertools.permutations("abcd", r)]
    equations = [(x, y, out) for x, y in itertools.product(operands, operands)
                 for labels in [sorted(set(x) | set(y))]
                 for out in (p for r in range(len(labels) + 1) for p in itertools.permutations(labels, r))]
    fired = 0
    for k in rng.choice(len(equations), size=draws, replace=False):
        x, y, out = equations[k]
        equation = f"{''.join(x)},{''.join(y)}->{''.join(out)}"
        g = Graph()
        xi, yi = g.input("x", [sizes[c] for c in x], "i64"), g.input("y", [sizes[c] for c in y], "i64")
        rewritten = run_pipeline(g.build(g.einsum(xi, yi, equation=equation), names=["o"]), "canonicalize")
        if "einsum" in str(rewritten.module):
            continue
        fired += 1
        args = [rng.integers(-9, 9, [sizes[c] for c in v]) for v in (x, y)]
        if not np.array_equal(interpret(rewritten, args)[0], np.einsum(equation, *args)):
            return False
    return fired > 0


LAYOUT_LEMMAS: dict[str, list[tuple[str, Callable[[], bool]]]] = {
    "transpose(transpose x) -> one transpose, or x": [
        (f"rank {r}", lambda r=r: lemma_transpose_transpose(r)) for r in range(1, MAX_RANK + 1)],  # type: ignore[misc]
    "transpose(x, identity) -> x": [
        (f"rank {r}", lambda r=r: lemma_transpose_transpose(r)) for r in range(1, 2)],  # type: ignore[misc]
    "broadcast(broadcast x) -> broadcast x": [
        (f"ranks {a}<={b}<={c}", lambda a=a, b=b, c=c: lemma_broadcast_broadcast(a, b, c))  # type: ignore[misc]
        for c in range(MAX_RANK + 1) for b in range(c + 1) for a in range(b + 1)],
    "add(x, broadcast b) -> add(x, b) when the result type is unchanged": [
        (f"ranks {a}<={b}<={c}", lambda a=a, b=b, c=c: lemma_broadcast_direct(a, b, c))  # type: ignore[misc]
        for c in range(MAX_RANK + 1) for b in range(c + 1) for a in range(b + 1)],
    "broadcast adding only size-1 dims -> reshape": [
        (f"ranks {a}<={b}", lambda a=a, b=b: lemma_broadcast_as_reshape(a, b))  # type: ignore[misc]
        for b in range(MAX_RANK + 1) for a in range(b + 1)],
    "transpose moving only size-1 dims -> reshape": [
        (f"rank {r}", lambda r=r: lemma_transpose_as_reshape(r)) for r in range(1, MAX_RANK + 1)],  # type: ignore[misc]
    "concat(concat(a, b), c) on one axis -> concat(a, b, c)": [
        (f"{n} operands, inner at {p}", lambda n=n, p=p: lemma_concat_concat(n, p))  # type: ignore[misc]
        for n in range(1, 4) for p in range(n)],
    "slice of everything -> x": [("any n, starts, ends", lemma_slice_everything)],
    "conv(pad(x, zeros around spatial dims)) -> conv(x) padding itself": [
        ("one spatial dim, any stride, dilation and pads", lemma_conv_of_zero_pad)],
    "einsum('bik,bkj->bij', x, y) and any batched matrix product -> transposes, reshapes and one matmul": [
        ("2000 equations of two operands (about half a matmul), up to 3 labels of 4 each, exact in int64", lemma_einsum_as_matmul)],
}
# Layout rules whose result is their operand by the driver's own check (same type, so same shape)
# and the op's definition: no index arithmetic to prove.
LAYOUT_BY_DEFINITION = {
    "reshape/broadcast/cast to x's own type -> x, concat(x) -> x":
        "reshape keeps row-major order; broadcast to its own shape repeats nothing; a cast to its own type "
        "and a concat of one piece copy",
    "split into one piece -> x": "one piece of a split holds every element, in order",
    "reshape(reshape x) -> reshape x": "each reshape keeps row-major order, so the two compose into one that does",
}


OK = ("proven", "proven up to the sign of zero", "by definition", "not applicable")


def prove_all() -> list[Result]:
    """Every rule of canonicalize and simplify-shapes: a list of results (see `Result.status`)."""
    rules = rules_by_doc()
    results: list[Result] = []
    claimed = {c.rule for c in CLAIMS} | set(LAYOUT_LEMMAS) | set(LAYOUT_BY_DEFINITION) | set(BY_CONSTRUCTION)
    for doc, (source, _) in rules.items():
        if doc not in claimed:
            results.append(Result(doc, "-", "-", "error", f"a rule of {source} with no claim in tilegraph/proofs.py"))
    for claim in CLAIMS:
        if claim.rule not in rules:
            results.append(Result(claim.rule, claim.before, "-", "error", "no rule has this doc line any more"))
            continue
        results += check_claim(rules[claim.rule][1], claim)
    for dt in IEEE:
        results.append(Result("neg(neg x) -> x, not(not x) -> x", "K.negative(x) = x * -1 is fpNeg(x)", dt,
                              *prove_negation(dt)))
    for s, m in cast_pairs():
        status, detail = prove_cast_keeps_value(s, m)
        results.append(Result(BY_CONSTRUCTION_CAST, f"cast(x, {m}) keeps the value", s, status, detail))
        if s in IEEE and m in IEEE:  # and the whole rule, for every target, between the float types
            for d in tuple(IEEE) + ("i1",):  # (float -> integer targets: the value lemma above covers them)
                if d != m:
                    status, detail = prove_cast(s, m, d)
                    results.append(Result(BY_CONSTRUCTION_CAST, f"cast(cast(x, {m}), {d})", s, status, detail))
    results += prove_small_casts()
    for doc, lemmas in LAYOUT_LEMMAS.items():
        for label, lemma in lemmas:
            results.append(Result(doc, label, "int", "proven" if lemma() else "refuted"))
    for doc, why in {**LAYOUT_BY_DEFINITION, "attributes at their default are left out":
                     BY_CONSTRUCTION["attributes at their default are left out"]}.items():
        results.append(Result(doc, "-", "-", "by definition", why))
    return results


def summary(results: list[Result]) -> list[tuple[str, str, str]]:
    """One row per rule: (rule, status, detail) for the README."""
    rows = []
    for doc in dict.fromkeys(r.rule for r in results):
        rs = [r for r in results if r.rule == doc]
        statuses = {r.status for r in rs}
        kinds = sorted({r.dtype for r in rs if r.dtype != "-" and r.status != "not applicable"}, key=lambda d: ALL.index(d) if d in ALL else 99)
        statuses -= {"not applicable"}
        if statuses <= {"proven", "proven up to the sign of zero"}:
            status = "proven up to the sign of zero" if "proven up to the sign of zero" in statuses else "proven"
        elif statuses == {"by definition"}:
            status = "by definition"
        else:
            status = "FAILED: " + "; ".join(f"{r.dtype} {r.claim}: {r.status} {r.detail}" for r in rs
                                            if r.status not in ("proven", "proven up to the sign of zero"))
        detail = ", ".join(kinds) if kinds != ["int"] else "over the integers, symbolic dims"
        if status == "by definition":
            detail = rs[0].detail
        rows.append((doc, status, detail if doc != BY_CONSTRUCTION_CAST else
                     f"{sum(1 for r in rs)} obligations: every lossless (x, a) pair keeps its values (ints, "
                     "IEEE floats: z3; narrow formats: every value), whole triples between IEEE floats"))
    return rows


def main() -> int:
    import time

    t = time.perf_counter()
    results = prove_all()
    for rule, status, detail in summary(results):
        print(f"| `{rule}` | {status} | {detail} |")
    for claim, dtype, why in REFUTED:
        status, cex = prove_z3(claim, dtype) if dtype not in SMALL else prove_exhaustive(claim, dtype)
        print(f"refuted as stated: {claim.before} -> {claim.after} on {dtype}: {status}: {cex} ({why})")
    print(f"{len(results)} obligations in {time.perf_counter() - t:.1f} s")
    return 0 if all(r.status in OK for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
