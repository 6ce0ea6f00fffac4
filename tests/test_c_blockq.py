"""The C runtime's block-format and KV-cache kernels (backends/c/blockq.c) against the float64
reference, at every instruction set this processor has (scalar, AVX2, AVX512-VNNI):

- block_matmul with activation='f32' is x times the dequantized weight; with 'q8' it
  multiplies the q8 activations it makes (quantize_activations) by the exact
  dequantized weight, within f32 rounding over K; and the op's float result within the stated
  activation bound (activation_error_bound), so a kernel that dropped a block's offset or min
  (an error of the weight's size) fails both;
- block_rows is the dequantization, bit for bit; cache_write writes exactly the rows it is
  given, in place; cache_attention is ir/kernels.py's causal grouped-query attention."""

import functools

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from tilegraph.backends.c import blockq
from tilegraph.ir import kernels
from tilegraph.ir.block_formats import FORMATS, quantize_activations
from tilegraph.accuracy import assert_close, tolerance

WEIGHT_FORMATS = ["q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q6_k", "f16", "bf16", "f32"]
ISAS = sorted({blockq.isa(name) for name in blockq.ISAS}, key=blockq.ISAS.get)  # those the processor has




@pytest.fixture(autouse=True)
def _best_isa():
    yield
    blockq.isa(None)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(WEIGHT_FORMATS), m=st.sampled_from([1, 2, 5, 8, 9, 20]), n=st.integers(1, 40),
       blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_block_matmul_with_float_activations_is_x_times_the_dequantized_weight(fmt, m, n, blocks, seed):
    """activation='f32': decode rows (register kernels or a dequantized row) and prompt rows
    (dequantized panels into sgemm) within f32 rounding of the float64 product."""
    f = FORMATS[fmt]
    k = blocks * max(f.block, 32)
    rng = np.random.default_rng(seed)
    w = f.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = blockq.block_matmul(x, w, fmt, k, activation="f32")
    assert_close(y, x.astype(np.float64) @ f.dequantize(w, (n, k)).astype(np.float64).T, "f32", k, name=fmt)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(WEIGHT_FORMATS), isa=st.sampled_from(ISAS), m=st.integers(1, 9), n=st.integers(1, 40),
       blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_block_matmul_is_its_reference(fmt, isa, m, n, blocks, seed, scale):
    f = FORMATS[fmt]
    k = blocks * max(f.block, 32)
    rng = np.random.default_rng(seed)
    w = f.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    x[rng.random((m, k)) < 0.1] = 0.0  # blocks of zeros and lone values: the scale's edge cases
    wd = f.dequantize(w, (n, k)).astype(np.float64)
    blockq.isa(isa)
    y = blockq.block_matmul(x, w, fmt, k)
    exact = x.astype(np.float64) @ wd.T
    if f.block == 1:
        assert_close(y, exact, "f32", k, name=f"{fmt} x @ w.T")
        return
    assert_close(y, quantize_activations(x.astype(np.float64)) @ wd.T, "f32", k, name=f"{fmt} q8(x) @ w.T ({isa})")
    rtol, _ = tolerance("f32", k)
    slack = blockq.activation_error_bound(x, wd) + rtol * (np.abs(x) @ np.abs(wd).T) + 1e-30
    assert (np.abs(y - exact) <= slack).all(), f"{fmt} ({isa}): outside the activation bound"


def test_the_activation_bound_is_tight_enough_to_fail():
    """A kernel that ignored q4_1's minimum would be off by m * sum(x): far outside the bound."""
    f = FORMATS["q4_1"]
    rng = np.random.default_rng(1)
    w = f.quantize(rng.standard_normal((8, 64)).astype(np.float32) + 3.0)
    x = rng.standard_normal((1, 64)).astype(np.float32) + 1.0
    wd = f.dequantize(w, (8, 64)).astype(np.float64)
    no_min = f.dequantize(w, (8, 64)).astype(np.float64) - np.repeat(
        w.reshape(8, 2, 20)[:, :, 2:4].copy().view(np.float16).astype(np.float64), 32, axis=1).reshape(8, 64)
    assert (np.abs(x @ no_min.T - x @ wd.T) > blockq.activation_error_bound(x, wd)).any()


DECODE_FORMATS = ["q4_0", "q4_1", "q8_0"]  # those with 512-bit decode kernels (blockq.c bq_zmm, bq_z8)
AMX_MIN_ROWS = 3  # blockq.c BQ_AMX_MIN_ROWS: fewer rows take the 8-row VBMI kernel under AMX


def test_decode_rows_take_the_fastest_kernel_the_processor_has():
    """A batch's decode rows (1..8) of the decode formats take AMX tiles (3..8 rows) where the processor
    has AMX int8 and grants it to this process, the 8-row VBMI kernel where it has AVX512-VBMI (and
    for one or two rows under AMX), the 4-row one with VNNI alone; a prompt's rows take sgemm panels.
    Fails if a change makes decode fall back to a slower kernel."""
    best = blockq.isa(None)
    expected = {"amx": "amx", "avx512_vbmi": "zmm8", "avx512_vnni": "zmm"}
    for name in ISAS:
        blockq.isa(name)
        for fmt in DECODE_FORMATS:
            for m in range(1, 9):
                want = "zmm8" if name == "amx" and m < AMX_MIN_ROWS else expected.get(name, "blocks")
                assert blockq.kernel(fmt, m) == want, (name, fmt, m)
            assert blockq.kernel(fmt, 9) == "sgemm"
        assert blockq.kernel("q4_k", 1) == "blocks" and blockq.kernel("f32", 1) == "float"
    if "avx512_vbmi" in ISAS:  # the default (best) instruction set takes the fastest kernels
        assert best == ISAS[-1]
        blockq.isa(None)
        assert blockq.kernel("q4_0", 1) == "zmm8"
        assert blockq.kernel("q4_1", 8) == ("amx" if "amx" in ISAS else "zmm8")


@pytest.mark.skipif("amx" not in ISAS, reason="the processor (or its OS) gives this process no AMX int8")
@pytest.mark.parametrize("fmt", DECODE_FORMATS)
def test_amx_decode_rows_are_their_reference(fmt):
    """The AMX kernel on arbitrary weight bytes: whole groups of 16 weight rows and a tail of 5 (the
    8-row kernel's), 3..8 activation rows, odd and even block counts, against q8(x) @ dequant(w).T."""
    f = FORMATS[fmt]
    rng = np.random.default_rng(7)
    blockq.isa("amx")
    for m in range(AMX_MIN_ROWS, 9):
        for blocks in (1, 6, 7):
            k = 32 * blocks
            w = _raw_blocks(fmt, rng, 53, k)
            x = rng.standard_normal((m, k)).astype(np.float32)
            assert blockq.kernel(fmt, m) == "amx"
            y = blockq.block_matmul(x, w, fmt, k)
            wd = f.dequantize(w, (53, k)).astype(np.float64)
            assert_close(y, quantize_activations(x.astype(np.float64)) @ wd.T, "f32", k, name=f"{fmt} (amx, {m} rows)")
    blockq.isa(None)


def _raw_blocks(fmt, rng, n, k):
    """Any bytes a file may hold (q8_0's -128 too), with finite f16 scales and mins."""
    f = FORMATS[fmt]
    nb = k // 32
    w = rng.integers(0, 256, (n, nb * f.block_bytes), dtype=np.uint8).reshape(n, nb, f.block_bytes)
    halves = 2 if fmt == "q4_1" else 1
    w[:, :, :2 * halves] = rng.uniform(-2, 2, (n, nb, halves)).astype(np.float16).view(np.uint8).reshape(n, nb, -1)
    return w.reshape(n, -1)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(DECODE_FORMATS), isa=st.sampled_from(ISAS), m=st.integers(1, 8), n=st.integers(1, 40),
       blocks=st.integers(1, 7), seed=st.integers(0, 2**32 - 1))
def test_decode_kernels_on_any_block_bytes_are_their_reference(fmt, isa, m, n, blocks, seed):
    """Every decode kernel (each ISA's; odd block counts take the single-block tail) on arbitrary
    weight bytes, a batch's rows at once, against q8(x) @ dequant(w).T in float64."""
    f = FORMATS[fmt]
    k = 32 * blocks
    rng = np.random.default_rng(seed)
    w = _raw_blocks(fmt, rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    blockq.isa(isa)
    y = blockq.block_matmul(x, w, fmt, k)
    wd = f.dequantize(w, (n, k)).astype(np.float64)
    assert_close(y, quantize_activations(x.astype(np.float64)) @ wd.T, "f32", k, name=f"{fmt} ({isa}, {m} rows)")


@pytest.mark.skipif("avx512_vbmi" not in ISAS, reason="the processor has no AVX512-VBMI")
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_q4_decode_rows_on_the_vbmi_kernel_are_their_reference(fmt, m):
    """The 8-row VBMI kernel on 1 to 8 rows: q4_1's nibbles as vpdpbusd's unsigned operand against
    the signed activations, q4_0's signed nibbles against activations + 128; 9 blocks: 4 pairs and
    the odd block."""
    f = FORMATS[fmt]
    k, n = 32 * 9, 37
    rng = np.random.default_rng(m)
    w = _raw_blocks(fmt, rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    blockq.isa("avx512_vbmi")
    assert blockq.kernel(fmt, m) == "zmm8"
    y = blockq.block_matmul(x, w, fmt, k)
    blockq.isa(None)
    wd = f.dequantize(w, (n, k)).astype(np.float64)
    assert_close(y, quantize_activations(x.astype(np.float64)) @ wd.T, "f32", k, name=f"{fmt} ({m} rows)")


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_block_rows_dequantize_exactly(fmt):
    f = FORMATS[fmt]
    k = 2 * max(f.block, 32)
    w = f.quantize(np.random.default_rng(2).standard_normal((7, k)).astype(np.float32))
    idx = np.array([6, 0, 3, 3])
    np.testing.assert_array_equal(blockq.block_rows(w, fmt, k, idx), f.dequantize(w, (7, k))[idx])
    with pytest.raises(blockq.KernelError, match="outside the table"):
        blockq.block_rows(w, fmt, k, np.array([7]))


def test_a_row_that_is_not_whole_blocks_is_refused():
    w = np.zeros((2, 18), np.uint8)
    with pytest.raises(blockq.KernelError, match="rows of 18 bytes"):
        blockq.block_matmul(np.zeros((1, 64), np.float32), w, "q4_0", 64)


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 3), s=st.integers(1, 12), t=st.integers(1, 4), d=st.integers(1, 9),
       per_sequence=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_cache_write_writes_in_place(b, h, s, t, d, per_sequence, seed):
    rng = np.random.default_rng(seed)
    t = min(t, s)
    cache = rng.standard_normal((b, h, s, d)).astype(np.float32)
    x = rng.standard_normal((b, h, t, d)).astype(np.float32)
    pos = rng.integers(0, s - t + 1, b) if per_sequence else np.int64(rng.integers(0, s - t + 1))
    want = kernels.cache_write(cache.copy(), x, pos)
    address = cache.ctypes.data
    blockq.cache_write(cache, x, pos)
    assert cache.ctypes.data == address
    np.testing.assert_array_equal(cache, want)


@settings(max_examples=30, deadline=None)
@given(isa=st.sampled_from(ISAS), b=st.integers(1, 2), s=st.integers(1, 12), t=st.integers(1, 4),
       d=st.integers(1, 40), per_sequence=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_an_f16_cache_write_rounds_as_the_interpreter(isa, b, s, t, d, per_sequence, seed):
    """f32 rows into an f16 cache: bit for bit ir/kernels.py's store='f16' (NumPy's rounding to
    nearest even), overflow, subnormals, zeros' signs, inf and NaN included, at each ISA."""
    blockq.isa(isa)
    rng = np.random.default_rng(seed)
    t = min(t, s)
    cache = rng.standard_normal((b, 2, s, d)).astype(np.float16)
    x = (rng.standard_normal((b, 2, t, d)) * rng.choice([1e-7, 3e-5, 1.0, 6e4, 7e4], (b, 2, t, d))).astype(np.float32)
    x.reshape(-1)[:6] = np.array([65519.996, 65520.0, -np.inf, np.nan, -0.0, 2.9802322e-08], np.float32)[:x.size][:6]
    pos = rng.integers(0, s - t + 1, b) if per_sequence else np.int64(rng.integers(0, s - t + 1))
    with np.errstate(over="ignore", invalid="ignore"):
        want = kernels.cache_write(cache.copy(), x, pos, "f16")
    blockq.cache_write(cache, x, pos)
    np.testing.assert_array_equal(cache.view(np.uint16) & 0x7DFF, want.view(np.uint16) & 0x7DFF)  # (NaN payloads)


def test_cache_write_past_the_end_is_refused():
    cache = np.zeros((1, 1, 4, 2), np.float32)
    with pytest.raises(blockq.KernelError, match="do not fit a cache of 4"):
        blockq.cache_write(cache, np.ones((1, 1, 2, 2), np.float32), np.int64(3))
    with pytest.raises(blockq.KernelError, match="position -1"):
        blockq.cache_write(cache, np.ones((1, 1, 1, 2), np.float32), np.int64(-1))
    assert not cache.any()


@settings(max_examples=60, deadline=None)
@given(isa=st.sampled_from(ISAS), cache=st.sampled_from([np.float32, np.float16]), b=st.integers(1, 2),
       kv=st.integers(1, 3), group=st.integers(1, 6), t=st.sampled_from([1, 2, 5, 17, 24]),
       d=st.sampled_from([1, 8, 48, 64, 128, 256]), extra=st.integers(0, 300), per_sequence=st.booleans(),
       window=st.sampled_from([0, 0, 1, 7, 64, 100, 400]), seed=st.integers(0, 2**32 - 1))
# a decode step over an f16 cache with 3 heads per KV head: V widened as p v reads it, several
# key blocks (the next ones prefetched), on the processor's best ISA
@example(isa=ISAS[-1], cache=np.float16, b=1, kv=2, group=3, t=1, d=128, extra=300, per_sequence=False, window=0,
         seed=1)
# f16 read in place with every row count per pass (ca_scores_zmm_h's 1..4 rows of 16..4 keys): 6
# heads x 5 queries per KV head (passes of 4 + 2 rows whose keys and windows differ), 2 and 1 heads
@example(isa=ISAS[-1], cache=np.float16, b=2, kv=1, group=6, t=5, d=64, extra=150, per_sequence=True, window=7,
         seed=2)
@example(isa=ISAS[-1], cache=np.float16, b=1, kv=3, group=2, t=1, d=128, extra=130, per_sequence=False, window=0,
         seed=3)
@example(isa=ISAS[-1], cache=np.float16, b=1, kv=2, group=1, t=3, d=64, extra=200, per_sequence=False, window=100,
         seed=4)
def test_cache_attention_is_its_reference(isa, cache, b, kv, group, t, d, extra, per_sequence, window, seed):
    """Decode (T <= 16: spans of keys split across threads and combined; with AVX-512 and D of 64
    or 128, 16 keys' scores per reduction and p v four query rows at a time) and prompt (T > 16)
    paths, over f32 or f16 caches (the reference reads the same f16 values, widened), with and
    without a sliding window (a prompt whose window cuts keys takes the decode units)."""
    blockq.isa(isa)
    rng = np.random.default_rng(seed)
    s = t + extra
    q = rng.standard_normal((b, kv * group, t, d)).astype(np.float32)
    k = rng.standard_normal((b, kv, s, d)).astype(cache)
    v = rng.standard_normal((b, kv, s, d)).astype(cache)
    pos = rng.integers(0, s - t + 1, b) if per_sequence else np.int64(rng.integers(0, s - t + 1))
    scale = d ** -0.5
    got = blockq.cache_attention(q, k, v, pos, scale, window)
    want = kernels.cache_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), pos, scale,
                                   window)
    assert_close(got, want, "f32", max(d, int(np.max(pos)) + t), name="cache_attention")


def test_decode_attention_reads_the_cache_in_place_where_the_processor_has_avx512():
    """A decode step's attention (T <= 16, or a window that cuts keys) takes the AVX-512 units at
    head sizes 64 and 128 wherever the processor has the block kernels' AVX-512 level: those read an
    f16 cache in place (no block widened into scratch); a prompt takes the GEMMs."""
    for name in ISAS:
        blockq.isa(name)
        units = "zmm" if blockq.ISAS[name] >= blockq.ISAS["avx512_vnni"] else "units"
        for d in (64, 128):
            assert blockq.attention_kernel(1, d, 2001) == units
            assert blockq.attention_kernel(16, d, 2016) == units
            assert blockq.attention_kernel(64, d, 600, window=512) == units
            assert blockq.attention_kernel(64, d, 600) == "prompt"
        assert blockq.attention_kernel(1, 256, 2001) == "units"
    best = blockq.isa(None)
    if blockq.ISAS[best] >= blockq.ISAS["avx512_vnni"]:
        assert blockq.attention_kernel(1, 128, 2001) == "zmm"


def test_cache_attention_past_the_cache_is_refused():
    q = np.zeros((1, 2, 3, 4), np.float32)
    k = np.zeros((1, 1, 8, 4), np.float32)
    with pytest.raises(blockq.KernelError, match="reach past a cache of 8"):
        blockq.cache_attention(q, k, k, np.int64(6), 0.5)
    with pytest.raises(blockq.KernelError, match="share"):
        blockq.cache_attention(np.zeros((1, 3, 1, 4), np.float32), np.zeros((1, 2, 8, 4), np.float32),
                               np.zeros((1, 2, 8, 4), np.float32), np.int64(0), 0.5)


# --- the lowering: a decoder layer's step is native C end to end, its caches written in place ---

def decoder_layer(fmt: str, b: int, hidden: int, heads: int, kv_heads: int, d: int, s: int, per_sequence: bool,
                  activation: str, cache_dtype: str = "f32"):
    """One Llama layer's step on T new tokens: rms_norm, q/k/v block matmuls, rope, the caches
    written, attention over them, the output projection and the residual."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(7)
    f = FORMATS[fmt]
    g = Graph()
    x = g.input("x", (b, "T", hidden))
    kc, vc = g.input("k_cache", (b, kv_heads, s, d), cache_dtype), g.input("v_cache", (b, kv_heads, s, d), cache_dtype)
    pos = g.input("pos", (b,) if per_sequence else (), "i64")
    cos, sin = g.input("cos", (b, 1, "T", d // 2)), g.input("sin", (b, 1, "T", d // 2))

    def linear(v, n, k, name):
        w = g.weight(name, f.quantize((rng.standard_normal((n, k)) / k ** 0.5).astype(np.float32)))
        return g.op("block_matmul", v, w, format=fmt, k=k, activation=activation)

    h = g.op("rms_norm", x, g.weight("norm", rng.uniform(0.5, 1.5, hidden).astype(np.float32)), epsilon=1e-5)

    def heads_of(v, n):
        return g.transpose(g.reshape(v, (b, "T", n, d)), (0, 2, 1, 3))

    q = g.op("rope", heads_of(linear(h, heads * d, hidden, "wq"), heads), cos, sin)
    k = g.op("rope", heads_of(linear(h, kv_heads * d, hidden, "wk"), kv_heads), cos, sin)
    v = heads_of(linear(h, kv_heads * d, hidden, "wv"), kv_heads)
    store = {} if cache_dtype == "f32" else {"store": cache_dtype}
    kc2, vc2 = g.op("cache_write", kc, k, pos, **store), g.op("cache_write", vc, v, pos, **store)
    a = g.op("cache_attention", q, kc2, vc2, pos, scale=d ** -0.5)
    a = g.reshape(g.transpose(a, (0, 2, 1, 3)), (b, "T", heads * d))
    y = g.add(x, linear(a, hidden, heads * d, "wo"))
    return g.build(y, kc2, vc2, names=["y", "k_cache_out", "v_cache_out"],
                   aliases={"k_cache": "k_cache_out", "v_cache": "v_cache_out"})


@functools.lru_cache(maxsize=None)
def _compiled_layer(fmt: str, per_sequence: bool, activation: str = "f32", cache_dtype: str = "f32"):
    from tilegraph.backends.c import compile_model

    model = decoder_layer(fmt, 2, 64, 4, 2, 16, 32, per_sequence, activation, cache_dtype)
    return model, compile_model(model)


@settings(max_examples=12, deadline=None)
@given(fmt=st.sampled_from(["q4_1", "q8_0"]), t=st.sampled_from([1, 3, 20]), per_sequence=st.booleans(),
       activation=st.sampled_from(["f32", "q8"]), cache_dtype=st.sampled_from(["f32", "f16"]),
       seed=st.integers(0, 2**31))
def test_a_decoder_layer_step_runs_natively_and_writes_its_caches_in_place(fmt, t, per_sequence, activation,
                                                                           cache_dtype, seed):
    """Values against the interpreter with exact activations; with 'q8' only what is structural
    (native, in place, no other row touched): rounding to int8 is discontinuous, so an f32-level
    difference upstream (an rms_norm's last bit) may round a value the other way, a full q8 step.
    An f16 cache: the interpreter rounds each written row to f16 as the kernel does; a row within
    f32 rounding of an f16 rounding boundary may round the other way, so the cache and what reads
    it are held to f16's tolerance."""
    from tilegraph.ir.interpreter import interpret

    b, hidden, kv_heads, d, s = 2, 64, 2, 16, 32
    model, compiled = _compiled_layer(fmt, per_sequence, activation, cache_dtype)
    dtype = np.float16 if cache_dtype == "f16" else np.float32
    assert all(kind == "segment" for kind, _ in compiled.program.plan), "a step ran on the host"
    assert len(compiled.program.plan) == 1, "the step is one native call"
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, s - t + 1, b) if per_sequence else np.int64(rng.integers(0, s - t + 1))
    angles = rng.uniform(-3, 3, (b, 1, t, d // 2))
    inputs = [rng.standard_normal((b, t, hidden)).astype(np.float32),
              rng.standard_normal((b, kv_heads, s, d)).astype(dtype),
              rng.standard_normal((b, kv_heads, s, d)).astype(dtype), pos,
              np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)]
    before = inputs[1].copy()
    want = interpret(model, [a.copy() if isinstance(a, np.ndarray) else a for a in inputs])
    k_cache, v_cache = inputs[1], inputs[2]
    got = compiled(*inputs)
    assert got[1] is k_cache and got[2] is v_cache, "the caches are the caller's arrays, written in place"
    written = np.zeros(k_cache.shape, bool)
    for i, p in enumerate(np.broadcast_to(pos, (b,))):
        written[i, :, p:p + t] = True
    np.testing.assert_array_equal(k_cache[~written], before[~written])  # no other row touched
    if activation == "q8":
        return
    stored = "f16" if cache_dtype == "f16" else "f32"  # what the cache's rows (and so y) are rounded to
    assert_close(k_cache, want[1], stored, hidden, name="k_cache")
    assert_close(got[0], want[0], stored, hidden + s, name="y")


def test_a_cache_that_would_be_copied_is_refused():
    """A cache that is not the writable C-contiguous f32 array the kernel writes (the call would
    write a copy, and the caller's cache would silently stay stale) is refused before any C runs."""
    from tilegraph.ir.model import ModelError

    _, compiled = _compiled_layer("q8_0", False)
    x = np.zeros((2, 1, 64), np.float32)
    c = np.zeros((2, 2, 32, 16), np.float32)
    trig = np.zeros((2, 1, 1, 8), np.float32)
    readonly = c.copy()
    readonly.flags.writeable = False
    for bad in (np.zeros((2, 2, 32, 32), np.float32)[..., ::2], c.astype(np.float64), np.asfortranarray(c), readonly):
        with pytest.raises(ModelError, match="updated in place"):
            compiled(x, bad, c.copy(), np.int64(0), trig, trig)


def test_decode_steps_allocate_nothing_that_stays():
    """Memory is flat across steps: after the first steps (the arena, the kernels' scratch at
    their largest), 200 more steps at growing positions leave the process's resident size
    where it was (each call's only new array is its output, freed by the caller)."""
    _, compiled = _compiled_layer("q4_1", False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 1, 64)).astype(np.float32)
    k_cache, v_cache = np.zeros((2, 2, 32, 16), np.float32), np.zeros((2, 2, 32, 16), np.float32)
    trig = np.ones((2, 1, 1, 8), np.float32)

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    for p in range(4):
        compiled(x, k_cache, v_cache, np.int64(p), trig, trig)
    before = resident()
    for step in range(200):
        compiled(x, k_cache, v_cache, np.int64(step % 32), trig, trig)
    assert resident() - before < 1 << 20


def test_a_language_model_step_with_sampling_is_one_native_call(tmp_path):
    """A tiny GGUF Llama on the C backend, f16 caches, sampling inside the step: prefill and
    decode are each one native segment (no host op, no Python between ops), the caches the
    model's own f16 arrays written in place, and greedy decoding in the step gives the tokens
    that the logits' argmax gives."""
    from tilegraph.generation import LanguageModel, Sampling
    from tilegraph.testing.gguf_files import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, layers=1)
    lm = LanguageModel(path, target="c", cache_len=24, activation="q8", cache_dtype="f16")
    sampling = Sampling(temperature=0.8, top_k=8, top_p=0.9, repetition_penalty=1.2, seed=3)
    for kind in ("prefill", "decode"):
        plan = lm.entry(2, kind, sampling)._runner.program.plan
        assert [k for k, _ in plan] == ["segment"], f"{kind}: {plan}"
    caches = lm.caches(2)
    assert all(c.dtype == np.float16 for c in caches)
    prompts = [[5, 70, 71], [100, 3, 250, 9]]
    runs = [list(lm.generate_ids(prompts, 6, sampling, stop=False)) for _ in range(2)]
    assert runs[0] == runs[1], "one seed, one sequence of tokens"
    assert all(a is b for a, b in zip(lm.caches(2), caches)) and caches[0][:, :, :8].any()
    logits = []
    greedy = list(lm.generate_ids(prompts, 4, Sampling(), stop=False, on_logits=lambda i, x: logits.append(x.copy())))
    assert [t for _, t in greedy] == [int(np.argmax(x[b])) for x in logits for b in range(2)]
