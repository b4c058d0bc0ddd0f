"""/v1/realtime keeps reading while an event is being handled: the client's keepalive pings are answered (aiohttp
answers a ping only when the connection's frames are read), a burst of audio beyond the buffer limit is refused
with typed errors instead of piling up unread, and the events still run one at a time, in order."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from rt import RawRealtime, user_text
from serving import engine_paused, serve

from streamserve.config import ServerConfig

RATE = 24000  # the session's default input: PCM16 mono at 24 kHz
GUARD_S = 60.0  # a guard against a hang only: under the bug the pong never comes while the engine is held


@pytest.mark.asyncio
async def test_pings_are_answered_while_an_event_waits_for_the_engine() -> None:
    async with serve(ServerConfig()) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send(user_text("In the beginning", id="first"))
        await c.until("conversation.item.done")
        await c.send(user_text("God created", id="third"))
        await c.until("conversation.item.done")
        with engine_paused(srv.engine):  # the insertion's rewind cannot run: its handler waits on the engine
            await c.send(user_text("the heaven", id="second", previous_item_id="first"))
            await c.send({"type": "conversation.item.retrieve", "item_id": "first"})  # queued behind it
            pong = await c.ws.ping()
            await asyncio.wait_for(pong, GUARD_S)
            assert [m["type"] for m in c.seen[-1:]] == ["conversation.item.done"]  # nothing handled meanwhile
        added = await c.until("conversation.item.added")
        assert added[-1]["item"]["id"] == "second" and added[-1]["previous_item_id"] == "first"
        got = await c.until("conversation.item.retrieved")  # handled after the insertion, in order
        assert got[-1]["item"]["id"] == "first"
        await c.close()


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()


@pytest.mark.asyncio
async def test_a_burst_of_audio_is_refused_past_the_limit_and_the_connection_goes_on(voiced: None) -> None:
    from voice_assets import speech

    data = pcm16(speech("Which city is the capital of France? " * 8, rate=RATE))  # ~15 s of speech, sent at once
    async with serve(ServerConfig(max_audio_buffer_s=4.0), voice=True) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "create_response": False}}}}})
        await c.until("session.updated")
        collect = asyncio.create_task(c.until("input_audio_buffer.cleared"))  # read while sending, as clients do
        step = RATE * 2 // 10  # 100 ms appends
        for i in range(0, len(data), step):
            await c.send({"type": "input_audio_buffer.append", "event_id": f"a{i // step}",
                          "audio": base64.b64encode(data[i:i + step]).decode()})
        for k in range(400):  # many tiny appends (5 ms each) behind the burst
            await c.send({"type": "input_audio_buffer.append", "event_id": f"t{k}",
                          "audio": base64.b64encode(bytes(240)).decode()})
        pong = await c.ws.ping()  # answered while the burst is worked through
        await asyncio.wait_for(pong, GUARD_S)
        await c.send({"type": "input_audio_buffer.clear", "event_id": "clear"})
        got = await collect
        errors = [m["error"] for m in got if m["type"] == "error"]
        assert errors and {e["code"] for e in errors} == {"audio_buffer_full"}, errors  # refused, typed
        assert all(e["event_id"][0] in "at" for e in errors)  # each names the append it refused
        await c.send(user_text("And God said"))
        await c.send({"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 6}})
        done = (await c.until("response.done"))[-1]
        assert done["response"]["status"] in ("completed", "incomplete")
        await c.close()
