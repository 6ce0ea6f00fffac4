"""How strong is the property suite? Seed known faults, one at a time, and count the ones it catches.

Each fault is a source patch (a line of a pass, a rule, a kernel or the chunk loop changed the way
a compiler engineer's slip changes it: a flipped comparison, an off-by-one block bound, a dropped
guard, swapped operands, a wrong reduction axis, an ignored mask, a wrong remainder). For each,
the tree is copied to a temporary directory, the patch applied there, and the focused test files of
its layer (LAYERS: the property suite for passes, ir/ and the NumPy backend; the C backend's tests for
the C emitter and runtime.c/blockq.c; each frontend's, quantize's, shard's and the caches' own; files
of `make test`, at their own hypothesis settings, slow tests left out but for WITH_SLOW) run on the copy. A fault is
caught when they fail. The untouched tree must pass first (a layer whose baseline fails or
times out is reported and its faults not run; the other layers go on). The score is printed per layer.

Affordable: each fault runs only the tests of its layer's files that can see it. The baseline run
records, with coverage.py, which test executes which line of the faulted files; a fault then runs
the tests that executed the body of the function around its line (the whole file's tests for a line
that runs at import, such as a rule table), in suite order, with -x. Every run uses one hypothesis
seed (--seed) and no example database, so a test runs the same code up to the faulted line as it
did in the baseline: a test that never reached that function cannot fail because of the fault.
Selection by coverage is the usual test selection of mutation testing; no test is written for a
fault's text. Code a test runs in a child Python process (a compile in a fresh process, a
command line) counts as that test's: coverage.py's subprocess measurement (COVERAGE_PROCESS_START),
with the test's id as the child's context. A fault in runtime.c or blockq.c names the runtime's
entry points its line runs under (`calls`); it runs the tests that built a module calling one (the
baseline records each test's emitted C) or ran a Python function of the C backend that calls one
through ctypes.

On two cores shared with other work: `-j` runs that many faults at once, each in its own copy
of the tree; the C backend's compiled libraries live in one cache for all runs (keyed by their
source, so a faulted emitter or runtime builds its own); `--time-limit` starts no fault past
that many seconds and scores those that ran.

    python benchmarks/fault_seeding.py                  # every fault
    python benchmarks/fault_seeding.py --only 1-8,12    # some of them
    python benchmarks/fault_seeding.py --layers "C runtime,quantize" -j 2 --time-limit 3600
    python benchmarks/fault_seeding.py --list

Prints one line per fault (caught by which test, or escaped) and the share caught. A fault proven
not to change any result (`equivalent`, the proof beside it) still runs but is left out of the
score. Faults in ir/kernels.py's float64 paths and in ir/ops.py templates change the oracle too (the
interpreter renders the same templates), so the differential suite cannot see them: they are left
out here and are the ONNX conformance suite's and the peers' job.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from queue import Queue

ROOT = Path(__file__).resolve().parents[1]
# The property suite: every pass on random graphs, the emitted NumPy against the interpreter,
# the per-op examples, and the rule proofs.
SUITE = ["tests/test_rule_proofs.py", "tests/test_passes.py", "tests/test_numpy_backend.py", "tests/test_properties.py",
         "tests/test_fusion.py", "tests/test_attention_tiling.py"]
# Each layer's focused test files: a fault runs against those of its layer (the tests among them
# that reach its code), as a change to that layer runs them before a merge.
LAYERS: dict[str, tuple[str, ...]] = {
    "passes and IR": tuple(SUITE),
    "NumPy backend": tuple(SUITE),
    "C emitter": ("tests/test_c_backend.py", "tests/test_untrusted_shapes.py"),
    "C runtime": ("tests/test_c_backend.py", "tests/test_c_blockq.py", "tests/test_untrusted_shapes.py"),
    "ONNX frontend": ("tests/test_onnx_frontend.py", "tests/test_onnx_conformance.py", "tests/test_untrusted_errors.py"),
    "torch frontend": ("tests/test_torch_frontend.py", "tests/test_untrusted_pt2.py"),
    "GGUF frontend": ("tests/test_gguf.py",),
    "quantize": ("tests/test_quantize.py", "tests/test_gptq.py"),
    "shard": ("tests/test_shard.py", "tests/test_distributed.py"),
    "compile cache": ("tests/test_untrusted_cache.py", "tests/test_compile_api.py"),
}
# Slow-marked files run all the same where they are a layer's own tests: the ONNX node conformance
# cases are where the ONNX frontend's converters meet onnx's reference (make test runs them too).
WITH_SLOW = {"tests/test_onnx_conformance.py"}
# A fault's layer, by the first prefix its path starts with (else "passes and IR").
LAYER_OF = (("backends/numpy/", "NumPy backend"), ("backends/c/", "C emitter"), ("frontends/onnx/", "ONNX frontend"),
            ("frontends/torch_export/", "torch frontend"), ("frontends/pt2_archive.py", "torch frontend"),
            ("frontends/gguf/", "GGUF frontend"), ("passes/quantize/", "quantize"), ("passes/gptq.py", "quantize"),
            ("passes/shard", "shard"), ("passes/partition.py", "shard"), ("backends/simulated_mesh.py", "shard"),
            ("ir/shard.py", "shard"), ("ir/cache.py", "compile cache"), ("tilegraph/compile_cache.py", "compile cache"),
            ("ir/strides.py", "C emitter"))  # the C emitter's views, which the C target's pricing reads too


@dataclass(frozen=True)
class Fault:
    path: str
    old: str
    new: str
    what: str
    # Why the fault cannot change what the pass or backend produces (an equivalent mutant), proven
    # from the code around it. It still runs; escaped, it is left out of the score (caught, it counts).
    equivalent: str = ""
    # A fault in runtime.c or blockq.c: the runtime's entry points through which its line runs
    # (a test is run against it when a module it builds, or the C backend's Python, calls one).
    calls: tuple[str, ...] = ()


FAULTS = [
    # --- canonicalize's rules ---------------------------------------------------------------
    Fault("passes/canonicalize.py", "            if is_splat(op.operands[side], value):",
          "            if constant_array(op.operands[side]) is not None:", "identity rule: guard dropped (x + c -> x)"),
    Fault("passes/canonicalize.py", 'Rule(("sub",), identity_operand(0, (1,)), "x - 0 -> x")',
          'Rule(("sub",), identity_operand(0, (1, 0)), "x - 0 -> x")', "0 - x -> x: wrong side accepted"),
    Fault("passes/canonicalize.py", 'return emit("mul", x, x) if is_splat(e, 2) else None',
          'return emit("mul", x, x) if is_splat(e, 3) else None', "x ** 3 -> x * x: wrong constant"),
    Fault("passes/canonicalize.py", 'return emit("add", x, n.operands[0]) if n else None',
          'return emit("sub", x, n.operands[0]) if n else None', "x - (-y) -> x - y: flipped op"),
    Fault("passes/canonicalize.py", '        return emit("sub", y, n.operands[0])',
          '        return emit("sub", n.operands[0], y)', "(-y) + x -> y - x: swapped operands"),
    Fault("passes/canonicalize.py", 'return emit("neg", op.operands[1]) if is_splat(op.operands[0], 0) else None',
          'return emit("neg", op.operands[1]) if constant_array(op.operands[0]) is not None else None',
          "c - x -> -x: guard dropped"),
    Fault("passes/canonicalize.py", "    perm = tuple(p1[j] for j in p2)", "    perm = tuple(p2[j] for j in p1)",
          "transpose composition: permutations swapped"),
    Fault("passes/canonicalize.py", 'return op.operands[0] if all(s == 1 for s in op.attr("steps")) else None',
          "return op.operands[0]", "slice of everything: step guard dropped"),
    Fault("passes/canonicalize.py", '    if not lossless_cast(info(x).dtype, info(inner.results[0]).dtype):',
          '    if False:', "cast(cast(x)): lossless guard dropped"),
    Fault("passes/canonicalize.py", "        return fd.nmant >= fs.nmant and fd.maxexp >= fs.maxexp and fd.minexp <= fs.minexp",
          "        return fd.nmant + 3 >= fs.nmant and fd.maxexp >= fs.maxexp", "lossless_cast: off by 3 mantissa bits"),
    Fault("passes/canonicalize.py", "        chosen = op.operands[1] if cond.all() else op.operands[2]",
          "        chosen = op.operands[2] if cond.all() else op.operands[1]", "where(true, x, y) -> y: sides swapped"),
    Fault("passes/canonicalize.py", '        if inner is not None and inner.attr("axis") % info(v).rank == axis:',
          "        if inner is not None:", "concat(concat): axis guard dropped",
          equivalent="the rewrite driver keeps only a replacement of the same type. Inner concat of k parts on "
                     "axis a, outer on b != a: the flat concat is well typed only if the parts agree on dim a (d "
                     "each), so the outer result has k*d there and the flat one d; equal types force k = 1 (an "
                     "identity concat: the rewrite is right) or d = 0 (an empty result: every value is equal)"),
    Fault("passes/canonicalize.py", "    if cond.all() or not cond.any():", "    if cond.any():",
          "where on a constant condition: all -> any"),
    Fault("passes/canonicalize.py", '    inner = producer(op.operands[0], op.op_name)\n    return inner.operands[0] if inner else None',
          '    inner = producer(op.operands[0])\n    return inner.operands[0] if inner else None',
          "f(f(x)) -> x: the inner op's kind not checked"),
    Fault("passes/canonicalize.py", '    if info(op.operands[0]).dtype.startswith("ui"):\n        return None\n', "",
          "abs(neg x) -> abs x: unsigned guard dropped"),
    # --- the rewrite driver and simplify-shapes -----------------------------------------------
    Fault("passes/rewrite.py", "any(v.type != r.type for v, r in zip(values, op.results))", "False",
          "rewrite driver: type check dropped"),
    Fault("passes/simplify_shapes.py", 'if moved == sorted(moved) else None', "",
          "transpose -> reshape: order guard dropped"),
    Fault("passes/simplify_shapes.py", "if x.shape != out.shape and dims_equal(numel(x.shape), numel(out.shape)):",
          "if x.shape != out.shape:", "broadcast -> reshape: element-count guard dropped",
          equivalent="the guard is tg.reshape's own shape rule (ir/ops.py _check_reshape, the same dims_equal of "
                     "the same numel): without it Emit raises Inapplicable and the rule does not apply"),
    Fault("passes/simplify_shapes.py", "if k > 0 and all(static_dim(d, 1) for d in out[:k]) and",
          "if k > 0 and", "unbroadcast: leading-ones guard dropped",
          equivalent="every tg.reshape keeps its element count (its shape rule): with the trailing dims equal to "
                     "x's, the prepended dims multiply to 1, so they are all 1 (or x is empty: so is the result)"),
    Fault("passes/simplify_shapes.py", "            fits = infer(op.spec, [info(t) for t in trial], op.py_attrs()) == want",
          "            fits = True", "bypass broadcast: result-type guard dropped"),
    # --- constant-fold, dce -------------------------------------------------------------------
    Fault("passes/constant_fold.py", "        if any(a.shape != r.shape for a, r in zip(arrays, results)):",
          "        if False:", "constant-fold: shape check dropped"),
    Fault("passes/constant_fold.py", 'values = evaluate(op, [self._value(s) for s in sources], self.store, dict(GLOBALS), float64=False)',
          'values = evaluate(op, [self._value(s) for s in sources][::-1], self.store, dict(GLOBALS), float64=False)',
          "constant-fold: operands reversed"),
    # --- fusion legality ----------------------------------------------------------------------
    Fault("passes/fuse.py", "        if self._has_detour(a, b) or self._has_detour(b, a):",
          "        if False:", "fuse: cycle check dropped"),
    Fault("passes/fuse.py", "            if not flat_ok(ops, uses, ref):", "            if False:",
          "fuse: regrouped-rows guard dropped"),
    # --- the NumPy backend's float32 kernels and chunk loop ----------------------------------
    Fault("backends/numpy/chunks.py", "    slices = [slice(i, min(i + rows, length)) for i in range(0, length, rows)]",
          "    slices = [slice(i, min(i + rows, length - 1)) for i in range(0, length, rows)]",
          "chunks: off-by-one last block bound"),
    Fault("backends/numpy/chunks.py", "    slices = [slice(i, min(i + rows, length)) for i in range(0, length, rows)]",
          "    slices = [slice(i, i + rows) for i in range(0, length - length % rows, rows)]",
          "chunks: the remainder block dropped"),
    Fault("backends/numpy/chunks.py", "    if rows <= 0 or rows >= length:", "    if rows <= 0 or rows > length:",
          "chunks: flipped comparison", equivalent="rows == length makes one chunk, slice(0, length), either way"),
    Fault("ir/kernels.py", "    np.multiply(p, x, out=p)  # x, not the clipped x", "    np.multiply(p, x2, out=p)  # x, not the clipped x",
          "erf float32: wrong operand"),
    Fault("ir/kernels.py", "        p *= xs  # (not t:", "        p *= t  # (not t:", "gelu float32: the clipped x used"),
    Fault("backends/numpy/attention.py", "            drop(~block)", "            pass", "flash attention: boolean mask ignored"),
    Fault("backends/numpy/attention.py", "            s += block", "            s -= block",
          "flash attention: additive mask subtracted"),
    Fault("backends/numpy/attention.py", "    if causal and j1 - 1 > i0 + (lk - lq):", "    if causal and j1 - 1 > i1 + (lk - lq):",
          "flash attention: causal block test off by a block"),
    # --- added in the second session: a wrong reduction axis, chunk-axis slips in fused groups ---
    Fault("passes/canonicalize.py", '    axes = [a % len(shape) for a in op.attr("axes")] if shape else []',
          '    axes = [(a + 1) % len(shape) for a in op.attr("axes")] if shape else []',
          "reduce over size-1 axes -> reshape: the wrong axis checked"),
    Fault("backends/numpy/groups.py", "return f\"{self._flat(buf.name, 'full')}.shape[{1 if self.cols else 0}]\"",
          "return f\"{self._flat(buf.name, 'full')}.shape[{0 if self.cols else 1}]\"",
          "fused group: the chunk count read off the wrong axis"),
    Fault("backends/numpy/groups.py", "        if axis < 0 or (isinstance(info.shape[axis], int) and info.shape[axis] == 1):",
          "        if axis < 0:", "fused group: a size-1 (broadcast) axis cut into chunks"),
    Fault("backends/numpy/groups.py", '                attrs["axis"] = -1', '                attrs["axis"] = 0',
          "fused group (flat): softmax/layer_norm over the wrong axis"),
    # --- decompose (ir/decompositions.py: the decompose pass and the Triton emitter's expansions) ---
    Fault("ir/decompositions.py", 'emit("reduce_sum", e, axes=(axis,), keepdims=True)',
          'emit("reduce_sum", e, axes=(0,), keepdims=True)', "softmax decomposition: the sum over the wrong axis"),
    Fault("ir/decompositions.py", 'emit("mul", centered, centered), axes=axes, keepdims=True)\n    y = emit("div"',
          'emit("mul", x, x), axes=axes, keepdims=True)\n    y = emit("div"',
          "layer_norm decomposition: the variance of x, not of x - mean"),
    Fault("ir/decompositions.py", 'emit("mul", x, emit.constant(SQRT_HALF, dt))', 'emit("mul", x, emit.constant(0.5, dt))',
          "gelu decomposition: a wrong constant"),
    # --- the C emitter (backends/c/*.py): views, loops, kernels, oneDNN epilogues -------------------
    Fault("backends/c/views.py", "            if j < 0 or (_is_one(view.shape[j]) and not _is_one(d)):",
          "            if j < 0:", "broadcast view: a size-1 dim keeps its stride"),
    Fault("backends/c/views.py", "            offset = offset + (r.start if len(r) else 0) * st",
          "            offset = offset + (r.start if len(r) else 0)", "slice view: the start not scaled by the stride"),
    Fault("backends/c/views.py", "            strides.append(st * k)", "            strides.append(st)",
          "slice view: the step ignored"),
    Fault("ir/strides.py",
          "        if any(not _eq(old[k][1], old[k + 1][1] * old[k + 1][0]) for k in range(oi, oj - 1)):",
          "        if False:", "no-copy reshape: merged dims not checked to walk memory as one run"),
    Fault("backends/c/emit.py", "                views.append(View(v.buf, v.offset + start * v.strides[axis],",
          "                views.append(View(v.buf, v.offset + start,", "split views: the offset not scaled by the axis stride"),
    Fault("backends/c/kernels.py", 'f"        if (r < 0) r += {rows};",', 'f"        if (r < 0) r = -r;",',
          "gather: a negative index mirrored, not wrapped"),
    Fault("backends/c/kernels.py", "f\"    out[{self._at(out, coords)}] = x[{self._at(x, {**coords, axis: 'r'})}];\",",
          "f\"    out[{self._at(out, coords)}] = x[{self._at(x, coords)}];\",",
          "gather_elements: x read at the output's position, the index ignored"),
    Fault("backends/c/kernels.py", 'f"acc += x[{at_x}];"] if op.attr("exclusive") else',
          'f"acc += x[{at_x}];"] if not op.attr("exclusive") else', "cumsum: exclusive and inclusive swapped"),
    Fault("backends/c/kernels.py", "            part = View(out.buf, start * out.strides[axis], x.shape, out.strides, out.dtype)",
          "            part = View(out.buf, start, x.shape, out.strides, out.dtype)",
          "concat: a part's offset not scaled by the axis stride"),
    Fault("backends/c/kernels.py", 'divisor = f"{kh * kw}.f" if include_pad else "(float)count"',
          'divisor = "(float)count" if include_pad else f"{kh * kw}.f"', "avg pool: count_include_pad inverted"),
    Fault("backends/c/kernels.py", '"acc = v > acc || v != v ? v : acc;" if is_max', '"acc = v < acc || v != v ? v : acc;" if is_max',
          "max pool (NCHW): the minimum taken"),
    Fault("backends/c/kernels.py", "out.offset + sum(p * st for p, st in zip(pads, out.strides))",
          "out.offset + sum(p * st for p, st in zip(pads[len(pads) // 2:], out.strides))",
          "pad: the interior placed by the end pads"),
    Fault("backends/c/kernels.py", 'finish = f"acc / (double){self.ints(n)}" if kind == "mean" else "acc"',
          'finish = "acc"', "reduce_mean (loop nest): the sum not divided"),
    Fault("backends/c/kernels.py", "f\"({ctype})({f'acc[j] / (double){self.ints(n)}' if mean else 'acc[j]'});\",",
          "f\"({ctype})(acc[j]);\",", "reduce_mean (rows of channels): the sum not divided"),
    Fault("backends/c/groups.py", "            for p in xs[1:3]:", "            for p in xs[2:0:-1]:",
          "layer_norm: scale and bias swapped"),
    Fault("backends/c/emit.py", "{int(bool(op.attr('causal')))}, {blocks[0]}", "0, {blocks[0]}",
          "attention: the causal flag dropped"),
    Fault("backends/c/loops.py", "            if merged and all(_eq(ps, s * d) for ps, s in zip(merged[-1][1], strides)):",
          "            if merged and _eq(merged[-1][1][0], strides[0] * d):",
          "loop nest: dims merged when only the first access runs on across them"),
    Fault("backends/c/onednn.py", '                if name == Op.sub and op.operands[0] is not current:',
          "                if False:", "GEMM epilogue: c - x fused as x - c",
          equivalent="the guard is dead: _posts' first check in the loop (`op.operands[0] is not current and not "
                     "(name in (add, mul) and op.operands[1] is current)`: break) already leaves the loop for "
                     "a sub whose first operand is not the accumulated value, so here op.operands[0] is "
                     "current and the condition is always false; c - x is never fused, whatever the IR"),
    Fault("backends/c/onednn.py", '                        else ("1.f", f"-({o.literal})")',
          '                        else ("1.f", f"({o.literal})")', "GEMM epilogue: x - c fused as x + c"),
    # --- the C runtime (runtime.c, blockq.c) -------------------------------------------------------
    Fault("backends/c/runtime.c", "        float inv = 1.f / s;", "        float inv = 1.f / (s + 1.f);",
          "softmax rows: a wrong normalizer", calls=("tg_softmax_rows",)),
    Fault("backends/c/runtime.c", "        float inv = 1.f / sqrtf(v / (float)n + eps);",
          "        float inv = 1.f / sqrtf(v / (float)(n - 1) + eps);", "layer_norm rows: the unbiased variance",
          calls=("tg_layer_norm_rows",)),
    Fault("backends/c/runtime.c", "            if (bias) t += bias[j];", "            if (bias) t -= bias[j];",
          "layer_norm rows: the bias subtracted", calls=("tg_layer_norm_rows",)),
    Fault("backends/c/runtime.c", "fmaxf(m / 127.f, 1.17549435e-38f)", "fmaxf(m / 128.f, 1.17549435e-38f)",
          "dynamic quantize rows: scale off by one code", calls=("tg_dynamic_quantize_rows",)),
    Fault("backends/c/runtime.c", "        int64_t first = i0 + i + lk - lq + 1 - j0;",
          "        int64_t first = i0 + i + lk - lq - j0;", "attention: the causal diagonal masked",
          calls=("tg_attention",)),
    Fault("backends/c/runtime.c", "for (int64_t j = 0; j < nk; j++) if (!mi[j * mc]) si[j] = -INFINITY;",
          "for (int64_t j = 0; j < nk; j++) if (mi[j * mc]) si[j] = -INFINITY;", "attention: boolean mask inverted",
          calls=("tg_attention",)),
    Fault("backends/c/runtime.c", "        for (int64_t c = 0; c < dv; c++) ai[c] *= corr;",
          "        for (int64_t c = 0; c < dv; c++) ai[c] *= 1.f;",
          "attention: the accumulator not rescaled when the running max grows", calls=("tg_attention",)),
    Fault("backends/c/runtime.c", "off[2] += idx * vb[i]; off[3] += idx * mb[i];", "off[2] += idx * vb[i];",
          "attention: the mask's batch strides ignored", calls=("tg_attention",)),
    Fault("backends/c/decode.c", "            memcpy((char *)cache + (size_t)((b * Hkv + h) * S + pos[b * pstride]) * row,",
          "            memcpy((char *)cache + (size_t)((b * Hkv + h) * S + pos[0]) * row,",
          "cache write: every sequence written at the first one's position", calls=("tg_cache_write",)),
    Fault("backends/c/blockq.c", "        float inv = (float)(1. / sqrt(ss / (double)n + (double)eps));",
          "        float inv = (float)(1. / sqrt(ss / (double)(n + 1) + (double)eps));", "rms_norm rows: a wrong mean",
          calls=("tg_rms_norm_rows",)),
    Fault("backends/c/blockq.c", "            out[j + 16] = ((w[2 + j] >> 4) - 8) * d;",
          "            out[j + 16] = ((w[2 + j] >> 4) - 7) * d;", "q4_0 dequantization: high nibbles off by one",
          calls=("tg_block_rows", "tg_block_matmul", "tg_block_matmul_f32", "tg_block_matmul_f32dq")),
    Fault("backends/c/blockq.c", "        for (int j = 0; j < 32; j++) out[j] = (int8_t)w[2 + j] * d;",
          "        for (int j = 0; j < 32; j++) out[j] = (uint8_t)w[2 + j] * d;", "q8_0 dequantization: codes read unsigned",
          calls=("tg_block_rows", "tg_block_matmul", "tg_block_matmul_f32", "tg_block_matmul_f32dq")),
    Fault("backends/c/blockq.c", "        float id = amax > 0.f ? 127.f / amax : 0.f;",
          "        float id = amax > 0.f ? 126.f / amax : 0.f;", "q8 activations (scalar kernels): a wrong inverse scale",
          calls=("tg_block_matmul",)),
    Fault("backends/c/decode.c", "        s[jj] = dot * scale;", "        s[jj] = dot;",
          "cache attention: the score scale dropped", calls=("tg_cache_attention",)),
    # --- the ONNX frontend -----------------------------------------------------------------------------
    Fault("frontends/onnx/nn.py", '    if n.attr("transB", 0):', '    if n.attr("transA", 0):',
          "Gemm: transB read as transA"),
    Fault("frontends/onnx/nn.py", 'y = n.op("add", y, c if beta == 1.0 else n.op("mul", c, beta))',
          'y = n.op("add", y, c)', "Gemm: beta ignored"),
    Fault("frontends/onnx/nn.py", 'lo = total // 2 if auto == "SAME_UPPER" else total - total // 2',
          'lo = total - total // 2 if auto == "SAME_UPPER" else total // 2', "auto_pad: SAME_UPPER and SAME_LOWER swapped"),
    Fault("frontends/onnx/nn.py", "n.op(\"mul\", total, alpha / size)", "n.op(\"mul\", total, alpha)",
          "LRN: alpha not divided by the window size"),
    Fault("frontends/onnx/layout.py", "    axis = axis + len(shape) if axis < 0 else axis  # in [-r, r]",
          "    axis = axis + len(shape) - 1 if axis < 0 else axis  # in [-r, r]", "Flatten: a negative axis off by one"),
    Fault("frontends/onnx/layout.py", '    perm = n.attr("perm", list(reversed(range(n.rank(x)))))',
          '    perm = n.attr("perm", list(range(n.rank(x))))', "Transpose: the default permutation is the identity"),
    Fault("frontends/onnx/layout.py", 'perm = (0, 3, 5, 1, 2, 4) if n.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)',
          'perm = (0, 1, 3, 5, 2, 4) if n.attr("mode", "DCR") == "DCR" else (0, 3, 5, 1, 2, 4)',
          "DepthToSpace: DCR and CRD swapped"),
    # --- the torch frontend (and the .pt2 allow-list) ------------------------------------------------
    Fault("frontends/torch_export/reductions.py", "    correction = 1 if correction is None else correction",
          "    correction = 0 if correction is None else correction", "var: the default correction 0"),
    Fault("frontends/torch_export/reductions.py", "    out = cv.g.log(cv.g.sum(cv.g.exp(x - m), axes, keepdims=True)) + m",
          "    out = cv.g.log(cv.g.sum(cv.g.exp(x - m), axes, keepdims=True))", "logsumexp: the max not added back"),
    Fault("frontends/torch_export/reductions.py",
          "    return shifted - cv.g.log(cv.g.sum(cv.g.exp(shifted), axis, keepdims=True))",
          "    return shifted - cv.g.log(cv.g.sum(cv.g.exp(shifted), axis, keepdims=False))",
          "log_softmax: the normalizer's axis dropped (broadcast the wrong way)"),
    Fault("frontends/torch_export/nn.py", "axis=-len(a.normalized_shape), epsilon=a.eps)", "axis=-1, epsilon=a.eps)",
          "layer_norm: only the last dim normalized"),
    Fault("frontends/pt2_archive.py", '        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:',
          "        if not isinstance(meta, dict):", ".pt2: pickled weights accepted"),
    Fault("frontends/pt2_archive.py", '        if m.group("name") and m.group("name") not in _NAMES:',
          "        if False:", ".pt2: names in sympy expressions not checked"),
    Fault("frontends/pt2_archive.py", "            if info.compress_type != zipfile.ZIP_STORED:", "            if False:",
          ".pt2: compressed members accepted"),
    # --- the GGUF frontend --------------------------------------------------------------------------
    Fault("frontends/gguf/llama.py", "raw.reshape(heads_to_unpermute, c.head_dim // 2, 2, -1).swapaxes(1, 2)",
          "raw.reshape(heads_to_unpermute, 2, c.head_dim // 2, -1).swapaxes(1, 2)",
          "llama Q/K rows: permuted the wrong way back"),
    Fault("frontends/gguf/llama.py", "np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim))",
          "np.arange(0, c.head_dim, 2, dtype=np.float64) / (c.head_dim - 2)))", "rotary frequencies: a wrong exponent"),
    Fault("frontends/gguf/llama.py", '"blk.0.attn_q.bias" in f.tensors, "blk.0.attn_q_norm.weight" in f.tensors,',
          'False, "blk.0.attn_q_norm.weight" in f.tensors,', "qwen2: the Q/K/V biases dropped"),
    Fault("frontends/gguf/llama.py", "scale=1.0 / float(np.sqrt(D)), window", "scale=1.0 / float(D), window",
          "attention scale: 1/D, not 1/sqrt(D)"),
    Fault("frontends/gguf/reader.py", "        if b.offset < a.offset + a.nbytes:", "        if b.offset < a.offset:",
          "reader: overlapping tensors accepted"),
    # --- quantize ---------------------------------------------------------------------------------
    Fault("passes/quantize/transform.py", "        combined = (np.float32(static[0]) * np.asarray(wscale, np.float32)).astype(np.float32)",
          "        combined = np.asarray(wscale, np.float32)", "w8a8 static: the activation scale left out"),
    Fault("passes/quantize/transform.py", '            return self.emit("mul", y, rs).results[0]', "            return y",
          "w8a8 dynamic: the row scales not applied"),
    Fault("passes/quantize/transform.py", 'acc = self.emit("matmul_integer", q, wq, zv).results[0]',
          'acc = self.emit("matmul_integer", q, wq).results[0]', "w8a8 static: the activation zero point ignored"),
    Fault("passes/quantize/transform.py", 'row_scales = sv if per_tensor else layer.emit("gather", sv, ids).results[0]',
          "row_scales = sv", "embedding tables: the row scales not gathered"),
    Fault("passes/quantize/observers.py", "zp = np.asarray(np.clip(np.rint(u8.lo - lo / scale), u8.lo, u8.hi))",
          "zp = np.asarray(np.clip(np.rint(u8.lo + lo / scale), u8.lo, u8.hi))", "asymmetric activations: zero point's sign"),
    Fault("passes/quantize/observers.py", "        better = err < best_err", "        better = err > best_err",
          "MSE observer: the worse scale kept"),
    # --- shard, partition and the simulated mesh --------------------------------------------------
    Fault("ir/shard.py", "            k = k * mesh[a] + c[a]", "            k = k + c[a]",
          "piece: a dim split over two mesh axes indexed wrong"),
    Fault("backends/simulated_mesh.py", "out[d] = np.concatenate(xs, axis=op.gather_axis.value.data)",
          "out[d] = np.concatenate(xs[::-1], axis=op.gather_axis.value.data)", "all_gather: pieces in reverse order"),
    Fault("backends/simulated_mesh.py", "out[d] = np.array_split(total, n, axis=op.scatter_axis.value.data)[pos]",
          "out[d] = np.array_split(total, n, axis=op.scatter_axis.value.data)[0]", "reduce_scatter: every device keeps the first slice"),
    Fault("passes/shard_strategies.py", 'return [Step("all_to_all", gathers[0][0], slices[0][1], gathers[0][1])]',
          'return [Step("all_to_all", gathers[0][0], gathers[0][1], slices[0][1])]', "reshard: all_to_all's dims swapped"),
    Fault("passes/partition.py", "    partial = tuple(sorted(a for d in loops.reduce for a in axes_of.get(d, ())))",
          "    partial = ()", "partition: a split reduction not all-reduced"),
    Fault("passes/shard_strategies.py", "        out[step.dim].append(step.axis)\n    else:",
          "        out[step.dim].insert(0, step.axis)\n    else:", "reshard: all_slice makes the new axis major"),
    # --- the compile cache and the caches' files (ir/cache.py) -------------------------------------
    Fault("ir/cache.py", "        return _digest_path(path).read_text().strip() == _digest_of(path)",
          "        return _digest_path(path).exists()", "cache: the digest not compared"),
    Fault("ir/cache.py", "        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or (hasattr(os, \"getuid\") and st.st_uid != os.getuid()):",
          "        if not stat.S_ISREG(st.st_mode):", "cache: an entry others can write (or own) trusted"),
    Fault("ir/cache.py", "    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):", "    if st.st_mode & stat.S_IWOTH:",
          "cache: a group-writable folder trusted"),
    Fault("ir/cache.py", "    os.chmod(made, 0o600)", "    os.chmod(made, 0o644)", "cache: entries written readable by others"),
    Fault("tilegraph/compile_cache.py", "    if not (cache.verified(path) and cache.verified(weights_path(path))):",
          "    if not cache.verified(path):", "compile cache: the weights' digest not checked"),
    Fault("tilegraph/compile_cache.py", "        h.update(f.name.encode() + b\"\\0\" + hashlib.sha256(f.read_bytes()).digest())",
          "        h.update(f.name.encode())", "compile-cache key: a companion file's bytes left out"),
    Fault("tilegraph/compile_cache.py", 'h = hashlib.sha256(f"{pipeline!r}\\0{hardware}\\0{_library_digest()}\\0".encode())',
          'h = hashlib.sha256(f"{hardware}\\0{_library_digest()}\\0".encode())', "compile-cache key: the pipeline left out"),
    Fault("tilegraph/compile_cache.py", "                if path.parent.resolve() not in file.parents:",
          "                if False:", "compile-cache key: reads external data outside the model's folder"),
]


def layer_of(path: str) -> str:
    if path.endswith(".c"):
        return "C runtime"
    for prefix, layer in LAYER_OF:
        if path.startswith(prefix):
            return layer
    return "passes and IR"


def copy_tree(dst: Path) -> None:
    # No .hypothesis: make test on a fresh checkout has no database of earlier failures either.
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build",
                                                             ".hypothesis", "fuzz-crashes"))


# A pytest plugin, loaded with -p into every suite run. "map": per-test line coverage of the
# faulted files (coverage.py, one dynamic context per test id), and per test the runtime
# functions (tg_*) named by the C modules it built. "select": run only the tests listed in a
# file, in collection order. Both: the C backend's compiled libraries in one cache shared by
# every run (its keys hold the runtime's and the module's source, so a faulted runtime.c or
# emitter builds its own), where each run would otherwise compile every module afresh.
PLUGIN = """
import json, os, re
import pytest

MODE = os.environ["FAULT_SEEDING_MODE"]
ROOT = os.environ["FAULT_SEEDING_ROOT"]
_called = {}
_current = [None]
if MODE == "map":
    import coverage
    _cov = coverage.Coverage(data_file=None, config_file=False, include=json.loads(os.environ["FAULT_SEEDING_FILES"]))
    _cov.start()
    # Code a test runs in a child Python process (a fresh compile, a CLI run) counts as that test's:
    # coverage's subprocess measurement (its .pth starts it in any Python that finds
    # COVERAGE_PROCESS_START), the test's id as the child's static context. Set only now, so this
    # process is measured by _cov alone.
    _SUB = os.environ["FAULT_SEEDING_MAP"] + ".sub"
    os.makedirs(_SUB, exist_ok=True)
    with open(os.path.join(_SUB, "coverage.ini"), "w") as f:
        f.write("[run]\\nparallel = True\\ndata_file = " + os.path.join(_SUB, ".coverage") +
                "\\ncontext = ${FAULT_SEEDING_CONTEXT}\\ninclude =\\n" +
                "".join("    " + p + "\\n" for p in json.loads(os.environ["FAULT_SEEDING_FILES"])))
    os.environ["COVERAGE_PROCESS_START"] = os.path.join(_SUB, "coverage.ini")


def pytest_configure(config):
    shared = os.environ.get("FAULT_SEEDING_C_CACHE")
    cache = os.environ.get("TILEGRAPH_CACHE_DIR")  # the suite's own (tests/conftest.py), set by now
    if shared and cache and not os.path.exists(os.path.join(cache, "c")):
        os.makedirs(cache, mode=0o700, exist_ok=True)
        os.symlink(shared, os.path.join(cache, "c"))
    if MODE == "map":
        from tilegraph.backends.c import runtime

        build = runtime.build

        def recording(source):
            if _current[0] is not None:
                _called.setdefault(_current[0], set()).update(re.findall(r"\\b(?:tg|bq)_\\w+", source))
            return build(source)

        runtime.build = recording


def pytest_collection_modifyitems(config, items):
    if MODE == "select":
        with open(os.environ["FAULT_SEEDING_TESTS"]) as f:
            keep = set(json.load(f))
        items[:] = [i for i in items if i.nodeid in keep]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    if MODE == "map":
        _cov.switch_context(item.nodeid)
        os.environ["FAULT_SEEDING_CONTEXT"] = item.nodeid
    yield


def pytest_sessionfinish(session):
    if MODE == "map":
        _cov.stop()
        data = _cov.get_data()
        lines = {}
        children = [coverage.CoverageData(basename=os.path.join(_SUB, n)) for n in sorted(os.listdir(_SUB))
                    if n.startswith(".coverage.")]
        for d in [data, *children]:
            if d is not data:
                d.read()
            for f in d.measured_files():
                mine = lines.setdefault(os.path.relpath(f, ROOT), {})
                for n, cs in d.contexts_by_lineno(f).items():
                    mine[n] = sorted(set(mine.get(n, ())) | {c for c in cs if c})
        with open(os.environ["FAULT_SEEDING_MAP"], "w") as f:
            json.dump({"lines": lines, "called": {t: sorted(n) for t, n in _called.items()}}, f)
"""


def run_suite(tree: Path, files: list[str], timeout: float, seed: int, env_extra: dict) -> tuple[bool, str]:
    """True if the test files pass on `tree`; else the first failing test's name."""
    shutil.rmtree(tree / ".hypothesis", ignore_errors=True)  # no failing examples carried from fault to fault
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree.parent.parent}", "HF_HUB_OFFLINE": "1",
           "FAULT_SEEDING_ROOT": str(tree), **env_extra}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "_fault_plugin",
           f"--hypothesis-seed={seed}", *([] if set(files) & WITH_SLOW else ["-m", "not slow"]), *files]
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    if p.returncode == 0:
        return True, ""
    if p.returncode == 5:  # no tests collected: nothing was selected
        return True, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", p.stdout, re.M)
    return False, failed[0] if failed else p.stdout.strip().splitlines()[-1:][0] if p.stdout.strip() else "error"


def lines_that_see(path: Path, old: str) -> range:
    """The lines a test must run for a fault at `old` to change what it computes: the body of the
    innermost function around it, or the whole file when the line runs at import (a rule table)."""
    text = path.read_text()
    first = text[:text.index(old)].count("\n") + 1
    last = first + old.count("\n")
    around = None
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body[0].lineno <= first \
                and last <= node.end_lineno:
            if around is None or node.body[0].lineno > around.body[0].lineno:
                around = node
    if around is None:
        return range(1, text.count("\n") + 2)
    return range(around.body[0].lineno, around.end_lineno + 1)


def _covering(coverage_map: dict, rel: str, lines) -> set[str]:
    seen = coverage_map["lines"].get(rel, {})
    return {t for n in lines for t in seen.get(str(n), ())}


def tests_that_see(coverage_map: dict, tree: Path, fault: Fault) -> list[str]:
    """A Python fault: the tests that ran the function around it. A C fault (runtime.c, blockq.c):
    the tests that built a module calling one of its entry points (`calls`), or ran a Python
    function of the C backend that calls one through ctypes."""
    if not fault.path.endswith(".c"):
        return sorted(_covering(coverage_map, fault.path, lines_that_see(tree / fault.path, fault.old)))
    tests = {t for t, names in coverage_map["called"].items() if set(fault.calls) & set(names)}
    for py in sorted((tree / "backends" / "c").glob("*.py")):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.FunctionDef) and any(f".{name}" in ast.unparse(node) for name in fault.calls):
                tests |= _covering(coverage_map, str(py.relative_to(tree)), range(node.body[0].lineno,
                                                                                  node.end_lineno + 1))
    return sorted(tests)


def parse_only(text: str | None) -> list[int]:
    if not text:
        return list(range(1, len(FAULTS) + 1))
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def _baseline(job: tuple[Path, tuple[str, ...], list[str], Path, int, float, str]) -> tuple[tuple[str, ...], bool, str, float]:
    tree, files, covered, out, seed, timeout, c_cache = job
    t = time.perf_counter()
    ok, why = run_suite(tree, list(files), timeout, seed, {
        "FAULT_SEEDING_MODE": "map", "FAULT_SEEDING_FILES": json.dumps([str(tree / f) for f in covered]),
        "FAULT_SEEDING_MAP": str(out), "FAULT_SEEDING_C_CACHE": c_cache})
    return files, ok, why, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="fault numbers, e.g. 1-8,12")
    ap.add_argument("--layers", help="only the faults of these layers (comma-separated names, as --list prints)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per suite run")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed, the same for every run")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="seconds: start no fault past this (the table counts those that ran)")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="suite runs at a time, each in its own copy of the tree")
    args = ap.parse_args()
    if args.list:
        for i, f in enumerate(FAULTS, 1):
            print(f"{i:2d} [{layer_of(f.path)}] {f.path}: {f.what}")
        return 0
    print("command:", " ".join(["python", "benchmarks/fault_seeding.py", *sys.argv[1:]]))
    stale = [i for i, f in enumerate(FAULTS, 1) if (ROOT / f.path).read_text().count(f.old) != 1]
    if stale:
        print(f"faults whose source line is gone or ambiguous (update them): {stale}")
    chosen = [i for i in parse_only(args.only) if i not in stale]
    if args.layers:
        wanted = {s.strip() for s in args.layers.split(",")}
        chosen = [i for i in chosen if layer_of(FAULTS[i - 1].path) in wanted]
    if not chosen:
        print("no faults chosen")
        return 2
    jobs = max(1, args.jobs)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trees = [Path(tmp) / f"tree{k}" / "tree" for k in range(jobs)]
        for tree in trees:
            copy_tree(tree)
        (Path(tmp) / "_fault_plugin.py").write_text(PLUGIN)
        c_cache = Path(tmp) / "c-cache"
        c_cache.mkdir(mode=0o700)
        # One baseline run per set of test files, with coverage of the faulted Python files (and of
        # the C backend's, whose functions call the runtime's entry points).
        suites = sorted({LAYERS[layer_of(FAULTS[i - 1].path)] for i in chosen})
        covered = sorted({FAULTS[i - 1].path for i in chosen if FAULTS[i - 1].path.endswith(".py")}
                         | ({str(p.relative_to(ROOT)) for p in (ROOT / "backends" / "c").glob("*.py")}
                            if any(FAULTS[i - 1].path.endswith(".c") for i in chosen) else set()))
        free: Queue = Queue()
        for tree in trees:
            free.put(tree)

        def baseline(k: int) -> tuple[tuple[str, ...], bool, str, float, Path]:
            tree = free.get()  # one run at a time in a tree
            try:
                out = Path(tmp) / f"map{k}.json"
                return (*_baseline((tree, suites[k], covered, out, args.seed, 4 * args.timeout, str(c_cache))), out)
            finally:
                free.put(tree)

        coverage_map: dict = {"lines": {}, "called": {}}
        with ThreadPoolExecutor(jobs) as pool:
            done = list(pool.map(baseline, range(len(suites))))
        # A layer whose baseline fails (or times out under load) cannot select its faults' tests:
        # its faults are not run; the layers whose baselines passed go on.
        no_baseline: set[int] = set()
        for files, ok, why, secs, out in done:
            print(f"baseline {' '.join(files)} (with per-test coverage): {'passes' if ok else 'FAILS: ' + why} "
                  f"({secs:.0f} s)", flush=True)
            if not ok:
                no_baseline |= {i for i in chosen if LAYERS[layer_of(FAULTS[i - 1].path)] == files}
                continue
            part = json.loads(out.read_text())
            for rel, lines in part["lines"].items():
                mine = coverage_map["lines"].setdefault(rel, {})
                for n, tests in lines.items():
                    mine[n] = sorted(set(mine.get(n, ())) | set(tests))
            for test, names in part["called"].items():
                coverage_map["called"][test] = sorted(set(coverage_map["called"].get(test, ())) | set(names))

        def one(i: int) -> tuple[int, str, str, int, float]:
            f = FAULTS[i - 1]
            tree = free.get()
            if args.time_limit and time.perf_counter() - t0 > args.time_limit:
                free.put(tree)
                return i, "not run", "", 0, 0.0
            try:
                path = tree / f.path
                original = path.read_text()
                tests = tests_that_see(coverage_map, tree, f)
                listing = tree.parent / "tests.json"
                listing.write_text(json.dumps(tests))
                path.write_text(original.replace(f.old, f.new, 1))
                t = time.perf_counter()
                try:
                    ok, why = run_suite(tree, list(LAYERS[layer_of(f.path)]), args.timeout, args.seed, {
                        "FAULT_SEEDING_MODE": "select", "FAULT_SEEDING_TESTS": str(listing),
                        "FAULT_SEEDING_C_CACHE": str(c_cache)})
                finally:
                    path.write_text(original)
            finally:
                free.put(tree)
            if f.equivalent and ok:
                verdict = "equivalent"
            else:  # a caught fault is not equivalent, whatever its note says
                verdict = "caught" if not ok else "ESCAPED"
            return i, verdict, why, len(tests), time.perf_counter() - t

        results: dict[int, str] = {i: "no baseline" for i in no_baseline}
        if no_baseline:
            print(f"not run (their layer's baseline failed): {','.join(map(str, sorted(no_baseline)))}")
        if no_baseline == set(chosen):
            return 2
        with ThreadPoolExecutor(jobs) as pool:
            for future in as_completed([pool.submit(one, i) for i in chosen if i not in no_baseline]):
                i, verdict, why, n, secs = future.result()
                f = FAULTS[i - 1]
                results[i] = verdict
                print(f"{i:2d} {verdict:10s} [{layer_of(f.path)}] {f.what} [{f.path}]"
                      f"{' by ' + why if verdict == 'caught' else ''} ({n} tests see it; {secs:.0f} s)", flush=True)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"CPU time of the suite runs: {cpu.ru_utime + cpu.ru_stime:.0f} s; wall {time.perf_counter() - t0:.0f} s "
          f"with {jobs} at a time; load average {os.getloadavg()[0]:.1f} (other work on the machine counts)")
    print(f"\n{'layer':16s} {'faults':>6s} {'equiv.':>6s} {'caught':>6s} {'escaped':>7s} {'score':>6s}   test files")
    skipped = [i for i in chosen if results[i] == "not run"]
    if skipped:
        print(f"not run (past --time-limit): {len(skipped)} faults, left out of the table: "
              f"{','.join(map(str, skipped))}")
    if no_baseline:
        print(f"not run (their layer's baseline failed): {len(no_baseline)} faults, left out of the table: "
              f"{','.join(map(str, sorted(no_baseline)))}")
    ran = [i for i in chosen if results[i] not in ("not run", "no baseline")]
    rows = [("all", ran)] + [(name, [i for i in ran if layer_of(FAULTS[i - 1].path) == name]) for name in LAYERS]
    for name, ids in rows[1:] + rows[:1]:
        if not ids:
            continue
        eq = sum(results[i] == "equivalent" for i in ids)
        caught = sum(results[i] == "caught" for i in ids)
        total = len(ids) - eq
        score = f"{100 * caught / total:.0f}%" if total else "-"
        listed = "" if name == "all" else " ".join(Path(x).name for x in LAYERS[name])
        print(f"{name:16s} {len(ids):6d} {eq:6d} {caught:6d} {total - caught:7d} {score:>6s}   {listed}")
    print("(score: caught of the non-equivalent faults; an equivalent fault, proven not to change any result, "
          "is left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
