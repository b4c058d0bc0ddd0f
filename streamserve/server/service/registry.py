"""Which connection holds which session, and how a dropped connection's sessions are resumed.

Every session a client opens gets an unguessable id (the engine's, 128 bits) and a resume token (256
bits). A connection reaches only the sessions it holds; any other id, existing or not, is answered as
unknown, so ids leak nothing. When a connection drops, its sessions are detached (their replies
cancelled) and kept for `resume_ttl` seconds: `resume` with the id and the token (compared in constant
time) re-attaches a session, KV cache and timeline included, to the new connection — taking it over
if the old connection has not noticed it is dead. The results (ack or error) of a session's latest 64
chunks stay in its entry and are sent again to whoever resumes it, so a client learns the fate of every
chunk it was waiting for, whether its ack was lost with the old connection or came while none held it. After the
TTL, a detached session is closed and its pages come back. The server holds at most `max_total`
sessions, open and detached together: when full, the oldest detached session makes room (the opener's own
address's first), and when none is detached, `open` is refused. Each client address (the owner's `address`,
server/transports/clients.py) holds at most `max_per_address` of them, open, detached and opening together, so that one
address cannot fill the table and so evict other addresses' detached sessions; a session keeps its address while
detached and takes its new holder's on a resume. A session another instance handed over (lifecycle.py) joins
with `adopt`, under its id and resume token; only native sessions (`portable`) are handed over by a drain.
Thread-safe: `open` runs in a worker thread. Owned by the session
service (server/service/service.py); an owner is whatever object stands for one connection there (an owner without an
`address` is counted per connection and in the total only).
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from streamserve.engine import Engine, Session
from streamserve.errors import SessionNotFoundError, StreamserveError
from streamserve.server.service.results import ChunkResult

RECENT_RESULTS = 64  # chunk results kept per session for a resume (>= the engine's queue bound per session)


class ResumeTokenError(StreamserveError):
    code = "invalid_resume_token"


class TooManySessionsError(StreamserveError):
    code = "too_many_sessions"


@dataclass(eq=False)
class Entry:
    session: Session
    resume_token: str
    owner: Any  # the connection holding it; None while detached
    address: str | None = None  # the client address that opened or last resumed it (kept while detached)
    detached_at: float | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # reply defaults from open / configure
    reserved_pages: int = 0  # counted against the owner's page quota (the session's page_cap)
    portable: bool = False  # opened by a protocol whose clients resume (native): a drain hands it over
    # the latest chunk results, neutral: whichever protocol resumes the session renders them
    recent: deque[ChunkResult] = field(default_factory=lambda: deque(maxlen=RECENT_RESULTS))


class SessionRegistry:
    def __init__(self, engine: Engine, resume_ttl: float, max_per_owner: int, max_chunk_tokens: int,
                 max_total: int, max_per_address: int | None = None) -> None:
        self.engine, self.resume_ttl = engine, resume_ttl
        self.max_per_owner, self.max_chunk_tokens, self.max_total = max_per_owner, max_chunk_tokens, max_total
        self.max_per_address = max_per_address  # None: no per-address limit
        self._entries: dict[str, Entry] = {}
        self._opening: list[Any] = []  # the owner of each open in flight
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def owned(self, owner: Any) -> list[Entry]:
        """The sessions `owner` holds; one the engine closed (a failed step, its idle TTL) no longer counts,
        though the reaper takes its entry out only later."""
        with self._lock:
            return [e for e in self._entries.values() if e.owner is owner and not e.session.closed]

    def all(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def open(self, owner: Any, sampling: dict[str, Any] | None, reserved_pages: int = 0, **session_kw: Any) -> Entry:
        """A new session held by `owner` (blocking: run it off the event loop). Opens in flight count against
        every limit, so opens running in several threads at once cannot pass them."""
        address = address_of(owner)
        with self._lock:
            if self._held(owner) >= self.max_per_owner:
                raise TooManySessionsError(f"this connection holds {self.max_per_owner} sessions (the limit); close "
                                           "one or open another connection")
            self._check_address(address)
            evict = None
            if len(self._entries) + len(self._opening) >= self.max_total:
                detached = [e for e in self._entries.values() if e.owner is None]
                if not detached:
                    raise TooManySessionsError(f"the server holds {self.max_total} sessions (its limit); retry later")
                own = [e for e in detached if address is not None and e.address == address]
                evict = min(own or detached, key=lambda e: e.detached_at or 0.0)
                del self._entries[evict.session.id]
            self._opening.append(owner)
        entry = None
        try:
            if evict is not None:
                evict.session.close()  # the oldest detached session makes room
            s = self.engine.open_session(**session_kw)
            s.max_chunk_tokens = self.max_chunk_tokens
            entry = Entry(s, secrets.token_urlsafe(32), owner, address, sampling=dict(sampling or {}),
                          reserved_pages=reserved_pages, portable=bool(getattr(owner_listener(owner), "hands_off",
                                                                                  False)))
        finally:
            with self._lock:
                self._opening.remove(owner)
                if entry is not None:
                    self._entries[entry.session.id] = entry
        return entry

    def adopt(self, owner: Any, session: Session, token: str, sampling: dict[str, Any], reserved_pages: int,
              recent: list[ChunkResult]) -> Entry:
        """A session restored from another instance's hand-off record, held by `owner` under its resume token: the
        limits of an open apply (TooManySessionsError, the caller then closes the session); nothing is evicted."""
        address = address_of(owner)
        with self._lock:
            if self._held(owner) >= self.max_per_owner:
                raise TooManySessionsError(f"this connection holds {self.max_per_owner} sessions (the limit)")
            self._check_address(address)
            if len(self._entries) + len(self._opening) >= self.max_total:
                raise TooManySessionsError(f"the server holds {self.max_total} sessions (its limit); retry later")
            session.max_chunk_tokens = self.max_chunk_tokens
            entry = Entry(session, token, owner, address, sampling=dict(sampling), reserved_pages=reserved_pages,
                          portable=True)
            entry.recent.extend(recent)
            self._entries[session.id] = entry
        return entry

    def _held(self, owner: Any) -> int:
        """Sessions `owner` holds or is opening (under the lock)."""
        held = sum(1 for e in self._entries.values() if e.owner is owner and not e.session.closed)
        return held + sum(1 for o in self._opening if o is owner)

    def _check_address(self, address: str | None) -> None:
        """TooManySessionsError when `address` holds max_per_address sessions: open, detached or opening (under the
        lock)."""
        if address is None or self.max_per_address is None:
            return
        held = sum(1 for e in self._entries.values() if e.address == address and not e.session.closed)
        if held + sum(1 for o in self._opening if address_of(o) == address) >= self.max_per_address:
            raise TooManySessionsError(
                f"this client address holds {self.max_per_address} sessions, open and detached (the server's limit "
                f"per address): close the sessions it no longer needs; a dropped connection's sessions count until "
                f"they are resumed or expire ({self.resume_ttl:g} s after the drop)")

    def get(self, owner: Any, session_id: str) -> Entry:
        """The session `owner` holds under this id; SessionNotFoundError for anything else."""
        with self._lock:
            e = self._entries.get(session_id)
        if e is None or e.owner is not owner or e.session.closed:
            raise SessionNotFoundError(f"this connection holds no session {session_id!r}; open one, or resume a "
                                       "dropped one with its resume token")
        return e

    def find(self, session_id: str) -> Entry | None:
        with self._lock:
            return self._entries.get(session_id)

    def verified(self, session_id: str, token: str) -> Entry:
        """The session `token` resumes (SessionNotFoundError, ResumeTokenError otherwise): checked before anything
        else is said about the session (its quota), so that without the token nothing is learnt of it."""
        with self._lock:
            return self._verified(session_id, token)

    def _verified(self, session_id: str, token: str) -> Entry:  # under the lock
        e = self._entries.get(session_id)
        if e is None or e.session.closed:
            raise SessionNotFoundError(f"no session {session_id!r} to resume: it was closed, expired after "
                                       f"{self.resume_ttl:g}s detached, or never existed; open a new one")
        if not hmac.compare_digest(e.resume_token.encode(), token.encode()):
            raise ResumeTokenError("the resume token does not match this session")
        return e

    def resume(self, owner: Any, session_id: str, token: str) -> tuple[Entry, Any]:
        """Re-attach a session to `owner`; -> (entry, the connection it was taken from, if any)."""
        with self._lock:
            e = self._verified(session_id, token)
            if e.owner is not owner and self._held(owner) >= self.max_per_owner:
                raise TooManySessionsError(f"this connection holds {self.max_per_owner} sessions (the limit)")
            address = address_of(owner)
            if address != e.address:  # resumed from another address: it counts there from now on
                self._check_address(address)
            previous = e.owner if e.owner is not owner else None
            e.owner, e.detached_at = owner, None
            if address is not None:
                e.address = address
        if previous is not None:
            e.session.cancel()  # its reply was streaming to the old connection
        return e, previous

    def detach_all(self, owner: Any) -> list[Entry]:
        """The owner's connection dropped: cancel its sessions' replies and keep them for a resume."""
        now = time.monotonic()
        with self._lock:
            entries = [e for e in self._entries.values() if e.owner is owner]
            for e in entries:
                e.owner, e.detached_at = None, now
        for e in entries:
            e.session.cancel()
        return entries

    def remove(self, session_id: str) -> Entry | None:
        with self._lock:
            return self._entries.pop(session_id, None)

    def expired(self, now: float | None = None) -> list[Entry]:
        """Take out the detached sessions past their TTL and the sessions the engine closed (faults,
        idle TTL); the caller closes them (blocking)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [sid for sid, e in self._entries.items() if e.session.closed or
                    (e.detached_at is not None and now - e.detached_at > self.resume_ttl)]
            return [self._entries.pop(sid) for sid in gone]


def owner_listener(owner: Any) -> Any:
    """The protocol adapter of an owner (a ClientContext's listener), or None."""
    return getattr(owner, "listener", None)


def address_of(owner: Any) -> str | None:
    """The client address an owner (a ClientContext) connects from; None for an owner without one."""
    return getattr(owner, "address", None)
