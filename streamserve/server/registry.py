"""Which connection holds which session, and how a dropped connection's sessions are resumed.

Every session a client opens gets an unguessable id (the engine's, 128 bits) and a resume token (256
bits). A connection reaches only the sessions it holds; any other id, existing or not, is answered as
unknown, so ids leak nothing. When a connection drops, its sessions are detached (their replies
cancelled) and kept for `resume_ttl` seconds: `resume` with the id and the token (compared in constant
time) re-attaches a session, KV cache and timeline included, to the new connection — taking it over
if the old connection has not noticed it is dead. After the TTL, a detached session is closed and its
pages come back.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from streamserve.engine import Engine, Session
from streamserve.errors import SessionNotFoundError, StreamserveError


class ResumeTokenError(StreamserveError):
    code = "invalid_resume_token"


class TooManySessionsError(StreamserveError):
    code = "too_many_sessions"


@dataclass(eq=False)
class Entry:
    session: Session
    resume_token: str
    owner: Any  # the connection holding it; None while detached
    detached_at: float | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # reply defaults from open / configure


class SessionRegistry:
    def __init__(self, engine: Engine, resume_ttl: float, max_per_owner: int, max_chunk_tokens: int) -> None:
        self.engine, self.resume_ttl = engine, resume_ttl
        self.max_per_owner, self.max_chunk_tokens = max_per_owner, max_chunk_tokens
        self._entries: dict[str, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def owned(self, owner: Any) -> list[Entry]:
        return [e for e in self._entries.values() if e.owner is owner]

    def open(self, owner: Any, sampling: dict[str, Any] | None, **session_kw: Any) -> Entry:
        """A new session held by `owner` (blocking: run it off the event loop)."""
        if len(self.owned(owner)) >= self.max_per_owner:
            raise TooManySessionsError(f"this connection holds {self.max_per_owner} sessions (the limit); close one "
                                       "or open another connection")
        s = self.engine.open_session(**session_kw)
        s.max_chunk_tokens = self.max_chunk_tokens
        entry = Entry(s, secrets.token_urlsafe(32), owner, sampling=dict(sampling or {}))
        self._entries[s.id] = entry
        return entry

    def get(self, owner: Any, session_id: str) -> Entry:
        """The session `owner` holds under this id; SessionNotFoundError for anything else."""
        e = self._entries.get(session_id)
        if e is None or e.owner is not owner or e.session.closed:
            raise SessionNotFoundError(f"this connection holds no session {session_id!r}; open one, or resume a "
                                       "dropped one with its resume token")
        return e

    def resume(self, owner: Any, session_id: str, token: str) -> tuple[Entry, Any]:
        """Re-attach a session to `owner`; -> (entry, the connection it was taken from, if any)."""
        e = self._entries.get(session_id)
        if e is None or e.session.closed:
            raise SessionNotFoundError(f"no session {session_id!r} to resume: it was closed, expired after "
                                       f"{self.resume_ttl:g}s detached, or never existed; open a new one")
        if not hmac.compare_digest(e.resume_token.encode(), token.encode()):
            raise ResumeTokenError("the resume token does not match this session")
        if e.owner is not owner and len(self.owned(owner)) >= self.max_per_owner:
            raise TooManySessionsError(f"this connection holds {self.max_per_owner} sessions (the limit)")
        previous = e.owner if e.owner is not owner else None
        e.owner, e.detached_at = owner, None
        return e, previous

    def detach_all(self, owner: Any) -> list[Entry]:
        """The owner's connection dropped: cancel its sessions' replies and keep them for a resume."""
        now = time.monotonic()
        entries = self.owned(owner)
        for e in entries:
            e.owner, e.detached_at = None, now
            e.session.cancel()
        return entries

    def remove(self, session_id: str) -> Entry | None:
        return self._entries.pop(session_id, None)

    def expired(self, now: float | None = None) -> list[Entry]:
        """Take out the detached sessions past their TTL and the sessions the engine closed (faults,
        idle TTL); the caller closes them (blocking)."""
        now = time.monotonic() if now is None else now
        gone = [sid for sid, e in self._entries.items() if e.session.closed or
                (e.detached_at is not None and now - e.detached_at > self.resume_ttl)]
        return [self._entries.pop(sid) for sid in gone]

    def all(self) -> list[Entry]:
        return list(self._entries.values())
