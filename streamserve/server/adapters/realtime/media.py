"""The hook a Realtime connection's audio takes when it does not travel in events: a WebRTC call
(server/adapters/webrtc/) carries the person's audio on a microphone track and the reply's audio on an outgoing track,
and the connection's events go over the data channel. One implementation serves both transports: RealtimeConnection and
InputAudio ask this object (`RealtimeConnection.media`, None on a WebSocket) only at the few points where the paths
part:

    input_format     what the Listener is fed (the microphone track decoded: PCM16 mono 48 kHz), whatever
                     session.update says of audio formats (those are the WebSocket's)
    output_format    what the Speaker makes (PCM16 mono 48 kHz for the outgoing track)
    emitter(run)     where a response's audio goes (the track, not response.output_audio.delta events)
    reply_done(run)  the response's audio is all handed over (the track says output_audio_buffer.stopped once
                     it has played out)
    interrupted()    barge-in: the track is cleared at once and the item truncated to what was heard
    clear()          output_audio_buffer.clear
    quiet()          nothing waits to go in before a reply (a response may start held, at the likely end of a
                     turn: realtime/speculation.py)
    before_reply()   a response is about to start: the call's waiting camera note goes in first (after the
                     person's message, before the reply's generation prompt), so the model answers on the
                     latest scene even when the person never paused between turns
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from streamserve.media.audio import AudioFormat
    from streamserve.server.adapters.realtime.response import ResponseRun


class MediaPath(Protocol):
    input_format: AudioFormat
    output_format: AudioFormat

    def emitter(self, run: ResponseRun) -> Callable[[bytes], Awaitable[None]]: ...
    def reply_done(self, run: ResponseRun) -> None: ...
    async def interrupted(self) -> None: ...
    async def clear(self) -> None: ...
    async def before_reply(self) -> None: ...
    def quiet(self) -> bool: ...
