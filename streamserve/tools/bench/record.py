"""What one bench session measured, and the summary of a kind of session; what every kind of session does with
an error (its code) and at its end (`wind_down`).

A session is *held* when it ran its whole duration with no missed deadline and no error. Latencies are kept in
milliseconds per measure (e.g. `append_ms`), summarised as nearest-rank p50/p90/p99.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

CLOSE_TIMEOUT_S = 5.0  # a connection's close may take this long at a session's end


@dataclass
class SessionRecord:
    kind: str  # "text", "voice" or "policy"
    index: int
    started: bool = False  # connected and opened: the session's clock runs
    completed: bool = False  # ran its whole duration (it may still have missed deadlines or had errors)
    missed: int = 0  # deadlines missed (what a deadline is depends on the kind: docs/benchmarks.md)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # error code -> count
    counts: collections.Counter[str] = field(default_factory=collections.Counter)  # chunks, replies, ticks, ...
    latencies: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))  # name -> ms

    @property
    def held(self) -> bool:
        return self.completed and self.missed == 0 and not self.errors

    def error(self, code: str) -> None:
        self.errors[code] += 1

    def latency(self, name: str, seconds: float) -> None:
        self.latencies[name].append(seconds * 1e3)


def code_of(e: BaseException) -> str:
    """An error's code for the report: the server's (client SDK errors carry it as `code`), else what kind of
    failure it was."""
    code = getattr(e, "code", None)
    if isinstance(code, str):
        return code
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):  # one class from Python 3.11, two before
        return "timeout"
    if isinstance(e, ConnectionRefusedError):
        return "connection_failed"
    if isinstance(e, ConnectionError) or type(e).__name__ in ("ConnectionClosed", "ConnectionClosedError",
                                                              "ConnectionClosedOK"):
        return "connection_lost"
    if isinstance(e, OSError):
        return "connection_failed"
    return type(e).__name__


async def wind_down(task: asyncio.Task[Any] | None, close: Callable[[], Awaitable[object]]) -> None:
    """A session's end, however it ended: its `task` still running (a reply, the event reader) is cancelled and
    awaited (a finished one's exception is retrieved, never logged as lost), then `close()` closes the connection
    within CLOSE_TIMEOUT_S. Neither raises: the session's figures are already in its record."""
    if task is not None:
        task.cancel()  # a no-op on a finished task
        with contextlib.suppress(BaseException):
            await task
    with contextlib.suppress(Exception):
        await asyncio.wait_for(close(), CLOSE_TIMEOUT_S)


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest rank (with few samples p99 is the slowest one); None without samples."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def spread(xs: list[float]) -> dict[str, Any]:
    r = {f"p{round(q * 100)}": percentile(xs, q) for q in (0.5, 0.9, 0.99)}
    return {"n": len(xs), **{k: None if v is None else round(v, 2) for k, v in r.items()},
            "max": round(max(xs), 2) if xs else None}


def summarise(records: list[SessionRecord]) -> dict[str, Any]:
    """The sessions of one kind -> held count, missed deadlines, errors by code, counts and latency spreads."""
    errors: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    lat: dict[str, list[float]] = collections.defaultdict(list)
    for r in records:
        errors.update(r.errors)
        counts.update(r.counts)
        for name, xs in r.latencies.items():
            lat[name] += xs
    return {"sessions": len(records), "held": sum(r.held for r in records),
            "completed": sum(r.completed for r in records),
            "missed_deadlines": sum(r.missed for r in records),
            "sessions_missing_deadlines": sum(r.missed > 0 for r in records),
            "errors": dict(sorted(errors.items())), "counts": dict(sorted(counts.items())),
            "latency_ms": {name: spread(xs) for name, xs in sorted(lat.items())}}
