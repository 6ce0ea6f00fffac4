"""A `.pt2` from a stranger never runs code: tilegraph reads only the members torch's plain
layout has, checks each, and hands torch a rebuilt archive of exactly those (frontends/
pt2_archive.py). Each attack below ran its payload through `torch.export.load` (torch 2.13)
before the allow-list; each must now be refused by name, before torch sees the file.
"""

import io
import json
import os
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch

from tilegraph.frontends import FrontendError
from tilegraph.frontends.pt2_archive import check_expression, checked_archive
from tilegraph.frontends.torch_export import load_pt2

MARKER = Path(tempfile.gettempdir()) / f"tilegraph-pt2-injected-{os.getpid()}"
RUN = f"__import__('pathlib').Path({str(MARKER)!r}).touch()"


class _Touch:
    def __reduce__(self):
        return (exec, (RUN,))


def _pickled(value) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


@pytest.fixture
def plain(tmp_path) -> Path:
    """A plain .pt2 of a Linear with a dynamic batch (so the program carries sympy expressions)
    and a buffer constant."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.register_buffer("shift", torch.ones(3))

        def forward(self, x):
            return torch.relu(self.fc(x)) + self.shift

    ep = torch.export.export(M().eval(), (torch.randn(3, 4),), dynamic_shapes=({0: torch.export.Dim("B")},))
    path = tmp_path / "plain.pt2"
    torch.export.save(ep, path)
    MARKER.unlink(missing_ok=True)
    yield path
    MARKER.unlink(missing_ok=True)


def _rewrite(src: Path, dst: Path, edit=None, add=(), compress=False) -> Path:
    """`src` copied to `dst`, each member's bytes passed through edit(name, data) (None drops
    it), then the (name, data) pairs of `add` appended (names relative to the root folder)."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        root = z.namelist()[0].split("/", 1)[0]
        for info in z.infolist():
            data = z.read(info)
            if edit is not None:
                data = edit(info.filename.split("/", 1)[1], data)
            if data is not None:
                out.writestr(info.filename, data,
                             compress_type=zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED)
        for name, data in add:
            out.writestr(f"{root}/{name}", data)
    return dst


def _program_edit(change):
    def edit(name, data):
        if name.startswith("models/"):
            program = json.loads(data)
            change(program)
            return json.dumps(program).encode()
        return data
    return edit


def _nodes(program):
    return program["graph_module"]["graph"]["nodes"]


def _sympy_payload(program):
    text = json.dumps(program)
    start = text.index('"expr_str": "') + len('"expr_str": "')
    end = text.index('"', start)
    program.clear()
    program.update(json.loads(text[:start] + RUN.replace('"', '\\"') + text[end:]))


def _opaque_constant(name, data):
    if name.endswith("_constants_config.json"):
        return json.dumps({"config": {"evil": {"path_name": "opaque_obj_0", "is_param": False,
                                               "use_pickle": True, "tensor_meta": None}}}).encode()
    return data


def _pickled_weight(name, data):
    if name.endswith("_weights_config.json"):
        config = json.loads(data)
        for meta in config["config"].values():
            meta["use_pickle"] = True
        return json.dumps(config).encode()
    if name.startswith("data/weights/weight_"):
        return _pickled(_Touch())
    return data


ATTACKS = {
    # torch's deserializer sympify()s every expr_str: a Python expression, eval'd.
    "sympy expression": (dict(edit=_program_edit(_sympy_payload)), "sympy expression"),
    # a node target resolved by getattr anywhere under torch, then called by run_decompositions
    "target outside ATen": (dict(edit=_program_edit(lambda p: _nodes(p)[0].update(target="torch.os.system"))),
                            "not an ATen/prims op"),
    "opaque object": (dict(edit=_opaque_constant, add=[("data/constants/opaque_obj_0", _pickled(_Touch()))]),
                      "not what torch's plain layout holds|a member torch's plain layout does not have"),
    "pickled weight": (dict(edit=_pickled_weight), "pickled object"),
    "sample inputs": (dict(edit=lambda n, d: _pickled(_Touch()) if n.startswith("data/sample_inputs/") else d),
                      "sample_inputs"),
    "AOTInductor library": (dict(add=[("data/aotinductor/model/evil.so", b"\x7fELF")]), "AOTInductor"),
    "extra file": (dict(add=[("extra/module_info.json", b"{}")]), "extra file"),
    "legacy weights": (dict(add=[("data/weights/model.pt", _pickled({"w": _Touch()}))]),
                       "plain layout does not have"),
    "unknown member": (dict(add=[("models/../../evil", b"")]), "plain layout does not have"),
    "duplicate member": (dict(add=[("archive_format", b"pt2")]), "appears twice"),
    "guards code": (dict(edit=_program_edit(lambda p: p.update(guards_code=[RUN]))), None),
    "compressed members": (dict(compress=True), "compressed"),
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_crafted_pt2_is_refused_by_name_and_never_runs_code(plain, tmp_path, attack):
    """Every way torch 2.13's loader runs a file's code, each closed by the allow-list."""
    how, refusal = ATTACKS[attack]
    evil = _rewrite(plain, tmp_path / "evil.pt2", **how)
    if refusal is None:  # dropped rather than refused: the program loads, its guards are gone
        model = load_pt2(evil)
        assert model.input_names and not MARKER.exists()
        ep = torch.export.load(checked_archive(evil))
        assert not ep._guards_code
        ep.module()
        assert not MARKER.exists()
        return
    with pytest.raises(FrontendError, match=refusal):
        load_pt2(evil)
    assert not MARKER.exists(), f"{attack}: the archive's code ran"


def test_the_legacy_layout_is_refused_before_torch_unpickles_its_state_dict(plain, tmp_path):
    """torch.export.load falls back to the pre-2.8 layout when the new one does not open,
    and unpickles its state dict (a `.json` member) without restriction."""
    from torch._export.serde.schema import SCHEMA_VERSION

    with zipfile.ZipFile(plain) as z:
        program = next(z.read(n) for n in z.namelist() if "/models/" in n)
    evil = tmp_path / "legacy.pt2"
    with zipfile.ZipFile(evil, "w") as out:
        out.writestr("version", ".".join(map(str, SCHEMA_VERSION)))
        out.writestr("serialized_exported_program.json", program)
        out.writestr("serialized_state_dict.json", _pickled({"w": _Touch()}))
        out.writestr("serialized_constants.json", _pickled({}))
        out.writestr("serialized_example_inputs.pt", _pickled(((torch.randn(2, 4),), {})))
    with pytest.raises(FrontendError, match="legacy"):
        load_pt2(evil)
    assert not MARKER.exists()


def test_a_plain_pt2_loads_through_the_rebuilt_archive(plain):
    """The allow-list keeps what torch.export.save writes: the model converts and computes."""
    model = load_pt2(plain)
    assert model.input_names
    ep = torch.export.load(checked_archive(plain))
    x = torch.randn(5, 4)
    assert torch.equal(ep.module()(x), torch.export.load(plain).module()(x))


@pytest.mark.parametrize("text,ok", [
    ("Symbol('s77', integer=True, positive=True)", True),
    ("Mul(Integer(-2), Add(Symbol('s0', integer=True), Integer(1)))", True),
    ("FloorDiv(Symbol('s0', integer=True), Integer(2))", True),
    ("Symbol('s0').__class__", False),
    ("__import__('os')", False),
    ("Symbol('a\\')')", False),
    ("sympify('x')", False),
    ("exec('1')", False),
    ("Symbol('x')[0]", False),
])
def test_only_sympy_constructors_of_names_and_numbers_pass_the_expression_check(text, ok):
    if ok:
        check_expression(text)
    else:
        with pytest.raises(ValueError):
            check_expression(text)


class _TouchThenTensor:
    """Unpickles as the tensor whose values it holds, after running the payload: a caller's own
    file with a pickled weight (a tensor subclass, say) does what its pickle says, too."""
    def __init__(self, tensor):
        self.values, self.parameter = tensor.tolist(), isinstance(tensor, torch.nn.Parameter)

    def __reduce__(self):
        value = f"__import__('torch').tensor({self.values!r})"
        if self.parameter:
            value = f"__import__('torch').nn.Parameter({value})"
        return (eval, (f"[{RUN}, {value}][1]",))


def _pickled_weights(plain: Path, dst: Path) -> Path:
    """`plain` with every weight pickled (use_pickle, as torch.export.save writes a tensor subclass)."""
    state = torch.export.load(plain).state_dict
    with zipfile.ZipFile(plain) as z:
        config = json.loads(next(z.read(n) for n in z.namelist() if n.endswith("_weights_config.json")))
    fqn_of = {meta["path_name"]: fqn for fqn, meta in config["config"].items()}
    for meta in config["config"].values():
        meta["use_pickle"] = True

    def edit(name, data):
        if name.endswith("_weights_config.json"):
            return json.dumps(config).encode()
        if name.startswith("data/weights/weight_"):
            return _pickled(_TouchThenTensor(state[fqn_of[name.rsplit("/", 1)[1]]]))
        return data
    return _rewrite(plain, dst, edit=edit)


def test_trust_pickle_hands_torch_the_file_itself(plain, tmp_path):
    """A caller's own archive with pickled weights is refused by default and loads, unpickled,
    when the caller says it is trusted."""
    import numpy as np

    from tilegraph.ir import interpret

    pickled = _pickled_weights(plain, tmp_path / "mine.pt2")
    with pytest.raises(FrontendError, match="pickled object"):
        load_pt2(pickled)
    assert not MARKER.exists()
    trusted = load_pt2(pickled, trust_pickle=True)
    assert MARKER.exists()  # torch unpickled the weights: the trusted path runs what the file says
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_array_equal(interpret(trusted, [x])[0], interpret(load_pt2(plain), [x])[0])


@pytest.mark.parametrize("command", ["import", "compile", "cost", "export", "tilegraph-opt"])
def test_the_commands_refuse_a_pickle_bearing_pt2_unless_told_to_trust_it(plain, tmp_path, capsys, command):
    """Every command that reads a .pt2: without --trust-pickle, exit 2 naming the pickled member,
    no output written and the payload not run; with it, torch's own loader (the payload runs)."""
    from tilegraph.cli import main as tilegraph_main
    from tilegraph.opt import main as opt_main
    from tests.test_cli import assert_clean_error, run

    pickled = _pickled_weights(plain, tmp_path / "mine.pt2")
    out = tmp_path / ("out.onnx" if command == "export" else "out.mlir" if command != "compile" else "out.py")
    argv = {"import": ["import", pickled, "-o", out], "compile": ["compile", pickled, "-o", out],
            "cost": ["cost", pickled], "export": ["export", pickled, "-o", out],
            "tilegraph-opt": [pickled, "-o", out]}[command]
    main = opt_main if command == "tilegraph-opt" else tilegraph_main

    code, _, err = run(main, argv, capsys)
    assert_clean_error(code, err, "pickled object")
    assert not MARKER.exists(), "the payload ran without --trust-pickle"
    assert not out.exists()

    code, _, err = run(main, [*argv, "--trust-pickle"], capsys)
    assert code == 0, err
    assert MARKER.exists(), "--trust-pickle did not take torch's own loader"
    assert command == "cost" or out.exists()
