"""Fused groups: one step per tg.fusion (elementwise loops, row ops, rows with reductions)."""

from __future__ import annotations

from typing import Any

import sympy
from xdsl.ir import SSAValue

from tilegraph.backends.c.tables import CTYPES, FLOATS, REDUCE_INIT, REDUCE_SIMD, STORAGE
from tilegraph.backends.c.views import (ConvStep, EmitterParts, Step, Unsupported, View, lowers, bf16_marker, feeds_gemm, _describe, _eq, _is_one, _only_use,
                                        _row_stride, c_float, contiguous_strides)
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.strides import strides_like
from tilegraph.ir.fusion import GroupKind, group_kind
from tilegraph.ir.shapes import info_of, numel
from tilegraph.ir.ops import OPS, Op


# The comment ending a weight-gradient GEMM's step that also sums its bias's gradient.
BIAS_GRADIENT = " + the bias gradient (column sum of the GEMM's dY)"


def _last(shape) -> Any:
    return shape[-1] if len(shape) else 1


class Groups(EmitterParts):
    """Lowers a tg.fusion as one step where it can."""

    # Whether a bias gradient's column sum runs in its weight gradient's GEMM step (False: a
    # step of its own, as before; benchmarks/train_bias_gradient.py times both).
    bias_in_gemm = True

    # --- groups -------------------------------------------------------------------------

    def group(self, group: FusionOp) -> None:
        if group in self.merged:
            return  # computed in its partner's step (a bias gradient with its weight's)
        partner = self._bias_partners().get(group)
        if partner is not None and self._step_index(partner) > self._step_index(group) and \
                all(self._ready(v) for v in partner.operands):
            first = len(self.steps)
            self._group(group)
            self._group(partner)
            if len(self.steps) - first >= 2 and all(s.lines is not None for s in self.steps[first:]):
                gemm = group if group.ops[0].op_name == Op.matmul else partner
                self._one_step(first, gemm)
                self.steps[first].comment = _describe(gemm) + BIAS_GRADIENT
            self.merged.add(partner)
            return
        self._group(group)

    def _ready(self, v: SSAValue) -> bool:
        """Whether `v` has its view now: computed, or a view (a reshape or transpose made in
        the program after this point) of a value that is, lowered here, ahead of its turn."""
        if self.prog.canon(v) in self.views:
            return True
        op = v.owner
        if not isinstance(op, TgOp) or not op.SPEC.view or self._step_index(op) == len(self.prog.steps) or \
                not all(self._ready(u) for u in op.operands):
            return False
        self.op(op)
        self.early.add(op)
        return True

    def _bias_partners(self) -> dict[FusionOp, FusionOp]:
        """A Linear layer's weight gradient X^T @ dY (or dY^T @ X) over all rows (a group of
        that one GEMM, dY read as (rows, N)) and its bias gradient, the column sum of the same
        dY (a group of that one reduce_sum over every leading axis), each the other's partner: the column
        sum runs in the GEMM's step, no step of its own. (oneDNN's post-ops take no
        reduction: the sum is a loop in the step, over dY as the GEMM reads it.)"""
        if hasattr(self, "_partners"):
            return self._partners
        self._partners: dict[FusionOp, FusionOp] = {}
        if not self.bias_in_gemm:
            return self._partners
        gemms: dict[SSAValue, FusionOp] = {}  # dY -> the one dW GEMM reading it
        sums: dict[SSAValue, FusionOp] = {}  # dY -> the one column sum of it
        for step in self.prog.steps:
            if not isinstance(step, FusionOp) or len(step.ops) != 1:
                continue
            op = step.ops[0]
            if group_kind(step) is GroupKind.MATMUL and op.op_name == Op.matmul:
                outer = [step.operands[list(step.block.args).index(v)] if v in step.block.args else None
                         for v in op.operands]
                lhs, out = info_of(op.operands[0].type), op.result_infos()[0]
                if lhs.rank != 2 or out.rank != 2 or out.dtype != "f32":
                    continue
                # X^T @ dY, or dY^T @ X (a weight kept as [out, in], ir/vjp.py): dY as (rows, N)
                # either side; the one of the two that has a column sum is dY.
                for rows in (outer[1] if _owned_by(outer[1], Op.reshape) else None, _swapped(outer[0])):
                    if rows is None:
                        continue
                    dy = self.prog.canon(rows.owner.operands[0])  # type: ignore[union-attr]
                    if info_of(dy.type).rank >= 2 and _eq(info_of(rows.type).shape[0],
                                                          numel(info_of(dy.type).shape[:-1])):
                        gemms[dy] = None if dy in gemms else step  # type: ignore[assignment]
            elif group_kind(step) is GroupKind.REDUCTION and op.op_name == Op.reduce_sum and \
                    op.operands[0] in step.block.args:
                dy = self.prog.canon(step.operands[0])
                rank = info_of(dy.type).rank
                if rank >= 2 and sorted(a % rank for a in op.attr("axes")) == list(range(rank - 1)) and \
                        info_of(dy.type).dtype == "f32":
                    sums[dy] = None if dy in sums else step  # type: ignore[assignment]
        for dy, gemm in gemms.items():
            total = sums.get(dy)
            if gemm is not None and total is not None and gemm not in self._partners and total not in self._partners:
                self._partners[gemm], self._partners[total] = total, gemm
        return self._partners

    def _group(self, group: FusionOp) -> None:
        ops = group.ops
        env: dict[SSAValue, View] = {a: self.view(v) for a, v in zip(group.block.args, group.operands)}
        yields = list(group.block.last_op.operands)
        done = False
        try:
            kind = group_kind(group)
            if kind is GroupKind.ELEMENTWISE:
                done = self.fused_elementwise(group, ops, env, yields) or self.fused_rows(group, ops, env, yields)
            elif kind in (GroupKind.MATMUL, GroupKind.MATMUL_EPILOGUE, GroupKind.CONV, GroupKind.CONV_EPILOGUE) and \
                    ops[0].op_name in (Op.matmul, Op.conv):
                done = self.fused_contraction(group, ops, env, yields)
            elif kind is GroupKind.HORIZONTAL_MATMUL:
                done = self.fused_siblings(group, ops, env, yields)
            elif kind is GroupKind.REDUCTION:
                done = self.fused_row(group, ops, env, yields) or self.fused_rows(group, ops, env, yields)
        except Unsupported:
            done = False
        if not done:
            for op in ops:
                self.op(op, env)
        for r, y in zip(group.results, yields):
            self.views[r] = env[y] if y in env else self.view(y)

    def _made_outside(self, op: TgOp, env: dict, computed) -> bool:
        """A constant, or a view of a value from outside the loop: made here, not in it."""
        if op.op_name == Op.constant:
            env[op.results[0]] = self.constant(op)
            return True
        if op.op_name in (Op.reshape, Op.transpose, Op.broadcast) and op.operands[0] not in computed:
            env[op.results[0]] = self.layout(op, [env[op.operands[0]]])[0]
            return True
        return False

    def fused_elementwise(self, group: FusionOp, ops, env, yields, into: View | None = None) -> bool:
        """A group of elementwise ops (and views of its inputs) as one loop. A reshape of a
        value computed in the loop that keeps the last dim (a linear layer's 2-D product
        back to its batch shape) is nothing in a loop over (rows, last dim)."""
        computed: dict[SSAValue, None] = {}
        inputs: dict[SSAValue, View] = {}
        consumer: dict[SSAValue, tuple] = {}  # input -> the shape of the first op reading it
        alias: dict[SSAValue, SSAValue] = {}
        body = []
        shape = info_of(yields[0].type).shape
        for op in ops:
            if op.op_name == Op.reshape and op.operands[0] in computed and shape and \
                    _eq(info_of(op.operands[0].type).shape[-1:][0] if info_of(op.operands[0].type).shape else 1,
                        op.result_infos()[0].shape[-1:][0] if op.result_infos()[0].shape else 1):
                alias[op.results[0]] = op.operands[0]
                computed[op.results[0]] = None
                continue
            if self._made_outside(op, env, computed):
                continue
            if not op.SPEC.pointwise:
                return False
            self._check_dtypes(op, [env[v] for v in op.operands if v in env])
            for v in op.operands:
                if v not in computed and v not in inputs:
                    inputs[v] = env[v]
                    consumer[v] = op.result_infos()[0].shape
            computed[op.results[0]] = None
            body.append(op)
        if not body or any(y not in computed for y in yields):
            return False
        if alias:  # one loop over (rows, last dim), every operand seen that way
            width = shape[-1]
            if any(not _eq(info_of(op.results[0].type).shape[-1:][0] if info_of(op.results[0].type).shape else 1,
                           width) or not _eq(numel(info_of(op.results[0].type).shape), numel(shape))
                   for op in body) or any(not _eq(numel(info_of(y.type).shape), numel(shape)) for y in yields):
                return False
            rows_shape = (sympy.sympify(numel(shape)) / sympy.sympify(width), width)
            outs = [(y, self._in_place(group, y, inputs, consumer) or self._temp(info_of(y.type))) for y in yields]
            inputs = {v: self._as_rows(self.broadcast(view, consumer[v]), rows_shape) for v, view in inputs.items()}
            loop_outs = [(y, View(o.buf, o.offset, rows_shape, contiguous_strides(rows_shape), o.dtype))
                         for y, o in outs]
            self.elementwise(body, computed, inputs, loop_outs, group, alias)
            env.update({y: o for y, o in outs})
            return True
        if any(len(info_of(y.type).shape) != len(shape) or
               not all(_eq(a, b) for a, b in zip(info_of(y.type).shape, shape)) for y in yields):
            return False
        laid_out = strides_like(shape, [(v.shape, None if v.literal is not None else v.strides) for v in inputs.values()])
        # `into`: a value the loop reads and nothing reads after it (a GEMM's result), of the
        # result's shape: each element is read, then written, at the same place.
        # (Not where the result is read by GEMMs: a buffer of its own, which its bf16 twin can
        # write; half-width writes over what the loop still reads would race.)
        if into is None and self._over_pieces(group, body, computed, inputs, consumer, shape, yields, env):
            return True
        if into is not None and len(yields) == 1 and into.dtype == info_of(yields[0].type).dtype and \
                into.rank == len(shape) and all(_eq(a, b) for a, b in zip(into.shape, shape)) and \
                not feeds_gemm(yields[0]):
            outs = [(yields[0], into)]
        else:
            outs = [(y, self._in_place(group, y, inputs, consumer) or self._temp(info_of(y.type), laid_out))
                    for y in yields]
        # Operands are named by the values the loop reads.
        self.elementwise(body, computed, inputs, outs, group)
        env.update({y: o for y, o in outs})
        return True

    def _over_pieces(self, group: FusionOp, body, computed, inputs: dict[SSAValue, View], consumer: dict, shape,
                     yields, env: dict) -> bool:
        """A loop whose input is a concat made by the step just before it, read by nothing else,
        at the loop's shape (DenseNet: every concat of a block's features, then its batch norm and
        relu) runs once per piece, reading the piece where it lies and writing that slice of the
        concat's own buffer: the concat's copy is gone, and the pair is one pass, not two."""
        y = info_of(yields[0].type)
        if len(yields) != 1 or self.model.aliases or feeds_gemm(yields[0]):
            return False  # (a bf16 twin writes whole buffers only)
        for v, view in inputs.items():
            op, step, out, axis, pieces = self.concats.get(view.buf, (None,) * 5)
            if op is not None and self.steps and self.steps[-1] is step and view == out and \
                    sum(1 for _ in op.results[0].uses) == 1 and out.dtype == y.dtype and \
                    all(_eq(a, b) for a, b in zip(consumer[v], shape)) and len(consumer[v]) == len(shape) and \
                    all(_eq(a, b) for a, b in zip(out.shape, shape)) and len(out.shape) == len(shape):
                break
        else:
            return False
        if len(pieces) < 2:
            return False
        self.steps.pop()
        first = len(self.steps)
        # One parallel region whose threads share each piece's loop: a piece alone may be too
        # small to split (DenseNet's 32 channels at 14x14) where the whole loop is not.
        self.workshare = True
        try:
            for x, start in pieces:
                parts = {u: x if u is v else _part(self.broadcast(w, shape), axis, start, x.shape[axis])
                         for u, w in inputs.items()}
                self.elementwise(body, computed, parts, [(yields[0], _part(out, axis, start, x.shape[axis]))], group)
        finally:
            self.workshare = False
        self._one_step(first, group)
        # (An `omp for` outside any region runs on the calling thread alone.)
        region = [pragma.replace("parallel for", "parallel", 1) for pragma in self._parallel_for(numel(shape), 1)]
        if region:
            self.steps[-1].lines = [*region, "{", *("    " + line for line in self.steps[-1].lines or []), "}"]
        env[yields[0]] = out
        return True

    def _in_place(self, group: FusionOp, y: SSAValue, inputs: dict[SSAValue, View], consumer: dict) -> View | None:
        """The buffer of the model input that group result `y` updates, where the model donates
        that input to it (Model.aliases: a training step's weights and optimizer state) and writing
        it in place is safe: every other step reading the input runs before this one, and this
        loop reads each element of it only at the element it writes (no broadcast, no other
        layout), so each element is read before it is overwritten. None otherwise."""
        if not self.model.aliases:
            return None
        result = group.results[list(group.block.last_op.operands).index(y)]
        outputs = [k for k, v in enumerate(self.prog.outputs) if self.prog.canon(v) is result]
        donors = [i for i, k in self.model.aliases.items() if k in outputs]
        if len(donors) != 1:
            return None
        arg = self.model.func.args[donors[0]]
        target = self.views[arg]
        y_shape = info_of(y.type).shape
        if not self._whole(target) or target.dtype != info_of(y.type).dtype or target.buf in self.donated or \
                not _eq(numel(target.shape), numel(y_shape)) or not _eq(_last(target.shape), _last(y_shape)):
            return None
        for v, view in inputs.items():
            if view.buf == target.buf and not (self._whole(view) and _eq(numel(view.shape), numel(consumer[v]))
                                               and _eq(numel(view.shape), numel(y_shape))
                                               and _eq(_last(view.shape), _last(y_shape))):
                return None
        here = self._step_index(group)
        if any(step > here for step in self._readers(arg)):
            return None
        self.donated.add(target.buf)
        return View(target.buf, target.offset, tuple(y_shape), contiguous_strides(y_shape), target.dtype)

    def _step_index(self, op) -> int:
        """`op`'s position among the program's steps; past the last for an op no step is."""
        if not hasattr(self, "_step_indices"):
            self._step_indices = {id(s): i for i, s in enumerate(self.prog.steps)}
        return self._step_indices.get(id(op), len(self.prog.steps))

    def _readers(self, value: SSAValue, enclosing: bool = False) -> set[int]:
        """The positions of the steps reading `value` or any view of it (views followed
        through); an op no step is (the function's return) counts as after the last, and so
        does an op inside a group unless `enclosing` (then its group's position)."""
        inner: dict[SSAValue, list[SSAValue]] = {}  # value -> the region arguments standing for it
        for a, v in self.prog.alias.items():
            inner.setdefault(v, []).append(a)
        found: set[int] = set()
        pending = [value]
        while pending:
            v = pending.pop()
            pending.extend(inner.get(v, []))
            for use in v.uses:
                op = use.operation
                step, outer = self._step_index(op), op
                while enclosing and step == len(self.prog.steps) and outer.parent_op() is not None:
                    outer = outer.parent_op()
                    step = self._step_index(outer)
                found.add(step)
                if isinstance(op, TgOp) and op.SPEC.view:
                    pending.extend(op.results)
        return found

    def _as_rows(self, view: View, rows_shape) -> View:
        """A view (broadcast to its reader's shape) as (rows, last dim): it must repeat
        along all leading dims, or walk them as one run of rows."""
        if view.literal is not None:
            return self.broadcast(view, rows_shape)
        row = _row_stride(view)
        if row is None:
            raise Unsupported("an operand whose rows do not collapse")
        return View(view.buf, view.offset, tuple(rows_shape), (row, view.strides[-1]), view.dtype)

    def fused_row(self, group: FusionOp, ops, env, yields) -> bool:
        """Elementwise ops, then softmax or layer_norm over the last axis, then elementwise ops
        (a group norm's per-channel scale and shift, an activation): the prologue as one loop
        into the result buffer, the row op in place, the epilogue as one loop in place."""
        rows = [i for i, o in enumerate(ops) if o.SPEC.row_normalizing]
        if len(rows) != 1 or len(yields) != 1:
            return False
        last, epi = ops[rows[0]], ops[rows[0] + 1:]
        if yields[0] is not (epi[-1] if epi else last).results[0] or any(not o.SPEC.pointwise for o in epi):
            return False
        # The epilogue reads the group's inputs, the row op's result and its own values (the
        # prologue's live only in its loop; the row op may have overwritten x).
        readable = {*group.block.args, last.results[0], *(o.results[0] for o in epi)}
        if any(v not in readable for o in epi for v in o.operands):
            return False
        pro = ops[:rows[0]]
        x = last.operands[0]
        first = len(self.steps)
        if pro:
            if any(not o.SPEC.pointwise for o in pro) or \
                    pro[-1].results[0] is not x:
                return False
            inner = {o.results[0] for o in pro}
            if any(v in inner for o in [last] for v in o.operands[1:]):
                return False
            for o in pro:
                self._check_dtypes(o, [env[v] for v in o.operands if v in env])
            out = self._temp(info_of(x.type))
            inputs = {}
            for o in pro:
                for v in o.operands:
                    if v not in inner and v not in inputs:
                        inputs[v] = env[v]
            self.elementwise(pro, {r: None for r in inner}, inputs, [(x, out)], group)
            env[x] = out
        result = self.row_op(last, [env[v] for v in last.operands], in_place=bool(pro) and _only_use(x, last))
        env[last.results[0]] = result
        # Each epilogue element reads the row op's result where it writes: in place.
        if epi and not self.fused_elementwise(group, epi, env, yields, into=result):
            for op in epi:
                self.op(op, env)
        self._one_step(first, group)
        return True

    def _one_step(self, first: int, group: FusionOp) -> None:
        """The native steps emitted since `first`, as one step of `group` (each body in a block
        of its own): a group is one kernel, whatever loops it takes."""
        parts = self.steps[first:]
        if len(parts) < 2 or any(p.lines is None for p in parts):
            return
        lines = [line for p in parts for line in ["{", *("    " + x for x in p.lines or []), "}"]]
        self.steps[first:] = [Step(_describe(group), lines=lines, reads=set().union(*(p.reads for p in parts)),
                                   writes=set().union(*(p.writes for p in parts)),
                                   state=[line for p in parts for line in p.state], conv=_conv_of(parts),
                                   **_bf16_parts(parts))]

    def fused_rows(self, group: FusionOp, ops, env, yields) -> bool:
        """Elementwise ops and reductions over the last axis (keepdims) that keep the rows
        (an RMS norm, a hand-written softmax, cross-entropy's backward): one pass over the rows, each reduction a loop
        over its row, every other value an expression computed where it is read (a row
        stays in cache: no intermediate goes through memory)."""
        widths: dict[SSAValue, Any] = {}  # computed value -> its last dim (the row's width, or 1)
        inputs: dict[SSAValue, View] = {}
        body: list[TgOp] = []
        shapes = [info_of(y.type).shape for y in yields]
        if not shapes or not all(shapes):
            return False
        # The row's width: a full-width result's, else a full-width value inside (a logsumexp's
        # exp, yielding only its max and sum, passes over the logits' rows); rows of width 1: all of them.
        inside = [info_of(v.type).shape for op in ops for v in (*op.operands, *op.results)
                  if info_of(v.type).rank == len(shapes[0])]
        full = next((sh for sh in shapes + inside if not _is_one(sh[-1])), shapes[0])
        lead, width = tuple(full[:-1]), full[-1]
        for op in ops:
            if self._made_outside(op, env, widths):
                continue
            shape = info_of(op.results[0].type).shape
            if len(shape) != len(full) or not all(_eq(a, b) for a, b in zip(shape[:-1], lead)) or \
                    not (_is_one(shape[-1]) or _eq(shape[-1], width)) or len(op.results) != 1:
                return False
            if op.op_name in (Op.reduce_sum, Op.reduce_mean, Op.reduce_max, Op.reduce_min):
                src = op.operands[0]
                if [a % len(full) for a in op.attr("axes")] != [len(full) - 1] or not op.attr("keepdims") or \
                        info_of(src.type).dtype not in FLOATS or not _eq(info_of(src.type).shape[-1], width):
                    return False
            elif not op.SPEC.pointwise:
                return False
            self._check_dtypes(op, [env[v] for v in op.operands if v in env])
            for v in op.operands:
                if v not in widths and v not in inputs:
                    if env[v].rank > len(full):
                        return False
                    inputs[v] = env[v]
            widths[op.results[0]] = 1 if _is_one(shape[-1]) else width
            body.append(op)
        # No reduction is fine too: elementwise ops whose results are rows of the full width and of
        # width 1 (cross-entropy's backward yields its per-row loss beside the logits' gradient)
        # are one pass over the rows as well, where fused_elementwise wants one shape for all.
        if any(y not in widths for y in yields):
            return False
        # Inputs broadcast to a row of the group: (lead..., width) or (lead..., 1).
        reads = {v: self.broadcast(view, lead + ((1,) if _is_one(view.shape[-1]) and view.rank else (width,)))
                 if view.rank else self.broadcast(view, lead + (1,)) for v, view in inputs.items()}
        outs = {y: self._temp(info_of(y.type)) for y in dict.fromkeys(yields)}
        views = list(reads.values()) + list(outs.values())
        index = {v: k for k, v in enumerate(list(reads) + list(outs))}
        n_lead = len(lead)

        def ref(v: SSAValue, view: View, at_j: bool) -> str:
            if view.literal is not None:
                return view.literal
            st = self.ints(view.strides[-1]) if at_j and not _is_one(view.shape[-1]) else "0"
            return f"r{index[v]}[{'0' if st == '0' else 'j' if st == '1' else f'j * {st}'}]"

        def row_values(targets: list[SSAValue]) -> tuple[list[str], dict]:
            """Statements computing `targets` (full-width values) at column j, and their names."""
            names: dict[SSAValue, str] = {}
            need: set[SSAValue] = set()
            stack = list(targets)
            while stack:
                v = stack.pop()
                if v in need or v not in widths or widths[v] == 1:
                    continue
                need.add(v)
                stack += list(v.owner.operands)
            lines = []
            for k, o in enumerate(body):
                if o.results[0] in need:
                    args = [arg(v, names) for v in o.operands]
                    dts = [info_of(v.type).dtype for v in o.operands]
                    lines.append(f"const {CTYPES[o.result_infos()[0].dtype]} e{k} = {self.expr(o, args, dts)};")
                    names[o.results[0]] = f"e{k}"
            return lines, names

        scalars: dict[SSAValue, str] = {}

        def arg(v: SSAValue, names: dict) -> str:
            if v in names:
                return names[v]
            if v in scalars:
                return scalars[v]
            return ref(v, reads[v], True)

        inner = []
        for k, o in enumerate(body):
            if widths[o.results[0]] != 1:
                continue
            out_t = CTYPES[o.result_infos()[0].dtype]
            if o.op_name.startswith("reduce_"):
                kind = o.op_name[len("reduce_"):]
                lines, names = row_values([o.operands[0]])
                init, (clause, step) = REDUCE_INIT[kind], REDUCE_SIMD[kind]
                nan = "nan" in clause
                total = f"acc / (double){self.ints(width)}" if kind == "mean" else "acc"
                inner += [f"{out_t} s{k};", "{", f"    double acc = {init};", *(["    int nan = 0;"] if nan else []),
                          f"    #pragma omp simd {clause}",
                          f"    for (int64_t j = 0; j < {self.ints(width)}; j++) {{",
                          *("        " + line for line in lines),
                          f"        const double v = {arg(o.operands[0], names)};", "        " + step, "    }",
                          f"    s{k} = ({out_t})(" + (f"nan ? NAN : {total}" if nan else total) + ");", "}"]
            else:
                dts = [info_of(v.type).dtype for v in o.operands]
                inner.append(f"const {out_t} s{k} = {self.expr(o, [arg(v, {}) for v in o.operands], dts)};")
            scalars[o.results[0]] = f"s{k}"
        full_yields = [y for y in outs if widths[y] != 1]
        for y in outs:
            if widths[y] == 1:
                inner.append(f"r{index[y]}[0] = {scalars[y]};")
        row_lines, names = row_values(full_yields) if full_yields else ([], {})

        def nest(views: list[View], store: str) -> list[str]:
            body = inner
            if full_yields:
                body = inner + ["#pragma omp simd", f"for (int64_t j = 0; j < {self.ints(width)}; j++) {{",
                                *("    " + line for line in row_lines)]
                body += [f"    r{index[y]}[j] = {store.format(names[y])};" for y in full_yields] + ["}"]
            lines = ["{"]
            for k, view in enumerate(views):
                written = k >= len(reads)
                if view.literal is None:
                    lines.append(f"    {'' if written else 'const '}{STORAGE[view.dtype]} *b{k} = "
                                 f"{self.ptr(view, not written)};")
            if n_lead:
                lines += ["    " + line for line in self._parallel_for(numel(lead) * sympy.sympify(width), n_lead)]
                lines += [f"    for (int64_t i{d} = 0; i{d} < {self.ints(n)}; i{d}++)" for d, n in enumerate(lead)]
            lines.append("    {")
            for k, view in enumerate(views):
                if view.literal is None:
                    written = k >= len(reads)
                    terms = "".join(f" + i{d} * {self.ints(view.strides[d])}" for d in range(n_lead)
                                    if self.ints(view.strides[d]) != "0")
                    lines.append(f"        {'' if written else 'const '}{STORAGE[view.dtype]} *r{k} = b{k}{terms};")
            return lines + ["        " + line for line in body] + ["    }", "}"]

        lines = nest(views, "{}")
        out = views[-1]
        # An RMS norm read only by GEMMs: a twin writing it in bf16 (onednn.bf16_sources).
        bf16 = len(outs) == 1 and full_yields and self._whole_temp(out) and feeds_gemm(full_yields[0])
        if bf16:
            half = views[:-1] + [View(out.buf, out.offset, out.shape, out.strides, "bf16")]
            lines = [f"if ({bf16_marker(out.buf)}) {{", *("    " + x for x in nest(half, "tg_f2bf({})")), "} else {",
                     *("    " + x for x in lines), "}"]
        self._step(_describe(group), lines, list(reads.values()), list(outs.values()))
        if bf16:
            self.steps[-1].bf16_writes.add(out.buf)
        env.update(outs)
        return True

    @lowers(*(name for name, spec in OPS.items() if spec.row_normalizing))
    def row_op(self, op: TgOp, xs: list[View], in_place: bool = False) -> View:
        info = op.result_infos()[0]
        if info.dtype != "f32" or any(x.dtype != "f32" for x in xs):
            raise Unsupported("row ops in f32 only")
        x = xs[0]
        rank = x.rank
        axis = op.attr("axis") % rank
        if op.op_name == Op.softmax and not all(_is_one(d) for d in x.shape[axis + 1:]):
            raise Unsupported("softmax over a leading axis")  # (trailing ones: its rows, ConvBERT's kernels)
        # A channels-last (N, C, ..., T) normalized along T (a group norm of one channel a group
        # after a convolution): its columns of channels, in place (tg_layer_norm_cols).
        columns = op.op_name == Op.layer_norm and axis == rank - 1 and self.is_channels_last(x)
        if not self.is_contiguous(x) and not columns:  # a transposed view (MobileViT's patches): its rows copied out
            x = self.materialize(x)
        # In place only on a temporary: an input, weight or constant is not the module's to write.
        out = x if in_place and self.buffers[x.buf].storage == "temp" else \
            self._result(op, [v for v in (x, *xs[1:]) if v is not None])  # laid out as the rows it reads
        n = numel(x.shape[axis:])
        rows = numel(x.shape[:axis])
        if op.op_name == Op.softmax:
            call = f"tg_softmax_rows({self.ptr(x)}, {self.ptr(out, False)}, {self.ints(rows)}, {self.ints(n)});"
            reads = [x]
        else:
            params = []
            reads = [x]
            for p in xs[1:3]:
                if p is None:
                    params.append("NULL")
                    continue
                full = self.broadcast(p, x.shape[axis:])
                if p.literal is not None or not self.is_contiguous(full):
                    raise Unsupported("layer_norm scale or bias not one value per element of a row")
                params.append(self.ptr(full))
                reads.append(p)
            while len(params) < 2:
                params.append("NULL")
            eps = c_float(op.attr('epsilon'), 'f32')
            if columns:
                outer = numel((x.shape[0], *x.shape[2:-1]))
                call = (f"tg_layer_norm_cols({self.ptr(x)}, {self.ptr(out, False)}, {params[0]}, {params[1]}, "
                        f"{self.ints(outer)}, {self.ints(n)}, {self.ints(x.shape[1])}, {eps});")
            else:
                call = (f"tg_layer_norm_rows({self.ptr(x)}, {self.ptr(out, False)}, {params[0]}, {params[1]}, "
                        f"{self.ints(rows)}, {self.ints(n)}, {eps});")
            if not columns and out.buf != x.buf and feeds_gemm(op.results[0]):  # a twin writing bf16 (onednn.bf16_sources)
                half = View(out.buf, out.offset, out.shape, out.strides, "bf16")
                twin = call.replace("tg_layer_norm_rows(", "tg_layer_norm_rows_bf16(").replace(
                    self.ptr(out, False), self.ptr(half, False))
                self._step(_describe(op), [f"if ({bf16_marker(out.buf)}) {twin}", f"else {call}"], reads, [out])
                self.steps[-1].bf16_writes.add(out.buf)
                return out
        self._step(_describe(op), [call], reads, [out])
        return out


def _part(view: View, axis: int, start, length) -> View:
    """`length` elements of `view` along `axis` from `start`."""
    shape = view.shape[:axis] + (length,) + view.shape[axis + 1:]
    return View(view.buf, view.offset + start * view.strides[axis], shape, view.strides, view.dtype, view.literal,
                view.value)


def _conv_of(parts: list[Step]) -> ConvStep | None:
    """A merged step's convolution, for chaining (onednn.chain_convolutions): where one part
    is a convolution and no other part touches its result (the source then counts as read
    by nothing else only where no other part touches it either)."""
    convs = [p for p in parts if p.conv is not None]
    if len(convs) != 1:
        return None
    conv = convs[0].conv
    assert conv is not None
    touched: set[int | None] = set().union(*(p.reads | p.writes for p in parts if p is not convs[0]))
    if conv.out.buf in touched:
        return None
    return conv._replace(alone=conv.alone and conv.src.buf not in touched)


def _bf16_parts(parts: list[Step]) -> dict:
    """A merged step's GEMM sources and bf16 writes (onednn.bf16_sources): each only where no
    part but those it comes from touches its buffer (a GEMM source may be read by several
    GEMMs of the step, a gated MLP's two)."""
    def touched(others: list[Step]) -> set:
        return set().union(*(p.reads | p.writes for p in others))
    gemms = touched([p for p in parts if not p.gemm_sources])
    sources = [(k, v) for p in parts for k, v in p.gemm_sources
               if v.buf not in gemms and all(v.buf not in q.writes for q in parts if q.gemm_sources)]
    writes = {b for i, p in enumerate(parts) for b in p.bf16_writes if b not in touched(parts[:i] + parts[i + 1:])}
    return dict(gemm_sources=sources, bf16_writes=writes)


def _owned_by(v: SSAValue | None, name: str) -> bool:
    return v is not None and isinstance(v.owner, TgOp) and v.owner.op_name == name


def _swapped(v: SSAValue | None) -> SSAValue | None:
    """The reshape that `v`, a transpose, swaps the axes of (dY^T's dY as rows), or None."""
    if v is None or not isinstance(v.owner, TgOp) or v.owner.op_name != Op.transpose:
        return None
    inner = v.owner.operands[0]
    return inner if _owned_by(inner, Op.reshape) else None
