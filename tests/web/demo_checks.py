"""One spoken conversation in the demo page, checked step by step; the same for both transports (the tests of
each transport call it and add what is theirs). Waits for states, never for times: WAIT is only a ceiling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from browser import demo

WAIT = 180_000  # ms: a phase's ceiling on a loaded 2-core CPU


def start(page: Any, transport: str) -> None:
    """Start from the keyboard, as a person without a mouse would; the call is up on `transport`."""
    page.focus("#start")
    page.keyboard.press("Enter")
    page.wait_for_function("() => __demo.state !== 'connecting' && __demo.state !== 'idle'", timeout=WAIT)
    assert demo(page, "state") == "live", demo(page, "errors")
    assert demo(page, "transport") == transport, demo(page, "fallbackReason")
    assert page.evaluate("document.activeElement.id") == "stop"  # focus moved to the next useful control
    page.wait_for_function("() => __demo.session !== null", timeout=WAIT)  # session.created
    assert demo(page, "session.model") == "default" and page.text_content("#info-model") == "default"


def voice_turn(page: Any, out: Path) -> dict[str, Any]:
    """The question heard (VAD, transcript), the reply's text and audio, the turn's latency; -> its details."""
    page.wait_for_function("() => __demo.userFinal.some(t => /capital/i.test(t))", timeout=WAIT)
    assert demo(page, "events['input_audio_buffer.speech_started']") >= 1
    assert demo(page, "events['input_audio_buffer.speech_stopped']") >= 1
    assert "capital" in page.text_content("#log").lower()
    page.wait_for_function("() => __demo.replies.some(r => r.text.trim().length > 0)", timeout=WAIT)
    page.wait_for_function("() => __demo.outputRmsMax > 0.02", timeout=WAIT)  # speech through the analyser
    page.wait_for_function("() => __demo.latencies.length >= 1", timeout=WAIT)
    latency = demo(page, "latencyDetails[0]")
    assert latency["ms"] > 0 and latency["source"] == "page", latency
    assert page.text_content("#latency").strip() == f"{latency['ms']} ms"
    page.screenshot(path=str(out / "2-reply.png"))
    return latency


def barge_in(page: Any, out: Path) -> None:
    """The question comes again over the reply (the fake microphone loops): playback stops, the item is cut to
    what was heard, which the page shows."""
    page.wait_for_function("() => __demo.bargeIns.some(b => b.stoppedAfterMs !== null)", timeout=WAIT)
    page.wait_for_function("() => __demo.events['conversation.item.truncated'] >= 1", timeout=WAIT)
    page.wait_for_function("() => __demo.replies.some(r => r.heard !== undefined)", timeout=WAIT)
    cut = next(r for r in demo(page, "replies") if "heard" in r)
    assert len(cut["heard"].strip()) < len(cut["text"].strip()), cut  # what the session keeps: what was heard
    page.screenshot(path=str(out / "3-barge-in.png"), full_page=True)


def phone(page: Any, out: Path) -> None:
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")  # nothing off-screen
    page.screenshot(path=str(out / "4-phone.png"), full_page=True)


def stop_and_check_nothing_left(page: Any, console: list[str]) -> None:
    """Stop from the keyboard: the server holds no connection and no session afterwards; no page error."""
    assert demo(page, "errors") == [], demo(page, "errors")
    page.focus("#stop")
    page.keyboard.press("Enter")
    page.wait_for_function("() => __demo.state === 'idle'", timeout=WAIT)
    page.wait_for_function("() => fetch('/healthz').then(r => r.json())"
                           ".then(h => h.connections === 0 && h.sessions_open === 0)", timeout=WAIT)
    assert not [m for m in console if m.startswith(("pageerror", "error"))], console
