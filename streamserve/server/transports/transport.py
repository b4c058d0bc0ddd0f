"""The connection transport: moves frames of any protocol between one client and its protocol adapter.

A `Channel` is the wire underneath (send a frame, receive a frame, close, abort); aiohttp's WebSocket is
the first (`WebSocketChannel`), a WebRTC data channel is the next. `Transport` puts policy over it, the
same for every protocol:

- everything sent goes through ONE bounded queue and ONE writer task, so a client that stops reading
  slows only its own connection (producers wait on the full queue: backpressure, nothing dropped);
- a frame that waits longer than `send_timeout` for the client is the end of it: the connection is
  aborted (a client that stops reading cannot hold memory or tasks for ever);
- frames read are rate limited in messages AND bytes per second (token buckets with bursts of twice the
  rate): over the rate, the read loop waits, so TCP slows the client down;
- `finish()` runs the detach callbacks once, whatever ended the connection, flushes what is queued
  (bounded wait) and stops the writer; from then on frames are dropped and no producer waits (one
  waiting on the full queue then is released), so nothing can hang on a connection that is gone.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import WSMsgType, web

log = logging.getLogger("streamserve.server")

Frame = bytes | str  # binary or text frame

OUTGOING_QUEUE = 256  # frames waiting for the writer; a full queue makes this connection's producers wait
SEND_TIMEOUT = 30.0  # seconds a frame may wait for a client that does not read; then the connection is cut
FINISH_TIMEOUT = 5.0  # seconds the writer may take to flush when a connection ends


class Channel(abc.ABC):
    """One client's wire: frames in, frames out. Implementations do no buffering or policy of their own."""

    @abc.abstractmethod
    async def send(self, frame: Frame) -> None: ...

    @abc.abstractmethod
    def receive(self) -> AsyncIterator[Frame]:
        """The frames the client sends, until it closes or the connection fails."""

    @abc.abstractmethod
    async def close(self, code: int, reason: str) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None:
        """Cut the connection at once, without a closing handshake."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...


class WebSocketChannel(Channel):
    """aiohttp's server-side WebSocket (prepared by the route) as a Channel."""

    def __init__(self, ws: web.WebSocketResponse, socket_transport: asyncio.BaseTransport | None) -> None:
        self.ws, self.socket_transport = ws, socket_transport

    async def send(self, frame: Frame) -> None:
        if isinstance(frame, str):
            await self.ws.send_str(frame)
        else:
            await self.ws.send_bytes(frame)

    async def receive(self) -> AsyncIterator[Frame]:  # type: ignore[override]
        async for msg in self.ws:
            if msg.type in (WSMsgType.BINARY, WSMsgType.TEXT):
                yield msg.data
            else:  # CLOSE / ERROR
                return

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code=code, message=reason.encode()[:120])

    def abort(self) -> None:
        if self.socket_transport is not None:
            self.socket_transport.abort()

    @property
    def closed(self) -> bool:
        return self.ws.closed


class TokenBucket:
    """`rate` units a second on average, bursts of up to twice that. `take(n)` waits while the bucket is
    short; a single take larger than the burst is allowed and paid for by waiting afterwards."""

    def __init__(self, rate: float) -> None:
        self.rate, self.capacity = float(rate), 2.0 * rate
        self.level, self.stamp = self.capacity, time.monotonic()

    def delay(self, n: float) -> float:
        """Take n units now; -> seconds the caller must wait before going on."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        self.level -= n
        return 0.0 if self.level >= 0 else -self.level / self.rate


class RateLimiter:
    """Per-connection read limit in messages and bytes per second: a frame waits for both buckets."""

    def __init__(self, messages_per_second: float, bytes_per_second: float) -> None:
        self.messages, self.bytes = TokenBucket(messages_per_second), TokenBucket(bytes_per_second)

    async def wait(self, n_bytes: int) -> None:
        pause = max(self.messages.delay(1), self.bytes.delay(n_bytes))
        if pause > 0:
            await asyncio.sleep(pause)


class Transport:
    def __init__(self, channel: Channel, limiter: RateLimiter, queue_size: int = OUTGOING_QUEUE,
                 send_timeout: float = SEND_TIMEOUT) -> None:
        self.channel, self.limiter, self.send_timeout = channel, limiter, send_timeout
        self.outgoing: asyncio.Queue[Frame] = asyncio.Queue(queue_size)
        self.writer: asyncio.Task | None = None
        self.detach_callbacks: list[Callable[[], Any]] = []
        self.finished = False  # finish() began: the detach callbacks ran
        self.stopped = False  # the writer is gone: frames are dropped

    def start(self) -> None:
        if self.writer is None:
            self.writer = asyncio.create_task(self.write_loop())

    async def frames(self) -> AsyncIterator[Frame]:
        """The client's frames, each after the rate limiter lets it through."""
        async for frame in self.channel.receive():
            await self.limiter.wait(len(frame.encode()) if isinstance(frame, str) else len(frame))
            yield frame

    async def send(self, frame: Frame) -> None:
        """Queue a frame; waits while the queue is full (the client reads slowly). Dropped once the writer
        is gone."""
        if not self.stopped:
            await self.outgoing.put(frame)

    def send_nowait(self, frame: Frame) -> bool:
        """Best effort, never waits: False when the client is so far behind that the queue is full (or gone)."""
        if self.stopped:
            return False
        try:
            self.outgoing.put_nowait(frame)
            return True
        except asyncio.QueueFull:
            return False

    async def drain(self, timeout: float) -> None:
        """Wait until the writer has sent everything queued (asyncio.TimeoutError after `timeout`)."""
        await asyncio.wait_for(self.outgoing.join(), timeout)

    async def close(self, code: int, reason: str, flush_timeout: float = 2.0) -> None:
        """The closing handshake, after what is queued (bounded wait): the frames that explain a close reach
        the client before it."""
        if self.writer is not None and not self.stopped:
            with contextlib.suppress(asyncio.TimeoutError):
                await self.drain(flush_timeout)
        await self.channel.close(code, reason)

    def abort(self) -> None:
        self.channel.abort()

    def on_detach(self, callback: Callable[[], Any]) -> None:
        """Run `callback` once when the connection ends (sessions are detached for a resume there)."""
        self.detach_callbacks.append(callback)

    async def finish(self) -> None:
        """The connection ended: run the detach callbacks, flush what is queued (bounded), stop the writer,
        release any producer still waiting on the full queue."""
        if self.finished:
            return
        self.finished = True
        for callback in self.detach_callbacks:
            try:
                callback()
            except Exception:  # one failing callback must not keep the others from freeing what they hold
                log.exception("streamserve: a detach callback failed")
        if self.writer is not None:
            with contextlib.suppress(asyncio.TimeoutError):  # a client that does not read: stop anyway
                await asyncio.wait_for(self.outgoing.join(), FINISH_TIMEOUT)
            self.writer.cancel()
            await asyncio.wait({self.writer})  # raises neither the writer's error nor its cancellation
            if not self.writer.cancelled() and self.writer.exception() is not None:
                log.error("streamserve: a connection's writer failed", exc_info=self.writer.exception())
        self.stopped = True
        while not self.outgoing.empty():  # each frame taken wakes one waiting producer, whose frame is taken next
            while not self.outgoing.empty():
                self.outgoing.get_nowait()
                self.outgoing.task_done()
            await asyncio.sleep(0)

    async def write_loop(self) -> None:
        while True:
            frame = await self.outgoing.get()
            try:
                if not self.channel.closed:  # else drop it: nobody can receive it any more
                    try:
                        await asyncio.wait_for(self.channel.send(frame), self.send_timeout)
                    except asyncio.TimeoutError:
                        log.warning("streamserve: a client stopped reading for %.0fs; cutting it off",
                                    self.send_timeout)
                        self.abort()
                    except (ConnectionError, RuntimeError):
                        pass  # going away: the read loop ends it
            finally:
                self.outgoing.task_done()
