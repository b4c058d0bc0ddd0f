"""A session on the server and its replies, as the client sees them (see client.py for the connection)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from streamserve_client.errors import InvalidInputError, StreamserveClientError, from_message

if TYPE_CHECKING:
    from streamserve_client.client import Client


@dataclass(frozen=True)
class Ack:
    """A chunk is in the session's KV cache (or was shed). Times in milliseconds."""

    seq: int
    tokens: int
    queue_ms: float  # waiting in the server's scheduler
    compute_ms: float  # in the engine
    round_trip_ms: float  # send to ack, measured here
    deadline_missed: bool = False
    shed: bool = False


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)


def fail(fut: asyncio.Future, error: BaseException) -> None:
    """Fail a caller's future; if the caller has gone (cancelled its wait), the error is dropped quietly."""
    if not fut.done():
        fut.set_exception(error)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())


def _pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb({k: v for k, v in message.items() if v is not None}, use_bin_type=True)


def _ndarray(a: np.ndarray) -> dict[str, Any]:
    """openpi's array form."""
    a = np.ascontiguousarray(a)
    return {"__ndarray__": True, "data": a.tobytes(), "dtype": a.dtype.str, "shape": list(a.shape)}


@dataclass(eq=False)
class _PendingAck:
    future: asyncio.Future
    message: dict[str, Any]
    sent_at: float  # perf_counter
    generation: int = -1  # the connection it was last sent on


class Response:
    """One reply: iterate it for `Delta`s; `finish_reason` and `usage` are set when it ends."""

    def __init__(self, session: Session, params: dict[str, Any]) -> None:
        self.session, self.params = session, params
        self.id: str | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, int] = {}
        self.text = ""
        self.token_ids: list[int] = []
        self._queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        self._started = False
        self._request_id: int | None = None

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        if not self._started:
            self._started = True
            await self.session._start_response(self)
        if self.finish_reason is not None:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._end("error")
            raise item
        if item["type"] == "done":
            self._end(item.get("reason", "error"))
            self.usage = item.get("usage", {})
            raise StopAsyncIteration
        self.id = item.get("response")
        d = Delta(item.get("text", ""), list(item.get("token_ids", [])))
        self.text += d.text
        self.token_ids += d.token_ids
        return d

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        self.session.client._replies.pop(self._request_id, None)

    async def wait(self) -> str:
        """Read to the end; -> the finish reason."""
        async for _ in self:
            pass
        assert self.finish_reason is not None
        return self.finish_reason


class Session:
    def __init__(self, client: Client, opened: dict[str, Any]) -> None:
        self.client = client
        self.id: str = opened["session"]
        self.resume_token: str = opened["resume_token"]
        self.info = opened
        self.next_seq: int = opened.get("next_seq", 0)
        self._acks: dict[int, _PendingAck] = {}  # by seq
        self._response: Response | None = None
        self.closed = False

    async def append(self, text: str | None = None, token_ids: list[int] | None = None,
                     audio: tuple[np.ndarray | bytes, int] | None = None, image: np.ndarray | None = None, *,
                     seq: int | None = None, capture_time: float | None = None, deadline_ms: float | None = None,
                     kind: str | None = None) -> Ack:
        """Send a chunk (exactly one of text, token_ids, audio=(pcm, rate), image) and wait for its ack.
        `seq` defaults to the next number; `capture_time` (any clock) comes back in the ack's message;
        `deadline_ms`: how soon after it reaches the server the chunk should be in the KV cache."""
        self._check()
        if sum(x is not None for x in (text, token_ids, audio, image)) != 1:
            raise InvalidInputError("append takes exactly one of text, token_ids, audio, image")
        msg: dict[str, Any] = {"type": "append", "session": self.id, "text": text, "capture_time": capture_time,
                               "token_ids": None if token_ids is None else [int(t) for t in token_ids],
                               "deadline_ms": deadline_ms, "kind": kind}
        if audio is not None:
            pcm, rate = audio
            data = pcm if isinstance(pcm, bytes) else np.asarray(pcm).astype("<i2").tobytes()
            msg["audio"] = {"pcm": data, "rate": int(rate), "channels": 1, "format": "s16le"}
        if image is not None:
            msg["image"] = _ndarray(np.asarray(image))
        seq = self.next_seq if seq is None else seq
        msg["seq"] = seq
        limit = self.client.hello.get("limits", {}).get("max_frame_bytes")
        if limit is not None and len(_pack(msg)) > limit:
            raise InvalidInputError(f"this chunk is over the server's frame limit of {limit} bytes; split it")
        self.next_seq = seq + 1
        pending = _PendingAck(asyncio.get_running_loop().create_future(), msg, time.perf_counter())
        self._acks[seq] = pending
        try:
            await self.client._send_append(pending)
            return await pending.future
        finally:
            self._acks.pop(seq, None)

    def respond(self, max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                top_k: int | None = None, seed: int | None = None, stop: list[str] | None = None) -> Response:
        """A reply to everything appended so far: `async for delta in session.respond(...)`.
        Parameters left out take the session's defaults (set at open or by `configure`)."""
        self._check()
        return Response(self, {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                               "top_k": top_k, "seed": seed, "stop": stop})

    async def _start_response(self, r: Response) -> None:
        if self._response is not None and self._response.finish_reason is None:
            raise InvalidInputError("this session already has a reply running; cancel it or read it to the end")
        self._response = r
        rid = next(self.client._ids)  # an error refusing this request comes back with its id
        self.client._replies[rid] = r
        r._request_id = rid
        await self.client._send({"type": "respond", "session": self.id, "id": rid, **r.params})

    async def cancel(self) -> None:
        """Stop the running reply (its iteration ends with finish_reason "cancelled")."""
        self._check()
        await self.client._send({"type": "cancel", "session": self.id})

    async def rewind(self, to_seq: int | None = None, to: int | None = None) -> int:
        """Forget everything after chunk `to_seq` (kept) or token position `to`; -> the session's length."""
        reply = await self.client._request({"type": "rewind", "session": self.id, "to_seq": to_seq, "to": to})
        self.next_seq = reply.get("next_seq", self.next_seq)
        return int(reply["tokens"])

    async def configure(self, chunk_budget_ms: float | None = None, **sampling: Any) -> dict[str, Any]:
        """Change the session's reply defaults (max_tokens, temperature, top_p, top_k, seed, stop) or its
        chunk deadline budget."""
        return await self.client._request({"type": "configure", "session": self.id, "chunk_budget_ms": chunk_budget_ms,
                                           "sampling": sampling or None})

    async def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(StreamserveClientError):
                await self.client._request({"type": "close", "session": self.id})
            self._lost(None)

    def _check(self) -> None:
        if self.closed:
            raise StreamserveClientError(f"session {self.id} is closed", code="session_closed")

    def _lost(self, error: BaseException | None) -> None:
        """The session is gone (closed, or not resumable): everything waiting on it ends."""
        self.closed = True
        self.client._sessions.pop(self.id, None)
        for p in self._acks.values():
            if not p.future.done():
                fail(p.future, error or StreamserveClientError("session closed", code="session_closed"))
        if self._response is not None and self._response.finish_reason is None and error is not None:
            self._response._queue.put_nowait(error)

    # ---- routing (called by the reader) ---------------------------------------------------------------
    def _on_ack(self, m: dict[str, Any]) -> None:
        p = self._acks.get(m.get("seq", -1))
        if p is not None and not p.future.done():
            p.future.set_result(Ack(m["seq"], m.get("tokens", 0), m.get("queue_ms", 0.0), m.get("compute_ms", 0.0),
                                    (time.perf_counter() - p.sent_at) * 1e3, m.get("deadline_missed", False),
                                    m.get("shed", False)))

    def _on_error(self, m: dict[str, Any]) -> None:
        err = from_message(m)
        p = self._acks.get(m["seq"]) if m.get("seq") is not None else None
        if p is not None:
            if not p.future.done():
                fail(p.future, err)
        elif m.get("code") == "session_moved":
            self._lost(err)
        elif self._response is not None and self._response.finish_reason is None:
            self._response._queue.put_nowait(err)

    def _on_reply(self, m: dict[str, Any]) -> None:
        if self._response is not None:
            self._response._queue.put_nowait(m)
