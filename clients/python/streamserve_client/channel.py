"""The channel: one object owns the WebSocket, request ids, every pending call and the routing of the
server's messages. Sessions and replies (session.py) talk to it through its public methods only.

Routing (docs/protocol.md): answers to requests by `id` (`opened`, `rewound`, `configured`, `closed`,
`stats`, an `error` refusing a request); acks and errors of chunks by `session` + `seq`; a reply's
`delta`s and `done` by `session`. Messages for a session this client no longer holds are dropped (they
may trail a close or a move), and so are answers to a request whose caller stopped waiting and
duplicate results after a resume.

One reader task per connection routes its messages; one supervisor task per channel reconnects.
- The connection drops: requests waiting for an answer and a running reply fail with
  `ConnectionLostError` (the server cancels the reply); the channel reconnects with backoff, resumes
  every session with its resume token and sends again the chunks the server lacks (`next_seq`), so an
  append still ends with its ack or its error.
- Any error in the reader (protocol.py says what is a violation; an exception while routing counts too)
  fails every pending call, chunks awaiting their ack included, with `ProtocolViolationError`, closes
  the connection (1002) and takes the same reconnect path. Nothing is left waiting on a stream that can
  no longer be trusted.
- The server drains (close 1012, after a `reconnect` message naming the sessions it handed over): the channel
  reconnects at once, without the first backoff, and resumes as above; the proxy takes the new connection to
  another instance, which restores the sessions (docs/protocol.md, Drain and hand-off).
- With `reconnect=False`, after the last failed attempt, or when the server closed the connection for
  good (1008, 1009, 4400), the channel is dead: every pending and later call raises its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from streamserve_client.errors import (
    ConnectionLostError,
    InvalidInputError,
    ProtocolViolationError,
    StreamserveClientError,
    UnknownSessionError,
    from_message,
)
from streamserve_client.handshake import open_connection
from streamserve_client.protocol import Ack, decode, pack
from streamserve_client.routes import Deliver, PendingChunk, RunningReply, SessionRoute, fail

PERMANENT_CLOSE_CODES = (1008, 1009, 4400)  # the server closed the connection for good: no resume
SERVICE_RESTART = 1012  # the server drains: its sessions wait on another instance; reconnect at once
MAX_KEPT_ERRORS = 32
RESUME_TIMEOUT_S = 10.0  # a resume unanswered this long counts as a broken connection
STALE_REPLY_WAIT_S = 5.0  # how long a new reply waits for the server to end one that failed (its `done`)


class Channel:
    def __init__(self, url: str, api_key: str | None = None, reconnect: bool = True, retries: int = 5,
                 max_frame_bytes: int = 1 << 22) -> None:
        self.url, self.api_key, self.reconnect, self.retries = url, api_key, reconnect, retries
        self.max_frame_bytes = max_frame_bytes
        self.hello: dict[str, Any] = {}
        self.errors: list[StreamserveClientError] = []  # errors for no pending call (rate limits, bad messages)
        self.generation = 0  # counts connections
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[ConnectionLostError] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._closing = False
        self._dead: ConnectionLostError | None = None
        self._ids = itertools.count(1)
        self._requests: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._sessions: dict[str, SessionRoute] = {}

    @property
    def dead(self) -> ConnectionLostError | None:
        """Why the channel is gone for good, or None while it is usable."""
        return self._dead

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def connect(self) -> None:
        if self._supervisor is not None:
            raise StreamserveClientError("this client is already connected (a Client connects once)")
        await self._open()
        self._connected.set()
        self._supervisor = asyncio.create_task(self._supervise())

    async def close(self) -> None:
        """Close the connection; every pending call fails with ConnectionLostError."""
        self._closing = True
        await self._close_socket()
        task = self._supervisor
        if task is not None and not task.done():
            if not self._connected.is_set():
                task.cancel()  # between connections: stop reconnecting
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._close_socket()  # a connection the cancelled reconnect had just opened
        if self._dead is None:
            self._fail_all(ConnectionLostError("the client closed the connection"))

    async def _close_socket(self) -> None:
        ws, reader = self._ws, self._reader
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close()
        if reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def drop(self) -> None:
        """Cut the connection as a network failure would (no closing handshake) and wait until the
        channel has noticed: it is then reconnecting, or dead with `reconnect=False`."""
        ws, reader = self._ws, self._reader
        if ws is None or reader is None or reader.done():
            return
        ws.transport.abort()
        await asyncio.wait({reader})
        await asyncio.sleep(0)  # let the supervisor take the reader's result

    async def _open(self) -> None:
        ws, self.hello = await open_connection(self.url, self.api_key, self.max_frame_bytes)
        self._ws = ws
        self.generation += 1
        self._reader = asyncio.create_task(self._read(ws))

    async def _read(self, ws: ClientConnection) -> ConnectionLostError:
        """Route this connection's messages until it ends; -> why it ended. Whatever waits for an answer
        from this connection has failed when this returns."""
        error: ConnectionLostError | None = None
        try:
            async for frame in ws:
                self._route(decode(frame))
        except websockets.ConnectionClosed:
            pass
        except ProtocolViolationError as e:
            error = e
        except Exception as e:  # a message the routing could not handle: fail loudly, never hang
            error = ProtocolViolationError(f"the client could not handle a server message: {type(e).__name__}: {e}")
        self._connected.clear()  # from now on, senders wait for the reconnect (or the end)
        if error is None:
            error = ConnectionLostError(f"the connection closed ({ws.close_code}: {ws.close_reason or 'no reason'})")
            self._fail_in_flight(
                ConnectionLostError("the connection dropped before the answer came; the request may or may not "
                                    "have been carried out"),
                ConnectionLostError("the connection dropped while this reply was running; the server cancelled it"),
                None)  # chunks stay: the resume sends them again if the server lacks them
            return error
        self._fail_in_flight(error, error, error)  # nothing this stream said can be trusted
        with contextlib.suppress(Exception):  # bounded by close_timeout
            await ws.close(1002, "protocol violation")
        return error

    async def _supervise(self) -> None:
        try:
            while True:
                assert self._reader is not None
                error = await self._reader
                if self._closing or not self.reconnect or self._ws_close_code() in PERMANENT_CLOSE_CODES:
                    self._fail_all(error)
                    return
                if not await self._reconnect(at_once=self._ws_close_code() == SERVICE_RESTART):
                    return
        except BaseException as e:  # a bug or a cancel while reconnecting: no call may wait for ever
            if self._dead is None:
                self._fail_all(ConnectionLostError(f"the client stopped reconnecting: {type(e).__name__}: {e}"
                                                   if not isinstance(e, asyncio.CancelledError)
                                                   else "the client is closed"))
            raise

    def _ws_close_code(self) -> int | None:
        return None if self._ws is None else self._ws.close_code

    async def _reconnect(self, at_once: bool = False) -> bool:
        """Reconnect with backoff (`at_once`: the first attempt without) and resume every session; -> False when
        the channel is dead."""
        failures = 0
        while failures < self.retries:
            if failures or not at_once:
                await asyncio.sleep(min(2.0, 0.1 * 2 ** failures))
            if self._closing:
                break
            try:
                await self._open()
            except (OSError, asyncio.TimeoutError, StreamserveClientError, websockets.WebSocketException):
                failures += 1
                continue
            if await self._resume_sessions():
                self._connected.set()
                return True
            failures += 1  # the new connection broke while resuming
        self._fail_all(ConnectionLostError("the client is closed" if self._closing else
                                           f"could not reconnect after {self.retries} attempts"))
        return False

    async def _resume_sessions(self) -> bool:
        """Resume every session on the new connection; -> False if the connection broke meanwhile."""
        for route in list(self._sessions.values()):
            try:
                resume = {"type": "resume", "session": route.session_id, "resume_token": route.resume_token}
                reply = await asyncio.wait_for(self.request(resume, now=True), RESUME_TIMEOUT_S)
                server_next = reply.get("next_seq", 0)
                for seq, chunk in sorted(route.chunks.items()):
                    if seq >= server_next:  # the server never got it (below: it resends the result, or acks later)
                        await self._send_chunk(chunk, now=True)
            except (ConnectionLostError, asyncio.TimeoutError):
                if self._ws is not None:
                    self._ws.transport.abort()  # a server that does not answer is as good as gone
                return False
            except StreamserveClientError as e:  # the server refused the resume: this session is gone
                self._lose(route, e)
        return True

    # ---- calls ----------------------------------------------------------------------------------------
    async def _socket(self, now: bool) -> ClientConnection:
        """The connection to send on (`now`: during a reconnect's resume, before others may send)."""
        if not now:
            await self._connected.wait()
        if self._dead is not None:
            raise self._dead.copy()
        if self._ws is None or self._reader is None or self._reader.done():
            raise ConnectionLostError("the connection is closed")
        return self._ws

    async def send(self, message: dict[str, Any], now: bool = False) -> None:
        """Send a message that has no answer of its own (cancel), once connected."""
        data = pack(message)
        ws = await self._socket(now)
        reader = self._reader  # this connection's
        try:
            await ws.send(data)
        except websockets.ConnectionClosed:
            if not self.reconnect or self._closing or now:
                raise ConnectionLostError("the connection is closed") from None
            if reader is not None:
                await asyncio.wait({reader})  # the reader notices the close, then the supervisor reconnects
            await (await self._socket(False)).send(data)

    async def request(self, message: dict[str, Any], now: bool = False) -> dict[str, Any]:
        """Send a message with an `id` and wait for the server's answer (an `error` raises its typed error)."""
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._requests[rid] = fut
        try:
            await self.send({**message, "id": rid}, now)
            return await fut
        finally:
            self._requests.pop(rid, None)

    async def append(self, session_id: str, seq: int, message: dict[str, Any]) -> Ack:
        """Send a chunk and wait for its ack (or its error); after a reconnect it is sent again if the
        server lacks it."""
        route = self._route_of(session_id)
        if seq in route.chunks:
            raise InvalidInputError(f"chunk {seq} of session {session_id} is already awaiting its ack", seq=seq)
        chunk = PendingChunk(asyncio.get_running_loop().create_future(), message, time.perf_counter())
        route.chunks[seq] = chunk
        try:
            await self._send_chunk(chunk)
            return await chunk.future
        finally:
            if route.chunks.get(seq) is chunk:
                del route.chunks[seq]

    async def _send_chunk(self, chunk: PendingChunk, now: bool = False) -> None:
        ws = await self._socket(now)
        if chunk.future.done() or chunk.generation == self.generation:
            return
        chunk.generation = self.generation
        with contextlib.suppress(websockets.ConnectionClosed):  # the resume after the reconnect sends it again
            await ws.send(pack(chunk.message))

    async def respond(self, session_id: str, params: dict[str, Any], deliver: Deliver) -> None:
        """Start a reply on the session; `deliver` then gets its deltas, its `done` or the error ending it."""
        route = self._route_of(session_id)
        old = route.reply
        if old is not None and not old.failed:
            raise InvalidInputError("this session already has a reply running; cancel it or read it to the end")
        if old is not None:  # it failed here; the server ends it with `done` right after
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(old.done.wait(), STALE_REPLY_WAIT_S)
            if route.reply is not old and route.reply is not None:
                raise InvalidInputError("this session already has a reply running; cancel it or read it to the end")
            route.end_reply()
        rid = next(self._ids)  # an error refusing the request comes back with this id
        route.reply = RunningReply(rid, deliver)
        try:
            await self.send({**params, "type": "respond", "session": session_id, "id": rid})
        except BaseException:
            if route.reply is not None and route.reply.request_id == rid:
                route.end_reply()
            raise

    # ---- sessions -------------------------------------------------------------------------------------
    def attach(self, session_id: str, resume_token: str, on_lost: Callable[[StreamserveClientError | None], None],
               on_event: Callable[[dict[str, Any]], None] | None = None, voice: bool = False) -> None:
        """Route the session's messages here; `on_lost` is told when it ends (None: closed by the client);
        `on_event` gets its voice messages (and, once it takes audio, its replies' text)."""
        if self._dead is not None:
            raise self._dead.copy()
        previous = self._sessions.get(session_id)
        if previous is not None:  # resumed again by this client: the older handle's calls end, never hang
            self._lose(previous, UnknownSessionError("this client resumed the session again; use the newer handle",
                                                     code="session_moved"))
        self._sessions[session_id] = SessionRoute(session_id, resume_token, on_lost, on_event=on_event, voice=voice)

    def voice_on(self, session_id: str) -> None:
        """The session takes audio: replies the server starts by itself go to its events."""
        route = self._sessions.get(session_id)
        if route is not None:
            route.voice = True

    def detach(self, session_id: str, error: StreamserveClientError | None = None) -> None:
        """The session is gone (closed, moved, or not resumable): everything waiting on it ends."""
        route = self._sessions.get(session_id)
        if route is not None:
            self._lose(route, error)

    def holds(self, session_id: str) -> bool:
        return session_id in self._sessions

    def _route_of(self, session_id: str) -> SessionRoute:
        if self._dead is not None:
            raise self._dead.copy()
        route = self._sessions.get(session_id)
        if route is None:
            raise StreamserveClientError(f"session {session_id} is closed", code="session_closed")
        return route

    def _lose(self, route: SessionRoute, error: StreamserveClientError | None) -> None:
        if self._sessions.get(route.session_id) is route:
            del self._sessions[route.session_id]
        closed = error or StreamserveClientError(f"session {route.session_id} is closed", code="session_closed")
        route.fail_chunks(closed)
        route.fail_reply(closed)
        route.on_lost(error)

    # ---- routing (the reader) -------------------------------------------------------------------------
    def _route(self, m: dict[str, Any]) -> None:
        kind, rid = m["type"], m.get("id")
        if rid is not None and kind == "error":
            refused = next((r for r in self._sessions.values() if r.reply and r.reply.request_id == rid), None)
            if refused is not None:  # a respond was refused: no `done` follows
                refused.fail_reply(from_message(m))
                return
        if rid is not None and rid in self._requests:
            fut = self._requests[rid]
            if kind == "error":
                fail(fut, from_message(m))
            elif not fut.done():
                fut.set_result(m)
            return
        if rid is not None and kind == "error":  # refusing a request whose caller stopped waiting
            self._keep_error(from_message(m))
            return
        route = self._sessions.get(m.get("session")) if m.get("session") is not None else None
        if route is None:
            if kind == "error":
                self._keep_error(from_message(m))
            return  # a newer server's message type, an answer nobody waits for, or a session no longer held
        if kind == "ack":
            route.on_ack(m)
        elif kind == "error":
            error = from_message(m)
            if error.code == "session_moved" and m.get("seq") is None:
                self._lose(route, error)
            elif not route.on_error(m, error):
                self._keep_error(error)
        elif kind in ("delta", "done"):
            route.on_reply_message(m)
        elif kind in ("turn", "transcript", "audio", "audio_done"):
            route.on_voice_message(m)
        elif kind == "closed":
            self._lose(route, StreamserveClientError(f"the server closed session {route.session_id}: "
                                                     f"{m.get('reason')}", code="session_closed"))

    def _keep_error(self, err: StreamserveClientError) -> None:
        self.errors.append(err)
        del self.errors[:-MAX_KEPT_ERRORS]

    # ---- failures -------------------------------------------------------------------------------------
    def _fail_in_flight(self, request_error: StreamserveClientError, reply_error: StreamserveClientError,
                        chunk_error: StreamserveClientError | None) -> None:
        """The connection ended: requests and replies waiting on it fail; chunks awaiting their ack fail
        too when `chunk_error` is given (else they stay, to be sent again after the resume)."""
        for fut in self._requests.values():
            fail(fut, request_error)
        for route in self._sessions.values():
            route.fail_reply(reply_error)
            if chunk_error is not None:
                route.fail_chunks(chunk_error)

    def _fail_all(self, error: ConnectionLostError) -> None:
        """The channel is gone for good: every pending call and every later one raises `error`."""
        self._dead = error
        self._connected.set()  # wake whoever waits to send: they get the error
        self._fail_in_flight(error, error, error)
        for route in list(self._sessions.values()):
            self._lose(route, error)
