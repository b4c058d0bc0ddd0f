"""Fault injection: a client that asks for long replies and never reads its socket.

The server must not buffer for it without bound: its frames wait in one bounded queue per connection, the
engine's deltas to it merge while they wait, and a frame that waits past the send timeout cuts the connection
(30 s in production; 1 s here, set on the server's Transport). Meanwhile another connection's session answers
exactly as it does alone, and once the stalled connection's sessions expire no KV page is left behind."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, ClassVar

import msgpack
import pytest
import websockets
from serving import RunningServer, serve

import streamserve.server.app as app_module
from streamserve.config import ServerConfig
from streamserve.server.transports.transport import Transport

PROMPT = "In the beginning God created"
SESSIONS = 4  # each asks for a 1024-token reply: far more than 4 KiB socket buffers and the queue hold


class RecordingTransport(Transport):
    """The server's transport with a 1 s send timeout and 4 KiB send buffers (kernel, asyncio, aiohttp: so that
    CI-sized replies fill what lies between the engine and the stalled client); remembers the connections it
    cut."""

    cut: ClassVar[list[RecordingTransport]] = []

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **{**kw, "send_timeout": 1.0})
        wire = getattr(self.channel, "socket_transport", None)
        if wire is not None:
            wire.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            wire.set_write_buffer_limits(high=4096)  # asyncio's buffer above the socket: 64 KiB by default
            # aiohttp waits for that buffer to drain only after every `_limit` bytes written (64 KiB by default)
            writer = getattr(getattr(self.channel, "ws", None), "_writer", None)
            if writer is not None and hasattr(writer, "_limit"):
                writer._limit = 4096

    def abort(self) -> None:
        RecordingTransport.cut.append(self)
        super().abort()


def raw(frame: dict[str, Any]) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


async def recv_type(ws: websockets.ClientConnection, kind: str) -> dict:
    while True:
        m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60))
        if m["type"] == kind:
            return m
        assert m["type"] != "error", m


async def stalled_client(srv: RunningServer) -> tuple[websockets.ClientConnection, socket.socket]:
    """A connection whose kernel receive buffer is 4 KiB and whose WebSocket library stops reading the socket
    once 2 frames wait unread: after its sessions are open, the test never calls recv() again."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the TCP window stays small
    sock.connect(("127.0.0.1", srv.port))
    sock.setblocking(False)
    ws = await websockets.connect(srv.url + "/v1/stream", sock=sock, max_queue=2)
    assert msgpack.unpackb(await ws.recv())["type"] == "hello"
    return ws, sock


async def greedy_over_the_wire(srv: RunningServer, n: int) -> list[int]:
    async with websockets.connect(srv.url + "/v1/stream") as ws:
        await recv_type(ws, "hello")
        await ws.send(raw({"type": "open", "id": 1}))
        sid = (await recv_type(ws, "opened"))["session"]
        await ws.send(raw({"type": "append", "session": sid, "text": PROMPT}))
        await recv_type(ws, "ack")
        await ws.send(raw({"type": "respond", "session": sid, "max_tokens": n}))
        got: list[int] = []
        while True:
            m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60))
            assert m["type"] != "error", m
            if m["type"] == "delta":
                got += m["token_ids"]
            elif m["type"] == "done":
                return got


@pytest.mark.asyncio
async def test_a_client_that_never_reads_is_cut_off_and_costs_the_others_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_module, "Transport", RecordingTransport)
    RecordingTransport.cut = []
    config = ServerConfig(resume_ttl=1.0, max_sessions_per_connection=SESSIONS, messages_per_second=1000.0)
    async with serve(config) as srv:
        engine = srv.engine
        alone = await greedy_over_the_wire(srv, 16)
        ws, sock = await stalled_client(srv)
        sids = []
        for i in range(SESSIONS):
            await ws.send(raw({"type": "open", "id": i}))
            sids.append((await recv_type(ws, "opened"))["session"])
            await ws.send(raw({"type": "append", "session": sids[-1], "seq": 0, "text": PROMPT}))
            await recv_type(ws, "ack")
        for sid in sids:  # ...and from here on the client reads nothing
            await ws.send(raw({"type": "respond", "session": sid, "max_tokens": 1024}))
        # while the stalled connection's replies run, another connection is served as if alone
        assert await greedy_over_the_wire(srv, 16) == alone

        async def cut_off() -> None:
            while not RecordingTransport.cut:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(cut_off(), 60)  # the server, not the client, ended it
        registry = srv.server.service.registry  # type: ignore[union-attr]

        async def expired() -> None:  # detached at the cut, closed after resume_ttl: every page back
            while registry.all() or engine.stats()["sessions_open"] or engine.stats()["kv_pages_used"]:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(expired(), 60)
        engine.check_integrity()
        assert await greedy_over_the_wire(srv, 16) == alone  # and the server still answers the same
        with pytest.raises(websockets.ConnectionClosed):  # the stalled client finds its connection gone
            while True:
                await asyncio.wait_for(ws.recv(), 30)
        sock.close()
