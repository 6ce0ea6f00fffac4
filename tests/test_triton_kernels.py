"""Every kernel kind of the Triton backend computes what the float64 interpreter computes.

Run in Triton's interpreter (no GPU): the same kernels a GPU runs. The models are
tests/test_triton_build.py's (row kernels, GEMM + epilogue, sibling and batched
GEMMs folded into flash attention, causal and masked attention, implicit-GEMM
conv, gather, scans and arg-reductions), in fp32, fp16 and bf16, fused and tiled
for an H100; every op example of the op table, each op alone, with the ops that
have no kernel (and run on the host through their NumPy template) named; and random
graphs (hypothesis) of elementwise chains, reductions, layout ops, composites and
matmuls, fused for an H100.
"""

from __future__ import annotations

import pytest
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import tilegraph  # noqa: F401,E402 - chooses Triton's interpreter before triton is imported
from tilegraph.backends.triton import emit, load
from tilegraph.ir.interpreter import interpret
from tilegraph.passes.registry import default_pipeline, run_pipeline
from tests.test_triton_build import MODELS
from tilegraph.ir import Graph, dtypes
from tilegraph.testing import (BINARY_OPS, COMPARE_OPS, COMPOSITE_OPS, LAYOUT_OPS, REDUCE_OPS, UNARY_OPS, assert_close,
                               graphs, op_examples, random_inputs, reduction_length)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
# Ops with no kernel yet: they run on the host through their NumPy template (HOST_OPS).
HOST_OPS = {"einsum", "max_pool", "avg_pool", "gather_elements", "pad", "tile", "scatter_elements", "scatter_nd",
            "nonzero", "unique", "narrow", "non_max_suppression", "rnn", "assert_size",
            "topk", "matmul", "conv", "slice", "cumprod", "bitcast",
            # generation's ops: kernels in the C backend only so far
            "block_matmul", "block_gather", "cache_write", "cache_attention", "rms_norm", "rope", "sample",
            # training's dropout and attention backward: C kernels only so far
            "dropout", "attention_grad",
            # quantization ops no kernel of backends/triton/quant.py covers: tg.quantize per channel or
            # to 4 bits, tg.dequantize by scales along another axis than the last, outside a GEMM
            "quantize", "dequantize"}


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_kernel_kind_agrees_with_the_float64_interpreter(kind, dtype):
    model = MODELS[kind](dtype)
    fused = run_pipeline(model, default_pipeline("h100"))
    compiled = load(emit(fused, hardware="h100"), fused.weights, fused)
    assert compiled.host_ops == {}
    inputs = random_inputs(model, sizes={"B": 2, "S": 40})
    for got, want, info in zip(compiled(*inputs), interpret(model, inputs), model.outputs):
        assert_close(got, want, info.dtype, 96)


EXAMPLES = [ex for examples in op_examples().values() for ex in examples]


@pytest.mark.parametrize("example", EXAMPLES, ids=[ex.id for ex in EXAMPLES])
def test_each_op_alone_agrees_and_runs_on_a_kernel_unless_listed(example):
    model = example.model
    compiled = load(emit(model, hardware="h100"), model.weights, model)
    assert set(compiled.host_ops) <= HOST_OPS, f"{example.op} fell back to the host"
    if example.op not in HOST_OPS and example.op not in ("iota",):
        assert not compiled.host_ops
    for got, want, info in zip(compiled(*example.inputs), interpret(model, list(example.inputs)), model.outputs):
        assert_close(got, want, info.dtype, example.reduction_length)


def test_a_one_element_slice_with_a_negative_step_reaches_the_device():
    """x[0:-2:-1] of one element runs on the host and has stride -4 (NumPy calls it
    contiguous, torch refuses it); hypothesis found it in a random graph."""
    g = Graph()
    x = g.input("x", (1,))
    model = g.build(g.exp(g.slice(x, starts=(0,), ends=(-2,), steps=(-1,))), names=["y"])
    compiled = load(emit(model, hardware="h100"), model.weights, model)
    inputs = [np.array([0.25], np.float32)]
    assert_close(compiled(*inputs)[0], interpret(model, inputs)[0], "f32", 1)


def _moved_unit_dim(shape):
    """Found by hypothesis: a transpose that moves a size-1 dim ((1, 2, 2) -> (2, 1, 2), or back)
    becomes a row reshape, fused with neg; the host expanded the (1, 2, 2) input to the group's
    (2, 1, 2) frame, which torch refuses (a reshape is needed, the ranks being equal)."""
    g = Graph()
    x = g.input("x0", shape)
    return g.build(g.op("neg", g.transpose(x, (1, 0, 2))), names=["y0"])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=graphs(ops=(*UNARY_OPS, *BINARY_OPS, *REDUCE_OPS, *LAYOUT_OPS, *COMPOSITE_OPS, *COMPARE_OPS, "where",
                         "matmul", "cast"), max_ops=8, symbolic=False))
@example(model=_moved_unit_dim((1, 2, 2)))
@example(model=_moved_unit_dim((2, 1, 3)))
def test_random_graphs_fused_for_a_gpu_agree_with_the_float64_interpreter(model):
    fused = run_pipeline(model, default_pipeline("h100"))
    compiled = load(emit(fused, hardware="h100"), fused.weights, fused)
    inputs = random_inputs(model)
    for got, want, info in zip(compiled(*inputs), interpret(model, inputs), model.outputs):
        assert_close(got, want, info.dtype, reduction_length(model))


def _casts_to_and_from_bf16():
    g = Graph()
    i, f = g.input("i", ("N",), "i64"), g.input("f", ("N",), "f32")
    h = g.input("h", ("N",), "bf16")
    model = g.build(g.op("cast", i, to="bf16"), g.op("cast", f, to="bf16"), g.op("cast", h, to="i32"),
                    names=["i_bf16", "f_bf16", "h_i32"])
    return model, load(emit(model, hardware="h100"), model.weights, model)


CASTS = []  # built on first use: (model, compiled)
BF16 = dtypes.numpy_dtype("bf16")
# Beyond 2**24 an int64 -> bf16 cast rounds twice (through fp32) in torch and ml_dtypes alike.
EXACT_IN_FP32 = 2 ** 24


# Found on MiniLM in bf16 (tests/test_triton_models.py): its attention mask, cast from the int64
# input, was all zeros in Triton's interpreter (an int 1 became the bf16 whose bits are 1), and
# stores of fp32 results into bf16 truncated where a GPU rounds to nearest even.
@example(ints=np.array([1, 0, -3], np.int64), floats=np.array([1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -9, -1 - 3 * 2 ** -8], np.float32))
@settings(max_examples=25, deadline=None)
@given(ints=arrays(np.int64, st.integers(1, 12), elements=st.integers(-EXACT_IN_FP32, EXACT_IN_FP32)),
       floats=arrays(np.float32, 3, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
def test_casts_to_and_from_bf16_convert_by_value_rounding_to_nearest_even(ints, floats):
    """A cast is exact or correctly rounded: bit for bit what the interpreter computes in the
    model's own dtypes (in float64 it would not round to bf16 at all)."""
    if not CASTS:
        CASTS.append(_casts_to_and_from_bf16())
    model, compiled = CASTS[0]
    n = len(ints)
    f = np.resize(floats, n)
    h = np.clip(f, -2.0 ** 30, 2.0 ** 30).astype(BF16)  # within an i32
    inputs = [ints, f, h]
    for got, want, info in zip(compiled(*inputs), interpret(model, inputs, float64=False), model.outputs):
        assert got.dtype == dtypes.numpy_dtype(info.dtype), info
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64), err_msg=str(info))


@pytest.mark.parametrize("lq, lk", [(150, 150), (70, 150)])
def test_causal_attention_over_several_blocks_masks_only_the_diagonal_blocks(lq, lk):
    """Causal attention visits the key blocks wholly below the diagonal unmasked and compares keys
    with queries only in the blocks the diagonal crosses (offset LK - LQ, as a decoder's cache
    puts it): several query and key blocks of 64, and a float mask holding float32's lowest value
    (HF's padding mask, one row all of it), against the float64 interpreter."""
    g = Graph()
    q = g.input("q", (1, 2, lq, 32), "f32")
    k, v = (g.input(n, (1, 2, lk, 32), "f32") for n in "kv")
    mask = g.input("mask", (1, 1, lq, lk), "f32")
    model = g.build(g.attention(q, k, v, mask, 0.17, True), names=["y"])
    fused = run_pipeline(model, default_pipeline("h100"))
    source = emit(fused, hardware="h100")
    compiled = load(source, fused.weights, fused)
    assert compiled.host_ops == {} and "diagonal" in source
    inputs = random_inputs(model, seed=3)
    low = np.finfo(np.float32).min
    inputs[3] = np.where(np.random.default_rng(4).random((1, 1, lq, lk)) < 0.2, low, 0).astype(np.float32)
    inputs[3][0, 0, 5] = low
    (got,), (want,) = compiled(*inputs), interpret(model, inputs)
    assert np.isfinite(got).all()
    assert_close(got, want, "f32", lk)


@pytest.mark.parametrize("width, kernels", [(384, 1), (768, 2)])
def test_a_layer_norm_after_a_gemm_is_one_kernel_until_its_rows_outgrow_a_program(width, kernels):
    """The GEMM holds whole rows for the layer_norm in its epilogue up to 2 * ROW_TILE_ELEMENTS / 16
    values; wider rows take a second kernel (GEMM with bias and residual, then the row ops), never
    the op-by-op fallback."""
    rng = np.random.default_rng(3)
    g = Graph()
    x, r = g.input("x", ("B", 8, 64)), g.input("r", ("B", 8, width))
    h = x @ g.weight("w", rng.standard_normal((64, width)).astype(np.float32)) + g.weight(
        "b", rng.standard_normal(width).astype(np.float32)) + r
    y = g.layer_norm(h, g.weight("s", rng.standard_normal(width).astype(np.float32)),
                     g.weight("t", rng.standard_normal(width).astype(np.float32)), -1, 1e-5)
    model = g.build(y)
    fused = run_pipeline(model, default_pipeline("h100"))
    compiled = load(emit(fused, hardware="h100"), fused.weights, fused)
    assert compiled.host_ops == {} and "SPLIT_GROUPS = ()" in compiled.source
    assert compiled.source.count("@triton.jit\ndef fusion_") == kernels
    inputs = random_inputs(model, sizes={"B": 2})
    assert_close(compiled(*inputs)[0], interpret(model, inputs)[0], "f32", 64)


def test_the_preparation_is_the_backends_registered_passes():
    """What the emitter runs before writing kernels is its description's passes, runnable by
    name: every op that computes ends up in a group, the emitter's copy is the same IR."""
    from tilegraph.backends.triton.prepare import prepare
    from tilegraph.ir import Graph
    from tilegraph.ir.dialect import FusionOp, TgOp
    from tilegraph.passes.registry import run_pipeline

    g = Graph()
    x = g.input("x", ("B", 8))
    y = g.softmax(x @ g.weight("w", np.ones((8, 4), np.float32)) + g.constant(np.float32(1.0)), axis=-1)
    model = g.build(y)
    by_name = run_pipeline(model, "triton-quantized-groups,triton-kernel-groups")
    assert str(by_name.module) == str(prepare(model).module)
    top = [op for op in by_name.func.body.block.ops if isinstance(op, TgOp)]
    assert all(op.SPEC.category in ("source", "layout") for op in top)
    assert any(isinstance(op, FusionOp) for op in by_name.func.body.block.ops)
