"""What the benchmark scripts share: timing, the machine they ran on, and table printing.

Timing rule (DESIGN.md: performance is a ratio measured in one run, side by side):
the peers are timed round-robin, one call each per round with the order rotated
every round, after a warm-up call each, and each one's median is reported. On a
shared machine a burst of load then lands on all of them alike instead of on
whichever happened to be running, and the median ignores the rounds it spoiled.

Switching libraries has a cost of its own: the thread pool of the one that just
ran (onnxruntime's intra-op pool, torch's OpenMP workers, OpenBLAS's) keeps
spinning for a while after its call returns, and on a 2-core machine those
spinners take the cores from the next library's call. So every timed call starts
after a pause (SETTLE_S), as it would in a process running one library, and a
fast runner also gets one untimed call before each timed one (SETTLE_BELOW_S).
`back_to_back` times the other case, a call right after one of the same runner.
A ratio of two runners is best taken per round (`paired_ratio`): the machine's
speed drifts over minutes, far less within a round.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def timed(fn: Callable):
    """(fn(), seconds it took): one call, for one-off costs such as compile time."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# A runner whose warm-up call took less than this gets an untimed settling call
# before each timed one. Measured on this project's 2-core machine, small CNN at
# batch 32: torch eager 0.74 ms timed alone, 2-30 ms right after onnxruntime and
# tilegraph calls, 0.83 ms after one settling call. The spin-down lasts a few ms,
# under a few percent of a call this long, so slower runners skip it (which keeps
# GPT-2-sized runs short).
SETTLE_BELOW_S = 0.05
# The pause before every timed call, so the previous runner's spinning pool threads
# have gone to sleep: libgomp spins up to 300k iterations by default, onnxruntime's
# intra-op workers a few thousand polls, OpenBLAS's workers a configurable loop; all
# are well under this. (On the 2-core dev machine it moved GPT-2 small b1 s256 by less
# than the run-to-run noise, 461 vs 470 ms for tilegraph: it matters for short calls.)
SETTLE_S = 0.05


def interleaved_samples(runners: dict[str, Callable], repeat: int, warmup: int = 1,
                        back_to_back: bool = False, first: dict[str, float] | None = None) -> dict[str, list[float]]:
    """Seconds of each call of each runner, timed round-robin: sample r of every runner
    comes from round r, so two runners' r-th samples were taken a fraction of a second apart.

    back_to_back: every timed call follows an untimed call of the same runner with no
    pause, so its thread pools are awake and its weights in cache, as in a serving loop
    (the pause comes before the untimed call); by default the pause comes right before
    the timed call. first: seconds of a call each runner already took (instead of a warmup
    round, to tell a fast runner; a runner missing from it counts as fast)."""
    names = list(runners)
    first = dict(first or {})
    for _ in range(warmup):
        for name in names:
            _, first[name] = timed(runners[name])
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        shift = r % len(names)  # rotate, so no runner always follows the same one
        for name in names[shift:] + names[:shift]:
            if back_to_back:  # the pause first, so the previous runner's spinning threads are asleep
                time.sleep(SETTLE_S)
                runners[name]()
            else:
                if first.get(name, 0.0) < SETTLE_BELOW_S:
                    runners[name]()
                time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            runners[name]()
            samples[name].append(time.perf_counter() - t0)
    return samples


def interleaved_medians(runners: dict[str, Callable], repeat: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each runner, timed round-robin over `repeat` rounds."""
    return {name: float(np.median(s)) for name, s in interleaved_samples(runners, repeat, warmup).items()}


def paired_ratio(samples: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) over rounds of a's time / b's in the same round.

    The shared machine's speed drifts by 20-40% over minutes, far more than within one
    round: a ratio per round cancels the drift that separate medians of a and b keep."""
    ratios = np.asarray(samples[a]) / np.asarray(samples[b])
    q1, median, q3 = np.percentile(ratios, [25, 50, 75])
    return float(median), float(q1), float(q3)


def paired_calls(calls: dict[str, Callable], repeat: int, a: str, b: str):
    """Each runner's median seconds per call and paired_ratio(a, b), a sample of each being
    enough calls to take ~20 ms (one call timed first to size it), timed round-robin."""
    runs = {}
    for label, call in calls.items():
        t0 = time.perf_counter()
        call()
        inner = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-6)))
        runs[label] = (lambda f=call, n=inner: [f() for _ in range(n)], inner)
    samples = interleaved_samples({key: fn for key, (fn, _) in runs.items()}, repeat)
    samples = {key: [t / runs[key][1] for t in samples[key]] for key in runs}  # per call
    return {key: float(np.median(samples[key])) for key in runs}, paired_ratio(samples, a, b)


def load_kernels(checkout: Path, name: str = "base"):
    """`ir/kernels.py` of a checkout, as a module of its own name (exits 2 if absent), with
    `attention_tiled` from backends/numpy/attention.py where an older checkout keeps it there."""
    path = checkout / "ir" / "kernels.py"
    if not path.is_file():
        print(f"--base {checkout}: no ir/kernels.py there", file=sys.stderr)
        sys.exit(2)
    module = _load_file(f"{name}_kernels", path)
    tiled = checkout / "backends" / "numpy" / "attention.py"
    if tiled.is_file():
        module.attention_tiled = _load_file(f"{name}_attention", tiled).attention_tiled
    return module


def _load_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_name() -> str:
    """The BLAS NumPy runs (its matmuls are tilegraph NumPy's) and, where threadpoolctl
    is installed to ask, its thread count."""
    try:
        from threadpoolctl import threadpool_info

        pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        pools = [p for p in pools if "numpy" in p.get("filepath", "")] or pools  # not torch's or scipy's copy
        if pools:
            return ", ".join(f"{p['internal_api']} {p.get('version') or ''} {p['num_threads']} thread{'s' * (p['num_threads'] != 1)}" for p in pools)
    except ImportError:
        pass
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"].get("blas", {})
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # older NumPy: no dict form
        return "?"


def machine_lines(**versions: str) -> list[str]:
    """The machine and library versions, for the top of a benchmark's output."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [f"machine: {cpu_model()}, {os.cpu_count()} logical cores ({usable} usable by this process), "
             f"{platform.system()} {platform.release()}",
             f"python {platform.python_version()}, numpy {np.__version__} (BLAS: {blas_name()})"]
    if versions:
        lines.append(", ".join(f"{k} {v}" for k, v in versions.items()))
    return lines


def format_table(header: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> str:
    """A plain-text table; `align` has one letter per column, 'l' or 'r' (default: first l, rest r)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    align = align or "l" + "r" * (len(header) - 1)

    def line(row):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def char_gpt_options(ap, *, layers: int, hidden: int, heads: int, block: int, batch: int) -> None:
    """The character GPT's shape (tests/models.py `char_gpt`) as options, with a script's defaults."""
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("block", block),
                        ("batch", batch)):
        ap.add_argument(f"--{name}", type=int, default=value)


def llama_shape_options(ap, *, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int) -> None:
    """A Llama-shaped model's sizes (from config, random weights) as options, with a script's defaults."""
    for name, value in (("hidden", hidden), ("ffn", ffn), ("layers", layers), ("heads", heads),
                        ("kv-heads", kv_heads), ("vocab", vocab)):
        ap.add_argument(f"--{name}", type=int, default=value)


def char_gpt_run(args):
    """Print the machine and its load, then (symbols, batches, module): the character GPT the
    options describe (tests/models.py `char_gpt`) and its batches of the shipped text."""
    import torch

    from tests.models import char_batches, char_corpus, char_gpt

    for line in machine_lines(torch=torch.__version__):
        print(line)
    print(f"load average at start: {os.getloadavg()} (other agents share this machine)")
    chars, batches = char_batches(char_corpus(), args.steps, args.batch, args.block)
    return chars, batches, char_gpt(len(chars), args.layers, args.hidden, args.heads, args.block)


def gpt2_shaped_step_setup(doc: str):
    """A GPT-2-small-shaped training step's script start (train_cross_entropy.py,
    train_bias_gradient.py): options --layers/--threads/--repeat parsed, the machine and load
    printed, the model (tests/models.py CharGPT, 768 wide, 12 heads, 50257 symbols) and one
    batch of 4 x 256. Returns (args, module, inputs, targets)."""
    import argparse

    import torch

    from tests.models import char_gpt

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    for line in machine_lines(torch=torch.__version__):
        print(line)
    print(f"load average at start: {os.getloadavg()} (other agents share this machine)")
    module = char_gpt(50257, layers=args.layers, hidden=768, heads=12, block=256)
    ids = torch.randint(0, 50257, (4, 257), generator=torch.Generator().manual_seed(1))
    return args, module, (ids[:, :-1],), ids[:, 1:].numpy()
