"""One @triton.jit kernel per fused group, and the host function that launches it.

Every kernel computes on 2-D tiles: BLOCK_M rows by BLOCK_N columns of the
group's values seen as [rows, last axis]. What fills the first tile depends on
the group's anchor; the rest of the group (its epilogue) is the same code for all:

    rows      no anchor: loads of the inputs (elementwise chains, row reductions:
              softmax, layer_norm, RMS norm, sums and means over the last axis)
    gemm      tl.dot over K of [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles, one
              accumulator per sibling matmul (horizontal groups share the lhs tile)
    attention flash attention: query blocks against key/value blocks with an
              online softmax; causal blocks past the diagonal are skipped
    conv      2-D convolution as an implicit GEMM: rows are output pixels
              (n, oh, ow), columns output channels, K runs over (c, kh, kw)

How values are addressed: every input of the epilogue is expanded by the host
(torch `expand`, a view) to the group's leading dims, so the kernel reaches any
broadcast with strides (0 where broadcast): the row index is decomposed into
coordinates of the leading dims once, and each load is Σ coordinate × stride.
Floats are computed in fp32 (fp64 stays fp64) and stored in their own type; a
GEMM's operands enter tl.dot in their own type (bf16/fp16 tensor cores) with fp32
accumulation, and fp32 operands use IEEE precision ("ieee"), not TF32, as torch
does by default.

Elementwise ops are rendered from `lowering.TRITON` / `TRITON_INT`; composites
(softmax, layer_norm, gelu) were spelled out by `passes.decompose`'s rules before
(`emit.py`), so no op's semantics is written twice here. A group this module
cannot express raises `Unsupported`; the emitter then runs its ops one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from xdsl.ir import SSAValue

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.escape import py_docstring
from tilegraph.ir.fusion import ANCHORS, row_reshape
from tilegraph.ir.ops import Op, OPS, py_literal
from tilegraph.ir.shapes import Dim, TensorInfo, dims_equal, info_of, numel
from tilegraph.backends.triton.lowering import TRITON, TRITON_INT

INDENT = "    "
# GEMM tile when the tile pass wrote none (a group made by the emitter itself).
DEFAULT_GEMM = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}
# Rows per program of a row kernel: enough to give a warp work when rows are short,
# capped so that a tile stays at most ROW_TILE_ELEMENTS values (registers).
ROW_TILE_ELEMENTS = 4096
# num_stages as the host writes it: the configuration's own, unless a kernel must cut it.
CONFIG_STAGES = "cfg['num_stages']"
# GEMM block rows per group of programs (the L2-friendly launch order of Triton's tutorial 03).
GROUP_M = 8
# The fewest rows a GEMM program holds when its epilogue reduces whole rows (a dot's M). Rows
# wider than 2 * ROW_TILE_ELEMENTS / this are reduced by a kernel of their own: past that the
# accumulator no longer fits in registers and spills, a cliff far steeper than one more pass
# over the GEMM's result.
MIN_WHOLE_ROW_BLOCK_M = 16
# Attention blocks the autotuner also tries beside the tile pass's (BLOCK_M queries, BLOCK_KV
# keys, warps): the scores and both dot operands live in registers, so the best size depends
# on the head dim and how tl.dot multiplies (FMAs replicate operands across threads; tensor
# cores take larger tiles).
ATTENTION_CONFIGS = ((64, 32, 4), (32, 32, 4), (64, 64, 4), (128, 64, 8), (32, 64, 2), (128, 32, 4), (128, 128, 8))
LOG2E = 1.4426950408889634  # log2(e): the attention kernel's exponentials are exp2


def rows_fit(block_m: int, width) -> bool:
    """Whether `block_m` whole rows of `width` (a GEMM's output, reduced after it) fit one program's
    accumulator: at most 2 x ROW_TILE_ELEMENTS fp32 values (more spill). A symbolic width fits
    (the host picks BLOCK_M from the bound width)."""
    return not isinstance(width, int) or block_m * triton_next_power_of_2(width) <= 2 * ROW_TILE_ELEMENTS


def triton_next_power_of_2(n: int) -> int:
    """triton.next_power_of_2, here where the emitter decides (Triton's own is for host code)."""
    return 1 << max(0, n - 1).bit_length()


def f32_dot_precision(backend: str, arch: int | str) -> str:
    """How tl.dot multiplies fp32 operands on a GPU: "tf32x3" where NVIDIA's tensor cores take
    TF32 (sm_80 on), "ieee" (fp32 FMAs) elsewhere: AMD's Triton has no tf32x3.

    tf32x3 splits each operand into two TF32 values (22 of fp32's 24 mantissa bits) and adds
    three tensor-core products in fp32: about fp32's accuracy at several times the FMA rate.
    The emitted kernels read the choice from their module's F32_DOT, which the module's build
    sets for its device (and the ahead-of-time build for each target), so one source serves
    both vendors."""
    return "tf32x3" if backend == "cuda" and isinstance(arch, int) and arch >= 80 else "ieee"


def dot_precision(dtype: str) -> str:
    """tl.dot's input_precision argument for operands of `dtype` ('' where Triton's default is right)."""
    if dtype == "f32":
        return ", input_precision=F32_DOT"
    return ', input_precision="ieee"' if dtype == "f64" else ""

TL_TYPES = {"f64": "tl.float64", "f32": "tl.float32", "f16": "tl.float16", "bf16": "tl.bfloat16",
            "i1": "tl.int1", "i8": "tl.int8", "i16": "tl.int16", "i32": "tl.int32", "i64": "tl.int64",
            "ui8": "tl.uint8", "ui16": "tl.uint16", "ui32": "tl.uint32", "ui64": "tl.uint64"}
# Triton's signature spelling of a pointer to each element type (for ahead-of-time builds).
POINTER_TYPES = {"f64": "*fp64", "f32": "*fp32", "f16": "*fp16", "bf16": "*bf16", "i1": "*i1", "i8": "*i8",
                 "i16": "*i16", "i32": "*i32", "i64": "*i64", "ui8": "*u8", "ui16": "*u16", "ui32": "*u32",
                 "ui64": "*u64"}
# How a row kernel does each reduction kind of the op table over the last axis:
# (tl call, neutral element for padding).
ROW_REDUCTIONS = {"sum": ("tl.sum", "0"), "mean": ("tl.sum", "0"), "max": ("tl.max", "float('-inf')"),
                  "min": ("tl.min", "float('inf')"), "prod": ("tl.reduce", "1")}
# Ops over an axis (or axes) that a row kernel computes once the axes are moved last:
# the op table's reductions, and the arg-reductions and scans.
AXIS_OPS = {name for name, spec in OPS.items() if spec.reduction} | {"argmax", "argmin", "cumsum", "cumprod"}


# A GEMM program's output tile: programs walk the output in groups of GROUP_M block rows, column
# by column, so the lhs blocks of a group stay in L2 while its columns are done (Triton's tutorial 03).
GEMM_TILE = ["pid = tl.program_id(0)", "num_m = tl.cdiv(M, BLOCK_M)", "in_group = GROUP_M * tl.cdiv(N, BLOCK_N)",
             "first_m = (pid // in_group) * GROUP_M", "group_m = tl.minimum(num_m - first_m, GROUP_M)",
             "pid_m = first_m + (pid % in_group) % group_m", "pid_n = (pid % in_group) // group_m",
             "m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
             "cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]",
             "kk = tl.arange(0, BLOCK_K)", "row_ok = m < M", "col_ok = cols < N"]


class Unsupported(Exception):
    """This module cannot write the group as one kernel (the emitter splits it)."""


class RowsTooWide(Unsupported):
    """A GEMM's epilogue reduces whole rows wider than a program's accumulator can hold: the
    emitter writes the GEMM (with its elementwise epilogue) and the row ops as two kernels."""


def needs_whole_rows(op: TgOp) -> bool:
    """Whether `op` needs a program to hold whole rows (reductions and scans over the last axis)."""
    return bool(op.SPEC.reduction) or op.op_name in (Op.argmax, Op.argmin, Op.cumsum, Op.cumprod)


def compute_type(dtype: str) -> str:
    """The Triton type a value is computed in: fp32 for f32/f16/bf16, else its own."""
    if dtype in ("f16", "bf16", "f32"):
        return "tl.float32"
    if dtype not in TL_TYPES:
        raise Unsupported(f"element type {dtype} has no Triton type")
    return TL_TYPES[dtype]


@dataclass
class Param:
    name: str
    signature: str  # its type in the kernel's signature: "*fp32", "i32", "fp32", "constexpr"


@dataclass
class Value:
    """A value inside the kernel: its variable and whether its last axis is the tile's columns."""

    var: str
    info: TensorInfo
    wide: bool  # spans the columns (last dim N); else one value per row ([BLOCK_M, 1] or broadcast)


@dataclass
class KernelCode:
    """What the emitter needs: the kernel's source and how to launch it."""

    name: str
    kernel: list[str]
    host: list[str]  # the host function's body (parameters: the inputs, then the symbols)
    params: list[Param]
    configs: list[dict]
    flops: str = "0"
    blocks: dict[str, str] = field(default_factory=dict)  # constexpr -> host expression (of cfg and dims)
    host_args: list[str] = field(default_factory=list)  # each non-constexpr parameter's host expression
    stages: str = CONFIG_STAGES  # num_stages, as a host expression
    helpers: set[str] = field(default_factory=set)  # module-level @triton.jit helpers it calls


class KernelWriter:
    """Writes the kernel and host function of one group.

    `ops` are the group's ops in order (composites already decomposed); `inputs`
    the values it reads from outside (block arguments), `outputs` the values it
    stores; `dims` renders a shape dim as host Python (symbols bound by the caller).
    """

    def __init__(self, name: str, kind: str, ops: Sequence[TgOp], inputs: Sequence[SSAValue],
                 outputs: Sequence[SSAValue], tile: dict, dims: Callable[[Dim], str],
                 shared_memory: int = 0, tf32: bool = False):
        self.name, self.kind = name, kind
        self.shared_memory = shared_memory  # bytes a program may use (0: no limit known)
        self.tf32 = tf32  # the GPU has TF32 tensor cores: fp32 GEMMs may take tf32x3 (f32_dot_precision)
        self.ops, self.inputs, self.outputs = list(ops), list(inputs), list(outputs)
        self.tile, self.dim = tile, dims
        self.params: list[Param] = []
        self.body: list[str] = []
        self.host: list[str] = []
        self.host_args: list[str] = []  # the kernel's arguments, as host expressions
        self.values: dict[SSAValue, Value] = {}
        self.input_names = {v: f"in{i}" for i, v in enumerate(self.inputs)}
        self.helpers: set[str] = set()
        self._counter = 0
        self.anchors = [op for op in self.ops if op.op_name in ANCHORS]
        self._check_values()

    # --- the group's geometry ---------------------------------------------------

    def _check_values(self) -> None:
        infos = [info_of(v.type) for op in self.ops for v in [*op.operands, *op.results]]
        if any(i.dtype not in TL_TYPES for i in infos):
            raise Unsupported("an element type without a Triton type")
        ref = max((info_of(r.type) for op in self.ops for r in op.results), key=lambda i: i.rank)
        if ref.rank == 0:
            ref = TensorInfo((1,), ref.dtype)
        self.ref = ref
        self.lead: tuple[Dim, ...] = tuple(ref.shape[:-1])
        # The tile's columns: the one last dim (other than 1) of the non-anchor values.
        epilogue = [op for op in self.ops if op not in self.anchors and op.op_name != Op.gather]
        lasts = [i.shape[-1] for op in epilogue for i in (info_of(v.type) for v in [*op.operands, *op.results])
                 if i.rank and not _is_one(i.shape[-1])]
        if any(not dims_equal(d, lasts[0]) for d in lasts):
            raise Unsupported(f"values with different last dims {sorted(set(map(str, lasts)))}")
        self.n: Dim = lasts[0] if lasts else ref.shape[-1]
        self.conv_layout = False  # conv tiles: rows are (n, oh, ow), columns the channels

    def _fresh(self, base: str) -> str:
        self._counter += 1
        return f"{base}{self._counter}"

    def _param(self, name: str, signature: str, host: str) -> str:
        self.params.append(Param(name, signature))
        self.host_args.append(host)
        return name

    def _pointer(self, name: str, dtype: str, host: str) -> str:
        return self._param(name, POINTER_TYPES[dtype], host)

    def _int(self, name: str, host: str) -> str:
        return self._param(name, "i32", host)

    # --- coordinates -----------------------------------------------------------

    def _decompose(self, flat: str, sizes: Sequence[Dim], prefix: str) -> list[str]:
        """Variables holding the coordinates of `flat` (a row-major index) over dims `sizes`."""
        size_params = [self._int(f"{prefix.upper()}{i}", self.dim(d)) for i, d in enumerate(sizes)]
        coords = [f"{prefix}{i}" for i in range(len(sizes))]
        rest = flat
        for i in reversed(range(len(sizes))):
            if i == 0:
                self.body.append(f"{coords[0]} = {rest}")
            else:
                self.body.append(f"{coords[i]} = {rest} % {size_params[i]}")
                self.body.append(f"{prefix}_rest{i} = {rest} // {size_params[i]}")
                rest = f"{prefix}_rest{i}"
        return coords

    def _strided(self, name: str, dtype: str, host_view: str, rank: int) -> list[str]:
        """Pointer and stride params of a tensor the host passes as `host_view` (rank dims)."""
        self._pointer(name, dtype, host_view)
        return [self._int(f"{name}_s{d}", f"{host_view}.stride({d})") for d in range(rank)]

    def _shape(self, shape: Sequence[Dim]) -> str:
        return "(" + ", ".join(self.dim(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"

    def _tile_shape(self, info: TensorInfo) -> list[Dim]:
        """The shape a value has in the tile's frame: the full result shape for conv tiles,
        else the group's leading dims and its own last dim."""
        if self.conv_layout:
            return list(self.ref.shape)
        return [*self.lead, info.shape[-1] if info.rank else 1]

    def _host_view(self, v: SSAValue) -> str:
        """Host code for outside value v seen in the tile's frame (a view: reshape of regrouped
        rows, expand of broadcast dims)."""
        info = info_of(v.type)
        arg = self.input_names[v]
        shape = self._tile_shape(info)
        regrouped = info.rank != len(shape) or not all(dims_equal(a, b) for a, b in zip(info.shape, shape))
        if info.rank and regrouped and dims_equal(numel(info.shape[:-1]), numel(shape[:-1])):
            # A row reshape: the same rows, grouped differently. At the same rank too: a moved
            # size-1 dim ((1, 2, N) as (2, 1, N)) is no broadcast that expand could make.
            arg = f"{arg}.reshape({self._shape(shape)})"
        return f"{arg}.expand({self._shape(shape)})"

    def _offset(self, strides: Sequence[str], wide: bool) -> str:
        """Σ coordinate × stride over the tile's frame (a row value skips the columns)."""
        terms = [f"{c} * {s}" for c, s in zip(self.dim_coords, strides) if wide or c != "cols"]
        if all(c == "cols" for c in self.dim_coords):
            # No leading dims (a rank-1 frame, R = 1): the pointers still span the tile's BLOCK_M
            # rows, which the row mask selects from.
            terms.insert(0, "rows * 0")
        return " + ".join(terms)

    # --- the epilogue: every non-anchor op on tiles --------------------------------

    def load_input(self, v: SSAValue) -> Value:
        """Load an outside value as a tile (columns masked to its own last dim)."""
        info = info_of(v.type)
        view = self._fresh("view")
        self.host.append(f"{view} = {self._host_view(v)}")
        name = self.input_names[v]
        strides = self._strided(name, info.dtype, view, len(self._tile_shape(info)))
        wide = self.conv_layout or (info.rank > 0 and not _is_one(info.shape[-1]))
        var = self._fresh("x")
        mask = "row_ok & col_ok" if wide else "row_ok"
        self.body.append(f"{var} = tl.load({name} + {self._offset(strides, wide)}, mask={mask}, other=0)"
                         f"{_upcast(info.dtype)}")
        return Value(var, info, wide)

    def value(self, v: SSAValue) -> Value:
        if v not in self.values:
            if v not in self.input_names:
                raise Unsupported(f"a value used before the group computes it ({v.owner})")
            self.values[v] = self.load_input(v)
        return self.values[v]

    def epilogue(self, ops: Sequence[TgOp]) -> None:
        for op in ops:
            self.values[op.results[0]] = self._op(op)

    def _op(self, op: TgOp) -> Value:
        out = op.result_infos()[0]
        name = op.op_name
        if name == Op.constant:
            return self._constant(op, out)
        if name == Op.reshape and row_reshape(op):
            src = self.value(op.operands[0])
            return Value(src.var, out, src.wide)
        if name == Op.broadcast and dims_equal(numel(info_of(op.operands[0].type).shape), numel(out.shape)):
            src = self.value(op.operands[0])
            return Value(src.var, out, src.wide)
        args = [self.value(v) for v in op.operands]
        var = self._fresh("t")
        if op.SPEC.reduction:
            return self._row_reduction(op, args[0], out, var)
        if name in (Op.argmax, Op.argmin):
            return self._arg_reduction(op, args[0], out, var)
        if name in (Op.cumsum, Op.cumprod):
            return self._scan(op, args[0], out, var)
        if name == Op.trilu:
            x = args[0]
            keep = f"(cols - c{len(self.lead) - 1}) {'>=' if op.attr('upper') else '<='} {op.attr('k')}"
            if len(self.lead) < 1 or not x.wide:
                raise Unsupported("trilu needs a matrix")
            self.body.append(f"{var} = tl.where({keep}, {x.var}, 0)")
            return Value(var, out, True)
        if op.SPEC.category != "elementwise":
            raise Unsupported(f"tg.{name} in a row kernel")
        operand_dtype = info_of(op.operands[0].type).dtype
        table = TRITON_INT if not dtypes.is_float(operand_dtype) and name in TRITON_INT else TRITON
        if name not in table:
            raise Unsupported(f"tg.{name} has no Triton template")
        env = {n: a.var for n, a in zip(op.SPEC.operand_names, args)}  # variables: no parentheses needed
        attrs = {k: py_literal(v) for k, v in op.py_attrs().items()}
        expr = table[name].format(**env, **attrs, dtype=compute_type(out.dtype), storage=TL_TYPES[out.dtype])
        if "tlmath." in expr:
            self.helpers.add("tlmath")
        self.body.append(f"{var} = {expr}")
        return Value(var, out, any(a.wide for a in args))

    def _constant(self, op: TgOp, out: TensorInfo) -> Value:
        import numpy as np

        array = np.asarray(op.attr("value"))
        if array.size != 1:
            raise Unsupported("a constant array inside a group")  # the emitter passes these as inputs
        scalar = array.reshape(()).item()
        literal = py_literal(float(scalar)) if dtypes.is_float(out.dtype) else repr(scalar)
        literal = {"inf": "float('inf')", "-inf": "float('-inf')", "nan": "float('nan')"}.get(literal, literal)
        var = self._fresh("k")
        self.body.append(f"{var} = tl.full([1, 1], {literal}, {compute_type(out.dtype)})")
        return Value(var, out, False)

    def _row_reduction(self, op: TgOp, x: Value, out: TensorInfo, var: str) -> Value:
        rank = info_of(op.operands[0].type).rank
        if [a % rank for a in op.attr("axes")] != [rank - 1] or not op.attr("keepdims"):
            raise Unsupported(f"tg.{op.op_name} over axes {op.attr('axes')} in a row kernel")
        if not self.whole_rows:
            raise Unsupported("a row reduction in a tile that does not hold whole rows")
        kind = op.SPEC.reduction
        fn, neutral = ROW_REDUCTIONS[kind]
        ct = compute_type(out.dtype)
        n = "N" if x.wide else "1"
        masked = f"tl.where(row_ok & (cols < {n}), {x.var}, {neutral if dtypes.is_float(out.dtype) else _int_neutral(kind, out.dtype)})"
        if kind == "prod":
            self.helpers.add("_multiply")
            self.body.append(f"{var} = tl.reduce({masked}, 1, _multiply, keep_dims=True)")
        else:
            self.body.append(f"{var} = {fn}({masked}, axis=1, keep_dims=True)")
        if kind == "mean":
            self.body.append(f"{var} = {var} / {n}")
        if kind in ("max", "min") and dtypes.is_float(out.dtype):
            # np.max/np.min propagate NaN; tl.max/tl.min need not.
            self.body.append(f"{var} = tl.where(tl.max(tl.where(row_ok & (cols < {n}), ({x.var} != {x.var}).to(tl.int32), 0), "
                             f"axis=1, keep_dims=True) > 0, float('nan'), {var})")
        self.body.append(f"{var} = {var}.to({ct})")
        return Value(var, out, False)

    def _arg_reduction(self, op: TgOp, x: Value, out: TensorInfo, var: str) -> Value:
        rank = info_of(op.operands[0].type).rank
        if op.attr("axis") % rank != rank - 1 or not op.attr("keepdims") or not self.whole_rows:
            raise Unsupported(f"tg.{op.op_name} over a non-last axis in a row kernel")
        neutral = "float('-inf')" if op.op_name == Op.argmax else "float('inf')"
        fn = "tl.argmax" if op.op_name == Op.argmax else "tl.argmin"
        valid = f"tl.where(cols < N, {x.var}, {neutral})"
        if op.attr("select_last_index"):
            # tl.argmax(tie_break_left=False) breaks ties either way (its fast path), not to the
            # last index: the last column holding the extreme value.
            extreme = "tl.max" if op.op_name == Op.argmax else "tl.min"
            self.body.append(f"{var} = {valid}")
            self.body.append(f"{var} = tl.max(tl.where({var} == {extreme}({var}, axis=1, keep_dims=True), cols, -1), "
                             f"axis=1, keep_dims=True).to({TL_TYPES[out.dtype]})")
        else:
            self.body.append(f"{var} = {fn}({valid}, axis=1, tie_break_left=True, keep_dims=True).to({TL_TYPES[out.dtype]})")
        return Value(var, out, False)

    def _scan(self, op: TgOp, x: Value, out: TensorInfo, var: str) -> Value:
        rank = info_of(op.operands[0].type).rank
        if rank == 0 and not (op.op_name == Op.cumprod and op.attr("exclusive")):
            # a scalar's scan is the scalar itself (nothing before it: 0 for an exclusive sum)
            self.body.append(f"{var} = {x.var} - {x.var}" if op.attr("exclusive") else f"{var} = {x.var}")
            return Value(var, out, True)
        if rank == 0 or op.attr("axis") % rank != rank - 1 or not self.whole_rows:
            raise Unsupported(f"tg.{op.op_name} over a non-last axis in a row kernel")
        if op.op_name == Op.cumprod and op.attr("exclusive"):
            raise Unsupported("exclusive cumprod")
        reverse = bool(op.attr("reverse"))
        neutral = "0" if op.op_name == Op.cumsum else "1"
        masked = f"tl.where(cols < N, {x.var}, {neutral})"
        if op.op_name == Op.cumsum:
            self.body.append(f"{var} = tl.cumsum({masked}, axis=1, reverse={reverse})")
            if op.attr("exclusive"):
                self.body.append(f"{var} = {var} - {x.var}")
        else:
            self.helpers.add("_multiply")
            self.body.append(f"{var} = tl.associative_scan({masked}, 1, _multiply, reverse={reverse})")
        return Value(var, out, True)

    def store_outputs(self) -> list[str]:
        """Store every output tile; returns the host expressions of the results (in their types)."""
        results = []
        for i, v in enumerate(self.outputs):
            val = self.value(v)
            info = info_of(v.type)
            shape = self._tile_shape(info)
            buf = f"out{i}"
            self.host.append(f"{buf} = torch.empty({self._shape(shape)}, device=DEVICE, "
                             f"dtype={TORCH_TYPES[info.dtype]})")
            strides = self._strided(buf, info.dtype, buf, len(shape))
            # A full tile (an accumulator of N = 1 columns too) is stored masked to its columns.
            wide = self.conv_layout or not _is_one(shape[-1]) or val.wide
            # A tile of rows x columns, or one value per row ([BLOCK_M, 1]) for a result whose last dim is 1.
            tile = f"tl.broadcast_to({val.var}, [BLOCK_M, {'BLOCK_N' if wide else 1}])"
            self.body.append(f"tl.store({buf} + {self._offset(strides, wide)}, {tile}.to({TL_TYPES[info.dtype]}), "
                             f"mask=row_ok{' & col_ok' if wide else ''})")
            same = len(shape) == info.rank and all(dims_equal(a, b) for a, b in zip(shape, info.shape))
            results.append(buf if same else f"{buf}.reshape({self._shape(info.shape)})")
        return results

    # --- kernels ---------------------------------------------------------------

    def write(self) -> KernelCode:
        kinds = {op.op_name for op in self.anchors}
        if [op.op_name for op in self.ops] == [Op.gather]:
            return self._gather_kernel()
        if not kinds:
            return self._rows_kernel()
        if kinds == {Op.matmul}:
            return self._gemm_kernel()
        if kinds == {Op.attention} and len(self.anchors) == 1:
            return self._attention_kernel()
        if kinds == {Op.conv} and len(self.anchors) == 1:
            return self._conv_kernel()
        raise Unsupported(f"a group anchored on {', '.join(sorted(kinds))}")

    def _check_epilogue_within(self, epilogue: Sequence[TgOp], out: TensorInfo) -> None:
        """An anchored kernel's tiles cover the anchor's result: every epilogue value must have
        its rows (row reshapes allowed) and its row width or one value per row."""
        rows = numel(out.shape[:-1])
        for op in epilogue:
            if op.op_name == Op.constant:
                continue  # a scalar, inline (the emitter takes arrays out of groups)
            for r in op.result_infos():
                if not r.rank or not dims_equal(numel(r.shape[:-1]), rows) or not (
                        _is_one(r.shape[-1]) or dims_equal(r.shape[-1], out.shape[-1])):
                    raise Unsupported(f"tg.{op.op_name} broadcasts the {self.kind} result {out} to {r}")

    def _whole_rows(self, ops: Sequence[TgOp]) -> bool:
        """Whether the ops need a program to hold whole rows (reductions and scans over the last axis)."""
        return any(needs_whole_rows(op) for op in ops)

    def _rows_kernel(self) -> KernelCode:
        self.whole_rows = self._whole_rows(self.ops)
        n = self.dim(self.n)
        rows = self.dim(numel(self.lead)) if self.lead else "1"
        if self.whole_rows:
            blocks = {"BLOCK_N": f"max(16, triton.next_power_of_2({n}))"}
            grid_n = "1"
        else:
            blocks = {"BLOCK_N": f"max(16, min(1024, triton.next_power_of_2({n})))"}
            grid_n = f"triton.cdiv({n}, BLOCK_N)"
        blocks["BLOCK_M"] = f"max(1, min(64, {ROW_TILE_ELEMENTS} // BLOCK_N))"
        self._int("R", rows)
        self._int("N", n)
        self.body += ["rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
                      "cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]",
                      "row_ok = rows < R", "col_ok = cols < N"]
        self.dim_coords = [*self._decompose("rows", self.lead, "c"), "cols"]
        self.epilogue(self.ops)
        results = self.store_outputs()
        warps = int(self.tile.get("num_warps", 4))
        return self._finish(results, blocks, f"(triton.cdiv({rows}, BLOCK_M), {grid_n})",
                            [{"num_warps": warps, "num_stages": 1}])

    def _gemm_config(self) -> list[dict]:
        t = self.tile
        if "block_m" not in t:
            return [dict(DEFAULT_GEMM)]
        first = {"BLOCK_M": t["block_m"], "BLOCK_N": t["block_n"], "BLOCK_K": t["block_k"],
                 "num_warps": t["num_warps"], "num_stages": t["num_stages"]}
        return [first] + [c for c in t.get("configs", []) if c != first]

    def _gemm_precision(self, dtype: str, configs: list[dict]) -> tuple[str, list[dict], dict[str, str]]:
        """tl.dot's precision argument for a GEMM on `dtype` operands, its configurations, and
        the constexpr that carries the choice (none or TF32X3).

        On a GPU with TF32 tensor cores an fp32 GEMM's configurations come twice, with fp32 FMAs
        (TF32X3=0, first: the default without autotuning) and with the module's F32_DOT (tf32x3
        there): which is faster depends on the GEMM and its epilogue, so the autotuner measures."""
        if dtype != "f32" or not self.tf32:
            return dot_precision(dtype), configs, {}
        return (', input_precision=(F32_DOT if TF32X3 else "ieee")',
                [c | {"TF32X3": 0} for c in configs] + [c | {"TF32X3": 1} for c in configs],
                {"TF32X3": "cfg['TF32X3']"})

    def _gemm_kernel(self) -> KernelCode:
        matmuls = self.anchors
        lhs = matmuls[0].operands[0]
        if any(op.operands[0] is not lhs for op in matmuls):
            raise Unsupported("sibling matmuls with different left operands")
        a_info = info_of(lhs.type)
        b_infos = [info_of(op.operands[1].type) for op in matmuls]
        out = info_of(matmuls[0].results[0].type)
        if a_info.rank < 2 or any(b.rank < 2 for b in b_infos) or not dtypes.is_float(a_info.dtype):
            raise Unsupported("matmul of vectors or integers")
        if any(self.values.get(op.operands[1]) for op in matmuls) or any(
                op.operands[i] not in self.input_names for op in matmuls for i in (0, 1)):
            raise Unsupported("a matmul reading a value computed in its own group (a prologue)")
        flat = all(b.rank == 2 for b in b_infos)
        if len(matmuls) > 1 and (not flat or any(not dims_equal(b.shape[-1], b_infos[0].shape[-1]) for b in b_infos)):
            raise Unsupported("sibling matmuls that are batched or of different widths")
        epilogue = [op for op in self.ops if op not in matmuls]
        self._check_epilogue_within(epilogue, out)
        self.whole_rows = self._whole_rows(epilogue)
        width = out.shape[-1]
        if self.whole_rows and not rows_fit(MIN_WHOLE_ROW_BLOCK_M, width):
            raise RowsTooWide(f"rows of {width} reduced after a GEMM: an accumulator of "
                              f"{MIN_WHOLE_ROW_BLOCK_M} x {triton_next_power_of_2(width)} fp32 values per program")
        k_dim, m_dim = a_info.shape[-1], out.shape[-2]
        batch = out.shape[:-2]
        self.n = out.shape[-1]
        k, m, n = self.dim(k_dim), self.dim(numel(out.shape[:-1]) if flat else m_dim), self.dim(self.n)
        self._int("M", m)
        self._int("K", k)
        self._int("N", n)
        # Operands: the lhs as [rows, K] (flat) or [*batch, M, K]; each rhs as [K, N] or [*batch, K, N].
        a_view = self._fresh("view")
        if flat:
            self.host.append(f"{a_view} = {self.input_names[lhs]}.reshape(-1, {k})")
        else:
            self.host.append(f"{a_view} = {self.input_names[lhs]}.expand({self._shape([*batch, m_dim, k_dim])})")
        a_strides = self._strided("a", a_info.dtype, a_view, 2 if flat else len(batch) + 2)
        b_strides = []
        for i, (op, b) in enumerate(zip(matmuls, b_infos)):
            view = self._fresh("view")
            arg = self.input_names[op.operands[1]]
            self.host.append(f"{view} = {arg}" if flat else
                             f"{view} = {arg}.expand({self._shape([*batch, b.shape[-2], b.shape[-1]])})")
            b_strides.append(self._strided(f"b{i}", b.dtype, view, 2 if flat else len(batch) + 2))
        self.body += GEMM_TILE
        a_base, b_base = "0", ["0"] * len(matmuls)
        if flat:
            self.body.append("rows = m")
        else:
            self.body.append("pid_b = tl.program_id(1)")
            bc = self._decompose("pid_b", batch, "bat")
            a_base = " + ".join(f"{c} * {s}" for c, s in zip(bc, a_strides)) or "0"
            b_base = [" + ".join(f"{c} * {s}" for c, s in zip(bc, bs)) or "0" for bs in b_strides]
            self.body.append("rows = pid_b * M + m")
        precision, configs, precision_block = self._gemm_precision(a_info.dtype, self._gemm_config())
        self.body.append(f"a_ptrs = a + {a_base} + m * {a_strides[-2]} + kk[None, :] * {a_strides[-1]}")
        for i in range(len(matmuls)):
            self.body.append(f"acc{i} = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
        self.body.append("for k0 in range(0, K, BLOCK_K):")
        loop = ["k_ok = (k0 + kk) < K",
                f"a_tile = tl.load(a_ptrs + k0 * {a_strides[-1]}, mask=row_ok & k_ok[None, :], other=0)"]
        for i, bs in enumerate(b_strides):
            loop.append(f"b_tile = tl.load(b{i} + {b_base[i]} + (k0 + kk)[:, None] * {bs[-2]} + cols * {bs[-1]}, "
                        "mask=k_ok[:, None] & col_ok, other=0)")
            loop.append(f"acc{i} = tl.dot(a_tile, b_tile, acc{i}{precision})")
        self.body += [INDENT + line for line in loop]
        for i, op in enumerate(matmuls):
            self.values[op.results[0]] = Value(f"acc{i}", info_of(op.results[0].type), True)
        self.dim_coords = [*self._decompose("rows", self.lead, "c"), "cols"]
        self.epilogue(epilogue)
        results = self.store_outputs()
        blocks = {"BLOCK_N": (f"max(16, triton.next_power_of_2({n}))" if self.whole_rows else "cfg['BLOCK_N']"),
                  "BLOCK_M": "cfg['BLOCK_M']", "BLOCK_K": "cfg['BLOCK_K']", "GROUP_M": str(GROUP_M), **precision_block}
        stages = None
        if self.whole_rows:
            # A row reduction in the epilogue: one program holds whole rows, so the accumulator
            # (at most 2 x ROW_TILE_ELEMENTS fp32 values) sets BLOCK_M, and the pipeline's stages
            # of operand tiles must still fit the shared memory a program may use.
            blocks["BLOCK_M"] = f"max({MIN_WHOLE_ROW_BLOCK_M}, min(cfg['BLOCK_M'], {ROW_TILE_ELEMENTS * 2} // BLOCK_N))"
            blocks["BLOCK_K"] = "min(cfg['BLOCK_K'], 32)"
            if self.shared_memory:
                size = dtypes.numpy_dtype(a_info.dtype).itemsize
                stages = (f"max(1, min(cfg['num_stages'], {self.shared_memory} // "
                          f"((BLOCK_M * BLOCK_K + BLOCK_K * BLOCK_N) * {size})))")
        grid_batch = self.dim(numel(batch)) if not flat and batch else "1"
        grid = f"(triton.cdiv({m}, BLOCK_M) * triton.cdiv({n}, BLOCK_N), {grid_batch})"
        flops = f"{len(matmuls)} * 2 * {self.dim(numel(out.shape[:-1]))} * {k} * {n}"
        return self._finish(results, blocks, grid, configs, flops=flops, stages=stages)

    def _attention_kernel(self) -> KernelCode:
        (op,) = self.anchors
        q, kv, v, *mask = op.operands
        if any(x not in self.input_names for x in op.operands):
            raise Unsupported("attention reading a value computed in its own group")
        qi, ki, vi = (info_of(x.type) for x in (q, kv, v))
        out = info_of(op.results[0].type)
        batch = out.shape[:-2]
        lq, lk, dh, dv = qi.shape[-2], ki.shape[-2], qi.shape[-1], vi.shape[-1]
        epilogue = [o for o in self.ops if o is not op]
        self._check_epilogue_within(epilogue, out)
        self.whole_rows = True  # a query block holds whole output rows (all of DV)
        for name in ("LQ", "LK", "DH", "DV"):
            self._int(name, self.dim({"LQ": lq, "LK": lk, "DH": dh, "DV": dv}[name]))
        strides = {}
        for name, x, last2 in (("q", q, (lq, dh)), ("k", kv, (lk, dh)), ("v", v, (lk, dv)),
                               *((("mask", mask[0], (lq, lk)),) if mask else ())):
            view = self._fresh("view")
            self.host.append(f"{view} = {self.input_names[x]}.expand({self._shape([*batch, *last2])})")
            strides[name] = self._strided(name, info_of(x.type).dtype, view, len(batch) + 2)
        self.body += ["pid_q = tl.program_id(0)", "pid_b = tl.program_id(1)"]
        bc = self._decompose("pid_b", batch, "bat")
        base = {n: " + ".join(f"{c} * {s}" for c, s in zip(bc, st)) or "0" for n, st in strides.items()}
        precision = dot_precision(qi.dtype)
        qs, ks, vs = strides["q"], strides["k"], strides["v"]
        self.body += [
            "m = pid_q * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
            "d_row = tl.arange(0, BLOCK_D)[None, :]",
            "d_col = tl.arange(0, BLOCK_D)[:, None]",
            "cols = tl.arange(0, BLOCK_N)[None, :]",
            "row_ok = m < LQ", "col_ok = cols < DV",
            "N = DV",  # the row width the epilogue's reductions mask to (as in the other kernels)
            f"q_tile = tl.load(q + {base['q']} + m * {qs[-2]} + d_row * {qs[-1]}, mask=row_ok & (d_row < DH), other=0)",
            "m_i = tl.full([BLOCK_M, 1], float('-inf'), tl.float32)",
            "l_i = tl.zeros([BLOCK_M, 1], tl.float32)",
            "acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)",
        ]
        scale = py_literal(float(op.attr("scale")))
        causal = bool(op.attr("causal"))
        if causal:
            # Keys past the diagonal (offset LK - LQ, as np.tril(k=LK-LQ)) are never read, and
            # only the blocks the diagonal crosses compare keys with queries: every key before
            # `diagonal` is on or below it for all of this block's queries.
            self.body += ["hi = tl.minimum(LK, (pid_q + 1) * BLOCK_M + LK - LQ)",
                          "diagonal = tl.minimum(tl.maximum(pid_q * BLOCK_M + LK - LQ, 0) // BLOCK_KV * BLOCK_KV, hi)"]
            loops = [("0", "diagonal", False), ("diagonal", "hi", True)]
        else:
            loops = [("0", "LK", True)]
        for lo, hi, edge in loops:
            self.body.append(f"for start in range({lo}, {hi}, BLOCK_KV):")
            loop = [
                "j = start + tl.arange(0, BLOCK_KV)[None, :]",
                f"k_tile = tl.load(k + {base['k']} + j * {ks[-2]} + d_col * {ks[-1]}, mask=(j < LK) & (d_col < DH), other=0)",
                f"s = tl.dot(q_tile, k_tile{precision}) * {scale}",
            ]
            keep = (["(j < LK)"] if edge else []) + (["(j <= m + LK - LQ)"] if causal and edge else [])
            if mask:
                ms = strides["mask"]
                load = f"tl.load(mask + {base['mask']} + m * {ms[-2]} + j * {ms[-1]}, mask=row_ok & (j < LK), other=0)"
                if info_of(mask[0].type).dtype == "i1":
                    keep.append(f"({load} != 0)")
                else:
                    loop.append(f"s = s + {load}.to(tl.float32)")
            if keep:
                loop.append(f"s = tl.where({' & '.join(keep)}, s, float('-inf'))")
            loop += [
                # Online softmax; a row with no key yet keeps m = -inf and adds nothing, and a row
                # with none at all ends 0/0 = NaN, as softmax of all -inf does in the reference.
                "m_new = tl.maximum(m_i, tl.max(s, axis=1, keep_dims=True))",
                "m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)",
                # exp(x) as exp2(x * log2(e)): exp2 is the GPU's native exponential. The difference
                # is scaled, not the scores, so a mask of float32's lowest value does not overflow.
                f"p = tl.exp2((s - m_safe) * {py_literal(LOG2E)})",
                f"alpha = tl.exp2((m_i - m_safe) * {py_literal(LOG2E)})",
                "l_i = l_i * alpha + tl.sum(p, axis=1, keep_dims=True)",
                "jv = start + tl.arange(0, BLOCK_KV)[:, None]",
                f"v_tile = tl.load(v + {base['v']} + jv * {vs[-2]} + cols * {vs[-1]}, mask=(jv < LK) & col_ok, other=0)",
                f"acc = acc * alpha + tl.dot(p.to(v_tile.dtype), v_tile{precision})",
                "m_i = m_new",
            ]
            self.body += [INDENT + line for line in loop]
        self.body += ["acc = acc / l_i", "rows = pid_b * LQ + m"]
        self.values[op.results[0]] = Value("acc", out, True)
        self.n = dv
        self.dim_coords = [*self._decompose("rows", self.lead, "c"), "cols"]
        self.epilogue(epilogue)
        results = self.store_outputs()
        t = self.tile
        # The tile pass's blocks (at most the sequence, which is not always a power of two) rounded up.
        blocks = {"BLOCK_M": f"max(16, triton.next_power_of_2(min(cfg['BLOCK_M'], {self.dim(lq)})))",
                  "BLOCK_KV": f"max(16, triton.next_power_of_2(min(cfg['BLOCK_KV'], {self.dim(lk)})))",
                  "BLOCK_D": f"max(16, triton.next_power_of_2({self.dim(dh)}))",
                  "BLOCK_N": f"max(16, triton.next_power_of_2({self.dim(dv)}))"}
        grid = f"(triton.cdiv({self.dim(lq)}, BLOCK_M), {self.dim(numel(batch)) if batch else '1'})"
        # Query-key pairs computed: all of them, or with a causal mask those on or below the
        # diagonal (offset LK - LQ), whose blocks are the only ones the kernel visits.
        lq_, lk_ = self.dim(lq), self.dim(lk)
        pairs = (f"sum(max(0, min({lk_}, q + {lk_} - {lq_} + 1)) for q in range({lq_}))" if op.attr("causal")
                 else f"{lq_} * {lk_}")
        flops = f"2 * {self.dim(numel(batch) if batch else 1)} * ({pairs}) * ({self.dim(dh)} + {self.dim(dv)})"
        first = (int(t.get("block_q", 64)), int(t.get("block_kv", 64)), int(t.get("num_warps", 4)))
        configs = [{"BLOCK_M": bm, "BLOCK_KV": bkv, "num_warps": w, "num_stages": 2}
                   for bm, bkv, w in dict.fromkeys((first, *ATTENTION_CONFIGS))]
        return self._finish(results, blocks, grid, configs, flops=flops)

    def _conv_kernel(self) -> KernelCode:
        (op,) = self.anchors
        x, w, *bias = op.operands
        xi, wi, out = info_of(x.type), info_of(w.type), info_of(op.results[0].type)
        if xi.rank != 4 or not dtypes.is_float(xi.dtype) or any(v not in self.input_names for v in op.operands):
            raise Unsupported("a conv that is not 2-D, or reads a value computed in its own group")
        epilogue = [o for o in self.ops if o is not op]
        if self._whole_rows(epilogue) or any(o.op_name == Op.trilu for o in epilogue):
            raise Unsupported("a reduction after a conv (its tile's columns are channels, not the last axis)")
        if any(r.rank != out.rank or not all(dims_equal(a, b) for a, b in zip(r.shape, out.shape))
               for o in epilogue if o.op_name != Op.constant for r in o.result_infos()):
            raise Unsupported("an epilogue broadcasting the conv's result to another shape (the tile is its pixels)")
        strides = op.attr("strides") or (1, 1)
        pads = op.attr("pads") or (0, 0, 0, 0)
        dil = op.attr("dilations") or (1, 1)
        groups = op.attr("groups")
        self.conv_layout, self.whole_rows = True, False
        n_, oc, oh, ow = out.shape
        for name, d in (("C", xi.shape[1]), ("H", xi.shape[2]), ("W", xi.shape[3]), ("OH", oh), ("OW", ow),
                        ("P", numel((n_, oh, ow))), ("OCG", f"{self.dim(oc)} // {groups}"),
                        ("CG", f"{self.dim(xi.shape[1])} // {groups}"), ("KH", wi.shape[2]), ("KW", wi.shape[3])):
            self._int(name, d if isinstance(d, str) else self.dim(d))
        xs = self._strided("x", xi.dtype, self.input_names[x], 4)
        ws = self._strided("w", wi.dtype, self.input_names[w], 4)
        self.body += [
            "pid = tl.program_id(0)", "g = tl.program_id(1)",
            "pid_n = pid % tl.cdiv(OCG, BLOCK_N)", "pid_m = pid // tl.cdiv(OCG, BLOCK_N)",
            "p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
            "oc_in_group = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]",
            "cols = g * OCG + oc_in_group",
            "row_ok = p < P", "col_ok = oc_in_group < OCG",
            "cn = p // (OH * OW)", "coh = (p // OW) % OH", "cow = p % OW",
            "kk = tl.arange(0, BLOCK_K)",
            "acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)",
            "KTOT = CG * KH * KW",
            "for k0 in range(0, KTOT, BLOCK_K):",
        ]
        precision, configs, precision_block = self._gemm_precision(xi.dtype, self._gemm_config())
        loop = [
            "ka = (k0 + kk)[None, :]", "ci = ka // (KH * KW)", "kh = (ka // KW) % KH", "kw = ka % KW",
            f"ih = coh * {strides[0]} - {pads[0]} + kh * {dil[0]}",
            f"iw = cow * {strides[1]} - {pads[1]} + kw * {dil[1]}",
            "a_ok = row_ok & (ka < KTOT) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)",
            f"a_tile = tl.load(x + cn * {xs[0]} + (g * CG + ci) * {xs[1]} + ih * {xs[2]} + iw * {xs[3]}, "
            "mask=a_ok, other=0)",
            "kb = (k0 + kk)[:, None]",
            f"b_tile = tl.load(w + cols * {ws[0]} + (kb // (KH * KW)) * {ws[1]} + ((kb // KW) % KH) * {ws[2]} "
            f"+ (kb % KW) * {ws[3]}, mask=(kb < KTOT) & col_ok, other=0)",
            f"acc = tl.dot(a_tile, b_tile, acc{precision})",
        ]
        self.body += [INDENT + line for line in loop]
        if bias:
            bs = self._strided("bias", info_of(bias[0].type).dtype, self.input_names[bias[0]], 1)
            self.body.append(f"acc += tl.load(bias + cols * {bs[0]}, mask=col_ok, other=0).to(tl.float32)")
        self.values[op.results[0]] = Value("acc", out, True)
        self.dim_coords = ["cn", "cols", "coh", "cow"]
        self.epilogue(epilogue)
        results = self.store_outputs()
        blocks = {"BLOCK_M": "cfg['BLOCK_M']", **precision_block, "BLOCK_N": "max(16, min(cfg['BLOCK_N'], "
                  f"triton.next_power_of_2({self.dim(oc)} // {groups})))", "BLOCK_K": "cfg['BLOCK_K']"}
        grid = f"(triton.cdiv({self.dim(numel((n_, oh, ow)))}, BLOCK_M) * triton.cdiv({self.dim(oc)} // {groups}, BLOCK_N), {groups})"
        flops = f"2 * {self.dim(numel(out.shape))} * {self.dim(numel(wi.shape[1:]))}"
        return self._finish(results, blocks, grid, configs, flops=flops)

    def _gather_kernel(self) -> KernelCode:
        """np.take(x, indices, axis): x seen as [A, V, B] (A the dims before the axis, B after),
        output rows (a, i) copy row indices[i] of x[a] (negative indices count from the end)."""
        (op,) = self.ops
        x, idx = op.operands
        xi, ii, out = info_of(x.type), info_of(idx.type), op.result_infos()[0]
        axis = op.attr("axis") % xi.rank
        a, v, b = numel(xi.shape[:axis]), xi.shape[axis], numel(xi.shape[axis + 1:])
        a_, v_, b_, n_ = self.dim(a), self.dim(v), self.dim(b), self.dim(numel(ii.shape))
        self.host += [f"x3 = {self.input_names[x]}.reshape({a_}, {v_}, {b_})",
                      f"idx1 = {self.input_names[idx]}.reshape(-1)",
                      f"out0 = torch.empty(({a_}, {n_}, {b_}), device=DEVICE, dtype={TORCH_TYPES[out.dtype]})"]
        xs = self._strided("x", xi.dtype, "x3", 3)
        self._pointer("idx", ii.dtype, "idx1")
        os_ = self._strided("out", out.dtype, "out0", 3)
        for name, d in (("NI", n_), ("V", v_), ("B", b_), ("R", f"{a_} * {n_}")):
            self._int(name, d)
        self.body += [
            "rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
            "cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]",
            "row_ok = rows < R", "col_ok = cols < B",
            "a = rows // NI", "i = rows % NI",
            "j = tl.load(idx + i, mask=row_ok, other=0).to(tl.int64)",
            "j = tl.where(j < 0, j + V, j)",
            f"tile = tl.load(x + a * {xs[0]} + j * {xs[1]} + cols * {xs[2]}, mask=row_ok & col_ok, other=0)",
            f"tl.store(out + a * {os_[0]} + i * {os_[1]} + cols * {os_[2]}, tile, mask=row_ok & col_ok)",
        ]
        blocks = {"BLOCK_N": f"max(16, min(1024, triton.next_power_of_2({b_})))",
                  "BLOCK_M": f"max(1, min(64, {ROW_TILE_ELEMENTS} // BLOCK_N))"}
        grid = f"(triton.cdiv({a_} * {n_}, BLOCK_M), triton.cdiv({b_}, BLOCK_N))"
        return self._finish([f"out0.reshape({self._shape(out.shape)})"], blocks, grid,
                            [{"num_warps": 4, "num_stages": 1}])

    def _finish(self, results: list[str], blocks: dict[str, str], grid: str, configs: list[dict],
                flops: str = "0", stages: str | None = None) -> KernelCode:
        """The kernel's source, and the host body that picks a configuration and launches it."""
        for b in blocks:
            self.params.append(Param(b, "constexpr"))
        params = ", ".join(p.name if p.signature != "constexpr" else f"{p.name}: tl.constexpr" for p in self.params)
        kernel = ["@triton.jit", f"def {self.name}({params}):",
                  INDENT + py_docstring(f'{self.kind}: {" ".join(op.op_name for op in self.ops)}')]
        kernel += [INDENT + line for line in self.body]
        launch = [f"{b} = {expr}" for b, expr in blocks.items()]
        launch.append(f"num_stages = {stages or CONFIG_STAGES}")
        launch.append(f"{self.name}[{grid}]({', '.join(self.host_args)}, {', '.join(f'{b}={b}' for b in blocks)}, "
                      "num_warps=cfg['num_warps'], num_stages=num_stages)")
        host = list(self.host) + ["", "def launch(cfg):"] + [INDENT + line for line in launch]
        key = ", ".join(f"tuple({a}.shape)" for a in self.input_names.values())
        host.append(f"launch(pick(TUNER, {self.name!r}, ({key}{',' if len(self.input_names) == 1 else ''}), "
                    f"CONFIGS[{self.name!r}], launch))")
        host.append(f"return {', '.join(results)}{',' if len(results) == 1 else ''}")
        return KernelCode(self.name, kernel, host, self.params, configs, flops=flops, blocks=blocks,
                          host_args=list(self.host_args), stages=stages or CONFIG_STAGES, helpers=self.helpers)


def _int_neutral(kind: str, dtype: str) -> str:
    import numpy as np

    info = np.iinfo(dtypes.numpy_dtype(dtype)) if dtype != "i1" else None
    if kind == "max":
        return str(info.min) if info else "0"
    if kind == "min":
        return str(info.max) if info else "1"
    return "1" if kind == "prod" else "0"


TORCH_TYPES = {"f64": "torch.float64", "f32": "torch.float32", "f16": "torch.float16", "bf16": "torch.bfloat16",
               "i1": "torch.bool", "i8": "torch.int8", "i16": "torch.int16", "i32": "torch.int32",
               "i64": "torch.int64", "ui8": "torch.uint8", "ui16": "torch.uint16", "ui32": "torch.uint32",
               "ui64": "torch.uint64"}

def _upcast(dtype: str) -> str:
    return ".to(tl.float32)" if dtype in ("f16", "bf16") else ""


def _is_one(d: Dim) -> bool:
    return isinstance(d, int) and d == 1
