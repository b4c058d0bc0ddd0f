"""A call's audio tracks: the reply track the server plays, and the microphone track it drains.

ReplyTrack (outgoing, an aiortc MediaStreamTrack): the Speaker's audio (PCM16 mono 48 kHz) played in 20 ms frames
(960 samples) with monotonic pts on a 1/48000 time base, paced by the clock (aiortc's sender calls recv() in a
loop); silence when idle. Its buffer holds at most BUFFER_MS of reply audio: `play` waits while it is full, so the
Speaker runs at most that far ahead of what the person hears. `clear()` drops what is buffered at once and returns
the ms of the reply played so far (barge-in truncates the item to that). Notices (started / stopped per response)
are handed to a callback, which must not block.

Microphone (`drain_audio`): aiortc's receive queue is unbounded, so a task takes every frame as it arrives into a
bounded deque of MIC_QUEUE frames (when the feeding falls behind, the oldest frame is dropped and counted); a second
task converts what has gathered (av's AudioResampler: any layout and rate -> s16 mono 48 kHz) and feeds it to the
sink in one call. Audio the sink refuses is dropped and counted; when the refusal is the media budget's (the
connection's or the server's media bytes are full: server/media/media_budget.py), the call is told once per run of
refusals by an `error` event on the data channel (`refused`), as a WebSocket client is told per append.
"""

from __future__ import annotations

import asyncio
import collections
import fractions
import logging
import time
from collections.abc import Awaitable, Callable

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from streamserve.media.audio import AudioFormat
from streamserve.server.media.media_budget import MediaBusyError, MediaQuotaError

log = logging.getLogger("streamserve.server")

RATE = 48000
FORMAT = AudioFormat("pcm16", RATE)  # what the Listener is fed and the Speaker makes on a call
FRAME_SAMPLES = RATE // 50  # 20 ms
FRAME_BYTES = 2 * FRAME_SAMPLES
BUFFER_MS = 1000  # reply audio queued in the track at most
MIC_QUEUE = 100  # microphone frames (20 ms each: 2 s) waiting to be fed at most

Notice = Callable[[str, str], None]  # (event type, response id) -> None; never blocks


class ReplyTrack(MediaStreamTrack):
    kind = "audio"

    def __init__(self, notice: Notice) -> None:
        super().__init__()
        self.notice = notice
        self.buffer = bytearray()  # reply audio not yet played (PCM16 mono 48 kHz)
        self.room = asyncio.Event()  # set while the buffer has room
        self.room.set()
        self.reply: str | None = None  # the response whose audio is buffered or playing
        self.finished = False  # ... and all of it is in the buffer (stopped follows when it has played)
        self.started = False  # ... and its output_audio_buffer.started went out
        self.cleared: set[str] = set()  # responses cleared: more of their audio is dropped
        self.played_ms = 0.0  # of the reply's audio, played out
        self.pts = 0
        self.t0: float | None = None
        self.frames_sent = 0

    # ---- the Speaker's side --------------------------------------------------------------------------------
    async def play(self, reply: str, data: bytes) -> None:
        """Queue `data` (PCM16 mono 48 kHz) of response `reply`; waits while the buffer is full."""
        if reply != self.reply:
            if reply in self.cleared:
                return
            self.switch(reply)
        while len(self.buffer) >= BUFFER_MS * RATE * 2 // 1000:
            self.room.clear()
            await self.room.wait()
            if self.reply != reply:  # cleared meanwhile
                return
        self.buffer += data

    def switch(self, reply: str) -> None:
        """A new response's audio begins (the last one's, if any, ends where it stands)."""
        if self.reply is not None and self.started:
            self.notice("output_audio_buffer.stopped", self.reply)
        self.reply, self.finished, self.started, self.played_ms = reply, False, False, 0.0
        self.buffer.clear()

    def finish(self, reply: str) -> None:
        """All of `reply`'s audio is queued: output_audio_buffer.stopped once it has played."""
        if reply == self.reply:
            self.finished = True
            if not self.buffer:
                self.stop_reply()

    def clear(self) -> tuple[str | None, float]:
        """Drop the buffered audio now; -> (the response that was playing, ms of it played), (None, 0) if none."""
        reply, played = self.reply, self.played_ms
        if reply is None:
            return None, 0.0
        self.cleared.add(reply)
        self.buffer.clear()
        self.reply, self.started, self.finished = None, False, False
        self.room.set()
        return reply, played

    @property
    def playing(self) -> bool:
        return self.reply is not None

    def stop_reply(self) -> None:
        if self.reply is not None and self.started:
            self.notice("output_audio_buffer.stopped", self.reply)
        self.reply, self.started, self.finished = None, False, False

    # ---- aiortc's side ---------------------------------------------------------------------------------------
    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        wait = self.t0 + self.pts / RATE - now
        if wait > 0:
            await asyncio.sleep(wait)
        chunk = bytes(self.buffer[:FRAME_BYTES])
        del self.buffer[:FRAME_BYTES]
        if chunk and self.reply is not None:
            if not self.started:
                self.started = True
                self.notice("output_audio_buffer.started", self.reply)
            self.played_ms += 1e3 * len(chunk) / (2 * RATE)
            if not self.buffer and self.finished:
                self.stop_reply()
        self.room.set()
        frame = av.AudioFrame(format="s16", layout="mono", samples=FRAME_SAMPLES)
        frame.planes[0].update(chunk.ljust(FRAME_BYTES, b"\0"))
        frame.sample_rate = RATE
        frame.pts = self.pts
        frame.time_base = fractions.Fraction(1, RATE)
        self.pts += FRAME_SAMPLES
        self.frames_sent += 1
        return frame


class MicDrain:
    """Drains a microphone track continuously and feeds PCM16 mono 48 kHz to `sink` (bytes -> awaitable).
    `refused(error)` tells the call of a media budget refusal (the call's Realtime `error`: an event on the data
    channel; None: the refused audio is dropped silently)."""

    def __init__(self, track: MediaStreamTrack, sink: Callable[[bytes], Awaitable[None]],
                 refused: Callable[[Exception], Awaitable[None]] | None = None) -> None:
        self.track, self.sink = track, sink
        self.refused = refused
        self.refusing = False  # the last feed was refused by the media budget (told once per run)
        self.frames: collections.deque[av.AudioFrame] = collections.deque()
        self.ready = asyncio.Event()
        self.dropped = 0  # frames dropped because feeding fell behind
        self.received = 0
        self.resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE)
        self.tasks = [asyncio.create_task(self.drain(), name="streamserve-webrtc-mic-drain"),
                      asyncio.create_task(self.feed(), name="streamserve-webrtc-mic-feed")]

    async def drain(self) -> None:
        try:
            while True:
                frame = await self.track.recv()
                self.received += 1
                if len(self.frames) >= MIC_QUEUE:
                    self.frames.popleft()
                    self.dropped += 1
                self.frames.append(frame)
                self.ready.set()
        except MediaStreamError:
            pass  # the track ended (the peer closed)

    def convert(self, frames: list[av.AudioFrame]) -> bytes:
        out = []
        for frame in frames:
            for f in self.resampler.resample(frame):
                out.append(f.to_ndarray().tobytes())  # packed s16 mono: [1, n]
        return b"".join(out)

    async def feed(self) -> None:
        while True:
            await self.ready.wait()
            self.ready.clear()
            frames = list(self.frames)
            self.frames.clear()
            data = self.convert(frames)
            if data:
                try:
                    await self.sink(data)
                    self.refusing = False
                except Exception as e:  # the Listener refused it (behind real time, closed): dropped, counted
                    self.dropped += len(frames)
                    log.debug("streamserve: microphone audio dropped: %s", e)
                    if isinstance(e, MediaQuotaError | MediaBusyError) and not self.refusing:
                        self.refusing = True
                        await self.tell(e)

    async def tell(self, e: Exception) -> None:
        if self.refused is not None:
            try:
                await self.refused(e)
            except Exception:  # the data channel is gone: nobody to tell
                log.debug("streamserve: a microphone refusal could not be told", exc_info=True)

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.wait(self.tasks)
