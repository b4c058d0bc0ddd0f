"""Waiting for an engine's compiled decode step: what benchmarks that time an engine at its defaults do first, so
that they time what a user gets once `streamserve models pull` (or an earlier start) compiled it."""

from __future__ import annotations

import sys
import time
from typing import Any

from streamserve.engine import Engine
from streamserve.engine.compiled import CompiledSteps

COMPILE_WAIT_S = 1800.0  # a cold compile of a small model takes minutes on two cores


def wait_compiled(engine: Engine, timeout: float = COMPILE_WAIT_S, say: bool = True) -> dict[str, Any] | None:
    """Wait until `engine`'s queued step compiles are done -> its `compiled_step` stats (None: it compiles nothing:
    cpu_compile off, a GPU). Raises TimeoutError after `timeout`. `say`: a line on stderr while it waits."""
    steps = engine.graphs.compiled if engine.graphs is not None else None
    if not isinstance(steps, CompiledSteps):
        return None
    t0 = time.perf_counter()
    if say and not steps.idle.is_set():
        print("waiting for the engine's compiled decode step (minutes when not cached)", file=sys.stderr, flush=True)
    if not steps.wait_idle(timeout):
        raise TimeoutError(f"the decode step was still compiling after {timeout:.0f}s")
    stats: dict[str, Any] = engine.stats()["compiled_step"]
    if say and time.perf_counter() - t0 > 1.0:
        print(f"compiled step: {stats['state']} after {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return stats
