"""Sharding: collective costs, the shard dialect's text, the planner's choices, and the partitioned
program's semantics on a simulated mesh.

- collectives cost alpha + beta * bytes with the ring/tree formulas, on the link the mesh axis uses;
- the shard dialect (xDSL's plus all_gather, reduce_scatter, all_to_all, all_slice) prints and
  parses back to the same text, and so does a module the `shard` pass annotated;
- on a GPT-shaped decoder with a large hidden size on 8 H100s the planner finds Megatron-LM's
  layout (Q/K/V and fc1 split by columns, out-projection and fc2 by rows, one all-reduce per block
  in the forward pass); on a small model with a large batch it finds data parallelism;
- memory budgets and user annotations are respected; repeated layers are solved once;
- every valid plan, on random graphs, computes on the simulated mesh what the float64
  interpreter computes on one device.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tilegraph.backends.simulated_mesh import groups, run
from tilegraph.ir import Model, interpret
from tilegraph.ir.interpreter import bind_inputs
from tilegraph.passes.cost import collectives as C
from tilegraph.passes.cost.collectives import Mesh
from tilegraph.passes.cost.hardware import H100, NCCL_BASE_LATENCY, hardware
from tilegraph.passes.partition import PartitionError, partition
from tilegraph.passes.registry import PipelineError, parse_pipeline, run_pipeline
from tilegraph.passes.remarks import collect
from tilegraph.passes.shard import ShardError, annotate, chosen_plan, plan
from tests.models import gpt_graph
from tilegraph.testing import assert_close, graphs, narrowest_float, random_inputs, reduction_length

NVLINK = H100.links["nvlink"]


# --- collectives ------------------------------------------------------------------------

def test_ring_collectives_follow_the_textbook_formulas():
    """Ring all-reduce = 2(n-1) alpha + 2(n-1)/n B/beta; all-gather, reduce-scatter and all-to-all
    move (n-1)/n B in n-1 steps; each pays NCCL's launch latency once."""
    B = 1e9
    assert float(C.all_reduce(NVLINK, 8, B, "ring")) == pytest.approx(
        NCCL_BASE_LATENCY + 14 * NVLINK.alpha + 2 * 7 / 8 * B / NVLINK.beta)
    for f in (C.all_gather, C.reduce_scatter, C.all_to_all):
        assert float(f(NVLINK, 8, B)) == pytest.approx(NCCL_BASE_LATENCY + 7 * NVLINK.alpha + 7 / 8 * B / NVLINK.beta)
    # all-reduce = reduce-scatter + all-gather, less one launch
    assert float(C.all_reduce(NVLINK, 8, B, "ring")) == pytest.approx(
        float(C.reduce_scatter(NVLINK, 8, B) + C.all_gather(NVLINK, 8, B)) - NCCL_BASE_LATENCY)
    assert C.all_reduce(NVLINK, 1, B) == 0 and C.all_gather(NVLINK, 1, B) == 0


def test_all_reduce_takes_the_tree_for_small_messages_and_the_ring_for_large_ones():
    small, large = 1e3, 1e9
    assert float(C.all_reduce(NVLINK, 8, small)) == float(C.all_reduce(NVLINK, 8, small, "tree"))
    assert float(C.all_reduce(NVLINK, 8, large)) == float(C.all_reduce(NVLINK, 8, large, "ring"))
    assert float(C.all_reduce(NVLINK, 8, small, "tree")) < float(C.all_reduce(NVLINK, 8, small, "ring"))


def test_a_mesh_axis_inside_a_node_uses_nvlink_and_one_across_nodes_infiniband():
    mesh = Mesh((4, 8), H100)  # 4 nodes of 8
    assert mesh.link(1).name == "nvlink" and mesh.link(0).name == "infiniband"
    assert Mesh((8,), H100).link(0).name == "nvlink"
    assert Mesh((8,), H100, intra_node="pcie").link(0).name == "pcie"
    # the same bytes cost more across nodes
    assert float(mesh.collective("all_gather", [0], 1e8)) > float(Mesh((4,), H100).collective("all_gather", [0], 1e8))


def test_collective_costs_are_formulas_of_symbolic_sizes():
    S = sympy.Symbol("S", positive=True, integer=True)
    cost = Mesh((8,), H100).collective("all_reduce", [0], 2 * 768 * S)
    assert cost.free_symbols == {S}
    assert float(cost.subs(S, 1024)) == pytest.approx(float(C.all_reduce(NVLINK, 8, 2 * 768 * 1024)))


# --- the dialect's text -------------------------------------------------------------------

COLLECTIVES_TEXT = """builtin.module {
  shard.grid @mesh(shape = 2x4)
  func.func @f(%0 : tensor<2x4xf32>) -> tensor<2x16xf32> {
    %1 = shard.sharding @mesh split_axes = [[0], [1]] : !shard.sharding
    %2 = shard.shard %0 to %1 annotate_for_users : tensor<2x4xf32>
    %3 = shard.all_gather %2 on @mesh grid_axes = [1] gather_axis = 1 : tensor<2x4xf32> -> tensor<2x16xf32>
    %4 = shard.reduce_scatter %3 on @mesh grid_axes = [1] reduction = max scatter_axis = 1 : tensor<2x16xf32> -> tensor<2x4xf32>
    %5 = shard.all_to_all %4 on @mesh grid_axes = [1] split_axis = 1 concat_axis = 0 : tensor<2x4xf32> -> tensor<8x1xf32>
    %6 = shard.all_slice %5 on @mesh grid_axes = [0, 1] slice_axis = 0 : tensor<8x1xf32> -> tensor<1x1xf32>
    %7 = shard.all_reduce %3 on @mesh grid_axes = [0] reduction = average : tensor<2x16xf32> -> tensor<2x16xf32>
    func.return %7 : tensor<2x16xf32>
  }
}
"""


def test_the_shard_dialect_and_its_added_collectives_round_trip():
    from tilegraph.ir.model import parse_module, print_module

    text = print_module(parse_module(COLLECTIVES_TEXT))
    assert print_module(parse_module(text)) == text
    for op in ("all_gather", "reduce_scatter", "all_to_all", "all_slice", "all_reduce"):
        assert f"shard.{op} " in text


def test_annotated_and_partitioned_modules_round_trip():
    model = gpt_graph(1, 32, 4, batch=4, seq=8, weights="random")
    annotated = run_pipeline(model, 'shard{mesh=2x2 inference=true sizes="B=4"}')
    assert "shard.grid @mesh(shape = 2x2)" in annotated.text and "shard.shard" in annotated.text
    assert Model.parse(annotated.text, annotated.weights).text == annotated.text
    local = partition(annotated).model
    assert Model.parse(local.text, local.weights).text == local.text


# --- the planner's choices ------------------------------------------------------------------

H100x8 = Mesh((8,), hardware("h100"))


def _matmuls(p):
    return {c.node.label.split("(")[1].rstrip(")"): c.strategy.name for c in p.choices
            if c.node.op is not None and c.node.op.op_name == "matmul"}


# One sequence of 2048 tokens. These tests price collectives without overlap (as Megatron-LM's
# papers do): overlapped, a replicated weight's gradient all-reduce hides behind the backward and
# the planner may prefer splitting a block's tokens (test_overlap_... below).
WIDE = {"B": 1, "S": 2048}
BLOCKS = [("mlp_only", ("mlp.fc1",), "mlp.fc2"),
          ("attention_only", ("attn.wq", "attn.wk", "attn.wv"), "attn.wo")]


@pytest.mark.parametrize("block, columns, rows", BLOCKS)
def test_a_wide_gpt_block_on_8_h100s_gets_megatrons_layout(block, columns, rows):
    """Hidden 8192 (GPT-3 6.7B-like) on 8 H100s, partial sums all-reduced (Megatron-LM without
    sequence parallelism): replicated weights would need a gradient all-reduce of 0.5-1 GB per
    block, Megatron's layout one 32 MB activation all-reduce forward (and one backward): first
    matmul(s) split by columns (heads), the last by rows."""
    p = plan(gpt_graph(1, 8192, 64, **{block: True}).module, H100x8, sizes=WIDE, reduce_scatter=False, overlap=False)
    mm = _matmuls(p)
    for w in columns:
        assert mm[f"h0.{w}"] == "n@0", mm
    assert mm[f"h0.{rows}"] == "k@0", mm
    assert [(kind, where.split("(")[1]) for kind, _, where in p.forward] == [("all_reduce", f"h0.{rows})")]
    assert p.comm > 0 and p.compute > 0 and p.memory < H100.memory_bytes
    assert p.runner_up is not None and p.runner_up.time >= p.time


@pytest.mark.parametrize("block, columns, rows", BLOCKS)
def test_with_reduce_scatter_the_row_split_block_scatters_its_sums_and_is_cheaper(block, columns, rows):
    """Allowed to reduce-scatter, the planner keeps the column/row splits and replaces the
    all-reduce by a reduce-scatter over the sequence (Megatron's sequence parallelism): the
    residual add then runs split, and the plan is predicted faster."""
    model = gpt_graph(1, 8192, 64, **{block: True})
    classic = plan(model.module, H100x8, sizes=WIDE, reduce_scatter=False, overlap=False)
    sp = plan(model.module, H100x8, sizes=WIDE, overlap=False)
    mm = _matmuls(sp)
    assert all(mm[f"h0.{w}"] == "n@0" for w in columns) and mm[f"h0.{rows}"].startswith("k@0>"), mm
    assert [(kind, where.split("(")[1]) for kind, _, where in sp.forward] == [("reduce_scatter", f"h0.{rows})")]
    assert sp.time < classic.time


def test_a_wide_gpt_decoder_keeps_megatrons_splits_in_every_layer():
    """Two whole layers: every block column/row split, its partial sums combined by exactly one
    collective (a reduce-scatter over the sequence), the only other forward collective an
    all-gather before the next column split: Megatron-LM with sequence parallelism."""
    p = plan(gpt_graph(2, 8192, 64).module, H100x8, sizes=WIDE, overlap=False)
    mm = _matmuls(p)
    for i in range(2):
        for w in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1"):
            assert mm[f"h{i}.{w}"] == "n@0", (w, mm)
        for w in ("attn.wo", "mlp.fc2"):
            assert mm[f"h{i}.{w}"].startswith("k@0"), (w, mm)
    combines = sorted(where.split("(")[1] for kind, _, where in p.forward if kind in ("all_reduce", "reduce_scatter"))
    assert combines == sorted(f"h{i}.{w})" for i in range(2) for w in ("attn.wo", "mlp.fc2"))
    gathers = [kind for kind, _, _ in p.forward if kind not in ("all_reduce", "reduce_scatter")]
    assert set(gathers) <= {"all_gather"} and len(gathers) <= 3  # between the 4 blocks


def test_a_small_model_with_a_large_batch_gets_data_parallelism():
    """Hidden 256, 64 x 512 tokens: the weights' gradients are tiny, the activations large."""
    model = gpt_graph(2, 256, 4)
    p = plan(model.module, H100x8, sizes={"B": 64, "S": 512})
    assert set(_matmuls(p).values()) <= {"b0@0", "m@0"}, _matmuls(p)  # batch or token rows split
    weights = [c for c in p.choices if c.node.op is not None and c.node.op.op_name == "weight"]
    assert all(c.strategy.name == "R" for c in weights)  # replicated, gradients all-reduced
    assert p.forward == []  # no communication in the forward pass


def test_repeated_layers_are_solved_once():
    """Eight layers plan with the variables of one: the ops at one place in every layer share them."""
    one = plan(gpt_graph(1, 512, 8).module, H100x8, sizes={"B": 8, "S": 512})
    eight = plan(gpt_graph(8, 512, 8).module, H100x8, sizes={"B": 8, "S": 512})
    start, period, copies = eight.layers
    assert copies >= 7 and period >= 40
    assert eight.variables <= 2 * one.variables
    per_layer = [[c.strategy.name for c in eight.choices[start + k * period:start + (k + 1) * period]]
                 for k in range(copies)]
    assert all(layer == per_layer[0] for layer in per_layer)


def test_a_memory_budget_the_replicated_weights_exceed_forces_them_to_be_split():
    """Data parallel keeps every weight (with its gradient and Adam state) on every device;
    under 60% of that memory the planner splits weights (ZeRO-3-like: gathered when used)."""
    model = gpt_graph(2, 1024, 8)
    sizes = {"B": 64, "S": 128}
    free = plan(model.module, H100x8, sizes=sizes)

    def weight_bytes(p):
        return sum(c.memory for c in p.choices if c.node.op is not None and c.node.op.op_name == "weight")

    budget = free.memory * 0.6
    tight = plan(model.module, H100x8, sizes=sizes, budget=budget)
    assert tight.memory <= budget < free.memory
    assert weight_bytes(tight) < weight_bytes(free)
    assert tight.time >= free.time
    with pytest.raises(ShardError, match="fits"):
        plan(model.module, H100x8, sizes=sizes, budget=1e6)


def test_a_user_annotation_is_kept_and_the_plan_adapts_around_it():
    """GSPMD-style: the user pins fc1 replicated in the wide model; the rest is re-planned."""
    model = gpt_graph(1, 8192, 64, mlp_only=True)
    text = model.text.replace("builtin.module {", 'builtin.module {\n  shard.grid @mesh(shape = 8)', 1)
    pinned = Model.parse(text, model.weights)
    func = pinned.func
    from tilegraph.ir.shard import ShardOp
    from tilegraph.passes.shard_annotations import sharding_op

    fc1 = next(op for op in func.walk() if op.name == "tg.weight" and op.attr("name") == "h0.mlp.fc1")
    uses = list(fc1.results[0].uses)
    spec_op = sharding_op(((), ()))
    ann = ShardOp(fc1.results[0], spec_op.results[0], None)
    func.body.block.insert_ops_after([spec_op, ann], fc1)
    for u in uses:
        u.operation.operands[u.index] = ann.result
    with collect() as remarks:
        out = run_pipeline(pinned, 'shard{mesh=8 sizes="B=1,S=2048"}')
    free = run_pipeline(model, 'shard{mesh=8 sizes="B=1,S=2048"}')
    fc1_out = next(op for op in out.func.walk() if op.name == "tg.weight" and op.attr("name") == "h0.mlp.fc1")
    assert "split_axes = [[], []]" in str(next(iter(fc1_out.results[0].uses)).operation.sharding.owner)
    assert out.text != free.text
    assert any("predicted step" in str(r) for r in remarks) and any("runner-up" in str(r) for r in remarks)


def test_bad_options_and_a_mismatched_grid_are_clear_errors():
    for bad in ("shard{mesh=0}", "shard{mesh=two}", "shard{memory=lots}", "shard{hardware=tpu}",
                'shard{sizes="B"}'):
        with pytest.raises(PipelineError, match="shard"):
            parse_pipeline(bad)
    model = gpt_graph(1, 32, 4, batch=4, seq=8, weights="random")
    annotated = run_pipeline(model, "shard{mesh=4}")
    with pytest.raises(ShardError, match="grid"):
        run_pipeline(annotated, "shard{mesh=2x2}")


# --- the partitioned program on a simulated mesh ------------------------------------------------

def _check_on_mesh(model, annotated, inputs, sizes):
    expected = interpret(model, inputs)
    got = run(partition(annotated, sizes), inputs)
    n = reduction_length(model, sizes)
    dtype = narrowest_float(model) or "f32"
    for name, a, e in zip(model.output_names, got, expected):
        assert_close(a, e, dtype, n, name=f"output '{name}' on the simulated mesh")


@pytest.mark.parametrize("pipeline", ['shard{mesh=2x4 inference=true sizes="B=8"}', 'shard{mesh=8 sizes="B=8"}',
                                      'shard{mesh=4 inference=true sizes="B=1"}'])
def test_the_planned_gpt_on_a_simulated_mesh_computes_what_one_device_does(pipeline):
    model = gpt_graph(2, 32, 4, seq=8, vocab=64, dtype="f32", weights="random")
    sizes = {"B": int(pipeline.split("B=")[1][0])}
    inputs = random_inputs(model, seed=3, sizes=sizes)
    _check_on_mesh(model, run_pipeline(model, pipeline), inputs, sizes)


def test_megatrons_layout_on_a_simulated_mesh_computes_what_one_device_does():
    """The wide model's plan (heads, columns and rows split 8 ways) applied to a narrow copy of it."""
    wide = plan(gpt_graph(1, 8192, 64).module, H100x8, sizes={"B": 1, "S": 2048}, overlap=False)
    names = iter([c.strategy.name for c in wide.choices])
    model = gpt_graph(1, 64, 8, batch=2, seq=8, dtype="f32", weights="random")
    annotated = model.clone()
    small = chosen_plan(annotated.module, H100x8, lambda n: [s.name for s in n.strategies].index(next(names)))
    annotate(annotated.module, small)
    assert "n@0" in {c.strategy.name for c in small.choices}
    assert any(c.strategy.name.startswith("k@0") for c in small.choices)
    text = partition(annotated).model.text
    assert text.count("shard.all_reduce") + text.count("shard.reduce_scatter") == 2  # one per block
    _check_on_mesh(model, annotated, random_inputs(model, seed=0), {})


def test_groups_are_ordered_row_major_over_their_axes():
    assert groups((2, 4), [1]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups((2, 4), [0]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups((2, 4), [0, 1]) == [list(range(8))]


def test_sizes_that_do_not_split_are_a_clear_error():
    model = gpt_graph(1, 32, 4, seq=8, weights="random", dtype="f32")
    annotated = model.clone()
    split_batch = chosen_plan(annotated.module, Mesh((4,), H100),
                              lambda n: [s.name for s in n.strategies].index("d0@0") if n.op is None else 0, {"B": 4})
    annotate(annotated.module, split_batch)
    with pytest.raises(PartitionError, match="does not split into 4"):
        partition(annotated, {"B": 3})


MESHES = [(2,), (2, 2), (4,)]
PROPERTY = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPERTY
@given(model=graphs(max_ops=8), mesh=st.sampled_from(MESHES), data=st.data())
def test_any_valid_plan_preserves_semantics_on_the_simulated_mesh(model, mesh, data):
    """Random graphs, a random strategy per op (not the planner's), symbols sized to split:
    the per-device programs, collectives included, compute the single-device result."""
    sizes = {"B": 4}
    annotated = model.clone()
    p = chosen_plan(annotated.module, Mesh(mesh, H100),
                    lambda n: data.draw(st.integers(0, len(n.strategies) - 1), label=n.label), sizes)
    annotate(annotated.module, p)
    assert Model.parse(annotated.text, annotated.weights).text == annotated.text
    inputs = random_inputs(model, seed=1, sizes=sizes)
    _, bound = bind_inputs(model, inputs)
    text = partition(annotated, bound).model.text
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_slice"):
        event(f"{kind} in the program: {f'shard.{kind} ' in text}")
    _check_on_mesh(model, annotated, inputs, bound)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=graphs(max_ops=8), mesh=st.sampled_from(MESHES), data=st.data())
def test_pipeline_stages_with_any_valid_plan_each_preserve_semantics(model, mesh, data):
    """Random graphs cut into pipeline stages at random places (`pipeline.cut`, what split_stages
    does at layer boundaries), each stage given its own random plan (ZeRO variants and weights
    gathered at use among them), run stage after stage on the simulated mesh: the single-device result."""
    from tilegraph.passes.parallel_degrees import cut

    sizes = {"B": 4}
    ops = len(list(model.func.body.block.ops)) - 1
    positions = sorted(set(data.draw(st.lists(st.integers(1, max(1, ops - 1)), max_size=2), label="cuts")))
    stages = cut(model, [p for p in positions if 0 < p < ops])
    inputs = random_inputs(model, seed=2, sizes=sizes)
    _, bound = bind_inputs(model, inputs)
    values = inputs
    for k, stage in enumerate(stages):
        p = chosen_plan(stage.module, Mesh(mesh, H100),
                        lambda n: data.draw(st.integers(0, len(n.strategies) - 1), label=f"{k}:{n.label}"), sizes)
        annotate(stage.module, p)
        values = run(partition(stage, bound), values)
    expected = interpret(model, inputs)
    n = reduction_length(model, bound)
    for name, a, e in zip(model.output_names, values, expected):
        assert_close(a, e, narrowest_float(model) or "f32", n, name=f"output '{name}' after {len(stages)} stages")


# --- the command line -----------------------------------------------------------------------

def test_the_shard_command_prints_the_plan_per_layer_time_split_and_memory(tmp_path, capsys):
    from tilegraph.cli import main

    path = gpt_graph(3, 64, 4, seq=16, vocab=128, dtype="f32", weights="random").save(tmp_path / "gpt.mlir")
    assert main(["shard", str(path), "--mesh", "4", "--hardware", "h100", "--symbolic", "--dim", "B=64"]) == 0
    out = capsys.readouterr().out
    assert "each of 3 repeated blocks" in out and "before the layers" in out and "after the layers" in out
    assert "predicted step time:" in out and "communication" in out and "memory per device:" in out
    assert "step time [s] =" in out
    assert main(["shard", str(path), "--mesh", "8", "--symbolic"]) == 0  # B not given: a formula of B
    formula = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step time [s] ="))
    assert "B" in formula


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "2y4"], "mesh"), (["--hardware", "cpu"], "GPUs"), (["--memory", "lots"], "memory"),
    (["--dim", "Q=3"], "Q"), (["--memory", "1kB", "--dim", "B=64"], "fits"),
])
def test_the_shard_command_reports_bad_input_in_one_paragraph(tmp_path, capsys, argv, message):
    from tilegraph.cli import main

    path = gpt_graph(1, 32, 4, seq=8, dtype="f32", weights="random").save(tmp_path / "gpt.mlir")
    assert main(["shard", str(path), *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err and captured.out == ""


# Cases hypothesis found (kept as plain tests: the property draws its plan with st.data()).

def _scalar_weight_model():
    """A rank-0 weight: its device copy must stay rank 0 (np.ascontiguousarray makes it 1-d)."""
    from tilegraph.ir import Graph

    g = Graph()
    x, y = g.input("x", ()), g.input("y", ("B", 2))
    w = g.weight("w", np.array(0.27, np.float32))
    return g.build(x * -w, y * w)


def _split_model():
    """An op with several results (split): the partitioner maps every result, not just the first."""
    from tilegraph.ir import Graph

    g = Graph()
    x = g.input("x", ("B", 4))
    a, b = g.split(x, (1, 3), axis=1)
    return g.build(g.exp(b) * 2.0, a)


@pytest.mark.parametrize("make", [_scalar_weight_model, _split_model])
@pytest.mark.parametrize("last", [False, True])
def test_found_cases_preserve_semantics_on_the_simulated_mesh(make, last):
    """Every op replicated, or every op at its most split strategy, on a 2x2 mesh."""
    model = make()
    annotated = model.clone()
    annotate(annotated.module, chosen_plan(annotated.module, Mesh((2, 2), H100),
                                           lambda n: len(n.strategies) - 1 if last else 0, {"B": 4}))
    inputs = random_inputs(model, seed=0, sizes={"B": 4})
    _check_on_mesh(model, annotated, inputs, {"B": 4})


# --- training memory, ZeRO, recomputation, overlap -------------------------------------------------

H100x1 = Mesh((1,), H100)


def _weights(p):
    return sum(c.memory for c in p.choices if c.node.op is not None and c.node.op.op_name == "weight")


def test_training_memory_is_weights_gradients_adam_state_and_what_the_backward_reads():
    """bf16 weights train with 16 bytes per parameter (weight, gradient, two f32 Adam moments, an f32
    master copy: ZeRO section 3.1); a GPT layer keeps 32 bytes per token and hidden unit for its
    backward (Korthikanti et al. 2022, eq. 1's 34sbh without dropout's masks, flash attention
    keeping no s x s matrix)."""
    model = gpt_graph(4, 2048, 16, seq=2048)
    p = plan(model.module, H100x1, sizes={"B": 4})
    params = sum(int(np.prod(c.node.info.shape)) for c in p.choices
                 if c.node.op is not None and c.node.op.op_name == "weight")
    assert _weights(p) == pytest.approx(16 * params)
    start, period, copies = p.layers
    layer = sum(c.memory for c in p.choices[start:start + period] if c.node.op.op_name != "weight")
    assert layer == pytest.approx(32 * 4 * 2048 * 2048)
    assert p.memory == pytest.approx(_weights(p) + copies * layer + 2 * 4 * 2048 * 2048)  # + the input x
    assert not p.recompute and p.zero == 0


def test_activations_over_the_budget_are_recomputed_layer_by_layer_at_the_price_of_a_forward():
    """Recomputation is an integer r of the program: r of the 4 layers keep only their input and
    re-run their forward (1/3 of a layer's step) in the backward. Each recomputed layer adds 1/12 of
    the compute and saves its activations less its checkpoint; all 4 also hold one layer's
    activations while recomputing (the backward meets them before any layer has freed its own), so
    r = 4 needs more memory than r = 3. Under a budget the planner recomputes the fewest layers that fit."""
    model = gpt_graph(4, 1024, 16, seq=2048)
    sizes = {"B": 4}
    free = plan(model.module, H100x1, sizes=sizes, runner_up=False)
    fixed = [plan(model.module, H100x1, sizes=sizes, recompute=r, runner_up=False) for r in range(5)]
    assert [p.recompute for p in fixed] == [0, 1, 2, 3, 4] and free.recompute == 0
    for r, p in enumerate(fixed):
        assert p.compute / free.compute == pytest.approx(1 + r / 12, rel=1e-3)
    saved = [fixed[r].memory - fixed[r + 1].memory for r in range(3)]
    start, period, _ = free.layers
    layer = sum(c.memory for c in free.choices[start:start + period] if c.node.op.op_name != "weight")
    checkpoint = 2 * 4 * 2048 * 1024  # the layer's input, bf16
    assert saved == pytest.approx([layer - checkpoint] * 3, rel=1e-6)
    assert fixed[4].memory == pytest.approx(fixed[3].memory + checkpoint, rel=1e-6)
    for r in (1, 2, 3):
        budget = (fixed[r].memory + fixed[r - 1].memory) / 2
        tight = plan(model.module, H100x1, sizes=sizes, budget=budget, runner_up=False)
        assert tight.recompute == r and tight.memory <= budget
        assert tight.time == pytest.approx(fixed[r].time, rel=1e-3)
    with pytest.raises(ShardError, match="fits"):
        plan(model.module, H100x1, sizes=sizes, budget=(fixed[1].memory + fixed[0].memory) / 2, recompute=False)
    always = plan(model.module, H100x1, sizes=sizes, recompute="always", runner_up=False)  # as a published configuration
    assert always.recompute == 4 and always.compute == pytest.approx(fixed[4].compute, rel=1e-6)


def test_zero_partitions_optimizer_state_over_the_data_parallel_axis_when_weights_do_not_fit():
    """Data parallel on 8 devices, a budget under the replicated weights' 16 bytes per parameter:
    ZeRO-1 (optimizer state 12/8 bytes per parameter) or 2 (and the gradient 2/8) on enough of the
    weights makes it fit at the cost of collectives' latencies, the computation still data parallel."""
    model = gpt_graph(2, 256, 4)
    sizes = {"B": 64, "S": 512}
    free = plan(model.module, H100x8, sizes=sizes)
    assert free.zero == 0 and set(_matmuls(free).values()) <= {"b0@0", "m@0"}
    budget = free.memory - 0.6 * _weights(free)
    zero = plan(model.module, H100x8, sizes=sizes, budget=budget)
    assert zero.zero in (1, 2) and zero.memory <= budget and set(_matmuls(zero).values()) <= {"b0@0", "m@0"}
    assert free.time <= zero.time < 1.05 * free.time
    per_param = {0: 16, 1: 2 + 2 + 12 / 8, 2: 2 + (2 + 12) / 8}  # bytes; the spec replicated on 8 devices
    for c in zero.choices:
        if c.node.op is not None and c.node.op.op_name == "weight":
            assert c.memory == pytest.approx(per_param[c.strategy.zero] * int(np.prod(c.node.info.shape)))


def test_overlapped_gradient_all_reduce_hides_behind_the_backward():
    """Data parallelism's gradient all-reduce does not depend on the backward of the layers before it:
    overlapped, it costs its exposed part plus OVERLAP_INTERFERENCE of itself."""
    from tilegraph.passes.shard import OVERLAP_INTERFERENCE

    model = gpt_graph(2, 512, 8)
    only = lambda n: {"R"} if n.op is not None and n.op.op_name == "weight" else None  # noqa: E731
    sizes = {"B": 64, "S": 512}
    serial = plan(model.module, H100x8, sizes=sizes, overlap=False, only=only)
    hidden = plan(model.module, H100x8, sizes=sizes, overlap=True, only=only)
    assert serial.compute == pytest.approx(hidden.compute)
    assert serial.comm > 0 and hidden.comm == pytest.approx(OVERLAP_INTERFERENCE * serial.comm, rel=0.05)


# --- planning from shapes alone ----------------------------------------------------------------

LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000)  # Llama-2-7B's config.json


def _materialised(model) -> int:
    """Bytes the weight store really holds (a zero-strided view holds one element)."""
    return sum(a.itemsize if not any(a.strides) else a.nbytes for a in map(np.asarray, model.weights.values()))


def test_a_llama_7b_config_plans_on_8_h100s_without_materialising_its_weights():
    """6.7 billion parameters described by their config: the weight store holds a few bytes, and the
    plan (training, 8 x 4096 tokens) fits 80 GB per device, with its ZeRO stage or recomputation."""
    from tilegraph.frontends.config import from_config

    from tilegraph.frontends.config import NAMED_CONFIGS

    assert NAMED_CONFIGS["llama-7b"] == LLAMA_7B  # what `tilegraph shard --config llama-7b` plans
    model = from_config(LLAMA_7B)
    params = sum(int(np.prod(np.shape(a))) for a in model.weights.values())
    assert 6.6e9 < params < 6.8e9 and _materialised(model) < 10_000
    p = plan(model.module, H100x8, sizes={"B": 8, "S": 4096})
    assert p.memory <= H100.memory_bytes and (p.zero or p.recompute or p.describe() != "all replicated")
    with pytest.raises(ShardError, match="fits"):
        plan(model.module, H100x1, sizes={"B": 8, "S": 4096})  # 16 bytes x 6.7e9 parameters > 80 GB


def test_a_torch_module_on_the_meta_device_imports_and_plans():
    """A Llama (grouped-query attention) built on torch's meta device: no values anywhere, its weights
    import as zero-strided views and the planner plans it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tilegraph

    config = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=512, use_cache=False)
    with torch.device("meta"):
        llama = LlamaForCausalLM(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(ids, use_cache=False).logits

    model = tilegraph.import_model(Logits(llama), example_inputs=(torch.zeros((2, 32), dtype=torch.long,
                                                                              device="meta"),))
    assert _materialised(model) < 10_000
    p = plan(model.module, Mesh((4,), H100))
    assert p.time > 0 and p.memory > sum(np.asarray(a).size for a in model.weights.values()) * 12


def test_a_small_llama_config_sharded_computes_what_one_device_does():
    """Grouped-query attention (K/V heads broadcast to query heads), RMSNorm and SwiGLU, planned on a
    2x2 mesh and run on the simulated mesh."""
    from tilegraph.frontends.config import from_config

    config = dict(LLAMA_7B, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64)
    model = from_config(config, seq=8, dtype="f32", weights="random")
    sizes = {"B": 4}
    annotated = run_pipeline(model, 'shard{mesh=2x2 sizes="B=4"}')
    _check_on_mesh(model, annotated, random_inputs(model, seed=5, sizes=sizes), sizes)


def test_a_config_of_no_known_model_is_a_clear_error():
    from tilegraph.frontends.config import ConfigError, from_config

    with pytest.raises(ConfigError, match="neither GPT-2"):
        from_config({"d_model": 512})
    with pytest.raises(ConfigError, match="non-integer"):
        from_config(dict(LLAMA_7B, hidden_size="wide"))
    with pytest.raises(ConfigError, match="multiple"):
        from_config(dict(LLAMA_7B, num_key_value_heads=5))


# --- pipeline stages and the degree search ----------------------------------------------------------

def test_a_pipeline_stage_pays_the_1f1b_bubble():
    """Two stages of a layer stack (no embedding or head), m micro-batches: a stage runs half the
    layers in m + 1 slots, so its compute is (m + 1) / (2m) of one device running all of them in m;
    the bubble is 1/(m + 1) of the stage's step, and stage 0 keeps two micro-batches' activations."""
    model = gpt_graph(4, 512, 8)
    sizes = {"B": 16, "S": 512}
    for m in (2, 8):
        whole = plan(model.module, H100x1, sizes=sizes, micro_batches=m, recompute=False)
        stage = plan(model.module, H100x1, sizes=sizes, stages=2, micro_batches=m, recompute=False)
        assert stage.compute / whole.compute == pytest.approx((m + 1) / (2 * m), rel=1e-3)
        assert stage.bubble == pytest.approx(stage.compute / (m + 1), rel=0.05)
        assert stage.comm > 0 and stage.stages == 2 and stage.micro_batches == m
    with pytest.raises(ShardError, match="divide"):
        plan(model.module, H100x1, sizes=sizes, stages=3)


def test_pipeline_stages_are_priced_each_with_its_own_ops_and_the_slowest_sets_the_pace():
    """Two stages of a GPT with a large vocabulary: the first holds the embeddings, the last the final
    LN and the head, each two layers. On one device per
    stage (no collectives) the last is slower by exactly the head's compute less the embedding's per
    slot, and it sets the step; the first keeps min(p, m) micro-batches' activations, the last one's.
    The plan, cut into its stages, computes what one device computes."""
    from tilegraph.passes.parallel_degrees import stage_plans

    model = gpt_graph(4, 256, 4, seq=64, vocab=8192)
    m, sizes = 4, {"B": 8}
    p = plan(model.module, H100x1, sizes=sizes, stages=2, micro_batches=m, recompute=False, runner_up=False)
    first, last = p.stage_times
    assert last > first and p.time == pytest.approx(last, rel=1e-9)
    start, period, copies = p.layers
    end = start + period * copies
    outside = [(i, c) for i, c in enumerate(p.choices) if not start <= i < end]
    pre = [c for i, c in outside if i < start and c.node.op is not None and c.node.op.op_name != "weight"]
    post = [c for i, c in outside if i >= end and c.node.op.op_name != "weight"]
    slots = m + 1
    assert last - first == pytest.approx(slots * (sum(c.compute for c in post) - sum(c.compute for c in pre)), rel=1e-6)
    weight = {c.node.label: c.memory for c in p.choices if c.node.op is not None and c.node.op.op_name == "weight"}
    layer_w = sum(c.memory for c in p.choices[start:start + period] if c.node.op.op_name == "weight")
    layer_a = sum(c.memory for c in p.choices[start:start + period] if c.node.op.op_name != "weight")
    per_stage = copies // 2
    ids = sum(c.memory for c in p.choices if c.node.op is None)
    assert p.stage_memory[0] == pytest.approx(weight["wte"] + weight["wpe"] + per_stage * layer_w + 2 * (
        ids + sum(c.memory for c in pre) + per_stage * layer_a), rel=1e-9)
    head_w = sum(v for k, v in weight.items() if k not in ("wte", "wpe") and not k.startswith("h"))
    assert head_w == weight["lm_head"] + weight["ln_f.g"] + weight["ln_f.b"]
    assert p.stage_memory[1] == pytest.approx(head_w + per_stage * layer_w + 1 * (
        sum(c.memory for c in post) + per_stage * layer_a), rel=1e-9)
    assert p.memory == max(p.stage_memory)

    # The same plan on 2 devices per stage, cut into its stages and run on the simulated mesh.
    small = gpt_graph(4, 32, 4, seq=8, vocab=64, dtype="f32", weights="random")
    mesh = Mesh((2,), H100)
    p2 = plan(small.module, mesh, sizes={"B": 4}, stages=2, micro_batches=2, runner_up=False)
    assert len(p2.stage_times) == 2
    inputs = random_inputs(small, seed=3, sizes={"B": 2})  # one micro-batch
    values = inputs
    for stage, stage_plan in stage_plans(small, p2, {"B": 2}):
        annotate(stage.module, stage_plan)
        values = run(partition(stage, {"B": 2}), values)
    expected = interpret(small, inputs)
    assert_close(values[0], expected[0], "f32", reduction_length(small, bind_inputs(small, inputs)[1]))


def test_the_degree_search_prices_every_layout_and_keeps_the_cheapest():
    """On 8 devices the search tries pipeline, tensor and data degrees (and micro-batch counts); the
    winner is the cheapest that fits, and its degrees multiply to the device count."""
    from tilegraph.passes.parallel_degrees import mfu, model_flops, search

    model = gpt_graph(2, 512, 8)
    sizes = {"B": 16, "S": 1024}
    best, tried = search(model.module, 8, H100, sizes, tensor_degrees=(1, 2), pipelines=(1, 2))
    assert best is not None and best.time == min(lay.time for lay in tried)
    assert {(lay.pipeline, lay.plan.mesh.shape) for lay in tried} >= {(1, (8,)), (1, (4, 2)), (2, (4,)), (2, (2, 2))}
    d = best.degrees
    assert d["data"] * d["tensor"] * d["sequence"] * d["pipeline"] == 8
    assert 0.05 < mfu(best, model_flops(model.module, sizes), 8) < 1


# --- Ulysses sequence parallelism ------------------------------------------------------------------

def _tensor_parallel(node):
    """Megatron-LM's layout on axis 0 (to price against)."""
    op = node.op
    if op is None or op.op_name not in ("matmul", "attention"):
        return None
    if op.op_name == "attention":
        return {"d1@0"}
    w = node.label.split("(")[1].rstrip(")")
    return {s.name for s in node.strategies if s.name.split(">")[0] == ("k@0" if w.endswith(("wo", "fc2")) else "n@0")}


def test_a_long_sequence_with_many_heads_gets_ulysses_sequence_parallelism():
    """One sequence of 32768 tokens, 32 heads, hidden 2048 on 8 H100s (DeepSpeed-Ulysses' setting): every
    matmul split by tokens, attention by heads, and the only forward collectives four all-to-alls
    (Q, K, V to heads, the output back to tokens), each moving 1/8 of what Megatron's all-gathers and
    reduce-scatters of the whole activation move; the planner's plan is faster than Megatron's."""
    model = gpt_graph(1, 2048, 32)
    sizes = {"B": 1, "S": 32768}
    p = plan(model.module, H100x8, sizes=sizes, runner_up=False)
    ops = {c.node.label: c.strategy.name for c in p.choices
           if c.node.op is not None and c.node.op.op_name in ("matmul", "attention")}
    assert all(name == ("d1@0" if label.startswith("attention") else "m@0") for label, name in ops.items()), ops
    assert [kind for kind, _, _ in p.forward] == ["all_to_all"] * 4
    megatron = plan(model.module, H100x8, sizes=sizes, only=_tensor_parallel, runner_up=False)
    assert p.time < megatron.time and p.comm < megatron.comm

    # the same choices on a narrow copy compute what one device computes
    names = iter([c.strategy.name for c in p.choices])
    small = gpt_graph(1, 64, 8, batch=1, seq=16, dtype="f32", weights="random")
    annotated = small.clone()
    annotate(annotated.module, chosen_plan(annotated.module, H100x8,
                                           lambda n: [s.name for s in n.strategies].index(next(names))))
    assert partition(annotated).model.text.count("shard.all_to_all") == 4
    _check_on_mesh(small, annotated, random_inputs(small, seed=4), {})


@st.composite
def _specs_pair(draw):
    """Two shardings of one rank-3 value over mesh axes 0-2: each axis on at most one dim, a
    dim split over several axes in the order given (major first)."""
    def spec():
        axes = draw(st.permutations([0, 1, 2]))
        used = axes[:draw(st.integers(0, 3))]
        dims = [draw(st.integers(0, 2)) for _ in used]
        return tuple(tuple(a for a, d in zip(used, dims) if d == dim) for dim in range(3))
    return spec(), spec()


@settings(max_examples=200, deadline=None)
@given(_specs_pair())
def test_the_resharding_steps_arrive_at_the_target_sharding(pair):
    """Whatever the two shardings, the collectives reshard_steps chooses, applied in order, give
    exactly the target, the order of the axes splitting one dim included (which is major
    decides which device holds which slice)."""
    from tilegraph.passes.shard_strategies import apply_step, reshard_steps

    src, dst = pair
    spec = src
    for step in reshard_steps(src, dst):
        spec = apply_step(spec, step)
    assert spec == dst, (src, dst, reshard_steps(src, dst))
