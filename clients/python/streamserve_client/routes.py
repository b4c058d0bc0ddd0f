"""What the channel keeps for each session while calls are in flight, and how a session's messages
reach them (channel.py dispatches by `session`; this routes by `seq` and to the running reply)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from streamserve_client.errors import ProtocolViolationError, StreamserveClientError
from streamserve_client.protocol import Ack

# what a reply receives: a `delta` or `done` message, or the error that ends it
ReplyItem = dict[str, Any] | StreamserveClientError
Deliver = Callable[[ReplyItem], None]


def fail(fut: asyncio.Future[Any], error: BaseException) -> None:
    """Fail a caller's future; if the caller has gone (cancelled its wait), the error is dropped quietly."""
    if not fut.done():
        fut.set_exception(error)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())


@dataclass(eq=False)
class PendingChunk:
    future: asyncio.Future[Ack]
    message: dict[str, Any]
    sent_at: float  # perf_counter
    generation: int = -1  # the connection it was last sent on: a chunk is sent at most once on each


@dataclass(eq=False)
class RunningReply:
    request_id: int
    deliver: Deliver
    response_id: Any = None  # learnt from the first delta
    failed: bool = False  # an error ended it here; the server's `done` is still to come
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class SessionRoute:
    session_id: str
    resume_token: str
    on_lost: Callable[[StreamserveClientError | None], None]
    chunks: dict[int, PendingChunk] = field(default_factory=dict)  # by seq
    reply: RunningReply | None = None
    on_event: Callable[[dict[str, Any]], None] | None = None  # the session's voice events (events.py)
    voice: bool = False  # the session takes audio: replies may start on the server's side (create_response)

    def on_voice_message(self, m: dict[str, Any]) -> None:
        """A `turn`, `transcript`, `audio` or `audio_done` message: to the session's events."""
        if self.on_event is not None:
            self.voice = True
            self.on_event(m)

    def on_ack(self, m: dict[str, Any]) -> None:
        """An ack; one for no chunk in flight is a duplicate result after a resume (ignored)."""
        chunk = self.chunks.get(m["seq"])
        if chunk is not None and not chunk.future.done():
            chunk.future.set_result(Ack.from_message(m, (time.perf_counter() - chunk.sent_at) * 1e3))

    def on_error(self, m: dict[str, Any], error: StreamserveClientError) -> bool:
        """An error about this session; -> False when it concerns no call in flight."""
        if m.get("seq") is not None:
            chunk = self.chunks.get(m["seq"])
            if chunk is not None:
                fail(chunk.future, error)
            return True  # else a duplicate result after a resume
        if self.reply is not None and not self.reply.failed:
            self.reply.failed = True  # the server ends the reply with `done` right after
            self.reply.deliver(error)
            return True
        return False

    def on_reply_message(self, m: dict[str, Any]) -> None:
        """A `delta` or `done`: output of the running reply, or a protocol violation."""
        reply, kind = self.reply, m["type"]
        if self.voice and self.on_event is not None:
            self.on_event(m)  # a voice session's events carry its replies' text too
            if reply is None:
                return  # a reply the server started (create_response at the end of speech)
        if reply is None:
            raise ProtocolViolationError(f"the server sent `{kind}` for session {self.session_id}, "
                                         "which has no reply running")
        response_id = m.get("response")
        if response_id is not None and reply.response_id is not None and response_id != reply.response_id:
            raise ProtocolViolationError(f"the server sent `{kind}` for reply {response_id!r} of session "
                                         f"{self.session_id}, whose running reply is {reply.response_id!r}")
        if response_id is not None:
            reply.response_id = response_id
        if not reply.failed:
            reply.deliver(m)
        if kind == "done":
            self.end_reply()

    def fail_reply(self, error: StreamserveClientError) -> None:
        """The running reply ends with `error` here, and no `done` will come for it (connection gone)."""
        if self.reply is not None:
            if not self.reply.failed:
                self.reply.deliver(error)
            self.end_reply()

    def fail_chunks(self, error: StreamserveClientError) -> None:
        for chunk in self.chunks.values():
            fail(chunk.future, error)
        self.chunks.clear()

    def end_reply(self) -> None:
        reply, self.reply = self.reply, None
        if reply is not None:
            reply.done.set()
