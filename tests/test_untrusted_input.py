"""A model file never runs code: every string it carries reaches generated source only
through `ir/escape.py`, and dims in a .mlir file are parsed, never evaluated.

Each test writes strings built to break out of wherever they land (a comment, a string
literal, a docstring, an identifier) with code that creates a marker file, then compiles
for every backend that runs here and asserts the result is right or a TilegraphError,
and that the marker never appeared.
"""

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import tilegraph
from tilegraph.frontends.onnx import from_onnx
from tilegraph.ir.escape import c_comment, c_string_literal, identifier, py_comment, py_docstring, py_string
from tilegraph.ir.model import Model
from tilegraph.ir.errors import TilegraphError
from tilegraph.reporting import user_errors

MARKER = Path(tempfile.gettempdir()) / f"tilegraph-injected-{os.getpid()}"
RUN = f"__import__('pathlib').Path({str(MARKER)!r}).touch()"
# Everything Python's str.splitlines, a C compiler or an editor counts as a line break.
LINE_BREAKS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
# Ways out of a comment, a string literal, a docstring or a C comment, each followed by RUN.
BREAKOUTS = [*LINE_BREAKS, '"', "'", '"""', "'''", "\\", "*/", "\x00", "{", "}", "??/", "\n#", ")\n", "')\n"]
# Text valid in a protobuf string (UTF-8: no lone surrogates).
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
EVIL = st.one_of(TEXT, st.builds(lambda pre, out, post: f"{pre}{out}{RUN}{out}{post}",
                                 TEXT, st.sampled_from(BREAKOUTS), TEXT))


@pytest.fixture(autouse=True)
def _no_marker():
    MARKER.unlink(missing_ok=True)
    yield
    assert not MARKER.exists(), "a string carried by the model ran as code"


def _onnx_model(names: dict[str, str], custom_op: str | None) -> bytes:
    """relu(x @ w + b) whose every name-bearing field holds one of `names`."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), names["weight"])
    b = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), names["bias"])
    nodes = [helper.make_node("MatMul", [names["input"], names["weight"]], [names["mm"]], name=names["node"],
                              doc_string=names["doc"]),
             helper.make_node("Add", [names["mm"], names["bias"]], [names["add"]], name=names["node2"]),
             helper.make_node("Relu", [names["add"]], [names["output"]], name=names["node3"])]
    if custom_op is not None:  # a custom-domain op: unsupported, so an error naming it
        nodes.append(helper.make_node(custom_op, [names["output"]], [names["extra"]], domain=names["domain"],
                                      **{"attr": names["attr"]}))
    x = helper.make_tensor_value_info(names["input"], TensorProto.FLOAT, [names["dim"], 4])
    outputs = [names["extra"] if custom_op is not None else names["output"]]
    y = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    graph = helper.make_graph(nodes, names["graph"], [x], y, [w, b], doc_string=names["graph_doc"])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name=names["producer"],
                              doc_string=names["model_doc"])
    helper.set_model_props(model, {names["key"]: names["value"]})
    return model.SerializeToString()


FIELDS = ["input", "output", "mm", "add", "weight", "bias", "node", "node2", "node3", "doc", "dim", "graph",
          "graph_doc", "producer", "model_doc", "key", "value", "extra", "domain", "attr"]
TENSOR_NAMES = ["input", "output", "mm", "add", "weight", "bias", "extra"]


def _compile_and_check(load, expected, target, errors=(TilegraphError,), pipeline=None):
    try:
        compiled = tilegraph.compile(load(), target=target, pipeline=pipeline)
        got = compiled.run(np.arange(8, dtype=np.float32).reshape(2, 4))[0]
    except errors as e:
        assert str(e)
        return
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def _expected():
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    return np.maximum(np.arange(8, dtype=np.float32).reshape(2, 4) @ w + b, 0)


ONNX_NAMES = st.fixed_dictionaries({f: EVIL for f in FIELDS})
ONNX_EXAMPLES = [
    ({f: (f"{f}\n{RUN}\n" if f in ("input", "output") else f) for f in FIELDS}, None),
    ({f: f"{f}\x00" for f in FIELDS}, None),
    ({f: f'{f}"""\u2028{RUN}\u2028"""' for f in FIELDS}, f"Op\n{RUN}"),
]


def _examples(test):
    for names, custom_op in ONNX_EXAMPLES:
        test = example(names=names, custom_op=custom_op)(test)
    return test


@settings(max_examples=60, deadline=None)
@given(names=ONNX_NAMES, custom_op=st.one_of(st.none(), EVIL))
@_examples
def test_no_string_in_an_onnx_file_runs_numpy(names, custom_op):
    """A graph input named 'x\\n<code>' ran <code> when compiled (the name landed
    raw in a comment of the emitted module); a NUL in it was a SyntaxError traceback."""
    _check_onnx("numpy", names, custom_op)


# Triton's interpreter costs seconds a model: fewer examples.
@settings(max_examples=10, deadline=None)
@given(names=ONNX_NAMES, custom_op=st.one_of(st.none(), EVIL))
@_examples
def test_no_string_in_an_onnx_file_runs_triton(names, custom_op):
    _check_onnx("triton", names, custom_op)


def _check_onnx(target, names, custom_op):
    tensor_names = [names[f] for f in TENSOR_NAMES]
    assume(all(tensor_names) and len(set(tensor_names)) == len(tensor_names))
    MARKER.unlink(missing_ok=True)
    _compile_and_check(lambda: from_onnx(_onnx_model(names, custom_op)), _expected(), target)
    assert not MARKER.exists(), "a string carried by the model ran as code"


def _builder_model(names: dict[str, str]) -> Model:
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input(names["input"], (2, 4))
    w = g.weight(names["weight"], rng.standard_normal((4, 3)).astype(np.float32))
    b = g.weight(names["bias"], rng.standard_normal(3).astype(np.float32))
    return g.build(g.relu(x @ w + b), names=[names["output"]])


MLIR_NAMES = st.fixed_dictionaries({f: EVIL for f in ["input", "weight", "bias", "output"]})
MLIR_EXAMPLE = dict(names={"input": f"x\n{RUN}", "weight": f'w"]\n{RUN}\n#', "bias": "b\x00", "output": f"y\u2028{RUN}"},
                    kind=f'matmul_epilogue"""\n{RUN}\n"""')


@settings(max_examples=30, deadline=None)
@given(names=MLIR_NAMES, kind=EVIL)
@example(**MLIR_EXAMPLE)
def test_no_string_in_a_mlir_file_runs_numpy(names, kind):
    """Names of inputs, outputs and weights, and a fusion's kind, as a .mlir file spells them
    (xDSL string escapes), through the parser and every backend."""
    _check_mlir("numpy", names, kind)


@settings(max_examples=6, deadline=None)
@given(names=MLIR_NAMES, kind=EVIL)
@example(**MLIR_EXAMPLE)
def test_no_string_in_a_mlir_file_runs_triton(names, kind):
    _check_mlir("triton", names, kind)


def _check_mlir(target, names, kind):
    assume(names["weight"] != names["bias"])
    MARKER.unlink(missing_ok=True)
    try:
        model = _builder_model(names)
    except TilegraphError:
        return
    fused = tilegraph.compile(model, pipeline="canonicalize,fuse,tile").model
    text = fused.text.replace('tg.fusion "matmul_epilogue"', "tg.fusion " + _mlir_string(kind))
    weights = {n: np.asarray(model.weights[n]) for n in (names["weight"], names["bias"])}
    _compile_and_check(lambda: Model.parse(text, weights), _expected(), target, errors=user_errors(),
                       pipeline="")
    assert not MARKER.exists(), "a string carried by the model ran as code"


def _mlir_string(s: str) -> str:
    """An MLIR string literal: printable ASCII as itself, every other byte as \\XX."""
    return '"' + "".join(chr(b) if 0x20 <= b < 0x7F and chr(b) not in '"\\' else f"\\{b:02X}"
                         for b in s.encode("utf-8")) + '"'


@pytest.mark.parametrize("dim", [
    "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0]"
    f".__init__.__globals__['system']('touch {MARKER}')",
    RUN, "B.real", "lambda: 1", "S**99999999", "9" * 5000, "(" * 500 + "S" + ")" * 500, "S; import os",
], ids=["os-system", "pathlib-touch", "attribute", "lambda", "huge-power", "long-number", "deep-parens",
        "statement"])  # (ids without the marker's per-process path: xdist workers must collect alike)
def test_a_dim_in_a_mlir_file_is_parsed_never_evaluated(dim):
    """Dim names in a type's encoding went through sympy.parse_expr (eval); the first
    string here ran os.system. Now anything but an expression of sizes is a ShapeError."""
    text = ('builtin.module {\n  func.func @forward(%x : tensor<?x4xf32, [' + _mlir_string(dim) + ']>) '
            '-> tensor<?x4xf32, [' + _mlir_string(dim) + ']> {\n'
            '    %0 = tg.relu %x : tensor<?x4xf32, [' + _mlir_string(dim) + ']>\n'
            '    func.return %0 : tensor<?x4xf32, [' + _mlir_string(dim) + ']>\n  }\n}\n')
    with pytest.raises(user_errors()):
        model = Model.parse(text)
        tilegraph.compile(model)


def test_a_tile_holding_a_string_is_refused():
    """Tile sizes are written into generated code: only integers pass the verifier."""
    text = ('builtin.module {\n  func.func @forward(%x : tensor<8x4xf32>) -> tensor<8x4xf32> {\n'
            f'    %0 = tg.fusion "elementwise" (%1 = %x) {{tile = {{rows = "1); {RUN}; (1"}}}} : tensor<8x4xf32> {{\n'
            '      %2 = tg.relu %1 : tensor<8x4xf32>\n      tg.yield %2\n    }\n'
            '    func.return %0 : tensor<8x4xf32>\n  }\n}\n')
    with pytest.raises(user_errors(), match="tile must hold integers"):
        tilegraph.compile(Model.parse(text), pipeline="")


ANY_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=()), max_size=40) | st.sampled_from(BREAKOUTS)


@given(ANY_TEXT)
@example("a*/b/*c??/\\\n\u2028\x00")
def test_escapes_keep_every_string_inside_its_context(text):
    """What the emitters rely on, checked by Python's own parser and by a C-comment scan."""
    import ast

    assert ast.literal_eval(py_string(text)) == text
    assert "\n" not in py_comment(text) and py_comment(text).isprintable()
    assert ast.literal_eval(py_docstring(text)).isprintable()
    source = f"x = 1  # {py_comment(text)}\ny = 2\n"
    assert ast.unparse(ast.parse(source)) == "x = 1\ny = 2"
    ident = identifier(text)
    assert ident.isidentifier() and ident.isascii()
    comment = c_comment(text)
    assert comment.startswith("/* ") and comment.endswith(" */") and "*/" not in comment[3:-3]
    assert "??" not in comment and comment.isprintable() and "/*" not in comment[3:-3]
    literal = c_string_literal(text)
    assert literal.isascii() and literal.isprintable() and "??" not in literal
    assert _c_unescape(literal[1:-1]) == text.encode("utf-8")


def _c_unescape(body: str) -> bytes:
    """The bytes a C compiler reads from a string literal's body (the escapes c_string_literal writes)."""
    out, i = bytearray(), 0
    simple = {"\\": b"\\", '"': b'"', "?": b"?", "n": b"\n", "t": b"\t", "r": b"\r"}
    while i < len(body):
        c = body[i]
        if c == "\\":
            if body[i + 1] in simple:
                out += simple[body[i + 1]]
                i += 2
            else:
                out.append(int(body[i + 1:i + 4], 8))
                i += 4
        else:
            assert c != '"'
            out += c.encode()
            i += 1
    return bytes(out)


def _pt2_with(tmp_path, replace: dict) -> Path:
    """A .pt2 of a small Linear with the archive members named in `replace` overwritten."""
    import io
    import zipfile

    import torch

    ep = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), (torch.randn(2, 4),))
    plain, evil = tmp_path / "plain.pt2", tmp_path / "evil.pt2"
    torch.export.save(ep, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(evil, "w") as out:
        for name in src.namelist():
            data = src.read(name)
            for suffix, make in replace.items():
                if name.endswith(suffix):
                    buffer = io.BytesIO()
                    torch.save(make(), buffer)
                    data = buffer.getvalue() if not isinstance(make(), bytes) else make()
            out.writestr(name, data)
    return evil


class _Touch:
    def __reduce__(self):
        return (exec, (RUN,))


def test_a_pt2_whose_pickles_name_code_is_refused_before_torch_unpickles_it(tmp_path):
    """torch.export.load retries a sample-inputs pickle that weights_only refuses with
    weights_only=False, which ran this file's code; tilegraph checks every pickle first."""
    from tilegraph.frontends import FrontendError
    from tilegraph.frontends.torch_export import load_pt2

    evil = _pt2_with(tmp_path, {"sample_inputs/model.pt": _Touch})
    with pytest.raises(FrontendError, match="sample_inputs/model.pt is not what torch"):
        load_pt2(evil)
    assert not MARKER.exists()
    pickled = _pt2_with(tmp_path, {"weights_config.json": lambda: b'{"config": {"0.weight": {"path_name": '
                                                                  b'"weight_0", "is_param": true, "use_pickle": true}}}'})
    with pytest.raises(FrontendError, match="pickled object|not a weight record"):
        load_pt2(pickled)
    assert load_pt2(tmp_path / "plain.pt2").input_names


# Terminal escape sequences: OSC (set the window title), CSI (clear the screen, colours), the
# 8-bit CSI, BEL, backspace and carriage return (overwrite what was printed), and the bidi
# controls that reorder what a reader sees (Trojan Source).
TERMINAL_ATTACKS = ["\x1b]0;pwned\x07", "\x1b[2J\x1b[31m", "\x9b31m", "ok\rtilegraph: fine", "a\x08\x08b",
                    "\u202eevil\u202c", "\u2066x\u2069", "\u200fy", "\x1bP+q\x1b\\", "\x85\u2028"]


@given(st.lists(st.sampled_from(TERMINAL_ATTACKS) | st.text(max_size=8), min_size=1, max_size=4)
       .map(lambda parts: "".join(parts).replace("\n", "")))
@settings(max_examples=60, deadline=None)
def test_terminal_text_writes_every_control_and_bidi_character_escaped(text):
    from tilegraph.ir.escape import terminal_text

    shown = terminal_text(text + "\n" + text)
    lines = shown.split("\n")
    assert len(lines) == 2 and lines[0] == lines[1]  # the message's own line breaks stay
    assert all(c.isprintable() or c == "\t" for c in lines[0])


def test_a_model_string_in_an_error_message_reaches_the_terminal_escaped(tmp_path, capsys):
    """An unsupported op's type and node name are quoted in the error: before, the escape
    sequences in them went to the terminal raw (retitle the window, clear the screen, hide text)."""
    from tilegraph.cli import main

    evil = "".join(TERMINAL_ATTACKS)
    node = helper.make_node("Evil" + evil, ["x"], ["y"], name="n" + evil, domain="ai.attack")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.attack", 1)])
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    code = main(["compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.py")])
    err = capsys.readouterr().err
    assert code == 2 and "unsupported op" in err
    assert not [c for c in err if not (c.isprintable() or c == "\n")], repr(err)
    assert "\\x1b]0;pwned\\x07" in err and "\\u202eevil" in err


def test_a_fusion_kind_from_a_mlir_file_reaches_the_cost_table_escaped(tmp_path, capsys):
    from tilegraph.cli import main
    from tilegraph.ir import Graph
    from tilegraph.passes.registry import run_pipeline

    g = Graph()
    x = g.input("x", ("B", 4))
    y = g.relu(x @ g.weight("w", np.eye(4, dtype=np.float32)) + 1.0)
    text = run_pipeline(g.build(y, names=["y"]), "fuse").save(tmp_path / "k.mlir").read_text()
    # (xDSL reads a string with escapes and non-ASCII text as bytes, not a string: two kinds)
    for kind in ('"\\1B]0;pwned\\07\\1B[2J\\0D"', '"pwned\u202eevil\u2066\x9b31m"'):
        (tmp_path / "k.mlir").write_text(text.replace('"matmul_epilogue"', kind), encoding="utf-8")
        for symbolic in ([], ["--symbolic"]):
            assert main(["cost", str(tmp_path / "k.mlir"), "--dim", "B=4", *symbolic]) == 0
            out = capsys.readouterr().out
            assert "pwned" in out and not [c for c in out if not (c.isprintable() or c == "\n")], repr(out)
