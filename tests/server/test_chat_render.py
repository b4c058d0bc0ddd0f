"""The native adapter renders the chat fields from the service's results alone (no side lookups)."""

from __future__ import annotations

from streamserve.server.adapters import protocol as P
from streamserve.server.adapters.native import render, render_hello
from streamserve.server.service.results import Limits, Opened, ServerInfo

LIMITS = Limits(1 << 20, 256, 4, 100.0, 1e6, 30.0, 128, 4096, None, None, 0.0)


def opened(chat: bool) -> Opened:
    return Opened("s1", "token", False, 0, 0, None, 4, "absolute", 200.0, 8, chat)


def test_opened_says_whether_the_session_is_a_chat_session() -> None:
    assert render(opened(True), 7)["chat"] is True
    assert render(opened(False), 7)["chat"] is False  # said, not left out: a client need not guess a default
    assert P.decode_client(P.encode({"type": "open", "chat": True}), 1 << 20).fields["chat"] is True


def test_hello_says_whether_the_model_has_a_chat_template() -> None:
    info = ServerInfo("m", "qwen3", 300, 1024, ("text",), LIMITS)
    assert render_hello(info)["chat_template"] is False
    assert render_hello(ServerInfo("m", "qwen3", 300, 1024, ("text",), LIMITS, chat_template=True))["chat_template"]
