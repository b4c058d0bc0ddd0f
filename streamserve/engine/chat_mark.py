"""A mark on a chat transcript, and the exact return to it: how a speculative turn is taken back.

A voice session starts its reply while the person may still be speaking (the VAD's first silence, before its
hangover confirms the turn: server/voice/speculate.py). The person's message is ended and the reply runs; if speech
resumes, both go, and the chat must stand exactly where it stood at the mark: the same token ids in the session
(its KV cut back to the mark's length: Session.rewind), the same messages, and the same message open (streamed in,
with the same content and held whitespace), so that the resumed utterance's next words extend it as if nothing had
happened.

    m = mark(chat)          # between operations: no reply running, no chunk of the chat's in flight
    ... end the open message, run a reply (recorded as the assistant's message) ...
    chat.cancel(); ... wait for the reply's end ...
    await restore_async(chat, offload, m)   # the reply's recording is cut away with the rest

A mark is plain data (a copy of the transcript's bookkeeping and the session's length); it does not pin the
session: anything may happen after it, and `restore` refuses (RewindError) only when the session cannot go back,
e.g. an endless session's window forgot tokens the mark holds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamserve.engine.session import RewindError

if TYPE_CHECKING:
    from streamserve.engine.chat import ChatTranscript
    from streamserve.engine.chat_stream import Offload

# ChatTranscript's (and its mixins') state that its operations change: what a mark copies and a restore sets back
STATE = ("messages", "starts", "offsets", "rendered", "pending", "length", "forgot", "_forgets", "open_message")


@dataclass(frozen=True)
class ChatMark:
    state: dict[str, Any]  # copies of STATE's attributes
    tokens: int  # the session's length at the mark
    gap: Any  # the session's forgotten positions at the mark (an endless session's): a restore needs the same


def mark(chat: ChatTranscript) -> ChatMark:
    """The chat as it stands now. ResponseInProgressError while a reply runs; ChatTemplateError when the session
    holds tokens the transcript does not account for (a chunk of the chat's in flight: mark between operations)."""
    from streamserve.errors import ChatTemplateError, ResponseInProgressError

    if chat._reply is not None:
        raise ResponseInProgressError("a reply is running on this chat: mark it between replies")
    if len(chat.session.token_ids) != chat.length:
        raise ChatTemplateError(f"the session holds {len(chat.session.token_ids)} tokens where its chat transcript "
                                f"accounts for {chat.length}: mark the chat between its operations")
    state = {name: copy.deepcopy(getattr(chat, name)) for name in STATE}
    return ChatMark(state, chat.length, chat.session.token_ids.gap)


def restore(chat: ChatTranscript, m: ChatMark) -> None:
    """Blocking: the session cut back to the mark's length and the transcript's state set back (no reply running:
    `restore_async` ends it first). RewindError when the session cannot go back (nothing is changed)."""
    from streamserve.errors import ResponseInProgressError

    if chat._reply is not None:
        raise ResponseInProgressError("a reply is running on this chat: end it before going back to a mark")
    if chat.session.token_ids.gap != m.gap or len(chat.session.token_ids) < m.tokens:
        raise RewindError("this chat cannot go back to the mark: its session forgot tokens since (an endless "
                          "session's window moved on)")
    if len(chat.session.token_ids) > m.tokens:
        chat.session.rewind(to=m.tokens)
    for name, value in m.state.items():
        setattr(chat, name, copy.deepcopy(value))  # the mark stays usable: a second restore gets the same


async def restore_async(chat: ChatTranscript, offload: Offload, m: ChatMark) -> None:
    """`restore` in the chat's turn, once the replies asked for have ended (cancel them and wait for their end: a
    reply still waiting for its turn would wait behind a restored open message; ResponseInProgressError, nothing
    changed). When the mark had a message open, the chat's `turns` stay taken as after that message's begin (its
    extends, end or abort follow)."""
    from streamserve.errors import ResponseInProgressError

    if chat._waiting:
        raise ResponseInProgressError("a reply asked for on this chat has not ended: cancel it and wait for its end "
                                      "before going back to a mark")
    async with chat.message_ops:
        await chat.turns.acquire()
        holds = False
        try:
            await offload(restore, chat, m)
            holds = chat.open_message is not None
            chat._holds_turns = holds
        finally:
            if not holds:
                chat.turns.release()


__all__ = ["ChatMark", "mark", "restore", "restore_async"]
