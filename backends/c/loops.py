"""Loop nests and elementwise bodies: how the C emitter writes a loop over a view's shape."""

from __future__ import annotations

from typing import Any

import sympy
from xdsl.ir import SSAValue

from tilegraph.backends.c.tables import (C_BINARY, C_BINARY_FLOAT, C_BINARY_INT, C_UNARY_FLOAT, C_UNARY_INT, CTYPES,
                                         FLOAT_TO_INT, FLOATS, PARALLEL_MIN, SIMD_BLOCK, STORAGE,
                                         UNROLLED_CHANNELS)
from tilegraph.backends.c.views import (EmitterParts, Unsupported, View, _describe, _eq, _is_one, bf16_marker, feeds_gemm,
                                        lowers)
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.quant import FORMATS
from tilegraph.ir.shapes import info_of, numel
from tilegraph.ir.ops import OPS, Op

# The elementwise ops `Loops.expr` writes as C (the others of the table run on the host).
EXPRESSIONS = {*C_UNARY_FLOAT, *C_UNARY_INT, *C_BINARY, *C_BINARY_FLOAT, *C_BINARY_INT, Op.gelu, Op.sigmoid, Op.cast,
               Op.mod, Op.isinf}


class Loops(EmitterParts):
    """Loop nests over views and straight-line elementwise bodies."""

    # --- loops ----------------------------------------------------------------------

    # Inside a parallel region the step opened (Groups._over_pieces): every loop nest is shared
    # among the region's threads, however small, and none waits for the others at its end.
    workshare = False

    def _parallel_for(self, total, loops: int) -> list[str]:
        """The OpenMP pragma sharing `loops` nested loops of `total` work among the threads:
        none where `total` is known and small (a team of one still costs a region)."""
        if self.workshare:
            return [f"#pragma omp for nowait{f' collapse({loops})' if loops > 1 else ''}"]
        n = sympy.sympify(total)
        if n.is_number and int(n) <= PARALLEL_MIN:
            return []
        return [f"#pragma omp parallel for{f' collapse({loops})' if loops > 1 else ''} "
                f"if ({self.ints(n)} > {PARALLEL_MIN})"]

    def loop(self, shape, accesses: list[tuple[View, bool]], body) -> list[str]:
        """A loop nest over `shape` reading and writing `accesses` (views of that shape,
        broadcast already; flag: written). `body(refs)` gets each access's C element
        expression and returns the innermost lines. Axes that every access walks
        contiguously are merged; the outer loops run on OpenMP threads."""
        order = list(range(len(shape)))
        written = next((a for a, w in accesses if w), None)
        # Walk memory in a channels-last output's order, unless its channels are fewer than a
        # vector (an image's 3 planes copied into channels-last: read along rows instead, or with
        # at most UNROLLED_CHANNELS of them, each pixel's channels one after another in the body,
        # the loop over pixels: rows read and pixels written in order, 0.33x the time of the
        # copy along rows at 224x224). A piece of a wider channels-last buffer (a concat's)
        # walks the same way.
        unrolled = 0
        if written is not None and _channels_innermost(written):
            few = sympy.sympify(shape[1]).is_number and int(shape[1]) < 16 and \
                any(not w and self.is_contiguous(a) for a, w in accesses if a.literal is None)
            if not few:
                order = [0, *range(2, len(shape)), 1]
            elif int(shape[1]) <= UNROLLED_CHANNELS and any(not _is_one(d) for d in shape[2:]):
                unrolled = int(shape[1])
                order = [0, *range(2, len(shape))]
        dims = [(shape[i], [a.strides[i] for a, _ in accesses]) for i in order if not _is_one(shape[i])]
        merged: list[tuple[Any, list]] = []
        for d, strides in dims:
            if merged and all(_eq(ps, s * d) for ps, s in zip(merged[-1][1], strides)):
                merged[-1] = (merged[-1][0] * d, strides)
            else:
                merged.append((d, strides))
        lines = ["{"]
        bases = []
        for k, (a, written) in enumerate(accesses):  # type: ignore[assignment]
            if a.literal is not None:
                bases.append(None)
                continue
            lines.append(f"    {'' if written else 'const '}{STORAGE[a.dtype]} *b{k} = {self.ptr(a, not written)};")
            bases.append(f"b{k}")
        if not merged:
            refs = [a.literal if b is None else f"{b}[0]" for (a, _), b in zip(accesses, bases)]
            lines += ["    " + line for line in body(refs)] + ["}"]
            return lines
        total = numel(tuple(d for d, _ in merged))
        outer, (inner_n, inner_strides) = merged[:-1], merged[-1]
        indent = "    "
        if outer:
            lines += [indent + line for line in self._parallel_for(total, len(outer))]
            for i, (d, _) in enumerate(outer):
                lines.append(f"{indent}for (int64_t i{i} = 0; i{i} < {self.ints(d)}; i{i}++)")
            lines.append(indent + "{")
            indent += "    "
            for k, b in enumerate(bases):
                if b is None:
                    continue
                terms = [f"i{i} * {self.ints(st[k])}" for i, (_, st) in enumerate(outer) if self.ints(st[k]) != "0"]
                const = "" if accesses[k][1] else "const "
                lines.append(f"{indent}{const}{STORAGE[accesses[k][0].dtype]} *r{k} = {b}"
                             + "".join(f" + {t}" for t in terms) + ";")
            lines.append(f"{indent}#pragma omp simd")
            loop = f"for (int64_t j = 0; j < {self.ints(inner_n)}; j++) {{"
        elif self._parallel_for(total, 1):
            # Blocks over the threads, each a simd loop: GCC's combined `parallel for simd`
            # loses vectorization on one thread, its if(false) path included.
            n = self.ints(inner_n)
            lines += [indent + line for line in self._parallel_for(total, 1)]
            lines += [f"{indent}for (int64_t j0 = 0; j0 < {n}; j0 += {SIMD_BLOCK})", f"{indent}#pragma omp simd"]
            loop = f"for (int64_t j = j0; j < (j0 + {SIMD_BLOCK} < {n} ? j0 + {SIMD_BLOCK} : {n}); j++) {{"
        else:
            lines.append(f"{indent}#pragma omp simd")
            loop = f"for (int64_t j = 0; j < {self.ints(inner_n)}; j++) {{"
        def refs_at(c: int) -> list:  # each access's element at channel c of the pixel (0: no channels unrolled)
            refs = []
            for k, b in enumerate(bases):
                if b is None:
                    refs.append(accesses[k][0].literal)
                    continue
                row = f"r{k}" if outer else b
                st = self.ints(inner_strides[k])
                at = "0" if st == "0" else "j" if st == "1" else f"j * {st}"
                channel = self.ints(accesses[k][0].strides[1] * c) if c else "0"
                refs.append(f"{row}[{at}]" if channel == "0" else f"{row}[{at} + {channel}]")
            return refs

        lines.append(indent + loop)
        if unrolled:
            for c in range(unrolled):
                lines += [indent + "    {"] + [indent + "        " + line for line in body(refs_at(c))] + \
                    [indent + "    }"]
        else:
            lines += [indent + "    " + line for line in body(refs_at(0))]
        lines.append(indent + "}")
        if outer:
            lines.append("    }")
        lines.append("}")
        return lines

    # --- elementwise ------------------------------------------------------------------

    @lowers(*(name for name, spec in OPS.items() if spec.pointwise and name in EXPRESSIONS))
    def pointwise(self, op: TgOp, xs: list[View]) -> View:
        """One elementwise op outside a group: a loop of its own."""
        out = self._result(op, xs)
        self.elementwise([op], {r: None for r in op.results}, dict(zip(op.operands, xs)), [(op.results[0], out)], op)
        return out

    def expr(self, op: TgOp, args: list[str], operand_dtypes: list[str]) -> str:
        """The C expression of one elementwise op on C operand expressions."""
        name, out = op.op_name, op.result_infos()[0]
        if name == Op.gelu:
            suffix = "" if out.dtype == "f32" else "_d"
            return f"tg_gelu_{'tanh' if op.attr('approximate') == 'tanh' else 'erf'}{suffix}({args[0]})"
        if name == Op.sigmoid:
            if out.dtype == "f32" and _convolution_swish(op):
                return f"tg_sigmoid_swish({args[0]})"
            return f"tg_sigmoid{'' if out.dtype == 'f32' else '_d'}({args[0]})"
        if name == Op.cast:
            src, dst = operand_dtypes[0], out.dtype
            if dst == "i1":
                return f"(({args[0]}) != 0)"
            if src == "i1" and dst in ("f32", "f64"):
                # a select, not a conversion of the uint8_t: GCC vectorises no uint8_t-to-float
                # conversion beside 64-bit compares (cross-entropy's one-hot over GPT-2's logits
                # ran its whole pass element by element, 5x the time)
                return f"(({args[0]}) ? ({CTYPES[dst]})1 : ({CTYPES[dst]})0)"
            if src in FLOATS and dst not in FLOATS:  # NumPy's results out of range too (runtime.h)
                if dst in FLOAT_TO_INT:
                    return f"(({CTYPES[dst]})tg_f2{FLOAT_TO_INT[dst]}({args[0]}))"
                raise Unsupported(f"float to {dst} cast")
            return f"(({CTYPES[dst]})({args[0]}))"
        if name == Op.isinf:
            if operand_dtypes[0] not in FLOATS:
                return "0"
            signs = [s for s, on in (("", op.attr("detect_positive")), ("-", op.attr("detect_negative"))) if on]
            return "(" + " || ".join([f"({args[0]}) == {s}INFINITY" for s in signs] or ["0"]) + ")"
        if name in (Op.div, Op.mod) and (out.dtype not in FLOATS or name == Op.mod):
            # NumPy's results where C's are undefined: x / 0, INT_MIN / -1 (runtime.h)
            if any(t != out.dtype for t in operand_dtypes):
                raise Unsupported(f"{name} of mixed types")
            if name == Op.mod and op.attr("fmod") and out.dtype in FLOATS:
                return f"fmod{'f' if out.dtype == 'f32' else ''}({args[0]}, {args[1]})"
            kind = "div" if name == Op.div else "fmod" if op.attr("fmod") else "mod"
            ct = CTYPES[out.dtype]
            return f"tg_{kind}_{out.dtype}(({ct})({args[0]}), ({ct})({args[1]}))"
        if name in (Op.quantize, Op.dequantize):
            ct = "double" if out.dtype == "f64" else "float"
            x, scale = (f"(({ct})({arg}))" for arg in args[:2])
            zp = f"(({ct})({args[2]}))" if len(args) > 2 else None
            if name == Op.dequantize:
                return f"(({x}{f' - {zp}' if zp else ''}) * {scale})"
            fmt = FORMATS[op.attr("to")]
            rounded = f"rintf({x} / {scale}){f' + {zp}' if zp else ''}"
            return f"(({CTYPES[out.dtype]})tg_saturate({rounded}, {fmt.lo}.f, {fmt.hi}.f))"
        if name == Op.bitwise_not and out.dtype == "i1":  # ~ of a bool byte is 0xFE/0xFF, both true
            return f"(!({args[0]}))"
        if name == Op.add and out.dtype == "i1":  # NumPy's True + True is True, C's is 2
            return f"(({args[0]}) != 0 || ({args[1]}) != 0)"
        is_float = operand_dtypes[-1] in FLOATS
        names = dict(zip(op.SPEC.operand_names, args))
        for templates in ((C_UNARY_FLOAT, C_BINARY_FLOAT) if is_float else (C_UNARY_INT, C_BINARY_INT)) + (C_BINARY,):
            if name in templates:
                f32 = operand_dtypes[-1] == "f32"
                if name == Op.pow and f32 and args[1] in ("2.0f", "3.0f"):  # a literal exponent (gelu_new's
                    # x ** 3): products, not a libm call per element
                    return "(" + " * ".join([f"({args[0]})"] * int(float(args[1][:-1]))) + ")"
                return templates[name].format(**names, exp="tg_expf" if f32 else "exp", tanh="tg_tanhf" if f32 else "tanh",
                                              erf="tg_erff" if f32 else "erf")
        raise Unsupported(name)

    def elementwise(self, ops: list[TgOp], inner: dict, inputs: dict, outputs: list[tuple[SSAValue, View]],
                    describe, alias: dict | None = None) -> None:
        """One loop computing `ops` (elementwise, in order) at every element of the
        outputs' shape: `inputs` maps outside values to views, `inner` the values
        computed in the loop, `outputs` (value, view) pairs of one shape."""
        shape = outputs[0][1].shape
        reads: list[View] = []
        operand_ref: dict[SSAValue, int] = {}
        for v, view in inputs.items():
            if view.rank > len(shape):
                raise Unsupported("an input larger than the loop")
            operand_ref[v] = len(reads)
            reads.append(self.broadcast(view, shape))
        accesses = [(r, False) for r in reads] + [(o, True) for _, o in outputs]

        def viewed(v: SSAValue) -> SSAValue:  # a view made in the loop is the value it views
            while alias and v in alias:
                v = alias[v]
            return v

        def body(refs, store="{}"):
            lines, local = [], {}
            for v, k in operand_ref.items():
                local[v] = refs[k]
            for i, op in enumerate(ops):
                args = [local[viewed(v)] for v in op.operands]
                dts = [info_of(v.type).dtype for v in op.operands]
                out = op.result_infos()[0]
                lines.append(f"const {CTYPES[out.dtype]} t{i} = {self.expr(op, args, dts)};")
                local[op.results[0]] = f"t{i}"
            for k, (v, _) in enumerate(outputs):
                lines.append(f"{refs[len(reads) + k]} = {store.format(local[viewed(v)])};")
            return lines

        lines = self.loop(shape, accesses, body)
        written = outputs[0][1]
        bf16 = len(outputs) == 1 and self._whole_temp(written) and all(r.buf != written.buf for r in reads) and \
            feeds_gemm(viewed(outputs[0][0]))
        if bf16:  # the same loop writing bf16, taken where the buffer's GEMMs read it so (bf16_sources)
            half = View(written.buf, written.offset, written.shape, written.strides, "bf16")
            alt = self.loop(shape, [(r, False) for r in reads] + [(half, True)], lambda refs: body(refs, "tg_f2bf({})"))
            lines = [f"if ({bf16_marker(written.buf)}) {{", *("    " + x for x in alt), "} else {",
                     *("    " + x for x in lines), "}"]
        self._step(_describe(describe), lines, reads, [o for _, o in outputs])
        if bf16:
            self.steps[-1].bf16_writes.add(written.buf)


def _channels_innermost(view: View) -> bool:
    """Whether `view` (rank 3 or more) steps one element from channel to channel and varies over
    a spatial dim: channels-last, densely or as a slice of channels of a wider such buffer."""
    return view.literal is None and view.rank >= 3 and _eq(view.strides[1], 1) and \
        any(not _is_one(d) and not _eq(st, 0) for d, st in zip(view.shape[2:], view.strides[2:]))


def _convolution_swish(sigmoid: TgOp) -> bool:
    """Whether `sigmoid` is of a convolution's result and read only by x * sigmoid(x): the swish
    after EfficientNet's convolutions, which runs as a loop over their results (onednn.py)."""
    x = sigmoid.operands[0]
    readers = [u.operation for u in sigmoid.results[0].uses]
    return isinstance(x.owner, TgOp) and x.owner.op_name == Op.conv and len(readers) == 1 and \
        isinstance(readers[0], TgOp) and readers[0].op_name == Op.mul and \
        {id(v) for v in readers[0].operands} == {id(x), id(sigmoid.results[0])}
