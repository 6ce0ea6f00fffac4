"""A pass written outside tilegraph registers by name (passes.registry.register_pass) and
then runs in pipelines like a built-in one: from Python, and from `tilegraph-opt` with
`--load-pass-plugin` importing the file that registers it."""

import numpy as np
import pytest

from tilegraph.ir import Graph
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.interpreter import interpret
from tilegraph.opt import main as opt_main
from tilegraph.passes import registry

PLUGIN = '''
from dataclasses import dataclass

from xdsl.passes import ModulePass

from tilegraph.passes.registry import register_pass
from tilegraph.passes.rewrite import Rule, info, run_rules


def _relu_as_max(op, emit):
    x = op.operands[0]
    return emit("max", x, emit.constant(0.0, info(x).dtype))


@register_pass
@dataclass(frozen=True)
class ReluAsMax(ModulePass):
    name = "relu-as-max"

    def apply(self, ctx, module):
        run_rules(module, [Rule(("relu",), _relu_as_max, "relu(x) -> max(x, 0)")], ctx)
'''


@pytest.fixture
def passes(monkeypatch):
    """The registry's table, restored afterwards (a registered pass would outlive the test)."""
    table = dict(registry.PASSES)
    monkeypatch.setattr(registry, "PASSES", table)
    return table


def _model():
    g = Graph()
    x = g.input("x", (2, 3))
    return g.build(g.relu(x), names=["y"])


def test_a_registered_pass_runs_by_name(passes, tmp_path):
    exec(compile(PLUGIN, "plugin", "exec"), {})
    out = registry.run_pipeline(_model(), "relu-as-max")
    names = [op.name for op in out.func.body.walk()]
    assert "tg.max" in names and "tg.relu" not in names
    x = np.array([[-1.0, 0.5, 2.0], [3.0, -0.0, -7.0]], np.float32)
    np.testing.assert_array_equal(interpret(out, [x])[0], np.maximum(x, 0))


def test_a_taken_name_is_refused(passes):
    exec(compile(PLUGIN, "plugin", "exec"), {})
    with pytest.raises(TilegraphError, match="taken"):
        exec(compile(PLUGIN, "plugin", "exec"), {})


def test_tilegraph_opt_loads_a_pass_plugin(passes, tmp_path, capsys):
    plugin = tmp_path / "my_passes.py"
    plugin.write_text(PLUGIN)
    path = _model().save(tmp_path / "m.mlir")
    assert opt_main([str(path), "--load-pass-plugin", str(plugin), "-p", "relu-as-max"]) == 0
    out = capsys.readouterr().out
    assert "tg.max" in out and "tg.relu" not in out
    assert opt_main([str(path), "--load-pass-plugin", str(tmp_path / "missing.py"), "-p", "cse"]) == 2
    assert "cannot load the pass plugin" in capsys.readouterr().err
