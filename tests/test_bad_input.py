"""Bad input a user can give, each a named error (exit 2, no traceback) or the right
behaviour, never a traceback from deep inside or a silent wrong answer."""

import io
from pathlib import Path

import numpy as np
import pytest

import tilegraph
from tilegraph.cli import main as tilegraph_main
from tilegraph.ir import Graph
from tilegraph.ir.errors import TilegraphError
from tilegraph.opt import main as opt_main
from tests.test_cli import EXAMPLE, assert_clean_error, run, small_model


def _embedding_model():
    g = Graph()
    ids = g.input("ids", ("B", 5), "i64")
    table = g.weight("table", np.random.default_rng(0).random((10, 4)).astype(np.float32))
    return g.build(g.gather(table, ids), names=["y"])


@pytest.mark.parametrize("target", ["numpy", "triton"])
def test_ids_outside_an_embedding_table_name_the_input_the_op_and_the_range(target):
    """Was a bare IndexError from inside the emitted module (onnxruntime names all three)."""
    compiled = tilegraph.compile(_embedding_model(), target=target)
    assert compiled.run(np.array([[0, 1, 9, -10, -1]]))[0].shape == (1, 5, 4)  # negative ids count from the end
    with pytest.raises(TilegraphError, match=r"input 'ids' holds 10 at \[0, 4\], outside the valid range "
                                             r"\[-10, 9\] of the tg.gather"):
        compiled.run(np.array([[1, 2, 3, 4, 10]]))


def test_a_symbolic_dimension_of_size_zero_is_refused_naming_it():
    """Sequence length 0 was `ValueError: cannot reshape array of size 0` in the emitted code."""
    compiled = tilegraph.compile(_embedding_model())
    with pytest.raises(TilegraphError, match="input 'ids' has B = 0"):
        compiled.run(np.zeros((0, 5), np.int64))


def test_an_error_inside_the_emitted_code_names_the_emitted_line(capsys):
    """check --dim seq=600 on a model with a 128-position table: an index past the table,
    inside the module (the C backend's gather refuses it), names the step."""
    code, _, err = run(tilegraph_main, ["check", EXAMPLE, "--dim", "seq=600", "--dim", "batch=1"], capsys)
    assert_clean_error(code, err, "the model cannot run on these inputs, at `gather", "128")


def test_compile_api_arguments_of_the_wrong_kind_are_named_errors():
    model = small_model_in_memory()
    with pytest.raises(TilegraphError, match="pipeline must be a string"):
        tilegraph.compile(model, pipeline=5)
    with pytest.raises(TilegraphError, match="target 'numpy' takes no option autotune"):
        tilegraph.compile(model, target="numpy", autotune=True)


def small_model_in_memory():
    g = Graph()
    x = g.input("x", ("B", 4))
    return g.build(g.relu(x), names=["y"])


def test_a_binary_mlir_file_is_a_named_error_in_both_commands(tmp_path, capsys):
    path = tmp_path / "bin.mlir"
    path.write_bytes(b"builtin.module {\xff\xfe\x00}")
    for main, argv in ((tilegraph_main, ["compile", path, "-o", tmp_path / "o.py"]), (opt_main, [path])):
        code, _, err = run(main, argv, capsys)
        assert_clean_error(code, err, "is not tg IR text", "0xff", "offset 16")


def _encrypted_npz() -> bytes:
    """An .npz whose member is flagged encrypted (general purpose bit 0): zipfile raised a
    RuntimeError asking for a password (found by tilegraph/fuzz.py, npz seed 21 case 913)."""
    buf = io.BytesIO()
    np.savez(buf, x=np.zeros((8, 4), np.float32))
    data = bytearray(buf.getvalue())
    for signature, flags in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # local header, central directory
        at = data.index(signature) + flags
        data[at] |= 1
    return bytes(data)


@pytest.mark.parametrize("content,needle", [(b"PK\x03\x04 not a zip", "BadZipFile"),
                                            (None, "is a single .npy array"),
                                            ("encrypted", "is encrypted")])
def test_a_corrupt_or_npy_weights_or_calibration_file_is_a_named_error(tmp_path, capsys, content, needle):
    model = small_model(tmp_path)
    bad = tmp_path / "bad.npz"
    if content == "encrypted":
        bad.write_bytes(_encrypted_npz())
    elif content is None:
        np.save(tmp_path / "a.npy", np.zeros(3))
        (tmp_path / "a.npy").rename(bad)
    else:
        bad.write_bytes(content)
    code, _, err = run(tilegraph_main, ["quantize", model, "--calib", bad, "-o", tmp_path / "q.mlir"], capsys)
    assert_clean_error(code, err, str(bad), needle)
    bad.replace(model.with_suffix(".weights.npz"))
    code, _, err = run(tilegraph_main, ["compile", model, "-o", tmp_path / "o.py"], capsys)
    assert_clean_error(code, err, needle)


def test_an_onnx_file_whose_external_data_is_missing_is_a_named_error(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), path, save_as_external_data=True, location="m.data", size_threshold=0)
    (tmp_path / "m.data").unlink()
    code, _, err = run(tilegraph_main, ["compile", path, "-o", tmp_path / "o.py"], capsys)
    assert_clean_error(code, err, "m.data")


@pytest.mark.parametrize("argv,needle", [
    (["check", EXAMPLE, "--seed", "-1"], "--seed: must be >= 0"),
    (["check", EXAMPLE, "--int-high", "0"], "--int-high: must be >= 1"),
    (["check", EXAMPLE, "--dim", "batch=2", "--dim", "batch=3"], "--dim batch is given twice"),
    (["check", EXAMPLE, "--dim", "batch=²"], "--dim takes NAME=SIZE"),
])
def test_bad_option_values_are_refused(argv, needle, capsys):
    with pytest.raises(SystemExit) if "must be" in needle else _no_raise():
        code, _, err = run(tilegraph_main, argv, capsys)
        assert_clean_error(code, err, needle)
    if "must be" in needle:  # argparse's own refusal: usage and one error line, exit 2
        assert needle in capsys.readouterr().err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("command", ["compile", "import", "export"])
def test_no_command_writes_over_the_model_it_reads(tmp_path, capsys, command):
    """`tilegraph compile m.onnx -o m.onnx` replaced the model with Python source, exit 0."""
    path = tmp_path / "m.onnx"
    path.write_bytes(EXAMPLE.read_bytes())
    code, _, err = run(tilegraph_main, [command, path, "-o", path], capsys)
    assert_clean_error(code, err, "would overwrite the model being read")
    assert path.read_bytes() == EXAMPLE.read_bytes()
    mlir = small_model(tmp_path)
    code, _, err = run(tilegraph_main, ["quantize", mlir, "--scheme", "w8", "-o", mlir], capsys)
    assert_clean_error(code, err, "would overwrite the model being read")


def test_compile_never_writes_over_the_weights_of_the_mlir_it_reads(tmp_path, capsys):
    """`tilegraph compile m.mlir -o m.py` replaced m.weights.npz, m.mlir's own weights, with the
    weights after the passes (fuse concatenates sibling weights, quantize adds new ones): m.mlir
    no longer loaded, or loaded with the wrong arrays."""
    mlir = small_model(tmp_path)
    weights = mlir.with_suffix(".weights.npz")
    before = weights.read_bytes()
    code, _, err = run(tilegraph_main, ["compile", mlir, "-o", mlir.with_suffix(".py")], capsys)
    assert_clean_error(code, err, "small.weights.npz would overwrite the weights of the model being read")
    assert weights.read_bytes() == before and not mlir.with_suffix(".py").exists()
    code, _, err = run(tilegraph_main, ["compile", mlir, "-o", tmp_path / "small_np.py"], capsys)
    assert code == 0, err
    assert weights.read_bytes() == before and (tmp_path / "small_np.weights.npz").is_file()


def test_calibration_samples_that_are_not_finite_are_refused(tmp_path, capsys):
    """NaN samples gave a broken quantized model, exit 0."""
    model = small_model(tmp_path)
    samples = np.random.default_rng(0).random((8, 4)).astype(np.float32)
    samples[3, 1] = np.nan
    np.savez(tmp_path / "calib.npz", x=samples)
    code, _, err = run(tilegraph_main, ["quantize", model, "--calib", tmp_path / "calib.npz", "-o",
                                        tmp_path / "q.mlir"], capsys)
    assert_clean_error(code, err, "input x holds 1 NaN or infinite value")
    assert not (tmp_path / "q.mlir").exists()


def test_opt_refuses_a_frontend_that_disagrees_with_the_file(tmp_path, capsys):
    """`tilegraph-opt -f onnx x.mlir` silently read the file as .mlir."""
    code, _, err = run(opt_main, ["-f", "onnx", small_model(tmp_path)], capsys)
    assert code == 2 and "-f onnx" in err and "is not a .onnx file" in err and "Traceback" not in err


@pytest.mark.parametrize("output", ["2", "a{", "llvm", "riscv-asm", "mlir{x=1}"])
def test_opt_prints_tg_ir_only_and_refuses_any_other_output_format(tmp_path, capsys, output):
    """xDSL's -t picks an output format: a value that is not a name ("2") raised xDSL's parse
    error as a traceback (found by the cli fuzz kind), and its other formats either import a
    package tilegraph does not ship (llvm) or print something that is not tg IR."""
    with pytest.raises(SystemExit) as e:
        opt_main([str(small_model(tmp_path)), "-t", output])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "-t/--target" in err and "Traceback" not in err, err
    code, out, _ = run(opt_main, [small_model(tmp_path), "-t", "mlir"], capsys)
    assert code == 0 and "tg.relu" in out


def test_ctrl_c_exits_quietly_with_130(capsys, monkeypatch):
    import tilegraph.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "compile", interrupted)
    code, out, err = run(tilegraph_main, ["compile", EXAMPLE, "-o", "x.py"], capsys)
    assert code == 130 and err == "tilegraph compile: interrupted\n" and not Path("x.py").exists()


def test_check_draws_ids_below_the_table_and_masks_in_0_1():
    """check --int-high N took `a % N` of values already in [0, 4): masks of 2s and 3s made
    (1 - mask) * finfo.min overflow to NaN."""
    from tilegraph.testing import random_inputs

    model = tilegraph.import_model(str(EXAMPLE))
    ids, mask = random_inputs(model, seed=0, sizes={"batch": 4, "seq": 64}, int_high=2)
    assert mask.min() >= 0 and mask.max() <= 1
    assert ids.max() >= 2 and ids.max() < 1000  # the tiny encoder's table: ids span it, not just {0, 1}


def test_cost_symbolic_on_the_cpu_target_finishes_with_a_formula():
    """`tilegraph cost --hardware cpu --symbolic` (a README command) sat in sympy.simplify's
    piecewise_fold for minutes on the bundled tiny encoder, 14 on MiniLM."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tilegraph.cli", "cost", str(EXAMPLE), "--hardware", "cpu",
                           "--symbolic"], capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 0, done.stderr
    assert "time [s] = " in done.stdout and "batch*seq" in done.stdout


def test_mixed_precision_says_how_many_layers_got_which_format(tmp_path, capsys):
    """It printed 'quantized 36 linear layers (mxfp4, mixed with w8a8 and float)' when no layer
    got mxfp4, and the same on --hardware cpu when 0 of 36 were quantized."""
    model = small_model(tmp_path)
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).random((8, 4)).astype(np.float32))
    code, out, err = run(tilegraph_main, ["quantize", model, "--calib", tmp_path / "calib.npz", "--scheme", "w8",
                                          "--fallback", "w8a8", "--max-error", "0.1", "--hardware", "cpu",
                                          "-o", tmp_path / "q.mlir"], capsys)
    assert code == 0, err
    assert "quantized 0 of 1 linear layers (1 float; chosen for cpu" in out, out


@pytest.mark.parametrize("pipeline", ["constant-fold{max-elements=-5}", "tile{max-rows=-1}", "fuse{max-ops=-3}"])
def test_a_negative_count_option_is_refused(pipeline):
    from tilegraph.passes.registry import parse_pipeline

    with pytest.raises(TilegraphError, match=r"(max-elements|max-rows|max-ops)\b.*-\d"):
        parse_pipeline(pipeline)


def test_opt_says_when_new_weights_are_saved_nowhere(tmp_path, capsys):
    code, out, err = run(opt_main, [small_model(tmp_path), "-p", "quantize{scheme=w8}"], capsys)
    assert code == 0 and "tg.weight" in out
    assert "new weight(s)" in err and "saved only with -o" in err
    code, out, err = run(opt_main, [small_model(tmp_path), "-p", "quantize{scheme=w8}", "-o", tmp_path / "q.mlir"],
                         capsys)
    assert code == 0 and "new weight" not in err


def test_the_triton_target_without_a_gpu_is_safe_to_call_from_several_threads():
    """7 of 20 concurrent calls raised Triton's InterpreterError: its interpreter keeps launch
    state in globals, so without a GPU calls are serialized."""
    from concurrent.futures import ThreadPoolExecutor

    g = Graph()
    x = g.input("x", ("B", 16))
    w = g.weight("w", np.random.default_rng(0).random((16, 16)).astype(np.float32))
    compiled = tilegraph.compile(g.build(g.softmax(g.relu(x @ w)), names=["y"]), target="triton")
    inputs = [np.random.default_rng(i).random((4, 16)).astype(np.float32) for i in range(12)]
    expected = [compiled.run(a)[0] for a in inputs]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda a: compiled.run(a)[0], inputs))
    for e, a in zip(expected, got):
        np.testing.assert_array_equal(a, e)


def test_shard_reports_the_budget_it_was_given_and_marks_a_tied_runner_up(tmp_path, capsys):
    """It printed '(of 80 GB)' under --memory 40GB, and a runner-up equal to the winner as if slower."""
    code, out, err = run(tilegraph_main, ["shard", small_model(tmp_path), "--mesh", "2", "--memory", "40GB"], capsys)
    assert code == 0, err
    assert "(budget 40 GB of 80 GB)" in out
    runner = next(line for line in out.splitlines() if line.startswith("runner-up"))
    best = next(line for line in out.splitlines() if line.startswith("predicted step time"))
    if runner.split()[1:3] == best.split()[3:5]:  # the same predicted time
        assert "predicted as fast" in runner


def test_an_unterminated_string_in_a_mlir_file_fails_fast():
    """xDSL's string-literal regex backtracked exponentially on a string with no closing quote:
    a truncated 548-byte .mlir hung the parser (found by tilegraph/fuzz.py). 2**60 steps before."""
    from tilegraph.ir.model import ModelError, parse_module

    with pytest.raises(ModelError, match="closing string literal"):
        parse_module('builtin.module {\n  func.func @f(%x : tensor<?xf32, ["' + "S" * 60 + "]>)")


def test_fuse_and_tile_price_candidates_as_numbers_and_decide_as_the_formulas_would(monkeypatch):
    """`cost --hardware cpu --symbolic` on MiniLM with dynamic batch and seq took ~50 s, most of it in
    fuse and tile building each candidate's cost as a formula in the dims (sympy collapsing
    Piecewise regimes and Max/Min of symbolic terms) only to evaluate it at the nominal size.
    They now price at that size from the start: every cost they build is a number, and the
    groups and tiles are those that pricing by formulas chooses."""
    import contextlib

    import tilegraph.passes.fuse as fuse
    from tilegraph.passes.cost import model
    from tilegraph.passes.registry import run_pipeline

    pipeline = 'canonicalize,cse,simplify-shapes,dce,fuse{hardware="cpu"},tile{hardware="cpu"}'
    # fuse prices through its own import of group_cost, tile's target tilers through the model's.
    priced = {"fuse": [], "tile": []}
    for module, name in ((fuse, "fuse"), (model, "tile")):
        def recording(*args, _real=module.group_cost, _seen=priced[name], **kwargs):
            cost = _real(*args, **kwargs)
            _seen.append(cost.time)
            return cost
        monkeypatch.setattr(module, "group_cost", recording)
    by_numbers = str(run_pipeline(tilegraph.import_model(str(EXAMPLE)), pipeline).module)
    assert all(priced.values()), {k: len(v) for k, v in priced.items()}
    assert not [t for seen in priced.values() for t in seen if getattr(t, "free_symbols", None)]
    assert "batch" in by_numbers  # the model stays symbolic: only the pricing is at the nominal size
    for module in (fuse, model):
        monkeypatch.setattr(module, "nominal_sizes", contextlib.nullcontext)
    by_formulas = str(run_pipeline(tilegraph.import_model(str(EXAMPLE)), pipeline).module)
    assert by_numbers == by_formulas


@pytest.mark.parametrize("op,dtype", [("shift_left", np.float32), ("shift_right", np.float16),
                                      ("bitwise_and", np.float32), ("bitwise_or", np.float64),
                                      ("bitwise_xor", np.float32), ("bitwise_not", np.float32),
                                      ("shift_left", np.bool_)])
def test_integer_only_ops_refuse_float_operands_naming_the_op_and_type(op, dtype):
    """The shape rules took f32 operands for the shift ops: the fuzzer's .mlir reached
    np.left_shift on floats (a TypeError inside the emitted code)."""
    from tilegraph.ir.dtypes import dtype_name
    from tilegraph.ir.shapes import ShapeError

    g = Graph()
    x = g.input("x", (2, 3), dtype_name(np.dtype(dtype)))
    with pytest.raises(ShapeError, match=rf"tg\.{op}: needs integer operands.*{dtype_name(np.dtype(dtype))}"):
        g.op(op, x) if op == "bitwise_not" else g.op(op, x, x)


def test_a_mlir_file_shifting_floats_is_a_named_error(tmp_path, capsys):
    text = ('func.func @forward(%x : tensor<4xf32>) -> tensor<4xf32> {\n'
            '  %y = "tg.shift_left"(%x, %x) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>\n'
            '  func.return %y : tensor<4xf32>\n}\n')
    (tmp_path / "s.mlir").write_text(text)
    code, _, err = run(tilegraph_main, ["compile", tmp_path / "s.mlir", "-o", tmp_path / "s_np.py"], capsys)
    assert_clean_error(code, err, "tg.shift_left", "needs integer operands", "f32")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_shard_shows_what_it_is_doing_on_a_terminal_and_with_progress(tmp_path, capsys, monkeypatch):
    """`--mesh 2x2x2x2x2` on a one-matmul MLP solved for 140 s with nothing shown."""
    import sys

    model = small_model(tmp_path)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert tilegraph_main(["shard", str(model), "--mesh", "2x2"]) == 0
    shown = terminal.getvalue()
    assert "\r\x1b[Ktilegraph shard: solving the integer program" in shown
    assert shown.endswith("\r\x1b[K")  # the status line is gone before the plan is printed
    assert "predicted step time" in capsys.readouterr().out
    monkeypatch.undo()
    # Not a terminal: nothing by default, one line per stage with --progress.
    code, out, err = run(tilegraph_main, ["shard", model, "--mesh", "2x2"], capsys)
    assert code == 0 and err == ""
    code, out, err = run(tilegraph_main, ["shard", model, "--mesh", "2x2", "--progress"], capsys)
    lines = err.splitlines()
    assert code == 0 and "\r" not in err and lines[0].startswith("tilegraph shard: importing the model (")
    assert any(line.startswith("tilegraph shard: solving the integer program") for line in lines)
