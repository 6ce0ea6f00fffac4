"""precision="bf16" on the C backend: GEMMs and convolutions multiply in bf16 on the
processor's AMX or AVX-512 BF16 units (found at run time), accumulating in f32.

What holds: the result agrees with the float64 interpreter within bf16's tolerance; where
the processor has bf16 units every GEMM and convolution runs on a kernel that uses them
(oneDNN's implementation name says so), and an f32 module loaded beside it in the same
process stays f32; where it has none, the module says so and runs f32; a precision the
backend does not know is a named error.
"""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
import pytest

import tilegraph
from tilegraph.backends.c import build
from tilegraph.backends.c.runtime import CompiledModel
from tilegraph.ir import Graph, interpret
from tilegraph.testing import assert_close


def _bf16_units() -> bool:
    """Whether the processor has bf16 dot products (AVX-512 BF16, and AMX where present), asked
    of oneDNN's dispatch through the runtime, as the modules themselves ask."""
    return bool(ctypes.CDLL(str(build.runtime())).tg_bf16_supported())


def _model():
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (2, 8, 12, 12))
    a = g.relu(g.op("conv", x, g.weight("w", rng.standard_normal((32, 8, 3, 3)).astype(np.float32) / 8),
                    pads=(1, 1, 1, 1)))
    rows = a.reshape(2, 32, 144).transpose(0, 2, 1)  # (2, 144, 32)
    y = g.gelu(g.matmul(rows, g.weight("m", rng.standard_normal((32, 64)).astype(np.float32) / 6)))
    return g.build(y, names=["y"]), [rng.standard_normal((2, 8, 12, 12)).astype(np.float32)]


def _runs_on_bf16_units(line: str) -> bool:
    impl = line.split(" source: ")[-1]
    return "amx" in impl or "bf16" in impl


def test_bf16_gemms_and_convolutions_run_on_the_processors_bf16_units():
    model, xs = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bf16 = tilegraph.compile(model, target="c", precision="bf16")
        got = bf16.run(*xs)[0]
    f32 = tilegraph.compile(model, target="c")
    exact = f32.run(*xs)[0]
    want = interpret(model, xs)[0]
    assert_close(got, want, "bf16", reduction_length=8 * 9 + 32)
    assert_close(exact, want, "f32", reduction_length=8 * 9 + 32)
    runner: CompiledModel = bf16._runner
    assert len(runner.primitives) == 2, runner.primitives  # the convolution and the GEMM
    assert not any(_runs_on_bf16_units(line) for line in f32._runner.primitives), f32._runner.primitives
    if runner._lib.tg_bf16_supported():
        assert runner.precision == "bf16"
        assert all(_runs_on_bf16_units(line) for line in runner.primitives), runner.primitives
        assert not np.array_equal(got, exact)  # the products were rounded to bf16
    else:
        assert runner.precision == "f32"
        assert any("no bf16 dot products" in str(w.message) for w in caught)


def test_an_unknown_precision_is_a_named_error():
    model, _ = _model()
    with pytest.raises(tilegraph.TilegraphError, match="precision= must be one of f32, bf16"):
        tilegraph.compile(model, target="c", precision="fp16")


def _attention():
    """Attention as torch's scaled_dot_product_attention exports it (Whisper, SDPA encoders):
    one tg.attention, 37 queries and keys (partial tiles), head dim 18 (a partial pair
    block), an additive mask over the keys."""
    rng = np.random.default_rng(3)
    g = Graph()
    q, k, v = (g.input(n, (1, 2, 37, 18)) for n in "qkv")
    y = g.attention(q, k, v, g.input("m", (1, 1, 1, 37)), scale=0.25)
    xs = [rng.standard_normal((1, 2, 37, 18)).astype(np.float32) for _ in range(3)]
    xs.append(np.where(rng.random((1, 1, 1, 37)) < 0.8, 0.0, -1e4).astype(np.float32))
    return g.build(y, names=["y"]), xs


def test_bf16_attention_multiplies_on_the_processors_bf16_units():
    """At precision bf16 the flash kernel's two products run on AMX tiles or AVX-512 BF16
    where the processor has them (found at run time), the softmax in f32: one step, no oneDNN
    primitive, no reference kernel; without either it runs its f32 products."""
    model, xs = _attention()
    want = interpret(model, xs)[0]
    f32 = tilegraph.compile(model, target="c")
    exact = f32.run(*xs)[0]
    assert_close(exact, want, "f32", reduction_length=37 + 18)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a processor without bf16 units: the module says so and runs f32
        bf16 = tilegraph.compile(model, target="c", precision="bf16")
    runner: CompiledModel = bf16._runner
    assert bf16.source.count("tg_attention(") == 1
    assert runner.primitives == [] and bf16.reference_kernels == []
    lib = runner._lib
    lib.tg_bf16_attention_count.restype = ctypes.c_int
    before = lib.tg_bf16_attention_count()
    got = bf16.run(*xs)[0]
    assert_close(got, want, "bf16", reduction_length=37 + 18)
    cpu_bf16 = _bf16_units()
    if runner.precision == "bf16" and cpu_bf16:
        assert lib.tg_bf16_attention_count() == before + 1  # the bf16 kernel ran, once
        assert not np.array_equal(got, exact)  # its operands were rounded to bf16
    else:
        assert lib.tg_bf16_attention_count() == before
    assert np.array_equal(f32.run(*xs)[0], exact)  # an f32 module beside it stays f32


@pytest.mark.parametrize("keys", [37, 197])
def test_bf16_folds_spelled_out_attention_over_enough_keys(keys):
    """Eager attention as exported (softmax(q @ k^T * scale + mask) @ v) at precision bf16:
    over C_BF16_FOLD_MIN_KEYS keys or more (ViT-S/16's 197 tokens) it becomes the flash
    kernel's one step (the scores never written), on AMX or AVX-512 BF16 where the processor has them; over
    fewer it stays oneDNN's GEMMs; f32 keeps the chain (its scores fit a core's cache). Both
    within bf16's tolerance of the interpreter."""
    from tilegraph.passes.registry import C_BF16_FOLD_MIN_KEYS

    rng = np.random.default_rng(keys)
    g = Graph()
    q, k, v = g.input("q", (1, 2, 5, 16)), g.input("k", (1, 2, keys, 16)), g.input("v", (1, 2, keys, 16))
    scores = g.matmul(q, k.transpose(0, 1, 3, 2)) * g.constant(np.float32(0.25)) + g.input("m", (1, 1, 1, keys))
    model = g.build(g.matmul(g.softmax(scores, axis=-1), v), names=["y"])
    xs = [rng.standard_normal((1, 2, n, 16)).astype(np.float32) for n in (5, keys, keys)]
    xs.append(np.where(rng.random((1, 1, 1, keys)) < 0.8, 0.0, -1e4).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bf16 = tilegraph.compile(model, target="c", precision="bf16")
    folded = keys >= C_BF16_FOLD_MIN_KEYS
    assert bf16.source.count("tg_attention(") == folded
    assert "tg_attention(" not in tilegraph.compile(model, target="c").source
    assert bf16.reference_kernels == []
    lib = bf16._runner._lib
    lib.tg_bf16_attention_count.restype = ctypes.c_int
    before = lib.tg_bf16_attention_count()
    assert_close(bf16.run(*xs)[0], interpret(model, xs)[0], "bf16", reduction_length=keys + 16)
    cpu_bf16 = _bf16_units()
    assert lib.tg_bf16_attention_count() == before + (folded and bf16._runner.precision == "bf16" and cpu_bf16)


@pytest.mark.parametrize("causal, mask", [(False, "bool"), (True, None)])
def test_bf16_attention_over_several_query_and_key_blocks(causal, mask):
    """The bf16 kernel's packing and tiling edges: 150 queries (a full and a partial query
    block), 301 keys (a block of 256 and one of 45: an odd count, half a pair), head dims 40
    and 24 (partial pair and column blocks), 3 heads; a bool mask or a causal cut with
    more keys than queries. Every key block is packed once and read by both query blocks, so a
    wrong offset in the packed k or v shows in every row. Within bf16's tolerance of the
    float64 interpreter, one tg_attention step, the bf16 kernel taken where the processor has bf16 units."""
    rng = np.random.default_rng(7)
    g = Graph()
    q, k, v = g.input("q", (1, 3, 150, 40)), g.input("k", (1, 3, 301, 40)), g.input("v", (1, 3, 301, 24))
    xs = [rng.standard_normal((1, 3, n, e)).astype(np.float32) for n, e in ((150, 40), (301, 40), (301, 24))]
    m = None
    if mask:
        m = g.input("m", (1, 1, 150, 301), "i1")
        keep = rng.random((1, 1, 150, 301)) < 0.7
        keep[..., 0] = True  # no row with every key masked (NaN there, as softmax's)
        xs.append(keep)
    model = g.build(g.attention(q, k, v, m, scale=0.15, causal=causal), names=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bf16 = tilegraph.compile(model, target="c", precision="bf16")
    assert bf16.source.count("tg_attention(") == 1 and bf16.reference_kernels == []
    runner: CompiledModel = bf16._runner
    lib = runner._lib
    lib.tg_bf16_attention_count.restype = ctypes.c_int
    before = lib.tg_bf16_attention_count()
    got = bf16.run(*xs)[0]
    assert_close(got, interpret(model, xs)[0], "bf16", reduction_length=301 + 40)
    cpu_bf16 = _bf16_units()
    assert lib.tg_bf16_attention_count() == before + (runner.precision == "bf16" and cpu_bf16)


def test_bf16_attention_adds_a_float_mask_in_its_max_pass():
    """An added float mask along the keys (an encoder's padding mask, BERT's) is summed into the
    scores in the softmax's max pass, 16 keys at a time, at both precisions: a mask that differs
    per query row and has -inf and large negative entries, 301 keys (a full key block and a
    partial one), 150 queries. Within each precision's tolerance of the float64 interpreter; rows
    the mask cuts apart must not see each other's keys."""
    rng = np.random.default_rng(5)
    g = Graph()
    q, k, v = g.input("q", (1, 2, 150, 32)), g.input("k", (1, 2, 301, 32)), g.input("v", (1, 2, 301, 16))
    m = g.input("m", (1, 1, 150, 301))
    xs = [rng.standard_normal((1, 2, n, e)).astype(np.float32) for n, e in ((150, 32), (301, 32), (301, 16))]
    mask = np.where(rng.random((1, 1, 150, 301)) < 0.3, -np.inf, rng.standard_normal((1, 1, 150, 301)))
    mask[..., 1::7] = -1e9
    mask[..., 0] = 0.0  # no row with every key masked (NaN there, as softmax's)
    xs.append(mask.astype(np.float32))
    model = g.build(g.attention(q, k, v, m, scale=0.2), names=["y"])
    want = interpret(model, xs)[0]
    assert_close(tilegraph.compile(model, target="c").run(*xs)[0], want, "f32", reduction_length=301 + 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bf16 = tilegraph.compile(model, target="c", precision="bf16")
    assert bf16.source.count("tg_attention(") == 1
    assert_close(bf16.run(*xs)[0], want, "bf16", reduction_length=301 + 32)


def test_bf16_attention_products_skip_the_tiles_padding():
    """On AVX-512 BF16 (no AMX) the flash kernel's products run over only the rows and pairs
    they need, where AMX multiplies whole 16 x 16 tiles: ViT-S/16's 197 tokens are 99 pairs of
    keys (tiles: 112) and a last slab of 5 query rows takes 8 (tiles: 16), a tenth less work.
    The kernel counts the multiply-adds of pairs it ran: on this processor's path it must be
    the trimmed count (on AMX the tiles' count), and the result within bf16's tolerance."""
    import re

    rng = np.random.default_rng(3)
    heads, n, d = 2, 197, 64
    g = Graph()
    q, k, v = (g.input(name, (1, heads, n, d)) for name in "qkv")
    model = g.build(g.attention(q, k, v, None, scale=0.125, causal=False), names=["y"])
    xs = [rng.standard_normal((1, heads, n, d)).astype(np.float32) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bf16 = tilegraph.compile(model, target="c", precision="bf16")
    runner: CompiledModel = bf16._runner
    if runner.precision != "bf16" or not _bf16_units():
        pytest.skip("no bf16 dot products on this processor")
    # the block sizes the tile pass chose: the call's last two arguments
    bq, bk = (int(x) for x in re.search(r"tg_attention\(.*, (\d+), (\d+)\)", bf16.source).groups())
    lib = runner._lib
    lib.tg_bf16_attention_pairs.restype = ctypes.c_int64
    lib.tg_amx_supported.restype = ctypes.c_int
    amx = bool(lib.tg_amx_supported())
    up = lambda x, m: -(-x // m) * m  # noqa: E731
    want = 0
    for i0 in range(0, n, bq):
        for r0 in range(0, min(bq, n - i0), 32):  # slabs of the kernel's TG_AMX_SLAB query rows
            rows = up(min(32, min(bq, n - i0) - r0), 16 if amx else 4)
            for j0 in range(0, n, bk):
                nk = min(bk, n - j0)
                scores, weighted = up(d // 2, 16 if amx else 1), up(-(-nk // 2), 16 if amx else 1)
                want += rows * up(nk, 16) * scores + rows * up(d, 16) * weighted
    before = lib.tg_bf16_attention_pairs()
    got = bf16.run(*xs)[0]
    assert lib.tg_bf16_attention_pairs() - before == heads * want
    assert_close(got, interpret(model, xs)[0], "bf16", reduction_length=n + d)


def _decoder_block():
    """A Llama block's GEMM sources: x @ W0 plus x (the residual), an RMS norm of that, and
    the norm read by four GEMMs (the query and key projections, a gated MLP's gate and up);
    attention over the projected heads read by its output projection; the MLP's
    silu(gate) * up read by its down projection."""
    rng = np.random.default_rng(11)
    g = Graph()
    x = g.input("x", (1, 24, 64))

    def w(name, n, m):
        return g.weight(name, (rng.standard_normal((n, m)) / np.sqrt(n)).astype(np.float32))
    h = g.matmul(x, w("w0", 64, 64)) + x
    rms = h * g.rsqrt(g.reduce_mean(h * h, axes=(-1,), keepdims=True) + g.constant(np.float32(1e-6))) * \
        g.weight("gamma", (1 + rng.standard_normal(64) / 4).astype(np.float32))
    q, k = g.matmul(rms, w("wq", 64, 64)), g.matmul(rms, w("wk", 64, 64))
    heads = [v.reshape(1, 24, 4, 16).transpose(0, 2, 1, 3) for v in (q, k)]
    att = g.attention(heads[0], heads[1], heads[1], scale=0.25, causal=True).transpose(0, 2, 1, 3).reshape(1, 24, 64)
    o = g.matmul(att, w("wo", 64, 64)) + h
    gate, up = g.matmul(rms, w("wg", 64, 96)), g.matmul(rms, w("wu", 64, 96))
    down = g.matmul(g.sigmoid(gate) * gate * up, w("wd", 96, 64)) + o
    return g.build(q, down, names=["q", "y"]), [rng.standard_normal((1, 24, 64)).astype(np.float32)]


def test_bf16_gemm_sources_are_written_in_bf16_by_their_producer():
    """At bf16, a buffer only bf16 GEMMs read (the RMS norm's result, attention's, the gated
    product) is written in bf16 by the step that computes it (a row loop, the attention
    kernel, an elementwise loop), so no GEMM converts its source each call: one warm call
    runs only the conversion of the model's input x; the key projection, read only by
    attention (as its k and v), is written in bf16 by its GEMM too. Within bf16's tolerance
    of the interpreter; at f32 the same source runs f32 and converts nothing."""
    model, xs = _decoder_block()
    want = interpret(model, xs)
    compiled = tilegraph.compile(model, target="c", precision="bf16")
    runner: CompiledModel = compiled._runner
    if runner.precision != "bf16":
        pytest.skip("this processor has no bf16 dot products")
    got = compiled.run(*xs)
    for a, b in zip(got, want):
        assert_close(a, b, "bf16", reduction_length=64 * 4 + 96)
    assert runner.program.bf16_sources == 4
    runner(*xs)
    before = runner.reorder_count()
    runner(*xs)
    assert runner.reorder_count() - before == 1, runner.primitives  # 8 GEMMs, only x's source converted
    assert not runner.reference_kernels
    f32 = tilegraph.compile(model, target="c")
    assert f32.source == compiled.source
    for a, b in zip(f32.run(*xs), want):
        assert_close(a, b, "f32", reduction_length=64 * 4 + 96)


def test_bf16_layer_norm_writes_its_gemms_source_in_bf16():
    """An encoder's layer_norm read by its query and key projections (BERT, ViT): at bf16 the
    row kernel writes the norm in bf16, so a warm call converts only the model input x (for
    the first GEMM); within bf16's tolerance of the interpreter."""
    rng = np.random.default_rng(1)
    g = Graph()
    x = g.input("x", (1, 20, 48))

    def w(name, n, m):
        return g.weight(name, (rng.standard_normal((n, m)) / 7).astype(np.float32))
    h = g.matmul(x, w("w0", 48, 48)) + x
    n = g.layer_norm(h, g.weight("s", (1 + rng.standard_normal(48) / 4).astype(np.float32)),
                     g.weight("b", (rng.standard_normal(48) / 4).astype(np.float32)))
    model = g.build(h, g.matmul(n, w("wq", 48, 32)), g.matmul(n, w("wk", 48, 32)), names=["h", "q", "k"])
    xs = [rng.standard_normal((1, 20, 48)).astype(np.float32)]
    compiled = tilegraph.compile(model, target="c", precision="bf16")
    runner: CompiledModel = compiled._runner
    if runner.precision != "bf16":
        pytest.skip("this processor has no bf16 dot products")
    for a, b in zip(compiled.run(*xs), interpret(model, xs)):
        assert_close(a, b, "bf16", reduction_length=48 * 2)
    assert runner.program.bf16_sources == 1
    before = runner.reorder_count()
    runner(*xs)
    assert runner.reorder_count() - before == 1, runner.primitives  # x's conversion, not the norm's twice


def test_bf16_projections_read_only_by_attention_are_written_in_bf16():
    """An encoder layer's query, key and value projections (bias post-ops) read only by its
    attention (BERT's, ViT's): at bf16 oneDNN writes each in bf16 and the flash kernel reads
    them so (tg_set_attention_in_bf16 with all three bits), where it rounded its f32 operands
    to bf16 itself; the attention's result is written in bf16 for the output projection. So
    a warm call converts nothing but the model input, once for each projection. Within bf16's
    tolerance of the interpreter; the f32 module runs the same source with every flag off."""
    rng = np.random.default_rng(4)
    g = Graph()
    x = g.input("x", (1, 40, 64))

    def w(name, n, m):
        return g.weight(name, (rng.standard_normal((n, m)) / 8).astype(np.float32))
    heads = [(g.matmul(x, w(f"w{c}", 64, 64)) + g.weight(f"b{c}", rng.standard_normal(64).astype(np.float32) / 4))
             .reshape(1, 40, 4, 16).transpose(0, 2, 1, 3) for c in "qkv"]
    att = g.attention(*heads, scale=0.25).transpose(0, 2, 1, 3).reshape(1, 40, 64)
    model = g.build(g.matmul(att, w("wo", 64, 64)), names=["y"])
    xs = [rng.standard_normal((1, 40, 64)).astype(np.float32)]
    want = interpret(model, xs)[0]
    compiled = tilegraph.compile(model, target="c", precision="bf16")
    runner: CompiledModel = compiled._runner
    if runner.precision != "bf16":
        pytest.skip("this processor has no bf16 dot products")
    assert compiled.source.count("tg_attention(") == 1
    assert "tg_set_attention_in_bf16((st->bf16 ? 1 : 0) | (st->bf16 ? 2 : 0) | (st->bf16 ? 4 : 0));" in \
        compiled.source
    assert runner.program.bf16_sources == 4  # q, k, v and the attention's result
    assert_close(compiled.run(*xs)[0], want, "bf16", reduction_length=64 + 40)
    assert sum("(a bf16 result)" in line for line in runner.primitives) == 3, runner.primitives
    before = runner.reorder_count()
    runner(*xs)
    assert runner.reorder_count() - before == 3, runner.primitives  # the input x's, one per projection
    f32 = tilegraph.compile(model, target="c")
    assert f32.source == compiled.source
    assert_close(f32.run(*xs)[0], want, "f32", reduction_length=64 + 40)


def test_bf16_gemm_writes_the_next_gemms_source_in_bf16():
    """An MLP's first projection (its bias and gelu oneDNN post-ops) read only by the second:
    at bf16 oneDNN writes it in bf16 and the second GEMM reads it so; a warm call converts
    only the model input x. Within bf16's tolerance of the interpreter."""
    rng = np.random.default_rng(2)
    g = Graph()
    x = g.input("x", (1, 20, 48))

    def w(name, n, m):
        return g.weight(name, (rng.standard_normal((n, m)) / 7).astype(np.float32))
    hidden = g.gelu(g.matmul(x, w("w1", 48, 96)) + g.weight("b1", (rng.standard_normal(96) / 4).astype(np.float32)))
    model = g.build(g.matmul(hidden, w("w2", 96, 48)) + x, names=["y"])
    xs = [rng.standard_normal((1, 20, 48)).astype(np.float32)]
    compiled = tilegraph.compile(model, target="c", precision="bf16")
    runner: CompiledModel = compiled._runner
    if runner.precision != "bf16":
        pytest.skip("this processor has no bf16 dot products")
    assert_close(compiled.run(*xs)[0], interpret(model, xs)[0], "bf16", reduction_length=48 + 96)
    assert runner.program.bf16_sources == 1
    assert sum("(a bf16 result)" in line for line in runner.primitives) == 1, runner.primitives
    before = runner.reorder_count()
    runner(*xs)
    assert runner.reorder_count() - before == 1, runner.primitives
