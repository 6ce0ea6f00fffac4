"""Converters of norms, matmuls, convolutions, pooling, resampling, attention and embeddings."""


from __future__ import annotations

import math

import numpy as np
import torch

from tilegraph.frontends import FrontendError
from tilegraph.ir import decompositions as D, dtypes
from tilegraph.ir.shapes import shape_str
from tilegraph.frontends.torch_export.importer import _TG_TO_TORCH, _same_dim
from tilegraph.frontends.torch_export.registry import _ntuple, converts

aten = torch.ops.aten



@converts("layer_norm.default", "native_layer_norm.default")
def _layer_norm(cv, node, a):
    x = a.input
    y = cv.g.layer_norm(x, a.weight, a.bias, axis=-len(a.normalized_shape), epsilon=a.eps)
    return y if "native" not in str(node.target) else (y, None, None)


@converts("rms_norm.default")
def _rms_norm(cv, node, a):
    x = a.input
    axes = tuple(range(x.rank - len(a.normalized_shape), x.rank))
    eps = a.eps if a.eps is not None else float(torch.finfo(_TG_TO_TORCH[x.dtype]).eps)
    y = D.rms_norm(cv.emit, x, axes, eps)
    return y if a.weight is None else y * a.weight


@converts("batch_norm.default", "_native_batch_norm_legit_no_training.default", "native_batch_norm.default",
          "_native_batch_norm_legit.default", "_native_batch_norm_legit.no_stats")
def _batch_norm(cv, node, a):
    if a.get("training"):
        # The running statistics torch would also update are state, not output: dropped.
        y, _, _ = D.batch_norm_training(cv.emit, a.input, a.weight, a.bias, a.eps)
    elif a.get("running_mean") is None or a.get("running_var") is None:
        raise FrontendError("batch_norm in eval mode without running statistics")
    else:
        y = D.batch_norm(cv.emit, a.input, a.weight, a.bias, a.running_mean, a.running_var, a.eps)
    return y if str(node.target) == "aten.batch_norm.default" else (y, None, None)


@converts("group_norm.default")
def _group_norm(cv, node, a):
    return D.group_norm(cv.emit, a.input, a.num_groups, a.weight, a.bias, a.eps)


@converts("native_group_norm.default")
def _native_group_norm(cv, node, a):
    return (D.group_norm(cv.emit, a.input, a.group, a.weight, a.bias, a.eps), None, None)


# contractions ----------------------------------------------------------------------


@converts("matmul.default", "mm.default", "bmm.default", "mv.default", "dot.default")
def _matmul(cv, node, a):
    dt = cv.meta_dtype(node)
    # The second operand's name differs per overload: other, mat2, vec, tensor.
    other = next(a[k] for k in ("other", "mat2", "vec", "tensor") if k in a)
    return cv.g.matmul(cv.g.cast(a.self, dt), cv.g.cast(other, dt))


@converts("linear.default")
def _linear(cv, node, a):
    w = a.weight
    y = cv.g.matmul(a.input, cv.g.transpose(w, (1, 0)) if w.rank == 2 else w)
    return y if a.bias is None else y + a.bias


@converts("addmm.default", "baddbmm.default", "addmv.default")
def _addmm(cv, node, a):
    m1 = a.get("mat1", a.get("batch1", a.get("mat")))
    m2 = a.get("mat2", a.get("batch2", a.get("vec")))
    y = cv.g.matmul(m1, m2)
    if a.alpha != 1:
        y = y * a.alpha
    if a.beta == 0:  # torch ignores self (even nan) when beta is 0
        return y
    return (a.self * a.beta if a.beta != 1 else a.self) + y


@converts("einsum.default")
def _einsum(cv, node, a):
    return cv.g.einsum(*a.tensors, equation=a.equation)


def _unbatched(cv, x, nd, fn):
    """Run a batched (N, C, *spatial) op on an unbatched (C, *spatial) input too."""
    if x.rank == nd + 1:
        y = fn(cv.g.reshape(x, (1,) + x.shape))
        return cv.g.reshape(y, y.shape[1:])
    return fn(x)


def _conv(cv, x, w, bias, stride, padding, dilation, groups):
    nd = w.rank - 2
    stride, dilation = _ntuple(stride, nd), _ntuple(dilation, nd)
    if isinstance(padding, str):
        if padding == "valid":
            lo = hi = (0,) * nd
        else:  # "same": total d*(k-1), the odd one at the end, as torch
            total = [dilation[i] * (w.shape[2 + i] - 1) for i in range(nd)]
            lo = tuple(t // 2 for t in total)
            hi = tuple(t - t // 2 for t in total)
    else:
        lo = hi = _ntuple(padding, nd)
    return _unbatched(cv, x, nd, lambda xb: cv.g.conv(xb, w, bias, strides=stride, pads=lo + hi,
                                                         dilations=dilation, groups=groups))


@converts("convolution.default", "_convolution.default")
def _convolution(cv, node, a):
    if a.transposed:
        nd = a.weight.rank - 2
        return _unbatched(cv, a.input, nd, lambda xb: _conv_transpose(
            cv, xb, a.weight, a.bias, _ntuple(a.stride, nd), _ntuple(a.padding, nd), _ntuple(a.dilation, nd),
            _ntuple(a.output_padding, nd), a.groups))
    return _conv(cv, a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups)


def _conv_transpose(cv, x, w, bias, stride, padding, dilation, output_padding, groups):
    """The transposed convolution as a stride-1 convolution of x with stride-1 zeros between its
    elements, padded by dilation*(k-1) - padding (cropped where that is negative; output_padding
    more at the end), with the kernel flipped and its in/out channels swapped per group."""
    g, nd = cv.g, w.rank - 2
    if not all(isinstance(d, int) for d in x.shape[2:]):
        raise FrontendError(f"transposed convolution of symbolic spatial dims {x.shape[2:]}")
    for i, s in enumerate(stride):
        a = 2 + i
        if s > 1:
            shape = x.shape
            pads = [0] * (2 * (x.rank + 1))
            pads[x.rank + 1 + a + 1] = s - 1  # s - 1 zeros after each element, on a new axis
            grown = g.pad(g.reshape(x, shape[:a + 1] + (1,) + shape[a + 1:]), pads)
            grown = g.reshape(grown, shape[:a] + (shape[a] * s,) + shape[a + 1:])
            x = g.slice(grown, [0], [(shape[a] - 1) * s + 1], axes=[a])
    for i in range(nd):
        a, k = 2 + i, w.shape[2 + i]
        lo = dilation[i] * (k - 1) - padding[i]
        hi = lo + output_padding[i]
        if lo < 0 or hi < 0:
            x = g.slice(x, [max(-lo, 0)], [x.shape[a] - max(-hi, 0)], axes=[a])
        if lo > 0 or hi > 0:
            pads = [0] * (2 * x.rank)
            pads[a], pads[x.rank + a] = max(lo, 0), max(hi, 0)
            x = g.pad(x, pads)
    cin, cout_g, *kernel = w.shape
    wt = g.reshape(w, (groups, cin // groups, cout_g, *kernel))
    wt = g.reshape(g.transpose(wt, (0, 2, 1, *range(3, 3 + nd))), (groups * cout_g, cin // groups, *kernel))
    wt = g.slice(wt, [-1] * nd, [-(1 << 63) + 1] * nd, axes=list(range(2, 2 + nd)), steps=[-1] * nd)  # flipped
    return g.conv(x, wt, bias, strides=(1,) * nd, pads=(0,) * (2 * nd), dilations=tuple(dilation), groups=groups)


@converts("conv1d.default", "conv2d.default", "conv3d.default", "conv1d.padding", "conv2d.padding",
          "conv3d.padding")
def _convnd(cv, node, a):
    return _conv(cv, a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups)


# pooling ---------------------------------------------------------------------------


def _pool_nd(node) -> int:
    name = str(node.target)
    return 3 if "3d" in name else 1 if "1d" in name else 2


def _fit_window(x, kernel, pads, ceil_mode):
    """With ceil_mode torch accepts a window larger than the padded input (EfficientNet's pooler:
    320 over 1x1) and makes one window of the whole padded input of it; tg's pools take that
    window at its real size, which gives the same single output."""
    if not ceil_mode:
        return kernel
    spatial = x.shape[-len(kernel):]
    return tuple(min(k, s + 2 * p) if isinstance(s, int) else k for k, s, p in zip(kernel, spatial, pads))


def _window(node, a):
    """A pool's spatial rank, window (fitted, see _fit_window), strides (the window by default) and pads."""
    nd = _pool_nd(node)
    kernel = _ntuple(a.kernel_size, nd)
    pads = _ntuple(a.padding, nd)
    return nd, _fit_window(a.self, kernel, pads, a.ceil_mode), _ntuple(a.stride, nd) if a.stride else kernel, pads


@converts("max_pool1d.default", "max_pool2d.default", "max_pool3d.default", "max_pool2d_with_indices.default",
          "max_pool3d_with_indices.default", "max_pool1d_with_indices.default")
def _max_pool(cv, node, a):
    nd, kernel, stride, pads = _window(node, a)
    y = _unbatched(cv, a.self, nd, lambda xb: cv.g.max_pool(xb, kernel=kernel, strides=stride, pads=pads + pads,
                                                             dilations=_ntuple(a.dilation, nd), ceil_mode=a.ceil_mode))
    return (y, None) if "indices" in str(node.target) else y


@converts("avg_pool1d.default", "avg_pool2d.default", "avg_pool3d.default")
def _avg_pool(cv, node, a):
    nd, kernel, stride, pads = _window(node, a)
    divisor = a.get("divisor_override")
    if divisor is not None and a.ceil_mode:
        raise FrontendError("avg_pool with both divisor_override and ceil_mode is not supported")
    include = a.count_include_pad or divisor is not None

    def pool(xb):
        y = cv.g.avg_pool(xb, kernel=kernel, strides=stride, pads=pads + pads, ceil_mode=a.ceil_mode,
                          count_include_pad=include)
        # Every window then averages exactly prod(kernel) terms: rescale to the divisor.
        return y if divisor is None else y * (math.prod(kernel) / divisor)

    return _unbatched(cv, a.self, nd, pool)


def _adaptive(cv, node, x, output_size, kind):
    nd = len(output_size)
    spatial = x.shape[-nd:]
    out = [s if o is None else o for s, o in zip(spatial, output_size)]
    if all(o == 1 for o in out):
        axes = tuple(range(x.rank - nd, x.rank))
        return cv.g.mean(x, axes, keepdims=True) if kind == "avg" else cv.g.amax(x, axes, keepdims=True)
    if not all(isinstance(s, int) and s % o == 0 for s, o in zip(spatial, out)):
        raise FrontendError(f"adaptive pooling from {shape_str(spatial)} to {tuple(out)} is supported only "
                            "when each output size divides its input size")
    # Divisible sizes: torch's windows [floor(i*in/out), ceil((i+1)*in/out)) are the
    # fixed windows of a pool with kernel = stride = in/out.
    kernel = tuple(s // o for s, o in zip(spatial, out))
    op = cv.g.avg_pool if kind == "avg" else cv.g.max_pool
    return _unbatched(cv, x, nd, lambda xb: op(xb, kernel=kernel, strides=kernel))


@converts("adaptive_avg_pool1d.default", "adaptive_avg_pool2d.default", "_adaptive_avg_pool2d.default",
          "adaptive_avg_pool3d.default", "_adaptive_avg_pool3d.default")
def _adaptive_avg(cv, node, a):
    return _adaptive(cv, node, a.self, list(a.output_size), "avg")


@converts("adaptive_max_pool1d.default", "adaptive_max_pool2d.default")
def _adaptive_max(cv, node, a):
    return (_adaptive(cv, node, a.self, list(a.output_size), "max"), None)


_NEAREST = [f"{kind}{n}d.{o}" for kind in ("upsample_nearest", "_upsample_nearest_exact") for n in (1, 2, 3)
            for o in ("default", "vec")]


@converts(*_NEAREST)
def _upsample_nearest(cv, node, a):
    """Nearest upsampling as one gather per spatial axis, of torch's source indices."""
    x = a.get("input", a.get("self"))
    nd = x.rank - 2
    out = cv.meta_shape(node)[2:]
    scales = a.get("scale_factors") or [v for k, v in a.items() if k.startswith("scales")] or [None] * nd
    exact = "exact" in str(node.target)
    for i in range(nd):
        size, n = x.shape[2 + i], out[i]
        if not (isinstance(size, int) and isinstance(n, int)):
            raise FrontendError(f"nearest upsampling of a symbolic size ({size} -> {n})")
        # ATen: src = min(floor((dst [+ 0.5]) * scale), in - 1), scale = 1/scale_factor
        # when one was given, else in/out; computed in float32 as ATen does.
        scale = np.float32(1.0 / scales[i] if scales[i] else size / n)
        dst = np.arange(n, dtype=np.float32) + np.float32(0.5 if exact else 0.0)
        src = np.minimum(np.floor(dst * scale).astype(np.int64), size - 1)
        if not (n == size and np.array_equal(src, np.arange(n))):
            x = cv.g.gather(x, cv.g.constant(src), axis=2 + i)
    return x


_LINEAR = [f"{kind}.{o}" for kind in ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d")
           for o in ("default", "vec")]


@converts(*_LINEAR)
def _upsample_linear(cv, node, a):
    """(Bi/tri)linear upsampling, one axis at a time: two gathers of torch's source taps and
    their weights, all computed here from the static sizes (ATen's upsample_linear rules)."""
    x = a.get("input", a.get("self"))
    nd = x.rank - 2
    out = cv.meta_shape(node)[2:]
    scales = a.get("scale_factors") or [v for k, v in a.items() if k.startswith("scales")] or [None] * nd
    corners = bool(a.align_corners)
    dtype = dtypes.numpy_dtype(x.dtype)
    for i in range(nd):
        size, n = x.shape[2 + i], out[i]
        if not (isinstance(size, int) and isinstance(n, int)):
            raise FrontendError(f"linear upsampling of a symbolic size ({size} -> {n})")
        # area_pixel_compute_scale / _source_index, in float32 as ATen computes them for float32
        if corners:
            scale = np.float32((size - 1) / (n - 1) if n > 1 else 0.0)
            src = np.arange(n, dtype=np.float32) * scale
        else:
            scale = np.float32(1.0 / scales[i] if scales[i] else size / n)
            src = np.maximum((np.arange(n, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5), 0)
        lo = src.astype(np.int64)
        hi = np.minimum(lo + 1, size - 1)
        frac = (src - lo).astype(dtype)
        shape = [1] * x.rank
        shape[2 + i] = n
        near = cv.g.gather(x, cv.g.constant(lo), axis=2 + i)
        far = cv.g.gather(x, cv.g.constant(hi), axis=2 + i)
        x = (near * cv.g.constant((1 - frac).reshape(shape).astype(dtype))
             + far * cv.g.constant(frac.reshape(shape)))
    return x


# attention and embedding -------------------------------------------------------------


def _sdpa(cv, node, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    if dropout_p:
        raise FrontendError(f"attention dropout_p={dropout_p}; pass dropout_p=0 at inference")
    if scale is None:
        if not isinstance(q.shape[-1], int):
            raise FrontendError("attention with a symbolic head dim needs an explicit scale")
        scale = 1.0 / math.sqrt(q.shape[-1])
    if enable_gqa and q.rank >= 3 and not _same_dim(q.shape[-3], k.shape[-3]):
        k, v = (_repeat_heads(cv, t, q.shape[-3]) for t in (k, v))
    lq, lk = q.shape[-2], k.shape[-2]
    user_mask = mask is not None
    causal = False
    if is_causal:
        if _same_dim(lq, lk):
            causal = True  # tg's causal mask then equals torch's (top-left aligned) one
        elif isinstance(lq, int) and isinstance(lk, int):
            mask = cv.g.constant(np.tril(np.ones((lq, lk), dtype=bool)))
        else:
            raise FrontendError(f"causal attention with query length {lq} != key length {lk} (symbolic)")
    if mask is not None and mask.dtype != "i1":
        mask = cv.g.cast(mask, q.dtype)
    out = cv.g.attention(q, k, v, mask, scale=float(scale), causal=causal)
    if user_mask:
        # torch returns 0, not nan, for a query row whose every key is masked out.
        # (A causal mask, torch's top-left aligned one, never masks a whole row.)
        keep = mask if mask.dtype == "i1" else cv.g.op("ne", mask, cv.const(-np.inf, mask.dtype))
        out = cv.g.where(cv.g.op("reduce_max", keep, axes=(keep.rank - 1,), keepdims=True), out, 0.0)
    return out


def _repeat_heads(cv, t, heads):
    """(..., Hk, S, E) -> (..., heads, S, E), each kv head repeated heads/Hk times in a row."""
    hk = t.shape[-3]
    rep = heads // hk
    lead = t.shape[:-3]
    x = cv.g.reshape(t, lead + (hk, 1) + t.shape[-2:])
    x = cv.g.broadcast(x, lead + (hk, rep) + t.shape[-2:])
    return cv.g.reshape(x, lead + (heads,) + t.shape[-2:])


@converts("scaled_dot_product_attention.default")
def _attention(cv, node, a):
    return _sdpa(cv, node, a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, a.scale, a.enable_gqa)


@converts("_scaled_dot_product_flash_attention_for_cpu.default")
def _attention_cpu(cv, node, a):
    out = _sdpa(cv, node, a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, a.scale, False)
    return (out, None)


@converts("embedding.default")
def _embedding(cv, node, a):
    return cv.g.gather(a.weight, a.indices, axis=0)
