"""A /v1/realtime connection's reader: the client's frames are read (and parsed) as they arrive, while the events
before them are still being handled, one at a time and in order, by the connection.

Why: aiohttp answers a client's keepalive ping only when the connection's frames are read. Read-then-handle in one
loop leaves every ping behind the event being handled: an insertion waiting for the engine, a commit waiting for
its Whisper pass, or a backlog of audio appends on a loaded CPU; past the client's ping timeout (20 s for the
`websockets` client) the client closes with 1011 "keepalive ping timeout". Reading apart from handling answers
pings at once. What waits to be handled is bounded: audio by the server's max_audio_buffer_s (an append past it
is refused with `audio_buffer_full`, as the Listener refuses audio it cannot transcribe in time), other events by
MAX_WAITING; a refusal is an `error` event naming the refused event, and the connection goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from streamserve.server.realtime.events import ClientEvent, RealtimeError
from streamserve.server.transport import Frame

MAX_WAITING = 1024  # client events read and not yet handled (each at most max_frame_bytes)


@dataclass(frozen=True)
class Waiting:
    """A frame read: its event, or the RealtimeError of a frame that is no valid event (told in its turn)."""

    event: ClientEvent | None
    error: RealtimeError | None = None
    audio_ms: float = 0.0  # audio it carries (an input_audio_buffer.append), counted until it is handled


class Inbox:
    def __init__(self, parse: Callable[[Frame], ClientEvent], audio_ms: Callable[[ClientEvent], float],
                 max_audio_ms: float, refuse: Callable[[RealtimeError], Awaitable[None]]) -> None:
        self.parse, self.measure, self.max_audio_ms, self.refuse = parse, audio_ms, max_audio_ms, refuse
        self.queue: asyncio.Queue[Waiting | None] = asyncio.Queue()  # None: the client's frames ended
        self.audio_ms = 0.0  # audio waiting in the queue

    async def read(self, frames: AsyncIterator[Frame]) -> None:
        """Read the client's frames until they end (run as a task beside the handling)."""
        try:
            async for frame in frames:
                try:
                    ev = self.parse(frame)
                except RealtimeError as e:
                    self.queue.put_nowait(Waiting(None, e))
                    continue
                ms = self.measure(ev)
                if ms and self.audio_ms + ms > self.max_audio_ms:
                    await self.refuse(RealtimeError(
                        f"{self.audio_ms / 1e3:.1f} s of this connection's audio is still waiting to be processed "
                        f"(limit {self.max_audio_ms / 1e3:g} s, max_audio_buffer_s): send audio at real-time pace",
                        "audio_buffer_full", "audio", event_id=ev.event_id))
                elif self.queue.qsize() >= MAX_WAITING:
                    await self.refuse(RealtimeError(
                        f"{MAX_WAITING} events of this connection are still waiting to be handled: wait for their "
                        "answers before sending more", "too_many_events", "type", event_id=ev.event_id))
                else:
                    self.audio_ms += ms
                    self.queue.put_nowait(Waiting(ev, None, ms))
        finally:
            self.queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[Waiting]:
        while (waiting := await self.queue.get()) is not None:
            self.audio_ms = max(0.0, self.audio_ms - waiting.audio_ms)
            yield waiting
