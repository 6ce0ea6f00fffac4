"""Every kind of group `fuse` makes is lowered as one group: one step (one kernel), with no
intermediate buffer written and read back, on every backend; and it still computes what
the float64 interpreter computes.

A group that a backend silently lowers op by op computes the right numbers, so only a
test of the lowering itself sees it (a fusion kind once went missing that way).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import tilegraph
from tilegraph.ir import Graph, interpret
from tilegraph.ir.dialect import FusionOp
from tilegraph.ir.fusion import GroupKind
from tilegraph.testing import assert_close, reduction_length

RNG = np.random.default_rng(0)


def _w(*shape):
    return (RNG.standard_normal(shape) * 0.3).astype(np.float32)


def _model(kind: GroupKind):
    """A model whose computation `fuse` makes into one group of `kind`."""
    g = Graph()
    x = g.input("x", ("S", 32))
    if kind is GroupKind.ELEMENTWISE:
        out = g.relu(x * g.weight("s", _w(32)) + g.weight("b", _w(32)))
    elif kind is GroupKind.REDUCTION:  # a residual add and a layer_norm
        out = g.layer_norm(x + g.weight("r", _w(32)), g.weight("gamma", _w(32)), g.weight("beta", _w(32)))
    elif kind is GroupKind.MATMUL:
        out = g.matmul(x, g.weight("w", _w(32, 48)))
    elif kind is GroupKind.MATMUL_EPILOGUE:
        out = g.relu(g.matmul(x, g.weight("w", _w(32, 48))) + g.weight("b", _w(48)))
    elif kind is GroupKind.HORIZONTAL_MATMUL:  # Llama's gated MLP
        g = Graph()
        x = g.input("x", ("B", 16, 32))
        gate, up = g.matmul(x, g.weight("wg", _w(32, 64))), g.matmul(x, g.weight("wu", _w(32, 64)))
        out = gate * g.sigmoid(gate) * up
    elif kind in (GroupKind.CONV, GroupKind.CONV_EPILOGUE):
        g = Graph()
        img = g.input("x", ("N", 4, 9, 9))
        out = g.conv(img, g.weight("w", _w(8, 4, 3, 3)), strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1))
        if kind is GroupKind.CONV_EPILOGUE:
            out = g.relu(out + g.weight("b", _w(1, 8, 1, 1)))
    elif kind is GroupKind.ATTENTION:
        g = Graph()
        q, k, v = (g.input(n, ("B", 2, "S", 16)) for n in "qkv")
        return g.build(g.attention(q, k, v, scale=0.25), names=["out"])
    else:
        raise AssertionError(kind)
    return g.build(out, names=["out"])


SIZES = {"S": 5, "N": 2, "B": 2}


def _inputs(model):
    return [RNG.standard_normal([d if isinstance(d, int) else SIZES[str(d)] for d in info.shape]).astype(np.float32)
            for info in model.inputs]


# The kinds `fuse` makes (QUANTIZED_MATMUL is the Triton backend's own). Einsum groups run on
# the host in C and NumPy (backends/c/emit.py's HOST_FALLBACK) and are not listed. For the C
# target `fuse` never merges sibling GEMMs: its cost model prices two GEMMs of one input as no
# slower than one wider GEMM, so only the NumPy target makes horizontal groups.
C_KINDS = [GroupKind.ELEMENTWISE, GroupKind.REDUCTION, GroupKind.MATMUL, GroupKind.MATMUL_EPILOGUE,
           GroupKind.CONV, GroupKind.CONV_EPILOGUE, GroupKind.ATTENTION]
KINDS = C_KINDS + [GroupKind.HORIZONTAL_MATMUL]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_fuse_makes_each_kind(kind):
    from tilegraph.passes.registry import DEFAULT_PIPELINE, run_pipeline, with_hardware

    target = "c" if kind in C_KINDS else "cpu"
    model = run_pipeline(_model(kind), with_hardware(DEFAULT_PIPELINE, target))
    kinds = [op.kind for op in model.func.walk() if isinstance(op, FusionOp)]
    assert kinds == [kind.value]


# Intermediates a group needs in C besides its results: a convolution's NCHW input copied channels-last,
# the layout oneDNN's fast kernels take.
EXTRA_BUFFERS = {GroupKind.CONV: 1, GroupKind.CONV_EPILOGUE: 1}


@pytest.mark.parametrize("kind", C_KINDS, ids=lambda k: k.value)
def test_the_c_backend_lowers_each_kind_as_one_step(kind):
    model = _model(kind)
    compiled = tilegraph.compile(model, target="c")
    program = compiled._runner.program
    assert len(program.steps) == 1 and program.steps[0].host_op is None, [s.comment for s in program.steps]
    temps = [b for b in program.emitter.buffers if b.storage == "temp"]
    assert len(temps) == len(model.outputs) + EXTRA_BUFFERS.get(kind, 0)
    xs = _inputs(model)
    for got, want in zip(compiled.run(*xs), interpret(model, xs)):
        assert_close(got, want, "f32", reduction_length=reduction_length(model, SIZES))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_the_numpy_backend_lowers_each_kind_as_one_function(kind):
    model = _model(kind)
    compiled = tilegraph.compile(model, target="numpy")
    assert len(re.findall(r"\bdef fusion_\d+\(", compiled.source)) == 1
    assert f"'buffers': {len(model.outputs)}," in compiled.source  # the memory plan: the results, nothing else
    xs = _inputs(model)
    for got, want in zip(compiled.run(*xs), interpret(model, xs)):
        assert_close(got, want, "f32", reduction_length=reduction_length(model, SIZES))


def test_an_rms_norm_after_a_gemm_is_one_pass_over_its_rows():
    """A decoder's residual add and RMS norm after its output projection (Llama): fused with
    the GEMM into one group, lowered as the GEMM then one loop over the rows, no intermediate
    (the squares, their mean, the reciprocal root) written and read back."""
    g = Graph()
    x = g.input("x", ("S", 32))
    h = g.matmul(x, g.weight("w", _w(32, 32))) + x
    rms = h * g.rsqrt(g.reduce_mean(h * h, axes=(-1,), keepdims=True) + g.constant(np.float32(1e-6))) * \
        g.weight("gamma", _w(32))
    model = g.build(h, rms, names=["h", "rms"])
    compiled = tilegraph.compile(model, target="c")
    program = compiled._runner.program
    assert [s.comment.split(":")[0] for s in program.steps] == ["fusion matmul_epilogue"], \
        [s.comment for s in program.steps]
    assert len([b for b in program.emitter.buffers if b.storage == "temp"]) == 2  # h and rms, nothing between
    xs = _inputs(model)
    for got, want in zip(compiled.run(*xs), interpret(model, xs)):
        assert_close(got, want, "f32", reduction_length=reduction_length(model, SIZES))
