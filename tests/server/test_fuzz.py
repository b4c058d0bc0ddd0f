"""Protocol fuzz: random bytes, random msgpack, and valid messages with fields swapped for random values,
sent to the real server. After each frame a `stats` request must still be answered (or the connection
closed with a protocol close code); afterwards a session on another connection, set up before the fuzz,
answers exactly as the engine does."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import RunningServer

import streamserve_client as sc

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                      max_leaves=12)
TEMPLATES = [
    {"type": "open", "window": 16, "sinks": 2, "sampling": {"max_tokens": 2}},
    {"type": "append", "session": "SESSION", "text": "And God said", "seq": 0},
    {"type": "append", "session": "SESSION", "token_ids": [1, 2, 3]},
    {"type": "respond", "session": "SESSION", "max_tokens": 2, "temperature": 0.5, "stop": ["x"]},
    {"type": "cancel", "session": "SESSION"},
    {"type": "rewind", "session": "SESSION", "to_seq": 0},
    {"type": "configure", "session": "SESSION", "sampling": {"top_p": 0.9}},
    {"type": "resume", "session": "SESSION", "resume_token": "x"},
    {"type": "close", "session": "SESSION"},
    {"type": "stats"},
]


@st.composite
def mutated(draw: st.DrawFn) -> dict:
    msg = dict(draw(st.sampled_from(TEMPLATES)))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from([*msg, "type", "session", "id", "seq", "max_tokens", "extra"]))
        if draw(st.booleans()) and key != "type":
            msg.pop(key, None)
        else:
            msg[key] = draw(values)
    return msg


frames = st.one_of(st.binary(max_size=200), values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
                   mutated().map(lambda m: m))


async def exchange(served: RunningServer, batch: list) -> None:
    ws = await websockets.connect(served.url + "/v1/stream")
    await ws.recv()  # hello
    session = None
    for n, frame in enumerate(batch):
        if isinstance(frame, dict):  # a mutated message: point it at this connection's session when it has one
            if frame.get("session") == "SESSION":
                frame["session"] = session or "SESSION"
            try:
                frame = msgpack.packb(frame, use_bin_type=True)
            except (TypeError, ValueError, OverflowError):
                continue
        try:
            await ws.send(frame)
            await ws.send(msgpack.packb({"type": "stats", "id": f"probe{n}"}))
            while True:
                m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30), raw=False)
                assert m.get("code") != "internal_error", (frame, m)  # a handler failed: a bug
                if m.get("type") == "opened" and session is None:
                    session = m["session"]
                if m.get("type") == "stats" and m.get("id") == f"probe{n}":
                    break
            if session is not None:
                await ws.send(msgpack.packb({"type": "cancel", "session": session}))
        except websockets.ConnectionClosed as e:
            assert e.rcvd is not None and e.rcvd.code in (4400, 1009), e  # only the protocol's own closes
            return
    await ws.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_the_server_survives_random_and_malformed_frames(served: RunningServer) -> None:
    def engine_tokens() -> list[int]:
        with served.engine.open_session() as s:
            s.append(text="And God said")
            return s.generate(max_tokens=8, stop_token_ids=())

    expected = await asyncio.to_thread(engine_tokens)
    client = sc.connect(served.url)
    await client.connect()
    bystander = await client.open_session()
    await bystander.append(text="And God said")
    loop = asyncio.get_running_loop()

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(frames, min_size=1, max_size=12))
    def fuzz(batch: list) -> None:  # hypothesis drives from a worker thread; the exchange runs on the server's loop
        asyncio.run_coroutine_threadsafe(exchange(served, batch), loop).result(120)

    await asyncio.to_thread(fuzz)
    r = bystander.respond(max_tokens=8, temperature=0.0)
    await r.wait()
    await client.close()
    assert r.token_ids == expected
    served.engine.check_integrity()
