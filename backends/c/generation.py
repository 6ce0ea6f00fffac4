"""Generation's ops in C: block-format matmuls and lookups, the KV cache, RMSNorm, RoPE.

Each is a call into the runtime's kernels (blockq.c) on views the emitter already has:

* `block_matmul` and `block_gather` read a weight as its GGUF bytes (ui8[N, row_bytes]),
  never widened. With activation='q8' the activation rows are rounded to int8 per 32
  (block_formats.quantize_activations) and meet the weight in integer dot products
  (blockq.c says why), as in llama.cpp, within `blockq.activation_error_bound` of
  activation='f32', which dequantizes each weight block to float in registers (a prompt:
  a dequantized panel at a time into an sgemm).
* `cache_write` writes the new rows into the cache operand's own buffer, which must be a
  model input read by nothing else (the op donates it, as XLA's aliased buffers): its
  result is that buffer, and the runtime hands the caller's array back as the output,
  never a copy (runtime.py, `donated`). Anything else runs on the host.
* `cache_attention` reads each cache row once for the heads that share it. A cache may be
  f16 (llama.cpp's default: half the bytes a decode step reads at depth): cache_write
  rounds into it (store='f16'), cache_attention widens each block of K rows in L1 and V
  rows as it reads them (AVX-512, up to 4 query rows per KV head), the block two ahead
  prefetched (the rows stream once per step).
* `sample` draws each sequence's token from its logits inside the step (decode.c).
* `rms_norm` is one pass per row; `rope` one loop over the two halves of each row;
  `iota` (the new tokens' positions) a loop, so a decode step stays one native call.
"""

from __future__ import annotations

import sympy

from tilegraph.backends.c.blockq import FORMATS
from tilegraph.backends.c.tables import CTYPES
from tilegraph.backends.c.views import EmitterParts, Unsupported, View, _describe, _eq, _only_use, c_float, lowers
from tilegraph.ir.block_formats import block_format
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.ops import Op
from tilegraph.ir.shapes import numel

CACHE_OPS = (Op.cache_write, Op.cache_attention)  # each checks its own dtypes (a cache may be f16)
ELEMENT_BYTES = {"f32": 4, "f64": 8, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "ui8": 1, "ui16": 2, "ui32": 4,
                 "ui64": 8, "i1": 1}


class Generation(EmitterParts):
    """Lowerings of generation's ops."""

    def _rows(self, x: View) -> View:
        """x with contiguous rows (a copy if it is strided)."""
        return x if self.is_contiguous(x) else self.materialize(x)

    def _block_operands(self, op: TgOp, w: View, x: View, ok: bool, what: str):
        """(format, k, the weight's bytes, x with contiguous rows, a new result) of a block-format op."""
        fmt, k = op.attr("format"), int(op.attr("k"))
        if not ok or x.literal is not None or fmt not in FORMATS:
            raise Unsupported(what)
        if w.literal is not None or w.dtype != "ui8" or not self.is_contiguous(w) or not _eq(w.offset, 0):
            raise Unsupported("a block-format weight as whole contiguous bytes")
        return fmt, k, w, self._rows(x), self._temp(op.result_infos()[0])

    @lowers(Op.block_matmul)
    def block_matmul(self, op: TgOp, xs: list[View]) -> View:
        fmt, k, w, x, out = self._block_operands(op, xs[1], xs[0], xs[0].dtype == "f32",
                                                 "block_matmul of f32 activations in a format the kernels know")
        kernel = "tg_block_matmul" if op.attr("activation") == "q8" else "tg_block_matmul_f32"
        n = self.ints(w.shape[0])
        self._step(_describe(op), [
            f"if ({kernel}({self.ptr(x)}, {self.ints(numel(x.shape[:-1]))}, {k}, {self.ptr(w)}, {n}, "
            f"{block_format(fmt).row_bytes(k)}, {FORMATS[fmt]}, {self.ptr(out, False)}, {n})) return 1;"], [x, w], [out])
        return out

    @lowers(Op.block_gather)
    def block_gather(self, op: TgOp, xs: list[View]) -> View:
        fmt, k, w, idx, out = self._block_operands(op, xs[0], xs[1], xs[1].dtype == "i64",
                                                   "block_gather with i64 indices")
        self._step(_describe(op), [
            f"if (tg_block_rows({self.ptr(w)}, {self.ints(w.shape[0])}, {k}, {block_format(fmt).row_bytes(k)}, "
            f"{FORMATS[fmt]}, {self.ptr(idx)}, {self.ints(numel(idx.shape))}, {self.ptr(out, False)})) return 1;"],
            [w, idx], [out])
        return out

    def _positions(self, pos: View) -> tuple[str, int]:
        """(pointer, stride) of a cache position operand: one i64, or one per sequence."""
        if pos.dtype != "i64" or pos.literal is not None:
            raise Unsupported("cache positions as an i64 tensor")
        if pos.rank == 0:
            return self.ptr(pos), 0
        if not _eq(pos.strides[0], 1) and not _eq(pos.shape[0], 1):
            raise Unsupported("strided cache positions")
        return self.ptr(pos), 0 if _eq(pos.shape[0], 1) else 1

    def _whole(self, v: View) -> bool:
        return (v.literal is None and self.is_contiguous(v) and _eq(v.offset, 0)
                and sympy.expand(sympy.sympify(numel(v.shape)) - self.buffers[v.buf].elements) == 0)

    @lowers(Op.cache_write)
    def cache_write(self, op: TgOp, xs: list[View]) -> View:
        cache, x, pos = xs
        # In place only into a whole model input that nothing else reads: writing a value some
        # other op still reads as the old cache would change what that op sees.
        buf = self.buffers[cache.buf]
        if not (self._whole(cache) and buf.storage == "input" and buf.index in self.model.aliases
                and _only_use(op.operands[0], op)):
            raise Unsupported("cache_write in place into a donated model input")
        store = op.attr("store")
        if cache.dtype not in CTYPES and not store:
            raise Unsupported(f"{cache.dtype} cache")
        x = self._rows(x)
        ptr, stride = self._positions(pos)
        b, h, s, d = cache.shape
        if store:  # f32 rows rounded into an f16 cache (the shape rule allows no other)
            self._step(_describe(op), [
                f"if (tg_cache_write_f16({self._f16_ptr(cache, False)}, {self.ptr(x)}, {self.ints(b)}, "
                f"{self.ints(h)}, {self.ints(s)}, {self.ints(x.shape[2])}, {self.ints(d)}, {ptr}, {stride})) "
                "return 1;"], [cache, x, pos], [cache])
            self.donated.add(cache.buf)
            return cache
        self._step(_describe(op), [
            f"if (tg_cache_write({self.ptr(cache, False)}, {self.ptr(x)}, {self.ints(b)}, {self.ints(h)}, "
            f"{self.ints(s)}, {self.ints(x.shape[2])}, {self.ints(d)}, {ELEMENT_BYTES[cache.dtype]}, {ptr}, "
            f"{stride})) return 1;"], [cache, x, pos], [cache])
        self.donated.add(cache.buf)
        return cache

    def _f16_ptr(self, v: View, const: bool = True) -> str:
        """A pointer to an f16 view's bits (uint16_t): only the cache kernels take f16, never C arithmetic."""
        off = self.ints(v.offset)
        base = f"(({'const ' if const else ''}uint16_t *)p[{v.buf}])"
        return base if off == "0" else f"({base} + {off})"

    @lowers(Op.cache_attention)
    def cache_attention(self, op: TgOp, xs: list[View]) -> View:
        q, k, v, pos = xs
        info = op.result_infos()[0]
        if info.dtype != "f32" or k.dtype not in ("f32", "f16") or not (self._whole(k) and self._whole(v)) \
                or not _eq(k.shape[3], v.shape[3]):
            raise Unsupported("cache_attention over whole f32 or f16 caches with one head size")
        q = self._rows(q)
        ptr, stride = self._positions(pos)
        out = self._temp(info)
        b, h, t, d = q.shape
        if k.dtype == "f16":
            kernel, kp, vp = "tg_cache_attention_f16", self._f16_ptr(k), self._f16_ptr(v)
        else:
            kernel, kp, vp = "tg_cache_attention", self.ptr(k), self.ptr(v)
        self._step(_describe(op), [
            f"if ({kernel}({self.ptr(q)}, {kp}, {vp}, {self.ptr(out, False)}, "
            f"{self.ints(b)}, {self.ints(h)}, {self.ints(k.shape[1])}, {self.ints(t)}, {self.ints(k.shape[2])}, "
            f"{self.ints(d)}, {ptr}, {stride}, {c_float(op.attr('scale'), 'f32')}, {int(op.attr('window'))})) "
            "return 1;"], [q, k, v, pos], [out])
        return out

    @lowers(Op.rms_norm)
    def rms_norm(self, op: TgOp, xs: list[View]) -> View:
        x = self._rows(xs[0])
        scale = xs[1] if len(xs) > 1 else None
        info = op.result_infos()[0]
        if info.dtype != "f32":
            raise Unsupported("rms_norm in f32")
        axis = op.attr("axis") % x.rank
        n, rows = numel(x.shape[axis:]), numel(x.shape[:axis])
        sp = "NULL"
        if scale is not None:
            full = self.broadcast(scale, x.shape[axis:])
            if scale.literal is not None or not self.is_contiguous(full):
                raise Unsupported("rms_norm's scale not one value per element of a row")
            sp = self.ptr(full)
        out = self._temp(info)
        self._step(_describe(op), [
            f"tg_rms_norm_rows({self.ptr(x)}, {self.ptr(out, False)}, {sp}, {self.ints(rows)}, {self.ints(n)}, "
            f"{c_float(op.attr('epsilon'), 'f32')});"], [x] + ([scale] if scale is not None else []), [out])
        return out

    @lowers(Op.rope)
    def rope(self, op: TgOp, xs: list[View]) -> View:
        x, cos, sin = xs
        info = op.result_infos()[0]
        if info.dtype != "f32" or x.literal is not None:
            raise Unsupported("rope in f32")
        half = int(x.shape[-1]) // 2
        shape = tuple(x.shape[:-1]) + (half,)
        out = self._temp(info)

        def halves(v: View) -> tuple[View, View]:
            first = View(v.buf, v.offset, shape, v.strides, v.dtype)
            return first, View(v.buf, v.offset + half * v.strides[-1], shape, v.strides, v.dtype)

        (x1, x2), (o1, o2) = halves(x), halves(out)
        c, s = self.broadcast(cos, shape), self.broadcast(sin, shape)
        lines = self.loop(shape, [(x1, False), (x2, False), (c, False), (s, False), (o1, True), (o2, True)],
                          lambda r: [f"{{ const float a = {r[0]}, b = {r[1]}, c = {r[2]}, s = {r[3]};",
                                     f"  {r[4]} = a * c - b * s; {r[5]} = b * c + a * s; }}"])
        self._step(_describe(op), lines, [x, cos, sin], [out])
        return out

    @lowers(Op.sample)
    def sample(self, op: TgOp, xs: list[View]) -> View:
        logits, seen, u = (self._rows(x) for x in xs)
        if logits.dtype != "f32" or u.dtype != "f32" or any(x.literal is not None for x in (logits, seen, u)):
            raise Unsupported("sample of f32 logits")
        out = self._temp(op.result_infos()[0])
        b, v = logits.shape
        a = op.py_attrs()
        self._step(_describe(op), [
            f"if (tg_sample({self.ptr(logits)}, {self.ptr(seen)}, {self.ptr(u)}, {self.ints(b)}, {self.ints(v)}, "
            f"{c_float(a['temperature'], 'f32')}, {int(a['top_k'])}, {c_float(a['top_p'], 'f32')}, "
            f"{c_float(a['repetition_penalty'], 'f32')}, {self.ptr(out, False)})) return 1;"], [logits, seen, u], [out])
        return out

    @lowers(Op.iota)
    def iota(self, op: TgOp, xs: list[View]) -> View:
        info = op.result_infos()[0]
        if info.dtype not in CTYPES:
            raise Unsupported(f"iota of {info.dtype}")
        out = self._temp(info)
        axis = op.attr("axis") % len(info.shape)
        inner = numel(info.shape[axis + 1:])
        self._step(_describe(op), [
            f"for (int64_t i = 0; i < {self.ints(numel(info.shape))}; i++)",
            f"    (({CTYPES[info.dtype]} *)p[{out.buf}])[i] = ({CTYPES[info.dtype]})(i / {self.ints(inner)} % "
            f"{self.ints(info.shape[axis])});"], [], [out])
        return out
