"""A calibration taken while other processes keep the cores busy is noticed: the profile
says so (`measured_busy`), and the first process that finds the machine quiet measures
again instead of trusting it for good. (A busy first compile's quick calibration priced
GEMMs 3-41x too slow, and every compile after decided by it.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tilegraph.ir import hardware
from tilegraph.ir.hardware import load_profile


@pytest.fixture
def quick_measure(monkeypatch):
    """The quick C calibration replaced by reading the suite's fixed profile (the load
    detection around it is what is tested, not the timings); counts its calls."""
    calls = []
    fixed = load_profile(Path(__file__).with_name("c_profile.json"))

    def measure(quick=True):
        calls.append(quick)
        return fixed

    monkeypatch.setitem(hardware.CALIBRATIONS, "c", measure)
    hardware._cpu_profile.cache_clear()
    yield calls
    hardware._cpu_profile.cache_clear()


def _busy_children():
    """A spinning child process per core: the cores kept busy by others."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    time.sleep(0.5)  # the children get scheduled
    return busy


def test_a_calibration_under_load_is_marked_and_measured_again_once_quiet(tmp_path, quick_measure, monkeypatch):
    path = str(tmp_path / "c-profile.json")
    busy = _busy_children()
    try:
        assert hardware.others_running() >= 1
        profile = hardware._cpu_profile(path, True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert profile.measured_busy >= 1
    assert load_profile(path).measured_busy >= 1  # saved with the mark
    assert len(quick_measure) == 1
    # A later process on a quiet machine does not trust it: it measures again.
    hardware._cpu_profile.cache_clear()
    monkeypatch.setattr(hardware, "quiet_now", lambda: True)
    monkeypatch.setattr(hardware, "busy_count", lambda start: 0)  # nobody else while it measures
    again = hardware._cpu_profile(path, True)
    assert len(quick_measure) == 2 and again.measured_busy == 0
    assert load_profile(path).measured_busy == 0
    # ... and a quiet profile is used as is.
    hardware._cpu_profile.cache_clear()
    hardware._cpu_profile(path, True)
    assert len(quick_measure) == 2


def test_a_busy_profile_is_used_while_the_machine_stays_busy(tmp_path, quick_measure, monkeypatch):
    path = tmp_path / "c-profile.json"
    fixed = load_profile(Path(__file__).with_name("c_profile.json"))
    hardware.save_profile(replace(fixed, measured_busy=3), path)
    monkeypatch.setattr(hardware, "others_running", lambda: 2)
    assert hardware._cpu_profile(str(path), True).measured_busy == 3
    assert quick_measure == []


def test_tilegraph_calibrate_under_load_is_detected_and_not_cached_as_is(tmp_path):
    """`tilegraph calibrate --quick`, the real measurement (NumPy's: no modules to build; the C
    backend's goes through the same ir/calibration.measure_and_save), while a busy child process
    per core keeps the cores busy: it says so and does not replace the profile measured quiet
    (with none there it saves its own marked, as the quick path above)."""
    path = tmp_path / "cpu.json"
    fixed = load_profile(Path(__file__).with_name("cpu_profile.json"))
    assert fixed is not None and fixed.measured_busy == 0
    hardware.save_profile(fixed, path)
    busy = _busy_children()
    try:
        done = subprocess.run([sys.executable, "-m", "tilegraph.cli", "calibrate", "--quick", "-o", str(path)],
                              capture_output=True, text=True, timeout=300)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert done.returncode == 0, done.stderr
    assert "warning: other processes kept" in done.stdout
    assert "kept the profile measured on a quiet machine" in done.stdout
    assert load_profile(path) == fixed  # the quiet one stays


def test_a_passing_thread_keeps_a_forwards_threads_and_a_neighbour_that_keeps_running_takes_its_core(monkeypatch):
    """Neighbours: a thread runnable at the moment of looking, but whose process used almost no
    CPU since the last look, leaves every core to the forward; one that used a core's worth
    takes that core; after a long gap the runnable count alone decides."""
    clock = {"all": 100.0, "own": 10.0, "t": 50.0}
    monkeypatch.setattr(hardware, "_cpu_seconds", lambda: (clock["all"], clock["own"], clock["t"]))
    monkeypatch.setattr(hardware, "others_running", lambda: 1)
    neighbours = hardware.Neighbours()

    def later(seconds, others, own=0.0):
        clock["t"] += seconds
        clock["own"] += own
        clock["all"] += others + own

    later(0.5, others=0.02, own=0.9)  # a shell's short job beside the forward
    assert neighbours.cores() == 0
    later(0.5, others=0.5, own=0.5)  # a process spinning on one core
    assert neighbours.cores() == 1
    later(0.01, others=0.0)  # too soon to read the ticks again: the last reading holds
    assert neighbours.cores() == 1
    later(30.0, others=0.0)  # a long gap: the runnable count now
    assert neighbours.cores() == 1
    monkeypatch.setattr(hardware, "others_running", lambda: 0)
    assert neighbours.cores() == 0


def test_a_thread_of_this_process_still_running_is_not_a_neighbour():
    """others_running counts other processes' runnable threads: a thread of the caller's own that
    runs (a thread pool spinning after its parallel region, in MiniLM's training benchmark
    torch's) once took a core from every forward that looked while it ran."""
    import threading

    import numpy as np

    data = np.ones(4_000_000, np.float32)
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            data.sum()  # NumPy releases the GIL for the loop: runnable beside the caller

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        own = []
        for _ in range(50):
            own.append(hardware._own_running())
            time.sleep(0.002)
    finally:
        stop.set()
        worker.join()
    assert max(own) >= 2  # the caller and its spinning thread
    assert min(own) >= 1


def test_others_running_leaves_out_this_process_s_own_runnable_threads(monkeypatch):
    monkeypatch.setattr(hardware, "_runnable_threads", lambda: 3)
    monkeypatch.setattr(hardware, "_own_running", lambda: 2)
    assert hardware.others_running() == 1
    monkeypatch.setattr(hardware, "_own_running", lambda: 3)
    assert hardware.others_running() == 0


def _not_saved(path, measured, why: str, kept, capsys) -> None:
    """measure_and_save of `measured` at `path` says why it is not saved, and `kept` stays there."""
    from tilegraph.ir.calibration import measure_and_save

    measure_and_save(lambda quick, progress: measured, lambda hw: "table", path, True, False, "calibrate")
    out = capsys.readouterr().out
    assert why in out and "this one is not saved" in out
    assert load_profile(path) == kept


def test_a_profile_implausibly_slower_than_the_quiet_one_is_not_saved(tmp_path, capsys, monkeypatch):
    """measure_and_save: a measurement the load check saw as quiet, but at half the GEMM rate
    of the same processor's quiet profile (slowed by what this process cannot see: a neighbour
    virtual machine, a throttled clock), keeps the earlier profile and says why; one within
    the plausible range replaces it."""
    from tilegraph.ir.calibration import measure_and_save

    monkeypatch.setattr(hardware, "busy_count", lambda start: 0)  # the load check sees nothing
    path = tmp_path / "cpu.json"
    fixed = load_profile(Path(__file__).with_name("cpu_profile.json"))
    hardware.save_profile(fixed, path)
    slow = replace(fixed, peak_flops={**fixed.peak_flops, "f32": fixed.flops("f32") / 2}, source="slow")
    _not_saved(path, slow, "peak f32 GEMM at 50%", fixed, capsys)
    close = replace(fixed, peak_flops={**fixed.peak_flops, "f32": fixed.flops("f32") * 0.9}, source="close")
    measure_and_save(lambda quick, progress: close, lambda hw: "table", path, True, False, "calibrate")
    assert load_profile(path).source == "close"


def _gemms_at(hw, best: float):
    """`hw` with its one-thread GEMM samples scaled so that the fastest runs at `best` FLOP/s."""
    top = max(r for *_, r in hw.gemm_samples)
    return replace(hw, gemm_samples=tuple((m, n, k, r * best / top) for m, n, k, r in hw.gemm_samples))


def test_a_profile_whose_gemms_no_quiet_core_of_this_processor_would_measure_is_not_trusted(
        tmp_path, capsys, monkeypatch, quick_measure):
    """off_peak, against the processor's datasheet peak a core: one-thread GEMMs at a tenth of it
    (the core was shared with what the load check cannot see) or above twice it (a broken timing)
    count as measured busy: `tilegraph calibrate` says so and keeps the quiet profile, the quick
    calibration of a first compile saves it marked, to be measured again once quiet."""
    monkeypatch.setattr(hardware, "processor_peak", lambda: 100e9)
    monkeypatch.setattr(hardware, "busy_count", lambda start: 0)  # the load check sees nothing
    fixed = load_profile(Path(__file__).with_name("c_profile.json"))
    assert hardware.off_peak(_gemms_at(fixed, 60e9)) is None
    shared, broken = _gemms_at(fixed, 10e9), _gemms_at(fixed, 250e9)
    assert "10% of this processor's peak" in hardware.off_peak(shared)
    assert "above this processor's peak" in hardware.off_peak(broken)

    path = tmp_path / "c.json"
    good = _gemms_at(fixed, 60e9)
    hardware.save_profile(good, path)
    _not_saved(path, shared, "10% of this processor's peak", good, capsys)

    quick_path = str(tmp_path / "quick.json")
    monkeypatch.setitem(hardware.CALIBRATIONS, "c", lambda quick=True: shared)
    assert hardware._cpu_profile(quick_path, True).measured_busy >= 1
    assert load_profile(quick_path).measured_busy >= 1


def test_of_two_calibrations_under_load_the_implausibly_slower_is_not_saved(tmp_path, capsys, monkeypatch):
    """measure_and_save: with a profile taken under load at the path, another taken under load at
    half its GEMM rate (a neighbour held a core through all of it) keeps the earlier one; one as
    fast replaces it, and a quiet one replaces it whatever its rates."""
    from tilegraph.ir.calibration import measure_and_save

    monkeypatch.setattr(hardware, "busy_count", lambda start: 1)  # others keep a core busy throughout
    path = tmp_path / "c.json"
    fixed = load_profile(Path(__file__).with_name("c_profile.json"))
    busy = replace(fixed, measured_busy=1, source="busy, fast")
    hardware.save_profile(busy, path)
    half = replace(fixed, peak_flops={**fixed.peak_flops, "f32": fixed.flops("f32") / 2}, source="busy, slow")
    _not_saved(path, half, "peak f32 GEMM at 50%", busy, capsys)
    measure_and_save(lambda quick, progress: replace(fixed, source="busy, as fast"), lambda hw: "table", path, True,
                     False, "calibrate")
    assert load_profile(path).source == "busy, as fast" and load_profile(path).measured_busy == 1
    monkeypatch.setattr(hardware, "busy_count", lambda start: 0)
    measure_and_save(lambda quick, progress: half, lambda hw: "table", path, True, False, "calibrate")
    assert load_profile(path).source == "busy, slow" and load_profile(path).measured_busy == 0


def test_a_calibration_takes_more_rounds_while_a_timing_had_a_neighbour_in_every_one(monkeypatch):
    """ir/calibration.in_rounds: a neighbour that outlasts the planned rounds (others busy beside
    a timing in each) gets more rounds, up to `most`, until every timing had one to itself; a
    quiet calibration takes the planned rounds only, and one that stays busy stops at `most`."""
    from tilegraph.ir import calibration

    fixed = load_profile(Path(__file__).with_name("c_profile.json"))
    state = {"round": 0, "busy": set()}
    monkeypatch.setattr(calibration, "median_times", lambda fns, budget, quantile=0.5: [1e-3 for _ in fns])
    monkeypatch.setattr(calibration, "others_cores",
                        lambda start, min_window=0.2: 1.0 if state["round"] in state["busy"] else 0.0)
    monkeypatch.setattr(calibration, "_wait_for_quiet", lambda seconds: None)

    def measure_round(timed):
        state["round"] += 1
        timed((lambda: None, lambda: None), 0.1)
        timed((lambda: None,), 0.1)
        return fixed

    def rounds_taken(busy, most=6):
        state.update(round=0, busy=busy)
        assert calibration.in_rounds(measure_round, 3, 0.25, 0.0, most) is fixed
        return state["round"]

    assert rounds_taken(set()) == 3
    assert rounds_taken({1, 2, 3}) == 4
    assert rounds_taken({1, 2, 3, 4, 5, 6, 7}) == 6
    assert rounds_taken({1, 2, 3}, most=None) == 3
