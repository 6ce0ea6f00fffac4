"""What every calibrator shares: timing calls on a shared machine, the processor's caches
and memory, a progress bar, and measuring, saving and printing a profile.

The backends' calibrators (backends/numpy/calibrate.py, backends/c/calibrate.py) time their own
kernels with it and hand ir/hardware.py the profile; the numbers they measure are theirs.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from tilegraph.ir.hardware import (BUSY_CORES, Hardware, clear_cache, cpu_clock, load_cached, marked_off_peak,
                                   measured_noting_load, off_peak, others_cores, quiet_now, save_profile)

# Fallbacks where /sys does not say (sizes of a common x86 server core).
DEFAULT_L1D, DEFAULT_L2, DEFAULT_L3 = 32 * 2**10, 512 * 2**10, 32 * 2**20
# Calls are timed in batches at least this long, so the timer's ~0.1 us is noise; no
# longer, so a neighbour's time slice (ms) spoils as few samples as it can.
MIN_BATCH = 20e-6


# Batch, heads, sequence and head dims of the attention measurement: MiniLM's (32) and
# GPT-2's (64) heads, at enough scores (4 x 12 x 128 x 128) that the kernel runs on all
# cores (ir/hardware.MIN_PARALLEL_SCORES).
ATTENTION_BATCH, ATTENTION_HEADS, ATTENTION_SEQ, ATTENTION_HEAD_DIMS = 4, 12, 128, (32, 64)


def cache_sizes() -> dict[str, int]:
    """Per-core L1d and L2 and the shared L3, in bytes, from /sys (fallbacks if absent)."""
    sizes = {"l1d": DEFAULT_L1D, "l2": DEFAULT_L2, "l3": DEFAULT_L3}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(root.glob("index*")) if root.is_dir() else ():
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if level == 1 and kind == "Data":
            sizes["l1d"] = size
        elif level in (2, 3) and kind in ("Unified", "Data"):
            sizes[f"l{level}"] = size
    return sizes


def _parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if text and text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


def median_time(fn: Callable[[], object], budget: float) -> float:
    """Median seconds of one call of `fn`, from batches of calls timed for about `budget` s."""
    return median_times((fn,), budget)[0]


def median_times(fns, budget: float, quantile: float = 0.5) -> list[float]:
    """median_time of each of `fns`, their batches interleaved so that a neighbour's
    load on a shared machine falls on all of them alike (what a difference needs).

    The median, not the best: a core running alone is clocked higher than two running
    together (turbo, AVX-512 licences), so the best single-core batch can be far faster
    than its median, and a parallel efficiency from best times swings from run to run
    where medians hold steady. `quantile` < 0.5 takes a quieter batch than the median
    (the C calibration's: on a shared machine, most batches lose time slices to others).
    """
    once = []
    for fn in fns:
        fn()  # warm up: page faults, BLAS threads waking
        start = time.perf_counter()
        fn()
        once.append(max(time.perf_counter() - start, 1e-8))
    numbers = [max(1, int(MIN_BATCH / t)) for t in once]
    round_time = sum(t * n for t, n in zip(once, numbers))
    repeat = min(max(3, int(budget / round_time)), 5001)
    samples: list[list[float]] = [[] for _ in fns]
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            for fn, number, out in zip(fns, numbers, samples):
                start = time.perf_counter()
                for _ in range(number):
                    fn()
                out.append((time.perf_counter() - start) / number)
    finally:
        if gc_was_enabled:
            gc.enable()
    return [float(np.quantile(s, quantile)) for s in samples]


class Fastest:
    """Times measurements taken in rounds far apart in time, and gives each its fastest round.

    A neighbour that keeps a core busy for a whole measurement (seconds) slows every batch of it,
    so no quantile of one measurement sees past it; a calibration in rounds (each the whole run,
    tens of seconds apart) keeps, of each measurement, the round others left it alone. Called as
    `median_times` is; a round makes the same calls in the same order (the nth call of a round is
    the nth of every other), and each call answers the fastest of its times so far. `quiet[n]`:
    whether other processes left measurement n alone (used under BUSY_CORES of a core while it
    ran) in some round so far."""

    def __init__(self, quantile: float = 0.5):
        self.quantile = quantile
        self.best: list[list[float]] = []
        self.quiet: list[bool] = []
        self._next = 0

    def new_round(self) -> None:
        self._next = 0

    def __call__(self, fns, budget: float) -> list[float]:
        start = cpu_clock()
        times = median_times(fns, budget, self.quantile)
        alone = others_cores(start, min_window=0.0) < BUSY_CORES
        if self._next == len(self.best):
            self.best.append(times)
            self.quiet.append(alone)
        elif len(self.best[self._next]) != len(times):
            raise AssertionError(f"measurement {self._next} of a round timed {len(times)} calls, "
                                 f"{len(self.best[self._next])} in the round before: rounds must repeat one another")
        else:
            self.best[self._next] = [min(a, b) for a, b in zip(self.best[self._next], times)]
            self.quiet[self._next] = self.quiet[self._next] or alone
        self._next += 1
        return self.best[self._next - 1]


def in_rounds(measure_round: Callable[[Fastest], Hardware], rounds: int, quantile: float, wait: float,
              most: int | None = None) -> Hardware:
    """The profile `measure_round(timer)` builds in the last of `rounds` rounds, when `timer` (a
    Fastest) answers each measurement's fastest round; more rounds, up to `most` in all, while
    some measurement had others busy beside it in every round so far (a neighbour that stays a
    minute outlasts three rounds). Before each round after the first, up to `wait` seconds pass
    waiting for other processes to leave the cores (quiet_now)."""
    timer = Fastest(quantile)
    profile = None
    r = 0
    while r < rounds or (r < (most or rounds) and not all(timer.quiet)):
        if r:
            _wait_for_quiet(wait)
        timer.new_round()
        profile = measure_round(timer)
        r += 1
    assert profile is not None, "in_rounds needs a round"
    return profile


def _wait_for_quiet(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not quiet_now():
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))


class Progress:
    """A text progress bar on stderr naming the step under way: redrawn in place on a
    terminal, one line a step otherwise."""

    WIDTH = 30

    def __init__(self, total: int, enabled: bool, stream=None):
        self.total, self.started, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def step(self, label: str) -> None:
        self.started += 1
        self.total = max(self.total, self.started)  # a calibration that takes more rounds than it planned
        if self.enabled:
            self._draw(self.started - 1, f"{self.started}/{self.total} {label}")

    def close(self) -> None:
        if self.enabled and self.tty:
            self._draw(self.total, "done")
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, done: int, text: str) -> None:
        if self.tty:
            filled = self.WIDTH * done // self.total
            self.stream.write(f"\rcalibrating [{'#' * filled}{'.' * (self.WIDTH - filled)}] {text:<32}")
        else:
            self.stream.write(f"calibrating {text}\n")
        self.stream.flush()


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 0


def table(title: str, rows: list[tuple[str, str]]) -> str:
    """(measurement, value) rows under `title`, in two aligned columns."""
    width = max(len(r[0]) for r in rows)
    value = max(16, *(len(r[1]) for r in rows))
    lines = [title, f"{'measurement':<{width}}  {'value':>{value}}"]
    lines += [f"{name:<{width}}  {v:>{value}}" for name, v in rows]
    return "\n".join(lines)


# A quiet processor does not lose this share of its GEMM rate or memory bandwidth between two
# measurements: a new profile that lost it was slowed by something the load check does not see.
IMPLAUSIBLY_SLOWER = 0.6


def implausibly_slower(hw: Hardware, earlier: Hardware) -> str | None:
    """What of `hw` is under IMPLAUSIBLY_SLOWER of the same processor's `earlier` profile, or None."""
    rates = [("peak f32 GEMM", hw.flops("f32"), earlier.flops("f32")),
             ("memory bandwidth", hw.memory_bandwidth, earlier.memory_bandwidth)]
    low = [f"{name} at {new / old:.0%}" for name, new, old in rates if old > 0 and new < IMPLAUSIBLY_SLOWER * old]
    return ", ".join(low) or None


def measure_and_save(measure_fn, summary_fn, path, quick: bool, progress: bool, command: str) -> Path:
    """Measure with `measure_fn`, save to `path`, print `summary_fn`'s table. A measurement
    taken while other processes kept the cores busy (ir/hardware.measured_noting_load) is not
    cached as is: it is saved marked `measured_busy` (the first process to find the machine
    quiet measures again), and never over a profile at `path` that was measured quiet; nor is
    one implausibly slower than that quiet profile (implausibly_slower), or, taken busy, than a
    busy one there. One whose GEMMs no quiet
    core of this processor would measure (ir/hardware.off_peak) counts as measured busy. Each
    time a warning says so (`command` says how to measure again)."""
    path = Path(path)
    hw = measured_noting_load(lambda: measure_fn(quick=quick, progress=progress))
    earlier = load_cached(path)
    print(summary_fn(hw))
    if hw.measured_busy:
        print(f"warning: other processes kept about {hw.measured_busy} of {hw.cores} cores busy while measuring "
              f"(multithreaded GEMMs suffer most): rerun `{command}` when idle")
    odd = off_peak(hw)
    if odd:
        print(f"warning: {odd}: the cores were shared (with another virtual machine on the host, or a throttled "
              f"clock) or the timing failed; marked as measured under load: rerun `{command}`")
        hw = marked_off_peak(hw)
    # Against the earlier profile: a quiet one is kept over a busy or implausibly slower one; a
    # busy one over a busy one implausibly slower still (two calibrations under load: the faster).
    slower = implausibly_slower(hw, earlier) if earlier is not None and (not earlier.measured_busy
                                                                          or hw.measured_busy) else None
    if slower and earlier is not None:
        print(f"warning: {slower} of the profile measured {'quiet' if not earlier.measured_busy else 'before'} "
              f"on this processor: something (other processes, another virtual machine on the host, a throttled "
              f"clock) slowed it; rerun `{command}`")
    if earlier is not None and ((not earlier.measured_busy and hw.measured_busy) or slower):
        print(f"kept the profile measured {'on a quiet machine' if not earlier.measured_busy else 'before'} at "
              f"{path} ({earlier.source}); this one is not saved")
        return path
    path = save_profile(hw, path)
    clear_cache()
    print(f"wrote {path}" + (" (marked as measured under load)" if hw.measured_busy else ""))
    return path
