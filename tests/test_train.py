"""tilegraph.train_step: forward, loss, backward and optimizer in one compiled program, weights
and optimizer state updated in place, against torch eager's training from the same start."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import tilegraph
from tests.models import CharGPT, char_batches, char_corpus, char_gpt
from tilegraph.ir import Model
from tilegraph.ir.ops import Op
from tilegraph.testing import PEER_RELATIVE_ERROR, relative_error
from tilegraph.train import SGD, AdamW, TrainError


def torch_losses(module, batches, optimizer, clip_norm=None):
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        logits = module(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip_norm)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("target", ["numpy", "c"])
def test_a_char_gpt_learns_as_torch_eager_does(target):
    chars, batches = char_batches(char_corpus(), steps=10, batch=4, block=16)
    torch.manual_seed(0)
    module = CharGPT(len(chars), layers=1, hidden=32, heads=2, block=16)
    reference = copy.deepcopy(module)
    step = tilegraph.train_step(module, "cross_entropy", AdamW(lr=1e-2, weight_decay=0.1),
                                example_inputs=(batches[0][0],), clip_norm=1.0, target=target)
    before = {k: v for k, v in step.weights.items()}
    if target == "c":
        runner = step.compiled._runner
        # the fast paths: every weight and moment updated where it lies (no copy back), and the
        # whole step native, the embeddings' scatter-added gradients included (no host step per call)
        assert len(runner._donated) == len(step.weights) + len(step.state)
        assert [s.comment for s in runner.program.steps if s.host_op is not None and not s.once] == []
    ours = [step(x, targets=y) for x, y in batches]
    theirs = torch_losses(reference, batches, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1),
                          clip_norm=1.0)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= PEER_RELATIVE_ERROR * abs(b), f"step {i}: {a} vs torch {b}"
    assert ours[-1] < ours[0] - 0.5
    # in place: the same arrays, now holding torch's trained weights, to each tensor's scale. The
    # key bias is left out: its gradient is zero but for rounding in both (a constant added to
    # every score of a row), and AdamW's m / sqrt(v) turns that noise into steps of lr's size,
    # different in each and with torch's thread count (it reached 1.1e-3 of the scale at one thread)
    hidden = module.blocks[0].qkv.bias.shape[0] // 3
    for name, p in reference.named_parameters():
        assert step.weights[name] is before[name]
        ours, theirs = step.weights[name], p.detach().numpy()
        if name.endswith("qkv.bias"):
            ours, theirs = (np.delete(t, np.s_[hidden:2 * hidden]) for t in (ours, theirs))
        assert relative_error(ours, theirs) <= 1e-3, name


def test_sgd_with_momentum_weight_decay_and_nesterov_matches_torch():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    reference = copy.deepcopy(module)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(6)]
    opt = SGD(lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True)
    step = tilegraph.train_step(module, "cross_entropy", opt, example_inputs=(batches[0][0],), target="numpy")
    ours = [step(x, targets=y) for x, y in batches]
    theirs = torch_losses(reference, batches, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9,
                                                              weight_decay=1e-2, nesterov=True))
    np.testing.assert_allclose(ours, theirs, rtol=PEER_RELATIVE_ERROR)


def test_the_step_marks_what_it_updates_in_place():
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    step = tilegraph.train_step(module, "cross_entropy", AdamW(), example_inputs=(torch.randn(2, 4),), target="numpy")
    ins, outs = step.model.input_names, step.model.output_names
    donated = {ins[i]: outs[r] for i, r in step.model.aliases.items()}
    # every weight and moment is donated to the result of its name; the data and the loss are not
    assert donated == {n: n for n in ("weight", "bias", "exp_avg.weight", "exp_avg.bias", "exp_avg_sq.weight",
                                      "exp_avg_sq.bias")}
    assert outs[0] == "loss"


def test_bad_requests_are_named_errors():
    module = torch.nn.Linear(4, 3)
    x = (torch.randn(2, 4),)
    with pytest.raises(TrainError, match="unknown loss 'hinge'"):
        tilegraph.train_step(module, "hinge", example_inputs=x, target="numpy")
    with pytest.raises(TrainError, match="optimizer must be"):
        tilegraph.train_step(module, optimizer=torch.optim.SGD, example_inputs=x, target="numpy")
    with pytest.raises(TrainError, match="no weight named nope"):
        tilegraph.train_step(module, params=["nope"], example_inputs=x, target="numpy")


def test_data_parallelism_on_two_processes_trains_as_one_process_does():
    """Two gloo processes, each half of every batch, gradients all-reduced: the loss at each step is
    the one-process step's on the whole batch."""
    import functools

    from tilegraph.train import train_data_parallel

    chars, batches = char_batches(char_corpus(), steps=5, batch=4, block=16)
    module = char_gpt(len(chars), 1, 32, 2, 16)
    optimizer = AdamW(lr=1e-2, weight_decay=0.1)
    one = tilegraph.train_step(module, "cross_entropy", optimizer, example_inputs=(batches[0][0],), clip_norm=1.0,
                               target="numpy", pipeline="")
    alone = [one(x, targets=y) for x, y in batches]
    # the processes get the model as tg IR at their half of the batch (no torch.export in each), and
    # compile with no passes: each compiles two modules, and fusion's search is what costs there
    half = tilegraph.import_model(module, example_inputs=(batches[0][0][:2],))
    make = functools.partial(Model.parse, half.text, dict(half.weights))
    result = train_data_parallel(make, batches, world=2, optimizer=optimizer, clip_norm=1.0, target="numpy",
                                 pipeline="")
    np.testing.assert_allclose(result["losses"], alone, rtol=PEER_RELATIVE_ERROR)
    assert len(result["seconds"]) == len(batches)


def test_a_builder_model_trains_one_sgd_step_by_its_own_gradient():
    from tilegraph.ir import Graph, interpret
    from tilegraph.train import build_gradients

    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (6, 3))
    w = g.weight("w", rng.standard_normal((3, 4)).astype(np.float32))
    model = g.build(g.tanh(x @ w) * 2.0, names=["logits"])
    xs = rng.standard_normal((6, 3)).astype(np.float32)
    ys = rng.integers(0, 4, 6)
    grads = build_gradients(model, "cross_entropy", ["w"])
    loss, gw = interpret(grads, [xs, ys, model.weights["w"]])
    step = tilegraph.train_step(model, "cross_entropy", SGD(lr=0.5), target="numpy")
    assert abs(step(xs, targets=ys) - loss) <= PEER_RELATIVE_ERROR * abs(loss)
    np.testing.assert_allclose(step.weights["w"], model.weights["w"] - 0.5 * gw, rtol=PEER_RELATIVE_ERROR, atol=1e-6)


def test_cross_entropy_gradient_does_not_differentiate_the_max_shift():
    """The loss does not depend on logsumexp's max shift: the backward takes (softmax - one_hot) /
    rows from the logits and each row's logsumexp, one exp per logit, and never the shift's
    gradient (a reduce_max VJP's tie mask `eq(x, max)`); the gradient matches the float64
    interpreter's and central differences of the loss."""
    from tilegraph.ir import Graph, interpret
    from tilegraph.ir.ops import Op
    from tilegraph.ir.shapes import info_of
    from tilegraph.testing import tolerance
    from tilegraph.train import build_gradients

    rng = np.random.default_rng(1)
    g = Graph()
    x = g.input("x", (5, 3))
    w = g.weight("w", rng.standard_normal((3, 7)).astype(np.float32))
    model = g.build(x @ w, names=["logits"])
    grads = build_gradients(model, "cross_entropy", ["w"])
    ops = [op for op in grads.ops() if hasattr(op, "op_name")]
    wide = [op for op in ops if op.results and tuple(info_of(op.results[0].type).shape) == (5, 7)]
    assert sum(op.op_name == Op.exp for op in wide) == 2  # the forward's sum of exps, the backward's softmax
    assert sum(op.op_name == Op.reduce_max for op in ops) == 1
    maxed = {op.results[0] for op in ops if op.op_name == Op.reduce_max}
    assert not [op for op in ops if op.op_name == Op.eq and set(op.operands) & maxed]
    xs = rng.standard_normal((5, 3)).astype(np.float32)
    ys = np.array([0, 6, -1, 3, 3])  # a negative target counts from the end, as the forward's gather does
    loss, gw = interpret(grads, [xs, ys, model.weights["w"]])
    w64 = model.weights["w"].astype(np.float64)

    def reference(wv):
        z = xs.astype(np.float64) @ wv
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        return float(np.mean(lse - z[np.arange(5), ys]))

    rtol, _ = tolerance("f32", 7)
    assert abs(loss - reference(w64)) <= rtol * abs(reference(w64))
    h, fd = 1e-6, np.zeros_like(w64)
    for i in np.ndindex(*w64.shape):
        d = np.zeros_like(w64)
        d[i] = h
        fd[i] = (reference(w64 + d) - reference(w64 - d)) / (2 * h)
    assert relative_error(gw, fd) <= rtol


@pytest.mark.parametrize("target", ["interpreter", "numpy", "c"])
def test_dropout_backward_recomputes_the_forward_mask(target):
    """tg.dropout's mask is a pure function of (seed, site, index): the VJP is the same dropout
    of the cotangent, so the backward drops exactly the elements the forward dropped (its zeros
    where the forward's are), without a saved mask; other seeds and sites draw other masks."""
    from tilegraph.ir import Graph, interpret
    from tilegraph.ir.autodiff import vjp
    from tilegraph.ir.kernels import dropout_keep
    from tilegraph.ir.ops import Op

    p = 0.3
    g = Graph()
    x, seed = g.input("x", (6, 40)), g.input("seed", (), "i64")
    model = vjp(g.build(g.op("dropout", x, seed, p=p, site=2) * 3.0, names=["y"]), wrt=["x"])
    assert sum(op.op_name == Op.dropout for op in model.ops() if hasattr(op, "op_name")) == 2
    rng = np.random.default_rng(0)
    xs = rng.uniform(0.5, 2.0, (6, 40)).astype(np.float32)
    ones = np.ones((6, 40), np.float32)
    if target == "interpreter":
        run = lambda s: interpret(model, [xs, np.int64(s), ones])  # noqa: E731
    else:
        compiled = tilegraph.compile(model, target=target)
        if target == "c":  # the fast path: both dropouts are C loops, no host step
            assert [s.comment for s in compiled._runner.program.steps if s.host_op is not None] == []
        run = lambda s: compiled.run(xs, np.int64(s), ones)  # noqa: E731
    y, gx = (np.asarray(v, np.float64) for v in run(7))
    keep = dropout_keep(7, 2, p, (6, 40))
    assert np.array_equal(y != 0, keep) and np.array_equal(gx != 0, keep)
    np.testing.assert_allclose(gx[keep], 3.0 / (1 - p), rtol=1e-6)
    reference, _ = interpret(model, [xs, np.int64(7), ones])
    tilegraph.testing.assert_close(y, reference, "f32")
    assert 0.55 < keep.mean() < 0.85
    assert not np.array_equal(np.asarray(run(8)[0]) != 0, keep)
    assert not np.array_equal(dropout_keep(7, 3, p, (6, 40)), keep)


def test_torch_dropout_in_a_training_step_is_seeded_and_its_gradient_matches_torch():
    """nn.Dropout in training mode becomes tg.dropout seeded per step (seed + step number): one
    SGD step equals torch's on the same mask (torch multiplying by tg's mask), and an eval-mode
    module trains without dropout."""
    from tilegraph.ir.kernels import dropout_keep
    from tilegraph.ir.ops import Op

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.4), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    reference = copy.deepcopy(module)
    x, y = torch.randn(12, 8), torch.randint(0, 5, (12,))
    step = tilegraph.train_step(module, "cross_entropy", SGD(lr=0.5), example_inputs=(x,), target="c", seed=41)
    ops = [op for op in step.model.ops() if hasattr(op, "op_name") and op.op_name == Op.dropout]
    assert len(ops) == 2 and {op.attr("site") for op in ops} == {0}  # forward and backward, one site
    loss = step(x, targets=y)
    mask = torch.from_numpy(dropout_keep(42, 0, 0.4, (12, 16)).astype(np.float32))  # seed 41 + step 1
    h = reference[0](x) * mask / 0.6
    out = reference[3](torch.relu(h))
    expected = torch.nn.functional.cross_entropy(out, y)
    expected.backward()
    assert abs(loss - float(expected.detach())) <= PEER_RELATIVE_ERROR * float(expected.detach())
    for name, p_ in reference.named_parameters():
        want = (p_ - 0.5 * p_.grad).detach().numpy()
        assert relative_error(step.weights[name], want) <= PEER_RELATIVE_ERROR, name
    module.eval()
    plain = tilegraph.train_step(module, "cross_entropy", SGD(lr=0.5), example_inputs=(x,), target="numpy")
    assert not [op for op in plain.model.ops() if hasattr(op, "op_name") and op.op_name == Op.dropout]


def test_bias_gradients_run_in_their_weight_gradient_gemm_steps_on_c():
    """Each Linear's bias gradient (the column sum of dY) runs in the step of its weight
    gradient's GEMM (X^T dY), no step of its own, and every gradient matches the float64
    interpreter at f32's tolerance; with the fusion off, the sums are steps of their own."""
    from tilegraph.backends.c.groups import BIAS_GRADIENT, Groups
    from tilegraph.testing import reduction_length
    from tilegraph.ir import interpret
    from tilegraph.train import build_gradients

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 16),
                                 torch.nn.Tanh(), torch.nn.Linear(16, 8))
    x = torch.randn(3, 10, 24)
    params = [n for n, _ in module.named_parameters()]
    model = build_gradients(tilegraph.import_model(module, example_inputs=(x,)), "cross_entropy", params)
    targets = np.random.default_rng(1).integers(0, 8, (3, 10))
    inputs = [x.numpy(), targets] + [p.detach().numpy() for p in module.parameters()]
    reference = interpret(model, inputs)

    def steps(compiled, bias_in_gemm: bool) -> list[str]:
        return [s.comment for s in compiled._runner.program.steps if (s.comment.endswith(BIAS_GRADIENT) if
                                                                       bias_in_gemm else
                                                                       s.comment.startswith("reduce_sum -> f32(1, 1, "))]

    compiled = tilegraph.compile(model, target="c")
    assert len(steps(compiled, True)) == 3 and steps(compiled, False) == []
    assert [s.comment for s in compiled._runner.program.steps if s.host_op is not None] == []
    for name, got, want in zip(model.output_names, compiled.run(*inputs), reference):
        tilegraph.testing.assert_close(got, want, "f32", reduction_length(model), name=name)
    try:
        Groups.bias_in_gemm = False
        plain = tilegraph.compile(model, target="c")
    finally:
        Groups.bias_in_gemm = True
    assert steps(plain, True) == [] and len(steps(plain, False)) == 3


def _lm_head(vocab: int = 50257):
    """An LM head's gradients under cross-entropy (rows 2 x 3, width 8) compiled for C, and inputs."""
    from tilegraph.train import build_gradients

    torch.manual_seed(0)
    module = torch.nn.Linear(8, vocab, bias=False)
    x = torch.randn(2, 3, 8)
    model = build_gradients(tilegraph.import_model(module, example_inputs=(x,)), "cross_entropy", ["weight"])
    targets = np.array([[0, vocab - 1, 7], [3, 3, vocab // 4]])
    return model, tilegraph.compile(model, target="c"), [x.numpy(), targets, module.weight.detach().numpy()]


def _matches_the_interpreter(model, compiled, inputs) -> None:
    from tilegraph.ir import interpret
    from tilegraph.testing import reduction_length

    for name, got, want in zip(model.output_names, compiled.run(*inputs), interpret(model, inputs)):
        tilegraph.testing.assert_close(got, want, "f32", reduction_length(model), name=name)


def test_cross_entropy_backward_over_the_logits_is_one_pass_on_c():
    """Cross-entropy's backward, (softmax - one_hot) * dloss over every logit beside each row's
    loss, is one fused step on C, one pass over the logits whose rows are too wide for a row op
    (an LM head's 50257), not a pass per op, its one-hot a select the compiler vectorises; the loss
    and gradient match the float64 interpreter."""
    vocab = 50257
    model, compiled, inputs = _lm_head(vocab)
    steps = compiled._runner.program.steps
    wide = [s.comment for s in steps if not s.comment.startswith("fusion") and f", {vocab})" in s.comment
            and not s.comment.startswith("matmul")]
    assert wide == [], wide  # no elementwise op over the logits runs as a step of its own
    backward = [s.comment for s in steps if s.comment.startswith("fusion elementwise") and "exp" in s.comment]
    assert len(backward) == 1 and all(op in backward[0] for op in ("eq", "cast", "mul")), backward
    assert "? (float)1 : (float)0)" in compiled.source and "((float)(e" not in compiled.source
    assert all(s.host_op is None for s in steps)
    _matches_the_interpreter(model, compiled, inputs)


def test_an_lm_heads_logsumexp_is_one_pass_over_the_logits_rows_on_c():
    """The loss's logsumexp (each row's max, then the sum of exp(logit - max)) after the LM head's
    GEMM: the group yields the logits, the max and the sum, never the exp, so it is one pass over
    the rows while each stays in cache, not an op per pass over memory writing two more
    logit-sized buffers (the width read off the values inside, not off the yields)."""
    model, compiled, inputs = _lm_head()
    head = [s for s in compiled._runner.program.steps if "reduce_max" in s.comment and s.comment.startswith("fusion")]
    assert len(head) == 1, [s.comment for s in compiled._runner.program.steps]
    assert len(head[0].writes) == 3, head[0].comment  # the logits, each row's max and its sum: nothing between
    _matches_the_interpreter(model, compiled, inputs)


def test_a_gemm_with_a_vocabulary_long_dim_runs_on_sgemm():
    """A GEMM with nothing fused into it and a dim as long as a vocabulary (the LM head's logits,
    N = 50257, and its weight gradient, M = 50257) runs on oneDNN's sgemm, which blocks the long
    dim, not on its matmul primitive (runtime.c, tg_long_gemm); a short one stays on the primitive.
    Both match the float64 interpreter."""
    for vocab, on_sgemm in ((50257, 2), (40, 0)):
        model, compiled, inputs = _lm_head(vocab)
        _matches_the_interpreter(model, compiled, inputs)
        assert sum("source: sgemm" in line for line in compiled.primitives) == on_sgemm, compiled.primitives


def test_a_layer_norm_after_a_gemm_and_what_its_backward_saves_are_one_pass_over_the_rows_on_c():
    """A residual block's GEMM, residual add and layer_norm, beside the mean, centred input and
    variance the backward saves (one group): the layer norm a row op, the rest one pass over the
    rows, not a pass over memory per op, so the step writes the group's results and the GEMM's
    own and no intermediate; the gradients match the float64 interpreter."""
    from tilegraph.train import build_gradients

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln = torch.nn.Linear(256, 256), torch.nn.LayerNorm(256)

        def forward(self, x):
            return self.ln(x + self.fc(x))

    torch.manual_seed(0)
    module, x = Block(), torch.randn(4, 64, 256)
    model = build_gradients(tilegraph.import_model(module, example_inputs=(x,)), "mean",
                            ["fc.weight", "fc.bias", "ln.weight", "ln.bias"])
    compiled = tilegraph.compile(model, target="c")
    block = [s for s in compiled._runner.program.steps if "matmul, add, add, layer_norm, reduce_mean" in s.comment]
    assert len(block) == 1, [s.comment for s in compiled._runner.program.steps]
    assert len(block[0].writes) <= len(block[0].kernel.results) + 1, block[0].comment
    params = dict(module.named_parameters())
    inputs = [x.numpy() if n == "x" else params[n].detach().numpy() for n in model.input_names]
    _matches_the_interpreter(model, compiled, inputs)


def test_a_linear_weight_gradient_is_made_in_the_weight_layout():
    """A Linear's weight is kept as [out, in] and read transposed: its gradient GEMM writes
    dY^T @ X as [out, in] too, so the optimizer reads it row by row, not (X^T @ dY) down its
    columns; on C the gradients match torch autograd's."""
    from tilegraph.ir.ops import Op
    from tilegraph.testing import reduction_length
    from tilegraph.train import build_gradients

    torch.manual_seed(0)
    module = torch.nn.Linear(8, 40)
    x, y = torch.randn(2, 3, 8), torch.randint(0, 40, (2, 3))
    model = build_gradients(tilegraph.import_model(module, example_inputs=(x,)), "cross_entropy",
                            ["weight", "bias"])
    compiled = tilegraph.compile(model, target="c")
    products = [tuple(op.result_infos()[0].shape) for op in compiled.model.module.walk()
                if getattr(op, "op_name", None) == Op.matmul]
    assert (40, 8) in products and (8, 40) not in products, products
    torch.nn.functional.cross_entropy(module(x).reshape(-1, 40), y.reshape(-1)).backward()
    got = dict(zip(model.output_names, compiled.run(x.numpy(), y.numpy(), *(p.detach().numpy() for p in
                                                                           module.parameters()))))
    grads = [n for n in model.output_names if "weight" in n]
    assert len(grads) == 1, model.output_names
    tilegraph.testing.assert_close(got[grads[0]], module.weight.grad.numpy(), "f32", reduction_length(model))


def _two_linears_one_c_step(hidden: int, lr: float):
    """Linear(24, hidden), GELU, Linear(hidden, 16): one AdamW step on C, its weights checked
    against torch's AdamW from the same start."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(24, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 16))
    x, y = torch.randn(4, 16, 24), torch.randint(0, 16, (4, 16))
    step = tilegraph.train_step(copy.deepcopy(module), "cross_entropy", AdamW(lr=lr, weight_decay=0.1),
                                example_inputs=(x,), target="c")
    step(x, targets=y)
    reference = copy.deepcopy(module)
    torch_losses(reference, [(x, y)], torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.1))
    for name, p in reference.named_parameters():
        assert relative_error(step.weights[name], p.detach().numpy()) < PEER_RELATIVE_ERROR, name
    return step


def test_linear_layers_train_as_2d_gemms_with_the_bias_as_post_op_on_c():
    """A training step's Linear layers (weights are inputs there, not constants): each forward
    GEMM is one 2-D GEMM over all rows, its bias added by oneDNN's post-op, not a batched GEMM
    and a pass of its own; one step's weights match torch's AdamW."""
    step = _two_linears_one_c_step(40, 1e-2)
    sources = {p.split(" source: ")[0].rsplit(" ", 1)[-1] for p in step.compiled.primitives}
    assert {"64x24", "64x40"} <= sources, sources  # forward: all 64 rows at once
    assert not any(s.count("x") > 1 for s in sources) and step.compiled.reference_kernels == []
    assert "{1, " in step.compiled.source  # a binary post-op: the bias added by the forward GEMM


def test_a_gemm_operand_passed_each_run_with_rows_4kib_apart_is_repacked_on_c():
    """A GEMM's B that the step passes each run (a weight, a gradient) lying row-major with its
    rows a multiple of 4 KiB apart is reordered each run into the blocked layout oneDNN asks for,
    not read in place (its rows would share a few L1 sets). Here the second Linear's input
    gradient (dY @ W, W 16 x 1024) and the first's weight gradient (X^T dY, dY 64 x 1024); the
    forward GEMMs read their weights transposed and stay as they are. One step's weights match
    torch's AdamW (at lr 1e-3: the first step moves each weight by about lr times its gradient's
    sign, and at 1e-2 rounding flips enough small gradients to differ by 1.6e-4 with or without it)."""
    step = _two_linears_one_c_step(1024, 1e-3)
    repacked = [p for p in step.compiled.primitives if p.endswith("(its B reordered each run)")]
    assert len(repacked) >= 2, step.compiled.primitives
    assert step.compiled.reference_kernels == []
    assert all("brg" in p.split(" source: ")[-1] for p in repacked), repacked


def test_a_b_repacked_each_run_lies_in_the_arena_the_memory_plan_counts_on_c():
    """The per-run copy of such a B lies in the binding's arena, reserved by the emitter for
    that step alone (so copies of different steps share bytes), not in a buffer each primitive
    keeps for itself: the arena the memory plan prices (call_bytes) is the arena the binding
    holds, and no primitive holds reorder scratch outside it."""
    from tilegraph.backends.c.runtime import call_bytes

    step = _two_linears_one_c_step(1024, 1e-3)
    runner = step.compiled._runner
    assert sum(p.endswith("(its B reordered each run)") for p in runner.primitives) >= 2
    assert runner.scratch_bytes() == 0
    program = runner.program
    reserved = [line for s in program.steps for line in s.lines or () if "tg_prim_scratch(" in line]
    assert len(reserved) >= 2, reserved
    (binding,) = runner._bindings.values()
    assert call_bytes(program)[0] == binding.arena_bytes


def test_bf16_training_keeps_f32_master_weights_and_its_loss_tracks_f32():
    """precision="bf16" on C: every GEMM of the step (forward and backward) multiplies in bf16 on
    the processor's bf16 units, accumulating in f32, while the weights, the AdamW moments and the
    update stay f32 (the master copy; bf16's exponent range is f32's, so no loss scaling). Its
    loss at every step is within bf16's tolerance of the f32 step's, differs from it (the
    products were rounded), and falls as f32's does."""
    from tilegraph.testing import reduction_length, tolerance

    chars, batches = char_batches(char_corpus(), steps=15, batch=4, block=16)
    losses, steps = {}, {}
    for precision in ("f32", "bf16"):
        step = tilegraph.train_step(char_gpt(len(chars), 1, 32, 2, 16), "cross_entropy",
                                    AdamW(lr=3e-3, weight_decay=0.1), example_inputs=(batches[0][0],), clip_norm=1.0,
                                    target="c", precision=precision)
        losses[precision] = np.array([step(x, targets=y) for x, y in batches])
        steps[precision] = step
    runner = steps["bf16"].compiled._runner
    if not runner._lib.tg_bf16_supported():
        pytest.skip("this processor has no bf16 dot products: the module runs f32")
    assert runner.precision == "bf16" and runner.primitives
    # (the attention backward's batched GEMMs over (batch, head) are the ones oneDNN keeps in f32)
    units = {line: "amx" in line.split(" source: ")[-1] or "bf16" in line.split(" source: ")[-1]
             for line in runner.primitives}
    if runner._lib.tg_amx_supported():
        assert all(bf16 for line, bf16 in units.items() if line.split(" source: ")[0].count("x") < 3), units
        assert sum(units.values()) >= 4, units  # distinct primitives: forward, dX and dW GEMMs
    else:
        # A step's weights are its inputs, multiplied as f32 operands with bf16 products (oneDNN's
        # fpmath mode), which oneDNN's kernels take on AMX only: elsewhere f32 kernels, none a reference one.
        assert not any(line.split(" source: ")[-1].startswith("ref") for line in units), units
    assert all(w.dtype == np.float32 for w in {**steps["bf16"].weights, **steps["bf16"].state}.values())
    rtol, _ = tolerance("bf16", reduction_length(steps["f32"].model))
    f32, bf16 = losses["f32"], losses["bf16"]
    assert np.all(np.abs(bf16 - f32) <= rtol * np.abs(f32)), (f32, bf16)
    assert not np.array_equal(f32, bf16)
    assert bf16[-3:].mean() < bf16[:3].mean() - 0.3 and f32[-3:].mean() < f32[:3].mean() - 0.3


def test_a_bert_training_step_on_c_folds_its_attention_and_matches_torch():
    """BERT's eager attention (matmul, scale, float mask added, softmax, matmul) is folded into
    tg.attention before autodiff on the C target: the step's backward is one attention_grad per
    layer, run by its kernel (the counter moves), and one SGD step from the same start, with
    padded rows, leaves the weights where torch's leaves them."""
    import ctypes

    from transformers import BertConfig, BertModel

    from tests.models import MiniLM

    class Weighted(torch.nn.Module):  # the mean of a LayerNorm's output is 0: weighed, it is a loss
        def __init__(self, m):
            super().__init__()
            self.m = m
            self.register_buffer("w", torch.randn(16, 32, generator=torch.Generator().manual_seed(2)))

        def forward(self, ids, mask):
            return self.m(ids, mask) * self.w

    torch.manual_seed(0)
    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
    module = Weighted(MiniLM(BertModel(config, add_pooling_layer=False).eval()))
    ids = torch.randint(1, 60, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 16, dtype=torch.int64)
    mask[1, 11:] = mask[2, 5:] = 0
    reference = copy.deepcopy(module)
    step = tilegraph.train_step(module, "mean", SGD(lr=0.5), example_inputs=(ids, mask), target="c")
    assert sum(getattr(op, "op_name", None) == Op.attention_grad for op in step.model.ops()) == 2
    lib = step.compiled._runner._lib
    lib.tg_attention_backward_count.restype = ctypes.c_int
    before = lib.tg_attention_backward_count()
    loss = step(ids, mask)
    assert lib.tg_attention_backward_count() == before + 2
    out = reference(ids, mask).mean()
    out.backward()
    assert abs(loss - out.item()) <= PEER_RELATIVE_ERROR * abs(out.item())
    for name, p in reference.named_parameters():
        if name not in step.weights:
            continue
        if name.endswith("self.key.bias"):
            # a constant added to a row's scores: its gradient is zero but for rounding on both
            # sides, so the bias (initialised to 0) stays at rounding's size, not relative to torch's
            assert not p.detach().any() and np.abs(step.weights[name]).max() <= PEER_RELATIVE_ERROR, name
            continue
        assert relative_error(step.weights[name], (p - 0.5 * p.grad).detach().numpy()) <= PEER_RELATIVE_ERROR, name
