"""One forward for several sessions' steps: planning each (admission), running them together (a captured
CUDA graph or the eager batched model), committing each, and isolating a session whose step fails.

After a batched forward that raises, every step is undone and each runs alone, so the one that fails is
found and only it fails. Logits are copied per session: a view would keep the whole batch's logits alive.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from streamserve.engine.graphs import graphable
from streamserve.sessions import PagedSessionKV

if TYPE_CHECKING:
    from streamserve.engine.engine import Engine
    from streamserve.engine.session import Session

# On a CPU, steps of fewer tokens than this run on one intra-op thread: waking a thread pool costs more than
# these small matmuls gain from it (default model, 2 cores: a 3-token step 5.5 ms on 2 threads, 1.9 ms on 1;
# from about 64 tokens on, more threads win; docs/benchmarks.md)
CPU_SMALL_STEP_TOKENS = 64


class BatchForward:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, jobs: list[tuple[Session, list[int]]]) -> list[torch.Tensor | BaseException]:
        """Each job's ids run after its session's committed tokens, all in one forward. -> per job the logits
        [V] of its last token, or the exception that failed it (that job's step is undone; the others are
        unaffected)."""
        with self.engine._lock:
            busy = [s.kv for s, _ in jobs]
            out: list[torch.Tensor | BaseException | None] = [None] * len(jobs)
            ready = [i for i in range(len(jobs)) if self._try_begin(jobs[i], busy, out, i)]
            try:
                logits = self._forward_jobs([jobs[i] for i in ready]) if ready else None
            except Exception as e:
                for i in ready:
                    jobs[i][0].kv.abort()
                if len(ready) == 1:
                    out[ready[0]] = e
                else:
                    for i in ready:  # find the job that fails: each runs alone
                        if self._try_begin(jobs[i], busy, out, i):
                            try:
                                out[i] = self._forward_jobs([jobs[i]])[0].clone()
                                jobs[i][0].kv.commit()
                            except Exception as e1:
                                jobs[i][0].kv.abort()
                                out[i] = e1
            else:
                for j, i in enumerate(ready):
                    jobs[i][0].kv.commit()
                    out[i] = logits[j].clone()  # type: ignore[index]
        return out  # type: ignore[return-value]

    def _try_begin(self, job: tuple[Session, list[int]], busy: list[PagedSessionKV],
                   out: list[torch.Tensor | BaseException | None], i: int) -> bool:
        try:
            self.engine.begin_step(job[0], job[0].kv, len(job[1]), busy)
            return True
        except Exception as e:
            out[i] = e
            return False

    def _forward_jobs(self, jobs: list[tuple[Session, list[int]]]) -> torch.Tensor:
        return self.forward_planned([s.kv for s, _ in jobs], [i for _, i in jobs])

    def forward_planned(self, kvs: list[PagedSessionKV], ids: list[list[int]], all_logits: bool = False
                        ) -> torch.Tensor:
        """The planned (`begin`) steps of `kvs` over `ids` in one forward -> logits [n, V] of each session's
        last token, or [T, V] with `all_logits` (one session). The caller commits or aborts."""
        e = self.engine
        widths = [len(i) for i in ids]
        t0 = time.perf_counter()
        with threads_for(e.device, sum(widths)):
            if e.graphs is not None and graphable(widths):
                logits = e.graphs.run(kvs, ids, all_logits)
            else:
                flat = torch.tensor([t for i in ids for t in i], dtype=torch.long, device=e.device)
                rows = None if all_logits else [r - 1 for r in itertools.accumulate(widths)]
                logits = e.model.forward_batch(flat, kvs, rows)
        self._count(widths, time.perf_counter() - t0)
        return logits

    def _count(self, widths: list[int], seconds: float) -> None:
        c = self.engine._counters
        c["decode_tokens"] += sum(1 for w in widths if w == 1)
        c["prefill_tokens"] += sum(w for w in widths if w > 1)
        c["decode_seconds" if all(w == 1 for w in widths) else "prefill_seconds"] += seconds
        c["forward_calls"] += 1


@contextlib.contextmanager
def threads_for(device: torch.device, tokens: int) -> Iterator[None]:
    """A small CPU step runs on one intra-op thread; the process's setting is restored after it."""
    prev = torch.get_num_threads()
    if device.type != "cpu" or tokens >= CPU_SMALL_STEP_TOKENS or prev == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
