"""One forward for several sessions' steps: planning each (admission), running them together (a captured
CUDA graph or the eager batched model), committing each, and isolating a session whose step fails.

After a batched forward that raises, every step is undone and each runs alone, so the one that fails is
found and only it fails. Logits are copied per session: a view would keep the whole batch's logits alive.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from streamserve.engine.graphs import graphable, rows_of
from streamserve.sessions import PagedSessionKV

if TYPE_CHECKING:
    from streamserve.engine.engine import Engine
    from streamserve.engine.session import Session

# On a CPU, steps of fewer tokens than this run on one intra-op thread: waking a thread pool costs more than
# these small matmuls gain from it (default model, 2 vCPUs: a 3-token step is 2.7x-4.4x slower on 2 threads;
# larger steps keep the process's setting; benchmarks/step_costs.py, docs/benchmarks.md)
CPU_SMALL_STEP_TOKENS = 64


class BatchForward:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.seconds: float | None = None  # the last step's forward time (None: no forward, or a graph captured)

    def run(self, jobs: list[tuple[Session, list[int]]], all_rows: list[bool] | None = None
            ) -> list[torch.Tensor | BaseException]:
        """Each job's ids run after its session's committed tokens, all in one forward. -> per job the logits
        [V] of its last token ([T, V] of all its tokens where `all_rows`: draft verification), or the
        exception that failed it (that job's step is undone; the others are unaffected). Verification jobs
        are committed without dropping pages outside the window: the caller truncates the rejected drafts
        first, then drops them (`kv.drop_outside_window()`)."""
        flags = all_rows or [False] * len(jobs)
        self.seconds = None
        with self.engine._lock:
            busy = [s.kv for s, _ in jobs]
            out: list[torch.Tensor | BaseException | None] = [None] * len(jobs)
            ready = [i for i in range(len(jobs)) if self._try_begin(jobs[i], busy, out, i)]
            try:
                logits = self._forward_jobs([jobs[i] for i in ready], [flags[i] for i in ready]) if ready else None
            except Exception as e:
                for i in ready:
                    jobs[i][0].kv.abort()
                if len(ready) == 1:
                    out[ready[0]] = e
                else:
                    for i in ready:  # find the job that fails: each runs alone
                        if self._try_begin(jobs[i], busy, out, i):
                            try:
                                out[i] = self._forward_jobs([jobs[i]], [flags[i]])[0].clone()
                                jobs[i][0].kv.commit(drop=not flags[i])
                            except Exception as e1:
                                jobs[i][0].kv.abort()
                                out[i] = e1
            else:
                for rows, i in zip(logits or [], ready, strict=True):
                    jobs[i][0].kv.commit(drop=not flags[i])
                    out[i] = rows.clone()  # a view would keep the whole batch's logits alive
        return out  # type: ignore[return-value]

    def _try_begin(self, job: tuple[Session, list[int]], busy: list[PagedSessionKV],
                   out: list[torch.Tensor | BaseException | None], i: int) -> bool:
        try:
            self.engine.begin_step(job[0], job[0].kv, len(job[1]), busy)
            return True
        except Exception as e:
            out[i] = e
            return False

    def _forward_jobs(self, jobs: list[tuple[Session, list[int]]], all_rows: list[bool]) -> list[torch.Tensor]:
        return self.forward_planned([s.kv for s, _ in jobs], [i for _, i in jobs], all_rows)

    def forward_planned(self, kvs: list[PagedSessionKV], ids: list[list[int]], all_rows: list[bool] | None = None
                        ) -> list[torch.Tensor]:
        """The planned (`begin`) steps of `kvs` over `ids` in one forward -> per session the logits of its last
        token [V], or of all its tokens [T, V] where `all_rows`. The caller commits or aborts."""
        e = self.engine
        widths = [len(i) for i in ids]
        flags = all_rows or [False] * len(ids)
        t0 = time.perf_counter()
        captured = e.graphs.captured if e.graphs is not None else 0
        with threads_for(e.device, sum(widths)):
            if e.graphs is not None and graphable(widths):
                logits = e.graphs.run(kvs, ids, flags)
            else:
                flat = torch.tensor([t for i in ids for t in i], dtype=torch.long, device=e.device)
                logits = e.model.forward_batch(flat, kvs, None if all(flags) else rows_of(widths, flags))
        seconds = time.perf_counter() - t0
        self._count(widths, seconds)
        # a step that captured a graph took capture time too: it measures nothing about the step's cost
        self.seconds = None if e.graphs is not None and e.graphs.captured != captured else seconds
        out, start = [], 0
        for w, f in zip(widths, flags, strict=True):  # split the rows per session
            n = w if f else 1
            out.append(logits[start:start + n] if f else logits[start])
            start += n
        return out

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
