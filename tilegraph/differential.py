"""Differential fuzzing: random valid graphs through every backend that runs here, compared pairwise.

    python -m tilegraph.differential --minutes 30 --out fuzz-cases          # progress on stderr, a summary at the end
    python -m tilegraph.differential --replay fuzz-cases/case-0/model.mlir   # run a saved reproducer again

Graphs come from `tilegraph.testing.graphs()` (the property suite's strategy), inputs from
`random_inputs`. Each backend of `BACKENDS` runs the graph; every pair of outputs is compared
within the project's tolerance (`tilegraph.testing`, by the narrowest float type and the
reduction length; integers exactly), and so is each backend against the float64 interpreter,
which decides which side of a diverging pair is wrong. A backend that refuses a graph (an op
it does not lower, a TilegraphError) sits that graph out; any other exception is a divergence.

A divergence is shrunk by hypothesis to a smallest graph that still diverges, then saved as
`case-N/model.mlir` + `model.weights.npz` + `inputs.npz` with `replay.sh` holding the command.

Every compile target of `tilegraph.backends.BACKENDS` is registered here, with its check of
whether it runs on this machine; another runner (onnxruntime below) is one `register` line.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from tilegraph.backends import TARGETS
from tilegraph.ir import dtypes

Runner = Callable[[object, list], list]


@dataclass
class Backend:
    name: str
    run: Runner  # (model, inputs) -> outputs
    available: Callable[[], bool] = lambda: True


BACKENDS: dict[str, Backend] = {}


def register(name: str, run: Runner, available: Callable[[], bool] = lambda: True) -> None:
    BACKENDS[name] = Backend(name, run, available)


def _interpreter(model, inputs):
    from tilegraph.ir import interpret

    return interpret(model, inputs, float64=False)  # in the model's own dtypes, as a backend computes


def _compiled(target: str) -> Runner:
    def run(model, inputs):
        import tilegraph

        out = tilegraph.compile(model, target=target)(*inputs)
        return [np.asarray(o.cpu() if hasattr(o, "cpu") else o) for o in (out if isinstance(out, (list, tuple)) else [out])]
    return run


def _onnxruntime(model, inputs):
    import onnxruntime as ort

    from tilegraph.backends.onnx_export import to_onnx

    proto = to_onnx(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3  # its notes on unused initializers are not findings
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {i.name: np.asarray(a) for i, a in zip(session.get_inputs(), inputs)}
    return session.run(None, feeds)


def _runs_here(target: str) -> Callable[[], bool]:
    from tilegraph.backends import runs_here

    return lambda: runs_here(target)


register("interpreter", _interpreter)
for _target in TARGETS:
    register(_target, _compiled(_target), _runs_here(_target))
register("onnxruntime", _onnxruntime, lambda: importlib.util.find_spec("onnxruntime") is not None)


# --- comparing -------------------------------------------------------------------------------------


@dataclass
class Divergence:
    backend: str
    against: str
    detail: str


@dataclass
class Stats:
    graphs: int = 0
    runs: dict = field(default_factory=dict)  # backend -> graphs it ran
    refused: dict = field(default_factory=dict)  # backend -> graphs it refused
    cases: list = field(default_factory=list)


def _close(a, b, dtype: str, n: int) -> str | None:
    from tilegraph.testing import assert_close

    try:
        assert_close(a, b, dtype, n)
    except AssertionError as e:
        return str(e).strip().splitlines()[0][:300] + " | " + " ".join(str(e).split())[-200:]
    return None


def compare(model, inputs, backends: list[str], stats: Stats | None = None) -> list[Divergence]:
    """Run `model` on every backend; the divergences (each backend against the float64 interpreter,
    and each pair), empty when all agree within tolerance."""
    from tilegraph.ir import TilegraphError, interpret
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.testing import narrowest_float, reduction_length

    expected = interpret(model, inputs)
    _, sizes = bind_inputs(model, inputs)
    n, coarsest = reduction_length(model, sizes), narrowest_float(model)
    outs, found = {}, []
    for name in backends:
        try:
            outs[name] = BACKENDS[name].run(model, inputs)
        except TilegraphError:
            if stats is not None:
                stats.refused[name] = stats.refused.get(name, 0) + 1
            continue
        except Exception as e:  # noqa: BLE001 - a crash on a valid graph is what we look for
            found.append(Divergence(name, "-", f"raised {type(e).__name__}: {str(e)[:300]}"))
            continue
        if stats is not None:
            stats.runs[name] = stats.runs.get(name, 0) + 1
    for name, got in outs.items():
        for i, (info, e) in enumerate(zip(model.outputs, expected)):  # type: ignore[misc]
            dtype = coarsest if dtypes.is_float(info.dtype) and coarsest else info.dtype
            if i >= len(got):
                found.append(Divergence(name, "float64 interpreter", f"output {i} missing"))
                continue
            problem = _close(np.asarray(got[i]), e, dtype, n)
            if problem:
                found.append(Divergence(name, "float64 interpreter", f"output {i}: {problem}"))
    # Pairs: two results each within tolerance of float64 are within twice it of each other; a
    # reduction length of 4n doubles the tolerance (it grows with sqrt(n)).
    names = list(outs)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            for i, info in enumerate(model.outputs):
                dtype = coarsest if dtypes.is_float(info.dtype) and coarsest else info.dtype
                x, y = outs[names[a]], outs[names[b]]
                if i < len(x) and i < len(y):
                    problem = _close(np.asarray(x[i]), np.asarray(y[i]), dtype, 4 * n)
                    if problem:
                        found.append(Divergence(names[a], names[b], f"output {i}: {problem}"))
    return found


# --- the run ----------------------------------------------------------------------------------------


def save_case(out: Path, model, inputs, found: list[Divergence], backends: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    k = 0
    while (out / f"case-{k}").exists():
        k += 1
    case = out / f"case-{k}"
    case.mkdir()
    path = model.save(case / "model.mlir")
    np.savez(case / "inputs.npz", *inputs)
    command = f"python -m tilegraph.differential --replay {path} --backends {','.join(backends)}"
    (case / "replay.sh").write_text(command + "\n")
    (case / "divergence.txt").write_text("\n".join(f"{d.backend} vs {d.against}: {d.detail}" for d in found) + "\n")
    return case


def fuzz(minutes: float, out: Path, backends: list[str], seed: int = 0, max_ops: int = 8,
         log=lambda s: print(s, file=sys.stderr, end="", flush=True)) -> Stats:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from tilegraph.testing import graphs, random_inputs

    stats = Stats()
    deadline = time.monotonic() + 60 * minutes
    start = time.monotonic()
    batch = 0
    seen: set[str] = set()
    while time.monotonic() < deadline:
        failing: list = []

        @hseed(seed + batch)
        @settings(max_examples=10, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck),
                  phases=[Phase.generate, Phase.shrink])
        @given(model=graphs(max_ops=max_ops))
        def one(model):
            inputs = random_inputs(model, 0)
            stats.graphs += 1
            found = compare(model, inputs, backends, stats)
            if found:
                failing[:] = [(model, inputs, found)]  # noqa: B023
                raise AssertionError(found[0].detail)

        try:
            one()
        except Exception:  # noqa: BLE001 - hypothesis shrank it: the last failing call is the smallest
            if failing:
                model, inputs, found = failing[0]
                key = model.text
                if key not in seen:
                    seen.add(key)
                    case = save_case(out, model, inputs, found, backends)
                    stats.cases.append((case, found))
                    log(f"\n{case}: " + "; ".join(f"{d.backend} vs {d.against}: {d.detail[:160]}" for d in found[:2]) + "\n")
        batch += 1
        elapsed = time.monotonic() - start
        log(f"\r[{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] graphs {stats.graphs}, divergences "
            f"{len(stats.cases)}, ran " + ", ".join(f"{k} {v}" for k, v in stats.runs.items()) + "   ")
    log("\n")
    return stats


def replay(path: Path, backends: list[str]) -> int:
    from tilegraph.ir import Model

    model = Model.load(path)
    data = np.load(path.parent / "inputs.npz")
    inputs = [data[f"arr_{i}"] for i in range(len(data.files))]
    found = compare(model, inputs, backends)
    for d in found:
        print(f"{d.backend} vs {d.against}: {d.detail}")
    print("agree" if not found else f"{len(found)} divergence(s)")
    return 1 if found else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tilegraph.differential", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--out", default="fuzz-cases", type=Path)
    ap.add_argument("--backends", default=None, help=f"comma-separated, of: {', '.join(BACKENDS)} (default: all available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-ops", type=int, default=8)
    ap.add_argument("--replay", type=Path, help="a saved case's model.mlir: run it again")
    args = ap.parse_args(argv)
    names = args.backends.split(",") if args.backends else [b.name for b in BACKENDS.values() if b.available()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        print(f"unknown backend(s) {unknown}; known: {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    if args.replay:
        return replay(args.replay, names)
    stats = fuzz(args.minutes, args.out, names, args.seed, args.max_ops)
    print(f"{stats.graphs} graphs in {args.minutes:g} min on {', '.join(names)}; ran: "
          + ", ".join(f"{k} {v}" for k, v in stats.runs.items())
          + ("; refused: " + ", ".join(f"{k} {v}" for k, v in stats.refused.items()) if stats.refused else "")
          + f"; {len(stats.cases)} divergence(s)")
    for case, found in stats.cases:
        print(f"  {case}: " + "; ".join(f"{d.backend} vs {d.against}: {d.detail[:200]}" for d in found[:3]))
    return 1 if stats.cases else 0


if __name__ == "__main__":
    sys.exit(main())
