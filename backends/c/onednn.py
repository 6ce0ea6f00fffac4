"""GEMMs and convolutions on oneDNN, with the epilogues oneDNN fuses; tiny GEMMs as loops."""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import sympy
from xdsl.ir import SSAValue

from tilegraph.backends.c.tables import (DNNL_BINARY, DNNL_ELTWISE, DNNL_TYPES, KNOWN, REPACK_ROW_BYTES, SMALL_GEMM,
                                         WINOGRAD_CHUNK_BYTES)
from tilegraph.backends.c.views import (ConvStep, EmitterParts, Unsupported, View, lowers, _describe, _eq, _is_one, _only_use,
                                        bf16_marker, bf16_read_marker, feeds_gemm,
                                        _plain_strides, _row_stride, channels_last_strides)
from tilegraph.ir import dtypes
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.fusion import ELTWISE_POSTS
from tilegraph.ir.hardware import (blocked_conv, chain_block, gemv_wins, strided_conv_shape, strided_conv_wins,
                                   winograd_shape, winograd_wins)
from tilegraph.ir.shapes import TensorInfo, info_of, numel
from tilegraph.ir.ops import Op
from tilegraph.ir.strides import rows_collapse, unit_dims_strided


class OneDNN(EmitterParts):
    """Contractions on oneDNN primitives."""

    # --- GEMMs and convolutions on oneDNN ------------------------------------------------

    def _posts(self, chain: list[TgOp], acc: SSAValue, env: dict, out_shape, geometry,
               accumulate=None, swish: bool = True) -> tuple[list[str], list[View], int, View | None]:
        """oneDNN post-ops for the leading ops of `chain` that it can fuse: returns the C
        initialiser lines of a tg_post array, the views their binary operands read, how
        many ops of the chain they cover, and the view the primitive accumulates into (its
        destination then; None if none). `geometry(view)` gives an operand, broadcast to the
        result's shape, as the primitive's destination sees it (dims, strides).
        `accumulate(add, operand, view)`: whether an add first in the chain may be a sum
        post-op into its other operand's buffer (_accumulates_into). `swish`: whether
        x * sigmoid(x) may be oneDNN's swish post-op (else it ends the posts)."""
        posts, operands = [], []
        into = None
        current = acc
        computed = {acc}  # values the primitive makes: no binary operand may be one
        covered = 0  # ops of the chain the posts cover (a swish covers two)
        skip: list[TgOp] = []  # ops of the chain one post-op already covers
        for i, op in enumerate(chain):
            if op in skip:
                continue
            name = op.op_name
            swish_mul = _swish_mul(chain[i:], current) if swish and len(posts) < 8 else None
            if swish_mul is not None:  # x * sigmoid(x) (SiLU): oneDNN's swish, one post-op
                posts.append(f"{{0, {DNNL_ELTWISE['swish']}, 1.f, 0.f, 0, {{0}}, {{0}}}}")
                current, skip = swish_mul.results[0], [swish_mul]
                computed.add(current)
                covered += 2
                continue
            hard = _hard_swish(chain[i:], current, self._scalar_value(env)) if len(posts) < 8 else None
            if hard is not None:  # x * hardsigmoid(x): oneDNN's hardswish, one post-op
                alpha, beta, ops = hard
                posts.append(f"{{0, {DNNL_ELTWISE['hardswish']}, {alpha!r}f, {beta!r}f, 0, {{0}}, {{0}}}}")
                current, skip = ops[-1].results[0], ops
                computed.add(current)
                covered += len(ops)
                continue
            if op.operands[0] is not current and not (name in (Op.add, Op.mul) and op.operands[1] is current):
                break
            if info_of(op.results[0].type).dtype != "f32" or len(posts) == 8:
                break
            other = [v for v in op.operands if v is not current]
            if any(v in computed for v in other) or not _only_use(current, op):
                break  # the epilogue overwrites `current`: nothing else may read it
            if name in ELTWISE_POSTS and name != Op.gelu and not other:
                posts.append(f"{{0, {DNNL_ELTWISE[name]}, 0.f, 0.f, 0, {{0}}, {{0}}}}")
            elif name == Op.gelu:
                alg = DNNL_ELTWISE["gelu_tanh" if op.attr("approximate") == "tanh" else "gelu_erf"]
                posts.append(f"{{0, {alg}, 0.f, 0.f, 0, {{0}}, {{0}}}}")
            elif name in (Op.max, Op.min) and len(other) == 1 and \
                    (env.get(other[0]) or self.view(other[0])).literal is not None:
                bound = (env.get(other[0]) or self.view(other[0])).literal  # relu6 is max then min: a clip each
                lo, hi = (bound, "INFINITY") if name == Op.max else ("-INFINITY", bound)
                posts.append(f"{{0, {DNNL_ELTWISE['clip']}, {lo}, {hi}, 0, {{0}}, {{0}}}}")
            elif name in (Op.add, Op.mul, Op.sub) and len(other) == 1:
                o = env.get(other[0]) or self.view(other[0])
                if name == Op.sub and op.operands[0] is not current:
                    break
                if o.dtype != "f32":
                    break
                if name == Op.add and not posts and accumulate is not None and o.literal is None and \
                        accumulate(op, other[0], o):
                    posts.append("{TG_POST_SUM, 0, 1.f, 0.f, 0, {0}, {0}}")
                    into = o
                elif o.literal is not None:
                    alpha, beta = ("1.f", o.literal) if name == Op.add else (o.literal, "0.f") if name == Op.mul \
                        else ("1.f", f"-({o.literal})")
                    posts.append(f"{{0, {DNNL_ELTWISE['linear']}, {alpha}, {beta}, 0, {{0}}, {{0}}}}")
                else:
                    if o.rank > len(out_shape):
                        break
                    try:
                        dims, strides = geometry(self.broadcast(o, out_shape))
                    except Unsupported:
                        break
                    # Only a whole tensor or one value per column (a bias): oneDNN 3.2's
                    # GEMM kernels, cached by a key that omits the broadcast, gave wrong
                    # results for a per-row-vector operand (MiniLM's attention mask) once
                    # a kernel with a whole-tensor operand had been made. (A convolution's
                    # per-channel operand, a folded batch norm, sent the small CNN's first
                    # convolution to a kernel 20x slower: it runs as a loop after it.)
                    if not (all(_is_one(d) for d in dims[:-1]) or all(not _is_one(d) or _is_one(o_d)
                                                                      for d, o_d in zip(dims, out_shape))):
                        break
                    posts.append(f"{{1, {DNNL_BINARY[name]}, 0.f, 0.f, {len(dims)}, "
                                 f"{{{', '.join(self.ints(d) for d in dims)}}}, "
                                 f"{{{', '.join(self.ints(s) for s in strides)}}}}}")
                    operands.append(o)
            else:
                break
            current = op.results[0]
            computed.add(current)
            if not info_of(current.type).shape == tuple(out_shape) and \
                    not all(_eq(a, b) for a, b in zip(info_of(current.type).shape, out_shape)):
                posts.pop()
                break
            covered += 1
        if into is not None and not any(p.startswith("{TG_POST_SUM") for p in posts):
            into = None  # (the add's post-op was taken back)
        return posts, operands, covered, into

    def _scalar_value(self, env: dict):
        """A function of a value: its number if it is a scalar literal, else None (a value the
        group computes has no view yet)."""
        def value(v: SSAValue):
            view = env.get(v) or self.views.get(self.prog.canon(v))
            return None if view is None or view.literal is None else view.value
        return value

    def _accumulates_into(self, group: FusionOp, add: TgOp, operand: SSAValue, o: View, shape, sources) -> bool:
        """Whether the residual add `add` after a convolution may run as oneDNN's sum post-op:
        the convolution writes into its operand `o`'s buffer, adding what it held (ResNet's
        and RegNet's blocks; onnxruntime's NCHWc convolution accumulates its Sum input in
        place too). A binary post-op reads the residual from one buffer and writes the
        result to another: one more pass over a block's output, mostly beyond the cores' L2.
        Only where that buffer holds nothing anyone reads later: `o` is a whole temporary of
        the result's shape, channels-last as the convolution writes, no other op of the
        group reads the operand, the convolution's own operands are elsewhere, and no value
        in that buffer is read by a step after this group."""
        if o.literal is not None or o.dtype != "f32" or self.buffers[o.buf].storage != "temp":
            return False
        if not (_eq(o.offset, 0) and len(o.shape) == len(shape) and all(_eq(a, b) for a, b in zip(o.shape, shape))
                and all(_is_one(d) or _eq(a, b) for d, a, b in zip(shape, o.strides, channels_last_strides(shape)))
                and sympy.expand(sympy.sympify(numel(shape)) - self.buffers[o.buf].elements) == 0):
            return False
        if not _only_use(operand, add) or any(v is not None and v.buf == o.buf for v in sources):
            return False
        here = self._step_index(group)
        return all(step <= here for u, view in list(self.views.items())
                   if view.literal is None and view.buf == o.buf for step in self._readers(u, enclosing=True))

    def fused_contraction(self, group: FusionOp, ops, env, yields) -> bool:
        """A GEMM or convolution, its epilogue on oneDNN where it fuses, the rest of the
        group op by op on the result (in place where elementwise)."""
        head, chain = ops[0], ops[1:]
        xs = [env.get(v) or self.view(v) for v in head.operands]
        self._check_dtypes(head, xs)
        first = len(self.steps)
        if head.op_name == Op.matmul:
            result, covered = self.matmul(head, xs[0], xs[1], chain, env)
        else:
            result, covered = self.conv(head, xs, chain, env, group)
        acc = chain[covered - 1].results[0] if covered else head.results[0]
        env[acc] = result
        rest = chain[covered:]
        if rest:
            last = rest[-1]
            if last.SPEC.row_normalizing and all(o.SPEC.pointwise for o in rest[:-1]) \
                    and self._row_prologue(rest, env, group, yields):
                pass
            elif not self._elementwise_rest(group, rest, env, yields, into=None if acc in yields else result) and \
                    not self._rows_rest(group, rest, env, yields) and not self._rows_beside_row_ops(group, rest, env, yields):
                for op in rest:
                    self.op(op, env)
        self._one_step(first, group)
        return True

    def fused_siblings(self, group: FusionOp, ops, env, yields) -> bool:
        """Sibling GEMMs of one input (a gated MLP's gate and up projections), each on
        oneDNN, then the ops that combine them as one loop."""
        heads = [op for op in ops if op.op_name == Op.matmul]
        rest = [op for op in ops if op.op_name != Op.matmul]
        if any(v in {r for h in heads for r in h.results} for h in heads for v in h.operands):
            return False
        first = len(self.steps)
        for head in heads:
            env[head.results[0]] = self.matmul(head, *(env.get(v) or self.view(v) for v in head.operands), [], env)[0]  # type: ignore[call-arg]
        gate = heads[0].results[0]
        if rest and not self._elementwise_rest(group, rest, env, yields, into=None if gate in yields else env[gate]):
            for op in rest:
                self.op(op, env)
        self._one_step(first, group)
        return True

    def _elementwise_rest(self, group, rest, env, yields, into: View | None = None) -> bool:
        """The ops oneDNN's post-ops did not take, as one loop over the result (not a
        pass over memory per op) where they are all elementwise; written `into` the GEMM's
        result where nothing else reads that. Of the group's results, the loop makes those the
        ops make: the GEMM's own result may be one too (a training step's pre-activation, which
        the backward reads beside the gelu the loop makes from it), already in its buffer."""
        made = {r for op in rest for r in op.results}
        try:
            return self.fused_elementwise(group, rest, env, [y for y in yields if y in made], into)
        except Unsupported:
            return False

    def _rows_rest(self, group, rest, env, yields) -> bool:
        """The ops after a GEMM as one pass over its rows where they are elementwise ops and
        reductions along the rows (an RMS norm after a decoder's residual add): not a pass
        over memory per op (groups.fused_rows)."""
        made = {r for op in rest for r in op.results}
        if not any(op.SPEC.reduction for op in rest):
            return False
        try:
            return self.fused_rows(group, rest, env, [y for y in yields if y in made])
        except Unsupported:
            return False

    def _rows_beside_row_ops(self, group, rest, env, yields) -> bool:
        """Row ops (layer_norm) that read none of the other ops, then the others as one pass over
        the rows (groups.fused_rows): a training step's layer norm after its residual add, beside
        the mean, centred input and variance it saves for its backward, not a pass over memory
        per op."""
        row_ops = [op for op in rest if op.SPEC.row_normalizing]
        others = [op for op in rest if not op.SPEC.row_normalizing]
        made = {r for op in others for r in op.results}
        if not row_ops or not others or any(v in made for op in row_ops for v in op.operands) or \
                not any(op.SPEC.reduction for op in others):
            return False
        for op in row_ops:
            self.op(op, env)
        if not self._rows_rest(group, others, env, yields):
            for op in others:
                self.op(op, env)
        return True

    def _row_prologue(self, rest, env, group, yields) -> bool:
        """Elementwise ops then softmax or layer_norm after a GEMM: the ops as one loop into
        the row op's input (and into every value of theirs the group also yields), then the
        row op, in place where it is its input's one reader."""
        try:
            pro, last = rest[:-1], rest[-1]
            x = last.operands[0]
            if pro:
                inner = {o.results[0] for o in pro}
                shape = info_of(x.type).shape
                kept = [y for y in dict.fromkeys(yields) if y in inner and y is not x]
                if x not in inner or any(v in inner for v in last.operands[1:]) or any(
                        info_of(y.type).shape != shape for y in kept):
                    return False  # (checked before anything is emitted)
                inputs = {}
                for o in pro:
                    for v in o.operands:
                        if v not in inner and v not in inputs:
                            inputs[v] = env.get(v) or self.view(v)
                outs = [(v, self._temp(info_of(v.type))) for v in [x, *kept]]
                self.elementwise(pro, {r: None for r in inner}, inputs, outs, group)
                env.update(outs)
            env[last.results[0]] = self.row_op(last, [env.get(v) or self.view(v) for v in last.operands],
                                               in_place=_only_use(x, last))
            return True
        except Unsupported:
            return False

    def _run_primitive(self, op: TgOp, k: int, state: list[str], src: View, weights: View, third: View | None,
                       dst: View, post_views: list[View], out: View, accumulated: Sequence[View] = (),
                       scratch: View | None = None) -> None:
        """The step running oneDNN primitive `k` (set up by `state`): src and weights in, the
        third operand (a GEMM's column scales, a convolution's bias) if any, the epilogue's
        operands, written to dst (`out`'s view as the primitive sees it); `accumulated`: the
        destination's earlier contents, read by a sum post-op; `scratch`: the arena bytes a B
        reordered each run is reordered into (`_repack_scratch`)."""
        extra = [third] if third is not None else []
        post_ptrs = ", ".join(self.ptr(v) for v in post_views) or "NULL"
        lines = ["{", f"    void *const post[] = {{{post_ptrs}}};"]
        if scratch is not None:
            lines.append(f"    tg_prim_scratch(&st->prim[{k}], {self.ptr(scratch, False)});")
        lines += [f"    if (tg_prim_run(&st->prim[{k}], {self.ptr(src)}, {self.ptr(weights)}, "
                 f"{self.ptr(third) if third is not None else 'NULL'}, {self.ptr(dst, False)}, post)) return 1;", "}"]
        self._step(_describe(op), lines, [src, weights, *extra, *post_views, *accumulated],
                   [out] + ([scratch] if scratch is not None else []), state)

    def _repack_scratch(self, b: View) -> View | None:
        """Arena bytes for a GEMM's B that the runtime reorders each run (runtime.c,
        tg_aliased_rows: a B not packed once as a weight, row-major, its rows a multiple of 4 KiB apart),
        so the binding's arena holds that copy only while its step runs and the memory plan
        counts it (call_bytes): oneDNN's blocked layouts pad K and N to at most 64 each. None
        where the runtime will not reorder it or a dim is symbolic (then the primitive
        allocates its own, reported by `CompiledModel.scratch_bytes`)."""
        dims = [sympy.sympify(d) for d in (*b.shape, b.strides[-2], b.strides[-1])]
        if b.rank < 2 or not all(d.is_number for d in dims):
            return None
        size = dtypes.numpy_dtype(b.dtype).itemsize
        k, n, row, col = (int(d) for d in dims[-4:])
        if k <= 1 or n <= 1 or col != 1 or (row * size) % REPACK_ROW_BYTES:
            return None
        padded = int(numel(b.shape[:-2])) * -(-k // 64) * 64 * -(-n // 64) * 64 * size
        return self._temp(TensorInfo((-(-padded // 4),), "f32"))

    @lowers(Op.matmul, Op.conv)
    def gemm_alone(self, op: TgOp, xs: list[View]) -> View:
        """A GEMM or convolution outside a group: no epilogue to fuse."""
        return (self.matmul(op, xs[0], xs[1], [], {}) if op.op_name == Op.matmul else self.conv(op, xs, [], {}))[0]

    def matmul(self, op: TgOp, a: View, b: View, chain: list[TgOp], env: dict,
               scales: View | None = None) -> tuple[View, int]:
        """A GEMM on oneDNN: f32, or integer (a i8/ui8, b i8) into i32, or into f32 times
        `scales` (one per column)."""
        info = op.result_infos()[0]
        if scales is not None:
            info = TensorInfo(info.shape, "f32")
        types = (a.dtype, b.dtype, info.dtype)
        if types not in (("f32", "f32", "f32"), ("i8", "i8", "i32"), ("ui8", "i8", "i32"), ("i8", "i8", "f32"),
                         ("ui8", "i8", "f32")):
            raise Unsupported(f"matmul of {a.dtype} x {b.dtype} -> {info.dtype}")
        # A broadcast scalar (an RNN's zero first state) becomes an array: GEMMs read memory.
        a, b = (self.materialize(v) if v.literal is not None else v for v in (a, b))
        a, b = self.for_onednn(a), self.for_onednn(b)
        if a.rank < 2 or b.rank < 2:
            raise Unsupported("matmul of a vector")
        if types == ("f32", "f32", "f32") and scales is None and all(
                sympy.sympify(d).is_number for d in info.shape + a.shape[-1:]) and \
                int(numel(info.shape)) * int(a.shape[-1]) <= SMALL_GEMM:
            return self._small_matmul(op, a, b, info), 0
        out = self._result(op, [a, b], info)
        weight = self.buffers[b.buf].storage in KNOWN and b.rank == 2
        rank = max(a.rank, b.rank)
        if b.rank == 2 and rows_collapse(a.shape, a.strides):
            # x[..., M, K] @ W[K, N] is one 2-D GEMM over all rows, which takes post-ops; so
            # where W is an input (a training step's weights), packed per call then.
            rows = numel(a.shape[:-1])
            a = View(a.buf, a.offset, (rows, a.shape[-1]), (a.strides[-2], a.strides[-1]), a.dtype)
            c = View(out.buf, 0, (rows, info.shape[-1]), (info.shape[-1], 1), out.dtype)
            rank = 2

            def geometry(full: View):  # the operand over all rows, as (rows, N)
                row = _row_stride(full)
                if row is None:
                    raise Unsupported("an epilogue operand whose rows do not collapse")
                rows_bc = _eq(row, 0)
                dims = [1 if rows_bc else rows, 1 if _eq(full.strides[-1], 0) else info.shape[-1]]
                return dims, [row if not rows_bc else dims[1], full.strides[-1] if dims[1] != 1 else 1]
        else:
            c = out

            def geometry(full: View):
                # Batched GEMMs take no binary post-ops: oneDNN 3.2 gave MiniLM's attention
                # scores plus a broadcast mask wrong results in some processes, not others.
                raise Unsupported("a binary post-op on a batched GEMM")
        posts, post_views, covered, _ = self._posts(chain, op.results[0], env, info.shape, geometry)
        # A source the GEMM may read as its producer writes it in bf16 (bf16_sources): a whole
        # temporary, rows contiguous, that no other operand of it lies in.
        bf16_gemm = weight and rank == 2 and types == ("f32", "f32", "f32") and scales is None
        bf16_source = bf16_gemm and self._whole_temp(a) and all(v.buf != a.buf for v in post_views)
        a = self._lead(a, rank)
        b = self._lead(b, rank)
        c = self._lead(c, rank)
        k = self._new_prim()
        arr = self._c_array
        type_names = [DNNL_TYPES[t] for t in types]
        if bf16_source:
            type_names[0] = _SOURCE.format(k)
        # A result that only bf16 GEMMs may read (an MLP's first projection, its activation a
        # post-op): written by oneDNN in bf16 where bf16_sources finds that they do.
        bf16_result = bf16_gemm and self._whole_temp(c) and feeds_gemm(op.results[0] if not covered else
                                                                         chain[covered - 1].results[0])
        if bf16_result:
            type_names[2] = f"({bf16_marker(c.buf)} ? dnnl_bf16 : dnnl_f32)"
        scratch = None if weight else self._repack_scratch(b)
        # A constant weight's 2-D GEMM goes to gemv.c where the rule finds it faster (one row:
        # tg_gemv_create leaves to oneDNN what it does not take; tg_set_gemv overrules the rule).
        gemv = weight and rank == 2 and types == ("f32", "f32", "f32") and scales is None
        create, last = ("tg_gemv_create", f", {int(gemv_wins(a.shape[-2]))}") if gemv \
            else ("tg_matmul_create", "")
        state = [
            "{",
            f"    const int64_t ad[] = {arr(a.shape)}, as[] = {arr(a.strides)};",
            f"    const int64_t bd[] = {arr(b.shape)}, bs[] = {arr(b.strides)};",
            f"    const int64_t cd[] = {arr(c.shape)}, cs[] = {arr(c.strides)};",
            f"    const tg_post posts[] = {{{', '.join(posts) or '{0}'}}};",
            f"    const int types[] = {{{', '.join(type_names)}}};",
            f"    if ({create}(&st->prim[{k}], {rank}, ad, as, bd, bs, cd, cs, types, {int(scales is not None)}, "
            f"{self.ptr(b) if weight else 'NULL'}, &tg_packs[{k}], {len(posts)}, posts, "
            f"{4 * int(numel(scratch.shape)) if scratch is not None else 0}{last})) return 1;",
            "}",
        ]
        self._run_primitive(op, k, state, a, b, scales, c, post_views, out, scratch=scratch)
        if bf16_source:
            self.steps[-1].gemm_sources.append((k, a))
        if bf16_result:
            self.steps[-1].bf16_writes.add(c.buf)
        return out, covered

    def _small_matmul(self, op: TgOp, a: View, b: View, info) -> View:
        """A GEMM too small for a library call to pay (an RNN step, a tiny model's heads) as
        loops: each row of the result accumulates rows of b, one simd loop over the columns."""
        out = self._result(op, [a, b], info)
        batch = tuple(info.shape[:-2])
        m, n, k = info.shape[-2], info.shape[-1], a.shape[-1]
        a_b, b_b = (self.broadcast(View(v.buf, v.offset, v.shape[:-2], v.strides[:-2], v.dtype), batch)
                    for v in (a, b))
        at = lambda view, batched: " + ".join([f"t{d} * {self.ints(st)}"  # noqa: E731
                                               for d, st in enumerate(batched.strides)] + ["0"])
        lines = ["{", f"    const float *A = {self.ptr(a)}, *B = {self.ptr(b)};", f"    float *C = {self.ptr(out, False)};"]
        lines += [f"    for (int64_t t{d} = 0; t{d} < {self.ints(n_)}; t{d}++)" for d, n_ in enumerate(batch)]
        lines += [
            f"    for (int64_t i = 0; i < {m}; i++) {{",
            f"        const float *ai = A + {at(a, a_b)} + i * {self.ints(a.strides[-2])};",
            f"        float *ci = C + {at(out, View(None, 0, batch, out.strides[:-2], 'f32'))} + "
            f"i * {self.ints(out.strides[-2])};",
            "        #pragma omp simd",
            f"        for (int64_t j = 0; j < {n}; j++) ci[j] = 0.f;",
            f"        for (int64_t p = 0; p < {k}; p++) {{",
            f"            const float aip = ai[p * {self.ints(a.strides[-1])}];",
            f"            const float *bp = B + {at(b, b_b)} + p * {self.ints(b.strides[-2])};",
            "            #pragma omp simd",
            f"            for (int64_t j = 0; j < {n}; j++) ci[j] += aip * bp[j * {self.ints(b.strides[-1])}];",
            "        }",
            "    }",
            "}",
        ]
        self._step(_describe(op), lines, [a, b], [out])
        return out

    @staticmethod
    def _lead(v: View, rank: int) -> View:
        # The new size-1 dims get the stride of a whole operand, not 0: oneDNN 3.x runs a matmul
        # with a zero batch stride (an activation times a gathered 2-D weight, as in sharded
        # per-device programs) on its reference kernel, orders of magnitude slower than brgemm.
        extra = rank - v.rank
        return View(v.buf, v.offset, (1,) * extra + v.shape, (numel(v.shape),) * extra + v.strides, v.dtype,
                    v.literal, v.value)

    def conv(self, op: TgOp, xs: list[View], chain: list[TgOp], env: dict,
             group: FusionOp | None = None) -> tuple[View, int]:
        info = op.result_infos()[0]
        x, w = (self.for_onednn(v) for v in xs[:2])
        if self.is_contiguous(x) and all(_is_one(d) for d in x.shape[2:]):  # (N, C, 1, 1): the same memory
            x = View(x.buf, x.offset, x.shape, channels_last_strides(x.shape), x.dtype)
        elif not self.is_channels_last(x):
            x = self.materialize(x, channels_last=True)
        bias = xs[2] if len(xs) > 2 else None
        if info.dtype != "f32" or w.literal is not None or x.literal is not None:
            raise Unsupported("conv: f32 tensors")
        constant_weight = self.buffers[w.buf].storage in KNOWN
        if bias is not None and (bias.literal is not None or not self.is_contiguous(bias)):
            raise Unsupported("conv bias")
        groups = op.attr("groups")
        nd = x.rank
        sp = nd - 2
        strides = list(op.attr("strides") or [1] * sp)
        dil = list(op.attr("dilations") or [1] * sp)
        pads = list(op.attr("pads") or [0] * (2 * sp))
        if groups > 1:
            o, i = w.shape[0], w.shape[1]
            wd = (groups, sympy.sympify(o) / groups) + (i,) + tuple(w.shape[2:])
            ws = (w.strides[0] * (sympy.sympify(o) / groups),) + tuple(w.strides)
        else:
            wd, ws = w.shape, w.strides

        def geometry(full: View):
            dims = [1 if _eq(st, 0) else d for d, st in zip(full.shape, full.strides)]
            strides = _plain_strides(dims, list(full.strides))
            # A binary operand laid out otherwise than the channels-last destination (a plain
            # NCHW residual: MaxViT's MBConv after its permuted attention block) has no fast
            # kernel: oneDNN falls back to its reference convolution, 300x slower at 56x56.
            # Such an add runs as a loop after the convolution instead.
            if not all(_is_one(d) or _eq(s, c) for d, s, c in zip(dims, strides, channels_last_strides(dims))):
                raise Unsupported("a binary post-op operand in another layout than the destination's")
            return dims, strides
        accumulate = None if group is None else \
            (lambda add, v, o: self._accumulates_into(group, add, v, o, info.shape, [x, w, bias]))
        # A swish after a convolution runs as the loop over the result just written, still in
        # cache, in the same step (runtime.h, tg_sigmoid), not as oneDNN's swish post-op: that
        # one's exp made every convolution kernel of EfficientNet-B0, depthwise and 1x1 alike,
        # slower by about 1.7x what the loop takes (benchmarks/onednn_layouts.py --post swish
        # against --post relu gives the post-op's share).
        posts, post_views, covered, into = self._posts(chain, op.results[0], env, info.shape, geometry, accumulate,
                                                       swish=False)
        if into is None:
            out = self._result(op, xs)
        else:  # the residual's buffer: the step reads it (the sum) and writes the result there
            out = View(into.buf, into.offset, tuple(info.shape), channels_last_strides(info.shape), into.dtype)
        k = self._new_prim()
        arr = self._c_array
        # A 3x3 stride-1 convolution goes to winograd.c where it is faster (ir/hardware.winograd_wins,
        # the rule the cost model prices by): its step passes the arena scratch its transformed
        # tiles live in (none where the rule says no: the runtime makes it oneDNN's, unless
        # tg_set_winograd overrules, as benchmarks/winograd_convs.py does to time both).
        eligible = constant_weight and x.rank == 4 and \
            winograd_shape(groups, w.shape[2:], strides, dil, pads, x.shape[1], *out.shape[1:])
        scratch = None
        if eligible and winograd_wins(x.shape[0], x.shape[1], out.shape[1], out.shape[2], out.shape[3], groups):
            scratch = self._temp(TensorInfo((winograd_floats(x.shape[0], x.shape[1], *out.shape[1:]),), "f32"))
        depthwise = groups > 1 and _eq(wd[1], 1) and _eq(wd[2], 1)
        # Blocked (nChw16c) where the rule finds oneDNN's blocked kernels faster and Winograd does
        # not win (a depthwise 3x3 is a shape winograd.c takes, never one it wins on);
        # chain_convolutions keeps it only inside a chain of such convolutions. A binary post-op
        # reads an operand in the emitter's layout, which the blocked kernels do not pair with
        # theirs (a sum post-op's destination is reordered into the blocked layout first: conv.c,
        # tg_conv_blocked).
        block = 0 if scratch is not None or post_views or x.rank != 4 else \
            blocked_conv(x.shape[0], x.shape[1], out.shape[1], out.shape[2], out.shape[3], depthwise, w.shape[2:])
        eligible = eligible and not block
        create = "tg_wino_create" if eligible else "tg_conv_create"
        last = f", {self.ints(numel(scratch.shape)) if scratch is not None else 0}" if eligible else f", {_BLOCK}"
        # A strided 1-D convolution goes to strided_conv.c (matmuls over views of its source)
        # where the rule finds that faster: no bias, only eltwise post-ops (no binary operand, no
        # sum into a residual's buffer); tg_set_strided_conv overrules, TG_STRIDED_CONV=0 for an A/B.
        if constant_weight and x.rank == 3 and bias is None and not post_views and into is None and \
                strided_conv_shape(groups, w.shape[2:], strides, dil, pads, x.shape[1], out.shape[1]):
            create = "tg_sconv_create"
            last = f", {int(strided_conv_wins(x.shape[0], x.shape[1], out.shape[1], out.shape[2], w.shape[2], strides[0]))}"
        # A 1x1 convolution of one 1x1 image (a squeeze-excitation's two) is a one-row matmul:
        # gemv.c where the rule finds that faster (tg_gemv_conv_create leaves to oneDNN what it
        # does not take: a batch of more at run time, a chained source in oneDNN's layout).
        if create == "tg_conv_create" and constant_weight and groups == 1 and into is None and \
                all(_is_one(d) for d in (*x.shape[2:], *w.shape[2:])):
            create = "tg_gemv_conv_create"
            last += f", {int(gemv_wins(x.shape[0]))}"
        state = [
            "{",
            f"    const int64_t xd[] = {arr(x.shape)}, xs[] = {arr(x.strides)};",
            f"    const int64_t wd[] = {arr(wd)}, ws[] = {arr(ws)};",
            f"    const int64_t yd[] = {arr(out.shape)}, ys[] = {arr(out.strides)};",
            f"    const int64_t str[] = {arr(strides)}, dil[] = {arr(dil)}, pad[] = {arr(pads)};",
            f"    const tg_post posts[] = {{{', '.join(posts) or '{0}'}}};",
            f"    if ({create}(&st->prim[{k}], {nd}, xd, xs, {len(wd)}, wd, ws, yd, ys, {int(bias is not None)}, "
            f"str, dil, pad, {self.ptr(w) if constant_weight else 'NULL'}, &tg_packs[{k}], {len(posts)}, posts, "
            f"{_FROM}, {_CHAIN_OUT}, {_STREAM}{last})) return 1;",
            "}",
        ]
        self._run_primitive(op, k, state, x, w, bias, out, post_views, out, [into] if into is not None else [],
                            scratch=scratch)
        others = [w, *([bias] if bias is not None else []), *post_views]
        self.steps[-1].conv = ConvStep(k, x, out, all(v.buf != x.buf for v in others),
                                       all(v.buf != out.buf for v in [x, *others]), depthwise, constant_weight, block)
        return out, covered


def winograd_floats(n, c, k, oh: int, ow: int) -> int:
    """The arena floats a Winograd convolution's step reserves: V and M of one chunk of tiles,
    36 slabs each of a row of C (K) per 4x4 tile, and one vector for reads past the last row
    (winograd.c, tg_wino_floats; it runs as many tiles a chunk as this holds). A chunk holds all
    the tiles, or as many as WINOGRAD_CHUNK_BYTES (a batch known only at run time: that many),
    split evenly: 16 tiles at most 14 a chunk go as 8 and 8, not 14 and a 2-row GEMM."""
    chunk = max(1, WINOGRAD_CHUNK_BYTES // (36 * 4 * (int(c) + int(k))))
    if sympy.sympify(n).is_number:
        tiles = int(n) * -(-int(oh) // 4) * -(-int(ow) // 4)
        chunk = -(-tiles // -(-tiles // chunk))
    return 36 * chunk * (int(c) + int(k)) + 16


# Placeholders of a convolution's state line that chain_convolutions fills in.
_FROM, _CHAIN_OUT, _STREAM, _BLOCK = "/*from*/NULL", "/*chain_out*/0", "/*stream*/0", "/*block*/0"


def chain_convolutions(steps: list, buffers: list, outputs: list[View]) -> int:
    """Marks the buffers between convolutions that nothing else touches, so no conversion to
    the emitter's f32 channels-last layout and back runs between them (conv.c,
    tg_conv_create). Two kinds, one rule each; returns how many buffers it marked.

    Chained: one convolution step alone writes the buffer, it is no output, and every step
    that reads it is a convolution on its own reading all of it (the producer's view) as its
    source and as nothing else. The producer leaves its result there as its kernel writes it
    (bf16 at precision bf16; oneDNN's preferred layout at f32, or the blocked one where the
    producer and its readers all run blocked: _blocked_chains) and each reader takes it so.
    Where one of them runs blocked and another not, the buffer is not chained.

    Streamed (ResNet's blocks: each adds into its shortcut's buffer, a sum post-op): a
    temporary, no output, that only convolutions touch, each reading all of it as its source
    or writing all of it as its result (adding into what it held or not), none depthwise (it
    computes in f32) and each with a constant weight (packed bf16 once, so its kernel takes
    bf16 operands). At bf16 every one of them takes the buffer as bf16 in the emitter's
    strides: its readers convert nothing and its writers write half the bytes."""
    readers, writers = _readers_writers(steps)
    kept = {v.buf for v in outputs}
    chains = []  # (the producing step, its readers) of each buffer that may be chained
    for step in steps:
        if step.conv is None:
            continue
        out = step.conv.out
        b = out.buf
        reads = readers.get(b, [])
        if buffers[b].storage != "temp" or b in kept or len(writers.get(b, [])) != 1 or not reads:
            continue
        if all(r.conv is not None and r.conv.alone and r.conv.src.buf == b and _same_place(r.conv.src, out)
               for r in reads):
            chains.append((step, reads))
    blocked = _blocked_chains(steps, chains)
    chained = 0
    for step, reads in chains:
        k = step.conv.prim
        if any(blocked.get(id(s)) != blocked.get(id(step)) for s in reads):
            continue  # (one side blocked, the other not: each takes the buffer in the emitter's layout)
        # 2: a reader computes in f32 (a depthwise convolution at bf16, runtime.c): an f32 result
        step.state = [line.replace(_CHAIN_OUT, "2" if any(r.conv.depthwise for r in reads) else "1")
                      for line in step.state]
        for r in reads:
            r.state = [line.replace(_FROM, f"&st->prim[{k}]") for line in r.state]
        chained += 1
    stream: dict[int, int] = {}  # id(step) -> 1: its source is streamed, 2: its result, 3: both
    for b in {step.conv.out.buf for step in steps if step.conv is not None}:
        touching = list({id(s): s for s in readers.get(b, []) + writers.get(b, [])}.values())
        if buffers[b].storage != "temp" or b in kept or len(writers[b]) < 2 or not readers.get(b):
            continue
        convs = [s.conv for s in touching]
        if not all(c is not None and (c.alone or c.src.buf != b) and (c.out_alone or c.out.buf != b) and
                   not c.depthwise and c.constant_weight for c in convs):
            continue
        views = [v for c in convs for v in (c.src, c.out) if v.buf == b]
        if not all(_same_place(v, views[0]) for v in views) or \
                not all(s.conv.out.buf == b for s in writers[b]) or \
                not all(s.conv.src.buf == b or s.conv.out.buf == b for s in readers[b]):
            continue
        for s in touching:
            stream[id(s)] = stream.get(id(s), 0) | (1 if s.conv.src.buf == b else 0) | (2 if s.conv.out.buf == b else 0)
        chained += 1
    for step in steps:
        if id(step) in stream:
            step.state = [line.replace(_STREAM, str(stream[id(step)])) for line in step.state]
        if id(step) in blocked:
            step.state = [line.replace(_BLOCK, str(blocked[id(step)])) for line in step.state]
    return chained


def _blocked_chains(steps: list, chains: list) -> dict[int, int]:
    """The convolution steps (by id) that run blocked (conv.c, tg_conv_blocked), each with
    its channel block: those the rule (ir/hardware.blocked_conv) finds faster that are chained
    to another such one (the producer and every reader of a buffer whose channels fill whole
    blocks). A blocked convolution reorders what it reads from, or writes to, an unchained
    buffer: alone, those reorders (a pass over its source and result each) cost about what the
    blocked kernel saves; in a chain only its ends pay them. Dropping one may leave a neighbour
    alone: repeated until none is. Each connected chain then takes one block (chain_block) by
    the buffers it keeps, so that none is reordered inside it."""
    links = [(step, reads) for step, reads in chains
             if all(s.conv.block for s in [step, *reads]) and chain_block([step.conv.out.shape[1]])]
    blocked = {id(s) for s in steps if s.conv is not None and s.conv.block}
    while True:
        live = [(step, reads) for step, reads in links if all(id(s) in blocked for s in [step, *reads])]
        linked = {id(s) for step, reads in live for s in [step, *reads]}
        if linked == blocked:
            break
        blocked = linked
    graph = nx.Graph()
    for step, reads in live:
        graph.add_edges_from((id(step), id(r), {"channels": step.conv.out.shape[1]}) for r in reads)
    return {node: chain_block([c for *_, c in graph.subgraph(part).edges(data="channels")])
            for part in nx.connected_components(graph) for node in part}


# The source type of GEMM k's state line, which bf16_sources makes the binding's precision.
_SOURCE = "/*source {}*/dnnl_f32"


def bf16_sources(steps: list, buffers: list, outputs: list[View]) -> int:
    """Marks the buffers that only bf16 GEMMs read, so their producer writes them in bf16
    and no GEMM converts its f32 source on every call (a 0.3B decoder's prompt ran 140 such
    conversions a call). A temporary, no output, written by one step alone, in one loop that
    has a bf16 twin (loops.py: a whole buffer, nothing else of the step touching it), and
    read only by GEMMs of a constant weight (packed bf16 once, runtime.c's tg_bf16_weights),
    each reading all of it row-major as its source and nothing else of its step touching it,
    or by attention as q, k or v (its bf16 products round them so anyway: an encoder's
    projections convert nothing in its attention). At bf16 the writer's twin runs (`st->bf16`)
    and each reader's primitive takes a bf16 source (runtime.c, tg_matmul_create), each
    attention its operands (attention.c, tg_set_attention_in_bf16); at f32 nothing changes.
    Returns how many it marked."""
    readers, writers = _readers_writers(steps)
    kept = {v.buf for v in outputs}
    marked = 0
    for b, ws in writers.items():
        if len(ws) != 1 or b not in ws[0].bf16_writes or b in kept or buffers[b].storage != "temp" or \
                not readers.get(b) or b in ws[0].reads:
            continue
        sources = [(k, v) for r in readers[b] for k, v in r.gemm_sources if v.buf == b]
        if not all((any(v.buf == b for _, v in r.gemm_sources) or b in r.bf16_reads) and b not in r.writes
                   for r in readers[b]):
            continue
        ws[0].lines = [line.replace(bf16_marker(b), "st->bf16") for line in ws[0].lines]
        ws[0].state = [line.replace(bf16_marker(b), "st->bf16") for line in ws[0].state]  # (a GEMM's result type)
        for r in readers[b]:
            for k, _ in sources:
                r.state = [line.replace(_SOURCE.format(k), "(st->bf16 ? dnnl_bf16 : dnnl_f32)") for line in r.state]
            r.lines = [line.replace(bf16_read_marker(b), "st->bf16") for line in r.lines]  # attention's operands
        marked += 1
    return marked


def _readers_writers(steps: list) -> tuple[dict[int, list], dict[int, list]]:
    """The steps reading, and those writing, each buffer."""
    readers: dict[int, list] = {}
    writers: dict[int, list] = {}
    for step in steps:
        for b in step.reads:
            readers.setdefault(b, []).append(step)
        for b in step.writes:
            writers.setdefault(b, []).append(step)
    return readers, writers


def _same_place(a: View, b: View) -> bool:
    """Whether two views address the same elements alike. A dim of size 1 addresses nothing
    by its stride, and the views disagree there (a reader's is normalized for oneDNN,
    unit_dims_strided): at batch 1 a plain comparison never matched, and no buffer chained."""
    return (a.offset, a.shape) == (b.offset, b.shape) and \
        unit_dims_strided(a.shape, a.strides) == unit_dims_strided(b.shape, b.strides)


def _swish_mul(chain: list[TgOp], current: SSAValue) -> TgOp | None:
    """The `mul` of `sigmoid(current) * current` (SiLU) when those are the chain's next two
    ops and nothing else reads `current` or the sigmoid (the epilogue overwrites them)."""
    if len(chain) < 2 or chain[0].op_name != Op.sigmoid or chain[0].operands[0] is not current:
        return None
    sig, mul = chain[0], chain[1]
    if mul.op_name != Op.mul or {id(v) for v in mul.operands} != {id(current), id(sig.results[0])}:
        return None
    if info_of(mul.results[0].type).dtype != "f32":
        return None
    if not (all(u.operation in (sig, mul) for u in current.uses) and _only_use(sig.results[0], mul)):
        return None
    return mul


def _hard_swish(chain: list[TgOp], current: SSAValue, value) -> tuple | None:
    """(alpha, beta, the ops it covers) when the chain's next ops are `current` times
    ir/decompositions.hard_sigmoid of it, max(min(alpha * x + beta, 1), 0): torch's hardswish,
    MobileNetV3's activation (a loop after the primitive otherwise). `value(v)`: a scalar
    operand's value, or None. Nothing else may read `current` or an intermediate (the
    epilogue overwrites them). (A hardsigmoid alone needs nothing here: `fold` moves its
    scale and shift into the weights, and its clamp is two clip post-ops.)"""
    if len(chain) < 5 or [op.op_name for op in chain[:2]] != [Op.mul, Op.add] or \
            {chain[2].op_name, chain[3].op_name} != {Op.min, Op.max} or chain[4].op_name != Op.mul:
        return None
    consts = []
    prev = current
    for op, bound in zip(chain[:4], (False, False, True, True)):  # (the clamp's order does not matter)
        if len(op.operands) != 2 or prev not in op.operands or info_of(op.results[0].type).dtype != "f32":
            return None
        c = value(op.operands[1] if op.operands[0] is prev else op.operands[0])
        if c is None or (bound and float(c) != (1.0 if op.op_name == Op.min else 0.0)):
            return None
        consts.append(float(c))
        prev = op.results[0]
    ops, mul = chain[:5], chain[4]
    if {id(v) for v in mul.operands} != {id(current), id(prev)} or info_of(mul.results[0].type).dtype != "f32":
        return None
    if not (all(_only_use(op.results[0], nxt) for op, nxt in zip(ops[:4], ops[1:])) and
            all(u.operation in (ops[0], mul) for u in current.uses)):
        return None
    return consts[0], consts[1], ops
