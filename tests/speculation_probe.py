"""A probe for the speculation tests (realtime and native): every take-back compared with the chat at its mark."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from streamserve.engine.chat import ChatTranscript


def watch_take_backs(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[tuple[bool, bool, bool]]:
    """ChatTranscript.mark notes the chat as it stands; `module.take_back`, once done, compares the chat with the
    last note -> one (token ids equal, messages equal, open message equal) per take-back, filled as they happen."""
    marks: list[tuple[Any, list[int], list[Any], Any]] = []
    checks: list[tuple[bool, bool, bool]] = []
    real_mark, real_take_back = ChatTranscript.mark, module.take_back

    def marking(chat: Any) -> Any:
        m = real_mark(chat)
        marks.append((chat, list(chat.session.token_ids), list(chat.messages), copy.copy(chat.open_message)))
        return m

    async def taking_back(*args: Any, **kw: Any) -> None:
        await real_take_back(*args, **kw)
        chat, ids, messages, open_message = marks[-1]
        checks.append((list(chat.session.token_ids) == ids, list(chat.messages) == messages,
                       chat.open_message == open_message))

    monkeypatch.setattr(ChatTranscript, "mark", marking)
    monkeypatch.setattr(module, "take_back", taking_back)
    return checks
