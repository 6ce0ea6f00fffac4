"""The sharded program run for real: N local processes joined by torch.distributed (gloo).

- a GPT layer in Megatron's layout (collectives in every block) on 2 processes gives what one
  device gives (the float64 interpreter, the dtype's tolerance) and what the simulated mesh gives;
- the same with each device's program as C-backend modules between its collectives;
- `tilegraph run --devices 2 --backend c` plans, partitions, runs each device's program as C-backend
  modules between its collectives, agrees, and times itself against the op-by-op run and one process;
- all-MiniLM-L6-v2 as the planner shards it on 2 and 4 processes agrees with one device (slow:
  torch.export of the model and a process per device);
- two pipeline stages, each on a 2x2 (data x tensor) mesh, two micro-batches, on 8 processes agree;
- collectives issued asynchronously and waited for at first use (overlap) give bit-identical outputs;
  several modes interleaved in one launch (op by op, NumPy and C backends) each agree.
"""

from __future__ import annotations

import numpy as np
import pytest

from tilegraph.backends import distributed, simulated_mesh
from tilegraph.ir import interpret
from tilegraph.ir.interpreter import bind_inputs
from tilegraph.passes.cost.collectives import Mesh
from tilegraph.passes.cost.hardware import H100
from tilegraph.passes.partition import partition
from tilegraph.passes.registry import run_pipeline
from tilegraph.passes.shard import annotate, chosen_plan, plan
from tests.models import gpt_graph, zero3_pick
from tilegraph.testing import assert_close, narrowest_float, random_inputs, reduction_length


def _agrees(model, got, inputs, what):
    expected = interpret(model, inputs)
    n = reduction_length(model, bind_inputs(model, inputs)[1])
    for name, a, e in zip(model.output_names, got, expected):
        assert_close(a, e, narrowest_float(model) or "f32", n, name=f"output '{name}' of {what}")


def test_megatrons_layout_on_two_processes_computes_what_one_device_does():
    mesh = Mesh((2,), H100)
    wide = plan(gpt_graph(1, 4096, 32).module, mesh, sizes={"B": 1, "S": 2048}, overlap=False)
    names = iter([c.strategy.name for c in wide.choices])
    model = gpt_graph(1, 32, 4, batch=2, seq=4, dtype="f32", weights="random")
    annotated = model.clone()
    annotate(annotated.module, chosen_plan(annotated.module, mesh,
                                           lambda n: [s.name for s in n.strategies].index(next(names))))
    program = partition(annotated)
    text = program.model.text
    assert text.count("shard.all_reduce") + text.count("shard.reduce_scatter") == 2  # one per block
    inputs = random_inputs(model, seed=2)
    (got, native), _ = distributed.compare([program], inputs, [(None, True), ("c", True)])
    _agrees(model, got, inputs, "2 gloo processes")
    for a, b in zip(got, simulated_mesh.run(program, inputs, float64=False)):
        np.testing.assert_array_equal(a, b)  # same ops in the same dtypes: the simulated mesh is exact
    # Each device's program as C modules between its all-reduces (one inside every block).
    _agrees(model, native, inputs, "2 gloo processes, C backend between collectives")


def test_tilegraph_run_on_two_processes_agrees(tmp_path, capsys):
    from tilegraph.cli import main

    path = gpt_graph(1, 32, 4, seq=8, vocab=64, dtype="f32", weights="random").save(tmp_path / "gpt.mlir")
    assert main(["run", str(path), "--devices", "2", "--backend", "c", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "2 processes" in out and out.strip().endswith("agree")
    assert "compiled (C backend between collectives)" in out and "op by op:" in out and "one process, C" in out


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_minilm_sharded_on_local_processes_matches_one_device(devices):
    import tilegraph
    from tilegraph.passes.registry import UNFUSED_PIPELINE
    from tests.models import minilm_inputs, minilm_model

    ids, mask = minilm_inputs(batch=4, seq=16)
    model = run_pipeline(tilegraph.import_model(minilm_model(), example_inputs=(ids, mask)), UNFUSED_PIPELINE)
    annotated = run_pipeline(model, f"shard{{mesh={devices} inference=true}}")
    program = partition(annotated)
    assert "shard.all_reduce" in program.model.text  # the planner split some of it: a real collective ran
    inputs = [ids.numpy(), mask.numpy()]
    got = distributed.run(program, inputs)
    _agrees(model, got, inputs, f"MiniLM on {devices} gloo processes")


def _layout(node):
    """Megatron's tensor parallelism over mesh axis 1, data parallelism over axis 0."""
    op = node.op
    if op is None:
        return {"d0@0"}
    w = node.label.split("(")[1].rstrip(")") if "(" in node.label else ""
    if op.op_name == "matmul" and w.endswith(("wq", "wk", "wv", "fc1", "wo", "fc2")):
        loop = "k@1" if w.endswith(("wo", "fc2")) else "n@1"
        return {s.name for s in node.strategies if s.name.split(">")[0] == f"b0@0,{loop}"}
    if op.op_name == "attention":
        return {"d0@0,d1@1"}
    return None


@pytest.mark.slow
def test_tensor_pipeline_and_data_parallelism_on_eight_processes_computes_what_one_device_does():
    """Two pipeline stages of two layers each, every stage on a 2x2 mesh (data x tensor), two
    micro-batches: eight gloo processes, stage 0 sending its activations to stage 1."""
    from tilegraph.passes.parallel_degrees import split_stages

    model = gpt_graph(4, 32, 4, seq=8, vocab=64, dtype="f32", weights="random")
    mesh = Mesh((2, 2), H100)
    programs = []
    for stage in split_stages(model, 2):
        p = plan(stage.module, mesh, sizes={"B": 2}, only=_layout, runner_up=False)
        annotate(stage.module, p)
        programs.append(partition(stage, {"B": 2}))
    text = programs[1].model.text
    assert "tg.attention" in text and ("shard.all_reduce" in text or "shard.reduce_scatter" in text)
    inputs = random_inputs(model, seed=6, sizes={"B": 4})
    got = distributed.run_stages(programs, inputs, micro_batches=2)
    _agrees(model, got, inputs, "2 stages x 2x2 mesh on 8 gloo processes")


def test_overlapped_collectives_give_the_same_result():
    """Weights stored split and all-gathered where used (ZeRO-3): with overlap every gather is issued
    before any compute and waited for at first use; the outputs are bit-identical to the synchronous run."""
    model = gpt_graph(2, 32, 4, seq=8, vocab=64, dtype="f32", weights="random")
    annotated = model.clone()
    mesh = Mesh((2,), H100)

    annotate(annotated.module, chosen_plan(annotated.module, mesh, zero3_pick, {"B": 2}))
    program = partition(annotated, {"B": 2})
    assert program.model.text.count("shard.all_gather") >= 8
    inputs = random_inputs(model, seed=7, sizes={"B": 2})
    modes = [(None, True), (None, False), ("numpy", True), ("c", False)]
    (eager, serial, numpy_backend, native), times = distributed.compare([program], inputs, modes, repeats=2)
    for a, b in zip(eager, serial):
        np.testing.assert_array_equal(a, b)
    assert [len(t) for t in times] == [2] * 4 and all(t > 0 for ts in times for t in ts)
    _agrees(model, eager, inputs, "overlapped collectives")
    _agrees(model, numpy_backend, inputs, "NumPy-backend segments, overlapped")
    _agrees(model, native, inputs, "C-backend segments")
