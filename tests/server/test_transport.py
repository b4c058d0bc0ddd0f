"""The connection transport on an in-memory channel: rate limits in messages and bytes (waiting, never
dropping), the bounded queue's backpressure, the send timeout that cuts a client that stops reading, and
one run of the detach callbacks however the connection ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from streamserve.server.transports.transport import Channel, Frame, RateLimiter, Transport


class MemoryChannel(Channel):
    def __init__(self, incoming: list[Frame] | None = None, stall: bool = False) -> None:
        self.incoming, self.sent, self.stall = list(incoming or []), [], stall
        self.aborted = self.is_closed = False

    async def send(self, frame: Frame) -> None:
        if self.stall:  # a client that stopped reading: the socket's buffer never drains
            await asyncio.Event().wait()
        self.sent.append(frame)

    async def receive(self) -> AsyncIterator[Frame]:  # type: ignore[override]
        for frame in self.incoming:
            yield frame

    async def close(self, code: int, reason: str) -> None:
        self.is_closed, self.sent_before_close = True, list(self.sent)

    def abort(self) -> None:
        self.aborted = True

    @property
    def closed(self) -> bool:
        return self.is_closed


@pytest.mark.asyncio
async def test_reads_wait_for_both_the_message_and_the_byte_rate() -> None:
    frames = [b"x" * 500] * 6  # 3000 bytes at 1000 bytes/s with a 2000-byte burst: about 1 s of waiting
    t = Transport(MemoryChannel(frames), RateLimiter(messages_per_second=1000.0, bytes_per_second=1000.0))
    t0 = time.monotonic()
    got = [f async for f in t.frames()]
    assert got == frames and 0.8 < time.monotonic() - t0 < 3  # nothing dropped, slowed down
    t = Transport(MemoryChannel([b"x"] * 30), RateLimiter(messages_per_second=10.0, bytes_per_second=1e9))
    t0 = time.monotonic()
    assert len([f async for f in t.frames()]) == 30 and time.monotonic() - t0 > 0.8  # 10 past the burst of 20


@pytest.mark.asyncio
async def test_a_client_that_stops_reading_is_cut_off_and_detach_runs_once() -> None:
    channel = MemoryChannel(stall=True)
    t = Transport(channel, RateLimiter(100.0, 1e6), queue_size=2, send_timeout=0.2)
    detached: list[int] = []
    t.on_detach(lambda: detached.append(1))
    t.start()
    await t.send(b"a")  # the writer takes it and stalls on the socket
    await t.send(b"b")
    await t.send(b"c")  # the queue (2) is full now
    assert not t.send_nowait(b"d")  # best effort refuses rather than waiting
    await asyncio.sleep(0.5)
    assert channel.aborted  # the send timeout cut it
    await t.finish()
    await t.finish()
    assert detached == [1]


@pytest.mark.asyncio
async def test_finish_flushes_what_is_queued() -> None:
    channel = MemoryChannel()
    t = Transport(channel, RateLimiter(100.0, 1e6))
    t.start()
    for i in range(5):
        await t.send(bytes([i]))
    await t.finish()
    assert channel.sent == [bytes([i]) for i in range(5)] and t.writer is not None and t.writer.done()


@pytest.mark.asyncio
async def test_a_producer_waiting_on_a_full_queue_is_released_when_the_connection_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's result being pushed to a connection that is ending must not wait for ever (a leaked task):
    once the writer is gone, waiting producers are released and later frames are dropped."""
    monkeypatch.setattr("streamserve.server.transports.transport.FINISH_TIMEOUT", 0.2)
    t = Transport(MemoryChannel(stall=True), RateLimiter(100.0, 1e6), queue_size=1, send_timeout=60.0)
    t.start()
    await t.send(b"a")  # the writer stalls on it
    await t.send(b"b")  # the queue is full
    blocked = asyncio.create_task(t.send(b"c"))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    await t.finish()  # the writer cannot flush within FINISH_TIMEOUT: it is stopped
    await asyncio.wait_for(blocked, 1.0)
    await asyncio.wait_for(t.send(b"d"), 1.0)  # after the end: dropped, never waits
    assert not t.send_nowait(b"e")


@pytest.mark.asyncio
async def test_finish_with_a_full_queue_does_not_wait_out_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client left (the channel is closed) with the queue full: the writer drops what is queued and stops
    at once, instead of idling until FINISH_TIMEOUT."""
    monkeypatch.setattr("streamserve.server.transports.transport.FINISH_TIMEOUT", 3.0)
    channel = MemoryChannel()
    t = Transport(channel, RateLimiter(100.0, 1e6), queue_size=2)
    for frame in (b"a", b"b"):
        await t.send(frame)  # queued before the writer starts: the queue is full
    channel.is_closed = True
    t.start()
    t0 = time.monotonic()
    await t.finish()
    assert time.monotonic() - t0 < 1.0 and channel.sent == []


@pytest.mark.asyncio
async def test_text_frames_are_rate_limited_by_their_bytes() -> None:
    frame = "é" * 500  # 1000 bytes in UTF-8: 3 frames are 3000 bytes at 1000 bytes/s, a burst of 2000
    t = Transport(MemoryChannel([frame] * 3), RateLimiter(messages_per_second=1000.0, bytes_per_second=1000.0))
    t0 = time.monotonic()
    assert len([f async for f in t.frames()]) == 3
    assert time.monotonic() - t0 > 0.8


@pytest.mark.asyncio
async def test_a_close_comes_after_the_frames_queued_before_it() -> None:
    """The error that explains a close (too many malformed messages) must reach the client before the close."""
    channel = MemoryChannel()
    t = Transport(channel, RateLimiter(100.0, 1e6))
    t.start()
    for i in range(3):
        await t.send(bytes([i]))
    await t.close(4400, "too many malformed messages")
    assert channel.sent_before_close == [bytes([i]) for i in range(3)]
    await t.finish()
