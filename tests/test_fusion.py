"""The fuse and tile passes, and the NumPy backend running their groups.

What these hold: fusion finds the groups a transformer block is made of (matmul
epilogues, a residual + layer_norm, the Q/K/V siblings as one GEMM), every
decision is visible in printed IR and leaves a remark with predicted costs, tiles
respect their limits, the memory planner reuses buffers, and none of it changes
results beyond the dtype's tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from tilegraph.backends.numpy import compile_model, emit
from tilegraph.ir import Graph, Model, interpret
from tilegraph.ir.dialect import FusionOp
from tilegraph.passes.registry import DEFAULT_PIPELINE, UNFUSED_PIPELINE, run_pipeline
from tilegraph.passes.remarks import collect
from tilegraph.testing import assert_close, random_inputs, reduction_length

RNG = np.random.default_rng(0)


def _w(*shape) -> np.ndarray:
    return (RNG.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)


def encoder_block(d: int = 64, hidden: int = 256, heads: int = 4, batch="B", seq: int = 48) -> Model:
    """One BERT-style block: Q/K/V projections, attention, output projection + residual +
    layer_norm, FFN with gelu + residual + layer_norm."""
    g = Graph()
    x = g.input("x", (batch, seq, d))
    q, k, v = (g.reshape(x @ g.weight(f"w{n}", _w(d, d)) + g.weight(f"b{n}", _w(d)), (batch, seq, heads, d // heads))
               for n in "qkv")
    q, k, v = (g.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
    a = g.attention(q, k, v, scale=float(1 / np.sqrt(d // heads)))
    a = g.reshape(g.transpose(a, (0, 2, 1, 3)), (batch, seq, d))
    h = g.layer_norm(a @ g.weight("wo", _w(d, d)) + g.weight("bo", _w(d)) + x, g.weight("g1", np.ones(d, np.float32)),
                     g.weight("n1", np.zeros(d, np.float32)), axis=-1, epsilon=1e-5)
    f = g.gelu(h @ g.weight("w1", _w(d, hidden)) + g.weight("b1", _w(hidden)))
    y = g.layer_norm(f @ g.weight("w2", _w(hidden, d)) + g.weight("b2", _w(d)) + h,
                     g.weight("g2", np.ones(d, np.float32)), g.weight("n2", np.zeros(d, np.float32)),
                     axis=-1, epsilon=1e-5)
    return g.build(y)


def groups(model: Model) -> list[FusionOp]:
    return [op for op in model.func.walk() if isinstance(op, FusionOp)]


def kinds(model: Model) -> list[tuple[str, tuple[str, ...]]]:
    return [(g.kind, tuple(op.op_name for op in g.ops)) for g in groups(model)]


@pytest.fixture(scope="module")
def block():
    return encoder_block()


@pytest.fixture(scope="module")
def fused(block):
    return run_pipeline(block, DEFAULT_PIPELINE)


def test_fusion_finds_the_groups_of_a_transformer_block(fused):
    found = kinds(fused)
    assert ("horizontal_matmul", ("matmul", "add", "matmul", "add", "matmul", "add")) in found
    assert ("matmul_epilogue", ("matmul", "add", "gelu")) in found
    assert found.count(("matmul_epilogue", ("matmul", "add", "add", "layer_norm"))) == 2
    # Every compute op is in a group; what is left outside only names or moves data.
    outside = {op.name for op in fused.ops() if not isinstance(op, FusionOp)} - {"func.return"}
    assert outside <= {"tg.weight", "tg.reshape", "tg.transpose", "tg.constant"}, outside


def test_fused_and_tiled_ir_prints_and_parses_back(fused):
    text = fused.text
    assert 'tg.fusion "matmul_epilogue"' in text and "tile = {" in text
    assert Model.parse(text, fused.weights).text == text


def test_every_fusion_decision_leaves_a_remark_with_predicted_costs(block):
    with collect() as remarks:
        run_pipeline(block, DEFAULT_PIPELINE)
    fuse = [str(r) for r in remarks if r.pass_name == "fuse"]
    assert any("fused" in r and "saves" in r and " us" in r for r in fuse)
    assert any("not fused" in r and "would" in r for r in fuse)  # the rejected, with why
    tile = [str(r) for r in remarks if r.pass_name == "tile"]
    assert any("chunks of" in r and "next best" in r for r in tile)


@pytest.mark.parametrize("tile", ["tile", "tile{max-rows=1}", "tile{max-rows=5}", "tile{max-cols=5}",
                                  "tile{blas-gemm=true max-rows=5}"])
def test_fused_groups_compute_what_the_interpreter_computes(block, tile):
    model = run_pipeline(block, f"{UNFUSED_PIPELINE},fuse,{tile}")
    x = random_inputs(block, seed=3, sizes={"B": 3})
    expected = interpret(block, x)[0]
    got = compile_model(model)(*x)[0]
    assert_close(got, expected, "f32", reduction_length(block, {"B": 3}))


def test_sibling_matmuls_run_as_one_gemm(fused):
    source = emit(fused)
    assert source.count("np.concatenate([") == 1  # the Q, K, V weights, once, in build()
    assert "3 sibling matmuls, one GEMM" in source


def test_the_memory_planner_reuses_buffers():
    g = Graph()
    x = g.input("x", ("B", 64))
    y = x
    for i in range(8):  # matmul groups of one shape: each result dies at the next group
        y = g.relu(y @ g.weight(f"w{i}", _w(64, 64)))
    model = run_pipeline(g.build(y), DEFAULT_PIPELINE)
    assert len(groups(model)) == 8
    source = emit(model)
    namespace: dict = {}
    exec(compile(source, "<test>", "exec"), namespace)  # noqa: S102
    assert namespace["PLAN"]["kernels"] == 8
    assert namespace["PLAN"]["buffers"] <= 3  # not 8: buffers of dead results are reused
    x_in = random_inputs(model, seed=0, sizes={"B": 5})
    assert_close(compile_model(model)(*x_in)[0], interpret(model, x_in)[0], "f32", 64 * 8)


def test_long_attention_is_tiled_flash_style():
    g = Graph()
    q = g.input("q", (1, 2, 4096, 16))
    model = run_pipeline(g.build(g.attention(q, q, q, scale=0.25, causal=True)), DEFAULT_PIPELINE)
    (group,) = groups(model)
    tile = group.tile()
    assert tile["block_kv"] < 4096 and tile["block_q"] < 4096
    assert "attention_tiled(" in emit(model)


def test_gpu_tiles_fit_shared_memory_and_registers(block):
    from tilegraph.passes.cost.hardware import hardware

    model = run_pipeline(block, f"{UNFUSED_PIPELINE},fuse{{hardware=h100}},tile{{hardware=h100}}")
    h100 = hardware("h100")
    gemm_tiles = [g.tile() for g in groups(model) if "block_m" in g.tile()]
    assert gemm_tiles
    for t in gemm_tiles:
        smem = t["num_stages"] * (t["block_m"] * t["block_k"] + t["block_k"] * t["block_n"]) * 4
        assert smem <= h100.shared_memory_per_core
        assert t["block_m"] * t["block_n"] // (32 * t["num_warps"]) <= 128


def test_fusion_lowers_the_predicted_time(block):
    from tilegraph.passes.cost.hardware import hardware
    from tilegraph.passes.cost.model import NOMINAL_DIM, at, module_cost

    # At the sizes the passes decide for (a symbolic dim is priced at NOMINAL_DIM).
    hw, sizes = hardware("cpu"), {"B": NOMINAL_DIM}
    before = at(module_cost(run_pipeline(block, UNFUSED_PIPELINE).module, hw).time, sizes)
    after = at(module_cost(run_pipeline(block, DEFAULT_PIPELINE).module, hw).time, sizes)
    assert after < before


def test_a_tiny_gemm_stays_off_blas_threads():
    # The small CNN's classifier (32x144 @ 144x10, 3 us) ran 70 us on BLAS's threads: the
    # handover alone (set_num_threads there and back) is 4x the GEMM. The tile pass now
    # prices it (Hardware.blas_call_overhead) and so cannot prefer it for a few FLOPs.
    g = Graph()
    x = g.input("x", (32, 144))
    model = run_pipeline(g.build(x @ g.weight("w", _w(144, 10)) + g.weight("b", _w(10))), DEFAULT_PIPELINE)
    (group,) = groups(model)
    assert "blas" not in group.tile()


def test_a_chain_of_two_gemms_is_priced_for_both_gemms():
    # fuse never makes such a group (two anchors), but it prices the candidate for its
    # "not fused" remark. Priced as siblings (one GEMM, widths summed, the first's K), the
    # chain 128x384 @ 384x1536 -> relu -> @ 1536x384 looked 1 ms faster than its two halves:
    # "would have saved 957.6 us". Fused, it saves at most the 128x1536 intermediate's trip
    # through memory; its two GEMMs cannot run faster than two groups run them.
    from tilegraph.ir.dialect import TgOp
    from tilegraph.ir.shapes import info_of
    from tilegraph.passes.cost.hardware import hardware
    from tilegraph.passes.cost.model import at_nominal, group_cost

    g = Graph()
    x = g.input("x", (128, 384))
    model = g.build(g.relu(x @ g.weight("w1", _w(384, 1536))) @ g.weight("w2", _w(1536, 384)))
    matmul1, relu, matmul2 = [op for op in model.func.walk() if isinstance(op, TgOp) and op.op_name != "weight"]
    x_info, w1, hidden, w2 = (info_of(v.type) for v in (*matmul1.operands, *matmul2.operands))
    hw = hardware("cpu")

    def predicted(ops, inputs, outputs):
        return at_nominal(group_cost(ops, inputs, outputs, hw).time)

    halves = predicted([matmul1, relu], [x_info, w1], [hidden]) + predicted([matmul2], [hidden, w2], model.outputs)
    assert predicted([matmul1, relu, matmul2], [x_info, w1, w2], model.outputs) >= 0.9 * halves


def test_a_group_no_one_reads_is_fused_and_priced():
    # Found by hypothesis (fuse alone, before dce, on a random graph): a GEMM epilogue whose
    # result nothing reads has no outputs, and pricing its GEMM on all cores asked for the
    # dtype of its first output.
    g = Graph()
    x = g.input("x", (64, 32))
    g.relu(x @ g.weight("w", _w(32, 16)) + g.weight("b", _w(16)))  # dead
    model = g.build(g.tanh(x))
    fused = run_pipeline(model, "fuse,tile")
    x_in = random_inputs(model, seed=5)
    assert_close(compile_model(fused)(*x_in)[0], interpret(model, x_in)[0], "f32")


def test_an_empty_tensor_is_fused_and_priced():
    # Found by hypothesis: a matmul with a zero-size dim made the cost model ask for
    # the GEMM rate of a 0x1x2 product.
    g = Graph()
    x = g.input("x", (0, 2))
    model = g.build(g.relu(x @ g.weight("w", _w(2, 1))))
    fused = run_pipeline(model, f"{UNFUSED_PIPELINE},fuse,tile{{max-rows=1}}")
    assert groups(fused)
    assert compile_model(fused)(np.zeros((0, 2), np.float32))[0].shape == (0, 1)


def test_a_linear_layer_exported_between_reshapes_still_fuses_with_what_follows():
    # GPT-2's Conv1D: [B, S, D] -> [B*S, D] @ W + b -> [B, S, H], then the activation.
    g = Graph()
    x = g.input("x", (2, 24, 32))
    h = g.reshape(g.reshape(x, (48, 32)) @ g.weight("w", _w(32, 64)) + g.weight("b", _w(64)), (2, 24, 64))
    model = g.build(g.tanh(h) * h)
    fused = run_pipeline(model, DEFAULT_PIPELINE)
    assert ("matmul_epilogue", ("matmul", "add", "reshape", "tanh", "mul")) in kinds(fused)
    for tile in ("tile", "tile{max-rows=5}"):
        out = run_pipeline(model, f"{UNFUSED_PIPELINE},fuse,{tile}")
        x_in = random_inputs(model, seed=2)
        assert_close(compile_model(out)(*x_in)[0], interpret(model, x_in)[0], "f32", 32)


def test_a_profiled_module_times_every_kernel_and_computes_the_same(fused, block):
    from tilegraph.backends.numpy.emit import emit_profiled
    from tilegraph.backends.numpy.runtime import load

    source, kernels = emit_profiled(fused)
    compiled = load(source, fused.weights, fused)
    x = random_inputs(block, seed=4, sizes={"B": 2})
    assert_close(compiled(*x)[0], interpret(block, x)[0], "f32", reduction_length(block, {"B": 2}))
    namespace: dict = {}
    exec(compile(source, "<profiled>", "exec"), namespace)  # noqa: S102
    forward = namespace["build"](fused.weights)
    forward(*x)
    profile = namespace["PROFILE"]
    assert set(profile) == set(kernels) and len(kernels) == len(groups(fused))
    assert all(calls == 1 and seconds > 0 for seconds, calls in profile.values())
    assert {k.kind for k in kernels.values()} == {g.kind for g in groups(fused)}


def test_an_input_broadcast_along_the_chunk_axis_is_read_whole_by_every_chunk():
    """A group chunked along axis 0 reading a value of size 1 on that axis (a broadcast):
    each chunk reads all of it, not its own rows of it."""
    rng = np.random.default_rng(0)
    g = Graph()
    x, b = g.input("x", (6, 8, 16)), g.input("b", (1, 8, 16))
    model = g.build(g.exp(x + b) * b)
    tiled = run_pipeline(model, "fuse,tile{max-rows=2}")
    group = next(op for op in tiled.func.body.block.ops if isinstance(op, FusionOp))
    assert group.tile().get("axis") == 0 and group.tile().get("chunks", 1) > 1
    xs = [rng.standard_normal((6, 8, 16)).astype(np.float32), rng.standard_normal((1, 8, 16)).astype(np.float32)]
    assert_close(compile_model(tiled)(*xs)[0], interpret(model, xs)[0], "f32")
