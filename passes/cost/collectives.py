"""What a collective costs on one axis of a device mesh: alpha + beta * bytes.

A `Mesh` is a grid of devices (`Mesh((2, 4), hw)`: 8 GPUs as 2 rows of 4), numbered
row-major, so the last axis holds neighbouring device ids. An axis whose groups
stay inside one node (`GPUS_PER_NODE` consecutive devices) talks over the node's
fabric (NVLink, or PCIe for cards without it); an axis that crosses nodes talks
over InfiniBand. `Mesh.link(axis)` is that `hardware.Link` (alpha: seconds per
message, beta: bytes/s per direction per device).

The formulas are the standard ones for n devices and B bytes (Thakur, Rabenseifner
and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005;
the same ring and tree models NCCL's tuner uses), each plus NCCL's fixed launch
latency (`hardware.NCCL_BASE_LATENCY`):

    all-reduce, ring      2(n-1) alpha + 2 (n-1)/n B / beta      B = the tensor on each device
    all-reduce, tree      2 ceil(log2 n) alpha + 2 B / beta      (a double binary tree: NCCL)
    all-gather, ring      (n-1) alpha + (n-1)/n B / beta         B = the gathered result
    reduce-scatter, ring  (n-1) alpha + (n-1)/n B / beta         B = the input on each device
    all-to-all, pairwise  (n-1) alpha + (n-1)/n B / beta         B = the tensor on each device

All-reduce takes the cheaper of ring and tree (NCCL picks per size the same way):
trees win on latency for small messages, rings on bandwidth for large ones.
Every result is a sympy expression, so a byte count in the model's symbolic dims
gives a formula, as the rest of the cost model does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import sympy

from tilegraph.ir.hardware import NCCL_BASE_LATENCY, Hardware, Link

# GPUs that share one NVLink/NVSwitch fabric: an HGX/DGX H100, H200 or A100 board
# holds 8 (DGX H100 user guide; DGX A100 user guide).
GPUS_PER_NODE = 8

# Gradients are all-reduced in buckets, not one tensor at a time: PyTorch DDP's default
# bucket_cap_mb = 25 (torch.nn.parallel.DistributedDataParallel), and Megatron-LM and
# DeepSpeed bucket likewise. A gradient of B bytes pays min(1, B / bucket) of one
# collective's latency.
GRADIENT_BUCKET = 25 * 2**20

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def all_reduce(link: Link, n: int, nbytes, algorithm: str = "best") -> sympy.Expr:
    """Seconds to all-reduce `nbytes` on each of `n` devices over `link` ("ring", "tree" or "best")."""
    if n <= 1:
        return sympy.Integer(0)
    b = sympy.sympify(nbytes)
    ring = 2 * (n - 1) * link.alpha + sympy.Rational(2 * (n - 1), n) * b / link.beta
    tree = 2 * math.ceil(math.log2(n)) * link.alpha + 2 * b / link.beta
    chosen = {"ring": ring, "tree": tree, "best": sympy.Min(ring, tree)}
    if algorithm not in chosen:
        raise ValueError(f"unknown all-reduce algorithm '{algorithm}': ring, tree or best")
    return NCCL_BASE_LATENCY + chosen[algorithm]


def _ring_pass(link: Link, n: int, nbytes) -> sympy.Expr:
    """One ring pass of (n-1) steps, each moving 1/n of `nbytes`: all-gather, reduce-scatter, all-to-all."""
    if n <= 1:
        return sympy.Integer(0)
    return NCCL_BASE_LATENCY + (n - 1) * link.alpha + sympy.Rational(n - 1, n) * sympy.sympify(nbytes) / link.beta


def all_gather(link: Link, n: int, nbytes) -> sympy.Expr:
    """Seconds to all-gather a result of `nbytes` per device from `n` shards."""
    return _ring_pass(link, n, nbytes)


def reduce_scatter(link: Link, n: int, nbytes) -> sympy.Expr:
    """Seconds to reduce-scatter an input of `nbytes` per device into `n` shards."""
    return _ring_pass(link, n, nbytes)


def all_to_all(link: Link, n: int, nbytes) -> sympy.Expr:
    """Seconds for each of `n` devices to send (n-1)/n of its `nbytes` to the others."""
    return _ring_pass(link, n, nbytes)


@dataclass(frozen=True)
class Mesh:
    """A grid of devices of one kind; `shape[i]` devices along axis i, numbered row-major."""

    shape: tuple[int, ...]
    hw: Hardware
    intra_node: str = "nvlink"  # the link inside a node: "nvlink", or "pcie" for cards without NVLink

    def __post_init__(self):
        if not self.shape or any(int(s) < 1 for s in self.shape):
            raise ValueError(f"a mesh needs positive axis sizes, got {self.shape}")

    @property
    def devices(self) -> int:
        return math.prod(self.shape)

    def link(self, axis: int) -> Link:
        """The link a collective over `axis` runs on: inside a node while the axis's groups fit in one."""
        if not self.hw.links:
            raise ValueError(f"hardware {self.hw.name} has no interconnect links to shard over")
        span = math.prod(self.shape[axis:])  # consecutive device ids one group of this axis covers
        return self.hw.links[self.intra_node if span <= GPUS_PER_NODE else "infiniband"]

    def group_size(self, axes: Sequence[int]) -> int:
        return math.prod(self.shape[a] for a in axes)

    def collective(self, kind: str, axes: Sequence[int], nbytes) -> sympy.Expr:
        """Seconds for collective `kind` over mesh `axes` (slowest link of them) on `nbytes`."""
        axes = tuple(axes)
        n = self.group_size(axes)
        if n <= 1:
            return sympy.Integer(0)
        link = min((self.link(a) for a in axes), key=lambda l: l.beta)
        return {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
                "all_to_all": all_to_all}[kind](link, n, nbytes)

    def bucketed(self, kind: str, axes: Sequence[int], nbytes) -> sympy.Expr:
        """`collective` for a gradient all-reduced in a bucket with others (GRADIENT_BUCKET): its bytes
        at full cost, its share of the bucket's latency."""
        latency = self.collective(kind, axes, 0)
        share = sympy.Min(1, sympy.sympify(nbytes) / GRADIENT_BUCKET)
        return self.collective(kind, axes, nbytes) - latency + latency * share

    def __str__(self) -> str:
        return "x".join(map(str, self.shape))


def parse_mesh(text: str | int) -> tuple[int, ...]:
    """'2x4' -> (2, 4); '8' -> (8,). ValueError on anything else."""
    parts = str(text).lower().replace("*", "x").split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"cannot read mesh '{text}': write axis sizes like 8 or 2x4") from None
    if not shape or min(shape) < 1:
        raise ValueError(f"cannot read mesh '{text}': axis sizes must be positive")
    return shape
