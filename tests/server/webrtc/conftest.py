"""Fixtures of the WebRTC call tests: loopback only (see rtc.py), and the voice models' skip."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rtc import pin_to_loopback
from voice_assets import needs_voice

pytest.importorskip("aiortc", reason="aiortc is not installed: it comes with the webrtc extra")


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """ICE host candidates are 127.0.0.1 only, and a UDP datagram to anything else fails the test."""
    refused = pin_to_loopback(monkeypatch)
    yield refused
    assert not refused, refused


@pytest.fixture(scope="module")
def voiced() -> None:
    needs_voice()


