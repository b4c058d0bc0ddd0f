"""Text to speech's scheduler (server/media/voice/deadlines.py): jobs start earliest deadline first, at most `workers`
at once; a job withdrawn before it starts never runs; a failing job fails only its own future. And two Speakers on one
runtime: a reply's first piece is synthesised before another reply's later pieces that were queued first."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from voice_assets import needs

from streamserve.server.media.voice.deadlines import DeadlineRunner

pytestmark = pytest.mark.asyncio


@pytest.fixture
def pool() -> Any:
    executor = ThreadPoolExecutor(2)
    yield executor
    executor.shutdown(wait=True)


async def test_earliest_deadline_first_and_at_most_workers_at_once(pool: ThreadPoolExecutor) -> None:
    runner = DeadlineRunner(pool, workers=1)
    gate, ran, lock = threading.Event(), [], threading.Lock()
    running = {"now": 0, "most": 0}

    def job(name: str) -> str:
        with lock:
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
        gate.wait(10)
        with lock:
            ran.append(name)
            running["now"] -= 1
        return name

    first = runner.submit(0.0, job, "holder")  # takes the only worker
    later = [runner.submit(d, job, n) for d, n in ((5.0, "late"), (1.0, "soon"), (1.0, "soon2"), (3.0, "mid"))]
    gone = runner.submit(2.0, job, "withdrawn")
    await asyncio.sleep(0.05)
    assert runner.depth == 5
    runner.withdraw(gone)
    gate.set()
    assert await asyncio.gather(first, *later) == ["holder", "late", "soon", "soon2", "mid"]
    assert ran == ["holder", "soon", "soon2", "mid", "late"] and running["most"] == 1
    assert gone.cancelled() and runner.started == 5 and runner.depth == 0


async def test_a_failing_job_fails_its_own_future_only(pool: ThreadPoolExecutor) -> None:
    runner = DeadlineRunner(pool, workers=2)

    def boom() -> None:
        raise ValueError("bad piece")

    bad, good = runner.submit(0.0, boom), runner.submit(0.0, lambda: "fine")
    with pytest.raises(ValueError, match="bad piece"):
        await bad
    assert await good == "fine"
    runner.withdraw(good)  # already done: nothing happens
    assert await runner.submit(0.0, lambda: 7) == 7


async def test_a_first_piece_overtakes_another_reply_s_later_piece() -> None:
    """Reply A's client reads slowly (its first piece is synthesised, not yet played); while the one worker is busy,
    A's second piece and then reply B's first piece wait: B's is due now, A's only once A's audio has played."""
    needs("soxr")
    from test_voice_speak_races import FakeRuntime, fmt

    from streamserve.server.media.voice.speak import Speaker

    runtime = FakeRuntime()  # one worker
    said: list[str] = []
    tone = runtime.voice.synthesize
    runtime.voice.synthesize = lambda text: (said.append(text), tone(text))[1]  # type: ignore[method-assign]
    reading = asyncio.Event()

    async def slow(data: bytes) -> None:
        await reading.wait()

    async def fast(data: bytes) -> None:
        return None

    a = Speaker(runtime, fmt(), slow)  # type: ignore[arg-type]
    a.feed("First. ")
    for _ in range(100):  # until A's first piece is synthesised (its emission then waits for the client)
        if said:
            break
        await asyncio.sleep(0.01)
    gate = threading.Event()
    busy = runtime.tts.submit(0.0, gate.wait, 10)  # the worker is taken
    a.feed("Second one. ")
    b = Speaker(runtime, fmt(), fast)  # type: ignore[arg-type]
    b.feed("Hello. ")
    await asyncio.sleep(0.05)
    assert runtime.tts.depth == 2
    gate.set()
    await busy
    await asyncio.wait_for(b.finish(), 20)
    reading.set()
    await asyncio.wait_for(a.finish(), 20)
    assert said == ["First.", "Hello.", "Second one."]
