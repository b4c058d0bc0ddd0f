"""Server-side quotas over the wire: window + sinks caps, the per-connection page quota and queued-token cap
(typed errors before anything is taken, given back on close and ack), and the floor on client deadlines."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import pytest_asyncio
import websockets
from serving import RunningServer, default_engine, engine_paused

import streamserve_client as sc
from streamserve.config import ServerConfig
from streamserve.engine import Session
from streamserve.errors import QuotaExceededError, SessionClosedError
from streamserve.server.service.auth import Grant
from streamserve.server.service.registry import Entry
from streamserve.server.service.results import AppendRequest, ChunkResult, OpenRequest
from streamserve.server.service.service import SessionService

pytestmark = pytest.mark.asyncio(loop_scope="module")
# the page quota fits two windowed sessions of 32 + 4 tokens, not three (a reservation: the window, the sinks and
# one step of the engine's budget, 64 tokens on a CPU: 8 pages of 16)
PAGES, QUEUED, FLOOR_MS = 20, 100, 2000.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def limited() -> AsyncIterator[RunningServer]:
    srv = await RunningServer.start(ServerConfig(max_window=64, max_pages_per_connection=PAGES,
                                                 max_queued_tokens_per_connection=QUEUED,
                                                 min_deadline_ms=FLOOR_MS, max_chunk_tokens=64), default_engine)
    yield srv
    await srv.stop()


async def raw_connect(srv: RunningServer) -> websockets.ClientConnection:
    ws = await websockets.connect(srv.url + "/v1/stream")
    assert msgpack.unpackb(await ws.recv())["type"] == "hello"
    return ws


async def recv(ws: websockets.ClientConnection, **match: object) -> dict:
    while True:
        m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30))
        if all(m.get(k) == v for k, v in match.items()):
            return m


def windowed_pages(srv: RunningServer, window: int, sinks: int) -> int:
    size = srv.engine.pool.page_size
    return math.ceil(sinks / size) + math.ceil((window + srv.server.service.step_tokens) / size) + 1


async def test_window_and_sinks_are_capped_by_the_server_and_the_context(limited: RunningServer,
                                                                        served: RunningServer) -> None:
    async with sc.connect(limited.url) as client:
        assert client.hello["limits"]["max_window"] == 64
        with pytest.raises(sc.StreamserveClientError) as info:
            await client.open_session(window=61, sinks=4)
        assert info.value.code == "window_too_large"
        s = await client.open_session(window=60, sinks=4)
        await s.close()
    context = served.engine.config.max_position_embeddings  # the default server's --max-window is larger
    async with sc.connect(served.url) as client:
        assert client.hello["limits"]["max_window"] == context
        with pytest.raises(sc.StreamserveClientError) as info:
            await client.open_session(window=context, sinks=4)
        assert info.value.code == "window_too_large"
    assert served.engine.stats()["sessions_open"] == 0


async def test_the_page_quota_reserves_at_open_refuses_past_it_and_returns_on_close(limited: RunningServer) -> None:
    need = windowed_pages(limited, 32, 4)
    assert 2 * need <= PAGES < 3 * need
    async with sc.connect(limited.url) as client:
        a = await client.open_session(window=32, sinks=4)
        b = await client.open_session(window=32, sinks=4)
        assert a.info["reserved_pages"] == need
        with pytest.raises(sc.StreamserveClientError) as info:
            await client.open_session(window=32, sinks=4)
        assert info.value.code == "quota_exceeded"
        with pytest.raises(sc.StreamserveClientError) as info:  # no window: the whole context's pages
            await client.open_session()
        assert info.value.code == "quota_exceeded"
        stats = await client.stats()
        assert stats["connection_pages_reserved"] == 2 * need and stats["connection_sessions"] == 2
        # what was reserved is what the session may hold: an endless stream stays under its page cap
        for _ in range(8):
            await a.append(token_ids=list(range(5, 69)))
        r = a.respond(max_tokens=40)
        assert await r.wait() == "length"
        await b.close()
        c = await client.open_session(window=32, sinks=4)  # b's reservation came back
        for s in (a, c):
            await s.close()
    assert limited.engine.stats()["sessions_open"] == 0


async def test_the_queued_token_cap_refuses_an_append_at_once(limited: RunningServer) -> None:
    ws = await raw_connect(limited)
    await ws.send(msgpack.packb({"type": "open", "id": 1, "window": 32, "sinks": 4}))
    sid = (await recv(ws, type="opened"))["session"]
    with engine_paused(limited.engine):  # nothing is acked meanwhile
        await ws.send(msgpack.packb({"type": "append", "session": sid, "seq": 0, "token_ids": list(range(5, 69))}))
        await ws.send(msgpack.packb({"type": "append", "session": sid, "seq": 1, "token_ids": list(range(5, 69))}))
        refused = await recv(ws, type="error")
        await ws.send(msgpack.packb({"type": "stats", "id": 2}))
        stats = await recv(ws, type="stats")
    assert refused["code"] == "quota_exceeded" and refused["seq"] == 1 and refused["session"] == sid
    assert stats["connection_queued_tokens"] == 64
    assert (await recv(ws, type="ack"))["seq"] == 0
    await ws.send(msgpack.packb({"type": "append", "session": sid, "seq": 1, "token_ids": list(range(5, 69))}))
    assert (await recv(ws, type="ack"))["seq"] == 1  # nothing of the refused chunk was queued: seq 1 is free
    await ws.send(msgpack.packb({"type": "stats", "id": 3}))
    assert (await recv(ws, type="stats"))["connection_queued_tokens"] == 0
    await ws.close()


async def test_client_deadlines_have_a_floor(limited: RunningServer) -> None:
    async with sc.connect(limited.url) as client:
        s = await client.open_session(window=32, chunk_budget_ms=1.0)
        assert s.info["chunk_budget_ms"] == FLOOR_MS
        assert (await s.configure(chunk_budget_ms=0.5))["chunk_budget_ms"] == FLOOR_MS
        # a 1 µs deadline cannot be met by any step; raised to the floor, it is
        ack = await s.append(token_ids=[5, 6, 7], deadline_ms=0.001)
        assert not ack.deadline_missed
        await s.close()


async def test_a_resume_renders_the_neutral_results_it_kept(limited: RunningServer) -> None:
    ws = await raw_connect(limited)
    await ws.send(msgpack.packb({"type": "open", "id": 1, "window": 32}))
    opened = await recv(ws, type="opened")
    sid = opened["session"]
    await ws.send(msgpack.packb({"type": "append", "session": sid, "seq": 0, "token_ids": [5, 6]}))
    first = await recv(ws, type="ack")
    entry = limited.server.service.registry.find(sid)  # type: ignore[union-attr]
    assert entry is not None and all(isinstance(r, ChunkResult) for r in entry.recent)
    ws.transport.abort()
    ws2 = await raw_connect(limited)
    await ws2.send(msgpack.packb({"type": "resume", "id": 2, "session": sid, "resume_token": opened["resume_token"]}))
    assert (await recv(ws2, type="opened"))["resumed"]
    again = await recv(ws2, type="ack")
    assert again == first  # the same result, rendered again in the native form
    await ws2.send(msgpack.packb({"type": "close", "id": 3, "session": sid}))
    await recv(ws2, type="closed")
    await ws2.close()


class HeldOpens:
    """The registry's open waits in its engine thread until `release`; what it made is in `made`."""

    def __init__(self, service: SessionService, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.release, self.done = threading.Event(), threading.Event(), threading.Event()
        self.made: list[Entry] = []
        real_open = service.registry.open

        def held_open(*args: Any, **kw: Any) -> Entry:
            self.entered.set()
            self.release.wait(10)
            try:
                self.made.append(real_open(*args, **kw))
                return self.made[-1]
            finally:
                self.done.set()

        monkeypatch.setattr(service.registry, "open", held_open)

    async def session_after_release(self) -> Session:
        self.release.set()
        await asyncio.to_thread(self.done.wait, 10)
        return self.made[0].session


async def closed_soon(session: Session) -> bool:
    deadline = time.monotonic() + 10
    while not session.closed and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return session.closed


async def test_an_open_cancelled_while_the_engine_opens_leaves_no_session_behind(
        limited: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler is cancelled (a shutdown, a dropped request) while the engine thread opens the session: the
    session it makes is closed, not left in the registry under a connection that is gone (pages held for ever,
    never reaped)."""
    service = limited.server.service
    assert service is not None
    held = HeldOpens(service, monkeypatch)
    ctx = service.connect(NullListener(), Grant())
    task = asyncio.create_task(service.open(ctx, OpenRequest(window=32)))
    await asyncio.to_thread(held.entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    session = await held.session_after_release()
    assert await closed_soon(session) and service.registry.find(session.id) is None
    assert service.registry.owned(ctx) == [] and service.reserved_pages(ctx) == 0


async def test_an_open_that_ends_after_its_connection_closes_the_session_it_made(
        limited: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter that reads on while an open runs (the service is protocol-neutral) may end its connection
    first: the session the open then makes must not stay held by a connection that is gone (never reaped)."""
    service = limited.server.service
    assert service is not None
    held = HeldOpens(service, monkeypatch)
    ctx = service.connect(NullListener(), Grant())
    task = asyncio.create_task(service.open(ctx, OpenRequest(window=32)))
    await asyncio.to_thread(held.entered.wait, 10)
    service.disconnect(ctx)  # the connection ends meanwhile
    session = await held.session_after_release()
    with pytest.raises(SessionClosedError):  # nobody hears of it
        await task
    assert await closed_soon(session) and service.registry.find(session.id) is None


class NullListener:
    async def push(self, result: object) -> None:
        pass

    def push_nowait(self, result: object) -> bool:
        return True


async def test_a_session_the_engine_closed_gives_its_quota_back_at_once(limited: RunningServer) -> None:
    """A session failing in the engine (or closed by its idle TTL) is gone for the client at once: its pages
    and its place among the connection's sessions come back then, not when the reaper next runs."""
    service = limited.server.service
    assert service is not None
    ctx = service.connect(NullListener(), Grant())
    need = windowed_pages(limited, 32, 4)
    held = [await service.open(ctx, OpenRequest(window=32, sinks=4)) for _ in range(PAGES // need)]
    with pytest.raises(QuotaExceededError):
        await service.open(ctx, OpenRequest(window=32, sinks=4))
    entry = service.registry.find(held[0].session)
    assert entry is not None
    await asyncio.to_thread(entry.session.close)  # what the engine does to a session whose step failed
    assert service.reserved_pages(ctx) == (len(held) - 1) * need
    again = await service.open(ctx, OpenRequest(window=32, sinks=4))
    for opened in (*held[1:], again):
        await service.close(ctx, opened.session)
    service.disconnect(ctx)


async def test_appends_running_at_once_cannot_pass_the_queued_token_cap_together(limited: RunningServer) -> None:
    """The service is protocol-neutral: an adapter may run appends concurrently. Long texts are tokenized off the
    event loop, so each append's check must count the tokens of the others still being tokenized."""
    service = limited.server.service
    assert service is not None
    ctx = service.connect(NullListener(), Grant())
    sid = (await service.open(ctx, OpenRequest(window=60, sinks=4))).session
    text = " righteousness" * 40  # over 512 characters (tokenized on the executor), 40 tokens
    with engine_paused(limited.engine):  # nothing is acked meanwhile
        outcomes = await asyncio.gather(*(service.append(ctx, sid, AppendRequest(text=text)) for _ in range(3)),
                                        return_exceptions=True)
        assert sum(isinstance(o, QuotaExceededError) for o in outcomes) == 1, outcomes
        assert ctx.queued_tokens == 80 <= QUEUED
    deadline = time.monotonic() + 30
    while ctx.queued_tokens and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert ctx.queued_tokens == 0
    await service.close(ctx, sid)
    service.disconnect(ctx)


async def test_a_resume_without_the_token_learns_nothing_of_the_session(limited: RunningServer) -> None:
    """The token is checked before the quota: a caller with the session id but not its token gets
    invalid_resume_token, never quota_exceeded (which would say that the session exists and what it reserves)."""
    async with sc.connect(limited.url) as owner, sc.connect(limited.url) as other:
        target = await owner.open_session(window=32, sinks=4)
        a = await other.open_session(window=32, sinks=4)
        b = await other.open_session(window=32, sinks=4)  # `other` has no quota left for a third session
        for token in ("not-the-token", target.info["resume_token"][:-1] + "x"):
            with pytest.raises(sc.StreamserveClientError) as info:
                await other.request({"type": "resume", "session": target.id, "resume_token": token})
            assert info.value.code == "invalid_resume_token"
        with pytest.raises(sc.StreamserveClientError) as info:  # with the token, the quota speaks
            await other.request({"type": "resume", "session": target.id, "resume_token": target.info["resume_token"]})
        assert info.value.code == "quota_exceeded"
        for s in (a, b, target):
            await s.close()
