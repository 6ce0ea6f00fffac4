"""`tilegraph-opt --check-semantics`: a wrong pass is named, with its output, worst element and the IR
before and after; correct pipelines pass; inputs are valid for the model (ids below table sizes)."""

from dataclasses import dataclass

import numpy as np
import pytest
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from tilegraph.ir import Graph
from tilegraph.ir.dialect import TgOp
from tilegraph.check_semantics import valid_inputs
from tilegraph.opt import main as opt_main
from tilegraph.passes import registry
from tilegraph.passes.rewrite import Rule, run_rules


@dataclass(frozen=True)
class DropLastActivation(ModulePass):
    """A bug as a new pass writer makes it: the last gelu/relu 'simplified' away."""

    name = "drop-last-activation"

    def apply(self, ctx, module):
        acts = [op for op in module.walk() if isinstance(op, TgOp) and op.op_name in ("gelu", "relu", "erf")]
        op = acts[-1]
        Rewriter.replace_op(op, [], [op.operands[0]])


def _drop_scale(op, emit):  # "a multiply by a constant is only a scale": wrong
    from tilegraph.passes.rewrite import constant_array

    return op.operands[0] if constant_array(op.operands[1]) is not None else None


@dataclass(frozen=True)
class WrongRules(ModulePass):
    name = "wrong-rules"

    def apply(self, ctx, module):
        run_rules(module, [Rule(("mul",), _drop_scale, "x * c -> x")], ctx)


@pytest.fixture
def wrong_passes(monkeypatch):
    monkeypatch.setitem(registry.PASSES, DropLastActivation.name, lambda: DropLastActivation)
    monkeypatch.setitem(registry.PASSES, WrongRules.name, lambda: WrongRules)


def small_model(tmp_path):
    g = Graph()
    x = g.input("x", ("B", 4))
    w = g.weight("w", np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4))
    y = g.softmax(g.relu(x @ w + 0.0) * 2.0)
    return g.build(y, names=["y"]).save(tmp_path / "small.mlir")


def test_a_correct_pipeline_passes_the_check(tmp_path, capsys):
    path = small_model(tmp_path)
    code = opt_main([str(path), "-p", "canonicalize,constant-fold,cse,simplify-shapes,dce,fuse,tile",
                     "--check-semantics", "--check-dir", str(tmp_path)])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "check-semantics: 7 passes" in err


def test_a_wrong_pass_is_named_with_its_output_worst_element_and_ir(tmp_path, capsys, wrong_passes):
    path = small_model(tmp_path)
    code = opt_main([str(path), "-p", "canonicalize,drop-last-activation,cse", "--check-semantics",
                     "--check-dir", str(tmp_path), "--dim", "B=4"])
    _, err = capsys.readouterr()
    assert code == 1, err
    assert "pass 'drop-last-activation' changed what the model computes" in err
    assert "output 'y'" in err and "worst element [" in err and "B=4" in err
    before = (tmp_path / "small.before-pass__drop-last-activation_.mlir").read_text()
    after = (tmp_path / "small.after-pass__drop-last-activation_.mlir").read_text()
    assert "tg.relu" in before and "tg.relu" not in after


def test_each_rewrite_names_the_rule(tmp_path, capsys, wrong_passes):
    path = small_model(tmp_path)
    code = opt_main([str(path), "-p", "wrong-rules", "--check-each-rewrite", "--check-dir", str(tmp_path)])
    _, err = capsys.readouterr()
    assert code == 1, err
    assert "pass 'wrong-rules', rule 'x * c -> x' on tg.mul" in err


def test_inputs_are_valid_for_the_model():
    g = Graph()
    ids = g.input("ids", ("B", "S"), "i64")
    mask = g.input("mask", ("B", "S"), "i64")
    table = g.weight("emb", np.ones((7, 4), np.float32))
    y = g.gather(table, ids) * g.cast(mask, "f32").reshape(("B", "S", 1))
    model = g.build(y)
    for seed in range(5):
        i, m = valid_inputs(model, seed, {"B": 2, "S": 50})
        assert i.min() >= 0 and i.max() < 7 and set(np.unique(m)) <= {0, 1}


@pytest.mark.slow
@pytest.mark.xdist_group("minilm_check_semantics")
def test_minilm_with_a_wrong_pass_names_it(tmp_path, capsys, wrong_passes):
    from tests.models import export_onnx, minilm_inputs, minilm_model

    path = export_onnx(minilm_model(), minilm_inputs(1, 8), tmp_path / "minilm.onnx",
                       input_names=["input_ids", "attention_mask"], output_names=["hidden"],
                       dynamic_axes={"input_ids": {0: "B", 1: "S"}, "attention_mask": {0: "B", 1: "S"}})
    pipeline = "canonicalize,constant-fold,cse,drop-last-activation,simplify-shapes,dce,fuse,tile"
    code = opt_main([str(path), "-p", pipeline, "--check-semantics", "--check-dir", str(tmp_path),
                     "--dim", "B=2", "--dim", "S=8"])
    _, err = capsys.readouterr()
    assert code == 1, err
    assert "pass 'drop-last-activation' changed what the model computes" in err
    assert "output 'hidden'" in err


def test_a_lossy_pass_is_held_to_its_stated_bound(tmp_path, capsys):
    # quantize changes results beyond rounding, by design: it is checked against its fake-quantized
    # reference (and each rounding against half an ulp), which then becomes the baseline
    path = small_model(tmp_path)
    code = opt_main([str(path), "-p", "canonicalize,quantize{scheme=w8},cse,fuse", "--check-semantics",
                     "--check-dir", str(tmp_path)])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "check-semantics: 4 passes" in err
