"""One installed namespace: the wheel holds `tilegraph` and nothing else at the top level,
and a compiled model runs from a working directory whose own `ir/`, `passes/`,
`backends/` and `frontends/` packages would shadow ours if anything imported them by
those names (the emitted module included).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHADOWED = ("ir", "passes", "backends", "frontends")

# Builds the wheel and a venv: slow next to a unit test, so it shares the slow mark.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (setuptools writes build/ beside them)."""
    src = tmp_path_factory.mktemp("src")
    for name in (*SHADOWED, "tilegraph"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, capture_output=True)
    (found,) = out.glob("tilegraph-*.whl")
    return found


def test_the_wheel_installs_no_top_level_package_but_tilegraph(wheel):
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
        names = archive.namelist()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tilegraph"}
    for package in SHADOWED:
        assert f"tilegraph/{package}/__init__.py" in names
    # Every folder of Python files in the checkout is in the wheel (a subpackage missing
    # from pyproject's list would install without its modules).
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.relative_to(ROOT)
        if rel.parts[0] in SHADOWED:
            assert f"tilegraph/{rel.as_posix()}" in names, f"{rel.parent} is not in the wheel"


def test_a_model_compiles_and_runs_beside_folders_that_shadow_the_old_names(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    # The dependencies come from this venv's site-packages as a plain path entry: its
    # .pth files (the editable install of this checkout among them) are not run.
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "user_project"
    for package in SHADOWED:
        (work / package).mkdir(parents=True)
        (work / package / "__init__.py").write_text(f"raise ImportError('the user project\\'s own {package}')\n")
    script = textwrap.dedent("""
        import numpy as np
        import tilegraph
        from tilegraph.ir import Graph, interpret

        g = Graph()
        x = g.input("x", ("B", 4))
        w = g.weight("w", np.arange(16, dtype=np.float32).reshape(4, 4) / 8)
        model = g.build(g.softmax(g.relu(x @ w)), names=["y"])
        compiled = tilegraph.compile(model, target="numpy")
        x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
        np.testing.assert_allclose(compiled(x), interpret(model, [x])[0], rtol=1e-5)
        assert "from tilegraph." in compiled.source
        native = tilegraph.compile(model)  # the default target: C (runtime.h and runtime.c come with the wheel)
        assert native.target == "c"
        np.testing.assert_allclose(native(x), interpret(model, [x])[0], rtol=1e-5)
        print(tilegraph.__file__)
    """)
    done = subprocess.run([python, "-c", script], cwd=work, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "TILEGRAPH_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(site)), done.stdout
