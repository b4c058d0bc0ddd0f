"""The browser demo in real Chromium over the WebSocket fallback (/v1/realtime), with the voice models: a fake
microphone plays synthesised speech (looping), the server hears it, the page shows the transcript and the reply,
plays the reply's audio (WebAudio analyser RMS), measures the turn's latency, and stops playback when the question
comes again over the reply (barge-in), truncating the item to what was played. Driven from the keyboard. Skips
when chromium, playwright, the voice extra or the voice models are missing (the message says what to install)."""

from __future__ import annotations

from pathlib import Path

import pytest
from browser import Browser, DemoServer, Namespace, artifacts, chromium, demo, needs_voice, question_wav, write_y4m
from browser import test_pattern as camera_frames

pytestmark = [pytest.mark.slow, pytest.mark.models]
WAIT = 180_000  # ms: a phase's ceiling on a loaded 2-core CPU (never a timing assertion: the test waits for states)


def test_voice_turn_barge_in_and_latency_over_the_websocket(tmp_path: Path) -> None:
    chromium()
    needs_voice()
    wav = question_wav(tmp_path / "question.wav", "What is the capital of France?")
    y4m = write_y4m(tmp_path / "camera.y4m", camera_frames())
    out = artifacts("websocket")
    with Namespace.create(required=False) as ns, \
            DemoServer.start(ns, ["--no-vision"], tmp_path / "server.log") as srv, \
            Browser.launch(tmp_path, ns, wav, y4m) as browser:
        page = browser.new_page(f"{srv.url}/?transport=ws&camera=1&max_output_tokens=64")
        page.screenshot(path=str(out / "1-idle.png"))
        page.focus("#start")
        page.keyboard.press("Enter")  # keyboard, as a person without a mouse would
        page.wait_for_function("() => __demo.state === 'live'", timeout=WAIT)
        assert demo(page, "transport") == "websocket"
        assert page.evaluate("document.activeElement.id") == "stop"  # focus moved to the next useful control
        page.wait_for_function("() => __demo.session !== null", timeout=WAIT)  # session.created
        assert demo(page, "session.model") == "default"
        assert page.text_content("#info-model") == "default"

        # the server heard the question: VAD turns and its words on the page
        page.wait_for_function("() => __demo.userFinal.some(t => /capital/i.test(t))", timeout=WAIT)
        assert demo(page, "events['input_audio_buffer.speech_started']") >= 1
        assert demo(page, "events['input_audio_buffer.speech_stopped']") >= 1
        assert "capital" in page.text_content("#log").lower()
        # the reply: its text streamed, its audio played through the player worklet and heard by the analyser
        page.wait_for_function("() => __demo.replies.some(r => r.text.trim().length > 0)", timeout=WAIT)
        page.wait_for_function("() => __demo.latencies.length >= 1", timeout=WAIT)
        page.wait_for_function("() => __demo.outputRmsMax > 0.02", timeout=WAIT)  # speech, not a click (silence: 0)
        latency = demo(page, "latencyDetails[0]")
        assert latency["ms"] > 0 and latency["source"] == "page", latency
        assert page.text_content("#latency").strip() == f"{latency['ms']} ms"
        page.screenshot(path=str(out / "2-reply.png"))

        # the question again, over the reply: playback stops, the item is cut to what was played
        page.wait_for_function("() => __demo.bargeIns.some(b => b.stoppedAfterMs !== null)", timeout=WAIT)
        page.wait_for_function("() => __demo.events['conversation.item.truncated'] >= 1", timeout=WAIT)
        page.wait_for_function("() => __demo.replies.some(r => r.heard !== undefined)", timeout=WAIT)
        cut = [r for r in demo(page, "replies") if "heard" in r]
        # what the session keeps is what was heard: a prefix of the reply's text, shorter than it
        assert len(cut[0]["heard"].strip()) < len(cut[0]["text"].strip()), cut[0]
        page.screenshot(path=str(out / "3-barge-in.png"), full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})  # a phone
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        page.screenshot(path=str(out / "4-phone.png"), full_page=True)

        assert demo(page, "errors") == [], demo(page, "errors")
        # Stop (keyboard): the call's connection and session are gone on the server (its health figures)
        page.focus("#stop")
        page.keyboard.press("Enter")
        page.wait_for_function("() => __demo.state === 'idle'", timeout=WAIT)
        page.wait_for_function("() => fetch('/healthz').then(r => r.json())"
                               ".then(h => h.connections === 0 && h.sessions_open === 0)", timeout=WAIT)
        assert not [m for m in browser.console if m.startswith(("pageerror", "error"))], browser.console
    print(f"\nscreenshots: {out}")
