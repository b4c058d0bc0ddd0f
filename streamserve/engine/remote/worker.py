"""`BackendLoop`: the SGLang backend's own thread and asyncio loop, where every HTTP call to SGLang runs.

The server's event loop only ever hands work to it (`call`, `run`) and never waits on it; the blocking calls
(`open_session`, `rewind`, `close` of the backend, as the service makes them on its executor) wait on a
`concurrent.futures.Future`. It also plays the engine loop's part for the server: `died` and `on_death`, so that a
dead SGLang server makes streamserve report unhealthy and exit, as a dead engine thread does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger("streamserve.engine")
T = TypeVar("T")


class BackendLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.died: BaseException | None = None
        self.tasks: set[asyncio.Task] = set()
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.loop.run_forever, name="streamserve-sglang", daemon=True)
        self._thread.start()

    def in_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop soon (from any thread; never waits). After `stop`, nothing runs."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the backend has shut down
            self.loop.call_soon_threadsafe(fn, *args)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """On the loop: run `coro` as a task the loop keeps until it ends (cancelled at `stop`)."""
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("streamserve: an SGLang backend task failed", exc_info=task.exception())

    def run(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run `coro` on the loop; -> a future to wait on from another thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (never from the loop's own thread)."""
        if self.in_thread():
            coro.close()
            raise RuntimeError("the SGLang backend's thread cannot wait for itself")
        return self.run(coro).result(timeout)

    # ---- death, as engine/loop.py reports it ------------------------------------------------------------
    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)
            died = self.died
        if died is not None:
            callback(died)

    def die(self, fault: BaseException) -> bool:
        """Record that the backend is gone (the first time only: -> whether this call did)."""
        with self._lock:
            if self.died is not None:
                return False
            self.died = fault
            callbacks = list(self._callbacks)
        for cb in callbacks:
            cb(fault)
        return True

    def stop(self, cleanup: Coroutine[Any, Any, Any] | None = None, timeout: float = 10.0) -> None:
        """Cancel the loop's tasks, run `cleanup`, stop the thread."""
        async def finish() -> None:
            for t in list(self.tasks):
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            if cleanup is not None:
                await cleanup

        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self.run(finish()).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
