"""Dims known only at run time: NonZero, Unique, boolean masks, TopK with a computed k.

A data-dependent size is a symbol (u0) that one tg op defines (ir/ops.py, "data-dependent
sizes"); every backend binds it from that op's result, the cost model prices it at a stated
expected size. Each model here is compiled once and run on inputs that give different sizes
(zero included), against the float64 interpreter, onnxruntime (ONNX files built with
onnx.helper) or torch eager (modules through torch.export).
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import tilegraph
from tilegraph.frontends.onnx import from_onnx
from tilegraph.ir import Graph
from tilegraph.ir.interpreter import interpret
from tilegraph.ir.model import parse_module, print_module
from tilegraph.ir.shapes import ShapeError, symbol
from tilegraph.ir.signature import Signature
from tilegraph.passes.cost.model import expected_sizes, module_cost, op_bytes
from tilegraph.ir.hardware import hardware
from tilegraph.testing import PEER_RELATIVE_ERROR, assert_close, reduction_length, relative_error

from tests.test_onnx_frontend import make_model, run_ort, vi

F32, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
TARGETS = ("numpy", "c")


def check_against(compiled, model, inputs, want):
    """compiled's outputs equal `want` (a peer's) and the float64 interpreter's, shape and values."""
    got = compiled.run(*inputs)
    oracle = interpret(model, list(inputs))
    n = reduction_length(model, Signature.of(model).bind(list(inputs))[1])
    for i, (g, w, o, info) in enumerate(zip(got, want, oracle, model.outputs)):
        assert g.shape == np.shape(w) == o.shape, f"output {i}: {g.shape}, peer {np.shape(w)}, oracle {o.shape}"
        assert_close(g, o, info.dtype, n, name=f"output {i} vs interpreter")
        if np.issubdtype(g.dtype, np.floating):
            assert relative_error(g, w) <= PEER_RELATIVE_ERROR, f"output {i} vs peer"
        else:
            np.testing.assert_array_equal(g, w)


# --- the IR ---------------------------------------------------------------------------------


def masked_sum_model():
    g = Graph()
    x = g.input("x", ("B", 4), "f32")
    rows = g.op("nonzero", g.op("gt", g.reshape(x, [-1]), g.constant(np.float32(0.25))), size="u0")
    picked = g.op("gather", g.reshape(x, [-1]), g.reshape(rows, ["u0"]))
    return g.build(picked * 2.0, g.op("reduce_sum", picked, axes=[0]))


def test_a_run_time_dim_is_a_symbol_in_the_types_and_the_text_round_trips():
    model = masked_sum_model()
    assert model.outputs[0].shape == (symbol("u0"),)
    text = print_module(model.module)
    assert 'tg.nonzero' in text and '["u0"]' in text
    assert print_module(parse_module(text)) == text


def test_a_size_attribute_must_name_a_symbol():
    g = Graph()
    x = g.input("x", (3,), "i1")
    with pytest.raises(ShapeError, match="must name a symbol"):
        g.op("nonzero", x, size="2*u0")
    for name in ("np", "lambda", "floor"):  # names of the generated code and Python's
        with pytest.raises(ShapeError, match="must name a symbol"):
            g.op("nonzero", x, size=name)
    with pytest.raises(ShapeError, match="expected fraction"):
        g.op("nonzero", x, size="u0", expected=1.5)


def test_the_cost_model_prices_a_run_time_dim_at_its_stated_expected_size():
    model = masked_sum_model()
    B = symbol("B")
    # nonzero of a 4B-element mask: half its bound by default (ir/ops.py)
    assert expected_sizes(model.module) == {"u0": 2 * B}
    cost = module_cost(model.module, hardware("cpu"))
    assert cost.expected == {"u0": 2 * B}
    for _, c in cost.rows:
        assert {s.name for s in sympy.sympify(c.time).free_symbols} <= {"B"}
    # the gather moves the bytes of its operands and result with u0 at 2B
    gather = next(op for op in model.func.walk() if getattr(op, "op_name", "") == "gather")
    priced = next(c for what, c in cost.rows if what == "gather")
    assert sympy.simplify(priced.bytes - op_bytes(gather).subs(symbol("u0"), 2 * B)) == 0
    assert op_bytes(gather).has(symbol("u0"))


@pytest.mark.parametrize("target", TARGETS + ("triton",))
def test_one_compiled_model_serves_every_run_time_size_including_zero(target):
    model = masked_sum_model()
    compiled = tilegraph.compile(model, target=target)
    rng = np.random.default_rng(0)
    sizes = set()
    for x in (rng.uniform(-1, 1, (3, 4)), rng.uniform(-1, 1, (5, 4)), np.zeros((2, 4)), np.ones((1, 4))):
        x = x.astype(np.float32)
        keep = x.reshape(-1)[x.reshape(-1) > 0.25]
        check_against(compiled, model, [x], [keep * 2, keep.sum(keepdims=False).reshape(())])
        sizes.add(len(keep))
    assert 0 in sizes and len(sizes) == 4


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), density=st.floats(0, 1), seed=st.integers(0, 2 ** 16))
@example(rows=1, density=0.0, seed=0)  # nothing selected: u0 = 0
@example(rows=4, density=1.0, seed=1)  # everything selected: u0 at its bound
def test_selecting_by_a_mask_matches_numpy_on_every_backend(rows, density, seed):
    """x[x > t] then downstream arithmetic: the interpreter, NumPy and C agree with NumPy's own
    boolean indexing for any mask, whatever the number of rows and selected elements."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (rows, 4)).astype(np.float32)
    threshold = np.float32(1 - density)
    g = Graph()
    xi = g.input("x", ("B", 4), "f32")
    rows_ = g.op("nonzero", g.op("ge", xi, g.constant(threshold)), size="u0")
    flat = g.op("add", g.op("mul", g.op("gather", rows_, g.constant(np.int64(0)), axis=0), g.constant(np.int64(4))),
                g.op("gather", rows_, g.constant(np.int64(1)), axis=0))
    picked = g.op("gather", g.reshape(xi, [-1]), flat)
    model = g.build(g.op("exp", picked), g.op("transpose", rows_, perm=[1, 0]))
    want = [np.exp(x[x >= threshold]), np.argwhere(x >= threshold)]
    for target in TARGETS:
        check_against(tilegraph.compile(model, target=target), model, [x], want)


# --- ONNX files -------------------------------------------------------------------------------


def onnx_mask_select():
    """y = GatherND(x, Transpose(NonZero(x > 0))) * 3: torch's ONNX exporter's x[x > 0]."""
    zero = helper.make_tensor("zero", F32, [], [0.0])
    three = helper.make_tensor("three", F32, [], [3.0])
    nodes = [helper.make_node("Constant", [], ["z"], value=zero), helper.make_node("Constant", [], ["t"], value=three),
             helper.make_node("Greater", ["x", "z"], ["m"]), helper.make_node("NonZero", ["m"], ["nz"]),
             helper.make_node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
             helper.make_node("GatherND", ["x", "idx"], ["sel"]), helper.make_node("Mul", ["sel", "t"], ["y"]),
             helper.make_node("Shape", ["y"], ["n"])]
    return make_model(nodes, [vi("x", F32, [3, 5])], [vi("y", F32, ["N"]), vi("n", I64, [1])])


def onnx_unique(sort: int, axis: int | None):
    attrs = {"sorted": sort} | ({} if axis is None else {"axis": axis})
    node = helper.make_node("Unique", ["x"], ["y", "first", "inverse", "counts"], **attrs)
    return make_model([node], [vi("x", I64, ["B", 4])],
                      [vi("y", I64, None), vi("first", I64, ["U"]), vi("inverse", I64, None), vi("counts", I64, ["U"])])


def onnx_topk_computed_k():
    """k = the number of positive entries of the first row, computed in the graph."""
    nodes = [helper.make_node("Constant", [], ["z"], value=helper.make_tensor("z0", F32, [], [0.0])),
             helper.make_node("Greater", ["x", "z"], ["pos"]), helper.make_node("Cast", ["pos"], ["posi"], to=I64),
             helper.make_node("Gather", ["posi", "zero"], ["row0"], axis=0),
             helper.make_node("ReduceSum", ["row0"], ["k"], keepdims=0),
             helper.make_node("Reshape", ["k", "one"], ["k1"]),
             helper.make_node("TopK", ["x", "k1"], ["values", "indices"], axis=1)]
    one = helper.make_tensor("one", I64, [1], [1])
    zero = helper.make_tensor("zero", I64, [], [0])
    graph = helper.make_graph(nodes, "g", [vi("x", F32, [3, 6])], [vi("values", F32, [3, "K"]),
                                                                   vi("indices", I64, [3, "K"])],
                               initializer=[one, zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def onnx_compress_run_time():
    nodes = [helper.make_node("Compress", ["x", "keep"], ["y"], axis=0)]
    return make_model(nodes, [vi("x", F32, [6, 3]), vi("keep", BOOL, [6])], [vi("y", F32, ["N", 3])])


@pytest.mark.parametrize("target", TARGETS)
def test_onnx_nonzero_and_gathernd_select_by_a_mask_as_onnxruntime_does(target):
    proto = onnx_mask_select()
    model = from_onnx(proto)
    assert any(op.name == "tg.nonzero" for op in model.func.walk())
    compiled = tilegraph.compile(proto, target=target)
    rng = np.random.default_rng(1)
    for x in (rng.normal(size=(3, 5)), rng.normal(size=(3, 5)) + 1, -np.ones((3, 5))):
        x = x.astype(np.float32)
        check_against(compiled, model, [x], run_ort(proto, {"x": x}))


@pytest.mark.parametrize("sort,axis", [(1, None), (0, None), (1, 1), (0, 0), (1, -1)])
def test_onnx_unique_matches_onnxruntime(sort, axis):
    proto = onnx_unique(sort, axis)
    model = from_onnx(proto)
    compiled = {t: tilegraph.compile(proto, target=t) for t in TARGETS}
    rng = np.random.default_rng(2)
    for x in (rng.integers(0, 3, (2, 4)), rng.integers(0, 2, (5, 4)), np.zeros((1, 4), np.int64)):
        x = x.astype(np.int64)
        if axis is not None:  # slices along the axis: repeat some to make duplicates
            x = np.concatenate([x, x[:1]], 0) if axis == 0 else np.concatenate([x[:, :2], x[:, :2]], 1)
        want = run_ort(proto, {"x": x})
        for t in TARGETS:
            check_against(compiled[t], model, [x], want)


@pytest.mark.parametrize("target", TARGETS)
def test_onnx_topk_with_a_k_computed_in_the_graph_matches_onnxruntime(target):
    proto = onnx_topk_computed_k()
    model = from_onnx(proto)
    compiled = tilegraph.compile(proto, target=target)
    rng = np.random.default_rng(3)
    ks = set()
    for _ in range(4):
        x = rng.normal(size=(3, 6)).astype(np.float32)
        check_against(compiled, model, [x], run_ort(proto, {"x": x}))
        ks.add(int((x[0] > 0).sum()))
    assert len(ks) > 1


def test_onnx_compress_on_a_run_time_condition_matches_onnxruntime():
    proto = onnx_compress_run_time()
    model = from_onnx(proto)
    compiled = tilegraph.compile(proto, target="numpy")
    x = np.arange(18, dtype=np.float32).reshape(6, 3)
    for keep in ([1, 0, 1, 1, 0, 0], [0] * 6, [1] * 6):
        keep = np.array(keep, bool)
        check_against(compiled, model, [x, keep], run_ort(proto, {"x": x, "keep": keep}))


def test_onnx_export_of_a_run_time_dim_runs_in_onnxruntime():
    from tilegraph.backends.onnx_export import export

    model = masked_sum_model()
    exported, _, _ = export(model)
    x = np.random.default_rng(4).uniform(-1, 1, (3, 4)).astype(np.float32)
    got = run_ort(exported, {"x": x})
    for g, w in zip(got, interpret(model, [x])):
        assert g.shape == w.shape
        assert_close(g, w, "f32", 12)


# --- torch.export --------------------------------------------------------------------------------


class MaskIndex(torch.nn.Module):
    def forward(self, x):
        return x[x > 0].sum() + x[:, x[0] > 0].mean(), x[x > 0] * 2


class NonzeroRows(torch.nn.Module):
    def forward(self, x):
        return torch.nonzero(x > 0.5), torch.masked_select(x, x < 0) - 1


class TopKItem(torch.nn.Module):
    def forward(self, x, k):
        values, indices = torch.topk(x, k.item(), dim=-1)
        return values * 2, indices


class PrefixItem(torch.nn.Module):
    def forward(self, x, n):
        return x[:, : n.item()].exp()


class Unique(torch.nn.Module):
    def forward(self, x):
        values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
        return values, inverse, counts * 2


class UniqueRows(torch.nn.Module):
    def forward(self, x):
        values, inverse, counts = torch.unique(x, dim=0, return_inverse=True, return_counts=True)
        return values, inverse, counts


class TinyMoE(torch.nn.Module):
    """Mixtral's sparse block as transformers wrote it before grouped_mm: per expert, the tokens
    routed to it (torch.where on the one-hot mask: a nonzero), their rows, scatter-added back."""

    def __init__(self, dim=8, experts=4, top_k=2):
        super().__init__()
        torch.manual_seed(0)
        self.top_k = top_k
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x):
        weights, chosen = torch.topk(torch.softmax(self.gate(x), -1), self.top_k, dim=-1)
        mask = torch.nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            y = expert(x[token]) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out


@pytest.mark.parametrize("module,inputs", [
    (MaskIndex(), [torch.randn(4, 5)]),
    (NonzeroRows(), [torch.randn(3, 4)]),
    (TopKItem(), [torch.randn(2, 6), torch.tensor(3)]),
    (Unique(), [torch.tensor([[3, 1, 3], [2, 1, 0]])]),
    (UniqueRows(), [torch.tensor([[3, 1], [2, 1], [3, 1], [0, 0]])]),
    (PrefixItem(), [torch.randn(2, 6), torch.tensor(4)]),
], ids=["mask-index", "nonzero-masked-select", "topk-item", "unique", "unique-rows", "prefix-item"])
@pytest.mark.parametrize("target", TARGETS)
def test_torch_export_data_dependent_ops_match_eager(module, inputs, target):
    compiled = tilegraph.compile(module, tuple(inputs), target=target)
    torch.manual_seed(5)
    runs = [inputs, [torch.randn_like(inputs[0]) if inputs[0].is_floating_point() else
                     torch.randint(0, 4, inputs[0].shape)] + inputs[1:]]
    if isinstance(module, (TopKItem, PrefixItem)):
        runs.append([inputs[0], torch.tensor(5)])  # another run-time size, the same compiled model
    for args in runs:
        want = module(*args)
        want = [w.numpy() for w in (want if isinstance(want, tuple) else (want,))]
        check_against(compiled, compiled.model, [a.numpy() for a in args], want)


@pytest.mark.parametrize("target", TARGETS)
def test_a_mixture_of_experts_routed_by_nonzero_matches_eager_at_several_routings(target):
    moe = TinyMoE().eval()
    x = torch.randn(6, 8)
    compiled = tilegraph.compile(moe, (x,), target=target)
    routed = compiled.model
    assert sum(op.name == "tg.nonzero" for op in routed.func.walk()) == 4
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(6, 8)
        with torch.no_grad():
            want = moe(x).numpy()
        check_against(compiled, routed, [x.numpy()], [want])
    # each expert's rows are priced at the expected count, not at every token
    cost = module_cost(routed.module, hardware("cpu"))
    assert len(cost.expected) == 4


# --- passes -------------------------------------------------------------------------------------


def _data_dependent_examples():
    from tilegraph.testing import op_examples

    examples = op_examples()
    return [ex for op in ("nonzero", "unique", "narrow", "non_max_suppression", "rnn", "assert_size")
            for ex in examples[op]]


@pytest.mark.parametrize("pass_name", sorted(__import__("tilegraph.passes.registry", fromlist=["PASSES"]).PASSES))
def test_every_registered_pass_keeps_the_meaning_of_models_with_run_time_dims_and_loops(pass_name):
    from tilegraph.testing import assert_preserves_semantics

    for ex in _data_dependent_examples():
        assert_preserves_semantics(pass_name, ex.model, list(ex.inputs))


def test_the_cost_of_a_recurrence_grows_with_its_symbolic_length():
    from tilegraph.testing import op_examples

    lstm = next(ex for ex in op_examples()["rnn"] if ex.label == "lstm-peepholes-clip")
    cost = module_cost(lstm.model.module, hardware("cpu"))
    T = symbol("T")
    (rnn,) = [c for what, c in cost.rows if what == "rnn"]
    # 4 gates of 3 over 2 inputs and 3 hidden, batch 2, per step: the two matmuls and the gate arithmetic
    assert sympy.expand(rnn.flops - (2 * 12 * 2 + 2 * 12 * 3 + 3 * 12) * 2 * T) == 0
    assert sympy.sympify(cost.time).has(T)


def test_a_traced_split_of_a_run_time_count_is_checked_when_it_runs():
    """torch's TorchScript exporter unrolls `for i in mask.nonzero()` at the count it saw: the
    ONNX Split of NonZero's rows into that many parts runs when the count matches and is a
    clear error (as in onnxruntime) when it does not."""
    nodes = [helper.make_node("NonZero", ["x"], ["nz"]), helper.make_node("Transpose", ["nz"], ["t"], perm=[1, 0]),
             helper.make_node("Split", ["t", "parts"], ["a", "b"], axis=0),
             helper.make_node("Concat", ["b", "a"], ["y"], axis=0)]
    parts = helper.make_tensor("parts", I64, [2], [1, 2])
    graph = helper.make_graph(nodes, "g", [vi("x", I64, [5])], [vi("y", I64, [3, 1])], initializer=[parts])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    model = from_onnx(proto)
    assert any(op.name == "tg.assert_size" for op in model.func.walk())
    x = np.array([0, 4, 0, 2, 7], np.int64)
    for target in TARGETS:
        compiled = tilegraph.compile(proto, target=target)
        check_against(compiled, model, [x], run_ort(proto, {"x": x}))
        with pytest.raises(ShapeError, match="run-time size is 2 where the model was built for 3"):
            compiled.run(np.array([0, 4, 0, 0, 7], np.int64))
