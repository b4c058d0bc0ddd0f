"""Which session a turn of the HTTP APIs runs on, and the turn itself, through the session service.

A turn is (`history`: the messages before it, `new`: its messages, sampling). Its session is chosen so that as few
tokens as possible are computed again:
- **continue**: a resident session whose chat transcript is exactly `history` (the session that ended the previous
  response, or a conversation's): only `new` (with the last reply's pending end of turn) is appended;
- **fork**: a resident session whose transcript extends `history` but belongs to another branch (a second
  continuation of the same response): its KV pages are copied to a new session (a snapshot restored: nothing is
  computed again) and the copy is rewound to `history`; a conversation's own session is rewound instead;
- **reuse** (chat completions): the longest idle session of the owner whose transcript is a prefix of the request's
  messages and whose tokens are a prefix of the request's rendered token ids;
- **restore**: a session parked in the snapshot store (evicted, or handed over by a drain) is resumed from it;
- **prefill**: else a new session, `history` appended first.
`cached_tokens` is the session's length when the turn's first new token goes in: what was not computed again.

Sessions belong to one owner (host.py): each owner is one `ClientContext` of the service (its limits: at most
--max-sessions-per-connection resident sessions; the least recently used idle one is parked or closed to make room).
An idle session is parked after --http-session-ttl. A turn that fails or is cancelled (its client went away) closes
its session: its KV pages come back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamserve.engine.chat import Message
from streamserve.server.auth import Grant
from streamserve.server.context import ClientContext
from streamserve.server.openai_http.errors import ApiError
from streamserve.server.openai_http.store import Resume
from streamserve.server.results import AppendRequest, ChunkResult, OpenRequest, ReplyDelta, ReplyDone, ServiceError

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.server.service import SessionService

log = logging.getLogger("streamserve.server")

QUEUE = 64  # results waiting for a turn's reader (the reply waits when its client reads slower than it decodes)
CHARS_PER_CHUNK = 2048  # a prefill appends messages in chunks of about this much text (each under max_chunk_tokens)
OnText = Callable[[str], Awaitable[None]]


@dataclass
class Resident:
    id: str
    token: str  # its resume token: the snapshot store's key for it (never sent to a client)
    busy: bool = False
    holder: str | None = None  # the stored response or conversation whose state it holds; None: chat completions'
    used: float = field(default_factory=time.monotonic)


@dataclass
class TurnResult:
    text: str
    finish_reason: str  # stop, length, cancelled, error, context
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    session: Resident
    history: list[Message]  # the transcript after the turn: history + new + the reply


class Dispatch:
    """The owner's ResultListener: each session's results go to the queue of the turn running on it."""

    hands_off = True  # a drain hands its sessions over to the snapshot store (server/lifecycle.py)

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}

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
    def __init__(self, key: str, service: SessionService) -> None:
        self.key, self.dispatch = key, Dispatch()
        self.ctx: ClientContext = service.connect(self.dispatch, Grant())
        self.residents: dict[str, Resident] = {}


class Turns:
    def __init__(self, service: Callable[[], SessionService]) -> None:
        self.service = service
        self.owners: dict[str, Owner] = {}

    def owner(self, key: str) -> Owner:
        if key not in self.owners:
            self.owners[key] = Owner(key, self.service())
        return self.owners[key]

    # ---- the turn ------------------------------------------------------------------------------------------
    async def run(self, owner: Owner, history: list[Message], new: list[Message], sampling: dict[str, Any],
                  on_text: OnText, prefer: str | None = None, resume: Resume | None = None,
                  rewind: bool = False, placed: Callable[[Resident], None] | None = None) -> TurnResult:
        """Run a turn (see the module's docstring); `prefer`: the resident session to continue (a response's, a
        conversation's; None: reuse among the owner's chat-completions sessions); `rewind`: that session may be
        rewound to `history` (a conversation's) rather than forked; `on_text` gets the reply's text as it comes."""
        service = self.service()
        params = service.check_sampling(sampling)  # refused before any session is taken
        res, cached, add = await self.place(owner, history, new, prefer, resume, rewind)
        if placed is not None:
            placed(res)
        q: asyncio.Queue = asyncio.Queue(QUEUE)
        owner.dispatch.queues[res.id] = q
        ok = False
        try:
            for part in chunks(add):
                await service.append(owner.ctx, res.id, AppendRequest(text="".join(m["content"] for m in part)),
                                     message=part)
            service.respond(owner.ctx, res.id, params)
            text, done = await self.read(q, on_text)
            chat = service.chats.get(res.id)
            after = list(chat.messages.kept()) if chat is not None else [*history, *new]
            usage = done.usage
            ok = done.reason not in ("error", "closed")
            return TurnResult(text, done.reason, usage["session_tokens"] - usage["completion_tokens"],
                              usage["completion_tokens"], cached, res, after)
        finally:
            owner.dispatch.queues.pop(res.id, None)
            if ok:
                res.busy, res.used = False, time.monotonic()
            else:  # failed or cancelled (the client went away): the session goes, with whatever it was doing
                service.spawn(self.drop(owner, res))

    async def read(self, q: asyncio.Queue, on_text: OnText) -> tuple[str, ReplyDone]:
        parts: list[str] = []
        while True:
            r = await q.get()
            if isinstance(r, ChunkResult) and r.error is not None:
                raise ServiceFailure(r.error)
            if isinstance(r, ServiceError):
                raise ServiceFailure(r)
            if isinstance(r, ReplyDelta) and r.text:
                parts.append(r.text)
                await on_text(r.text)
            if isinstance(r, ReplyDone):
                return "".join(parts), r

    # ---- which session ---------------------------------------------------------------------------------------
    async def place(self, owner: Owner, history: list[Message], new: list[Message], prefer: str | None,
                    resume: Resume | None, rewind: bool) -> tuple[Resident, int, list[list[Message]]]:
        """-> (the session, now busy; its length kept; the message groups to append)."""
        service = self.service()
        res = self.idle(owner, prefer) if prefer is not None else None
        if res is None and prefer is None:
            res = await self.reusable(owner, [*history, *new])
        if res is None and resume is not None:
            res = await self.restored(owner, resume)
        if res is not None:
            kept = self.transcript(res)
            n = common(kept, history)
            if n == len(kept) or (n > 0 and prefer is not None):
                try:
                    if n < len(kept):  # it holds more than `history`: another branch's (fork), or rewound
                        res = res if rewind else await self.fork(owner, res)
                        await service.rewind(owner.ctx, res.id, None, None, to_message=n)
                        n = len(self.transcript(res))  # messages appended together go back together
                    held = len(service.registry.get(owner.ctx, res.id).session.token_ids)
                except BaseException:
                    await self.drop(owner, res)
                    raise
                return res, held, [*groups(history[n:]), *groups(new)]
            res.busy = False
        res = await self.open(owner)
        return res, 0, [*groups(history), *groups(new)]

    async def drop(self, owner: Owner, res: Resident) -> None:
        owner.residents.pop(res.id, None)
        self.service().cancel_session(res.id)
        await self.close(owner, res.id)

    def idle(self, owner: Owner, session_id: str) -> Resident | None:
        res = owner.residents.get(session_id)
        if res is None or self.service().registry.find(session_id) is None:
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

    async def reusable(self, owner: Owner, messages: list[Message]) -> Resident | None:
        """The owner's idle chat-completions session holding the longest prefix of `messages`, by messages and token
        ids (busy now), or None."""
        service = self.service()
        best: tuple[int, Resident] | None = None
        for res in list(owner.residents.values()):
            if res.holder is None and not res.busy and service.registry.find(res.id) is not None:
                kept = self.transcript(res)
                if kept and common(kept, messages) == len(kept) < len(messages) and (best is None or
                                                                                     len(kept) > best[0]):
                    best = (len(kept), res)
        if best is None:
            return None
        res = best[1]
        res.busy = True
        chat = service.chats.get(res.id)
        session = service.registry.find(res.id).session

        def same_tokens() -> bool:  # the request rendered by the template, tokenized: does the session hold its head?
            held = list(session.token_ids)
            return chat.encode(chat.render(messages, True))[:len(held)] == held

        if await asyncio.get_running_loop().run_in_executor(service.tokenize_executor, same_tokens):
            return res
        res.busy = False
        return None

    async def open(self, owner: Owner) -> Resident:
        await self.make_room(owner)
        opened = await self.service().open(owner.ctx, OpenRequest(), chat=True)
        res = Resident(opened.session, opened.resume_token, busy=True)
        owner.residents[res.id] = res
        return res

    async def fork(self, owner: Owner, src: Resident) -> Resident:
        """A copy of `src` (its KV pages and transcript; nothing computed again), busy; `src` is idle again."""
        await self.make_room(owner, keep=src)
        try:
            opened = await self.service().fork(owner.ctx, src.id)
        finally:
            src.busy = False
        res = Resident(opened.session, opened.resume_token, busy=True)
        owner.residents[res.id] = res
        return res

    async def restored(self, owner: Owner, resume: Resume) -> Resident | None:
        """The session parked in the snapshot store, resumed here (busy), or None when it is not there any more."""
        service = self.service()
        if service.store is None:
            return None
        await self.make_room(owner)
        try:
            opened, _ = await service.resume(owner.ctx, resume.session_id, resume.token)
        except Exception as e:  # gone, expired, of another model: the turn prefills instead
            log.info("streamserve: openai: session %s not restored (%s)", resume.session_id, type(e).__name__)
            return None
        res = Resident(opened.session, resume.token, busy=True)
        owner.residents[res.id] = res
        return res

    # ---- letting sessions go ---------------------------------------------------------------------------------
    async def make_room(self, owner: Owner, keep: Resident | None = None) -> None:
        """Below the owner's session limit: its least recently used idle session is parked (or closed)."""
        limit = self.service().config.max_sessions_per_connection
        while len(owner.residents) >= limit:
            idle = [r for r in owner.residents.values() if not r.busy and r is not keep]
            if not idle:
                raise ApiError(429, f"This key has {limit} turns running (the server's --max-sessions-per-connection)"
                               "; wait for one to end.", "too_many_sessions")
            await self.park(owner, min(idle, key=lambda r: r.used))

    async def park(self, owner: Owner, res: Resident) -> Resume | None:
        """Let a resident session go: into the snapshot store when there is one (-> where), else closed."""
        owner.residents.pop(res.id, None)
        service = self.service()
        entry = service.registry.find(res.id)
        if entry is None:
            return None
        if service.store is not None and res.holder is not None:
            try:
                await service.run_engine(lambda: service.store.put(service.record_of(entry)))
                await self.close(owner, res.id)
                return Resume(res.id, res.token)
            except Exception as e:
                log.warning("streamserve: openai: session %s not parked (%s: %s)", res.id, type(e).__name__, e)
        await self.close(owner, res.id)
        return None

    async def close(self, owner: Owner, session_id: str) -> None:
        with contextlib.suppress(Exception):  # already gone (the engine closed it, a drain moved it)
            await self.service().close(owner.ctx, session_id)

    async def reap(self, ttl: float, parked: Callable[[str, Resume | None], None]) -> None:
        """Park the sessions idle for longer than `ttl`; `parked(holder, resume)` tells their holders."""
        now = time.monotonic()
        for owner in list(self.owners.values()):
            for res in list(owner.residents.values()):
                if not res.busy and now - res.used > ttl:
                    where = await self.park(owner, res)
                    if res.holder is not None:
                        parked(res.holder, where)
            if not owner.residents:
                self.service().disconnect(owner.ctx)
                del self.owners[owner.key]

    async def let_go(self, owner: Owner, session_id: str | None) -> None:
        """Close a session its holder no longer needs (a response or conversation deleted or evicted)."""
        res = owner.residents.get(session_id or "")
        if res is not None and not res.busy:
            owner.residents.pop(res.id, None)
            await self.close(owner, res.id)


class ServiceFailure(Exception):
    """A typed error the service pushed for a turn's chunk or reply."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


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


def chunks(message_groups: list[list[Message]]) -> list[list[Message]]:
    """Groups joined into appends of about CHARS_PER_CHUNK characters (a long history in a few chunks, each under
    the chunk limit; one long message stays one chunk, and is refused if over it)."""
    out: list[list[Message]] = []
    for g in message_groups:
        if not g:
            continue
        if out and sum(len(m["content"]) for m in out[-1] + g) <= CHARS_PER_CHUNK:
            out[-1] = out[-1] + g
        else:
            out.append(list(g))
    return out
