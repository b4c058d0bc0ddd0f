"""The call's parts without a network: the reply track (pacing state, notices, played ms, clear, its bound), the
microphone drain (never lets a track's queue grow: oldest dropped, counted), the data channel Channel (bounded
receive queue: overflow ends the call; send waits on the SCTP buffer)."""

from __future__ import annotations

import asyncio
from typing import Any

import av
import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from streamserve.server.adapters.webrtc import tracks as T
from streamserve.server.adapters.webrtc.channel import HIGH_WATER, RECEIVE_QUEUE, DataChannel


def pcm(ms: int, level: int = 1000) -> bytes:
    return (np.full(T.RATE * ms // 1000, level, np.int16)).tobytes()


@pytest.mark.asyncio
async def test_reply_track_notices_played_ms_and_clear() -> None:
    notices: list[tuple[str, str]] = []
    track = T.ReplyTrack(lambda kind, reply: notices.append((kind, reply)))
    idle = await track.recv()  # silence when idle, 20 ms at 48 kHz
    assert idle.samples == T.FRAME_SAMPLES and idle.sample_rate == T.RATE and not np.any(idle.to_ndarray())
    await track.play("resp_1", pcm(60))
    track.finish("resp_1")
    frames = [await track.recv() for _ in range(4)]
    assert [f.pts for f in frames] == [T.FRAME_SAMPLES * i for i in range(1, 5)]  # monotonic pts
    assert [bool(np.any(f.to_ndarray())) for f in frames] == [True, True, True, False]
    assert notices == [("output_audio_buffer.started", "resp_1"), ("output_audio_buffer.stopped", "resp_1")]
    await track.play("resp_2", pcm(100))
    await track.recv()
    await track.recv()
    assert track.clear() == ("resp_2", 40.0)  # what was played of it
    await track.play("resp_2", pcm(100))  # more of a cleared response: dropped
    assert not np.any((await track.recv()).to_ndarray())
    assert notices[-1] == ("output_audio_buffer.started", "resp_2")  # cleared, not stopped
    track.stop()


@pytest.mark.asyncio
async def test_reply_track_buffer_is_bounded() -> None:
    track = T.ReplyTrack(lambda kind, reply: None)
    await track.play("r", pcm(T.BUFFER_MS))
    more = asyncio.ensure_future(track.play("r", pcm(100)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not more.done()  # the Speaker waits while the track holds BUFFER_MS
    await track.recv()
    await asyncio.wait_for(more, 5)
    track.stop()


class Flood(MediaStreamTrack):
    """A microphone whose frames are all there at once (a receive queue that filled while nobody read)."""

    kind = "audio"

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    async def recv(self) -> av.AudioFrame:
        if self.left == 0:
            raise MediaStreamError
        self.left -= 1
        await asyncio.sleep(0)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 960), np.int16), format="s16", layout="mono")
        frame.sample_rate = 48000
        return frame


@pytest.mark.asyncio
async def test_mic_drain_keeps_the_queue_bounded() -> None:
    gate = asyncio.Event()
    fed: list[int] = []

    async def slow_sink(data: bytes) -> None:
        fed.append(len(data))
        await gate.wait()

    n = 3 * T.MIC_QUEUE
    drain = T.MicDrain(Flood(n), slow_sink)
    await asyncio.wait_for(drain.tasks[0], 10)  # every frame taken at once, though the sink is stuck
    assert drain.received == n and len(drain.frames) == T.MIC_QUEUE and drain.dropped > 0
    gate.set()
    while drain.frames:
        await asyncio.sleep(0.01)
    assert drain.dropped + sum(fed) // (2 * 960) == n  # every frame fed or counted as dropped
    await drain.close()


class FakeDC:
    label, readyState = "oai-events", "open"

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}
        self.bufferedAmount = 0
        self.bufferedAmountLowThreshold = 0
        self.sent: list[Any] = []
        self.closed = False

    def on(self, name: str, fn: Any) -> None:
        self.handlers[name] = fn

    def send(self, data: Any) -> None:
        self.sent.append(data)

    def close(self) -> None:
        self.closed = True


@pytest.mark.asyncio
async def test_data_channel_overflow_ends_and_send_waits_for_the_buffer() -> None:
    ended: list[bool] = []
    ch = DataChannel(lambda: ended.append(True))
    dc = FakeDC()
    ch.attach(dc)  # type: ignore[arg-type]
    dc.bufferedAmount = HIGH_WATER + 1
    sending = asyncio.ensure_future(ch.send("x"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not sending.done() and not dc.sent  # waits for bufferedamountlow
    dc.bufferedAmount = 0
    dc.handlers["bufferedamountlow"]()
    await asyncio.wait_for(sending, 5)
    assert dc.sent == ["x"]
    for i in range(RECEIVE_QUEUE + 1):
        dc.handlers["message"](f"{i}")
    assert ended == [True] and ch.overflows == 1 and ch.closed
    got = [f async for f in ch.receive()]
    assert len(got) == RECEIVE_QUEUE  # what was queued is read, then the end
