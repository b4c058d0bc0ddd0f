"""`POST /v1/realtime/calls` and `DELETE /v1/realtime/calls/{call_id}` (docs/webrtc.md).

POST takes an SDP offer, as `application/sdp` or as multipart/form-data with `sdp` and `session` (a Realtime session
configuration, JSON, as OpenAI's unified interface takes; `session.video.fps` sets the camera's sampling rate here),
and answers 201 with the SDP answer (`application/sdp`) and `Location: /v1/realtime/calls/{call_id}`. Errors are
OpenAI's JSON error shape: {"error": {"message", "type", "code", "param"}}.

    400 invalid_sdp (garbage, not parseable, refused by aiortc), sdp_not_offer (a=setup other than actpass),
        no_audio (no audio m-line), invalid_session (or the session field's own code), invalid_body
    401 invalid_api_key / client_secret_used      413 sdp_too_large      415 unsupported_media_type
    429 too_many_calls (calls per key), too_many_connections (max_connections_per_ip: a call is a connection of
        its client address, server/transports/clients.py, until it ends)
    503 not_ready (model loading) / server_busy (max_connections)

Calls per key (`max_calls_per_key`): a client secret counts its own calls; the API key, and every caller when no
key is configured, count per client address, so one address cannot take every call of the key.

DELETE ends the call (204); only the credential that made it may (the API key, or the same client secret);
another gets 404, as an unknown id does.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import BodyPartReader, web

from streamserve.server.adapters.realtime import events as E
from streamserve.server.adapters.realtime import settings as S
from streamserve.server.adapters.realtime.events import RealtimeError
from streamserve.server.adapters.webrtc.call import Call
from streamserve.server.adapters.webrtc.video import MAX_FPS
from streamserve.server.transports.clients import UNKNOWN, TooManyConnectionsError, expect

if TYPE_CHECKING:
    from streamserve.config import ServerConfig
    from streamserve.server.adapters.adapter import ProtocolAdapter
    from streamserve.server.service.auth import Grant
    from streamserve.server.service.service import SessionService
    from streamserve.server.transports.clients import ConnectionCounts

log = logging.getLogger("streamserve.server")

MAX_SDP_BYTES = 64 * 1024  # a browser's offer is a few KB
MAX_SESSION_BYTES = 64 * 1024


def error(status: int, code: str, message: str, param: str | None = None) -> web.Response:
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code, "param": param}},
                             status=status)


class BadOffer(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.response = error(status, code, message, param)


def check_offer(raw: bytes) -> str:
    """The offer's text, or BadOffer: too big, not text, not SDP, an answer, no audio."""
    if len(raw) > MAX_SDP_BYTES:
        raise BadOffer(413, "sdp_too_large", f"the SDP offer is over {MAX_SDP_BYTES} bytes", "sdp")
    try:
        sdp = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadOffer(400, "invalid_sdp", "the SDP offer is not UTF-8 text", "sdp") from None
    lines = [ln.strip() for ln in sdp.splitlines() if ln.strip()]
    if not lines or lines[0] != "v=0" or not any(ln.startswith("m=") for ln in lines):
        raise BadOffer(400, "invalid_sdp", "the body is not an SDP offer (it must start with v=0 and have media "
                       "lines)", "sdp")
    try:
        from aiortc.sdp import SessionDescription

        parsed = SessionDescription.parse(sdp)
    except Exception:
        raise BadOffer(400, "invalid_sdp", "the SDP offer could not be parsed", "sdp") from None
    if not any(m.kind == "audio" for m in parsed.media):
        raise BadOffer(400, "no_audio", "the offer has no audio m-line: add a microphone track (or a recvonly audio "
                       "transceiver) before creating the offer", "sdp")
    if any(m.dtls is not None and m.dtls.role in ("client", "server") for m in parsed.media) or \
            any(ln in ("a=setup:active", "a=setup:passive") for ln in lines):
        raise BadOffer(400, "sdp_not_offer", "this SDP is an answer (a=setup:active/passive): send the offer "
                       "(a=setup:actpass)", "sdp")
    return sdp


def new_call_id() -> str:
    return "rtc_" + secrets.token_urlsafe(24)  # 192 random bits


class Server(Protocol):
    """What the calls need of the server (app.py's Server, which imports this module)."""

    config: ServerConfig
    engine: Any
    service: SessionService | None
    server_metrics: Any
    load_error: BaseException | None
    connections: set[ProtocolAdapter]
    per_address: ConnectionCounts  # connections per client address (WebSockets and calls)

    def grant(self, request: web.Request) -> Grant | None: ...


class Calls:
    """The server's live calls: by id, counted per credential (an API key's per client address), all closed at
    shutdown."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.live: dict[str, Call] = {}
        self.limit = server.config.max_calls_per_key
        self.metrics: CallMetrics | None = None  # registered with the engine's metrics once it has loaded

    def owned_by(self, grant: Grant) -> int:
        """The live calls that count against `grant`'s max_calls_per_key: its client secret's, or with the API key
        (or no key configured) the key's calls from the same client address."""
        if grant.secret is not None:
            return sum(1 for c in self.live.values() if c.grant.secret is grant.secret)
        return sum(1 for c in self.live.values() if c.grant.secret is None and c.grant.address == grant.address)

    async def create(self, request: web.Request) -> web.Response:
        srv = self.server
        grant: Grant | None = srv.grant(request)
        if grant is None:
            return error(401, "invalid_api_key", "send 'Authorization: Bearer <api key or client secret>'")
        if srv.load_error is not None:
            return error(503, "model_failed", "the model failed to load (see the server log)")
        if srv.service is None or srv.server_metrics is None:
            return error(503, "not_ready", "the model is still loading; retry shortly")
        try:
            offer, session = await self.read_body(request)
            sdp = check_offer(offer)
        except BadOffer as e:
            return e.response
        if self.owned_by(grant) >= self.limit:
            whose = "this client secret has" if grant.secret is not None else "this key has, from this address,"
            return error(429, "too_many_calls", f"{whose} {self.limit} calls open (the server's limit of calls per "
                         "key): hang one up first")
        if len(srv.connections) >= srv.config.max_connections:
            return error(503, "server_busy", "too many connections; retry later")
        service = srv.service
        try:
            fps = self.video_fps(session, srv.config.video_fps)
        except RealtimeError as e:
            return error(400, e.code, e.message, e.param)
        if self.metrics is None:
            self.metrics = CallMetrics(srv.engine.metrics.registry, self)
        try:  # the call is a connection of its address from here until `ended` (or the refusal below)
            srv.per_address.acquire(self.address(grant))
        except TooManyConnectionsError as e:
            return error(429, e.code, str(e))
        try:
            call = Call(new_call_id(), service, grant, srv.server_metrics.messages, fps, self.ended)
        except BaseException:
            srv.per_address.release(self.address(grant))
            raise
        if session is not None:  # the session configuration, checked whole as session.update checks it
            try:
                call.conn.settings = S.update(call.conn.settings, {k: v for k, v in session.items()
                                                                   if k not in ("video", "model")},
                                              service.voice is not None, service.config.max_reply_tokens)
            except RealtimeError as e:
                srv.per_address.release(self.address(grant))  # never live: `ended` will not give it back
                await call.close()
                return error(400, e.code, e.message, e.param)
        self.live[call.id] = call
        srv.connections.add(call.conn)
        try:
            answer = await call.answer(sdp)
        except Exception as e:
            await call.close()
            log.info("streamserve: an offer was refused by the WebRTC stack: %s", e)
            return error(400, "invalid_sdp", "the SDP offer was refused (no usable audio codec, ICE or DTLS "
                         "parameters)", "sdp")
        try:
            await call.start()
        except Exception as e:
            err = E.from_service(e)
            status = 401 if err.code == "client_secret_used" else 429 if err.code == "quota_exceeded" else \
                500 if err.kind == "server_error" else 400
            return error(status, err.code, err.message)
        return web.Response(status=201, body=answer.encode(), content_type="application/sdp",
                            headers={"Location": f"/v1/realtime/calls/{call.id}"})

    @staticmethod
    def video_fps(session: dict[str, Any] | None, default: float) -> float:
        """The session configuration's video.fps, else the server's (ServerConfig.video_fps once it exists)."""
        video = (session or {}).get("video")
        if video is None:
            return min(default, MAX_FPS)
        fps = video.get("fps", default) if isinstance(video, dict) else None
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= MAX_FPS:
            raise RealtimeError(f"session.video.fps must be a number above 0 and at most {MAX_FPS:g}",
                                "invalid_value", "session.video.fps")
        return float(fps)

    async def read_body(self, request: web.Request) -> tuple[bytes, dict[str, Any] | None]:
        """-> (the offer's bytes, the session configuration or None). BadOffer for a body of the wrong kind."""
        kind = request.content_type
        if kind == "application/sdp":
            return await self.read_limited(request.content, MAX_SDP_BYTES, "sdp"), None
        if kind != "multipart/form-data":
            raise BadOffer(415, "unsupported_media_type", "send the offer as application/sdp, or multipart/form-data "
                           "with the fields sdp and session")
        sdp: bytes | None = None
        session: Any = None
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "sdp":
                    sdp = await self.read_limited(part, MAX_SDP_BYTES, "sdp")
                elif part.name == "session":
                    raw = await self.read_limited(part, MAX_SESSION_BYTES, "session")
                    try:
                        session = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        raise BadOffer(400, "invalid_session", "session is not JSON", "session") from None
                    if not isinstance(session, dict):
                        raise BadOffer(400, "invalid_session", "session must be a JSON object", "session")
        except (ValueError, AssertionError) as e:
            raise BadOffer(400, "invalid_body", f"the multipart body could not be read: {e}") from None
        if sdp is None:
            raise BadOffer(400, "invalid_sdp", "the multipart body has no sdp field", "sdp")
        return sdp, session

    @staticmethod
    async def read_limited(stream: Any, limit: int, param: str) -> bytes:
        data = b""
        while chunk := await stream.read_chunk(8192) if isinstance(stream, BodyPartReader) else \
                await stream.read(8192):
            data += chunk
            if len(data) > limit:
                raise BadOffer(413, f"{param}_too_large", f"{param} is over {limit} bytes", param)
        return data

    async def delete(self, request: web.Request) -> web.Response:
        grant = self.server.grant(request)
        if grant is None:
            return error(401, "invalid_api_key", "send 'Authorization: Bearer <api key or client secret>'")
        call = self.live.get(request.match_info["call_id"])
        if call is None or (grant.secret is not None and call.grant.secret is not grant.secret):
            return error(404, "call_not_found", "no such call (or not yours)", "call_id")
        await call.close()
        return web.Response(status=204)

    @staticmethod
    def address(grant: Grant) -> str:
        return grant.address or UNKNOWN  # the server's grant() always sets it

    def ended(self, call: Call) -> None:
        if self.live.pop(call.id, None) is not None:  # once per live call: its address's connection goes back
            self.server.per_address.release(self.address(call.grant))
        self.server.connections.discard(call.conn)
        if self.metrics is not None:
            self.metrics.ended(call)

    async def close_all(self) -> None:
        for call in list(self.live.values()):
            await call.close()


class CallMetrics:
    """Prometheus figures of the calls (GET /metrics): live calls, and at each call's end what it dropped."""

    def __init__(self, registry: Any, calls: Calls) -> None:
        from prometheus_client import Counter, Gauge

        Gauge("streamserve_webrtc_calls", "Live WebRTC calls", registry=registry).set_function(lambda: len(calls.live))
        self.total = Counter("streamserve_webrtc_calls_ended", "WebRTC calls ended", registry=registry)
        self.mic_dropped = Counter("streamserve_webrtc_mic_frames_dropped", "Microphone frames (20 ms) dropped: "
                                   "feeding fell behind or the Listener refused them", registry=registry)
        self.notes = Counter("streamserve_webrtc_camera_notes", "Camera notes made", registry=registry)

    def ended(self, call: Call) -> None:
        self.total.inc()
        if call.mic is not None:
            self.mic_dropped.inc(call.mic.dropped)
        if call.camera is not None:
            self.notes.inc(call.camera.notes)


def routes(calls: Calls) -> list[web.RouteDef]:
    return [web.post("/v1/realtime/calls", calls.create, expect_handler=expect),
            web.delete("/v1/realtime/calls/{call_id}", calls.delete, expect_handler=expect)]

