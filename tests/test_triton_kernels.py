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
from hypothesis import HealthCheck, given, settings

import tilegraph  # noqa: F401,E402 - chooses Triton's interpreter before triton is imported
from backends.triton import emit, load
from ir.interpreter import interpret
from passes.registry import default_pipeline, run_pipeline
from tests.test_triton_build import MODELS
from tilegraph.testing import (BINARY_OPS, COMPARE_OPS, COMPOSITE_OPS, LAYOUT_OPS, REDUCE_OPS, UNARY_OPS, assert_close,
                               graphs, op_examples, random_inputs, reduction_length)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
# Ops with no kernel yet: they run on the host through their NumPy template (HOST_OPS).
HOST_OPS = {"einsum", "max_pool", "avg_pool", "gather_elements", "pad", "tile", "scatter_elements", "scatter_nd",
            "topk", "matmul", "conv", "slice", "cumprod"}


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


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=graphs(ops=(*UNARY_OPS, *BINARY_OPS, *REDUCE_OPS, *LAYOUT_OPS, *COMPOSITE_OPS, *COMPARE_OPS, "where",
                         "matmul", "cast"), max_ops=8, symbolic=False))
def test_random_graphs_fused_for_a_gpu_agree_with_the_float64_interpreter(model):
    fused = run_pipeline(model, default_pipeline("h100"))
    compiled = load(emit(fused, hardware="h100"), fused.weights, fused)
    inputs = random_inputs(model)
    for got, want, info in zip(compiled(*inputs), interpret(model, inputs), model.outputs):
        assert_close(got, want, info.dtype, reduction_length(model))
