"""One speech-to-text scheduler for every stream of a server: Whisper passes batched and ordered by urgency.

    words = await scheduler.submit(request, kind)    # None: a step pass skipped under load

Kinds, most urgent first:
    final        the end of an utterance: a turn waits for it
    speculative  the pass at the first silence (server/media/voice/listen.py): the likely final, a turn may wait for it
    step         a partial transcript while the person speaks: nothing waits for it
Each round runs, as one batch on the speech-to-text thread (Whisper.words_batch: one encoder forward per window
length, one batched decode), every waiting final and speculative pass, up to `max_batch`; only when none waits, up
to `max_batch` step passes. A step still waiting when a round of urgent passes starts is skipped (None): the
stream's next pass covers its audio again, so under load partial transcripts get sparser and no final pass waits
behind another stream's partial (at most behind the one batch already running). Passes of different languages run
in different batches.

Steps use only spare capacity. The speech-to-text thread being free does not mean the cores are: replies are
decoded and synthesised beside it. So step rounds wait while `spare()` says no (the runtime: while text to speech
has work) and take at most `step_share` of the time (after a step round of d seconds, the next starts no sooner
than d * (1 / step_share - 1) later). A waiting step is skipped as soon as its stream has something else to do
(`skip_steps`: the first silence, a stop), so a stream's urgent pass never waits behind its own held-back step.
With eight people talking on two cores, partials ran back to back on both cores and every reply waited for them.

Bounded: a Listener has at most one pass in flight, and at most `max_waiting` passes wait here; past that, submit
raises CapacityError. The counts and times are on /metrics when metrics() registered them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamserve.errors import CapacityError, InvalidInputError

if TYPE_CHECKING:
    from streamserve.media.stt import StreamingTranscriber, TranscriptUpdate

log = logging.getLogger("streamserve.voice")

KINDS = ("final", "speculative", "step")  # most urgent first
URGENT = ("final", "speculative")
STEP_RECHECK_S = 0.02  # how often held-back steps look for spare capacity again


@dataclass(eq=False)  # compared by identity (a request's audio is an array)
class _Pass:
    request: Any  # streamserve.media.whisper.PassRequest
    kind: str
    language: str
    future: asyncio.Future[Any]
    owner: object = None  # the stream that asked (skip_steps)
    queued_at: float = field(default_factory=time.perf_counter)


class SttScheduler:
    def __init__(self, whisper: Any, executor: Executor, max_batch: int = 8, max_waiting: int = 1024,
                 spare: Callable[[], bool] | None = None, step_share: float = 0.5) -> None:
        if not 0.0 < step_share <= 1.0:
            raise InvalidInputError(f"step_share is a fraction of the time in (0, 1], not {step_share}")
        self.whisper, self.executor = whisper, executor
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.spare, self.step_share = spare or (lambda: True), step_share
        self._steps_after = 0.0  # perf_counter time before which no step round starts (the share)
        self._waiting: list[_Pass] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counts = {(kind, outcome): 0 for kind in KINDS for outcome in ("run", "skipped")}
        self._metrics: tuple[Any, Any, Any] | None = None  # passes, latency, batch size

    @property
    def depth(self) -> int:
        """Passes waiting (not the batch running)."""
        return len(self._waiting)

    def metrics(self, registry: Any) -> None:
        """Register on `registry` (the engine's, served on /metrics): the queue depth, passes run and skipped by
        kind, each pass's latency (queued to done) by kind, and the batch sizes."""
        from prometheus_client import Counter, Gauge, Histogram

        Gauge("streamserve_stt_queue_depth", "Speech-to-text passes waiting for the STT thread",
              registry=registry).set_function(lambda: self.depth)
        passes = Counter("streamserve_stt_passes", "Speech-to-text passes by kind (final, speculative, step) and "
                         "outcome (run; skipped: a step under load)", ["kind", "outcome"], registry=registry)
        latency = Histogram("streamserve_stt_pass_seconds", "A speech-to-text pass from queued to done, by kind",
                            ["kind"], registry=registry,
                            buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0))
        batch = Histogram("streamserve_stt_batch_size", "Passes run together in one speech-to-text batch",
                          registry=registry, buckets=(1, 2, 3, 4, 6, 8, 12, 16))
        self._metrics = (passes, latency, batch)

    async def submit(self, request: Any, kind: str, language: str = "en", owner: object = None) -> list[Any] | None:
        """The words of `request`'s pass, once a batch ran it; None when a step was skipped under load (or by
        skip_steps(owner))."""
        if kind not in KINDS:
            raise InvalidInputError(f"a speech-to-text pass is one of {', '.join(KINDS)}, not {kind!r}")
        if len(self._waiting) >= self.max_waiting:
            raise CapacityError(f"{len(self._waiting)} speech-to-text passes are waiting: the server is too busy")
        self._ensure_worker()
        assert self._wake is not None
        item = _Pass(request, kind, language, asyncio.get_running_loop().create_future(), owner)
        self._waiting.append(item)
        self._wake.set()
        try:
            return await asyncio.shield(item.future)
        except asyncio.CancelledError:
            if item in self._waiting:  # not started: nothing runs it now
                self._waiting.remove(item)
            raise

    def skip_steps(self, owner: object) -> None:
        """Settle `owner`'s waiting step passes with None (its stream has other work: its next pass covers them)."""
        for p in [p for p in self._waiting if p.kind == "step" and p.owner is owner]:
            self._settle(p, None, "skipped")
        self._waiting = [p for p in self._waiting if not p.future.done()]

    async def step(self, transcriber: StreamingTranscriber, urgent: bool) -> TranscriptUpdate | None:
        """transcriber.step() through the scheduler, as a speculative pass when `urgent`, else a step; None when
        the step was skipped under load (the transcriber is as before: its next pass covers the audio)."""
        request = transcriber.step_request()
        if request is None:
            return transcriber.apply_step(None)
        words = await self.submit(request, "speculative" if urgent else "step", transcriber.language, transcriber)
        return None if words is None else transcriber.apply_step(words)

    async def finish(self, transcriber: StreamingTranscriber) -> TranscriptUpdate:
        """transcriber.finish() through the scheduler, as a final pass."""
        request = transcriber.finish_request()
        words = None if request is None else await self.submit(request, "final", transcriber.language)
        return transcriber.apply_finish(words)

    def _ensure_worker(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            # a new event loop (a server started again in the same process): passes of the old one are orphans
            self._waiting = [p for p in self._waiting if p.future.get_loop() is loop]
            self._loop, self._wake = loop, asyncio.Event()
            self._task = loop.create_task(self._work(), name="streamserve-stt-scheduler")

    def _next_batch(self) -> list[_Pass]:
        """The next round's passes (removed from the queue); the steps it skips are settled with None."""
        urgent = [p for p in self._waiting if p.kind in URGENT]
        if urgent:
            urgent.sort(key=lambda p: (KINDS.index(p.kind), p.queued_at))
            language = urgent[0].language
            chosen = [p for p in urgent if p.language == language][:self.max_batch]
            for p in [p for p in self._waiting if p.kind == "step"]:
                self._settle(p, None, "skipped")
        else:
            language = self._waiting[0].language
            chosen = [p for p in self._waiting if p.language == language][:self.max_batch]
        self._waiting = [p for p in self._waiting if p not in chosen and not p.future.done()]
        return chosen

    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            if not any(p.kind in URGENT for p in self._waiting) and not self._steps_may_run():
                self._wake.clear()  # steps wait for spare capacity; an urgent pass or skip_steps wakes us
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), STEP_RECHECK_S)
                continue
            batch: list[_Pass] = []
            try:
                batch = self._next_batch()
                if not batch:
                    continue
                began = time.perf_counter()
                found = await asyncio.get_running_loop().run_in_executor(
                    self.executor, self._run, [p.request for p in batch], batch[0].language)
                if batch[0].kind == "step":
                    took = time.perf_counter() - began
                    self._steps_after = time.perf_counter() + took * (1.0 / self.step_share - 1.0)
            except Exception as e:  # one bad batch fails its passes only; the scheduler goes on
                log.exception("streamserve: a speech-to-text batch failed")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            for p, words in zip(batch, found, strict=True):
                self._settle(p, words, "run")
            if self._metrics is not None:
                self._metrics[2].observe(len(batch))

    def _steps_may_run(self) -> bool:
        """Whether a round of step passes may start now: the share allows it and the cores are spare."""
        return time.perf_counter() >= self._steps_after and self.spare()

    def _run(self, requests: Sequence[Any], language: str) -> list[list[Any]]:
        """On the speech-to-text thread: one batch (a Whisper without words_batch runs its passes one by one)."""
        batched = getattr(self.whisper, "words_batch", None)
        if batched is not None and len(requests) > 1:
            return batched(requests, language)
        return [self.whisper.words(r.audio, r.prompt, language) for r in requests]

    def _settle(self, p: _Pass, words: list[Any] | None, outcome: str) -> None:
        self.counts[p.kind, outcome] += 1
        if self._metrics is not None:
            self._metrics[0].labels(p.kind, outcome).inc()
            if outcome == "run":
                self._metrics[1].labels(p.kind).observe(time.perf_counter() - p.queued_at)
        if not p.future.done() and not p.future.get_loop().is_closed():  # the waiter may be gone with its loop
            p.future.set_result(words)

    def close(self) -> None:
        for p in self._waiting:
            if not p.future.done():
                p.future.cancel()
        self._waiting.clear()
        if self._task is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)
