"""Fixtures of the WebRTC call tests: loopback only (see rtc.py), and the voice models' skip."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rtc import is_loopback
from voice_assets import needs_voice

pytest.importorskip("aiortc", reason="aiortc is not installed: it comes with the webrtc extra")


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """ICE host candidates are 127.0.0.1 only, and a UDP datagram to anything else fails the test."""
    from asyncio import selector_events

    import aioice.ice

    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    refused: list[Any] = []
    original = selector_events._SelectorDatagramTransport.sendto

    def sendto(self: Any, data: bytes, addr: Any = None) -> None:
        target = addr if addr is not None else self.get_extra_info("peername")
        if target is not None and not is_loopback(str(target[0])):
            refused.append(target)
            raise AssertionError(f"a datagram to {target} (not loopback)")
        original(self, data, addr)

    monkeypatch.setattr(selector_events._SelectorDatagramTransport, "sendto", sendto)
    yield refused
    assert not refused, refused


@pytest.fixture(scope="module")
def voiced() -> None:
    needs_voice()


