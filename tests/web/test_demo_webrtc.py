"""The browser demo in real Chromium over WebRTC (POST /v1/realtime/calls, aiortc on the server), inside a network
namespace of the test's own (loopback only: ICE candidates cannot leave it). The fake microphone's question goes up
the mic track, the events come on the "oai-events" data channel, the reply's audio on the remote track (played by
an <audio> element, measured by a WebAudio analyser); the fake camera's checkerboard reaches the server's vision
path, whose note the page shows. Skips when chromium, playwright, aiortc (the webrtc extra), the voice extra or
the voice models are missing, or when no network namespace can be made (not root)."""

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
    demo,
    question_wav,
    write_y4m,
)
from voice_assets import needs_voice

pytestmark = [pytest.mark.slow, pytest.mark.models]


def test_voice_and_camera_over_webrtc(tmp_path: Path) -> None:
    chromium()
    needs_voice()
    pytest.importorskip("aiortc", reason='aiortc is missing: pip install "streamserve[webrtc]"')
    wav = question_wav(tmp_path / "question.wav", "Which city is the capital of France?")
    y4m = write_y4m(tmp_path / "camera.y4m", camera_frames())
    out = artifacts("webrtc")
    with Namespace.create(required=True) as ns, \
            DemoServer.start(ns, [], tmp_path / "server.log") as srv, \
            Browser.launch(tmp_path, ns, wav, y4m) as browser:
        page = browser.new_page(f"{srv.url}/?transport=webrtc&camera=1&max_output_tokens=64")
        check.start(page, "webrtc")
        assert page.evaluate("document.getElementById('remote').srcObject !== null")  # the reply's track plays
        latency = check.voice_turn(page, out)
        check.barge_in(page, out)
        assert demo(page, "events['output_audio_buffer.started']") >= 1
        print(f"\nlatency {latency}", flush=True)
        # the camera: frames sampled by the server, labelled, a note appended to the session and announced
        page.wait_for_function("() => __demo.videoNotes.length >= 1", timeout=check.WAIT)
        assert "camera" in demo(page, "videoNotes[0]").lower()
        check.phone(page, out)
        check.stop_and_check_nothing_left(page, browser.console)
    print(f"\nlatency {latency}; screenshots: {out}")
