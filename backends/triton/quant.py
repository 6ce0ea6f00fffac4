"""Quantized layers on the Triton backend: low-precision GEMMs for real, activations quantized on the device.

The `quantize` pass (passes/quantize/) writes every scheme in the IR's own terms:
int8 x int8 -> int32 as tg.matmul_integer, and the float formats as the product of
dequantized operands, `matmul(dequantize(qa, sa), dequantize(qw, sw))` (fp8, MXFP8) or
`matmul(a, dequantize(qw, sw))` (weight-only: w8, w4a16, MXFP4). The NumPy backend
computes that last form as written (fake quantization: a float GEMM of the dequantized
values). This backend computes it in the low precision itself, because the scales
factor out of the GEMM or ride along with it:

    scheme   operands in tl.dot                      scales
    w8a8     i8 x i8 -> i32 (tl.dot, int32 acc)      i32 -> float in the epilogue (tg.dequantize);
             ui8 activations with a zero point z:    (a - z) w = (a - 128) w + (128 - z) sum_k w
    fp8      f8E4M3FN x f8E4M3FN -> fp32 (tl.dot)    per-row x per-column: on the accumulator
    mxfp8    e4m3 x e4m3, tl.dot_scaled              E8M0 blocks of 32 along K, inside dot_scaled
             (and an MXFP8 activation times an MXFP4 weight: e4m3 x e2m1)
    w8, w4a16, mxfp4 (weight-only): the weight is read in its storage type, decoded and
             scaled in registers (4-bit values unpacked from bytes), and multiplied in
             the activation's precision

`group_quantized` does this at the IR level, on the backend's private copy of the module:
it moves the tg.dequantize ops that feed a matmul (and the tg.dequantize reading a
tg.matmul_integer, with the elementwise group after it) into one tg.fusion group, and
`QuantKernelWriter` writes that group as one GEMM whose prologue loads the quantized
tiles. tg.dynamic_quantize and tg.quantize of activations are row kernels of their own
(scales from the whole row, or from each block of 32 for MX). Weights in 4-bit formats
live on the device two to a byte along K ([ceil(K/2), N] uint8: `runtime.pack_k`), the
layout tl.dot_scaled reads e2m1 in; the 4-bit GEMMs unpack them in registers.

Why weight-only MXFP4 does not go through tl.dot_scaled: its operand formats are e2m1,
e4m3, e5m2, bf16 and fp16, so an fp32 activation would be rounded to bf16 first, a
quantization the IR does not say (a weight-only scheme keeps activations float). For bf16
activations no target multiplies bf16 x e2m1 natively (sm_90 and sm_100 both upcast the
weight to bf16 first, as the decoded path does), and Triton 3.6's dot_scaled with an
unscaled bf16 operand returned wrong products on sm_90 where decoding the tile in registers
agreed with the interpreter (benchmarks/triton_gpu_log.md).

Numerics, against the float64 interpreter of the quantized module: integer accumulators
are exact (int8 x int8 products summed in int32, as tg.matmul_integer); fp8 and MX
products are exact in fp32 (3-bit mantissas), so results differ from the interpreter's
by fp32 accumulation only. Triton's interpreter converts fp32 to fp8 wrongly (3.8:
no ties-to-even, no carry into the exponent); `runtime.py` gives it the conversion
a GPU makes (cvt.rn.satfinite), as it does for bf16.

What the hardware does with it (checked by tests/test_triton_quant.py on the PTX of
ahead-of-time builds): on sm_90 tl.dot of int8 tiles becomes wgmma with s8 operands, and of
fp8 tiles mma.sync on operands widened to f16 (wgmma's own fp8 accumulation keeps fewer bits
than fp32, and the kernels accumulate as the IR says: in fp32); tl.dot_scaled is native on sm_100 (tcgen05.mma with block scales) and
emulated on sm_90 (operands upcast to bf16, then wgmma).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from xdsl.ir import Block, Operation, SSAValue
from xdsl.rewriter import Rewriter

from tilegraph.ir import dtypes
from tilegraph.ir.ops import Op, OPS, QUANTIZATION_OPS
from tilegraph.ir.dialect import FusionOp, TgOp, YieldOp
from tilegraph.ir.fusion import ANCHORS, GroupKind
from tilegraph.ir.quant import FORMATS, MIN_SCALE, MX_BLOCK
from tilegraph.ir.shapes import TensorInfo, dims_equal, info_of, numel
from tilegraph.backends.triton.group_kernels import (AXIS_OPS, GEMM_TILE, GROUP_M, INDENT, POINTER_TYPES, ROW_TILE_ELEMENTS,
                                     TL_TYPES, TORCH_TYPES, KernelCode, KernelWriter, Unsupported, Value, compute_type, dot_precision,
                                     rows_fit)

# Element types only these kernels read or write (Triton's names for them); E8M0 scales and
# 4-bit values travel as their bytes (uint8).
FP8_TYPES = {"f8E4M3FN": "tl.float8e4nv", "f8E5M2": "tl.float8e5"}
QUANT_POINTERS = {**POINTER_TYPES, "f8E4M3FN": "*fp8e4nv", "f8E5M2": "*fp8e5", "f8E8M0FNU": "*u8",
                  "i4": "*u8", "f4E2M1FN": "*u8"}
QUANT_TORCH = {**TORCH_TYPES, "f8E4M3FN": "torch.float8_e4m3fn", "f8E5M2": "torch.float8_e5m2",
               "f8E8M0FNU": "torch.uint8"}
PACKED = dtypes.PACKED_4BIT
# tl.dot_scaled's names of the formats it multiplies.
SCALED_FORMATS = {"f8E4M3FN": "e4m3", "f8E5M2": "e5m2", "f4E2M1FN": "e2m1", "bf16": "bf16", "f16": "fp16"}
# The K of one int8 / fp8 tensor-core instruction (mma.m16n8k32, wgmma k = 32 for 8-bit
# operands: PTX ISA 8.x): a smaller BLOCK_K would not fill one.
MIN_BLOCK_K_8BIT = 32
# dot_scaled on sm_100 takes K in steps of 64 for 4-bit operands (tcgen05.mma kind::mxf4,
# K = 64), and a K tile holds whole MX blocks of 32.
MIN_BLOCK_K_SCALED = 64
# The smallest M, N (and K) tile of a tensor-core dot (mma.m16n8k16: 16 rows; Triton asks 16 of N and K too).
MIN_BLOCK_MN = 16
# M tiles that reach the low-precision tensor-core instructions, measured on ahead-of-time builds
# (tests/test_triton_quant.py checks the PTX): a warpgroup's wgmma on sm_90 has M = 64, and below
# that Triton multiplies 8-bit floats with mma.sync on f16 (fp8 tiles of 32 rows: m16n8k16.f16);
# tcgen05.mma with block scales (kind::mxf8f6f4) on sm_100 takes M = 128, and at 64 Triton
# emulates dot_scaled with bf16 (kind::f16).
MIN_BLOCK_M_8BIT = 64
MIN_BLOCK_M_SCALED = 128
# An E8M0 byte for a scale of 1 (2^0): what masked-off blocks of dot_scaled read.
E8M0_ONE = 127
# tl.dot's accumulator type must be its out_dtype, which is float32 unless named: an int32
# accumulator needs out_dtype=tl.int32 (the interpreter does not check; the compiler asserts).
INTEGER_DOT = "acc = tl.dot(a_tile, b_tile, acc, out_dtype=tl.int32)"
# On sm_90 Triton lets fp8 wgmma accumulate in the tensor core's reduced precision across the
# whole K loop unless told otherwise; 0 asks for every product added into the fp32 accumulator,
# so the result is what the float64 interpreter computes within fp32 rounding.
FP8_DOT = "acc = tl.dot(a_tile, b_tile, acc, max_num_imprecise_acc=0)"


# --- grouping: the prologue and epilogue of each quantized GEMM in one tg.fusion ----------------------------


def group_quantized(func) -> None:
    """Put each quantized GEMM's ops into one tg.fusion group (module docstring)."""
    rewriter = Rewriter()
    for op in list(func.body.block.ops):
        if op.parent_block() is None:
            continue  # merged already
        if isinstance(op, TgOp) and op.op_name == Op.matmul_integer:
            _group_integer(op, rewriter)
        elif _matmul_of(op) is not None:
            _group_float(op, rewriter)


def _matmul_of(op: Operation) -> TgOp | None:
    """The one matmul a lone op or a fused group is (or is anchored on)."""
    if isinstance(op, TgOp):
        return op if op.op_name == Op.matmul else None
    if isinstance(op, FusionOp):
        mms = [o for o in op.ops if o.op_name in ANCHORS]
        return mms[0] if len(mms) == 1 and mms[0].op_name == Op.matmul else None
    return None


def _outer(group: Operation, v: SSAValue) -> SSAValue:
    """The value outside `group` that its block argument `v` stands for (v itself for a lone op)."""
    if isinstance(group, FusionOp) and v in group.block.args:
        return group.operands[group.block.args.index(v)]
    return v


def _only_user(v: SSAValue) -> Operation | None:
    users = {use.operation for use in v.uses}
    return users.pop() if len(users) == 1 else None


def _top_dequantize(v: SSAValue, reader: Operation) -> TgOp | None:
    owner = v.owner
    if isinstance(owner, TgOp) and owner.op_name == Op.dequantize and owner.parent_block() is reader.parent_block() \
            and _only_user(owner.results[0]) is reader:
        return owner
    return None


def _group_float(group: Operation, rewriter: Rewriter) -> None:
    mm = _matmul_of(group)
    a, w = (_outer(group, v) for v in mm.operands)
    wdeq = _top_dequantize(w, group)
    if wdeq is None or not (isinstance(wdeq.operands[0].owner, TgOp) and
                            wdeq.operands[0].owner.op_name in (Op.weight, Op.constant)) \
            or info_of(wdeq.operands[0].type).rank != 2 or info_of(a.type).rank < 2:
        return
    adeq = _top_dequantize(a, group) or _own_copy(a, group, rewriter)
    items = [wdeq] + ([adeq] if adeq is not None else []) + [group]
    if _rows_too_wide(mm, wdeq, adeq) and isinstance(group, FusionOp):
        cut = next((i for i, o in enumerate(group.ops) if o.op_name in WHOLE_ROW_OPS), None)
        if cut is not None:
            # The row reductions after the GEMM (layer_norm) become a kernel of their own, reading
            # what the GEMM stores.
            head = _unwrap(group, rewriter)
            items = items[:-1] + head[:cut]  # type: ignore[operator]
            tail = head[cut:]
            _merge(tail, GroupKind.REDUCTION, None, rewriter)
    _merge(items, GroupKind.QUANTIZED_MATMUL, group.attributes.get("tile") if isinstance(group, FusionOp) else None, rewriter)


def _rows_too_wide(mm: TgOp, wdeq: TgOp, adeq: TgOp | None) -> bool:
    """Whether whole output rows are too many for one program at the GEMM's smallest tile: tcgen05's
    block-scaled MMA takes 128 rows (MIN_BLOCK_M_SCALED), always too many; 8-bit floats on both sides
    take 64 (MIN_BLOCK_M_8BIT), too many once a row is wider than the float GEMM's whole-row
    accumulator allows (2 x ROW_TILE_ELEMENTS values: a 64 x 512 one spills, and the GEMM ran at a
    tenth of its rate; benchmarks/triton_gpu_log.md)."""
    if info_of(wdeq.operands[1].type).dtype == "f8E8M0FNU":
        return True
    fp8 = adeq is not None and all(info_of(d.operands[0].type).dtype in FP8_TYPES for d in (adeq, wdeq))
    return fp8 and not rows_fit(MIN_BLOCK_M_8BIT, info_of(mm.results[0].type).shape[-1])


# Ops that need a program to hold whole rows (group_kernels.py's row reductions and scans, and the
# composites made of them, not yet spelled out when quantized GEMMs are grouped).
WHOLE_ROW_OPS = AXIS_OPS | {name for name, spec in OPS.items() if spec.row_normalizing}


def _unwrap(group: FusionOp, rewriter: Rewriter) -> list[TgOp]:
    """The ops of a group, put back where the group was (in order); the group goes."""
    mapper: dict[SSAValue, SSAValue] = dict(zip(group.block.args, group.operands))
    ops = []
    for op in group.ops:
        copy = op.clone(value_mapper=mapper)
        rewriter.insert_op(copy, _before(group))
        ops.append(copy)
    for r, y in zip(group.results, group.block.last_op.operands):
        r.replace_all_uses_with(mapper[y])
    rewriter.erase_op(group)
    return ops


def _own_copy(a: SSAValue, reader: Operation, rewriter: Rewriter) -> TgOp | None:
    """An activation's tg.dequantize that other GEMMs read too (Q, K and V share theirs): a copy of
    it for `reader` alone, so that each GEMM multiplies the quantized values itself; the original
    goes when the last reader has its copy."""
    deq = a.owner
    if not (isinstance(deq, TgOp) and deq.op_name == Op.dequantize and deq.parent_block() is reader.parent_block()):
        return None
    copy = deq.clone()
    rewriter.insert_op(copy, _after(deq))
    for i, v in enumerate(reader.operands):
        if v is a:
            reader.operands[i] = copy.results[0]
    if not deq.results[0].uses:
        rewriter.erase_op(deq)
    return copy


def _group_integer(mi: TgOp, rewriter: Rewriter) -> None:
    items: list[Operation] = [mi]
    deq = _only_user(mi.results[0])
    if isinstance(deq, TgOp) and deq.op_name == Op.dequantize and deq.parent_block() is mi.parent_block():
        items.append(deq)
        after = _only_user(deq.results[0])
        # The elementwise group after it (the row scale of dynamic quantization, bias, activation)
        # is the GEMM's epilogue when it keeps the GEMM's shape.
        out = info_of(deq.results[0].type)
        if isinstance(after, FusionOp) and after.parent_block() is mi.parent_block() and \
                all(o.SPEC.category == "elementwise" for o in after.ops) and \
                all(_same_shape(info_of(r.type), out) for r in after.results):
            items.append(after)
    _merge(items, GroupKind.QUANTIZED_MATMUL, None, rewriter)


def _same_shape(a: TensorInfo, b: TensorInfo) -> bool:
    return a.rank == b.rank and all(dims_equal(x, y) for x, y in zip(a.shape, b.shape))


def _merge(items: Sequence[Operation], kind: GroupKind, tile, rewriter: Rewriter) -> FusionOp:
    """One tg.fusion computing `items` (ops and groups of one block, in program order), placed
    where the last of them was; values they make that others read are its results."""
    inside = set(items)
    inputs: list[SSAValue] = []
    for it in items:
        for v in it.operands:
            if v.owner not in inside and v not in inputs:
                inputs.append(v)
    block = Block(arg_types=[v.type for v in inputs])
    mapper: dict[SSAValue, SSAValue] = dict(zip(inputs, block.args))
    for it in items:
        if isinstance(it, FusionOp):
            inner = dict(zip(it.block.args, (mapper[v] for v in it.operands)))
            for op in it.ops:
                block.add_op(op.clone(value_mapper=inner))
            for r, y in zip(it.results, it.block.last_op.operands):
                mapper[r] = inner[y]
        else:
            block.add_op(it.clone(value_mapper=mapper))
    outputs = [r for it in items for r in it.results if any(u.operation not in inside for u in r.uses)]
    block.add_op(YieldOp.create(operands=[mapper[r] for r in outputs]))
    group = FusionOp.build_group(kind.value, inputs, [r.type for r in outputs], block, {"tile": tile} if tile else None)
    rewriter.insert_op(group, _before(items[-1]))
    for r, new in zip(outputs, group.results):
        r.replace_all_uses_with(new)
    for it in reversed(items):
        rewriter.erase_op(it)
    return group


def _before(op: Operation):
    from xdsl.rewriter import InsertPoint

    return InsertPoint.before(op)


def _after(op: Operation):
    from xdsl.rewriter import InsertPoint

    return InsertPoint.after(op)


# --- kernels ------------------------------------------------------------------------------------------------


@dataclass
class Side:
    """One operand of a quantized GEMM as the kernel loads it."""

    raw: SSAValue  # the values loaded (a block argument): float, or quantized
    scale: SSAValue | None = None
    layout: str = "none"  # none | outer (per tensor, row or column: applied to the accumulator) | block (along K)
    block: int = 0
    zero_point: SSAValue | None = None

    @property
    def dtype(self) -> str:
        return info_of(self.raw.type).dtype

    @property
    def mx(self) -> bool:
        return self.scale is not None and info_of(self.scale.type).dtype == "f8E8M0FNU"


class QuantKernelWriter(KernelWriter):
    """A KernelWriter for groups holding quantization ops: the quantized GEMM (prologue:
    dequantize of its operands; matmul_integer) and the activation quantization row kernels."""

    def _check_values(self) -> None:
        allowed = set(TL_TYPES) | set(QUANT_POINTERS)
        infos = [info_of(v.type) for op in self.ops for v in [*op.operands, *op.results]]
        if any(i.dtype not in allowed for i in infos):
            raise Unsupported("an element type without a Triton type")
        self.anchor = next((op for op in self.ops if op.op_name in (Op.matmul, Op.matmul_integer)), None)
        self.prologue = self._prologue()
        ends = [op for op in self.ops if op is not self.anchor and op not in self.prologue]
        ref = max((info_of(r.type) for op in (ends or self.ops) for r in op.results), key=lambda i: i.rank)
        if self.anchor is not None:
            ref = info_of(self.anchor.results[0].type)
        self.ref = ref if ref.rank else TensorInfo((1,), ref.dtype)
        self.lead = tuple(self.ref.shape[:-1])
        self.n = self.ref.shape[-1]
        self.conv_layout = False

    def _prologue(self) -> list[TgOp]:
        if self.anchor is None or self.anchor.op_name != Op.matmul:
            return []
        return [v.owner for v in self.anchor.operands[:2]
                if isinstance(v.owner, TgOp) and v.owner.op_name == Op.dequantize and v.owner in self.ops]

    def _pointer(self, name: str, dtype: str, host: str) -> str:
        return self._param(name, QUANT_POINTERS[dtype], host)

    def write(self) -> KernelCode:
        names = [op.op_name for op in self.ops]
        if names in (["dynamic_quantize"], ["quantize"]):
            return self._quantize_rows_kernel()
        if self.anchor is not None:
            return self._quantized_gemm_kernel()
        if all(op.op_name == Op.dequantize or op.SPEC.category == "elementwise" for op in self.ops):
            return self._rows_kernel()  # integers to float, elementwise (`_op` below)
        raise Unsupported(f"quantization ops ({' '.join(names)}) outside a quantized GEMM")

    # --- tg.dequantize of integers, scales along the last axis: elementwise (the GEMM's accumulator) ---------

    def _op(self, op: TgOp) -> Value:
        if op.op_name != Op.dequantize:
            if op.op_name in QUANTIZATION_OPS:
                raise Unsupported(f"tg.{op.op_name} in a GEMM's epilogue")
            return super()._op(op)
        x, scale, *zp = (self.value(v) for v in op.operands)
        xi, si = info_of(op.operands[0].type), info_of(op.operands[1].type)
        rank = xi.rank
        along_last = si.rank == 0 or (si.rank == 1 and op.attr("axis") % rank == rank - 1) or \
            (si.rank == rank and not op.attr("block_size"))
        if not along_last or si.dtype not in TL_TYPES or xi.dtype not in ("i32", "i8", "ui8"):
            raise Unsupported(f"tg.dequantize of {xi} by {si} (a scale along another axis than the last, or blocks)")
        out = op.result_infos()[0]
        var = self._fresh("t")
        shifted = f"({x.var}.to(tl.float32) - {zp[0].var}.to(tl.float32))" if zp else f"{x.var}.to(tl.float32)"
        self.body.append(f"{var} = ({shifted} * {scale.var}.to(tl.float32)).to({compute_type(out.dtype)})")
        return Value(var, out, x.wide or scale.wide)

    # --- activation quantization: a row kernel ---------------------------------------------------------------

    def _quantize_rows_kernel(self) -> KernelCode:
        """tg.dynamic_quantize (scales from each row, or each block of it) or tg.quantize by a
        per-tensor scale: rows of the last axis, whole, in one program each."""
        (op,) = self.ops
        x = op.operands[0]
        xi = info_of(x.type)
        to = op.attr("to")
        fmt = FORMATS[to]
        if xi.rank == 0 or to in PACKED or dtypes.is_float(to) and to not in FP8_TYPES:
            raise Unsupported(f"quantizing to {to} on the device")
        dynamic = op.op_name == Op.dynamic_quantize
        block = op.attr("block_size")
        if not dynamic and (op.attr("block_size") or info_of(op.operands[1].type).rank != 0):
            raise Unsupported("tg.quantize by a scale other than one per tensor")
        if block and (block & (block - 1) or not isinstance(xi.shape[-1], int)):
            raise Unsupported(f"blocks of {block} (not a power of two)")
        k = self.dim(xi.shape[-1])
        rows = self.dim(numel(xi.shape[:-1])) if xi.rank > 1 else "1"
        q_type = TL_TYPES.get(to) or FP8_TYPES[to]
        self.host += [f"x2 = {self.input_names[x]}.reshape(-1, {k})",
                      f"q2 = torch.empty(({rows}, {k}), device=DEVICE, dtype={QUANT_TORCH[to]})"]
        xs = self._strided("x", xi.dtype, "x2", 2)
        qs = self._strided("q", to, "q2", 2)
        self._int("R", rows)
        self._int("N", k)
        self.body += ["rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
                      "cols = tl.arange(0, BLOCK_N)[None, :]", "row_ok = rows < R", "col_ok = cols < N",
                      f"x = tl.load(x + rows * {xs[0]} + cols * {xs[1]}, mask=row_ok & col_ok, other=0).to(tl.float32)"]
        hi, tiny = _f32(fmt.hi), _f32(MIN_SCALE)
        results = ["q2.reshape(" + self._shape(xi.shape) + ")"]
        if not dynamic:
            self._pointer("scale", info_of(op.operands[1].type).dtype, self.input_names[op.operands[1]])
            self.body.append("s = tl.load(scale).to(tl.float32)")
            self.body.append("y = tl.math.div_rn(x, s)")
        elif block == 0:  # one float32 scale per row: ir.quant.absmax_scale of its largest magnitude
            self.host.append(f"s2 = torch.empty(({rows}, 1), device=DEVICE, dtype=torch.float32)")
            ss = self._strided("s_out", "f32", "s2", 2)
            self.body += ["amax = tl.max(tl.abs(x), axis=1, keep_dims=True)",
                          f"s = tl.where(amax > 0, tl.maximum(tl.math.div_rn(amax, {hi}), {tiny}), 1.0)",
                          "y = tl.math.div_rn(x, s)",
                          f"tl.store(s_out + rows * {ss[0]}, s, mask=row_ok)"]
            results.append(f"s2.reshape({self._shape(op.result_infos()[1].shape)})")
        else:  # one scale per block of the row
            nb = -(-xi.shape[-1] // block)
            mx = not fmt.integer
            self.host.append(f"s2 = torch.empty(({rows}, {nb}), device=DEVICE, "
                             f"dtype={'torch.float8_e8m0fnu' if mx else 'torch.float32'})")
            ss = self._strided("s_out", "f8E8M0FNU" if mx else "f32", "s2.view(torch.uint8)" if mx else "s2", 2)
            self.helpers.add("tlquant")
            self.body += [f"amax = tl.max(tl.reshape(tl.abs(x), [BLOCK_M, BLOCK_N // {block}, {block}]), axis=2)",
                          f"sb = tl.arange(0, BLOCK_N // {block})[None, :]"]
            if mx:
                emax = fmt.max_exponent()
                limit = int(round((fmt.hi / 2.0 ** emax - 1) * 2 ** 23))
                self.body += [f"e = tlquant.mx_exponent(amax, {emax}, {limit})",
                              f"tl.store(s_out + rows * {ss[0]} + sb * {ss[1]}, (e + 127).to(tl.uint8), "
                              f"mask=row_ok & (sb < {nb}))",
                              "inv = tlquant.pow2(-e)"]
                # x / 2^e, exact as NumPy's division (a power of two: one rounding, if any, of the same value)
                scaled = "x * inv_full"
            else:
                self.body += [f"s = tl.where(amax > 0, tl.maximum(tl.math.div_rn(amax, {hi}), {tiny}), 1.0)",
                              f"tl.store(s_out + rows * {ss[0]} + sb * {ss[1]}, s, mask=row_ok & (sb < {nb}))",
                              "inv = s"]
                scaled = "tl.math.div_rn(x, inv_full)"
            self.body += [f"inv_full = tl.reshape(tl.broadcast_to(inv[:, :, None], [BLOCK_M, BLOCK_N // {block}, "
                          f"{block}]), [BLOCK_M, BLOCK_N])", f"y = {scaled}"]
            results.append(f"s2.reshape({self._shape(op.result_infos()[1].shape)})")
        if fmt.integer:
            self.helpers.add("tlmath")
            self.body.append("y = tlmath.rint(y)")
            if len(op.operands) > 2:  # a zero point
                self._pointer("zp", info_of(op.operands[2].type).dtype, self.input_names[op.operands[2]])
                self.body.append("y = y + tl.load(zp).to(tl.float32)")
        # Saturate (ONNX saturate=1 for float formats; integers clip), then convert: round to
        # nearest even for fp8, exact for integers.
        self.body.append(f"y = tl.minimum(tl.maximum(y, {_f32(fmt.lo)}), {hi})")
        self.body.append(f"tl.store(q + rows * {qs[0]} + cols * {qs[1]}, y.to({q_type}), mask=row_ok & col_ok)")
        blocks = {"BLOCK_N": f"max({max(16, block)}, triton.next_power_of_2({k}))",
                  "BLOCK_M": f"max(1, min(64, {ROW_TILE_ELEMENTS} // BLOCK_N))"}  # as group_kernels.py's row kernels
        return self._finish(results, blocks, f"(triton.cdiv({rows}, BLOCK_M),)", [{"num_warps": 4, "num_stages": 1}])

    # --- the quantized GEMM ---------------------------------------------------------------------------------

    def _sides(self) -> tuple[Side, Side]:
        mm = self.anchor
        if mm.op_name == Op.matmul_integer:
            zp = mm.operands[2] if len(mm.operands) > 2 else None
            return Side(mm.operands[0], zero_point=zp), Side(mm.operands[1])
        sides = []
        for i, v in enumerate(mm.operands[:2]):
            deq = v.owner if v.owner in self.prologue else None
            if deq is None:
                sides.append(Side(v))
                continue
            if len(deq.operands) > 2:
                raise Unsupported("a dequantize with a zero point feeding a float matmul")
            q, s = deq.operands[:2]
            qi, si = info_of(q.type), info_of(s.type)
            axis, block = deq.attr("axis") % max(qi.rank, 1), deq.attr("block_size")
            k_axis = qi.rank - 1 if i == 0 else 0
            if block and axis == k_axis:
                layout = "block"
            elif si.rank == 0 or (i == 1 and si.rank == 1 and axis == 1) or \
                    (i == 0 and si.rank == qi.rank and not block and _is_one(si.shape[-1])):
                layout = "outer"
            else:
                raise Unsupported(f"a scale {si} (axis {axis}, blocks of {block}) of a matmul operand {qi}")
            sides.append(Side(q, s, layout, block))
        return sides[0], sides[1]

    def _mode(self, a: Side, b: Side) -> str:
        """integer | raw (8-bit floats, scales outside the K sum) | scaled (tl.dot_scaled) | dequant (the
        weight decoded in registers)."""
        if self.anchor.op_name == Op.matmul_integer:
            if a.dtype not in ("i8", "ui8") or b.dtype != "i8":
                raise Unsupported(f"an integer GEMM of {a.dtype} x {b.dtype}")
            return "integer"
        if a.scale is not None:
            if b.scale is None:
                raise Unsupported("a quantized activation times a float weight")
            if a.layout == b.layout == "outer" and a.dtype == b.dtype and a.dtype in FP8_TYPES:
                return "raw"
            if a.layout == b.layout == "block" and a.mx and b.mx and a.block == b.block == MX_BLOCK \
                    and a.dtype in SCALED_FORMATS and b.dtype in SCALED_FORMATS:
                return "scaled"
            raise Unsupported(f"quantized operands {a.dtype} ({a.layout}) x {b.dtype} ({b.layout})")
        if not dtypes.is_float(a.dtype):
            raise Unsupported(f"a matmul of {a.dtype}")
        if b.scale is None:
            raise Unsupported("a float matmul in a quantized group")
        return "dequant"

    def _quantized_gemm_kernel(self) -> KernelCode:
        mm = self.anchor
        a, b = self._sides()
        mode = self._mode(a, b)
        ai, bi = info_of(mm.operands[0].type), info_of(mm.operands[1].type)
        out = info_of(mm.results[0].type)
        if bi.rank != 2 or ai.rank < 2:
            raise Unsupported("a quantized matmul that is batched on the right")
        if any(v not in self.input_names for v in (a.raw, b.raw)):
            raise Unsupported("a quantized GEMM's operand computed in its group")
        epilogue = [op for op in self.ops if op is not mm and op not in self.prologue]
        self._check_epilogue_within(epilogue, out)
        self.whole_rows = self._whole_rows(epilogue)  # a layer_norm after the GEMM: programs hold whole rows
        k_dim = ai.shape[-1]
        k, m, n = self.dim(k_dim), self.dim(numel(out.shape[:-1])), self.dim(out.shape[-1])
        self._int("M", m)
        self._int("K", k)
        self._int("N", n)
        # 8-bit floats are loaded as their bytes (masked lanes read 0, which Triton's interpreter
        # cannot write as an fp8 constant) and bitcast.
        self.host.append(f"a2 = {self.input_names[a.raw]}.reshape(-1, {k}){_bytes(a.dtype)}")
        a_s = self._strided("a", _byte_type(a.dtype), "a2", 2)
        b_arg = self.input_names[b.raw]
        b_s = self._strided("b", _byte_type(b.dtype), b_arg + _bytes(b.dtype), 2)
        packed = b.dtype in PACKED
        if packed:
            self._int("KP", f"{b_arg}.shape[0]")  # rows of packed bytes: ceil(K / 2)
        acc_type = "tl.int32" if mode == "integer" else "tl.float32"
        body = GEMM_TILE + ["rows = m", f"acc = tl.zeros([BLOCK_M, BLOCK_N], dtype={acc_type})"]
        loop = ["k_ok = (k0 + kk) < K",
                f"a_tile = tl.load(a + m * {a_s[0]} + (k0 + kk)[None, :] * {a_s[1]}, mask=row_ok & k_ok[None, :], "
                f"other=0){_bitcast(a.dtype)}"]
        if packed:
            self.helpers.add("tlquant")
            loop += ["kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)",
                     f"b_tile = tl.load(b + kh[:, None] * {b_s[0]} + cols * {b_s[1]}, "
                     "mask=(kh < KP)[:, None] & col_ok, other=0)"]
        else:
            loop.append(f"b_tile = tl.load(b + (k0 + kk)[:, None] * {b_s[0]} + cols * {b_s[1]}, "
                        f"mask=k_ok[:, None] & col_ok, other=0){_bitcast(b.dtype)}")
        after: list[str] = []
        if mode == "integer":
            loop += self._integer_loop(a, body, after)
        elif mode == "raw":
            loop.append(FP8_DOT)
        elif mode == "scaled":
            loop += self._scaled_loop(a, b, k_dim)
        else:
            loop += self._dequant_loop(a, b, packed)
        self.body += body + ["for k0 in range(0, K, BLOCK_K):"] + [INDENT + ln for ln in loop] + after
        self.values[mm.results[0]] = Value("acc", out, True)
        self.dim_coords = [*self._decompose("rows", self.lead, "c"), "cols"]
        for side in (a, b):  # per-tensor, per-row and per-column scales multiply the accumulator
            if side.layout == "outer":
                s = self.value(side.scale)
                self.body.append(f"acc = acc * {s.var}.to(tl.float32)")
        self.epilogue(epilogue)
        results = self.store_outputs()
        configs = self._gemm_config()
        min_k = MIN_BLOCK_K_SCALED if mode == "scaled" else MIN_BLOCK_K_8BIT if mode in ("integer", "raw") \
            else MIN_BLOCK_MN
        if packed:
            min_k = max(min_k, 2 * MIN_BLOCK_MN)  # BLOCK_K // 2 rows of packed bytes, at least a dot operand's
        min_m = {"scaled": MIN_BLOCK_M_SCALED, "integer": MIN_BLOCK_M_8BIT,
                 "raw": MIN_BLOCK_M_8BIT}.get(mode, MIN_BLOCK_MN)
        blocks = {"BLOCK_N": f"max({MIN_BLOCK_MN}, cfg['BLOCK_N'])", "BLOCK_M": f"max({min_m}, cfg['BLOCK_M'])",
                  "BLOCK_K": f"max({min_k}, cfg['BLOCK_K'])", "GROUP_M": str(GROUP_M)}
        stages = None
        if self.whole_rows:
            # As group_kernels.py's GEMM with a row reduction after it: whole rows per program, BLOCK_M from
            # the accumulator's size, but not below what reaches the low-precision instructions (rows
            # too wide for that went to a kernel of their own: _rows_too_wide).
            blocks["BLOCK_N"] = f"max({MIN_BLOCK_MN}, triton.next_power_of_2({n}))"
            blocks["BLOCK_M"] = (f"max({min(min_m, MIN_BLOCK_M_8BIT)}, "
                                 f"min(cfg['BLOCK_M'], {ROW_TILE_ELEMENTS * 2} // BLOCK_N))")
            if self.shared_memory:
                size = max(dtypes.numpy_dtype(_byte_type(t)).itemsize if t not in PACKED else 1
                           for t in (a.dtype, b.dtype))
                stages = (f"max(1, min(cfg['num_stages'], {self.shared_memory} // "
                          f"((BLOCK_M * BLOCK_K + BLOCK_K * BLOCK_N) * {size})))")
        grid = f"(triton.cdiv({m}, BLOCK_M) * triton.cdiv({n}, BLOCK_N), 1)"
        flops = f"2 * {m} * {k} * {n}"
        return self._finish(results, blocks, grid, configs, flops=flops, stages=stages)

    def _integer_loop(self, a: Side, body: list[str], after: list[str]) -> list[str]:
        """int8 x int8 -> int32. A ui8 operand with zero point z is shifted into int8 (a - 128) and the
        difference made good after the loop: (a - z) w = (a - 128) w + (128 - z) colsum(w)."""
        shift = 128 if a.dtype == "ui8" else 0
        if not shift and a.zero_point is None:
            return [INTEGER_DOT]
        body.append("wsum = tl.zeros([BLOCK_N], dtype=tl.int32)")
        correction = str(shift)
        if a.zero_point is not None:
            self._pointer("zp", info_of(a.zero_point.type).dtype, self.input_names[a.zero_point])
            correction = f"({shift} - tl.load(zp).to(tl.int32))"
        after.append(f"acc = acc + {correction} * wsum[None, :]")
        return [f"a_tile = (a_tile.to(tl.int32) - {shift}).to(tl.int8)",
                INTEGER_DOT,
                "wsum += tl.sum(b_tile.to(tl.int32), axis=0)"]

    def _block_scale(self, side: Side, name: str, transposed: bool) -> tuple[list[str], str]:
        """Lines loading the E8M0 bytes of a K tile's MX blocks: [BLOCK_M, BLOCK_K // 32] for the lhs
        (scales [rows, K/32]); [BLOCK_N, BLOCK_K // 32] for the rhs (scales [K/32, N], read transposed,
        as dot_scaled takes them)."""
        si = info_of(side.scale.type)
        arg = self.input_names[side.scale]
        view = f"{arg}.view(torch.uint8)" + ("" if transposed else f".reshape(-1, {self.dim(si.shape[-1])})")
        ss = self._strided(name, "f8E8M0FNU", view, 2)
        self._int(f"{name.upper()}_BLOCKS", self.dim(si.shape[0] if transposed else si.shape[-1]))
        ok = f"(kb < {name.upper()}_BLOCKS)"  # kb: the K tile's MX blocks, a row ([1, BLOCK_K // 32])
        if transposed:  # cols_t: the tile's columns as a column ([BLOCK_N, 1])
            where, mask = f"cols_t * {ss[1]} + kb * {ss[0]}", f"(cols_t < N) & {ok}"
        else:
            where, mask = f"m * {ss[0]} + kb * {ss[1]}", f"row_ok & {ok}"
        return [f"{name}_tile = tl.load({name} + {where}, mask={mask}, other={E8M0_ONE})"], f"{name}_tile"

    def _scaled_loop(self, a: Side, b: Side, k_dim) -> list[str]:
        if not isinstance(k_dim, int):
            raise Unsupported("MX blocks along a symbolic K")
        lines, a_scale = ([], "None")
        if a.scale is not None:
            lines, a_scale = self._block_scale(a, "sa", transposed=False)
        more, b_scale = self._block_scale(b, "sb", transposed=True)
        fa, fb = SCALED_FORMATS[a.dtype], SCALED_FORMATS[b.dtype]
        coords = [f"kb = (k0 // {MX_BLOCK} + tl.arange(0, BLOCK_K // {MX_BLOCK}))[None, :]",
                  "cols_t = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[:, None]"]
        return coords + lines + more + [f'acc = tl.dot_scaled(a_tile, {a_scale}, "{fa}", b_tile, {b_scale}, "{fb}", acc)']

    def _dequant_loop(self, a: Side, b: Side, packed: bool) -> list[str]:
        """The weight tile decoded to float in registers, scaled by its K blocks' scales (per-column and
        per-tensor scales multiply the accumulator instead), then a dot in the activation's precision."""
        lines = []
        if packed:
            decode = "tlquant.e2m1" if b.dtype == "f4E2M1FN" else "tlquant.int4"
            lines.append(f"w = {decode}(tlquant.unpack_k(b_tile, BLOCK_K, BLOCK_N))")
        else:
            lines.append("w = b_tile.to(tl.float32)")
        if b.layout == "block":
            si = info_of(b.scale.type)
            ss = self._strided("sb", si.dtype, self.input_names[b.scale] + _bytes(si.dtype), 2)
            s = (f"tl.load(sb + ((k0 + kk) // {b.block})[:, None] * {ss[0]} + cols * {ss[1]}, "
                 "mask=k_ok[:, None] & col_ok, other=1)")
            if b.mx:
                self.helpers.add("tlquant")
                s = f"tlquant.e8m0({s})"
            lines.append(f"w = w * {s}.to(tl.float32)")
        precision = dot_precision(a.dtype)
        lines.append(f"acc = tl.dot(a_tile, w.to(a_tile.dtype), acc{precision})")
        return lines


def _byte_type(dtype: str) -> str:
    return "ui8" if dtype in FP8_TYPES else dtype


def _bytes(dtype: str) -> str:
    """Host code viewing a tensor of 8-bit floats (fp8, E8M0) as its bytes."""
    return ".view(torch.uint8)" if dtype in FP8_TYPES or dtype == "f8E8M0FNU" else ""


def _bitcast(dtype: str) -> str:
    return f".to({FP8_TYPES[dtype]}, bitcast=True)" if dtype in FP8_TYPES else ""


def _is_one(d) -> bool:
    return isinstance(d, int) and d == 1


def _f32(x: float) -> str:
    return repr(float(x))


__all__ = ["group_quantized", "QuantKernelWriter"]
