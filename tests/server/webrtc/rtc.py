"""Helpers of the WebRTC call tests: an aiortc client peer (microphone track playing synthesised speech, optional
camera track, the `oai-events` data channel, the reply track's audio collected) and the loopback-only guard.

Network: aioice gathers host candidates on every interface and skips 127.0.0.1, so `loopback_only` (autouse in
conftest.py) makes host discovery return 127.0.0.1 alone, in the server and the client (they share this process),
and no ICE server is configured on either side (aiortc's default would ask stun.l.google.com). As a guard, every
UDP datagram sent while a test runs goes through a check that fails the test if its destination is not loopback.
"""

from __future__ import annotations

import asyncio
import fractions
import ipaddress
import json
import time
from typing import Any

import aiohttp
import av
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

EVENT_TIMEOUT = 120.0
RATE = 48000
FRAME = RATE // 50  # 20 ms


def check_event(message: dict[str, Any]) -> None:
    """`message` validates against the openai SDK's GA server-event union, every field its model defines present."""
    from openai.types.realtime.realtime_server_event import RealtimeServerEvent
    from pydantic import TypeAdapter

    assert isinstance(message.get("event_id"), str) and message["event_id"], message
    model = TypeAdapter(RealtimeServerEvent).validate_python(message)
    missing = set(type(model).model_fields) - set(message)
    assert not missing, f"{message['type']} lacks {missing}"


def pin_to_loopback(monkeypatch: Any) -> list[Any]:
    """ICE host candidates are 127.0.0.1 only, and a UDP datagram to anything else fails (it is also recorded in the
    returned list, which the caller checks is empty at the end)."""
    from asyncio import selector_events

    import aioice.ice

    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    refused: list[Any] = []
    original = selector_events._SelectorDatagramTransport.sendto

    def sendto(self: Any, data: bytes, addr: Any = None) -> None:
        target = addr if addr is not None else self.get_extra_info("peername")
        if target is not None and not is_loopback(str(target[0])):
            refused.append(target)
            raise AssertionError(f"a datagram to {target} (not loopback)")
        original(self, data, addr)

    monkeypatch.setattr(selector_events._SelectorDatagramTransport, "sendto", sendto)
    return refused


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class SpeechTrack(MediaStreamTrack):
    """A microphone: float32 mono at 48 kHz queued with `say`, played in paced 20 ms frames; silence otherwise."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.queue = np.zeros(0, np.float32)
        self.pts = 0
        self.t0: float | None = None

    def say(self, samples: np.ndarray) -> None:
        self.queue = np.concatenate([self.queue, samples.astype(np.float32)])

    @property
    def talking(self) -> bool:
        return len(self.queue) > 0

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        self.t0 = self.t0 if self.t0 is not None else now
        wait = self.t0 + self.pts / RATE - now
        if wait > 0:
            await asyncio.sleep(wait)
        chunk, self.queue = self.queue[:FRAME], self.queue[FRAME:]
        pcm = np.zeros(FRAME, np.int16)
        pcm[:len(chunk)] = (np.clip(chunk, -1, 1) * 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, self.pts, fractions.Fraction(1, RATE)
        self.pts += FRAME
        return frame


class CameraTrack(MediaStreamTrack):
    """A camera: the same RGB image [H, W, 3] uint8 at 5 fps."""

    kind = "video"

    def __init__(self, image: np.ndarray) -> None:
        super().__init__()
        self.image, self.pts = image, 0

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        await asyncio.sleep(0.2)
        frame = av.VideoFrame.from_ndarray(self.image, format="rgb24")
        frame.pts, frame.time_base = self.pts, fractions.Fraction(1, 90000)
        self.pts += 18000
        return frame


class CallClient:
    """One call from the client's side."""

    def __init__(self, camera: np.ndarray | None = None) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = SpeechTrack()
        self.pc.addTrack(self.mic)
        if camera is not None:
            self.pc.addTrack(CameraTrack(camera))
        self.dc = self.pc.createDataChannel("oai-events")
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.seen: list[dict[str, Any]] = []
        self.dc.on("message", lambda m: self.events.put_nowait(json.loads(m)))
        self.opened = asyncio.Event()
        self.dc.on("open", self.opened.set)
        self.audio: list[tuple[float, float]] = []  # (arrival time, RMS) of each reply frame
        self.tasks: list[asyncio.Task] = []
        self.pc.on("track", self.on_track)
        self.location: str | None = None

    def on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self.tasks.append(asyncio.ensure_future(self.listen(track)))

    async def listen(self, track: MediaStreamTrack) -> None:
        try:
            while True:
                frame = await track.recv()
                x = frame.to_ndarray().astype(np.float32) / 32768
                self.audio.append((time.monotonic(), float(np.sqrt(np.mean(x ** 2)))))
        except MediaStreamError:
            pass

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def connect(self, http: str, key: str | None = None, session: dict[str, Any] | None = None) -> None:
        sdp = await self.offer()
        status, body, headers = await post_offer(http, sdp, key, session)
        assert status == 201, body
        assert headers["Content-Type"].startswith("application/sdp")
        self.location = headers["Location"]
        for line in body.decode().splitlines():  # every candidate the server offers is loopback
            if line.startswith("a=candidate:"):
                assert is_loopback(line.split()[4]), line
        await self.pc.setRemoteDescription(RTCSessionDescription(body.decode(), "answer"))
        await asyncio.wait_for(self.opened.wait(), 30)
        created = await self.recv()
        assert created["type"] == "session.created", created

    async def send(self, message: dict[str, Any]) -> None:
        self.dc.send(json.dumps(message))

    async def recv(self) -> dict[str, Any]:
        message = await asyncio.wait_for(self.events.get(), EVENT_TIMEOUT)
        check_event(message)
        self.seen.append(message)
        return message

    async def until(self, kind: str) -> list[dict[str, Any]]:
        got = []
        while True:
            got.append(await self.recv())
            if got[-1]["type"] == kind:
                return got

    def loud_frames(self, since: float = 0.0, level: float = 0.01) -> int:
        return sum(1 for t, rms in self.audio if t >= since and rms > level)

    def vanish(self) -> None:
        """The peer disappears without a word (a closed laptop, a lost network): its ICE sockets close silently."""
        for transceiver in self.pc.getTransceivers():
            ice = transceiver.receiver.transport.transport
            for protocol in ice._connection._protocols:
                protocol.transport.abort()

    async def close(self) -> None:
        await self.pc.close()
        for t in self.tasks:
            t.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks)


async def post_offer(http: str, sdp: str | bytes, key: str | None = None, session: dict[str, Any] | None = None,
                     content_type: str = "application/sdp") -> tuple[int, bytes, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        if session is not None:
            form = aiohttp.FormData()
            form.add_field("sdp", sdp, content_type="application/sdp")
            form.add_field("session", json.dumps(session), content_type="application/json")
            r = await s.post(f"{http}/v1/realtime/calls", data=form, headers=headers)
        else:
            r = await s.post(f"{http}/v1/realtime/calls", data=sdp, headers={**headers, "Content-Type": content_type})
        async with r:
            return r.status, await r.read(), r.headers


async def delete_call(http: str, location: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.delete(f"{http}{location}", headers=headers) as r:
        return r.status


def state(srv: Any) -> tuple[int, int, int, int, int]:
    """What a call holds on a running server: sessions, KV pages, tasks, calls, connections."""
    st = srv.engine.stats()
    return (st["sessions_open"], st["kv_pages_used"], len(asyncio.all_tasks()), len(srv.server.calls.live),
            len(srv.server.connections))


async def settled(srv: Any, before: tuple[int, ...], polls: int = 600) -> None:
    """Poll (at most `polls` x 50 ms) until the server is back to `before`: nothing of the call is left."""
    after = state(srv)
    for _ in range(polls):
        if after == before:
            break
        await asyncio.sleep(0.05)
        after = state(srv)
    assert after == before, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    srv.engine.check_integrity()
