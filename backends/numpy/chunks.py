"""Run a fused group's chunk loop on all cores (imported by emitted modules): the
NumPy backend's runtime, its thread pool and its control of BLAS's threads.

NumPy releases the GIL inside ufunc loops and BLAS calls, so chunks of a few
hundred KB each run truly in parallel on a thread pool.

BLAS runs single-threaded while a model runs (`single_threaded_blas`): the
backend parallelises GEMMs itself, a chunk of rows per thread with its epilogue
applied while the rows are in cache. One multi-threaded BLAS call followed by a
threaded epilogue is slower: BLAS's idle threads spin on the cores the epilogue needs.
"""

from __future__ import annotations

import itertools
import os
import threading
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable

import numpy as np

# Threads a compiled model uses: every core this process may run on, or TILEGRAPH_NUM_THREADS.
THREADS = max(1, int(os.environ.get("TILEGRAPH_NUM_THREADS") or 0) or (
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)))


class _Worker:
    """A daemon thread that runs one task per wake-up, handed over by two raw locks.

    A raw lock is a futex: releasing `go` wakes the thread with nothing allocated, the
    cheapest handoff CPython has. A fork/join through concurrent.futures (a Future,
    a queue, a Condition per call) costs several times as much, and MiniLM at batch 1
    has ~40 parallel loops per forward.
    """

    def __init__(self):
        self.go, self.done = threading.Lock(), threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.task = None
        self.error: BaseException | None = None
        threading.Thread(target=self._loop, name="tg-worker", daemon=True).start()

    def _loop(self):
        while True:
            self.go.acquire()
            try:
                self.task()
            except BaseException as e:  # handed to the caller by join()
                self.error = e
            finally:
                self.task = None
                self.done.release()

    def start(self, task) -> None:
        self.task, self.error = task, None
        self.go.release()

    def join(self) -> None:
        self.done.acquire()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


_workers: list[_Worker] = []
# One parallel loop at a time owns the workers; a second (another thread running a
# model meanwhile) runs its items on its own thread rather than wait.
_workers_lock = threading.Lock()


@lru_cache(maxsize=1)  # scanning the loaded libraries takes milliseconds; they do not change
def blas_libraries() -> tuple:
    """The BLAS libraries NumPy loaded (threadpoolctl controllers), or none without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - present wherever scikit-learn is
        return ()
    return tuple(ThreadpoolController().select(user_api="blas").lib_controllers)


class OneBlasThread:
    """BLAS on one thread while the kernel runs, so `threads` is the number of cores it
    uses. OpenBLAS otherwise starts its own threads for every block's small matmul,
    which spin on the cores our threads (or other processes) need: with OpenBLAS free,
    blocked attention on two threads ran at less than half the speed of pinned BLAS, and
    on a loaded machine ten times slower. The setting is
    process-wide: the first caller in saves it and the last one out restores it,
    so concurrent calls nest."""

    _lock = threading.Lock()
    _depth = 0
    _saved: list = []

    def __enter__(self):
        cls = type(self)
        with cls._lock:
            if cls._depth == 0:  # only libraries not on one thread already (the NumPy backend pins them)
                cls._saved = [(lib, n) for lib in blas_libraries() if (n := lib.num_threads) != 1]
                for lib, _ in cls._saved:
                    lib.set_num_threads(1)
            cls._depth += 1

    def __exit__(self, *exc):
        cls = type(self)
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0:
                for lib, n in cls._saved:
                    lib.set_num_threads(n)


def parallel_for(run, items: list, threads: int) -> None:
    """run(item) for every item, on `threads` threads: the caller and threads - 1 pool workers.

    Each thread pulls the next item from a shared counter (next() on itertools.count
    is atomic under the GIL), so uneven items balance themselves. Returns once every
    item is done (nothing still writes into the caller's arrays); re-raises the first
    exception. A call made while another is running (from `run`, or from another thread)
    runs its items on the calling thread alone.
    """
    counter = itertools.count()

    def worker():
        with np.errstate(all="ignore"):  # errstate is per thread; IEEE results are the semantics
            while (i := next(counter)) < len(items):
                run(items[i])

    helpers = min(threads, len(items)) - 1
    if helpers <= 0 or not _workers_lock.acquire(blocking=False):
        worker()
        return
    try:
        while len(_workers) < helpers:
            _workers.append(_Worker())
        for w in _workers[:helpers]:
            w.start(worker)
        try:
            worker()
        finally:
            errors = []
            for w in _workers[:helpers]:
                try:
                    w.join()
                except BaseException as e:
                    errors.append(e)
        if errors:
            raise errors[0]
    finally:
        _workers_lock.release()


def run_chunks(chunk: Callable[[slice], None], length: int, rows: int) -> None:
    """chunk(slice(i, i + rows)) for every i in range(0, length, rows), on all cores.

    `rows` comes from the tile pass, chosen at nominal sizes where dims are symbolic;
    at run time a chunk is never so big that a core gets no work.
    """
    rows = min(rows, -(-length // THREADS))
    if rows <= 0 or rows >= length:
        chunk(slice(0, length))
        return
    slices = [slice(i, min(i + rows, length)) for i in range(0, length, rows)]
    if THREADS == 1:
        for s in slices:
            chunk(s)
        return
    parallel_for(chunk, slices, THREADS)


# The one process-wide BLAS pin: re-entrant, shared with the attention kernel.
single_threaded_blas = OneBlasThread


@contextmanager
def blas_threads():
    """BLAS on THREADS threads for one whole GEMM inside a single_threaded_blas region (a
    group whose tile says `blas`: its GEMM is cheaper on BLAS's own threads, which share
    packed panels, than cut into chunks on ours), back to one after."""
    libraries = blas_libraries()
    for lib in libraries:
        lib.set_num_threads(THREADS)
    try:
        yield
    finally:
        for lib in libraries:
            lib.set_num_threads(1)
