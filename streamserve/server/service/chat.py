"""Chat sessions in the session service: a session opened with `chat` takes messages ({role, content})
instead of text or token ids, and its replies are recorded as the assistant's messages.

Each chat session has a `ChatTranscript` (engine/chat.py: the template's rendering of the conversation,
appended turn by turn), kept here by session id for as long as the session lives, resumes included.
A chat session's operations run one at a time in the order asked (the transcript's `turns`): a message
appended while a reply runs goes in after it, as a chunk would. A reply runs as a service task, not a
connection's, so that it is recorded even when the connection goes (its output is then dropped).
A message may also be streamed in while it is said (`begin`, `extend`..., then `end` or `abort`: speech
transcribed as the person speaks); the chat's other operations asked meanwhile wait for its end.
A chat session with a window (an endless one) keeps a bounded transcript: the messages whose tokens the session
forgot are forgotten too (engine/chat_log.py), still counted (`message_count`, `to_message`), and a rewind to one
is refused with `tokens_forgotten`.
(Split from service.py, which calls this and owns the rest of the service.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from streamserve.engine import Engine, Session
from streamserve.engine.chat import (
    ChatMessageError,
    ChatTranscript,
    Message,
    NoChatTemplateError,
    Offload,
    check_message,
)
from streamserve.engine.chat_render import check_role
from streamserve.engine.streams import Delta, ResponseStream
from streamserve.engine.work import Ack
from streamserve.errors import InvalidInputError
from streamserve.server.service.results import AppendRequest, ReplyDelta, ReplyDone, ResultListener, service_error


class NotChatSessionError(InvalidInputError):
    """A chat message (or a rewind to a message) on a session opened without `chat`."""

    code = "not_chat_session"


class ChatSessions:
    def __init__(self, engine: Engine, offload: Offload, spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.engine, self.offload, self.spawn = engine, offload, spawn  # the service's executor and task set
        self.transcripts: dict[str, ChatTranscript] = {}

    @property
    def available(self) -> bool:
        """Whether the model has a chat template (chat sessions need one)."""
        return bool(self.engine.tokenizer.chat_template)

    def check_open(self, chat: bool) -> None:
        """NoChatTemplateError for a chat session on a model without a chat template."""
        if chat and not self.available:
            raise NoChatTemplateError(f"model {self.engine.name!r} has no chat template: open a session without chat "
                                      "and append text")

    def start(self, session: Session, chat: bool) -> None:
        """`session` (just opened, empty) is a chat session if `chat`."""
        if chat:
            self.transcripts[session.id] = ChatTranscript(session)

    def export(self, session_id: str) -> dict[str, Any] | None:
        """A chat session's conversation as plain data for a hand-off (server/service/handoff.py; between operations,
        blocking); None for a plain session."""
        chat = self.transcripts.get(session_id)
        return None if chat is None else chat.export_state()

    def adopt(self, session: Session, state: dict[str, Any] | None) -> None:
        """`session` (restored from a hand-off record) continues the conversation `state` (None: a plain session);
        ValueError when the state does not fit the session."""
        if state is not None:
            self.transcripts[session.id] = ChatTranscript(session, state)

    def get(self, session_id: str) -> ChatTranscript | None:
        return self.transcripts.get(session_id)

    def forget(self, session_id: str) -> None:
        chat = self.transcripts.pop(session_id, None)
        if chat is not None:
            chat.drop_message()  # what waits for a message that will never end goes on (to a closed session)

    def cancel(self, session_id: str) -> None:
        """End a chat session's running reply and any asked for that has not started (never starts)."""
        chat = self.transcripts.get(session_id)
        if chat is not None:
            chat.cancel()

    def check_append(self, session_id: str, message: Any, req: AppendRequest
                     ) -> tuple[Message | list[Message] | None, AppendRequest]:
        """-> (the checked message of a chat session's append, or list of messages appended together; None for a
        plain session's; the request, whose text is the messages' content for the service's size checks), or the
        typed error of a message on a plain session, or of text or token ids on a chat session."""
        chat = self.transcripts.get(session_id)
        if message is not None and chat is None:
            raise NotChatSessionError("this session was opened without chat: append text or token_ids, or open a "
                                      "session with chat for messages")
        if message is None and chat is not None:
            raise InvalidInputError("this is a chat session: append messages {role, content}, not text or token_ids")
        if message is None:
            return None, req
        checked = [check_message(m) for m in (message if isinstance(message, list) else [message])]
        if not checked:
            raise ChatMessageError("append took an empty list of messages; send at least one")
        text = "".join(m["content"] for m in checked)
        kind = "video" if req.kind == "video" else "text"  # a camera note stays sheddable
        return (checked if isinstance(message, list) else checked[0]), replace(req, text=text, kind=kind)

    def add(self, session_id: str, message: Message | list[Message], chunk: dict[str, Any]) -> asyncio.Future[Ack]:
        """Append a message in its turn (`chunk`: seq, capture_time, deadline); -> its chunk's ack, to come."""
        return asyncio.ensure_future(self.transcripts[session_id].add_async(message, self.offload, **chunk))

    # ---- a message streamed in while it is said (engine/chat_stream.py) ----------------------------------------
    def chat(self, session_id: str) -> ChatTranscript:
        """The session's transcript, or NotChatSessionError."""
        chat = self.transcripts.get(session_id)
        if chat is None:
            raise NotChatSessionError("this session was opened without chat: stream messages into a session opened "
                                      "with chat")
        return chat

    def begin(self, session_id: str, role: str, chunk: dict[str, Any] | None = None) -> asyncio.Future[Ack]:
        """Open a streamed `role` message in its turn, after the chat's earlier operations (`chunk`: seq,
        capture_time, deadline of its header's chunk); -> its header chunk's ack, to come. Until `end` or `abort`,
        the chat's other operations (add, a reply, a rewind) wait. The future fails with MessageOpenError when a
        message is open, a ChatTemplateError when the template cannot render the role here."""
        chat = self.chat(session_id)
        check_role(role)
        return asyncio.ensure_future(chat.begin_message_async(role, self.offload, **(chunk or {})))

    def extend(self, session_id: str, text: str, chunk: dict[str, Any] | None = None) -> asyncio.Future[Ack]:
        """Append `text` to the open message, in order; -> its chunk's ack (0 tokens when only whitespace was
        held back). MessageNotOpenError (in the future) without a begin."""
        chat = self.chat(session_id)
        if not isinstance(text, str):
            raise ChatMessageError(f"a message's content is text, got {type(text).__name__}")
        return asyncio.ensure_future(chat.extend_message_async(text, self.offload, **(chunk or {})))

    def end(self, session_id: str, chunk: dict[str, Any] | None = None) -> asyncio.Future[Message]:
        """Close the open message (the end of its turn goes in) and record it; -> the message {role, content}.
        The chat's operations waiting for it go on."""
        chat = self.chat(session_id)
        return asyncio.ensure_future(chat.end_message_async(self.offload, **(chunk or {})))

    def abort(self, session_id: str) -> asyncio.Future[bool]:
        """Take the open message out (the session as before its begin); -> False if none was open."""
        chat = self.chat(session_id)
        return asyncio.ensure_future(chat.abort_message_async(self.offload))

    def message_count(self, session_id: str) -> int:
        """The chat's recorded messages (a streamed one counts from its end; an endless session's forgotten ones
        too): `rewind(to_message=n)` keeps n."""
        return len(self.chat(session_id).messages)

    def open_message(self, session_id: str) -> Message | None:
        """The message being streamed in ({role, content so far}), or None."""
        msg = self.chat(session_id).open_message
        return None if msg is None else {"role": msg.role, "content": msg.content}

    def respond(self, listener: ResultListener, session_id: str, params: dict[str, Any]) -> bool:
        """Start a reply if this is a chat session (-> True; its deltas and done reach `listener`). Its generation
        prompt goes first, as chunk `params["seq"]` (default: the next); the reply is recorded as the assistant's
        message. `params` are checked sampling parameters (the seq is taken out)."""
        seq = params.pop("seq", None)
        chat = self.transcripts.get(session_id)
        if chat is None:
            if seq is not None:
                raise InvalidInputError("respond takes a seq only on a chat session (the chunk of its generation "
                                        "prompt)")
            return False
        ticket = chat.ask_reply(params)  # a refused reply raises here, having taken nothing
        self.spawn(self.reply(listener, chat, session_id, ticket, seq, params))
        return True

    async def reply(self, listener: ResultListener, chat: ChatTranscript, session_id: str, ticket: int,
                    seq: int | None, params: dict[str, Any]) -> None:
        response = ""

        async def push(stream: ResponseStream, d: Delta) -> None:
            nonlocal response
            response = stream.id
            await listener.push(ReplyDelta(session_id, stream.id, d.text, d.token_ids))

        reason, usage = "cancelled", {"completion_tokens": 0, "session_tokens": len(chat.session)}
        try:
            stream = await chat.reply_async(ticket, push, self.offload, seq, **params)
            if stream is not None:
                response, reason, usage = stream.id, stream.finish_reason or "error", stream.usage
        except Exception as e:
            await listener.push(service_error(e, session_id))
            reason = "error"
        await listener.push(ReplyDone(session_id, response, reason, usage))

    async def rewind(self, session_id: str, to: int | None, to_seq: int | None, to_message: int | None) -> int | None:
        """A chat session's rewind (whole messages: a point inside one goes back to where it began); None for a
        plain session, which `to_message` cannot rewind. ForgottenMessagesError (`tokens_forgotten`) for a message,
        or a point among the tokens of messages, that an endless chat forgot."""
        chat = self.transcripts.get(session_id)
        if chat is None:
            if to_message is not None:
                raise NotChatSessionError("to_message rewinds a chat session; this one was opened without chat")
            return None
        return await chat.rewind_async(self.offload, to_message, to, to_seq)
