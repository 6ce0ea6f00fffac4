"""Loading and calling an emitted C module.

`load` builds (or finds in the cache) the module's shared library and binds the
weights. A call checks the inputs against the signature (the project's one input
check, `ir.signature`) before any C runs, so a wrong call is a TilegraphError,
never a write outside a buffer. Per shape binding (the values of the symbolic
dims), it evaluates the module's int table once, plans every intermediate into one
arena (buffers whose lifetimes do not overlap share bytes) and creates the oneDNN
primitives; later calls with the same binding reuse all of it, so a forward
allocates nothing but its outputs.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping, cast

import numpy as np
import sympy

from tilegraph.backends.c.build import BuildError, build, sanitizer
from tilegraph.backends.c.emit import CProgram, emit_program, work
from tilegraph.backends.c.views import View
from tilegraph.ir import cache, dtypes
from tilegraph.ir.arena import ALIGN, lay_out
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.hardware import Neighbours
from tilegraph.ir.interpreter import GLOBALS, evaluate, run_time_sizes
from tilegraph.ir.model import Model, ModelError
from tilegraph.ir.ops import size_definitions
from tilegraph.ir.shapes import ShapeError, numel
from tilegraph.ir.signature import Signature, SizeConditions

# Shape bindings a compiled model keeps (each holds an arena and oneDNN primitives): a
# stranger's stream of distinct shapes grew a process by 650 MiB over 300 of them. A serving
# loop uses a few shapes; a ninth evicts the least recently used, which a later call remakes.
MAX_BINDINGS = 8
SERIAL_WORK = 20_000_000  # a forward of fewer FLOPs plus elements written runs on one thread (~0.2 ms)
# A call running this long reads its neighbours again at its next segment (_run): a few of a
# training step's segments, a hundred scheduler time slices, and 30 us of /proc reads each.
RECHOOSE_S = 0.1


class _Binding:
    """Everything one set of symbol values needs: ints, arena, pointers, primitives."""

    def __init__(self, module: "CompiledModel", sizes: dict[str, int]):
        prog = module.program
        em = prog.emitter
        module.conditions.check(sizes)  # every value's dims: non-negative integers, before any C runs
        subs = {sympy.Symbol(k, integer=True, positive=True): v for k, v in sizes.items()}
        self._subs = subs
        ints = [int(e.xreplace(subs)) for e in em.ints.exprs] or [0]
        if not all(-(2 ** 63) <= v < 2 ** 63 for v in ints):  # C's int64_t sizes, strides and offsets
            at = ", ".join(f"{k}={v}" for k, v in sizes.items()) or "its sizes"
            raise ModelError(f"at {at}, a size, stride or offset of the C module does not fit 64 bits "
                             f"({max(ints, key=abs)})")
        self.ints = np.array(ints, dtype=np.int64)
        self.bases: list[np.ndarray | None] = list(module.fixed)
        elements = [int(sympy.sympify(b.elements).xreplace(subs)) for b in em.buffers]
        self._check_extents(module, elements)
        self._elements = elements
        self._offsets, self.arena_bytes = _plan_arena(module, elements)
        for i, buf in enumerate(em.buffers):  # made once per binding by the steps marked `once`
            if buf.storage == "folded":
                self.bases[i] = np.empty(elements[i], dtypes.numpy_dtype(buf.dtype))
        self.pointers = (ctypes.c_void_p * len(em.buffers))()
        for i, base in enumerate(self.bases):
            if base is not None:
                self.pointers[i] = base.ctypes.data
        # The oneDNN primitives and kernels' state, per thread count: a primitive is made for the
        # threads OpenMP gives when it is made, and runs that many whatever the caller set later
        # (a convolution made for 2 threads, run while a neighbour takes a core, still waits at
        # its barriers for the second thread).
        self.states: dict[int, int] = {}
        # Less work than this runs on one thread: waking the other threads for each kernel
        # (they sleep between calls) costs more than they save.
        work = sympy.sympify(sympy.sympify(module.work).xreplace(subs))
        self.serial = bool(work.is_number and work < SERIAL_WORK)
        self._arrays: dict[int, np.ndarray] = {}  # id(view) -> its array (views live as long as the program)
        outputs = module._outputs
        self.out_shapes = {i: (self.shape(outputs[i].shape), dtypes.numpy_dtype(outputs[i].dtype))
                           for i in module._direct}
        self.out_views: dict[int, np.ndarray] = {}
        self.arena = np.empty(0, np.uint8)
        self.generation = -1
        self.lay_out(module)

    def lay_out(self, module: "CompiledModel") -> None:
        """Points the temporaries into the arena: this binding's own, or (module.workspace) the one
        the modules sharing it take turns on, laid out again after it grew."""
        em, size = module.program.emitter, self.arena_bytes
        try:
            if module.workspace is not None:
                self.arena, self.generation = module.workspace.reserve(size + ALIGN, self)
            else:
                self.arena = np.empty(size + ALIGN, dtype=np.uint8)
        except (MemoryError, ValueError) as e:  # ValueError: past NumPy's largest array
            at = ", ".join(f"{k}={v}" for k, v in self._subs.items()) or "its sizes"
            raise ModelError(f"the C module's intermediates need {size:,} bytes at {at}: {e}") from None
        start = (-self.arena.ctypes.data) % ALIGN
        for i, off in self._offsets.items():
            dt = dtypes.numpy_dtype(em.buffers[i].dtype)
            n = self._elements[i]
            # Under a sanitizer each temp is an allocation of its own, so that AddressSanitizer
            # sees its bounds (inside one arena, a write past a buffer lands in its neighbour).
            base = np.empty(n, dt) if sanitizer() else self.arena[start + off: start + off + n * dt.itemsize].view(dt)
            self.bases[i] = base
            self.pointers[i] = base.ctypes.data
        # Outputs copied out of the arena, a weight or a constant: their views, made once per lay-out.
        self.out_views = {i: self.view(v) for i, v in enumerate(module._outputs)
                          if v.literal is None and i not in module._direct and self.bases[v.buf] is not None}

    def _release(self) -> None:
        """Drops every view of the shared arena (the Workspace is about to replace it): laid out
        again before this binding's next call."""
        for i in self._offsets:
            self.bases[i] = None
        self._arrays.clear()
        self.out_views = {}
        self.arena = np.empty(0, np.uint8)
        self.generation = -1

    def _check_extents(self, module: "CompiledModel", elements: list[int]) -> None:
        """Every view the program reads or writes lies inside its buffer at these sizes: checked
        once per binding, so that no C kernel is handed an extent past its memory."""
        at = lambda: ", ".join(f"{k}={v}" for k, v in self._subs.items()) or "its sizes"  # noqa: E731
        for i, n in enumerate(elements):
            if n < 0:
                raise ModelError(f"at {at()}, buffer {i} of the C module would hold {n} elements")
        memo: dict = {}

        def value(e) -> int:
            if isinstance(e, int):
                return e
            if e not in memo:
                memo[e] = int(sympy.sympify(e).xreplace(self._subs))
            return memo[e]

        for v in module.views:
            ints = [value(e) for e in (v.offset, *v.shape, *v.strides)]
            offset, shape, strides = ints[0], ints[1:1 + v.rank], ints[1 + v.rank:]
            if any(d < 0 for d in shape):
                raise ModelError(f"at {at()}, a view of the C module's buffer {v.buf} would have shape {shape}")
            if 0 in shape:
                continue
            low = offset + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
            high = offset + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
            if low < 0 or high >= elements[v.buf]:
                raise ModelError(f"at {at()}, a view of the C module (shape {shape}, offset {offset}, strides "
                                 f"{strides}) reaches elements [{low}, {high}] of buffer {v.buf}, which holds "
                                 f"{elements[v.buf]}")

    def shape(self, dims) -> tuple[int, ...]:
        """Concrete sizes of symbolic dims under this binding."""
        return tuple(int(sympy.sympify(d).xreplace(self._subs)) for d in dims)

    def array(self, v: View, per_call: set[int]) -> np.ndarray:
        """view(v), made once per binding where v's buffer is the binding's own (an
        input's or a direct output's array changes every call)."""
        if v.buf in per_call:
            return self.view(v)
        a = self._arrays.get(id(v))
        if a is None:
            a = self._arrays[id(v)] = self.view(v)
        return a

    def view(self, v: View) -> np.ndarray:
        if v.literal is not None:
            raise ModelError("a literal has no array")
        base = self.bases[v.buf]
        ints = lambda e: int(sympy.sympify(e).xreplace(self._subs))  # noqa: E731
        shape = tuple(ints(d) for d in v.shape)
        offset = ints(v.offset)
        if all(shape):  # as_strided checks nothing: the elements the view reaches lie in its buffer
            reach = [(n - 1) * ints(s) for n, s in zip(shape, v.strides)]
            if offset + sum(r for r in reach if r < 0) < 0 or offset + sum(r for r in reach if r > 0) >= base.size:
                raise ModelError(f"a view of the C module reaches outside its buffer {v.buf} ({base.size} elements)")
        strides = tuple(ints(s) * base.itemsize for s in v.strides)
        flat = base.reshape(-1)[offset:]
        if flat.dtype.type.__module__ == "numpy":
            return np.lib.stride_tricks.as_strided(flat, shape, strides, writeable=True)
        # ml_dtypes' types (bf16, fp8, fp4) have no strided-view support: stride the bytes.
        raw = np.lib.stride_tricks.as_strided(flat.view(f"u{base.itemsize}"), shape, strides, writeable=True)
        return raw.view(flat.dtype)


class Workspace:
    """One arena for C modules that run one after another, never at once (a training step's
    segments, forward then backward, then the optimizer): each binding lays its temporaries out
    at its start, so the modules together hold the largest one's arena, not the sum of them all.
    Growing it (a module with a larger arena binds) drops the others' views of the old one (they
    lay out again at their next call) before the new one is made: the old bytes are freed first.
    Pass it to each module's load (`tilegraph.compile(..., target="c", workspace=w)`); their calls
    take turns on its lock."""

    def __init__(self) -> None:
        self.array = np.empty(0, np.uint8)
        self.generation = 0
        self.lock = threading.Lock()
        self._users: weakref.WeakSet = weakref.WeakSet()

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def reserve(self, nbytes: int, user: "_Binding") -> tuple[np.ndarray, int]:
        """The arena (at least `nbytes`) and its generation, for `user` to lay out in."""
        if nbytes > self.array.nbytes:
            for other in list(self._users):
                other._release()
            self.array = np.empty(0, np.uint8)  # the old arena freed before the new one is made
            self.array = np.empty(nbytes, np.uint8)
            self.generation += 1
        self._users.add(user)
        return self.array, self.generation


def _plan_arena(module: "CompiledModel", elements: list[int]) -> tuple[dict[int, int], int]:
    """Byte offsets of the temporaries (ir/arena.py's layout: first fit, largest first, among the
    buffers whose lifetimes, first write to last read in steps, overlap) and the arena's bytes."""
    em = module.program.emitter
    sizes = {i: elements[i] * dtypes.numpy_dtype(em.buffers[i].dtype).itemsize for i in module.lifetimes}
    return lay_out(sizes, module.lifetimes, ALIGN)  # type: ignore[return-value]


class CompiledModel:
    """A loaded C module: call it with the model inputs, get the list of outputs."""

    def __init__(self, program: CProgram, library: ctypes.CDLL, weights: Mapping[str, np.ndarray], model: Model,
                 precision: str = "f32", workspace: Workspace | None = None):
        self.program = program
        self.source = program.source
        self.model = model
        self.input_names = list(model.input_names)
        self.output_names = list(model.output_names)
        self._signature = Signature.of(model)
        self._lib = library
        self.workspace = workspace
        # one binding's arena is shared, and so is a workspace's among its modules: calls take turns
        self._lock = workspace.lock if workspace is not None else threading.Lock()
        em = program.emitter
        # The caller's arrays, weights and constants are read, never written; an input the model
        # donates (Model.aliases: a KV cache) is written where it lies.
        for step in program.steps:
            kept = sorted(b for b in step.writes
                          if em.buffers[b].storage in ("input", "weight", "constant") and b not in em.donated)
            if kept:
                b = em.buffers[kept[0]]
                raise ModelError(f"the C module would write into {b.storage} {b.index!r} at `{step.comment}`; a compiled "
                                 "model never writes into an array it is given")
        self.fixed: list[np.ndarray | None] = []
        for b in em.buffers:
            if b.storage == "weight":
                if b.index not in weights:
                    raise ModelError(f"weights missing for the compiled model: {b.index}")
                array = _c_array(weights[b.index], dtypes.numpy_dtype(b.dtype))
                if sympy.sympify(b.elements) != array.size:  # C would read past it, or stop short
                    raise ModelError(f"weight '{b.index}' has shape {array.shape}, {array.size} elements; the "
                                     f"model's has {b.elements}")
                self.fixed.append(array)
            elif b.storage == "constant":
                self.fixed.append(_c_array(em.constants[b.index], dtypes.numpy_dtype(b.dtype)))
            else:
                self.fixed.append(None)
        # An output that is a whole intermediate buffer is written straight into a fresh
        # array of the caller's (no arena bytes, no copy); other outputs are copied out.
        self._direct = _direct_outputs(program)  # output index -> its buffer
        self.lifetimes = {b: t for b, t in _lifetimes(program).items() if b not in self._direct.values()}
        self._outputs = em.outputs()
        # Inputs a step updates in place (a KV cache, donated: Model.aliases): the
        # caller's own array is written, so it must reach C uncopied; an output that is such
        # an input whole is that array, returned as given (copying a cache out per token
        # would cost what the in-place write saves).
        self._donated = {int(em.buffers[i].index or 0) for i in em.donated}  # (an input's index is its position)
        self._aliased = {i: v.buf for i, v in enumerate(self._outputs)
                         if v.literal is None and v.buf in em.donated and em.is_contiguous(v)
                         and sympy.sympify(v.offset) == 0 and sympy.expand(
                             sympy.sympify(numel(v.shape)) - em.buffers[v.buf].elements) == 0}
        self._inputs = [(i, b.index) for i, b in enumerate(em.buffers) if b.storage == "input"]
        self._per_call = [i for i, _ in self._inputs] + list(self._direct.values())  # buffers each call binds
        self._per_call_set = set(self._per_call)
        self._segments = {}
        for kind, k in program.plan:
            if kind == "segment":
                fn = getattr(library, f"tg_segment_{k}")
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
                fn.restype = ctypes.c_int
                self._segments[k] = fn
        library.tg_state_new.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        library.tg_state_new.restype = ctypes.c_void_p
        library.tg_packs_new.restype = ctypes.c_void_p
        library.tg_state_free.argtypes = [ctypes.c_void_p]
        library.tg_state_free.restype = None
        library.tg_state_own_bytes.argtypes = [ctypes.c_void_p]
        library.tg_state_own_bytes.restype = ctypes.c_size_t
        self._packs = library.tg_packs_new()  # this model's packed weights, filled by its first binding
        if not self._packs:
            raise ModelError("out of memory creating the C module's weight table")
        library.tg_error.restype = ctypes.c_char_p
        library.tg_max_threads.restype = ctypes.c_int
        library.tg_primitive_count.restype = ctypes.c_int
        library.tg_primitive_report.restype = ctypes.c_char_p
        library.tg_bf16_supported.restype = ctypes.c_int
        library.tg_reorder_count.restype = ctypes.c_int
        library.tg_huge_page_bytes.restype = ctypes.c_size_t
        # The GEMMs' and convolutions' products: "f32", or "bf16" (f32 accumulation) where the
        # processor has bf16 units; asked for elsewhere, f32 with a warning.
        self.precision = precision
        if precision == "bf16" and not library.tg_bf16_supported():
            warnings.warn("precision='bf16': this processor has no bf16 dot products (AVX-512 BF16 or AMX); "
                          "the C module runs in f32", RuntimeWarning, stacklevel=3)
            self.precision = "f32"
        # The oneDNN primitives of every binding so far (made at its first call), one line
        # each with the implementation oneDNN chose; those on its reference kernel apart.
        self.primitives: list[str] = []
        self.reference_kernels: list[str] = []
        # The steps' chained convolution buffers (emit.py's chain_convolutions).
        self.chained_buffers = program.chained
        self.work = work(model)  # the forward's FLOPs and the elements it writes
        self._bindings: OrderedDict[tuple, _Binding] = OrderedDict()  # least recently used first
        self.conditions = SizeConditions.of(model)
        # Every view a kernel or host step touches, for each binding's extent check.
        self.views = list({id(v): v for v in (*em.views.values(), *em.outputs(),
                                               *(x for s in program.steps for x in (*s.host_in, *s.host_out)))
                           if v.literal is None and v.buf is not None}.values())
        self.last_threads = 0  # the threads the last call started with (_uncontended_threads)
        self.segment_threads: list[int] = []  # the threads each native segment of the last call ran on
        # Whether a call leaves the cores busy neighbours hold to them (_uncontended_threads), or
        # runs on every thread whatever else runs: what a calibration of the team times (its
        # "all threads" GEMMs ran on one, priced the models' GEMMs at half their rate).
        self.adaptive_threads = True
        self._run_time_sizes = any(size_definitions(op) for op in model.func.body.block.ops)

    def __call__(self, *inputs: Any, **named: Any) -> list[np.ndarray]:
        if named and inputs:
            raise ShapeError("give the inputs either all by position or all by name")
        arrays, sizes = self._signature.bind(named if named else inputs)
        known = {}
        if self._run_time_sizes:  # dims known only at run time: found first, then planned as any binding
            sizes, known = run_time_sizes(self.model, arrays, sizes)
        arrays = [_c_array(a) for a in arrays]
        for j in self._donated:
            given = named.get(self.input_names[j]) if named else inputs[j] if j < len(inputs) else None
            if arrays[j] is not given or not arrays[j].flags.writeable:
                spec = self.model.inputs[j]
                raise ModelError(f"input '{self.input_names[j]}' is updated in place (a cache): pass a writable, "
                                 f"C-contiguous numpy array of {spec.dtype} (np.require(a, dtype, 'CAW')), "
                                 "which the call then writes")
        with self._lock:
            return self._run(arrays, sizes, known)

    def reorder_count(self) -> int:
        """oneDNN reorders run so far in this process (layout or precision conversions around
        the primitives): a test reads it to see what chaining saves."""
        return int(self._lib.tg_reorder_count())

    def huge_page_bytes(self) -> int:
        """Bytes of packed weights and reorder scratch this process put on transparent huge
        pages (runtime.c, tg_alloc_big; numpy advises the arena's own): 0 where the kernel
        offers none or no such buffer spans a huge page."""
        return int(self._lib.tg_huge_page_bytes())

    def scratch_bytes(self) -> int:
        """Bytes of reorder scratch the oneDNN primitives of every binding allocated for
        themselves, outside the arena the memory plan counts (runtime.c, tg_reorder_step): 0
        where each GEMM's B reordered each run has its bytes in the arena (onednn.py,
        _repack_scratch) and no layout needed a reorder around the reference kernel."""
        return sum(int(self._lib.tg_state_own_bytes(state)) for b in self._bindings.values()
                   for state in b.states.values())

    def set_threads(self, n: int) -> None:
        """OpenMP's thread count for this process's C modules (one pool serves them all)."""
        self._lib.tg_set_threads(int(n))

    def _binding(self, sizes: dict[str, int]) -> _Binding:
        key = tuple(sorted(sizes.items()))
        b = self._bindings.get(key)
        if b is None:
            b = self._bindings[key] = _Binding(self, sizes)
            while len(self._bindings) > MAX_BINDINGS:  # the least recently used goes, arena and primitives
                _, old = self._bindings.popitem(last=False)
                for state in old.states.values():
                    self._lib.tg_state_free(state)
                old.states.clear()
        else:
            self._bindings.move_to_end(key)
        return b

    def _run(self, arrays: list[np.ndarray], sizes: dict[str, int], known: dict | None = None) -> list[np.ndarray]:
        b = self._binding(sizes)
        if self.workspace is not None and b.generation != self.workspace.generation:
            b.lay_out(self)  # the shared arena grew (another module's binding) since this one's last call
        for i, index in self._inputs:
            b.bases[i] = arrays[index]
            b.pointers[i] = arrays[index].ctypes.data
        fresh = {}
        for i, buf in self._direct.items():
            shape, dtype = b.out_shapes[i]
            try:
                fresh[i] = np.empty(shape, dtype)
            except (MemoryError, ValueError) as e:
                raise ModelError(f"output {self.output_names[i]} would be {shape}: {e}") from None
            b.bases[buf] = fresh[i].reshape(-1)
            b.pointers[buf] = fresh[i].ctypes.data
        threads = self._lib.tg_max_threads()
        adaptive = self.adaptive_threads and not b.serial

        def choose() -> int:
            return 1 if b.serial else _uncontended_threads(threads) if adaptive else threads
        # A call re-reads its neighbours between segments (emit.LONG_WORK) once RECHOOSE_S have
        # passed: what ran when a training step of seconds began says little of its later
        # layers. Not where convolutions chain: a kernel made for another team may block its
        # buffer otherwise.
        rechoose = choose if adaptive and not self.chained_buffers else None
        use = choose()
        self.last_threads = use
        self.segment_threads = []
        try:
            return self._run_native(b, use, sizes, known, fresh, rechoose)
        finally:
            self._lib.tg_set_threads(threads)

    def _state(self, b: _Binding, threads: int, sizes: dict[str, int], known: dict | None) -> int:
        """The binding's kernels and primitives made for `threads` (made now, the first time)."""
        ints = b.ints.ctypes.data
        state = b.states.get(threads)
        if state is None:
            first = not b.states
            if first:
                for kind, k in self.program.plan:  # weights' dequantizations first: the kernels pack them
                    if kind == "host" and self.program.steps[k].once:
                        self._host(self.program.steps[k], b, sizes, known or {})
            made = self._lib.tg_primitive_count()
            self._lib.tg_set_bf16(int(self.precision == "bf16"))  # for this module's primitives only
            try:
                state = self._lib.tg_state_new(self._packs, ints, b.pointers)
            finally:
                self._lib.tg_set_bf16(0)
            if not state:
                raise ModelError(f"the C module could not prepare its kernels: {self._error()}")
            b.states[threads] = state
            if first:  # the same primitives again, for fewer threads
                self._note_primitives(self._lib.tg_primitive_count() - made)
        return state

    def _run_native(self, b: _Binding, threads: int, sizes: dict[str, int], known: dict | None,
                    fresh: dict, rechoose: Callable[[], int] | None = None) -> list[np.ndarray]:
        ints = b.ints.ctypes.data
        self._lib.tg_set_threads(threads)
        state = self._state(b, threads, sizes, known)
        chosen = time.monotonic()
        bf16 = self.precision == "bf16"
        if bf16:  # the kernels calling oneDNN's GEMMs at run time (attention) multiply in bf16 too
            self._lib.tg_set_run_bf16(1)
        try:
            for kind, k in self.program.plan:
                if kind == "segment":
                    if rechoose is not None and self.segment_threads and time.monotonic() - chosen >= RECHOOSE_S:
                        chosen, use = time.monotonic(), rechoose()
                        if use != threads:
                            threads = use
                            self._lib.tg_set_threads(threads)
                            state = self._state(b, threads, sizes, known)
                    self.segment_threads.append(threads)
                    if self._segments[k](state, ints, b.pointers):
                        raise ModelError(self._run_error())
                elif not self.program.steps[k].once:
                    self._host(self.program.steps[k], b, sizes, known or {})
        finally:
            if bf16:
                self._lib.tg_set_run_bf16(0)
        outs: list[np.ndarray] = []
        for i, v in enumerate(self._outputs):
            if i in self._aliased:  # state updated in place: its buffer is always bound
                outs.append(cast(np.ndarray, b.bases[self._aliased[i]]))
                continue
            outs.append(fresh[i] if i in fresh else _literal_array(v, b) if v.literal is not None else
                        np.array(b.out_views[i] if i in b.out_views else b.view(v)))
        for i in self._per_call:  # the caller's arrays are not the module's to keep
            b.bases[i] = None
        return outs

    def _note_primitives(self, new: int) -> None:
        """Records the oneDNN primitives a binding just made (`primitives`: kind, source dims,
        the implementation oneDNN chose) and warns of those on oneDNN's reference kernel
        (`reference_kernels`): no layout was found that a fast kernel takes, and such a kernel
        runs 10-1000x slower."""
        if new <= 0:
            return
        lines = (self._lib.tg_primitive_report() or b"").decode(errors="replace").splitlines()[-new:]
        self.primitives += lines
        refs = [line for line in lines if line.split(" source: ")[-1].startswith("ref")]
        if refs:
            self.reference_kernels += refs
            warnings.warn(f"{len(refs)} oneDNN primitive(s) of this C module run on oneDNN's reference kernel "
                          f"(slow): {'; '.join(refs[:4])}{' ...' if len(refs) > 4 else ''}", RuntimeWarning,
                          stacklevel=4)

    def _host(self, step, b: _Binding, sizes: dict[str, int], known: dict) -> None:
        results = known.get(step.host_op)
        if results is None:
            operands = [b.array(v, self._per_call_set) if v.literal is None else _literal_array(v, b)
                        for v in step.host_in]
            try:
                results = evaluate(step.host_op, operands, {}, {**GLOBALS, **sizes}, float64=False)
            except (IndexError, ValueError, TypeError, ZeroDivisionError, MemoryError) as e:
                # Inputs valid for the signature that the model's own computation cannot take (a
                # position past its table): name the op and what the host ran for it.
                op = step.host_op
                raise ModelError(f"the model cannot run on these inputs, at `{step.comment}`, run on the host as "
                                 f"`{op.SPEC.numpy if isinstance(op.SPEC.numpy, str) else op.op_name}`: {e}") from None
        for out, value in zip(step.host_out, results):
            target = b.array(out, self._per_call_set)
            np.copyto(target, np.asarray(value).astype(target.dtype, copy=False))

    def _run_error(self) -> str:
        """What a failed native call reports, at the step that refused its inputs (an index
        past a table) where the kernel named it, as a host step's error does."""
        message = self._error()
        step = re.search(r" \(step (\d+)\)$", message)
        if step is None or int(step.group(1)) >= len(self.program.steps):
            return f"running the C module: {message}"
        return (f"the model cannot run on these inputs, at `{self.program.steps[int(step.group(1))].comment}`: "
                f"{message[:step.start()]}")

    def _error(self) -> str:
        return (self._lib.tg_error() or b"").decode(errors="replace")

    def __repr__(self) -> str:
        return f"CompiledModel[c]({', '.join(self.input_names)} -> {', '.join(self.output_names)})"


CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_NEIGHBOURS = Neighbours()


def _uncontended_threads(threads: int) -> int:
    """The threads a forward starts with: at most `threads`, and no more than the cores other
    processes keep busy leave free (hardware.Neighbours). A team of
    OpenMP threads moves in lockstep, every parallel region ending in a barrier, and oneDNN
    splits each kernel evenly among them: one thread waiting for a core stalls the whole
    team at every barrier, a scheduler time slice each. With another process busy on one
    of 2 cores, MiniLM b8 on 2 threads ran 8.5x its quiet time (onnxruntime 3.1x, its pool
    lending work to whichever thread runs)."""
    if threads <= 1:
        return threads
    return max(1, min(threads, CORES - _NEIGHBOURS.cores()))


def _c_array(a, dtype=None) -> np.ndarray:
    """`a` as C reads it, copied if it is not already: C-contiguous and aligned to its itemsize
    (an array from np.frombuffer at an odd offset is contiguous but not aligned: the C loops'
    vector loads assume alignment), of `dtype` in native byte order where one is given."""
    return np.require(a, dtype, ("C", "A"))


def _literal_array(v: View, b: _Binding) -> np.ndarray:
    return np.full(b.shape(v.shape), v.value, dtypes.numpy_dtype(v.dtype))


def _direct_outputs(program: CProgram) -> dict[int, int]:
    """Output index -> its buffer, for the outputs written straight into a fresh array of the
    caller's: a whole intermediate buffer (no arena bytes, no copy); the others are copied out."""
    em = program.emitter
    direct: dict[int, int] = {}
    for i, v in enumerate(em.outputs()):
        if (v.literal is None and em.buffers[v.buf].storage == "temp" and v.buf not in direct.values()
                and sympy.sympify(v.offset) == 0 and em.is_contiguous(v)
                and sympy.expand(sympy.sympify(numel(v.shape)) - em.buffers[v.buf].elements) == 0):
            direct[i] = v.buf  # type: ignore[assignment]
    return direct


def call_bytes(program: CProgram, sizes: Mapping[str, int] | None = None) -> tuple[int, int]:
    """(arena bytes, output bytes) one call of `program` holds at its end, at `sizes` (a symbolic dim
    not given: 1): the arena its binding lays out (`_plan_arena`) and the outputs' arrays, those
    written straight into their own and those copied out of the arena while it is still held."""
    em = program.emitter
    subs = {sympy.Symbol(k, integer=True, positive=True): v for k, v in (sizes or {}).items()}

    def count(e) -> int:
        e = sympy.sympify(e).xreplace(subs)
        return int(e.subs({s: 1 for s in e.free_symbols}))

    direct = _direct_outputs(program)
    lifetimes = {b: t for b, t in _lifetimes(program).items() if b not in direct.values()}
    sizes_of = {i: count(em.buffers[i].elements) * dtypes.numpy_dtype(em.buffers[i].dtype).itemsize for i in lifetimes}
    arena = lay_out(sizes_of, lifetimes, ALIGN)[1]
    outputs = sum(count(numel(v.shape)) * dtypes.numpy_dtype(v.dtype).itemsize for v in em.outputs())
    return arena, outputs


def planned_bytes(module) -> int:
    """The bytes a call of `module` (already fused for this backend) holds at its end, as emitted:
    arena and outputs (`call_bytes`). What the recompute pass prices a C budget with (ir/arena.py)."""
    return sum(call_bytes(emit_program(Model(module)), None))


def _lifetimes(program: CProgram) -> dict[int, tuple[int, int]]:
    """Temp buffer -> (first step writing it, last step reading it); outputs live to the end."""
    em = program.emitter
    live: dict[int, list[int]] = {}
    for i, step in enumerate(program.steps):
        for buf in step.writes:
            if em.buffers[buf].storage == "temp":
                live.setdefault(buf, [i, i])[1] = i
        for buf in step.reads:
            if buf in live:
                live[buf][1] = max(live[buf][1], i)
    end = len(program.steps)
    for v in em.outputs():
        if v.buf in live:
            live[v.buf][1] = end
    for i, buf in enumerate(em.buffers):   # type: ignore[assignment]  # a temp no step writes (never happens) still gets bytes
        if buf.storage == "temp" and i not in live:  # type: ignore[attr-defined]
            live[i] = [0, end]
    return {k: (a, z) for k, (a, z) in live.items()}


_LOADED: dict[str, ctypes.CDLL] = {}


def _passive_openmp() -> None:
    """OpenMP threads that wait by sleeping, not spinning, unless the user chose: read once,
    when libgomp loads with the first module. A spinning worker on a machine whose cores
    other processes also use takes the core the next step needs: MiniLM ran 25x slower at
    a load of 2 on 2 cores. A sleeping one costs a wake-up per parallel region instead."""
    if not any(v in os.environ for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
# The program emit() made last, by its source: load() needs its buffer table too, and
# re-emitting it would drop the name= emit() was given (the sources would then differ).
_emitted: dict[str, tuple[Model, CProgram]] = {}


def remember(model: Model, program: CProgram) -> str:
    _emitted.clear()
    _emitted[program.source] = (model, program)
    return program.source


PRECISIONS = ("f32", "bf16")


def load(source: str, weights: Mapping[str, np.ndarray], model: Model | None = None,
         threads: int | None = None, precision: str = "f32", workspace: Workspace | None = None) -> CompiledModel:
    """Build (or find in the cache) the module's library and bind its weights. `threads`
    caps the OpenMP threads its kernels and oneDNN use (default: OpenMP's, one per core).
    `precision="bf16"`: GEMMs and convolutions multiply in bf16 on the processor's AMX or
    AVX-512 BF16 units, accumulating in f32, and attention's products too; an activation only such
    GEMMs read is stored in bf16 by its producer; everything else stays f32. `workspace`: a Workspace
    whose one arena this module's temporaries share with the other modules given it."""
    if precision not in PRECISIONS:
        raise TilegraphError(f"precision= must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise TilegraphError(f"threads= must be a positive integer, got {threads!r}")
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TilegraphError(f"workspace= must be a tilegraph.backends.c.runtime.Workspace, got {type(workspace).__name__}")
    if model is None:
        raise TilegraphError("the C backend loads a module with the model it was emitted from (load(source, "
                             "weights, model))")
    last = _emitted.get(source)
    # Only from the same model: two models of one source may differ in constants, which
    # the program holds as data, not text.
    program = last[1] if last is not None and last[0] is model else emit_program(model)
    if program.source != source:
        raise TilegraphError("this C source was not emitted from this model")
    path = str(build(source))
    library = _LOADED.get(path)
    if library is None:
        _passive_openmp()
        try:
            library = ctypes.CDLL(path)
        except OSError:  # a module that does not load (its digest matched: a half-written build) is rebuilt once
            cache.remove(Path(path))
            path = str(build(source))
            try:
                library = ctypes.CDLL(path)
            except OSError as e:
                raise BuildError(f"the C module built at {path} does not load: {e}") from None
        _LOADED[path] = library
    compiled = CompiledModel(program, library, weights, model, precision, workspace)
    if threads is not None:
        compiled.set_threads(threads)
    return compiled
