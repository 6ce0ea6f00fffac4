"""Shapes from a stranger's file are checked where they are made, so the C backend never
writes or reads outside its buffers: a static dim is never negative and a rank never past
what oneDNN's arrays hold (every type made or read, `ir.shapes.check_dims`); every symbolic
dim is a non-negative integer at a call's sizes, checked once per shape binding before any
C runs (`ir.signature.SizeConditions`); views lie inside their buffers; attention's block
sizes are checked where the IR is read; and no kernel writes into an array the caller owns.

Each model below is an attacker's file: on the code before these checks each
wrote outside a buffer (a crash, heap corruption) or returned a truncated or wrong answer.
"""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tilegraph
from tilegraph.ir import interpret
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import ModelError
from tilegraph.ir.shapes import MAX_RANK
from tilegraph.testing import assert_close

TARGETS = ["c", "numpy"]


def _onnx(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


STATIC = {
    # Tile by -3 then Concat: the concat wrote before its output array ("double free or corruption")
    "tile with a negative repeat": _onnx(
        [helper.make_node("Tile", ["x", "r"], ["t"], name="tile"), helper.make_node("Concat", ["t", "x"], ["y"], axis=0)],
        [_f32("x", [2, 3])], [_f32("y", None)], [_ints("r", [-3, 1])]),
    # Split sizes -2 and 6 of 4 rows: read before and past the input
    "split with negative sizes": _onnx(
        [helper.make_node("Split", ["x", "s"], ["a", "b"], axis=0, name="split")],
        [_f32("x", [4, 3])], [_f32("a", None), _f32("b", None)], [_ints("s", [-2, 6])]),
}


@pytest.mark.parametrize("case", STATIC)
def test_a_negative_static_dimension_is_refused_where_its_op_is_imported(case):
    with pytest.raises(TilegraphError, match="negative dimension"):
        tilegraph.import_model(STATIC[case])


@pytest.mark.parametrize("indices,axis", [((2, 5), 0), ((4, 1), 1)])
def test_gather_elements_indices_longer_than_the_data_off_the_axis_are_refused(indices, axis):
    """Off the axis, an index position past the data's length has no element to read (onnxruntime
    and torch.gather refuse it); it was accepted and failed in the kernel, or broadcast."""
    with pytest.raises(TilegraphError, match="gather_elements.*longer than"):
        tilegraph.import_model(_onnx([helper.make_node("GatherElements", ["x", "i"], ["y"], axis=axis)],
                                     [_f32("x", [3, 2]), helper.make_tensor_value_info("i", TensorProto.INT64, indices)],
                                     [_f32("y", None)]))


def _tile(x_shape, repeats):
    return _onnx([helper.make_node("Tile", ["x", "r"], ["y"], name="tile")], [_f32("x", x_shape)], [_f32("y", None)],
                 [_ints("r", repeats)])


@pytest.mark.parametrize("repeats", [[1, 2, 2 ** 61], [2 ** 30, 2 ** 30, 1]])
def test_a_static_size_past_any_memory_is_refused_where_its_op_is_imported(repeats):
    """Tile by 2^61 of a (1, 4, 1) input: np.tile crashed the process (SIGSEGV; found by the
    shapes fuzz kind). Every type goes through the same check, whichever op makes it."""
    with pytest.raises(TilegraphError, match="more than 2"):
        tilegraph.import_model(_tile([1, 4, 1], repeats))


@pytest.mark.parametrize("target", TARGETS)
def test_a_symbolic_size_past_any_memory_is_refused_at_its_binding(target):
    """Tile by 2^62 along a length L: at L = 1 its 2^62 * 8 elements crashed np.tile, and at
    L = 3 the dim is past int64. Refused at the binding, before any kernel runs."""
    f = tilegraph.compile(tilegraph.import_model(_tile([1, 4, "L"], [1, 2, 2 ** 62])), target=target)
    for length in (1, 3):
        with pytest.raises(ModelError, match=f"L={length}: .*more than 2\\^56"):
            f(np.ones((1, 4, length), np.float32))
    small = tilegraph.compile(tilegraph.import_model(_tile([1, 4, "L"], [1, 2, 3])), target=target)
    x = np.random.default_rng(0).standard_normal((1, 4, 2)).astype(np.float32)
    assert_close(_one(small(x)), np.tile(x.astype(np.float64), (1, 2, 3)), "f32", 1)


@pytest.mark.parametrize("op", ["MatMul", "Conv"])
def test_a_rank_past_what_onednn_holds_is_refused_before_any_backend(op):
    """A batched MatMul (or a Conv) of rank 13 overflowed a 12-entry array in runtime.c."""
    shape = [1] * (MAX_RANK - 1) + [2, 2]
    nodes = [helper.make_node(op, ["x", "x"], ["y"])]
    with pytest.raises(TilegraphError, match=f"rank {MAX_RANK + 1}"):
        tilegraph.compile(_onnx(nodes, [_f32("x", shape)], [_f32("y", None)]), target="c")


# Calls runtime.c's entry points as a module would, through ctypes on the built runtime, with
# arguments no verified IR produces: what an edited module could pass. A child process, so
# that a write past the runtime's arrays (the code before its check) cannot take pytest down.
_RUNTIME_CALL = """
import ctypes, sys
from tilegraph.backends.c.build import runtime

lib = ctypes.CDLL(str(runtime()))
lib.tg_error.restype = ctypes.c_char_p
ones = (ctypes.c_int64 * 32)(*[1] * 32)  # the caller's arrays are long enough: only the runtime's are not
f32 = (ctypes.c_int * 3)(3, 3, 3)  # dnnl_f32
prim, pack, posts = (ctypes.create_string_buffer(1 << 16) for _ in range(3))
what, nd, npost = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if what == "matmul":
    rc = lib.tg_matmul_create(prim, nd, ones, ones, ones, ones, ones, ones, f32, 0, None, pack, npost, posts)
else:
    rc = lib.tg_conv_create(prim, nd, ones, ones, nd, ones, ones, ones, ones, 0, ones, ones, ones, None, pack,
                            npost, posts, None, 0, 0)
print("rc", rc, lib.tg_error().decode())
"""


@pytest.mark.parametrize("call,message", [
    (("matmul", 13, 0), "a matmul of rank 13: the C runtime takes ranks 2 to 12"),
    (("convolution", 13, 0), "a convolution of rank 13: the C runtime takes ranks 3 to 12"),
    (("convolution", 15, 0), "a convolution of rank 15"),  # its 13 spatial dims: past the pads' array too
    (("matmul", 2, 9), "a matmul with 9 post-ops: the C runtime takes at most 8"),
    (("matmul", 2, 0), None),  # a 1x1 GEMM: the check lets through what the runtime holds
])
def test_the_c_runtime_refuses_ranks_past_its_arrays_when_called_directly(call, message):
    """The IR refuses rank 13 first (above), so no model reaches runtime.c's own check: a
    module not emitted from verified IR (an edited cache entry) calls it with a rank-13 (or a
    nine-post-op) descriptor. Before the check, its 12-entry stack arrays were written past."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _RUNTIME_CALL, *map(str, call)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]  # no signal, no abort
    if message is None:
        assert done.stdout.startswith("rc 0"), done.stdout
    else:
        assert done.stdout.startswith("rc 1") and message in done.stdout, done.stdout


def _pool_then_concat():
    """A window of 4 over a length L bound at call time: at L = 2 the pool's L - 3 is
    negative; the concat after it wrote outside its output, and the sum returned a number."""
    return _onnx([helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[4], name="pool"),
                  helper.make_node("Concat", ["p", "x"], ["c"], axis=2, name="cat"),
                  helper.make_node("ReduceSum", ["c"], ["y"], keepdims=0, name="sum")],
                 [_f32("x", [1, 1, "L"])], [_f32("y", None)])


def _reshape_minus_one():
    """Reshape(x, [-1, 2]) of a (B, 3) input: at an odd B, 3*B/2 is no size (it was truncated
    and the rows past it were uninitialized memory)."""
    return _onnx([helper.make_node("Reshape", ["x", "s"], ["y"], name="reshape")],
                 [_f32("x", ["B", 3])], [_f32("y", None)], [_ints("s", [-1, 2])])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("make,bad,good,message", [
    (_pool_then_concat, (1, 1, 2), (1, 1, 9), r"L=2.*L - 3 = -1"),
    (_reshape_minus_one, (3, 3), (4, 3), r"B=3.*3\*B/2 = 9/2"),
])
def test_symbolic_sizes_are_checked_at_each_binding_before_any_kernel_runs(target, make, bad, good, message):
    model = tilegraph.import_model(make())
    f = tilegraph.compile(model, target=target)
    x = np.random.default_rng(0).standard_normal(good).astype(np.float32)
    assert_close(_one(f(x)), interpret(model, [x])[0], "f32", 4)
    with pytest.raises(ModelError, match=message if target == "c" else None):
        f(np.ones(bad, np.float32))
    assert_close(_one(f(x)), interpret(model, [x])[0], "f32", 4)  # a refused binding leaves the model usable


def _one(out):
    return out if isinstance(out, np.ndarray) else out[0]


def _attention_mlir(tmp_path, block_q):
    from tilegraph.ir.builder import Graph

    g = Graph()
    q, k, v = (g.input(n, (2, "S", 8)) for n in "qkv")
    model = tilegraph.compile(g.build(g.attention(q, k, v)), target="c").model
    text = str(model)
    assert "block_q = " in text
    path = tmp_path / "attention.mlir"
    path.write_text(text.replace(text[text.index("block_q = "):].split(" :")[0], f"block_q = {block_q}"))
    return path


@pytest.mark.parametrize("block", [0, -3, 2 ** 62])
def test_attention_block_sizes_read_from_a_file_are_checked(tmp_path, block):
    """Block sizes of 0, 2^62 or negative crashed with SIGFPE, overflowed the heap, or
    returned uninitialized memory."""
    path = _attention_mlir(tmp_path, block)
    x = np.ones((2, 5, 8), np.float32)
    with pytest.raises(TilegraphError, match="block"):
        tilegraph.compile(str(path), target="c", pipeline="")(x, x, x)


IN_PLACE = """builtin.module {
  func.func @forward(%x: tensor<8x8xf32> {tg.name = "x"}) -> (tensor<8x8xf32> {tg.name = "a"}, tensor<8x8xf32> {tg.name = "b"}) {
    %0 = tg.weight {name = "w"} : tensor<8x8xf32>
    %1, %2 = tg.fusion "matmul" (%3 = %x, %4 = %0) {tile = {}} : tensor<8x8xf32>, tensor<8x8xf32> {
      %5 = tg.matmul %4, %4 : tensor<8x8xf32>
      %6 = tg.softmax %3 : tensor<8x8xf32>
      tg.yield %5, %6
    }
    func.return %1, %2 : tensor<8x8xf32>, tensor<8x8xf32>
  }
}
"""


def test_a_crafted_fusion_never_runs_a_kernel_in_place_on_the_callers_array(tmp_path):
    """A softmax in a GEMM's group reading the group's argument ran in place on it: the
    caller's input array came back overwritten."""
    path = tmp_path / "inplace.mlir"
    path.write_text(IN_PLACE)
    np.savez(tmp_path / "inplace.weights.npz", w=np.eye(8, dtype=np.float32))
    x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    keep = x.copy()
    try:
        f = tilegraph.compile(str(path), target="c", pipeline="")
        out = f(x)
    except ModelError as e:
        assert "never writes into an array it is given" in str(e)
    else:
        expected = interpret(f.model, [keep])
        for got, want in zip(out, expected):
            assert_close(got, want, "f32", 8)
    np.testing.assert_array_equal(x, keep)
