"""What a machine can do, as data: the numbers every cost-model decision is made against.

A `Hardware` holds peak FLOP/s per dtype, memory and cache bandwidth and sizes,
per-kernel (GPU) or per-NumPy-call (CPU) fixed costs, and interconnect links
(latency alpha, bandwidth beta). `hardware(name)` gives one:

- "h100", "h200", "a100": the SXM parts, typed in from NVIDIA's datasheets and
  whitepapers (each number says where it comes from). FLOP/s are dense: the
  datasheets print the 2:4-sparse figure for tensor cores, which is twice this.
- "cpu": this machine, *measured* by the NumPy backend's calibration of its own
  kernels (`backends/numpy/calibrate.py`, `tilegraph calibrate`) and kept as JSON in
  the user's cache directory, keyed by CPU model and core count. With no profile yet,
  the first call runs the quick calibration (a couple of seconds) and saves it;
  `clear_cache()` makes the next call re-read the file.
- "c": this machine again, as the native C backend runs on it: its own kernels (oneDNN
  GEMMs, fused C loops, row kernels, flash attention, convolution, the module call)
  measured by `backends/c/calibrate.py` (`tilegraph calibrate --target c`), kept beside
  the "cpu" profile and measured quickly on first use the same way. Its `backend` is
  "c", which is how the cost model knows a group is one C pass, not NumPy calls.

It lies below passes and backends, which both read it (the cost model; the Triton
backend's GPU description and cache directory): it imports neither. Each backend that
measures a profile registers its measuring function (`register_calibration`).

Two helpers turn the table into rates the cost model divides by:
`Hardware.flops(dtype)` (falls back to the type the part really computes in) and
`Hardware.matmul_rate(m, n, k, dtype)` (measured curve on the CPU, tile and wave
quantization on GPUs).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping

# (The NumPy backend's attention kernel, backends/numpy/attention.py, and the cost model.)
# Below this many scores (batch x Lq x Lk) one thread does the work: handing items
# to the pool costs more than it saves: MiniLM's attention at batch 1 (196K scores)
# gains nothing from a second thread, GPT-2's at 256 tokens (786K) does.
MIN_PARALLEL_SCORES = 1 << 19

PROFILE_FORMAT = 11  # (2: per-core GEMM samples; 3: chunk_call_overhead; 4: parallel costs, conv rate; 5: skinny GEMMs; 6: BLAS threads; 7: attention, fused kernels, spilled rates; 8: BLAS call overhead; 9: C row kernels per row, pool rate, stem convolutions; 10: a 7x7 stem, a sum along rows; 11: cold rows copied) bump when the JSON layout changes: older profiles are then re-measured


@dataclass(frozen=True)
class Link:
    name: str
    alpha: float  # s, latency of one message (one step of a ring collective)
    beta: float  # bytes/s, bandwidth per direction per device
    source: str = ""

    def time(self, nbytes: float) -> float:
        """Seconds to send one message of `nbytes`: alpha + nbytes / beta."""
        return self.alpha + nbytes / self.beta


@dataclass(frozen=True)
class Hardware:
    name: str  # "h100", "h200", "a100", "cpu"
    device: str  # "gpu" or "cpu"
    peak_flops: Mapping[str, float]  # tg dtype name -> dense FLOP/s (i8: ops/s); only what the part has
    memory_bandwidth: float  # bytes/s, DRAM/HBM streaming (CPU: one NumPy call, 2 reads + 1 write per element)
    cache_bandwidth: float  # bytes/s for data resident in `cache_bytes`
    cache_bytes: int  # GPU: L2 size; CPU: L2 per core (what a fused group's working set should fit in)
    memory_bytes: int  # HBM capacity / RAM
    cores: int  # SMs / CPU cores
    shared_memory_per_core: int  # GPU: shared memory per SM (bytes); CPU: L1d per core
    registers_per_core: int  # GPU: 32-bit registers per SM; CPU: 0
    launch_overhead: float  # s: GPU kernel launch; CPU: fixed cost of one NumPy call on a small array
    alloc_overhead: float  # s: allocating a temporary (CPU: ~1 MB np.empty + first touch); GPU: 0
    links: Mapping[str, Link]  # GPU: "nvlink", "infiniband", "pcie"; CPU: empty
    # CPU only (empty on GPUs): measured throughput.
    # (m, n, k, FLOP/s) of one f32 np.matmul, net of launch_overhead: time = launch + 2mnk / rate
    gemm_samples: tuple[tuple[int, int, int, float], ...] = ()
    ufunc_rates: Mapping[str, float] = field(default_factory=dict)  # elements/s, f32, cache-resident
    # elements/s, f32, of the same calls over a chunk whose arrays spill out of one core's L2
    # (what a row chunk of a wide layer sees); empty: `ufunc_rates` at every size.
    ufunc_rates_spilled: Mapping[str, float] = field(default_factory=dict)
    source: str = ""  # datasheet URLs, or "calibrated <date> on <cpu model> ..."
    # GPU only: the most shared memory one thread block may use (the tile pass's limit).
    shared_memory_per_block: int = 0
    # CPU only: the fixed cost of one NumPy call inside a fused group's chunk loop running
    # on all cores (slicing the chunk's views, and the GIL the threads share between
    # calls); 0: launch_overhead.
    chunk_call_overhead: float = 0.0
    # CPU only: one fork/join of the chunk pool (waking the workers, waiting for them),
    # and how much of `cores` x the one-core GEMM rate all cores get together (shared
    # caches, memory bus, clocks); 1.0 when not measured.
    parallel_overhead: float = 0.0
    parallel_efficiency: float = 1.0
    # CPU only: the same for one whole GEMM with BLAS on all cores (its own threads, which
    # share packed panels and spin rather than sleep between calls); 0: not measured,
    # and `tile` never chooses it.
    blas_parallel_efficiency: float = 0.0
    # CPU only: what running a GEMM on BLAS's threads adds to its call, whatever its size
    # (handing BLAS all cores and taking them back), calibrated: it can exceed the whole
    # of a small GEMM (a small CNN's classifier), which then stays on one thread.
    blas_call_overhead: float = 0.0
    # CPU only: FLOP/s of the NumPy convolution kernel (K.conv: im2col, small batched GEMMs),
    # which is far from the GEMM curve; 0: priced as a GEMM.
    conv_rate: float = 0.0
    # CPU "c" only: oneDNN's convolutions by kind ("dense" 3x3, "pointwise" 1x1, "depthwise"),
    # all threads, at backends/c/calibrate.CONV_CASES: (m, n, k, FLOP/s), m x n x k the implicit
    # GEMM of one group (output pixels, output channels of a group, a group's inputs x the
    # window); empty: `conv_rate` for all.
    conv_rates: Mapping[str, tuple[int, int, int, float]] = field(default_factory=dict)
    # CPU "c" only: what running one oneDNN primitive costs beyond a step of a module, whatever
    # its work (a 1x1 convolution on a 1x1 map, a squeeze-excitation's, is all this); 0: nothing.
    primitive_overhead: float = 0.0
    # CPU "c" only: elements/s of a sum or mean over the positions of channels-last data (a
    # squeeze-excitation's or a classifier's global average pool, ir/strides.reduces_rows_of_channels),
    # after the convolution that writes it; 0: priced as a loop at `add`'s rate.
    pool_rate: float = 0.0
    # CPU "c" only: seconds a row kernel (softmax, layer_norm) takes per row beyond its elements
    # at `ufunc_rates` (its loops' setup and tails: a window's 49-wide score rows ran at a third
    # of 256-wide rows' rate per element); empty: the rate alone, measured over 256-wide rows.
    row_overhead: Mapping[str, float] = field(default_factory=dict)
    # CPU "c" only: bytes/s a gather writes as it copies rows into the arena (the C copies:
    # gather, concat, pad, ...); 0: priced as a pass at the cache and memory bandwidths.
    copy_bandwidth: float = 0.0
    # CPU "c" only: bytes/s of the rows such a copy reads from a weight beyond the caches (a
    # language model's embedding: every forward's weights evict it); 0: at `copy_bandwidth`.
    cold_copy_bandwidth: float = 0.0
    # CPU "c" only: the size of L3 (shared) and bytes/s of a fused loop's pass over data beyond
    # the cores' L2 that fits it; 0: such data is priced at `memory_bandwidth`.
    l3_bytes: int = 0
    l3_bandwidth: float = 0.0
    # CPU only: (rows, efficiency) of a GEMM with that few rows against a tall one of the
    # same other dims; the volume curve (`gemm_samples`) alone cannot tell 8 x 3072 x 768
    # from 128 x 384 x 384, of about the same work, though the skinny one runs at a fraction
    # of the rate (its few rows cannot fill the kernel's register block).
    skinny_gemm: tuple[tuple[int, float], ...] = ()
    # CPU only: (head dim, FLOP/s) of the NumPy attention kernel (backends/numpy/attention.py, one
    # core): its batched small GEMMs over strided heads and its softmax passes run far
    # below the GEMM curve; and its speedup on all cores. Empty: priced from the GEMM curve.
    attention_rates: tuple[tuple[int, float], ...] = ()
    attention_speedup: float = 0.0
    # Which CPU backend's kernels were measured: "numpy" (the fields as described above) or
    # "c" (backends/c/calibrate.py). In a "c" profile: launch_overhead is one call of a
    # compiled module from Python; chunk_call_overhead one more step (C function) in it when
    # the step runs on one thread, parallel_overhead when it opens an OpenMP region;
    # ufunc_rates elements/s of each op inside a fused C loop on all threads (softmax,
    # layer_norm: a whole row kernel); cache_bandwidth and memory_bandwidth bytes/s of one
    # fused loop's pass; conv_rate oneDNN's convolution on all threads; attention_rates the
    # C flash kernel on one thread (attention_speedup: on all).
    backend: str = "numpy"
    # CPU "c" only: (m, n, k, FLOP/s) of oneDNN's GEMM on a prepacked weight with all
    # threads (`gemm_samples` holds the same on one thread). Empty: `gemm_samples` x cores.
    gemm_samples_threaded: tuple[tuple[int, int, int, float], ...] = ()
    # CPU only: other processes' runnable threads seen while it was measured (0: a quiet
    # machine). A profile taken under load (GEMMs priced 3-41x too slow) is used, but
    # measured again by the first process that finds the machine quiet (_cpu_profile).
    measured_busy: int = 0

    @property
    def execution(self) -> str:
        """How code runs on this part, which passes price and tile for: "gpu" (Triton kernels),
        "c" (the C backend's compiled loops and oneDNN) or "numpy" (NumPy calls in chunks)."""
        return "gpu" if self.device == "gpu" else self.backend

    # Dict fields make the generated hash fail; these three identify a profile.
    def __hash__(self) -> int:
        return hash((self.name, self.device, self.source))

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; a dtype the part has no rate for runs at the rate of
        the type it is computed in (bf16 on the CPU: f32, since NumPy widens it; fp8 on
        A100: bf16; integers wider than 8 bits: f32)."""
        for name in (dtype, *_computed_as(dtype)):
            if name in self.peak_flops:
                return self.peak_flops[name]
        raise AssertionError(f"hardware {self.name} has no f32 rate")  # every profile has one

    def matmul_rate(self, m: int, n: int, k: int, dtype: str = "f32", threaded: bool = False) -> float:
        """FLOP/s expected for one (m x k) @ (k x n) GEMM at concrete sizes.

        CPU: the measured f32 np.matmul rates on one core (`gemm_samples`), interpolated linearly
        in log(m*n*k) and clamped at the smallest and largest sample, scaled by
        flops(dtype) / flops("f32").

        GPU: peak times the fraction of issued tensor-core work that is useful when
        the output is cut into GPU_TILE_M x GPU_TILE_N tiles, one per SM per wave,
        each stepping through k in GPU_TILE_K slices:
            tiles      = ceil(m / TM) * ceil(n / TN)
            waves      = ceil(tiles / cores)
            efficiency = m*n*k / (waves * cores * TM*TN * ceil(k / TK)*TK)
        (tile quantization for ragged edges, wave quantization for a last wave that
        leaves SMs idle). An upper bound: it ignores pipeline fill for small k.

        `threaded` (CPU): the rate of one GEMM on all cores, from `gemm_samples_threaded`
        where the profile has them (the C backend's oneDNN GEMMs thread themselves), by the
        whole shape, not the volume alone (`_by_shape`).
        """
        m, n, k = int(m), int(n), int(k)
        if min(m, n, k) <= 0:
            raise ValueError(f"matmul_rate needs positive sizes, got {m}x{n}x{k}")
        if self.device == "gpu":
            tiles = math.ceil(m / GPU_TILE_M) * math.ceil(n / GPU_TILE_N)
            waves = math.ceil(tiles / self.cores)
            issued = waves * self.cores * GPU_TILE_M * GPU_TILE_N * math.ceil(k / GPU_TILE_K) * GPU_TILE_K
            return self.flops(dtype) * (m * n * k) / issued
        if not self.gemm_samples:
            return self.flops(dtype)
        if threaded and self.gemm_samples_threaded:
            return _by_shape(m, n, k, self.gemm_samples_threaded) * self.flops(dtype) / self.flops("f32")
        curve = _gemm_curve(self.gemm_samples)
        rate = _interp(math.log(m * n * k), curve)
        if self.skinny_gemm:  # few rows (or columns): BLAS's register blocking is left half empty
            rate *= min(1.0, _interp(math.log(min(m, n)), tuple((math.log(r), e) for r, e in self.skinny_gemm)))
        return rate * self.flops(dtype) / self.flops("f32")

    def to_dict(self) -> dict:
        """Plain JSON-able data; `from_dict` gives back an equal Hardware."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Hardware":
        d = dict(d)
        if "kind" in d:  # profiles saved before the field was named for what it holds
            d["device"] = d.pop("kind")
        d["links"] = {k: Link(**v) for k, v in d.get("links", {}).items()}
        for key in ("gemm_samples", "gemm_samples_threaded"):
            d[key] = tuple((int(m), int(n), int(k), float(r)) for m, n, k, r in d.get(key, ()))
        d["skinny_gemm"] = tuple((int(r), float(e)) for r, e in d.get("skinny_gemm", ()))
        d["attention_rates"] = tuple((int(h), float(r)) for h, r in d.get("attention_rates", ()))
        d["conv_rates"] = {kind: (int(m), int(n), int(k), float(r)) for kind, (m, n, k, r) in
                           d.get("conv_rates", {}).items()}
        return cls(**d)


def _computed_as(dtype: str) -> tuple[str, ...]:
    """The types `dtype` is computed in where the part has no rate of its own, best first."""
    if dtype in ("bf16", "f16"):
        return ("f16" if dtype == "bf16" else "bf16", "f32")
    if dtype.startswith(("f8", "f6", "f4")):  # narrow floats: the nearest tensor-core type there is
        return ("f8E4M3FN", "f8E5M2", "bf16", "f16", "f32")
    if re.fullmatch(r"u?i[1-8]", dtype):
        return ("i8", "f32")
    return ("f32",)  # tf32, wider integers, i1, f64 where absent


def _gemm_curve(samples) -> tuple[tuple[float, float], ...]:
    """(log(m*n*k), FLOP/s) sorted by size; samples of equal m*n*k are averaged."""
    by_size: dict[int, list[float]] = {}
    for m, n, k, rate in samples:
        by_size.setdefault(m * n * k, []).append(rate)
    return tuple((math.log(s), sum(r) / len(r)) for s, r in sorted(by_size.items()))


def _by_shape(m: int, n: int, k: int, samples) -> float:
    """The rate at (m, n, k) from samples (m, n, k, rate): a geometric mean of the samples'
    rates weighted by inverse squared distance in (log m, log n, log k), exact at a sample.
    The volume alone does not tell oneDNN's rates apart: at one volume, a weight that fits the
    cores' L2 is read from there for every block of rows, a wider one streams from L3 each time."""
    at = (math.log(m), math.log(n), math.log(k))
    num = den = 0.0
    for sm, sn, sk, rate in samples:
        d2 = sum((a - math.log(b)) ** 2 for a, b in zip(at, (sm, sn, sk)))
        if d2 < 1e-12:
            return rate
        num, den = num + math.log(rate) / d2, den + 1 / d2
    return math.exp(num / den)


def _interp(x: float, curve) -> float:
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]


# --- GPUs -------------------------------------------------------------------------

# Output tile of one thread block in the GPU matmul efficiency model: 128x128 is
# cuBLAS's / CUTLASS's usual tile for large bf16 GEMMs on Ampere and Hopper, and the
# one NVIDIA's "Matrix Multiplication Background" guide uses to explain tile and wave
# quantization (https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/).
GPU_TILE_M = GPU_TILE_N = 128
GPU_TILE_K = 64  # k slice per main-loop step of those kernels (64 bf16 = one 128-byte row)

# Sources shared by the parts below.
CUDA_GUIDE = ("https://docs.nvidia.com/cuda/cuda-c-programming-guide/"
              "#features-and-technical-specifications-technical-specifications-per-compute-capability")
NCCL_TUNING = "https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc"
CUDA_GRAPHS_BLOG = "https://developer.nvidia.com/blog/cuda-graphs/"

GIB, KIB, MIB = 2**30, 2**10, 2**20
REGISTERS_PER_SM = 65536  # 32-bit registers per SM, compute capability 8.0 and 9.0 (CUDA_GUIDE)
# Launching one kernel costs a few us of CPU/driver time before it runs; NVIDIA's CUDA
# Graphs post (CUDA_GRAPHS_BLOG) measures back-to-back short kernels at a few us each,
# and graphs exist to remove exactly that. 4 us: the usual figure for a PyTorch/Triton launch.
KERNEL_LAUNCH = 4e-6

# Interconnect latency alpha per message = NCCL's own per-step ring latency (hwLat,
# Ring/LL128, in us) in its tuning model (NCCL_TUNING): NVLink 1.9, PCI 2.5, network 4.0.
# NCCL adds a base latency per collective on top (baseLat, Ring/Simple 8.4 us).
ALPHA_NVLINK, ALPHA_PCIE, ALPHA_NET = 1.9e-6, 2.5e-6, 4.0e-6
NCCL_BASE_LATENCY = 8.4e-6  # s, once per collective launch (NCCL_TUNING baseLat Ring/Simple)

# H100 SXM5 datasheet (dense = half the printed sparse tensor figures):
H100_DATASHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
# L2 size, SM count, shared memory: the Hopper architecture whitepaper.
HOPPER_WHITEPAPER = "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper"
HOPPER_FLOPS = {
    "f64": 67e12,  # FP64 Tensor Core 67 TFLOPS (vector FP64 is 34; GEMMs use the tensor cores)
    "f32": 67e12,  # FP32 67 TFLOPS (CUDA cores)
    "tf32": 494.5e12,  # TF32 Tensor Core 989 TFLOPS with sparsity
    "bf16": 989.5e12,  # BF16 Tensor Core 1,979 TFLOPS with sparsity
    "f16": 989.5e12,  # FP16 Tensor Core 1,979 TFLOPS with sparsity
    "f8E4M3FN": 1979e12,  # FP8 Tensor Core 3,958 TFLOPS with sparsity
    "f8E5M2": 1979e12,
    "i8": 1979e12,  # INT8 Tensor Core 3,958 TOPS with sparsity
}  # no FP4 on Hopper (Blackwell adds it)
HOPPER_L2 = 50 * MIB  # whitepaper: 50 MB L2 (cudaDeviceProp.l2CacheSize = 52428800)
HOPPER_SMS = 132  # SXM5: 132 SMs (whitepaper)
HOPPER_SMEM_PER_SM = 228 * KIB  # compute capability 9.0: 228 KB shared memory per SM (CUDA_GUIDE)
HOPPER_SMEM_PER_BLOCK = 227 * KIB  # ... of which 227 KB per thread block
# L2 bandwidth is not on NVIDIA's datasheets. Estimate: the 5,120 bytes/clock L2 read
# bandwidth the Ampere whitepaper gives for A100, at the H100 SXM boost clock of
# 1.98 GHz. Only its ratio to HBM matters to fusion (L2-resident beats HBM by ~3x).
HOPPER_L2_BANDWIDTH = 5120 * 1.98e9
# NVLink 4: 900 GB/s total bandwidth per GPU (datasheet) = 450 GB/s each direction.
HOPPER_NVLINK = 450e9
# InfiniBand NDR 400 Gb/s, one ConnectX-7 per GPU in DGX/HGX H100 (DGX H100 user guide:
# https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html) = 50 GB/s.
NDR_PER_GPU = 400e9 / 8
PCIE_GEN5_X16 = 64e9  # datasheet "PCIe Gen5: 128 GB/s" counts both directions

H100 = Hardware(
    name="h100", device="gpu", peak_flops=HOPPER_FLOPS,
    memory_bandwidth=3.35e12,  # H100 SXM: 3.35 TB/s HBM3 (datasheet)
    cache_bandwidth=HOPPER_L2_BANDWIDTH, cache_bytes=HOPPER_L2,
    memory_bytes=80 * 10**9,  # 80 GB HBM3 (datasheet)
    cores=HOPPER_SMS, shared_memory_per_core=HOPPER_SMEM_PER_SM, registers_per_core=REGISTERS_PER_SM,
    launch_overhead=KERNEL_LAUNCH, alloc_overhead=0.0,  # a caching allocator: temporaries cost no call
    links={
        "nvlink": Link("nvlink", ALPHA_NVLINK, HOPPER_NVLINK, f"{H100_DATASHEET}; alpha: {NCCL_TUNING}"),
        "infiniband": Link("infiniband", ALPHA_NET, NDR_PER_GPU, f"NDR 400 Gb/s per GPU; alpha: {NCCL_TUNING}"),
        "pcie": Link("pcie", ALPHA_PCIE, PCIE_GEN5_X16, f"{H100_DATASHEET}; alpha: {NCCL_TUNING}"),
    },
    source=f"{H100_DATASHEET}; {HOPPER_WHITEPAPER}; {CUDA_GUIDE}",
    shared_memory_per_block=HOPPER_SMEM_PER_BLOCK,
)

# H200 SXM: the same GH100 die and clocks as H100 SXM (same FLOP/s, SMs, L2, NVLink),
# with 141 GB of HBM3e at 4.8 TB/s (https://www.nvidia.com/en-us/data-center/h200/).
H200_PAGE = "https://www.nvidia.com/en-us/data-center/h200/"
H200 = replace(
    H100, name="h200",
    memory_bandwidth=4.8e12,  # 4.8 TB/s HBM3e
    memory_bytes=141 * 10**9,  # 141 GB HBM3e
    # The page lists H100's NVLink (900 GB/s) and PCIe Gen5 (128 GB/s): the links are H100's.
    source=f"{H200_PAGE}; {HOPPER_WHITEPAPER}; {CUDA_GUIDE}",
)

# A100 SXM4 80GB datasheet (dense = half the printed sparse tensor figures):
A100_DATASHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                  "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
AMPERE_WHITEPAPER = ("https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/"
                     "nvidia-ampere-architecture-whitepaper.pdf")
A100 = Hardware(
    name="a100", device="gpu",
    peak_flops={
        "f64": 19.5e12,  # FP64 Tensor Core 19.5 TFLOPS (vector FP64 9.7)
        "f32": 19.5e12,  # FP32 19.5 TFLOPS
        "tf32": 156e12,  # TF32 Tensor Core 156 TFLOPS (312 with sparsity)
        "bf16": 312e12,  # BF16 Tensor Core 312 TFLOPS (624 with sparsity)
        "f16": 312e12,  # FP16 Tensor Core 312 TFLOPS
        "i8": 624e12,  # INT8 Tensor Core 624 TOPS (1,248 with sparsity)
    },  # no FP8 (Hopper adds it): flops("f8E4M3FN") falls back to bf16
    memory_bandwidth=2.039e12,  # A100 80GB SXM: 2,039 GB/s HBM2e
    # Ampere whitepaper: L2 read bandwidth 5,120 bytes/clock, at the 1.41 GHz boost clock.
    cache_bandwidth=5120 * 1.41e9,
    cache_bytes=40 * MIB,  # 40 MB L2 (whitepaper; cudaDeviceProp.l2CacheSize = 41943040)
    memory_bytes=80 * 10**9,
    cores=108,  # 108 SMs (whitepaper)
    shared_memory_per_core=164 * KIB,  # compute capability 8.0: 164 KB per SM, 163 KB per block (CUDA_GUIDE)
    registers_per_core=REGISTERS_PER_SM,
    launch_overhead=KERNEL_LAUNCH, alloc_overhead=0.0,
    links={
        # NVLink 3: 600 GB/s total per GPU (datasheet) = 300 GB/s each direction.
        "nvlink": Link("nvlink", ALPHA_NVLINK, 300e9, f"{A100_DATASHEET}; alpha: {NCCL_TUNING}"),
        # DGX A100: one ConnectX-6 HDR 200 Gb/s per GPU = 25 GB/s
        # (https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html).
        "infiniband": Link("infiniband", ALPHA_NET, 200e9 / 8, f"HDR 200 Gb/s per GPU; alpha: {NCCL_TUNING}"),
        # PCIe Gen4 x16: the datasheet's 64 GB/s counts both directions.
        "pcie": Link("pcie", ALPHA_PCIE, 32e9, f"{A100_DATASHEET}; alpha: {NCCL_TUNING}"),
    },
    source=f"{A100_DATASHEET}; {AMPERE_WHITEPAPER}; {CUDA_GUIDE}",
    shared_memory_per_block=163 * KIB,
)

GPUS = {"h100": H100, "h200": H200, "a100": A100}
TARGETS: tuple[str, ...] = (*GPUS, "cpu", "c")


def check_target(name: str) -> None:
    """ValueError naming the choices unless `name` is a hardware target (a pass option's check)."""
    if str(name).strip().lower() not in TARGETS:
        raise ValueError(f"unknown hardware target '{name}': choose one of {', '.join(TARGETS)}")


def hardware(name: str) -> Hardware:
    """The description of `name` (one of TARGETS, any case); "cpu" is this machine's
    measured profile, calibrated quickly on first use; "c" the same for the C backend."""
    from tilegraph.ir.errors import TilegraphError

    key = str(name).strip().lower()
    if key in GPUS:
        return GPUS[key]
    if key == "c":
        return _cpu_profile(str(c_profile_path()), native=True)
    if key == "cpu":
        profile = _cpu_profile(str(cpu_profile_path()))
        # The NumPy backend runs on TILEGRAPH_NUM_THREADS threads when it is set
        # (backends/numpy/chunks.py): decide for the cores it will use.
        threads = int(os.environ.get("TILEGRAPH_NUM_THREADS") or 0)
        return replace(profile, cores=threads) if threads and threads != profile.cores else profile
    raise TilegraphError(f"unknown hardware target '{name}': choose one of {', '.join(TARGETS)}")


def clear_cache() -> None:
    """Forget the loaded CPU profile, so the next hardware("cpu") reads the file again."""
    _cpu_profile.cache_clear()


# What measures this machine's profile "cpu" (the NumPy backend's kernels) and "c" (the C
# backend's) quickly on first use (quick=True): each backend registers its own
# (backends/__init__.py), from the layer above this one.
CALIBRATIONS: dict[str, Callable[..., Hardware]] = {}


def register_calibration(profile: str, measure: Callable[..., Hardware]) -> None:
    CALIBRATIONS[profile] = measure


def _measure(native: bool = False) -> Hardware:
    from tilegraph.ir.errors import TilegraphError

    calibrate = CALIBRATIONS.get("c" if native else "cpu")
    if calibrate is None:
        raise TilegraphError(f"no {'C backend' if native else 'CPU'} profile and no calibration to measure one: "
                             "import tilegraph first")
    return calibrate(quick=True)


def others_running() -> int:
    """Runnable threads of other processes right now (/proc/loadavg's running count, less this
    process's own: the caller, and a thread pool of its own still spinning after its last
    parallel region, which would otherwise read as a neighbour); 0 where the system does not say."""
    running = _runnable_threads()
    return max(0, running - _own_running()) if running > 1 else 0


def _runnable_threads() -> int:
    """Runnable threads of every process (/proc/loadavg's running count), 0 where it does not say."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return 0


def _own_running() -> int:
    """This process's runnable threads (at least 1, the caller): /proc/self/task/*/stat's state."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        # the state follows the command name, which is in parentheses and may hold spaces
        count += stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"R"
    return max(1, count)


# A measurement window in which other processes used this many cores' worth of CPU on
# average (rounded to the nearest whole core, at least one) was taken on a busy machine. Half
# a core: a neighbour held one core for half the run, which halves a two-core GEMM's rate.
BUSY_CORES = 0.5
# A machine is quiet now when no other thread is runnable and, over this many seconds,
# others used less than QUIET_CORES of a core (one reading of the runnable count alone is
# often 0 between a busy neighbour's time slices).
QUIET_WINDOW, QUIET_CORES = 0.2, 0.25


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(CPU seconds every process has used, all cores together; of them, this process's own,
    its threads and the children it waited for; the monotonic clock), or None where
    /proc/stat does not say."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        # user nice system idle iowait irq softirq steal: all but idle and iowait were busy
        # (steal: the hypervisor gave this machine's cores to another)
        ticks = sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8) if i < len(fields))
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    own = os.times()
    return ticks / hz, own.user + own.system + own.children_user + own.children_system, time.monotonic()


def cpu_clock() -> tuple[float, float, float] | None:
    """Where others_cores (and busy_count) counts from: now (_cpu_seconds)."""
    return _cpu_seconds()


def others_cores(start: tuple[float, float, float] | None, min_window: float = QUIET_WINDOW) -> float:
    """Cores' worth of CPU other processes used on average since `start` (_cpu_seconds()),
    over at least `min_window` seconds (slept out if need be: the kernel counts in ticks);
    0.0 where the system does not say."""
    if start is None:
        return 0.0
    left = start[2] + min_window - time.monotonic()
    if left > 0:
        time.sleep(left)
    end = _cpu_seconds()
    return 0.0 if end is None else _others_between(start, end)


def _others_between(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    return max(0.0, (end[0] - start[0]) - (end[1] - start[1])) / max(end[2] - start[2], 1e-9)


def _busy_cores(used: float, quiet_below: float = BUSY_CORES) -> int:
    """0 below `quiet_below` of a core on average (quiet), else the cores' worth used, at least 1."""
    return 0 if used < quiet_below else max(1, round(used))


def busy_count(start: tuple[float, float, float] | None) -> int:
    """How busy others kept the machine since `start` (_busy_cores)."""
    return _busy_cores(others_cores(start))


# Others' CPU time since a look older than this says little of what runs now.
RECENT = 2.0


class Neighbours:
    """The cores other processes keep busy, asked before each forward starts its threads. One
    reading of the runnable count often sees a passing thread (a shell, a short compile) that
    would halve a whole forward's threads; a neighbour that keeps running also used the CPU
    since the last look. So: none runnable now, none busy; else, when the last look was
    recent, the cores' worth others used since it (none where it was quiet); after a longer gap,
    the runnable count."""

    def __init__(self) -> None:
        self._since = _cpu_seconds()
        self._busy: int | None = None

    def cores(self) -> int:
        running, now, since = others_running(), _cpu_seconds(), self._since
        if now is not None and (since is None or now[2] - since[2] >= QUIET_WINDOW):
            used = _others_between(since, now) if since and now[2] - since[2] <= RECENT else None
            # a neighbour that started since the last look used part of the window: not quiet is busy
            self._busy = None if used is None else _busy_cores(used, QUIET_CORES)
            self._since = now
        if running == 0:
            return 0
        return running if self._busy is None else min(running, self._busy)


def quiet_now() -> bool:
    """No other process runnable now, nor using more than QUIET_CORES of a core over a short window."""
    return others_running() == 0 and others_cores(_cpu_seconds()) < QUIET_CORES


def _trusted(profile: Hardware) -> bool:
    """A profile to use as is: one measured on a quiet machine, or a busy one's while the
    machine is still busy (measuring again would be no better)."""
    return not profile.measured_busy or not quiet_now()


def measured_noting_load(measure: Callable[[], Hardware]) -> Hardware:
    """`measure()`'s profile, marked (`measured_busy`) with how busy other processes kept the
    machine while it ran: the CPU time they used meanwhile (this process's own threads and
    compilers not counted: a count of runnable threads would see its own OpenMP team)."""
    start = _cpu_seconds()
    profile = measure()
    busy = busy_count(start)
    return replace(profile, measured_busy=busy) if busy else profile


def marked_off_peak(profile: Hardware) -> Hardware:
    """`profile`, marked as measured busy (at least one core) where its GEMM rates are
    implausible for this processor (off_peak): trusted no more than a busy one."""
    return replace(profile, measured_busy=max(1, profile.measured_busy)) if off_peak(profile) else profile


# f32 lanes of the widest vector FMA a core has, by /proc/cpuinfo's flags, widest first.
VECTOR_LANES = (("avx512f", 16), ("avx2", 8), ("sse2", 4))
# A core's peak, as a datasheet prints it: two FMA pipes of those lanes, 2 FLOPs a lane, at the
# clock /proc/cpuinfo states. Cores issue this or half of it (one 512-bit pipe, or AVX-512 split
# into 256-bit halves) and turbo above the stated clock by up to twice (server parts: 1.2-1.6x).
FMA_PIPES, TURBO = 2, 2.0
# A quiet one-thread GEMM of the calibrated shapes reaches half of a core's real peak or more
# (oneDNN and OpenBLAS: 70-95%), so at least a quarter of the datasheet peak above: a profile
# whose best one-thread GEMM is below that shared its core with others.
PEAK_SHARE = 0.25


def processor_peak() -> float:
    """One core's datasheet f32 FLOP/s (VECTOR_LANES, FMA_PIPES, the stated clock), or 0.0
    where /proc/cpuinfo says neither the flags nor the clock."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return 0.0
    clock = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", info, re.M)
    lanes = vector_lanes(info)
    return FMA_PIPES * lanes * 2 * float(clock.group(1)) * 1e6 if clock and lanes else 0.0


def off_peak(hw: Hardware, peak: float | None = None) -> str | None:
    """What of `hw`'s one-thread GEMM rates no quiet core of this processor (`peak`: one core's
    datasheet f32 FLOP/s, processor_peak()) would measure, or None: the best below PEAK_SHARE of
    the peak (the core was shared), or any above TURBO times it (the timing is broken)."""
    peak = processor_peak() if peak is None else peak
    rates = [r for *_, r in hw.gemm_samples]
    if not peak or not rates or hw.device != "cpu":
        return None
    if max(rates) > TURBO * peak:
        return f"a one-thread GEMM at {max(rates) / 1e9:.0f} GFLOP/s, above this processor's peak of " \
               f"{TURBO * peak / 1e9:.0f} a core"
    if max(rates) < PEAK_SHARE * peak:
        return f"one-thread GEMMs at {max(rates) / peak:.0%} of this processor's peak of {peak / 1e9:.0f} GFLOP/s a core"
    return None


def _measure_noting_load(native: bool) -> Hardware:
    """A quick measurement, marked with how busy others kept the machine (measured_noting_load)
    or as busy where implausible for the processor (marked_off_peak)."""
    return marked_off_peak(measured_noting_load(lambda: _measure(native)))


@lru_cache(maxsize=None)
def _cpu_profile(path: str, native: bool = False) -> Hardware:
    """The profile at `path`, measured now (quickly) if there is none, or if it was taken
    under load and the machine is quiet now: by the NumPy backend's calibration, or where
    `native`, the C backend's."""
    profile = load_cached(path)
    if profile is not None and _trusted(profile):
        return profile
    try:
        with _locked(Path(path)):  # one pytest-xdist worker calibrates, the others wait and read it
            profile = load_cached(path)
            if profile is None or not _trusted(profile):
                profile = _measure_noting_load(native)
                save_profile(profile, path)
    except OSError:  # no writable cache directory: the measurement serves this process only
        profile = profile or _measure_noting_load(native)
    return profile


# --- the CPU profile on disk ---------------------------------------------------------

def cache_dir() -> Path:
    """$TILEGRAPH_CACHE_DIR, else $XDG_CACHE_HOME/tilegraph, else ~/.cache/tilegraph."""
    if os.environ.get("TILEGRAPH_CACHE_DIR"):
        return Path(os.environ["TILEGRAPH_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tilegraph"


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo), or the platform's best guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown-cpu"


def cpu_profile_path() -> Path:
    """Where this machine's profile lives: one file per CPU model, core count and profile
    format. The format is in the name so that two checkouts of different versions on one
    machine do not each re-measure and overwrite the other's profile on every run."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", cpu_model()).strip("-").lower() or "cpu"
    return cache_dir() / f"cpu-{slug}-{os.cpu_count() or 1}cores-v{PROFILE_FORMAT}.json"


def decision_context() -> str:
    """What the passes decide by besides the model, the pipeline and the library: the processor
    (its profile's name: model, cores, profile format), its vector width and the switches read
    at compile time (TG_BLOCKED). A compiled model cached under one context is not reused
    under another (tilegraph/compile_cache.py)."""
    return f"{cpu_profile_path().name}\0{vector_lanes()}\0TG_BLOCKED={os.environ.get('TG_BLOCKED', '')}"


def c_profile_path() -> Path:
    """Where this machine's C backend profile lives (as cpu_profile_path, prefixed "c-")."""
    return cpu_profile_path().with_name("c-" + cpu_profile_path().name)


def load_profile(path) -> Hardware | None:
    """The profile saved at `path`, or None when it is missing, unreadable or of an older format."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != PROFILE_FORMAT:
            return None
        hw = Hardware.from_dict(data["hardware"])
        return hw if "f32" in hw.peak_flops else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_cached(path) -> Hardware | None:
    """The profile the cache holds at `path`, only if it is an entry this user wrote with its
    digest (ir/cache.py): the passes decide fusion, tiling and threads by it, so an edited,
    planted or damaged one is measured again, not trusted."""
    from tilegraph.ir import cache

    return load_profile(path) if cache.verified(Path(path)) else None


def save_profile(hw: Hardware, path) -> Path:
    """Write `hw` as JSON atomically (temporary file + rename: readers never see half a file),
    mode 0600 with its digest beside it (`<name>.sha256`), which the cache's reader checks."""
    import tempfile

    from tilegraph.ir import cache

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": PROFILE_FORMAT, "hardware": hw.to_dict()}, f, indent=1)
        cache.place(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class _locked:
    """An exclusive lock on `path`.lock while one process calibrates (no-op without fcntl)."""

    def __init__(self, path: Path):
        self.path = path.with_name(path.name + ".lock")
        self.file = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: racing writers still write whole files
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()  # closing releases the lock


# --- which convolutions the C backend runs as Winograd F(4x4, 3x3) (backends/c/winograd.c) ---
# Read by its emitter (backends/c/onednn.py) and by its cost model (passes/targets/c.conv_time).
# At least this many channels in and out (a group's, grouped), and at least this many 4x4
# tiles (rows of its 36 GEMMs) unless the transformed weight (36 C K / groups floats) is at most
# this many bytes, small enough to stay in cache between calls; grouped, at least this many
# tiles x channels of a group (each GEMM's rows x columns: its transforms' cost per channel is
# the dense convolution's, its GEMMs' work a group's width; the measurements: winograd_wins).
WINOGRAD_MIN_CHANNELS = 32
WINOGRAD_MIN_TILES = 8
WINOGRAD_CACHED_WEIGHT = 4 << 20
WINOGRAD_MIN_GROUP_WORK = 1024


def winograd_shape(groups, window, strides, dilations, pads, c, k, oh, ow) -> bool:
    """Whether winograd.c can run this convolution (of a constant weight, which the caller
    checks): 2-D, 3x3, stride 1, dense or grouped, pads of at most 2, channel and spatial sizes
    known when the program is emitted (its tiles are counted then)."""
    import sympy

    return all(sympy.sympify(d).is_number for d in (*window, c, k, oh, ow)) and \
        [int(d) for d in window] == [3, 3] and list(strides) == [1, 1] and list(dilations) == [1, 1] and \
        all(0 <= int(p) <= 2 for p in pads)


def winograd_wins(n, c, k, oh, ow, groups=1) -> bool:
    """Whether Winograd F(4x4, 3x3) beats oneDNN's direct convolution on a shape winograd_shape
    takes (a batch known only at run time is judged at 1, the fewest tiles). Measured
    (benchmarks/winograd_convs.py, winograd/direct in one process, one thread, on an AVX-512
    processor) it does on every shape with enough channels and tiles: ResNet-50's 56x56x64
    0.54x at batch 1, 28x28x128 0.42x, 14x14x256 0.49x (0.45-0.65x at batch 8), DenseNet-121's
    128 -> 32 0.55-0.95x. Where its GEMMs have few rows and a transformed weight beyond the
    caches (4x the direct one's, streamed from memory each call) it gains nothing: 7x7x512 at
    batch 1, 4 tiles and 38 MB, 1.00x (1.14x in a run under load), where 7x7x128 (2.4 MB) runs
    at 0.66x. Narrow convolutions gain little (16 channels: 0.88-0.93x; 0.98-1.2x under load)
    for a weight 4x the size: left to oneDNN. Grouped, at batch 1 (36 x groups GEMMs of a
    group's width), RegNetY-4GF's 64 channels a group: 56x56x128 0.49-0.57x, 28x28x192 0.51-0.63x,
    14x14x512 (16 tiles) 0.72-0.77x, 7x7x1088 (4 tiles, a 10 MB weight) 0.80-1.29x; 32 a group
    28x28x256 0.71x but 14x14x512 1.05x; 16 a group 28x28x256 1.40x, 8 a group 2.09x."""
    import sympy

    batch = sympy.sympify(n)
    batch = batch.subs({d: 1 for d in batch.free_symbols})
    c, k, oh, ow, groups = (int(d) for d in (c, k, oh, ow, groups))
    tiles = int(batch) * -(-oh // 4) * -(-ow // 4)
    width = min(c, k) // groups
    if width < WINOGRAD_MIN_CHANNELS or (groups > 1 and tiles * width < WINOGRAD_MIN_GROUP_WORK):
        return False
    return tiles >= WINOGRAD_MIN_TILES or 36 * 4 * c * k // groups <= WINOGRAD_CACHED_WEIGHT


# --- which convolutions the C backend runs as matmuls over strided views (backends/c/strided_conv.c) ---
# Read by its emitter (backends/c/onednn.py) and by its cost model (passes/targets/c.conv_time).
# strided_conv.c takes up to this many matmuls (ceil(k / stride)); the rule asks for
# STRIDED_CONV_WIN_BLOCKS, the count measured faster, at least this many channels in and out and
# this many rows (batch x output positions) a GEMM (the measurements: strided_conv_wins).
STRIDED_CONV_MAX_BLOCKS = 4
STRIDED_CONV_WIN_BLOCKS = 2
STRIDED_CONV_MIN_CHANNELS = 512
STRIDED_CONV_MIN_ROWS = 128


def strided_conv_shape(groups, window, strides, dilations, pads, c, k) -> bool:
    """Whether strided_conv.c can run this convolution (of a constant weight, with no bias and
    eltwise post-ops only, which the caller checks): 1-D, dense, stride >= 2, dilation 1, no
    padding, at most STRIDED_CONV_MAX_BLOCKS matmuls, channels known when the program is emitted."""
    import sympy

    if len(window) != 1 or not all(sympy.sympify(d).is_number for d in (*window, c, k)):
        return False
    s, w = int(strides[0]), int(window[0])
    return int(groups) == 1 and s >= 2 and int(dilations[0]) == 1 and all(int(p) == 0 for p in pads) and \
        -(-w // s) <= STRIDED_CONV_MAX_BLOCKS


def strided_conv_wins(n, c, k, length, window, stride) -> bool:
    """Whether the matmuls beat oneDNN's direct convolution on a shape strided_conv_shape takes
    (a batch or output length known only at run time judged at 1 and 1024). Measured
    (benchmarks/strided_convs.py, matmuls/direct in one process, one thread, gelu epilogue, on an
    AVX-512 processor): two matmuls (k 3 stride 2, k 4 stride 3) at 512 channels and more ran in
    0.76-0.82 of brgconv's time over 1500-48000 outputs (wav2vec 2.0 base's feature encoder on 30 s
    of audio, its GEMMs at oneDNN's GEMM rate, the convolution below it), 0.87-0.90 at 128-500
    outputs, 768 and 1024 channels 0.79-0.82; at 384 and fewer channels nothing (0.96-1.14), where
    brgconv runs as well as the GEMMs. One matmul (k 2 stride 2, windows that do not overlap: the
    convolution is that GEMM already) 1.03-1.09; k 10 stride 5 0.97."""
    import sympy

    def at(d, default):
        d = sympy.sympify(d)
        return int(d.subs({x: default for x in d.free_symbols}))

    blocks = -(-int(window) // int(stride))
    return blocks == STRIDED_CONV_WIN_BLOCKS and min(at(c, 1), at(k, 1)) >= STRIDED_CONV_MIN_CHANNELS and \
        at(n, 1) * at(length, 1024) >= STRIDED_CONV_MIN_ROWS


# --- which convolutions the C backend runs in oneDNN's blocked layout (conv.c, tg_conv_blocked) ---
# Read by its emitter (backends/c/onednn.py, chain_convolutions) and by its cost model
# (passes/targets/c.conv_time). benchmarks/onednn_layouts.py, the same shapes in channels-last
# and nChw16c interleaved in one process, one thread, on an AVX-512 processor: at batch 8 every
# depthwise convolution of MobileNetV2 and EfficientNet-B0 with a 14x14 output or more ran in
# 0.49-0.77 of channels-last's time (7x7: 0.88-1.05), MobileNetV2's 1x1 ones in 0.44-0.98;
# ResNet-50's wide ones 0.87-1.04, nothing to gain. At batch 1 only the 112x112 ones gained
# (0.62-0.88; 56x56 0.86-1.18), too little for the reorders at a chain's ends.
BLOCKED_MIN_BATCH = 8
BLOCKED_MIN_ROWS = 8 * 14 * 14  # output pixels of all images
BLOCKED_NARROW = 384  # a 1x1 convolution's fewer channels (in or out) at most this many
# The time a blocked convolution takes against its channels-last twin, the geometric mean of
# the 14x14-and-larger shapes above at batch 8 (depthwise 0.59, 1x1 0.63).
BLOCKED_SHARE = 0.6


@lru_cache(maxsize=4)
def vector_lanes(info: str | None = None) -> int:
    """f32 lanes of the processor's widest vectors (VECTOR_LANES) by `info` (/proc/cpuinfo's
    text, read where not given), 0 where it does not say."""
    try:
        info = Path("/proc/cpuinfo").read_text() if info is None else info
    except OSError:
        return 0
    flags = re.search(r"^flags\s*:(.*)$", info, re.M)
    return next((n for flag, n in VECTOR_LANES if flags and flag in flags.group(1).split()), 0)


def chain_block(channels) -> int:
    """The channel block a chain of blocked convolutions runs in, by the channels of the
    buffers it keeps blocked (`channels`): 16 (nChw16c) where each divides by it, else 8
    (nChw8c, oneDNN's 8-lane kernels: on the shapes above at batch 8 within 0.8-1.35x of
    nChw16c's time, 0.61x channels-last's in all against 16c's 0.63x), else 0: a buffer padded
    to the block would not fit where the emitter put it (MobileNetV3's 24, 40, 72 and 120)."""
    channels = [int(c) for c in channels]
    return next((b for b in (16, 8) if all(c % b == 0 for c in channels)), 0)


def blocked_conv(n, c, k, oh, ow, depthwise: bool, window) -> int:
    """The vector lanes (16) whose blocked layout oneDNN's blocked kernels run this convolution faster
    in than in channels-last, or 0: a depthwise or 1x1 one of at most BLOCKED_NARROW channels
    on one side, at a batch of BLOCKED_MIN_BATCH or more with BLOCKED_MIN_ROWS output pixels,
    on a processor with 16-lane vectors (where it was measured; elsewhere oneDNN's blocked
    kernels are unmeasured and channels-last stays). A batch known only at run time is judged
    at 1. Whether it pays for the reorders at a chain's ends is the emitter's chain rule.
    TG_BLOCKED=0 in the environment turns it off, for a same-run A/B (benchmarks/blocked_convs.py)."""
    import sympy

    if os.environ.get("TG_BLOCKED") == "0":
        return 0

    dims = [sympy.sympify(d) for d in (n, c, k, oh, ow, *window)]
    if not all(d.is_number for d in dims[1:]):
        return 0
    batch = dims[0].subs({s: 1 for s in dims[0].free_symbols})
    n, c, k, oh, ow = (int(d) for d in (batch, *dims[1:5]))
    if not (depthwise or (all(int(d) == 1 for d in dims[5:]) and min(c, k) <= BLOCKED_NARROW)):
        return 0
    if n < BLOCKED_MIN_BATCH or n * oh * ow < BLOCKED_MIN_ROWS or vector_lanes() != 16:
        return 0
    return 16


# --- which matmuls the C backend runs as one-row GEMVs (backends/c/gemv.c) ---
# Read by its emitter (backends/c/onednn.py), for matmuls and for 1x1 convolutions of a 1x1
# image. Its cost model needs no twin: a GEMM's time is bounded below by its weight's read from
# memory (passes/targets/c.anchor_compute), which is what this path runs at.


def gemv_wins(m) -> bool:
    """Whether gemv.c beats oneDNN on x[m, K] @ W[K, N], W constant: at one row, as
    measured (benchmarks/gemv_heads.py, gemv/oneDNN in one process, one thread, bias and an
    activation, on an AVX-512 processor). Weights read from memory each call, as a whole model's
    call reads them: 0.64-0.75x on the image heads (MobileNetV3's 960x1280 and 1280x1000,
    ResNet-50's 2048x1000: 19-21 GB/s against oneDNN's 14-15), 0.48-0.72x on the
    squeeze-excitation 1x1 convolutions of MobileNetV3 and EfficientNet (a oneDNN convolution call
    is the larger part of their time); from cache 0.78-0.95x, but 1.05x on 128x1000 (a short K
    per panel), which a model's call reads cold (0.89x). A batch known only at run time is judged
    at 1 (gemv.c itself takes only a source of one row and leaves any other to oneDNN)."""
    import sympy

    rows = sympy.sympify(m)
    return int(rows.subs({s: 1 for s in rows.free_symbols})) == 1
