"""The PyTorch frontend imports what torch.export gives and computes what torch computes.

Every case is a small nn.Module: it is exported, converted, compiled with
`tilegraph.compile` (fp32) and compared with the same module run by torch in
float64 (floats widened, default dtype float64), within the fp32 tolerance of
`tilegraph.testing` for the case's longest reduction. Integer and boolean
results must match exactly, and every result has torch's dtype.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import tilegraph
from tilegraph.frontends import FrontendError
from tilegraph.frontends.torch_export import from_exported_program, from_torch, load_pt2
from tilegraph.ir import dtypes
from tilegraph.testing import assert_close


class Fn(nn.Module):
    """A module whose forward is a function, so one-line cases stay one line."""

    def __init__(self, fn, **children):
        super().__init__()
        self.fn = fn
        for name, child in children.items():
            self.add_module(name, child)

    def forward(self, *xs):
        return self.fn(self, *xs)


def reference(module: nn.Module, inputs) -> list[torch.Tensor]:
    """The module's result computed by torch in float64 (weights, inputs and defaults)."""
    m64 = copy.deepcopy(module).double().eval()
    args = [x.double() if x.is_floating_point() else x for x in inputs]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            out = m64(*args)
    finally:
        torch.set_default_dtype(previous)
    return list(out) if isinstance(out, (tuple, list)) else [out]


# The two op levels a program can arrive at: as torch.export gives it (linear,
# layer_norm, scaled_dot_product_attention, ...) and decomposed to core ATen
# (addmm, native_layer_norm, max_pool2d_with_indices, constant_pad_nd, ...).
LEVELS = ["export", "core_aten"]


def import_at(level: str, module: nn.Module, inputs: tuple):
    if level == "export":
        return from_torch(module, inputs)
    return from_exported_program(torch.export.export(module.eval(), inputs).run_decompositions())


def check(module: nn.Module, inputs: tuple, n: int = 1, dynamic_shapes=None, model=None, level="export"):
    """Import, compile and run `module`; compare with torch. n: the longest reduction."""
    module = module.eval()
    if model is None:
        model = from_torch(module, inputs, dynamic_shapes) if dynamic_shapes else import_at(level, module, inputs)
    outs = tilegraph.compile(model).run(*inputs)
    with torch.no_grad():
        eager = module(*inputs)
    eager = list(eager) if isinstance(eager, (tuple, list)) else [eager]
    expected = reference(module, inputs)
    assert len(outs) == len(eager), f"{len(outs)} outputs, torch gives {len(eager)}"
    for i, (a, t, e) in enumerate(zip(outs, eager, expected)):
        want = dtypes.dtype_name(t.numpy().dtype)
        assert dtypes.dtype_name(a.dtype) == want, f"output {i}: dtype {a.dtype}, torch gives {t.dtype}"
        ref = e.numpy() if dtypes.is_float(want) else t.numpy()  # integers: exact, as torch computes them
        assert_close(a, ref, want, reduction_length=n, name=f"output {i}")
    return model


# Deterministic cases whatever runs first (pytest -n 2 splits them over processes):
# module weights come from torch's global generator, seeded as this file loads;
# inputs from `_gen`, reseeded before every test.
torch.manual_seed(0)
_gen = torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True)
def _seeded_inputs():
    _gen.manual_seed(1)


def r(*shape):
    return torch.randn(*shape, generator=_gen)


def pos(*shape):
    return torch.rand(*shape, generator=_gen) + 0.25


def ints(*shape, lo=-9, hi=10):
    return torch.randint(lo, hi, shape, generator=_gen)


def nonzero_ints(*shape):
    v = ints(*shape, lo=1, hi=5)
    return v * torch.where(ints(*shape, lo=0, hi=2) > 0, 1, -1)


# --- elementwise ----------------------------------------------------------------------

ELEMENTWISE = {
    "arithmetic": (lambda m, x, y: (x + y, x - 2.5 * y, x * y, x / (y.abs() + 0.5), torch.add(x, y, alpha=3),
                                    torch.sub(x, y, alpha=0.5), torch.rsub(x, 2.0)), lambda: (r(3, 4), r(4))),
    "scalars": (lambda m, x: (x + 1, 2 - x, x * 3, x / 4, 1 / (x.abs() + 1), x ** 2, 2 ** x, x.pow(3)),
                lambda: (r(3, 4),)),
    "int_promotion": (lambda m, i, x: (i + x, i * 2.5, i / 3, (i * 2) // 3, i % 3, torch.fmod(i, 4),
                                       torch.div(i, 4, rounding_mode="trunc"), torch.div(i, 4, rounding_mode="floor"),
                                       i + 1, -i, i.abs()), lambda: (ints(3, 5), r(5))),
    "float_rounding_div": (lambda m, x, y: (torch.div(x, y, rounding_mode="floor"), torch.fmod(x, y),
                                            torch.div(x, y, rounding_mode="trunc"), torch.remainder(x, y), x // y),
                           lambda: (ints(4, 5).float(), nonzero_ints(4, 5).float())),
    "max_min_clamp": (lambda m, x, y: (torch.maximum(x, y), torch.minimum(x, y), x.clamp(-0.5, 0.5), x.clamp(min=0),
                                       x.clamp(max=0.1), torch.clamp(x, y - 1, y + 1), F.hardtanh(x), F.relu6(x * 4)),
                      lambda: (r(3, 4), r(3, 4))),
    "compare_logical_where": (lambda m, x, y: (x > y, x <= 0.5, x == x, x != y, x >= y, x < 0, (x > 0) & (y > 0),
                                               (x > 0) | (y < 0), ~(x > 0), torch.logical_xor(x > 0, y > 0),
                                               torch.logical_not(x > 0), torch.where(x > y, x, y),
                                               torch.where(x > 0, x, 0.0), x.masked_fill(x < 0, -1.0)),
                              lambda: (r(3, 4), r(4))),
    "compare_int_float": (lambda m, i, x: (i > x, i == 2, i < 2.5), lambda: (ints(3, 4), r(3, 4))),
    "unary_math": (lambda m, x, p: (x.exp(), p.log(), p.sqrt(), p.rsqrt(), x.abs(), -x, x.sin(), x.cos(), x.tanh(),
                                    x.sigmoid(), torch.erf(x), p.reciprocal(), torch.expm1(x * 1e-6),
                                    torch.log1p(x * 1e-6), p.log2(), p.log10(), torch.exp2(x), x.square(), x.atan(),
                                    (x / 4).asin()), lambda: (r(3, 4), pos(3, 4))),
    "rounding": (lambda m, x: (x.floor(), x.ceil(), x.round(), x.trunc(), x.sign(), x.frac(), x.round(decimals=2)),
                 lambda: (r(4, 5) * 3,)),
    "activations": (lambda m, x: (F.relu(x), F.gelu(x), F.gelu(x, approximate="tanh"), F.silu(x), F.leaky_relu(x, 0.1),
                                  F.elu(x), F.selu(x), F.celu(x, 0.5), F.softplus(x, beta=2, threshold=3),
                                  F.hardswish(x), F.hardsigmoid(x), F.mish(x), torch.sigmoid(x), torch.tanh(x)),
                    lambda: (r(4, 6) * 3,)),
    "nonfinite": (lambda m, x: (x.isnan(), x.isinf(), x.isfinite(), x.isposinf(), x.isneginf()),
                  lambda: (torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0]),)),
}


@pytest.mark.parametrize("case", list(ELEMENTWISE))
@pytest.mark.parametrize("level", LEVELS)
def test_elementwise_matches_torch(case, level):
    fn, make = ELEMENTWISE[case]
    check(Fn(fn), make(), level=level)


# --- reductions, softmax, normalization -----------------------------------------------

REDUCTIONS = {
    "sum_mean": (lambda m, x: (x.sum(), x.sum(1), x.sum((0, 2), keepdim=True), x.mean(-1), x.mean((1, 2)), x.mean()),
                 60),
    "max_min_prod_arg": (lambda m, x: (x.amax(1), x.amin((0, 2), keepdim=True), x.max(), x.min(), *torch.max(x, 1),
                                       *torch.min(x, -1, keepdim=True), x.prod(2), x.argmax(1), x.argmin(),
                                       x.argmax(2, keepdim=True)), 5),
    "var_std_norms": (lambda m, x: (x.var(1), x.std((0, 2), keepdim=True), x.var(correction=0),
                                    torch.logsumexp(x, 1), torch.linalg.vector_norm(x, dim=1),
                                    torch.linalg.vector_norm(x, ord=1, dim=2),
                                    torch.linalg.vector_norm(x, ord=float("inf")),
                                    torch.var_mean(x, 2)[0],
                                    # no correction given: aten's default, 1 (unbiased)
                                    x.var(), torch.var(x, 1, correction=None)), 60),
    "any_all_cumsum_count": (lambda m, x: ((x > 0).any(1), (x > 0).all(), x.cumsum(1), (x > 0).sum(1),
                                           torch.count_nonzero(x > 0.5, dim=2)), 5),
    "topk_sort_cumprod": (lambda m, x: (*torch.topk(x, 2, 1), *torch.topk(x, 3, largest=False), *x.sort(0),
                                        *x.sort(dim=-1, descending=True, stable=True), x.argsort(1), x.cumprod(2)), 5),
    "softmax": (lambda m, x: (torch.softmax(x, -1), torch.softmax(x, 0), F.log_softmax(x, 1), F.log_softmax(x, -1)), 5),
}


@pytest.mark.parametrize("case", list(REDUCTIONS))
@pytest.mark.parametrize("level", LEVELS)
def test_reductions_match_torch(case, level):
    fn, n = REDUCTIONS[case]
    check(Fn(fn), (r(3, 4, 5),), n=n, level=level)


def _with_stats(bn):
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=_gen)
        bn.bias.uniform_(-0.2, 0.2, generator=_gen)
        bn.running_mean.uniform_(-0.3, 0.3, generator=_gen)
        bn.running_var.uniform_(0.5, 2.0, generator=_gen)
    return bn


NORMS = {
    "layer_norm": (nn.LayerNorm(8), (3, 5, 8), 8),
    "layer_norm_2d_no_affine": (nn.LayerNorm((5, 8), elementwise_affine=False), (3, 5, 8), 40),
    "group_norm": (nn.GroupNorm(2, 6), (2, 6, 4, 4), 48),
    "rms_norm": (nn.RMSNorm(8, eps=1e-6), (3, 5, 8), 8),
    "batch_norm_2d": (_with_stats(nn.BatchNorm2d(6)), (2, 6, 4, 4), 1),
    "batch_norm_1d": (_with_stats(nn.BatchNorm1d(6)), (4, 6), 1),
    "batch_norm_1d_seq": (_with_stats(nn.BatchNorm1d(6)), (2, 6, 7), 1),
    "instance_norm": (nn.InstanceNorm2d(6, affine=True), (2, 6, 4, 5), 20),
    "instance_norm_1d": (nn.InstanceNorm1d(6), (2, 6, 7), 7),
}


@pytest.mark.parametrize("case", list(NORMS))
@pytest.mark.parametrize("level", LEVELS)
def test_normalization_matches_torch(case, level):
    module, shape, n = NORMS[case]
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1 and not isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d):
                p.copy_(torch.randn(p.shape, generator=_gen))
    check(module, (r(*shape),), n=n, level=level)


# --- contractions, convolution, pooling -----------------------------------------------


CONTRACTIONS = {
    "matmul_family": (Fn(lambda m, a, b, c, v: (a @ b, v @ b, torch.bmm(a[0], c), torch.mm(a[0, 0], b),
                                                 torch.einsum("bij,jk->bik", a[0], b), b.t() @ v,
                                                 torch.addmm(b[0], a[0, 0], b, beta=0.5, alpha=2.0),
                                                 torch.baddbmm(a[0], a[0], c[:, :, :5]))),
                      (r(2, 3, 4, 5), r(5, 6), r(3, 5, 6), r(5)), 6),
    "linear": (Fn(lambda m, x: (m.fc(x), m.nobias(x)), fc=nn.Linear(8, 5), nobias=nn.Linear(8, 3, bias=False)),
               (r(2, 3, 8),), 8),
    "conv2d": (Fn(lambda m, x: (m.a(x), m.b(x), m.c(x), m.d(x), m.e(x)),
                  a=nn.Conv2d(3, 6, 3, stride=2, padding=1), b=nn.Conv2d(3, 4, 3, dilation=2, bias=False),
                  c=nn.Conv2d(3, 6, 3, groups=3, padding="same"), d=nn.Conv2d(3, 2, (2, 3), padding="valid"),
                  e=nn.Conv2d(3, 2, 3, padding=1, padding_mode="reflect")), (r(2, 3, 9, 9),), 27),
    "conv1d": (Fn(lambda m, x: (m.a(x), m.b(x), m.a(x[0])), a=nn.Conv1d(4, 6, 3, stride=2, padding=2),
                  b=nn.Conv1d(4, 4, 4, padding="same", groups=2)), (r(2, 4, 11),), 12),
    "pool2d": (Fn(lambda m, x: (F.max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 2, ceil_mode=True),
                                F.avg_pool2d(x, 2), F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
                                F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), F.avg_pool2d(x, 2, divisor_override=3),
                                F.adaptive_avg_pool2d(x, (3, 1)), F.adaptive_avg_pool2d(x, 1),
                                F.adaptive_max_pool2d(x, 3), F.max_pool2d(x, 3, 1, dilation=2),
                                # ceil_mode windows larger than the input (EfficientNet's pooler)
                                F.avg_pool2d(x, 12, ceil_mode=True), F.max_pool2d(x, (10, 2), ceil_mode=True))),
               (r(2, 3, 9, 9),), 9),
    "upsample_nearest": (Fn(lambda m, x: (F.interpolate(x, scale_factor=2), F.interpolate(x, size=(7, 4)),
                                          F.interpolate(x, scale_factor=1.5, mode="nearest-exact"),
                                          F.interpolate(x[:, :, 0], scale_factor=3), m.up(x)),
                            up=nn.Upsample(scale_factor=(2, 1))), (r(1, 2, 3, 5),), 1),
    "conv_transpose": (Fn(lambda m, x: (m.a(x), m.b(x), m.c(x[:, :, 0]), m.a(x[0])),
                          a=nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1),
                          b=nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 3), padding=(2, 0), dilation=2, groups=2),
                          c=nn.ConvTranspose1d(4, 2, 4, stride=3, padding=2, bias=False)), (r(2, 4, 5, 5),), 24),
    "upsample_linear": (Fn(lambda m, x: (F.interpolate(x, scale_factor=2, mode="bilinear"),
                                         F.interpolate(x, size=(7, 4), mode="bilinear", align_corners=True),
                                         F.interpolate(x, scale_factor=1.7, mode="bilinear"),
                                         F.interpolate(x[:, :, 0], size=9, mode="linear"),
                                         F.interpolate(x[:, :, None], scale_factor=2, mode="trilinear"))),
                        (r(1, 2, 3, 5),), 2),
    "pool1d": (Fn(lambda m, x: (F.max_pool1d(x, 3, 2), F.avg_pool1d(x, 2), F.adaptive_avg_pool1d(x, 4),
                                F.max_pool2d(x, 2))), (r(2, 3, 8),), 3),
}


@pytest.mark.parametrize("case", list(CONTRACTIONS))
@pytest.mark.parametrize("level", LEVELS)
def test_contractions_and_pools_match_torch(case, level):
    module, inputs, n = CONTRACTIONS[case]
    check(module, inputs, n=n, level=level)


def test_small_cnn_block_keeps_ops_whole():
    """conv2d, batch_norm, max_pool2d and linear arrive as tg ops, not as their pieces."""
    module = Fn(lambda m, x: m.fc(F.max_pool2d(F.relu(m.bn(m.conv(x))), 2).flatten(1)),
                conv=nn.Conv2d(3, 4, 3, padding=1), bn=_with_stats(nn.BatchNorm2d(4)), fc=nn.Linear(64, 5))
    model = check(module, (r(2, 3, 8, 8),), n=64)
    ops = re.findall(r"= (tg\.\w+)", model.text)
    assert ops.count("tg.conv") == 1 and ops.count("tg.max_pool") == 1 and ops.count("tg.matmul") == 1


# --- attention --------------------------------------------------------------------------


def _bool_mask():
    mask = torch.rand(2, 1, 4, 6, generator=_gen) > 0.4
    mask[:, :, 0, :] = False  # one query sees no key: torch gives 0 there, not nan
    mask[:, :, 1, :] = True
    return mask


ATTENTION = {
    "plain": (lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v),
              (r(2, 3, 4, 8), r(2, 3, 6, 8), r(2, 3, 6, 5))),
    "float_mask_scale": (lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3),
                         (r(2, 3, 4, 8), r(2, 3, 6, 8), r(2, 3, 6, 5), r(4, 6))),
    "bool_mask": (lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                  (r(2, 3, 4, 8), r(2, 3, 6, 8), r(2, 3, 6, 5), _bool_mask())),
    "causal": (lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
               (r(2, 3, 5, 8), r(2, 3, 5, 8), r(2, 3, 5, 8))),
    "causal_query_shorter": (lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                             (r(1, 2, 3, 8), r(1, 2, 5, 8), r(1, 2, 5, 8))),
    "grouped_query": (lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                      (r(1, 4, 3, 8), r(1, 2, 5, 8), r(1, 2, 5, 8))),
}


@pytest.mark.parametrize("case", list(ATTENTION))
@pytest.mark.parametrize("level", LEVELS)
def test_attention_matches_torch(case, level):
    fn, inputs = ATTENTION[case]
    model = check(Fn(fn), inputs, n=8, level=level)
    if level == "export":
        assert "tg.attention" in model.text  # one composite, not its pieces


def test_multihead_attention_module():
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    module = Fn(lambda m, x: m.mha(x, x, x, need_weights=False)[0], mha=mha)
    check(module, (r(2, 5, 16),), n=16)


# --- indexing and layout ---------------------------------------------------------------

LAYOUT = {
    "embedding_gather": (lambda m, x, i: (m.emb(i), m.pad(i), x.index_select(1, i[0]), torch.gather(x, 1, i[:, :3] % 5),
                                          x[i[0]], x[:, i[1]], F.embedding(i, x)),
                         lambda: (r(6, 5), ints(2, 4, lo=0, hi=5)), dict(emb=nn.Embedding(10, 3),
                                                                       pad=nn.Embedding(10, 3, padding_idx=0))),
    "advanced_indexing": (lambda m, x, i: (x[i[0], i[1]], x[:, i[0], i[1] % 3], x[i[0], :, i[1] % 3 - 3],
                                           x[i[:, :1], i[1]], x[i]),
                          lambda: (r(6, 4, 3), ints(2, 5, lo=0, hi=4)), {}),
    "scatter": (lambda m, x, i, d: (x.scatter(1, i, x[:, 2:] * 2), x.scatter(1, i, 2.5), x.scatter_add(1, d, x[:, :3]),
                                    x.scatter_reduce(1, d, x[:, :3], "amax"),
                                    torch.scatter(x, 1, d, x[:, 1:4], reduce="multiply")),
                lambda: (r(4, 6), torch.argsort(torch.rand(4, 6, generator=_gen), 1)[:, :2],
                         ints(4, 3, lo=0, hi=6)), {}),
    "views": (lambda m, x: (x.view(4, 15), x.reshape(-1), x.permute(2, 0, 1), x.transpose(0, 2), x[0].t(),
                            x.unsqueeze(1), x[:, :1].squeeze(1), x[None].squeeze(), x.flatten(1), x.flatten(),
                            x.unflatten(2, (5, 1)), x[:, :1].expand(4, 6, 5), x[0].expand_as(x), x.mT.contiguous(),
                            x.movedim(0, -1), x.swapaxes(0, 1)), lambda: (r(4, 3, 5),), {}),
    "cat_split": (lambda m, x, i: (torch.cat([x, x * 2], 1), torch.stack([x, x], 2), *x.split(2, 1),
                                   *x.split([1, 4], 1), *x.chunk(3, 0), *x.unbind(0), torch.cat([i, x], 1),
                                   torch.hstack([x, x]), *torch.tensor_split(x, 3, 1)),
                  lambda: (r(3, 5), ints(3, 2)), {}),
    "slicing": (lambda m, x: (x[1:3], x[:, ::2], x[..., -2:], x[-1], x.select(1, 0), x.narrow(0, 1, 2), x[:, None],
                              x.flip(0), x.flip((1, 2)), x.repeat(2, 1, 3), x[0].tril(), x[0].triu(1), x[:, 1:-1, 2],
                              x[0].repeat(2, 1, 1)), lambda: (r(4, 5, 6),), {}),
    "pad": (lambda m, x: (F.pad(x, (1, 2)), F.pad(x, (1, 1, 2, 0), value=3.0), F.pad(x, (2, 1, 1, 2), mode="reflect"),
                          F.pad(x, (1, 1, 1, 1), mode="replicate"), F.pad(x, (1, 2, 0, 1), mode="circular"),
                          F.pad(x, (-1, 1))), lambda: (r(2, 3, 4, 5),), {}),
}


@pytest.mark.parametrize("case", list(LAYOUT))
@pytest.mark.parametrize("level", LEVELS)
def test_layout_matches_torch(case, level):
    fn, make, children = LAYOUT[case]
    check(Fn(fn, **children), make(), level=level)


# --- creation and casts ---------------------------------------------------------------

CREATION = {
    "static": (lambda m, x: (x + torch.arange(5), torch.arange(1, 10, 2.5) * 1.0, torch.arange(2, 7) + x.long(),
                             torch.zeros_like(x), torch.ones(3), torch.full((2, 3), 7.0), torch.full_like(x, 2),
                             x.new_ones(2), x.new_zeros((2, 2)) + 1, torch.zeros(x.shape[0], dtype=torch.int32),
                             torch.tensor([1.5, -2.0]) * x[0, :2], torch.eye(3), torch.empty(2, 2).fill_(4.0),
                             torch.ones(2, 2, dtype=torch.bool))),
    "casts": (lambda m, x: (x.to(torch.int32), x.long(), (x > 0).float(), (x > 0).long() * 3, x.half(), x.double(),
                            x.int().float(), x.type_as(torch.tensor([1], dtype=torch.int16)))),
}


@pytest.mark.parametrize("case", list(CREATION))
@pytest.mark.parametrize("level", LEVELS)
def test_creation_and_casts_match_torch(case, level):
    check(Fn(CREATION[case]), (r(4, 5) * 3,), level=level)


def test_in_place_ops_are_functionalized():
    """The training IR keeps x.add_ and index assignment; the frontend decomposes them away."""

    def fn(m, x):
        y = x.clone()
        y.add_(1.0)
        y[0] = 5.0
        y[:, 1:3] = x[:, :2] * 3
        y[1, :] = x[2]
        y.relu_()
        z = x.clone()
        z[z > 0.5] = -1.0
        z[:, -1] += 1
        w = x.clone()
        w[torch.tensor([0, 2])] = x[1] * 3
        w.index_put_((torch.tensor([1, 1]), torch.tensor([0, 3])), torch.tensor(1.5), accumulate=True)
        return y * 2, z, w

    check(Fn(fn), (r(3, 4),))


# --- both op levels ---------------------------------------------------------------------


BLOCKS = {
    "cnn": (Fn(lambda m, x: m.fc(F.adaptive_avg_pool2d(F.relu(m.bn(m.conv(x))), 1).flatten(1)),
               conv=nn.Conv2d(3, 4, 3), bn=_with_stats(nn.BatchNorm2d(4)), fc=nn.Linear(4, 3)),
            (r(2, 3, 8, 8),), 36),
    "transformer_block": (Fn(lambda m, x: m.ln(x + F.scaled_dot_product_attention(
        *[m.qkv(x).view(2, 5, 3, 2, 4)[:, :, i].transpose(1, 2) for i in range(3)], is_causal=True
    ).transpose(1, 2).reshape(2, 5, 8)), qkv=nn.Linear(8, 24), ln=nn.LayerNorm(8)), (r(2, 5, 8),), 8),
    "log_softmax_gelu": (Fn(lambda m, x: F.log_softmax(F.gelu(m.fc(x)), -1), fc=nn.Linear(6, 7)), (r(3, 6),), 7),
}


@pytest.mark.parametrize("case", list(BLOCKS))
def test_core_aten_form_imports_the_same(case):
    """A program already decomposed to core ATen (addmm, native_layer_norm, _softmax,
    convolution, ...) converts and computes what the training-IR form does."""
    module, inputs, n = BLOCKS[case]
    ep = torch.export.export(module.eval(), inputs).run_decompositions()
    assert any("native" in str(node.target) or "addmm" in str(node.target) for node in ep.graph.nodes)
    check(module, inputs, n=n, model=from_exported_program(ep))
    check(module, inputs, n=n)


# --- dynamic shapes ---------------------------------------------------------------------


class TwoInputs(Fn):
    """Dynamic-shape specs follow forward's parameters, so these cases name them."""

    def forward(self, x, y):
        return self.fn(self, x, y)


def test_dynamic_dims_become_named_symbols():
    module = TwoInputs(lambda m, x, y: m.fc(x) + y.sum(1, keepdim=True), fc=nn.Linear(8, 4))
    batch = Dim("batch", max=64)
    model = from_torch(module, (r(3, 8), r(3, 2)), dynamic_shapes={"x": {0: batch}, "y": {0: batch}})
    assert 'tensor<?x8xf32, ["batch"]>' in model.text
    assert 'tensor<?x4xf32, ["batch"]>' in model.text
    compiled = tilegraph.compile(model)
    for b in (1, 5):
        x, y = r(b, 8), r(b, 2)
        assert_close(compiled(x, y), reference(module, (x, y))[0], "f32", 8)


def test_size_arithmetic_under_dynamic_shapes():
    """Sizes used as values: a symbolic arange, a slice to a symbolic bound, a view by
    computed sizes, a size as a tensor operand."""

    def fn(m, x, table):
        n = x.shape[1]
        pos = torch.arange(n) + 1
        flat = x.reshape(x.shape[0] * n)
        window = table[:, 1 : n + 1]  # a fixed-size buffer cut to a symbolic length
        return x * pos, x[:, : n - 1], flat, x / n, window + x, table[:, :n] * 2, torch.ones_like(x) * 2

    module = TwoInputs(fn)
    seq = Dim("seq", min=3, max=14)
    x, table = r(3, 6), r(3, 16)
    model = from_torch(module, (x, table), dynamic_shapes={"x": {1: seq}, "y": None})
    assert '["seq"]' in model.text
    compiled = tilegraph.compile(model)
    for n in (6, 9):
        x = r(3, n)
        for a, e in zip(compiled.run(x, table), reference(module, (x, table))):
            assert_close(a, e, "f32")


def test_unnamed_dynamic_dim_keeps_torch_symbol():
    module = TwoInputs(lambda m, x, y: x.softmax(-1) * y)
    model = from_torch(module, (r(4, 8), r(8)), dynamic_shapes={"x": {0: Dim.AUTO}, "y": None})
    (name,) = [str(d) for d in model.inputs[0].shape if not isinstance(d, int)]
    assert re.fullmatch(r"s\d+", name), name
    x, y = r(7, 8), r(8)
    assert_close(tilegraph.compile(model)(x, y), reference(module, (x, y))[0], "f32", 8)


# --- errors -------------------------------------------------------------------------------


def test_every_unsupported_op_is_listed_in_one_error():
    module = Fn(lambda m, x: torch.cummax(x, 1)[0] + torch.searchsorted(torch.tensor([0.0, 0.5]), x)
                + torch.cummax(x * 2, 1)[0])
    with pytest.raises(FrontendError) as err:
        from_torch(module, (r(3, 4),))
    text = str(err.value)
    assert "2 unsupported op(s)" in text
    assert re.search(r"aten\.cummax\.\w+\s+x2\s+\(first at node 'cummax\w*'\)", text), text
    assert re.search(r"aten\.searchsorted\.\w+\s+x1\s+\(first at node 'searchsorted\w*'\)", text), text


def test_training_mode_dropout_names_the_node():
    module = Fn(lambda m, x: m.drop(x) * 2, drop=nn.Dropout(0.5)).train()
    ep = torch.export.export(module, (r(3, 4),))
    with pytest.raises(FrontendError, match=r"node 'dropout\w*' \(aten\.dropout\.default\): dropout in training mode"):
        from_exported_program(ep)


def test_export_failure_is_a_frontend_error():
    def fn(m, x):
        return x * 2 if x.sum() > 0 else x  # data-dependent control flow

    with pytest.raises(FrontendError, match="torch.export.export failed for Fn"):
        from_torch(Fn(fn), (r(3),))


def test_unsupported_arguments_name_the_node():
    module = Fn(lambda m, x: m.up(x), up=nn.ConvTranspose2d(2, 2, 3))
    with pytest.raises(FrontendError, match=r"node '\w+' \(aten\.\w+\.\w+\).*transposed convolution of symbolic"):
        from_torch(module, (r(1, 2, 5, 5),), dynamic_shapes=(({2: Dim("h", min=2, max=64)},),))


# --- weights, modes, files ----------------------------------------------------------------


def test_weights_are_named_by_state_dict_key_and_copied():
    module = Fn(lambda m, x: m.body[1](F.relu(m.body[0](x))), body=nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    module.register_buffer("unused", torch.zeros(3))
    x = r(2, 4)
    model = from_torch(module, (x,))
    assert set(model.weights) == {"body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias"}
    np.testing.assert_array_equal(model.weights["body.1.weight"], module.body[1].weight.detach().numpy())
    expected = reference(module, (x,))[0]
    with torch.no_grad():
        module.body[0].weight.zero_()  # the imported model must not alias the module's tensors
    assert_close(tilegraph.compile(model)(x), expected, "f32", 4)


def test_from_torch_exports_eval_and_restores_the_mode():
    module = Fn(lambda m, x: m.bn(m.drop(x)), drop=nn.Dropout(0.5), bn=_with_stats(nn.BatchNorm1d(4))).train()
    x = r(5, 4)
    model = from_torch(module, (x,))
    assert module.training and module.drop.training and module.bn.training
    module.eval()
    check(module, (x,), model=model)


def test_pt2_file_loads(tmp_path):
    module = Fn(lambda m, x: torch.softmax(m.fc(x), -1), fc=nn.Linear(6, 3))
    x = r(2, 6)
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(module.eval(), (x,)), str(path))
    check(module, (x,), n=6, model=load_pt2(path))
    assert_close(tilegraph.compile(str(path))(x), reference(module, (x,))[0], "f32", 6)
    with pytest.raises(FrontendError, match="cannot load"):
        load_pt2(tmp_path / "missing.pt2")


def test_converter_table_names_real_ops():
    """Every op name the converter table registers exists in the pinned torch (no typos)."""
    from tilegraph.frontends.torch_export import CONVERTERS, UNKNOWN_NAMES

    assert UNKNOWN_NAMES == []
    assert len(CONVERTERS) > 200
