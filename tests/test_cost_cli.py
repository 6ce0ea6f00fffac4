"""The cost commands tell the truth about what the compiler predicts and plans:
`tilegraph cost` (table and formulas), `tilegraph compile --report`, and
`tilegraph-opt --remarks / --print-cost-after-all`.

Models are small and mostly static (symbolic dims make the passes work in sympy,
which is slow), so the whole file runs in seconds on the CPU profile already in
the user's cache.
"""

import re

import numpy as np
import pytest
import sympy

from tilegraph.ir import Graph
from tilegraph.ir.dtypes import numpy_dtype
from tilegraph.ir.shapes import info_of, numel, symbol
from tilegraph.cli import main as tilegraph_main
from tilegraph.passes.registry import with_hardware
from tilegraph.opt import main as opt_main

SI = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
ROW = re.compile(r"^\s*(\d+)\s+(\S+(?: \S+)?)\s+([\d.]+[kMGT]?)\s+([\d.]+[kMGT]?)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+"
                 r"(compute|memory|overhead)")


def run(main, argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def count(text: str) -> float:
    """'12.5M' -> 12.5e6 (the tables' SI counts)."""
    number, prefix = re.fullmatch(r"([\d.]+)([kMGT]?)", text).groups()
    return float(number) * SI[prefix]


def table(out: str):
    """(rows as dicts, totals dict) of a `tilegraph cost` table."""
    unit = re.search(r"time \((s|ms|us)\)", out).group(1)
    rows = [dict(label=m[2], flops=count(m[3]), bytes=count(m[4]), time=float(m[6]) * SECONDS[unit], bound=m[8])
            for m in (ROW.match(line) for line in out.splitlines()) if m]
    t = re.search(r"total: (\d+) kernels, (\S+) FLOPs, (\S+) bytes, ([\d.]+) (s|ms|us) predicted", out)
    return rows, dict(kernels=int(t[1]), flops=count(t[2]), bytes=count(t[3]), time=float(t[4]) * SECONDS[t[5]])


def dense_model(tmp_path, rows=256, features=64, name="dense"):
    """softmax(relu(x @ w + b)): a GEMM with an epilogue the default pipeline fuses."""
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (rows, features))
    w = g.weight("w", rng.standard_normal((features, features)).astype(np.float32))
    b = g.weight("b", rng.standard_normal(features).astype(np.float32))
    y = g.softmax(g.relu(x @ w + b))
    return g.build(y, names=["y"]).save(tmp_path / f"{name}.mlir")


def chain_model(tmp_path, shape=(256, 64), links=4, name="chain"):
    """y = f(f(...f(x))), f(v) = exp(v) * 0.5 + 1: an elementwise chain, 3 ops a link."""
    g = Graph()
    h = g.input("x", shape)
    for _ in range(links):
        h = g.exp(h) * 0.5 + 1.0
    return g.build(h, names=["y"]).save(tmp_path / f"{name}.mlir")


def mlp_model(tmp_path, layers=4, width=64):
    """relu(... relu(x @ w0 + 1) ...): one fused group a layer, symbolic batch B."""
    rng = np.random.default_rng(0)
    g = Graph()
    h = g.input("x", ("B", width))
    for i in range(layers):
        h = g.relu(h @ g.weight(f"w{i}", rng.standard_normal((width, width)).astype(np.float32)) + 1.0)
    model = g.build(h, names=["y"])
    return model, model.save(tmp_path / "mlp.mlir")


def test_table_has_a_fusion_row_and_totals_are_the_sum_of_rows(tmp_path, capsys):
    code, out, err = run(tilegraph_main, ["cost", dense_model(tmp_path), "--hardware", "cpu"], capsys)
    assert code == 0, err
    rows, total = table(out)
    assert any(r["label"].startswith("fusion") for r in rows), out
    assert "matmul add relu softmax" in out  # the epilogue landed in the GEMM's group
    assert total["kernels"] == len(rows)
    assert sum(r["flops"] for r in rows) == pytest.approx(total["flops"], rel=2e-3)
    assert sum(r["bytes"] for r in rows) == pytest.approx(total["bytes"], rel=2e-3)
    # times print with 3 decimals in the table's unit: each row is off by at most half of the last digit
    rounding = len(rows) * 0.0005 * SECONDS[re.search(r"time \((s|ms|us)\)", out).group(1)]
    assert abs(sum(r["time"] for r in rows) - total["time"]) <= rounding + 1e-3 * total["time"]
    # FLOPs of the group: 2*m*n*k for the GEMM plus the epilogue's per-element counts; never fewer than the GEMM's
    assert total["flops"] >= 2 * 256 * 64 * 64


def test_h100_predicts_a_big_matmul_faster_than_this_cpu(tmp_path, capsys):
    g = Graph()
    x = g.input("x", (2048, 2048))
    y = x @ g.weight("w", np.zeros((2048, 2048), dtype=np.float32))
    path = g.build(y, names=["y"]).save(tmp_path / "big.mlir")
    times = {}
    for target in ("cpu", "h100"):
        code, out, err = run(tilegraph_main, ["cost", path, "--hardware", target], capsys)
        assert code == 0, err
        rows, total = table(out)
        assert total["flops"] == pytest.approx(2 * 2048**3, rel=1e-3)
        assert rows[0]["bound"] == "compute"  # 2048^3 GEMM: intensity in the hundreds of FLOP/B
        times[target] = total["time"]
    # ~17 GFLOP: an H100 (hundreds of TFLOP/s) vs a few CPU cores (tens to hundreds of GFLOP/s)
    assert times["h100"] * 100 < times["cpu"], times


def test_symbolic_prints_formulas_that_match_the_table(tmp_path, capsys):
    g = Graph()
    x = g.input("x", ("batch", "seq", 32))
    w = g.weight("w", np.ones((32, 16), dtype=np.float32))
    path = g.build(g.relu(x @ w), names=["y"]).save(tmp_path / "seq.mlir")
    code, out, err = run(tilegraph_main, ["cost", path, "--hardware", "h100", "--symbolic"], capsys)
    assert code == 0, err
    formulas = dict(re.findall(r"^(FLOPs|bytes|time \[s\]) = (.+)$", out, re.M))
    batch, seq = sympy.symbols("batch seq")
    # 2*k*n per row for the GEMM (k=32, n=16), one per element for relu
    assert sympy.sympify(formulas["FLOPs"]) - (2 * 32 * 16 + 16) * batch * seq == 0
    time = sympy.sympify(formulas["time [s]"])
    assert {s.name for s in time.free_symbols} == {"batch", "seq"}
    # the formula and the table agree at concrete sizes
    code, out, err = run(tilegraph_main, ["cost", path, "--hardware", "h100", "--dim", "batch=4", "--dim", "seq=512"],
                         capsys)
    assert code == 0, err
    assert "sizes: batch=4, seq=512" in out
    _, total = table(out)
    assert float(time.subs({batch: 4, seq: 512})) == pytest.approx(total["time"], rel=2e-3)


def test_a_pipeline_target_option_beats_the_command_line_target():
    assert with_hardware("canonicalize,fuse{max-ops=4},tile{hardware=cpu}", "h100") == \
        'canonicalize,fuse{max-ops=4 hardware="h100"},tile{hardware="cpu"}'
    assert with_hardware("", "h100") == ""


def test_fuse_lowers_the_predicted_time_of_an_elementwise_chain(tmp_path, capsys):
    argv = [chain_model(tmp_path), "-p", "canonicalize,fuse,tile", "--print-cost-after-all", "--hardware", "cpu"]
    code, out, err = run(opt_main, argv, capsys)
    assert code == 0, err
    costs = {where: (float(t) * SECONDS[unit], int(k)) for where, t, unit, k in
             re.findall(r"^// cost (input|after \S+): ([\d.]+) (s|ms|us), (\d+) kernels?", out, re.M)}
    assert list(costs) == ["input", "after canonicalize", "after fuse", "after tile"]
    before, after = costs["after canonicalize"], costs["after fuse"]
    assert after[0] < before[0], out
    assert before[1] == 12 and after[1] == 1  # 4 links of exp, mul, add: one group
    assert "tg.fusion" in out  # the IR is still printed after the costs
    assert "remark" not in err  # remarks only when asked


def test_remarks_show_each_fuse_decision_with_its_prediction(tmp_path, capsys):
    code, _, err = run(opt_main, [chain_model(tmp_path, links=2), "-p", "fuse,tile", "--remarks"], capsys)
    assert code == 0, err
    fused = [line for line in err.splitlines() if line.startswith("remark: [fuse] fused")]
    assert len(fused) >= 5  # 6 ops end in one group: at least 5 merges
    assert all(re.search(r"predicted [\d.]+ us -> [\d.]+ us, saves [\d.]+ us", line) for line in fused), err
    assert any(line.startswith("remark: [tile]") for line in err.splitlines())


def test_report_plans_less_memory_than_all_intermediates(tmp_path, capsys):
    model, path = mlp_model(tmp_path)
    code, out, err = run(tilegraph_main, ["compile", path, "-o", tmp_path / "mlp_np.py", "--report", "--dim", "B=32"],
                         capsys)
    assert code == 0, err
    kernels = int(re.search(r"^kernels: (\d+)", out, re.M)[1])
    buffers = int(re.search(r"^planned buffers: (\d+)", out, re.M)[1])
    peak = count(re.search(r"planned peak of intermediates.*: (\S+)B at B=32", out)[1])
    assert kernels == 4 and buffers < kernels  # four layers, buffers reused
    # every value the model computes, at B=32: what running op by op with no reuse would hold
    intermediates = sum(sympy.sympify(numel(info.shape)).subs(symbol("B"), 32) * numpy_dtype(info.dtype).itemsize
                        for op in model.ops() if op.name not in ("tg.weight", "tg.constant")
                        for info in (info_of(r.type) for r in op.results))
    assert 0 < peak < intermediates
    assert re.search(r"weights: 4 arrays, 65.54kB", out)  # 4 x 64 x 64 float32
    # without sizes, the peak is the planner's formula in the symbolic batch
    code, out, _ = run(tilegraph_main, ["compile", path, "-o", tmp_path / "mlp_np.py", "--report"], capsys)
    formula = re.search(r"planned peak of intermediates.*: (.+) bytes", out)[1]
    assert float(sympy.sympify(formula).subs("B", 32)) == pytest.approx(peak, rel=1e-3)


@pytest.mark.parametrize("argv, needle", [
    (["cost", "{model}", "--hardware", "tpu"], "h100, h200, a100, cpu"),
    (["cost", "{model}", "--dim", "B"], "NAME=SIZE"),
    (["cost", "{model}", "--dim", "B=0"], "positive"),
    (["cost", "{model}", "--dim", "seq=8"], "symbolic dimensions: B"),
    (["cost", "{model}", "-p", "fuse{{no-such=1}}"], "pass 'fuse'"),
    (["compile", "{model}", "-o", "{tmp}/x.py", "--report", "--dim", "seq=8"], "symbolic dimensions: B"),
])
def test_bad_cost_arguments_are_clean_errors(tmp_path, capsys, argv, needle):
    _, path = mlp_model(tmp_path, layers=1)
    code, _, err = run(tilegraph_main, [a.format(model=path, tmp=tmp_path) for a in argv], capsys)
    assert code == 2 and "Traceback" not in err and err.startswith("tilegraph"), err
    assert needle in err, err
    assert not (tmp_path / "x.py").exists()  # a bad --dim fails before anything is written


def test_opt_rejects_an_unknown_hardware_target(tmp_path, capsys):
    code, _, err = run(opt_main, [chain_model(tmp_path, links=1), "--print-cost-after-all", "--hardware", "tpu"],
                       capsys)
    assert code == 2 and "unknown hardware target 'tpu'" in err, err
