"""Where a C module's time goes: each native step timed on its own, beside the whole model
on onnxruntime, so a step's share can be read against the peer's total.

The module is emitted with every step a segment of its own (emit_program(per_step=True)),
so each step is one native call; a step's time is the median over rounds of that call.
The sum of the steps is a little above the whole module's time (one call per step instead
of one per run of steps).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/c_steps.py [--models cnn,minilm,gpt2] [--repeat N] [--threads N]
                                                            [--top N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import cpu_speed  # noqa: E402
import torch  # noqa: E402

import tilegraph  # noqa: E402
from tilegraph.backends.c.build import build  # noqa: E402
from tilegraph.backends.c.emit import emit_program  # noqa: E402
from tilegraph.backends.c.runtime import CompiledModel, _c_array  # noqa: E402
from tilegraph.passes.registry import DEFAULT_PIPELINE  # noqa: E402


def step_times(optimized, arrays: list[np.ndarray], repeat: int, threads: int | None) -> tuple[list, float]:
    """(comment, median seconds) per step of the per-step module, and the whole call's median."""
    import ctypes

    program = emit_program(optimized, per_step=True)
    compiled = CompiledModel(program, ctypes.CDLL(str(build(program.source))), optimized.weights, optimized)
    if threads:
        compiled.set_threads(threads)
    compiled(*arrays)  # binds, packs the weights, plans the arena
    samples: dict[int, list[float]] = {}
    calls = {k: fn for k, fn in compiled._segments.items()}
    segment_of = {}
    for kind, k in program.plan:
        if kind == "segment":
            segment_of[k] = k
    whole = []
    original = compiled._segments
    for _ in range(repeat):
        timers = {}
        for k, fn in calls.items():
            def timed_call(state, ints, ptrs, fn=fn, k=k):
                t = time.perf_counter()
                rc = fn(state, ints, ptrs)
                timers[k] = time.perf_counter() - t
                return rc
            original[k] = timed_call
        t = time.perf_counter()
        compiled(*[_c_array(a) for a in arrays])
        whole.append(time.perf_counter() - t)
        for k, dt in timers.items():
            samples.setdefault(k, []).append(dt)
    steps = []
    segments = [k for kind, k in program.plan if kind == "segment"]
    step_of_segment = [i for i, s in enumerate(program.steps) if s.host_op is None]
    for k, i in zip(segments, step_of_segment):
        steps.append((f"step {i}: {program.steps[i].comment}", float(np.median(samples[k]))))
    return steps, float(np.median(whole))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="cnn", help="comma-separated, of: " + ", ".join(cpu_speed.MODELS))
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top", type=int, default=15, help="steps listed, slowest first")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for case in cpu_speed.cases(args.models.split(",")):
        module = case.module()
        arrays = [t.numpy() for t in case.inputs]
        with tempfile.TemporaryDirectory() as tmp:
            session = cpu_speed.ort_session(module, case.inputs, case.input_names, Path(tmp), args.threads)
        feeds = dict(zip(case.input_names, arrays))
        optimized = tilegraph.compile(tilegraph.import_model(module, case.inputs), target="numpy",
                                      pipeline=DEFAULT_PIPELINE).model
        steps, whole = step_times(optimized, arrays, args.repeat, args.threads)
        session.run(None, feeds)
        ort = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            session.run(None, feeds)
            ort.append(time.perf_counter() - t)
        ort_ms = 1e3 * float(np.median(ort))
        total = sum(t for _, t in steps)
        print(f"\n{case.label}: C per-step module {1e3 * whole:.3f} ms (steps sum {1e3 * total:.3f} ms), "
              f"onnxruntime {ort_ms:.3f} ms, {len(steps)} native steps")
        for comment, t in sorted(steps, key=lambda s: -s[1])[:args.top]:
            print(f"  {1e3 * t:8.3f} ms {100 * t / total:5.1f}%  {comment[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
