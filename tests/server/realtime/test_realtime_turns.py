"""/v1/realtime: response.create while the person's message is being streamed into the session. While they speak it
is refused (`conversation_busy`: their message is open in the session); once their speech has stopped it waits for
their item, so the response follows it and names it as its previous item, as in the session."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import pytest
from rt import RawRealtime
from serving import serve
from voice_assets import speech

from streamserve.config import ServerConfig

RATE = 24000
FRAME = RATE * 2 // 50  # bytes of 20 ms of PCM16 at 24 kHz


def spoken(text: str) -> bytes:
    lead, tail = np.zeros(RATE // 2, np.float32), np.zeros(RATE * 2, np.float32)
    x = np.concatenate([lead, speech(text, rate=RATE), tail])
    return (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()


async def play(c: RawRealtime, data: bytes) -> None:
    """20 ms appends at real-time pace."""
    start = time.monotonic()
    for i in range(0, len(data), FRAME):
        await c.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(data[i:i + FRAME]).decode()})
        await asyncio.sleep(max(0.0, start + (i + FRAME) / (2 * RATE) - time.monotonic()))


@pytest.mark.asyncio
async def test_response_create_during_speech_is_busy_then_follows_the_item(voiced: None) -> None:
    async with serve(ServerConfig(), voice=True) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"],
                                                            "audio": {"input": {"turn_detection": {
                                                                "type": "server_vad", "create_response": False}}}}})
        await c.until("session.updated")
        sender = asyncio.create_task(play(c, spoken("Which city is the capital of France?")))
        started = (await c.until("input_audio_buffer.speech_started"))[-1]
        await c.send({"type": "response.create", "event_id": "early", "response": {"max_output_tokens": 4}})
        error = await c.error()
        assert error["code"] == "conversation_busy" and error["event_id"] == "early"
        await c.until("input_audio_buffer.speech_stopped")
        await c.send({"type": "response.create", "event_id": "after", "response": {"max_output_tokens": 4}})
        got = await c.until("response.done")
        kinds = [m["type"] for m in got]
        assert "error" not in kinds, got
        assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
        user = next(m["item"] for m in got if m["type"] == "conversation.item.added")
        assert user["id"] == started["item_id"] and user["role"] == "user"
        reply = next(m for m in got if m["type"] == "conversation.item.added" and m["item"]["role"] == "assistant")
        assert reply["previous_item_id"] == user["id"]  # as in the session: the reply follows their message
        await sender
        await c.close()
