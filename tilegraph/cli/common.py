"""What the commands share: exit codes, default dims, output checks, and how times, counts, formulas and sizes are printed."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

EXIT_MISMATCH = 1
# A symbolic dim the user gave no --dim for is costed at this size (and the output
# says so): a batch or sequence of a hundred-odd rows, where the bundled models run.
DEFAULT_DIM = 128



def refuse_overwriting(model: str | Path, *outputs: str | Path) -> None:
    """A TilegraphError when a file a command writes is the model it reads (or its weights)."""
    from tilegraph.ir.errors import TilegraphError

    inputs = {Path(model).resolve(): "the model being read"}
    if Path(model).suffix == ".mlir":  # its weights are read from beside it
        inputs[Path(model).with_suffix(".weights.npz").resolve()] = "the weights of the model being read"
    for out in outputs:
        if out is not None and Path(out).resolve() in inputs:
            what = inputs[Path(out).resolve()]
            if Path(out).name.endswith(".weights.npz"):  # the weights a command writes beside its output
                raise TilegraphError(f"the output's weights file {out} would overwrite {what} ({model}): "
                                     f"name the output differently from the model")
            raise TilegraphError(f"-o {out} would overwrite {what} ({model}); write elsewhere")



def write_together(writers: dict) -> None:
    """Writes {path: write(path)} so that a failure leaves none of them new: each is written
    whole to a temporary name beside it, then moved into place in the order given (the
    weights first: a module or model is never left without the weights it loads)."""
    import os

    made: list[tuple[Path, Path]] = []
    try:
        for path, write in writers.items():
            path = Path(path)
            tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # same suffix: np.savez keeps the name
            made.append((tmp, path))
            write(tmp)
        for tmp, path in made:
            try:
                os.replace(tmp, path)
            except OSError as e:  # named by the file the user asked for, not the temporary one
                raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        for tmp, _ in made:
            tmp.unlink(missing_ok=True)


# Random integer inputs of `run`: masks and flags in {0, 1} (ids of an embedding span its table).
VALID_INT_HIGH = 2


def nonfinite_differ(actual, expected) -> bool:
    """Whether NaN or inf stand in different places (the same NaN in both is agreement)."""
    import numpy as np

    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    finite = np.isfinite(e)
    return a.shape != e.shape or not np.array_equal(np.isnan(a), np.isnan(e)) or \
        not np.array_equal(a[~finite], e[~finite])




FORMULA_DIGITS = 4


# sympy.simplify's time grows exponentially in Piecewise/Min/Max/ceiling terms (the CPU cost
# model's regimes: `cost --hardware cpu --symbolic` sat in piecewise_fold for 14 minutes on
# MiniLM); past this size, or with such terms, the formula is only expanded (about 1 s).
SIMPLIFY_MAX_OPS = 200


def _formula(expr, dims: dict[str, int]) -> str:
    import sympy

    expr = _subs(sympy.sympify(expr), dims)
    regimes = expr.has(sympy.Piecewise, sympy.Min, sympy.Max, sympy.floor, sympy.ceiling)
    if not regimes and sympy.count_ops(expr) <= SIMPLIFY_MAX_OPS:
        expr = sympy.simplify(expr)  # cancels
    expr = sympy.expand(expr)  # lists terms
    return str(expr.xreplace({f: sympy.Float(f, FORMULA_DIGITS) for f in expr.atoms(sympy.Float)}))


def _time_unit(seconds: float) -> tuple[str, float]:
    """The unit that shows `seconds` as a number >= 1: s, ms or us."""
    for unit, scale in (("s", 1.0), ("ms", 1e3)):
        if seconds >= 1 / scale:
            return unit, scale
    return "us", 1e6


def format_time(seconds: float) -> str:
    unit, scale = _time_unit(seconds)
    return f"{seconds * scale:.4g} {unit}"


def format_count(x: float) -> str:
    """12.3G, 4.56M, 789: a count with a decimal SI prefix."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{prefix}"
    return f"{x:.4g}"


# --- shared by cost, compile --report and tilegraph-opt ---------------------------------

def parse_dims(items: Sequence[str]) -> dict[str, int]:
    """`["batch=8", "seq=128"]` -> {"batch": 8, "seq": 128}; a TilegraphError for anything else."""
    from tilegraph.ir.errors import TilegraphError

    sizes: dict[str, int] = {}
    for item in items:
        name, _, size = item.partition("=")
        if not name.strip() or not (size.strip().isdecimal() and size.strip().isascii()) or int(size) < 1:
            raise TilegraphError(f"--dim takes NAME=SIZE with a positive integer size, got '{item}'")
        if name.strip() in sizes:
            raise TilegraphError(f"--dim {name.strip()} is given twice ({name.strip()}={sizes[name.strip()]} and "
                                 f"{item}); give each dimension once")
        sizes[name.strip()] = int(size)
    return sizes


def sizes_for(symbols: set[str], dims: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """A size for every symbol: the --dim given, else DEFAULT_DIM; and the names defaulted."""
    defaulted = sorted(symbols - dims.keys())
    return {**{name: DEFAULT_DIM for name in defaulted}, **dims}, defaulted


def describe_sizes(sizes: dict[str, int], defaulted: Sequence[str]) -> str:
    """'batch=8, seq=128 (seq: default 128; set with --dim NAME=SIZE)'."""
    note = f" ({', '.join(defaulted)}: default {DEFAULT_DIM}; set with --dim NAME=SIZE)" if defaulted else ""
    return ", ".join(f"{k}={v}" for k, v in sorted(sizes.items())) + note


def check_dims(dims: dict[str, int], symbols: set[str]) -> None:
    from tilegraph.ir.errors import TilegraphError

    unknown = sorted(dims.keys() - symbols)
    if unknown:
        known = ", ".join(sorted(symbols)) or "none: every dimension is static"
        raise TilegraphError(f"--dim {', '.join(unknown)}: not a symbolic dimension of the model "
                             f"(its symbolic dimensions: {known})")


def _input_symbols(model) -> set[str]:
    import sympy

    return {s.name for info in model.inputs for d in info.shape if isinstance(d, sympy.Expr)
            for s in d.free_symbols}


def _cost_symbols(cost) -> set[str]:
    import sympy

    return {s.name for _, c in cost.rows for e in (c.flops, c.bytes, c.time)
            for s in sympy.sympify(e).free_symbols}


def _subs(expr, dims: dict[str, int]):
    """`expr` with the symbols named in `dims` (matched by name: assumptions may differ) replaced."""
    return expr.subs({s: dims[s.name] for s in expr.free_symbols if s.name in dims})



def spec_text(spec) -> str:
    from tilegraph.passes.shard_strategies import spec_str

    return spec_str(spec)
