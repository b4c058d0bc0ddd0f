"""Byte budgets for media the server holds: one global budget (--max-media-bytes) and one account per connection
(--max-media-bytes-per-connection).

Media waits in a few buffers for longer than one handler call: input audio the Listener has not transcribed yet
(voice/listen.py; the Realtime inbox's audio events before that, realtime/inbox.py), reply audio synthesised and not
yet sent (voice/speak.py), images waiting for the vision thread (vision.py). Each such buffer holds a `Holding` on
its connection's `MediaAccount`: `admit(n)` before taking n more bytes (refused with a typed error, nothing taken),
`settle(n)` when what it holds changed by its own work (never refused: it was admitted), `drop()` when it goes.

    global full          -> MediaBusyError    `server_busy`    (retry later: other connections hold the bytes)
    the connection full  -> MediaQuotaError   `quota_exceeded` (this connection sends faster than it is served)

An account is closed with its connection (`MediaBudget.close(ctx)`, from service.disconnect): whatever it still holds
goes back to the global budget at once, and its buffers' later admits and releases are no-ops, so a disconnect can
never leak budget, whatever order the buffers stop in. Accounts and the budget are thread-safe (one lock): buffers
may be touched from executor threads.

The connection whose audio an append is: `charging(account)` sets it for the call (a ContextVar), for buffers made
by code that does not take an account (the native path: service.append -> voice_sessions -> the Listener).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from streamserve.errors import QuotaExceededError, StreamserveError


class MediaBusyError(StreamserveError):
    """The server holds its limit of media bytes over all connections (--max-media-bytes): this media was refused,
    nothing taken. Retry later (or send more slowly)."""

    code = "server_busy"


class MediaQuotaError(QuotaExceededError):
    """This connection holds its limit of media bytes (--max-media-bytes-per-connection): audio sent faster than it
    is transcribed, images faster than they are labelled. This media was refused, nothing taken."""


class MediaBudget:
    """The server's media bytes: the global count and each connection's account."""

    def __init__(self, max_bytes: int, max_bytes_per_connection: int) -> None:
        self.max_bytes, self.max_per_connection = max_bytes, max_bytes_per_connection
        self.held = 0  # bytes held over all open accounts
        self.refused = {"server_busy": 0, "quota_exceeded": 0}  # refusals so far (a metric's figures)
        self.lock = threading.RLock()  # re-entrant: a finalizer (close) may run in a gc inside a locked call
        self._accounts: weakref.WeakKeyDictionary[Any, MediaAccount] = weakref.WeakKeyDictionary()
        self._counter: Any = None  # the refusals' Prometheus counter, once metrics() registered it

    def metrics(self, registry: Any) -> None:
        """Register this budget's Prometheus metrics in `registry` (the engine's, served on /metrics): the bytes
        held and the limit, and the refusals by code."""
        from prometheus_client import Counter, Gauge

        Gauge("streamserve_media_bytes_held", "Bytes of media held over all connections (input audio waiting to be "
              "transcribed, reply audio not yet sent, images waiting for the vision thread)",
              registry=registry).set_function(lambda: self.held)
        Gauge("streamserve_media_bytes_limit", "--max-media-bytes", registry=registry).set_function(
            lambda: self.max_bytes)
        self._counter = Counter("streamserve_media_refused", "Media refused by the media byte budgets, by code "
                                "(server_busy: the server's, quota_exceeded: a connection's)", ["code"],
                                registry=registry)

    def refuse(self, code: str) -> None:
        """Count a refusal (called with the lock held)."""
        self.refused[code] += 1
        if self._counter is not None:
            self._counter.labels(code).inc()

    def account(self, owner: Any) -> MediaAccount:
        """The account of `owner` (a connection's ClientContext), made at its first use and held weakly. close()
        gives its bytes back; an owner collected without a close gives them back then. A connection already gone
        (`owner.gone`) gets a closed account: it holds nothing."""
        with self.lock:
            acct = self._accounts.get(owner)
            if acct is None:
                acct = MediaAccount(self)
                if getattr(owner, "gone", False):
                    acct.closed = True
                    return acct
                self._accounts[owner] = acct
                weakref.finalize(owner, acct.close)
            return acct

    def close(self, owner: Any) -> None:
        """`owner`'s connection ended: everything its account holds goes back now."""
        with self.lock:
            acct = self._accounts.pop(owner, None)
        if acct is not None:
            acct.close()

    @property
    def accounts(self) -> int:
        return len(self._accounts)


class MediaAccount:
    """One connection's media bytes, within its own limit and the global one."""

    def __init__(self, budget: MediaBudget) -> None:
        self.budget = budget
        self.held = 0
        self.closed = False

    def acquire(self, n: int, what: str = "media") -> None:
        """Take n bytes, or raise (MediaQuotaError: this connection's limit; MediaBusyError: the server's), taking
        nothing. A closed account takes nothing and refuses nothing (its buffers are stopping)."""
        if n <= 0:
            return
        b = self.budget
        with b.lock:
            if self.closed:
                return
            if self.held + n > b.max_per_connection:
                b.refuse("quota_exceeded")
                raise MediaQuotaError(
                    f"this connection holds {self.held} bytes of media waiting to be processed; {n} more ({what}) "
                    f"would pass its limit of {b.max_per_connection} (--max-media-bytes-per-connection): send at "
                    "real-time pace, or wait for answers before sending more")
            if b.held + n > b.max_bytes:
                b.refuse("server_busy")
                raise MediaBusyError(
                    f"the server holds its limit of {b.max_bytes} bytes of media waiting to be processed "
                    f"(--max-media-bytes); this {what} ({n} bytes) was refused: retry later")
            self.held += n
            b.held += n

    def take(self, n: int) -> None:
        """Take n bytes without a check: bytes already admitted whose exact size is known only now."""
        if n <= 0:
            return
        with self.budget.lock:
            if not self.closed:
                self.held += n
                self.budget.held += n

    def release(self, n: int) -> None:
        """Give n bytes back (never more than the account holds; nothing once it is closed)."""
        if n <= 0:
            return
        with self.budget.lock:
            if self.closed:
                return
            n = min(n, self.held)
            self.held -= n
            self.budget.held -= n

    def close(self) -> None:
        with self.budget.lock:
            if self.closed:
                return
            self.closed = True
            self.budget.held -= self.held
            self.held = 0


class Holding:
    """What one buffer holds of an account (None: no accounting, e.g. a Listener made outside a server)."""

    def __init__(self, account: MediaAccount | None, what: str = "media") -> None:
        self.account, self.what = account, what
        self.bytes = 0

    def admit(self, n: int) -> None:
        """The buffer takes n more bytes: refused (typed error, nothing taken) past a limit."""
        if self.account is not None:
            self.account.acquire(n, self.what)
        self.bytes += max(0, n)

    def settle(self, n: int) -> None:
        """The buffer now holds n bytes (it consumed some, or what it admitted turned out a little larger)."""
        n = max(0, n)
        if self.account is not None:
            if n > self.bytes:
                self.account.take(n - self.bytes)
            else:
                self.account.release(self.bytes - n)
        self.bytes = n

    def drop(self) -> None:
        self.settle(0)

    def move(self, account: MediaAccount | None) -> None:
        """Charge another account (the buffer's connection changed) with what it holds."""
        if account is self.account:
            return
        held = self.bytes
        self.drop()
        self.account = account
        if account is not None:
            account.take(held)
        self.bytes = held


_charging: contextvars.ContextVar[MediaAccount | None] = contextvars.ContextVar("streamserve_media_account",
                                                                               default=None)


@contextlib.contextmanager
def charging(account: MediaAccount | None) -> Iterator[None]:
    """Media buffers made or fed within this block charge `account` (unless given one explicitly)."""
    token = _charging.set(account)
    try:
        yield
    finally:
        _charging.reset(token)


def current() -> MediaAccount | None:
    """The account set by the innermost `charging` block, or None."""
    return _charging.get()
