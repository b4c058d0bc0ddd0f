"""The asyncio client of streamserve's native protocol.

    async with streamserve_client.connect("ws://127.0.0.1:8000", api_key=None) as client:
        session = await client.open_session(window=None, sinks=4)
        ack = await session.append(text="...")
        async for delta in session.respond(max_tokens=32, temperature=0.0):
            print(delta.text, end="")

One reader task routes the server's messages: replies to requests (by `id`), acks (by session and
seq), deltas and the end of a reply (by session). When the connection drops, the client reconnects
and resumes every session with its resume token. The server says which chunks it had (`next_seq`) and sends
the results of the latest ones again; the client sends again the chunks it lacks and waits for the
others' results, so every append ends with its ack or its error. A reply running when the connection
dropped ends with `ConnectionLostError` (the server cancels it), and so does a request whose answer was
lost. Connections the server closed for good (1008, 1009, 4400) are not reopened.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import msgpack
import websockets
from websockets.asyncio.client import ClientConnection

from streamserve_client.errors import (
    ConnectionLostError,
    ServerBusyError,
    StreamserveClientError,
    UnauthorizedError,
    from_message,
)
from streamserve_client.session import Response, Session, _pack, _PendingAck, fail

PATH = "/v1/stream"


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
        self._dead: ConnectionLostError | None = None  # set when the connection is gone for good
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
        if self._dead is None:
            for s in list(self._sessions.values()):
                await s.close()
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    async def open_session(self, window: int | None = None, sinks: int | None = None,
                           positions: str | None = None, chunk_budget_ms: float | None = None,
                           drafter: str | None = None, **sampling: Any) -> Session:
        """A new persistent session; `drafter` ("none", "ngram", "auto") its speculative decoding (default:
        the server's); `sampling` (max_tokens, temperature, top_p, top_k, seed, stop) its reply defaults."""
        reply = await self._request({"type": "open", "window": window, "sinks": sinks, "positions": positions,
                                     "chunk_budget_ms": chunk_budget_ms, "drafter": drafter,
                                     "sampling": sampling or None})
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
        if self._dead is not None:
            raise self._dead
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
        if self._dead is not None:
            raise self._dead
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
        code = ws.close_code
        if self._closing or not self.reconnect or code in (1008, 1009, 4400):  # closed for good: no resume
            self._fail_all(ConnectionLostError(f"the connection closed ({code}: {ws.close_reason or 'no reason'})"))
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
        for fut in self._requests.values():  # their answers went with the connection
            if not fut.done():
                fail(fut, ConnectionLostError("the connection dropped before the answer came; the request "
                                              "may or may not have been carried out"))
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
                    if seq >= server_next:  # the server never got it (below: it resends the result, or acks later)
                        await self._send_append(p, now=True)
            except StreamserveClientError as e:
                s._lost(e)
        self._connected.set()

    def _fail_all(self, error: ConnectionLostError) -> None:
        self._dead = error
        self._connected.set()  # wake whoever waits to send: they get the error
        for fut in self._requests.values():
            if not fut.done():
                fail(fut, error)
        for s in list(self._sessions.values()):
            s._lost(error)


def connect(url: str, api_key: str | None = None, reconnect: bool = True) -> Client:
    """`async with connect("ws://127.0.0.1:8000") as client:` (the /v1/stream path is added if missing)."""
    return Client(url, api_key=api_key, reconnect=reconnect)
