"""End to end over loopback: the real server, the default model, the Python client SDK."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import msgpack
import pytest
import websockets
from serving import RunningServer, default_engine, engine_paused, serve

import streamserve_client as sc
from streamserve.config import ServerConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")  # the module's server runs in the module's loop

PROMPTS = ["In the beginning God created", "And the LORD spake unto Moses", "Blessed are the meek",
           "The LORD is my shepherd"]


async def engine_tokens(served: RunningServer, text: str, n: int) -> list[int]:
    """The engine's own greedy tokens (in a worker thread: the server shares this event loop)."""
    def run() -> list[int]:
        with served.engine.open_session() as s:
            s.append(text=text)
            return s.generate(max_tokens=n, stop_token_ids=())

    return await asyncio.to_thread(run)


async def http_get(url: str) -> tuple[int, bytes]:
    def run() -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    return await asyncio.to_thread(run)


def raw(frame: dict) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


async def raw_connect(served: RunningServer) -> websockets.ClientConnection:
    ws = await websockets.connect(served.url + "/v1/stream")
    hello = msgpack.unpackb(await ws.recv())
    assert hello["type"] == "hello" and hello["protocol"] == 1
    return ws


async def recv_type(ws: websockets.ClientConnection, kind: str) -> dict:
    while True:
        m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30))
        if m["type"] == kind:
            return m


async def test_sessions_at_once_get_the_engines_greedy_tokens_over_the_wire(served: RunningServer) -> None:
    expected = [await engine_tokens(served, p, 16) for p in PROMPTS]

    async def one(client: sc.Client, text: str) -> tuple[list[int], str, sc.Ack]:
        s = await client.open_session()
        ack = await s.append(text=text)
        r = s.respond(max_tokens=16, temperature=0.0)
        text_out = "".join([d.text async for d in r])
        assert r.finish_reason == "length" and r.usage["completion_tokens"] == 16
        await s.close()
        return r.token_ids, text_out, ack

    async def main() -> list:
        async with sc.connect(served.url) as a, sc.connect(served.url) as b:
            assert a.hello["model"] == "default" and a.hello["limits"]["max_chunk_tokens"] == 64
            return await asyncio.gather(*(one(a if i % 2 else b, p) for i, p in enumerate(PROMPTS)))

    out = await main()
    assert [o[0] for o in out] == expected
    assert [o[1] for o in out] == [served.engine.tokenizer.decode(e) for e in expected]
    ack = out[0][2]
    assert ack.seq == 0 and ack.tokens > 0 and ack.compute_ms > 0 and ack.round_trip_ms >= ack.compute_ms
    assert served.engine.stats()["sessions_open"] == 0


async def test_cancel_mid_reply_and_rewind_to_a_chunk(served: RunningServer) -> None:
    async def main() -> None:
        async with sc.connect(served.url) as client:
            s = await client.open_session(window=32, sinks=4)  # rolling: the reply could run for ever
            await s.append(text="In the beginning")
            await s.append(text=" God created")
            r = s.respond(max_tokens=1000)
            n = 0
            async for _ in r:
                n += 1
                if n == 3:
                    await s.cancel()
            assert r.finish_reason == "cancelled" and n >= 3
            assert await s.rewind(to_seq=1) == len(served.engine.tokenizer.encode("In the beginning God created"))
            assert s.next_seq == 2
            ack = await s.append(text=" the heaven")
            assert ack.seq == 2

    await main()


async def test_a_cut_connection_resumes_with_kv_and_timeline(served: RunningServer) -> None:
    expected = await engine_tokens(served, "In the beginning God created the heaven", 12)

    async def main() -> tuple[list[int], list[int]]:
        async with sc.connect(served.url) as client:
            s = await client.open_session()
            await s.append(text="In the beginning")
            await client.drop_connection()  # the network drops
            ack = await s.append(text=" God created the heaven")  # sent after the client reconnects and resumes
            assert ack.tokens > 0
            got = [t for d in [d async for d in s.respond(max_tokens=12)] for t in d.token_ids]
            # a second client takes the session over with its id and resume token
            async with sc.connect(served.url) as other:
                s2 = await other.resume_session(s.id, s.resume_token)
                assert s2.info["resumed"] and s2.info["tokens"] == len(served.engine.tokenizer.encode(
                    "In the beginning God created the heaven")) + 12
                more = [t for d in [d async for d in s2.respond(max_tokens=3)] for t in d.token_ids]
                await s2.close()
            return got, more

    got, more = await main()
    assert got == expected and len(more) == 3


async def test_every_error_code_reaches_the_client_typed(served: RunningServer) -> None:
    async def main() -> None:
        async with sc.connect(served.url) as client:
            s = await client.open_session()
            cases = [
                (s.append(token_ids=[]), sc.InvalidInputError, "empty_append"),
                (s.append(token_ids=[10**6]), sc.InvalidInputError, "token_out_of_range"),
                (s.append(token_ids=list(range(1, 100))), sc.InvalidInputError, "chunk_too_large"),
                (s.append(audio=(b"\0\0" * 160, 16000)), sc.UnsupportedModalityError, "unsupported_modality"),
                (s.append(image=__import__("numpy").zeros((4, 4, 3), dtype="uint8")), sc.UnsupportedModalityError,
                 "unsupported_modality"),
                (s.rewind(to_seq=99), sc.InvalidInputError, "invalid_rewind"),
                (client.resume_session(s.id, "x" * 43), sc.UnknownSessionError, "invalid_resume_token"),
                (client.resume_session("no-such-session", "x"), sc.UnknownSessionError, "unknown_session"),
                (client.open_session(window=0), sc.InvalidInputError, "bad_message"),
                (client.open_session(max_tokens=10**6), sc.InvalidInputError, "invalid_input"),
                (client.open_session(temperature=-1.0), sc.InvalidInputError, "invalid_input"),
                (client.open_session(stop=[""]), sc.InvalidInputError, "invalid_input"),
                (client.open_session(seed=2**63 + 5), sc.InvalidInputError, "bad_message"),
                (s.configure(top_p=2.0), sc.InvalidInputError, "invalid_input"),
                (s.append(text="x" * 10_000), sc.InvalidInputError, "chunk_too_large"),
            ]
            for coro, cls, code in cases:
                with pytest.raises(cls) as info:
                    await coro
                assert info.value.code == code, (code, info.value)
            await s.append(text="In the beginning", seq=5)
            with pytest.raises(sc.InvalidInputError, match="out of order") as info:
                await s.append(text=" again", seq=3)
            assert info.value.code == "invalid_input" and info.value.seq == 3
            r = s.respond(max_tokens=200)
            await r.__anext__()
            with pytest.raises(sc.InvalidInputError, match="already"):
                await s.respond(max_tokens=2).__anext__()  # the client's own check
            with pytest.raises(sc.InvalidInputError) as info:  # and the server's, bypassing it
                await client.request({"type": "respond", "session": s.id, "max_tokens": 2})
            assert info.value.code == "response_in_progress"
            await s.cancel()
            assert await r.wait() == "cancelled"  # the running reply was not disturbed
            extra = [await client.open_session() for _ in range(3)]
            with pytest.raises(sc.CapacityError) as info:
                await client.open_session()
            assert info.value.code == "too_many_sessions"
            for x in extra:
                await x.close()

    await main()


async def test_malformed_frames_get_errors_and_the_connection_survives_until_too_many(served: RunningServer) -> None:
    async def main() -> None:
        ws = await raw_connect(served)
        for frame in (b"\xc1", raw([1, 2]), raw({"type": "warp"}), raw({"type": "append"}),
                      raw({"type": "open", "window": "big"}), raw({"type": "open", "surprise": 1}),
                      raw({1: "int key"}), "a text frame"):
            await ws.send(frame)
            m = msgpack.unpackb(await ws.recv())
            assert m["type"] == "error" and m["code"] == "bad_message" and not m["fatal"]
        await ws.send(raw({"type": "stats", "id": 7}))
        assert (await recv_type(ws, "stats"))["id"] == 7  # still served
        for _ in range(20):
            await ws.send(b"\xc1")
        with pytest.raises(websockets.ConnectionClosed) as info:
            while True:
                await ws.recv()
        assert info.value.rcvd.code == 4400
        ws = await raw_connect(served)  # a huge frame closes only its own connection, with 1009
        await ws.send(b"\0" * (2 << 20))
        with pytest.raises(websockets.ConnectionClosed) as info:
            await ws.recv()
        assert info.value.rcvd.code == 1009

    await main()


async def test_a_connection_never_reaches_another_connections_session(served: RunningServer) -> None:
    async def main() -> None:
        async with sc.connect(served.url) as a, sc.connect(served.url) as b:
            s = await a.open_session()
            await s.append(text="In the beginning")
            for msg in ({"type": "append", "session": s.id, "text": "x", "id": 1},
                        {"type": "respond", "session": s.id, "id": 2}, {"type": "close", "session": s.id, "id": 3}):
                with pytest.raises(sc.UnknownSessionError):
                    await b.request(msg)
            assert (await s.append(text=" God")).tokens > 0  # untouched

    await main()


async def test_rate_limit_health_metrics_and_stats(served: RunningServer) -> None:
    status, body = await http_get(served.http + "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = await http_get(served.http + "/metrics")
    text = body.decode()
    assert "streamserve_step_seconds_bucket" in text and "streamserve_connections" in text

    async def main() -> float:
        ws = await raw_connect(served)
        t0 = time.monotonic()
        for i in range(1250):  # over 500 a second, past the burst of 1000: the server reads more slowly
            await ws.send(raw({"type": "stats", "id": i}))
        ids = [msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30))["id"] for _ in range(1250)]
        assert ids == list(range(1250))  # nothing dropped, in order
        await ws.close()
        return time.monotonic() - t0

    assert await main() >= 0.4  # (1250 - 1000) / 500 a second


async def test_api_key_is_required_when_set_and_a_full_server_says_try_later() -> None:
    async with serve(ServerConfig(api_key="s3cret", max_connections=1)) as srv:
        with pytest.raises(sc.UnauthorizedError):
            await sc.connect(srv.url).connect()
        with pytest.raises(sc.UnauthorizedError):
            await sc.connect(srv.url, api_key="wrong").connect()
        assert (await http_get(srv.http + "/metrics"))[0] == 401
        assert (await http_get(srv.http + "/healthz"))[0] == 200  # health stays open

        async def ok() -> int:
            async with sc.connect(srv.url, api_key="s3cret") as c:
                s = await c.open_session()
                with pytest.raises(sc.ServerBusyError):  # one connection is the limit: 1013, try later
                    await sc.connect(srv.url, api_key="s3cret").connect()
                return (await s.append(text="In the beginning")).tokens

        assert await ok() > 0


async def test_sync_client_and_dropped_sessions_expire_after_the_ttl(served: RunningServer) -> None:
    await asyncio.to_thread(sync_client_and_a_dropped_session, served)  # blocking calls: off the server's loop


def sync_client_and_a_dropped_session(served: RunningServer) -> None:
    with sc.SyncClient(served.url) as client:
        s = client.open_session(max_tokens=5)
        assert s.append(text="In the beginning").tokens > 0
        text = "".join(d.text for d in s.respond())
        assert text and s.finish_reason == "length"
        sid = s.id
        # the network drops: the client reconnects and resumes the session
        client.drop_connection()
        assert s.append(text=" God").tokens > 0
    # the client closed its sessions; now one that is only dropped
    c = sc.SyncClient(served.url, reconnect=False)
    s = c.open_session()
    s.append(text="In the beginning")
    c.drop_connection()
    deadline = time.monotonic() + 15
    while served.server.service.registry.all() and time.monotonic() < deadline:
        time.sleep(0.2)
    registry = served.server.service.registry
    assert not registry.all() and sid not in [e.session.id for e in registry.all()]
    assert served.engine.stats()["sessions_open"] == 0 and served.engine.stats()["kv_pages_used"] == 0
    c.close()  # the connection is gone: only the client's thread stops


async def test_shutdown_tells_sessions_and_frees_pages() -> None:
    srv = await RunningServer.start(ServerConfig(), default_engine)
    engine = srv.engine

    async def main() -> list[dict]:
        ws = await raw_connect(srv)
        await ws.send(raw({"type": "open", "id": 1}))
        sid = (await recv_type(ws, "opened"))["session"]
        await ws.send(raw({"type": "append", "session": sid, "text": "In the beginning"}))
        await recv_type(ws, "ack")
        stop = asyncio.create_task(srv.stop())
        got = []
        with pytest.raises(websockets.ConnectionClosed) as info:
            while True:
                got.append(msgpack.unpackb(await ws.recv()))
        await stop
        assert info.value.rcvd.code == 1001
        return got

    got = await main()
    assert any(m["type"] == "closed" and m["reason"] == "shutdown" for m in got)
    assert engine.stats()["kv_pages_used"] == 0 and engine.stats()["sessions_open"] == 0


async def test_results_of_chunks_finished_while_detached_reach_the_resuming_client(served: RunningServer) -> None:
    async def main() -> None:
        ws = await raw_connect(served)
        await ws.send(raw({"type": "open", "id": 1}))
        opened = await recv_type(ws, "opened")
        sid, token = opened["session"], opened["resume_token"]
        with engine_paused(served.engine):  # the chunks cannot run before the connection is gone
            for seq in range(3):
                await ws.send(raw({"type": "append", "session": sid, "seq": seq, "token_ids": [5, 6, 7]}))
            await ws.send(raw({"type": "append", "session": sid, "seq": 3, "token_ids": [10**6]}))
            await ws.send(raw({"type": "stats", "id": 2}))
            await recv_type(ws, "stats")  # the server has read them all
            ws.transport.abort()
        ws2 = await raw_connect(served)
        await ws2.send(raw({"type": "resume", "session": sid, "resume_token": token, "id": 3}))
        resumed = await recv_type(ws2, "opened")
        assert resumed["next_seq"] == 3  # seq 3 was refused at the call: it never entered the queue
        acks = [await recv_type(ws2, "ack") for _ in range(3)]
        assert [a["seq"] for a in acks] == [0, 1, 2] and all(a["tokens"] == 3 for a in acks)
        await ws2.close()

    await main()


async def test_the_server_sheds_its_oldest_detached_session_when_full() -> None:
    async with serve(ServerConfig(max_sessions=2, max_sessions_per_connection=2)) as srv:
        async def main() -> None:
            c1 = sc.connect(srv.url, reconnect=False)
            await c1.connect()
            old = await c1.open_session()
            await c1.open_session()
            await c1.drop_connection()  # both detached now
            await asyncio.sleep(0.3)
            async with sc.connect(srv.url) as c2:
                await c2.open_session()  # the oldest detached session made room
                with pytest.raises(sc.UnknownSessionError):
                    await c2.resume_session(old.id, old.resume_token)
                await c2.open_session()
                with pytest.raises(sc.CapacityError) as info:  # two held by this connection: the limit
                    await c2.open_session()
                assert info.value.code == "too_many_sessions"

        await main()


async def test_a_client_whose_server_is_gone_fails_fast_and_a_shutdown_does_not_wait_for_a_silent_client() -> None:
    srv = await RunningServer.start(ServerConfig(), default_engine)

    async def main() -> None:
        ws = await raw_connect(srv)
        await ws.send(raw({"type": "open", "id": 1}))
        await recv_type(ws, "opened")
        ws.transport.pause_reading()  # a client that never reads again
        client = sc.connect(srv.url)
        await client.connect()
        client.retries = 2
        s = await client.open_session()
        t0 = time.monotonic()
        await srv.stop()
        assert time.monotonic() - t0 < 15
        with pytest.raises(sc.StreamserveClientError):  # told the session closed, or the connection is gone
            await asyncio.wait_for(s.append(text="In the beginning"), 30)
        with pytest.raises(sc.ConnectionLostError):
            await asyncio.wait_for(client.stats(), 30)
        await asyncio.wait_for(client.close(), 5)
        ws.transport.abort()

    await main()


async def test_a_session_with_a_drafter_gives_the_same_tokens_over_the_wire(served: RunningServer) -> None:
    text = "And God said, Let there be light: and there was light. And God said, Let there be"
    expected = await engine_tokens(served, text, 24)

    async def main() -> list[int]:
        async with sc.connect(served.url) as client:
            s = await client.open_session(drafter="ngram")
            await s.append(text=text)
            r = s.respond(max_tokens=24)
            await r.wait()
            with pytest.raises(sc.InvalidInputError):
                await client.open_session(drafter="draft:/etc")  # paths are the server operator's choice
            return r.token_ids

    assert await main() == expected
