"""Audio over the native protocol, end to end over loopback: the real server with its voice models, the default
model, the Python SDK. Speech streamed at real-time pace -> turn events, transcript, a reply started by the server
at the end of speech, the reply's audio; bad audio; no voice; nothing left running after a disconnect.

Needs the voice extra and models (skips naming them otherwise).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from serving import RunningServer, default_engine, engine_paused, engine_throttled, serve
from voice_assets import needs_voice, speech

import streamserve_client as sc
from streamserve.config import ServerConfig
from streamserve.media import VOICE_EXTRA

pytestmark = pytest.mark.asyncio(loop_scope="module")

RATE = 16000
FRAME_S = 0.02
WAIT_S = 300  # a hang guard only
CONFIG = ServerConfig(messages_per_second=1000.0)
VOICE = {"turn_detection": {"type": "server_vad", "create_response": True, "interrupt_response": True},
         "speak": {"encoding": "pcm16", "rate": 24000, "channels": 1}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def voiced() -> AsyncIterator[RunningServer]:
    needs_voice()
    srv = await RunningServer.start(CONFIG, default_engine, voice=True)
    yield srv
    await srv.stop()


def heard(text: str, said: str) -> bool:
    """Whether `text` is a transcript of `said`: its key word and most of its words (the Piper voice's rendering
    varies from run to run, its duration predictor being stochastic, and Whisper base sometimes mishears a word)."""
    got, want = set(re.findall(r"[a-z]+", text.lower())), re.findall(r"[a-z]+", said.lower())
    return "capital" in got and sum(w in got for w in want) >= len(want) - 1


def spoken(text: str) -> bytes:
    """Silence, `text` spoken, silence (past the VAD's 500 ms), as pcm16 at 16 kHz."""
    x = np.concatenate([np.zeros(RATE // 2, np.float32), speech(text, RATE), np.zeros(RATE, np.float32)])
    return np.clip(np.rint(x * 32768), -32768, 32767).astype("<i2").tobytes()


async def stream(session: sc.Session, data: bytes) -> None:
    """`data` in 20 ms appends at real-time pace."""
    step = int(2 * RATE * FRAME_S)
    for i in range(0, len(data), step):
        await session.append(audio=(data[i:i + step], RATE))
        await asyncio.sleep(FRAME_S)


async def collect(session: sc.Session, until: type) -> list[sc.Event]:
    out: list[sc.Event] = []
    async for event in session.events():
        out.append(event)
        if isinstance(event, until):
            break
    return out


async def test_spoken_turn_gets_transcript_reply_and_reply_audio(voiced: RunningServer) -> None:
    async with sc.connect(voiced.url) as client:
        assert "audio" in client.hello["modalities"]
        audio = client.hello["audio"]
        assert audio["input"] == "transcribe" and audio["output_rate"] == 24000 and audio["voice_rate"] == 22050
        session = await client.open_session(voice=VOICE, max_tokens=12, temperature=0.0)
        assert session.info["voice"]["turn_detection"]["create_response"] is True
        assert session.info["voice"]["speak"] == VOICE["speak"]
        events = asyncio.ensure_future(collect(session, sc.ReplyAudioDone))
        await stream(session, spoken("Which city is the capital of France?"))
        got = await asyncio.wait_for(events, WAIT_S)
    kinds = [type(e) for e in got]
    assert kinds[0] is sc.SpeechStarted
    stop = kinds.index(sc.SpeechStopped)
    final = next(e for e in got if isinstance(e, sc.TranscriptFinal))
    assert stop < got.index(final)
    assert heard(final.text, "Which city is the capital of France?"), final.text
    deltas = [e for e in got if isinstance(e, sc.TranscriptDelta)]
    assert "".join(d.text for d in deltas).strip() == final.text
    assert all(d.seq is not None for d in deltas)  # appended to the session as chunks
    assert [d.seq for d in deltas] == sorted({d.seq for d in deltas})
    # the server started the reply at the end of speech: its text, its end, its audio, the audio's end
    text = "".join(e.text for e in got if isinstance(e, sc.ReplyText))
    assert text.strip()
    assert any(isinstance(e, sc.ReplyDone) for e in got)
    audio_events = [e for e in got if isinstance(e, sc.ReplyAudio)]
    assert audio_events and all(e.rate == 24000 and e.encoding == "pcm16" for e in audio_events)
    assert got.index(final) < got.index(audio_events[0])
    pcm = b"".join(e.audio for e in audio_events)
    assert len(pcm) % 2 == 0 and np.abs(np.frombuffer(pcm, "<i2")).max() > 1000  # a voice, not silence
    done = got[-1]
    assert isinstance(done, sc.ReplyAudioDone) and done.reason == "done"
    assert done.audio_ms == pytest.approx(1e3 * len(pcm) / 2 / 24000, abs=1.0)


async def test_speech_during_a_reply_cancels_it_and_its_audio(voiced: RunningServer) -> None:
    async with sc.connect(voiced.url) as client:
        session = await client.open_session(voice=VOICE, max_tokens=64, temperature=0.0)
        first_text = None
        # a step per 30 ms: the reply's 64 tokens take seconds, so it is still running when the client sees its
        # first text and pauses the engine (unthrottled, a fast decode could finish it in between)
        with engine_throttled(voiced.engine):
            await stream(session, spoken("Tell me a story."))
            async for event in session.events():  # the reply the server started at the end of speech is running
                if isinstance(event, sc.ReplyText):
                    first_text = event
                    break
        assert first_text is not None
        with engine_paused(voiced.engine):  # it cannot finish while the person speaks again
            events = asyncio.ensure_future(collect(session, sc.SpeechStarted))
            await stream(session, spoken("Stop."))
            await asyncio.wait_for(events, WAIT_S)
        got = await asyncio.wait_for(collect(session, sc.ReplyAudioDone), WAIT_S)
    done = next(e for e in got if isinstance(e, sc.ReplyDone))
    assert done.response == first_text.response and done.reason == "cancelled"
    assert got[-1].response == first_text.response and got[-1].reason == "cancelled"


async def test_commit_without_turn_detection_and_a_chat_session(voiced: RunningServer) -> None:
    async with sc.connect(voiced.url) as client:
        session = await client.open_session(chat=True, voice={"turn_detection": False, "input": {"rate": RATE}})
        assert session.info["voice"]["turn_detection"] is False
        data = spoken("Good morning.")
        step = int(2 * RATE * FRAME_S)
        for i in range(0, len(data), step):
            await session.append(audio=(data[i:i + step], RATE))
        committed = await asyncio.wait_for(session.commit(), WAIT_S)
        assert "morning" in committed["text"].lower()
        assert committed["audio_end_ms"] > committed["audio_start_ms"] >= 0
        # the utterance went into the conversation as the user's message: a reply follows it
        reply = session.respond(max_tokens=4, temperature=0.0)
        assert await asyncio.wait_for(reply.wait(), WAIT_S) in ("length", "stop")
        assert (await session.commit())["text"] == ""  # nothing buffered any more


async def test_bad_audio_is_a_typed_error_and_the_connection_goes_on(voiced: RunningServer) -> None:
    async with sc.connect(voiced.url) as client:
        session = await client.open_session()
        with pytest.raises(sc.InvalidInputError) as odd:
            await session.append(audio=(b"\x00\x01\x02", RATE))  # 1.5 pcm16 samples
        assert odd.value.code == "invalid_audio_format" and "multiple of 2" in odd.value.message
        with pytest.raises(sc.InvalidInputError) as enc:
            await session.append(audio=(b"\x00\x00", RATE), encoding="mp3")
        assert enc.value.code == "invalid_audio_format" and "pcm16" in enc.value.message
        with pytest.raises(sc.InvalidInputError) as rate:
            await session.append(audio=(b"\x00\x00", 1000))
        assert rate.value.code == "invalid_audio_format" and "8000" in rate.value.message
        with pytest.raises(sc.InvalidInputError) as ulaw:
            await session.append(audio=(b"\x00", 16000), encoding="g711_ulaw")
        assert ulaw.value.code == "invalid_audio_format"
        with pytest.raises(sc.InvalidInputError) as vad:
            await session.configure(voice={"turn_detection": {"type": "server_vad", "threshold": 2.0}})
        assert vad.value.code == "invalid_turn_detection"
        with pytest.raises(sc.InvalidInputError) as eager:
            await session.configure(voice={"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}})
        assert eager.value.code == "bad_message" and "eagerness" in eager.value.message
        configured = await session.configure(voice={"turn_detection": {"type": "semantic_vad", "eagerness": "low"}})
        td = configured["voice"]["turn_detection"]
        assert td["type"] == "semantic_vad" and td["eagerness"] == "low", configured
        configured = await session.configure(voice={"turn_detection": {"type": "server_vad"}})  # and back
        td = configured["voice"]["turn_detection"]
        assert td["type"] == "server_vad" and "eagerness" not in td and td["silence_duration_ms"] == 500, configured
        with pytest.raises(sc.InvalidInputError) as bad:  # the protocol's own check: a map of known keys
            await client.request({"type": "configure", "session": session.id, "voice": {"volume": 3}})
        assert bad.value.code == "bad_message" and "volume" in bad.value.message
        ack = await session.append(text="In the beginning")  # the connection and the session go on
        assert ack.tokens > 0
        ack = await session.append(audio=(np.zeros(320, np.int16), RATE))
        assert ack.tokens == 0


async def test_disconnect_and_close_free_listeners_and_speakers(voiced: RunningServer) -> None:
    service = voiced.server.service
    assert service is not None
    data = spoken("Thank you very much.")
    step = int(2 * RATE * FRAME_S)
    client = sc.connect(voiced.url, reconnect=False)
    await client.connect()
    a = await client.open_session(voice=VOICE, max_tokens=8)
    b = await client.open_session(voice={"turn_detection": False})
    for i in range(0, len(data) // 2, step):  # both mid-utterance
        await a.append(audio=(data[i:i + step], RATE))
        await b.append(audio=(data[i:i + step], RATE))
    assert service.audio.active() == 2
    await b.close()
    await client.drop_connection()  # a, mid-speech, detached for a resume
    for _ in range(600):  # the frees run as tasks: wait for them (bounded)
        if service.audio.active() == 0:
            break
        await asyncio.sleep(0.05)
    assert service.audio.active() == 0
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith(("streamserve-listener",
                                                                           "streamserve-speaker")) and not t.done()]
    assert await voiced.server.service.voice.run(lambda: 7) == 7  # the media executor takes work at once
    await client.close()


async def test_without_voice_audio_is_refused_naming_the_extra() -> None:
    async with serve(CONFIG, voice=False) as srv, sc.connect(srv.url) as client:
        assert client.hello["modalities"] == ["text"] and "audio" not in client.hello
        session = await client.open_session()
        with pytest.raises(sc.UnsupportedModalityError) as refused:
            await session.append(audio=(np.zeros(320, np.int16), RATE))
        assert VOICE_EXTRA in refused.value.message
        with pytest.raises(sc.UnsupportedModalityError):
            await client.open_session(voice={"speak": True})
        assert (await session.append(text="In the beginning")).tokens > 0


async def test_a_model_with_an_audio_encoder_hears_audio_as_embeddings(tmp_path: Path) -> None:
    """A checkpoint shipping an audio projector takes audio natively: appends become embeds chunks (one vector per
    40 ms), with no speech to text; hello says so."""
    needs_voice()
    from streamserve.engine import Engine
    from streamserve.engine.loading import DEFAULT_MODEL_DIR
    from streamserve.media.encoder import N_MELS, save_audio_projector

    folder = tmp_path / "hearing"
    folder.mkdir()
    for f in DEFAULT_MODEL_DIR.iterdir():
        (folder / f.name).symlink_to(f)
    hidden = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", kv_memory="16MiB").config.hidden_size
    rng = np.random.default_rng(0)
    save_audio_projector(folder, (rng.standard_normal((N_MELS * 4, hidden)) * 0.01).astype(np.float32), 4)

    def load() -> Engine:
        return Engine.from_pretrained(folder, device="cpu", kv_memory="128MiB")

    async with serve(CONFIG, load, voice=True) as srv, sc.connect(srv.url) as client:
        assert client.hello["audio"]["input"] == "encoder"
        session = await client.open_session(max_tokens=4)
        data = spoken("Hello.")
        ack = await session.append(audio=(data[:2 * 3200], RATE))  # 200 ms: 5 embeddings
        assert ack.tokens == 5
        assert (await session.append(audio=(data[6400:6400 + 320], RATE))).tokens == 0  # 10 ms: waits for more
        assert (await session.append(audio=(data[6720:6720 + 960], RATE))).tokens == 1  # 30 ms more: one period
        reply = session.respond(temperature=0.0)
        assert await asyncio.wait_for(reply.wait(), WAIT_S) in ("length", "stop")
        with pytest.raises(sc.InvalidInputError):
            await session.append(audio=(b"\x00", RATE))
