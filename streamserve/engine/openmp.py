"""OpenMP worker threads handed back by the threads that stop running torch work.

torch's CPU kernels (and the code Inductor generates) run on OpenMP. GNU OpenMP (libgomp, which torch's Linux
wheels ship) keeps a pool of worker threads per thread that started a parallel region, and its workers wait for
the next region by spinning, then by sleeping. Once the pools of all threads together hold more threads than the
process may use CPUs, libgomp cuts every worker's spin to ~100 iterations, so each parallel region wakes a worker
from its sleep: on a 2-vCPU machine a tiny `bmm` took 82 us in the engine thread after the main thread had run one
2-thread op, against 4 us before (docs/benchmarks.md, issue 16). The engine thread, the compile thread and the
thread that loaded the model each get a pool; the first is the one that must stay fast.

`release_openmp_threads()` ends the calling thread's pool (OpenMP 5.0's `omp_pause_resource_all` with
`omp_pause_soft`; its next parallel region starts a new one, tens of microseconds). The engine calls it on the
thread that loaded a model, on the compile thread after each compile, and on the engine thread when it falls
idle, so that whichever thread works next has the CPUs' worth of workers to itself; the server runs its
executors' calls through `releasing` (a snapshot's copies, the camera's classifier). Without a loaded OpenMP
runtime that has the call (another parallel backend, another platform), it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

log = logging.getLogger("streamserve")
T = TypeVar("T")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads end, the runtime stays initialized
RUNTIMES = ("libgomp", "libiomp", "libomp")  # GNU, Intel and LLVM OpenMP: all three implement the call


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    """`omp_pause_resource_all` of the OpenMP runtime torch runs on, or None."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    maps = Path("/proc/self/maps")  # the runtime torch loaded (a wheel may ship its own copy under another name)
    paths = {line.split()[-1] for line in maps.read_text().splitlines()
             if any(r in line.rsplit("/", 1)[-1] for r in RUNTIMES)} if maps.exists() else set()
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn  # type: ignore[no-any-return]
    log.debug("no OpenMP runtime with omp_pause_resource_all is loaded: worker threads are kept")
    return None


def release_openmp_threads() -> bool:
    """End the calling thread's OpenMP worker threads -> whether a runtime did (False: nothing to call, or called
    inside a parallel region, where the runtime refuses)."""
    fn = _pause_all()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0


def releasing(fn: Callable[[], T]) -> T:
    """fn() on this thread, then this thread's OpenMP workers handed back: for a pool thread (an executor's) that
    runs torch work now and then, next to the engine thread."""
    try:
        return fn()
    finally:
        release_openmp_threads()
