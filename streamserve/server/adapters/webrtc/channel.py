"""A WebRTC call's data channel `oai-events` as a transport `Channel`, so RealtimeConnection runs over it unchanged.

The channel is the client's: it is in the offer and opens (aiortc's "datachannel" event) only after ICE and DTLS
have connected, which is after the answer. Until then `send` waits for it (the Transport's writer waits, bounded by
its send_timeout, then aborts the call) and `receive` yields nothing yet.

    receive  messages arrive by callback (SCTP cannot be paused from aiortc): they go into a queue of
             RECEIVE_QUEUE messages. A client that sends faster than the connection reads (the Transport's rate
             limiter is what slows reading) fills it; the next message then ends the call (counted in `overflows`),
             as a WebSocket client past its limits is cut off: events are never dropped silently.
    send     waits while the SCTP send buffer holds more than HIGH_WATER bytes, until aiortc's
             `bufferedamountlow` (threshold LOW_WATER): a client that stops reading holds at most HIGH_WATER bytes
             here, and the Transport's bounded queue and send timeout do the rest.
    close    closes the data channel (the call ends with it: call.py); abort is the same, at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from streamserve.server.transports.transport import Channel, Frame

if TYPE_CHECKING:
    from aiortc import RTCDataChannel

LABEL = "oai-events"
RECEIVE_QUEUE = 256  # messages received and not yet read
HIGH_WATER = 256 * 1024  # bytes in the SCTP send buffer above which send waits
LOW_WATER = 64 * 1024  # ... until it drains to this
_END = None


class DataChannel(Channel):
    def __init__(self, on_close: Callable[[], None]) -> None:
        self.on_close = on_close  # the call ends when its events channel does
        self.dc: RTCDataChannel | None = None
        self.opened = asyncio.Event()
        self.low = asyncio.Event()
        self.low.set()
        self.incoming: asyncio.Queue[Frame | None] = asyncio.Queue(RECEIVE_QUEUE + 1)  # + room for the end marker
        self.overflows = 0
        self.ended = False

    def attach(self, dc: RTCDataChannel) -> None:
        """The client's `oai-events` channel has opened."""
        if self.dc is not None or self.ended:
            dc.close()  # a second one (or one after the end): not ours
            return
        self.dc = dc
        dc.bufferedAmountLowThreshold = LOW_WATER
        dc.on("message", self._message)
        dc.on("bufferedamountlow", self.low.set)
        dc.on("close", self._closed)
        self.opened.set()

    def _message(self, message: Frame) -> None:
        if self.ended:
            return
        if self.incoming.qsize() >= RECEIVE_QUEUE:
            self.overflows += 1
            self.end()
            self.on_close()
            return
        self.incoming.put_nowait(message)

    def _closed(self) -> None:
        self.end()
        self.on_close()

    def end(self) -> None:
        """No more frames: receive() ends after what is queued (room for the marker is always kept)."""
        if not self.ended:
            self.ended = True
            self.incoming.put_nowait(_END)
            self.opened.set()  # a send waiting for a channel that will never come goes on (and drops)
            self.low.set()

    async def send(self, frame: Frame) -> None:
        await self.opened.wait()
        while self.dc is not None and not self.ended and self.dc.bufferedAmount > HIGH_WATER:
            self.low.clear()
            await self.low.wait()
        if self.dc is None or self.ended or self.dc.readyState != "open":
            return  # gone: nobody can receive it
        self.dc.send(frame)

    async def receive(self) -> AsyncIterator[Frame]:  # type: ignore[override]
        while (frame := await self.incoming.get()) is not None:
            yield frame

    async def close(self, code: int, reason: str) -> None:
        self.abort()

    def abort(self) -> None:
        self.end()
        if self.dc is not None:
            self.dc.close()

    @property
    def closed(self) -> bool:
        return self.ended
