"""`BetweenSteps`: the engine loop's critical section. A step holds it from planning to delivery, so any
operation that holds it (rewind, snapshot, park, close, admission, orphan reclaim, a test stepping the
loop by hand) sees every session between two steps. Re-entrant: a step's admission and a close during a
step's fault handling take it again on the same thread.

Fair to those who wait: Python's locks are not, and the engine loop releases the guard after a step only to
take it again at once, so under a steady load (a session flooding long chunks) a close or rewind could wait
hundreds of steps — seconds. Threads that find the guard taken count themselves as waiting, and the loop
calls `pause_for_waiters()` between steps: it lets every waiter in before its next step."""

from __future__ import annotations

import threading
from types import TracebackType

PAUSE_LIMIT_S = 0.1  # the loop never pauses longer than this for waiters (a waiter that died, a lost wake-up)


class BetweenSteps:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._waiters = threading.Condition(threading.Lock())  # guards `_waiting`; notified as waiters get in
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Threads blocked waiting for the guard now."""
        return self._waiting

    def __enter__(self) -> BetweenSteps:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()

    def acquire(self, blocking: bool = True) -> bool:
        if self._lock.acquire(blocking=False):  # free, or this thread's already (re-entrant)
            return True
        if not blocking:
            return False
        with self._waiters:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._waiters:
                self._waiting -= 1
                self._waiters.notify_all()
        return True

    def release(self) -> None:
        self._lock.release()

    def pause_for_waiters(self) -> None:
        """Between steps, not holding the guard: return once every thread waiting for it now has had it."""
        with self._waiters:
            if self._waiting:
                self._waiters.wait_for(lambda: self._waiting == 0, PAUSE_LIMIT_S)
