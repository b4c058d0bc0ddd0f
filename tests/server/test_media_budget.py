"""Media byte budgets (server/media_budget.py): the global budget and per-connection accounts on their own
(acquire/release, which limit refuses, release on close, threads), the Realtime inbox's audio frames, and through
a real server on loopback: audio sent faster than it is transcribed is refused with the typed code while another
connection goes on, the server's budget refuses with server_busy, and after disconnects nothing is held.

The server tests need the voice extra and models (they skip naming them otherwise). They hold the speech-to-text
thread with a gate, so the backlog cannot drain while they fill it: no timing is assumed.
"""

from __future__ import annotations

import asyncio
import base64
import gc
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
from streamserve.server import media_budget as M
from streamserve.server.realtime.events import RealtimeError
from streamserve.server.realtime.inbox import Inbox

PER_CONNECTION = 64_000  # 1 s of 16 kHz float32 (what the Listener's backlog holds)
GLOBAL = 100_000
RATE = 16000
FRAME = 2 * RATE // 50  # 20 ms of pcm16 at 16 kHz: 640 bytes in, 1280 bytes held
WAIT_S = 60  # a hang guard only


class Owner:
    """Stands for a connection's ClientContext (weakly referenced by the budget)."""

    gone = False


# ---- the budget on its own ---------------------------------------------------------------------------------
def test_acquire_release_and_which_limit_refuses() -> None:
    budget = M.MediaBudget(max_bytes=1000, max_bytes_per_connection=600)
    a, b = Owner(), Owner()
    acct_a, acct_b = budget.account(a), budget.account(b)
    assert budget.account(a) is acct_a and budget.accounts == 2
    acct_a.acquire(500)
    with pytest.raises(M.MediaQuotaError) as own:  # a's own limit
        acct_a.acquire(101)
    assert own.value.code == "quota_exceeded" and "--max-media-bytes-per-connection" in str(own.value)
    assert (acct_a.held, budget.held) == (500, 500)  # nothing taken by the refusal
    acct_b.acquire(500)
    with pytest.raises(M.MediaBusyError) as busy:  # b is within its own limit, the server is not
        acct_b.acquire(1)
    assert busy.value.code == "server_busy" and "--max-media-bytes" in str(busy.value)
    assert budget.refused == {"server_busy": 1, "quota_exceeded": 1}
    acct_a.release(200)
    acct_b.acquire(100)  # room again
    acct_b.release(10_000)  # never more than it holds
    assert (acct_a.held, acct_b.held, budget.held) == (300, 0, 300)


def test_metrics_show_the_bytes_held_and_the_refusals() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    budget = M.MediaBudget(1000, 600)
    registry = CollectorRegistry()
    budget.metrics(registry)
    acct = budget.account(owner := Owner())
    acct.acquire(500)
    with pytest.raises(M.MediaQuotaError):
        acct.acquire(200)
    text = generate_latest(registry).decode()
    assert "streamserve_media_bytes_held 500.0" in text and "streamserve_media_bytes_limit 1000.0" in text
    assert 'streamserve_media_refused_total{code="quota_exceeded"} 1.0' in text
    budget.close(owner)
    assert "streamserve_media_bytes_held 0.0" in generate_latest(registry).decode()


def test_close_gives_everything_back_and_later_calls_are_no_ops() -> None:
    budget = M.MediaBudget(1000, 1000)
    owner = Owner()
    acct = budget.account(owner)
    acct.acquire(700)
    budget.close(owner)
    assert budget.held == 0 and acct.held == 0 and budget.accounts == 0
    acct.release(700)  # a buffer stopping after its connection ended
    acct.acquire(900)
    acct.take(900)
    assert budget.held == 0
    owner.gone = True  # a connection already gone gets a closed account: it can hold nothing
    late = budget.account(owner)
    late.acquire(10)
    assert late.closed and budget.held == 0


def test_an_owner_collected_without_close_gives_its_bytes_back() -> None:
    budget = M.MediaBudget(1000, 1000)
    owner = Owner()
    budget.account(owner).acquire(400)
    del owner
    gc.collect()
    assert budget.held == 0 and budget.accounts == 0


def test_holding_admits_settles_moves_and_drops() -> None:
    budget = M.MediaBudget(1000, 500)
    a, b = Owner(), Owner()
    held = M.Holding(budget.account(a), "audio")
    held.admit(300)
    with pytest.raises(M.MediaQuotaError):
        held.admit(300)
    assert held.bytes == 300
    held.settle(450)  # admitted work turned out larger: taken without a check
    held.settle(100)  # consumed
    assert (held.bytes, budget.account(a).held) == (100, 100)
    held.move(budget.account(b))
    assert (budget.account(a).held, budget.account(b).held, budget.held) == (0, 100, 100)
    held.drop()
    assert budget.held == 0
    free = M.Holding(None)  # no account: counted, never refused
    free.admit(10**9)
    assert free.bytes == 10**9


def test_charging_sets_the_current_account_for_a_block() -> None:
    budget = M.MediaBudget(1000, 1000)
    owner = Owner()
    acct = budget.account(owner)
    assert M.current() is None
    with M.charging(acct):
        assert M.current() is acct
        with M.charging(None):  # nested blocks restore the outer one
            assert M.current() is None
        assert M.current() is acct
    assert M.current() is None


def test_threads_never_pass_the_limits_and_end_at_zero() -> None:
    budget = M.MediaBudget(max_bytes=50_000, max_bytes_per_connection=20_000)
    owners = [Owner() for _ in range(4)]
    accounts = [budget.account(o) for o in owners]
    over: list[int] = []

    def work(acct: M.MediaAccount, seed: int) -> None:
        rng = np.random.default_rng(seed)
        mine: list[int] = []
        for _ in range(3000):
            if mine and rng.random() < 0.5:
                acct.release(mine.pop())
                continue
            n = int(rng.integers(1, 4000))
            try:
                acct.acquire(n)
            except (M.MediaQuotaError, M.MediaBusyError):
                continue
            mine.append(n)
            if budget.held > budget.max_bytes or acct.held > budget.max_per_connection:
                over.append(budget.held)
        for n in mine:
            acct.release(n)

    threads = [threading.Thread(target=work, args=(accounts[i % 4], i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not over
    assert budget.held == 0 and all(a.held == 0 for a in accounts)
    assert budget.refused["server_busy"] + budget.refused["quota_exceeded"] > 0  # the limits were reached


# ---- the Realtime inbox's audio frames ------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_inbox_refuses_audio_frames_past_the_account_and_gives_them_back() -> None:
    from streamserve.server.realtime.events import parse

    budget = M.MediaBudget(1_000_000, 3_000)
    owner = Owner()
    refused: list[RealtimeError] = []

    async def refuse(e: RealtimeError) -> None:
        refused.append(e)

    def frame(i: int) -> str:
        return json.dumps({"type": "input_audio_buffer.append", "event_id": f"a{i}",
                           "audio": base64.b64encode(bytes(960)).decode()})  # ~1.4 kB a frame

    async def frames() -> AsyncIterator[str]:
        for i in range(4):
            yield frame(i)

    inbox = Inbox(lambda f: parse(f, 1 << 20), lambda ev: 20.0, 60_000.0, refuse, account=budget.account(owner))
    await inbox.read(frames())
    assert [e.code for e in refused] == ["quota_exceeded", "quota_exceeded"]  # two fit in 3 kB
    assert [e.event_id for e in refused] == ["a2", "a3"] and budget.held == inbox.media.bytes > 0
    handled = [w.event.event_id async for w in inbox if w.event is not None]
    assert handled == ["a0", "a1"] and budget.held == 0


# ---- reply audio synthesised and not yet sent ------------------------------------------------------------------
class FakeVoice:
    sample_rate = 16000

    def synthesize(self, text: str) -> np.ndarray:
        return np.zeros(1600 * len(text.split()), np.float32)  # 100 ms a word: [n] at 16 kHz


class FakeRuntime:
    voice = FakeVoice()

    async def run(self, fn, *args):  # type: ignore[no-untyped-def]
        return fn(*args)


@pytest.mark.asyncio
async def test_speaker_holds_its_unsent_audio_on_the_account_until_emitted_or_cancelled() -> None:
    from streamserve.media.audio import AudioFormat
    from streamserve.server.voice.speak import Speaker

    budget = M.MediaBudget(10**6, 10**6)
    owner = Owner()
    gate, emitted = asyncio.Event(), []

    async def emit(chunk: bytes) -> None:  # a client that reads only when the gate opens
        await gate.wait()
        emitted.append(chunk)

    fmt = AudioFormat("pcm16", 16000)
    sp = Speaker(FakeRuntime(), fmt, emit, budget.account(owner))  # type: ignore[arg-type]
    sp.feed("One two three four. Five six seven. ")
    for _ in range(100):  # the synthesis runs on the loop here: a few turns of it
        if budget.held >= 2 * 3200 * 3:
            break
        await asyncio.sleep(0)
    assert budget.held >= 2 * 3200 * 3  # at least two pieces waiting, 100 ms (3200 B of pcm16) a word
    gate.set()
    await sp.finish()
    assert sum(map(len, emitted)) == 3200 * 7 and budget.held == 0
    gate.clear()
    sp2 = Speaker(FakeRuntime(), fmt, emit, budget.account(owner))  # type: ignore[arg-type]
    sp2.feed("Eight nine ten. Eleven twelve. ")
    for _ in range(100):
        if budget.held > 0:
            break
        await asyncio.sleep(0)
    assert budget.held > 0
    sp2.cancel()  # barge-in: its audio is dropped, and so is what it held
    await sp2.wait_idle()
    assert budget.held == 0


# ---- a WebRTC call's microphone --------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_call_microphone_refusals_are_dropped_and_told_once_per_run() -> None:
    import fractions

    av = pytest.importorskip("av")
    pytest.importorskip("aiortc")
    from aiortc.mediastreams import MediaStreamError

    from streamserve.server.webrtc.tracks import MicDrain

    class Track:
        def __init__(self) -> None:
            self.frames: asyncio.Queue = asyncio.Queue()

        async def recv(self):  # type: ignore[no-untyped-def]
            frame = await self.frames.get()
            if frame is None:
                raise MediaStreamError
            return frame

    def frame(i: int):  # type: ignore[no-untyped-def]
        f = av.AudioFrame(format="s16", layout="mono", samples=960)  # 20 ms at 48 kHz
        f.planes[0].update(bytes(1920))
        f.sample_rate, f.pts, f.time_base = 48000, 960 * i, fractions.Fraction(1, 48000)
        return f

    budget = M.MediaBudget(10**6, 1)
    owner = Owner()
    answers = ["refuse", "refuse", "accept", "refuse"]
    fed, told = asyncio.Queue(), []

    async def sink(data: bytes) -> None:
        answer = answers.pop(0)
        fed.put_nowait(answer)
        if answer == "refuse":
            budget.account(owner).acquire(len(data), "audio")  # over the 1-byte budget: MediaQuotaError

    async def refused(e: Exception) -> None:
        told.append(e)

    track = Track()
    mic = MicDrain(track, sink, refused)  # type: ignore[arg-type]
    for i in range(4):  # one frame at a time: each is one feed
        track.frames.put_nowait(frame(i))
        await asyncio.wait_for(fed.get(), WAIT_S)
    track.frames.put_nowait(None)
    await mic.close()
    assert mic.dropped == 3 and budget.held == 0
    assert [getattr(e, "code", None) for e in told] == ["quota_exceeded", "quota_exceeded"]  # the runs: 2 and 1


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
    from streamserve.server.voice import speak

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
