"""Every kind of kernel the Triton backend writes builds for real GPUs, ahead of time.

The issue's bar: "a kernel that would not build on a real GPU fails CI". Each
model below is small and exercises one kernel kind (row kernels, GEMM with a fused
epilogue, sibling and batched GEMMs, flash attention, implicit-GEMM conv2d,
gather, reductions and scans over any axis) in fp32, fp16 and bf16; every kernel
of the emitted module is compiled by `backends.triton.aot` for sm_90 (PTX and
cubin, with the shared memory it needs checked against an H100's) and for gfx942.
All of them, and MiniLM's module, are built in one subprocess (`build_many`: one
start of Python, torch and Triton rather than thirteen), so these tests share one
xdist group and run on one worker.
"""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph  # chooses Triton's interpreter before triton is imported
from tilegraph.backends.triton import emit
from tilegraph.backends.triton.aot import build_many
from tilegraph.ir import Graph
from tilegraph.passes.cost.hardware import hardware
from tilegraph.passes.registry import default_pipeline, run_pipeline

pytestmark = pytest.mark.xdist_group("triton_build")

RNG = np.random.default_rng(7)
DTYPES = ("f32", "f16", "bf16")


def _weight(g, name, shape, dtype):
    return g.weight(name, RNG.standard_normal(shape).astype(np.float32).astype(_numpy(dtype)))


def _numpy(dtype):
    from tilegraph.ir import dtypes

    return dtypes.numpy_dtype(dtype)


def rows(dtype):
    g = Graph()
    x = g.input("x", ("B", 8, 48), dtype)
    b = _weight(g, "b", (48,), dtype)
    y = g.layer_norm(g.softmax(g.exp(x) + b), _weight(g, "s", (48,), dtype), b, -1, 1e-5)
    return g.build(y, g.sum(x, (0, 2), True), names=["y", "s"])


def gemm(dtype):
    g = Graph()
    x = g.input("x", ("B", 16, 64), dtype)
    h = g.gelu(x @ _weight(g, "w", (64, 96), dtype) + _weight(g, "b", (96,), dtype))
    q, k, v = (h @ _weight(g, f"w{i}", (96, 32), dtype) for i in range(3))
    return g.build(g.softmax(q @ k.transpose(0, 2, 1)) @ v, names=["y"])


def attention(dtype):
    g = Graph()
    q, k, v = (g.input(n, ("B", 4, "S", 32), dtype) for n in "qkv")
    mask = g.input("mask", ("B", 1, 1, "S"), "i1")
    return g.build(g.attention(q, k, v, None, 0.17, True), g.attention(q, k, v, mask, 0.17, False),
                   names=["causal", "masked"])


def conv_gather(dtype):
    g = Graph()
    x = g.input("x", ("B", 3, 16, 16), dtype)
    y = g.relu(g.op("conv", x, _weight(g, "w", (8, 3, 3, 3), dtype), _weight(g, "b", (8,), dtype),
                    strides=(2, 2), pads=(1, 1, 1, 1), dilations=(1, 1), groups=1))
    ids = g.input("ids", ("B", 7), "i64")
    e = g.gather(_weight(g, "table", (100, 24), dtype), ids, 0)
    return g.build(y, e, g.op("cumsum", e, axis=1), g.op("argmax", e, axis=1, keepdims=False),
                   names=["y", "e", "c", "a"])


MODELS = {"rows": rows, "gemm": gemm, "attention": attention, "conv_gather": conv_gather}


def minilm_source() -> str:
    from tests.models import minilm_inputs, minilm_model

    model = tilegraph.import_model(minilm_model(), minilm_inputs(2, 128))
    return emit(run_pipeline(model, default_pipeline("h100")), hardware="h100")


@pytest.fixture(scope="module")
def built() -> dict:
    """(kind, dtype) or "minilm" -> (the module's source, its builds), all in one subprocess."""
    sources = {(kind, dtype): emit(run_pipeline(MODELS[kind](dtype), default_pipeline("h100")), hardware="h100")
               for kind in MODELS for dtype in DTYPES}
    sources["minilm"] = minilm_source()
    return {key: (source, results) for (key, source), results in zip(sources.items(), build_many(list(sources.values())))}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_kernel_builds_for_hopper_and_cdna3(built, kind, dtype):
    source, results = built[kind, dtype]
    assert results, "no kernel was built"
    assert all(f"'{r.kernel}': {{'signature'" in source for r in results)  # this module's builds
    failed = [f"{r.kernel} on {r.target}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert {r.target for r in results} == {"cuda:90", "hip:gfx942"}
    limit = hardware("h100").shared_memory_per_block
    for r in results:
        assert r.shared <= limit, f"{r.kernel} needs {r.shared} bytes of shared memory; an H100 block has {limit}"


def test_minilm_kernels_build_for_hopper_and_cdna3(built):
    """The real model's module: every kernel (its six layers share them) builds for both GPUs."""
    source, results = built["minilm"]
    failed = [f"{r.kernel} on {r.target}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    kinds = {r.kernel for r in results}
    assert source.count("@triton.jit") == len(kinds) >= 5  # gather, embeddings, QKV, attention, FFN, ...
    assert "SPLIT_GROUPS = ()" in source  # every fused group is one kernel
    assert all(r.shared <= hardware("h100").shared_memory_per_block for r in results)


def test_fp32_attention_takes_tf32_tensor_cores_three_times_on_hopper(built):
    """fp32 tl.dot is tf32x3 where NVIDIA's tensor cores take TF32 (about fp32's accuracy: three TF32
    products of the split operands, accumulated in fp32) and fp32 FMAs on AMD, from one module
    source: the module's F32_DOT is chosen per target (group_kernels.f32_dot_precision)."""
    from tilegraph.backends.triton.group_kernels import f32_dot_precision

    assert (f32_dot_precision("cuda", 90), f32_dot_precision("cuda", 75), f32_dot_precision("hip", "gfx942")) == \
        ("tf32x3", "ieee", "ieee")
    source, results = built["attention", "f32"]
    assert "input_precision=F32_DOT" in source
    hopper = [r for r in results if r.target == "cuda:90" and r.mma]
    assert hopper, "no tensor-core instruction on sm_90"
    assert all(".tf32" in m for r in hopper for m in r.mma), [r.mma for r in hopper]


def test_fp32_gemms_offer_the_autotuner_fmas_and_tf32x3_on_hopper(built):
    """Which is faster depends on the GEMM and its epilogue: each configuration comes with fp32 FMAs
    (first, the default) and with tf32x3, and the TF32X3 builds multiply on TF32 tensor cores."""
    from tilegraph.backends.triton.runtime import import_source

    source, _ = built["gemm", "f32"]
    gemms = {name: entry for name, entry in import_source(source).KERNELS.items() if "TF32X3" in entry["signature"]}
    assert gemms, "no fp32 GEMM offers tf32x3"
    for entry in gemms.values():
        choices = [c["TF32X3"] for c in entry["configs"]]
        assert choices[0] == 0 and sorted(choices) == [0] * (len(choices) // 2) + [1] * (len(choices) // 2)
    builds = build_many([source], targets=("cuda:90",), all_configs=True)[0]
    for r in builds:
        if r.kernel in gemms:
            assert r.ok, r.error
            assert bool(r.mma) == bool(r.config["TF32X3"]) and all(".tf32" in m for m in r.mma), (r.config, r.mma)
