"""Delivery from the engine thread to callers, sync or asyncio, without ever making the engine wait.

An append's ack is a `concurrent.futures.Future` (awaited through `asyncio.wrap_future`, which hands the
result to the event loop with `call_soon_threadsafe`). A response's deltas go through an `Outbox`:
`put` never blocks, and deltas the consumer has not read yet merge into one, so at most one delta and
the end wait in it, however slow the consumer. Its memory is bounded by the reply's `max_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamserve.engine.work import Response
from streamserve.errors import StreamserveError


class ReplySession(Protocol):
    """What a reply's stream needs of its session (`session.Session` is one)."""

    @property
    def token_ids(self) -> list[int]: ...

    def cancel(self) -> None: ...

    def on_engine_thread(self) -> bool:
        """Whether the caller runs on the engine thread (which must never wait for a reply)."""
        ...


@dataclass
class Delta:
    """New output of a response: text (complete UTF-8, stop strings held back) and the token ids."""

    text: str
    token_ids: list[int] = field(default_factory=list)

    def merged(self, other: Delta) -> Delta:
        return Delta(self.text + other.text, self.token_ids + other.token_ids)


@dataclass
class End:
    reason: str  # "length", "stop", "context", "cancelled", "closed" or "error"
    error: BaseException | None = None


class Outbox:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: deque[Delta | End] = deque()
        self._wake: Callable[[], None] | None = None  # wakes an asyncio consumer

    def put(self, item: Delta | End) -> None:
        with self._cv:
            if isinstance(item, Delta) and self._items and isinstance(self._items[-1], Delta):
                self._items[-1] = self._items[-1].merged(item)
            else:
                self._items.append(item)
            self._cv.notify_all()
            wake = self._wake
        if wake is not None:
            wake()

    def __len__(self) -> int:
        return len(self._items)

    def get(self) -> Delta | End:
        with self._cv:
            while not self._items:
                self._cv.wait()
            return self._items.popleft()

    async def aget(self) -> Delta | End:
        loop = asyncio.get_running_loop()
        while True:
            event = asyncio.Event()
            with self._cv:
                if self._items:
                    self._wake = None
                    return self._items.popleft()
                self._wake = functools.partial(_call_soon, loop, event.set)
            await event.wait()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> None:
    with contextlib.suppress(RuntimeError):  # the consumer's event loop has closed: nobody is listening
        loop.call_soon_threadsafe(fn)


class ResponseStream:
    """One reply, as it is generated: iterate it with `async for` (or plain `for`) to get `Delta`s.

    The reply runs ahead of the consumer (the engine never waits for it); tokens are committed to the
    session as they are produced. After the iteration ends, `finish_reason` says why: "length"
    (max_tokens), "stop" (a stop token or string), "context" (the model's context is full), "cancelled"
    or "closed". An engine fault raises a typed error from the iteration instead.
    """

    def __init__(self, session: ReplySession, response: Response) -> None:
        self.session = session
        self._response = response
        self.id = response.id
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []  # everything received so far
        self.text = ""

    @property
    def finished(self) -> bool:
        """Whether the engine has ended the reply (its end may still wait unread in the stream)."""
        return self._response.finished

    @property
    def unread(self) -> int:
        """Items waiting to be read: at most one (merged) delta, then the end."""
        return len(self._response.outbox)

    @property
    def usage(self) -> dict[str, int]:
        """completion_tokens, session_tokens; and `forwards` (model forwards that made its tokens, the append's
        it started from included), `draft_tokens` and `accepted_tokens` (verified, accepted) when it was drafted."""
        r = self._response
        out = {"completion_tokens": r.produced, "session_tokens": len(self.session.token_ids), "forwards": r.forwards}
        if r.drafted:
            out |= {"draft_tokens": r.drafted, "accepted_tokens": r.accepted}
        return out

    def cancel(self) -> None:
        """End this reply within one engine step (what it produced stays in the session)."""
        self.session.cancel()

    def _take(self, item: Delta | End) -> Delta | None:
        if isinstance(item, Delta):
            self.token_ids += item.token_ids
            self.text += item.text
            return item
        self.finish_reason = item.reason
        if item.error is not None:
            raise item.error
        return None

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        if self.finish_reason is not None:
            raise StopIteration
        d = self._take(self._response.outbox.get())
        if d is None:
            raise StopIteration
        return d

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        d = self._take(await self._response.outbox.aget())
        if d is None:
            raise StopAsyncIteration
        return d

    def wait(self) -> str:
        """Block until the reply ends (discarding what is not read yet); -> the finish reason."""
        for _ in self:
            pass
        assert self.finish_reason is not None
        return self.finish_reason


class TokenIterator:
    """A reply's token ids one by one. Closing it (or dropping it, or an exception in the loop reading it)
    before the end cancels the reply and waits for its end, whether or not iteration had started."""

    def __init__(self, stream: ResponseStream) -> None:
        self.stream = stream
        self._buffer: list[int] = []

    def __iter__(self) -> TokenIterator:
        return self

    def __next__(self) -> int:
        while not self._buffer:
            try:
                self._buffer = list(next(self.stream).token_ids)
            except BaseException:
                self.close()
                raise
        return self._buffer.pop(0)

    def close(self) -> None:
        st = self.stream
        if st.finish_reason is None:
            st.session.cancel()
            if not st.session.on_engine_thread():  # never block the engine on itself
                with contextlib.suppress(StreamserveError):
                    st.wait()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
