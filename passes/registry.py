"""The one registry of tilegraph passes, read by the CLI (`tilegraph-opt`), `compile()` and the tests.

`PASSES` maps a pass name to a zero-argument function that imports its module and
returns the class, as xDSL's `xdsl.transforms.get_all_passes` does, so that the
command line starts without importing every pass. A pipeline is written in xDSL's
syntax, `canonicalize,cse,constant-fold{max-elements=1000}`; `run_pipeline` runs
one on a copy of a model, verifies the IR after each pass (a broken pass is named,
not discovered three passes later) and drops the weights no longer referenced.

The property-based suite (tests/test_properties.py) runs every pass registered
here on random graphs against the float64 interpreter: registering a pass is
enough to have it checked. A pass written outside tilegraph registers by name with
`register_pass` (the one public call; `tilegraph-opt --load-pass-plugin` imports
the module that calls it). A lossy pass (class attribute `LOSSY = True`, e.g.
`quantize`) is checked within its stated error bound instead: it gives a
`reference()` pass whose output it must match exactly (up to float rounding), and
the reference's roundings are each checked against their bound
(`tilegraph.testing.assert_within_quantization_bound`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from xdsl.passes import ModulePass
from xdsl.utils.arg_spec import parse_pipeline as _parse_specs
from xdsl.utils.exceptions import ArgSpecParseError

from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model, ModelError, WeightStore, context


def _canonicalize():
    from tilegraph.passes.canonicalize import Canonicalize

    return Canonicalize


def _cse():
    from tilegraph.passes.cse import CommonSubexpressionElimination

    return CommonSubexpressionElimination


def _dce():
    from tilegraph.passes.dce import DeadCodeElimination

    return DeadCodeElimination


def _constant_fold():
    from tilegraph.passes.constant_fold import ConstantFold

    return ConstantFold


def _simplify_shapes():
    from tilegraph.passes.simplify_shapes import SimplifyShapes

    return SimplifyShapes


def _decompose():
    from tilegraph.passes.decompose import Decompose

    return Decompose


def _fuse():
    from tilegraph.passes.fuse import Fuse

    return Fuse


def _attention():
    from tilegraph.passes.attention import FoldAttention

    return FoldAttention


def _tile():
    from tilegraph.passes.tile import Tile

    return Tile


def _shard():
    from tilegraph.passes.shard import Shard

    return Shard


def _quantize():
    from tilegraph.passes.quantize import Quantize

    return Quantize


def _recompute():
    from tilegraph.passes.recompute import Recompute

    return Recompute


PASSES: dict[str, Callable[[], type[ModulePass]]] = {
    "canonicalize": _canonicalize,
    "cse": _cse,
    "dce": _dce,
    "constant-fold": _constant_fold,
    "simplify-shapes": _simplify_shapes,
    "decompose": _decompose,
    "attention": _attention,
    "fuse": _fuse,
    "tile": _tile,
    "shard": _shard,
    "quantize": _quantize,
    "recompute": _recompute,
}



def register_pass(pass_class: type[ModulePass] | None = None, *, name: str | None = None):
    """Make a pass written outside tilegraph runnable by name in every pipeline
    (`tilegraph-opt -p my-pass`, `tilegraph.compile(..., pipeline=...)`, `run_pipeline`).

    `pass_class` is an xDSL ModulePass class (a dataclass whose fields are its options);
    it is registered under `name`, by default its own `name` attribute. Usable as a
    decorator, bare or as `@register_pass(name=...)`. A name already taken is refused.
    """
    if pass_class is None:
        return lambda cls: register_pass(cls, name=name)
    if not (isinstance(pass_class, type) and issubclass(pass_class, ModulePass)):
        raise PipelineError(f"register_pass: {pass_class!r} is not an xDSL ModulePass class")
    key = name or getattr(pass_class, "name", "")
    if not key or key in PASSES:
        raise PipelineError(f"register_pass: {'the name ' + repr(key) + ' is taken' if key else 'a pass needs a name'}"
                            f"; the passes are: {', '.join(sorted(PASSES))}")
    PASSES[key] = lambda: pass_class
    return pass_class


# Simplify first (so folding and cse see one spelling), fold what is known, merge
# equal ops, tidy layout ops, drop what no output needs. Composites stay whole:
# `decompose` is for the passes and backends that want primitives.
UNFUSED_PIPELINE = "canonicalize,constant-fold,cse,simplify-shapes,dce"
# Then group ops into kernels by predicted time saved and choose their tiles, both
# against the local CPU's calibrated cost model (the NumPy backend's target).
DEFAULT_PIPELINE = UNFUSED_PIPELINE + ",fuse,tile"


# The C backend at precision bf16 folds spelled-out attention into its flash kernel (both
# products on AMX tiles, the row softmax on vectors between them, the scores never written)
# over at least C_BF16_FOLD_MIN_KEYS keys. Its weights-by-values product steps through the
# keys AMX_KEYS_PER_STEP at a time (one tile of 16 bf16 pairs deep), and each call packs every
# head's k and v once: with fewer than four such steps a row, that fixed work outweighs the
# two oneDNN steps and the pass over the scores the fold saves; from four on it does not
# (benchmarks/full_size_sweep.py --precision bf16 says whether it still holds: its folded-bf16
# column is every attention folded).
AMX_KEYS_PER_STEP = 32
C_BF16_FOLD_MIN_KEYS = 4 * AMX_KEYS_PER_STEP
# At f32 the flash kernel's products are oneDNN's sgemm per block of keys: it wins once the
# chain's scores outgrow one core's L2 (`attention{beyond-cache=c}`: the profile's cache_bytes), as
# Whisper's encoder's 6 x 1500 x 1500 do, and not while they fit, as BERT's and ViT's do; and
# only over C_F32_FOLD_MIN_KEYS keys or more: a block's two sgemm calls over fewer keys (Swin's
# windows of 49 at a large batch) do not repay packing its query and key rows, where the chain's
# batched GEMMs pack each operand once (benchmarks/full_size_sweep.py --fold times both).
C_F32_FOLD_MIN_KEYS = 128


def default_pipeline(hardware: str = "cpu", precision: str = "f32") -> str:
    """The default pipeline, with fusion and tiling decided for a hardware target (`passes/cost`).
    For a GPU, attention spelled out as matmul-softmax-matmul is folded first (`attention`):
    the Triton backend has a flash kernel for it; so for the C backend, at precision bf16 over
    enough keys (C_BF16_FOLD_MIN_KEYS), at f32 where the scores outgrow a core's cache."""
    if hardware == "cpu":
        return DEFAULT_PIPELINE
    if hardware == "c":  # the C backend: as the NumPy one, its groups priced as C steps
        fold = f",attention{{min-keys={C_BF16_FOLD_MIN_KEYS}}}" if precision == "bf16" else \
            f",attention{{min-keys={C_F32_FOLD_MIN_KEYS} beyond-cache=c}}"
        return UNFUSED_PIPELINE + fold + ",fuse{hardware=c},tile{hardware=c}"
    return UNFUSED_PIPELINE + f",attention,fuse{{hardware={hardware}}},tile{{hardware={hardware}}}"


class PipelineError(TilegraphError):
    """A pipeline that cannot be read: unknown pass, bad option; the message says which."""


def get_pass_class(name: str) -> type[ModulePass]:
    if name not in PASSES:
        raise PipelineError(f"unknown pass '{name}'; the passes are: {', '.join(sorted(PASSES))}")
    return PASSES[name]()


def parse_pipeline(text: str) -> list[ModulePass]:
    """`canonicalize,cse,constant-fold{max-elements=1000}` -> pass instances, in order."""
    try:
        specs = list(_parse_specs(text))
    except ArgSpecParseError as e:
        raise PipelineError(f"cannot read the pipeline '{text}': {e}") from None
    unknown = [s.name for s in specs if s.name not in PASSES]
    if unknown:
        raise PipelineError(f"unknown pass{'es' if len(unknown) > 1 else ''} {', '.join(repr(n) for n in unknown)} "
                            f"in '{text}'; the passes are: {', '.join(sorted(PASSES))}")
    passes = []
    for spec in specs:
        cls = get_pass_class(spec.name)
        try:
            passes.append(cls.from_pass_spec(spec))
        except TilegraphError:
            raise
        except (ValueError, TypeError) as e:
            options = ", ".join(f"{f.name.replace('_', '-')}={f.default}" for f in dataclasses.fields(cls)) or "none"
            raise PipelineError(f"pass '{spec.name}': {e} (its options: {options})") from None
        # A count or size option (an int whose default is >= 0: max-elements, max-rows, max-ops,
        # group-size) is never negative; 0 keeps its documented meaning ("none", "the default").
        for f in dataclasses.fields(cls):
            value = getattr(passes[-1], f.name)
            if (type(f.default) is int and f.default >= 0 and type(value) is int and value < 0):
                raise PipelineError(f"pass '{spec.name}': {f.name.replace('_', '-')}={value} is negative; it "
                                    f"counts or sizes something (default {f.default})")
    return passes


def run_pipeline(model: Model, pipeline: str | Sequence[ModulePass], *, verify_each: bool = True) -> Model:
    """Run passes on a copy of `model` (weights included); the input model is untouched."""
    passes = parse_pipeline(pipeline) if isinstance(pipeline, str) else list(pipeline)
    out = model.clone()
    ctx = context()
    for p in passes:
        p.apply(ctx, out.module)
        if verify_each:
            try:
                out.verify()
            except ModelError as e:
                raise ModelError(f"the IR after pass '{p.name}' does not verify: {e}") from None
    from tilegraph.passes.dce import referenced_weights

    used = referenced_weights(out.module)
    return Model(out.module, WeightStore({k: v for k, v in out.weights.items() if k in used}))


def with_hardware(pipeline: str, hardware: str) -> str:
    """`pipeline` with `hardware=<hardware>` given to every pass that has a `hardware` option
    (fuse, tile, shard) and was not given one: the passes decide for the hardware being costed."""
    from xdsl.utils.arg_spec import ArgSpec

    parse_pipeline(pipeline)  # unknown passes and bad options: the registry's clear error
    specs = []
    for spec in _parse_specs(pipeline):
        options = {f.name for f in dataclasses.fields(get_pass_class(spec.name))}
        given = {k.replace("-", "_") for k in spec.parameters}
        if "hardware" in options and "hardware" not in given:
            spec = ArgSpec(spec.name, {**spec.parameters, "hardware": (hardware,)})
        specs.append(str(spec))
    return ",".join(specs)
