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

Sessions belong to one owner and are let go as residents.py says. A turn that fails or is cancelled (its client
went away) closes its session: its KV pages come back at once; a session it only looked at stays as it was.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from streamserve.engine.chat import Message
from streamserve.server.adapters.openai_http.residents import Owner, Resident, Residents, common, groups, log
from streamserve.server.adapters.openai_http.store import Resume
from streamserve.server.service.results import (
    AppendRequest,
    ChunkResult,
    OpenRequest,
    ReplyDelta,
    ReplyDone,
    ServiceError,
)

QUEUE = 64  # results waiting for a turn's reader (the reply waits when its client reads slower than it decodes)
TEMPLATE_TOKENS = 16  # per message, for its role header and end of turn, when appends are sized
OnText = Callable[[str], Awaitable[None]]


@dataclass
class TurnResult:
    text: str
    finish_reason: str  # stop, length, cancelled, error, context
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    session: Resident
    history: list[Message]  # the transcript after the turn: history + new + the reply


class ServiceFailure(Exception):
    """A typed error the service pushed for a turn's chunk or reply."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


class Turns(Residents):
    async def run(self, key: str, history: list[Message], new: list[Message], sampling: dict[str, Any],
                  on_text: OnText, prefer: str | None = None, resume: Resume | None = None,
                  rewind: bool = False) -> TurnResult:
        """Run a turn for owner `key` (see the module's docstring); `prefer`: the resident session to continue (a
        response's, a conversation's; None: reuse among the owner's chat-completions sessions); `rewind`: that
        session may be rewound to `history` (a conversation's) rather than forked; `on_text` gets the reply's text
        as it comes."""
        service = self.service()
        params = service.check_sampling(sampling)  # refused before any session is taken
        owner = self.owner(key)
        owner.active += 1
        try:
            res, cached, add = await self.place(owner, history, new, prefer, resume, rewind)
            return await self.reply(owner, res, cached, add, params, on_text, [*history, *new])
        finally:
            owner.active -= 1

    async def reply(self, owner: Owner, res: Resident, cached: int, add: list[list[Message]], params: dict[str, Any],
                    on_text: OnText, expected: list[Message]) -> TurnResult:
        service = self.service()
        q: asyncio.Queue = asyncio.Queue(QUEUE)
        owner.dispatch.queues[res.id] = q
        ok = False
        try:
            for part in await self.chunks(add):
                await service.append(owner.ctx, res.id, AppendRequest(text="".join(m["content"] for m in part)),
                                     message=part)
            service.respond(owner.ctx, res.id, params)
            text, done = await self.read(q, on_text)
            chat = service.chats.get(res.id)
            after = list(chat.messages.kept()) if chat is not None else expected
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

    async def chunks(self, message_groups: list[list[Message]]) -> list[list[Message]]:
        """Groups joined into appends of at most --max-chunk-tokens (counted with the tokenizer, off the event loop,
        plus TEMPLATE_TOKENS a message); a group over it alone stays one append, and is refused."""
        service = self.service()
        limit = service.config.max_chunk_tokens
        flat = [m for g in message_groups for m in g]
        if sum(len(m["content"]) for m in flat) + TEMPLATE_TOKENS * len(flat) <= limit:  # surely under (1 char >= 1)
            return [flat] if flat else []
        tok = service.engine.tokenizer

        def sizes() -> list[int]:
            return [sum(len(tok.encode(m["content"], add_special_tokens=False)) + TEMPLATE_TOKENS for m in g)
                    for g in message_groups]

        counts = await asyncio.get_running_loop().run_in_executor(service.tokenize_executor, sizes)
        out: list[list[Message]] = []
        size = 0
        for g, n in zip(message_groups, counts, strict=True):
            if out and size + n <= limit:
                out[-1], size = out[-1] + g, size + n
            elif g:
                out.append(list(g))
                size = n
        return out

    # ---- which session ---------------------------------------------------------------------------------------
    async def place(self, owner: Owner, history: list[Message], new: list[Message], prefer: str | None,
                    resume: Resume | None, rewind: bool) -> tuple[Resident, int, list[list[Message]]]:
        """-> (the session, now busy; its length kept; the message groups to append). A session found here that the
        turn does not take is idle again; one made here is closed on any failure."""
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
                if n < len(kept) and not rewind:  # another branch's: copied (the source is idle again)
                    res = await self.fork(owner, res)
                try:
                    if n < len(kept):  # back to `history`'s head (messages appended together go back together)
                        await service.rewind(owner.ctx, res.id, None, None, to_message=n)
                        n = len(self.transcript(res))
                    held = len(service.registry.get(owner.ctx, res.id).session.token_ids)
                except BaseException:
                    service.spawn(self.drop(owner, res))
                    raise
                return res, held, [*groups(history[n:]), *groups(new)]
            res.busy = False
        res = await self.open(owner)
        return res, 0, [*groups(history), *groups(new)]

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
        if best is None or (res := self.idle(owner, best[1].id)) is None:
            return None
        chat = service.chats.get(res.id)
        session = service.registry.find(res.id).session

        def same_tokens() -> bool:  # the request rendered by the template, tokenized: does the session hold its head?
            held = list(session.token_ids)
            return chat.encode(chat.render(messages, True))[:len(held)] == held

        try:
            if await asyncio.get_running_loop().run_in_executor(service.tokenize_executor, same_tokens):
                return res
        except BaseException:
            res.busy = False
            raise
        res.busy = False
        return None

    async def open(self, owner: Owner) -> Resident:
        await self.make_room(owner)
        opened = await self.service().open(owner.ctx, OpenRequest(), chat=True)  # closed if cancelled (service)
        res = Resident(opened.session, opened.resume_token, busy=True)
        owner.residents[res.id] = res
        return res

    async def fork(self, owner: Owner, src: Resident) -> Resident:
        """A copy of `src` (its KV pages and transcript; nothing computed again), busy; `src` is idle again."""
        try:
            await self.make_room(owner, keep=src)
            copying = asyncio.ensure_future(self.service().fork(owner.ctx, src.id))
            try:
                opened = await asyncio.shield(copying)
            except asyncio.CancelledError:  # the copy is made all the same: nobody's, it closes
                copying.add_done_callback(lambda f: self.orphaned(owner, f, lambda o: o.session))
                raise
        finally:
            src.busy = False
        res = Resident(opened.session, opened.resume_token, busy=True)
        owner.residents[res.id] = res
        return res

    async def restored(self, owner: Owner, resume: Resume) -> Resident | None:
        """The session parked in the snapshot store, resumed here (busy), or None when it is not there any more or
        another turn holds it (the turn then prefills)."""
        service = self.service()
        if service.registry.find(resume.session_id) is not None:  # resumed here already, by an earlier turn
            return self.idle(owner, resume.session_id)
        if service.store is None:
            return None
        await self.make_room(owner)
        resuming = asyncio.ensure_future(service.resume(owner.ctx, resume.session_id, resume.token))
        try:
            opened, _ = await asyncio.shield(resuming)
        except asyncio.CancelledError:
            resuming.add_done_callback(lambda f: self.orphaned(owner, f, lambda o: o[0].session))
            raise
        except Exception as e:  # gone, expired, of another model: the turn prefills instead
            log.info("streamserve: openai: session %s not restored (%s)", resume.session_id, type(e).__name__)
            return None
        res = Resident(opened.session, resume.token, busy=True)
        owner.residents[res.id] = res
        return res

    def orphaned(self, owner: Owner, made: asyncio.Future, session_of: Callable[[Any], str]) -> None:
        """A session made for a turn that was cancelled meanwhile: closed."""
        if not made.cancelled() and made.exception() is None:
            self.service().spawn(self.close(owner, session_of(made.result())))
