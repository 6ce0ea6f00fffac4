"""Reverse-mode autodiff (ir/autodiff.py, ir/vjp.py): every op's VJP against float64 finite
differences, on each op's examples and on random graphs, and whole models' parameter
gradients against torch.autograd."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, currently_in_test_context, given, settings
from hypothesis import strategies as st

from tilegraph.ir import Graph, Model, dtypes, interpret
from tilegraph.ir import autodiff, vjp
from tilegraph.ir.autodiff import NotDifferentiable
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.model import ModelError, WeightStore
from tilegraph.ir.ops import OPS, Op
from tilegraph.ir.shapes import info_of
from tilegraph.testing import (ALL_OPS, PEER_RELATIVE_ERROR, graphs, op_examples, random_inputs, reduction_length,
                               relative_error, tolerance)

# Central differences in float64 with this step: truncation ~h^2 |f'''| and rounding
# ~2^-53 |f| / h, both below 1e-9 of the scale for the bounded values the generator draws,
# far inside float32's tolerance, the one the check uses.
STEP = 1e-6


def test_every_op_has_a_vjp_or_a_stated_reason():
    assert vjp.missing() == [], f"ops with neither a VJP nor a reason in ir/vjp.py NO_GRADIENT: {vjp.missing()}"
    assert not set(vjp.VJPS) & set(vjp.NO_GRADIENT)


def test_a_rule_for_an_op_the_table_lacks_fails_at_registration():
    with pytest.raises(KeyError, match="no op 'softmx'"):
        vjp.vjp("softmx")
    with pytest.raises(KeyError, match="already has a rule"):
        vjp.vjp("add")


def as_float64(model: Model) -> Model:
    """The same graph in f64 (finite differences need perturbations f32 inputs would round away)."""
    text = re.sub(r"\bf32\b", "f64", model.text)
    text = re.sub(r"(\d|x|<)f32>", r"\1f64>", text)
    weights = WeightStore({k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in
                           model.weights.items()})
    m = Model.parse(text, weights)
    m.verify()
    return m


def check_against_finite_differences(model: Model, inputs, seed: int = 0) -> None:
    """<vjp(cotangent), direction> against the central difference of <f(x + h d), cotangent>,
    for random cotangents and directions over every float input and weight."""
    model = as_float64(model)
    inputs = [np.asarray(a, np.float64) if np.asarray(a).dtype.kind == "f" else np.asarray(a) for a in inputs]
    rng = np.random.default_rng(seed)
    float_inputs = [n for n, t in zip(model.input_names, model.inputs) if t.dtype == "f64"]
    # Values only compared (the generator's eq/ne between exactly equal weights) are left still:
    # moving them moves where a comparison flips, which is no derivative.
    compared = {name for name in float_inputs + autodiff.float_weights(model) if _only_compared(model, name)}
    wrt = [n for n in float_inputs + autodiff.float_weights(model) if n not in compared]
    if not wrt:
        return
    outs = interpret(model, inputs)
    float_outs = [i for i, t in enumerate(model.outputs) if dtypes.is_float(t.dtype)]
    cots = [rng.standard_normal(np.shape(outs[i])) for i in float_outs]
    vm = autodiff.vjp(model, wrt)
    grads = interpret(vm, inputs + cots)[len(outs):]
    dirs = {n: rng.standard_normal(np.shape(g)) for n, g in zip(wrt, grads)}

    def objective(t: float) -> tuple[float, list[np.ndarray]]:
        """<f(x + t d), cotangent>, and the values of the ops that jump (_discrete) on the way."""
        moved = [a + t * dirs[n] if n in dirs else a for n, a in zip(model.input_names, inputs)]
        m = Model(model.module, WeightStore({k: (v + t * dirs[k] if k in dirs else v)
                                             for k, v in model.weights.items()}))
        values: dict = {}
        ys = interpret(m, moved, values=values)
        return float(sum(np.sum(ys[i] * c) for i, c in zip(float_outs, cots))), [values[r] for r in jumps]

    jumps = [r for op in model.ops() if _discrete(op) for r in op.results]
    (ahead, at_ahead), (behind, at_behind) = objective(STEP), objective(-STEP)
    if currently_in_test_context() and any(not np.array_equal(a, b) for a, b in zip(at_ahead, at_behind)):
        # a random point within STEP of a comparison's threshold (or a rounding's): the difference
        # may span a jump, where no derivative is; the graph is drawn again (an op's own examples
        # are fixed points, chosen off their jumps: a tie that topk's indices swap moves no value)
        assume(False)
    fd = (ahead - behind) / (2 * STEP)
    terms = [np.asarray(g) * dirs[n] for n, g in zip(wrt, grads)]
    analytic = float(sum(np.sum(t) for t in terms))
    scale = max(1.0, float(sum(np.sum(np.abs(t)) for t in terms)))
    rtol, _ = tolerance("f32", reduction_length(model))
    assert abs(analytic - fd) <= rtol * scale, f"VJP {analytic} vs finite differences {fd} (scale {scale})\n{model}"


def _discrete(op) -> bool:
    """Whether `op` can jump as its float operands move: an integer or boolean result of float
    operands (comparisons, argmax, casts), or a piecewise-constant float op."""
    if not isinstance(op, TgOp) or op.op_name in (Op.weight, Op.constant):
        return False
    floats_in = any(dtypes.is_float(info_of(o.type).dtype) for o in op.operands)
    return floats_in and (op.op_name in PIECEWISE_CONSTANT or
                          any(not dtypes.is_float(r.dtype) for r in op.result_infos()))


# Piecewise-constant ops' examples sit on their jumps on purpose (round's halves, sign's 0),
# where finite differences see the jump; their VJP (zero) is checked on the random graphs' side.
PIECEWISE_CONSTANT = ("floor", "ceil", "round", "sign")
def _only_compared(model: Model, name: str) -> bool:
    values = [a for n, a in zip(model.input_names, model.func.args) if n == name] + [
        op.results[0] for op in model.ops() if getattr(op, "op_name", "") == "weight" and op.attr("name") == name]
    uses = [u.operation for v in values for u in v.uses]
    return bool(uses) and all(getattr(op, "op_name", "") in ("eq", "ne", "lt", "le", "gt", "ge") for op in uses)


EXAMPLES = [ex for name, exs in op_examples().items() if name in vjp.VJPS and name not in PIECEWISE_CONSTANT
            for ex in exs]


@pytest.mark.parametrize("example", EXAMPLES, ids=[ex.id for ex in EXAMPLES])
def test_each_vjp_matches_finite_differences(example):
    rounded = [t for op in as_float64(example.model).ops() if isinstance(op, TgOp) for t in op.result_infos()
               if dtypes.is_float(t.dtype) and t.dtype != "f64"]
    if rounded:
        pytest.skip(f"rounds to {rounded[0].dtype} on the way: finite differences would measure the rounding")
    try:
        check_against_finite_differences(example.model, example.inputs)
    except NotDifferentiable as e:
        # a rule that refuses these attributes says which, and only for what it states
        assert "not written" in str(e) or "symbolic" in str(e) or "run-time" in str(e), e


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=graphs(ops=ALL_OPS, symbolic=False), seed=st.integers(0, 2 ** 16))
def test_vjps_of_random_graphs_match_finite_differences(model, seed):
    check_against_finite_differences(model, random_inputs(model, seed), seed)


# rms_norm and rope are not in the random graphs' op families (their operands have shapes of their
# own kinds): each is drawn here over random shapes, axes and broadcasts instead.
@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(1, 3), min_size=0, max_size=2), width=st.integers(1, 6),
       axis_back=st.integers(1, 2), scaled=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_rms_norm_vjp_matches_finite_differences(rows, width, axis_back, scaled, seed):
    shape = (*rows, width, 3) if axis_back == 2 else (*rows, width)
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", shape)
    scale = g.weight("scale", rng.uniform(0.5, 2, shape[-axis_back:]).astype(np.float32)) if scaled else None
    model = g.build(g.op("rms_norm", x, scale, axis=-axis_back, epsilon=1e-5))
    check_against_finite_differences(model, [rng.uniform(-2, 2, shape)], seed)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), seq=st.integers(1, 4), half=st.integers(1, 4),
       per_head=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_rope_vjp_matches_finite_differences(batch, heads, seq, half, per_head, seed):
    rng = np.random.default_rng(seed)
    angles = (heads if per_head else 1, seq, half)  # cos/sin broadcast over batch (and heads)
    g = Graph()
    x = g.input("x", (batch, heads, seq, 2 * half))
    theta = rng.uniform(-3, 3, angles)
    cos = g.weight("cos", np.cos(theta).astype(np.float32))
    sin = g.weight("sin", np.sin(theta).astype(np.float32))
    model = g.build(g.op("rope", x, cos, sin))
    check_against_finite_differences(model, [rng.uniform(-2, 2, (batch, heads, seq, 2 * half))], seed)


def small_mlp():
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (4, 3))
    w = g.weight("w", rng.standard_normal((3, 5)).astype(np.float32))
    y = g.sum(g.relu(x @ w) * (x @ w))  # w read twice: both reads' cotangents are summed
    return g.build(y, names=["loss"])


def test_grad_and_value_and_grad_name_their_results():
    model = small_mlp()
    vg = autodiff.value_and_grad(model)
    assert vg.output_names == ["loss", "grad_w"]
    assert autodiff.grad(model, wrt=["x", "w"]).output_names == ["grad_x", "grad_w"]
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    loss, gw = interpret(vg, [x])
    h = x @ model.weights["w"].astype(np.float64)
    np.testing.assert_allclose(gw, x.T.astype(np.float64) @ (2 * np.maximum(h, 0)), rtol=1e-12)


def test_bad_requests_are_named_errors():
    model = small_mlp()
    with pytest.raises(ModelError, match="no input or weight has that name"):
        autodiff.grad(model, wrt=["nope"])
    g = Graph()
    x = g.input("x", (3,))
    nonscalar = g.build(g.exp(x))
    with pytest.raises(ModelError, match="scalar float loss"):
        autodiff.grad(nonscalar, wrt=["x"])
    g = Graph()
    x = g.input("x", (2, 3))
    q = g.op("quantize", x, g.constant(np.float32(0.1)), to="i8")
    deq = g.op("dequantize", q, g.constant(np.float32(0.1)))
    with pytest.raises(NotDifferentiable, match="tg.dequantize"):
        autodiff.grad(g.build(g.sum(deq)), wrt=["x"])


# --- whole models against torch.autograd ---


def torch_gradients(module, inputs, wrt_prefix=""):
    """The module's loss and its parameters' gradients from torch.autograd."""
    for p in module.parameters():
        p.grad = None
    loss = module(*inputs)
    loss.backward()
    return float(loss), {wrt_prefix + n: p.grad.numpy() for n, p in module.named_parameters()}


def check_parameter_gradients(module, inputs, padding: dict | None = None):
    from tilegraph.frontends.torch_export import from_torch

    model = from_torch(module, inputs)
    params = [n for n, _ in module.named_parameters()]
    vg = autodiff.value_and_grad(model, wrt=[n for n in params if n in model.weights])
    outs = interpret(vg, [t.numpy() for t in inputs])
    loss, grads = torch_gradients(module, inputs)
    assert relative_error(outs[0], loss) <= PEER_RELATIVE_ERROR
    checked = 0
    largest = max(float(np.max(np.abs(g))) for g in grads.values() if g is not None)
    for name, g in zip(vg.output_names[1:], outs[1:]):
        name = name[len("grad_"):]
        want = grads[name]
        if name in (padding or {}):
            # torch's nn.Embedding(padding_idx=p) leaves row p out of the gradient by definition
            # (an attribute of the module, not of the function torch.export writes down)
            assert not want[padding[name]].any()
            g, want = np.delete(g, padding[name], axis=0), np.delete(want, padding[name], axis=0)
        if np.max(np.abs(want)) < 1e-6 * largest:
            # zero but for rounding (a key bias: softmax ignores what it adds to every score of a
            # row): float32's tolerance for a sum over the tokens, at the largest gradient's scale
            rtol, _ = tolerance("f32", int(np.prod(inputs[0].shape)))
            assert np.max(np.abs(g - want)) <= rtol * largest, name
        else:
            assert relative_error(g, want) <= PEER_RELATIVE_ERROR, name
        checked += 1
    assert checked >= len(params) - 1  # every parameter the export reads (MiniLM's pooler is not built)


def summed_against(module, shape):
    import torch

    weights = torch.randn(*shape, generator=torch.Generator().manual_seed(1))

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, *xs):
            return (self.m(*xs) * weights).sum()

    return Loss()


def test_gpt2_shaped_parameter_gradients_match_torch_autograd():
    from tests.models import gpt2_inputs, gpt2_model

    module = gpt2_model(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128)
    check_parameter_gradients(summed_against(module, (2, 16, 64)), gpt2_inputs(2, 16, vocab_size=128))


def test_minilm_parameter_gradients_match_torch_autograd():
    from tests.models import MINILM_HIDDEN, minilm_inputs, minilm_model

    module = minilm_model()
    padding = {"m.bert.embeddings.word_embeddings.weight": module.bert.embeddings.word_embeddings.padding_idx}
    check_parameter_gradients(summed_against(module, (2, 8, MINILM_HIDDEN)), minilm_inputs(2, 8), padding)


@pytest.mark.parametrize("causal, mask_kind, lq", [(False, None, 10), (True, None, 6), (False, "float", 7),
                                                   (True, "bool", 10), (False, "float-keys", 5)])
def test_blockwise_attention_backward_matches_torch_and_holds_no_lq_by_lk_value(monkeypatch, causal, mask_kind, lq):
    """Above ATTENTION_BACKWARD_BLOCK keys, attention's VJP walks blocks of keys (FlashAttention-2's
    backward, each row's logsumexp first): its gradients equal torch.autograd's in float64 (dq, dk,
    dv and a float mask's), and no value of the backward is Lq x Lk, only Lq x block slabs."""
    monkeypatch.setattr(vjp, "ATTENTION_BACKWARD_BLOCK", 4)
    lk, d = 10, 3
    rng = np.random.default_rng(lq + 2 * causal)
    shapes = {"q": (2, 2, lq, d), "k": (2, 1, lk, d), "v": (2, 1, lk, 4)}
    mshape = {"float": (2, 1, lq, lk), "bool": (1, 1, lq, lk), "float-keys": (2, 1, 1, lk)}.get(mask_kind)
    g = Graph()
    q, k, v = (g.input(n, s) for n, s in shapes.items())
    mask = None if mask_kind is None else g.input("mask", mshape, "i1" if mask_kind == "bool" else "f32")
    out = g.op("attention", q, k, v, *([mask] if mask is not None else []), scale=0.6, causal=causal)
    wrt = list(shapes) + (["mask"] if mask_kind and mask_kind != "bool" else [])
    model = autodiff.vjp(g.build(out, names=["out"]), wrt=wrt)
    # (a float mask as large as the scores has a gradient as large: that one result is allowed)
    returned = model.func.body.block.last_op.operands
    allowed = {returned[-1]} if mask_kind == "float" else set()
    for op in model.ops():
        for r in getattr(op, "results", []):
            shape = tuple(info_of_value(r).shape)
            assert shape[-2:] != (lq, lk) or r in allowed, f"{op.name} makes an Lq x Lk value {shape}"
    values = {n: rng.standard_normal(s) for n, s in shapes.items()}
    if mask_kind == "bool":
        values["mask"] = rng.random(mshape) < 0.8
        values["mask"][..., 0] = True  # no row wholly masked (its forward is NaN in both)
    elif mask_kind:
        values["mask"] = rng.standard_normal(mshape)
    cot = rng.standard_normal((2, 2, lq, 4))
    ours = interpret(model, [values[n] for n in model.input_names[:-1]] + [cot])
    t = torch_attention_grads(values, cot, 0.6, causal, mask_kind)
    rtol, _ = tolerance("f32", lk)  # the inputs are f32, rounded on the way in
    for name, got in zip(wrt, ours[1:]):
        assert relative_error(got, t[name].grad.numpy()) <= rtol, name
    if causal and mask_kind == "bool":  # the blocks' ops on the C backend, against the float64 interpreter
        import tilegraph
        from tilegraph.testing import assert_close

        feed = [np.asarray(values[n], np.float32) if values[n].dtype != bool else values[n]
                for n in model.input_names[:-1]] + [cot.astype(np.float32)]
        for got, want in zip(tilegraph.compile(model, target="c").run(*feed), ours):
            assert_close(np.asarray(got), want, "f32", lk)


def torch_attention_grads(values: dict, cot, scale: float, causal: bool, mask_kind):
    """torch.autograd's attention in float64 over `values` (q, k, v and a mask), backward from `cot`:
    the tensors by name, each float one with its .grad, and "out", the attention's result."""
    import torch

    t = {n: torch.tensor(a, dtype=torch.float64 if a.dtype != bool else torch.bool, requires_grad=a.dtype != bool)
         for n, a in values.items()}
    lq, lk = t["q"].shape[-2], t["k"].shape[-2]
    s = t["q"] @ t["k"].transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), -torch.inf)
    if mask_kind == "bool":
        s = s.masked_fill(~t["mask"], -torch.inf)
    elif mask_kind:
        s = s + t["mask"]
    t["out"] = torch.softmax(s, -1) @ t["v"]
    t["out"].backward(torch.from_numpy(np.asarray(cot, np.float64)))
    return t


def info_of_value(v):
    from tilegraph.ir.shapes import info_of
    return info_of(v.type)


def test_what_a_backward_reads_of_its_forward_is_read_off_its_rule():
    """forward_values_read (what a training step keeps; the sharding planner prices it) follows the
    rules: add reads nothing, mul both operands, exp its result, where its condition alone, and
    probing a rule leaves the forward's values with the uses they had."""
    g = Graph()
    c = g.input("c", (4, 3), "i1")
    x, y = g.input("x", (4, 3), "f32"), g.input("y", (4, 3), "f32")
    model = g.build(x + y, x * y, g.exp(x), g.where(c, x, y), names=["a", "m", "e", "w"])
    ops = {op.op_name: op for op in model.func.body.walk() if isinstance(op, TgOp)}
    uses = {name: [len(list(v.uses)) for v in op.operands] for name, op in ops.items()}
    reads = {name: vjp.forward_values_read(op) for name, op in ops.items()}
    assert reads == {"add": (frozenset(), False), "mul": (frozenset({0, 1}), False),
                     "exp": (frozenset(), True), "where": (frozenset({0}), False)}
    assert uses == {name: [len(list(v.uses)) for v in op.operands] for name, op in ops.items()}


@pytest.mark.parametrize("causal, mask_kind, lq, lk", [(True, None, 150, 150), (True, "bool", 70, 130),
                                                       (False, "float", 90, 40), (False, None, 1, 5)])
def test_attention_backward_is_one_op_and_the_c_kernel_runs_it_matching_torch(causal, mask_kind, lq, lk):
    """Where q, k and v share their batch dims, attention's VJP is one tg.attention_grad; on the C
    backend that op is attention_backward.c's kernel (it is in the emitted C and it ran), over
    several query blocks and a causal band that skips keys (Lk - Lq = 60), and its gradients (and the
    forward's result) equal torch.autograd's in float64. (A float mask's gradient goes the spelled-out
    way beside it.)"""
    import ctypes

    import tilegraph

    d, e = 16, 8
    rng = np.random.default_rng(lq + lk)
    shapes = {"q": (2, 3, lq, d), "k": (2, 3, lk, d), "v": (2, 3, lk, e)}
    mshape = {"float": (2, 1, lq, lk), "bool": (1, 1, lq, lk)}.get(mask_kind)
    g = Graph()
    q, k, v = (g.input(n, s) for n, s in shapes.items())
    mask = None if mask_kind is None else g.input("mask", mshape, "i1" if mask_kind == "bool" else "f32")
    out = g.op("attention", q, k, v, *([mask] if mask is not None else []), scale=0.3, causal=causal)
    wrt = list(shapes) + (["mask"] if mask_kind == "float" else [])
    model = autodiff.vjp(g.build(out, names=["out"]), wrt=wrt)
    assert [op.op_name for op in model.ops() if getattr(op, "op_name", None) == "attention_grad"] == ["attention_grad"]
    values = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    if mask_kind == "bool":
        values["mask"] = rng.random(mshape) < 0.8
        values["mask"][..., 0] = True  # no row wholly masked (its forward is NaN in both)
    elif mask_kind:
        values["mask"] = rng.standard_normal(mshape).astype(np.float32)
    cot = rng.standard_normal((2, 3, lq, e)).astype(np.float32)
    compiled = tilegraph.compile(model, target="c")
    assert compiled.source.count("tg_attention_backward(") == 1
    lib = compiled._runner._lib
    lib.tg_attention_backward_count.restype = ctypes.c_int
    before = lib.tg_attention_backward_count()
    ours = compiled.run(*[values[n] for n in model.input_names[:-1]], cot)
    assert lib.tg_attention_backward_count() == before + 1
    t = torch_attention_grads(values, cot, 0.3, causal, mask_kind)
    rtol, _ = tolerance("f32", max(lq, lk))
    # (the forward too: its flash kernel multiplies no key past a query block's causal band)
    assert relative_error(np.asarray(ours[0], np.float64), t["out"].detach().numpy()) <= rtol
    for name, got in zip(wrt, ours[1:]):
        assert relative_error(np.asarray(got, np.float64), t[name].grad.numpy()) <= rtol, name
