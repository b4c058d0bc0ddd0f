"""One WebRTC call: an aiortc RTCPeerConnection, the Realtime connection over its data channel, its tracks.

    offer -> answer()            the peer (no ICE servers: host candidates only), the reply track, the answer
                                 (aiortc's setLocalDescription waits for ICE gathering: the answer has them all)
    start()                      the conversation's session opens (refusals are the POST's answer), then
                                 RealtimeConnection.run() serves the data channel `oai-events`
    microphone track             MicDrain -> the connection's Listener (PCM16 mono 48 kHz)
    camera track                 CameraSampler -> notes appended to the session (video chunks)
    RealtimeConnection.media     this object (realtime/media.py): reply audio to the ReplyTrack, barge-in clears
                                 it and truncates the item to what was heard, output_audio_buffer.* events
    close()                      whatever ends the call (DELETE, the peer's connection failed or closed, ICE/DTLS
                                 failure, the data channel closing, no connection within CONNECT_TIMEOUT, server
                                 shutdown): peer closed, tasks ended, Listener/Speaker and session closed. Once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from streamserve.server.adapters.realtime.connection import RealtimeConnection
from streamserve.server.adapters.realtime.events import event
from streamserve.server.adapters.webrtc.channel import LABEL, DataChannel
from streamserve.server.adapters.webrtc.tracks import FORMAT, MicDrain, ReplyTrack
from streamserve.server.adapters.webrtc.video import CameraSampler
from streamserve.server.transports.transport import RateLimiter, Transport

if TYPE_CHECKING:
    from aiortc import RTCDataChannel
    from aiortc.mediastreams import MediaStreamTrack
    from prometheus_client import Counter

    from streamserve.server.adapters.realtime.response import ResponseRun
    from streamserve.server.service.auth import Grant
    from streamserve.server.service.service import SessionService

log = logging.getLogger("streamserve.server")

CONNECT_TIMEOUT = 30.0  # seconds from the answer to a connected peer; else the call ends
NOTICES = 64  # output_audio_buffer.* events waiting to be sent (a response makes at most two)


class Call:
    input_format = FORMAT
    output_format = FORMAT

    def __init__(self, call_id: str, service: SessionService, grant: Grant, messages: Counter, video_fps: float,
                 on_end: Callable[[Call], None]) -> None:
        self.id, self.service, self.grant, self.video_fps, self.on_end = call_id, service, grant, video_fps, on_end
        c = service.config
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # never asks a STUN/TURN server anything
        self.channel = DataChannel(self.end_soon)
        self.track = ReplyTrack(self.notice)
        self.transport = Transport(self.channel, RateLimiter(c.messages_per_second, c.bytes_per_second))
        self.conn = RealtimeConnection(service, self.transport, grant, messages, media=self)
        self.mic: MicDrain | None = None
        self.camera: CameraSampler | None = None
        self.notices: asyncio.Queue[tuple[str, str]] = asyncio.Queue(NOTICES)
        self.pending_note: str | None = None  # a camera note waiting for the conversation to be quiet
        self.last_reply: str | None = None
        self.tasks: set[asyncio.Task] = set()
        self.runner: asyncio.Task | None = None
        self.connected = False  # the peer has been connected (ICE and DTLS done) at least once
        self.closing = False
        self.closed = asyncio.Event()
        self.created = time.monotonic()

    # ---- set-up ------------------------------------------------------------------------------------------------
    async def answer(self, offer: str) -> str:
        """The offer (checked by the route) -> the answer SDP. Raises what aiortc refuses."""
        self.pc.on("track", self.on_track)
        self.pc.on("datachannel", self.on_datachannel)
        self.pc.on("connectionstatechange", self.on_state)
        await self.pc.setRemoteDescription(RTCSessionDescription(offer, "offer"))
        self.pc.addTrack(self.track)  # takes the offer's audio transceiver: the reply plays on it
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        return self.pc.localDescription.sdp

    async def start(self) -> None:
        """Open the conversation's session (raises its refusal: nothing is left behind), then serve the call."""
        try:
            await self.conn.open_session()
        except BaseException:
            await self.close()
            raise
        self.runner = asyncio.create_task(self.serve(), name=f"streamserve-call-{self.id[-6:]}")
        self.spawn(self.notify())
        self.spawn(self.connect_deadline())

    async def serve(self) -> None:
        try:
            await self.conn.run()
        except Exception:
            log.exception("streamserve: a call's connection failed")
        finally:
            if not self.closing:  # else close() is under way (and waits for this task)
                await self.close()

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ---- the peer's events -------------------------------------------------------------------------------------
    def on_track(self, track: MediaStreamTrack) -> None:
        if self.closing:
            return
        if track.kind == "audio" and self.mic is None:
            self.mic = MicDrain(track, self.heard, self.conn.error)  # budget refusals: an error event
        elif track.kind == "video" and self.camera is None:
            self.camera = CameraSampler(track, self.video_fps, self.service.vision, self.note)

    async def heard(self, pcm: bytes) -> None:
        audio = self.conn.audio
        if audio is not None:  # no voice models: the microphone is drained and dropped
            await audio.listener.append(pcm)

    def on_datachannel(self, dc: RTCDataChannel) -> None:
        if dc.label == LABEL:
            self.channel.attach(dc)
        else:
            dc.close()  # only oai-events is spoken here

    def on_state(self) -> None:
        if self.pc.connectionState == "connected":
            self.connected = True
        if self.pc.connectionState in ("failed", "closed"):
            self.end_soon()

    def end_soon(self) -> None:
        if not self.closing:
            self.spawn(self.close())

    async def connect_deadline(self) -> None:
        await asyncio.sleep(CONNECT_TIMEOUT)
        if not self.connected or self.channel.dc is None:
            log.info("streamserve: call %s did not connect within %.0f s (peer %s, events channel %s)", self.id,
                     CONNECT_TIMEOUT, self.pc.connectionState, "open" if self.channel.dc else "never opened")
            self.end_soon()

    # ---- output_audio_buffer.* ------------------------------------------------------------------------------------
    def notice(self, kind: str, reply: str) -> None:
        """The track's started/stopped (called from its recv: must not block)."""
        self.last_reply = reply
        with contextlib.suppress(asyncio.QueueFull):  # only if nobody reads: the call is ending
            self.notices.put_nowait((kind, reply))

    async def notify(self) -> None:
        while True:
            kind, reply = await self.notices.get()
            await self.conn.send(event(kind, response_id=reply))
            await self.flush_note()  # a reply's end is when a waiting camera note may go in

    # ---- the MediaPath (realtime/media.py) ---------------------------------------------------------------------
    def emitter(self, run: ResponseRun) -> Callable[[bytes], Awaitable[None]]:
        async def emit(data: bytes) -> None:
            if run.cancel_reason is not None or not data:
                return
            if run.audio_started is None:
                run.audio_started = time.monotonic()
            await self.track.play(run.id, data)
        return emit

    def reply_done(self, run: ResponseRun) -> None:
        self.track.finish(run.id)

    async def interrupted(self) -> None:
        """Barge-in: the track is cleared at once; the item is cut to what was played (the server knows)."""
        reply, played = self.track.clear()
        if reply is None:
            return
        await self.conn.send(event("output_audio_buffer.cleared", response_id=reply))
        run = self.find_run(reply)
        audio = self.conn.audio
        if run is None or run.speaker is None or audio is None:
            return
        if run.cancel_reason is None and run.speaker.done and played >= run.speaker.audio_ms:
            return  # all of it was heard
        await audio.truncate_heard(run.item, run.speaker.heard_text(played))
        await self.conn.send(event("conversation.item.truncated", item_id=run.item.id, content_index=0,
                                   audio_end_ms=int(played)))

    async def clear(self) -> None:
        """output_audio_buffer.clear: the buffered audio goes at once (cancel the response first to stop more)."""
        reply, _ = self.track.clear()
        reply = reply or self.last_reply
        if reply is not None:
            await self.conn.send(event("output_audio_buffer.cleared", response_id=reply))

    def find_run(self, reply: str) -> ResponseRun | None:
        if self.conn.current is not None and self.conn.current.id == reply:
            return self.conn.current
        return next((r for r in self.conn.spoken.values() if r.id == reply), None)

    # ---- camera notes ----------------------------------------------------------------------------------------------
    async def note(self, text: str | None) -> None:
        """After each camera sample: its new note (None when the scene did not change) replaces one still waiting,
        and a waiting note goes in if the conversation is quiet now."""
        if text is not None:
            self.pending_note = text
        await self.flush_note()

    def quiet(self) -> bool:
        return self.pending_note is None

    async def before_reply(self) -> None:
        await self.flush_note()  # the person's message has ended: the scene goes in before the reply reads it

    async def flush_note(self) -> None:
        """Append the waiting note as a system message in a video chunk, only while nobody speaks: not inside the
        person's open message (it streams into the session) nor during a reply."""
        conn, text = self.conn, self.pending_note
        if text is None or conn.session is None or conn.current is not None or self.closing:
            return
        if conn.audio is not None and conn.audio.streaming:
            return  # tried again when the next sample or reply ends
        from streamserve.server.adapters.realtime.conversation import Item
        from streamserve.server.adapters.realtime.events import new_id

        self.pending_note = None
        # a system item the client sees (conversation.item.added, then .done at its ack), as the model reads it
        note = Item(new_id("item_"), "system", [{"type": "input_text", "text": f"(camera) {text}"}])
        try:
            await conn.add_item(note, kind="video")
        except Exception as e:  # shed under load, or the session is going: the next change brings a new note
            log.debug("streamserve: a camera note was not appended: %s", e)

    # ---- the end ---------------------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Free everything the call holds (idempotent; a second caller waits for the first)."""
        if self.closing:
            await self.closed.wait()
            return
        self.closing = True
        try:
            self.channel.abort()  # the connection's reads end: run() finishes the transport (session closed)
            if self.runner is not None and self.runner is not asyncio.current_task():
                await asyncio.wait({self.runner})
            elif self.runner is None:
                await self.transport.finish()  # never served: detach here (the session, if opened, closes)
                if self.conn.audio is not None:
                    await self.conn.audio.close()
            if self.camera is not None:  # what the camera gave: the first thing to read when a note never came
                c = self.camera
                log.info("streamserve: call %s camera: %d frames received, %d sampled, %d notes, %d failed",
                         self.id, c.received, c.sampled, c.notes, c.failures)
            for part in (self.mic, self.camera):
                if part is not None:
                    await part.close()
            self.track.clear()
            self.track.stop()
            with contextlib.suppress(Exception):
                await self.pc.close()
            me = asyncio.current_task()
            rest = [t for t in self.tasks if t is not me]
            for t in rest:
                t.cancel()
            if rest:
                await asyncio.wait(rest)
        finally:
            self.closed.set()
            self.on_end(self)
