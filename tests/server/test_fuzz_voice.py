"""Protocol fuzz of the voice part (as tests/server/test_fuzz.py does for the rest): audio appends with random bytes,
rates, channels and encodings (NaN float32 and partial frames included), voice settings with random values on open
and configure, commits, all mixed with text appends with explicit seqs, sent to the real server with its voice
models. After each frame a `stats` request must still be answered (or the connection closed with a protocol close
code), no answer may be an internal_error; afterwards no Listener or Speaker is left and a bystander session
answers exactly as the engine does.

Needs the voice extra and models (skips naming them otherwise).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

import msgpack
import pytest
import pytest_asyncio
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import RunningServer, default_engine
from voice_assets import needs_voice

import streamserve_client as sc
from streamserve.config import ServerConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")

ENCODINGS = ["pcm16", "float32", "g711_ulaw", "g711_alaw", "mp3", "", "PCM16"]
nan_f32 = st.lists(st.sampled_from([float("nan"), float("inf"), 0.5, -1.0]), max_size=16).map(
    lambda xs: struct.pack(f"<{len(xs)}f", *xs))
audio_bytes = st.one_of(st.binary(max_size=400), nan_f32, st.just(b""))
numbers = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=8), st.sampled_from([0, 1, 2, 8, 9, 8000, 16000, 24000, 44100, 192000, 192001]),
                    st.floats(-0.5, 1.5), st.integers(-10, 20000))  # in and around the valid ranges too
fmt_maps = st.dictionaries(st.sampled_from(["encoding", "rate", "channels", "volume"]),
                           st.one_of(numbers, st.sampled_from(ENCODINGS)), max_size=4)
vad_maps = st.one_of(st.booleans(), st.none(), st.dictionaries(
    st.sampled_from(["type", "threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms",
                     "create_response", "interrupt_response", "eagerness"]),
    st.one_of(numbers, st.sampled_from(["server_vad", "none", "semantic_vad"])), max_size=5))
voices = st.one_of(st.none(), numbers, st.fixed_dictionaries(
    {}, optional={"input": st.one_of(fmt_maps, numbers), "turn_detection": vad_maps,
                  "speak": st.one_of(st.booleans(), fmt_maps, numbers)}))


@st.composite
def voice_frames(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(["audio", "audio", "audio", "configure", "open", "commit", "text"]))
    if kind == "audio":
        msg = {"type": "append", "session": "SESSION", "audio": draw(audio_bytes)}
        for key, strat in (("rate", numbers), ("channels", numbers),
                           ("encoding", st.one_of(st.sampled_from(ENCODINGS), numbers)), ("seq", numbers)):
            if draw(st.booleans()):
                msg[key] = draw(strat)
        return msg
    if kind == "configure":
        return {"type": "configure", "session": "SESSION", "voice": draw(voices)}
    if kind == "open":
        return {"type": "open", "voice": draw(voices)}
    if kind == "commit":
        return {"type": "commit", "session": "SESSION"}
    return {"type": "append", "session": "SESSION", "text": " And God said", "seq": draw(numbers)}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def voiced() -> AsyncIterator[RunningServer]:
    needs_voice()
    srv = await RunningServer.start(ServerConfig(messages_per_second=1000.0), default_engine, voice=True)
    yield srv
    await srv.stop()


async def exchange(served: RunningServer, batch: list[dict]) -> None:
    ws = await websockets.connect(served.url + "/v1/stream")
    await ws.recv()  # hello
    await ws.send(msgpack.packb({"type": "open", "id": "first", "voice": {"input": {"rate": 16000}}}))
    session = None
    while session is None:
        m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30), raw=False)
        session = m.get("session") if m.get("type") == "opened" else None
    for n, msg in enumerate(batch):
        if msg.get("session") == "SESSION":
            msg = {**msg, "session": session}
        try:
            frame = msgpack.packb(msg, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            continue
        try:
            await ws.send(frame)
            await ws.send(msgpack.packb({"type": "stats", "id": f"probe{n}"}))
            while True:
                m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60), raw=False)
                assert m.get("code") != "internal_error", (msg, m)  # a handler failed: a bug
                if m.get("type") == "stats" and m.get("id") == f"probe{n}":
                    break
        except websockets.ConnectionClosed as e:
            assert e.rcvd is not None and e.rcvd.code in (4400, 1009), e  # only the protocol's own closes
            return
    await ws.close()


async def test_the_voice_protocol_survives_random_audio_and_settings(voiced: RunningServer) -> None:
    def engine_tokens() -> list[int]:
        with voiced.engine.open_session() as s:
            s.append(text="And God said")
            return s.generate(max_tokens=8, stop_token_ids=())

    expected = await asyncio.to_thread(engine_tokens)
    client = sc.connect(voiced.url)
    await client.connect()
    bystander = await client.open_session()
    await bystander.append(text="And God said")
    loop = asyncio.get_running_loop()

    @settings(max_examples=200, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(voice_frames(), min_size=1, max_size=10))
    def fuzz(batch: list[dict]) -> None:  # hypothesis drives from a worker thread; the exchange runs on the loop
        asyncio.run_coroutine_threadsafe(exchange(voiced, batch), loop).result(300)

    await asyncio.to_thread(fuzz)
    r = bystander.respond(max_tokens=8, temperature=0.0)
    await r.wait()
    await client.close()
    assert r.token_ids == expected
    service = voiced.server.service
    assert service is not None
    for _ in range(600):  # the disconnected sessions' Listeners stop in tasks of their own (bounded wait)
        if service.audio.active() == 0:
            break
        await asyncio.sleep(0.05)
    assert service.audio.active() == 0
    voiced.engine.check_integrity()
