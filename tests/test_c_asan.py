"""The C backend is memory safe: under AddressSanitizer it runs clean, and a wrong call never reaches C.

The sanitized run is a child process (this file run as a script) with libasan
preloaded and TILEGRAPH_C_SANITIZE=address, so every module it compiles is built
with -fsanitize=address; the runtime then gives each intermediate an allocation of
its own (inside the arena, a write past one buffer would land unseen in the next).
The child runs random graphs (symbolic dims, odd sizes, unfused and after the default
pipeline), every op example, quantized linear layers, a small conv net, flash
attention at sizes no block divides, and wrong calls, each checked against the
float64 interpreter or required to raise a TilegraphError. A canary child reads
past an input by going around the check, to show that the harness would see it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
ASAN_ERROR = "ERROR: AddressSanitizer"


def _libasan() -> str | None:
    """gcc's AddressSanitizer runtime, or None (gcc prints the bare name when it has none)."""
    try:
        path = subprocess.run([os.environ.get("CC") or "gcc", "-print-file-name=libasan.so"], capture_output=True,
                              text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def _sanitized_child(mode: str, tmp_path) -> subprocess.CompletedProcess:
    lib = _libasan()
    if lib is None:
        pytest.skip("libasan (gcc's AddressSanitizer runtime, Debian: libasan8) is not installed")
    # The suite's fixed profiles (conftest.py): a first compile would otherwise calibrate, sanitized.
    from tilegraph.ir.hardware import c_profile_path, cpu_profile_path, load_profile, save_profile

    (tmp_path / "cache").mkdir(exist_ok=True)
    for name, path in (("cpu_profile.json", cpu_profile_path()), ("c_profile.json", c_profile_path())):
        save_profile(load_profile(Path(__file__).with_name(name)), tmp_path / "cache" / path.name)
    env = {**os.environ, "LD_PRELOAD": lib, "TILEGRAPH_C_SANITIZE": "address",
           "TILEGRAPH_CACHE_DIR": str(tmp_path / "cache"),
           # CPython and oneDNN keep allocations until exit by design: leaks are not the question.
           # A huge size a mutated model declares is a MemoryError (a named error), as unsanitized.
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1:allocator_may_return_null=1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, __file__, mode], env=env, capture_output=True, text=True, timeout=1200,
                          cwd=ROOT)


@pytest.mark.slow
def test_the_c_backend_runs_clean_under_address_sanitizer(tmp_path):
    done = _sanitized_child("all", tmp_path)
    report = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-8000:]}"
    assert ASAN_ERROR not in done.stderr, report
    assert done.returncode == 0, report
    assert "sanitized child: done" in done.stdout, report


def test_the_harness_sees_a_read_past_a_buffer(tmp_path):
    """Handing C an input shorter than its shape, behind the check's back, is a heap
    overflow that the sanitized child reports: so a clean run above means something."""
    done = _sanitized_child("canary", tmp_path)
    assert f"{ASAN_ERROR}: heap-buffer-overflow" in done.stderr, done.stderr[-4000:]
    assert done.returncode != 0


def _model_and_input():
    from tilegraph.ir import Graph

    g = Graph()
    x = g.input("x", ("B", 37))
    w = g.weight("w", np.random.default_rng(0).standard_normal((37, 19)).astype(np.float32))
    return g.build(g.softmax(x @ w), names=["y"]), np.random.default_rng(1).standard_normal((5, 37)).astype(np.float32)


def _misaligned(a: np.ndarray) -> np.ndarray:
    raw = np.zeros(a.nbytes + 1, np.uint8)
    b = np.frombuffer(raw.data, a.dtype, a.size, offset=1).reshape(a.shape)
    b[...] = a
    assert not b.flags.aligned
    return b


def test_an_input_reaches_c_contiguous_and_aligned():
    """A contiguous array at an odd address (np.frombuffer at offset 1) passes NumPy's
    contiguity test unchanged; C assumes every pointer aligned to its type (the vectoriser's
    loops rely on it), so the runtime copies it first (it once passed it as is)."""
    from tilegraph.backends.c import compile_model
    from tilegraph.ir import interpret
    from tilegraph.testing import assert_close

    model, x = _model_and_input()
    compiled = compile_model(model)
    inputs = [i for i, buf in enumerate(compiled.program.emitter.buffers) if buf.storage == "input"]
    for variant in (_misaligned(x), np.asfortranarray(x), x[::-1], x.astype(">f4")):
        assert_close(compiled(variant)[0], interpret(model, [np.array(variant)])[0], "f32", 37)
        binding = compiled._binding({"B": 5})
        assert all(binding.pointers[i] % 4 == 0 for i in inputs), "a misaligned input went to C"


def test_weights_of_another_size_are_refused_at_load():
    """load() takes the weights apart from the model: a table of the wrong size would have
    oneDNN read past it (it once packed whatever it was given)."""
    from tilegraph.backends.c import emit, load
    from tilegraph.ir import TilegraphError

    model, _ = _model_and_input()
    source = emit(model)
    for w in (np.zeros((37, 18), np.float32), np.zeros((36, 19), np.float32), np.zeros(3, np.float32)):
        with pytest.raises(TilegraphError, match="weight 'w' has shape"):
            load(source, {"w": w}, model)
    load(source, {"w": np.zeros((19, 37), np.float32).T}, model)  # transposed storage is copied, not refused


def test_a_host_view_outside_its_buffer_is_an_error():
    """The host fallback views buffers with as_strided, which checks nothing: a view
    reaching past its buffer (an emitter bug) is a TilegraphError, not a stray read."""
    from tilegraph.backends.c import compile_model
    from tilegraph.backends.c.views import View
    from tilegraph.ir import TilegraphError

    model, x = _model_and_input()
    compiled = compile_model(model)
    compiled(x)
    binding = compiled._binding({"B": 5})
    inp = next(i for i, buf in enumerate(compiled.program.emitter.buffers) if buf.storage == "input")
    binding.bases[inp] = x
    assert binding.view(View(inp, 36, (5, 1), (37, 1), "f32")).shape == (5, 1)
    for offset, shape, strides in ((37, (5, 1), (37, 1)), (0, (5, 38), (37, 1)), (1, (2, 37), (37, -1)),
                                   (-1, (1,), (1,))):
        with pytest.raises(TilegraphError, match="outside its buffer"):
            binding.view(View(inp, offset, shape, strides, "f32"))


def test_a_bf16_max_pool_on_the_host_matches():
    """The C backend runs a bf16 max pool on the host at bf16 (ml_dtypes' bfloat16, which
    NumPy does not count as floating): its padding fill was once taken for an integer's
    (found by the sanitized random graphs in bf16)."""
    from tilegraph.backends.c import compile_model
    from tilegraph.ir import Graph, interpret
    from tilegraph.ir.dtypes import numpy_dtype
    from tilegraph.testing import assert_close

    g = Graph()
    model = g.build(g.op("max_pool", g.input("x", ("B", 2, 5, 4), "bf16"), kernel=(2, 2), pads=(1, 1, 0, 0)),
                    names=["y"])
    x = np.random.default_rng(0).uniform(-1, 1, (3, 2, 5, 4)).astype(numpy_dtype("bf16"))
    assert_close(np.asarray(compile_model(model)(x)[0], np.float64), interpret(model, [x])[0], "bf16")


# ---------------------------------------------------------------------------------------
# The child: everything below runs in the sanitized process.


def _close(model, got, inputs, n=None, dtype=None):
    from tilegraph.ir import interpret
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.testing import assert_close, narrowest_float, reduction_length

    want = interpret(model, inputs)
    assert len(got) == len(want)
    if n is None:
        n = reduction_length(model, bind_inputs(model, inputs)[1])
    for name, a, e in zip(model.output_names, got, want):
        if np.issubdtype(np.asarray(e).dtype, np.floating):  # NaN where both are (a fully masked row)
            assert np.array_equal(np.isnan(np.asarray(a, np.float64)), np.isnan(e)), name
            a, e = np.nan_to_num(np.asarray(a, np.float64)), np.nan_to_num(e)
        assert_close(np.asarray(a), e, dtype or narrowest_float(model), n, name=name)


def _op_examples():
    from tilegraph.backends.c import compile_model
    from tilegraph.testing import op_examples

    count = 0
    for op, examples in sorted(op_examples().items()):
        for ex in examples:
            compiled = compile_model(ex.model)
            inputs = [np.array(a) for a in ex.inputs]  # allocations of their own, exactly their size
            _close(ex.model, compiled(*inputs), inputs, ex.reduction_length)
            count += 1
    print(f"op examples: {count}", flush=True)


def _random_graphs():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import tilegraph
    from tilegraph.passes.registry import DEFAULT_PIPELINE
    from tilegraph.testing import graphs, random_inputs

    @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(model=st.sampled_from(["f32", "f32", "f16", "bf16"]).flatmap(lambda dtype: graphs(dtype=dtype)),
           pipeline=st.sampled_from(["", DEFAULT_PIPELINE]))
    def check(model, pipeline):
        compiled = tilegraph.compile(model, target="c", pipeline=pipeline)
        for seed in (1, 2, 1):  # two bindings of the symbols, then the first again
            inputs = random_inputs(model, seed=seed)
            _close(model, compiled.run(*inputs), inputs)

    check()
    print("random graphs: done", flush=True)


def _small_sizes():
    """Random graphs with every symbolic dim bound to 1, 2 or 3 at call time, and the fuzzer's
    shape mutations on C (tilegraph/fuzz.py's shapes_c: repeats, split sizes, pads, windows,
    ranks rewritten): windows, splits and slices go empty or negative, which must be a
    TilegraphError before any C runs, or a right answer; never a stray read or write."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import tilegraph
    from tilegraph.fuzz import Fuzzer
    from tilegraph.ir import TilegraphError
    from tilegraph.ir.shapes import free_symbols
    from tilegraph.passes.registry import DEFAULT_PIPELINE
    from tilegraph.testing import graphs, random_inputs

    @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(model=graphs(dtype="f32"), pipeline=st.sampled_from(["", DEFAULT_PIPELINE]),
           size=st.integers(1, 3))
    def check(model, pipeline, size):
        compiled = tilegraph.compile(model, target="c", pipeline=pipeline)
        symbols = sorted(set().union(*(free_symbols(t.shape) for t in model.inputs)))
        for sizes in ({s: size for s in symbols}, {s: 1 + (i + size) % 3 for i, s in enumerate(symbols)}):
            inputs = random_inputs(model, seed=size, sizes=sizes)
            try:
                got = compiled.run(*inputs)
            except TilegraphError:
                continue
            _close(model, got, inputs)

    check()
    crashes = Fuzzer().run("shapes_c", SHAPE_CASES, seed=5)
    assert not crashes, "\n".join(crashes)
    print(f"small sizes: done ({SHAPE_CASES} shape mutations)", flush=True)


SHAPE_CASES = 150  # C shape mutations in the sanitized child (the long run: python -m tilegraph.fuzz)


def _quantized():
    from tilegraph.backends.c import compile_model
    from tilegraph.ir import Graph
    from tilegraph.passes.quantize import observe_ranges, save_ranges
    from tilegraph.passes.registry import DEFAULT_PIPELINE, run_pipeline

    rng = np.random.default_rng(0)
    for m, k, n, scheme in [(3, 77, 13, "w8a8"), (1, 5, 70, "w8a8"), (17, 130, 9, "calibrated"), (5, 33, 7, "w8"),
                            (2, 64, 31, "fp8"), (4, 96, 5, "mxfp4"), (3, 64, 11, "w4a16"), (2, 64, 9, "mxfp8")]:
        g = Graph()
        x = g.input("x", ("B", k))
        model = g.build(x @ g.weight("w", rng.standard_normal((k, n)).astype(np.float32)), names=["y"])
        xs = rng.standard_normal((m, k)).astype(np.float32)
        spec = "quantize{scheme=%s}" % scheme
        if scheme == "calibrated":
            with tempfile.TemporaryDirectory() as tmp:
                path = save_ranges(Path(tmp) / "c.npz", observe_ranges(model, [[xs]]))
                q = run_pipeline(model, f'quantize{{scheme=w8a8 calib="{path}" symmetric=true}},{DEFAULT_PIPELINE}')
        else:
            q = run_pipeline(model, spec + "," + DEFAULT_PIPELINE)
        _close(q, compile_model(q)(xs), [xs], k, "f32")
    print("quantized: done", flush=True)


def _conv_net():
    """Channels-last convolutions (padded, strided, grouped), a layer_norm along their last axis,
    max and average pools with odd windows and ceil mode, a linear head: at an odd image size
    and two batches."""
    import tilegraph
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    w = lambda *s: g.weight(f"w{len(s)}_{s[0]}_{s[-1]}", (0.3 * rng.standard_normal(s)).astype(np.float32))  # noqa: E731
    g = Graph()
    x = g.input("x", ("B", 3, 13, 11))
    h = g.relu(g.op("conv", x, w(8, 3, 3, 3), w(8), pads=(1, 1, 1, 1)))
    # a group norm of one channel a group: its columns of channels, then a loop in place
    gamma, beta = (g.weight(n, rng.standard_normal((8, 1, 1)).astype(np.float32)) for n in ("gamma", "beta"))
    h = g.gelu(g.op("layer_norm", h, None, None, axis=-1, epsilon=1e-5) * gamma + beta)
    h = g.op("max_pool", h, kernel=(3, 2), strides=(2, 2), ceil_mode=True)
    h = g.relu(g.op("conv", h, w(12, 4, 3, 3), strides=(2, 1), groups=2))
    h = g.op("avg_pool", h, kernel=(2, 2), pads=(0, 1, 1, 0))
    h = g.reshape(h, ("B", -1))
    model = g.build(g.softmax(h @ w(int(np.prod(h.shape[1:])), 10)), names=["p"])
    compiled = tilegraph.compile(model, target="c")
    for b in (2, 5, 2):
        xs = rng.standard_normal((b, 3, 13, 11)).astype(np.float32)
        _close(model, [compiled(xs)], [xs], 3 * 3 * 8)
    print("conv net: done", flush=True)
    return compiled, model


def _attention():
    """Query and key counts that leave partial blocks, causal with lq != lk, boolean and
    float masks broadcast over heads and rows, two batch sizes per module."""
    from tilegraph.backends.c import compile_model
    from tilegraph.ir import Graph
    from tilegraph.testing import random_inputs

    for lq, lk, d, heads, causal, mask in [(1, 1, 1, 1, False, None), (7, 130, 33, 2, True, "i1"),
                                           (65, 3, 8, 3, False, "f32"), (33, 33, 64, 1, True, None),
                                           (70, 139, 8, 2, False, "i1")]:
        g = Graph()
        qkv = [g.input(name, ("B", heads, n, width)) for name, n, width in (("q", lq, d), ("k", lk, d), ("v", lk, 5))]
        masks = [g.input("m", ("B", 1, 1, lk), mask)] if mask else []
        model = g.build(g.attention(*qkv, *masks, causal=causal), names=["y"])
        compiled = compile_model(model)
        assert all(kind == "segment" for kind, _ in compiled.program.plan)
        for batch in (2, 1):
            inputs = random_inputs(model, seed=lq + batch, sizes={"B": batch})
            _close(model, compiled(*inputs), inputs, lk + d)
    print("attention: done", flush=True)


def _wrong_calls(conv, conv_model):
    """Wrong calls are TilegraphErrors before any C runs; arrays C cannot take as they are
    (strided, reversed, Fortran-ordered, broadcast, misaligned, byte-swapped, wider) are copied."""
    import tilegraph
    from tilegraph.ir import Graph, TilegraphError

    rng = np.random.default_rng(0)
    xs = rng.standard_normal((2, 3, 13, 11)).astype(np.float32)
    wrong = [(), (xs, xs), (xs[0],), (xs[:, :2],), (np.zeros((0, 3, 13, 11), np.float32),), (xs[..., :10],),
             (xs.astype(np.complex64),), (xs.astype(str),), (None,), ([[1.0]],), (xs.reshape(-1),)]
    for args in wrong:
        try:
            conv(*args)
        except TilegraphError:
            pass
        else:
            raise AssertionError(f"a call with {[getattr(a, 'shape', a) for a in args]} ran")
    for call in (lambda: conv(x=xs, y=xs), lambda: conv(), lambda: conv(xs, x=xs)):
        try:
            call()
        except TilegraphError:
            pass
        else:
            raise AssertionError("a call with wrong names ran")
    big = rng.standard_normal((3, 6, 26, 22)).astype(np.float32)
    for ok in (big[:, ::2, ::2, ::2], big[:, :3, :13, :11], xs[::-1], np.asfortranarray(xs), _misaligned(xs),
               xs.astype(">f4"), xs.astype(np.float64), xs.transpose(0, 1, 3, 2).copy().transpose(0, 1, 3, 2),
               np.broadcast_to(xs[:1], xs.shape)):
        _close(conv_model, [conv(ok)], [np.array(ok, np.float32)], 3 * 3 * 8)

    g = Graph()  # an embedding: ids out of range, ids of a float dtype
    table = g.weight("table", rng.standard_normal((11, 6)).astype(np.float32))
    ids = g.input("ids", ("B", "S"), "i64")
    model = g.build(g.op("gather", table, ids, axis=0), names=["e"])
    emb = tilegraph.compile(model, target="c")
    for bad in (np.array([[0, 11]]), np.array([[-12]]), np.array([[1.0, 2.0]]), np.array([[1, 2]], np.uint64) * 2**62):
        try:
            emb(bad)
        except TilegraphError:
            pass
        else:
            raise AssertionError(f"ids {bad} ran")
    good = np.array([[0, 10, -11, 3], [5, -1, 2, 2]])
    _close(model, [emb(good)], [good], 1)
    print("wrong calls: done", flush=True)


def _canary():
    """Skip the signature check and hand C an input one row short: ASan must report it. (An
    emitted loop reads it: oneDNN, which runs the GEMMs, is not instrumented.)"""
    from tilegraph.backends.c import compile_model
    from tilegraph.ir import Graph

    g = Graph()
    model = g.build(g.exp(g.input("x", ("B", 37))), names=["y"])
    x = np.ones((5, 37), np.float32)
    compiled = compile_model(model)
    compiled(x)
    compiled._run([np.array(x[:-1])], {"B": 5})
    print("canary: no report", flush=True)


def _child(mode: str) -> None:
    import ctypes

    os.environ.pop("LD_PRELOAD", None)  # the compiler the child runs needs no sanitizer of its own
    from tilegraph.backends.c.build import flags

    assert "-fsanitize=address" in flags(), "TILEGRAPH_C_SANITIZE is not set"
    ctypes.CDLL(None)["__asan_init"]  # the runtime is loaded (a KeyError/AttributeError otherwise)
    if mode == "canary":
        _canary()
        return
    if mode == "small":  # the small-sizes section alone (python tests/test_c_asan.py small, under ASan)
        _small_sizes()
        print("sanitized child: done", flush=True)
        return
    conv, conv_model = _conv_net()
    _wrong_calls(conv, conv_model)
    _attention()
    _quantized()
    _random_graphs()
    _small_sizes()
    _op_examples()
    print("sanitized child: done", flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
