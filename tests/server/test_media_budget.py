"""Media byte budgets (server/media/media_budget.py): the global budget and per-connection accounts on their own
(acquire/release, which limit refuses, release on close, threads), the Realtime inbox's audio frames, and through
the Speaker's unsent audio and a WebRTC call's microphone. Through a real server: test_media_budget_server.py.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import gc
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from streamserve.server.adapters.realtime.events import RealtimeError
from streamserve.server.adapters.realtime.inbox import Inbox
from streamserve.server.media import media_budget as M
from streamserve.server.media.voice.deadlines import DeadlineRunner

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
    from streamserve.server.adapters.realtime.events import parse

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


class InlineExecutor(concurrent.futures.Executor):
    """Runs each job at once in the caller (the loop here), so the synthesis needs only a few turns of the loop."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as e:
            done.set_exception(e)
        return done


class FakeRuntime:
    voice = FakeVoice()
    tts = DeadlineRunner(InlineExecutor(), 1)

    async def run(self, fn, *args):  # type: ignore[no-untyped-def]
        return fn(*args)


@pytest.mark.asyncio
async def test_speaker_holds_its_unsent_audio_on_the_account_until_emitted_or_cancelled() -> None:
    from streamserve.media.audio import AudioFormat
    from streamserve.server.media.voice.speak import Speaker

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

    from streamserve.server.adapters.webrtc.tracks import MicDrain

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
