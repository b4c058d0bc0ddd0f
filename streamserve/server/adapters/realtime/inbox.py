"""A /v1/realtime connection's reader: the client's frames are read (and parsed) as they arrive, while the events
before them are still being handled, one at a time and in order, by the connection.

Why: aiohttp answers a client's keepalive ping only when the connection's frames are read. Read-then-handle in one
loop leaves every ping behind the event being handled: an insertion waiting for the engine, a commit waiting for
its Whisper pass, or a backlog of audio appends on a loaded CPU; past the client's ping timeout (20 s for the
`websockets` client) the client closes with 1011 "keepalive ping timeout". Reading apart from handling answers
pings at once. What waits to be handled is bounded, whatever the frame: audio by the server's max_audio_buffer_s (an
append past it is refused with `audio_buffer_full`, as the Listener refuses audio it cannot transcribe in time),
every entry (an event, or the error of a frame that is none) by MAX_WAITING, and the events' frames by
MAX_WAITING_BYTES; the frames of audio events also count against the connection's media account
(server/media/media_budget.py: `quota_exceeded`, or `server_busy` when the server's media budget is full) until they are
handled; a refusal is an `error` event naming the refused event, and the connection goes on. A frame that
is no valid event is malformed: the MAX_BAD_FRAMES-th closes the connection with 4400, as the native protocol does
(native.py), after its `error` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from streamserve.errors import StreamserveError
from streamserve.server.adapters.native import MAX_BAD_MESSAGES
from streamserve.server.adapters.protocol import CLOSE_BAD_CLIENT
from streamserve.server.adapters.realtime.events import ClientEvent, RealtimeError
from streamserve.server.media.media_budget import Holding, MediaAccount
from streamserve.server.transports.transport import Frame

MAX_WAITING = 1024  # entries read and not yet handled: events (each at most max_frame_bytes) and parse errors
MAX_WAITING_BYTES = 16 << 20  # frame bytes of the events waiting (UTF-8, as max_frame_bytes counts them)
MAX_BAD_FRAMES = MAX_BAD_MESSAGES  # frames that are no valid event, per connection; the last closes it (4400)


@dataclass(frozen=True)
class Waiting:
    """A frame read: its event, or the RealtimeError of a frame that is no valid event (told in its turn)."""

    event: ClientEvent | None
    error: RealtimeError | None = None
    audio_ms: float = 0.0  # audio it carries (an input_audio_buffer.append), counted until it is handled
    size: int = 0  # its frame's bytes, counted until it is handled


class Inbox:
    """`refuse` tells an error at once (out of turn); `close(code, reason)` ends the connection (None: the reader
    only stops reading, and the connection ends when what waits is handled). `account`: the connection's media
    account; by default, when `refuse` is a connection's method, that connection's (its service's budget, its ctx)."""

    def __init__(self, parse: Callable[[Frame], ClientEvent], audio_ms: Callable[[ClientEvent], float],
                 max_audio_ms: float, refuse: Callable[[RealtimeError], Awaitable[None]],
                 close: Callable[[int, str], Awaitable[None]] | None = None,
                 account: MediaAccount | None = None) -> None:
        self.parse, self.measure, self.max_audio_ms, self.refuse = parse, audio_ms, max_audio_ms, refuse
        self.close = close
        self.media = Holding(account, "audio event")  # None: waiting audio is bounded by max_audio_ms only
        self.queue: asyncio.Queue[Waiting | None] = asyncio.Queue()  # None: the client's frames ended
        self.audio_ms = 0.0  # audio waiting in the queue
        self.bytes = 0  # frame bytes of the events waiting in the queue
        self.bad = 0  # malformed frames read on this connection
        self.closed = False  # closed for malformed frames: what still waits is dropped, not handled

    async def read(self, frames: AsyncIterator[Frame]) -> None:
        """Read the client's frames until they end, or until the connection is closed for malformed frames (run as
        a task beside the handling)."""
        try:
            async for frame in frames:
                try:
                    ev = self.parse(frame)
                except RealtimeError as e:
                    if not await self.malformed(e):
                        return
                    continue
                ms = self.measure(ev)
                size = len(frame.encode()) if isinstance(frame, str) else len(frame)
                if ms and self.audio_ms + ms > self.max_audio_ms:
                    await self.refuse(RealtimeError(
                        f"{self.audio_ms / 1e3:.1f} s of this connection's audio is still waiting to be processed "
                        f"(limit {self.max_audio_ms / 1e3:g} s, max_audio_buffer_s): send audio at real-time pace",
                        "audio_buffer_full", "audio", event_id=ev.event_id))
                elif self.queue.qsize() >= MAX_WAITING:
                    await self.refuse(RealtimeError(
                        f"{MAX_WAITING} events of this connection are still waiting to be handled: wait for their "
                        "answers before sending more", "too_many_events", "type", event_id=ev.event_id))
                elif self.bytes and self.bytes + size > MAX_WAITING_BYTES:  # one event alone always fits
                    await self.refuse(RealtimeError(
                        f"{self.bytes} bytes of this connection's events are still waiting to be handled (limit "
                        f"{MAX_WAITING_BYTES >> 20} MiB): wait for their answers before sending more",
                        "too_many_events", "type", event_id=ev.event_id))
                elif ms and (refused := self.admit(size, ev.event_id)) is not None:
                    await self.refuse(refused)
                else:
                    self.audio_ms += ms
                    self.bytes += size
                    self.queue.put_nowait(Waiting(ev, None, ms, size))
        finally:
            self.queue.put_nowait(None)

    async def malformed(self, e: RealtimeError) -> bool:
        """A frame that is no valid event: its error waits its turn (told at once when the queue is full); the
        MAX_BAD_FRAMES-th is told at once and closes the connection. -> whether to go on reading."""
        self.bad += 1
        if self.bad >= MAX_BAD_FRAMES:
            e.message += f" ({self.bad} malformed frames on this connection: it is closed, {CLOSE_BAD_CLIENT})"
            e.args = (e.message,)
            self.closed = True
            await self.refuse(e)
            if self.close is not None:
                await self.close(CLOSE_BAD_CLIENT, f"{self.bad} malformed frames")
            return False
        if self.queue.qsize() >= MAX_WAITING:
            await self.refuse(e)
        else:
            self.queue.put_nowait(Waiting(None, e))
        return True

    async def __aiter__(self) -> AsyncIterator[Waiting]:
        """What waits, in order, until the frames end; once closed for malformed frames, what still waits is
        dropped (the end comes after the close: the handling must not end, and cancel the reader, before it)."""
        while (waiting := await self.queue.get()) is not None:
            self.audio_ms = max(0.0, self.audio_ms - waiting.audio_ms)
            self.bytes -= waiting.size
            if waiting.audio_ms:  # an audio event's frame: off the media account as it is handled
                self.media.settle(self.media.bytes - waiting.size)
            if not self.closed:
                yield waiting

    def admit(self, size: int, event_id: str | None) -> RealtimeError | None:
        """An audio event's frame onto the connection's media account -> None, or the refusal to tell."""
        try:
            self.media.admit(size)
        except StreamserveError as e:
            return RealtimeError(str(e), e.code, "audio", event_id=event_id)
        return None
