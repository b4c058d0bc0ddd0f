"""The Listener's low-latency paths (server/media/voice/listen.py) on real synthesised speech, counted, never timed:
the speculative final pass (started where the VAD first scores silence) is the utterance's last Whisper pass when
the person has stopped (the end of speech needs no pass of its own), and is an ordinary step when they go on
(no word lost or doubled); SpeechStopped is not queued behind a pass.

Needs the voice extra and models (skips naming them otherwise).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from voice_assets import needs_voice, speech

from streamserve.server.media.voice import listen as L

pytestmark = pytest.mark.asyncio(loop_scope="module")

RATE = 24000
FRAME = RATE // 50  # 20 ms
WAIT_S = 300  # a hang guard only


class CountingWhisper:
    """The real Whisper, each pass logged (("pass", samples it covers)) in the log the events also go to."""

    def __init__(self, inner: Any, log: list[Any]) -> None:
        self.inner, self.log = inner, log
        self.running = 0

    def words(self, audio16k: np.ndarray, prompt: str | None = None, language: str = "en") -> list[Any]:
        self.log.append(("pass", len(audio16k)))
        self.running += 1
        try:
            return self.inner.words(audio16k, prompt=prompt, language=language)
        finally:
            self.running -= 1

    def transcribe(self, audio16k: np.ndarray, language: str = "en") -> str:
        self.log.append(("pass", len(audio16k)))
        return self.inner.transcribe(audio16k, language=language)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def models() -> AsyncIterator[Any]:
    needs_voice()
    from streamserve.server.media.voice.runtime import VoiceRuntime

    rt = await asyncio.to_thread(VoiceRuntime.load)
    yield rt
    rt.close()


class Recorder:
    """A runtime whose Whisper passes are logged, and the events of one Listener, in one log."""

    def __init__(self, models: Any) -> None:
        from streamserve.server.media.voice.runtime import VoiceRuntime

        self.log: list[Any] = []
        self.whisper = CountingWhisper(models.whisper, self.log)
        self.runtime = VoiceRuntime(models.vad, self.whisper, models.voice, workers=1)
        self.done = asyncio.Event()

    async def __call__(self, ev: L.ListenEvent) -> None:
        self.log.append(ev)
        if isinstance(ev, L.TranscriptDone):
            self.done.set()

    def events(self) -> list[L.ListenEvent]:
        return [e for e in self.log if not isinstance(e, tuple)]

    def kinds(self) -> str:
        letters = {L.SpeechStarted: "S", L.SpeechStopped: "E", L.TranscriptDelta: "d", L.TranscriptPartial: "p",
                   L.TranscriptDone: "F", L.TurnLikely: "L", L.TurnResumed: "R"}
        return "".join(letters[type(e)] for e in self.events())

    async def idle(self, listener: L.Listener) -> None:
        """Until the Listener's worker waits for audio: no pass running, less than a pass's worth not transcribed."""
        while self.whisper.running or listener.backlog_s >= 0.6:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)


def pcm16(x: np.ndarray) -> bytes:
    return np.clip(np.rint(x * 32768), -32768, 32767).astype("<i2").tobytes()


def frames(x: np.ndarray) -> list[bytes]:
    data = pcm16(x)
    return [data[i:i + 2 * FRAME] for i in range(0, len(data), 2 * FRAME)]


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.float32)


def voiced(text: str) -> np.ndarray:
    """`text` spoken, cut to its voiced part (|x| > 0.01, -40 dBFS) so that pauses are what the test puts."""
    x = speech(text, RATE)
    loud = np.nonzero(np.abs(x) > 0.01)[0]
    return np.asarray(x[loud[0]:loud[-1] + 1])


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


async def feed_slowly(listener: L.Listener, x: np.ndarray) -> None:
    """Frame by frame, letting the worker take each one (and any hint it brings) before the next."""
    for frame in frames(x):
        await listener.append(frame)
        await asyncio.sleep(0)


async def test_the_speculative_pass_is_the_last_one_when_speech_does_not_resume(models: Any) -> None:
    rec = Recorder(models)
    listener = L.Listener(rec.runtime, audio_format(), server_vad(), rec)
    for frame in frames(np.concatenate([silence(0.5), speech("Which city is the capital of France?", RATE)])):
        await listener.append(frame)
    await rec.idle(listener)
    await feed_slowly(listener, silence(1.2))  # the VAD's hint, the speculative pass, then the stop
    await asyncio.wait_for(rec.done.wait(), WAIT_S)
    await listener.close()
    rec.runtime.close()
    # the speculative pass's words looked complete (TurnLikely: a reply may start), then the stop confirmed them
    assert re.fullmatch(r"S[dp]*LEd?F", rec.kinds()), rec.kinds()
    likely = next(e for e in rec.events() if isinstance(e, L.TurnLikely))
    stopped = next(i for i, e in enumerate(rec.log) if isinstance(e, L.SpeechStopped))
    # no Whisper pass began after SpeechStopped: finish() reused the speculative pass
    assert not [e for e in rec.log[stopped:] if isinstance(e, tuple)], rec.log
    done = rec.events()[-1]
    assert isinstance(done, L.TranscriptDone)
    assert "capital" in words(done.text) and "france" in words(done.text), done.text
    deltas = "".join(e.text for e in rec.events() if isinstance(e, L.TranscriptDelta))
    assert deltas.strip() == done.text  # each word once
    assert likely.text == done.text  # what a speculated reply was started on is the final transcript


async def test_the_speculative_pass_is_a_step_when_speech_resumes(models: Any) -> None:
    rec = Recorder(models)
    listener = L.Listener(rec.runtime, audio_format(), server_vad(), rec)
    first, second = voiced("Good morning to you."), voiced("Tell me about the sea.")
    await feed_slowly(listener, np.concatenate([silence(0.5), first]))
    await rec.idle(listener)
    passes_before = sum(isinstance(e, tuple) for e in rec.log)
    await feed_slowly(listener, silence(0.3))  # a pause under silence_duration_ms (500): the VAD's hint only
    for frame in frames(np.concatenate([second, silence(1.2)])):  # speech again while that pass runs
        await listener.append(frame)
    await asyncio.wait_for(rec.done.wait(), WAIT_S)
    await listener.close()
    rec.runtime.close()
    kinds = rec.kinds()
    assert re.fullmatch(r"S[dp]*(LR)?[dp]*L?Ed?F", kinds), kinds  # one utterance: the pause did not end the turn
    # (if its words looked complete, TurnLikely, then TurnResumed as speech went on: a speculated reply taken back)
    started = rec.events()[0]
    assert isinstance(started, L.SpeechStarted)
    # a pass began in the pause (the speculative one): it covered the first phrase and ended before the second
    pause_from, pause_to = 1e3 * (0.5 + len(first) / RATE), 1e3 * (0.8 + len(first) / RATE)
    ends = [started.audio_start_ms + e[1] / 16 for e in rec.log[passes_before:] if isinstance(e, tuple)]
    assert any(pause_from <= end <= pause_to for end in ends), (ends, pause_from, pause_to)
    done = rec.events()[-1]
    assert isinstance(done, L.TranscriptDone)
    got = words(done.text)
    for word in ("morning", "tell", "sea"):
        assert got.count(word) == 1, done.text  # neither lost nor doubled
    deltas = "".join(e.text for e in rec.events() if isinstance(e, L.TranscriptDelta))
    assert deltas.strip() == done.text


def audio_format() -> Any:
    from streamserve.media.audio import AudioFormat

    return AudioFormat("pcm16", RATE, 1)


def server_vad() -> Any:
    from streamserve.media.vad import VADConfig

    return VADConfig()
