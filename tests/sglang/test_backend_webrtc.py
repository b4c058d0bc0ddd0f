"""A WebRTC call on the SGLang backend: an aiortc client speaks on its microphone track, the server hears it (VAD,
Whisper), the turn's transcript reaches SGLang as the chat's user message, and the reply comes back on the data
channel, as on the engine backend. ICE stays on 127.0.0.1 (tests/server/webrtc/rtc.py's guard). Skips without
aiortc or the voice models."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serving import serve
from voice_assets import needs_voice, speech

from streamserve.config import EngineConfig, ServerConfig
from streamserve.engine.remote.launch import LaunchedSGLang
from streamserve.server.service.backends import backend_loader

pytest.importorskip("aiortc", reason="aiortc is not installed: it comes with the webrtc extra")
from server.webrtc.rtc import RATE, CallClient, pin_to_loopback  # (tests/ is on the path)


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    refused = pin_to_loopback(monkeypatch)
    yield
    assert not refused, refused


@pytest.mark.asyncio
async def test_a_spoken_turn_over_webrtc_on_the_sglang_backend(sglang: LaunchedSGLang, checkpoint: Path) -> None:
    needs_voice()
    cfg = EngineConfig(model=str(checkpoint), backend="sglang", sglang_url=sglang.url)
    async with serve(ServerConfig(), backend_loader(cfg), voice=True) as srv:
        c = CallClient()
        await c.connect(srv.http, session={"type": "realtime", "max_output_tokens": 8,
                                           "output_modalities": ["text"]})
        silence = np.zeros(int(0.3 * RATE), np.float32)
        c.mic.say(np.concatenate([silence, speech("Which city is the capital of France?", rate=RATE),
                                  np.zeros(int(1.5 * RATE), np.float32)]))
        events: list[dict[str, Any]] = await c.until("response.done")
        kinds = [m["type"] for m in events]
        assert "error" not in kinds, [m for m in events if m["type"] == "error"]
        said = next(m for m in events if m["type"] == "conversation.item.input_audio_transcription.completed")
        assert "capital" in said["transcript"].lower(), said
        done = next(m for m in events if m["type"] == "response.done")
        assert done["response"]["status"] in ("completed", "incomplete"), done
        await c.close()
        for _ in range(300):  # the call's session closes with it (and SGLang's with it)
            if not srv.engine.sessions():
                break
            await asyncio.sleep(0.1)
        assert srv.engine.sessions() == []
