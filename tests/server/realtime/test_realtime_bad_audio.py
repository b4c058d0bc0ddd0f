"""/v1/realtime with audio that is not a turn: a wrong input rate is the API's error; silence only and 30 s of
noise start no response (the noise may be heard as speech, but its transcript is empty or the turn is dropped), the
connection goes on answering, and nothing is left behind (sessions, KV pages, STT passes, Listeners)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from rt import RawRealtime, user_text
from serving import serve

from streamserve.config import ServerConfig

RATE = 24000
APPEND_S = 0.2  # one append: 200 ms
PACE = 5.0  # sent at 5x real time: faster than that, the audio waiting would pass max_audio_buffer_s (30 s)


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()


async def send_all(c: RawRealtime, data: bytes) -> None:
    step = int(2 * RATE * APPEND_S)
    for i in range(0, len(data), step):
        await c.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(data[i:i + step]).decode()})
        await asyncio.sleep(APPEND_S / PACE)


@pytest.mark.asyncio
async def test_wrong_rate_silence_and_noise_start_no_turn_and_leave_nothing(voiced: None) -> None:
    async with serve(ServerConfig(), voice=True) as srv:
        assert srv.server.service is not None and srv.server.service.voice is not None
        st = srv.engine.stats()
        before = st["sessions_open"], st["kv_pages_used"]
        c = await RawRealtime.connect(srv.http)
        await c.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}}}}})
        error = await c.error()
        assert error["code"] == "invalid_value" and error["param"].endswith("rate"), error
        rng = np.random.default_rng(7)
        await send_all(c, pcm16(np.zeros(3 * RATE, np.float32)))  # silence only
        await send_all(c, pcm16(rng.normal(0.0, 0.08, 30 * RATE).astype(np.float32)))  # 30 s of loud noise
        await send_all(c, pcm16(np.zeros(2 * RATE, np.float32)))  # the VAD sees the noise end
        await c.send(user_text("And God said"))  # in order behind the audio: its response comes after all of it
        await c.send({"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 4}})
        got = await c.until("response.done")
        kinds = [m["type"] for m in got]
        assert [m for m in got if m["type"] == "error"] == []
        assert kinds.count("response.created") == 1  # ours: neither the silence nor the noise started one
        committed = [m for m in got if m["type"] == "conversation.item.input_audio_transcription.completed"]
        assert all(not m["transcript"].strip() or len(m["transcript"]) < 400 for m in committed), committed
        assert got[-1]["response"]["status"] in ("completed", "incomplete")
        await c.close()
        service = srv.server.service
        for _ in range(600):  # the connection's Listener, Speakers and session end on executors
            st = srv.engine.stats()
            if (st["sessions_open"], st["kv_pages_used"]) == before and service.voice.stt.depth == 0 \
                    and service.budget.held == 0:
                break
            await asyncio.sleep(0.05)
        st = srv.engine.stats()
        assert (st["sessions_open"], st["kv_pages_used"]) == before and service.voice.stt.depth == 0
        assert service.budget.held == 0  # no media bytes left on any account
        srv.engine.check_integrity()
