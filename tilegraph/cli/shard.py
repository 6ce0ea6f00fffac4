"""`tilegraph shard`: the sharding plan, with a status line while the solver runs."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path

from tilegraph.cli.common import (_formula, _input_symbols, check_dims, describe_sizes, format_time, parse_dims,
                                  sizes_for, spec_text)
from tilegraph.ir.ops import Op


def _shard(args) -> int:
    from tilegraph.ir.errors import TilegraphError
    from tilegraph.ir.hardware import GPUS, hardware
    from tilegraph.passes.cost.collectives import Mesh, parse_mesh
    from tilegraph.passes.registry import UNFUSED_PIPELINE, run_pipeline
    from tilegraph.passes.shard import parse_memory, plan

    try:
        shape, budget = parse_mesh(args.mesh), parse_memory(args.memory)
    except ValueError as e:
        raise TilegraphError(str(e)) from None
    if str(args.hardware).lower() not in GPUS:  # (before hardware(): "cpu" would calibrate this machine)
        raise TilegraphError(f"--hardware {args.hardware}: sharding plans are for GPUs ({', '.join(GPUS)})")
    hw = hardware(args.hardware)
    dims = parse_dims(args.dim)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    with StatusLine("tilegraph shard") if show else contextlib.nullcontext() as status:
        if status:
            status("importing the model")
        model = run_pipeline(_model_to_plan(args), UNFUSED_PIPELINE if args.pipeline is None else args.pipeline)
        symbols = _input_symbols(model)
        check_dims(dims, symbols)
        sizes, defaulted = sizes_for(symbols, dims)
        p = plan(model.module, Mesh(shape, hw), budget=budget, sizes=sizes, training=not args.inference,
                 names=model.input_names, progress=status)
    print(f"{Path(args.model).name if args.model else args.config} on {p.mesh} x {hw.name} ({p.mesh.devices} devices), "
          f"{'forward pass' if args.inference else 'training step'}")
    if sizes:
        print(f"sizes: {describe_sizes(sizes, defaulted)}")
    _print_plan(p)
    if args.symbolic:
        print(f"step time [s] = {_formula(p.formula, dims)}")
    return 0


def _model_to_plan(args):
    """The model file, or the model --config describes (a config.json or a named shape), never both."""
    import tilegraph
    from tilegraph.ir.errors import TilegraphError

    if (args.model is None) == (args.config is None):
        raise TilegraphError("tilegraph shard plans a model file or a --config (a config.json or a named shape "
                             "such as llama-7b): give exactly one")
    if args.model is not None:
        return tilegraph.import_model(args.model, trust_pickle=args.trust_pickle)
    from tilegraph.frontends.config import NAMED_CONFIGS, from_config, read_config

    config = NAMED_CONFIGS.get(args.config.lower()) or read_config(args.config)
    return from_config(config)


# How often a status line on a terminal is redrawn (its elapsed time ticks while a stage runs).
STATUS_REFRESH_S = 0.5


class StatusLine:
    """A long command's progress on stderr: the stage it is in and how long it has run.

    On a terminal, one line redrawn in place (by a thread, so the time ticks while one call,
    such as the integer program's solve, runs) and cleared at the end. Elsewhere (--progress
    into a file or a pipe), one line per stage, so a log is not filled with redraws."""

    def __init__(self, tool: str, stream=None):
        self.tool, self.stream = tool, stream or sys.stderr
        self.live = self.stream.isatty()
        self.stage, self.started = "", time.perf_counter()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, stage: str) -> None:
        with self._lock:
            self.stage = stage
            if self.live:
                self._draw()
            else:
                print(f"{self.tool}: {stage} ({time.perf_counter() - self.started:.1f} s)", file=self.stream,
                      flush=True)

    def _draw(self) -> None:
        self.stream.write(f"\r\x1b[K{self.tool}: {self.stage} ({time.perf_counter() - self.started:.0f} s)")
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(STATUS_REFRESH_S):
            with self._lock:
                self._draw()

    def __enter__(self) -> "StatusLine":
        if self.live:
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.stream.write("\r\x1b[K")  # the line goes: the plan (or the error) is printed next
            self.stream.flush()


def _print_plan(p) -> None:
    from tilegraph.passes.shard import SOLVE_TIME_LIMIT, recompute_text

    start, period, copies = p.layers
    parts = [("", 0, len(p.choices))] if not copies else [
        ("before the layers", 0, start),
        (f"each of {copies} repeated blocks (ops {start}..{start + period - 1}, the same plan in every block; "
         "ops that differ are listed before and after)", start, start + period),
        ("after the layers", start + period * copies, len(p.choices))]
    for title, lo, hi in parts:
        rows = p.choices[lo:hi]
        if not rows:
            continue
        if title:
            print(f"-- {title}")
        width = max(len(c.node.label) for c in rows)
        for c in rows:
            if c.node.op is None or c.node.op.op_name in (Op.weight, Op.constant) or not (c.compute or c.comm):
                continue
            print(f"  {c.node.label:<{width}}  {c.strategy.name:<12}  compute {format_time(c.compute):>10}  "
                  f"comm {format_time(c.comm):>10}")
        split = [f"{c.node.label} {spec_text(c.strategy.out)}" for c in rows
                 if c.node.op is not None and c.node.op.op_name == Op.weight and c.strategy.name != "R"]
        inputs = [f"{c.node.label} {spec_text(c.strategy.out)}" for c in rows if c.node.op is None]
        if inputs:
            print(f"  inputs: {', '.join(inputs)}")
        if split:
            print(f"  weights split: {', '.join(split)}")
    print(f"forward collectives per step: {len(p.forward)} "
          f"({', '.join(sorted(set(k for k, _, _ in p.forward))) or 'none'})")
    share = p.comm / p.time if p.time else 0.0
    print(f"predicted step time: {format_time(p.time)} = compute {format_time(p.compute)} + communication "
          f"{format_time(p.comm)} ({100 * share:.1f}% communication)")
    budget = p.budget or p.mesh.hw.memory_bytes
    print(f"memory per device: {p.memory / 1e9:.4g} GB (budget {budget / 1e9:.4g} GB"
          + (f" of {p.mesh.hw.memory_bytes / 1e9:.4g} GB" if budget != p.mesh.hw.memory_bytes else "") + "); "
          f"ZeRO stage {p.zero}, {recompute_text(p)} in the backward")
    if p.runner_up is not None:
        tie = " (a different layout, predicted as fast)" if p.runner_up.time <= p.time * (1 + 1e-9) else ""
        print(f"runner-up: {format_time(p.runner_up.time)} (compute {format_time(p.runner_up.compute)} + "
              f"communication {format_time(p.runner_up.comm)}){tie}")
    cut = f"; stopped at the {SOLVE_TIME_LIMIT:g} s limit: the best plan found, not proven best" if p.cut_short else ""
    print(f"solved in {p.solve_time:.2f} s ({p.variables} variables{cut})")
