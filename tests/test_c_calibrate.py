"""The C backend's calibration and the cost model's prices for target "c".

What holds: `tilegraph calibrate --target c` runs end to end on real compiled modules and
writes a profile whose numbers are positive and finite and read back equal; the cost
model prices a group for "c" from those numbers, not NumPy's, and a fused elementwise
chain below the same ops unfused; `fuse` fuses for "c" by those prices and `tile` leaves
the C backend's groups whole (it reads no tile).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

import tilegraph
from tilegraph.backends.c.calibrate import CONV_CASES, QUICK_STEMS, STEM_CASES
from tilegraph.ir import Graph, interpret
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.fusion import VIEW_OPS
from tilegraph.ir.ops import Op
from tilegraph.ir.hardware import Hardware, hardware, load_profile
from tilegraph.ir.ops import Op
from tilegraph.ir.shapes import info_of
from tilegraph.passes.cost.model import at, at_nominal, fusion_cost, group_cost, module_cost, op_cost
from tilegraph.passes.targets.c import C_PARALLEL_MIN, STEM_KINDS, step_memory
from tilegraph.passes.registry import default_pipeline, run_pipeline
from tilegraph.testing import assert_close


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """One quick calibration through the CLI, as a user runs it (a few seconds)."""
    path = tmp_path_factory.mktemp("calibrate") / "c.json"
    done = subprocess.run([sys.executable, "-m", "tilegraph.cli", "calibrate", "--target", "c", "--quick",
                           "-o", str(path)], capture_output=True, text=True, timeout=120)
    return done, path


def test_cli_calibrate_target_c_writes_a_profile(calibrated):
    done, path = calibrated
    assert done.returncode == 0, done.stderr
    assert "C backend" in done.stdout and f"wrote {path}" in done.stdout
    assert "GEMM f32 128x384x384 (one thread / all)" in done.stdout


def _numbers(hw: Hardware) -> list[float]:
    return [hw.launch_overhead, hw.chunk_call_overhead, hw.cache_bandwidth, hw.memory_bandwidth, hw.conv_rate,
            hw.attention_speedup, hw.parallel_efficiency, *hw.peak_flops.values(), *hw.ufunc_rates.values(),
            *(r for *_, r in hw.gemm_samples), *(r for *_, r in hw.gemm_samples_threaded),
            *(r for _, r in hw.attention_rates), *(r for *_, r in hw.conv_rates.values())]


def test_the_c_profile_is_positive_finite_and_round_trips(calibrated):
    done, path = calibrated
    hw = load_profile(path)
    assert hw is not None, path.read_text()[:500]
    assert hw.backend == "c" and hw.name == "c" and hw.device == "cpu"
    assert all(math.isfinite(x) and x > 0 for x in _numbers(hw)), hw
    assert hw.parallel_overhead >= 0 and math.isfinite(hw.parallel_overhead)
    assert hw.primitive_overhead >= 0 and math.isfinite(hw.primitive_overhead)
    # every kernel class measured: GEMM one thread and all, loop ops, row kernels, attention
    assert len(hw.gemm_samples) == len(hw.gemm_samples_threaded) >= 3
    assert {"add", "exp", "gelu", "softmax", "layer_norm"} <= set(hw.ufunc_rates)
    assert [d for d, _ in hw.attention_rates] == [32, 64]
    assert set(hw.conv_rates) == {"dense", "pointwise", "depthwise", "winograd", *QUICK_STEMS} == \
        {*CONV_CASES, *QUICK_STEMS}
    assert set(QUICK_STEMS) < set(STEM_CASES) == set(STEM_KINDS)  # a full run measures the 7x7 stem too
    assert "reduce_sum" in hw.ufunc_rates  # (an exp post-op's rate where it measured above noise)
    assert hw.pool_rate > 0 and set(hw.row_overhead) == {"softmax", "layer_norm"}
    assert all(math.isfinite(x) and x >= 0 for x in hw.row_overhead.values())
    assert Hardware.from_dict(json.loads(path.read_text())["hardware"]) == hw


def _chain(ops: int):
    g = Graph()
    x, y = g.input("x", ("B", 384)), g.input("y", ("B", 384))
    z = x
    for i in range(ops):
        z = g.op("tanh", z) if i % 3 == 2 else z * y if i % 3 else z + y
    return g.build(z, names=["z"])


def _chain_ops(model):
    return [op for op in model.func.body.block.ops if getattr(op, "op_name", None) in ("add", "mul", "tanh")]


def _fused_cost(ops, hw):
    """The chain's ops as one group: reads x and y, writes the last result."""
    return group_cost(ops, [info_of(v.type) for v in ops[0].operands], [info_of(ops[-1].results[0].type)], hw)


def test_a_fused_elementwise_chain_is_priced_below_its_ops_for_c():
    c, cpu = hardware("c"), hardware("cpu")
    assert c.backend == "c" and cpu.backend == "numpy"
    ops = _chain_ops(_chain(6))
    for sizes in ({"B": 4}, {"B": 256}, {"B": 8192}):  # a tiny step, in cache, beyond the caches
        unfused = sum(at(op_cost(op, c).time, sizes) for op in ops)
        fused = at(_fused_cost(ops, c).time, sizes)
        assert 0 < fused < unfused, (sizes, fused, unfused)
    # priced from the C numbers, not NumPy's: the same group differs between the targets
    assert at(_fused_cost(ops, c).time, {"B": 256}) != at(_fused_cost(ops, cpu).time, {"B": 256})


def test_fuse_for_c_makes_one_group_of_the_chain_and_tile_leaves_it_whole():
    model = run_pipeline(_chain(6), default_pipeline("c"))
    groups = [op for op in model.func.body.block.ops if isinstance(op, FusionOp)]
    assert len(groups) == 1 and len(groups[0].ops) == 6
    assert groups[0].tile() == {}  # the C backend blocks its own loops
    before = sum(at_nominal(op_cost(op, hardware("c")).time) for op in _chain_ops(_chain(6)))
    assert at_nominal(module_cost(model.module, hardware("c")).time) < before


def test_compile_for_c_fuses_by_the_c_prices_and_still_computes_the_same():
    assert tilegraph.backends.backend("c").HARDWARE == "c"
    model = _chain(7)
    compiled = tilegraph.compile(model, target="c")
    assert sum(isinstance(op, FusionOp) for op in compiled.model.func.body.block.ops) == 1
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((5, 384)).astype(np.float32) for _ in range(2)]
    assert_close(compiled(*inputs), interpret(model, inputs)[0], "f32")


def test_the_cost_model_knows_where_c_loops_go_parallel():
    from tilegraph.backends.c.tables import PARALLEL_MIN

    assert C_PARALLEL_MIN == PARALLEL_MIN


def test_a_gather_is_priced_by_the_rows_it_copies_not_the_table():
    """An embedding lookup in C copies its rows: the table's size does not enter its price."""
    def lookup_cost(vocab: int) -> float:
        g = Graph()
        table = g.weight("table", np.zeros((vocab, 384), np.float32))
        ids = g.input("ids", (1, 128), "i64")
        model = g.build(g.embedding(table, ids), names=["e"])
        op = next(op for op in model.func.body.block.ops if getattr(op, "op_name", None) == "gather")
        return at(op_cost(op, hardware("c")).time)

    assert lookup_cost(30522) == pytest.approx(lookup_cost(1024))
    assert lookup_cost(30522) < 10 * lookup_cost(4)  # not the 47 MB table from memory (1000x the rows)


def test_causal_attention_is_priced_at_about_half_the_full_one_for_c():
    """The C flash kernel stops at the diagonal, so a causal attention does about half the work."""
    def attention_cost(causal: bool) -> float:
        g = Graph()
        q, k, v = (g.input(name, (1, 12, 256, 64)) for name in "qkv")
        model = g.build(g.attention(q, k, v, causal=causal), names=["o"])
        op = next(op for op in model.func.body.block.ops if getattr(op, "op_name", None) == "attention")
        return at(op_cost(op, hardware("c")).compute_time)

    assert attention_cost(True) / attention_cost(False) == pytest.approx((256 + 1) / 2 / 256)


def test_convolutions_are_priced_by_kind_and_shape_for_c():
    """oneDNN's convolutions by what they are: a depthwise one at the calibrated depthwise rate,
    a 3x3 or 1x1 as its implicit GEMM on the GEMM curve, scaled by how the calibrated
    convolution of its kind ran against the curve (so at the calibrated shape: its own rate)."""
    from dataclasses import replace

    base = hardware("c")
    hw = replace(base, conv_rates={"dense": (3136, 64, 576, 40e9), "pointwise": (784, 128, 256, 60e9),
                                   "depthwise": (3136, 1, 9, 3e9)})

    def conv_time(xs, ws, groups, hw=hw):
        g = Graph()
        pad = ws[-1] // 2
        y = g.op("conv", g.input("x", xs), g.weight("w", np.zeros(ws, np.float32)), pads=(pad,) * 4, groups=groups)
        model = g.build(y, names=["y"])
        op = next(op for op in model.func.body.block.ops if getattr(op, "op_name", None) == "conv")
        return at(op_cost(op, hw).compute_time), 2 * int(np.prod(y.shape)) * int(np.prod(ws[1:]))

    t, flops = conv_time((1, 96, 56, 56), (96, 1, 3, 3), 96)
    assert t == pytest.approx(flops / 3e9)
    t, flops = conv_time((1, 64, 56, 56), (64, 64, 3, 3), 1)
    assert t == pytest.approx(flops / 40e9)
    t, flops = conv_time((1, 256, 28, 28), (128, 256, 1, 1), 1)
    assert t == pytest.approx(flops / 60e9)
    # another shape: the GEMM curve's rate there, in the calibrated kind's proportion to it
    t, flops = conv_time((1, 512, 7, 7), (2048, 512, 1, 1), 1)
    curve = hw.matmul_rate(49, 2048, 512, threaded=True) / hw.matmul_rate(784, 128, 256, threaded=True)
    assert t == pytest.approx(flops / (60e9 * curve))
    # where winograd.c runs a 3x3 (ir/hardware.winograd_wins), at its calibrated rate; a strided
    # 3x3, which it does not run, at the direct convolution's
    wino = replace(hw, conv_rates={**hw.conv_rates, "winograd": (3136, 64, 576, 90e9)})
    t, flops = conv_time((1, 64, 56, 56), (64, 64, 3, 3), 1, hw=wino)
    assert t == pytest.approx(flops / 90e9)
    g = Graph()
    y = g.op("conv", g.input("x", (1, 64, 56, 56)), g.weight("w", np.zeros((64, 64, 3, 3), np.float32)),
             pads=(1,) * 4, strides=(2, 2))
    op = next(op for op in g.build(y, names=["y"]).func.body.block.ops if getattr(op, "op_name", None) == "conv")
    assert at(op_cost(op, wino).compute_time) == pytest.approx(at(op_cost(op, hw).compute_time))
    # a profile without kinds prices every convolution at its one rate
    t, flops = conv_time((1, 96, 56, 56), (96, 1, 3, 3), 96, hw=replace(base, conv_rates={}))
    assert t == pytest.approx(flops / base.conv_rate)


def test_every_native_step_names_the_kernel_it_computes():
    """A per-step profile (benchmarks/cost_model_accuracy.py) charges each step's time to the
    top-level op it computes: every step names one, a group's steps their group."""
    from tilegraph.backends.c.emit import emit_program

    g = Graph()
    x = g.input("x", (8, 64))
    w = g.weight("w", np.ones((64, 32), np.float32))
    model = run_pipeline(g.build(g.softmax(g.op("tanh", g.matmul(x, w) + 1.0)), names=["y"]), default_pipeline("c"))
    top = [op for op in model.func.body.block.ops if getattr(op, "op_name", None) not in ("weight", "constant", None)
           or isinstance(op, FusionOp)]
    program = emit_program(model, per_step=True)
    assert program.steps and all(step.kernel in top for step in program.steps)
    assert {step.kernel for step in program.steps} <= set(top)


def test_a_step_beyond_l2_that_fits_l3_is_priced_at_the_l3_rate():
    from dataclasses import replace


    hw = replace(hardware("c"), cache_bytes=1 << 20, cores=2, l3_bytes=64 << 20, l3_bandwidth=20e9,
                 cache_bandwidth=80e9, memory_bandwidth=5e9)
    assert at(step_memory(hw, 1 << 20, 0)) == pytest.approx((1 << 20) / 80e9)  # in the cores' L2
    assert at(step_memory(hw, 8 << 20, 0)) == pytest.approx((8 << 20) / 20e9)  # beyond L2, in L3
    assert at(step_memory(hw, 48 << 20, 0)) == pytest.approx((48 << 20) / 5e9)  # more than half of L3
    assert at(step_memory(replace(hw, l3_bandwidth=0.0), 8 << 20, 0)) == pytest.approx((8 << 20) / 5e9)


def _reshape_cases():
    """(name, model) pairs whose reshapes the C backend makes views of, or copies."""
    rng = np.random.default_rng(0)
    cases = []
    # Swin's window partition: (1, 56, 56, 96) -> (1, 8, 7, 8, 7, 96) -> windows first -> (64, 49, 96): a copy.
    g = Graph()
    x = g.input("x", (1, 56, 56, 96))
    t = g.transpose(g.reshape(g.op("tanh", x), (1, 8, 7, 8, 7, 96)), (0, 1, 3, 2, 4, 5))
    cases.append(("window partition", g.build(g.op("tanh", g.reshape(t, (64, 49, 96))), names=["y"])))
    # Heads merged back after attention: the output is written as the transpose wants it: free.
    g = Graph()
    q, k, v = (g.input(n, (1, 4, 32, 16)) for n in "qkv")
    o = g.transpose(g.attention(q, k, v), (0, 2, 1, 3))
    cases.append(("heads merged", g.build(g.op("tanh", g.reshape(o, (1, 32, 64))), names=["y"])))
    # A transposed dim split in two (no dims merged): free.
    g = Graph()
    x = g.input("x", (2, 8, 6))
    t = g.transpose(g.reshape(g.op("tanh", x), (2, 8, 2, 3)), (0, 2, 1, 3))
    cases.append(("split dims", g.build(g.op("tanh", g.reshape(t, (2, 2, 2, 4, 3))), names=["y"])))
    # A convolution's channels-last result: the spatial dims merged (ViT's patches) are a view,
    # channels and pixels merged (a flatten) a copy.
    for name, shape in (("conv pixels", (1, 8, 49)), ("conv flatten", (1, 392))):
        g = Graph()
        w = g.weight("w", rng.standard_normal((8, 3, 3, 3)).astype(np.float32))
        y = g.op("conv", g.input("x", (1, 3, 7, 7)), w, pads=(1, 1, 1, 1))
        cases.append((name, g.build(g.op("tanh", g.reshape(g.op("sigmoid", y), shape)), names=["y"])))
    return cases


def test_a_reshapes_layout_question_asks_each_value_once(monkeypatch):
    """Pricing a reshape follows the layouts of the values above it; a value read along two paths
    (x + tanh(x), layer after layer) is asked once, not once per path (2^layers: 40 such layers
    took hours to price)."""
    from tilegraph.passes.targets import c

    asked = []
    real = c.written
    monkeypatch.setattr(c, "written", lambda value, rule: asked.append(value) or real(value, rule))
    g = Graph()
    h = g.input("x", (2, 4, 8))
    for _ in range(40):
        h = h + g.tanh(h)
    model = g.build(g.reshape(h, (8, 8)))
    (op,) = [o for o in model.func.walk() if getattr(o, "op_name", None) == "reshape"]
    op_cost(op, hardware("c"))
    assert 0 < len(asked) == len(set(asked)) <= 2 * 40 + 1


@pytest.mark.parametrize("case", range(5))
def test_a_reshape_is_priced_as_the_copy_the_c_backend_makes(case):
    """The C target prices a reshape as a copy exactly where the emitter copies (a transpose's
    dims merged: Swin's windows, measured 34-115 us, were priced 0 as a view), and as nothing
    where it makes a view (attention's output laid out for the transpose that merges its heads,
    a convolution's channels-last pixels)."""
    from dataclasses import replace

    from tilegraph.backends.c.emit import emit_program
    from tilegraph.ir.strides import reshape_copies
    from tilegraph.passes.targets.c import layouts

    name, model = _reshape_cases()[case]
    compiled = run_pipeline(model, default_pipeline("c"))
    program = emit_program(compiled)
    copies = sum(1 for step in program.steps if step.comment.startswith("copy into a contiguous buffer"))
    expected = {"window partition": 1, "heads merged": 0, "split dims": 0, "conv pixels": 0, "conv flatten": 1}[name]
    assert copies == expected, [s.comment for s in program.steps]
    hw = hardware("c")
    priced = []
    for op in compiled.func.body.block.walk():
        if getattr(op, "op_name", None) == "reshape":
            copies_here = reshape_copies(op, layouts())
            priced += [op] if copies_here else []
            if op.parent_op() is compiled.func:  # a kernel of its own: a copy step, or nothing
                assert (at(op_cost(op, hw).time) > 0) == copies_here
    assert len(priced) == expected
    for op in priced:  # the copy's price: its bytes at the calibrated copy rate
        nbytes = 4 * int(np.prod(op.result_infos()[0].shape))
        with_copies = replace(hw, copy_bandwidth=10e9)
        assert at(op_cost(op, with_copies).memory_time) == pytest.approx(nbytes / 10e9)
    # and the model computes what the interpreter does
    xs = [np.random.default_rng(1).standard_normal(tuple(int(d) for d in i.shape)).astype(np.float32)
          for i in model.inputs]
    assert_close(tilegraph.compile(model, target="c")(*xs), interpret(model, xs)[0], "f32", reduction_length=64)


def test_every_buffer_the_c_emitter_lays_out_lies_where_the_c_target_prices_it():
    """One rule (ir/strides.result_strides) places a computed value in the C backend: the
    emitter's buffers and the target's answer agree for convolutions, residual adds, pools,
    pads, attention laid out for its reader, and a GEMM over all rows whose weight is an input
    (a training step's; the target used to lay it out for its transposing reader)."""
    from tilegraph.backends.c.emit import CEmitter
    from tilegraph.ir.strides import strides_of
    from tilegraph.passes.targets.c import layouts

    rng = np.random.default_rng(0)
    cases = [model for _, model in _reshape_cases()]
    g = Graph()
    w1, w2 = (g.weight(n, rng.standard_normal(s).astype(np.float32)) for n, s in (("w1", (8, 8, 3, 3)), ("w2", (8, 8, 1, 1))))
    y = g.op("relu", g.op("conv", g.input("x", (1, 8, 14, 14)), w1, pads=(1, 1, 1, 1)))
    p = g.op("max_pool", g.op("conv", y, w2) + y, kernel=(2, 2), strides=(2, 2))
    q = g.op("tanh", g.op("pad", p, pads=(0, 0, 1, 1, 0, 0, 1, 1), mode="constant", value=0.0))
    cases.append(g.build(g.op("tanh", q + g.input("r", (1, 8, 9, 9))), names=["y"]))
    g = Graph()
    xw = g.matmul(g.input("a", (2, 16, 32)), g.input("w", (32, 24)))
    cases.append(g.build(g.op("tanh", g.transpose(xw, (1, 0, 2))), names=["y"]))
    compared = 0
    for model in cases:
        em = CEmitter(run_pipeline(model, default_pipeline("c")))
        em.run()
        rule = layouts()
        for v, view in em.views.items():
            if isinstance(v.owner, (TgOp, FusionOp)) and view.literal is None and view.rank >= 3 and \
                    getattr(v.owner, "op_name", None) not in {*VIEW_OPS, Op.split, Op.weight}:
                want = strides_of(v, rule)
                assert all(d == 1 or a == b for d, a, b in zip(view.shape, view.strides, want)), \
                    (v.owner, view.shape, view.strides, want)
                compared += 1
    assert compared >= 12


def test_a_convolution_is_priced_a_primitive_call_besides_its_work():
    """A squeeze-excitation's 1x1 convolution on a 1x1 map is nearly all oneDNN's call (RegNet's:
    20-50 us each, priced 0.3 us by its FLOPs): the calibrated `primitive_overhead` is added to
    every convolution, not to the GEMMs whose calibrated rates already hold it."""
    from dataclasses import replace

    hw = replace(hardware("c"), primitive_overhead=15e-6)
    g = Graph()
    w = g.weight("w", np.zeros((16, 64, 1, 1), np.float32))
    model = g.build(g.op("conv", g.input("x", (1, 64, 1, 1)), w), names=["y"])
    conv = next(op for op in model.func.body.block.ops if getattr(op, "op_name", None) == "conv")
    assert at(op_cost(conv, hw).time) - at(op_cost(conv, replace(hw, primitive_overhead=0.0)).time) == \
        pytest.approx(15e-6)
    assert at(op_cost(conv, hw).time) > 15e-6
    g = Graph()
    model = g.build(g.matmul(g.input("x", (1, 64)), g.weight("w", np.zeros((64, 16), np.float32))), names=["y"])
    mm = next(op for op in model.func.body.block.ops if getattr(op, "op_name", None) == "matmul")
    assert at(op_cost(mm, hw).time) == at(op_cost(mm, replace(hw, primitive_overhead=0.0)).time)


def _op_named(model, name: str):
    return next(op for op in model.func.body.block.ops if getattr(op, "op_name", None) == name)


def test_a_global_average_pool_is_priced_at_the_calibrated_pool_rate():
    """A mean over a convolution's channels-last result runs the C backend's rows-of-channels
    kernel (RegNet's squeeze-excitation pools, priced as an add loop, took 3-6x their price):
    it is priced at the calibrated `pool_rate`, and the emitter takes that kernel. A mean over
    a row-major input runs another loop, priced as before."""
    from dataclasses import replace

    from tilegraph.backends.c.emit import emit_program
    from tilegraph.passes.targets.c import loop_rate

    hw = replace(hardware("c"), pool_rate=1e9)
    rng = np.random.default_rng(0)
    g = Graph()
    y = g.op("conv", g.input("x", (1, 64, 28, 28)), g.weight("w", rng.standard_normal((64, 64, 3, 3)).astype(np.float32) / 24),
             pads=(1, 1, 1, 1))
    model = g.build(g.mean(y, axes=(2, 3), keepdims=True), names=["y"])
    mean = _op_named(model, "reduce_mean")
    elements = 64 * 28 * 28
    assert at(op_cost(mean, hw).compute_time) == pytest.approx(elements / 1e9)
    assert at(op_cost(mean, replace(hw, pool_rate=0.0)).compute_time) == pytest.approx(elements / loop_rate(hw, "add"))
    assert "acc[j] += row[j]" in emit_program(model).source  # the rows-of-channels kernel
    xs = [rng.standard_normal((1, 64, 28, 28)).astype(np.float32)]
    assert_close(tilegraph.compile(model, target="c")(*xs), interpret(model, xs)[0], "f32", reduction_length=576 * 784)

    g = Graph()
    plain = g.build(g.mean(g.input("x", (1, 64, 28, 28)), axes=(2, 3), keepdims=True), names=["y"])
    mean = _op_named(plain, "reduce_mean")
    assert at(op_cost(mean, hw).compute_time) == pytest.approx(elements / loop_rate(hw, "reduce_mean"))
    assert "acc[j] += row[j]" not in emit_program(plain).source


def test_a_sum_along_rows_is_priced_at_the_calibrated_row_reduction_rate():
    """A sum or mean along rows (an RMSNorm's mean of squares, alone or in its fused group) is
    one accumulator a row that every element is added to in turn: priced at the calibrated
    `ufunc_rates["reduce_sum"]` (Llama's RMSNorm groups took 7-9x their price at `add`'s
    rate), and the emitter runs that loop. Without the rate: `add`'s, as before."""
    from dataclasses import replace

    from tilegraph.backends.c.emit import emit_program
    from tilegraph.passes.targets.c import loop_rate

    base = hardware("c")
    hw = replace(base, ufunc_rates={**base.ufunc_rates, "reduce_sum": 1e9})
    rng = np.random.default_rng(0)
    rows, width = 128, 1024
    g = Graph()
    x = g.input("x", (1, rows, width))
    y = x * g.op("rsqrt", g.mean(x * x, axes=(-1,), keepdims=True) + g.constant(np.float32(1e-6))) \
        * g.weight("w", rng.standard_normal(width).astype(np.float32))
    model = g.build(y, names=["y"])
    mean = _op_named(model, "reduce_mean")
    assert at(op_cost(mean, hw).compute_time) == pytest.approx(rows * width / 1e9)
    assert at(op_cost(mean, base).compute_time) == pytest.approx(rows * width / loop_rate(base, "add"))
    compiled = run_pipeline(model, default_pipeline("c"))
    (group,) = [op for op in compiled.func.body.block.ops if isinstance(op, FusionOp)]
    assert {Op.reduce_mean, Op.mul} <= {op.op_name for op in group.ops}
    slower = replace(hw, ufunc_rates={**hw.ufunc_rates, "reduce_sum": 0.5e9})
    assert at(fusion_cost(group, slower).time) - at(fusion_cost(group, hw).time) == pytest.approx(rows * width / 1e9)
    assert "double acc = 0;" in emit_program(compiled).source  # one accumulator a row
    xs = [rng.standard_normal((1, rows, width)).astype(np.float32)]
    assert_close(tilegraph.compile(model, target="c")(*xs), interpret(model, xs)[0], "f32", reduction_length=width)


def test_an_image_models_first_convolution_is_priced_by_the_calibrated_stems():
    """A convolution over an image's 3 channels (a stem, a Swin or ViT patch embedding, kernel
    = stride) is no GEMM of its short k (a 4x4/4 priced as a 3x3's efficiency took 3x its
    price): a time per output and per FLOP, solved from the two calibrated first convolutions
    nearest in FLOPs per output (a 3x3/2 and a 7x7/2 stem, a 16x16/16 patch embedding), so
    exact at each; 16 input channels are a GEMM as before."""
    from dataclasses import replace

    base = hardware("c")
    stems = {"stem": (12544, 32, 27, 46e9), "stem7x7": (12544, 64, 147, 150e9), "patch": (196, 768, 768, 125e9)}
    hw = replace(base, primitive_overhead=0.0, conv_rates={**base.conv_rates, **stems})

    def conv_time(xs, ws, stride, hw):
        g = Graph()
        pad = ws[-1] // 2 if ws[-1] > stride else 0
        y = g.op("conv", g.input("x", xs), g.weight("w", np.zeros(ws, np.float32)), strides=(stride, stride),
                 pads=(pad,) * 4)
        return at(op_cost(_op_named(g.build(y, names=["y"]), "conv"), hw).compute_time), \
            2 * int(np.prod(y.shape)) * int(np.prod(ws[1:])), int(np.prod(y.shape))

    for (xs, ws, stride), rate in ((((1, 3, 224, 224), (32, 3, 3, 3), 2), 46e9), (((1, 3, 224, 224), (64, 3, 7, 7), 2), 150e9),
                                   (((1, 3, 224, 224), (768, 3, 16, 16), 16), 125e9)):
        t, flops, _ = conv_time(xs, ws, stride, hw)
        assert t == pytest.approx(flops / rate)
    # Swin's 4x4/4 (96 FLOPs an output) on the line through the 3x3 (54) and the 7x7 (294):
    # a time per output a and per FLOP b that give both their times
    b = (294 / 150e9 - 54 / 46e9) / (294 - 54)
    a = 54 / 46e9 - b * 54
    t, flops, outputs = conv_time((1, 3, 224, 224), (96, 3, 4, 4), 4, hw)
    assert t == pytest.approx(outputs * a + flops * b)
    assert flops / 46e9 > t > flops / 150e9
    t16, *_ = conv_time((1, 16, 56, 56), (32, 16, 3, 3), 1, hw)
    assert t16 == pytest.approx(conv_time((1, 16, 56, 56), (32, 16, 3, 3), 1, replace(hw, conv_rates=base.conv_rates))[0])
    # one calibrated stem alone: its rate
    t, flops, _ = conv_time((1, 3, 224, 224), (96, 3, 4, 4), 4,
                            replace(hw, conv_rates={**base.conv_rates, "stem": stems["stem"]}))
    assert t == pytest.approx(flops / 46e9)


def test_a_row_kernel_is_priced_a_fixed_cost_per_row():
    """A softmax over short rows (a Swin window's 49 keys) costs more per element than over
    long ones (its max, sum and scale loops' setup, per row): priced at the calibrated
    per-row cost besides the per-element rate, so 49-wide rows above 256-wide ones."""
    from dataclasses import replace

    hw = replace(hardware("c"), ufunc_rates={**hardware("c").ufunc_rates, "softmax": 2e9},
                 row_overhead={"softmax": 80e-9})

    def softmax_time(rows, width, hw=hw):
        g = Graph()
        model = g.build(g.softmax(g.input("x", (rows, width))), names=["y"])
        return at(op_cost(_op_named(model, "softmax"), hw).compute_time)

    assert softmax_time(9408, 49) == pytest.approx(9408 * 49 / 2e9 + 9408 * 80e-9)
    assert softmax_time(9408, 49) > 2 * softmax_time(1801, 256)
    assert softmax_time(9408, 49, replace(hw, row_overhead={})) == pytest.approx(9408 * 49 / 2e9)


def test_activations_a_convolution_applies_as_it_writes_cost_no_loop():
    """relu, gelu, sigmoid and sigmoid(x) * x after a GEMM or convolution run as oneDNN's
    post-ops inside its pass (the emitter's ELTWISE_POSTS, and swish; after a convolution a
    swish is a loop in its step, priced at the same calibrated rate): the group is priced as
    the anchor alone, not the anchor plus a loop at sigmoid's calibrated rate (EfficientNet's
    swish convolutions were priced 2-3x their time). A sigmoid on another value still costs
    its loop."""
    from tilegraph.backends.c.emit import emit_program
    from tilegraph.passes.targets.c import loop_rate

    rng = np.random.default_rng(0)
    hw = hardware("c")

    def group(act):
        g = Graph()
        x = g.input("x", (1, 32, 28, 28))
        y = g.op("conv", x, g.weight("w", rng.standard_normal((32, 32, 3, 3)).astype(np.float32) / 17), pads=(1,) * 4)
        model = run_pipeline(g.build(act(g, x, y), names=["y"]), default_pipeline("c"))
        return model, next(op for op in model.func.body.block.ops if isinstance(op, FusionOp))

    loop = 32 * 28 * 28 / loop_rate(hw, "sigmoid")  # what a sigmoid's loop over the result costs

    def alone(fused):  # the group's convolution priced as a step of its own
        return at(op_cost(next(op for op in fused.ops if op.op_name == "conv"), hw).time)

    for act in (lambda g, x, y: g.op("relu", y), lambda g, x, y: g.op("sigmoid", y) * y,
                lambda g, x, y: g.op("gelu", y)):
        model, fused = group(act)
        # at most the pass writing the result (no loop at an activation's rate)
        assert alone(fused) <= at(fusion_cost(fused, hw).time) < alone(fused) + 0.1 * loop
    model, fused = group(lambda g, x, y: g.op("sigmoid", y) * y)
    source = emit_program(model).source  # as the emitter runs it: a loop in the convolution's step
    assert "tg_sigmoid_swish(" in source and "dnnl_eltwise_swish" not in source
    xs = [rng.standard_normal((1, 32, 28, 28)).astype(np.float32)]
    assert_close(tilegraph.compile(model, target="c")(*xs), interpret(model, xs)[0], "f32", reduction_length=288)
    # a sigmoid of the input, added after: a loop of its own
    model, fused = group(lambda g, x, y: y + g.op("sigmoid", x))
    assert at(fusion_cost(fused, hw).time) >= alone(fused) + loop


def test_an_activation_that_evaluates_an_exp_costs_each_element_the_calibrated_post_rate():
    """A post-op that evaluates an exp (a swish, a sigmoid, a gelu) costs oneDNN's pass each
    element it writes at the calibrated `ufunc_rates["eltwise_post"]` (free, EfficientNet's
    swish convolutions took twice their price); a relu stays free; the swish counts once."""
    from dataclasses import replace

    from tilegraph.ir.fusion import POST_RATE

    rng = np.random.default_rng(0)
    base = hardware("c")
    hw = replace(base, ufunc_rates={**base.ufunc_rates, POST_RATE: 1e9})
    written = 32 * 28 * 28

    def extra(act):  # what the post-op rate adds to the group over the same group priced without it
        g = Graph()
        x = g.input("x", (1, 32, 28, 28))
        y = g.op("conv", x, g.weight("w", rng.standard_normal((32, 32, 3, 3)).astype(np.float32) / 17), pads=(1,) * 4)
        model = run_pipeline(g.build(act(g, y), names=["y"]), default_pipeline("c"))
        (fused,) = [op for op in model.func.body.block.ops if isinstance(op, FusionOp)]
        return at(fusion_cost(fused, hw).time) - at(fusion_cost(fused, base).time)

    assert extra(lambda g, y: g.op("relu", y)) == pytest.approx(0.0, abs=1e-12)
    for act in (lambda g, y: g.op("sigmoid", y) * y, lambda g, y: g.op("gelu", y), lambda g, y: g.op("sigmoid", y)):
        assert extra(act) == pytest.approx(written / 1e9)


def test_a_round_a_neighbour_slowed_leaves_the_c_profile_as_a_quiet_one(monkeypatch):
    """The C calibration runs in rounds and builds each number from each timing's fastest round:
    a neighbour that held the cores through one round (every timing 3x slower) leaves the
    profile the rounds give without it, whichever round it slowed. (Timings made up, each a
    function of its place in a round, so the profiles compare exactly.)"""
    from tilegraph.backends.c import calibrate
    from tilegraph.ir import calibration

    clock = {"round": 0, "call": 0, "slow": None}
    new_round = calibration.Fastest.new_round

    def next_round(self):
        clock["round"], clock["call"] = clock["round"] + 1, 0
        new_round(self)

    def times(fns, budget, quantile=0.5):
        clock["call"] += 1
        factor = 3.0 if clock["slow"] in (clock["round"], "every") else 1.0
        return [factor * 1e-5 * (1 + (7 * clock["call"] + 3 * j) % 11) for j in range(len(fns))]

    monkeypatch.setattr(calibration.Fastest, "new_round", next_round)
    monkeypatch.setattr(calibration, "median_times", times)

    def profile(slow):
        clock.update(round=0, slow=slow)
        return replace(calibrate.measure(quick=True, progress=False), source="")

    quiet = profile(None)
    assert clock["round"] == calibrate.QUICK_ROUNDS >= 2
    assert profile(1) == quiet and profile(2) == quiet
    busy = profile("every")  # ... but one slowed in every round is slower
    assert all(b[3] < q[3] for b, q in zip(busy.gemm_samples, quiet.gemm_samples))


def test_the_calibration_times_every_thread_while_a_neighbour_keeps_a_core(monkeypatch):
    """The calibration's modules run on the whole team the cost model prices, where a model
    compiled as users compile it leaves a busy neighbour its core: under load its "all threads"
    GEMMs and attention ran on one thread, and priced the models' at half their rate."""
    from tilegraph.backends.c import calibrate, compile_model, runtime

    monkeypatch.setattr(runtime._NEIGHBOURS, "cores", lambda: 1)  # another process keeps a core busy
    g = Graph()
    w = g.weight("w", np.ones((256, 256), np.float32))
    model = g.build(g.matmul(g.input("x", (256, 256)), w), names=["y"])  # above the one-thread work
    x = np.ones((256, 256), np.float32)
    timed, user = calibrate._module(model), compile_model(model)
    timed(x), user(x)
    team = timed._lib.tg_max_threads()
    if team == 1:
        pytest.skip("one thread: no team to keep")
    assert timed.last_threads == team
    assert user.last_threads == max(1, min(team, runtime.CORES - 1))


def test_a_weights_rows_are_priced_at_the_calibrated_rate_of_rows_from_memory():
    """A gather from a weight (an embedding: its rows evicted by the weights each forward
    streams) copies its rows from memory, at `cold_copy_bandwidth`; the same gather from a
    value the model computed, at `copy_bandwidth` (a language model's embedding lookup took
    4-5x the time of rows in cache)."""
    hw = replace(hardware("c"), copy_bandwidth=32e9, cold_copy_bandwidth=8e9)
    g = Graph()
    table = g.weight("table", np.zeros((30522, 768), np.float32))
    ids = g.input("ids", (1, 128), "i64")
    model = g.build(g.embedding(table, ids), g.embedding(g.input("x", (512, 768)), ids), names=["e", "f"])
    weight_rows, computed_rows = (op for op in model.func.body.block.ops if getattr(op, "op_name", None) == "gather")
    moved = 128 * 768 * 4
    cold, hot = (at(op_cost(op, hw).memory_time) for op in (weight_rows, computed_rows))
    assert cold == pytest.approx(moved / 8e9)
    assert hot == pytest.approx(moved / 32e9)


def test_the_layout_of_a_value_at_the_end_of_a_long_chain_is_answered_without_deep_recursion():
    """passes/targets/c.layouts answers a value's strides from its producers', producers first: a
    chain of elementwise ops as long as a deep training step's residual stream (BERT-base's, forward
    and back) once exceeded Python's recursion limit while the tile pass priced a reshape."""
    from tilegraph.passes.targets.c import layouts

    g = Graph()
    x = g.input("x", (2, 4, 8))  # (a layout rule of rank 3 or more: rank 2 is row-major outright)
    y = x
    for _ in range(2000):
        y = g.op("add", y, x)
    model = g.build(y)
    last = next(op for op in reversed(list(model.ops())) if getattr(op, "op_name", None) == Op.add)
    assert tuple(layouts()(last.results[0])) == (32, 8, 1)
