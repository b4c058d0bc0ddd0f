"""A chat message streamed into the session while it is being said (speech transcribed as the person speaks, text
as it is typed): its header goes in at `begin_message`, its words at each `extend_message`, the end of its turn at
`end_message`; `abort_message` takes it all out again.

The session's text stays the template's rendering (engine/chat.py's invariant), though the content is not known
when the message begins:
- begin: the conversation is rendered with the message's content as a sentinel (two sentinels, whose renderings
  part where the content begins however the template transforms it) and cut there; what lies before (the pending
  end of the last turn, the role's header) is appended.
- extend: the text goes in as it comes. Whitespace is kept out of the session where a template's `| trim` may
  drop it: at the content's start (dropped: the content begins at its first non-space character) and at the end
  of each piece (held back: it goes in before the next piece's text, or with the end of the turn). So a trimming
  template (Gemma's) and a verbatim one (ChatML) both find the session's text a prefix of their rendering.
- end: the conversation is rendered with the whole content; when the session's text is a prefix of it, only the
  rest (the end of the turn) is appended. When it is not (a template that rewrites content, or a tokenizer whose
  pieces do not decode back to their text), the session is cut back to the message's start and the message's
  whole rendering appended: correct, at the cost of one message's prefill again. The message is then recorded
  as `add` would have recorded it (`{role, content}`, its start for `rewind`).
- abort: the session goes back to before `begin` (the pending end of the last turn pending again).

The token ids may differ from `add`'s of the same message only where the pieces met (each piece is tokenized
alone); the text, and so the model's reading of it, is the same.

Asyncio callers (the session service): `begin_message_async` takes the transcript's `turns` in its order and
keeps it until `end_message_async` or `abort_message_async`: a message added, a reply asked for or a rewind while
the message is open waits until it ends. The message's own operations run in the order asked (`message_ops`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamserve.engine.chat_log import GapList
from streamserve.engine.chat_render import ChatMessageError, ChatTemplate, Message, check_role
from streamserve.engine.session import Session
from streamserve.engine.work import Ack
from streamserve.errors import ChatTemplateError, InvalidInputError

# two contents no template writes, that differ from their first character, which no `| trim` drops
PROBES = ("\x00streamserve-probe-a\x00", "\x01streamserve-probe-b\x01")
Offload = Callable[..., Awaitable[Any]]  # offload(fn, *args) runs fn off the event loop, -> its result


class MessageOpenError(InvalidInputError):
    """A message is being streamed into this chat: end it (or abort it) before anything else goes in."""

    code = "message_in_progress"


class MessageNotOpenError(InvalidInputError):
    """A streamed message's extend or end without a begin."""

    code = "no_open_message"


@dataclass
class OpenMessage:
    """A message being streamed into the session (between `begin_message` and its end)."""

    role: str
    before: int  # the session's length before begin (the last turn's pending end not in yet)
    pending: str  # the transcript's pending text before begin (it goes back to it at an abort)
    start: int  # where the message's rendering begins in the session (after that pending end)
    text: str  # the message's rendering so far in the session: its header, then the content but `held`
    content: str = ""  # the content so far (its leading whitespace dropped), `held` included
    held: str = ""  # trailing whitespace of the content not in the session yet

    def piece(self, text: str) -> tuple[str, str, str]:
        """A piece of content as it arrives -> (what the content gains, the text to append, what is held back)."""
        gained = text if self.content else text.lstrip()
        body = self.held + gained
        shown = body.rstrip()
        return gained, shown, body[len(shown):]


@dataclass(frozen=True)
class Piece:
    """A planned extend: its `ids` (the tokens of `text`), the content it adds, the whitespace held after it."""

    ids: list[int]
    content: str
    text: str
    held: str


def no_chunk(chunk: Mapping[str, Any]) -> Ack:
    """The ack of a piece that appended nothing (whitespace held back): 0 tokens; no seq was used (-1 unless the
    caller named one)."""
    seq = chunk.get("seq")
    return Ack(-1 if seq is None else int(seq), 0, 0.0, 0.0)


class StreamedMessages:
    """ChatTranscript's streamed messages (a mixin: ChatTranscript, engine/chat.py, holds the conversation's state
    and calls `start_messages` from its constructor; see this module's docstring)."""

    session: Session
    template: ChatTemplate
    messages: GapList[Message]  # numbered from the first message; a windowed chat forgets old ones
    rendered: str
    pending: str
    length: int
    turns: asyncio.Lock
    if TYPE_CHECKING:  # ChatTranscript's own state changes, which a message's end and abort make too
        def render(self, messages: Sequence[Message], generation_prompt: bool = False) -> str: ...
        def encode(self, text: str) -> list[int]: ...
        def _extension(self, longer: str, what: str, shorter: str | None = None) -> str: ...
        def _check_idle(self) -> None: ...
        def _take(self, messages: Sequence[Message], start: int, rendered: str) -> None: ...
        def _cut(self, to: int) -> None: ...

    def start_messages(self) -> None:
        self.open_message: OpenMessage | None = None
        self.message_ops = asyncio.Lock()  # asyncio callers: begin, extends, end or abort in the order asked
        self._holds_turns = False  # an asyncio begin holds `turns` until the message's end or abort

    def _check_no_message(self) -> None:
        """MessageOpenError while a message is open (ChatTranscript's other operations call this)."""
        if self.open_message is not None:
            raise MessageOpenError(f"a {self.open_message.role} message is being streamed into this chat: end it "
                                   "(or abort it) first")

    def _opened(self) -> OpenMessage:
        msg = self.open_message
        if msg is None:
            raise MessageNotOpenError("no message is being streamed into this chat: begin one first")
        if len(self.session.token_ids) != self.length:
            raise ChatTemplateError(f"the session holds {len(self.session.token_ids)} tokens where its chat "
                                    f"transcript accounts for {self.length}: it was changed outside the transcript; "
                                    "open a new chat session")
        return msg

    # ---- planning and recording ------------------------------------------------------------------------
    def plan_begin(self, role: str) -> tuple[OpenMessage, list[int]]:
        """The open message and the ids that begin it (the pending end of the last turn, the role's header)."""
        role = check_role(role)
        self._check_idle()  # no reply running, no message open, the session as the transcript left it
        # rendered with two contents that differ from their first character on: the renderings part where the
        # content begins, however the template writes it (verbatim, trimmed, upper-cased...)
        a, b = (self.render([*self.messages, {"role": role, "content": c}]) for c in PROBES)
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        if a == b:
            raise ChatTemplateError(f"the chat template renders no content for a {role} message here, so it cannot "
                                    "be streamed; append it whole (add) instead")
        head = self._extension(a[:at], f"a {role} message")
        closing = self.encode(self.pending)
        msg = OpenMessage(role, self.length, self.pending, self.length + len(closing), head)
        return msg, closing + self.encode(head)

    def _began(self, msg: OpenMessage, ids: list[int]) -> None:  # its ids are in the session
        self.open_message, self.pending, self.length = msg, "", self.length + len(ids)

    def plan_extend(self, text: str) -> Piece:
        if not isinstance(text, str):
            raise ChatMessageError(f"a message's content is text, got {type(text).__name__}")
        msg = self._opened()
        gained, shown, held = msg.piece(text)
        return Piece(self.encode(shown), gained, shown, held)

    def _extended(self, piece: Piece) -> None:  # its ids are in the session
        msg = self.open_message
        if msg is None:  # dropped meanwhile: the session is gone
            return
        msg.content, msg.text, msg.held = msg.content + piece.content, msg.text + piece.text, piece.held
        self.length += len(piece.ids)

    def plan_end(self) -> tuple[list[int], Message, str]:
        """-> (the ids that end the message, the message, the conversation's rendering with it). Where the
        session's text is not a prefix of that rendering, the session is first cut back to the message's start."""
        msg = self._opened()
        m: Message = {"role": msg.role, "content": msg.content}
        try:
            full = self.render([*self.messages, m])
            tail = self._extension(full, f"the streamed {msg.role} message")  # the message's whole rendering
        except ChatTemplateError as e:
            self.abort_message()
            raise type(e)(f"{e} (the streamed message was dropped: the chat stands as before it began)") from None
        ids = self.session.token_ids
        if not (tail.startswith(msg.text) and self.template.text_after(ids, msg.start) == msg.text):
            self._cut(msg.start)  # the message goes in again, whole, as its rendering writes it
            msg.text = ""
        return self.encode(tail[len(msg.text):]), m, full

    def _ended(self, m: Message, full: str, ids: list[int]) -> None:  # its ids are in the session
        msg = self.open_message
        if msg is None:  # dropped meanwhile: the session is gone
            return
        self._take((m,), msg.start, full)
        self.open_message, self.length = None, self.length + len(ids)

    def _append(self, ids: list[int], chunk: Mapping[str, Any]) -> Ack:
        return self.session.append_chunk(token_ids=ids, **chunk) if ids else no_chunk(chunk)

    async def _submit(self, ids: list[int], chunk: Mapping[str, Any]) -> Ack:
        if not ids:
            return no_chunk(chunk)
        return await asyncio.wrap_future(self.session.submit_chunk(token_ids=ids, **chunk))

    # ---- blocking use ------------------------------------------------------------------------------------
    def begin_message(self, role: str, **chunk: Any) -> Ack:
        """Open a `role` message: the pending end of the last turn and the role's header go in (`chunk`:
        Session.append_chunk's seq, capture_time, deadline); -> its chunk's ack. MessageOpenError when a message
        is open, ResponseInProgressError while a reply runs."""
        msg, ids = self.plan_begin(role)
        ack = self._append(ids, chunk)
        self._began(msg, ids)
        return ack

    def extend_message(self, text: str, **chunk: Any) -> Ack:
        """Append `text` to the open message's content; -> its chunk's ack (0 tokens: all of it held back)."""
        piece = self.plan_extend(text)
        ack = self._append(piece.ids, chunk)
        self._extended(piece)
        return ack

    def end_message(self, **chunk: Any) -> Message:
        """Close the open message (the end of its turn goes in) and record it; -> the message {role, content}."""
        ids, m, full = self.plan_end()
        self._append(ids, chunk)
        self._ended(m, full, ids)
        return m

    def abort_message(self) -> bool:
        """Take the open message out: the session and the chat as before its begin; -> False if none was open."""
        msg = self.open_message
        if msg is None:
            return False
        self._cut(msg.before)  # (a refused cut raises here, and the message stays open)
        self.open_message, self.pending = None, msg.pending
        return True

    # ---- asyncio use (the session service) --------------------------------------------------------------
    async def begin_message_async(self, role: str, offload: Offload, **chunk: Any) -> Ack:
        """`begin_message` after the chat's earlier operations; the chat's `turns` stay taken until the message
        ends or is aborted (a message, reply or rewind asked meanwhile goes after it)."""
        async with self.message_ops:
            self._check_no_message()  # a second begin, asked before the first message's end, is refused
            await self.turns.acquire()
            try:
                msg, ids = await offload(self.plan_begin, role)  # renders and tokenizes: off the event loop
                ack = await self._submit(ids, chunk)
                self._began(msg, ids)
                self._holds_turns = True
                return ack
            finally:
                if not self._holds_turns:
                    self.turns.release()

    async def extend_message_async(self, text: str, offload: Offload, **chunk: Any) -> Ack:
        async with self.message_ops:
            piece = await offload(self.plan_extend, text)
            ack = await self._submit(piece.ids, chunk)
            self._extended(piece)
            return ack

    async def end_message_async(self, offload: Offload, **chunk: Any) -> Message:
        async with self.message_ops:
            try:
                ids, m, full = await offload(self.plan_end)  # may cut the session: on the offload thread
                await self._submit(ids, chunk)
                self._ended(m, full, ids)
                return m
            finally:
                self._release_turns()

    async def abort_message_async(self, offload: Offload) -> bool:
        async with self.message_ops:
            try:
                return bool(await offload(self.abort_message))
            finally:
                self._release_turns()

    def drop_message(self) -> None:
        """The session is gone (closed, expired): forget its open message, and let what waits for it go on (to
        find the session closed)."""
        self.open_message = None
        self._release_turns()

    def _release_turns(self) -> None:
        if self._holds_turns and self.open_message is None:
            self._holds_turns = False
            self.turns.release()
