"""The ONNX frontend: what it reports, what it folds, what it keeps symbolic.

Models are built with onnx.helper; results are checked against onnxruntime (the
real peer) or the float64 interpreter on the imported model.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx import StaticInputNeeded, from_onnx
from tilegraph.ir.interpreter import interpret
from tilegraph.ir.shapes import symbol
from tilegraph.testing import PEER_RELATIVE_ERROR, assert_close, reduction_length, relative_error

F32 = TensorProto.FLOAT
I64 = TensorProto.INT64


def make_model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    # IR version 10 (onnx 1.16): what the installed onnxruntime reads.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def run_ort(model, feeds):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def tg_ops(model) -> list[str]:
    return [op.name for op in model.func.body.block.ops if op.name != "func.return"]


# --- errors -------------------------------------------------------------------------


def test_every_unsupported_op_is_listed_in_one_error_before_converting():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu0"),
        helper.make_node("Frobnicate", ["a"], ["b"], name="frob0"),
        helper.make_node("Frobnicate", ["b"], ["c"], name="frob1"),
        helper.make_node("DeformConv", ["c"], ["d"], name="deform0"),
        helper.make_node("Wibble", ["d"], ["y"], name="wib0", domain="com.example"),
    ]
    model = make_model(nodes, [vi("x", F32, [4])], [vi("y", F32, [4])])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(FrontendError) as err:
        from_onnx(model)
    msg = str(err.value)
    assert "3 unsupported op types (4 nodes)" in msg
    assert "Frobnicate: 2 nodes (e.g. 'frob0')" in msg
    assert "DeformConv: 1 node (e.g. 'deform0')" in msg
    assert "com.example.Wibble: 1 node (e.g. 'wib0')" in msg
    assert "Relu" not in msg


def test_missing_and_malformed_files_are_frontend_errors(tmp_path):
    with pytest.raises(FrontendError, match="cannot read"):
        from_onnx(tmp_path / "nope.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff\xfe this is not a protobuf \x00\x01\x02" * 10)
    with pytest.raises(FrontendError, match="not an ONNX model"):
        from_onnx(junk)
    text = tmp_path / "text.onnx"
    text.write_text("hello")
    with pytest.raises(FrontendError, match="not an ONNX model"):
        from_onnx(text)


def test_malformed_tensors_are_frontend_errors_naming_them():
    # Found by mutating a model's protobuf fields: an unknown element type in an
    # initializer was a KeyError from inside onnx, and a Constant's broken tensor
    # attribute escaped before the node was named.
    x = vi("x", F32, [2])
    bad_type = numpy_helper.from_array(np.zeros(2, np.float32), "w")
    bad_type.data_type = 40
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [x], [vi("y", F32, [2])],
                       [bad_type])
    with pytest.raises(FrontendError, match="initializer 'w': element type 40 is not supported"):
        from_onnx(model)
    short = numpy_helper.from_array(np.zeros(4, np.float32), "c")
    short.raw_data = short.raw_data[:6]
    model = make_model([helper.make_node("Constant", [], ["c"], name="const", value=short),
                        helper.make_node("Add", ["x", "c"], ["y"], name="add")], [x], [vi("y", F32, [2])])
    with pytest.raises(FrontendError, match="node 'const' \\(Constant\\): attribute 'value'"):
        from_onnx(model)


def test_a_shape_mismatch_names_the_node_the_op_and_the_shapes():
    model = make_model([helper.make_node("MatMul", ["a", "b"], ["y"], name="proj")],
                       [vi("a", F32, [2, 3]), vi("b", F32, [4, 5])], [vi("y", F32, [2, 5])])
    with pytest.raises(FrontendError) as err:
        from_onnx(model)
    msg = str(err.value)
    assert "proj" in msg and "MatMul" in msg and "f32(2, 3)" in msg and "f32(4, 5)" in msg


def test_a_bad_attribute_is_a_frontend_error_naming_the_node():
    model = make_model([helper.make_node("Transpose", ["x"], ["y"], name="t0", perm=[0, 0])],
                       [vi("x", F32, [2, 3])], [vi("y", F32, [3, 2])])
    with pytest.raises(FrontendError, match="t0.*Transpose.*perm"):
        from_onnx(model)


def test_an_old_opset_definition_that_changed_is_rejected_and_an_unchanged_one_imported():
    changed = make_model([helper.make_node("Dropout", ["x"], ["y"], name="d0")],
                         [vi("x", F32, [3])], [vi("y", F32, [3])], opset=11)
    with pytest.raises(FrontendError, match=r"Dropout \(opset 11; only its opset-13\+ definition"):
        from_onnx(changed)
    # Not is defined once, at opset 1: an opset-7 model means the same as an opset-13 one.
    unchanged = make_model([helper.make_node("Not", ["x"], ["y"])], [vi("x", TensorProto.BOOL, [3])],
                           [vi("y", TensorProto.BOOL, [3])], opset=7)
    x = np.array([True, False, True])
    np.testing.assert_array_equal(interpret(from_onnx(unchanged), [x])[0], ~x)


# --- symbolic dims and folding -----------------------------------------------------------


def _flatten_tail_model():
    """y = reshape(x, [shape(x)[0], shape(x)[1], -1]) written the way exporters write it."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Constant", [], ["i0"], value=numpy_helper.from_array(np.array(0, dtype=np.int64))),
        helper.make_node("Constant", [], ["i1"], value=numpy_helper.from_array(np.array(1, dtype=np.int64))),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["t"], axis=0),
        helper.make_node("Constant", [], ["ax"], value=numpy_helper.from_array(np.array([0], dtype=np.int64))),
        helper.make_node("Unsqueeze", ["b", "ax"], ["b1"]),
        helper.make_node("Unsqueeze", ["t", "ax"], ["t1"]),
        helper.make_node("Constant", [], ["m1"], value=numpy_helper.from_array(np.array([-1], dtype=np.int64))),
        helper.make_node("Concat", ["b1", "t1", "m1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("Relu", ["r"], ["y"]),
    ]
    return make_model(nodes, [vi("x", F32, ["batch", "seq", 4, 8])], [vi("y", F32, ["batch", "seq", 32])])


def test_dim_params_become_symbols_and_shape_chains_fold_into_a_symbolic_reshape():
    model = from_onnx(_flatten_tail_model())
    batch, seq = symbol("batch"), symbol("seq")
    assert model.inputs[0].shape == (batch, seq, 4, 8)
    assert model.outputs[0].shape == (batch, seq, 32)
    # Shape, Gather, Unsqueeze, Concat all folded at import: only the data path remains.
    assert tg_ops(model) == ["tg.reshape", "tg.relu"]
    onnx_model = _flatten_tail_model()
    for shape in [(2, 3, 4, 8), (5, 1, 4, 8)]:
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        (ref,) = run_ort(onnx_model, {"x": x})
        assert_close(ref, interpret(model, [x])[0], "f32", reduction_length(model, {"batch": shape[0], "seq": shape[1]}))


def test_integer_arithmetic_on_symbolic_shape_values_truncates():
    """reshape(x, [shape(x)[0] * 6 / 4, -1]): Div of shape values is integer division, also symbolically."""
    const = lambda name, v: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(v)))
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], end=1),
        const("six", [6]), const("four", [4]), const("m1", [-1]),
        helper.make_node("Mul", ["s", "six"], ["s6"]),
        helper.make_node("Div", ["s6", "four"], ["rows"]),
        helper.make_node("Concat", ["rows", "m1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    proto = make_model(nodes, [vi("x", F32, ["n", 6])], [vi("y", F32, [None, None])])
    model = from_onnx(proto)
    n = symbol("n")
    assert model.outputs[0].shape[0] == sympy.floor(sympy.Rational(3, 2) * n)
    for rows in (2, 4):
        x = np.arange(rows * 6, dtype=np.float32).reshape(rows, 6)
        (ref,) = run_ort(proto, {"x": x})
        np.testing.assert_array_equal(interpret(model, [x])[0], ref)


def test_dim_params_that_name_python_or_generated_code_globals_are_renamed():
    proto = make_model([helper.make_node("Neg", ["x"], ["y"])], [vi("x", F32, ["K", "np", "int"])],
                       [vi("y", F32, ["K", "np", "int"])])
    model = from_onnx(proto)
    assert [str(d) for d in model.inputs[0].shape] == ["K_", "np_", "int_"]
    x = np.ones((2, 3, 4), dtype=np.float32)
    np.testing.assert_array_equal(interpret(model, [x])[0], -x)


def test_unnamed_unknown_dims_get_fresh_distinct_symbols():
    inp = helper.make_tensor_value_info("x", F32, [None, None, 3])
    model = from_onnx(make_model([helper.make_node("Neg", ["x"], ["y"])], [inp], [vi("y", F32, [None, None, 3])]))
    d0, d1, three = model.inputs[0].shape
    assert isinstance(d0, sympy.Symbol) and isinstance(d1, sympy.Symbol) and d0 != d1 and three == 3


def test_a_slice_to_a_symbolic_length_keeps_the_length_symbolic():
    """positions[:, :seq] of a static table, seq taken from an input's shape (BERT exports)."""
    table = np.arange(20, dtype=np.int64).reshape(1, 20) * 3
    nodes = [
        helper.make_node("Shape", ["ids"], ["s"], start=1, end=2),
        helper.make_node("Constant", [], ["z"], value=numpy_helper.from_array(np.array([0], dtype=np.int64))),
        helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array([1], dtype=np.int64))),
        helper.make_node("Slice", ["table", "z", "s", "one"], ["pos"]),
        helper.make_node("Add", ["ids", "pos"], ["y"]),
    ]
    proto = make_model(nodes, [vi("ids", I64, ["batch", "seq"])], [vi("y", I64, ["batch", "seq"])],
                       initializers=[numpy_helper.from_array(table, "table")])
    model = from_onnx(proto)
    assert model.outputs[0].shape == (symbol("batch"), symbol("seq"))
    for shape in [(2, 7), (3, 20)]:
        ids = np.random.default_rng(1).integers(0, 100, shape)
        (ref,) = run_ort(proto, {"ids": ids})
        np.testing.assert_array_equal(interpret(model, [ids])[0], ref)


def test_a_shape_fed_as_a_graph_input_asks_for_it_and_folds_when_given():
    proto = make_model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="r0")],
                       [vi("x", F32, [2, 6]), vi("shape", I64, [2])], [vi("y", F32, [3, 4])])
    with pytest.raises(StaticInputNeeded) as err:
        from_onnx(proto)
    assert err.value.inputs == ("shape",) and "r0" in str(err.value)
    model = from_onnx(proto, constant_inputs={"shape": np.array([3, 4])})
    assert model.input_names == ["x"]
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    np.testing.assert_array_equal(interpret(model, [x])[0], x.reshape(3, 4))
    with pytest.raises(FrontendError, match="not inputs of the graph"):
        from_onnx(proto, constant_inputs={"nope": np.array([1])})


# --- weights -----------------------------------------------------------------------------


def test_initializers_become_named_weights_and_their_values_never_reach_the_ir_text():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    w[0, 0] = 1234.5678  # a value we can look for in the text
    b = np.full(32, 8765.4321, dtype=np.float32)
    small = np.array([2.5, -1.5], dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["x", "layer.w"], ["h"]), helper.make_node("Add", ["h", "layer.b"], ["y"]),
             helper.make_node("Mul", ["x2", "tiny"], ["z"])]
    proto = make_model(nodes, [vi("x", F32, ["n", 64]), vi("x2", F32, [2])],
                       [vi("y", F32, ["n", 32]), vi("z", F32, [2])],
                       initializers=[numpy_helper.from_array(w, "layer.w"), numpy_helper.from_array(b, "layer.b"),
                                     numpy_helper.from_array(small, "tiny")])
    model = from_onnx(proto)
    assert set(model.weights) == {"layer.w", "layer.b"}
    np.testing.assert_array_equal(model.weights["layer.w"], w)
    text = model.text
    assert '"layer.w"' in text and '"layer.b"' in text
    assert "1234.5" not in text and "8765.4" not in text
    assert "2.5" in text  # a 2-element initializer stays inline as a constant
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x2 = np.array([1.0, 2.0], dtype=np.float32)
    ref = run_ort(proto, {"x": x, "x2": x2})
    for want, got in zip(ref, interpret(model, [x, x2])):
        assert_close(want, got, "f32", reduction_length(model))


# --- ops ONNX defines as functions ---------------------------------------------------------


def test_an_op_onnx_defines_as_a_function_is_imported_through_its_body():
    """Attention (opset 23) has no converter of its own: its function body is expanded."""
    from onnx.reference import ReferenceEvaluator

    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1)
    proto = make_model([node], [vi("q", F32, [1, 2, 4, 8]), vi("k", F32, [1, 2, 6, 8]), vi("v", F32, [1, 2, 6, 8])],
                       [vi("y", F32, [1, 2, 4, 8])], opset=23)
    model = from_onnx(proto)
    rng = np.random.default_rng(2)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in
             [("q", (1, 2, 4, 8)), ("k", (1, 2, 6, 8)), ("v", (1, 2, 6, 8))]}
    (ref,) = ReferenceEvaluator(proto).run(None, feeds)
    assert_close(ref, interpret(model, feeds)[0], "f32", reduction_length(model))
    assert "tg.softmax" in tg_ops(model) or "tg.exp" in tg_ops(model)


def test_compositions_match_onnxruntime_on_a_small_conv_net():
    """Conv (SAME padding), BatchNorm, HardSwish, LpNormalization, Resize and Gemm together."""
    rng = np.random.default_rng(3)
    inits = {
        "w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3,
        "scale": rng.uniform(0.5, 1.5, 4).astype(np.float32), "bias": rng.standard_normal(4).astype(np.float32),
        "mean": rng.standard_normal(4).astype(np.float32) * 0.1, "var": rng.uniform(0.5, 2, 4).astype(np.float32),
        "scales": np.array([1, 1, 2, 2], dtype=np.float32),
        "fc": rng.standard_normal((10, 4 * 10 * 10)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], auto_pad="SAME_UPPER", strides=[1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["bn"], epsilon=1e-3),
        helper.make_node("HardSwish", ["bn"], ["h"]),
        helper.make_node("LpNormalization", ["h"], ["l"], axis=1, p=2),
        helper.make_node("Resize", ["l", "", "scales"], ["r"], mode="linear"),
        helper.make_node("Flatten", ["r"], ["f"]),
        helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1, alpha=0.5),
    ]
    proto = make_model(nodes, [vi("x", F32, [2, 3, 5, 5])], [vi("y", F32, [2, 10])],
                       initializers=[numpy_helper.from_array(v, k) for k, v in inits.items()], opset=19)
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    (ref,) = run_ort(proto, {"x": x})
    model = from_onnx(proto)
    assert_close(ref, interpret(model, [x])[0], "f32", reduction_length(model))


def _small_model():
    """MatMul, Add, Relu, Softmax, Reshape, Transpose, Unsqueeze, Conv and ReduceMean, with
    initializers of three element types: the fields a corrupted file gets wrong."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([2, 3, 2], np.int64), "shape"),
             numpy_helper.from_array(np.array([1], np.int64), "ax"),
             numpy_helper.from_array(rng.standard_normal((3, 1, 2, 2)).astype(np.float32), "cw")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Softmax", ["r"], ["s"], name="sm", axis=-1),
             helper.make_node("Reshape", ["s", "shape"], ["rs"], name="rs"),
             helper.make_node("Transpose", ["rs"], ["t"], name="tr", perm=[1, 0, 2]),
             helper.make_node("Unsqueeze", ["t", "ax"], ["u"], name="un"),
             helper.make_node("Conv", ["u", "cw"], ["c"], name="conv", pads=[0, 0, 1, 1]),
             helper.make_node("ReduceMean", ["c"], ["y"], name="rm", axes=[1], keepdims=0)]
    return make_model(nodes, [vi("x", F32, [2, 4])], [vi("y", F32, None)], inits)


def _corrupt(model, data) -> None:
    """One field of `model` set to a value a broken exporter or a damaged file could hold."""
    g = model.graph

    def pick(seq):
        return seq[data.draw(st.integers(0, len(seq) - 1))]

    odd = st.sampled_from([-5, -1, 0, 1, 3, 9, 2 ** 40])
    kind = data.draw(st.sampled_from(["dims", "dtype", "raw", "node input", "node output", "attribute",
                                      "drop node", "drop initializer", "input dim", "input dtype", "opset",
                                      "graph output"]))
    if kind == "dims" and (t := pick(g.initializer)).dims:
        t.dims[data.draw(st.integers(0, len(t.dims) - 1))] = data.draw(odd)
    elif kind == "dtype":
        pick(g.initializer).data_type = data.draw(st.sampled_from([0, 2, 6, 7, 9, 10, 11, 16, 40, 999]))
    elif kind == "raw":
        t = pick(g.initializer)
        t.raw_data = t.raw_data[:data.draw(st.integers(0, len(t.raw_data)))] + data.draw(st.binary(max_size=3))
    elif kind == "node input" and (n := pick(g.node)).input:
        n.input[data.draw(st.integers(0, len(n.input) - 1))] = data.draw(st.sampled_from(["", "nope", "x", "w", "y"]))
    elif kind == "node output":
        pick(g.node).output[0] = data.draw(st.sampled_from(["x", "w", "y", "m", ""]))
    elif kind == "attribute" and (n := pick(g.node)).attribute:
        a = pick(n.attribute)
        if a.ints:
            a.ints[data.draw(st.integers(0, len(a.ints) - 1))] = data.draw(odd)
        else:
            a.i = data.draw(odd)
    elif kind == "drop node":
        del g.node[data.draw(st.integers(0, len(g.node) - 1))]
    elif kind == "drop initializer":
        del g.initializer[data.draw(st.integers(0, len(g.initializer) - 1))]
    elif kind == "input dim":
        dim = g.input[0].type.tensor_type.shape.dim[data.draw(st.integers(0, 1))]
        dim.dim_param = data.draw(st.sampled_from(["B", "", "x y"]))
    elif kind == "input dtype":
        g.input[0].type.tensor_type.elem_type = data.draw(st.sampled_from([0, 2, 7, 9, 10, 11, 16, 999]))
    elif kind == "opset":
        model.opset_import[0].version = data.draw(st.sampled_from([0, 1, 6, 13, 18, 21, 99]))
    elif kind == "graph output":
        g.output[0].name = data.draw(st.sampled_from(["nope", "x", "w", "m", ""]))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_corrupted_file_imports_and_runs_or_is_a_frontend_error(data):
    """A damaged file, or one a broken exporter wrote, never raises from deep inside the
    project: it imports, compiles and runs, or the error is a TilegraphError naming the
    problem (a mutation fuzzer found an onnx KeyError this way)."""
    import tilegraph
    from tilegraph.ir.errors import TilegraphError
    from tilegraph.testing import random_inputs

    model = _small_model()
    for _ in range(data.draw(st.integers(1, 3))):
        _corrupt(model, data)
    try:
        compiled = tilegraph.compile(from_onnx(model.SerializeToString()))
        compiled(*random_inputs(compiled.model, seed=0))
    except TilegraphError as e:
        assert str(e)


def test_a_negative_conv_pad_is_an_error_naming_it():
    """Found by the corruption test above: pads=[-1, 0, 1, 1] on the small model's Conv
    imported, then failed inside the NumPy kernel. A window op's pads are never negative."""
    from tilegraph.ir.errors import TilegraphError

    model = _small_model()
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    conv.attribute[0].ints[:] = [-1, 0, 1, 1]
    with pytest.raises(TilegraphError, match=r"pads \(-1, 0, 1, 1\) must not be negative"):
        from_onnx(model.SerializeToString())


# --- folding at import keeps ONNX's shapes ------------------------------------------

# ONNX ops the importer folds when every input is known, each with the inputs it takes:
# a function of the drawn constant `a` (float32) and `i` (int64, same shape) to
# (inputs, attributes). Shapes are what onnx's reference evaluator gives.
def _scalar_index(a):
    return np.array(0, np.int64)


FOLDABLE = {
    "Neg": lambda a, i: ([i], {}),
    "Abs": lambda a, i: ([a], {}),
    "Sqrt": lambda a, i: ([np.abs(a)], {}),
    "Floor": lambda a, i: ([a], {}),
    "Cast": lambda a, i: ([i], {"to": TensorProto.FLOAT}),
    "Add": lambda a, i: ([i, i], {}),
    "Sub": lambda a, i: ([a, np.float32(1.5)], {}),
    "Mul": lambda a, i: ([i, np.array(3, np.int64)], {}),
    "Div": lambda a, i: ([a, np.float32(2.0)], {}),
    "Mod": lambda a, i: ([i, np.array(3, np.int64)], {}),
    "Max": lambda a, i: ([i, np.array(1, np.int64)], {}),
    "Equal": lambda a, i: ([i, np.array(1, np.int64)], {}),
    "Less": lambda a, i: ([a, np.float32(0.0)], {}),
    "Where": lambda a, i: ([a > 0, i, np.array(-1, np.int64)], {}),
    "Identity": lambda a, i: ([i], {}),
    "Shape": lambda a, i: ([a], {}),
    "Size": lambda a, i: ([a], {}),
    "Unsqueeze": lambda a, i: ([i, np.array([0], np.int64)], {}),
    "Reshape": lambda a, i: ([i, np.array([-1], np.int64)], {}),
    "Expand": lambda a, i: ([i, np.array([2] + [1] * i.ndim, np.int64)], {}),
    "ReduceSum": lambda a, i: ([i], {"keepdims": 0}),
    "ReduceMax": lambda a, i: ([a], {"keepdims": 1}),
    # On 1-d and n-d data only (a 0-d tensor has no axis to gather, squeeze or concatenate along).
    "Gather": lambda a, i: ([i, _scalar_index(i)], {"axis": 0}),
    "Squeeze": lambda a, i: ([i[:1], np.array([0], np.int64)], {}),
    "Concat": lambda a, i: ([i, i], {"axis": 0}),
    "Slice": lambda a, i: ([i, np.array([0], np.int64), np.array([1], np.int64)], {}),
    "Transpose": lambda a, i: ([i], {}),
}
NEEDS_AXIS = {"Gather", "Squeeze", "Concat", "Slice"}


@settings(max_examples=150, deadline=None)
@given(op=st.sampled_from(sorted(FOLDABLE)), shape=st.sampled_from([(), (1,), (3,), (2, 1, 3)]),
       seed=st.integers(0, 2**16))
def test_folding_at_import_gives_the_shapes_and_dtypes_of_onnx_reference_evaluator(op, shape, seed):
    """A node whose inputs are all Constants folds at import; the value it folds to has the shape,
    dtype and values onnx's reference evaluator gives, 0-d values staying 0-d (not (1,))."""
    from onnx.reference import ReferenceEvaluator

    if op in NEEDS_AXIS and not shape:
        shape = (3,)
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(np.float32)
    i = rng.integers(-5, 6, shape).astype(np.int64)
    inputs, attrs = FOLDABLE[op](a, i)
    nodes = [helper.make_node("Constant", [], [f"c{k}"], value=numpy_helper.from_array(np.asarray(v)))
             for k, v in enumerate(inputs)]
    nodes.append(helper.make_node(op, [f"c{k}" for k in range(len(inputs))], ["y"], **attrs))
    model = make_model(nodes, [], [helper.make_empty_tensor_value_info("y")])
    (expected,) = ReferenceEvaluator(model).run(None, {})
    imported = from_onnx(model)
    assert imported.outputs[0].shape == expected.shape
    assert imported.outputs[0].dtype == {"float32": "f32", "int64": "i64", "bool": "i1"}[expected.dtype.name]
    np.testing.assert_array_equal(interpret(imported, [], float64=False)[0], expected)


def test_a_scalar_output_imports_as_a_0d_tensor_and_a_wrong_declared_shape_is_an_error():
    """ReduceSum to a scalar: the declared shape () is what the IR says; a declared (1,) would be
    a mismatch the import reports rather than compiles."""
    nodes = [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)]
    model = from_onnx(make_model(nodes, [vi("x", F32, [3])], [vi("y", F32, [])]))
    assert model.outputs[0].shape == ()
    with pytest.raises(FrontendError, match=r"graph output 'y' is declared with shape \(1,\)"):
        from_onnx(make_model(nodes, [vi("x", F32, [3])], [vi("y", F32, [1])]))


def test_an_if_on_a_run_time_condition_runs_both_branches_and_selects_as_onnxruntime_does():
    """If, Loop and Scan are unrolled at import (the conformance suite holds the static cases);
    a condition known only at run time selects between branches of one type with where."""
    def branch(name, op, c):
        node = helper.make_node(op, ["x", f"{name}_c"], [f"{name}_y"])
        const = helper.make_node("Constant", [], [f"{name}_c"], value=numpy_helper.from_array(np.float32(c)))
        return helper.make_graph([const, node], name, [], [vi(f"{name}_y", F32, [3])])

    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=branch("then", "Add", 1.0),
                              else_branch=branch("else", "Mul", 2.0))]
    onnx_model = make_model(nodes, [vi("cond", TensorProto.BOOL, []), vi("x", F32, [3])], [vi("y", F32, [3])])
    model = from_onnx(onnx_model)
    assert "tg.where" in model.text
    x = np.array([1.0, -2.0, 3.5], np.float32)
    for c in (True, False):
        (ref,) = run_ort(onnx_model, {"cond": np.array(c), "x": x})
        np.testing.assert_array_equal(interpret(model, [np.array(c), x], float64=False)[0], ref)


def test_same_padding_with_stride_1_keeps_symbolic_spatial_dims_and_matches_onnxruntime():
    """auto_pad SAME_UPPER with stride 1 pads kernel - 1 whatever the size (the odd one at the end)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 2)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER")]  # onnxruntime: no dilation with SAME
    onnx_model = make_model(nodes, [vi("x", F32, [1, 3, "h", "w_"])], [vi("y", F32, [1, 4, "h", "w_"])], [w])
    model = from_onnx(onnx_model)
    assert model.outputs[0].shape == (1, 4, symbol("h"), symbol("w_"))
    for shape in [(1, 3, 5, 6), (1, 3, 8, 3)]:
        x = rng.standard_normal(shape).astype(np.float32)
        (ref,) = run_ort(onnx_model, {"x": x})
        assert_close(interpret(model, [x])[0], ref, "f32", 18)


# --- Resize on symbolic spatial dims ----------------------------------------------------------


def _symbolic_resize_model(mode, ctm, by_sizes, factors=(2, 3)):
    inits = [helper.make_tensor("roi", F32, [0], [])]
    if by_sizes:  # sizes computed from the input's Shape, as exporters write an upsample
        inits.append(helper.make_tensor("k", I64, [4], [1, 1, *factors]))
        nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Mul", ["s", "k"], ["sizes"]),
                 helper.make_node("Resize", ["x", "roi", "", "sizes"], ["y"], mode=mode,
                                  coordinate_transformation_mode=ctm)]
    else:
        inits.append(helper.make_tensor("scales", F32, [4], [1, 1, *factors]))
        nodes = [helper.make_node("Resize", ["x", "roi", "scales"], ["y"], mode=mode,
                                  coordinate_transformation_mode=ctm)]
    return make_model(nodes, [vi("x", F32, [1, 2, "H", "W"])], [vi("y", F32, None)], inits, opset=19)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("ctm,by_sizes", [("half_pixel", False), ("asymmetric", True), ("pytorch_half_pixel", True),
                                          ("half_pixel_symmetric", False)])
def test_resize_on_symbolic_spatial_dims_matches_onnxruntime_at_every_size(mode, ctm, by_sizes):
    """One import serves every H and W: the taps of an integer factor repeat with its period."""
    proto = _symbolic_resize_model(mode, ctm, by_sizes)
    model = from_onnx(proto)
    assert [str(d) for d in model.outputs[0].shape] == ["1", "2", "2*H", "3*W"]
    rng = np.random.default_rng(7)
    for h, w in ((3, 4), (5, 2), (1, 1)):
        x = rng.normal(size=(1, 2, h, w)).astype(np.float32)
        (want,) = run_ort(proto, {"x": x})
        (got,) = interpret(model, [x], float64=False)
        (exact,) = interpret(model, [x])
        assert got.shape == want.shape == (1, 2, 2 * h, 3 * w)
        assert_close(got, exact, "f32", reduction_length(model, {"H": h, "W": w}))
        assert relative_error(got, want) <= PEER_RELATIVE_ERROR


def test_resize_of_a_symbolic_dim_by_a_fraction_is_a_clear_error():
    with pytest.raises(FrontendError, match="only integer factors"):
        from_onnx(_symbolic_resize_model("linear", "half_pixel", False, factors=(1.5, 2)))


# --- RNN, GRU, LSTM over a symbolic number of steps --------------------------------------------


def _recurrent_model(kind, direction, layout=0, peepholes=False, lbr=0, seed=0):
    rng = np.random.default_rng(seed)
    gates, hidden, inputs = {"RNN": 1, "GRU": 3, "LSTM": 4}[kind], 3, 2
    dirs = 2 if direction == "bidirectional" else 1
    inits = [numpy_helper.from_array(rng.uniform(-1, 1, (dirs, gates * hidden, inputs)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.uniform(-1, 1, (dirs, gates * hidden, hidden)).astype(np.float32), "R"),
             numpy_helper.from_array(rng.uniform(-0.5, 0.5, (dirs, 2 * gates * hidden)).astype(np.float32), "B")]
    names = ["x", "W", "R", "B", "", "h0"]
    if peepholes:
        inits.append(numpy_helper.from_array(rng.uniform(-0.5, 0.5, (dirs, 3 * hidden)).astype(np.float32), "P"))
        names += ["", "P"]
    extra = {"linear_before_reset": lbr} if kind == "GRU" else {}
    outs = ["y", "yh"] + (["yc"] if kind == "LSTM" else [])
    node = helper.make_node(kind, names, outs, hidden_size=hidden, direction=direction, layout=layout, **extra)
    seq = ["B", "T", inputs] if layout else ["T", "B", inputs]
    h0 = ["B", dirs, hidden] if layout else [dirs, "B", hidden]
    return make_model([node], [vi("x", F32, seq), vi("h0", F32, h0)], [vi(o, F32, None) for o in outs], inits,
                      opset=14)


@pytest.mark.parametrize("kind,direction,layout,peepholes,lbr", [
    ("LSTM", "forward", 0, True, 0), ("LSTM", "bidirectional", 1, False, 0), ("GRU", "reverse", 0, False, 1),
    ("GRU", "bidirectional", 0, False, 0), ("RNN", "forward", 1, False, 0)])
def test_recurrences_over_a_symbolic_sequence_are_one_loop_op_and_match_onnxruntime(kind, direction, layout,
                                                                                   peepholes, lbr):
    proto = _recurrent_model(kind, direction, layout, peepholes, lbr)
    model = from_onnx(proto)
    loops = [op for op in model.func.walk() if getattr(op, "op_name", "") == "rnn"]
    assert len(loops) == (2 if direction == "bidirectional" else 1)  # not one copy per step
    import tilegraph

    compiled = tilegraph.compile(proto, target="c")
    rng = np.random.default_rng(1)
    dirs = 2 if direction == "bidirectional" else 1
    for steps in (1, 4, 9):
        x = rng.normal(size=(2, steps, 2) if layout else (steps, 2, 2)).astype(np.float32)
        h0 = rng.normal(size=(2, dirs, 3) if layout else (dirs, 2, 3)).astype(np.float32)
        if layout:  # onnxruntime has no batch-first recurrences: the same weights time-major, transposed
            want = run_ort(_recurrent_model(kind, direction, 0, peepholes, lbr),
                           {"x": x.transpose(1, 0, 2), "h0": h0.transpose(1, 0, 2)})
            want = [want[0].transpose(2, 0, 1, 3)] + [v.transpose(1, 0, 2) for v in want[1:]]
        else:
            want = run_ort(proto, {"x": x, "h0": h0})
        exact = interpret(model, [x, h0])
        for got in (interpret(model, [x, h0], float64=False), compiled.run(x, h0)):
            for g, w, e in zip(got, want, exact):
                assert g.shape == w.shape
                assert_close(g, e, "f32", reduction_length(model, {"T": steps, "B": 2}))
                assert relative_error(g, w) <= PEER_RELATIVE_ERROR


# --- SAME padding with stride > 1 on symbolic spatial dims -------------------------------------


def _same_model(op, auto, k, s):
    rng = np.random.default_rng(3)
    inits, extra = [], {}
    if op == "Conv":
        inits.append(numpy_helper.from_array(rng.normal(size=(3, 2, k, k)).astype(np.float32), "w"))
    node = helper.make_node(op, ["x", "w"] if op == "Conv" else ["x"], ["y"], auto_pad=auto, strides=[s, s],
                            kernel_shape=[k, k], **extra)
    return make_model([node], [vi("x", F32, [1, 2, "H", "W"])], [vi("y", F32, None)], inits)


@pytest.mark.parametrize("op,auto,k,s", [("Conv", "SAME_UPPER", 3, 2), ("Conv", "SAME_LOWER", 3, 2),
                                         ("Conv", "SAME_UPPER", 4, 3), ("MaxPool", "SAME_UPPER", 3, 2),
                                         ("MaxPool", "SAME_LOWER", 2, 2)])
def test_same_padding_with_a_stride_on_symbolic_dims_matches_onnxruntime_at_every_size(op, auto, k, s):
    """The padding depends on the size modulo the stride: found at run time, one import for all sizes."""
    proto = _same_model(op, auto, k, s)
    model = from_onnx(proto)
    rng = np.random.default_rng(4)
    for h, w in ((5, 6), (7, 4), (8, 9), (3, 3)):
        x = rng.normal(size=(1, 2, h, w)).astype(np.float32)
        (want,) = run_ort(proto, {"x": x})
        (got,) = interpret(model, [x], float64=False)
        assert got.shape == want.shape == (1, 3 if op == "Conv" else 2, -(-h // s), -(-w // s))
        assert_close(got, interpret(model, [x])[0], "f32", 2 * k * k)
        assert relative_error(got, want) <= PEER_RELATIVE_ERROR


def test_a_symbolic_shape_value_floors_a_negative_numerator():
    """Regression: floor(1/2 - H/2) (sympy's form of part of a SAME padding) was computed by the
    truncating integer div, 1 too high for even H."""
    from tilegraph.frontends.onnx.importer import _Importer
    from tilegraph.ir import Graph

    H = symbol("H")
    imp = _Importer.__new__(_Importer)
    imp.g = Graph()
    x = imp.g.input("x", ("H",), "f32")
    value = imp.symbolic_tensor(np.array(sympy.floor((1 - H) / 2), dtype=object), "a test value")
    model = imp.g.build(value, x)
    for h in range(1, 7):
        assert int(interpret(model, [np.zeros(h, np.float32)])[0]) == (1 - h) // 2


@pytest.mark.parametrize("size", [3, 5])
def test_lrn_matches_onnxruntime_with_an_alpha_large_enough_to_matter(size):
    """LRN divides alpha by the window size: with the default alpha (1e-4) the difference hides
    under the tolerance, so a large alpha and inputs of magnitude ~3 make it show."""
    node = helper.make_node("LRN", ["x"], ["y"], size=size, alpha=0.5, beta=0.75, bias=1.0)
    proto = make_model([node], [vi("x", F32, [2, 6, 4, 4])], [vi("y", F32, [2, 6, 4, 4])])
    x = np.random.default_rng(4).standard_normal((2, 6, 4, 4)).astype(np.float32) * 3
    model = from_onnx(proto)
    (want,) = run_ort(proto, {"x": x})
    assert_close(want, interpret(model, [x])[0], "f32", reduction_length(model))
