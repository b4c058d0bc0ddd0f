"""Live hand-off between two real servers sharing a snapshot store (docs/protocol.md, Drain and hand-off): instance A
drains (between turns, and while a reply runs), tells its clients to reconnect and closes with 1012; instance B
restores each session on its resume and the greedy continuation equals an uninterrupted session's. Wrong tokens are
refused and leave the record; chat sessions continue their conversation; no KV page is left behind on either side.
The SDK and the serve process: test_handoff_sdk.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import websockets
from serving import RunningServer, serve
from test_native import http_get  # (tests in this folder import each other's helpers, as test_quant does)

from streamserve.config import ServerConfig

WAIT_S = 60.0
TURNS = [" In the beginning God created the heaven", " And the earth was without form", " And God said"]
REPLY = 8


def config(store: Path, **kw: Any) -> ServerConfig:
    return ServerConfig(snapshot_store=str(store), resume_ttl=30.0, max_chunk_tokens=64, messages_per_second=500.0,
                        **kw)


@contextlib.asynccontextmanager
async def pair(store: Path) -> AsyncIterator[tuple[RunningServer, RunningServer]]:
    async with serve(config(store)) as a, serve(config(store)) as b:
        yield a, b


def pack(m: dict[str, Any]) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


class Raw:
    """A raw native client on one connection."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws, self.ids = ws, 0

    @classmethod
    async def connect(cls, srv: RunningServer) -> Raw:
        ws = await websockets.connect(srv.url + "/v1/stream")
        assert msgpack.unpackb(await ws.recv())["type"] == "hello"
        return cls(ws)

    async def recv(self) -> dict[str, Any]:
        return msgpack.unpackb(await asyncio.wait_for(self.ws.recv(), WAIT_S))

    async def until(self, kind: str) -> dict[str, Any]:
        while True:
            m = await self.recv()
            if m["type"] == kind or m["type"] == "error":
                return m

    async def request(self, m: dict[str, Any]) -> dict[str, Any]:
        self.ids += 1
        await self.ws.send(pack({**m, "id": self.ids}))
        while True:
            r = await self.recv()
            if r.get("id") == self.ids:
                return r

    async def append(self, sid: str, seq: int, **kw: Any) -> dict[str, Any]:
        await self.ws.send(pack({"type": "append", "session": sid, "seq": seq, **kw}))
        while True:  # (after a resume, the results of the latest chunks come first)
            ack = await self.until("ack")
            assert ack["type"] == "ack", ack
            if ack["seq"] == seq:
                return ack

    async def reply(self, sid: str, n: int = REPLY) -> list[int]:
        """A greedy reply of n tokens, read to its end."""
        await self.ws.send(pack({"type": "respond", "session": sid, "max_tokens": n, "temperature": 0.0}))
        return await self.read_reply()

    async def read_reply(self, first: list[int] | None = None) -> list[int]:
        ids = list(first or [])
        while True:
            m = await self.recv()
            if m["type"] == "delta":
                ids += m["token_ids"]
            elif m["type"] == "done":
                assert m["reason"] == "length", m
                return ids
            elif m["type"] == "error":
                raise AssertionError(m)


def chat_turn(text: str) -> dict[str, Any]:
    return {"message": {"role": "user", "content": text}}


def content(i: int, chat: bool) -> dict[str, Any]:
    return chat_turn(TURNS[i]) if chat else {"text": TURNS[i]}


def seq_of(i: int, chat: bool) -> int:
    """Turn i's chunk seq: a chat reply's generation prompt takes a seq too."""
    return 2 * i if chat else i


async def uninterrupted(srv: RunningServer, chat: bool) -> list[list[int]]:
    """The replies of the whole conversation on one session, never moved."""
    c = await Raw.connect(srv)
    opened = await c.request({"type": "open", "chat": chat})
    sid, replies = opened["session"], []
    for i in range(len(TURNS)):
        await c.append(sid, seq_of(i, chat), **content(i, chat))
        replies.append(await c.reply(sid))
    assert (await c.request({"type": "close", "session": sid}))["type"] == "closed"
    await c.ws.close()
    return replies


async def drain(srv: RunningServer) -> None:
    def post() -> int:
        req = urllib.request.Request(srv.http + "/admin/drain", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert await asyncio.to_thread(post) == 202


async def moved_out(c: Raw, sid: str) -> None:
    """The drain's `reconnect` naming the session, then close 1012."""
    m = await c.until("reconnect")
    assert m == {"type": "reconnect", "reason": "drain", "sessions": [sid]}
    with pytest.raises(websockets.ConnectionClosed):
        await c.recv()
    assert c.ws.close_code == 1012


def pages(srv: RunningServer) -> int:
    return srv.engine.stats()["kv_pages_used"]


async def resume(srv: RunningServer, sid: str, token: str) -> tuple[Raw, dict[str, Any]]:
    c = await Raw.connect(srv)
    return c, await c.request({"type": "resume", "session": sid, "resume_token": token})


@pytest.mark.asyncio
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
async def test_a_session_drained_between_turns_continues_on_the_other_instance_token_identical(
        tmp_path: Path, chat: bool) -> None:
    async with pair(tmp_path) as (a, b):
        expected = await uninterrupted(b, chat)
        c = await Raw.connect(a)
        opened = await c.request({"type": "open", "chat": chat, "sampling": {"max_tokens": REPLY}})
        sid, token = opened["session"], opened["resume_token"]
        got = []
        for i in range(2):
            await c.append(sid, seq_of(i, chat), **content(i, chat))
            got.append(await c.reply(sid))
        await drain(a)
        await moved_out(c, sid)
        await asyncio.wait_for(a.server.drained.wait(), WAIT_S)
        assert pages(a) == 0 and len(a.server.service.registry) == 0  # everything went to the store
        status, _ = await http_get(a.http + "/healthz")
        assert status == 503
        # a wrong token is refused, and the record stays for the right client
        bad, refused = await resume(b, sid, "x" * 43)
        assert refused["type"] == "error" and refused["code"] == "invalid_resume_token"
        await bad.ws.close()
        c2, resumed = await resume(b, sid, token)
        assert resumed["type"] == "opened" and resumed["resumed"] and resumed["session"] == sid, resumed
        assert resumed["next_seq"] == seq_of(2, chat) and resumed["chat"] == chat
        assert resumed["reserved_pages"] == opened["reserved_pages"]
        await c2.append(sid, seq_of(2, chat), **content(2, chat))
        got.append(await c2.reply(sid))
        assert got == expected
        assert (await c2.request({"type": "close", "session": sid}))["type"] == "closed"
        await c2.ws.close()
        assert pages(b) == 0
        assert list(tmp_path.iterdir()) == []  # the record went with the restore


@pytest.mark.asyncio
async def test_a_drain_while_a_reply_runs_lets_it_end_then_hands_the_session_over(tmp_path: Path) -> None:
    async with pair(tmp_path) as (a, b):
        expected = await uninterrupted(b, chat=False)
        c = await Raw.connect(a)
        opened = await c.request({"type": "open"})
        sid, token = opened["session"], opened["resume_token"]
        got = []
        await c.append(sid, 0, text=TURNS[0])
        got.append(await c.reply(sid))
        await c.append(sid, 1, text=TURNS[1])
        # the engine is held between steps (from another thread) while the reply starts and the drain begins
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with a.engine.guard:
                held.set()
                release.wait(WAIT_S)

        holder = threading.Thread(target=hold)
        holder.start()
        await asyncio.to_thread(held.wait)
        try:
            await c.ws.send(pack({"type": "respond", "session": sid, "max_tokens": REPLY, "temperature": 0.0}))
            while a.server.service.operations or not a.engine.stats()["responding"]:
                await asyncio.sleep(0.01)  # the reply is queued on the engine
            await drain(a)
            while not a.server.service.draining:
                await asyncio.sleep(0.01)
        finally:
            release.set()
            await asyncio.to_thread(holder.join)
        got.append(await c.read_reply())  # the running reply ends whole (it was not cancelled)...
        await moved_out(c, sid)  # ...before the session moves
        await asyncio.wait_for(a.server.drained.wait(), WAIT_S)
        assert pages(a) == 0
        c2, resumed = await resume(b, sid, token)
        assert resumed["resumed"] and resumed["next_seq"] == 2
        await c2.append(sid, 2, text=TURNS[2])
        got.append(await c2.reply(sid))
        assert got == expected
        await c2.ws.close()  # detached on B: parked until its TTL, then closed


@pytest.mark.asyncio
async def test_a_detached_session_is_handed_over_and_its_latest_acks_come_with_it(tmp_path: Path) -> None:
    async with pair(tmp_path) as (a, b):
        c = await Raw.connect(a)
        opened = await c.request({"type": "open"})
        sid, token = opened["session"], opened["resume_token"]
        await c.append(sid, 0, text=TURNS[0])
        await c.ws.close()  # detached: waits on A for a resume
        while a.server.service.registry.find(sid).owner is not None:
            await asyncio.sleep(0.01)
        await drain(a)
        await asyncio.wait_for(a.server.drained.wait(), WAIT_S)
        assert pages(a) == 0
        c2, resumed = await resume(b, sid, token)
        assert resumed["resumed"] and resumed["next_seq"] == 1 and resumed["tokens"] == opened["tokens"] + len(
            b.engine.tokenizer.encode(TURNS[0], add_special_tokens=False))
        ack = await c2.until("ack")  # the results of its latest chunks, as after any resume
        assert ack["type"] == "ack" and ack["seq"] == 0
        # another resume of the same id now finds it held here, not in the store
        other, again = await resume(b, sid, token)
        assert again["resumed"] and again["session"] == sid
        await other.ws.close()
        await c2.ws.close()


@pytest.mark.asyncio
async def test_connection_bound_sessions_are_closed_not_stored_and_native_ones_move(tmp_path: Path) -> None:
    async with serve(config(tmp_path)) as a:
        rt = await websockets.connect(a.url + "/v1/realtime?model=default")
        assert json.loads(await asyncio.wait_for(rt.recv(), WAIT_S))["type"] == "session.created"
        c = await Raw.connect(a)
        sid = (await c.request({"type": "open"}))["session"]
        assert len(a.server.service.registry) == 2
        await drain(a)
        await moved_out(c, sid)
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                await asyncio.wait_for(rt.recv(), WAIT_S)
        assert rt.close_code == 1001  # the Realtime connection closes as at a shutdown
        await asyncio.wait_for(a.server.drained.wait(), WAIT_S)
        assert [p.name for p in tmp_path.iterdir()] == [f"{sid}.rec"]  # only the native session was stored


@pytest.mark.asyncio
async def test_a_draining_server_refuses_new_connections_with_503_before_the_upgrade(tmp_path: Path) -> None:
    async with serve(config(tmp_path)) as a:
        c = await Raw.connect(a)  # holds the drain open: it waits for nothing, but the test looks before the end
        opened = await c.request({"type": "open"})
        a.server.service.draining = True  # what the drain sets first (the rest of it is not needed here)
        a.server.draining = asyncio.get_running_loop().create_future()
        with pytest.raises(websockets.InvalidStatus) as info:
            await websockets.connect(a.url + "/v1/stream")
        assert info.value.response.status_code == 503
        status, body = await http_get(a.http + "/healthz")
        assert (status, body) == (503, b'{"status": "draining"}')
        # operations other than cancel, close and stats are not carried out while draining
        await c.ws.send(pack({"type": "append", "session": opened["session"], "seq": 0, "text": "ignored"}))
        stats = await c.request({"type": "stats"})
        assert stats["type"] == "stats" and a.server.service.registry.find(opened["session"]).session.next_seq == 0
        a.server.draining.cancel()
        await c.ws.close()


@pytest.mark.asyncio
async def test_without_a_store_a_drain_is_a_graceful_shutdown_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    async with serve(ServerConfig(max_chunk_tokens=64)) as a:
        c = await Raw.connect(a)
        sid = (await c.request({"type": "open"}))["session"]
        with caplog.at_level("WARNING", logger="streamserve.server"):
            await drain(a)
            closed = await c.until("closed")
            assert closed["session"] == sid and closed["reason"] == "shutdown"
            with pytest.raises(websockets.ConnectionClosed):
                await c.recv()
            await asyncio.wait_for(a.server.drained.wait(), WAIT_S)
        assert c.ws.close_code == 1001
        assert "graceful shutdown" in caplog.text


@pytest.mark.asyncio
async def test_admin_drain_needs_the_api_key_when_one_is_configured(tmp_path: Path) -> None:
    async with serve(config(tmp_path, api_key="k" * 32)) as a:
        def post(key: str | None) -> int:
            req = urllib.request.Request(a.http + "/admin/drain", method="POST",
                                         headers={"Authorization": f"Bearer {key}"} if key else {})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        assert await asyncio.to_thread(post, None) == 401
        assert await asyncio.to_thread(post, "wrong") == 401
        assert a.server.draining is None
        assert await asyncio.to_thread(post, "k" * 32) == 202
        await asyncio.wait_for(a.server.drained.wait(), WAIT_S)


@pytest.mark.asyncio
async def test_admin_drain_without_a_key_is_refused_to_a_proxied_request(tmp_path: Path) -> None:
    async with serve(config(tmp_path)) as a:
        def post() -> int:
            req = urllib.request.Request(a.http + "/admin/drain", method="POST",
                                         headers={"X-Forwarded-For": "203.0.113.9"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        assert await asyncio.to_thread(post) == 403 and a.server.draining is None
