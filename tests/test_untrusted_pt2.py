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


def test_trust_pickle_hands_torch_the_file_itself(plain, tmp_path):
    """A caller's own archive with a pickled weight (a tensor subclass, say) loads when the
    caller says it is trusted, and only then."""
    pickled = _rewrite(plain, tmp_path / "mine.pt2", edit=lambda n, d: d)
    assert load_pt2(pickled, trust_pickle=True).input_names == load_pt2(plain).input_names
