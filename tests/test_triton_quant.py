"""The Triton backend computes quantized layers in low precision, and computes what the float64 interpreter does.

backends/triton/quant.py turns each scheme of the quantize pass into one GEMM kernel that
multiplies the stored low-precision values: tl.dot on int8 tiles into int32 (w8a8), on
f8E4M3FN tiles into fp32 (fp8), tl.dot_scaled on MX blocks (mxfp8), and weight-only GEMMs
that decode int8 / packed int4 / packed e2m1 weights in registers. Activations are quantized on the device by row kernels.

Run here in Triton's interpreter (no GPU): the same kernels a GPU runs, checked against the
float64 interpreter of the quantized module: integer accumulators and quantized activations
bit for bit, layer outputs within the fp32 tolerance of tilegraph.testing (fp8 and MX products
are exact in fp32, so only the accumulation rounds). What the kernels become on real GPUs is
checked on ahead-of-time builds for sm_90 and sm_100: the PTX holds the low-precision
tensor-core instructions (wgmma with s8 operands; tcgen05.mma kind::i8, f8f6f4 and mxf8f6f4
with block scales), or, where Triton emulates (dot_scaled on sm_90) or accumulates in fp32 on
f16 instructions (fp8 on sm_90), the test says so. These expectations are Triton 3.8's (the
version `make test` installs); an H100 run with Triton 3.6 built w8a8 for sm_100 on mma.sync.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import tilegraph  # noqa: F401 - chooses Triton's interpreter before triton is imported
from tilegraph.backends.triton import emit, load
from tilegraph.backends.triton.aot import build_many
from tilegraph.backends.triton.runtime import pack_k, to_numpy, to_torch
from tilegraph.ir import Graph, dtypes
from tilegraph.ir.interpreter import interpret
from tilegraph.ir.quant import FORMATS, mx_scale, quantize
from tilegraph.passes.quantize import observe_ranges, save_ranges
from tilegraph.passes.registry import default_pipeline, run_pipeline
from tilegraph.testing import assert_close, reduction_length

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.xdist_group("triton_quant")]

RNG = np.random.default_rng(5)
# What each scheme's GEMM multiplies in, as the kernel spells it.
LOW_PRECISION = {
    "w8a8": "acc = tl.dot(a_tile, b_tile, acc, out_dtype=tl.int32)",
    "fp8": "acc = tl.dot(a_tile, b_tile, acc, max_num_imprecise_acc=0)",
    "mxfp8": 'tl.dot_scaled(a_tile, sa_tile, "e4m3", b_tile, sb_tile, "e4m3", acc)',
    "mxfp4": "tlquant.e2m1(tlquant.unpack_k(b_tile, BLOCK_K, BLOCK_N))",  # fp32 activations: see quant.py
    "w4a16": "tlquant.int4(tlquant.unpack_k(b_tile, BLOCK_K, BLOCK_N))",
    "w8": "w = b_tile.to(tl.float32)",
}


def mlp(dtype: str = "f32"):
    """A linear layer and a GELU (K = 64); two layers reading the same activation (K = 96: MX
    blocks of 32 in K tiles of 64 and more, the last partly masked; the quantized activation
    shared, as Q, K and V share theirs), added and layer-normed (a row reduction after a
    quantized GEMM). Every quantized activation is a model input: a float computation before
    a quantizer rounds in fp32 on the device and in float64 in the oracle, and one ulp can move
    a value across a rounding boundary of the format (a whole step, not a rounding error);
    that the device quantizes exactly as the interpreter does is the activation test's."""
    g = Graph()
    x, z = g.input("x", ("B", 16, 64), dtype), g.input("z", ("B", 16, 96), dtype)

    def w(name, shape):
        return g.weight(name, RNG.standard_normal(shape).astype(np.float32).astype(dtypes.numpy_dtype(dtype)))

    h = g.gelu(x @ w("w1", (64, 96)) + w("b1", (96,)))
    y = g.layer_norm(z @ w("w2", (96, 48)) + z @ w("w3", (96, 48)), w("s", (48,)), w("b", (48,)), -1, 1e-5)
    return g.build(h, y, names=["h", "y"])


MLP = mlp()
INPUTS = [RNG.standard_normal((3, 16, 64)).astype(np.float32), RNG.standard_normal((3, 16, 96)).astype(np.float32)]


def compiled_quantized(model, spec: str):
    quantized = run_pipeline(model, f"quantize{{{spec}}}," + default_pipeline("h100"))
    return quantized, load(emit(quantized, hardware="h100"), quantized.weights, quantized)


@pytest.mark.parametrize("scheme", list(LOW_PRECISION))
def test_each_scheme_runs_on_low_precision_kernels_and_agrees_with_the_float64_interpreter(scheme):
    quantized, compiled = compiled_quantized(MLP, f"scheme={scheme}")
    assert compiled.host_ops == {}, "a quantization op fell back to the host"
    assert "SPLIT_GROUPS = ()" in compiled.source  # the layer_norm after a GEMM stays in its kernel
    assert LOW_PRECISION[scheme] in compiled.source
    if scheme == "w8a8":
        assert "dtype=tl.int32)" in compiled.source
    for got, want in zip(compiled(*INPUTS), interpret(quantized, INPUTS)):
        assert_close(got, want, "f32", reduction_length(quantized))


def gemm_then_layer_norm(width: int):
    g = Graph()
    x = g.input("x", ("B", 16, 64))
    w = g.weight("w", RNG.standard_normal((64, width)).astype(np.float32))
    bias = g.weight("c", RNG.standard_normal(width).astype(np.float32))
    ones, zeros = g.weight("s", np.ones(width, np.float32)), g.weight("b", np.zeros(width, np.float32))
    return g.build(g.layer_norm(x @ w + bias, ones, zeros, -1, 1e-5), names=["y"])


@pytest.mark.parametrize("width, own_kernel", [(48, False), (384, True)])
def test_an_fp8_gemm_keeps_its_layer_norm_while_whole_rows_fit_its_64_row_tiles(width, own_kernel):
    """8-bit floats on both sides take tiles of 64 rows: a layer_norm over rows of 48 stays in the
    GEMM's kernel; over rows of 384 (MiniLM's) it is a row kernel of its own, reading what the GEMM
    stores, where a 64 x 512 accumulator would spill."""
    quantized, compiled = compiled_quantized(gemm_then_layer_norm(width), "scheme=fp8")
    groups = re.findall(r"'group': '([^']*)'", compiled.source)
    gemm = [g for g in groups if g.startswith("quantized_matmul")]
    assert len(gemm) == 1 and LOW_PRECISION["fp8"] in compiled.source
    assert ("reduce_mean" in gemm[0]) != own_kernel
    assert any(g.startswith("reduction") and "reduce_mean" in g for g in groups) == own_kernel
    x = RNG.standard_normal((2, 16, 64)).astype(np.float32)
    assert_close(compiled(x)[0], interpret(quantized, [x])[0], "f32", reduction_length(quantized))


@pytest.mark.parametrize("scheme", ["w8a8", "fp8"])
def test_calibrated_activations_agree_with_the_float64_interpreter(scheme, tmp_path):
    """Static activation scales (one per tensor, from calibration). int8 activations are ui8 with a
    zero point z: the kernel multiplies (a - 128) in int8 and adds (128 - z) times the weight's
    column sums, which must come out exactly as (a - z) @ w."""
    calib = save_ranges(tmp_path / "calib.npz", observe_ranges(MLP, [INPUTS]))
    quantized, compiled = compiled_quantized(MLP, f'scheme={scheme} calib="{calib}"')
    assert LOW_PRECISION[scheme] in compiled.source and compiled.host_ops == {}
    assert ("wsum" in compiled.source) == (scheme == "w8a8")
    for got, want in zip(compiled(*INPUTS), interpret(quantized, INPUTS)):
        assert_close(got, want, "f32", reduction_length(quantized))


def integer_gemm(m: int, k: int, n: int, unsigned: bool):
    g = Graph()
    a = g.input("a", (m, k), "ui8" if unsigned else "i8")
    w = g.weight("w", RNG.integers(-128, 128, (k, n)).astype(np.int8))
    zp = g.constant(np.uint8(RNG.integers(0, 256))) if unsigned else None
    return g.build(g.op("matmul_integer", a, w, *([zp] if zp is not None else [])), names=["acc"])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 70), k=st.integers(1, 300), n=st.integers(1, 40), unsigned=st.booleans(),
       seed=st.integers(0, 2 ** 16))
@example(m=65, k=300, n=33, unsigned=True, seed=1)  # a partial tile everywhere; int8 extremes below
def test_int8_gemm_accumulates_exactly_in_int32(m, k, n, unsigned, seed):
    model = integer_gemm(m, k, n, unsigned)
    compiled = load(emit(model, hardware="h100"), model.weights, model)
    assert compiled.host_ops == {} and "tl.dot(a_tile, b_tile, acc, out_dtype=tl.int32)" in compiled.source
    lo, hi = (0, 256) if unsigned else (-128, 128)
    a = np.random.default_rng(seed).integers(lo, hi, (m, k)).astype(np.uint8 if unsigned else np.int8)
    a[0] = lo  # the extremes of the type
    got = compiled(a)[0]
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, interpret(model, [a])[0])


def activation_quantizer(k: int, to: str, block: int):
    g = Graph()
    x = g.input("x", ("R", k))
    q, s = g.op("dynamic_quantize", x, to=to, block_size=block)
    return g.build(q, s, names=["q", "scale"])


QUANTIZERS = {(to, block): activation_quantizer(64, to, block)
              for to, block in (("i8", 0), ("f8E4M3FN", 0), ("f8E4M3FN", 32), ("f8E5M2", 32))}
# fp32 values whose quotient by the row's scale lands on a tie (x.5 for int8; between two e4m3
# values for fp8), and tiny and huge magnitudes (MX scales at both ends of E8M0's range).
TIES = np.array([[127.0, 0.5, 1.5, 2.5, -2.5, 100.5] + [0.0] * 58,
                 [448.0, 17.0, 1.9375, 0.0009765625, 9.0, -13.0] + [1.0] * 58,
                 [3e-39, 1e-40, 0.0, 2e-45] + [0.0] * 60,
                 [3e38, -1e38, 2.0, 1.0] + [0.0] * 60], np.float32)


@example(x=TIES)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=arrays(np.float32, st.tuples(st.integers(1, 9), st.just(64)),
                elements=st.floats(-1e4, 1e4, width=32, allow_nan=False)))
def test_activations_are_quantized_on_the_device_bit_for_bit(x):
    """Per row (int8: half to even; fp8: to nearest even, saturating) and per MX block of 32
    (an E8M0 power of two, ir.quant.mx_scale): the same values and scales as the interpreter."""
    for (to, block), model in QUANTIZERS.items():
        compiled = _loaded(model)
        assert compiled.host_ops == {}
        got, want = compiled(x), interpret(model, [x], float64=False)
        for g, w, name in zip(got, want, ("q", "scale")):
            assert g.dtype == w.dtype, (to, block, name)
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8) if g.dtype.itemsize == 1 else g,
                                          np.asarray(w).view(np.uint8) if w.dtype.itemsize == 1 else w,
                                          err_msg=f"{to} blocks of {block}: {name}")


_LOADED: dict = {}


def _loaded(model):
    if id(model) not in _LOADED:
        _LOADED[id(model)] = load(emit(model, hardware="h100"), model.weights, model)
    return _LOADED[id(model)]


def mx_weight(k: int, n: int, fmt: str):
    """An MX-quantized [K, N] weight: its values in `fmt` and its E8M0 scales [ceil(K/32), N]."""
    w = RNG.standard_normal((k, n)).astype(np.float32)
    blocks = np.abs(np.pad(w, ((0, -k % 32), (0, 0)))).reshape(-1, 32, n).max(axis=1)
    scale = mx_scale(blocks, FORMATS[fmt])
    return quantize(w, scale, None, 0, 32, fmt, FORMATS[fmt].numpy), scale


def mx8_times_mx4(k: int = 96, n: int = 40):
    """MXFP8 activations times MXFP4 weights: a pairing no scheme makes yet, which tl.dot_scaled
    multiplies natively on sm_100 (e4m3 x e2m1)."""
    g = Graph()
    x = g.input("x", ("B", 24, k))
    q, s = g.op("dynamic_quantize", x, to="f8E4M3FN", block_size=32)
    a = g.op("dequantize", q, s, axis=2, block_size=32)
    wq, ws = mx_weight(k, n, "f4E2M1FN")
    w = g.op("dequantize", g.weight("w.q", wq), g.weight("w.scale", ws), axis=0, block_size=32)
    return g.build(a @ w, names=["y"])


def test_mxfp8_activations_meet_mxfp4_weights_in_dot_scaled():
    model = mx8_times_mx4()
    fused = run_pipeline(model, default_pipeline("h100"))
    compiled = load(emit(fused, hardware="h100"), fused.weights, fused)
    assert compiled.host_ops == {}
    assert 'tl.dot_scaled(a_tile, sa_tile, "e4m3", b_tile, sb_tile, "e2m1", acc)' in compiled.source
    x = RNG.standard_normal((2, 24, 96)).astype(np.float32)
    assert_close(compiled(x)[0], interpret(model, [x])[0], "f32", reduction_length(model))


def test_bf16_activations_meet_mxfp4_weights_decoded_in_registers():
    """A bf16 model's activations enter tl.dot as they are (no rounding the IR does not say), against
    the weight tile decoded to bf16 in registers (quant.py says why not dot_scaled)."""
    model = mlp("bf16")
    quantized, compiled = compiled_quantized(model, "scheme=mxfp4")
    assert "dot_scaled" not in compiled.source
    assert compiled.source.count("acc = tl.dot(a_tile, w.to(a_tile.dtype), acc)") == 3
    xs = [x.astype(dtypes.numpy_dtype("bf16")) for x in INPUTS]
    for got, want in zip(compiled(*xs), interpret(quantized, xs)):
        assert_close(got, want, "bf16", reduction_length(quantized))


def test_4bit_weights_stay_packed_two_to_a_byte_on_the_device():
    """An odd K pads the last byte with a zero nibble; the host reads the values back unpacked."""
    k, n = 45, 24
    values = RNG.integers(-8, 8, (k, n)).astype(ml_dtypes.int4)
    scale = np.abs(RNG.standard_normal((-(-k // 16), n))).astype(np.float32) + 0.1
    g = Graph()
    x = g.input("x", ("B", k))
    y = x @ g.op("dequantize", g.weight("w.q", values), g.weight("w.scale", scale), axis=0, block_size=16)
    model = g.build(y, names=["y"])
    compiled = load(emit(model, hardware="h100"), model.weights, model)
    assert compiled.host_ops == {} and 'pack_k(W["w.q"])' in compiled.source
    packed = pack_k(to_torch(values, torch.device("cpu")))
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == ((k + 1) // 2, n)
    np.testing.assert_array_equal(to_numpy(packed).astype(np.int8), values.astype(np.int8))
    xs = RNG.standard_normal((3, k)).astype(np.float32)
    assert_close(compiled(xs)[0], interpret(model, [xs])[0], "f32", reduction_length(model))


# --- ahead of time: what the GPU multiplies in ----------------------------------------------------------------

# Tensor-core instructions of each module's GEMMs, per target (sm_90 / sm_100). dot_scaled on sm_90
# is Triton's emulation (operands upcast to bf16, wgmma on bf16); a bf16 x e2m1 weight-only GEMM
# decodes the weight to bf16 in registers on both.
EXPECTED_MMA = {
    "w8a8": {"cuda:90": "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8",
             "cuda:100": "tcgen05.mma.cta_group::1.kind::i8"},
    # fp8 on sm_90: wgmma's fp8 accumulation is not fp32's, so fp32 accumulation (max_num_imprecise_acc=0)
    # takes mma.sync on the operands widened to f16 (exact).
    "fp8": {"cuda:90": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
            "cuda:100": "tcgen05.mma.cta_group::1.kind::f8f6f4"},
    "mxfp8": {"cuda:90": ".f32.bf16.bf16", "cuda:100": "kind::mxf8f6f4.block_scale.block32"},
    "mx8x4": {"cuda:90": ".f32.bf16.bf16", "cuda:100": "kind::mxf8f6f4.block_scale.block32"},
    # bf16 tensor cores either way: tcgen05 for tiles of 64 rows and more, mma.sync below.
    "mxfp4-bf16": {"cuda:90": ".f32.bf16.bf16", "cuda:100": ("kind::f16", ".f32.bf16.bf16")},
}


@pytest.mark.slow
def test_quantized_gemms_build_for_hopper_and_blackwell_on_low_precision_tensor_cores():
    sources = {scheme: emit(run_pipeline(MLP, f"quantize{{scheme={scheme}}}," + default_pipeline("h100")),
                            hardware="h100") for scheme in ("w8a8", "fp8", "mxfp8")}
    sources["mx8x4"] = emit(run_pipeline(mx8_times_mx4(), default_pipeline("h100")), hardware="h100")
    sources["mxfp4-bf16"] = emit(run_pipeline(mlp("bf16"), "quantize{scheme=mxfp4}," + default_pipeline("h100")),
                                 hardware="h100")
    results = dict(zip(sources, build_many(list(sources.values()), targets=("cuda:90", "cuda:100"))))
    for name, builds in results.items():
        failed = [f"{r.kernel} on {r.target}: {r.error}" for r in builds if not r.ok]
        assert not failed, "\n".join(failed)
        for target, instruction in EXPECTED_MMA[name].items():
            gemms = [r for r in builds if r.target == target and r.mma]
            assert gemms, f"{name}: no tensor-core instruction for {target}"
            for r in gemms:
                accepted = instruction if isinstance(instruction, tuple) else (instruction,)
                assert len(r.mma) == 1 and any(i in r.mma[0] for i in accepted), f"{name} {r.kernel} on {target}: {r.mma}"
