"""Blocking jobs of all sessions on a shared executor, the earliest deadline first (text to speech's scheduler).

    fut = runner.submit(deadline, fn, *args)     # deadline: loop.time() by which its result is needed
    runner.withdraw(fut)                         # a job not started yet is dropped (a cancelled reply)

At most `workers` jobs run at once; the next to start is the waiting job with the earliest deadline (ties in
order of submission). A Speaker submits each piece of a reply with the time its audio will be needed: the first
piece now (nothing is playing: a turn's first audio waits for it), a later piece when the audio already
synthesised for its reply runs out. So under load every reply's first audio goes before other replies' later
sentences, which still arrive before their turn to play. Nothing here is bounded by count: each reply has at most
one piece in here (its synthesis task awaits it), and replies are bounded by sessions.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any


class DeadlineRunner:
    def __init__(self, executor: Executor, workers: int) -> None:
        self.executor, self.workers = executor, max(1, workers)
        self._waiting: list[tuple[float, int, Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
        self._order = itertools.count()
        self._running = 0
        self.started = 0  # jobs started so far (a test's count)

    @property
    def depth(self) -> int:
        """Jobs waiting to start."""
        return sum(1 for *_, fut in self._waiting if not fut.done())

    @property
    def busy(self) -> bool:
        """A job runs or waits (the speech-to-text scheduler holds partial passes back meanwhile)."""
        return self._running > 0 or self.depth > 0

    def submit(self, deadline: float, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """fn(*args) on the executor once it is the earliest-deadline job waiting and a worker is free."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        heapq.heappush(self._waiting, (deadline, next(self._order), fn, args, fut))
        self._dispatch(loop)
        return fut

    def withdraw(self, fut: asyncio.Future[Any] | None) -> None:
        """Drop `fut`'s job if it has not started (its future is cancelled); a started job runs to its end."""
        if fut is not None and not fut.done() and any(f is fut for *_, f in self._waiting):
            fut.cancel()

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        while self._running < self.workers and self._waiting:
            _, _, fn, args, fut = heapq.heappop(self._waiting)
            if fut.done():  # withdrawn while it waited
                continue
            self._running += 1
            self.started += 1
            job = loop.run_in_executor(self.executor, fn, *args)
            job.add_done_callback(lambda job, fut=fut: self._finished(loop, job, fut))

    def _finished(self, loop: asyncio.AbstractEventLoop, job: asyncio.Future[Any], fut: asyncio.Future[Any]) -> None:
        self._running -= 1
        if not fut.done():
            if job.cancelled():
                fut.cancel()
            elif job.exception() is not None:
                fut.set_exception(job.exception())  # type: ignore[arg-type]
            else:
                fut.set_result(job.result())
        self._dispatch(loop)
