"""The SDK's audio side against the fake server: audio appends go out as raw bytes with rate/channels/encoding,
the server's voice messages (and a reply the server starts by itself) come back as typed events in order through
a bounded queue that drops the oldest reply audio first."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
from fake_server import FakeServer

import streamserve_client as sc
from streamserve_client.events import EventQueue, SessionEnded
from streamserve_client.session import audio_bytes

WAIT_S = 10.0  # a hang guard only


def pack(m: dict) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


@pytest.mark.asyncio
async def test_audio_append_is_raw_bytes_with_its_format(fake_server: FakeServer) -> None:
    async with sc.connect(fake_server.url) as client:
        session = await client.open_session(voice={"turn_detection": False})
        pcm = np.array([0, 1000, -1000, 32767], np.int16)
        ack = await session.append(audio=(pcm, 16000))
        await session.append(audio=(b"\x01\x02\x03\x04", 8000), encoding="g711_ulaw", channels=2)
        await session.append(audio=(np.array([0.5, -0.5], np.float32), 24000), encoding="float32")
    opened, first, second, third = [m for m in fake_server.received if m["type"] in ("open", "append")]
    assert opened["voice"] == {"turn_detection": False}
    assert ack.seq == 0 and first["seq"] == 0 and second["seq"] == 1
    assert isinstance(first["audio"], bytes) and first["audio"] == pcm.astype("<i2").tobytes()
    assert (first["rate"], first["channels"], first["encoding"]) == (16000, 1, "pcm16")
    assert (second["audio"], second["rate"], second["channels"], second["encoding"]) == \
        (b"\x01\x02\x03\x04", 8000, 2, "g711_ulaw")
    assert np.frombuffer(third["audio"], "<f4").tolist() == [0.5, -0.5]


def test_audio_bytes_conversions() -> None:
    assert audio_bytes(np.array([1.0, -1.0, 0.0]), "pcm16") == np.array([32767, -32768, 0], "<i2").tobytes()
    assert audio_bytes(np.array([16384], np.int16), "float32") == np.array([0.5], "<f4").tobytes()
    assert audio_bytes(b"\x07", "g711_alaw") == b"\x07"
    with pytest.raises(sc.InvalidInputError):
        audio_bytes(np.zeros(4), "g711_ulaw")


@pytest.mark.asyncio
async def test_voice_messages_become_typed_events_in_order(fake_server: FakeServer) -> None:
    async with sc.connect(fake_server.url) as client:
        session = await client.open_session(voice={"speak": True})
        sid = session.id
        for m in ({"type": "turn", "session": sid, "event": "speech_started", "audio_start_ms": 120},
                  {"type": "transcript", "session": sid, "partial": " What is"},
                  {"type": "transcript", "session": sid, "delta": " What is", "seq": 3},
                  {"type": "turn", "session": sid, "event": "speech_stopped", "audio_end_ms": 1900},
                  {"type": "transcript", "session": sid, "final": "What is it?", "audio_start_ms": 120,
                   "audio_end_ms": 1900},
                  {"type": "turn", "session": sid, "event": "some_newer_event"},  # ignored
                  # a reply the server started at the end of speech: no reply of the client is running
                  {"type": "delta", "session": sid, "response": "r1", "text": "It is", "token_ids": [1, 2]},
                  {"type": "done", "session": sid, "response": "r1", "reason": "stop", "usage": {}},
                  {"type": "audio", "session": sid, "response": "r1", "audio": b"\x00\x00" * 10, "rate": 24000,
                   "encoding": "pcm16", "channels": 1},
                  {"type": "audio_done", "session": sid, "response": "r1", "reason": "done", "audio_ms": 0.4}):
            await fake_server.send_raw(pack(m))
        got = []
        async for event in session.events():
            got.append(event)
            if isinstance(event, sc.ReplyAudioDone):
                break
        assert client.channel.dead is None  # no protocol violation: the server's reply went to the events
        assert session.next_seq == 4  # after the server's transcript chunk 3
    assert got == [sc.SpeechStarted(120), sc.TranscriptPartial(" What is"), sc.TranscriptDelta(" What is", 3),
                   sc.SpeechStopped(1900), sc.TranscriptFinal("What is it?", 120, 1900),
                   sc.ReplyText("r1", "It is", [1, 2]), sc.ReplyDone("r1", "stop", {}),
                   sc.ReplyAudio("r1", b"\x00\x00" * 10, 24000, "pcm16", 1), sc.ReplyAudioDone("r1", "done", 0.4)]


@pytest.mark.asyncio
async def test_a_malformed_voice_message_is_a_protocol_violation(fake_server: FakeServer) -> None:
    async with sc.connect(fake_server.url, reconnect=False) as client:
        session = await client.open_session(voice={"speak": True})
        await fake_server.send_raw(pack({"type": "audio", "session": session.id, "audio": "AAAA", "rate": 24000}))
        ended = [e async for e in session.events()]  # ends: the session is lost with the connection
        assert ended == []
        assert isinstance(client.channel.dead, sc.ProtocolViolationError)


@pytest.mark.asyncio
async def test_the_event_queue_is_bounded_and_drops_the_oldest_audio_first() -> None:
    q = EventQueue(capacity=4)
    audio = [sc.ReplyAudio("r", bytes([i]), 24000) for i in range(3)]
    q.put(sc.SpeechStarted(0))
    for a in audio:
        q.put(a)
    q.put(sc.SpeechStopped(10))  # full: the oldest audio goes
    q.put(sc.TranscriptFinal("hi"))  # and the next
    assert (len(q), q.dropped, q.dropped_audio) == (4, 2, 2)
    assert [await q.get() for _ in range(4)] == [sc.SpeechStarted(0), audio[2], sc.SpeechStopped(10),
                                                 sc.TranscriptFinal("hi")]
    for i in range(6):  # no audio queued: the oldest event of any kind goes
        q.put(sc.TranscriptPartial(str(i)))
    assert (len(q), q.dropped, q.dropped_audio) == (4, 4, 2)
    assert (await q.get()) == sc.TranscriptPartial("2")
    q.put(SessionEnded())
    q.put(sc.SpeechStarted(5))  # after the end: nothing more
    assert [await asyncio.wait_for(q.get(), WAIT_S) for _ in range(4)][-1] == SessionEnded()
    assert len(q) == 0


@pytest.mark.asyncio
async def test_events_after_the_end_end_at_once() -> None:
    """Reading events() again after the session ended returns at once (it waited for ever: the end was consumed)."""
    q = EventQueue(capacity=4)
    q.put(sc.SpeechStarted(0))
    q.put(SessionEnded())
    assert await q.get() == sc.SpeechStarted(0)
    assert await q.get() == SessionEnded()
    assert await asyncio.wait_for(q.get(), WAIT_S) == SessionEnded()  # again, and again
    assert await asyncio.wait_for(q.get(), WAIT_S) == SessionEnded()


@pytest.mark.asyncio
async def test_audio_arrays_carry_their_channels_and_finite_samples_only(fake_server: FakeServer) -> None:
    """A [n, channels] array is sent with its channel count (it went out as mono, twice as long); a channels
    argument that contradicts the array, more than 2 dimensions, and NaN/inf samples are refused before sending."""
    async with sc.connect(fake_server.url) as client:
        session = await client.open_session(voice={"turn_detection": False})
        stereo = np.array([[0, 100], [200, 300], [400, 500]], np.int16)  # [n=3, channels=2]
        await session.append(audio=(stereo, 16000))
        with pytest.raises(sc.InvalidInputError):
            await session.append(audio=(stereo, 16000), channels=3)
        with pytest.raises(sc.InvalidInputError):
            await session.append(audio=(np.zeros((2, 2, 2), np.int16), 16000))
        with pytest.raises(sc.InvalidInputError):
            await session.append(audio=(np.array([0.1, np.nan], np.float32), 16000))
        with pytest.raises(sc.InvalidInputError):
            await session.append(audio=(np.array([0.1, np.inf], np.float32), 16000), encoding="float32")
        await session.append(audio=(b"\x00\x00\x00\x00", 16000), channels=2)  # bytes: as the caller says
    sent = [m for m in fake_server.received if m["type"] == "append"]
    assert len(sent) == 2
    assert sent[0]["channels"] == 2 and sent[0]["audio"] == stereo.astype("<i2").tobytes()
    assert sent[1]["channels"] == 2
