"""Image models transformers has no config for, written in plain torch after torchvision's
definitions (torchvision cannot be installed beside the pinned torch wheel): MobileNetV3-Large,
DenseNet-121 and MaxViT-T, at their published sizes, random weights.

Each follows torchvision.models' module of the same name layer for layer (the same block
tables, activations, normalisation epsilons and reshapes), so the graph an exporter sees is
the one a torchvision user's model gives; only the weights differ. Every model takes one
`pixel_values` tensor (N, 3, 224, 224) and returns the 1000 logits.

    build(name) -> torch.nn.Module      names: mobilenet-v3-large, densenet-121, maxvit-t
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


def _make_divisible(v: float, divisor: int = 8) -> int:
    """torchvision's (after the TensorFlow original): round to a multiple of `divisor`,
    never more than 10% below `v`."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def _conv_norm_act(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, norm=nn.BatchNorm2d,
                   act=nn.ReLU, bias: bool | None = None) -> nn.Sequential:
    """torchvision.ops.Conv2dNormActivation: padding (kernel - 1) // 2, a bias only without a norm."""
    layers = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups,
                        bias=norm is None if bias is None else bias)]
    if norm is not None:
        layers.append(norm(cout))
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation: global average, 1x1 conv, activation, 1x1 conv, gate."""

    def __init__(self, channels: int, squeeze: int, act=nn.ReLU, gate=nn.Sigmoid):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)
        self.act, self.gate = act(), gate()

    def forward(self, x):
        return x * self.gate(self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(x, 1)))))


# --- MobileNetV3-Large (torchvision.models.mobilenetv3, "Searching for MobileNetV3") ---

# input, kernel, expanded, output, squeeze-excitation, hardswish (else ReLU), stride
MOBILENET_V3_LARGE = [
    (16, 3, 16, 16, False, False, 1), (16, 3, 64, 24, False, False, 2), (24, 3, 72, 24, False, False, 1),
    (24, 5, 72, 40, True, False, 2), (40, 5, 120, 40, True, False, 1), (40, 5, 120, 40, True, False, 1),
    (40, 3, 240, 80, False, True, 2), (80, 3, 200, 80, False, True, 1), (80, 3, 184, 80, False, True, 1),
    (80, 3, 184, 80, False, True, 1), (80, 3, 480, 112, True, True, 1), (112, 3, 672, 112, True, True, 1),
    (112, 5, 672, 160, True, True, 2), (160, 5, 960, 160, True, True, 1), (160, 5, 960, 160, True, True, 1),
]


class InvertedResidual(nn.Module):
    def __init__(self, cin, kernel, expanded, cout, se, hardswish, stride, norm):
        super().__init__()
        act = nn.Hardswish if hardswish else nn.ReLU
        layers = [] if expanded == cin else [_conv_norm_act(cin, expanded, 1, norm=norm, act=act)]
        layers.append(_conv_norm_act(expanded, expanded, kernel, stride, groups=expanded, norm=norm, act=act))
        if se:
            layers.append(SqueezeExcitation(expanded, _make_divisible(expanded // 4), gate=nn.Hardsigmoid))
        layers.append(_conv_norm_act(expanded, cout, 1, norm=norm, act=None))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return y + x if self.residual else y


class MobileNetV3Large(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        norm = partial(nn.BatchNorm2d, eps=0.001, momentum=0.01)
        layers = [_conv_norm_act(3, 16, 3, 2, norm=norm, act=nn.Hardswish)]
        layers += [InvertedResidual(*row, norm=norm) for row in MOBILENET_V3_LARGE]
        layers.append(_conv_norm_act(160, 960, 1, norm=norm, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(960, 1280), nn.Hardswish(), nn.Dropout(0.2),
                                        nn.Linear(1280, num_classes))
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, pixel_values):
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(pixel_values), 1), 1))


# --- DenseNet-121 (torchvision.models.densenet, "Densely Connected Convolutional Networks") ---

class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int, bn_size: int):
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.conv1(F.relu(self.norm1(torch.cat(features, 1))))
        return self.conv2(F.relu(self.norm2(x)))


class DenseBlock(nn.Module):
    def __init__(self, layers: int, cin: int, growth: int, bn_size: int):
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth, bn_size) for i in range(layers))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet121(nn.Module):
    def __init__(self, growth: int = 32, blocks=(6, 12, 24, 16), init_features: int = 64, bn_size: int = 4,
                 num_classes: int = 1000):
        super().__init__()
        layers = [nn.Conv2d(3, init_features, 7, 2, 3, bias=False), nn.BatchNorm2d(init_features), nn.ReLU(),
                  nn.MaxPool2d(3, 2, 1)]
        channels = init_features
        for i, n in enumerate(blocks):
            layers.append(DenseBlock(n, channels, growth, bn_size))
            channels += n * growth
            if i != len(blocks) - 1:  # a transition halves the channels and the resolution
                layers += [nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels // 2, 1, bias=False),
                           nn.AvgPool2d(2, 2)]
                channels //= 2
        layers.append(nn.BatchNorm2d(channels))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, pixel_values):
        x = F.relu(self.features(pixel_values))
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# --- MaxViT-T (torchvision.models.maxvit, "MaxViT: Multi-Axis Vision Transformer") ---

def _relative_position_index(size: int) -> torch.Tensor:
    coords = torch.flatten(torch.stack(torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")), 1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += size - 1
    rel[:, :, 1] += size - 1
    rel[:, :, 0] *= 2 * size - 1
    return rel.sum(-1)


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, expansion: float, squeeze: float, stride: int, norm, act):
        super().__init__()
        if stride != 1 or cin != cout:
            proj = [nn.Conv2d(cin, cout, 1)]
            self.proj = nn.Sequential(*([nn.AvgPool2d(3, stride, 1)] if stride == 2 else []), *proj)
        else:
            self.proj = nn.Identity()
        mid = int(cout * expansion)
        self.layers = nn.Sequential(
            norm(cin),
            _conv_norm_act(cin, mid, 1, norm=norm, act=act),
            _conv_norm_act(mid, mid, 3, stride, groups=mid, norm=norm, act=act),
            SqueezeExcitation(mid, int(cout * squeeze), act=nn.SiLU),
            nn.Conv2d(mid, cout, 1))

    def forward(self, x):
        return self.proj(x) + self.layers(x)


class RelativePositionalAttention(nn.Module):
    def __init__(self, dim: int, head_dim: int, max_seq_len: int):
        super().__init__()
        self.heads, self.head_dim = dim // head_dim, head_dim
        self.size, self.max_seq_len = int(math.sqrt(max_seq_len)), max_seq_len
        self.to_qkv, self.merge = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.scale = dim ** -0.5  # torchvision scales by the feature width, not the head's
        self.relative_position_bias_table = nn.Parameter(torch.empty((2 * self.size - 1) ** 2, self.heads))
        self.register_buffer("relative_position_index", _relative_position_index(self.size))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def forward(self, x):
        B, G, P, D = x.shape
        H, DH = self.heads, self.head_dim
        q, k, v = torch.chunk(self.to_qkv(x), 3, dim=-1)
        q, k, v = (t.reshape(B, G, P, H, DH).permute(0, 1, 3, 2, 4) for t in (q, k, v))
        k = k * self.scale
        dots = torch.einsum("bghid,bghjd->bghij", q, k)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        bias = bias.view(self.max_seq_len, self.max_seq_len, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        out = torch.einsum("bghij,bghjd->bghid", F.softmax(dots + bias, dim=-1), v)
        return self.merge(out.permute(0, 1, 3, 2, 4).reshape(B, G, P, D))


class PartitionAttention(nn.Module):
    """Attention within 7x7 windows ("window") or across a 7x7 grid of strided positions ("grid"),
    then an MLP, each pre-normalised with a residual."""

    def __init__(self, dim: int, head_dim: int, partition: int, kind: str, grid: int, mlp_ratio: int, act):
        super().__init__()
        n = grid // partition
        self.p, self.g = (partition, n) if kind == "window" else (n, partition)
        self.grid, self.swap = grid, kind == "grid"
        self.attn_layer = nn.Sequential(nn.LayerNorm(dim), RelativePositionalAttention(dim, head_dim, partition ** 2))
        self.mlp_layer = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * mlp_ratio), act(),
                                       nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x):
        B, C, H, W = x.shape
        P = self.p
        x = x.reshape(B, C, H // P, P, W // P, P).permute(0, 2, 4, 3, 5, 1).reshape(B, (H // P) * (W // P), P * P, C)
        if self.swap:
            x = torch.swapaxes(x, -2, -3)
        x = x + self.attn_layer(x)
        x = x + self.mlp_layer(x)
        if self.swap:
            x = torch.swapaxes(x, -2, -3)
        gh, gw = self.grid // P, self.grid // P
        return x.reshape(B, gh, gw, P, P, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, gh * P, gw * P)


class MaxViTT(nn.Module):
    def __init__(self, image: int = 224, stem: int = 64, channels=(64, 128, 256, 512), depths=(2, 2, 5, 2),
                 head_dim: int = 32, partition: int = 7, num_classes: int = 1000):
        super().__init__()
        norm = partial(nn.BatchNorm2d, eps=1e-3, momentum=0.99)
        act = nn.GELU
        self.stem = nn.Sequential(_conv_norm_act(3, stem, 3, 2, norm=norm, act=act, bias=False),
                                  _conv_norm_act(stem, stem, 3, 1, norm=None, act=None, bias=True))
        grid = (image + 1) // 2
        layers = []
        for cin, cout, depth in zip((stem, *channels[:-1]), channels, depths):
            grid = (grid + 1) // 2  # each block's first MBConv has stride 2
            for i in range(depth):
                layers += [MBConv(cin if i == 0 else cout, cout, 4, 0.25, 2 if i == 0 else 1, norm, act),
                           PartitionAttention(cout, head_dim, partition, "window", grid, 4, act),
                           PartitionAttention(cout, head_dim, partition, "grid", grid, 4, act)]
        self.blocks = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(channels[-1]),
                                        nn.Linear(channels[-1], channels[-1]), nn.Tanh(),
                                        nn.Linear(channels[-1], num_classes, bias=False))
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, pixel_values):
        return self.classifier(self.blocks(self.stem(pixel_values)))


MODELS = {"mobilenet-v3-large": MobileNetV3Large, "densenet-121": DenseNet121, "maxvit-t": MaxViTT}


def build(name: str) -> nn.Module:
    return MODELS[name]().eval()
