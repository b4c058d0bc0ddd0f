"""`WS /v1/stream`: the native protocol adapter (docs/protocol.md).

It decodes each frame with `protocol.decode_client` (I/O-free), calls the session service, and renders
the service's neutral results as native msgpack maps. Nothing here waits for the model: the service
runs blocking work on its executors. Everything sent goes through the connection's `Transport` (one
bounded queue, one writer, send timeout, read rate limit); when the connection ends, for whatever
reason, the service cancels its replies and detaches its sessions for a resume (server/adapters/adapter.py,
shared by every protocol).

A new wire protocol is a new adapter module beside this one, over the same service and transport.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import Counter

from streamserve.server.adapters import protocol as P
from streamserve.server.adapters.adapter import ProtocolAdapter
from streamserve.server.service.auth import Grant
from streamserve.server.service.results import (
    AppendRequest,
    ChunkResult,
    Closed,
    Committed,
    Configured,
    Opened,
    OpenRequest,
    Pushed,
    ReplyAudio,
    ReplyAudioDone,
    ReplyDelta,
    ReplyDone,
    Rewound,
    ServerInfo,
    ServiceError,
    Stats,
    Transcript,
    TurnEvent,
    VoiceSettings,
    service_error,
)
from streamserve.server.service.service import SessionService
from streamserve.server.transports.transport import Frame, Transport
from streamserve.version import __version__

log = logging.getLogger("streamserve.server")

MAX_BAD_MESSAGES = 16  # malformed frames tolerated per connection before it is closed (4400)


# ---- rendering: neutral results -> native messages ------------------------------------------------------
def render_hello(info: ServerInfo) -> dict[str, Any]:
    lim = info.limits
    return {"type": "hello", "protocol": P.PROTOCOL_VERSION, "server": f"streamserve {__version__}",
            "model": info.model, "policy_model": info.policy_model, "architecture": info.architecture,
            "modalities": list(info.modalities),
            "chat_template": info.chat_template, "capabilities": list(info.capabilities),
            "vocab_size": info.vocab_size, "max_context": info.max_context,
            "limits": {"max_frame_bytes": lim.max_frame_bytes, "max_chunk_tokens": lim.max_chunk_tokens,
                       "max_sessions": lim.max_sessions, "messages_per_second": lim.messages_per_second,
                       "bytes_per_second": lim.bytes_per_second, "resume_ttl_s": lim.resume_ttl_s,
                       "max_reply_tokens": lim.max_reply_tokens, "max_window": lim.max_window,
                       "max_pages": lim.max_pages, "max_queued_tokens": lim.max_queued_tokens,
                       "min_deadline_ms": lim.min_deadline_ms},
            "audio": None if info.audio is None else {
                "input": info.audio.input, "output_rate": info.audio.output_rate, "voice": info.audio.voice,
                "voice_rate": info.audio.voice_rate, "encodings": list(info.audio.encodings)},
            "image": None if info.image is None else {
                "input": info.image.input, "model": info.image.model, "max_pixels": info.image.max_pixels,
                "formats": ["jpeg", "png"]}}


def render_voice(v: VoiceSettings | None) -> dict[str, Any] | None:
    """A session's voice settings; turn_detection false when off (nil would read as absent)."""
    if v is None:
        return None
    return {"input": {k: x for k, x in v.input.items() if x is not None},
            "turn_detection": False if v.turn_detection is None else v.turn_detection,
            "speak": False if v.speak is None else v.speak}


def render(result: Any, request_id: Any = None) -> dict[str, Any]:
    """One service result -> one native message (`request_id`: the id of the client message it answers)."""
    if isinstance(result, ServiceError):
        return P.error_message(result.code, result.message, fatal=result.fatal, request_id=request_id,
                               session=result.session, seq=result.seq)
    if isinstance(result, ChunkResult):
        if result.error is not None:
            return render(result.error)
        return {"type": "ack", "session": result.session, "seq": result.seq, "tokens": result.tokens,
                "queue_ms": result.queue_ms, "compute_ms": result.compute_ms,
                "deadline_missed": result.deadline_missed, "shed": result.shed, "capture_time": result.capture_time,
                "chunk_seq": result.chunk_seq}
    if isinstance(result, ReplyDelta):
        return {"type": "delta", "session": result.session, "response": result.response, "text": result.text,
                "token_ids": result.token_ids}
    if isinstance(result, ReplyDone):
        return {"type": "done", "session": result.session, "response": result.response, "reason": result.reason,
                "usage": result.usage}
    if isinstance(result, ReplyAudio):
        return {"type": "audio", "session": result.session, "response": result.response, "audio": result.audio,
                "rate": result.rate, "encoding": result.encoding, "channels": result.channels}
    if isinstance(result, ReplyAudioDone):
        return {"type": "audio_done", "session": result.session, "response": result.response,
                "reason": result.reason, "audio_ms": result.audio_ms}
    if isinstance(result, TurnEvent):
        key = "audio_start_ms" if result.event == "speech_started" else "audio_end_ms"
        return {"type": "turn", "session": result.session, "event": result.event, key: result.audio_ms}
    if isinstance(result, Transcript):
        return {"type": "transcript", "session": result.session, result.kind: result.text, "seq": result.seq,
                "audio_start_ms": result.audio_start_ms, "audio_end_ms": result.audio_end_ms}
    if isinstance(result, Committed):
        return {"type": "committed", "id": request_id, "session": result.session, "text": result.text,
                "audio_start_ms": result.audio_start_ms, "audio_end_ms": result.audio_end_ms}
    if isinstance(result, Opened):
        return {"type": "opened", "id": request_id, "session": result.session, "resume_token": result.resume_token,
                "resumed": result.resumed, "next_seq": result.next_seq, "tokens": result.tokens,
                "window": result.window, "sinks": result.sinks, "positions": result.positions,
                "chunk_budget_ms": result.chunk_budget_ms, "reserved_pages": result.reserved_pages, "chat": result.chat,
                "voice": render_voice(result.voice)}
    if isinstance(result, Rewound):
        return {"type": "rewound", "id": request_id, "session": result.session, "tokens": result.tokens,
                "next_seq": result.next_seq}
    if isinstance(result, Configured):
        return {"type": "configured", "id": request_id, "session": result.session, "sampling": result.sampling,
                "chunk_budget_ms": result.chunk_budget_ms, "voice": render_voice(result.voice)}
    if isinstance(result, Closed):
        return {"type": "closed", "id": request_id, "session": result.session, "reason": result.reason}
    if isinstance(result, Stats):
        return {"type": "stats", "id": request_id, **result.engine, "connection_sessions": result.connection_sessions,
                "connection_pages_reserved": result.connection_pages_reserved,
                "connection_queued_tokens": result.connection_queued_tokens}
    raise TypeError(f"no native rendering for {type(result).__name__}")


class NativeConnection(ProtocolAdapter):
    """One native-protocol connection: frames decoded and dispatched to the service, results rendered."""

    hands_off = True  # its clients resume: a drain hands its sessions over to another instance (service/lifecycle.py)

    def __init__(self, service: SessionService, transport: Transport, grant: Grant, messages: Counter) -> None:
        super().__init__(service, transport, grant)
        self.messages = messages
        self.max_frame_bytes = service.config.max_frame_bytes
        self.bad = 0

    def render_pushed(self, result: Pushed) -> list[Frame]:
        return [P.encode(render(result))]

    async def send(self, message: dict[str, Any]) -> None:
        await self.transport.send(P.encode(message))

    async def greet(self) -> None:
        await self.send(render_hello(self.service.info()))

    async def handle(self, frame: Frame) -> None:
        try:
            m = P.decode_client(frame, self.max_frame_bytes)
        except P.ProtocolError as e:
            await self.send(P.error_message(e.code, e.message, request_id=e.request_id, session=e.session, seq=e.seq))
            self.bad += 1
            if self.bad >= MAX_BAD_MESSAGES:
                await self.transport.close(P.CLOSE_BAD_CLIENT, f"{self.bad} malformed messages")
            return
        self.messages.labels(m.type).inc()
        if self.service.draining and m.type not in P.DRAIN_TYPES:  # the client sends it again after its resume
            return
        self.service.operations += 1  # a drain waits for it
        try:
            answer = await getattr(self, f"on_{m.type}")(m)
            if answer is not None:
                await self.send(render(answer, m.id))
        except Exception as e:  # typed errors keep their message; anything else is internal_error + request id
            await self.send(render(service_error(e, m.session, m.fields.get("seq")), m.id))
        finally:
            self.service.operations -= 1

    async def move_out(self, moved: list[str], closed: list[str]) -> None:
        """The drain handed this connection's sessions `moved` over (and closes `closed`): say so, then close with
        1012, so that the client reconnects at once (through the proxy, to another instance) and resumes them."""
        for sid in closed:
            await self.push(Closed(sid, "shutdown"))
        await self.send({"type": "reconnect", "reason": "drain", "sessions": moved})
        await self.transport.close(P.CLOSE_SERVICE_RESTART, "server draining: reconnect and resume")

    # ---- one handler per client message type: fields -> service call ----------------------------------
    async def on_open(self, m: P.ClientMessage) -> Opened:
        f = m.fields
        return await self.service.open(self.ctx, OpenRequest(f["window"], f["sinks"], f["positions"], f["drafter"],
                                                             f["chunk_budget_ms"], f["sampling"], f["voice"]),
                                       bool(f["chat"]))

    async def on_resume(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        opened, recent = await self.service.resume(self.ctx, m.session, m.fields["resume_token"])
        await self.send(render(opened, m.id))
        for result in recent:  # the latest chunks' results: the client takes those it waits for
            await self.push(result)

    async def on_append(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        keys = ("seq", "capture_time", "deadline_ms", "kind", "text", "token_ids", "audio", "image", "rate",
                "channels", "encoding")
        await self.service.append(self.ctx, m.session, AppendRequest(**{k: m.fields[k] for k in keys}),
                                  m.fields["message"])

    async def on_respond(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        self.service.respond(self.ctx, m.session, m.fields)

    async def on_cancel(self, m: P.ClientMessage) -> None:
        assert m.session is not None
        self.service.cancel(self.ctx, m.session)

    async def on_rewind(self, m: P.ClientMessage) -> Rewound:
        assert m.session is not None
        f = m.fields
        return await self.service.rewind(self.ctx, m.session, f["to"], f["to_seq"], f["to_message"])

    async def on_configure(self, m: P.ClientMessage) -> Configured:
        assert m.session is not None
        return self.service.configure(self.ctx, m.session, m.fields["sampling"], m.fields["chunk_budget_ms"],
                                      m.fields["voice"])

    async def on_commit(self, m: P.ClientMessage) -> Committed:
        assert m.session is not None
        return await self.service.commit(self.ctx, m.session)

    async def on_close(self, m: P.ClientMessage) -> Closed:
        assert m.session is not None
        return await self.service.close(self.ctx, m.session)

    async def on_stats(self, m: P.ClientMessage) -> Stats:
        return self.service.stats(self.ctx)

