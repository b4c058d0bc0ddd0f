"""The speech-to-text scheduler (server/media/voice/stt_scheduler.py) on a Whisper stand-in that records its batches:
passes of several streams in one batch, finals first, steps skipped under load, bounded, and a failing batch failing
its own passes only. The real Whisper's batches are tested in tests/media/test_whisper.py."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from streamserve.errors import CapacityError, InvalidInputError
from streamserve.media.whisper import PassRequest, Word
from streamserve.server.media.voice.stt_scheduler import SttScheduler

pytestmark = pytest.mark.asyncio


class Recording:
    """words_batch records each batch (the requests' tags, from their prompts) and may be held on a gate."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on: str | None = None

    def words_batch(self, requests: list[PassRequest], language: str = "en") -> list[list[Word]]:
        self.gate.wait(30)
        tags = [r.prompt or "" for r in requests]
        self.batches.append(tags)
        if self.fail_on in tags:
            raise RuntimeError("a bad batch")
        return [[Word(f" {t}", 0.0, 0.1)] for t in tags]

    def words(self, audio: np.ndarray, prompt: str | None = None, language: str = "en") -> list[Word]:
        return self.words_batch([PassRequest(audio, prompt)], language)[0]


def req(tag: str) -> PassRequest:
    return PassRequest(np.zeros(1600, np.float32), tag)


@pytest.fixture
def stt() -> Any:
    executor = ThreadPoolExecutor(1)
    whisper = Recording()
    scheduler = SttScheduler(whisper, executor, max_batch=3, max_waiting=6)
    yield scheduler, whisper
    scheduler.close()
    whisper.gate.set()
    executor.shutdown(wait=True)


async def test_passes_waiting_together_run_as_one_batch_finals_first(stt: Any) -> None:
    scheduler, whisper = stt
    whisper.gate.clear()  # the first pass holds the thread while the others queue up
    first = asyncio.ensure_future(scheduler.submit(req("a"), "step"))
    await asyncio.sleep(0.05)
    queued = [asyncio.ensure_future(scheduler.submit(req(t), k))
              for t, k in (("b", "speculative"), ("c", "final"), ("d", "final"), ("e", "final"))]
    await asyncio.sleep(0.05)
    assert scheduler.depth == 4
    whisper.gate.set()
    results = await asyncio.gather(first, *queued)
    # finals first in arrival order, then the speculative pass; at most max_batch (3) a batch
    assert whisper.batches == [["a"], ["c", "d", "e"], ["b"]]
    assert [r[0].text.strip() for r in results] == ["a", "b", "c", "d", "e"]
    assert scheduler.counts["final", "run"] == 3 and scheduler.depth == 0


async def test_a_step_waiting_when_urgent_passes_run_is_skipped(stt: Any) -> None:
    scheduler, whisper = stt
    whisper.gate.clear()
    running = asyncio.ensure_future(scheduler.submit(req("x"), "step"))
    await asyncio.sleep(0.05)
    step = asyncio.ensure_future(scheduler.submit(req("partial"), "step"))
    final = asyncio.ensure_future(scheduler.submit(req("final"), "final"))
    await asyncio.sleep(0.05)
    whisper.gate.set()
    assert await step is None  # skipped: the stream's next pass covers its audio
    assert (await final)[0].text == " final" and (await running)[0].text == " x"
    assert whisper.batches == [["x"], ["final"]]
    assert scheduler.counts["step", "skipped"] == 1
    # with nothing urgent waiting, steps run (batched)
    found = await asyncio.gather(*(scheduler.submit(req(t), "step") for t in ("p", "q")))
    assert [f[0].text for f in found] == [" p", " q"]


async def test_the_queue_is_bounded_and_kinds_are_checked(stt: Any) -> None:
    scheduler, whisper = stt
    whisper.gate.clear()
    running = asyncio.ensure_future(scheduler.submit(req("r"), "final"))
    await asyncio.sleep(0.05)
    waiting = [asyncio.ensure_future(scheduler.submit(req(str(i)), "final")) for i in range(6)]
    await asyncio.sleep(0.05)
    with pytest.raises(CapacityError):
        await scheduler.submit(req("one too many"), "final")
    with pytest.raises(InvalidInputError, match="final"):
        await scheduler.submit(req("?"), "partial")
    whisper.gate.set()
    assert len(await asyncio.gather(running, *waiting)) == 7 and scheduler.depth == 0


async def test_a_cancelled_pass_leaves_the_queue_and_a_failing_batch_fails_only_itself(stt: Any) -> None:
    scheduler, whisper = stt
    whisper.gate.clear()
    running = asyncio.ensure_future(scheduler.submit(req("r"), "final"))
    await asyncio.sleep(0.05)
    gone = asyncio.ensure_future(scheduler.submit(req("gone"), "final"))
    await asyncio.sleep(0.05)
    gone.cancel()
    await asyncio.sleep(0.05)
    assert scheduler.depth == 0
    whisper.fail_on = "bad"
    bad = asyncio.ensure_future(scheduler.submit(req("bad"), "final"))
    whisper.gate.set()
    await running
    with pytest.raises(RuntimeError, match="bad batch"):
        await bad
    assert (await scheduler.submit(req("after"), "final"))[0].text == " after"  # the scheduler goes on
    assert all("gone" not in b for b in whisper.batches)


async def test_steps_wait_for_spare_capacity_and_urgent_passes_do_not() -> None:
    executor, whisper = ThreadPoolExecutor(1), Recording()
    spare = threading.Event()  # the runtime's "no speech is being synthesised"
    scheduler = SttScheduler(whisper, executor, spare=spare.is_set)
    try:
        step = asyncio.ensure_future(scheduler.submit(req("partial"), "step"))
        final = await scheduler.submit(req("final"), "final")  # not held back
        assert final[0].text == " final" and whisper.batches == [["final"]]
        assert await step is None  # skipped by the final's round: its stream's next pass covers the audio
        later = asyncio.ensure_future(scheduler.submit(req("later"), "step"))
        await asyncio.sleep(0.1)
        assert not later.done()  # still no spare capacity
        spare.set()
        assert (await later)[0].text == " later"
    finally:
        scheduler.close()
        executor.shutdown(wait=True)


async def test_a_streams_held_step_is_skipped_when_it_has_other_work_and_steps_keep_their_share() -> None:
    executor, whisper = ThreadPoolExecutor(1), Recording()
    scheduler = SttScheduler(whisper, executor, step_share=0.01)
    try:
        whisper.gate.clear()
        first = asyncio.ensure_future(scheduler.submit(req("first"), "step"))
        await asyncio.sleep(0.05)
        whisper.gate.set()
        await first  # a step round of >= 50 ms: no step round for 99 times as long
        mine, other = object(), object()
        held = asyncio.ensure_future(scheduler.submit(req("mine"), "step", owner=mine))
        theirs = asyncio.ensure_future(scheduler.submit(req("theirs"), "step", owner=other))
        await asyncio.sleep(0.1)
        assert not held.done() and not theirs.done() and whisper.batches == [["first"]]
        scheduler.skip_steps(mine)  # its stream went silent: the urgent pass it makes next must not wait
        assert await held is None and not theirs.done()
        assert scheduler.counts["step", "skipped"] == 1
        with pytest.raises(InvalidInputError, match="step_share"):
            SttScheduler(whisper, executor, step_share=0.0)
    finally:
        scheduler.close()
        executor.shutdown(wait=True)
