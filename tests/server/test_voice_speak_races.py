"""The Speaker (server/media/voice/speak.py) under failures and races, with a stand-in voice (a tone per piece) so no
voice model is needed: a failing emit must not leave its synthesis task waiting for ever; audio comes out in the
order of the text whatever the interleaving of feed() and emission; heard_text at the edges.

Needs soxr (the voice extra) for the output resampler.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from voice_assets import needs

from streamserve.server.media.voice.deadlines import DeadlineRunner
from streamserve.server.media.voice.speak import Speaker

pytestmark = pytest.mark.asyncio

WAIT_S = 20  # a hang guard only
VOICE_RATE = 22050


class ToneVoice:
    """A stand-in TTS voice: 10 ms of audio per character, every sample of piece n equal to a level of its own."""

    sample_rate = VOICE_RATE

    def __init__(self) -> None:
        self.levels: dict[str, float] = {}

    def synthesize(self, text: str) -> np.ndarray:
        level = self.levels.setdefault(text.strip(), 0.1 + 0.05 * len(self.levels))
        return np.full(VOICE_RATE * len(text) // 100, level, np.float32)  # [n]


class FakeRuntime:
    def __init__(self) -> None:
        self.voice = ToneVoice()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="fake-media")
        self.tts = DeadlineRunner(self.executor, 1)

    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def fmt(encoding: str = "float32", rate: int = VOICE_RATE) -> Any:
    from streamserve.media.audio import AudioFormat

    return AudioFormat(encoding, rate, 1)


def speaker_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("streamserve-speaker") and not t.done()]


async def test_a_failing_emit_ends_synthesis_too() -> None:
    """emit() fails (the connection broke): finish() raises, and wait_idle() returns: the synthesis task, blocked on
    the full audio queue with nobody left to drain it, must stop too (it used to wait for ever: a leaked task)."""
    needs("soxr")

    async def emit(data: bytes) -> None:
        raise ConnectionResetError("the client went away")

    speaker = Speaker(FakeRuntime(), fmt(), emit)  # type: ignore[arg-type]
    for i in range(8):  # more pieces than the audio queue holds
        speaker.feed(f"Sentence number {i} is here. ")
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(speaker.finish(), WAIT_S)
    await asyncio.wait_for(speaker.wait_idle(), WAIT_S)
    assert speaker.done and not speaker_tasks()


async def test_audio_follows_the_text_in_order_whatever_the_interleaving() -> None:
    """Text fed while earlier pieces are emitted (a slow client): the audio is the pieces' audio in text order,
    chunked at <= 100 ms, nothing lost or repeated; heard_text maps each piece's audio back to it."""
    needs("soxr")
    runtime = FakeRuntime()
    chunks: list[bytes] = []

    async def emit(data: bytes) -> None:
        chunks.append(data)
        await asyncio.sleep(0)  # the feeder runs between chunks

    f = fmt()
    speaker = Speaker(runtime, f, emit)  # type: ignore[arg-type]
    # the first piece short enough to be whole (a first sentence is cut after FIRST_PIECE_MAX_WORDS words)
    pieces = ["Piece 0 is spoken.", *(f"Piece {i} of the reply is spoken now." for i in range(1, 6))]
    for p in pieces:
        for word in p.split(" "):
            speaker.feed(word + " ")
            await asyncio.sleep(0)
    await asyncio.wait_for(speaker.finish(), WAIT_S)
    x = np.frombuffer(b"".join(chunks), "<f4")  # float32 at the voice's rate: no resampling, levels kept exactly
    assert all(f.duration_ms(len(c)) <= 100 + 1e-6 for c in chunks)
    levels = [runtime.voice.levels[p] for p in pieces]
    runs = [float(v) for i, v in enumerate(x) if i == 0 or v != x[i - 1]]
    assert [round(v, 4) for v in runs] == [round(v, 4) for v in levels]
    # heard_text: nothing at 0 ms or before, everything past the end, whole pieces at their ends
    assert speaker.heard_text(0) == "" and speaker.heard_text(-5) == ""
    assert speaker.heard_text(speaker.audio_ms * 10) == " ".join(pieces)
    first_end = 1e3 * (np.argmax(x != x[0])) / VOICE_RATE
    assert speaker.heard_text(first_end) == pieces[0]
    mid = speaker.heard_text(first_end + 1.0)  # 1 ms into piece 1: none of its words yet
    assert mid == pieces[0]


def split_all(text: str) -> list[str]:
    from streamserve.media.tts import SentenceSplitter

    splitter = SentenceSplitter()
    return splitter.push(text) + splitter.flush()


async def test_g711_and_24k_output_from_the_voice_rate() -> None:
    """Reply audio converted from the voice's 22050 Hz: pcm16 at 24 kHz and mu-law at 8 kHz keep the duration."""
    needs("soxr")
    for f in (fmt("pcm16", 24000), fmt("g711_ulaw", 8000), fmt("g711_alaw", 8000)):
        chunks: list[bytes] = []

        async def emit(data: bytes, chunks: list[bytes] = chunks) -> None:
            chunks.append(data)

        speaker = Speaker(FakeRuntime(), f, emit)  # type: ignore[arg-type]
        speaker.feed("One sentence only, spoken once.")
        await asyncio.wait_for(speaker.finish(), WAIT_S)
        n = sum(map(len, chunks))
        assert n % f.bytes_per_frame == 0
        pieces = split_all("One sentence only, spoken once.")  # the fake voice: len(piece) // 100 s of audio each
        want_ms = 1e3 * sum(VOICE_RATE * len(p) // 100 for p in pieces) / VOICE_RATE
        assert speaker.audio_ms == pytest.approx(f.duration_ms(n))
        assert abs(speaker.audio_ms - want_ms) < 5.0, (f, speaker.audio_ms, want_ms)
