"""The C runtime's threads over a long call: chosen again between native segments, so a training
step of seconds that began beside a busy neighbour takes the whole team back once it has gone."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tilegraph.backends.c import compile_model, runtime
from tilegraph.backends.c.emit import SEGMENT_STEPS
from tilegraph.ir import Graph, interpret
from tilegraph.testing import assert_close

emit = importlib.import_module("tilegraph.backends.c.emit")  # the module (the package exports a function by its name)
WIDTH, PRODUCTS = 128, SEGMENT_STEPS + 8  # two segments, and more work than runs on one thread


def test_a_short_module_stays_one_native_call():
    """Below LONG_WORK the whole forward is one native call, however many steps it has."""
    model, _ = _chain()
    assert [kind for kind, _ in compile_model(model).program.plan] == ["segment"]


def _chain():
    """x times PRODUCTS weights in turn: one GEMM step each, nothing to fuse between them."""
    rng = np.random.default_rng(0)
    g = Graph()
    y = g.input("x", (WIDTH, WIDTH))
    for i in range(PRODUCTS):
        y = g.matmul(y, g.weight(f"w{i}", (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)))
    return g.build(y, names=["y"]), rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)


def test_a_long_call_takes_the_team_back_when_its_neighbour_leaves(monkeypatch):
    """A neighbour busy when the call starts (one thread), gone by its next segment: the later
    segments run on every thread, on primitives made for that team, and the result is the
    float64 interpreter's within the chain's reductions."""
    monkeypatch.setattr(emit, "LONG_WORK", 0)  # a long call's segments, at a test's size
    model, x = _chain()
    compiled = compile_model(model)
    segments = [k for kind, k in compiled.program.plan if kind == "segment"]
    assert len(segments) >= 2, "a long program is cut into segments the runtime can choose threads between"
    team = compiled._lib.tg_max_threads()
    if team == 1:
        pytest.skip("one thread: no team to take back")
    looks = iter([1])  # busy at the start, then quiet
    monkeypatch.setattr(runtime._NEIGHBOURS, "cores", lambda: next(looks, 0))
    monkeypatch.setattr(runtime, "RECHOOSE_S", 0.0)
    got = compiled(x)[0]
    assert compiled.last_threads == 1
    assert compiled.segment_threads == [1] + [team] * (len(segments) - 1)
    assert set(next(iter(compiled._bindings.values())).states) == {1, team}
    assert_close(got, interpret(model, [x])[0], "f32", reduction_length=WIDTH * PRODUCTS)


def test_a_call_under_a_steady_neighbour_keeps_one_team(monkeypatch):
    """Busy throughout: every segment on the threads the call began with, no second set of primitives."""
    monkeypatch.setattr(emit, "LONG_WORK", 0)
    model, x = _chain()
    compiled = compile_model(model)
    monkeypatch.setattr(runtime._NEIGHBOURS, "cores", lambda: 1)
    monkeypatch.setattr(runtime, "RECHOOSE_S", 0.0)
    compiled(x)
    assert set(compiled.segment_threads) == {1}
    assert set(next(iter(compiled._bindings.values())).states) == {1}
