"""Chat turns on one persistent session, rendered incrementally by the checkpoint's chat template.

A `ChatTranscript` keeps a conversation (messages `{"role", "content"}`) on one `Session`: the session's
tokens stand for the template's rendering of it, yet only each new turn's text is tokenized and appended.
- A message: the conversation is rendered with it; the old rendering must be a prefix of the new one
  (else: `TemplateNotIncrementalError`, nothing changes) and only the difference is appended. A default
  system prompt a template inserts on the first turn (SmolLM2's) or its BOS (Gemma's) is part of the
  first difference (appended without the tokenizer's own special tokens: a BOS is never doubled).
- A reply: the generation prompt is appended first; the model's tokens join the session as generated, the
  stop token included. The generated text becomes the assistant message; its tokens are kept as far as their
  text agrees with the conversation rendered again, the rest is cut (a stop token that is not the end of
  turn, whitespace Gemma's `| trim` drops), and the rendering's remainder (the end of turn after max_tokens
  or a cancel) is `pending`: it goes in with the next turn's chunk, or `settle()`.
- `rewind(n)` keeps the first n messages: the session goes back to where message n's rendering began.
- A message streamed in while it is said (`begin_message`, `extend_message`, `end_message`, `abort_message`):
  engine/chat_stream.py.
- An endless (windowed) session forgets the token ids its window dropped; the transcript then forgets the messages
  all of whose tokens went (engine/chat_log.py): `messages`, `starts` and `offsets` are `GapList`s
  numbered as before, `rendered` is the rendering of the messages kept, and a rewind to a forgotten message is
  refused (`ForgottenMessagesError`, code `tokens_forgotten`). Host memory and each turn's rendering then stay
  bounded by the window, however long the conversation; a session without a window keeps every message.

Blocking methods (`add`, `reply`, `rewind`, `settle`) serve the terminal and tools; asyncio ones the session
service, one at a time in the order asked (`turns`). A turn renders the conversation kept (templates read
`loop.first`, `messages[0]`: a suffix alone is not sound; the head is kept for them) but tokenizes only the new
text. The template half (messages checked, renderings, their tokens, the extension checks) is
engine/chat_render.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamserve.config import SAMPLING_DEFAULTS as SD
from streamserve.engine.chat_log import ForgettingMessages, ForgottenMessagesError, GapList
from streamserve.engine.chat_mark import MarkedChat
from streamserve.engine.chat_render import (
    ROLES,
    ChatMessageError,
    ChatTemplate,
    Message,
    NoChatTemplateError,
    TemplateNotIncrementalError,
    Turn,
    check_message,
    check_reply_params,
)
from streamserve.engine.chat_stream import MessageNotOpenError, MessageOpenError, Offload, StreamedMessages
from streamserve.engine.session import Session
from streamserve.engine.streams import Delta, ResponseStream
from streamserve.engine.work import Ack
from streamserve.errors import ChatTemplateError, InvalidInputError, ResponseInProgressError, RewindError

MIN_REWIND_REACH = 16  # the most a reply's end may be cut back (stop token, trimmed whitespace, broken bytes)
OnDelta = Callable[[ResponseStream, Delta], Awaitable[None]]
__all__ = ["MIN_REWIND_REACH", "ROLES", "ChatMessageError", "ChatReply", "ChatTranscript", "ForgottenMessagesError",
           "Message", "MessageNotOpenError", "MessageOpenError", "NoChatTemplateError", "Offload", "OnDelta",
           "TemplateNotIncrementalError", "Turn", "check_message"]


@dataclass
class _Reply:
    start: int  # where the assistant message's rendering (its generation prompt) begins
    at: int  # where the generated tokens begin
    prompt: str  # the conversation's rendering with the generation prompt
    stop_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()


class ChatTranscript(StreamedMessages, ForgettingMessages, MarkedChat):
    """A conversation on one persistent, initially empty session (see the module's docstring; a message streamed
    in while it is said: engine/chat_stream.py)."""

    def __init__(self, session: Session, state: Mapping[str, Any] | None = None) -> None:
        """`state`: a conversation `export_state` wrote, on a session restored from the same snapshot (a hand-off
        between servers); default: a new conversation on an empty session."""
        tok = session.engine.tokenizer
        if not tok.chat_template:
            raise NoChatTemplateError(f"model {session.engine.name!r} has no chat template (its tokenizer_config.json "
                                      "has no chat_template): use `streamserve generate`, or append plain text")
        if session.token_ids and state is None:
            raise InvalidInputError("a chat transcript starts on an empty session; open a new session for it")
        if any(g.window is not None and g.reach < MIN_REWIND_REACH for g in session.engine.pool.groups):
            raise InvalidInputError(f"chat on a model with sliding-window layers needs --rewind-reach >= "
                                    f"{MIN_REWIND_REACH}: a reply's end may be cut back by a few tokens")
        self.session, self.tokenizer, self.template = session, tok, ChatTemplate(tok)
        self.messages: GapList[Message] = GapList()  # by number; an endless session's forgotten ones not kept
        self.rendered = self.pending = ""  # the messages kept, rendered (no generation prompt); its tail not in
        # the session yet
        self.length = 0  # the session's tokens the transcript accounts for
        self.starts: GapList[int] = GapList()  # per message: the session position where its rendering begins
        self.offsets: GapList[int] = GapList()  # per message: where its rendering begins in `rendered`
        self.forgot: tuple[int, int] | None = None  # where the forgotten messages begin and end in the session
        self._forgets = True  # False once the template rendered the messages kept otherwise without the others
        self.end_of_turn_ids = self.template.end_of_turn_ids()
        self.turns = asyncio.Lock()  # asyncio callers: one chat operation at a time, in the order asked
        self._reply: _Reply | None = None  # between a reply's generation prompt and its record
        self._asked = self._cancelled = 0  # reply tickets handed out; the latest one cancelled
        self._waiting = 0  # replies asked for (async) and not recorded yet
        self.start_messages()  # no message being streamed in
        if state is not None:
            self._load(state)

    # ---- hand-off (server/service/handoff.py): the conversation as plain data, between operations -------------
    def export_state(self) -> dict[str, Any]:
        """The conversation as plain data (str, int, lists, dicts), between operations: InvalidInputError while a
        message is streamed in or a reply runs. Blocking (it may render): off the event loop."""
        self._check_idle()
        if self._waiting:
            raise ResponseInProgressError("a reply was asked for on this chat and has not been recorded")

        def rows(g: GapList[Any]) -> dict[str, Any]:
            return {"rows": g.kept(), "gap": None if g.gap is None else list(g.gap)}

        return {"messages": rows(self.messages), "starts": rows(self.starts), "offsets": rows(self.offsets),
                "rendered": self.rendered, "pending": self.pending, "length": self.length,
                "forgot": None if self.forgot is None else list(self.forgot), "forgets": self._forgets}

    def _load(self, st: Mapping[str, Any]) -> None:
        """`export_state`'s data -> this transcript (ValueError when it does not fit the session)."""
        def rows(d: Any, kind: type) -> GapList[Any]:
            gap = d["gap"]
            if not all(isinstance(r, kind) for r in d["rows"]):
                raise ValueError(f"chat state rows are not all {kind.__name__}")
            return GapList(d["rows"], None if gap is None else (int(gap[0]), int(gap[1])))

        try:
            msgs = rows(st["messages"], dict)
            self.messages = GapList([check_message(m) for m in msgs.kept()], msgs.gap)
            self.starts, self.offsets = rows(st["starts"], int), rows(st["offsets"], int)
            self.rendered, self.pending, self.length = str(st["rendered"]), str(st["pending"]), int(st["length"])
            self.forgot = None if st["forgot"] is None else (int(st["forgot"][0]), int(st["forgot"][1]))
            self._forgets = bool(st["forgets"])
        except (KeyError, TypeError, IndexError, ChatMessageError) as e:
            raise ValueError(f"damaged chat state: {e}") from None
        if not len(self.messages) == len(self.starts) == len(self.offsets) \
                or self.length != len(self.session.token_ids):
            raise ValueError(f"damaged chat state: {len(self.messages)} messages for {len(self.starts)} starts, "
                             f"{self.length} tokens for a session of {len(self.session.token_ids)}")

    # ---- rendering (no engine calls: engine/chat_render.py) ---------------------------------------------
    def render(self, messages: Iterable[Message], generation_prompt: bool = False) -> str:
        return self.template.render(list(messages), generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Template text -> ids: special tokens written in it become their ids; none are added."""
        return self.template.encode(text)

    def _extension(self, longer: str, what: str, shorter: str | None = None) -> str:
        """The text `longer` adds to `shorter` (default: the conversation's rendering), which it must extend."""
        return self.template.extension(longer, self.rendered if shorter is None else shorter, what)

    def _check_idle(self) -> None:
        self._check_no_message()
        if self._reply is not None:
            raise ResponseInProgressError("a reply is running on this chat: read it to its end (or cancel it) first")
        if len(self.session.token_ids) != self.length:
            raise ChatTemplateError(f"the session holds {len(self.session.token_ids)} tokens where its chat "
                                    f"transcript accounts for {self.length}: it was changed outside the transcript; "
                                    "open a new chat session")
        self._forget()  # every operation that renders starts here (off the event loop): the messages rendered
        # are then those the session still keeps

    # ---- planning and recording (the session is read, never waited for, except by `record`) -----------
    def plan_message(self, message: Any) -> Turn:
        """A message, or a list of them rendered and appended as one (for templates that render a system prompt
        differently once a user turn follows it: the two together extend the conversation, one alone does not)."""
        ms = tuple(check_message(m) for m in (message if isinstance(message, list) else [message]))
        if not ms:  # it would plan a turn of no message: one `commit` would take for a reply's generation prompt
            raise ChatMessageError("an empty list of chat messages: send at least one")
        self._check_idle()
        what = " and ".join(f"a {m['role']} message" for m in ms)
        text = self._extension(self.render([*self.messages, *ms]), what)
        closing = self.encode(self.pending)
        ids = closing + self.encode(text)
        if not ids:
            raise ChatTemplateError(f"the chat template renders {what} as nothing")
        return Turn(ids, self.length + len(closing), self.rendered + text, ms)

    def commit(self, turn: Turn) -> None:  # the planned turn is in the session (its chunk was acked)
        if not turn.messages:
            self._reply = _Reply(turn.start, self.length + len(turn.ids), turn.rendered)
        if turn.messages:
            self._take(turn.messages, turn.start, turn.rendered)
        self.pending = ""
        self.length += len(turn.ids)

    def plan_prompt(self) -> Turn:
        self._check_idle()
        text = self._extension(self.render(self.messages, True), "the generation prompt")
        closing = self.encode(self.pending)
        return Turn(closing + self.encode(text), self.length + len(closing), self.rendered + text, ())

    def start_stream(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature,
                     top_p: float = SD.top_p, top_k: int = SD.top_k, seed: int | None = SD.seed,
                     stop: Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None) -> ResponseStream:
        """Start the reply after its generation prompt is in (`commit`). It stops at the model's EOS ids and
        the template's end-of-turn token unless `stop_token_ids` says otherwise."""
        r = self._reply
        if r is None:
            raise InvalidInputError("a chat reply starts after its generation prompt is in the session")
        ids = (*self.session.engine.eos_token_ids, *self.end_of_turn_ids) if stop_token_ids is None else stop_token_ids
        r.stop_ids, r.stop = frozenset(ids), tuple(stop or ())
        try:
            return self.session.stream(max_tokens, temperature, top_p, top_k, seed, stop, list(r.stop_ids))
        except BaseException:
            self._reply = None
            self._cut(r.start)  # the prompt goes again: the transcript stands as before
            raise

    def record(self, stream: ResponseStream) -> str:
        """Blocking: wait for the reply's end and record it as the assistant message; -> its content."""
        r = self._reply
        if r is None:
            raise InvalidInputError("no chat reply to record")
        stream.wait()  # at once if it has ended
        self._reply = None
        log = self.session.token_ids
        # the reply's ids: from the session, or, where an endless session's window already forgot its start (a
        # reply longer than what the window keeps), from the stream, which received every one of them
        ids = list(log[r.at:]) if r.at >= log.base else list(stream.token_ids)
        body = ids[:-1] if stream.finish_reason == "stop" and ids and ids[-1] in r.stop_ids else ids
        content = self.template.decode(body)
        for s in r.stop:  # a stop string ends the reply's text before it
            content = content.split(s, 1)[0]
        m: Message = {"role": "assistant", "content": content}
        try:
            full = self.render([*self.messages, m])
            tail = self._extension(full, "the reply", r.prompt)  # the content as rendered, then the turn's end
        except ChatTemplateError:
            self._cut(r.start)  # the reply and its prompt go: the transcript stands as before it
            raise
        keep, text = self.template.agreeing(ids, tail)
        if keep < len(ids):
            self.session.rewind(to=r.at + keep)
        self._take((m,), r.start, full)
        self.pending, self.length = tail[len(text):], r.at + keep
        return content

    def _take(self, messages: Sequence[Message], start: int, rendered: str) -> None:  # appended together: one
        # start for all (a rewind keeps all or none of them); `rendered`: the conversation's rendering with them
        self.messages.extend(messages)
        self.starts.extend([start] * len(messages))
        self.offsets.extend([len(self.rendered)] * len(messages))
        self.rendered = rendered

    def _cut(self, to: int) -> None:  # back to an earlier point of this transcript's own text
        if not self.session.closed and len(self.session.token_ids) > to:
            self.session.rewind(to=to)
        self.length = to

    # ---- blocking use (the terminal, tools, tests) -----------------------------------------------------
    def add(self, message: Any, **chunk: Any) -> Ack:
        """Append a message (`chunk`: Session.append_chunk's seq, capture_time, deadline); -> its chunk's ack."""
        turn = self.plan_message(message)
        ack = self.session.append_chunk(token_ids=turn.ids, **chunk)
        self.commit(turn)
        return ack

    def reply(self, seq: int | None = None, **sampling: Any) -> ChatReply:
        """Append the generation prompt and start the reply (`sampling`: `start_stream`'s parameters)."""
        check_reply_params(sampling)
        turn = self.plan_prompt()
        if turn.ids:
            self.session.append_chunk(token_ids=turn.ids, seq=seq)
        self.commit(turn)
        return ChatReply(self, self.start_stream(**sampling))

    def rewind(self, messages: int) -> int:
        """Keep the first `messages` messages (a reply must have ended); -> the session's length. On an endless
        session, ForgottenMessagesError when message `messages` was forgotten (no rewind reaches it)."""
        if isinstance(messages, bool) or not isinstance(messages, int) or not 0 <= messages <= len(self.messages):
            raise RewindError(f"cannot keep {messages!r} messages: the chat has {len(self.messages)}")
        self._check_idle()
        if messages < len(self.messages):
            to = self.starts[messages]  # ForgottenMessagesError for a forgotten message
            gap = self.messages.gap  # (forgotten messages go whole groups at a time: none of them shares `to`)
            while messages > 0 and (gap is None or not gap[0] < messages <= gap[1]) \
                    and self.starts[messages - 1] == to:
                messages -= 1  # inside messages appended together: back to the first of them
            self.session.rewind(to=to)
            del self.messages[messages:], self.starts[messages:]
            self.rendered, self.pending, self.length = self.rendered[:self.offsets[messages]], "", to
            del self.offsets[messages:]
            if self.messages.gap is None:  # back into the head: nothing is forgotten any more
                self.forgot = None
        return self.length

    def settle(self) -> None:
        """Append the pending end of the last reply's turn now (one chunk): the session is then the rendering."""
        self._check_idle()
        if ids := self.encode(self.pending):
            self.session.append_chunk(token_ids=ids)
            self.pending, self.length = "", self.length + len(ids)

    # ---- asyncio use (the session service): one operation at a time, in order ---------------------------
    async def add_async(self, message: Any, offload: Offload, **chunk: Any) -> Ack:
        async with self.turns:
            turn = await offload(self.plan_message, message)  # renders and tokenizes: off the event loop
            ack = await asyncio.wrap_future(self.session.submit_chunk(token_ids=turn.ids, **chunk))
            self.commit(turn)
            return ack

    def ask_reply(self, sampling: Mapping[str, Any]) -> int:
        """A reply is asked for (checked now, run by `reply_async` in its turn); -> its ticket."""
        if self._waiting:
            raise ResponseInProgressError("this chat already has a reply running or asked for: cancel it or wait")
        check_reply_params(sampling)
        self._waiting, self._asked = self._waiting + 1, self._asked + 1
        return self._asked

    def cancel(self) -> None:
        """End the running reply and any asked for that has not started (its `reply_async` returns None)."""
        self._cancelled = self._asked
        self.session.cancel()

    async def reply_async(self, ticket: int, on_delta: OnDelta, offload: Offload, seq: int | None = None,
                          **sampling: Any) -> ResponseStream | None:
        """Append the generation prompt (chunk `seq`), stream the reply to `on_delta`, record it; -> the
        ended stream, or None when cancelled before it started."""
        try:
            async with self.turns:
                if ticket <= self._cancelled:
                    return None
                turn = await offload(self.plan_prompt)
                if turn.ids:
                    await asyncio.wrap_future(self.session.submit_chunk(token_ids=turn.ids, seq=seq))
                self.commit(turn)
                stream = await offload(lambda: self.start_stream(**sampling))
                if ticket <= self._cancelled:
                    stream.cancel()
                ended = False
                try:
                    async for d in stream:
                        await on_delta(stream, d)
                    ended = True
                finally:
                    if not ended:  # a consumer's failure or an engine error: the reply ends, and is recorded
                        stream.cancel()
                    if not self.session.closed:
                        await offload(self.record, stream)
                return stream
        finally:
            self._waiting -= 1

    async def rewind_async(self, offload: Offload, messages: int | None = None, to: int | None = None,
                           to_seq: int | None = None) -> int:
        """`rewind` to `messages`, or to the messages whole in the first `to` tokens or up to chunk `to_seq`, after
        ending a running or asked-for reply (which is recorded first)."""
        self.cancel()
        async with self.turns:
            return await offload(self.rewind, messages if messages is not None else self.messages_within(to, to_seq))


class ChatReply:
    """A reply on a chat transcript: iterate it for its `Delta`s; at its end (or `wait()`) it is recorded as
    the assistant message (`content`). `stream.cancel()` ends it early; what was generated is recorded."""

    def __init__(self, chat: ChatTranscript, stream: ResponseStream) -> None:
        self.chat, self.stream = chat, stream
        self.content: str | None = None

    def __iter__(self) -> ChatReply:
        return self

    def __next__(self) -> Delta:
        try:
            return next(self.stream)
        except StopIteration:
            self.wait()
            raise

    def wait(self) -> str:
        """Block until the reply ends and is recorded; -> the assistant message's content."""
        if self.content is None:
            self.content = self.chat.record(self.stream)
        return self.content

