"""Bad files are named errors with exit status 2 and no partial output, from every command:
each case below was a traceback, or was accepted and computed something, before these checks.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tilegraph.cli import main


def _f32(name, shape, t=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, t, shape)


def _save(path, nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


def _external(tmp_path, offset, length):
    (tmp_path / "w.bin").write_bytes(np.zeros(16, np.float32).tobytes())
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4, 4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "w.bin"), ("offset", offset), ("length", length)):
        w.external_data.add(key=key, value=value)
    return _save(tmp_path / "m.onnx", [helper.make_node("MatMul", ["x", "w"], ["y"])], [_f32("x", [1, 4])],
                 [_f32("y", None)], [w])


BAD = {
    "external data offset past the file": (lambda p: _external(p, "1000", "64"), "external data"),
    "negative external data offset": (lambda p: _external(p, "-8", "64"), "external data"),
    "two nodes writing one value": (lambda p: _save(p / "m.onnx", [helper.make_node("Relu", ["x"], ["y"]),
                                                                   helper.make_node("Neg", ["x"], ["y"])],
                                                    [_f32("x", [2])], [_f32("y", None)]), "one writer"),
    "a node writing a graph input": (lambda p: _save(p / "m.onnx", [helper.make_node("Relu", ["x"], ["x"])],
                                                     [_f32("x", [2])], [_f32("x", None)]), "one writer"),
    "an unknown opset version": (lambda p: _save(p / "m.onnx", [helper.make_node("Relu", ["x"], ["y"])],
                                                 [_f32("x", [2])], [_f32("y", None)], opset=99), "opset 99"),
    # uint64 ids past the signed range read as -1, a valid index from the end
    "unsigned gather indices": (lambda p: _save(
        p / "m.onnx", [helper.make_node("Add", ["ids", "ids"], ["i"]), helper.make_node("Gather", ["e", "i"], ["y"])],
        [_f32("ids", [2], TensorProto.UINT64)], [_f32("y", None)],
        [numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "e")]), "signed integers"),
}


def _run(capsys, *argv):
    code = main(list(map(str, argv)))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("command", ["import", "compile", "check", "cost"])
def test_a_bad_model_is_a_named_error_from_every_command(tmp_path, capsys, case, command):
    make, message = BAD[case]
    path = make(tmp_path)
    argv = {"import": ["import", path, "-o", tmp_path / "out.mlir"],
            "compile": ["compile", path, "-o", tmp_path / "out.py"],
            "check": ["check", path], "cost": ["cost", path, "--hardware", "cpu"]}[command]
    code, err = _run(capsys, *argv)
    assert code == 2 and message in err, err
    assert not any(tmp_path.glob("out*")), "a refused model left output behind"


def test_a_float_in_an_integer_array_attribute_of_a_mlir_file_is_refused(tmp_path, capsys):
    path = tmp_path / "m.mlir"
    path.write_text('builtin.module {\n  func.func @forward(%x: tensor<1x1x8xf32> {tg.name = "x"}) -> '
                    '(tensor<1x1x5xf32> {tg.name = "y"}) {\n    %0 = tg.max_pool %x {kernel = array<f64: 4.0>, '
                    'strides = array<i64: 1>, pads = array<i64: 0, 0>, dilations = array<i64: 1>} : '
                    'tensor<1x1x5xf32>\n    func.return %0 : tensor<1x1x5xf32>\n  }\n}\n')
    code, err = _run(capsys, "compile", path, "-o", tmp_path / "out.py")
    assert code == 2 and "array of integers" in err


def test_a_zero_size_batched_matmul_is_costed(tmp_path, capsys):
    path = _save(tmp_path / "m.onnx", [helper.make_node("MatMul", ["a", "b"], ["y"])],
                 [_f32("a", [2, 3, 4]), _f32("b", [2, 4, 0])], [_f32("y", None)])
    code, err = _run(capsys, "cost", path, "--hardware", "cpu")
    assert code == 0, err


def test_check_says_when_onnxruntime_refuses_the_model(tmp_path, capsys):
    path = _save(tmp_path / "m.onnx", [helper.make_node("Relu", ["x"], ["y"])], [_f32("x", [2])], [_f32("y", None)])
    proto = onnx.load(path)
    proto.ir_version = 99  # tilegraph reads it; onnxruntime refuses the IR version
    onnx.save(proto, path)
    code, err = _run(capsys, "check", path)
    assert code == 2 and "onnxruntime cannot run" in err


def test_compile_leaves_no_module_when_its_weights_cannot_be_written(tmp_path, capsys):
    path = _save(tmp_path / "m.onnx", [helper.make_node("MatMul", ["x", "w"], ["y"])], [_f32("x", [1, 4])],
                 [_f32("y", None)], [numpy_helper.from_array(np.ones((4, 4), np.float32), "w")])
    (tmp_path / "out.weights.npz").mkdir()  # where the weights would go: a folder
    code, err = _run(capsys, "compile", path, "-o", tmp_path / "out.py")
    assert code == 2 and "out.weights.npz" in err
    assert not (tmp_path / "out.py").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
