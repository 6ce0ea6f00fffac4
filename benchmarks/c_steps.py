"""Where a C module's time goes: each native step timed on its own, beside the whole model
on onnxruntime, so a step's share can be read against the peer's total.

The module is emitted with every step a segment of its own (emit_program(per_step=True)),
so each step is one native call; a step's time is the median over rounds of that call.
The sum of the steps is a little above the whole module's time (one call per step instead
of one per run of steps).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/c_steps.py [--models cnn,minilm,gpt2] [--archs resnet,lstm]
                                                            [--full resnet50,bert-base [--batch N]]
                                                            [--repeat N] [--threads N] [--top N]
                                                            [--precision bf16] [--pipeline PASSES]
                                                            [--ort-profile [--in-order]]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import arch_sweep  # noqa: E402
import cpu_speed  # noqa: E402
import full_size_sweep  # noqa: E402
import torch  # noqa: E402

import tilegraph  # noqa: E402
from tilegraph.backends.c.build import build  # noqa: E402
from tilegraph.backends.c.emit import emit_program  # noqa: E402
from tilegraph.backends.c.runtime import CompiledModel  # noqa: E402
from tilegraph.ir.dialect import FusionOp  # noqa: E402
from tilegraph.passes.cost.model import at, op_flops  # noqa: E402
from tilegraph.passes.registry import default_pipeline  # noqa: E402


def kernel_flops(kernel) -> float:
    """FLOPs of one call of a top-level kernel (a fused group or one op) by the op table's
    `flops` traits; 0 where a dim is known only at run time."""
    try:
        return sum(at(op_flops(o)) for o in (kernel.ops if isinstance(kernel, FusionOp) else [kernel]))
    except ValueError:
        return 0.0


def gflops(flops: float, seconds: float) -> str:
    """The achieved rate of a step, blank for one that does no arithmetic to speak of."""
    return f"{flops / seconds / 1e9:6.1f} GFLOP/s" if flops > 1e6 and seconds > 0 else " " * 13


def step_times(optimized, arrays: list[np.ndarray], repeat: int, threads: int | None,
               precision: str = "f32") -> tuple[list, float]:
    """(description, median seconds, FLOPs) per step of the per-step module (native steps, and
    ops run on the host), and the whole call's median. A kernel split over several steps has
    its FLOPs on its first step."""
    program = emit_program(optimized, per_step=True)
    compiled = CompiledModel(program, ctypes.CDLL(str(build(program.source))), optimized.weights, optimized,
                             precision)
    if threads:
        compiled.set_threads(threads)
    compiled(*arrays)  # binds, packs the weights, plans the arena
    samples: dict[int, list[float]] = {}  # step index -> seconds per call

    def timed(fn, step: int):
        def call(*args):
            t = time.perf_counter()
            rc = fn(*args)
            samples.setdefault(step, []).append(time.perf_counter() - t)
            return rc
        return call

    # Per step, the plan has one entry a step, in order: ("segment", k) or ("host", i).
    segment_step = {k: i for i, (kind, k) in enumerate(program.plan) if kind == "segment"}
    for k, step in segment_step.items():
        compiled._segments[k] = timed(compiled._segments[k], step)
    host = compiled._host
    compiled._host = lambda step, *rest: timed(host, program.steps.index(step))(step, *rest)
    whole = []
    for _ in range(repeat):
        t = time.perf_counter()
        compiled(*arrays)
        whole.append(time.perf_counter() - t)
    counted: set[int] = set()  # kernels whose FLOPs a step already carries

    def flops(i: int) -> float:
        kernel = program.steps[i].kernel or program.steps[i].host_op
        if kernel is None or id(kernel) in counted:
            return 0.0
        counted.add(id(kernel))
        return kernel_flops(kernel)
    steps = [(f"step {i}{' (host)' if program.steps[i].host_op is not None else ''}: {program.steps[i].comment}",
              float(np.median(ts[-repeat:])), flops(i)) for i, ts in sorted(samples.items())]
    return steps, float(np.median(whole))


def step_kind(comment: str) -> str:
    """A step's kind for the summary: the ops its comment names, shapes dropped."""
    body = comment.split(": ", 1)[-1]
    return body.split(" [")[0].split(" (")[0].strip()[:60]


def print_by_kind(steps: list, total: float) -> None:
    kinds: dict[str, list[tuple[float, float]]] = {}
    for comment, t, flops in steps:
        kinds.setdefault(step_kind(comment), []).append((t, flops))
    print("  C steps by kind:")
    for kind, rows in sorted(kinds.items(), key=lambda kv: -sum(t for t, _ in kv[1])):
        t, flops = sum(t for t, _ in rows), sum(f for _, f in rows)
        print(f"    {1e3 * t:8.3f} ms {100 * t / total:5.1f}% {gflops(flops, t)}  x{len(rows):<3d} {kind}")


def print_ort_profile(session, feeds: dict, repeat: int) -> None:
    """onnxruntime's own profile (SessionOptions.enable_profiling): node time summed by op
    type, median over the runs, so its kernels can be set beside the C steps."""
    import json
    for _ in range(repeat):
        session.run(None, feeds)
    with open(session.end_profiling()) as f:
        events = json.load(f)
    per_run: dict[str, dict[int, float]] = {}  # op type -> run index -> microseconds
    run = -1
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            run += 1
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            per_run.setdefault(op, {}).setdefault(run, 0.0)
            per_run[op][run] += e["dur"]
    med = {op: float(np.median(list(runs.values()))) for op, runs in per_run.items()}
    total = sum(med.values())
    print(f"  onnxruntime profile: kernels sum {total / 1e3:.3f} ms")
    for op, us in sorted(med.items(), key=lambda kv: -kv[1]):
        print(f"    {us / 1e3:8.3f} ms {100 * us / total:5.1f}%  {op}")


def print_ort_nodes(session, feeds: dict, repeat: int) -> None:
    """onnxruntime's own profile node by node, in the order it ran them: op type, input and
    output shapes, median time, so each C step (printed in order with --in-order) can be set
    beside the nodes it replaces (a convolution and the activation onnxruntime runs after it)."""
    import json
    for _ in range(repeat):
        session.run(None, feeds)
    with open(session.end_profiling()) as f:
        events = json.load(f)
    nodes: dict[str, tuple] = {}  # name -> (op, input shapes, output shapes, [microseconds])
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            a = e.get("args", {})
            shapes = [[list(d.values())[0] for d in a.get(k, [])] for k in ("input_type_shape", "output_type_shape")]
            nodes.setdefault(e["name"][:-len("_kernel_time")], (a.get("op_name", "?"), *shapes, []))[3].append(e["dur"])
    print(f"  onnxruntime nodes in order: {len(nodes)}")
    for name, (op, ins, outs, us) in nodes.items():
        print(f"    {np.median(us) / 1e3:8.3f} ms  {op:18s} {ins} -> {outs}  {name[-48:]}")


def openvino_request(module, inputs, names, tmp: Path, threads: int | None):
    """OpenVINO at its default precision (bf16 where the processor has bf16 units) with its
    per-node counters on (PERF_COUNT), over the ONNX export full_size_sweep.py feeds it."""
    import openvino as ov

    import models

    path = models.export_onnx(module, inputs, tmp / "model.onnx", input_names=names, output_names=["y"])
    config = {"PERFORMANCE_HINT": "LATENCY", "PERF_COUNT": "YES"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    return ov.Core().compile_model(str(path), "CPU", config).create_infer_request()


def print_ov_profile(request, feeds: dict, repeat: int, in_order: bool) -> float:
    """OpenVINO's per-node profile (get_profiling_info after each run): node time summed by
    (node type, kernel), median over the runs; with in_order every executed node in order.
    Returns the median time of a whole call (ms)."""
    per_node: dict[str, list] = {}  # node name -> [type, exec type, [microseconds per run]]
    whole = []
    for _ in range(repeat):
        t = time.perf_counter()
        request.infer(feeds)
        whole.append(time.perf_counter() - t)
        for info in request.get_profiling_info():
            if info.status.name != "EXECUTED":
                continue
            entry = per_node.setdefault(info.node_name, [info.node_type, info.exec_type, []])
            entry[2].append(info.real_time.total_seconds() * 1e6)
    med = {name: float(np.median(us)) for name, (_, _, us) in per_node.items()}
    total = sum(med.values())
    print(f"  openvino profile: call {1e3 * float(np.median(whole)):.3f} ms, nodes sum {total / 1e3:.3f} ms, "
          f"{len(per_node)} executed nodes")
    if in_order:
        for name, (kind, exec_type, _) in per_node.items():
            print(f"    {med[name] / 1e3:8.3f} ms  {kind:18s} {exec_type:28s} {name[-60:]}")
        return 1e3 * float(np.median(whole))
    kinds: dict[tuple, list[float]] = {}
    for name, (kind, exec_type, _) in per_node.items():
        kinds.setdefault((kind, exec_type), []).append(med[name])
    for (kind, exec_type), us in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"    {sum(us) / 1e3:8.3f} ms {100 * sum(us) / total:5.1f}%  x{len(us):<3d} {kind} ({exec_type})")
    return 1e3 * float(np.median(whole))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="cnn", help="comma-separated, of: " + ", ".join(cpu_speed.MODELS))
    ap.add_argument("--archs", default="", help="comma-separated names of benchmarks/arch_sweep.py's architectures")
    ap.add_argument("--full", default="", help="comma-separated names of benchmarks/full_size_sweep.py's models")
    ap.add_argument("--batch", type=int, default=1, help="batch of the --full models")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top", type=int, default=15, help="steps listed, slowest first")
    ap.add_argument("--precision", default="f32", help="the C module's precision (f32, bf16)")
    ap.add_argument("--pipeline", default=None,
                    help="the pass pipeline (default: the C backend's own at --precision), e.g. with `attention` "
                         "to time the flash kernel against the spelled-out chain")
    ap.add_argument("--ort-profile", action="store_true",
                    help="also print onnxruntime's own per-op-type profile and the C steps summed by kind")
    ap.add_argument("--in-order", action="store_true",
                    help="list every C step in order (not the --top slowest) and, with --ort-profile, every "
                         "onnxruntime node in order, to set them side by side")
    ap.add_argument("--ov-profile", action="store_true",
                    help="also print OpenVINO's per-node profile at its default precision (PERF_COUNT), summed by "
                         "node type (with --in-order: every node in order), and the C steps summed by kind")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = cpu_speed.cases(args.models.split(",")) if args.models else []
    for name in filter(None, args.archs.split(",")):
        arch = next(a for a in arch_sweep.ARCHS if a.name == name)
        arch_sweep.FirstOutput = arch_sweep._first_output_class()
        module, names, inputs = arch_sweep.build(arch)
        chosen.append(cpu_speed.Case(name, name, lambda module=module: module, inputs, names))
    full = set(filter(None, args.full.split(",")))
    for name in filter(None, args.full.split(",")):
        module, names, inputs = full_size_sweep.build(name, args.batch)
        chosen.append(cpu_speed.Case(name, name, lambda module=module: module, inputs, names))
    for case in chosen:
        module = case.module()
        arrays = [t.numpy() for t in case.inputs]
        if case.model in full:  # as full_size_sweep.py compiles it: exported at its static shapes, before
            with torch.no_grad():  # the ONNX exporter runs (after it, Swin's window shift guards on the batch)
                source = torch.export.export(module, tuple(case.inputs))
        else:
            source = tilegraph.import_model(module, case.inputs)
        with tempfile.TemporaryDirectory() as tmp:
            session = cpu_speed.ort_session(module, case.inputs, case.input_names, Path(tmp), args.threads)
            profiled = (cpu_speed.ort_session(module, case.inputs, case.input_names, Path(tmp), args.threads,
                                              profile=True) if args.ort_profile else None)
            ov_request = (openvino_request(module, case.inputs, case.input_names, Path(tmp), args.threads)
                          if args.ov_profile else None)
        feeds = dict(zip(case.input_names, arrays))
        optimized = tilegraph.compile(source, target="c",
                                      pipeline=args.pipeline or default_pipeline("c", args.precision)).model
        steps, whole = step_times(optimized, arrays, args.repeat, args.threads, args.precision)
        session.run(None, feeds)
        ort = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            session.run(None, feeds)
            ort.append(time.perf_counter() - t)
        ort_ms = 1e3 * float(np.median(ort))
        total = sum(s[1] for s in steps)
        print(f"\n{case.label}: C per-step module {1e3 * whole:.3f} ms (steps sum {1e3 * total:.3f} ms), "
              f"onnxruntime {ort_ms:.3f} ms, {len(steps)} native steps")
        listed = sorted(steps, key=lambda s: int(s[0].split()[1].rstrip(":"))) if args.in_order else \
            sorted(steps, key=lambda s: -s[1])[:args.top]
        for comment, t, flops in listed:
            print(f"  {1e3 * t:8.3f} ms {100 * t / total:5.1f}% {gflops(flops, t)}  {comment[:110]}")
        if profiled is not None or ov_request is not None:
            print_by_kind(steps, total)
        if profiled is not None:
            (print_ort_nodes if args.in_order else print_ort_profile)(profiled, feeds, args.repeat)
        if ov_request is not None:
            ov_request.infer(feeds)
            print_ov_profile(ov_request, feeds, args.repeat, args.in_order)
    return 0


if __name__ == "__main__":
    sys.exit(main())
