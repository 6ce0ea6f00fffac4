"""The cost model's unit properties (passes/cost/model.py).

What these hold: FLOPs and bytes follow their definitions (a GEMM is 2mnk, an
elementwise op reads each input once and writes its output once, a fused group
touches memory only for its own inputs and outputs), the datasheet roofline puts
a big GEMM and a big add on the sides of the ridge they belong on, costs are
formulas in the symbolic dims, and on this machine's profile the model ranks two
very different kernels the way the clock does. Accuracy on whole models is not a
unit test: benchmarks/cost_model_accuracy.py measures it.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import sympy

from tilegraph.backends.numpy import compile_model
from tilegraph.ir import Graph, Model
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.shapes import symbol
from tilegraph.passes.cost.hardware import hardware
from tilegraph.passes.cost.model import (at, cold_bytes, forward_flops, fusion_cost, module_cost, op_bytes, op_cost,
                                         op_flops)
from tilegraph.passes.registry import DEFAULT_PIPELINE, run_pipeline

F32 = 4  # bytes per f32 element
RNG = np.random.default_rng(0)


def _w(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def only(model: Model, name: str) -> TgOp:
    (op,) = [op for op in model.func.walk() if isinstance(op, TgOp) and op.op_name == name]
    return op


def groups(model: Model) -> list[FusionOp]:
    return [op for op in model.func.walk() if isinstance(op, FusionOp)]


def matmul_model(m, n, k, batch=()) -> Model:
    g = Graph()
    x, w = g.input("x", (*batch, m, k)), g.input("w", (k, n))  # an input: no big random weight to make
    return g.build(x @ w)


def add_model(*shape) -> Model:
    g = Graph()
    x, y = g.input("x", shape), g.input("y", shape)
    return g.build(x + y)


@pytest.mark.parametrize("m, n, k, batch", [(7, 5, 3, ()), (128, 384, 1536, ()), (16, 32, 8, (3, 2))])
def test_matmul_flops_are_two_m_n_k(m, n, k, batch):
    op = only(matmul_model(m, n, k, batch), "matmul")
    assert op_flops(op) == 2 * m * n * k * int(np.prod(batch))


def test_a_models_forward_flops_sum_its_ops_at_the_given_sizes():
    g = Graph()
    x, w = g.input("x", (symbol("B"), 64, 32)), g.input("w", (32, 16))
    model = g.build((x @ w) + 1.0)
    assert forward_flops(model.module, {"B": 3}) == 3 * (2 * 64 * 16 * 32 + 64 * 16)


def test_elementwise_bytes_are_each_input_read_once_plus_the_output_written_once():
    assert op_bytes(only(add_model(64, 32), "add")) == 3 * 64 * 32 * F32
    # A broadcast operand is read at its own size, not at the result's.
    g = Graph()
    x = g.input("x", (64, 32))
    y = g.input("bias", (32,))
    assert op_bytes(only(g.build(x + y), "add")) == (64 * 32 + 32 + 64 * 32) * F32
    # An f16 output is half the bytes of an f32 one.
    g = Graph()
    x = g.input("x", (64, 32))
    assert op_bytes(only(g.build(g.cast(x, "f16")), "cast")) == 64 * 32 * (F32 + 2)


def test_a_fused_elementwise_chain_moves_only_its_inputs_and_outputs():
    g = Graph()
    x, y = g.input("x", (256, 512)), g.input("y", (256, 512))
    out = g.tanh(g.exp(x) * y + x)  # four ops, one result
    model = run_pipeline(g.build(out), DEFAULT_PIPELINE)
    (group,) = groups(model)
    assert len(group.ops) >= 3
    cost = fusion_cost(group, hardware("cpu"))
    unfused = sum(op_bytes(op) for op in group.ops)
    assert cost.bytes == 3 * 256 * 512 * F32  # x and y read, the result written: intermediates stay in cache
    assert cost.bytes < unfused


def test_h100_roofline_puts_a_big_gemm_on_compute_and_a_big_add_on_memory():
    h100 = hardware("h100")
    gemm = op_cost(only(matmul_model(4096, 4096, 4096), "matmul"), h100)
    add = op_cost(only(add_model(8192, 8192), "add"), h100)
    assert gemm.bound() == "compute"
    assert add.bound() == "memory"
    # Arithmetic intensity on the right sides of the ridge (peak FLOP/s / bandwidth).
    ridge = h100.flops("f32") / h100.memory_bandwidth
    assert at(gemm.intensity) > ridge > at(add.intensity)


def test_a_c_gemm_of_one_row_reads_its_weight_from_memory_at_least_once():
    """Decode: one row times a large weight. The C target's GEMM rates were calibrated on weights
    in cache; a row cannot reuse them, so the step is priced at least at the weight's bytes over
    the memory bandwidth (it was priced 6x faster than memory could deliver them)."""
    c = hardware("c")

    def weighted(rows, k, n):
        g = Graph()
        x = g.input("x", (rows, k))
        return op_cost(only(g.build(x @ g.weight("w", np.zeros((k, n), np.float32))), "matmul"), c)

    k, n = 576, 8192
    assert at(weighted(1, k, n).time) >= k * n * F32 / c.memory_bandwidth
    # Many rows reuse the weight: priced by their arithmetic, well above one read of it.
    assert at(weighted(4096, k, n).time) > 4 * k * n * F32 / c.memory_bandwidth


def test_a_lookup_reads_the_rows_it_takes_and_a_table_also_multiplied_is_read_whole():
    """An embedding gather reads from memory the rows it returns, not its whole table (what
    `tilegraph cost --decode` counts too); a table the LM head also multiplies (tied
    embeddings) is read whole, once."""
    vocab, hidden, rows = 4096, 64, 3

    def weight_bytes(tied: bool) -> int:
        g = Graph()
        table = g.weight("table", np.zeros((vocab, hidden), np.float32))
        out = g.gather(table, g.input("ids", (rows,), "i64"))
        if tied:
            out = out @ table.transpose(1, 0)
        model = g.build(out)
        return int(cold_bytes([op for op in model.func.walk() if isinstance(op, TgOp)]))

    assert weight_bytes(tied=False) == rows * hidden * F32
    assert weight_bytes(tied=True) == vocab * hidden * F32


def test_costs_are_formulas_in_the_symbolic_batch():
    g = Graph()
    x = g.input("x", ("B", 64))
    h = g.gelu(x @ g.weight("w1", _w(64, 256)) + g.weight("b1", _w(256)))
    model = run_pipeline(g.build(h @ g.weight("w2", _w(256, 64)) + x), DEFAULT_PIPELINE)
    cost = module_cost(model.module, hardware("cpu"))
    b = symbol("B")
    for c in (cost.time, cost.flops, cost.bytes):
        assert isinstance(c, sympy.Expr) and c.free_symbols == {b}
    # Every op here does the same work per row: FLOPs are linear in B, at least the two GEMMs' 2mnk.
    assert sympy.expand(cost.flops - b * cost.flops.subs(b, 1)) == 0
    assert at(cost.flops, {"B": 1}) >= 2 * (2 * 64 * 256)
    assert 0 < at(cost.time, {"B": 1}) < at(cost.time, {"B": 64})
    assert at(cost.bytes, {"B": 1}) < at(cost.bytes, {"B": 64})
    with pytest.raises(ValueError, match="B"):  # a formula needs its sizes
        at(cost.time)


def _median_seconds(fn, calls: int = 15) -> float:
    fn()  # warm-up: first-touch and BLAS buffers
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def test_cpu_profile_ranks_a_big_gemm_and_a_tiny_add_the_way_the_clock_does():
    hw = hardware("cpu")
    big, tiny = matmul_model(512, 512, 512), add_model(64)
    predicted = {name: at(op_cost(op, hw).time) for name, op in
                 (("gemm", only(big, "matmul")), ("add", only(tiny, "add")))}
    x, w = _w(512, 512), _w(512, 512)
    a, b = _w(64), _w(64)
    run_big, run_tiny = compile_model(big), compile_model(tiny)
    measured = {"gemm": _median_seconds(lambda: run_big(x, w)), "add": _median_seconds(lambda: run_tiny(a, b))}
    assert (predicted["gemm"] > predicted["add"]) == (measured["gemm"] > measured["add"])
    assert predicted["gemm"] > predicted["add"]  # and the clock agrees, by the line above
