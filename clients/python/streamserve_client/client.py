"""The asyncio client of streamserve's native protocol.

    async with streamserve_client.connect("ws://127.0.0.1:8000", api_key=None) as client:
        session = await client.open_session(window=None, sinks=4)
        ack = await session.append(text="...")
        async for delta in session.respond(max_tokens=32, temperature=0.0):
            print(delta.text, end="")

One reader task routes the server's messages: replies to requests (by `id`), acks (by session and
seq), deltas and the end of a reply (by session). When the connection drops, the client reconnects
and resumes every session with its resume token; chunks whose acks were lost are sent again when the
server had not received them (by seq) and acknowledged as `replayed` when it had. A reply running
when the connection dropped ends with `ConnectionLostError` (the server cancels it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection

from streamserve_client.errors import (
    ConnectionLostError,
    InvalidInputError,
    ServerBusyError,
    StreamserveClientError,
    UnauthorizedError,
    from_message,
)

PATH = "/v1/stream"


@dataclass(frozen=True)
class Ack:
    """A chunk is in the session's KV cache (or was shed). Times in milliseconds."""

    seq: int
    tokens: int
    queue_ms: float  # waiting in the server's scheduler
    compute_ms: float  # in the engine
    round_trip_ms: float  # send to ack, measured here
    deadline_missed: bool = False
    shed: bool = False
    replayed: bool = False  # acknowledged after a reconnect: the server had it, its timings were lost


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)


def _pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb({k: v for k, v in message.items() if v is not None}, use_bin_type=True)


def _ndarray(a: np.ndarray) -> dict[str, Any]:
    """openpi's array form."""
    a = np.ascontiguousarray(a)
    return {"__ndarray__": True, "data": a.tobytes(), "dtype": a.dtype.str, "shape": list(a.shape)}


@dataclass(eq=False)
class _PendingAck:
    future: asyncio.Future
    message: dict[str, Any]
    sent_at: float  # perf_counter
    generation: int = -1  # the connection it was last sent on


class Response:
    """One reply: iterate it for `Delta`s; `finish_reason` and `usage` are set when it ends."""

    def __init__(self, session: Session, params: dict[str, Any]) -> None:
        self.session, self.params = session, params
        self.id: str | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, int] = {}
        self.text = ""
        self.token_ids: list[int] = []
        self._queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        self._started = False
        self._request_id: int | None = None

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        if not self._started:
            self._started = True
            await self.session._start_response(self)
        if self.finish_reason is not None:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._end("error")
            raise item
        if item["type"] == "done":
            self._end(item.get("reason", "error"))
            self.usage = item.get("usage", {})
            raise StopAsyncIteration
        self.id = item.get("response")
        d = Delta(item.get("text", ""), list(item.get("token_ids", [])))
        self.text += d.text
        self.token_ids += d.token_ids
        return d

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        self.session.client._replies.pop(self._request_id, None)

    async def wait(self) -> str:
        """Read to the end; -> the finish reason."""
        async for _ in self:
            pass
        assert self.finish_reason is not None
        return self.finish_reason


class Session:
    def __init__(self, client: Client, opened: dict[str, Any]) -> None:
        self.client = client
        self.id: str = opened["session"]
        self.resume_token: str = opened["resume_token"]
        self.info = opened
        self.next_seq: int = opened.get("next_seq", 0)
        self._acks: dict[int, _PendingAck] = {}  # by seq
        self._response: Response | None = None
        self.closed = False

    async def append(self, text: str | None = None, token_ids: list[int] | None = None,
                     audio: tuple[np.ndarray | bytes, int] | None = None, image: np.ndarray | None = None, *,
                     seq: int | None = None, capture_time: float | None = None, deadline_ms: float | None = None,
                     kind: str | None = None) -> Ack:
        """Send a chunk (exactly one of text, token_ids, audio=(pcm, rate), image) and wait for its ack.
        `seq` defaults to the next number; `capture_time` (any clock) comes back in the ack's message;
        `deadline_ms`: how soon after it reaches the server the chunk should be in the KV cache."""
        self._check()
        if sum(x is not None for x in (text, token_ids, audio, image)) != 1:
            raise InvalidInputError("append takes exactly one of text, token_ids, audio, image")
        msg: dict[str, Any] = {"type": "append", "session": self.id, "text": text, "capture_time": capture_time,
                               "token_ids": None if token_ids is None else [int(t) for t in token_ids],
                               "deadline_ms": deadline_ms, "kind": kind}
        if audio is not None:
            pcm, rate = audio
            data = pcm if isinstance(pcm, bytes) else np.asarray(pcm).astype("<i2").tobytes()
            msg["audio"] = {"pcm": data, "rate": int(rate), "channels": 1, "format": "s16le"}
        if image is not None:
            msg["image"] = _ndarray(np.asarray(image))
        seq = self.next_seq if seq is None else seq
        msg["seq"] = seq
        self.next_seq = seq + 1
        pending = _PendingAck(asyncio.get_running_loop().create_future(), msg, time.perf_counter())
        self._acks[seq] = pending
        try:
            await self.client._send_append(pending)
            return await pending.future
        finally:
            self._acks.pop(seq, None)

    def respond(self, max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                top_k: int | None = None, seed: int | None = None, stop: list[str] | None = None) -> Response:
        """A reply to everything appended so far: `async for delta in session.respond(...)`.
        Parameters left out take the session's defaults (set at open or by `configure`)."""
        self._check()
        return Response(self, {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                               "top_k": top_k, "seed": seed, "stop": stop})

    async def _start_response(self, r: Response) -> None:
        if self._response is not None and self._response.finish_reason is None:
            raise InvalidInputError("this session already has a reply running; cancel it or read it to the end")
        self._response = r
        rid = next(self.client._ids)  # an error refusing this request comes back with its id
        self.client._replies[rid] = r
        r._request_id = rid
        await self.client._send({"type": "respond", "session": self.id, "id": rid, **r.params})

    async def cancel(self) -> None:
        """Stop the running reply (its iteration ends with finish_reason "cancelled")."""
        self._check()
        await self.client._send({"type": "cancel", "session": self.id})

    async def rewind(self, to_seq: int | None = None, to: int | None = None) -> int:
        """Forget everything after chunk `to_seq` (kept) or token position `to`; -> the session's length."""
        reply = await self.client._request({"type": "rewind", "session": self.id, "to_seq": to_seq, "to": to})
        self.next_seq = reply.get("next_seq", self.next_seq)
        return int(reply["tokens"])

    async def configure(self, chunk_budget_ms: float | None = None, **sampling: Any) -> dict[str, Any]:
        """Change the session's reply defaults (max_tokens, temperature, top_p, top_k, seed, stop) or its
        chunk deadline budget."""
        return await self.client._request({"type": "configure", "session": self.id, "chunk_budget_ms": chunk_budget_ms,
                                           "sampling": sampling or None})

    async def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(StreamserveClientError):
                await self.client._request({"type": "close", "session": self.id})
            self._lost(None)

    def _check(self) -> None:
        if self.closed:
            raise StreamserveClientError(f"session {self.id} is closed", code="session_closed")

    def _lost(self, error: BaseException | None) -> None:
        """The session is gone (closed, or not resumable): everything waiting on it ends."""
        self.closed = True
        self.client._sessions.pop(self.id, None)
        for p in self._acks.values():
            if not p.future.done():
                p.future.set_exception(error or StreamserveClientError("session closed", code="session_closed"))
        if self._response is not None and self._response.finish_reason is None and error is not None:
            self._response._queue.put_nowait(error)

    # ---- routing (called by the reader) ---------------------------------------------------------------
    def _on_ack(self, m: dict[str, Any]) -> None:
        p = self._acks.get(m.get("seq", -1))
        if p is not None and not p.future.done():
            p.future.set_result(Ack(m["seq"], m.get("tokens", 0), m.get("queue_ms", 0.0), m.get("compute_ms", 0.0),
                                    (time.perf_counter() - p.sent_at) * 1e3, m.get("deadline_missed", False),
                                    m.get("shed", False)))

    def _on_error(self, m: dict[str, Any]) -> None:
        err = from_message(m)
        p = self._acks.get(m["seq"]) if m.get("seq") is not None else None
        if p is not None:
            if not p.future.done():
                p.future.set_exception(err)
        elif m.get("code") == "session_moved":
            self._lost(err)
        elif self._response is not None and self._response.finish_reason is None:
            self._response._queue.put_nowait(err)

    def _on_reply(self, m: dict[str, Any]) -> None:
        if self._response is not None:
            self._response._queue.put_nowait(m)


class Client:
    def __init__(self, url: str, api_key: str | None = None, reconnect: bool = True, retries: int = 5,
                 max_frame_bytes: int = 1 << 22) -> None:
        self.url = url if url.rstrip("/").endswith(PATH) else url.rstrip("/") + PATH
        self.api_key, self.reconnect, self.retries = api_key, reconnect, retries
        self.max_frame_bytes = max_frame_bytes
        self.hello: dict[str, Any] = {}
        self._ws: ClientConnection | None = None
        self._sessions: dict[str, Session] = {}
        self._requests: dict[int, asyncio.Future] = {}
        self._replies: dict[int, Response] = {}  # respond request id -> its reply, for errors refusing it
        self._ids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._closing = False
        self._connected = asyncio.Event()
        self._generation = 0  # counts connections: a chunk is sent at most once on each
        self.errors: list[StreamserveClientError] = []  # connection-level errors (rate limits, bad messages)

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        await self._open()
        self._connected.set()

    async def _open(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            ws = await websockets.connect(self.url, additional_headers=headers, max_size=self.max_frame_bytes)
        except websockets.InvalidStatus as e:
            if e.response.status_code == 401:
                raise UnauthorizedError("the server wants an API key (api_key=...) or a different one",
                                        code="unauthorized") from None
            raise
        try:
            hello = msgpack.unpackb(await ws.recv(), raw=False)
        except websockets.ConnectionClosed as e:
            if e.rcvd is not None and e.rcvd.code == 1013:
                raise ServerBusyError(f"server busy: {e.rcvd.reason}", code="busy") from None
            raise ConnectionLostError(f"the connection closed before the server's hello: {e}") from None
        self._ws, self.hello = ws, hello
        self._generation += 1
        self._reader = asyncio.create_task(self._read(ws))

    async def close(self) -> None:
        self._closing = True
        for s in list(self._sessions.values()):
            await s.close()
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    async def open_session(self, window: int | None = None, sinks: int | None = None,
                           positions: str | None = None, chunk_budget_ms: float | None = None,
                           **sampling: Any) -> Session:
        """A new persistent session; `sampling` (max_tokens, temperature, top_p, top_k, seed, stop) sets its
        reply defaults."""
        reply = await self._request({"type": "open", "window": window, "sinks": sinks, "positions": positions,
                                     "chunk_budget_ms": chunk_budget_ms, "sampling": sampling or None})
        s = Session(self, reply)
        self._sessions[s.id] = s
        return s

    async def resume_session(self, session_id: str, resume_token: str) -> Session:
        """Take over a session opened by another connection (or a previous run of this program)."""
        reply = await self._request({"type": "resume", "session": session_id, "resume_token": resume_token})
        s = Session(self, reply)
        self._sessions[s.id] = s
        return s

    async def stats(self) -> dict[str, Any]:
        return await self._request({"type": "stats"})

    # ---- plumbing -------------------------------------------------------------------------------------
    async def _send(self, message: dict[str, Any], now: bool = False) -> None:
        """Send when connected (`now`: during a reconnect's resume, before others may send)."""
        if not now:
            await self._connected.wait()
        assert self._ws is not None
        try:
            await self._ws.send(_pack(message))
        except websockets.ConnectionClosed:
            if not self.reconnect or self._closing or now:
                raise ConnectionLostError("the connection is closed") from None
            await self._connected.wait()  # the reader is reconnecting
            await self._ws.send(_pack(message))

    async def _send_append(self, p: _PendingAck, now: bool = False) -> None:
        """Send a chunk once per connection: after a reconnect the resume sends again what the server lacks."""
        if not now:
            await self._connected.wait()
        if p.future.done() or p.generation == self._generation:
            return
        p.generation = self._generation
        assert self._ws is not None
        with contextlib.suppress(websockets.ConnectionClosed):  # the resume after the reconnect sends it again
            await self._ws.send(_pack(p.message))

    async def _request(self, message: dict[str, Any], now: bool = False) -> dict[str, Any]:
        rid = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._requests[rid] = fut
        try:
            await self._send({**message, "id": rid}, now)
            return await fut
        finally:
            self._requests.pop(rid, None)

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for frame in ws:
                self._route(msgpack.unpackb(frame, raw=False))
        except websockets.ConnectionClosed:
            pass
        if self._closing or not self.reconnect:
            self._fail_all(ConnectionLostError("the connection closed"))
            return
        self._connected.clear()
        await self._reconnect()

    def _route(self, m: dict[str, Any]) -> None:
        kind, rid, sid = m.get("type"), m.get("id"), m.get("session")
        if kind == "error" and rid is not None and rid in self._replies:
            self._replies[rid]._queue.put_nowait(from_message(m))
            return
        if rid is not None and rid in self._requests:
            fut = self._requests[rid]
            if not fut.done():
                fut.set_exception(from_message(m)) if kind == "error" else fut.set_result(m)
            return
        s = self._sessions.get(sid) if sid is not None else None
        if s is None:
            if kind == "error":
                self.errors.append(from_message(m))
                self.errors[:] = self.errors[-32:]
            return
        if kind == "ack":
            s._on_ack(m)
        elif kind == "error":
            s._on_error(m)
        elif kind in ("delta", "done"):
            s._on_reply(m)
        elif kind == "closed":
            s._lost(StreamserveClientError(f"the server closed session {sid}: {m.get('reason')}",
                                           code="session_closed"))

    async def _reconnect(self) -> None:
        """Reconnect with backoff and resume every session; what cannot be resumed fails."""
        lost = ConnectionLostError("the connection dropped while this reply was running; the server cancelled it")
        for s in self._sessions.values():
            if s._response is not None and s._response.finish_reason is None:
                s._response._queue.put_nowait(lost)
        for attempt in range(self.retries):
            await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
            try:
                await self._open()
                break
            except (OSError, StreamserveClientError, websockets.WebSocketException):
                continue
        else:
            self._fail_all(ConnectionLostError(f"could not reconnect after {self.retries} attempts"))
            return
        for s in list(self._sessions.values()):
            try:
                reply = await self._request({"type": "resume", "session": s.id, "resume_token": s.resume_token},
                                            now=True)
                server_next = reply.get("next_seq", s.next_seq)
                for seq, p in sorted(s._acks.items()):
                    if seq < server_next:  # the server has it: only the ack was lost
                        if not p.future.done():
                            p.future.set_result(Ack(seq, 0, 0.0, 0.0, 0.0, replayed=True))
                    else:
                        await self._send_append(p, now=True)
            except StreamserveClientError as e:
                s._lost(e)
        self._connected.set()

    def _fail_all(self, error: StreamserveClientError) -> None:
        for fut in self._requests.values():
            if not fut.done():
                fut.set_exception(error)
        for s in list(self._sessions.values()):
            s._lost(error)


def connect(url: str, api_key: str | None = None, reconnect: bool = True) -> Client:
    """`async with connect("ws://127.0.0.1:8000") as client:` (the /v1/stream path is added if missing)."""
    return Client(url, api_key=api_key, reconnect=reconnect)
