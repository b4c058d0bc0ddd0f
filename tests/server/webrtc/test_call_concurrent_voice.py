"""Voice at once on one server: two /v1/realtime WebSocket sessions and one WebRTC call, each saying a question
at real-time pace at the same time, all complete their turns with the real voice models (the default chat
model): speech events, the transcript, a response with audio that ends by itself (done, or at
max_output_tokens), each connection its own; afterwards nothing is left (sessions, KV pages, calls,
connections, STT passes). No timing is asserted: timeouts only stop a hung test."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import numpy as np
import pytest
import websockets
from rtc import CallClient, state
from serving import serve
from voice_assets import norm_words, speech

from streamserve.config import ServerConfig

WS_RATE = 24000  # the Realtime API's PCM16 rate
FRAME = WS_RATE // 50  # 20 ms
WAIT_S = 240.0
QUESTIONS = {"ws-a": ("Which city is the capital of France?", "capital"),
             "ws-b": ("How many legs does a spider have?", "spider"),
             "call": ("What colour is the sky on a clear day?", "sky")}


def spoken(text: str, rate: int) -> np.ndarray:
    return np.concatenate([np.zeros(int(0.3 * rate), np.float32), speech(text, rate=rate),
                           np.zeros(int(1.5 * rate), np.float32)])


async def websocket_turn(http: str, text: str) -> list[dict[str, Any]]:
    """One spoken turn over /v1/realtime: the question streamed in 20 ms frames at real-time pace, then the
    events up to the response's done."""
    pcm = (np.clip(spoken(text, WS_RATE), -1.0, 1.0) * 32767).astype("<i2").tobytes()
    async with websockets.connect(http.replace("http", "ws", 1) + "/v1/realtime?model=default") as ws:
        seen: list[dict[str, Any]] = []

        async def until(kind: str) -> None:
            while not seen or seen[-1]["type"] != kind:
                seen.append(json.loads(await asyncio.wait_for(ws.recv(), WAIT_S)))

        await until("session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                        "max_output_tokens": 16}}))
        await until("session.updated")

        async def play() -> None:
            start = time.monotonic()
            for i in range(0, len(pcm), 2 * FRAME):
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(pcm[i:i + 2 * FRAME]).decode()}))
                await asyncio.sleep(max(0.0, start + (i + 2 * FRAME) / (2 * WS_RATE) - time.monotonic()))

        sender = asyncio.create_task(play())
        await until("response.done")
        await sender
        return seen


def check_turn(events: list[dict[str, Any]], word: str, audio_on_track: bool) -> None:
    kinds = [m["type"] for m in events]
    assert "error" not in kinds, [m for m in events if m["type"] == "error"]
    assert kinds.count("input_audio_buffer.speech_started") >= 1
    said = next(m for m in events if m["type"] == "conversation.item.input_audio_transcription.completed")
    assert word in norm_words(said["transcript"]), said
    done = next(m for m in events if m["type"] == "response.done")
    status = done["response"]["status"], (done["response"]["status_details"] or {}).get("reason")
    assert status in (("completed", None), ("incomplete", "max_output_tokens")), done  # never cancelled or failed
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")  # held until the turn's end
    assert ("response.output_audio.delta" in kinds) != audio_on_track  # WebSocket: in events; a call: on its track


@pytest.mark.asyncio
async def test_two_realtime_sessions_and_a_webrtc_call_at_once(voiced: None) -> None:
    async with serve(ServerConfig(), voice=True) as srv:
        before = state(srv)
        call = CallClient()
        await call.connect(srv.http, session={"type": "realtime", "max_output_tokens": 16})
        call.mic.say(spoken(QUESTIONS["call"][0], 48000))
        a, b, c = await asyncio.gather(websocket_turn(srv.http, QUESTIONS["ws-a"][0]),
                                       websocket_turn(srv.http, QUESTIONS["ws-b"][0]),
                                       call.until("output_audio_buffer.stopped"))
        check_turn(a, QUESTIONS["ws-a"][1], False)
        check_turn(b, QUESTIONS["ws-b"][1], False)
        if not any(m["type"] == "response.done" for m in c):
            c += await call.until("response.done")
        check_turn(c, QUESTIONS["call"][1], True)
        assert call.loud_frames() > 10  # the call's reply audio reached its track
        for events in (a, b):  # each connection got its own response only
            assert len({m["response"]["id"] for m in events if m["type"] == "response.created"}) == 1
        await call.close()
        # (the STT scheduler's worker task is made at the first pass and lives with the server: tasks not compared)
        for _ in range(600):
            if state(srv)[:2] + state(srv)[3:] == before[:2] + before[3:]:
                break
            await asyncio.sleep(0.05)
        assert state(srv)[:2] + state(srv)[3:] == before[:2] + before[3:], (state(srv), before)
        assert srv.server.service.voice.stt.depth == 0  # no pass left waiting
        srv.engine.check_integrity()
