"""A fake streamserve for the client SDK's tests: enough of the native protocol (docs/protocol.md) to
open, resume, append, respond, close and ask for stats, on 127.0.0.1, with knobs that hold answers back
(so calls are in flight) and a way to send any frame (junk) to the connected client."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field
from typing import Any

import msgpack
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

HELLO = {"type": "hello", "protocol": 1, "server": "fake", "model": "fake", "modalities": ["text"],
         "limits": {"max_frame_bytes": 1 << 20, "max_chunk_tokens": 64}}


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


@dataclass
class FakeSession:
    id: str
    resume_token: str
    seqs: list[int] = field(default_factory=list)  # the chunks this server has, in order
    tokens: int = 0


class FakeServer:
    def __init__(self) -> None:
        self.sessions: dict[str, FakeSession] = {}
        self.connections = 0  # accepted so far
        self.resumes: list[str] = []  # session ids, in the order they were resumed
        self.received: list[dict[str, Any]] = []  # every client message
        self.hold_acks = False  # appends are kept but not acknowledged
        self.lose_appends = False  # appends are not even kept (as if lost with the connection)
        self.hold_requests = False  # stats requests get no answer
        self.hold_replies = False  # a reply sends one delta, then waits
        self.silent = False  # no hello: the connection is accepted and nothing is said
        self.hello: dict[str, Any] = dict(HELLO)  # what the server says first
        self.unanswered_resumes = 0  # this many resumes get no answer
        self.connected = asyncio.Event()  # set while a client is connected (cleared when it goes)
        self._ws: ServerConnection | None = None
        self._server: Server | None = None
        self._reply_tasks: set[asyncio.Task[None]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the server runs on its own thread

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"ws://{host}:{port}"

    async def start(self) -> None:
        self._server = await serve(self._handle, "127.0.0.1", 0)

    async def stop(self) -> None:
        for task in self._reply_tasks:
            task.cancel()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def send_raw(self, frame: bytes | str) -> None:
        """Send any frame to the connected client (the junk of the tests)."""
        await asyncio.wait_for(self.connected.wait(), 10)
        assert self._ws is not None
        await self._ws.send(frame)

    def send_raw_threadsafe(self, frame: bytes | str) -> None:
        """`send_raw` from another thread than the server's loop."""
        assert self.loop is not None
        asyncio.run_coroutine_threadsafe(self.send_raw(frame), self.loop).result(10)

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        self._ws = ws
        self.connected.set()
        if self.silent:
            await ws.wait_closed()
            return
        await ws.send(pack(self.hello))
        try:
            async for frame in ws:
                m = msgpack.unpackb(frame, raw=False)
                self.received.append(m)
                await self._answer(ws, m)
        except ConnectionClosed:
            pass  # the client closed with an error code (1002 after junk) or the network dropped
        finally:
            if self._ws is ws:
                self.connected.clear()

    async def _answer(self, ws: ServerConnection, m: dict[str, Any]) -> None:
        kind, rid, sid = m["type"], m.get("id"), m.get("session")
        if kind == "open":
            s = FakeSession(secrets.token_urlsafe(16), secrets.token_urlsafe(32))
            self.sessions[s.id] = s
            await ws.send(pack(self._opened(s, rid, resumed=False)))
        elif kind == "resume":
            if self.unanswered_resumes > 0:
                self.unanswered_resumes -= 1
                return
            s = self.sessions.get(sid)
            if s is None or s.resume_token != m["resume_token"]:
                await ws.send(pack({"type": "error", "code": "unknown_session", "message": "no such session",
                                    "id": rid, "fatal": False}))
                return
            self.resumes.append(s.id)
            await ws.send(pack(self._opened(s, rid, resumed=True)))
            if not self.hold_acks:  # the latest chunks' results again; the client ignores what it has
                for seq in s.seqs[-4:]:
                    await ws.send(pack(self._ack(s, seq)))
        elif kind == "append":
            s = self.sessions[sid]
            if self.lose_appends:
                return
            s.seqs.append(m["seq"])
            s.tokens += len(m.get("token_ids") or m.get("text", ""))
            if not self.hold_acks:
                await ws.send(pack(self._ack(s, m["seq"])))
        elif kind == "respond":
            task = asyncio.create_task(self._reply(ws, self.sessions[sid], m.get("max_tokens") or 3))
            self._reply_tasks.add(task)
            task.add_done_callback(self._reply_tasks.discard)
        elif kind == "close":
            self.sessions.pop(sid, None)
            await ws.send(pack({"type": "closed", "id": rid, "session": sid, "reason": "client"}))
        elif kind == "stats" and not self.hold_requests:
            await ws.send(pack({"type": "stats", "id": rid, "model": "fake", "sessions_open": len(self.sessions)}))

    async def _reply(self, ws: ServerConnection, s: FakeSession, n: int) -> None:
        with contextlib.suppress(ConnectionClosed):  # the client went away mid-reply
            for _ in range(n):
                await ws.send(pack({"type": "delta", "session": s.id, "response": "r1", "text": "a",
                                    "token_ids": [97]}))
                s.tokens += 1
                while self.hold_replies:
                    await asyncio.sleep(0.01)
            await ws.send(pack({"type": "done", "session": s.id, "response": "r1", "reason": "length",
                                "usage": {"completion_tokens": n, "session_tokens": s.tokens}}))

    def _opened(self, s: FakeSession, rid: Any, resumed: bool) -> dict[str, Any]:
        return {"type": "opened", "id": rid, "session": s.id, "resume_token": s.resume_token, "resumed": resumed,
                "next_seq": (s.seqs[-1] + 1) if s.seqs else 0, "tokens": s.tokens}

    def _ack(self, s: FakeSession, seq: int) -> dict[str, Any]:
        return {"type": "ack", "session": s.id, "seq": seq, "tokens": 1, "queue_ms": 0.1, "compute_ms": 0.2,
                "deadline_missed": False, "shed": False}
