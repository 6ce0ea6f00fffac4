"""The tg dialect: shape rules, verifier messages, textual round-trip, interpreter basics."""

import numpy as np
import pytest

from tilegraph.ir import Graph, Model, ModelError, ShapeError, interpret
from tilegraph.testing import assert_close


def mlp():
    g = Graph()
    x = g.input("x", ("B", 8))
    w = g.weight("fc.w", np.arange(8 * 4, dtype=np.float32).reshape(8, 4) / 10)
    y = g.relu(x @ w + 1.0)
    return g.build(g.softmax(y), names=["probs"])


def test_printed_ir_round_trips_exactly():
    m = mlp()
    text = m.text
    assert Model.parse(text, m.weights).text == text
    assert '["B"]' in text and "tg.softmax" in text


def test_symbolic_dims_flow_through_reshape():
    g = Graph()
    x = g.input("x", ("B", "S", 6))
    y = g.reshape(x, ("B", -1))
    assert str(y.shape[1]) == "6*S"
    m = g.build(y)
    out = interpret(m, [np.ones((2, 3, 6))])[0]
    assert out.shape == (2, 18)


def test_broadcasting_mismatch_names_the_op_and_shapes():
    g = Graph()
    a = g.input("a", (3, 4))
    b = g.input("b", (5,))
    with pytest.raises(ShapeError, match=r"tg.add.*\(3, 4\).*\(5,\)"):
        g.add(a, b)


def test_verifier_failure_names_the_op():
    lines = mlp().text.splitlines()
    i = next(i for i, line in enumerate(lines) if "tg.matmul" in line)
    lines[i] = lines[i].replace("?x4xf32", "?x5xf32")
    text = "\n".join(lines)
    m = Model.parse(text, mlp().weights)
    with pytest.raises(ModelError, match="tg.matmul"):
        m.verify()


def test_interpreter_matches_numpy_on_a_small_mlp():
    m = mlp()
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    (probs,) = interpret(m, [x])
    h = np.maximum(x.astype(np.float64) @ m.weights["fc.w"].astype(np.float64) + 1, 0)
    e = np.exp(h - h.max(1, keepdims=True))
    assert_close(probs, e / e.sum(1, keepdims=True), "f64", reduction_length=8)


def test_inputs_of_the_wrong_shape_are_refused_by_name():
    with pytest.raises(ShapeError, match="input 'x'"):
        interpret(mlp(), [np.ones((3, 9))])


def test_weights_save_beside_the_text(tmp_path):
    m = mlp()
    path = m.save(tmp_path / "m.mlir")
    assert (tmp_path / "m.weights.npz").is_file()
    loaded = Model.load(path)
    assert loaded.text == m.text
    np.testing.assert_array_equal(loaded.weights["fc.w"], m.weights["fc.w"])


def test_a_model_prints_as_its_ir_and_weight_shapes_not_its_object_tree():
    """hypothesis prints a failing example's Model: field by field, xDSL's object tree of a
    30-op graph ran to 199 MB and the failing test hung instead of failing."""
    from hypothesis.vendor.pretty import pretty

    g = Graph()
    x = g.input("x", ("B", 256))
    model = g.build(x @ g.weight("w", np.zeros((256, 512), np.float32)))
    text = repr(model)
    assert text.startswith("Model(weights: w (256, 512))") and "tg.matmul" in text
    assert len(text) < 2000
    assert pretty(model) == text
