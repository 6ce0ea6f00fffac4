"""Layers only point down (DESIGN.md): ir imports no pass, backend, frontend or command;
backends import no pass or frontend; passes import no backend or frontend; frontends
import no pass or backend.

Checked on the source, by parsing every import statement (and every importlib.import_module
of a literal name) of each package, including imports inside functions.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    # ir holds no runtime either: no thread pools, no BLAS thread control.
    "ir": ("tilegraph.passes", "tilegraph.backends", "tilegraph.frontends", "tilegraph.cli", "threading",
           "threadpoolctl", "concurrent"),
    "backends": ("tilegraph.passes", "tilegraph.frontends"),
    "passes": ("tilegraph.backends", "tilegraph.frontends"),
    # Frontends build IR, nothing more; shapes are named through ir.shapes.symbol_named, not by
    # reading the interpreter's names.
    "frontends": ("tilegraph.passes", "tilegraph.backends", "tilegraph.cli", "tilegraph.ir.interpreter.GLOBALS"),
    # The commands run without the test-only packages (hypothesis): what `check` and `run` share
    # with the tests is tilegraph.accuracy.
    "tilegraph/cli": ("tilegraph.testing",),
}


def imported_names(source: str, package: list[str]) -> set[str]:
    """Every module name a file of `package` (["tilegraph", "passes", "cost"]) imports, made absolute."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's own package upwards
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names.add(str(node.args[0].value))
    return names


def violations(layer: str) -> list[str]:
    out = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        package = ["tilegraph", *path.relative_to(ROOT).parts[:-1]]
        for name in sorted(imported_names(path.read_text(), package)):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer]):
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_only_point_down(layer):
    assert violations(layer) == []


def test_the_check_sees_lazy_and_relative_imports():
    source = ("def f():\n    from tilegraph.backends.numpy import chunks\n    from ...frontends import onnx\n"
              "    importlib.import_module('tilegraph.cli')\n")
    names = imported_names(source, ["tilegraph", "passes", "cost"])
    assert {"tilegraph.backends.numpy.chunks", "tilegraph.frontends.onnx", "tilegraph.cli"} <= names


@pytest.mark.parametrize("path", ["passes/fuse.py", "passes/tile.py", "passes/cost/model.py"])
def test_fuse_tile_and_the_cost_model_do_not_branch_on_a_backend_or_hardware_kind(path):
    """What differs per target is its module in passes/targets/, looked up by the way code runs
    there (Hardware.execution), not tested for inline: no comparison reads `.backend`, `.device`
    or `.kind`."""
    tree = ast.parse((ROOT / path).read_text())
    branches = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                and any(isinstance(n, ast.Attribute) and n.attr in ("backend", "device", "kind", "execution")
                        for side in (node.left, *node.comparators) for n in ast.walk(side))]
    assert not branches, branches
