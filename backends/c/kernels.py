"""Reductions, gathers, copies, pools and pads as emitted loops."""

from __future__ import annotations

import math

import sympy

from tilegraph.backends.c.tables import CTYPES, FLOATS, REDUCE_INIT, REDUCE_STEP, TOPK_MAX
from tilegraph.backends.c.views import (EmitterParts, Unsupported, View, lowers, _describe, _eq, _is_one, c_float,
                                        contiguous_strides)
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.shapes import numel
from tilegraph.ir.ops import Op
from tilegraph.ir.strides import reduces_rows_of_channels

# Channels a reduction over NHWC positions accumulates at a time (_reduce_rows_of_channels),
# each block a task of the threads: 64 doubles stay in L1 beside the row being added, and a
# batch-1 squeeze-excite pool of 96-1152 channels splits into 2-18 tasks (256 made one task
# of a 96- to 256-channel pool, on one thread however many there were).
CHANNEL_BLOCK = 64


class Kernels(EmitterParts):
    """Ops lowered as loops of their own."""

    # --- reductions, gathers, copies ----------------------------------------------------

    @lowers(Op.reduce_sum, Op.reduce_mean, Op.reduce_max, Op.reduce_min, spread=True)
    def reduce(self, op: TgOp, x: View) -> View:
        info = op.result_infos()[0]
        kind = op.op_name[len("reduce_"):]
        axes = sorted(a % x.rank for a in op.attr("axes"))  # none: nothing is reduced (np.sum(axis=()))
        if kind == "mean" and x.dtype not in FLOATS:
            raise Unsupported("integer mean")
        out = self._temp(info)
        keep = [i for i in range(x.rank) if i not in axes]
        kept_shape = tuple(x.shape[i] for i in keep)
        out_view = View(out.buf, 0, kept_shape, contiguous_strides(kept_shape), out.dtype)
        red = View(x.buf, x.offset, tuple(x.shape[i] for i in axes), tuple(x.strides[i] for i in axes), x.dtype,
                   x.literal)
        n = numel(red.shape)
        ctype = CTYPES[x.dtype]
        acc_type = "double" if x.dtype in FLOATS else ctype
        init = REDUCE_INIT[kind] if x.dtype in FLOATS or kind in ("sum", "mean") else ""
        if not init:
            raise Unsupported("integer max/min reduction")
        step = REDUCE_STEP[kind]
        finish = f"acc / (double){self.ints(n)}" if kind == "mean" else "acc"
        if (kind in ("sum", "mean") and x.dtype in FLOATS and x.literal is None
                and reduces_rows_of_channels(x.shape, x.strides, axes)):
            lines = self._reduce_rows_of_channels(x, out, keep, axes, kind == "mean")
            self._step(_describe(op), lines, [x], [out])
            return out
        # Each output element walks its reduced axes as a nest of loops.
        kept_view = View(x.buf, x.offset, kept_shape, tuple(x.strides[i] for i in keep), x.dtype, x.literal)
        simd = kind in ("sum", "mean") and x.dtype in FLOATS

        def body(refs):
            lines = [f"const {ctype} *base = &{refs[0]};", f"{acc_type} acc = {init};"]
            idx = []
            for i, (d, st) in enumerate(zip(red.shape, red.strides)):
                lines.append("    " * i + f"for (int64_t k{i} = 0; k{i} < {self.ints(d)}; k{i}++)")
                idx.append(f"k{i} * {self.ints(st)}")
            depth = "    " * len(red.shape)
            if simd and lines[-1].lstrip().startswith("for"):  # the innermost reduced axis, vectorised
                lines.insert(len(lines) - 1, "    " * (len(red.shape) - 1) + "SIMD_SUM")
            lines.append(depth + "{ " + f"const {acc_type} v = base[{' + '.join(idx) or '0'}]; " + step + " }")
            lines.append(f"{refs[1]} = ({CTYPES[info.dtype]})({finish});")
            return lines

        if x.literal is not None:
            raise Unsupported("reduction of a literal")
        lines = self.loop(kept_shape, [(kept_view, False), (out_view, True)], body)
        # (a sum's innermost loop an OpenMP simd reduction: the C compiler leaves a double
        # accumulator's loop scalar otherwise; the kept loops around it stay as they are)
        lines = [line.replace("#pragma omp simd", "").replace("SIMD_SUM", "#pragma omp simd reduction(+:acc)")
                 for line in lines]
        self._step(_describe(op), lines, [x], [out])
        return out

    def _reduce_rows_of_channels(self, x: View, out: View, keep: list[int], axes: list[int], mean: bool) -> list[str]:
        """A sum or mean whose innermost kept dim is x's contiguous one (a global average
        pool over NHWC, a column sum): the reduced positions are walked once, each adding
        its row of channels into a block of accumulators in one simd loop. (Walking each
        channel's positions on its own strides through the whole tensor once per channel:
        EfficientNet's squeeze-excite pools took 0.2-0.4 ms each.)"""
        block = CHANNEL_BLOCK
        c = self.ints(x.shape[keep[-1]])
        outer = keep[:-1]
        ctype = CTYPES[x.dtype]
        n = numel(tuple(x.shape[a] for a in axes))
        lines = ["{", f"    const {ctype} *x = {self.ptr(x)};", f"    {ctype} *y = {self.ptr(out, False)};"]
        lines += ["    " + line for line in self._parallel_for(numel(x.shape), len(outer) + 1)]
        lines += [f"    for (int64_t o{i} = 0; o{i} < {self.ints(x.shape[d])}; o{i}++)" for i, d in enumerate(outer)]
        at = " + ".join([f"o{i} * {self.ints(x.strides[d])}" for i, d in enumerate(outer)] + ["c0"])
        out_at = "0"
        for i, d in enumerate(outer):
            out_at = f"({out_at}) * {self.ints(x.shape[d])} + o{i}"
        lines += [f"    for (int64_t c0 = 0; c0 < {c}; c0 += {block}) {{",
                  f"        const int64_t nc = {c} - c0 < {block} ? {c} - c0 : {block};",
                  f"        double acc[{block}];",
                  "        for (int64_t j = 0; j < nc; j++) acc[j] = 0;",
                  f"        const {ctype} *base = x + {at};"]
        idx = []
        for i, a in enumerate(axes):
            lines.append("        " + "    " * i + f"for (int64_t k{i} = 0; k{i} < {self.ints(x.shape[a])}; k{i}++)")
            idx.append(f"k{i} * {self.ints(x.strides[a])}")
        depth = "        " + "    " * len(axes)
        lines += [depth + "{", depth + f"    const {ctype} *row = base + {' + '.join(idx) or '0'};",
                  depth + "    #pragma omp simd", depth + "    for (int64_t j = 0; j < nc; j++) acc[j] += row[j];",
                  depth + "}",
                  f"        {ctype} *yr = y + ({out_at}) * {c} + c0;",
                  "        for (int64_t j = 0; j < nc; j++) yr[j] = "
                  f"({ctype})({f'acc[j] / (double){self.ints(n)}' if mean else 'acc[j]'});",
                  "    }", "}"]
        return lines

    @lowers(Op.gather, spread=True)
    def gather(self, op: TgOp, table: View, ids: View) -> View:
        """Slices of a table along an axis by index (rows: embedding lookups); an index out
        of range is an error naming the op and the range, never a read outside the table."""
        info = op.result_infos()[0]
        axis = op.attr("axis") % table.rank
        if ids.dtype not in ("i64", "i32"):
            raise Unsupported("gather by i64 or i32 indices")
        table, ids = (v if self.is_contiguous(v) else self.materialize(v) for v in (table, ids))
        out = self._temp(info)
        rows = self.ints(table.shape[axis])
        outer = self.ints(numel(table.shape[:axis]))
        width = self.ints(numel(table.shape[axis + 1:]))
        count = self.ints(numel(ids.shape))
        ctype = CTYPES[table.dtype]
        lines = [
            "{",
            f"    const {CTYPES[ids.dtype]} *ids = {self.ptr(ids)};",
            f"    const {ctype} *table = {self.ptr(table)};",
            f"    {ctype} *out = {self.ptr(out, False)};",
            f"    for (int64_t o = 0; o < {outer}; o++)",
            f"    for (int64_t i = 0; i < {count}; i++) {{",
            "        int64_t r = ids[i];",
            f"        if (r < -{rows} || r >= {rows})",
            f'            TG_FAIL("gather: index %lld is out of range [-%lld, %lld) of the table (step %d)", '
            f"(long long)r, (long long){rows}, (long long){rows}, {len(self.steps)});",
            f"        if (r < 0) r += {rows};",
            f"        memcpy(out + (o * {count} + i) * {width}, table + (o * {rows} + r) * {width}, "
            f"sizeof({ctype}) * {width});",
            "    }",
            "}",
        ]
        self._step(_describe(op), lines, [table, ids], [out])
        return out

    @lowers(Op.scatter_nd, spread=True)
    def scatter_nd(self, op: TgOp, x: View, ids: View, updates: View) -> View:
        """A copy of x with slices set to, or added to, rows of updates (an embedding's
        gradient: cotangent rows added into a zero table; MoE routing's token order), in order, so repeated indices add
        up as the host's np.add.at does; an index out of range is an error naming the op."""
        info = op.result_infos()[0]
        reduction = op.attr("reduction")
        # (a bool's + is NumPy's or, not the byte's sum; integers wrap as np.add.at's do)
        if (reduction not in ("none", "add") or info.dtype not in CTYPES or ids.dtype not in ("i64", "i32")
                or reduction == "add" and info.dtype == "i1"):
            raise Unsupported("scatter_nd setting or adding slices by i64/i32 indices")
        k = ids.shape[-1]
        if not isinstance(k, int) and not getattr(k, "is_Integer", False):
            raise Unsupported("scatter_nd by a symbolic index depth")
        k = int(k)
        ids, updates = (v if self.is_contiguous(v) else self.materialize(v) for v in (ids, updates))
        out = self._temp(info)
        if x.literal is not None:
            fill = [f"    for (int64_t e = 0; e < {self.ints(numel(info.shape))}; e++) out[e] = {x.literal};"]
        else:
            fill = self.loop(x.shape, [(x, False), (out, True)], lambda refs: [f"{refs[1]} = {refs[0]};"])
        dims = [self.ints(d) for d in info.shape[:k]]
        width = self.ints(numel(info.shape[k:]))
        count = self.ints(numel(ids.shape[:-1]))
        ctype = CTYPES[info.dtype]
        index = ["        int64_t at = 0;"]
        for j, d in enumerate(dims):
            index += [f"        int64_t r{j} = ix[i * {k} + {j}];",
                      f"        if (r{j} < -{d} || r{j} >= {d})",
                      f'            TG_FAIL("scatter_nd: index %lld is out of range [-%lld, %lld) of dim {j} (step %d)", '
                      f"(long long)r{j}, (long long){d}, (long long){d}, {len(self.steps)});",
                      f"        at = at * {d} + (r{j} < 0 ? r{j} + {d} : r{j});"]
        apply = "dst[e] += src[e]" if reduction == "add" else "dst[e] = src[e]"
        lines = ["{", f"    {ctype} *out = {self.ptr(out, False)};", *fill,
                 f"    const {CTYPES[ids.dtype]} *ix = {self.ptr(ids)};",
                 f"    const {ctype} *upd = {self.ptr(updates)};",
                 f"    for (int64_t i = 0; i < {count}; i++) {{", *index,
                 f"        {ctype} *dst = out + at * {width};",
                 f"        const {ctype} *src = upd + i * {width};",
                 f"        for (int64_t e = 0; e < {width}; e++) {apply};",
                 "    }", "}"]
        self._step(_describe(op), lines, [x, ids, updates] if x.literal is None else [ids, updates], [out])
        return out

    @lowers(Op.dropout, spread=True)
    def dropout(self, op: TgOp, x: View, seed: View) -> View:
        """tg.dropout as one loop over the elements in row-major order, each one's Philox bits
        (runtime.h `tg_philox`, the op table's counters) compared with p's threshold: the
        backward's dropout of the cotangent draws the same bits, element for element."""
        info = op.result_infos()[0]
        if info.dtype not in FLOATS or seed.dtype not in ("i64", "i32") or x.literal is not None:
            raise Unsupported("dropout of a float tensor by an i64/i32 seed")
        x = x if self.is_contiguous(x) else self.materialize(x)
        out = self._temp(info)
        ctype = CTYPES[info.dtype]
        p = float(op.attr("p"))
        threshold = math.floor(p * 2.0 ** 32)
        key = seed.literal if seed.literal is not None else f"{self.ptr(seed)}[0]"
        lines = ["{", f"    const {ctype} *x = {self.ptr(x)};", f"    {ctype} *out = {self.ptr(out, False)};",
                 f"    const uint64_t seed = (uint64_t)({key});",
                 f"    const {ctype} scale = {c_float(1.0 / (1.0 - p), info.dtype)};",
                 f"    for (int64_t i = 0; i < {self.ints(numel(info.shape))}; i++)",
                 f"        out[i] = tg_philox((uint64_t)i, {int(op.attr('site'))}u, seed) >= {threshold}u "
                 f"? x[i] * scale : ({ctype})0;",
                 "}"]
        self._step(_describe(op), lines, [x] + ([seed] if seed.literal is None else []), [out])
        return out

    @lowers(Op.tile, spread=True)
    def tile(self, op: TgOp, x: View) -> View:
        """np.tile as one copy: the output seen as (r0, d0, r1, d1, ...) reads x repeated
        (stride 0) along each r."""
        info = op.result_infos()[0]
        reps = list(op.attr("repeats"))
        if x.literal is not None or len(reps) != x.rank:
            raise Unsupported("tile of a tensor, one repeat per dim")
        out = self._temp(info)
        split = tuple(d for r, n in zip(reps, x.shape) for d in (r, n))
        dst = View(out.buf, out.offset, split, contiguous_strides(split), out.dtype)
        src = View(x.buf, x.offset, split, tuple(st for s_ in x.strides for st in (sympy.Integer(0), s_)), x.dtype)
        self._step(_describe(op), self.loop(split, [(src, False), (dst, True)], lambda refs: [f"{refs[1]} = {refs[0]};"]),
                   [x], [out])
        return out

    def _nest(self, shape, skip: int | None, inner: list[str]) -> list[str]:
        """Loops c0, c1, ... over `shape` (leaving out axis `skip`) around `inner`."""
        dims = [d for d in range(len(shape)) if d != skip]
        lines = [f"{'    ' * k}for (int64_t c{d} = 0; c{d} < {self.ints(shape[d])}; c{d}++)" for k, d in enumerate(dims)]
        return lines + ["    " * len(dims) + line for line in inner]

    def _at(self, view: View, coords: dict[int, str]) -> str:
        """The element offset of `view` at C coordinate expressions (dims of size 1: 0)."""
        terms = [f"{c} * {self.ints(view.strides[d])}" for d, c in coords.items() if not _is_one(view.shape[d])]
        return " + ".join(terms) or "0"

    @lowers(Op.gather_elements, spread=True)
    def gather_elements(self, op: TgOp, x: View, ids: View) -> View:
        """out[c] = x[c with c[axis] = ids[c]], an index out of range an error."""
        info = op.result_infos()[0]
        axis = op.attr("axis") % x.rank
        if ids.dtype not in ("i64", "i32") or ids.literal is not None or x.literal is not None or any(
                d != axis and not (_is_one(xd) or _eq(xd, od)) for d, (xd, od) in enumerate(zip(x.shape, ids.shape))):
            raise Unsupported("gather_elements: i64/i32 indices, x as large as them but along the axis")
        out = self._temp(info)
        coords = {d: f"c{d}" for d in range(x.rank)}
        rows = self.ints(x.shape[axis])
        ctype = CTYPES[x.dtype]
        lines = ["{", f"    const {CTYPES[ids.dtype]} *ids = {self.ptr(ids)};", f"    const {ctype} *x = {self.ptr(x)};",
                 f"    {ctype} *out = {self.ptr(out, False)};"]
        lines += ["    " + line for line in self._nest(info.shape, None, [
            "{",
            f"    int64_t r = ids[{self._at(ids, coords)}];",
            f"    if (r < -{rows} || r >= {rows})",
            f'        TG_FAIL("gather_elements: index %lld is out of range [-%lld, %lld) (step %d)", (long long)r, '
            f"(long long){rows}, (long long){rows}, {len(self.steps)});",
            f"    if (r < 0) r += {rows};",
            f"    out[{self._at(out, coords)}] = x[{self._at(x, {**coords, axis: 'r'})}];",
            "}"])]
        lines.append("}")
        self._step(_describe(op), lines, [x, ids], [out])
        return out

    @lowers(Op.cumsum, spread=True)
    def cumsum(self, op: TgOp, x: View) -> View:
        """Running sums along an axis, in the order of the axis (or reversed), exclusive or not."""
        info = op.result_infos()[0]
        axis = op.attr("axis") % max(x.rank, 1)
        if x.literal is not None or x.rank == 0:
            raise Unsupported("cumsum of a tensor")
        out = self._temp(info)
        n = self.ints(x.shape[axis])
        ctype = CTYPES[info.dtype]
        k = f"({n} - 1 - k)" if op.attr("reverse") else "k"
        coords = {d: f"c{d}" for d in range(x.rank) if d != axis}
        at_x = self._at(x, {**coords, axis: k})
        at_out = self._at(out, {**coords, axis: k})
        step = [f"out[{at_out}] = acc;", f"acc += x[{at_x}];"] if op.attr("exclusive") else \
            [f"acc += x[{at_x}];", f"out[{at_out}] = acc;"]
        lines = ["{", f"    const {ctype} *x = {self.ptr(x)};", f"    {ctype} *out = {self.ptr(out, False)};"]
        lines += ["    " + line for line in self._nest(info.shape, axis, [
            "{", f"    {ctype} acc = 0;", f"    for (int64_t k = 0; k < {n}; k++) {{",
            *("        " + line for line in step), "    }", "}"])]
        lines.append("}")
        self._step(_describe(op), lines, [x], [out])
        return out

    @lowers(Op.topk, spread=True)
    def topk(self, op: TgOp, x: View) -> list[View]:
        """The k largest (or smallest) of each row along the axis, by insertion into a sorted
        list of k as the row is read in order, so equal values keep their index order; a NaN
        ranks above every number, as NumPy's stable sort of the reversed row makes it (below
        every number for the smallest). MoE routing's top experts of each token."""
        values, indices = op.result_infos()
        k, axis, largest = op.attr("k"), op.attr("axis") % max(x.rank, 1), op.attr("largest")
        if x.literal is not None or x.rank == 0 or not 0 < k <= TOPK_MAX:
            raise Unsupported(f"topk of a tensor with 1 to {TOPK_MAX} values kept")
        vals, idx = self._temp(values), self._temp(indices)
        ctype, n = CTYPES[x.dtype], self.ints(x.shape[axis])
        nan_first = "|| (a != a && b == b)" if largest else "|| (b != b && a == a)"
        before = f"((a {'>' if largest else '<'} b){nan_first if x.dtype in FLOATS else ''})"
        coords = {d: f"c{d}" for d in range(x.rank) if d != axis}
        at_x, at_v, at_i = (self._at(v, {**coords, axis: j}) for v, j in ((x, "j"), (vals, "p"), (idx, "p")))
        row = ["{", f"    {ctype} top[{k}]; int64_t at[{k}]; int64_t m = 0;",
               f"    for (int64_t j = 0; j < {n}; j++) {{",
               f"        {ctype} a = x[{at_x}], b;",
               f"        if (m == {k}) {{ b = top[{k - 1}]; if (!{before}) continue; }}",
               f"        int64_t p = m < {k} ? m++ : {k - 1};",
               f"        for (; p > 0; p--) {{ b = top[p - 1]; if (!{before}) break; top[p] = b; at[p] = at[p - 1]; }}",
               "        top[p] = a; at[p] = j;", "    }",
               f"    for (int64_t p = 0; p < {k}; p++) {{ v[{at_v}] = top[p]; ix[{at_i}] = at[p]; }}", "}"]
        lines = ["{", f"    const {ctype} *x = {self.ptr(x)};", f"    {ctype} *v = {self.ptr(vals, False)};",
                 f"    int64_t *ix = {self.ptr(idx, False)};"]
        lines += ["    " + line for line in self._nest(values.shape, axis, row)] + ["}"]
        self._step(_describe(op), lines, [x], [vals, idx])
        return [vals, idx]

    @lowers(Op.argmax, Op.argmin, spread=True)
    def arg_extreme(self, op: TgOp, x: View) -> View:
        """The index of each row's largest (smallest) value along the axis: the first, or the
        last (select_last_index); a NaN wins over every number for both, as in NumPy."""
        info = op.result_infos()[0]
        axis, keep = op.attr("axis") % max(x.rank, 1), op.attr("keepdims")
        if x.literal is not None or x.rank == 0:
            raise Unsupported(f"{op.op_name} of a tensor")
        out = self._temp(info)
        ctype, n = CTYPES[x.dtype], self.ints(x.shape[axis])
        beats = f"(a {'>' if op.op_name == Op.argmax else '<'} b)"
        ties = "a == b"
        if x.dtype in FLOATS:
            beats, ties = f"({beats} || (a != a && b == b))", "(a == b || (a != a && b != b))"
        if op.attr("select_last_index"):
            beats = f"({beats} || {ties})"
        coords = {d: f"c{d}" for d in range(x.rank) if d != axis}
        out_coords = coords if keep else {d - (d > axis): c for d, c in coords.items()}
        row = ["{", f"    {ctype} b = x[{self._at(x, {**coords, axis: '0'})}]; int64_t at = 0;",
               f"    for (int64_t j = 1; j < {n}; j++) {{",
               f"        {ctype} a = x[{self._at(x, {**coords, axis: 'j'})}];",
               f"        if ({beats}) {{ b = a; at = j; }}", "    }",
               f"    out[{self._at(out, out_coords)}] = at;", "}"]
        lines = ["{", f'    if ({n} < 1) TG_FAIL("{op.op_name} of an empty axis (step %d)", {len(self.steps)});',
                 f"    const {ctype} *x = {self.ptr(x)};", f"    int64_t *out = {self.ptr(out, False)};"]
        lines += ["    " + line for line in self._nest(x.shape, axis, row)] + ["}"]
        self._step(_describe(op), lines, [x], [out])
        return out

    @lowers(Op.concat)
    def concat(self, op: TgOp, xs: list[View]) -> View:
        info = op.result_infos()[0]
        out = self._result(op, xs)
        axis = op.attr("axis") % len(info.shape)
        start = sympy.Integer(0)
        lines = []
        for x in xs:
            if x.literal is not None and x.rank:
                raise Unsupported("concat of a literal")
            part = View(out.buf, start * out.strides[axis], x.shape, out.strides, out.dtype)
            lines += self.loop(x.shape, [(x, False), (part, True)], lambda refs: [f"{refs[1]} = {refs[0]};"])
            start = start + x.shape[axis]
        self._step(_describe(op), lines, xs, [out])
        # What an elementwise loop reading the concat next may compute piece by piece instead
        # (Groups.fused_elementwise): the step, the pieces and where each starts.
        self.concats[out.buf] = (op, self.steps[-1], out, axis,
                                 [(x, sum((y.shape[axis] for y in xs[:k]), sympy.Integer(0))) for k, x in enumerate(xs)])
        return out

    @lowers(Op.max_pool, Op.avg_pool, spread=True)
    def pool(self, op: TgOp, x: View) -> View:
        """Max and average pools over 1-D or 2-D windows (a 1-D pool is a 2-D one of height 1)."""
        info = op.result_infos()[0]
        kernel = list(op.attr("kernel"))
        nd = len(kernel)
        if nd not in (1, 2) or x.dtype != "f32" or any(d != 1 for d in (op.attr("dilations") or [1] * nd)):
            raise Unsupported("pools: 1-D or 2-D, f32, no dilation")
        if op.op_name == Op.avg_pool and op.attr("ceil_mode"):
            raise Unsupported("avg_pool with ceil_mode")
        strides = list(op.attr("strides") or [1] * nd)
        pads = list(op.attr("pads") or [0] * (2 * nd))
        out = self._result(op, [x])
        channels_last = self.is_channels_last(x)
        out_view = out
        if nd == 1:  # (N, C, W) as (N, C, 1, W)
            x = View(x.buf, x.offset, x.shape[:2] + (1,) + x.shape[2:], x.strides[:2] + (0,) + x.strides[2:], x.dtype)
            out_view = View(out.buf, out.offset, out.shape[:2] + (1,) + out.shape[2:],
                            out.strides[:2] + (0,) + out.strides[2:], out.dtype)
            kernel, strides, pads = [1] + kernel, [1] + strides, [0, pads[0], 0, pads[1]]
        n, c, h, w = (self.ints(d) for d in x.shape)
        oh, ow = (self.ints(d) for d in out_view.shape[2:])
        sn, sc, sh, sw = (self.ints(st) for st in x.strides)
        yn, yc, yh, yw = (self.ints(st) for st in out_view.strides)
        # channels innermost when they are contiguous in memory
        axes = ([f"b < {n}", f"oy < {oh}", f"ox < {ow}", f"ch < {c}"] if channels_last else
                [f"b < {n}", f"ch < {c}", f"oy < {oh}", f"ox < {ow}"])
        is_max = op.op_name == Op.max_pool
        include_pad = is_max or op.attr("count_include_pad")
        kh, kw = kernel
        # The divisor: the whole window, or (count_include_pad false) the taps inside the input.
        divisor = f"{kh * kw}.f" if include_pad else "(float)count"
        if channels_last and _eq(x.strides[1], 1) and _eq(out_view.strides[1], 1):
            lines = self._pool_channels_last(x, out, out_view, kernel, strides, pads, is_max, divisor, numel(info.shape))
            self._step(_describe(op), lines, [x], [out])
            return out
        lines = [
            "{",
            f"    const float *x = {self.ptr(x)};",
            f"    float *y = {self.ptr(out, False)};",
            *("    " + line for line in self._parallel_for(numel(info.shape), 2)),
            *(f"    for (int64_t {a.split()[0]} = 0; {a}; {a.split()[0]}++)" for a in axes[:3]),
            f"    for (int64_t {axes[3].split()[0]} = 0; {axes[3]}; {axes[3].split()[0]}++) {{",
            # The window's taps inside the input, as bounds (GCC 12 at -O3 miscompiled the
            # loop that skipped the outside taps with `continue`: averages of 3 of 4 taps).
            f"        const int64_t y0 = oy * {strides[0]} - {pads[0]}, x0 = ox * {strides[1]} - {pads[1]};",
            f"        const int64_t ky0 = y0 < 0 ? -y0 : 0, ky1 = {h} - y0 < {kh} ? {h} - y0 : {kh};",
            f"        const int64_t kx0 = x0 < 0 ? -x0 : 0, kx1 = {w} - x0 < {kw} ? {w} - x0 : {kw};",
            f"        float acc = {'-INFINITY' if is_max else '0.f'};",
            "        for (int64_t ky = ky0; ky < ky1; ky++)",
            "            for (int64_t kx = kx0; kx < kx1; kx++) {",
            f"                float v = x[b * {sn} + ch * {sc} + (y0 + ky) * {sh} + (x0 + kx) * {sw}];",
            "                " + ("acc = v > acc || v != v ? v : acc;" if is_max else "acc += v;"),
            "            }",
            "        const int64_t count = (ky1 > ky0 ? ky1 - ky0 : 0) * (kx1 > kx0 ? kx1 - kx0 : 0);",
            f"        y[b * {yn} + ch * {yc} + oy * {yh} + ox * {yw}] = {'acc' if is_max else f'acc / {divisor}'};",
            "    }",
            "}",
        ]
        self._step(_describe(op), lines, [x], [out])
        return out

    def _pool_channels_last(self, x: View, out: View, out_view: View, kernel, strides, pads, is_max: bool,
                            divisor: str, total) -> list[str]:
        """A pool over NHWC: per output pixel, the window's taps each one simd pass over the
        channels, accumulating in the output row (the loop with channels outermost walks
        each tap at a stride of C floats and does not vectorise: ResNet-50's stem pool ran
        10 ms, against ~0.3 ms this way)."""
        n, c, h, w = (self.ints(d) for d in x.shape)
        oh, ow = (self.ints(d) for d in out_view.shape[2:])
        sn, _, sh, sw = (self.ints(st) for st in x.strides)
        yn, _, yh, yw = (self.ints(st) for st in out_view.strides)
        kh, kw = kernel
        step = "yr[ch] = v > yr[ch] || v != v ? v : yr[ch];" if is_max else "yr[ch] += v;"
        return [
            "{",
            f"    const float *x = {self.ptr(x)};",
            f"    float *y = {self.ptr(out, False)};",
            *("    " + line for line in self._parallel_for(total, 3)),
            f"    for (int64_t b = 0; b < {n}; b++)",
            f"    for (int64_t oy = 0; oy < {oh}; oy++)",
            f"    for (int64_t ox = 0; ox < {ow}; ox++) {{",
            f"        const int64_t y0 = oy * {strides[0]} - {pads[0]}, x0 = ox * {strides[1]} - {pads[1]};",
            f"        const int64_t ky0 = y0 < 0 ? -y0 : 0, ky1 = {h} - y0 < {kh} ? {h} - y0 : {kh};",
            f"        const int64_t kx0 = x0 < 0 ? -x0 : 0, kx1 = {w} - x0 < {kw} ? {w} - x0 : {kw};",
            "        const int64_t count = (ky1 > ky0 ? ky1 - ky0 : 0) * (kx1 > kx0 ? kx1 - kx0 : 0);",
            f"        float *restrict yr = y + b * {yn} + oy * {yh} + ox * {yw};",
            "        #pragma omp simd",
            f"        for (int64_t ch = 0; ch < {c}; ch++) yr[ch] = {'-INFINITY' if is_max else '0.f'};",
            "        for (int64_t ky = ky0; ky < ky1; ky++)",
            "            for (int64_t kx = kx0; kx < kx1; kx++) {",
            f"                const float *restrict xr = x + b * {sn} + (y0 + ky) * {sh} + (x0 + kx) * {sw};",
            "                #pragma omp simd",
            f"                for (int64_t ch = 0; ch < {c}; ch++) {{ const float v = xr[ch]; {step} }}",
            "            }",
            *([] if is_max else ["        #pragma omp simd",
                                 f"        for (int64_t ch = 0; ch < {c}; ch++) yr[ch] /= {divisor};"]),
            "        (void)count;",
            "    }",
            "}",
        ]

    @lowers(Op.pad, spread=True)
    def pad(self, op: TgOp, x: View) -> View:
        """Constant padding: the output filled with the value, then x copied into its interior."""
        pads = list(op.attr("pads"))
        if op.attr("mode") != "constant" or any(not (isinstance(p, int) and p >= 0) for p in pads):
            raise Unsupported("pad: constant mode, pads >= 0")
        info = op.result_infos()[0]
        out = self._result(op, [x])
        value = op.attr("value")
        literal = (c_float(value, info.dtype) if info.dtype in FLOATS
                   else f"(({CTYPES[info.dtype]}){int(value)})")
        fill = View(None, 0, out.shape, (sympy.Integer(0),) * out.rank, out.dtype, literal, value)
        interior = View(out.buf, out.offset + sum(p * st for p, st in zip(pads, out.strides)), x.shape, out.strides,
                        out.dtype)
        copy = lambda refs: [f"{refs[1]} = {refs[0]};"]  # noqa: E731
        lines = self.loop(out.shape, [(fill, False), (out, True)], copy) + \
            self.loop(x.shape, [(x, False), (interior, True)], copy)
        self._step(_describe(op), lines, [x], [out])
        return out
