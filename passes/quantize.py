"""`quantize`: store weights in low precision, and compute in it where the backend can.

What it decides: for every `tg.matmul` whose right operand is a 2-D float weight (a
linear layer, [K, N]), how its weight and its activation are stored and multiplied,
by the scheme (`quantize{scheme=w8a8}`):

    scheme  weight                              activation                 the product
    w8      i8, per output channel              float                      float matmul of the dequantized weight
    w4a16   i4, groups of 128 along K           float                      float matmul of the dequantized weight
    mxfp4   f4E2M1FN, MX blocks of 32 along K   float                      float matmul of the dequantized weight
    w8a8    i8, per output channel              i8 per tensor (calibrated, int8 x int8 -> int32 (tg.matmul_integer), for
                                                ui8 + zero point unless     real; one dequantize of the i32 result
                                                symmetric) or per row
                                                (dynamic, no calibration)
    fp8     f8E4M3FN, per output channel        f8E4M3FN per tensor / row  fake-quant: dequantize both, float matmul
    mxfp8   f8E4M3FN, MX blocks of 32 along K   f8E4M3FN MX blocks of 32   fake-quant: dequantize both, float matmul
                                                (always from the data)

Embedding tables (a 2-D float weight read by gather on axis 0) are stored in i8 with one scale
per row, in every scheme (`embeddings=false` keeps them float), as onnxruntime does.

Fake quantization is used only where NumPy has no low-precision GEMM: for fp8 the float32
GEMM of the dequantized values is the product an fp8 tensor core makes (the products of
3-bit mantissas are exact in float32, which accumulates), so the numbers are those of a
real fp8 kernel, but not its speed. Weight-only schemes dequantize the weight each call,
as weight-only kernels do in their prologue. (The Triton backend computes these forms in fp8 and
MX for real: backends/triton/quant.py.)

Scales (observers): a weight's scale maps its largest magnitude to the format's largest
value (`minmax`), or is the clipping that minimizes the squared error of that group
(`mse`: ratios MSE_RATIOS of the largest magnitude, plus the coarser granularity's scale,
so per channel is never worse than per tensor). MX scales are powers of two (f8E8M0FNU).
Rounding: to nearest (`rounding=nearest`), or GPTQ (`rounding=gptq hessians=<file>`,
passes/gptq.py): each layer's weights rounded in turn so that the layer's output on the
calibration inputs (their X^T X, from `passes.gptq.hessians`) stays close, for every weight
scheme; the scales and storage stay the scheme's.

Activation ranges come from `calibrate` (min/max, percentile or MSE over calibration
inputs), saved by `tilegraph quantize --calib` and read here from `calib=<file.npz>`;
without them activations are quantized from their own values at run time.

Per layer (or embedding table) formats: `formats="name=scheme,..."` (a scheme, or none for
float) overrides `scheme` for the layers it names. `mixed_precision` chooses them: per layer
the scheme, among the given ones and float, that the cost model predicts fastest on a
target, within an error budget measured on the calibration inputs.

The stated error bound (checked by tilegraph.testing.assert_within_quantization_bound on
every property-suite graph): the quantized model computes, within float rounding, what
`simulate=true` computes, which is the float model with each quantized tensor x replaced
by dequantize(quantize(x)); and each of those is within half an ulp of its format times
its scale of x (plus, for a calibrated clipping range, the distance of x beyond it). With
rounding=gptq, x for a weight is GPTQ's weight (on its grid), not the original: GPTQ bounds
the layer's calibration output error (never above round to nearest's), not each weight's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import TgOp, make_op
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model, weights_of
from tilegraph.ir.quant import FORMATS, MX_BLOCK, Format, absmax_scale, dequantize, mx_scale, quantize
from tilegraph.ir.shapes import TensorInfo, info_of
from tilegraph.passes.gptq import gptq


class QuantizeError(TilegraphError):
    """A scheme, observer or calibration file the quantize pass cannot use; the message says which."""


@dataclass(frozen=True)
class Scheme:
    weight: str  # storage type of weights
    granularity: str  # "tensor", "channel" (output channel) or "group" (blocks along K)
    group_size: int  # for "group"
    mx: bool  # f8E8M0FNU power-of-two scales (OCP MX)
    activation: str | None = None  # storage type of activations; None: weight-only
    integer_gemm: bool = False  # int x int -> i32 for real (tg.matmul_integer)


SCHEMES = {
    "w8": Scheme("i8", "channel", 0, False),
    # 128: the group size of GPTQ and AWQ's int4 checkpoints.
    "w4a16": Scheme("i4", "group", 128, False),
    "mxfp4": Scheme("f4E2M1FN", "group", MX_BLOCK, True),
    "w8a8": Scheme("i8", "channel", 0, False, "i8", integer_gemm=True),
    "fp8": Scheme("f8E4M3FN", "channel", 0, False, "f8E4M3FN"),
    "mxfp8": Scheme("f8E4M3FN", "group", MX_BLOCK, True, "f8E4M3FN"),
}
OBSERVERS = ("minmax", "percentile", "mse")
# Between the items of `formats`: ONNX names hold ':' (onnx::MatMul_655), not ','.
FORMATS_SEPARATOR = ","
GRANULARITIES = ("tensor", "channel", "group")
ROUNDINGS = ("nearest", "gptq")
# Clipping ratios the MSE observer tries: 1 (no clipping) down to 0.5 of the largest
# magnitude in steps of 2.5%, the grid of NVIDIA's and Intel's MSE calibrators (TensorRT
# and Neural Compressor search a similar range); below half, int8 outliers dominate.
MSE_RATIOS = tuple(1.0 - 0.025 * i for i in range(21))
# The percentile observer's default: ignore the 0.01% most extreme activations
# (onnxruntime's and PyTorch's HistogramObserver defaults are 99.99 / 99.999).
DEFAULT_PERCENTILE = 99.99
# Values kept per tensor for the percentile and MSE observers (a uniform sample beyond).
OBSERVER_SAMPLE = 1 << 20


# --- which matmuls ----------------------------------------------------------------------


def linear_layers(func_ops: Iterable[Operation], store) -> list[tuple[TgOp, TgOp]]:
    """(matmul, weight op) for every matmul of an activation (rank >= 2) by a 2-D float weight
    (a tg.weight, or a small tg.constant: the builder keeps tiny weights inline)."""
    found = []
    for op in func_ops:
        if not (isinstance(op, TgOp) and op.op_name == "matmul"):
            continue
        a, w = op.operands
        owner = w.owner
        if not (isinstance(owner, TgOp) and owner.op_name in ("weight", "constant")):
            continue
        if owner.op_name == "weight" and owner.attr("name") not in store:
            continue
        wi, ai = info_of(w.type), info_of(a.type)
        if wi.rank != 2 or ai.rank < 2 or wi.dtype not in ("f32", "f16", "bf16"):
            continue
        found.append((op, owner))
    return found


def embedding_tables(func_ops: Iterable[Operation], store) -> list[tuple[TgOp, TgOp]]:
    """(gather, table weight op) for every row lookup (gather on axis 0) in a 2-D float weight."""
    found = []
    for op in func_ops:
        if not (isinstance(op, TgOp) and op.op_name == "gather" and op.attr("axis") == 0):
            continue
        owner = op.operands[0].owner
        if isinstance(owner, TgOp) and owner.op_name == "weight" and owner.attr("name") in store and \
                info_of(op.operands[0].type).rank == 2 and info_of(op.operands[0].type).dtype in ("f32", "f16", "bf16"):
            found.append((op, owner))
    return found


def layer_name(w: TgOp, index: int) -> str:
    """What a layer is called: its weight's name (an inline constant weight: `linear<index>`)."""
    return w.attr("name") if w.op_name == "weight" else f"linear{index}"


def weight_value(w: TgOp, store) -> np.ndarray:
    return np.asarray(store[w.attr("name")] if w.op_name == "weight" else w.attr("value"), np.float32)


# --- observers: weights ---------------------------------------------------------------------


def _blocks(w: np.ndarray, size: int) -> np.ndarray:
    """|w| [K, N] as [ceil(K/size), size, N], zero-padded."""
    k, n = w.shape
    b = -(-k // size)
    padded = np.zeros((b * size, n), np.float32)
    padded[:k] = np.abs(w)
    return padded.reshape(b, size, n)


def _round_trip(w: np.ndarray, scale: np.ndarray, fmt: Format, granularity: str, size: int) -> np.ndarray:
    axis, block = (0, size) if granularity == "group" else (1, 0)
    return dequantize(quantize(w, scale, None, axis, block, fmt.name, fmt.numpy), scale, None, axis, block,
                      np.float32)


def _group_sq_error(w, scale, fmt, granularity, size) -> np.ndarray:
    """Squared error per scale entry."""
    err = (_round_trip(w, scale, fmt, granularity, size).astype(np.float64) - w) ** 2
    if granularity == "group":
        k, n = err.shape
        padded = np.zeros((-(-k // size) * size, n))
        padded[:k] = err
        return padded.reshape(-1, size, n).sum(axis=1)
    if granularity == "channel":
        return err.sum(axis=0)
    return np.asarray(err.sum())


def _amax(w: np.ndarray, granularity: str, size: int) -> np.ndarray:
    if granularity == "tensor":
        return np.asarray(np.abs(w).max(initial=0.0), np.float32)
    if granularity == "channel":
        return np.abs(w).max(axis=0, initial=0.0).astype(np.float32)
    return _blocks(w, size).max(axis=1)


def weight_scale(w: np.ndarray, fmt: Format, granularity: str, size: int, mx: bool, observer: str) -> np.ndarray:
    """The scale of a weight [K, N]: () per tensor, (N,) per channel, (ceil(K/size), N) per group."""
    w = np.asarray(w, np.float32)
    amax = _amax(w, granularity, size)
    make = (lambda a: mx_scale(a, fmt)) if mx else (lambda a: absmax_scale(a, fmt))
    best = make(amax)
    if observer == "minmax":
        return best
    if observer != "mse":
        raise QuantizeError(f"weights take the 'minmax' or 'mse' observer, not '{observer}'")
    best_err = _group_sq_error(w, best, fmt, granularity, size)
    # The scale chosen at the next coarser granularity is a candidate too (found by hypothesis:
    # per tensor's best clipping beat each channel's own grid): a finer one is never worse.
    coarser = []
    if granularity != "tensor":
        up = weight_scale(w, fmt, GRANULARITIES[GRANULARITIES.index(granularity) - 1], size, mx, observer)
        coarser = [np.broadcast_to(up, amax.shape).astype(best.dtype)]
    ratios = [make(amax * np.float32(r)) for r in MSE_RATIOS[1:]] if not mx else \
        [make(amax / 2)]  # MX scales are powers of two: the one below clips (the OCP rule)
    for cand in coarser + ratios:
        err = _group_sq_error(w, cand, fmt, granularity, size)
        better = err < best_err
        best = np.where(better, cand, best).astype(best.dtype)
        best_err = np.where(better, err, best_err)
    return best


# --- observers: activations (calibration) --------------------------------------------------------


class Observer:
    """Collects one activation's values over calibration batches; `range()` is the (lo, hi) to quantize."""

    def __init__(self, kind: str, percentile: float = DEFAULT_PERCENTILE, symmetric: bool = False,
                 storage: str = "i8", seed: int = 0):
        if kind not in OBSERVERS:
            raise QuantizeError(f"unknown observer '{kind}'; the observers are: {', '.join(OBSERVERS)}")
        if not 50 < percentile <= 100:
            raise QuantizeError(f"percentile {percentile} must be in (50, 100]")
        self.kind, self.percentile, self.symmetric, self.storage = kind, percentile, symmetric, storage
        self.lo, self.hi = np.inf, -np.inf
        self.sample: list[np.ndarray] = []
        self.seen = 0
        self.rng = np.random.default_rng(seed)

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float32).reshape(-1)
        x = x[np.isfinite(x)]
        if not x.size:
            return
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))
        if self.kind != "minmax":
            self.seen += x.size
            self.sample.append(x)
            kept = sum(s.size for s in self.sample)
            if kept > OBSERVER_SAMPLE:  # keep a uniform sample of everything seen
                allx = np.concatenate(self.sample)
                self.sample = [self.rng.choice(allx, OBSERVER_SAMPLE, replace=False)]

    def range(self) -> tuple[float, float]:
        if self.lo > self.hi:
            return (0.0, 0.0)
        lo, hi = min(self.lo, 0.0), max(self.hi, 0.0)
        if self.kind == "percentile":
            x = np.concatenate(self.sample)
            lo = min(float(np.percentile(x, 100 - self.percentile)), 0.0)
            hi = max(float(np.percentile(x, self.percentile)), 0.0)
        elif self.kind == "mse":
            x = np.concatenate(self.sample).astype(np.float64)
            best, best_err = (lo, hi), np.inf
            for r in MSE_RATIOS:
                cand = (lo * r, hi * r)
                scale, zp, storage = activation_params(cand, self.storage, self.symmetric)
                f = FORMATS[storage]
                q = quantize(x, scale, zp, 1, 0, storage, f.numpy)
                err = float(np.sum((dequantize(q, scale, zp, 1, 0, np.float64) - x) ** 2))
                if err < best_err:
                    best, best_err = cand, err
            lo, hi = best
        return (lo, hi)


def activation_params(rng: tuple[float, float], storage: str, symmetric: bool):
    """(scale, zero point or None, storage type) for an activation range (lo, hi). An asymmetric
    int8 range is stored as ui8 with a zero point (as onnxruntime's static quantization does)."""
    lo, hi = min(rng[0], 0.0), max(rng[1], 0.0)
    fmt = FORMATS[storage]
    if not fmt.integer or symmetric:
        return absmax_scale(np.float32(max(-lo, hi)), fmt), None, storage
    u8 = FORMATS["ui8"]
    scale = absmax_scale(np.float32((hi - lo) / (u8.hi - u8.lo) * u8.hi), u8)
    zp = np.asarray(np.clip(np.rint(u8.lo - lo / scale), u8.lo, u8.hi)).astype(np.uint8)
    return scale, zp, "ui8"


def calibrate(model: Model, batches: Iterable[Sequence[np.ndarray]], observer: str = "minmax", *,
              percentile: float = DEFAULT_PERCENTILE, symmetric: bool = False, storage: str = "i8",
              progress: Callable[[Iterable], Iterable] = iter) -> dict[str, tuple[float, float]]:
    """Run `model` (the interpreter, float32) on calibration batches and observe the activation of every
    linear layer the pass would quantize; returns {weight name: (lo, hi)}."""
    from tilegraph.ir.interpreter import interpret

    layers = linear_layers(model.func.body.block.ops, model.weights)
    if not layers:
        raise QuantizeError("the model has no matmul by a 2-D float weight to calibrate")
    names = [layer_name(w, i) for i, (_, w) in enumerate(layers)]
    observers = {n: Observer(observer, percentile, symmetric, storage) for n in names}
    count = 0
    for batch in progress(batches):
        values: dict = {}
        interpret(model, list(batch), float64=False, values=values)
        for n, (mm, _) in zip(names, layers):
            observers[n].update(values[mm.operands[0]])
        count += 1
    if not count:
        raise QuantizeError("no calibration batches")
    return {name: o.range() for name, o in observers.items()}


def save_calibration(path: str | Path, ranges: dict[str, tuple[float, float]]) -> Path:
    np.savez(path, **{k: np.array(v, np.float64) for k, v in ranges.items()})
    return Path(path)


def save_hessians(path: str | Path, hessians: dict[str, np.ndarray]) -> Path:
    """Each layer's X^T X (passes.gptq.hessians) for rounding=gptq, in float32."""
    np.savez(path, **{k: np.asarray(v, np.float32) for k, v in hessians.items()})
    return Path(path)


def load_calibration(path: str | Path) -> dict[str, tuple[float, float]]:
    if not Path(path).is_file():
        raise QuantizeError(f"quantize: no calibration file {path}")
    with np.load(path, allow_pickle=False) as data:
        out = {}
        for k in data.files:
            v = data[k]
            if v.shape != (2,):
                raise QuantizeError(f"quantize: calibration entry '{k}' in {path} is not a (lo, hi) pair")
            out[k] = (float(v[0]), float(v[1]))
        return out


# --- the pass -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantize(ModulePass):
    """Quantize linear layers by a scheme (see the module docstring)."""

    name = "quantize"
    # Lossy: the property suite checks it within its stated bound, against `reference()`.
    LOSSY = True

    scheme: str = "w8a8"
    calib: str = ""  # activation ranges from `calibrate` (.npz); empty: dynamic activation scales
    observer: str = "minmax"  # weights: minmax | mse
    granularity: str = ""  # weights: tensor | channel | group; empty: the scheme's
    group_size: int = 0  # with granularity=group; 0: the scheme's
    symmetric: bool = False  # calibrated int8 activations: i8 (true) or ui8 with a zero point
    simulate: bool = False  # fake-quant everything: float ops on dequantize(quantize(x))
    embeddings: bool = True  # embedding tables (gather on axis 0) as i8, one scale per row
    formats: str = ""  # per layer or table: "name=scheme,..." (a scheme, or none: float), over `scheme`
    rounding: str = "nearest"  # weights: nearest | gptq (data-aware, passes/gptq.py; needs `hessians`)
    hessians: str = ""  # with rounding=gptq: each layer's X^T X from `save_hessians` (.npz)
    act_order: bool = False  # with rounding=gptq: largest inputs first, scales fixed up front

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise QuantizeError(f"unknown scheme '{self.scheme}'; the schemes are: {', '.join(SCHEMES)}")
        if self.observer not in ("minmax", "mse"):
            raise QuantizeError(f"weights take the 'minmax' or 'mse' observer, not '{self.observer}' "
                                "(percentile is for calibrated activations)")
        if self.granularity not in ("",) + GRANULARITIES:
            raise QuantizeError(f"unknown granularity '{self.granularity}'; one of {', '.join(GRANULARITIES)}")
        if self.group_size < 0:
            raise QuantizeError(f"group-size {self.group_size} is negative")
        if self.calib:
            load_calibration(self.calib)  # a bad file fails when the pipeline is read
        self.layer_formats()
        if self.rounding not in ROUNDINGS:
            raise QuantizeError(f"unknown rounding '{self.rounding}'; one of {', '.join(ROUNDINGS)}")
        if self.rounding == "gptq" and not self.hessians:
            raise QuantizeError("rounding=gptq needs hessians=<file.npz> (each layer's calibration X^T X: "
                                "tilegraph quantize --rounding gptq --calib makes it)")
        if self.hessians and not Path(self.hessians).is_file():
            raise QuantizeError(f"quantize: no hessians file {self.hessians}")

    def reference(self) -> "Quantize":
        """The fake-quant model this pass's output must match (its stated bound)."""
        # A plain Quantize with these options, not dataclasses.replace: that would keep a
        # subclass's rewrite, which is what the reference is there to check.
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(Quantize) if f.init}
        return Quantize(**options | {"simulate": True})

    def layer_formats(self) -> dict[str, str]:
        """The `formats` option as {layer: scheme or "none"}."""
        out = {}
        for item in filter(None, self.formats.split(FORMATS_SEPARATOR)):
            name, _, sch = item.rpartition("=")
            if not name or (sch != "none" and sch not in SCHEMES):
                raise QuantizeError(f"formats: '{item}' is not layer=scheme (a scheme: none, {', '.join(SCHEMES)})")
            out[name] = sch
        return out

    def resolved(self, scheme: str | None = None) -> Scheme:
        s = SCHEMES[scheme or self.scheme]
        gran = self.granularity or s.granularity
        size = self.group_size or s.group_size or 128
        if s.mx and (self.granularity or self.group_size) and (gran != "group" or size != MX_BLOCK):
            raise QuantizeError(f"scheme {scheme or self.scheme} uses MX blocks of {MX_BLOCK}; granularity and "
                                "group-size cannot change")
        if s.mx:
            gran, size = "group", MX_BLOCK
        return Scheme(s.weight, gran, size if gran == "group" else 0, s.mx, s.activation, s.integer_gemm)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        scheme = self.resolved()
        store = weights_of(op)
        ranges = load_calibration(self.calib) if self.calib else {}
        formats = self.layer_formats()
        from xdsl.dialects.func import FuncOp

        for func in [f for f in op.walk() if isinstance(f, FuncOp)]:
            for i, (mm, w) in enumerate(linear_layers(list(func.body.block.ops), store)):
                name = layer_name(w, i)
                if formats.get(name) == "none":
                    continue
                s = self.resolved(formats[name]) if name in formats else scheme
                _Layer(self, s, store, mm, w, name, ranges.get(name)).rewrite()
            if self.embeddings:
                for gather, table in embedding_tables(list(func.body.block.ops), store):
                    if formats.get(table.attr("name")) != "none":
                        self._embedding(gather, table, store)

    def _embedding(self, gather: TgOp, table: TgOp, store) -> None:
        """gather(T, ids) -> dequantize(gather(T_i8, ids), gather(row scales, ids)): the table is stored
        in int8 with one scale per row (per token); with granularity=tensor, one for the table (as
        onnxruntime quantizes Gather)."""
        name = table.attr("name")
        t = np.asarray(store[name], np.float32)
        fmt = FORMATS["i8"]
        per_tensor = self.granularity == "tensor"
        scale = absmax_scale(np.abs(t).max(axis=None if per_tensor else 1, keepdims=not per_tensor, initial=0.0),
                             fmt)
        layer = _Layer(self, SCHEMES["w8"], store, gather, table, name, None)
        sv = layer.array(name + ".scale", scale)
        dtype = info_of(gather.results[0].type).dtype
        ids = gather.operands[1]
        if self.simulate:
            q = layer.emit("quantize", table.results[0], sv, to="i8").results[0]
            deq = layer.emit("dequantize", q, sv, to=dtype).results[0]
            out = layer.emit("gather", deq, ids).results[0]
        else:
            q = layer.array(name + ".q", quantize(t, scale, None, 1, 0, "i8", fmt.numpy))
            rows = layer.emit("gather", q, ids).results[0]
            row_scales = sv if per_tensor else layer.emit("gather", sv, ids).results[0]
            out = layer.emit("dequantize", rows, row_scales, to=dtype).results[0]
        layer.replace(out)


class _Layer:
    """Rewrites one matmul(a, W)."""

    def __init__(self, p: Quantize, s: Scheme, store, mm: TgOp, w: TgOp, name: str, rng):
        self.p, self.s, self.store, self.mm, self.w, self.name, self.rng = p, s, store, mm, w, name, rng
        self.new: list[Operation] = []
        self.dtype = info_of(mm.results[0].type).dtype

    def emit(self, opname, *operands, result=None, **attrs) -> TgOp:
        op = make_op(opname, [o for o in operands if o is not None], attrs, result)
        self.new.append(op)
        return op

    def array(self, name: str, value: np.ndarray) -> SSAValue:
        value = np.asarray(value)
        base, n = name, 1
        while name in self.store:
            name, n = f"{base}{n}", n + 1
        self.store[name] = value
        return self.emit("weight", name=name, result=TensorInfo(tuple(value.shape),
                                                                 dtypes.dtype_name(value.dtype))).results[0]

    def rewrite(self) -> None:
        s, p = self.s, self.p
        name = self.name
        w = weight_value(self.w, self.store)
        fmt = FORMATS[s.weight]
        if p.rounding == "gptq":  # w becomes GPTQ's weights, each on the grid of its scale
            w, scale = gptq(w, self._hessian(w.shape[0]), fmt, s.granularity, s.group_size,
                            lambda x, gran: weight_scale(x, fmt, gran, s.group_size, s.mx, p.observer),
                            act_order=p.act_order)
        else:
            scale = weight_scale(w, fmt, s.granularity, s.group_size, s.mx, p.observer)
        waxis, wblock = (0, s.group_size) if s.granularity == "group" else (1, 0)
        if s.mx:
            scale = scale.astype(dtypes.numpy_dtype("f8E8M0FNU"))
        sv = None if s.integer_gemm and not p.simulate else self.array(name + ".scale", scale)
        if p.simulate:
            src = self.array(name + ".gptq", w) if p.rounding == "gptq" else self.w.results[0]
            q = self.emit("quantize", src, sv, to=s.weight, axis=waxis, block_size=wblock).results[0]
        else:
            q = self.array(name + ".q", quantize(w, scale, None, waxis, wblock, s.weight, fmt.numpy))
        a = self.mm.operands[0]
        if s.integer_gemm and not p.simulate:
            out = self._integer_gemm(a, q, scale)
        else:
            wd = self.emit("dequantize", q, sv, to=self.dtype, axis=waxis, block_size=wblock).results[0]
            x = a if s.activation is None else self._fake_quant_activation(a)
            out = self.emit("matmul", x, wd).results[0]
        self.replace(out)

    def _hessian(self, k: int) -> np.ndarray:
        with np.load(self.p.hessians, allow_pickle=False) as data:
            if self.name not in data.files:
                raise QuantizeError(f"quantize: {self.p.hessians} has no Hessian for layer '{self.name}'")
            h = data[self.name]
        if h.shape != (k, k):
            raise QuantizeError(f"quantize: the Hessian of layer '{self.name}' in {self.p.hessians} is {h.shape}, "
                                f"its weight has {k} rows")
        return h

    def replace(self, out: SSAValue) -> None:
        """The new ops in, the matmul (or gather) out, and its weight if nothing else reads it."""
        name = self.name
        block = self.mm.parent_block()
        block.insert_ops_before(self.new, self.mm)
        self.mm.results[0].replace_all_uses_with(out)
        block.erase_op(self.mm)
        if not self.w.results[0].uses:
            block.erase_op(self.w)
            if self.w.op_name == "weight":
                del self.store[name]

    def _static(self):
        """(scale, zero point, storage) of the calibrated activation, or None for dynamic scales."""
        if self.rng is None or self.s.mx:  # MX block scales always come from the data
            return None
        return activation_params(self.rng, self.s.activation, self.p.symmetric)

    def _fake_quant_activation(self, a: SSAValue) -> SSAValue:
        s = self.s
        rank = info_of(a.type).rank
        static = self._static()
        if static is None:
            q, qs = self.emit("dynamic_quantize", a, to=s.activation, block_size=MX_BLOCK if s.mx else 0).results
            return self.emit("dequantize", q, qs, to=self.dtype, axis=rank - 1,
                             block_size=MX_BLOCK if s.mx else 0).results[0]
        scale, zp, storage = static
        sv = self.emit("constant", value=scale, result=TensorInfo((), "f32")).results[0]
        zv = self.emit("constant", value=zp, result=TensorInfo((), storage)).results[0] if zp is not None else None
        q = self.emit("quantize", a, sv, zv, to=storage).results[0]
        return self.emit("dequantize", q, sv, zv, to=self.dtype).results[0]

    def _integer_gemm(self, a: SSAValue, wq: SSAValue, wscale: np.ndarray) -> SSAValue:
        """int8 x int8 -> int32, then one dequantize by activation scale x weight scale."""
        rank = info_of(a.type).rank
        static = self._static()
        if static is None:
            q, row_scale = self.emit("dynamic_quantize", a, to="i8").results
            acc = self.emit("matmul_integer", q, wq).results[0]
            ws = self.array(self.name + ".scale", np.asarray(wscale, np.float32))
            y = self.emit("dequantize", acc, ws, to=self.dtype, axis=rank - 1).results[0]
            rs = row_scale if self.dtype == "f32" else self.emit("cast", row_scale, to=self.dtype).results[0]
            return self.emit("mul", y, rs).results[0]
        scale, zp, storage = static
        sv = self.emit("constant", value=scale, result=TensorInfo((), "f32")).results[0]
        zv = self.emit("constant", value=zp, result=TensorInfo((), storage)).results[0] if zp is not None else None
        q = self.emit("quantize", a, sv, zv, to=storage).results[0]
        acc = self.emit("matmul_integer", q, wq, zv).results[0]
        combined = (np.float32(scale) * np.asarray(wscale, np.float32)).astype(np.float32)
        cs = self.array(self.name + ".acc_scale", np.broadcast_to(combined, (info_of(wq.type).shape[1],)))
        return self.emit("dequantize", acc, cs, to=self.dtype, axis=rank - 1).results[0]


# --- mixed precision: which layers stay in higher precision --------------------------------------


def relative_error(model: Model, quantized: Model, batches: Sequence[Sequence[np.ndarray]]) -> float:
    """||y_q - y|| / ||y|| over every output and calibration batch (the interpreter, float32)."""
    return output_agreement(_outputs(model, batches), _outputs(quantized, batches))[0]


def _outputs(model: Model, batches) -> list[list[np.ndarray]]:
    from tilegraph.ir.interpreter import interpret

    return [[np.asarray(y, np.float64) for y in interpret(model, list(b), float64=False)] for b in batches]


def output_agreement(reference: list, got: list) -> tuple[float, float]:
    """(relative error ||y_q - y|| / ||y||, mean cosine similarity of the outputs' last-axis vectors) over
    every output and batch."""
    num = den = 0.0
    cosines = []
    for ys, qs in zip(reference, got):
        for y, yq in zip(ys, qs):
            num += float(np.sum((yq - y) ** 2))
            den += float(np.sum(y ** 2))
            a, b = y.reshape(-1, y.shape[-1] if y.ndim else 1), yq.reshape(-1, y.shape[-1] if y.ndim else 1)
            norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
            cosines.append(np.where(norms > 0, np.sum(a * b, axis=1) / np.where(norms > 0, norms, 1), 1.0))
    err = float(np.sqrt(num / den)) if den else float(np.sqrt(num))
    return err, float(np.mean(np.concatenate(cosines))) if cosines else 1.0


def layer_time(m: int, k: int, n: int, scheme: str, hw) -> float:
    """Predicted seconds of one linear layer [m, k] @ [k, n] on `hw` (passes/cost), in float (scheme
    'none') or quantized by `scheme`: the quantize pass's rewrite of that layer alone, costed op by op."""
    from tilegraph.ir import Graph
    from tilegraph.passes.cost.model import at, module_cost
    from tilegraph.passes.registry import run_pipeline

    g = Graph()
    x = g.input("x", (m, k))
    layer = g.build(x @ g.weight("w", np.zeros((k, n), np.float32)), names=["y"])
    if scheme != "none":
        layer = run_pipeline(layer, f"quantize{{scheme={scheme}}}")
    return at(module_cost(layer.func, hw).time)


@dataclass
class MixedPlan:
    """What `mixed_precision` chose."""

    pipeline: str  # quantize{... formats="layer=scheme,..."}
    formats: dict  # layer -> scheme, or "none" (float)
    remarks: list
    error: float  # measured on the calibration batches, everything together
    cosine: float
    predicted_f32: float  # s, the float model's linear layers on the target
    predicted: float  # s, the same layers as chosen
    shapes: dict  # layer -> (m, k, n) the predictions are for


def mixed_precision(model: Model, batches: Sequence[Sequence[np.ndarray]], schemes: Sequence[str],
                    max_error: float | None = None, min_cosine: float | None = None, target: str = "cpu",
                    sizes: dict | None = None, progress: Callable[[Iterable], Iterable] = iter,
                    memo: dict | None = None, **options) -> MixedPlan:
    """Choose each linear layer's format among `schemes` and float ("none") to minimize the predicted time
    of the model's linear layers on `target` (passes/cost: `layer_time` at `sizes`, by default the first
    calibration batch's), keeping the measured relative output error within `max_error` and the mean
    cosine similarity of the outputs at least `min_cosine` (on the calibration batches).

    1. Predicted saving of each (layer, scheme): float time minus quantized time. A scheme that saves
       nothing on the target is never chosen (on the NumPy CPU backend that may be every scheme).
    2. Sensitivity of each (layer, scheme) that saves time: the error with only that layer quantized.
    3. Moves, one per (layer, scheme), each layer's in order of its saving: taken greedily by
       marginal saving per marginal sensitivity (squared errors of independent roundings add); the
       longest prefix whose measured error (all its layers quantized together) is within the budget
       wins, by bisection (the error grows with the prefix in practice; each step is measured).
    A remark per layer (passes.remarks, and in the returned plan) says why it got its format.
    `memo`: measurements kept between calls on the same model and batches (another budget).
    """
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.ir.hardware import hardware
    from tilegraph.passes.cost.model import at
    from tilegraph.passes.registry import run_pipeline
    from tilegraph.passes.remarks import remark

    for sch in schemes:
        if sch not in SCHEMES:
            raise QuantizeError(f"unknown scheme '{sch}'; the schemes are: {', '.join(SCHEMES)}")
    if max_error is None and min_cosine is None:
        raise QuantizeError("mixed precision needs an accuracy budget: a maximum error or a minimum cosine")
    hw = hardware(target)
    options.setdefault("embeddings", "false")  # the search is over linear layers; tables stay as they are
    found = linear_layers(model.func.body.block.ops, model.weights)
    layers = [layer_name(w, i) for i, (_, w) in enumerate(found)]
    if sizes is None:
        sizes = bind_inputs(model, list(batches[0]))[1]
    shapes = {}
    for name, (mm, w) in zip(layers, found):
        a = info_of(mm.operands[0].type).shape
        m = int(np.prod([at(d, sizes) for d in a[:-1]]))
        shapes[name] = (m, *info_of(w.results[0].type).shape)
    times: dict = {}

    def predicted(name: str, sch: str) -> float:
        key = (shapes[name], sch)
        if key not in times:
            times[key] = layer_time(*shapes[name], sch, hw)
        return times[key]

    saving = {(n, sch): predicted(n, "none") - predicted(n, sch) for n in layers for sch in schemes}
    extra = "".join(f" {k.replace('_', '-')}={v}" for k, v in options.items())

    def spec(formats: dict) -> str:
        given = FORMATS_SEPARATOR.join(f"{n}={formats.get(n, 'none')}" for n in layers)
        return f'quantize{{scheme={schemes[0]}{extra} formats="{given}"}}'

    memo = {} if memo is None else memo
    if "reference" not in memo:
        memo["reference"] = _outputs(model, batches)

    def measure(formats: dict) -> tuple[float, float]:
        key = spec(formats)
        if key not in memo:
            memo[key] = output_agreement(memo["reference"], _outputs(run_pipeline(model, key), batches))
        return memo[key]

    def within(err_cos: tuple[float, float]) -> bool:
        return (max_error is None or err_cos[0] <= max_error) and (min_cosine is None or err_cos[1] >= min_cosine)

    useful = [(n, sch) for n in layers for sch in schemes if saving[n, sch] > 0]
    sens = {key: measure({key[0]: key[1]}) for key in progress(useful)}
    moves = []
    for n in layers:
        prev_gain, prev_err = 0.0, 0.0
        for sch in sorted((s for m, s in useful if m == n), key=lambda s: saving[n, s]):
            gain, err = saving[n, sch] - prev_gain, sens[n, sch][0] ** 2 - prev_err
            moves.append((gain / max(err, 1e-30), n, sch))
            prev_gain, prev_err = saving[n, sch], max(prev_err, sens[n, sch][0] ** 2)
    moves.sort(key=lambda mv: -mv[0])

    def assignment(count: int) -> dict:
        chosen: dict = {}
        for _, n, sch in moves[:count]:
            if saving[n, sch] > saving.get((n, chosen.get(n)), 0.0):
                chosen[n] = sch
        return chosen

    lo, hi = 0, len(moves)
    result = measure(assignment(hi)) if moves else measure({})
    if moves and not within(result):
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if within(measure(assignment(mid))):
                lo = mid
            else:
                hi = mid
        result = measure(assignment(lo))
    else:
        lo = hi
    chosen = assignment(lo)
    budget = " and ".join(x for x in (f"relative error <= {max_error:g}" if max_error is not None else "",
                                      f"cosine >= {min_cosine:g}" if min_cosine is not None else "") if x)
    remarks = []
    for n in layers:
        got = chosen.get(n, "none")
        gains = ", ".join(f"{sch} {saving[n, sch] * 1e6:+.1f} us" for sch in schemes)
        alone = ", ".join(f"{sch} error {sens[n, sch][0]:.4f}" for sch in schemes if (n, sch) in sens)
        if got != "none":
            why = f"the most predicted saving kept within {budget}"
        elif not any(saving[n, sch] > 0 for sch in schemes):
            why = f"no scheme is predicted faster than float on {hw.name}"
        else:
            why = f"quantizing it too would break {budget}"
        msg = (f"{n} [{shapes[n][0]}x{shapes[n][1]}x{shapes[n][2]}]: {got} ({why}; predicted saving on "
               f"{hw.name}: {gains}" + (f"; alone: {alone}" if alone else "") + ")")
        remark("quantize", msg)
        remarks.append(msg)
    f32 = sum(predicted(n, "none") for n in layers)
    now = f32 - sum(saving[n, sch] for n, sch in chosen.items())
    summary = (f"all together: relative error {result[0]:.4f}, cosine {result[1]:.5f} ({budget}); "
               f"{len(chosen)} of {len(layers)} layers quantized; linear layers predicted on {hw.name}: "
               f"{f32 * 1e3:.3f} ms in float -> {now * 1e3:.3f} ms ({f32 / now:.2f}x)")
    remark("quantize", summary)
    remarks.append(summary)
    return MixedPlan(spec(chosen), {n: chosen.get(n, "none") for n in layers}, remarks, result[0], result[1],
                     f32, now, shapes)
