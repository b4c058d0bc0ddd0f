"""The client SDK's channel against a fake server: junk mid-stream fails every pending call with a typed
error within a bounded time and the client resumes (or, without reconnects, stays failed); unknown
message types are ignored; dropped connections resume and re-send what the server lacks."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import pytest
from fake_server import FakeServer

import streamserve_client as sc
from streamserve_client import channel, handshake
from streamserve_client.routes import SessionRoute
from streamserve_client.session import MAX_BUFFERED_DELTAS

BOUND_S = 5.0  # every pending call must fail within this after the junk arrives


async def held_append(fake: FakeServer, session: Any) -> asyncio.Task:
    """An append the fake server keeps without acknowledging: a call in flight. -> its task, once it was sent."""
    fake.hold_acks = True
    pending = asyncio.create_task(session.append(text="x"))
    while not any(m["type"] == "append" for m in fake.received):
        await asyncio.sleep(0.01)
    return pending


def junk_frames(session_id: str) -> dict[str, bytes | str]:
    """What a broken (or hostile) server sends, by name; `session_id` is a session with no reply running."""
    return {
        "garbage bytes": b"\xc1\xff\x00garbage",
        "truncated msgpack": msgpack.packb({"type": "ack", "session": session_id, "seq": 0})[:-3],
        "a text frame": "hello?",
        "a list, not a map": msgpack.packb(["ack", session_id, 0]),
        "a map without type": msgpack.packb({"session": session_id, "seq": 0}),
        "an ack with a string seq": msgpack.packb({"type": "ack", "session": session_id, "seq": "0"}),
        "an ack without seq": msgpack.packb({"type": "ack", "session": session_id}),
        "a delta for no running reply": msgpack.packb({"type": "delta", "session": session_id, "response": "r9",
                                                       "text": "x", "token_ids": [1]}),
        "a done with a text usage": msgpack.packb({"type": "done", "session": session_id, "usage": "lots"}),
        "an error without code": msgpack.packb({"type": "error", "message": "?", "session": session_id}),
    }


JUNK = list(junk_frames("s"))


async def calls_in_flight(client: sc.Client, fake: FakeServer,
                          ) -> tuple[sc.Session, sc.Session, list[asyncio.Task[Any]]]:
    """Two sessions; on the first a chunk awaiting its ack and a running reply, plus a request awaiting its
    answer: -> (busy session, idle session, the pending calls)."""
    busy, idle = await client.open_session(), await client.open_session()
    fake.hold_acks = fake.hold_requests = fake.hold_replies = True
    reply = busy.respond(max_tokens=3)
    first = await asyncio.wait_for(reply.__anext__(), BOUND_S)  # the reply is running
    assert first.text == "a"
    tasks = [asyncio.create_task(busy.append(text="chunk")), asyncio.create_task(client.stats()),
             asyncio.create_task(reply.wait())]
    while not any(m["type"] == "append" for m in fake.received) or not any(
            m["type"] == "stats" for m in fake.received):
        await asyncio.sleep(0.01)
    assert not any(t.done() for t in tasks)
    return busy, idle, tasks


async def expect_violation(tasks: list[asyncio.Task[Any]]) -> None:
    done, pending = await asyncio.wait(tasks, timeout=BOUND_S)
    assert not pending, f"{len(pending)} calls still waiting {BOUND_S} s after the junk"
    for t in done:
        error = t.exception()
        assert isinstance(error, sc.ProtocolViolationError), repr(error)
        assert isinstance(error, sc.ConnectionLostError) and error.code == "protocol_violation"


@pytest.mark.asyncio
@pytest.mark.parametrize("junk", JUNK)
async def test_junk_fails_every_pending_call_then_the_client_resumes(fake_server: FakeServer, junk: str) -> None:
    async with sc.connect(fake_server.url) as client:
        busy, idle, tasks = await calls_in_flight(client, fake_server)
        await fake_server.send_raw(junk_frames(idle.id)[junk])
        await expect_violation(tasks)
        fake_server.hold_acks = fake_server.hold_requests = fake_server.hold_replies = False
        # the client reconnected and resumed both sessions; later calls work
        ack = await asyncio.wait_for(busy.append(text="again"), BOUND_S)
        assert ack.tokens == 1 and fake_server.connections == 2
        assert sorted(fake_server.resumes) == sorted([busy.id, idle.id])
        reply = idle.respond(max_tokens=2)
        assert [d.text async for d in reply] == ["a", "a"] and reply.finish_reason == "length"
        assert (await client.stats())["model"] == "fake"
        assert not busy.closed and not idle.closed


@pytest.mark.asyncio
@pytest.mark.parametrize("junk", ["garbage bytes", "an ack with a string seq", "a delta for no running reply"])
async def test_without_reconnects_junk_fails_fast_and_the_client_stays_failed(fake_server: FakeServer,
                                                                             junk: str) -> None:
    client = sc.connect(fake_server.url, reconnect=False)
    await client.connect()
    busy, idle, tasks = await calls_in_flight(client, fake_server)
    await fake_server.send_raw(junk_frames(idle.id)[junk])
    await expect_violation(tasks)
    for call in (client.stats(), busy.append(text="more"), client.open_session()):
        with pytest.raises(sc.ProtocolViolationError):
            await asyncio.wait_for(call, BOUND_S)
    assert busy.closed and idle.closed
    await asyncio.sleep(0.3)
    assert fake_server.connections == 1  # no reconnect
    await asyncio.wait_for(client.close(), BOUND_S)


@pytest.mark.asyncio
async def test_an_exception_while_routing_fails_every_pending_call_like_junk(fake_server: FakeServer,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: SessionRoute, m: dict[str, Any]) -> None:
        raise RuntimeError("a bug in the client")

    async with sc.connect(fake_server.url) as client:
        busy, _, tasks = await calls_in_flight(client, fake_server)
        with monkeypatch.context() as patch:
            patch.setattr(SessionRoute, "on_ack", broken)
            await fake_server.send_raw(msgpack.packb({"type": "ack", "session": busy.id, "seq": 0}))
            await expect_violation(tasks)
        fake_server.hold_acks = fake_server.hold_requests = fake_server.hold_replies = False
        assert (await asyncio.wait_for(busy.append(text="fine"), BOUND_S)).tokens == 1


def test_the_blocking_client_fails_pending_calls_on_junk_and_resumes(fake_server_thread: FakeServer) -> None:
    fake = fake_server_thread
    with sc.SyncClient(fake.url, timeout=BOUND_S) as client:
        s = client.open_session()
        assert s.append(text="x").tokens == 1
        fake.hold_requests = True
        with ThreadPoolExecutor(1) as pool:
            stats = pool.submit(client.stats)
            while not any(m["type"] == "stats" for m in fake.received):
                time.sleep(0.01)
            fake.send_raw_threadsafe(b"\xc1")
            with pytest.raises(sc.ProtocolViolationError):
                stats.result(BOUND_S)
        fake.hold_requests = False
        assert client.stats()["model"] == "fake" and s.append(text="y").seq == 1
        assert "".join(d.text for d in s.respond(max_tokens=2)) == "aa" and s.finish_reason == "length"
        client.drop_connection()
        assert s.append(text="z").seq == 2 and fake.resumes == [s.id, s.id]


@pytest.mark.asyncio
async def test_unknown_message_types_and_fields_from_a_newer_server_are_ignored(fake_server: FakeServer) -> None:
    async with sc.connect(fake_server.url) as client:
        busy, _, tasks = await calls_in_flight(client, fake_server)
        await fake_server.send_raw(msgpack.packb({"type": "turn_detected", "session": busy.id, "at": 1.5}))
        await fake_server.send_raw(msgpack.packb({"type": "ack", "session": "someone-else", "seq": 3}))
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in tasks)  # nothing failed, nothing resolved
        fake_server.hold_acks = fake_server.hold_requests = fake_server.hold_replies = False
        # known messages with fields this client does not know
        stats_id = next(m["id"] for m in fake_server.received if m["type"] == "stats")
        await fake_server.send_raw(msgpack.packb({"type": "ack", "session": busy.id, "seq": 0, "tokens": 5,
                                                  "energy_mj": 0.3}))
        await fake_server.send_raw(msgpack.packb({"type": "stats", "id": stats_id, "model": "fake", "gpus": 8}))
        ack, stats, reason = await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)
        assert ack.seq == 0 and ack.tokens == 5 and stats["gpus"] == 8 and reason == "length"
        assert fake_server.connections == 1


@pytest.mark.asyncio
async def test_a_dropped_connection_resends_the_chunks_the_server_lacks(fake_server: FakeServer) -> None:
    async with sc.connect(fake_server.url) as client:
        s = await client.open_session()
        assert (await s.append(text="kept")).seq == 0
        fake_server.lose_appends = True  # the next chunk goes down with the connection
        pending = asyncio.create_task(s.append(text="lost"))
        while not any(m["type"] == "append" and m["seq"] == 1 for m in fake_server.received):
            await asyncio.sleep(0.01)
        fake_server.lose_appends = False
        await client.drop_connection()
        ack = await asyncio.wait_for(pending, BOUND_S)  # sent again after the resume (next_seq was 1)
        assert ack.seq == 1 and fake_server.sessions[s.id].seqs == [0, 1]
        assert [m["seq"] for m in fake_server.received if m["type"] == "append"] == [0, 1, 1]
        assert fake_server.resumes == [s.id]


@pytest.mark.asyncio
async def test_a_reply_running_at_a_drop_ends_with_connection_lost_and_the_session_goes_on(
        fake_server: FakeServer) -> None:
    async with sc.connect(fake_server.url) as client:
        s = await client.open_session()
        fake_server.hold_replies = True
        reply = s.respond(max_tokens=3)
        await asyncio.wait_for(reply.__anext__(), BOUND_S)
        await client.drop_connection()
        with pytest.raises(sc.ConnectionLostError) as info:
            await asyncio.wait_for(reply.wait(), BOUND_S)
        assert not isinstance(info.value, sc.ProtocolViolationError) and reply.finish_reason == "error"
        fake_server.hold_replies = False
        assert (await asyncio.wait_for(s.append(text="on"), BOUND_S)).tokens == 1


@pytest.mark.asyncio
async def test_a_reader_that_falls_behind_gets_merged_deltas_in_bounded_memory(fake_server: FakeServer) -> None:
    async with sc.connect(fake_server.url) as client:
        s = await client.open_session()
        reply = s.respond(max_tokens=1000)
        first = await asyncio.wait_for(reply.__anext__(), BOUND_S)
        while fake_server.sessions[s.id].tokens < 1000 or not any(
                m["type"] == "respond" for m in fake_server.received):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # everything has arrived; nothing has been read
        rest = [d async for d in reply]
        assert len(rest) <= MAX_BUFFERED_DELTAS + 1 and reply.finish_reason == "length"
        assert first.text + "".join(d.text for d in rest) == "a" * 1000 and len(reply.token_ids) == 1000


@pytest.mark.asyncio
async def test_resuming_a_session_this_client_holds_ends_the_older_handles_calls(fake_server: FakeServer) -> None:
    async with sc.connect(fake_server.url) as client:
        old = await client.open_session()
        pending = await held_append(fake_server, old)
        new = await client.resume_session(old.id, old.resume_token)
        with pytest.raises(sc.UnknownSessionError) as info:
            await asyncio.wait_for(pending, BOUND_S)
        assert info.value.code == "session_moved" and old.closed and not new.closed
        fake_server.hold_acks = False
        assert (await asyncio.wait_for(new.append(text="y"), BOUND_S)).seq == 1


@pytest.mark.asyncio
async def test_a_resume_the_server_never_answers_counts_as_a_broken_connection(fake_server: FakeServer,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel, "RESUME_TIMEOUT_S", 0.5)
    async with sc.connect(fake_server.url) as client:
        s = await client.open_session()
        fake_server.unanswered_resumes = 1
        await client.drop_connection()
        assert (await asyncio.wait_for(s.append(text="x"), BOUND_S)).tokens == 1
        assert fake_server.connections == 3 and fake_server.resumes == [s.id]


@pytest.mark.asyncio
async def test_a_server_that_stays_silent_is_refused_in_bounded_time(fake_server: FakeServer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handshake, "HELLO_TIMEOUT_S", 0.3)
    fake_server.silent = True
    with pytest.raises(sc.ConnectionLostError, match="no hello"):
        await asyncio.wait_for(sc.connect(fake_server.url).connect(), BOUND_S)


@pytest.mark.asyncio
async def test_a_server_that_does_not_speak_first_with_hello_is_refused(fake_server: FakeServer) -> None:
    fake_server.hello = {"type": "hello", "protocol": "one"}
    with pytest.raises(sc.ProtocolViolationError):
        await asyncio.wait_for(sc.connect(fake_server.url).connect(), BOUND_S)


@pytest.mark.asyncio
async def test_an_unexpected_error_while_reconnecting_fails_every_call_instead_of_hanging(
        fake_server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: object) -> None:
        raise RuntimeError("a bug in the handshake")

    async with sc.connect(fake_server.url) as client:
        pending = await held_append(fake_server, await client.open_session())
        monkeypatch.setattr(channel, "open_connection", broken)
        await client.drop_connection()
        with pytest.raises(sc.ConnectionLostError):
            await asyncio.wait_for(pending, BOUND_S)
        with pytest.raises(sc.ConnectionLostError):
            await asyncio.wait_for(client.stats(), BOUND_S)
        assert client.channel.dead is not None


def test_a_blocking_call_that_times_out_is_cancelled_and_raises_a_typed_error(
        fake_server_thread: FakeServer) -> None:
    fake = fake_server_thread
    with sc.SyncClient(fake.url, timeout=0.3) as client:
        s = client.open_session()
        fake.hold_acks = True
        with pytest.raises(sc.CallTimeoutError) as info:
            s.append(text="x")
        assert isinstance(info.value, TimeoutError) and info.value.code == "timeout"
        fake.hold_acks = False
        time.sleep(0.05)
        # the timed-out append no longer waits: its seq is free, nothing is pending on the loop
        assert s.append(text="y", seq=0).seq == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("code", [1012, 1001])
async def test_a_draining_server_closing_with_1012_is_reconnected_without_backoff_and_resumed(
        fake_server: FakeServer, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """1012 (a drain: docs/protocol.md): the first reconnect has no backoff; any other close keeps it (the control).
    The drain's `reconnect` message, sent first, changes nothing on the client."""
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, *args: Any) -> Any:
        delays.append(delay)
        return await real_sleep(delay, *args)

    monkeypatch.setattr(channel.asyncio, "sleep", sleep)
    async with sc.connect(fake_server.url) as client:
        s = await client.open_session()
        assert (await s.append(text="before")).seq == 0
        assert fake_server._ws is not None
        await fake_server.send_raw(msgpack.packb({"type": "reconnect", "reason": "drain", "sessions": [s.id]}))
        await fake_server._ws.close(code, "server draining")
        while fake_server.resumes != [s.id]:
            await real_sleep(0.01)
        assert (await asyncio.wait_for(s.append(text="after"), BOUND_S)).seq == 1
        assert client.channel.generation == 2 and fake_server.sessions[s.id].seqs == [0, 1]
    first_backoff = min(2.0, 0.1 * 2 ** 0)
    assert (first_backoff in delays) == (code != 1012), delays
