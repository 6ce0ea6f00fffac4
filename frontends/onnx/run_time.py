"""Converters whose result sizes, or whose inputs' sizes, are known only at run time:
NonZero, Unique, Compress, TopK with a computed k, NonMaxSuppression; Resize and SAME
padding on symbolic spatial dims; Split of a run-time size; RNN/GRU/LSTM over a symbolic
number of steps (one tg.rnn, a loop inside the op).

Imported after every other family: some of these wrap the static converter of the same
op type (taken from CONVERTERS) and register themselves in its place.
"""

from __future__ import annotations

import numpy as np
import sympy

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import CONVERTERS, _axis, _conv
from tilegraph.frontends.onnx.recurrent import RNN_DEFAULT_ACTIVATIONS, RNN_GATES, rnn_outputs, time_major
from tilegraph.frontends.onnx.sampling import _resize_taps
from tilegraph.ir import dtypes
from tilegraph.ir.shapes import normalize_dim, numel, symbol

# --- data-dependent sizes: NonZero, Unique, Compress, TopK on run-time values, NonMaxSuppression ---
# The result's size is a symbol that one tg op defines (ir/ops.py, "data-dependent sizes"),
# named u0, u1, ... (a name no graph input uses); with known inputs these fold at import.


def _run_time_size(n) -> str:
    imp = n.imp
    taken = {p.dim_param for i in imp.proto.graph.input for p in i.type.tensor_type.shape.dim}
    k = getattr(imp, "_run_time_sizes", 0)
    while f"u{k}" in taken:
        k += 1
    imp._run_time_sizes = k + 1
    return f"u{k}"


@_conv("NonZero")
def _nonzero(n):
    x = n.x(0)
    if isinstance(x, np.ndarray):
        return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)
    if n.rank(x) == 0:
        raise FrontendError("NonZero of a scalar computed at run time")
    mask = x if n.dtype(x) == "i1" else n.op("ne", x, 0)
    return n.op("nonzero", mask, size=_run_time_size(n))


@_conv("Unique")
def _unique(n):
    x = n.x(0)
    flatten = "axis" not in n.attrs
    axis = 0 if flatten else _axis(n.attrs["axis"], n.rank(x))
    sort = bool(n.attr("sorted", 1))
    if isinstance(x, np.ndarray):
        from tilegraph.ir.kernels import unique

        return unique(x, flatten, axis, sort)
    return n.op("unique", x, size=_run_time_size(n), flatten=flatten, axis=axis, sorted=sort)


_static_compress = CONVERTERS["Compress"]


@_conv("Compress")
def _compress_run_time(n):
    """Compress on a condition computed at run time: the rows of its nonzero entries."""
    if isinstance(n.opt(1), np.ndarray):
        return _static_compress(n)
    x, cond = n.x(0), n.x(1)
    if "axis" not in n.attrs:
        x = n.reshape(x, (numel(n.shape(x)),))
        axis = 0
    else:
        axis = _axis(n.attrs["axis"], n.rank(x))
    length, dim = n.shape(cond)[0], n.shape(x)[axis]
    if not (isinstance(length, int) and isinstance(dim, int)) and not sympy.simplify(length - dim) == 0:
        raise FrontendError(f"a run-time condition of length {length} over a dim of {dim}")
    if isinstance(length, int) and isinstance(dim, int) and length > dim:
        cond = n.slice(cond, 0, 0, dim)  # (ONNX: a longer condition's extra entries are ignored)
    size = _run_time_size(n)
    rows = n.op("nonzero", n.cast(cond, "i1"), size=size)
    return n.op("gather", x, n.reshape(rows, (symbol(size),)), axis=axis)


_static_topk = CONVERTERS["TopK"]


@_conv("TopK")
def _topk_run_time_k(n):
    """TopK with k computed at run time: the whole axis sorted, then both results narrowed to k."""
    if isinstance(n.opt(1), np.ndarray):
        return _static_topk(n)
    x = n.x(0)
    axis = _axis(n.attr("axis", -1), n.rank(x))
    if not isinstance(n.shape(x)[axis], int):
        raise FrontendError(f"TopK with a run-time k over symbolic dim {axis} of {n.info(x)}")
    k = n.reshape(n.cast(n.x(1), "i64"), ())
    size = _run_time_size(n)
    full = n.op("topk", x, k=n.shape(x)[axis], axis=axis, largest=bool(n.attr("largest", 1)))
    return tuple(n.op("narrow", t, k, axis=axis, size=size) for t in full)


@_conv("NonMaxSuppression")
def _non_max_suppression(n):
    boxes, scores = n.x(0), n.x(1)
    # Absent inputs take the spec's defaults (no boxes kept, IoU 0); an absent score threshold
    # filters nothing, so it stays absent.
    count = n.opt(2) if n.opt(2) is not None else np.zeros(1, np.int64)
    iou = n.opt(3) if n.opt(3) is not None else np.zeros(1, np.float32)
    rest = [n.opt(4)] if n.opt(4) is not None else []
    return n.op("non_max_suppression", boxes, scores, count, iou, *rest, size=_run_time_size(n),
                center_point_box=int(n.attr("center_point_box", 0)))


# --- Resize on symbolic spatial dims: integer scale factors, taps made at run time ---
# With an integer factor s and a coordinate transformation that does not depend on the input
# length, output o reads source taps floor(o / s) + offset[o % s] with weights[o % s]: the
# taps repeat with period s. The tables (s rows) come from the same _resize_taps as the static
# case, taken well inside a longer axis; the edge clamp becomes an edge pad of the input.
_PERIODIC_CTM = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "asymmetric")
_static_resize = CONVERTERS["Resize"]


def _symbolic_resize_factors(n, shape, axes) -> dict[int, int] | None:
    """axis -> integer factor when a resized axis is symbolic (None: the static converter's case)."""
    if all(isinstance(shape[a], int) for a in axes):
        return None
    scales, sizes = n.opt(2), n.opt(3)
    factors = {}
    for i, a in enumerate(axes):
        if sizes is not None and isinstance(sizes, np.ndarray) and sizes.size:
            f = sympy.simplify(sympy.sympify(sizes.reshape(-1)[i]) / sympy.sympify(shape[a]))
        elif scales is not None and isinstance(scales, np.ndarray) and scales.size:
            f = sympy.nsimplify(float(scales.reshape(-1)[i]))
        else:
            return None
        if not (f.is_Integer and f >= 1):
            raise FrontendError(f"Resize of symbolic dim {a} ({shape[a]}) by {f}: only integer factors can be "
                                "resized on symbolic dims")
        factors[a] = int(f)
    return factors


@_conv("Resize")
def _resize_symbolic(n):
    x = n.x(0)
    shape, r = n.shape(x), n.rank(x)
    axes = [_axis(a, r) for a in n.attr("axes", range(r))]
    factors = _symbolic_resize_factors(n, shape, axes)
    if factors is None:
        return _static_resize(n)
    mode, ctm = n.attr("mode", "nearest"), n.attr("coordinate_transformation_mode", "half_pixel")
    if ctm not in _PERIODIC_CTM or n.attr("exclude_outside", 0) or mode not in ("nearest", "linear", "cubic") or \
            n.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise FrontendError(f"Resize on symbolic dims supports integer factors with {', '.join(_PERIODIC_CTM)}, "
                            f"stretch, no exclude_outside; got mode {mode}, {ctm}")
    if mode != "nearest" and not dtypes.is_float(n.dtype(x)):
        raise FrontendError(f"Resize mode '{mode}' needs a float input")
    inside = 4  # the table rows are taken at source position `inside` of a 2 * inside + 1 long axis
    for a in axes:
        s = factors[a]
        if s == 1:
            continue
        idx, coeffs, _ = _resize_taps(n, 2 * inside + 1, s * (2 * inside + 1), float(s), (0.0, 1.0))
        offsets, coeffs = idx[inside * s:(inside + 1) * s] - inside, coeffs[inside * s:(inside + 1) * s]
        if mode == "nearest":
            offsets = offsets[np.arange(s), np.argmax(coeffs, axis=1)][:, None]
        pad = int(np.abs(offsets).max())
        padded = x
        if pad:
            pads = [0] * (2 * r)
            pads[a] = pads[a + r] = pad
            padded = n.op("pad", x, pads=tuple(pads), mode="edge")
        out = normalize_dim(s * sympy.sympify(shape[a]))
        o = n.iota((out,), 0)
        phase = n.op("mod", o, np.int64(s))
        source = n.op("add", n.op("div", o, np.int64(s)), np.int64(pad))  # floor(o / s) on the padded axis
        taps = n.op("add", n.reshape(source, (out, 1)), n.op("gather", offsets.astype(np.int64), phase, axis=0))
        if mode == "nearest":
            x = n.op("gather", padded, n.reshape(taps, (out,)), axis=a)
            continue
        dt = dtypes.numpy_dtype(n.dtype(x))
        gathered = n.op("gather", padded, taps, axis=a)  # (..., out, taps, ...)
        w = n.op("gather", coeffs.astype(dt), phase, axis=0)
        w = n.reshape(w, (out, coeffs.shape[1]) + (1,) * (r - a - 1))
        x = n.reduce("sum", n.op("mul", gathered, w), [a + 1], False)
    return x



# --- Split of a run-time size into static parts ---
# torch's TorchScript exporter unrolls a Python loop over a nonzero's rows at the count it saw,
# splitting a (u0, ...) value into that many static parts: the count is checked when the model
# runs (tg.assert_size), as onnxruntime fails a Split whose parts do not add up.
_static_split = CONVERTERS["Split"]


@_conv("Split")
def _split_run_time_size(n):
    x = n.x(0)
    axis = _axis(n.attr("axis", 0), n.rank(x))
    dim = n.shape(x)[axis]
    sizes = n.ints_attr_or_input("split", 1) if isinstance(dim, sympy.Symbol) else None
    if sizes is not None and all(isinstance(s, int) for s in sizes) and not isinstance(x, np.ndarray) \
            and _defined_at_run_time(n, dim):
        n.inputs[0] = n.op("assert_size", x, axis=axis, size=sum(sizes))
    return _static_split(n)


def _defined_at_run_time(n, dim) -> bool:
    """Whether symbol `dim` is a size some tg op of the graph so far defines (not a graph input's)."""
    from tilegraph.ir.ops import size_definitions

    return any(name == dim.name for op in n.imp.g.block.ops for _, _, name in size_definitions(op))


# --- SAME padding with stride > 1 on symbolic spatial dims ---
# The padding then depends on the size modulo the stride. The window positions are the same as
# over the input's rows lo - P .. lo - P + L - 1 of a generously padded copy (P rows each side),
# with L = (ceil(H / s) - 1) * s + k_eff the padded length and lo the run-time begin padding: a
# gather of those rows (lo computed at run time from H), then the op without padding on that axis.
# Conv pads with zeros and MaxPool with the lowest value; an AveragePool's count of padding is
# not a gathered row, so it stays refused.
_static_window_ops = {name: CONVERTERS[name] for name in ("Conv", "MaxPool")}


@_conv("Conv", "MaxPool")
def _same_padding_on_symbolic_dims(n):
    convert = _static_window_ops[n.op_type]
    auto = n.attr("auto_pad", "NOTSET")
    x = n.x(0)
    spatial = n.shape(x)[2:]
    nd = len(spatial)
    strides = list(n.attr("strides", [1] * nd))
    if auto not in ("SAME_UPPER", "SAME_LOWER") or all(isinstance(d, int) or st == 1
                                                        for d, st in zip(spatial, strides)):
        return convert(n)
    kernel = list(n.attr("kernel_shape", list(n.shape(n.x(1))[2:]) if n.op_type == "Conv" else None))
    dilations = list(n.attr("dilations", [1] * nd))
    if n.op_type == "MaxPool" and (n.attr("ceil_mode", 0) or n.wants_output(1)):
        return convert(n)  # (its own error)
    dt = n.dtype(x)
    low = float(np.finfo(dtypes.numpy_dtype(dt)).min) if dtypes.is_float(dt) else \
        float(np.iinfo(dtypes.numpy_dtype(dt)).min)
    fill = 0.0 if n.op_type == "Conv" else low
    pads = [0] * (2 * nd)
    for i, (h, st, k, dil) in enumerate(zip(spatial, strides, kernel, dilations)):
        span = dil * (k - 1) + 1
        if isinstance(h, int) or st == 1:  # as the static converter pads it
            total = span - 1 if st == 1 else max(0, (-(-h // st) - 1) * st + span - h)
            pads[i] = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads[i + nd] = total - pads[i]
            continue
        if span < st:
            raise FrontendError(f"auto_pad {auto} with a window of {span} under stride {st} on symbolic dim {h}")
        length = normalize_dim((sympy.floor((h + st - 1) / st) - 1) * st + span)
        # at run time, from h: total = (ceil(h / s) - 1) * s + span - h, lo its SAME share
        size = n.imp.symbolic_tensor(np.array(h, dtype=object), "a SAME padding")
        steps = n.op("div", n.op("add", size, np.int64(st - 1)), np.int64(st))
        total = n.op("sub", n.op("add", n.op("mul", n.op("sub", steps, np.int64(1)), np.int64(st)), np.int64(span)), size)
        half = n.op("div", total, np.int64(2))
        lo = half if auto == "SAME_UPPER" else n.op("sub", total, half)
        edge = [0] * (2 * (nd + 2))
        edge[2 + i] = edge[2 + i + nd + 2] = span
        padded = n.op("pad", x, pads=tuple(edge), value=fill)
        rows = n.op("add", n.iota((length,), 0), n.op("sub", np.int64(span), lo))
        x = n.op("gather", padded, rows, axis=2 + i)
    n.inputs[0] = x
    n.attrs["auto_pad"] = "NOTSET"
    n.attrs["pads"] = pads
    return convert(n)


# --- RNN, GRU, LSTM over a symbolic number of steps: tg.rnn, a loop inside one op ---
_unrolled_recurrent = CONVERTERS["LSTM"]


@_conv("RNN", "GRU", "LSTM")
def _recurrent_loop(n):
    """A static sequence is unrolled (_recurrent); a symbolic one becomes one tg.rnn per direction."""
    kind = n.op_type
    x = n.x(0)
    layout = n.attr("layout", 0)
    if isinstance(n.shape(x)[1 if layout else 0], int):
        return _unrolled_recurrent(n)
    w, r, b, lens, h0 = n.x(1), n.x(2), n.opt(3), n.opt(4), n.opt(5)
    c0, p = (n.opt(6), n.opt(7)) if kind == "LSTM" else (None, None)
    if lens is not None or n.attr("input_forget", 0) or \
            [a.lower() for a in n.attr("activations", [])] not in ([], [a.lower() for a in RNN_DEFAULT_ACTIVATIONS[kind]]
                                                                    * n.shape(w)[0]):
        raise FrontendError(f"{kind} over a symbolic sequence supports the default activations, no "
                            "sequence_lens, no input_forget")
    x, h0, c0 = time_major(n, layout, x, h0, c0)
    _, batch, _ = n.shape(x)
    directions, gh = n.shape(w)[0], n.shape(w)[1]
    hidden = gh // RNN_GATES[kind]
    direction = n.attr("direction", "forward")
    if (direction == "bidirectional") != (directions == 2):
        raise FrontendError(f"direction '{direction}' does not fit W {n.info(w)}")
    zeros = n.broadcast(n.const(0, n.dtype(x)).reshape(1, 1), (batch, hidden))
    ys, hs, cs = [], [], []
    for d in range(directions):
        def pick(v, shape):
            return n.reshape(n.slice(v, 0, d, d + 1), shape)  # noqa: B023

        operands = [x, pick(w, (gh, n.shape(w)[2])), pick(r, (gh, hidden)),
                    pick(b, (2 * gh,)) if b is not None else n.const(np.zeros(2 * gh), n.dtype(x)),
                    pick(h0, (batch, hidden)) if h0 is not None else zeros]
        if kind == "LSTM":
            operands.append(pick(c0, (batch, hidden)) if c0 is not None else zeros)
            if p is not None:
                operands.append(pick(p, (3 * hidden,)))
        outs = n.op("rnn", *operands, cell=kind.lower(), reverse=direction == "reverse" or d == 1,
                    clip=float(n.attrs.get("clip", 0.0)), linear_before_reset=bool(n.attr("linear_before_reset", 0)))
        ys.append(n.unsqueeze(outs[0], [1]))
        hs.append(n.unsqueeze(outs[1], [0]))
        cs.append(n.unsqueeze(outs[2], [0]) if kind == "LSTM" else None)
    return rnn_outputs(n, kind, ys, hs, cs, layout)
