"""The `recompute` pass: values a training step keeps from its forward for its backward are
recomputed under a memory budget; the predicted peak falls, the NumPy backend's measured peak
with it, and the step computes the same numbers."""

from __future__ import annotations

from collections import Counter

import numpy as np

import tilegraph
from tests.models import char_batches, char_corpus, char_gpt
from tilegraph.ir import interpret
from tilegraph.ir.ops import Op
from tilegraph.ir.shapes import info_of
from tilegraph.passes.recompute import peak_bytes, recompute
from tilegraph.passes.registry import run_pipeline
from tilegraph.passes.remarks import collect
from tilegraph.testing import traced_peak
from tilegraph.train import build_gradients


def gradient_step(layers: int = 2, hidden: int = 128, batch: int = 4, block: int = 16):
    chars, batches = char_batches(char_corpus(), 1, batch, block)
    module = char_gpt(len(chars), layers, hidden, 2, block)
    model = tilegraph.import_model(module, example_inputs=(batches[0][0],))
    params = [n for n, _ in module.named_parameters()]
    step = run_pipeline(build_gradients(model, "cross_entropy", params), "canonicalize,cse,dce")
    x, y = batches[0]
    return step, [x.numpy(), y.numpy()] + [np.asarray(model.weights[p]) for p in params]


def measured_peak(model, inputs) -> int:
    """Bytes NumPy allocates at most during one call of the model's NumPy module, no passes."""
    compiled = tilegraph.compile(model, target="numpy", pipeline="")
    compiled.run(*inputs)
    return traced_peak(lambda: compiled.run(*inputs))


def test_recompute_lowers_the_predicted_and_the_measured_peak_and_keeps_the_numbers():
    step, inputs = gradient_step()
    before = peak_bytes(step.func.body.block)
    with collect() as remarks:
        smaller = run_pipeline(step.clone(), "recompute{budget=0.5}")
    after = peak_bytes(smaller.func.body.block)
    assert after < 0.95 * before
    assert any("recomputes tg." in str(r) for r in remarks)
    assert any("predicted peak of intermediates" in str(r) for r in remarks)
    assert len(smaller.ops()) > len(step.ops())
    # the same ops on the same values: the same numbers, exactly
    for a, b in zip(interpret(step, inputs), interpret(smaller, inputs)):
        np.testing.assert_array_equal(a, b)
    # the prediction is what the NumPy module holds, up to the temporaries inside its kernels
    measured_before, measured_after = measured_peak(step, inputs), measured_peak(smaller, inputs)
    assert measured_after < measured_before
    for predicted, measured in ((before, measured_before), (after, measured_after)):
        assert predicted <= measured <= 1.2 * predicted


def test_the_op_table_states_the_temporaries_numpys_kernels_hold():
    """`numpy_temporaries` is what the recompute pass prices while an op runs on NumPy: each kernel
    holds, at its peak, its result and that many result-sized arrays (up to a ufunc's buffer, 8192
    elements of at most 8 bytes, which NumPy allocates on its own);
    gelu holds erf's square and x / sqrt(2) (it held four before its passes were made in place)."""
    from tilegraph.ir import kernels as K
    from tilegraph.ir.ops import OPS

    x = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)
    runs = {Op.gelu: lambda: K.gelu(x, "none"), Op.erf: lambda: K.erf(x),
            Op.layer_norm: lambda: K.layer_norm(x, None, None, -1, 1e-5), Op.softmax: lambda: K.softmax(x, -1)}
    for op, run in runs.items():
        run()
        held = traced_peak(run)
        assert abs(held - (1 + OPS[op].numpy_temporaries) * x.nbytes) <= 8192 * 8, (op, held / x.nbytes)
    assert OPS[Op.gelu].numpy_temporaries == 2


def test_a_budget_already_met_changes_nothing():
    step, _ = gradient_step()
    text = step.text
    assert run_pipeline(step, "recompute{budget=1.0}").text == text


def test_whole_layers_are_recomputed_when_pointwise_ops_and_gemms_fall_short():
    """Activations dominate this step (4 layers, 256 tokens, hidden 32): recomputing pointwise ops and
    GEMMs alone (round 1) stops short of 50% of save-everything; rebuilding normalisations, splits
    and stretches of a layer from what is still live (round 2, as checkpointing) reaches it, the
    NumPy module's measured peak follows the prediction, and the numbers are the same."""
    step, inputs = gradient_step(layers=4, hidden=32, batch=8, block=32)
    before = peak_bytes(step.func.body.block)
    with collect() as shallow_remarks:
        shallow = run_pipeline(step.clone(), "recompute{budget=0.5 checkpoint=false}")
    assert "not reached" in str(shallow_remarks[-1])
    assert peak_bytes(shallow.func.body.block) > 0.5 * before
    with collect() as remarks:
        smaller = run_pipeline(step.clone(), "recompute{budget=0.5}")
    after = peak_bytes(smaller.func.body.block)
    assert after <= 0.5 * before, [str(r) for r in remarks]
    assert "not reached" not in str(remarks[-1])
    # round 2 rebuilt ops round 1 never recomputes: normalisations, reductions and splits (the heads'
    # q, k, v that attention's backward reads)
    never = (Op.layer_norm, Op.softmax, Op.reduce_sum, Op.reduce_mean, Op.reduce_max, Op.split)
    grew = Counter(getattr(o, "op_name", o.name) for o in smaller.ops())
    grew.subtract(Counter(getattr(o, "op_name", o.name) for o in step.ops()))
    assert any(grew[name] > 0 for name in never), grew
    rounded_once = Counter(getattr(o, "op_name", o.name) for o in shallow.ops())
    rounded_once.subtract(Counter(getattr(o, "op_name", o.name) for o in step.ops()))
    assert not any(rounded_once[name] > 0 for name in never), rounded_once
    for a, b in zip(interpret(step, inputs), interpret(smaller, inputs)):
        np.testing.assert_array_equal(a, b)
    # NumPy's attention kernel allocates temporaries the op table does not state (its scores, of
    # another shape than its result): once it is rebuilt near the backward's peak, the prediction
    # is a floor
    measured_before, measured_after = measured_peak(step, inputs), measured_peak(smaller, inputs)
    assert measured_after < 0.7 * measured_before
    assert before <= measured_before <= 1.2 * before
    assert after <= measured_after


def test_the_arena_layout_shares_bytes_only_between_buffers_apart_in_time():
    """ir/arena.py, the layout the C runtime allocates and the pass prices: buffers live at once
    never overlap in bytes, buffers apart in time share, every offset is aligned, and the arena is
    the highest end, at least the peak of the (aligned) bytes live at once."""
    from tilegraph.ir.arena import ALIGN, lay_out

    sizes = {"a": 1000, "b": 600, "c": 500, "d": 100, "e": 700}
    lifetimes = {"a": (0, 1), "b": (1, 3), "c": (2, 4), "d": (4, 5), "e": (5, 6)}
    offsets, total = lay_out(sizes, lifetimes)
    rounded = {k: -(-n // ALIGN) * ALIGN for k, n in sizes.items()}
    for x in sizes:
        assert offsets[x] % ALIGN == 0
        for y in sizes:
            apart = lifetimes[x][1] < lifetimes[y][0] or lifetimes[y][1] < lifetimes[x][0]
            if x < y and not apart:
                assert offsets[x] + rounded[x] <= offsets[y] or offsets[y] + rounded[y] <= offsets[x], (x, y)
    assert offsets["e"] == 0  # after a's and b's time: their bytes again
    live = max(sum(rounded[k] for k, (s, t) in lifetimes.items() if s <= i <= t) for i in range(7))
    assert total == max(offsets[k] + rounded[k] for k in sizes) >= live


def test_the_floor_is_below_every_budget_the_pass_reaches_and_above_the_gradients():
    """The floor the final remark prints: no recomputation of this step goes below it (a 5% budget
    stops above it), and a step's gradients, kept to its end, are part of it."""
    step, _ = gradient_step(layers=2, hidden=32, batch=4, block=16)
    with collect() as remarks:
        result = recompute(step.clone().func.body.block, 0.05)
    floor, (_, live_after) = result["floor"], result["live"]
    assert "not reached" in str(remarks[-1]) and f"floor {floor / 1e6:.3f} MB" in str(remarks[-1])
    grads = sum(4 * int(np.prod(info_of(v.type).shape)) for v in step.func.body.block.last_op.operands[1:])
    assert grads < floor <= live_after


def test_fuse_groups_every_clone_of_a_step_alike():
    """Fusion decides by predicted savings, and equal savings (two identical layers) fall to the
    order candidates were found in: that order is the program's, never object addresses, so the
    recompute pass prices a step the same each time it fuses a clone of it."""
    step, _ = gradient_step(layers=2, hidden=32, batch=4, block=32)
    fused = {str(run_pipeline(step.clone(), "fuse{hardware=c}")) for _ in range(4)}
    assert len(fused) == 1


def test_on_c_the_budget_is_of_the_arena_the_emitted_step_holds():
    """`recompute{hardware=c}` prices the step as the C backend runs it (fused, its emitter's buffers,
    the runtime's arena layout, the outputs' arrays): the compiled module's arena plus what a warm call
    allocates is within 10% of the prediction, and the budget is met in those bytes."""
    import tilegraph.backends.c  # noqa: F401  (registers the C backend's layout)
    from tilegraph.passes.recompute import priced_bytes

    step, inputs = gradient_step(layers=2, hidden=32, batch=4, block=32)
    with collect() as remarks:
        smaller = run_pipeline(step.clone(), "recompute{budget=0.7 hardware=c}")
    assert "not reached" not in str(remarks[-1]), str(remarks[-1])
    reference, predicted = priced_bytes(step.func.body.block, "c"), priced_bytes(smaller.func.body.block, "c")
    assert predicted <= 0.7 * reference, (predicted, reference)
    assert priced_bytes(smaller.func.body.block, "c") == predicted  # a step prices the same each time
    # the live-bytes model alone misses what the emitter adds (buffers inside fused groups, the
    # outputs copied out of the arena)
    assert predicted > 1.1 * peak_bytes(smaller.func.body.block, kernels=False)
    compiled = tilegraph.compile(smaller, target="c", pipeline="fuse{hardware=c},tile{hardware=c}", threads=1)
    compiled.run(*inputs)
    arena = sum(b.arena_bytes for b in compiled._runner._bindings.values())
    measured = arena + traced_peak(lambda: compiled.run(*inputs))
    assert abs(measured / predicted - 1) <= 0.1, (measured, predicted)
