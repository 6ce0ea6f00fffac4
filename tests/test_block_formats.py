"""GGUF's block formats (ir/block_formats.py): each dequantizes as llama.cpp's own reader
(the `gguf` package's gguf.quants) does, on any bytes, and its reference quantization
round-trips within the format's step."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tilegraph.ir.block_formats import ACTIVATION_FORMATS, FORMATS, BlockFormatError, block_gather, block_matmul

import gguf  # noqa: E402  (a dependency of tilegraph: the GGUF frontend reads with it)
from gguf import quants  # noqa: E402


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_sizes_are_ggmls(name):
    fmt = FORMATS[name]
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(fmt.ggml_type)] == (fmt.block, fmt.block_bytes)


# q8_1 is left out: gguf's table still has the old (f32 d, f32 s) 40-byte block, ggml-common.h
# has had two f16 (36 bytes) since 2024; no file stores q8_1, kernels use ggml's in-memory one.
@pytest.mark.parametrize("name", ["q8_0", "q8_k"])
def test_activation_sizes_are_ggmls(name):
    fmt = ACTIVATION_FORMATS[name]
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(fmt.ggml_type)] == (fmt.block, fmt.block_bytes)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(FORMATS)), rows=st.integers(1, 3), blocks=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_dequantize_any_bytes_as_gguf_does(name, rows, blocks, seed):
    """Bytes nobody chose (NaN and inf scales included) dequantize to gguf.quants' values, bit for bit."""
    fmt = FORMATS[name]
    k = blocks * max(fmt.block, 32)
    raw = np.random.default_rng(seed).integers(0, 256, (rows, fmt.row_bytes(k)), dtype=np.uint8)
    with np.errstate(all="ignore"):
        mine = fmt.dequantize(raw, (rows, k))
        ref = quants.dequantize(raw, gguf.GGMLQuantizationType(fmt.ggml_type))
    assert mine.dtype == np.float32 and mine.shape == ref.shape == (rows, k)
    np.testing.assert_array_equal(mine, ref)


# Worst error of the reference encoding relative to the row's largest magnitude: half a
# step of the format's grid (4-bit: 1/15 of the range; 6-bit and 8-bit finer; q4_0 a whole
# step of max/8 at the end opposite the max, clipped to 15), plus the f16 rounding of
# scales and the 6-bit rounding of k-quant scales.
MAX_RELATIVE_ERROR = {"f32": 0.0, "f16": 1e-3, "bf16": 4e-3, "q4_0": 0.125 + 1e-3, "q4_1": 0.067, "q5_0": 0.0625 + 1e-3,
                      "q8_0": 4e-3 + 1e-3, "q4_k": 0.1, "q6_k": 0.04}


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(FORMATS)), seed=st.integers(0, 2**32 - 1),
       scale=st.floats(1e-3, 1e3))
def test_quantize_round_trips_within_a_step(name, seed, scale):
    fmt = FORMATS[name]
    x = (np.random.default_rng(seed).standard_normal((3, 512)) * scale).astype(np.float32)
    raw = fmt.quantize(x)
    assert raw.dtype == np.uint8 and raw.shape == (3, fmt.row_bytes(512))
    back = fmt.dequantize(raw, x.shape)
    assert np.abs(back - x).max() <= MAX_RELATIVE_ERROR[name] * np.abs(x).max()
    np.testing.assert_array_equal(quants.dequantize(raw, gguf.GGMLQuantizationType(fmt.ggml_type)), back)


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q8_0", "bf16"])
def test_quantize_is_ggmls_reference(name):
    """Where gguf.quants quantizes (ggml's *_ref routines, bit-exact), ours writes the same bytes."""
    fmt = FORMATS[name]
    x = (np.random.default_rng(1).standard_normal((4, 256)) * 3).astype(np.float32)
    np.testing.assert_array_equal(fmt.quantize(x), quants.quantize(x, gguf.GGMLQuantizationType(fmt.ggml_type)))


def test_activation_formats_round_trip():
    x = np.random.default_rng(2).standard_normal((2, 512)).astype(np.float32)
    for fmt in ACTIVATION_FORMATS.values():
        back = fmt.dequantize(fmt.quantize(x), x.shape)
        assert np.abs(back - x).max() <= 0.01 * np.abs(x).max(), fmt.name
    q8k = ACTIVATION_FORMATS["q8_k"].quantize(x).reshape(-1, 292)
    bsums = q8k[:, 260:].copy().view(np.int16)
    np.testing.assert_array_equal(bsums, q8k[:, 4:260].view(np.int8).reshape(-1, 16, 16).sum(-1))


def test_matmul_and_gather_read_the_bytes():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((70, 64)).astype(np.float32)
    for name in ("q4_1", "q8_0"):
        raw = FORMATS[name].quantize(w)
        x = rng.standard_normal((2, 3, 64))
        np.testing.assert_allclose(block_matmul(x, raw, name, 64), x @ FORMATS[name].dequantize(raw, w.shape).T,
                                   rtol=1e-12)
        np.testing.assert_array_equal(block_gather(raw, np.array([[5, 0], [69, -1]]), name, 64),
                                      FORMATS[name].dequantize(raw, w.shape)[[[5, 0], [69, -1]]])


def test_bad_shapes_are_named():
    with pytest.raises(BlockFormatError, match="whole number"):
        FORMATS["q4_0"].row_bytes(48)
    with pytest.raises(BlockFormatError, match="bytes"):
        FORMATS["q8_0"].dequantize(np.zeros(33, np.uint8), (1, 32))
