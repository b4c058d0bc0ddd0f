"""The Listener: one audio stream in -> turn events and transcript text out (protocol-neutral).

    append(bytes) --decode + resample to 16 kHz + VAD (per-frame thread)--> work queue --worker--> emit(event)

`append` does the cheap part on the runtime's per-frame thread (decode, resampling, Silero VAD; a few ms per 20 ms
frame, never behind a Whisper pass); ONE worker task per stream submits its Whisper passes to the runtime's STT
scheduler (batched with other streams', finals first; a partial may be skipped under load), one at a time, only
when the transcriber is `ready()` and nothing is queued: a slow machine transcribes less often, never falls further
behind. SpeechStopped goes out from `append` as soon as the VAD ends the turn (not behind a pass, whose words then
go in the final delta). The end of speech is transcribed speculatively: when the VAD first scores silence during
speech (TurnDetector.silent_since_ms), the worker runs a pass over the utterance so far at once and holds back the
audio after it. If the stop follows, that audio was the VAD's hangover and is dropped, so finish() needs no pass;
if speech resumes, the held audio goes to the transcriber. When that pass's words look complete, `TurnLikely` goes
out (a reply may start, held back: server/media/voice/speculate.py), then `TurnResumed` if speech resumes after all.
What is queued or not yet transcribed is bounded: past `max_buffer_s` seconds of it, `append` refuses audio
(`audio_buffer_full`); its bytes (16 kHz float32: 64 kB a second) count against the connection's media account
(server/media/media_budget.py): past its or the server's budget an append is refused (`quota_exceeded`, `server_busy`).
Events (server/media/voice/listen_events.py, importable from here too), in order for one utterance:
    SpeechStarted, (TranscriptDelta | TranscriptPartial | TurnLikely | TurnResumed)*, SpeechStopped,
    TranscriptDelta?, TranscriptDone            (TurnResumed follows a TurnLikely, before any other event)
With turn detection off there are no speech events: all audio is one utterance until `commit()`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from streamserve.media.turns import turn_state
from streamserve.server.media import media_budget
from streamserve.server.media.voice.listen_events import (
    AudioBufferFullError,
    ListenerClosedError,
    ListenEvent,
    SpeechStarted,
    SpeechStopped,
    TranscriptDelta,
    TranscriptDone,
    TranscriptPartial,
    TurnLikely,
    TurnResumed,
    Work,
)

if TYPE_CHECKING:
    from streamserve.media.audio import AudioFormat, AudioInput
    from streamserve.media.stt import StreamingTranscriber
    from streamserve.media.vad import TurnDetector, VADConfig
    from streamserve.server.media.media_budget import MediaAccount
    from streamserve.server.media.voice.runtime import VoiceRuntime

log = logging.getLogger("streamserve.voice")

RATE = 16000  # what VAD and Whisper take
SAMPLE_BYTES = 4  # float32: what the backlog holds, per 16 kHz sample
_UNSET: Any = object()


class Listener:
    def __init__(self, runtime: VoiceRuntime, fmt: AudioFormat, turn_detection: VADConfig | None,
                 emit: Callable[[ListenEvent], Awaitable[None]], *, max_buffer_s: float = 30.0,
                 language: str = "en", account: MediaAccount | None = None) -> None:
        from streamserve.media.stt import StreamingTranscriber

        self.runtime, self.emit, self.max_buffer_s = runtime, emit, max_buffer_s
        self.fmt = fmt.check()
        self.audio_ms = 0.0  # the stream's audio clock: ms of input received
        self._input = self._make_input(self.fmt)
        self.turn_detection = turn_detection
        self._detector = self._make_detector(turn_detection)
        self._stt: StreamingTranscriber = StreamingTranscriber(runtime.whisper, language=language)
        self._lock = asyncio.Lock()  # one append (decode + VAD) at a time: the audio stays in order
        self._queue: collections.deque[Work] = collections.deque()
        self._wake = asyncio.Event()
        self._epoch = 0  # bumped by clear(): queued work and results of older epochs are dropped
        self._queued_s = 0.0  # audio waiting in the queue
        self._untranscribed_s = 0.0  # audio in the transcriber that no pass has covered yet
        self._utterance_start: int | None = None  # ms, while an utterance is open
        self._fed_ms = 0.0  # ms of 16 kHz audio produced (turn detection off: the utterance clock)
        self._clock_offset = 0.0  # ms of audio fed before the current detector (its clock starts at 0)
        self._utterance_open, self._start_ms = False, 0  # the worker's view: the transcriber holds an utterance, from
        self._silent_hint: float | None = None  # the detector's silent_since_ms last told to the worker
        self._silent_ms: int | None = None  # the worker's view: a trailing silence began here (ms), audio held
        self._held: list[np.ndarray] = []  # audio after a "silence" hint, [k] each; to the transcriber on resume
        self._n = self._open_n = 0  # utterances started (append's count); the one whose start the worker sent
        self._likely = False  # a TurnLikely of the open utterance went out (a TurnResumed may follow)
        self._stop_said = False  # SpeechStopped of the worker's utterance already sent: its pass's words wait
        self._deferred = ""  # ... here, for the final delta (events stay S (d|p)* E d? F)
        self._closed = False
        self._last: asyncio.Future[Any] | None = None  # the latest decode + VAD on the executor
        # the backlog's bytes on the connection's media account (the one given, or the append's: media_budget.py)
        self._holding = media_budget.Holding(account or media_budget.current(), "audio")
        self._admitted = 0  # bytes admitted by appends still decoding (not in the backlog yet)
        self._worker = asyncio.create_task(self._work(), name="streamserve-listener")

    # ---- configuration ---------------------------------------------------------------------------------
    def _make_input(self, fmt: AudioFormat) -> AudioInput:
        from streamserve.media.audio import AudioInput

        return AudioInput(fmt, RATE)

    def _make_detector(self, config: VADConfig | None) -> TurnDetector | None:
        from streamserve.media.vad import TurnDetector

        return None if config is None else TurnDetector(self.runtime.vad, config.check())

    def configure(self, fmt: AudioFormat | None = None, turn_detection: VADConfig | None = _UNSET) -> None:
        """A new input format (the resampler starts afresh) and/or turn detection (None: off). Changing turn
        detection starts a fresh detector; an utterance in progress goes on until commit() or the next stop."""
        if fmt is not None and fmt != self.fmt:
            self.fmt = fmt.check()
            self._input = self._make_input(self.fmt)
        if turn_detection is not _UNSET and turn_detection != self.turn_detection:
            self._detector = self._make_detector(turn_detection)
            self.turn_detection = turn_detection
            if turn_detection is not None and self._detector is not None:  # the new detector's clock starts now
                self._clock_offset = self._fed_ms

    @property
    def speaking(self) -> bool:
        return self._utterance_start is not None

    @property
    def backlog_s(self) -> float:
        """Seconds of audio received and not yet covered by a transcription pass."""
        return self._queued_s + self._untranscribed_s + sum(map(len, self._held)) / RATE

    # ---- input -----------------------------------------------------------------------------------------
    async def append(self, data: bytes) -> None:
        """Audio in the stream's format. AudioFormatError for partial frames; AudioBufferFullError when more than
        max_buffer_s of audio waits for transcription (send more slowly, or commit)."""
        self._check_open()
        ms = self.fmt.duration_ms(len(data))
        if self.backlog_s + ms / 1e3 > self.max_buffer_s:
            raise AudioBufferFullError(f"{self.backlog_s:.1f} s of this stream's audio is still waiting to be "
                                       f"transcribed (limit {self.max_buffer_s:g} s): send audio at real-time pace "
                                       "or commit the utterance")
        if (account := media_budget.current()) is not None:  # the append's connection (another after a resume)
            self._holding.move(account)
        need = round(ms * RATE / 1e3) * SAMPLE_BYTES
        self._holding.admit(need)  # MediaQuotaError / MediaBusyError: refused, nothing taken
        self._admitted += need
        try:
            async with self._lock:
                self._check_open()
                if self._last is not None:  # an append cancelled mid-way: its decode may still run on the executor
                    await asyncio.wait({self._last})
                fut = self._last = asyncio.ensure_future(self.runtime.run_light(self._process, data))
                x, events = await asyncio.shield(fut)
                if self._closed:
                    return
                self.audio_ms += ms
                for event in self._route(x, events):
                    await self._send(event, self._epoch)
        finally:
            self._admitted -= need
            self._settle_bytes()

    def _process(self, data: bytes) -> tuple[np.ndarray, list[Any]]:
        """On the per-frame thread: bytes -> [n] float32 at 16 kHz, and the VAD's events over them."""
        x = self._input.feed(data)
        events = self._detector.feed(x) if self._detector is not None else []
        return x, events

    def _route(self, x: np.ndarray, events: list[Any]) -> list[ListenEvent]:
        """Queue the utterance's audio and the turn events of one append, in order; -> the events to send now: a
        SpeechStopped when the worker is on its utterance (so it never waits behind a Whisper pass)."""
        from streamserve.media.vad import SpeechStarted as VadStarted

        start_ms = self._fed_ms
        self._fed_ms += 1e3 * len(x) / RATE
        if self._detector is None:  # no turn detection: everything is one utterance until commit()
            if self._utterance_start is None:
                self._utterance_start = int(start_ms)
            self._put(Work("audio", self._epoch, x, ms=self._utterance_start))
            if self._fed_ms - self._utterance_start > 1e3 * self.max_buffer_s:  # as long as it may be: commit
                self._put(Work("stop", self._epoch, ms=int(self._fed_ms)))
                self._utterance_start = None
            return []
        now: list[ListenEvent] = []
        if self._utterance_start is not None:  # speaking when this audio began: all of it is the utterance's
            self._put(Work("audio", self._epoch, x, ms=int(start_ms)))
        for ev in events:
            if isinstance(ev, VadStarted):
                self._utterance_start, self._silent_hint = int(ev.audio_start_ms + self._clock_offset), None
                self._n += 1
                self._put(Work("start", self._epoch, ev.audio, ms=self._utterance_start, n=self._n))
            else:
                if self._utterance_start is None:
                    continue  # a stop for an utterance commit() or clear() already ended
                self._utterance_start, self._silent_hint = None, None
                stop = Work("stop", self._epoch, ms=int(ev.audio_end_ms + self._clock_offset))
                if self._utterance_open and self._open_n == self._n:
                    stop.said = self._stop_said = True
                    now.append(SpeechStopped(stop.ms))
                self._put(stop)
        silent = self._detector.silent_since_ms if self._utterance_start is not None else None
        if silent != self._silent_hint:  # after this append's audio: the worker has it all when it speculates
            self._silent_hint = silent
            ms = int(silent + self._clock_offset) if silent is not None else 0
            self._put(Work("silence" if silent is not None else "resume", self._epoch, ms=ms))
        return now

    def _settle_bytes(self) -> None:
        """The account holds what the backlog holds now (16 kHz float32), plus what appends in flight admitted."""
        self._holding.settle(0 if self._closed else round(self.backlog_s * RATE) * SAMPLE_BYTES + self._admitted)

    def _put(self, work: Work) -> None:
        if work.samples is not None:
            self._queued_s += len(work.samples) / RATE
        self._queue.append(work)
        if work.kind != "audio":  # a held-back partial pass must not delay what this means (a silence, a stop)
            self.runtime.stt.skip_steps(self._stt)
        self._wake.set()

    async def commit(self) -> TranscriptDone | None:
        """End the current utterance now (turn detection off, or the client's decision): -> its TranscriptDone
        (also emitted), or None when no audio is buffered. Either way it returns once the work queued before it
        is done: an utterance the VAD already stopped has had its final pass (a cut connection's drain relies on
        this before it closes the Listener)."""
        self._check_open()
        async with self._lock:
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            if self._utterance_start is None:  # nothing to end: wait only for what is queued
                self._put(Work("barrier", self._epoch, done=done))
            else:
                self._utterance_start, self._silent_hint = None, None
                if self._detector is not None:  # the detector's speech ends here too: no SpeechStopped will follow
                    self._detector.reset()
                self._put(Work("commit", self._epoch, ms=int(self._fed_ms), done=done))
        return await done

    async def clear(self) -> None:
        """Drop the buffered audio and the current utterance (no events of it follow once this returns)."""
        self._check_open()
        async with self._lock:
            self._epoch += 1
            while self._queue:  # a commit or barrier waiting on its work returns (None)
                self._settle(self._queue.popleft(), None)
            self._queued_s = 0.0
            self._utterance_start, self._silent_hint = None, None
            if self._detector is not None:
                self._detector.reset()
            self._input = self._make_input(self.fmt)
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._put(Work("reset", self._epoch, done=done))
            self._settle_bytes()
        await done

    async def close(self) -> None:
        """Stop: queued work is dropped, a pass in flight is waited for (so the media executor is idle of this
        stream's work when this returns), nothing is emitted after."""
        if self._closed:
            return
        self._closed, self._epoch = True, self._epoch + 1
        while self._queue:  # a commit, clear or barrier waiting on its work returns (None) instead of hanging
            self._settle(self._queue.popleft(), None)
        self._holding.drop()  # nothing it held is kept: the account has it back now
        self._wake.set()
        try:
            await asyncio.shield(self._worker)
        except asyncio.CancelledError:
            if not self._worker.done():  # our caller was cancelled: the worker still stops by itself
                raise
        except Exception:  # logged by the worker
            pass
        if self._last is not None:  # a decode in flight: the executor is done with this stream when close returns
            await asyncio.wait({self._last})

    def _check_open(self) -> None:
        if self._closed:
            raise ListenerClosedError("this audio stream is closed")

    # ---- the worker: transcription passes, one at a time -------------------------------------------------
    async def _work(self) -> None:
        while not self._closed:
            if not self._queue:
                if self._stt.ready() and self._utterance_open and self._untranscribed_s > 0 and self._silent_ms is None:
                    await self._pass("step", self._epoch)  # nothing queued, no trailing silence (it'd delay the final)
                    self._settle_bytes()
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            w = self._queue.popleft()
            if w.epoch != self._epoch:
                self._settle(w, None)
                continue
            try:
                await self._do(w)
            except Exception as e:  # one bad pass must not end the stream's transcription
                log.exception("streamserve: a transcription step failed")
                self._settle(w, None, e)
            finally:
                self._settle_bytes()

    async def _do(self, w: Work) -> None:
        if w.samples is not None:
            self._queued_s = max(0.0, self._queued_s - len(w.samples) / RATE)
        if w.kind == "barrier":  # changes nothing: a trailing silence stays held back
            self._settle(w, None)
            return
        if w.kind not in ("audio", "silence"):  # any of these ends a trailing silence (and what it held back)
            keep = w.kind in ("resume", "commit")  # commit: the client's end, all audio counts
            self._end_silence(keep)
            if self._likely and w.kind != "stop":  # the likely end was not the end (a stop confirms it)
                self._likely = False
                if keep:
                    await self._send(TurnResumed(), w.epoch)
        if w.kind in ("reset", "start"):
            self._stop_said, self._deferred, self._open_n = False, "", w.n
        if w.kind == "reset":
            self._stt.reset()
            self._untranscribed_s, self._utterance_open = 0.0, False
            self._settle(w, None)
        elif w.kind == "silence":
            self._silent_ms = w.ms
            # Speculate only when nothing else is queued (a stop behind: finish() runs this pass; speech resumed)
            if self._utterance_open and self._untranscribed_s > 0 and all(q.kind == "audio" for q in self._queue):
                await self._pass("step", w.epoch)
        elif w.kind == "start":
            self._stt.reset()
            self._utterance_open, self._start_ms, self._untranscribed_s = True, w.ms, 0.0
            await self._send(SpeechStarted(w.ms), w.epoch)
            self._add(w.samples)
        elif w.kind == "audio":
            if not self._utterance_open:  # turn detection off: the first audio opens the utterance
                self._stt.reset()
                self._utterance_open, self._start_ms, self._untranscribed_s = True, w.ms, 0.0
            if self._silent_ms is not None and w.samples is not None:  # maybe the VAD's hangover: held back
                self._held.append(w.samples)
            else:
                self._add(w.samples)
        elif w.kind != "resume":  # stop or commit: the utterance ends; the rest is transcribed at once
            if w.kind == "stop" and self._detector is not None and not w.said:
                await self._send(SpeechStopped(w.ms), w.epoch)
            done = await self._pass("finish", w.epoch, end_ms=w.ms) if self._utterance_open else None
            self._settle(w, done)

    def _end_silence(self, keep: bool) -> None:
        """A trailing silence is over: its held audio goes to the transcriber (`keep`: speech resumed, or a commit)
        or is dropped (the VAD's stop: it was the hangover, the speculative pass covered the speech before it)."""
        held, self._held, self._silent_ms = self._held, [], None
        if keep:
            for samples in held:
                self._add(samples)

    def _add(self, samples: np.ndarray | None) -> None:
        if samples is not None and len(samples):
            self._stt.add(samples)
            self._untranscribed_s += len(samples) / RATE

    async def _pass(self, kind: str, epoch: int, end_ms: int = 0) -> TranscriptDone | None:
        """One Whisper pass through the STT scheduler (step: while speaking, urgent at the first silence, when it is
        the likely final; finish: the end of the utterance); its latency is on /metrics (stt_pass_seconds)."""
        covered, before, stt = self._untranscribed_s, self._stt.text, self.runtime.stt
        update = await (stt.step(self._stt, self._silent_ms is not None) if kind == "step" else stt.finish(self._stt))
        if update is None:  # a step skipped under load: the next pass covers this audio
            return None
        if kind == "step" and self._detector is not None:  # semantic_vad: the words so far set the turn's silence
            self._detector.hear(self._stt.text + update.partial)
        self._untranscribed_s = max(0.0, self._untranscribed_s - covered)
        if kind == "step" and self._stop_said:  # SpeechStopped went out meanwhile: its words go in the final delta
            self._deferred += update.committed
            return None
        if kind == "step":
            if update.committed:
                await self._send(TranscriptDelta(update.committed), epoch)
            if update.partial:
                await self._send(TranscriptPartial(update.partial), epoch)
            text = (self._stt.text + update.partial).strip()
            if self._silent_ms is not None and self._detector is not None and turn_state(text) == "complete":
                self._likely = True  # the pass at the first silence: maybe the end; its words look complete
                await self._send(TurnLikely(text, update.partial), epoch)
            return None
        self._utterance_open, self._untranscribed_s, self._stop_said, self._likely = False, 0.0, False, False
        committed, self._deferred = self._deferred + update.committed, ""
        if committed:
            await self._send(TranscriptDelta(committed), epoch)
        done = TranscriptDone((before + update.committed).strip(), self._start_ms, max(end_ms, self._start_ms))
        await self._send(done, epoch)
        return done

    async def _send(self, event: ListenEvent, epoch: int) -> None:
        if epoch != self._epoch or self._closed:
            return  # cleared or closed meanwhile: nothing of that utterance goes out
        try:
            await self.emit(event)
        except Exception:
            log.exception("streamserve: delivering a voice event failed")

    @staticmethod
    def _settle(w: Work, result: Any, error: BaseException | None = None) -> None:
        if w.done is not None and not w.done.done():
            w.done.set_exception(error) if error is not None else w.done.set_result(result)
