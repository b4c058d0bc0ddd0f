"""A mark on a chat transcript, and the exact return to it: how a speculative turn is taken back.

A voice session starts its reply while the person may still be speaking (the VAD's first silence, before its
hangover confirms the turn: server/media/voice/speculate.py). The person's message is ended and the reply runs; if
speech resumes, both go, and the chat must stand exactly where it stood at the mark: the same token ids in the session
(its KV cut back to the mark's length: Session.rewind), the same messages, and the same message open (streamed in,
with the same content and held whitespace), so that the resumed utterance's next words extend it as if nothing had
happened.

    m = chat.mark()         # between operations: no reply running, no chunk of the chat's in flight
    ... end the open message, run a reply (recorded as the assistant's message) ...
    chat.cancel(); ... wait for the reply's end ...
    await chat.restore_async(offload, m)    # the reply's recording is cut away with the rest

A mark is plain data (a copy of the transcript's bookkeeping and the session's length); it does not pin the
session: anything may happen after it, and `restore` refuses (RewindError) only when the session cannot go back,
e.g. an endless session's window forgot tokens the mark holds.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from streamserve.engine.session import Session
from streamserve.errors import ChatTemplateError, ResponseInProgressError, RewindError

Offload = Callable[..., Awaitable[Any]]  # offload(fn, *args) runs fn off the event loop, -> its result

# ChatTranscript's (and its mixins') state that its operations change: what a mark copies and a restore sets back
STATE = ("messages", "starts", "offsets", "rendered", "pending", "length", "forgot", "_forgets", "open_message")


@dataclass(frozen=True)
class ChatMark:
    state: dict[str, Any]  # copies of STATE's attributes
    tokens: int  # the session's length at the mark
    gap: Any  # the session's forgotten positions at the mark (an endless session's): a restore needs the same


class MarkedChat:
    """ChatTranscript's marks (a mixin: ChatTranscript, engine/chat.py, holds the state; see the module's docstring)."""

    session: Session
    length: int
    open_message: Any
    turns: asyncio.Lock
    message_ops: asyncio.Lock
    _reply: Any
    _waiting: int
    _holds_turns: bool

    @property
    def reply_pending(self) -> bool:
        """A reply was asked for and has not ended (recorded) yet."""
        return bool(self._waiting)

    def mark(self) -> ChatMark:
        """The chat as it stands now. ResponseInProgressError while a reply runs; ChatTemplateError when the session
        holds tokens the transcript does not account for (a chunk in flight: mark between operations)."""
        if self._reply is not None:
            raise ResponseInProgressError("a reply is running on this chat: mark it between replies")
        if len(self.session.token_ids) != self.length:
            raise ChatTemplateError(f"the session holds {len(self.session.token_ids)} tokens where its chat "
                                    f"transcript accounts for {self.length}: mark the chat between its operations")
        state = {name: copy.deepcopy(getattr(self, name)) for name in STATE}
        return ChatMark(state, self.length, self.session.token_ids.gap)

    def restore(self, m: ChatMark) -> None:
        """Blocking: the session cut back to the mark's length and the transcript's state set back (no reply
        running: `restore_async` waits for it). RewindError when the session cannot go back (nothing changed)."""
        if self._reply is not None:
            raise ResponseInProgressError("a reply is running on this chat: end it before going back to a mark")
        if self.session.token_ids.gap != m.gap or len(self.session.token_ids) < m.tokens:
            raise RewindError("this chat cannot go back to the mark: its session forgot tokens since (an endless "
                              "session's window moved on)")
        if len(self.session.token_ids) > m.tokens:
            self.session.rewind(to=m.tokens)
        for name, value in m.state.items():
            setattr(self, name, copy.deepcopy(value))  # the mark stays usable: a second restore gets the same

    async def restore_async(self, offload: Offload, m: ChatMark) -> None:
        """`restore` in the chat's turn, once the replies asked for have ended (cancel them and wait for their end:
        a reply still waiting for its turn would wait behind a restored open message; ResponseInProgressError,
        nothing changed). When the mark had a message open, the chat's `turns` stay taken as after that message's
        begin (its extends, end or abort follow)."""
        if self._waiting:
            raise ResponseInProgressError("a reply asked for on this chat has not ended: cancel it and wait for its "
                                          "end before going back to a mark")
        async with self.message_ops:
            await self.turns.acquire()
            holds = False
            try:
                await offload(self.restore, m)
                holds = self.open_message is not None
                self._holds_turns = holds
            finally:
                if not holds:
                    self.turns.release()


__all__ = ["ChatMark", "MarkedChat"]
