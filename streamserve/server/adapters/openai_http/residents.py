"""The sessions the HTTP APIs keep resident, per owner, and how they are let go (turns.py runs turns on them).

Each owner (host.py: the bearer presented) is one `ClientContext` of the session service, whose listener
(`Dispatch`) routes each session's results to the turn running on it. An owner holds at most
--max-sessions-per-connection sessions: the least recently used idle one is parked for a new one; an idle one is
parked after --http-session-ttl. *Parked* means written to the --snapshot-store as a hand-off record (a later turn
resumes it: nothing is computed again) when there is one and a stored object holds the session's state, else closed.
The holder hears where (`parked(holder, session id, resume)`). An owner with no session and no turn running is
retired by the reaper (its context disconnected).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamserve.engine.chat import Message
from streamserve.server.adapters.openai_http.errors import ApiError
from streamserve.server.adapters.openai_http.store import Resume
from streamserve.server.service.auth import Grant
from streamserve.server.service.context import ClientContext

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.server.service.service import SessionService

log = logging.getLogger("streamserve.server")

Parked = Callable[[str, str, Resume | None], None]  # (holder id, session id, where it went or None: closed)


@dataclass
class Resident:
    id: str
    token: str  # its resume token: the snapshot store's key for it (never sent to a client)
    busy: bool = False  # a turn runs on it (or is placing itself on it)
    holder: str | None = None  # the stored response or conversation whose state it holds; None: chat completions'
    used: float = field(default_factory=time.monotonic)


class Dispatch:
    """An owner's ResultListener: each session's results go to the queue of the turn running on it."""

    hands_off = True  # a drain hands its sessions over to the snapshot store (server/service/lifecycle.py)

    def __init__(self, record_ttl: float) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.record_ttl = record_ttl  # how long a hand-off record of its sessions is kept (lifecycle.record_of)

    async def push(self, result: Any) -> None:
        q = self.queues.get(getattr(result, "session", None) or "")
        if q is not None:
            await q.put(result)

    def push_nowait(self, result: Any) -> bool:
        q = self.queues.get(getattr(result, "session", None) or "")
        if q is not None:
            try:
                q.put_nowait(result)
            except asyncio.QueueFull:
                return False
        return True


class Owner:
    def __init__(self, key: str, service: SessionService, record_ttl: float) -> None:
        self.key, self.dispatch = key, Dispatch(record_ttl)
        self.ctx: ClientContext = service.connect(self.dispatch, Grant())
        self.residents: dict[str, Resident] = {}
        self.active = 0  # turns running: the reaper never retires an owner with one


class Residents:
    def __init__(self, service: Callable[[], SessionService], parked: Parked, record_ttl: float) -> None:
        self.service, self.parked, self.record_ttl = service, parked, record_ttl
        self.owners: dict[str, Owner] = {}

    def owner(self, key: str) -> Owner:
        if key not in self.owners:
            self.owners[key] = Owner(key, self.service(), self.record_ttl)
        return self.owners[key]

    def idle(self, owner: Owner, session_id: str) -> Resident | None:
        """The owner's resident session `session_id`, now busy, if it is idle and open; else None."""
        res = owner.residents.get(session_id)
        entry = self.service().registry.find(session_id)
        if res is None or entry is None or entry.session.closed:
            if res is not None and not res.busy:
                owner.residents.pop(session_id, None)
            return None
        if res.busy:
            return None
        res.busy = True
        return res

    def transcript(self, res: Resident) -> list[Message]:
        chat = self.service().chats.get(res.id)
        if chat is None or chat.messages.gap is not None:  # an endless session forgot its start: never matched
            return [{"role": "\x00", "content": ""}]
        return list(chat.messages.kept())

    async def make_room(self, owner: Owner, keep: Resident | None = None) -> None:
        """Below the owner's session limit: its least recently used idle session is parked (or closed)."""
        limit = self.service().config.max_sessions_per_connection
        while len(owner.residents) >= limit:
            idle = [r for r in owner.residents.values() if not r.busy and r is not keep]
            if not idle:
                raise ApiError(429, f"This key has {limit} turns running (the server's --max-sessions-per-connection)"
                               "; wait for one to end.", "too_many_sessions")
            await self.park(owner, min(idle, key=lambda r: r.used))

    async def park(self, owner: Owner, res: Resident) -> None:
        """Let an idle resident session go: into the snapshot store when there is one and it holds a stored object's
        state, else closed; its holder hears where."""
        owner.residents.pop(res.id, None)
        service = self.service()
        entry = service.registry.find(res.id)
        where = None
        if entry is not None and service.store is not None and res.holder is not None and not entry.session.closed:
            store = service.store
            try:
                await service.run_engine(lambda: store.put(service.record_of(entry)))
                where = Resume(res.id, res.token)
            except Exception as e:
                log.warning("streamserve: openai: session %s not parked (%s: %s)", res.id, type(e).__name__, e)
        if entry is not None:
            await self.close(owner, res.id)
        if res.holder is not None:
            self.parked(res.holder, res.id, where)

    async def close(self, owner: Owner, session_id: str) -> None:
        with contextlib.suppress(Exception):  # already gone (the engine closed it, a drain moved it)
            await self.service().close(owner.ctx, session_id)

    async def drop(self, owner: Owner, res: Resident) -> None:
        """A session whose turn failed or was cancelled: its reply ends, it closes (its state is not trusted)."""
        owner.residents.pop(res.id, None)
        self.service().cancel_session(res.id)
        await self.close(owner, res.id)

    async def reap(self, ttl: float) -> None:
        """Park the sessions idle for longer than `ttl`; retire owners with nothing left."""
        now = time.monotonic()
        for owner in list(self.owners.values()):
            for res in list(owner.residents.values()):
                if not res.busy and now - res.used > ttl and owner.residents.get(res.id) is res:
                    await self.park(owner, res)
            if not owner.residents and not owner.active and self.owners.get(owner.key) is owner:
                self.service().disconnect(owner.ctx)
                del self.owners[owner.key]

    async def let_go(self, owner: Owner, session_id: str | None) -> None:
        """Close a session its holder no longer needs (a response or conversation deleted or evicted)."""
        res = owner.residents.get(session_id or "")
        if res is not None and not res.busy:
            owner.residents.pop(res.id, None)
            await self.close(owner, res.id)


def common(a: list[Message], b: list[Message]) -> int:
    """How many leading messages `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x["role"] != y["role"] or x["content"] != y["content"]:
            break
        n += 1
    return n


def groups(messages: list[Message]) -> list[list[Message]]:
    """Messages in append groups: a system message goes with the message after it (templates such as Gemma's render
    it into the next turn: alone it does not extend the conversation)."""
    out: list[list[Message]] = []
    held: list[Message] = []
    for m in messages:
        held.append(m)
        if m["role"] != "system":
            out.append(held)
            held = []
    if held:
        out.append(held)
    return out
