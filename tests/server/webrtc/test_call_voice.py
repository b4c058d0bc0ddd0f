"""A whole WebRTC call against a real server with the voice models: an aiortc client speaks synthesised speech on
its microphone track and gets VAD events, the transcript, a reply (transcript deltas on the data channel, audio on
its track, output_audio_buffer.started/stopped); barge-in clears the track and truncates the reply to what was
heard. Skips (naming what to install or pull) when the voice extra, a voice model or aiortc is missing."""

from __future__ import annotations

import numpy as np
import pytest
from rtc import RATE, CallClient, delete_call, settled, state
from serving import serve
from voice_assets import speech

from streamserve.config import ServerConfig

QUESTION = "Which city is the capital of France?"


def spoken(text: str, tail_s: float = 1.5) -> np.ndarray:
    return np.concatenate([np.zeros(int(0.3 * RATE), np.float32), speech(text, rate=RATE),
                           np.zeros(int(tail_s * RATE), np.float32)])


@pytest.mark.asyncio
async def test_a_spoken_turn_over_webrtc(voiced: None) -> None:
    async with serve(ServerConfig(), voice=True) as srv:
        c = CallClient()
        await c.connect(srv.http, session={"type": "realtime", "max_output_tokens": 24})
        c.mic.say(spoken(QUESTION))
        events = await c.until("output_audio_buffer.stopped")
        kinds = [m["type"] for m in events]
        assert "error" not in kinds, [m for m in events if m["type"] == "error"]
        for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "conversation.item.input_audio_transcription.completed", "response.created",
                     "response.output_audio_transcript.delta", "output_audio_buffer.started", "response.done"):
            assert kind in kinds, (kind, kinds)
        assert "response.output_audio.delta" not in kinds  # the audio is on the track
        said = next(m for m in events if m["type"] == "conversation.item.input_audio_transcription.completed")
        assert "capital" in said["transcript"].lower(), said  # (Opus at 48 kHz: "France" may come out "friends")
        assert kinds.index("output_audio_buffer.started") > kinds.index("response.created")
        started = next(m for m in events if m["type"] == "output_audio_buffer.started")
        done = next(m for m in events if m["type"] == "response.done")
        assert started["response_id"] == done["response"]["id"] == events[-1]["response_id"]
        assert c.loud_frames() > 10  # reply audio above silence reached the client's track
        await c.close()


@pytest.mark.asyncio
async def test_barge_in_clears_the_track_and_truncates(voiced: None) -> None:
    async with serve(ServerConfig(), voice=True) as srv:
        c = CallClient()
        await c.connect(srv.http, session={"type": "realtime", "max_output_tokens": 200})
        await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Tell me a long story about the sea, the ships and the sailors."}]}})
        await c.send({"type": "response.create"})
        before = await c.until("output_audio_buffer.started")
        c.mic.say(spoken("Stop, please stop."))
        events = before + await c.until("output_audio_buffer.cleared")
        kinds = [m["type"] for m in events]
        assert "input_audio_buffer.speech_started" in kinds
        truncated = await c.until("conversation.item.truncated")
        events += truncated
        assert truncated[-1]["audio_end_ms"] > 0
        events += await c.until("input_audio_buffer.committed")
        said = "".join(m["delta"] for m in c.seen if m["type"] == "response.output_audio_transcript.delta"
                       and m["item_id"] == truncated[-1]["item_id"])
        await c.send({"type": "conversation.item.retrieve", "item_id": truncated[-1]["item_id"]})
        got = (await c.until("conversation.item.retrieved"))[-1]["item"]
        heard = got["content"][0]["transcript"]
        assert heard and len(heard) < len(said)  # what was heard, kept; the rest (generated, never played) gone
        await c.close()


@pytest.mark.asyncio
async def test_output_audio_buffer_clear(voiced: None) -> None:
    async with serve(ServerConfig(), voice=True) as srv:
        c = CallClient()
        await c.connect(srv.http, session={"type": "realtime", "max_output_tokens": 200})
        await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "In the beginning God created the heaven and the earth."}]}})
        await c.send({"type": "response.create"})
        started = (await c.until("output_audio_buffer.started"))[-1]
        await c.send({"type": "response.cancel"})
        await c.send({"type": "output_audio_buffer.clear"})
        events = await c.until("output_audio_buffer.cleared")
        assert events[-1]["response_id"] == started["response_id"]
        done = (await c.until("response.done"))[-1] if not any(m["type"] == "response.done" for m in events) else \
            next(m for m in events if m["type"] == "response.done")
        assert done["response"]["status"] == "cancelled"
        await c.close()


@pytest.mark.asyncio
async def test_voice_calls_ended_mid_reply_and_mid_speech_leave_nothing(voiced: None) -> None:
    async with serve(ServerConfig(), voice=True) as srv:
        before = state(srv)
        for hang_up in ("delete", "peer closes"):
            c = CallClient()
            await c.connect(srv.http, session={"type": "realtime", "max_output_tokens": 200})
            await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "In the beginning God created the heaven and the earth."}]}})
            await c.send({"type": "response.create"})
            await c.until("output_audio_buffer.started")
            c.mic.say(spoken("And the earth was without form.", tail_s=0.0))
            await c.until("input_audio_buffer.speech_started")  # mid-speech (the Listener busy), mid-reply
            if hang_up == "delete":
                assert c.location is not None
                assert await delete_call(srv.http, c.location) == 204
            await c.close()
            await settled(srv, before)
