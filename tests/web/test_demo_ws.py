"""The browser demo in real Chromium over the WebSocket fallback (/v1/realtime), with the voice models: a fake
microphone plays synthesised speech (looping), the server hears it, the page shows the transcript and the reply,
plays the reply's audio (WebAudio analyser RMS), measures the turn's latency, and stops playback when the question
comes again over the reply (barge-in), truncating the item to what was played. Driven from the keyboard. Skips
when chromium, playwright, the voice extra or the voice models are missing (the message says what to install)."""

from __future__ import annotations

from pathlib import Path

import demo_checks as check
import pytest
from browser import (
    Browser,
    DemoServer,
    Namespace,
    artifacts,
    camera_frames,
    chromium,
    question_wav,
    write_y4m,
)
from voice_assets import needs_voice

pytestmark = [pytest.mark.slow, pytest.mark.models]


def test_voice_turn_barge_in_and_latency_over_the_websocket(tmp_path: Path) -> None:
    chromium()
    needs_voice()
    wav = question_wav(tmp_path / "question.wav", "Which city is the capital of France?")
    y4m = write_y4m(tmp_path / "camera.y4m", camera_frames())
    out = artifacts("websocket")
    with Namespace.create(required=False) as ns, \
            DemoServer.start(ns, ["--no-vision"], tmp_path / "server.log") as srv, \
            Browser.launch(tmp_path, ns, wav, y4m) as browser:
        page = browser.new_page(f"{srv.url}/?transport=ws&camera=1&max_output_tokens=64")
        page.screenshot(path=str(out / "1-idle.png"))
        check.start(page, "websocket")
        assert "WebRTC" in page.text_content("#camera-note")  # the preview says frames go only over WebRTC
        latency = check.voice_turn(page, out)
        check.barge_in(page, out)
        check.phone(page, out)
        check.stop_and_check_nothing_left(page, browser.console)
    print(f"\nlatency {latency}; screenshots: {out}")
