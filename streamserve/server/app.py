"""`streamserve serve`: the HTTP and WebSocket front end, on one port (aiohttp).

    GET /healthz      200 {"status": "ok", ...} once the engine is loaded; 503 {"status": "loading"} before
    GET /metrics      Prometheus text (the engine's metrics and the server's)
    WS  /v1/stream    the native protocol (docs/protocol.md; server/native.py)

The engine loads in a worker thread after the port is open, so health checks see the server at once.
With an API key, /metrics and /v1/stream need `Authorization: Bearer KEY` (compared in constant time;
HTTP 401 otherwise, before any WebSocket upgrade). SIGINT/SIGTERM shut down gracefully: every
connection is told which of its sessions close and is closed with 1001, replies end, pages come back.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Gauge

from streamserve import __version__
from streamserve.config import (
    SAMPLING_DEFAULTS,
    SESSION_DEFAULTS,
    EngineConfig,
    SchedulerConfig,
    ServerConfig,
    SessionConfig,
)
from streamserve.engine import Engine
from streamserve.engine.sampling import check_sampling, check_seed, check_stop
from streamserve.errors import InvalidInputError
from streamserve.server import protocol as P
from streamserve.server.native import NativeConnection
from streamserve.server.registry import SessionRegistry

log = logging.getLogger("streamserve.server")

REAP_SECONDS = 1.0


@dataclass
class ServerMetrics:
    connections: Gauge
    messages: Counter


class Server:
    def __init__(self, config: ServerConfig, load: Callable[[], Engine],
                 sessions: SessionConfig = SESSION_DEFAULTS) -> None:
        key = config.api_key if config.api_key is not None else os.environ.get("STREAMSERVE_API_KEY") or None
        self.config = replace(config, api_key=key)
        self.session_defaults = sessions  # for `open` messages that leave window, sinks, ... out
        self._load = load
        self.engine: Engine | None = None  # type: ignore[assignment]
        self.registry: SessionRegistry = None  # type: ignore[assignment]
        self.connections: set[NativeConnection] = set()
        self.started = time.monotonic()
        self.load_error: BaseException | None = None
        self.app = web.Application(client_max_size=config.max_frame_bytes)
        self.app.add_routes([web.get("/healthz", self.healthz), web.get("/metrics", self.metrics),
                             web.get("/v1/stream", self.stream)])
        self.app.on_startup.append(self._on_startup)
        self.app.on_shutdown.append(self._on_shutdown)
        self.app.on_cleanup.append(self._on_cleanup)
        self._background: list[asyncio.Task] = []
        self._tasks: set[asyncio.Task] = set()
        self.ready = asyncio.Event()

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def _on_startup(self, app: web.Application) -> None:
        self._background.append(asyncio.create_task(self._load_engine()))
        self._background.append(asyncio.create_task(self._reaper()))

    async def _load_engine(self) -> None:
        try:
            engine = await asyncio.to_thread(self._load)
        except Exception as e:
            self.load_error = e
            log.error("streamserve: the model failed to load: %s", e)
            self.ready.set()
            return
        c = self.config
        self.registry = SessionRegistry(engine, c.resume_ttl, c.max_sessions_per_connection, c.max_chunk_tokens,
                                        c.max_sessions)
        reg = engine.metrics.registry
        self.server_metrics = ServerMetrics(
            Gauge("streamserve_connections", "Open WebSocket connections", registry=reg),
            Counter("streamserve_messages", "Client messages received, by type", ["type"], registry=reg))
        self.server_metrics.connections.set_function(lambda: len(self.connections))
        self.engine = engine
        self.ready.set()
        log.info("streamserve: serving %s", engine.name)

    async def _reaper(self) -> None:
        """Close detached sessions past their resume TTL, and forget sessions the engine closed."""
        while True:
            await asyncio.sleep(REAP_SECONDS)
            if self.registry is None:
                continue
            try:
                for entry in self.registry.expired():
                    await asyncio.to_thread(entry.session.close)
            except Exception:  # never let one bad close end the reaping
                log.exception("streamserve: reaping sessions failed")

    async def _on_shutdown(self, app: web.Application) -> None:
        await asyncio.gather(*(self._say_goodbye(conn) for conn in list(self.connections)))

    async def _say_goodbye(self, conn: NativeConnection) -> None:
        """Tell a connection which sessions close, give it 2 s to read that, close it; cut it if it will not."""
        if self.registry is not None:
            for entry in self.registry.owned(conn):
                conn.send_nowait({"type": "closed", "session": entry.session.id, "reason": "shutdown"})
        try:
            await asyncio.wait_for(conn.out.join(), 2.0)
            await asyncio.wait_for(conn.close(P.CLOSE_GOING_AWAY, "server shutting down"), 2.0)
        except Exception:  # a client that does not read: cut it
            conn.abort()

    def spawn(self, coro: Any) -> None:
        """A task of the server's (not of one connection): it outlives the connection that started it."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def deliver(self, session_id: str, message: dict[str, Any]) -> None:
        """Send a chunk's result to whichever connection holds its session now (none while detached)."""
        entry = self.registry.find(session_id) if self.registry is not None else None
        if entry is None:
            return
        entry.recent.append(message)  # sent again to a connection that resumes the session
        owner = entry.owner
        if owner is not None:
            await owner.send(message)

    async def _on_cleanup(self, app: web.Application) -> None:
        for t in [*self._background, *self._tasks]:
            t.cancel()
        if self.engine is not None:
            for entry in self.registry.all():
                self.registry.remove(entry.session.id)
                await asyncio.to_thread(entry.session.close)
            await asyncio.to_thread(self.engine.shutdown)

    # ---- helpers --------------------------------------------------------------------------------------
    def authorized(self, request: web.Request) -> bool:
        if self.config.api_key is None:
            return True
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {self.config.api_key}"
        return hmac.compare_digest(given.encode(), expected.encode())

    def hello(self) -> dict[str, Any]:
        e, c = self.engine, self.config
        assert e is not None
        return {"type": "hello", "protocol": P.PROTOCOL_VERSION, "server": f"streamserve {__version__}",
                "model": e.name, "architecture": e.config.architecture, "modalities": ["text"],
                "vocab_size": e.config.vocab_size, "max_context": e.config.max_position_embeddings,
                "limits": {"max_frame_bytes": c.max_frame_bytes, "max_chunk_tokens": c.max_chunk_tokens,
                           "max_sessions": c.max_sessions_per_connection,
                           "messages_per_second": c.messages_per_second, "resume_ttl_s": c.resume_ttl,
                           "max_reply_tokens": c.max_reply_tokens}}

    def check_sampling(self, params: dict[str, Any]) -> dict[str, Any]:
        """Reply parameters within the engine's ranges and the server's max_reply_tokens (checked where they
        are given: `open` and `configure` too, so a session's defaults are always usable)."""
        d, limit = SAMPLING_DEFAULTS, self.config.max_reply_tokens
        max_tokens = params.get("max_tokens", min(d.max_tokens, limit))
        check_sampling(max_tokens, params.get("temperature", d.temperature), params.get("top_p", d.top_p),
                       params.get("top_k", d.top_k))
        check_seed(params.get("seed"))
        check_stop(params.get("stop"))
        if max_tokens > limit:
            raise InvalidInputError(f"max_tokens {max_tokens} is over this server's limit of {limit}")
        return {**params, "max_tokens": max_tokens}

    # ---- routes ---------------------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        if self.load_error is not None:
            return web.json_response({"status": "failed", "error": str(self.load_error)}, status=500)
        if self.engine is None:
            return web.json_response({"status": "loading"}, status=503)
        st = self.engine.stats()
        return web.json_response({"status": "ok", "model": st["model"], "device": st["device"],
                                  "sessions_open": st["sessions_open"], "connections": len(self.connections),
                                  "uptime_s": round(time.monotonic() - self.started, 1)})

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return _unauthorized()
        if self.engine is None:
            return web.Response(status=503, text="loading\n")
        return web.Response(body=self.engine.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        if not self.authorized(request):
            return _unauthorized()
        ws = web.WebSocketResponse(max_msg_size=self.config.max_frame_bytes, heartbeat=20.0)
        await ws.prepare(request)
        if self.engine is None:
            await ws.close(code=P.CLOSE_TRY_LATER, message=b"the model is still loading; retry shortly")
            return ws
        if len(self.connections) >= self.config.max_connections:
            await ws.close(code=P.CLOSE_TRY_LATER, message=b"too many connections; retry later")
            return ws
        conn = NativeConnection(self, ws, request.transport)
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
        return ws


def _unauthorized() -> web.Response:
    return web.json_response({"type": "error", "code": "unauthorized",
                              "message": "send 'Authorization: Bearer <api key>'"}, status=401,
                             headers={"WWW-Authenticate": "Bearer"})


def engine_loader(engine: EngineConfig, scheduler: SchedulerConfig | None = None) -> Callable[[], Engine]:
    def load() -> Engine:
        return Engine.from_pretrained(engine.model, device=engine.device, dtype=engine.dtype, kernels=engine.kernels,
                                      cuda_graphs=engine.cuda_graphs, kv_memory=engine.kv_memory,
                                      drafter=engine.drafter, max_draft=engine.max_draft,
                                      page_size=engine.page_size, idle_ttl=engine.idle_ttl, scheduler=scheduler)
    return load


async def start(server: Server) -> tuple[web.AppRunner, int]:
    """Start listening; -> (runner, the bound port). `await runner.cleanup()` stops it."""
    runner = web.AppRunner(server.app, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, server.config.host, server.config.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def run(server: Server, announce: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully."""

    async def main() -> None:
        runner, port = await start(server)
        announce(f"streamserve: listening on http://{server.config.host}:{port} "
                 f"(WebSocket ws://{server.config.host}:{port}/v1/stream); loading the model...")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        ready = asyncio.create_task(server.ready.wait())
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready in done and server.load_error is not None:
            announce(f"streamserve: the model failed to load: {server.load_error}")
            await runner.cleanup()
            raise SystemExit(1)
        if ready in done and server.engine is not None:
            announce(f"streamserve: ready: {server.engine.name} on {server.engine.device}")
        await stopped
        announce("streamserve: shutting down")
        await runner.cleanup()

    asyncio.run(main())
