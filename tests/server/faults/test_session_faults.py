"""Fault injection over the wire (native protocol, loopback): an engine exception in one session's step, and the
KV pool running out while sessions are parked. Each fails only what it must, typed, and nothing leaks: the
other sessions answer exactly as an uninterrupted reference does."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
import websockets
from helpers import greedy, random_ids
from serving import RunningServer, serve

from streamserve.config import ServerConfig
from streamserve.engine import Engine

PROMPT = "In the beginning God created"


def raw(frame: dict[str, Any]) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


async def recv_type(ws: websockets.ClientConnection, *kinds: str) -> dict:
    while True:
        m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60))
        if m["type"] in kinds:
            return m


async def connect(srv: RunningServer) -> websockets.ClientConnection:
    ws = await websockets.connect(srv.url + "/v1/stream")
    await recv_type(ws, "hello")
    return ws


async def open_with(ws: websockets.ClientConnection, **append: Any) -> tuple[str, str]:
    await ws.send(raw({"type": "open", "id": 1}))
    opened = await recv_type(ws, "opened")
    await ws.send(raw({"type": "append", "session": opened["session"], **append}))
    ack = await recv_type(ws, "ack", "error")
    assert ack["type"] == "ack", ack
    return opened["session"], opened["resume_token"]


async def reply(ws: websockets.ClientConnection, sid: str, n: int) -> tuple[list[int], dict]:
    """(the reply's tokens, how it ended: its `done`, or an `error` about the session)"""
    await ws.send(raw({"type": "respond", "session": sid, "max_tokens": n}))
    got: list[int] = []
    while True:
        m = await recv_type(ws, "delta", "done", "error")
        if m["type"] == "delta":
            got += m["token_ids"]
        else:
            return got, m


async def no_pages(engine: Engine) -> None:
    async def wait() -> None:
        while engine.stats()["sessions_open"] or engine.stats()["kv_pages_used"]:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(wait(), 30)
    engine.check_integrity()


@pytest.mark.asyncio
async def test_an_engine_exception_in_one_sessions_step_fails_that_session_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with serve(ServerConfig()) as srv:
        engine = srv.engine
        expected = await asyncio.to_thread(lambda: greedy(engine, engine.tokenizer.encode(PROMPT), 12))
        a, b = await connect(srv), await connect(srv)
        sid_a, _ = await open_with(a, token_ids=engine.tokenizer.encode(PROMPT))
        sid_b, _ = await open_with(b, token_ids=engine.tokenizer.encode(PROMPT))
        victim = srv.server.service.registry.find(sid_a).session.kv  # type: ignore[union-attr]
        model = type(engine.model)
        real = model.forward_batch

        def faulty(self: Any, ids: Any, kvs: Any, rows: Any = None) -> Any:  # any step that includes the victim
            if any(kv is victim for kv in kvs):
                raise RuntimeError("injected fault: /secret/path in the message")
            return real(self, ids, kvs, rows)

        monkeypatch.setattr(model, "forward_batch", faulty)
        (_, end_a), (got_b, end_b) = await asyncio.gather(reply(a, sid_a, 12), reply(b, sid_b, 12))
        assert end_a["type"] == "error" and end_a["code"] == "step_failed", end_a
        assert "secret" not in end_a["message"] and "RuntimeError" not in end_a["message"]  # the cause: the log's
        assert end_b == {**end_b, "type": "done", "reason": "length"} and got_b == expected
        await a.send(raw({"type": "append", "session": sid_a, "text": " the heaven"}))
        assert (await recv_type(a, "error"))["code"] in ("unknown_session", "session_closed")  # it was closed
        monkeypatch.undo()
        assert (await reply(b, sid_b, 4))[1]["reason"] == "length"  # b goes on
        await b.send(raw({"type": "close", "session": sid_b, "id": 2}))
        await recv_type(b, "closed")
        await a.close()
        await b.close()
        await no_pages(engine)


def small_pool() -> Engine:
    return Engine.from_pretrained("default", device="cpu", kv_memory="1MiB")  # 16 pages of 16 tokens


@pytest.mark.asyncio
async def test_pool_exhaustion_while_sessions_are_parked_is_a_typed_refusal_and_the_parked_come_back_intact() -> None:
    ids = {k: random_ids(100, seed=1717 + i) for i, k in enumerate("abc")}  # 7 pages each
    async with serve(ServerConfig(resume_ttl=60.0), load=small_pool) as srv:
        engine = srv.engine
        assert engine.stats()["kv_pages_total"] == 16
        expected = {k: await asyncio.to_thread(greedy, engine, ids[k], 8) for k in "ab"}
        first = await connect(srv)
        sid_a, tok_a = await open_with(first, token_ids=ids["a"], seq=0)
        sid_b, tok_b = await open_with(first, token_ids=ids["b"], seq=0)
        first.transport.abort()  # a and b are detached, idle, holding 14 pages
        second = await connect(srv)
        sid_c, _ = await open_with(second, token_ids=ids["c"], seq=0)  # needs 7 of 2 free: parks a (or both)
        assert engine.stats()["sessions_parked"] >= 1
        # 13 more pages for c can never fit beside the 7 it holds: refused, typed, nothing of it taken. (It runs
        # in 64-token steps, and the first ones fit: b may be parked on the way.)
        await second.send(raw({"type": "append", "session": sid_c, "seq": 1, "token_ids": random_ids(200, 9)}))
        refused = await recv_type(second, "error")
        assert refused["code"] == "capacity_exceeded" and "retry" in refused["message"], refused
        assert len(srv.server.service.registry.find(sid_c).session.token_ids) == 100  # type: ignore[union-attr]
        third = await connect(srv)
        for sid, tok, k in ((sid_a, tok_a, "a"), (sid_b, tok_b, "b")):  # each comes back from the host
            await third.send(raw({"type": "resume", "session": sid, "resume_token": tok, "id": 2}))
            resumed = await recv_type(third, "opened")
            assert resumed["tokens"] == 100 and resumed["next_seq"] == 1
            got, end = await reply(third, sid, 8)
            assert end["type"] == "done" and got == expected[k], (k, end)
        assert engine.stats()["sessions_parked_total"] >= 2
        for ws, sids in ((third, (sid_a, sid_b)), (second, (sid_c,))):
            for sid in sids:
                await ws.send(raw({"type": "close", "session": sid, "id": 3}))
                await recv_type(ws, "closed")
            await ws.close()
        await no_pages(engine)
