"""A CPU through the C backend (a profile of `backend` "c": backends/c/calibrate.py): what an
op and a fused group cost, and how a group is tiled.

A group is one step of the compiled module, one loop over memory whatever its length, its GEMM
or convolution on oneDNN with all threads (`Hardware.matmul_rate(threaded=True)`), its
attention on the flash kernel. So a group costs its step's fixed cost (an OpenMP region when it
is large enough for one, `C_PARALLEL_MIN`), its anchors, and the roofline of its loop: the
calibrated per-element rate of each op in the loop on all threads against its inputs and
outputs at the pass bandwidth (L2 while they fit the cores' caches, weights always from
memory). Fusing a chain thus saves a step and the intermediate passes, never a NumPy call. An
op alone is a group of one; quantization ops run their NumPy templates (targets/numpy.py).

Tiles: attention's `block_q` and `block_kv`, the largest blocks whose scores, accumulator and
K/V rows fit one core's cache with two tasks per core. The other loops and oneDNN's GEMMs block
themselves and read no tile: those groups get an empty one (they run whole, as priced here).
"""

from __future__ import annotations

import math
from typing import Callable

import sympy
from xdsl.ir import BlockArgument, OpResult, SSAValue

from tilegraph.ir.dialect import FusionOp, TgOp, YieldOp
from tilegraph.ir.fusion import ANCHORS, ELTWISE_POSTS, EXP_POSTS, POST_RATE, VIEW_OPS
from tilegraph.ir.hardware import (BLOCKED_SHARE, blocked_conv, strided_conv_shape, strided_conv_wins, winograd_shape,
                                   winograd_wins)
from tilegraph.ir.ops import Op
from tilegraph.ir.shapes import info_of
from tilegraph.ir.strides import reduces_rows_of_channels, reshape_copies, result_strides, strides_of
from tilegraph.passes.cost.model import (Cost, at_nominal, cold_bytes, element_count, free, gemm_rate, group_traffic,
                                         interpolate, matmul_shape, memo_hw, nbytes, op_bytes, op_flops, parallel_speedup,
                                         prod, sized, through_views)
from tilegraph.passes.remarks import listening, remark
from tilegraph.passes.targets.numpy import quant_cost

# (backends/c/emit.PARALLEL_MIN) A C loop over more elements than this opens an OpenMP
# region; a smaller one runs on the calling thread. tests/test_c_calibrate.py checks they agree.
C_PARALLEL_MIN = 32768

# Ops the C loops compute through a libm call: priced at `exp`'s calibrated rate when the
# profile has no rate of their own. The rest are a few vector instructions: `add`'s.
C_LIBM = {"log", "pow", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
          "expm1", "log1p", "sigmoid", "erf", "tanh", "exp", "gelu"}

# A convolution over this few input channels is an image model's first (RGB or RGBA):
# priced by the calibrated stems (stem_time), not as a GEMM of so short a k.
STEM_CHANNELS = 4
# The calibrated first convolutions (`conv_rates` keys, backends/c/calibrate.STEM_CASES): a
# 3x3 stride-2 stem, a 7x7 stride-2 stem, a 16x16 stride-16 patch embedding.
STEM_KINDS = ("stem", "stem7x7", "patch")

# The C backend's flash blocks (queries, keys), tried largest first.
C_FLASH_BLOCKS = ((128, 256), (128, 128), (64, 128), (64, 64), (32, 64))

__all__ = ["op_cost", "quant_cost", "group_cost", "choose_tile", "C_PARALLEL_MIN"]


def op_cost(op: TgOp, hw) -> Cost:
    """An op alone is a step of its own: a group of one, or a copy."""
    name = op.op_name
    if name == Op.reshape and reshape_copies(op, layouts()):  # a transpose's dims merged: copied
        return _reshape_copy(op, hw)
    if name in VIEW_OPS:  # nothing moves
        return free(name)
    if op.SPEC.category not in ("layout", "source"):
        anchors = [op] if name in ANCHORS else []
        return group_cost([op], anchors, [] if anchors else [op], [info_of(v.type) for v in op.operands],
                          op.result_infos(), hw, label=name)
    # Copies (gather, concat, pad, ...): a copy reads what it writes (a gather reads its rows,
    # not the whole table; a split writes every part); rows of a weight (an embedding) come
    # from memory, at most the whole table.
    zero = sympy.Integer(0)
    flops, bytes_ = op_flops(op), op_bytes(op)
    moved = sum((nbytes(info) for info in op.result_infos()), zero)
    tables = [v for v in map(through_views, op.operands) if isinstance(v.owner, TgOp) and v.owner.op_name == Op.weight]
    cold = sympy.Min(moved, sum((nbytes(info_of(v.type)) for v in tables), zero)) if tables else zero
    memory, overhead = copy_time(hw, moved, cold, element_count(op.result_infos()[0]))
    return Cost(flops, bytes_, memory + overhead, zero, memory, overhead, label=name, ops=[name])


def copy_time(hw, moved: sympy.Expr, cold: sympy.Expr, elements: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """(memory, overhead) of a step that copies `moved` bytes, `cold` of them from a weight.
    At the calibrated row-copy rate where the profile has one: a copy is short rows, each
    checked against its bounds, not a streaming pass, and for the few rows a lookup takes
    that rate, not where in memory the table lies, sets its time; but the rows of a weight come
    from memory at the calibrated rate of rows beyond the caches (`cold_copy_bandwidth`: a
    language model's embedding rows, evicted by the weights each forward streams, took 4-5x
    the time of rows in cache)."""
    memory = moved / hw.copy_bandwidth if hw.copy_bandwidth else step_memory(hw, 2 * moved, cold)
    if hw.copy_bandwidth and hw.cold_copy_bandwidth:
        memory += cold * (1 / hw.cold_copy_bandwidth - 1 / hw.copy_bandwidth)
    return memory, step_overhead(hw, elements)


def layouts() -> Callable[[SSAValue], tuple]:
    """`written`, each value's answer kept for this one question: a value an elementwise op
    reads along two paths (x + f(x)) would else be asked again down each, twice per layer. The
    values a layout is read from are answered first, producers before readers, so no answer
    recurses further than one op: a chain of elementwise ops and layer norms through a deep
    training step (BERT-base's residual stream, forward and back) outran Python's recursion limit."""
    memo: dict[SSAValue, tuple] = {}

    def rule(value: SSAValue) -> tuple:
        if value not in memo:
            for v in _read_before(value, memo):
                strides_of(v, rule)
            memo[value] = written(value, rule)
        return memo[value]

    return rule


def _read_before(value: SSAValue, done: dict) -> list[SSAValue]:
    """The values `value`'s layout is read from, directly or not (an op's operands, a group's
    yielded value, a group argument's operand), producers first; `value` and those in `done` left out."""
    order: list[SSAValue] = []
    seen = {value}
    stack: list[tuple[SSAValue, bool]] = [(u, False) for u in _reads(value)]
    while stack:
        v, expanded = stack.pop()
        if expanded:
            order.append(v)
        elif v not in seen and v not in done:
            seen.add(v)
            stack.append((v, True))
            stack.extend((u, False) for u in _reads(v))
    return order


def _reads(value: SSAValue) -> list[SSAValue]:
    if isinstance(value, BlockArgument):
        group = value.owner.parent_op()
        return [group.operands[value.index]] if isinstance(group, FusionOp) else []
    op = value.owner
    if isinstance(op, FusionOp):
        ret = op.block.last_op
        return [ret.operands[value.index]] if isinstance(ret, YieldOp) and isinstance(value, OpResult) else []
    return list(op.operands)


def written(value: SSAValue, rule: Callable[[SSAValue], tuple]) -> tuple:
    """Where the C backend lays out a value an op computes (ir/strides.result_strides, the rule
    its emitter lays out buffers by), `rule` answering for the values it reads."""
    return result_strides(value, lambda x: strides_of(x, rule))


def _reshape_copy(op: TgOp, hw) -> Cost:
    """A reshape the C backend cannot make a view: a strided loop copying every element."""
    info = op.result_infos()[0]
    zero = sympy.Integer(0)
    moved = nbytes(info)
    memory, overhead = copy_time(hw, moved, zero, element_count(info))
    return Cost(zero, 2 * moved, memory + overhead, zero, memory, overhead, label="reshape (copy)", ops=[op.op_name])


def group_cost(ops, anchors, rest, inputs, outputs, hw, label: str = "", **_tile) -> Cost:
    """One step of a compiled module (module docstring), as

        steps x step cost + anchors + row kernels + max(loop compute, loop memory)

    Anchors (oneDNN's GEMM and convolution on a packed weight, the flash kernel) and the
    row kernels (softmax, layer_norm) run at their calibrated rates, which include their own
    traffic; the loop (every other op, one pass) is a roofline of its ops' calibrated rates
    against the bytes the group moves beyond what its anchors read and write."""
    names = [op.op_name for op in ops]
    zero = sympy.Integer(0)
    inside = set(ops)
    flops, bytes_ = group_traffic(ops, inputs, outputs)
    anchor_time = sum((anchor_compute(op, hw) for op in anchors), zero)
    # What the anchors read from outside and write out of the group: in their rates.
    anchor_in = {v: None for op in anchors for v in op.operands if v.owner not in inside}
    anchor_out = [r for op in anchors for r in op.results if any(u.operation not in inside for u in r.uses)]
    anchor_io = sum((nbytes(info_of(v.type)) for v in [*anchor_in, *anchor_out]), zero)
    # Row ops (runtime.h): one call per group of rows, each row a fixed cost and its elements.
    rows = [op for op in rest if op.SPEC.row_normalizing]
    row_time = sum((row_kernel_time(hw, op) for op in rows), zero)
    loop = zero
    posts = eltwise_posts(anchors, rest)
    for op in rest:
        if op.SPEC.row_normalizing or op in posts:
            continue
        elements = element_count(op.result_infos()[0]) if op.SPEC.category != "reduction" \
            else element_count(info_of(op.operands[0].type))
        loop += elements / (reduction_rate(hw, op) if op.SPEC.category == "reduction" else loop_rate(hw, op.op_name))
    # An activation oneDNN applies as it writes costs no pass, but one that evaluates an exp
    # costs each element its calibrated rate (EfficientNet's swish convolutions).
    if POST_RATE in hw.ufunc_rates:
        anchor_time += sum((element_count(op.result_infos()[0]) for op in posts if op.op_name in EXP_POSTS),
                           zero) / hw.ufunc_rates[POST_RATE]
    loop_bytes = sympy.Max(bytes_ - anchor_io, zero)
    memory = step_memory(hw, loop_bytes, cold_bytes([op for op in ops if op not in anchors]))
    compute = anchor_time + row_time + loop
    # One step per anchor (an epilogue rides on oneDNN's post-ops or the step's own loop),
    # one more for a row kernel or reduction after it; a group without anchors is one step.
    after = any(op.SPEC.row_normalizing or op.SPEC.category == "reduction" for op in rest)
    steps = max(1, len(anchors) + (1 if anchors and after else 0))
    size = max((element_count(o) for o in outputs), key=at_nominal) if outputs else zero
    overhead = steps * step_overhead(hw, size)
    time = overhead + anchor_time + row_time + sympy.Max(loop, memory)
    # A reshape the backend cannot make a view (a transposed operand's dims merged) is a
    # copy step of its own before the loop.
    for op in ops:
        if op.op_name == Op.reshape and reshape_copies(op, layouts()):
            copy = _reshape_copy(op, hw)
            time, memory, overhead = time + copy.time, memory + copy.memory_time, overhead + copy.overhead
    return Cost(flops, bytes_, time, compute, memory, overhead, kernels=1, label=label, ops=names)


def loop_rate(hw, name: str) -> float:
    rates = hw.ufunc_rates
    if name in rates:
        return rates[name]
    if name in C_LIBM and "exp" in rates:
        return rates["exp"]
    return rates.get("add") or hw.cache_bandwidth / 12


def eltwise_posts(anchors, rest) -> set:
    """The ops of `rest` a GEMM or convolution applies as it writes its result (ELTWISE_POSTS
    in a chain on it, sigmoid(x) * x as a swish): they cost its pass nothing, not a loop at
    their calibrated rate (EfficientNet's swish convolutions were priced 2-3x their time);
    those of EXP_POSTS their elements at the calibrated post-op rate (group_cost)."""
    covered: set = set()
    for anchor in anchors:
        if anchor.op_name not in (Op.conv, Op.matmul):
            continue
        current, before = anchor.results[0], None
        for op in rest:
            if op.op_name in ELTWISE_POSTS and op.operands[0] is current:
                before, current = current, op.results[0]
            elif op.op_name == Op.mul and before is not None and current.owner.op_name == Op.sigmoid and \
                    {id(v) for v in op.operands} == {id(before), id(current)}:
                before, current = None, op.results[0]
            else:
                if op.op_name in (Op.add, Op.sub, Op.mul) and current in op.operands:  # a bias or scale on the way
                    before, current = None, op.results[0]
                continue
            covered.add(op)
    return covered


def row_kernel_time(hw, op: TgOp) -> sympy.Expr:
    """A softmax's or layer_norm's row kernel: its elements at the calibrated rate, and each
    row (along the last axis) its calibrated fixed cost."""
    info = op.result_infos()[0]
    elements = element_count(info)
    per_row = hw.row_overhead.get(op.op_name, 0.0)
    rows = elements / sized(info.shape[-1]) if per_row and info.shape else sympy.Integer(0)
    return elements / loop_rate(hw, op.op_name) + rows * per_row


def reduction_rate(hw, op: TgOp) -> float:
    """Elements/s a reduction reads in a C loop: a sum or mean whose kept channels lie
    contiguous (a global average pool over a convolution's channels-last result) at its
    kernel's calibrated rate (`pool_rate`): rows of channels added into blocks of accumulators,
    far below a fused loop's `add`; any other sum or mean adds each row's elements into one
    accumulator in turn (backends/c/groups.py), a chain of dependent adds: at the calibrated
    sum along rows (`ufunc_rates["reduce_sum"]`, an RMSNorm's mean of squares ran at a tenth
    of `add`'s rate); any other reduction at its op's loop rate."""
    if op.op_name in (Op.reduce_sum, Op.reduce_mean):
        x = op.operands[0]
        shape = info_of(x.type).shape
        axes = sorted(int(a) % len(shape) for a in op.attr("axes"))
        if reduces_rows_of_channels(shape, strides_of(x, layouts()), axes):
            return hw.pool_rate or loop_rate(hw, op.op_name)
        if Op.reduce_sum in hw.ufunc_rates:  # a mean is the same sum, divided once at the end
            return hw.ufunc_rates[Op.reduce_sum]
    return loop_rate(hw, op.op_name)


def anchor_compute(op: TgOp, hw) -> sympy.Expr:
    """An anchor's time: oneDNN's GEMM or convolution on all threads, the flash kernel. A
    GEMM or convolution takes at least one read of its weights from memory: its calibrated
    rates were measured on weights in cache, which a decode step's one row cannot reuse."""
    arithmetic = _anchor_arithmetic(op, hw)
    if op.op_name == Op.attention:
        return arithmetic
    # A convolution is a oneDNN primitive's call besides its work (the GEMM rates were taken
    # net of nothing but the module call, so they hold theirs), all of a squeeze-excitation's
    # 1x1 convolution on a 1x1 map.
    call = hw.primitive_overhead if op.op_name == Op.conv else 0.0
    return call + sympy.Max(arithmetic, cold_bytes([op]) / hw.memory_bandwidth)


def _anchor_arithmetic(op: TgOp, hw) -> sympy.Expr:
    flops = op_flops(op)
    if op.op_name == Op.conv and hw.conv_rates:
        return conv_time(op, hw, flops)
    if op.op_name == Op.conv and hw.conv_rate:
        return flops / hw.conv_rate
    if op.op_name == Op.attention and hw.attention_rates:
        q, k = (info_of(v.type) for v in op.operands[:2])
        d = sized(q.shape[-1])
        if op.attr("causal"):  # the flash kernel stops at the diagonal: the visible share of the keys
            lq, lk = (max(1.0, at_nominal(sized(x.shape[-2]))) for x in (q, k))
            flops = flops * min(1.0, (max(lk - lq, 0.0) + (lq + 1) / 2) / lk)
        return flops / (interpolate(hw.attention_rates, at_nominal(d)) * max(hw.attention_speedup, 1.0))
    if op.op_name == Op.einsum:
        return flops / gemm_rate(hw, op) / parallel_speedup(hw, hw.cores)
    m, n, k = (max(1, int(at_nominal(d))) for d in matmul_shape(op))  # type: ignore[assignment]
    return flops / hw.matmul_rate(m, n, k, op.result_infos()[0].dtype, threaded=True)


def conv_time(op: TgOp, hw, flops: sympy.Expr) -> sympy.Expr:
    """A convolution on oneDNN, all threads: channels-last (_channels_last_time), or at
    BLOCKED_SHARE of that where the emitter's rule runs it in the blocked layout (ir/hardware.
    blocked_conv; the emitter keeps it so only inside a chain of such convolutions)."""
    x, w, out = info_of(op.operands[0].type), info_of(op.operands[1].type), op.result_infos()[0]
    if len(x.shape) == 3 and _strided(op, x, w, out):
        return _strided_time(hw, x, w, out, int(op.attr("strides")[0]))
    t = _channels_last_time(op, hw, flops)
    if len(x.shape) != 4:
        return t
    depthwise = int(op.attr("groups") or 1) > 1 and at_nominal(sized(w.shape[1])) == 1
    n, c, (k, oh, ow) = x.shape[0], x.shape[1], out.shape[1:]
    return t * BLOCKED_SHARE if blocked_conv(n, c, k, oh, ow, depthwise, w.shape[2:]) else t


def _channels_last_time(op: TgOp, hw, flops: sympy.Expr) -> sympy.Expr:
    """A convolution on oneDNN in channels-last. Depthwise (one input channel a group): at the
    calibrated depthwise rate, a pass over memory more than arithmetic (by the elements it
    reads and writes where that is more). Else as the GEMM it
    is, output pixels x a group's output channels x (a group's inputs x the window), at the
    GEMM curve's rate for that shape times how a calibrated convolution of its kind (3x3 or
    1x1) ran against the curve at its own shape: the curve carries the size, the calibration
    what oneDNN's convolution kernels do differently from its GEMMs."""
    x, w = (info_of(v.type) for v in op.operands[:2])
    groups = int(op.attr("groups") or 1)
    out = op.result_infos()[0]
    if groups > 1 and at_nominal(sized(w.shape[1])) == 1 and "depthwise" in hw.conv_rates:
        # The calibrated one (stride 1) moved an element in and out per window of k taps; a
        # strided one reads more inputs per output than its arithmetic says.
        *_, k_cal, rate = hw.conv_rates["depthwise"]
        return sympy.Max(flops / rate, (element_count(x) + element_count(out)) * k_cal / rate)
    if groups > 1 and at_nominal(sized(w.shape[1])) == 1:
        return flops / (hw.conv_rate or hw.flops("f32"))
    if groups == 1 and at_nominal(sized(w.shape[1])) <= STEM_CHANNELS and any(kind in hw.conv_rates for kind in STEM_KINDS):
        return stem_time(hw, flops, element_count(out))
    window = w.shape[2:]
    kind = "pointwise" if all(at_nominal(sized(d)) == 1 for d in window) else "dense"
    if kind == "dense" and "winograd" in hw.conv_rates and _winograd(op, groups, x, out):
        kind = "winograd"  # (a profile measured before winograd.c has none: priced as oneDNN's)
    if kind not in hw.conv_rates:
        return flops / (hw.conv_rate or hw.flops("f32"))
    m = max(1, int(at_nominal(prod([out.shape[0], *out.shape[2:]]))))
    n = max(1, int(at_nominal(sized(out.shape[1]))) // groups)
    k = max(1, int(at_nominal(prod(w.shape[1:]))))
    rm, rn, rk, rate = hw.conv_rates[kind]
    efficiency = rate / hw.matmul_rate(rm, rn, rk, threaded=True)
    return flops / (hw.matmul_rate(m, n, k, threaded=True) * efficiency)


def _winograd(op: TgOp, groups: int, x, out) -> bool:
    """Whether the C backend runs `op` on winograd.c: its weight a constant and the rule the
    emitter chooses by (ir/hardware.winograd_shape, winograd_wins)."""
    weight = through_views(op.operands[1]).owner
    if not (isinstance(weight, TgOp) and weight.op_name in (Op.weight, Op.constant)) or len(x.shape) != 4:
        return False
    n = len(x.shape) - 2
    strides, dilations, pads = (op.attr(a) for a in ("strides", "dilations", "pads"))
    window = info_of(op.operands[1].type).shape[2:]
    return winograd_shape(groups, window, strides or [1] * n, dilations or [1] * n, pads or [0] * 2 * n,
                          x.shape[1], *out.shape[1:]) and \
        winograd_wins(x.shape[0], x.shape[1], out.shape[1], out.shape[2], out.shape[3], groups)


def _strided(op: TgOp, x, w, out) -> bool:
    """Whether the C backend runs `op` on strided_conv.c: a constant weight, no bias, and the rule
    the emitter chooses by (ir/hardware.strided_conv_shape, strided_conv_wins)."""
    weight = through_views(op.operands[1]).owner
    if not (isinstance(weight, TgOp) and weight.op_name in (Op.weight, Op.constant)) or len(op.operands) > 2:
        return False
    strides, dilations, pads = (op.attr(a) for a in ("strides", "dilations", "pads"))
    return strided_conv_shape(int(op.attr("groups") or 1), w.shape[2:], strides or [1], dilations or [1],
                              pads or [0, 0], x.shape[1], out.shape[1]) and \
        strided_conv_wins(x.shape[0], x.shape[1], out.shape[1], out.shape[2], w.shape[2],
                          (strides or [1])[0])


def _strided_time(hw, x, w, out, stride: int) -> sympy.Expr:
    """strided_conv.c's matmuls, one per block of `stride` taps: (batch x outputs) x (the block's
    taps x input channels) @ that x output channels each, at the GEMM curve's rate."""
    window, c, k = int(at_nominal(sized(w.shape[2]))), sized(x.shape[1]), sized(out.shape[1])
    rows = sized(out.shape[0]) * sized(out.shape[2])
    m, n = max(1, int(at_nominal(rows))), max(1, int(at_nominal(k)))
    t = sympy.Integer(0)
    for b0 in range(0, window, stride):
        kb = min(stride, window - b0)
        t += 2 * rows * k * kb * c / hw.matmul_rate(m, n, max(1, int(at_nominal(kb * c))), threaded=True)
    return t


def stem_time(hw, flops: sympy.Expr, outputs: sympy.Expr) -> sympy.Expr:
    """An image's first convolution (a 3x3 or 7x7 stride-2 stem, a ViT's or Swin's patch
    embedding) reads the caller's plain image of a few channels, no GEMM of so short a k: a
    time per output element plus its FLOPs at a rate, the two solved from the two calibrated
    ones (STEM_KINDS) nearest in FLOPs per output on either side (a line through each
    neighbouring pair, the end ones beyond the last: a 7x7 stem is not priced by what a 3x3's
    outputs and a 16x16 patch's FLOPs cost). Where no pair solves to positive costs, or one
    sample alone: at the nearest one's rate."""
    # (FLOPs per output, time per output) of each sample: m x n outputs, 2mnk FLOPs
    points = sorted((2.0 * k, 2.0 * k / rate) for m, n, k, rate in
                    (hw.conv_rates[kind] for kind in STEM_KINDS if kind in hw.conv_rates))
    per_output = at_nominal(flops) / max(at_nominal(outputs), 1.0)
    if len(points) >= 2:
        i = min(max(sum(1 for x, _ in points if x <= per_output) - 1, 0), len(points) - 2)
        (x0, y0), (x1, y1) = points[i], points[i + 1]
        b = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
        a = y0 - b * x0
        if a > 0 and b > 0:
            return outputs * a + flops * b
    x, y = min(points, key=lambda p: abs(math.log(p[0]) - math.log(max(per_output, 1e-9))))
    return flops * y / x


@memo_hw
def step_memory(hw, bytes_: sympy.Expr, cold: sympy.Expr) -> sympy.Expr:
    """One pass over a step's inputs and outputs: at the cache rate while they fit the
    cores' L2 (the step before ran on every core), weights from memory; beyond L2, at the L3
    rate while they fit half of L3 (the rest of it holds the weights streaming through); else
    all from memory."""
    fits = bytes_ <= hw.cache_bytes * hw.cores
    if hw.l3_bandwidth:  # beyond L2, a layer's activations stay in L3 where it holds them
        in_l3 = bytes_ <= hw.l3_bytes / 2
        return sympy.Piecewise((cold / hw.memory_bandwidth + (bytes_ - cold) / hw.cache_bandwidth, fits),
                               (cold / hw.memory_bandwidth + (bytes_ - cold) / hw.l3_bandwidth, in_l3),
                               (bytes_ / hw.memory_bandwidth, True))
    return sympy.Piecewise((cold / hw.memory_bandwidth + (bytes_ - cold) / hw.cache_bandwidth, fits),
                           (bytes_ / hw.memory_bandwidth, True))


@memo_hw
def step_overhead(hw, elements: sympy.Expr) -> sympy.Expr:
    """The fixed cost of one step: a function call, and an OpenMP region when it is big enough."""
    return sympy.Piecewise((hw.chunk_call_overhead, elements <= C_PARALLEL_MIN),
                           (hw.chunk_call_overhead + hw.parallel_overhead, True))


def choose_tile(group: FusionOp, hw, *_options) -> dict[str, int]:
    """Attention's blocks; every other group runs whole (module docstring)."""
    attention = [op for op in group.ops if op.op_name == Op.attention]
    return _attention_blocks(attention[0], hw) if attention else {}


def _attention_blocks(op, hw) -> dict[str, int]:
    """The C backend's flash kernel: blocks of `block_q` queries against `block_kv` keys
    per task, each block's scores, accumulator and K/V rows within one core's cache, as
    large as that allows (each block is two products: attention.c's register-blocked loops, or
    sgemm calls where the processor lacks AVX-512), with at least two tasks per
    core while the queries allow it (tasks are a batch row times a block of queries)."""
    q, k, v = (info_of(x.type).shape for x in op.operands[:3])
    lq, lk, d, dv = (int(at_nominal(x)) for x in (q[-2], k[-2], q[-1], v[-1]))
    tasks_per_block = int(at_nominal(math.prod(q[:-2]))) if len(q) > 2 else 1
    best = (C_FLASH_BLOCKS[0][0], C_FLASH_BLOCKS[0][1])
    for bq, bk in C_FLASH_BLOCKS:  # largest first
        live = 4 * (bq * bk + bq * (d + dv) + bk * (d + dv))
        if live <= hw.cache_bytes and (tasks_per_block * math.ceil(lq / bq) >= 2 * hw.cores or bq == C_FLASH_BLOCKS[-1][0]):
            best = (bq, bk)
            break
    tile = {"block_q": min(best[0], max(lq, 1)), "block_kv": min(best[1], max(lk, 1))}
    if listening():
        remark("tile", f"attention {lq}x{lk}, head dims {d}/{dv} on the C backend: blocks of {tile['block_q']} "
                       f"queries x {tile['block_kv']} keys ({4 * (best[0] * best[1] + best[0] * (d + dv) + best[1] * (d + dv)) // 1024} "
                       f"KiB live of {hw.cache_bytes // 1024} KiB of cache per core)")
    return tile
