"""`streamserve serve`: routes, lifecycle and auth on one port (aiohttp). The session work is the session
service's (server/service/service.py), the wire format the protocol adapter's (server/adapters/native.py), the sending
the transport's (server/transports/transport.py).

    GET  /healthz                    ready or not: 200 {"status": "ok"} / 503 {"status": "loading" | "failed"};
                                     with a valid key also the model, sessions, connections, uptime
    GET  /metrics                    Prometheus text (the engine's metrics and the server's)
    WS   /v1/stream                  the native protocol (docs/protocol.md)
    WS   /v1/policy                  a robot policy, openpi's protocol (adapters/policy/; also `/` on --policy-port)
    WS   /v1/realtime                the OpenAI Realtime API, GA events (docs/realtime.md; `?model=` accepted)
    /v1/models, /v1/chat/completions, /v1/responses, /v1/conversations, /v1/audio/*: OpenAI's HTTP APIs, their
                                     stored state and sessions (server/adapters/openai_http/, docs/openai.md)
    POST /v1/realtime/client_secrets a short-lived client secret (OpenAI's request and response shape)
    POST /v1/realtime/calls          a WebRTC call (SDP offer in, answer out; server/adapters/webrtc/, docs/webrtc.md);
    DELETE /v1/realtime/calls/{id}   hangs it up (only when aiortc, the webrtc extra, is installed)
    POST /admin/drain                drain, as SIGUSR1 (server/drain.py; the API key, or a loopback peer)
    GET  /                           the browser voice/video demo (clients/web/, installed as streamserve.web)
    GET  /web/{path}                 its modules, worklets and styles (transports/static.py: listed at start, in memory)

The engine loads in a worker thread after the port is open, so health checks see the server at once. Connections
(WebSockets, WebRTC calls) count against --max-connections and, per client address (transports/clients.py: the peer, or
X-Forwarded-For from a --trusted-proxies peer), --max-connections-per-ip; every route answers `Expect` with
transports/clients.py's handler (100-continue or 417, never 500). With an API key, /v1/stream, /v1/realtime, /v1/policy
and calls need it or a live client secret (service/auth.py), the HTTP APIs, /metrics and minting secrets the key
itself, /healthz nothing (it says more with the key); a browser page from an origin not allowed gets 403 before
anything else. No exception text reaches a client: an unexpected failure is answered with `internal_error` and a
request id that the server log also has. SIGINT/SIGTERM shut down gracefully: every connection is told which of its
sessions close and is closed with 1001, replies end, pages come back. SIGUSR1 (or POST /admin/drain) drains
(server/drain.py), then stops. If the engine thread dies (engine/loop.py), /healthz says `failed`, new connections
are closed with 1011, work on open sessions is refused (`engine_failed`), and `run` shuts down the same way and exits
with status 1, so that a supervisor restarts the server rather than keep a process that cannot serve.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial

from aiohttp import web
from prometheus_client import Counter, Gauge

from streamserve.config import (
    SESSION_DEFAULTS,
    ServerConfig,
    SessionConfig,
)
from streamserve.engine import Engine
from streamserve.engine.compiled import compile_note
from streamserve.errors import StreamserveError
from streamserve.server.adapters import protocol as P
from streamserve.server.adapters.adapter import ProtocolAdapter
from streamserve.server.adapters.native import NativeConnection
from streamserve.server.adapters.openai_http import OpenAIHttp
from streamserve.server.adapters.policy import PolicyEndpoint
from streamserve.server.adapters.realtime.connection import RealtimeConnection
from streamserve.server.adapters.secrets_route import client_secrets_route
from streamserve.server.adapters.webrtc import webrtc_calls
from streamserve.server.drain import drain_route, start_drain
from streamserve.server.media.loaders import load_vision, load_voice
from streamserve.server.service.auth import (
    Authenticator,
    Grant,
    bearer,
    origin_allowed,
    parse_origins,
    resolve_api_key,
    split_protocols,
)
from streamserve.server.service.results import service_error
from streamserve.server.service.service import SessionService
from streamserve.server.transports.clients import (
    UNKNOWN,
    ConnectionCounts,
    TooManyConnectionsError,
    answer_unmatched_expectations,
    client_address,
    close_reason,
    expect,
    parse_trusted_proxies,
)
from streamserve.server.transports.http_replies import error_response, unauthorized, utf8
from streamserve.server.transports.static import StaticFiles
from streamserve.server.transports.transport import RateLimiter, Transport, WebSocketChannel

log = logging.getLogger("streamserve.server")

REAP_SECONDS = 1.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ServerMetrics:
    connections: Gauge
    messages: Counter


class Server:
    def __init__(self, config: ServerConfig, load: Callable[[], Engine],
                 sessions: SessionConfig = SESSION_DEFAULTS, step_tokens: int | None = None) -> None:
        self.config = replace(config, api_key=resolve_api_key(config), api_key_file=None)
        self.auth = Authenticator(self.config.api_key)
        self.trusted_proxies = parse_trusted_proxies(config.trusted_proxies)  # checked at start (InvalidInputError)
        self.per_address = ConnectionCounts(config.max_connections_per_ip)  # WebSockets and calls per client address
        self.origins = parse_origins(config.allowed_origins)
        self.session_defaults, self.step_tokens = sessions, step_tokens
        self.load = load
        self.engine: Engine | None = None
        self.service: SessionService | None = None
        self.server_metrics: ServerMetrics | None = None
        self.connections: set[ProtocolAdapter] = set()  # every protocol's
        self.started = time.monotonic()
        self.load_error: BaseException | None = None  # for the operator (the log, the CLI), never a client
        self.app = web.Application(client_max_size=config.max_frame_bytes, middlewares=[self.guard])
        self.openai = OpenAIHttp(self)  # the OpenAI HTTP APIs (server/adapters/openai_http/)
        self.app.add_routes([web.get("/healthz", self.healthz, expect_handler=expect),
                             web.post("/admin/drain", partial(drain_route, self), expect_handler=expect),
                             web.get("/metrics", self.metrics, expect_handler=expect),
                             web.get("/v1/stream", self.stream, expect_handler=expect),
                             web.get("/v1/realtime", self.realtime, expect_handler=expect),
                             web.post("/v1/realtime/client_secrets", partial(client_secrets_route, self),
                                      expect_handler=expect),
                             *StaticFiles().routes(), *self.openai.routes()])
        answer_unmatched_expectations(self.app)  # its 404 and 405 answers too
        for hooks, hook in ((self.app.on_startup, self.on_startup), (self.app.on_shutdown, self.on_shutdown),
                            (self.app.on_cleanup, self.on_cleanup)):
            hooks.append(hook)
        self.background: list[asyncio.Task] = []
        self.ready = asyncio.Event()
        self.engine_failed = asyncio.Event()  # set (on the event loop) when the engine thread dies
        self.draining: asyncio.Task | None = None  # the drain (server/drain.py), once asked for
        self.drained = asyncio.Event()  # set when the drain is done: `run` then stops the server
        self.calls = webrtc_calls(self)
        self.policy = PolicyEndpoint(self)  # WS /v1/policy, and its own site with --policy-port

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def on_startup(self, app: web.Application) -> None:
        self.background.append(asyncio.create_task(self.load_engine()))
        self.background.append(asyncio.create_task(self.reaper()))

    async def load_engine(self) -> None:
        try:
            engine = await asyncio.to_thread(self.load)
        except Exception as e:
            self.load_error = e
            if isinstance(e, StreamserveError):  # a typed, explained failure: no traceback needed
                log.error("streamserve: the model failed to load: %s", e)
            else:
                log.exception("streamserve: the model failed to load")
            self.ready.set()
            return
        # the most tokens of one session one step runs (page reservations): the engine's step budget, which may
        # depend on its device, unless the caller fixes it
        limits = engine.scheduler.limits
        step = self.step_tokens or max(limits.step_tokens or 0, limits.min_append_tokens)
        voice = None if self.config.no_voice else await asyncio.to_thread(load_voice)
        vision = None if self.config.no_vision else await asyncio.to_thread(load_vision)
        self.service = SessionService(engine, self.config, self.session_defaults, step, voice, vision)
        reg = engine.metrics.registry
        self.server_metrics = ServerMetrics(
            Gauge("streamserve_connections", "Open WebSocket connections", registry=reg),
            Counter("streamserve_messages", "Client messages received, by type", ["type"], registry=reg))
        self.server_metrics.connections.set_function(lambda: len(self.connections))
        self.service.metrics(reg)  # media bytes and refusals; the STT queue, passes and latencies
        self.engine = engine
        try:  # --policy-model: the robot policy beside it, on an engine of its own
            await self.policy.load_model(step, vision)
        except Exception as e:
            self.load_error = e
            log.error("streamserve: the policy model failed to load: %s", e)
            self.ready.set()
            return
        self.service.policy_model = self.policy.model_name()
        loop = asyncio.get_running_loop()
        engine.loop.on_death(lambda fault: loop.call_soon_threadsafe(self.engine_failed.set))
        self.ready.set()
        log.info("streamserve: serving %s", engine.name)

    async def reaper(self) -> None:
        while True:
            await asyncio.sleep(REAP_SECONDS)
            if self.service is None:
                continue
            try:
                for service in (self.service, self.policy.service):
                    if service is not None:
                        await service.reap()
                await self.openai.reap()
            except Exception:  # never let one bad close end the reaping
                log.exception("streamserve: reaping sessions failed")

    async def on_shutdown(self, app: web.Application) -> None:
        await asyncio.gather(*(self.say_goodbye(conn) for conn in list(self.connections)))
        if self.calls is not None:  # their peers, tracks and tasks too
            await self.calls.close_all()

    async def say_goodbye(self, conn: ProtocolAdapter) -> None:
        """Tell a connection which sessions close, give it 2 s to read that, close it; cut it if it will not."""
        if self.service is not None:
            self.service.announce_shutdown(conn.ctx)
        try:
            await conn.transport.drain(2.0)
            await asyncio.wait_for(conn.transport.close(P.CLOSE_GOING_AWAY, "server shutting down"), 2.0)
        except Exception:  # a client that does not read: cut it
            conn.transport.abort()

    async def on_cleanup(self, app: web.Application) -> None:
        for t in self.background:
            t.cancel()
        if self.service is not None:
            await self.service.shutdown()
        await self.policy.close_model()

    @property
    def engine_died(self) -> BaseException | None:
        """What ended the engine thread, if it died (the detail is for the log, never a client)."""
        return None if self.engine is None else self.engine.loop.died

    # ---- auth -----------------------------------------------------------------------------------------
    def credential(self, request: web.Request) -> str | None:
        given = bearer(request.headers.get("Authorization"))
        return given if given is not None else split_protocols(request.headers.get("Sec-WebSocket-Protocol"))[0]

    def grant(self, request: web.Request) -> Grant | None:
        """The request's Grant (None: 401), carrying the client address its limits count against."""
        credential = self.credential(request)
        if credential is not None and not utf8(credential):  # no key or secret of ours: refused, as a wrong one is
            return None
        return self.auth.grant_for(credential, client_address(request, self.trusted_proxies))

    def operator(self, request: web.Request) -> bool:
        """The API key itself (or no key configured): what server-wide figures need; a client secret is not
        enough."""
        credential = self.credential(request)
        return not self.auth.required or (credential is not None and utf8(credential)
                                          and self.auth.is_api_key(credential))

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every request: a browser page from a foreign origin is refused first; a failure that is not a typed
        answer becomes `internal_error` + request id (the traceback goes to the log, not the client)."""
        if not origin_allowed(request.headers.get("Origin"), request.host, self.origins, self.config.host):
            return error_response(403, "origin_not_allowed", "this origin may not use this server "
                                  "(the server's --allowed-origins)")
        if self.draining is not None and (request.path.startswith("/v1/")
                                          or request.headers.get("Upgrade", "").lower() == "websocket"):
            return web.json_response({"status": "draining"}, status=503)  # before any upgrade: a proxy retries
        try:
            return await handler(request)
        except web.HTTPException:
            raise  # aiohttp's own answers (404, 405, 413): fixed texts, no detail
        except Exception as e:
            err = service_error(e)
            return error_response(500, err.code, err.message, request_id=err.request_id)

    # ---- routes ---------------------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        if self.load_error is not None or self.engine_died is not None:
            return web.json_response({"status": "failed"}, status=503)
        if self.engine is None or self.draining is not None:
            return web.json_response({"status": "loading" if self.engine is None else "draining"}, status=503)
        if self.operator(request):
            st = self.engine.stats()
            return web.json_response({"status": "ok", "model": st["model"], "device": st["device"],
                                      "sessions_open": st["sessions_open"], "connections": len(self.connections),
                                      "uptime_s": round(time.monotonic() - self.started, 1)})
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.operator(request):
            return unauthorized()
        if self.engine is None:
            return web.Response(status=503, text="loading\n")
        return web.Response(body=self.engine.metrics.exposition() + self.policy.metrics_text(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        return await self.websocket(request, NativeConnection, self.config.max_frame_bytes)

    async def realtime(self, request: web.Request) -> web.StreamResponse:
        # frames up to twice max_frame_bytes are read, so that the adapter answers one over max_frame_bytes with an
        # `error` event and the connection goes on; past that aiohttp closes it (1009)
        return await self.websocket(request, RealtimeConnection, 2 * self.config.max_frame_bytes)

    async def websocket(self, request: web.Request, adapter: Callable[..., ProtocolAdapter],
                        max_msg_size: int) -> web.StreamResponse:
        """A WebSocket route: auth (Bearer, subprotocol key, client secret), the upgrade, then `adapter` serves it."""
        grant = self.grant(request)
        if grant is None:
            return unauthorized()
        if not all(utf8(k) and utf8(v) for k, v in request.headers.items()):  # the clone below encodes them all
            return error_response(400, "invalid_header", "a header of the WebSocket handshake is not UTF-8 text")
        offered = split_protocols(request.headers.get("Sec-WebSocket-Protocol"))[1]
        # compress=False: no permessage-deflate (media frames do not compress; it costs CPU and memory per
        # connection). protocols: echo a non-secret protocol the client offered, never a key. The handshake
        # sees only the non-secret ones: aiohttp logs the client's whole list when none overlaps.
        headers = request.headers.copy()
        headers.popall("Sec-WebSocket-Protocol", None)
        if offered:
            headers["Sec-WebSocket-Protocol"] = ", ".join(offered)
        ws = web.WebSocketResponse(max_msg_size=max_msg_size, heartbeat=20.0, compress=False,
                                   protocols=tuple(offered))
        address = grant.address or UNKNOWN  # self.grant always sets it
        try:  # decided before the upgrade; told after it (close 1013), as a browser sees no HTTP status
            self.per_address.acquire(address)
        except TooManyConnectionsError as e:
            await ws.prepare(request.clone(headers=headers))
            await ws.close(code=P.CLOSE_TRY_LATER, message=close_reason(e))
            return ws
        try:  # the address's count goes back on every way out, the upgrade's failure included
            await ws.prepare(request.clone(headers=headers))
            await self.serve_websocket(request, ws, adapter, grant)
        finally:
            self.per_address.release(address)
        return ws

    async def serve_websocket(self, request: web.Request, ws: web.WebSocketResponse,
                              adapter: Callable[..., ProtocolAdapter], grant: Grant) -> None:
        """An upgraded WebSocket: refused with a close code when the server cannot serve it, else served."""
        if self.load_error is not None:  # permanent until the operator acts: not "retry shortly"
            await ws.close(code=P.CLOSE_INTERNAL, message=b"the model failed to load (see the server log)")
            return
        if self.engine_died is not None:
            await ws.close(code=P.CLOSE_INTERNAL, message=b"the engine failed (see the server log)")
            return
        if self.service is None or self.server_metrics is None:
            await ws.close(code=P.CLOSE_TRY_LATER, message=b"the model is still loading; retry shortly")
            return
        if len(self.connections) >= self.config.max_connections:
            await ws.close(code=P.CLOSE_TRY_LATER, message=b"too many connections; retry later")
            return
        c = self.config
        transport = Transport(WebSocketChannel(ws, request.transport),
                              RateLimiter(c.messages_per_second, c.bytes_per_second))
        conn = adapter(self.service, transport, grant, self.server_metrics.messages)
        self.connections.add(conn)
        try:
            await conn.run()
        except Exception as e:  # the upgrade is done: no HTTP answer any more, a close code and the log
            service_error(e)
            if not ws.closed:
                await ws.close(code=P.CLOSE_INTERNAL, message=b"internal server error")
        finally:
            self.connections.discard(conn)


async def start(server: Server) -> tuple[web.AppRunner, int]:
    """Start listening; -> (runner, the bound port). `await runner.cleanup()` stops it."""
    runner = web.AppRunner(server.app, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, server.config.host, server.config.port)
    await site.start()
    await server.policy.start_site(runner)  # with --policy-port (its failure stops `runner` too)
    return runner, runner.addresses[0][1]


def run(server: Server, announce: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully; on SIGUSR1 drain, then stop (exit 0)."""

    async def main() -> None:
        runner, port = await start(server)
        announce(f"streamserve: listening on http://{server.config.host}:{port} "
                 f"(WebSocket ws://{server.config.host}:{port}/v1/stream{server.policy.where()}); loading the model...")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, start_drain, server)
        ready = asyncio.create_task(server.ready.wait())
        stopped = asyncio.create_task(stop.wait())
        drained = asyncio.create_task(server.drained.wait())
        done, _ = await asyncio.wait({ready, stopped, drained}, return_when=asyncio.FIRST_COMPLETED)
        if ready in done and server.load_error is not None:
            announce(f"streamserve: the model failed to load: {server.load_error}")
            await runner.cleanup()
            raise SystemExit(1)
        if ready in done and server.engine is not None:
            announce(f"streamserve: ready: {server.engine.name} on {server.engine.device}{server.policy.note()}"
                     f"{compile_note(getattr(server.engine, 'graphs', None), announce)}")  # (SGLang: none)
        failed = asyncio.create_task(server.engine_failed.wait())
        await asyncio.wait({stopped, failed, drained}, return_when=asyncio.FIRST_COMPLETED)
        if server.engine_died is not None:
            announce(f"streamserve: the engine thread died ({type(server.engine_died).__name__}: see the log); "
                     "shutting down")
            await runner.cleanup()
            raise SystemExit(1)
        failed.cancel()
        announce("streamserve: drained; stopping" if server.drained.is_set() else "streamserve: shutting down")
        await runner.cleanup()

    asyncio.run(main())
