"""The Speaker (server/media/voice/speak.py): a reply's streamed text -> audio in the client's format, sentence by
sentence; first audio before the reply is finished; cancel stops at once; heard_text maps played audio back to text.

Needs the voice extra and models (skips naming them otherwise).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from voice_assets import needs_voice

from streamserve.server.media.voice.speak import CHUNK_MS, Speaker

pytestmark = pytest.mark.asyncio(loop_scope="module")

REPLY = ("The capital of France is Paris. It lies on the river Seine, in the north of the country. "
         "Many people visit it every year.")
WAIT_S = 300  # a hang guard only


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime() -> AsyncIterator[object]:
    needs_voice()
    from streamserve.server.media.voice.runtime import VoiceRuntime

    rt = await asyncio.to_thread(VoiceRuntime.load)
    yield rt
    rt.close()


def fmt(rate: int = 24000, encoding: str = "pcm16") -> object:
    from streamserve.media.audio import AudioFormat

    return AudioFormat(encoding, rate, 1)


def words_of(text: str) -> list[str]:
    return text.split()


async def test_streams_the_reply_as_audio_before_it_is_finished(runtime: object) -> None:
    f = fmt()
    chunks: list[bytes] = []
    first = asyncio.Event()

    async def emit(data: bytes) -> None:
        chunks.append(data)
        first.set()

    speaker = Speaker(runtime, f, emit)
    for word in REPLY.split(" "):  # token-like deltas
        speaker.feed(word + " ")
    # the first sentence is spoken while the reply has not finished (finish() not called yet)
    await asyncio.wait_for(first.wait(), WAIT_S)
    assert chunks and not speaker.done
    await asyncio.wait_for(speaker.finish(), WAIT_S)
    assert speaker.done
    data = b"".join(chunks)
    assert len(data) % f.bytes_per_frame == 0
    assert all(f.duration_ms(len(c)) <= CHUNK_MS + 1e-6 for c in chunks)
    assert speaker.audio_ms == pytest.approx(f.duration_ms(len(data)))
    # as long as the voice speaking the whole text (the voice's durations vary a little from run to run: Piper's
    # duration predictor is stochastic; sentence by sentence adds a pause or two)
    voice = runtime.voice
    whole_ms = 1e3 * len(await runtime.run(voice.synthesize, REPLY)) / voice.sample_rate
    assert 0.75 * whole_ms < speaker.audio_ms < 1.35 * whole_ms, (speaker.audio_ms, whole_ms)
    # what was heard, by audio played
    assert speaker.heard_text(0) == ""
    assert speaker.heard_text(speaker.audio_ms + 1) == REPLY
    half = words_of(speaker.heard_text(speaker.audio_ms / 2))
    assert 0 < len(half) < len(words_of(REPLY)) and half == words_of(REPLY)[:len(half)]
    assert speaker.heard_text(speaker.audio_ms / 4) and len(words_of(speaker.heard_text(speaker.audio_ms / 4))) \
        <= len(half)


async def test_other_formats(runtime: object) -> None:
    f = fmt(8000, "g711_ulaw")
    chunks: list[bytes] = []

    async def emit(data: bytes) -> None:
        chunks.append(data)

    speaker = Speaker(runtime, f, emit)
    speaker.feed("Hello there.")
    await asyncio.wait_for(speaker.finish(), WAIT_S)
    assert chunks and max(len(c) for c in chunks) <= 800  # 100 ms of 8 kHz mu-law
    assert speaker.audio_ms == pytest.approx(1e3 * sum(map(len, chunks)) / 8000)


async def test_cancel_stops_emission_at_once(runtime: object) -> None:
    chunks: list[bytes] = []
    first = asyncio.Event()

    async def emit(data: bytes) -> None:
        chunks.append(data)
        first.set()
        await asyncio.sleep(0.01)  # a client reading at its pace

    speaker = Speaker(runtime, fmt(), emit)
    speaker.feed(REPLY)
    finishing = asyncio.ensure_future(speaker.finish())
    await asyncio.wait_for(first.wait(), WAIT_S)
    speaker.cancel()
    n = len(chunks)
    await asyncio.wait_for(finishing, WAIT_S)  # finish() returns once cancelled
    await asyncio.wait_for(speaker.wait_idle(), WAIT_S)  # no synthesis of it left on the media executor
    assert speaker.cancelled and speaker.done
    assert len(chunks) == n  # nothing emitted after cancel() returned
    assert speaker.audio_ms < 1e3 * len(REPLY) / 10  # far from the whole reply
    speaker.feed("ignored after a cancel")
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("streamserve-speaker") and not t.done()]
