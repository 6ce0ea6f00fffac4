"""Quantized ops (ir/quant.py's semantics) in C and on oneDNN's integer GEMMs."""

from __future__ import annotations

from tilegraph.backends.c.tables import CTYPES, FLOATS
from tilegraph.backends.c.views import EmitterParts, Unsupported, View, _describe, _eq, _is_one, lowers
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.quant import FORMATS
from tilegraph.ir.shapes import TensorInfo, numel
from tilegraph.ir.ops import Op


class Quantized(EmitterParts):
    """Integer quantization ops."""

    # --- quantized ops (ir/quant.py's semantics) ------------------------------------

    @lowers(Op.dynamic_quantize, spread=True)
    def dynamic_quantize(self, op: TgOp, x: View) -> list[View]:
        q_info, s_info = op.result_infos()
        if op.attr("block_size") or q_info.dtype != "i8" or x.dtype != "f32" or x.literal is not None or \
                not self.is_contiguous(x):
            raise Unsupported("dynamic_quantize: rows of f32 to i8")
        q, scale = self._temp(q_info), self._temp(s_info)
        n = x.shape[-1]
        self._step(_describe(op), [f"tg_dynamic_quantize_rows({self.ptr(x)}, {self.ptr(q, False)}, "
                                   f"{self.ptr(scale, False)}, {self.ints(numel(x.shape[:-1]))}, {self.ints(n)});"],
                   [x], [q, scale])
        return [q, scale]

    @lowers(Op.quantize, Op.dequantize)
    def requantize(self, op: TgOp, xs: list[View]) -> View:
        """quantize / dequantize with a scale per tensor, per channel or broadcast, as one loop."""
        info = op.result_infos()[0]
        x = xs[0]
        if op.attr("block_size") or x.literal is not None:
            raise Unsupported("block scales")
        if op.op_name == Op.quantize and (not FORMATS[op.attr("to")].integer or x.dtype not in FLOATS):
            raise Unsupported("quantize to a float format")
        self._check_dtypes(op, xs)
        operands = {}
        for v, view in zip(op.operands, xs):
            if v is not op.operands[0] and view.rank == 1 and x.rank > 1:  # per channel: along `axis`
                axis = op.attr("axis") % x.rank
                view = self.reshape(view, tuple(view.shape[0] if i == axis else 1 for i in range(x.rank)))
            operands[v] = view
        out = self._temp(info)
        self.elementwise([op], {op.results[0]: None}, operands, [(op.results[0], out)], op)
        return out

    @lowers(Op.matmul_integer)
    def matmul_integer(self, op: TgOp, xs: list[View]) -> View:
        """int8 x int8 -> int32 on oneDNN (VNNI where the processor has it). When the one
        reader of the result dequantizes it by one f32 scale per column, oneDNN applies
        that scale and writes f32: the dequantize is folded into the GEMM."""
        if len(xs) > 2:
            return self._matmul_integer_zero_point(op, *xs)
        a, b = xs
        users = {use.operation for use in op.results[0].uses}
        user = users.pop() if len(users) == 1 else None
        scales = None
        if (getattr(user, "op_name", None) == Op.dequantize and len(user.operands) == 2
                and not user.attr("block_size") and user.result_infos()[0].dtype == "f32"):
            source = user.operands[1].owner
            if self.prog.canon(user.operands[1]) not in self.views and getattr(source, "op_name", None) in (
                    Op.weight, Op.constant):
                self.op(source)
            s = self.views.get(self.prog.canon(user.operands[1]))
            n = op.result_infos()[0].shape[-1]
            if s is not None and s.literal is None and s.rank == 1 and _eq(s.shape[0], n) and \
                    user.attr("axis") % len(op.result_infos()[0].shape) == len(op.result_infos()[0].shape) - 1 \
                    and self.is_contiguous(s):
                scales = s
        out = self.matmul(op, a, b, [], {}, scales=scales)[0]
        if scales is not None:
            self.folded[user] = out
        return out

    def _matmul_integer_zero_point(self, op: TgOp, a: View, b: View, zero: View) -> View:
        """(a - z) @ b = a @ b - z * (column sums of b), exactly, in int32: the GEMM on oneDNN
        without the zero point, then one pass subtracting z times b's column sums (an
        asymmetric uint8 activation times an int8 weight, calibrated w8a8)."""
        if b.rank != 2 or not _is_one(numel(zero.shape)) or op.result_infos()[0].dtype != "i32":
            raise Unsupported("matmul_integer: one zero point, a 2-D right operand, int32")
        out = self.matmul(op, a, b, [], {})[0]
        if not self.is_contiguous(out):
            raise Unsupported("matmul_integer: a strided result")
        k, n = b.shape
        sums = self._temp(TensorInfo((n,), "i32"))
        z = zero.literal if zero.literal is not None else f"({self.ptr(zero)})[0]"
        lines = [
            "{",
            f"    const {CTYPES[b.dtype]} *B = {self.ptr(b)};",
            f"    int32_t *S = {self.ptr(sums, False)}, *C = {self.ptr(out, False)};",
            f"    const int32_t z = (int32_t){z};",
            f"    for (int64_t j = 0; j < {self.ints(n)}; j++) S[j] = 0;",
            f"    for (int64_t p = 0; p < {self.ints(k)}; p++)",
            "        #pragma omp simd",
            f"        for (int64_t j = 0; j < {self.ints(n)}; j++) S[j] += (int32_t)B[p * {self.ints(b.strides[0])} + "
            f"j * {self.ints(b.strides[1])}];",
            *("    " + line for line in self._parallel_for(numel(out.shape), 1)),
            f"    for (int64_t r = 0; r < {self.ints(numel(out.shape[:-1]))}; r++)",
            "        #pragma omp simd",
            f"        for (int64_t j = 0; j < {self.ints(n)}; j++) C[r * {self.ints(n)} + j] -= z * S[j];",
            "}",
        ]
        self._step("matmul_integer: the zero point times the column sums", lines,
                   [b, out] + ([zero] if zero.literal is None else []), [out, sums])
        return out
