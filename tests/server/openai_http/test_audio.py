"""POST /v1/audio/transcriptions and /v1/audio/speech (streamserve/server/adapters/openai_http/audio.py) through the
`openai` SDK and pipecat's OpenAI STT and TTS services, on a real server with the voice models (skipped, naming what to
pull, without them)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from serving import RunningServer, default_engine
from voice_assets import needs_voice, speech

from streamserve.config import ServerConfig
from streamserve.media.stt import normalize

openai = pytest.importorskip("openai", reason="the openai SDK is a dev dependency")
SENTENCE = "The capital of France is Paris."
LONG = " ".join(f"Sentence number {n} is here to be spoken aloud." for n in range(1, 13))  # 12 pieces at least
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv() -> AsyncIterator[RunningServer]:
    needs_voice()
    running = await RunningServer.start(ServerConfig(), default_engine, voice=True)
    yield running
    await running.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def ai(srv: RunningServer) -> AsyncIterator[Any]:
    async with client(srv) as sdk:
        yield sdk


def client(srv: RunningServer) -> Any:
    return openai.AsyncOpenAI(base_url=f"{srv.http}/v1", api_key="x", max_retries=0)


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def wav_file(x: np.ndarray, rate: int, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm16(np.repeat(x, channels)))
    return out.getvalue()


async def test_speech_round_trip_through_whisper(srv: RunningServer, ai: Any) -> None:
    sf = pytest.importorskip("soundfile")
    audio = await ai.audio.speech.create(model="tts-1", voice="alloy", input=SENTENCE, response_format="wav")
    data = audio.content
    assert audio.response.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(data)) as w:  # the streamed header (sizes 0xFFFFFFFF) is read to the end
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert len(samples) == (len(data) - 44) // 2
    read, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000 and len(read) == len(samples)
    seconds = len(samples) / 24000
    assert 1.0 < seconds < 6.0

    t = await ai.audio.transcriptions.create(model="whisper-1", file=("speech.wav", data, "audio/wav"))
    assert "paris" in t.text.lower()
    text = await ai.audio.transcriptions.create(model="gpt-4o-transcribe", file=("speech.wav", data, "audio/wav"),
                                                response_format="text")
    assert isinstance(text, str) and "paris" in text.lower()
    verbose = await ai.audio.transcriptions.create(model="whisper-1", file=("speech.wav", data, "audio/wav"),
                                                   response_format="verbose_json", language="en",
                                                   timestamp_granularities=["word", "segment"])
    assert verbose.language == "english" and "paris" in verbose.text.lower()
    assert verbose.duration == pytest.approx(seconds, abs=0.05)
    assert verbose.segments and verbose.segments[0].start >= 0.0 and verbose.segments[-1].end <= seconds + 0.5
    assert verbose.words and any("paris" in w.word.lower() for w in verbose.words)
    srt = await ai.audio.transcriptions.create(model="whisper-1", file=("speech.wav", data), response_format="srt")
    assert srt.startswith("1\n00:00:") and "-->" in srt

    mp3 = await ai.audio.speech.create(model="tts-1", voice="piper-joe", input=SENTENCE)  # OpenAI's default: mp3
    assert mp3.response.headers["content-type"] == "audio/mpeg"
    t = await ai.audio.transcriptions.create(model="whisper-1", file=("speech.mp3", mp3.content, "audio/mpeg"))
    assert "paris" in t.text.lower()


async def test_transcription_reads_any_wav_and_streams(srv: RunningServer, ai: Any) -> None:
    stereo = wav_file(np.asarray(speech(SENTENCE, 44100)), 44100, channels=2)  # another rate, two channels
    t = await ai.audio.transcriptions.create(model="whisper-1", file=("s.wav", stereo, "audio/wav"))
    assert "paris" in t.text.lower()
    events = [e async for e in await ai.audio.transcriptions.create(
        model="gpt-4o-transcribe", file=("s.wav", stereo, "audio/wav"), stream=True)]
    assert [e.type for e in events][-1] == "transcript.text.done"
    assert "paris" in events[-1].text.lower()
    assert "".join(e.delta for e in events[:-1]).strip() == events[-1].text


async def test_pcm_streams_piece_by_piece(srv: RunningServer, ai: Any) -> None:
    tts = srv.server.service.voice.tts
    before = tts.started
    chunks: list[bytes] = []
    started_at_first_bytes = None
    async with ai.audio.speech.with_streaming_response.create(model="tts-1", voice="nova", input=LONG,
                                                              response_format="pcm") as r:
        assert r.headers["content-type"] == "audio/pcm"
        async for chunk in r.iter_bytes():
            if started_at_first_bytes is None:
                started_at_first_bytes = tts.started - before
            chunks.append(chunk)
    pieces = tts.started - before
    assert pieces >= 12
    assert started_at_first_bytes is not None and started_at_first_bytes < pieces  # audio before all synthesis
    data = b"".join(chunks)
    assert len(data) % 2 == 0
    samples = np.frombuffer(data, "<i2")
    seconds = len(samples) / 24000  # 16-bit, 24 kHz: ~12 sentences of ~2.5 s
    assert 15.0 < seconds < 60.0
    assert np.abs(samples).max() > 1000

    fast = await ai.audio.speech.create(model="tts-1", voice="echo", input=SENTENCE, response_format="pcm", speed=2.0)
    slow = await ai.audio.speech.create(model="tts-1", voice="echo", input=SENTENCE, response_format="pcm", speed=0.5)
    assert len(slow.content) > 2.5 * len(fast.content)


async def test_bad_requests_get_openai_errors(srv: RunningServer, ai: Any) -> None:
    wav = wav_file(np.asarray(speech(SENTENCE, 16000)), 16000)
    calls = [
        ("file", lambda: ai.audio.transcriptions.create(model="whisper-1", file=("a.txt", b"not audio, just text"))),
        ("response_format", lambda: ai.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav),
                                                                   response_format="xml")),
        ("language", lambda: ai.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav), language="xx")),
        ("temperature", lambda: ai.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav),
                                                               temperature=1.5)),
        ("voice", lambda: ai.audio.speech.create(model="tts-1", voice="bob", input="Hello.")),
        ("input", lambda: ai.audio.speech.create(model="tts-1", voice="alloy", input="")),
        ("input", lambda: ai.audio.speech.create(model="tts-1", voice="alloy", input="word " * 1000)),  # 5000 chars
        ("speed", lambda: ai.audio.speech.create(model="tts-1", voice="alloy", input="Hello.", speed=5.0)),
        ("response_format", lambda: ai.audio.speech.create(model="tts-1", voice="alloy", input="Hi.",
                                                           response_format="ogg")),
    ]
    for param, call in calls:
        with pytest.raises(openai.BadRequestError) as caught:
            await call()
        assert caught.value.status_code == 400
        body = caught.value.body
        assert isinstance(body, dict) and body["type"] == "invalid_request_error", body
        assert body["param"] == param and body["message"], body

    async with aiohttp.ClientSession() as http:
        form = aiohttp.FormData()
        form.add_field("model", "whisper-1")
        async with http.post(f"{srv.http}/v1/audio/transcriptions", data=form) as r:  # no file
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["param"] == "file" and err["type"] == "invalid_request_error"
        big = aiohttp.FormData()
        forty_s = wav_file(np.zeros(16000 * 40, np.float32), 16000)  # 1.28 MB: past the 1 MiB default
        big.add_field("file", io.BytesIO(forty_s), filename="big.wav")
        async with http.post(f"{srv.http}/v1/audio/transcriptions", data=big) as r:
            assert r.status == 413
            assert "--max-frame-bytes" in (await r.json())["error"]["message"]

    av = pytest.importorskip("av")
    long_silence = io.BytesIO()  # 11 minutes of silence: a few kB of FLAC, past the 10-minute bound
    with av.open(long_silence, "w", format="flac") as container:
        stream = container.add_stream("flac", rate=16000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 16000 * 60), np.int16), format="s16", layout="mono")
        frame.sample_rate = 16000
        for _ in range(11):
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    with pytest.raises(openai.BadRequestError) as caught:
        await ai.audio.transcriptions.create(model="whisper-1", file=("long.flac", long_silence.getvalue()))
    assert caught.value.body["param"] == "file" and caught.value.body["code"] == "audio_too_long"

    ok = await ai.audio.speech.create(model="tts-1", voice="alloy", input="Still here.", response_format="pcm")
    assert len(ok.content) > 24000  # the server still answers


async def test_speech_client_gone_stops_synthesis(srv: RunningServer) -> None:
    tts = srv.server.service.voice.tts
    before = tts.started
    async with aiohttp.ClientSession() as http:
        r = await http.post(f"{srv.http}/v1/audio/speech",
                            json={"model": "tts-1", "voice": "alloy", "input": LONG, "response_format": "pcm"})
        assert r.status == 200
        assert await r.content.read(1024)
        r.close()  # the connection goes away mid-stream

    async def idle() -> None:
        while tts.busy:  # the piece in flight, if any, ends; nothing more is submitted
            await asyncio.sleep(0.05)

    await asyncio.wait_for(idle(), 30)
    await asyncio.sleep(0.3)  # (a piece submitted late would show here)
    assert not tts.busy
    assert tts.started - before < 6  # of 12 pieces and more
    async with client(srv) as ai:
        ok = await ai.audio.speech.create(model="tts-1", voice="alloy", input=SENTENCE, response_format="wav")
    assert len(ok.content) > 44 + 24000


async def test_server_without_voice_says_so(served: RunningServer) -> None:
    silence = wav_file(np.zeros(1600), 16000)
    async with client(served) as ai:
        for call in (lambda: ai.audio.speech.create(model="tts-1", voice="alloy", input="Hello."),
                     lambda: ai.audio.transcriptions.create(model="whisper-1", file=("a.wav", silence))):
            with pytest.raises(openai.BadRequestError) as caught:
                await call()
            assert caught.value.body["code"] == "voice_unavailable"
            assert "streamserve models pull" in caught.value.body["message"]


async def run_pipeline(service: Any, frames: list[Any], done: Any) -> list[Any]:
    """`service` in a minimal pipeline (no transport): `frames` queued, what comes out collected until
    done(collected) or an ErrorFrame."""
    from pipecat.frames.frames import EndFrame, ErrorFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.workers.runner import WorkerRunner

    seen: list[Any] = []
    finished = asyncio.Event()

    class Collect(FrameProcessor):
        async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            seen.append(frame)
            if isinstance(frame, ErrorFrame) or done(seen):
                finished.set()
            await self.push_frame(frame, direction)

    task = PipelineWorker(Pipeline([service, Collect()]), idle_timeout_secs=None)
    workers = WorkerRunner(handle_sigint=False)
    await workers.add_workers(task)
    runner = asyncio.create_task(workers.run())
    for frame in frames:
        await task.queue_frame(frame)
    await asyncio.wait_for(finished.wait(), 60)
    await task.queue_frame(EndFrame())
    await asyncio.wait_for(runner, 60)
    await service._client.close()  # the service's AsyncOpenAI client: pipecat leaves its connections open
    errors = [f for f in seen if isinstance(f, ErrorFrame)]
    assert not errors, errors
    return seen


async def test_pipecat_openai_tts_service(srv: RunningServer) -> None:
    pytest.importorskip("pipecat.services.openai.tts", reason="pipecat-ai[openai] is a dev dependency")
    from pipecat.frames.frames import TTSAudioRawFrame, TTSSpeakFrame, TTSStoppedFrame
    from pipecat.services.openai.tts import OpenAITTSService

    tts = OpenAITTSService(api_key="x", base_url=f"{srv.http}/v1", sample_rate=24000)
    seen = await run_pipeline(tts, [TTSSpeakFrame("Hello there, how are you?")],
                              lambda seen: isinstance(seen[-1], TTSStoppedFrame))
    audio = b"".join(f.audio for f in seen if isinstance(f, TTSAudioRawFrame))
    assert all(f.sample_rate == 24000 for f in seen if isinstance(f, TTSAudioRawFrame))
    assert len(audio) / 2 / 24000 > 0.3


async def test_pipecat_openai_stt_service(srv: RunningServer) -> None:
    pytest.importorskip("pipecat.services.openai.stt", reason="pipecat-ai[openai] is a dev dependency")
    from pipecat.frames.frames import (
        InputAudioRawFrame,
        TranscriptionFrame,
        VADUserStartedSpeakingFrame,
        VADUserStoppedSpeakingFrame,
    )
    from pipecat.services.openai.stt import OpenAISTTService

    stt = OpenAISTTService(api_key="x", base_url=f"{srv.http}/v1", sample_rate=16000)
    data = pcm16(np.concatenate([np.zeros(3200, np.float32), speech(SENTENCE, 16000)]))
    step = 16000 * 2 // 50  # 20 ms frames
    frames = [VADUserStartedSpeakingFrame(),
              *(InputAudioRawFrame(audio=data[i:i + step], sample_rate=16000, num_channels=1)
                for i in range(0, len(data), step)),
              VADUserStoppedSpeakingFrame()]
    seen = await run_pipeline(stt, frames, lambda seen: isinstance(seen[-1], TranscriptionFrame))
    texts = [f.text for f in seen if isinstance(f, TranscriptionFrame)]
    assert any("paris" in t.lower() for t in texts), texts


NOUNS = ("apple", "river", "mountain", "teacher", "window", "garden", "bicycle", "kitchen", "airplane", "doctor",
         "library", "ocean", "candle", "forest", "guitar", "market", "elephant", "bridge", "summer", "rocket")


async def test_long_audio_is_transcribed_in_passes(ai: Any) -> None:
    """~45 s of speech (mp3): Whisper passes of 28 s at most, each keeping the words that end 3 s before its end; no
    sentence is lost or repeated where one pass hands over to the next."""
    text = " ".join(f"The next word I say is {noun}." for noun in NOUNS)
    mp3 = await ai.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="mp3")
    verbose = await ai.audio.transcriptions.create(model="whisper-1", file=("long.mp3", mp3.content),
                                                   response_format="verbose_json")
    assert verbose.duration > 35.0
    assert len({s.seek for s in verbose.segments}) >= 2  # more than one pass
    starts = [s.start for s in verbose.segments]
    assert starts == sorted(starts) and verbose.segments[-1].end > verbose.duration - 3.0
    heard = [normalize(w) for w in verbose.text.split()]
    assert sum(heard.count(noun) == 1 for noun in NOUNS) >= 18, verbose.text  # (Whisper base mishears one or two)
    assert all(heard.count(noun) <= 1 for noun in NOUNS), verbose.text


async def test_speech_as_server_sent_events(srv: RunningServer) -> None:
    async with aiohttp.ClientSession() as http, http.post(
            f"{srv.http}/v1/audio/speech", json={"model": "gpt-4o-mini-tts", "voice": "coral", "input": SENTENCE,
                                                  "response_format": "pcm", "stream_format": "sse"}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"} and len(pcm) / 48000 > 1.0
