"""`BetweenSteps`: the engine loop's critical section. A step holds it from planning to delivery, so any
operation that holds it (rewind, snapshot, park, close, admission, orphan reclaim, a test stepping the
loop by hand) sees every session between two steps. Re-entrant: a step's admission and a close during a
step's fault handling take it again on the same thread."""

from __future__ import annotations

import threading
from types import TracebackType


class BetweenSteps:
    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> BetweenSteps:
        self._lock.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()

    def acquire(self, blocking: bool = True) -> bool:
        return self._lock.acquire(blocking=blocking)

    def release(self) -> None:
        self._lock.release()
