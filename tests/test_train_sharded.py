"""tilegraph.train_sharded: the shard planner's ZeRO-3, Megatron tensor-parallel and 2-stage GPipe plans
executed as training on 2 real gloo processes, against torch eager from the same weights and batches."""

from __future__ import annotations

import copy
import functools
import os
import signal

import numpy as np
import pytest
import torch

import tilegraph
from tests.models import char_batches, char_corpus, char_gpt, char_gpt_segments
from tests.test_train import torch_losses
from tilegraph.ir.arena import ALIGN
from tilegraph.testing import PEER_RELATIVE_ERROR
from tilegraph.train import AdamW
from tilegraph.train_sharded import STRATEGIES, ModelAt, Processes, ShardedTrainError, pipeline_order, train_sharded

COLUMN = (".qkv.weight", ".qkv.bias", ".fc.weight", ".fc.bias")
ROW = (".proj.weight", ".out.weight")
ADAMW_ARRAYS = 3  # a weight (or its slice) and its two moments, held between steps


def _models(module, batch: int) -> ModelAt:
    """The model as the processes plan it: its batch dim symbolic (each segment is imported at its rows)."""
    dyn = ({0: torch.export.Dim("B")},)
    ids = torch.zeros((batch, module.pos.weight.shape[0]), dtype=torch.int64)
    return ModelAt({None: tilegraph.import_model(module, example_inputs=(ids,), dynamic_shapes=dyn)})


pytestmark = pytest.mark.xdist_group("train_sharded")  # one worker: the processes are shared


@pytest.fixture(scope="module")
def processes():
    """Two gloo processes shared by this module's runs (their start-up, imports and link measurement
    paid once; started first, so that they start while `gpt` runs torch); a run whose process fails
    ends them, so the next run gets new ones."""
    held = [Processes(2).__enter__()]

    def live() -> Processes:
        if not held or held[-1].closed:
            held.append(Processes(2).__enter__())
        return held[-1]
    yield live
    for group in held:
        group.close()


@pytest.fixture(scope="module")
def gpt():
    """The 2-block char GPT (2 blocks: one per pipeline stage), 3 steps of 4 rows, and torch eager's
    losses from the same weights and batches."""
    chars, batches = char_batches(char_corpus(), steps=3, batch=4, block=8)
    module = char_gpt(len(chars), layers=2, hidden=16, heads=2, block=8)
    reference = copy.deepcopy(module)
    theirs = torch_losses(reference, batches, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1),
                          clip_norm=1.0)
    return module, batches, _models(module, 4), theirs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_sharded_plan_trains_as_torch_eager_does(strategy, processes, gpt):
    module, batches, models, theirs = gpt
    params = dict(module.named_parameters())
    segments = functools.partial(char_gpt_segments, module, strategy)
    # the pipeline: 4 micro-batches of one row, in 1F1B's order
    result = processes().train(strategy, models, list(params), batches, optimizer=AdamW(lr=1e-2, weight_decay=0.1),
                               clip_norm=1.0, segments=segments, micro_batches=4, pipeline="")
    np.testing.assert_allclose(result["losses"], theirs, rtol=PEER_RELATIVE_ERROR)
    plan, held = result["plan"], np.array(result["memory"])[:, 0]
    assert plan["time"] > 0 and plan["memory"] > 0
    size = {k: p.numel() * 4 for k, p in params.items()}
    if strategy == "zero3":
        # every weight stored as half of itself on each process (its first dim split), moments too
        assert plan["zero"] == 3
        assert list(held) == [ADAMW_ARRAYS * sum(size.values()) / 2] * 2
        # gathered a unit (embedding, block, head) at a time with the next one prefetched, never the whole
        # model: at most the two largest neighbouring units
        units = [("tok.", "pos."), ("blocks.0.",), ("blocks.1.",), ("ln_f.", "head.")]
        unit = [sum(v for k, v in size.items() if k.startswith(u)) for u in units]
        gathered = np.array(result["memory"])[:, 4]
        assert list(gathered) == [max(a + b for a, b in zip(unit, unit[1:]))] * 2
        assert gathered[0] < sum(size.values())
    elif strategy == "tensor":
        # Megatron's column and row weights split, the rest (embeddings, LayerNorms, row biases, head) whole
        assert plan["zero"] == 0
        split = sum(v for k, v in size.items() if k.endswith(COLUMN + ROW))
        assert list(held) == [ADAMW_ARRAYS * (sum(size.values()) - split / 2)] * 2
    else:
        # each stage holds its half of the layers whole: the two stages hold the model once between them
        assert (plan["stages"], plan["micro_batches"]) == (2, 4)
        # 1F1B: stage 0 holds 2 micro-batches' activations at most, stage 1 one (GPipe: 4 each)
        assert [int(r[5]) for r in result["memory"]] == [2, 1]
        first = sum(v for k, v in size.items() if k.startswith(("tok.", "pos.", "blocks.0.")))
        assert list(held) == [ADAMW_ARRAYS * first, ADAMW_ARRAYS * (sum(size.values()) - first)]


# How far a rank's measured bytes (held between steps + C arena + a warm step's peak) may be from
# the plan's bytes per device, either way. What the plan leaves out is nearly fixed (a step's Python
# objects, which tracemalloc counts): a larger share of a smaller model's bytes
MEMORY_WITHIN = 1.25


@pytest.mark.parametrize("strategy", ["pipeline", "zero3"])
def test_a_plan_trains_on_the_c_backend_in_the_memory_it_planned(strategy, processes, gpt):
    # the runs above on compiled C (oneDNN GEMMs, one thread per process): the pipeline (the fewest
    # modules to compile, its activations and cotangents sent between processes) and ZeRO-3 (units
    # gathered and prefetched, gradients reduce-scattered)
    module, batches, models, theirs = gpt
    result = processes().train(strategy, models, [n for n, _ in module.named_parameters()], batches,
                               optimizer=AdamW(lr=1e-2, weight_decay=0.1), clip_norm=1.0, micro_batches=2,
                               segments=functools.partial(char_gpt_segments, module, strategy), pipeline="",
                               target="c")
    np.testing.assert_allclose(result["losses"], theirs, rtol=PEER_RELATIVE_ERROR)
    assert [r.rsplit(".", 1)[0] for r in result["runners"]] == ["tilegraph.backends.c.runtime"]
    assert not result["reference_kernels"]
    # a rank's modules (each segment's forward and backward, the optimizer step) take turns on one
    # arena: the rank holds the largest module's, not the sum of them all
    arenas = result["arenas"]
    mem, plan = np.array(result["memory"]), result["plan"]
    assert len(arenas) >= 3 and 0 < max(arenas) < sum(arenas)
    assert mem[0, 6] == max(arenas) + ALIGN
    # the plan counts that arena as the runtime lays it out, before any call (the largest rank's of
    # each stage), and ZeRO-3's two gathered units (the one computing and the one prefetched)
    stage = [1 if strategy == "pipeline" and r >= 1 else 0 for r in range(len(mem))]
    for r, s in enumerate(stage):
        assert plan[f"stage{s}_workspace"] >= mem[r, 6]
        assert plan[f"stage{s}_gathered"] == pytest.approx(mem[r, 4] if strategy == "zero3" else 0)
        measured = mem[r, 0] + mem[r, 1] + mem[r, 6]
        assert 1 / MEMORY_WITHIN <= measured / plan[f"stage{s}_memory"] <= MEMORY_WITHIN, (r, measured, plan)


def test_1f1b_runs_one_forward_and_one_backward_in_turn():
    assert pipeline_order("1f1b", 0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),
                                                 ("B", 3)]
    assert pipeline_order("1f1b", 1, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3),
                                                 ("B", 3)]
    assert pipeline_order("gpipe", 0, 2, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    # every micro-batch's forward before its backward, each once, on every stage of a deeper pipeline
    for stage in range(4):
        order = pipeline_order("1f1b", stage, 4, 6)
        assert sorted(order) == sorted([("F", j) for j in range(6)] + [("B", j) for j in range(6)])
        assert all(order.index(("F", j)) < order.index(("B", j)) for j in range(6))
        live = max(sum(1 if k == "F" else -1 for k, _ in order[:i + 1]) for i in range(len(order)))
        assert live == 4 - stage


def test_bad_requests_are_named_errors(gpt):
    models = gpt[2]
    _, batches = char_batches(char_corpus(), steps=1, batch=3, block=8)
    with pytest.raises(ShardedTrainError, match="unknown strategy"):
        train_sharded("expert", models, [], batches, world=2, optimizer=AdamW())
    with pytest.raises(ShardedTrainError, match="split evenly"):
        train_sharded("zero3", models, [], batches, world=2, optimizer=AdamW())
    with pytest.raises(ShardedTrainError, match="unknown pipeline schedule 'zb'"):
        train_sharded("pipeline", models, [], batches, world=2, optimizer=AdamW(), micro_batches=1, schedule="zb")


def test_a_process_failing_is_a_named_error(processes, gpt):
    module, batches, models, _ = gpt
    # raised inside the processes, first thing: no model with the batch dim symbolic to plan
    only_rows = ModelAt({4: models(None)})
    with pytest.raises(ShardedTrainError, match=r"process \d: ShardedTrainError: no model imported at None rows"):
        processes().train("zero3", only_rows, [], batches, optimizer=AdamW())


def _killed_in_rank_1(models: ModelAt, rows):
    """`models(rows)`, except in rank 1, which ends by a signal (as a crash in native code ends it)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return models(rows)


def test_a_process_dying_is_named_with_its_signal(processes, gpt):
    module, batches, models, _ = gpt
    # rank 0 then fails in a collective ("Connection reset by peer") or waits: either way the error
    # names the rank that died, and how
    with pytest.raises(ShardedTrainError, match=r"process 1 ended with exit code -9 \(SIGKILL\)"):
        processes().train("zero3", functools.partial(_killed_in_rank_1, models), [], batches, optimizer=AdamW(),
                          segments=functools.partial(char_gpt_segments, module, "zero3"))
