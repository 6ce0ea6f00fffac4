"""Run a fused group's chunk loop on all cores (imported by emitted modules).

NumPy releases the GIL inside ufunc loops and BLAS calls, so chunks of a few
hundred KB each run truly in parallel on a thread pool.

BLAS runs single-threaded while a model runs (`single_threaded_blas`): the
backend parallelises GEMMs itself, a chunk of rows per thread with its epilogue
applied while the rows are in cache. Measured on this 2-core machine (MiniLM's
1024x384 @ 384x1536 plus bias and gelu): 10.5 ms this way against 16 ms for one
2-thread BLAS call followed by a threaded epilogue, whose idle BLAS threads spin
on the cores the epilogue needs.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable

from tilegraph.ir.kernels import OneBlasThread, blas_libraries, parallel_for

# Threads a compiled model uses: every core this process may run on, or TILEGRAPH_NUM_THREADS.
THREADS = max(1, int(os.environ.get("TILEGRAPH_NUM_THREADS") or 0) or (
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)))


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


# The one process-wide BLAS pin (ir/kernels.py): re-entrant, shared with the attention kernel.
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
