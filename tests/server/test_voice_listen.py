"""The Listener (server/media/voice/listen.py) on real synthesised speech: turn events and transcripts in order, commit
with turn detection off, clear, the bounded backlog, close.

Needs the voice extra and models (skips naming them otherwise): one VoiceRuntime per module.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
from voice_assets import needs_voice, speech

from streamserve.server.media.voice import listen as L

pytestmark = pytest.mark.asyncio(loop_scope="module")

RATE = 24000
FRAME = RATE // 50  # 20 ms
QUESTION = "Which city is the capital of France?"
WAIT_S = 300  # a hang guard only: a pass takes ~1 s on a 2-core CPU


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime() -> AsyncIterator[object]:
    needs_voice()
    from streamserve.server.media.voice.runtime import VoiceRuntime

    rt = await asyncio.to_thread(VoiceRuntime.load)
    yield rt
    rt.close()


def pcm16(x: np.ndarray) -> bytes:
    return np.clip(np.rint(x * 32768), -32768, 32767).astype("<i2").tobytes()


def utterance(text: str, lead_s: float = 0.5, tail_s: float = 1.2) -> bytes:
    """Silence, `text` spoken, silence (enough for the VAD to stop), as pcm16 at RATE."""
    x = np.concatenate([np.zeros(int(lead_s * RATE), np.float32), speech(text, RATE),
                        np.zeros(int(tail_s * RATE), np.float32)])
    return pcm16(x)


def heard(text: str, said: str) -> bool:
    """Whether `text` is a transcript of `said`: its key word and most of its words (the Piper voice's rendering
    varies from run to run, its duration predictor being stochastic, and Whisper base sometimes mishears a word)."""
    got, want = set(re.findall(r"[a-z]+", text.lower())), re.findall(r"[a-z]+", said.lower())
    return "capital" in got and sum(w in got for w in want) >= len(want) - 1


def frames(data: bytes) -> list[bytes]:
    step = 2 * FRAME
    return [data[i:i + step] for i in range(0, len(data), step)]


class Collector:
    def __init__(self) -> None:
        self.events: list[L.ListenEvent] = []
        self.done = asyncio.Event()

    async def __call__(self, ev: L.ListenEvent) -> None:
        self.events.append(ev)
        if isinstance(ev, L.TranscriptDone):
            self.done.set()

    def kinds(self) -> str:
        letters = {L.SpeechStarted: "S", L.SpeechStopped: "E", L.TranscriptDelta: "d", L.TranscriptPartial: "p",
                   L.TranscriptDone: "F"}
        return "".join(letters[type(e)] for e in self.events)


def fmt() -> object:
    from streamserve.media.audio import AudioFormat

    return AudioFormat("pcm16", RATE, 1)


def vad() -> object:
    from streamserve.media.vad import VADConfig

    return VADConfig()


async def test_server_vad_events_in_order_and_the_transcript(runtime: object) -> None:
    got = Collector()
    listener = L.Listener(runtime, fmt(), vad(), got)
    for frame in frames(utterance(QUESTION)):
        await listener.append(frame)
        await asyncio.sleep(0)  # let the worker run between frames, as a real-time stream would
    await asyncio.wait_for(got.done.wait(), WAIT_S)
    await listener.close()
    assert re.fullmatch(r"S[dp]*Ed?F", got.kinds()), got.kinds()
    started, stopped, done = got.events[0], got.events[got.kinds().index("E")], got.events[-1]
    assert isinstance(started, L.SpeechStarted) and isinstance(stopped, L.SpeechStopped)
    assert isinstance(done, L.TranscriptDone)
    assert 0 < started.audio_start_ms < stopped.audio_end_ms <= listener.audio_ms + 1
    assert (done.audio_start_ms, done.audio_end_ms) == (started.audio_start_ms, stopped.audio_end_ms)
    assert heard(done.text, QUESTION), done.text
    # the deltas are the transcript, each word once (append-only)
    deltas = "".join(e.text for e in got.events if isinstance(e, L.TranscriptDelta))
    assert deltas.strip() == done.text
    assert listener.backlog_s == 0.0


async def test_two_utterances_and_speech_timing(runtime: object) -> None:
    got = Collector()
    listener = L.Listener(runtime, fmt(), vad(), got)
    for frame in frames(utterance("Good morning.") + utterance("Thank you very much.")):
        await listener.append(frame)
        await asyncio.sleep(0)
    for _ in range(2):
        await asyncio.wait_for(got.done.wait(), WAIT_S)
        got.done.clear()
        if got.kinds().count("F") == 2:
            break
    await listener.close()
    assert re.fullmatch(r"(S[dp]*Ed?F){2}", got.kinds()), got.kinds()
    finals = [e for e in got.events if isinstance(e, L.TranscriptDone)]
    assert "morning" in finals[0].text.lower() and "thank" in finals[1].text.lower()
    assert finals[0].audio_end_ms < finals[1].audio_start_ms


async def test_without_turn_detection_commit_ends_the_utterance(runtime: object) -> None:
    got = Collector()
    listener = L.Listener(runtime, fmt(), None, got)
    assert await listener.commit() is None  # nothing buffered
    for frame in frames(utterance(QUESTION, tail_s=0.3)):
        await listener.append(frame)
    done = await asyncio.wait_for(listener.commit(), WAIT_S)
    await listener.close()
    assert done is not None and heard(done.text, QUESTION), done
    assert re.fullmatch(r"[dp]*F", got.kinds()), got.kinds()  # no speech events without turn detection
    assert got.events[-1] == done


async def test_clear_drops_the_utterance(runtime: object) -> None:
    got = Collector()
    listener = L.Listener(runtime, fmt(), None, got)
    for frame in frames(utterance(QUESTION, tail_s=0.0)):
        await listener.append(frame)
    await asyncio.wait_for(listener.clear(), WAIT_S)
    n = len(got.events)
    assert await listener.commit() is None
    await listener.close()
    assert len(got.events) == n and not any(isinstance(e, L.TranscriptDone) for e in got.events)


async def test_backlog_is_bounded(runtime: object) -> None:
    from streamserve.media.audio import AudioFormatError

    listener = L.Listener(runtime, fmt(), None, Collector(), max_buffer_s=0.5)
    data = utterance(QUESTION)
    with pytest.raises(L.AudioBufferFullError) as refused:
        for frame in frames(data):  # as fast as the loop goes: far faster than a Whisper pass
            await listener.append(frame)
    assert refused.value.code == "audio_buffer_full" and "real-time" in str(refused.value)
    with pytest.raises(AudioFormatError):  # half a sample
        await listener.append(b"\x00")
    await listener.close()
    with pytest.raises(L.ListenerClosedError):
        await listener.append(frames(data)[0])


async def test_close_leaves_nothing_running(runtime: object) -> None:
    got = Collector()
    listener = L.Listener(runtime, fmt(), vad(), got)
    for frame in frames(utterance(QUESTION))[:80]:  # mid-speech
        await listener.append(frame)
    before = len(got.events)
    await listener.close()
    tasks = [t for t in asyncio.all_tasks() if t.get_name() == "streamserve-listener" and not t.done()]
    assert not tasks
    await asyncio.sleep(0.05)
    assert len(got.events) == before  # nothing emitted after close
    # the media executor is free: a job submitted now starts at once (no pass of this stream ahead of it)
    assert await runtime.run(lambda: 42) == 42


async def test_commit_after_the_vad_stopped_waits_for_the_final_pass(runtime: object) -> None:
    """A cut connection's drain commits and then closes: when the VAD has already ended the utterance, commit has
    nothing to end but must still return only after the queued final pass, or close would drop its words."""
    import threading

    got = Collector()
    listener = L.Listener(runtime, fmt(), vad(), got)
    hold = threading.Event()
    held = asyncio.get_running_loop().run_in_executor(runtime.stt_executor, hold.wait)  # no pass runs meanwhile
    try:
        for frame in frames(utterance(QUESTION)):
            await listener.append(frame)
            await asyncio.sleep(0)
        stopped = await asyncio.wait_for(_until(got, L.SpeechStopped), WAIT_S)
        assert isinstance(stopped, L.SpeechStopped) and not got.done.is_set()  # the final pass has not run
        commit = asyncio.ensure_future(listener.commit())
        await asyncio.sleep(0.2)
        assert not commit.done()  # waiting behind the queued final pass
    finally:
        hold.set()
        await held
    assert await asyncio.wait_for(commit, WAIT_S) is None  # the VAD's utterance: nothing left to end
    assert got.done.is_set() and heard(got.events[-1].text, QUESTION), got.kinds()
    await listener.close()


async def _until(got: Collector, kind: type) -> L.ListenEvent:
    while not any(isinstance(e, kind) for e in got.events):
        await asyncio.sleep(0.01)
    return next(e for e in got.events if isinstance(e, kind))
