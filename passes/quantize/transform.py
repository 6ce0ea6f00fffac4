"""The `quantize` pass: rewrites each linear layer (and embedding table) by its scheme."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import TgOp, make_op
from tilegraph.ir.model import weights_of
from tilegraph.ir.quant import FORMATS, MX_BLOCK, absmax_scale, quantize
from tilegraph.ir.shapes import TensorInfo, info_of
from tilegraph.passes.gptq import gptq
from tilegraph.passes.quantize.files import load_ranges
from tilegraph.passes.quantize.observers import activation_params, weight_scale
from tilegraph.passes.quantize.schemes import (FORMATS_SEPARATOR, GRANULARITIES, ROUNDINGS, SCHEMES, QuantizeError,
                                               Scheme, embedding_tables, layer_name, linear_layers, weight_value)
from tilegraph.ir.ops import Op


# --- the pass -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantize(ModulePass):
    """Quantize linear layers by a scheme (see the module docstring)."""

    name = "quantize"
    # Lossy: the property suite checks it within its stated bound, against `reference()`.
    LOSSY = True

    scheme: str = "w8a8"
    calib: str = ""  # activation ranges from `observe_ranges` (.npz); empty: dynamic activation scales
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
            load_ranges(self.calib)  # a bad file fails when the pipeline is read
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
        ranges = load_ranges(self.calib) if self.calib else {}
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
            q = layer.array(name + ".q", quantize(t, scale, None, 1, 0, "i8", fmt.numpy))  # type: ignore[assignment]
            rows = layer.emit("gather", q, ids).results[0]
            row_scales = sv if per_tensor else layer.emit("gather", sv, ids).results[0]
            if not per_tensor and info_of(ids.type).rank == 0:  # one row, its axis gone: its one scale
                row_scales = layer.emit("reshape", row_scales, result=TensorInfo((), info_of(row_scales.type).dtype)).results[0]
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
            q = self.array(name + ".q", quantize(w, scale, None, waxis, wblock, s.weight, fmt.numpy))  # type: ignore[assignment]
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
            if self.w.op_name == Op.weight:
                del self.store[name]

    def _static(self):
        """(scale, zero point, storage) of the calibrated activation, or None for dynamic scales."""
        if self.rng is None or self.s.mx:  # MX block scales always come from the data
            return None
        return activation_params(self.rng, self.s.activation, self.p.symmetric)

    def _quantize_static(self, a: SSAValue, static) -> tuple[SSAValue, SSAValue | None, SSAValue]:
        """(scale, zero point or None, codes) of `a` quantized by the calibrated `static` parameters."""
        scale, zp, storage = static
        sv = self.emit("constant", value=scale, result=TensorInfo((), "f32")).results[0]
        zv = self.emit("constant", value=zp, result=TensorInfo((), storage)).results[0] if zp is not None else None
        return sv, zv, self.emit("quantize", a, sv, zv, to=storage).results[0]

    def _fake_quant_activation(self, a: SSAValue) -> SSAValue:
        s = self.s
        rank = info_of(a.type).rank
        static = self._static()
        if static is None:
            q, qs = self.emit("dynamic_quantize", a, to=s.activation, block_size=MX_BLOCK if s.mx else 0).results
            return self.emit("dequantize", q, qs, to=self.dtype, axis=rank - 1,
                             block_size=MX_BLOCK if s.mx else 0).results[0]
        sv, zv, q = self._quantize_static(a, static)  # type: ignore[assignment]
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
        _, zv, q = self._quantize_static(a, static)  # type: ignore[assignment]
        acc = self.emit("matmul_integer", q, wq, zv).results[0]
        combined = (np.float32(static[0]) * np.asarray(wscale, np.float32)).astype(np.float32)
        cs = self.array(self.name + ".acc_scale", np.broadcast_to(combined, (info_of(wq.type).shape[1],)))
        return self.emit("dequantize", acc, cs, to=self.dtype, axis=rank - 1).results[0]
