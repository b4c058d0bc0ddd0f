"""Media byte budgets (server/media/media_budget.py) through a real server on loopback: audio sent faster than it is
transcribed is refused with the typed code while another connection goes on, the server's budget refuses with
server_busy, a spoken reply's audio is charged to its connection, an image past the budget is refused, and after
disconnects nothing is held. The budget on its own: test_media_budget.py.

These tests need the voice extra and models (they skip naming them otherwise). They hold the speech-to-text thread
with a gate, so the backlog cannot drain while they fill it: no timing is assumed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import pytest_asyncio
from serving import RunningServer, default_engine
from voice_assets import needs_voice

import streamserve_client as sc
from streamserve.config import ServerConfig

PER_CONNECTION = 64_000  # 1 s of 16 kHz float32 (what the Listener's backlog holds)
GLOBAL = 100_000
RATE = 16000
FRAME = 2 * RATE // 50  # 20 ms of pcm16 at 16 kHz: 640 bytes in, 1280 bytes held
WAIT_S = 60  # a hang guard only


# ---- through a real server ---------------------------------------------------------------------------------
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def voiced() -> AsyncIterator[RunningServer]:
    needs_voice()
    config = ServerConfig(messages_per_second=2000.0, max_media_bytes=GLOBAL,
                          max_media_bytes_per_connection=PER_CONNECTION)
    srv = await RunningServer.start(config, default_engine, voice=True)
    yield srv
    await srv.stop()


@pytest.fixture
def stt_held(voiced: RunningServer) -> Iterator[threading.Event]:
    """The server's speech-to-text thread held: no pass runs, so audio waits untranscribed until the gate opens."""
    service = voiced.server.service
    assert service is not None and service.voice is not None
    gate = threading.Event()
    service.voice.stt_executor.submit(gate.wait)
    try:
        yield gate
    finally:
        gate.set()


async def until_released(srv: RunningServer) -> None:
    """Wait (bounded) until the server has seen the disconnects: no account left, nothing held."""
    service = srv.server.service
    assert service is not None
    for _ in range(600):  # the disconnect is noticed by the server's read loop
        if service.budget.held == 0 and service.budget.accounts == 0:
            return
        await asyncio.sleep(0.05)
    assert (service.budget.held, service.budget.accounts) == (0, 0)


async def fill(session: sc.Session, frames: int) -> sc.StreamserveClientError | None:
    """Append up to `frames` 20 ms frames of audio as fast as acks come -> the first refusal, or None."""
    for _ in range(frames):
        try:
            await session.append(audio=(bytes(FRAME), RATE))
        except sc.StreamserveClientError as e:
            return e
    return None


@pytest.mark.asyncio(loop_scope="module")
async def test_native_audio_past_the_connection_budget_is_refused_and_others_go_on(
        voiced: RunningServer, stt_held: threading.Event) -> None:
    service = voiced.server.service
    assert service is not None
    a, b = sc.connect(voiced.url, reconnect=False), sc.connect(voiced.url, reconnect=False)
    await a.connect()
    await b.connect()
    try:
        sa = await a.open_session(voice={"turn_detection": False})
        sb = await b.open_session(voice={"turn_detection": False})
        refused = await fill(sa, 200)  # 4 s of audio, far faster than it is transcribed (the thread is held)
        assert isinstance(refused, sc.CapacityError) and refused.code == "quota_exceeded", refused
        assert "--max-media-bytes-per-connection" in refused.message
        held_a = service.budget.held
        assert PER_CONNECTION - 2 * FRAME < held_a <= PER_CONNECTION
        assert await fill(sb, 5) is None  # another connection goes on
        assert (await sa.append(text="In the beginning")).tokens > 0  # and so does the refused one
        busy = await fill(sb, 200)  # b is within its own budget; the server's is full
        assert isinstance(busy, sc.CapacityError) and busy.code == "server_busy", busy
        assert GLOBAL - 2 * FRAME < service.budget.held <= GLOBAL
        await a.drop_connection()  # cut, sessions not closed, their Listeners still stuck behind the held thread
        await b.drop_connection()
        await until_released(voiced)  # the disconnects gave everything back all the same
    finally:
        stt_held.set()
        await a.close()
        await b.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_native_reply_audio_is_charged_to_the_connection(voiced: RunningServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from streamserve.server.media.voice import speak

    made: list[speak.Speaker] = []
    init = speak.Speaker.__init__

    def recording(self: speak.Speaker, *args: object, **kw: object) -> None:
        init(self, *args, **kw)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(speak.Speaker, "__init__", recording)
    async with sc.connect(voiced.url) as client:
        session = await client.open_session(voice={"turn_detection": False, "speak": True})
        await session.append(text="Once upon a time, there was")
        reply = session.respond(max_tokens=12, temperature=0.0)
        assert await asyncio.wait_for(reply.wait(), WAIT_S) in ("length", "stop")
    assert made and all(sp._held.account is not None for sp in made)  # the respond's connection's account
    await until_released(voiced)


@pytest.mark.asyncio(loop_scope="module")
async def test_realtime_audio_past_the_connection_budget_is_an_error_event(
        voiced: RunningServer, stt_held: threading.Event) -> None:
    import websockets

    async with websockets.connect(voiced.url + "/v1/realtime?model=default") as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": None}}}}))  # off: all audio is one utterance, held until transcribed
        assert json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))["type"] == "session.updated"
        step = 24000 * 2 // 10  # 100 ms at the session's default 24 kHz pcm16
        for i in range(40):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "event_id": f"a{i}",
                                      "audio": base64.b64encode(bytes(step)).decode()}))
        await ws.send(json.dumps({"type": "session.update", "event_id": "after",
                                  "session": {"type": "realtime", "instructions": "Be brief."}}))
        errors = []
        while True:  # the connection goes on: the update after the refusals is answered
            m = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
            if m["type"] == "error":
                errors.append(m["error"])
            if m["type"] == "session.updated":
                break
        assert errors and {e["code"] for e in errors} == {"quota_exceeded"}, errors
        assert all(e["event_id"].startswith("a") for e in errors)
    await until_released(voiced)


@pytest.mark.asyncio(loop_scope="module")
async def test_an_image_past_the_connection_budget_is_refused_and_given_back() -> None:
    pytest.importorskip("PIL.Image")
    from streamserve.media.vision import VISION_MODEL
    from streamserve.models.store import installed

    if installed(VISION_MODEL) is None:
        pytest.skip(f"the vision model is not in the model cache: run `streamserve models pull {VISION_MODEL}`")
    config = ServerConfig(messages_per_second=1000.0, max_media_bytes_per_connection=100_000)
    srv = await RunningServer.start(config, default_engine, vision=True)
    try:
        service = srv.server.service
        assert service is not None
        async with sc.connect(srv.url) as client:
            session = await client.open_session()
            rng = np.random.default_rng(0)
            with pytest.raises(sc.CapacityError) as refused:  # 120 kB held while it waits: over the 100 kB
                await session.append(image=rng.integers(0, 256, (200, 200, 3), dtype=np.uint8))
            assert refused.value.code == "quota_exceeded"
            ack = await session.append(image=rng.integers(0, 256, (100, 100, 3), dtype=np.uint8))  # 30 kB: fits
            assert ack.compute_ms > 0 and service.budget.held == 0  # labelled (noise: no note), given back
        await until_released(srv)
    finally:
        await srv.stop()
