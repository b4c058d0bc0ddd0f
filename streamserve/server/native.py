"""`WS /v1/stream`: one connection of the native protocol (docs/protocol.md).

The read loop decodes and validates each frame (`protocol.decode_client`) and dispatches it; nothing
it does waits for the model. Appends are submitted at once and their acks sent by a task when the
engine has the chunk in the KV; replies are forwarded delta by delta by a task each. Blocking session
operations (open, rewind, close: they take the engine lock) run in a worker thread. Everything the
server sends goes through one bounded queue and one writer task, so a client that stops reading slows
only its own connection, and the engine's outboxes merge what it has not read yet. When the connection
ends, for whatever reason, its tasks are cancelled and its sessions detached for a resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

from streamserve.errors import ChunkTooLargeError, StreamserveError
from streamserve.server import protocol as P
from streamserve.server.registry import Entry

if TYPE_CHECKING:
    from streamserve.server.app import Server

log = logging.getLogger("streamserve.server")

OUTGOING_QUEUE = 256  # frames waiting for the writer; a full queue makes this connection's tasks wait
MAX_BAD_MESSAGES = 16  # malformed frames tolerated per connection before it is closed (4400)
MAX_PENDING_ACKS = 256  # appends in flight per connection; past it the read loop waits (backpressure)
SEND_TIMEOUT = 30.0  # seconds a frame may wait for a client that does not read; then the connection is cut
CHARS_PER_TOKEN = 32  # text longer than max_chunk_tokens times this is refused before tokenizing
INLINE_TOKENIZE_CHARS = 512  # longer text is tokenized in a worker thread, not on the event loop


class RateLimiter:
    """A token bucket: `rate` messages a second on average, bursts of twice that. Over the rate the read loop
    waits (backpressure: TCP slows the client down); nothing is dropped."""

    def __init__(self, rate: float) -> None:
        self.rate, self.capacity = rate, 2 * rate
        self.tokens, self.stamp = self.capacity, time.monotonic()

    async def wait(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            await asyncio.sleep((1 - self.tokens) / self.rate)
            self.tokens, self.stamp = 1.0, time.monotonic()
        self.tokens -= 1


class NativeConnection:
    def __init__(self, server: Server, ws: web.WebSocketResponse, transport: Any = None) -> None:
        self.server, self.ws, self.transport = server, ws, transport
        self.cfg = server.config
        self.out: asyncio.Queue[bytes | None] = asyncio.Queue(OUTGOING_QUEUE)
        self.tasks: set[asyncio.Task] = set()
        self.limiter = RateLimiter(self.cfg.messages_per_second)
        self.pending_acks = asyncio.Semaphore(MAX_PENDING_ACKS)
        self.bad = 0

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def run(self) -> None:
        writer = asyncio.create_task(self._writer())
        try:
            await self.send(self.server.hello())
            async for msg in self.ws:
                if msg.type == WSMsgType.BINARY:
                    await self.handle(msg.data)
                elif msg.type == WSMsgType.TEXT:
                    await self.handle(msg.data)  # answered with bad_message: the protocol is binary
                else:  # CLOSE / ERROR
                    break
        finally:
            for t in list(self.tasks):
                t.cancel()
            self.server.registry.detach_all(self)
            await self.out.put(None)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(writer, 5.0)

    async def _writer(self) -> None:
        while True:
            frame = await self.out.get()
            try:
                if frame is None:
                    return
                if not self.ws.closed:  # else drain: nobody can receive it any more
                    try:
                        await asyncio.wait_for(self.ws.send_bytes(frame), SEND_TIMEOUT)
                    except asyncio.TimeoutError:
                        log.warning("streamserve: a client stopped reading for %.0fs; cutting it off", SEND_TIMEOUT)
                        self.abort()
                    except (ConnectionError, RuntimeError):
                        pass  # going away: the read loop ends it
            finally:
                self.out.task_done()

    def abort(self) -> None:
        """Cut the connection at once (a client that does not read; a shutdown that cannot wait)."""
        if self.transport is not None:
            self.transport.abort()

    async def send(self, message: dict[str, Any]) -> None:
        await self.out.put(P.encode(message))

    def send_nowait(self, message: dict[str, Any]) -> bool:
        """Best effort, never waits: False when the client is so far behind that the queue is full."""
        try:
            self.out.put_nowait(P.encode(message))
            return True
        except asyncio.QueueFull:
            return False

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code=code, message=reason.encode()[:120])

    # ---- dispatch -------------------------------------------------------------------------------------
    async def handle(self, data: bytes | str) -> None:
        await self.limiter.wait()
        try:
            m = P.decode_client(data, self.cfg.max_frame_bytes)
        except P.ProtocolError as e:
            await self.send(P.error_message(e.code, e.message, request_id=e.request_id, session=e.session, seq=e.seq))
            self.bad += 1
            if self.bad >= MAX_BAD_MESSAGES:
                await self.close(P.CLOSE_BAD_CLIENT, f"{self.bad} malformed messages")
            return
        self.server.server_metrics.messages.labels(m.type).inc()
        try:
            await getattr(self, f"on_{m.type}")(m)
        except StreamserveError as e:
            await self.send(P.error_message(e.code, str(e), request_id=m.id, session=m.session,
                                            seq=m.fields.get("seq")))
        except Exception as e:  # a bug: say so, log it, keep serving this connection
            log.exception("streamserve: %s failed", m.type)
            await self.send(P.error_message("internal_error", f"the server failed on this {m.type}: {e!r}",
                                            request_id=m.id, session=m.session, seq=m.fields.get("seq")))

    async def on_open(self, m: P.ClientMessage) -> None:
        f, d = m.fields, self.server.session_defaults
        kw: dict[str, Any] = {"window": d.window, "sinks": d.sinks, "positions": d.positions, "page_cap": d.page_cap,
                              "chunk_budget": d.chunk_budget}
        kw.update({k: f[k] for k in ("window", "sinks", "positions", "drafter") if f[k] is not None})
        if f["chunk_budget_ms"] is not None:
            kw["chunk_budget"] = f["chunk_budget_ms"] / 1e3
        sampling = self.server.check_sampling(f["sampling"] or {})
        entry = await asyncio.to_thread(self.server.registry.open, self, sampling, **kw)
        await self.send(self._opened(entry, m.id, resumed=False))

    async def on_resume(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        entry, previous = self.server.registry.resume(self, m.session, m.fields["resume_token"])
        if previous is not None:  # taken over from a connection that has not noticed it is gone
            previous.send_nowait(P.error_message("session_moved", "another connection resumed this session",
                                                 session=m.session))
        await self.send(self._opened(entry, m.id, resumed=True))
        for message in list(entry.recent):  # the latest chunks' results: the client takes those it waits for
            await self.send(message)

    def _opened(self, e: Entry, request_id: Any, resumed: bool) -> dict[str, Any]:
        s, pol = e.session, e.session.kv.policy
        return {"type": "opened", "id": request_id, "session": s.id, "resume_token": e.resume_token,
                "resumed": resumed, "next_seq": s.next_seq, "tokens": len(s.token_ids), "window": pol.window,
                "sinks": pol.sinks, "positions": pol.mode, "chunk_budget_ms": s.chunk_budget * 1e3}

    async def on_append(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        f = m.fields
        s = self.server.registry.get(self, m.session).session
        if f["audio"] is not None or f["image"] is not None:
            raise UnsupportedModalityError(f"this server accepts text and token_ids; {self.server.engine.name} "
                                           "has no audio or vision input yet")
        limit = self.cfg.max_chunk_tokens
        too_many = f["token_ids"] is not None and len(f["token_ids"]) > limit
        too_long = f["text"] is not None and len(f["text"]) > limit * CHARS_PER_TOKEN
        if too_many or too_long:
            raise ChunkTooLargeError(f"this chunk is over the limit of {limit} tokens per chunk; split it")
        now = time.monotonic()
        deadline = None if f["deadline_ms"] is None else now + f["deadline_ms"] / 1e3
        args = (f["text"], f["token_ids"], None, f["seq"], now, deadline, f["kind"] or "text")
        await self.pending_acks.acquire()  # too many in flight: stop reading until acks go out
        try:
            if f["text"] is not None and len(f["text"]) > INLINE_TOKENIZE_CHARS:
                fut = await asyncio.to_thread(s.submit_chunk, *args)  # tokenizing it would stall the loop
            else:
                fut = s.submit_chunk(*args)
        except BaseException:
            self.pending_acks.release()
            raise
        self.server.spawn(self._ack(m, s.id, fut))  # the server's: the ack follows the session if it moves

    async def _ack(self, m: P.ClientMessage, session_id: str, fut: Any) -> None:
        try:
            try:
                ack = await asyncio.wrap_future(fut)
            except StreamserveError as e:
                await self.server.deliver(session_id, P.error_message(e.code, str(e), session=session_id,
                                                                      seq=m.fields["seq"]))
                return
            await self.server.deliver(session_id, {
                "type": "ack", "session": session_id, "seq": ack.seq, "tokens": ack.tokens,
                "queue_ms": round(ack.queue_ms, 3), "compute_ms": round(ack.compute_ms, 3),
                "deadline_missed": ack.deadline_missed, "shed": ack.shed, "capture_time": m.fields["capture_time"]})
        finally:
            self.pending_acks.release()

    async def on_respond(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        entry = self.server.registry.get(self, m.session)
        params = self.server.check_sampling({**entry.sampling, **m.fields})
        stop = params.pop("stop", None)
        stream = entry.session.stream(**params, stop=stop)
        self.spawn(self._forward(stream, m.session))

    async def _forward(self, stream: Any, session_id: str) -> None:
        try:
            async for d in stream:
                await self.send({"type": "delta", "session": session_id, "response": stream.id, "text": d.text,
                                 "token_ids": d.token_ids})
            reason = stream.finish_reason
        except StreamserveError as e:
            await self.send(P.error_message(e.code, str(e), session=session_id))
            reason = "error"
        await self.send({"type": "done", "session": session_id, "response": stream.id, "reason": reason,
                         "usage": stream.usage})

    async def on_cancel(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        self.server.registry.get(self, m.session).session.cancel()

    async def on_rewind(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        s = self.server.registry.get(self, m.session).session
        n = await asyncio.to_thread(s.rewind, m.fields["to"], m.fields["to_seq"])
        await self.send({"type": "rewound", "id": m.id, "session": s.id, "tokens": n, "next_seq": s.next_seq})

    async def on_configure(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        entry = self.server.registry.get(self, m.session)
        if m.fields["sampling"] is not None:
            entry.sampling = self.server.check_sampling({**entry.sampling, **m.fields["sampling"]})
        if m.fields["chunk_budget_ms"] is not None:
            entry.session.chunk_budget = m.fields["chunk_budget_ms"] / 1e3
        await self.send({"type": "configured", "id": m.id, "session": m.session, "sampling": entry.sampling,
                         "chunk_budget_ms": entry.session.chunk_budget * 1e3})

    async def on_close(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        entry = self.server.registry.get(self, m.session)
        self.server.registry.remove(m.session)
        await asyncio.to_thread(entry.session.close)
        await self.send({"type": "closed", "id": m.id, "session": m.session, "reason": "client"})

    async def on_stats(self, m: P.ClientMessage) -> None:
        st = self.server.engine.stats()
        keys = ("model", "sessions_open", "sessions_parked", "kv_pages_used", "kv_pages_total", "steps",
                "queued_chunks", "queued_tokens", "responding", "chunks_shed", "decode_tokens_per_s")
        await self.send({"type": "stats", "id": m.id, **{k: st[k] for k in keys},
                         "connection_sessions": len(self.server.registry.owned(self))})


class UnsupportedModalityError(StreamserveError):
    code = "unsupported_modality"
