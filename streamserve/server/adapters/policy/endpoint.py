"""The policy endpoint's place in `streamserve serve`: the `/v1/policy` route on the main port and, with
--policy-port, the same endpoint at `/` on a second aiohttp site of the same host (openpi's client connects to
`ws://host:port` with no path). Both go through the server's WebSocket route (auth, origin check, connection
limits, those per client address included, transport) and the same session service; the second site's routes
answer `Expect` as the main site's do (server/transports/clients.py).

With --policy-model, the endpoint serves that checkpoint on an engine and a session service of its own (loaded
after the main model, before the server is ready; the same config, auth and limits), so one server serves a chat
model and a robot policy. Otherwise it serves the main model. The native `hello` says which (`policy_model`).

The codec is the served checkpoint's `policy.json` (robot/codec.py), read once the model has loaded: a model
without one has no policy, and a client is told so (text frame, close 1011) instead of being sent metadata. So is a
client of a policy that reads camera images when the server takes none (no vision model loaded and no image encoder
in the checkpoint): the text names `streamserve models pull efficientnet-lite0`. A "projector" policy's
state_projector.safetensors is loaded with the codec (robot/codec.py StateProjector).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import Counter

from streamserve.config import EngineConfig, ServerConfig, SessionConfig
from streamserve.engine import Engine
from streamserve.errors import ModelLoadError, StreamserveError
from streamserve.robot.codec import PolicyCodec
from streamserve.robot.projector import StateProjector
from streamserve.server.adapters.policy.connection import PolicyConnection
from streamserve.server.media.loaders import engine_loader
from streamserve.server.media.vision import unavailable
from streamserve.server.service.auth import Grant
from streamserve.server.service.service import SessionService
from streamserve.server.transports.clients import answer_unmatched_expectations, expect
from streamserve.server.transports.transport import Transport

log = logging.getLogger("streamserve.server")

PATH = "/v1/policy"


class Host(Protocol):
    """What the endpoint uses of `streamserve.server.app.Server` (which imports this module, so not imported here)."""

    app: web.Application
    config: ServerConfig
    engine: Engine | None
    session_defaults: SessionConfig

    async def guard(self, request: web.Request, handler: Any) -> web.StreamResponse: ...

    async def healthz(self, request: web.Request) -> web.Response: ...

    def websocket(self, request: web.Request, adapter: Callable[..., Any],
                  max_msg_size: int) -> Awaitable[web.StreamResponse]: ...


class PolicyEndpoint:
    def __init__(self, server: Host) -> None:
        self.server = server
        self.runner: web.AppRunner | None = None
        self.port: int | None = None  # the policy site's bound port (with --policy-port 0: the one chosen)
        self.codec_of: tuple[object, PolicyCodec | None, str, StateProjector | None] | None = None
        # (engine, codec, refusal, the codec's state projector)
        self.service: SessionService | None = None  # --policy-model's (None: the server's main service)
        server.app.add_routes([web.get(PATH, self.route, expect_handler=expect)])
        server.app.on_shutdown.append(self.on_shutdown)  # after the server's goodbyes (registered first)

    async def load_model(self, step_tokens: int, vision: Any) -> None:
        """With --policy-model: load it (in a worker thread) on an engine of its own, with a session service of its
        own (no voice: a policy reads states and camera images). Its failure is the server's load failure."""
        name = self.server.config.policy_model
        main = self.server.engine
        if name is None or main is None:
            return
        load = engine_loader(EngineConfig(model=name, device=getattr(main.device, "type", str(main.device))))
        engine = await asyncio.to_thread(load)
        self.service = SessionService(engine, self.server.config, self.server.session_defaults, step_tokens, None,
                                      vision)
        codec, refusal, _ = self.resolve()
        if codec is None:
            raise ModelLoadError(f"--policy-model {name}: {refusal.split(': ', 1)[-1]}")
        log.info("streamserve: serving the robot policy %s on /v1/policy", engine.name)

    def model_name(self) -> str | None:
        """The model /v1/policy serves (None: the main model is no policy and no --policy-model was given)."""
        if self.server.engine is None:
            return None
        codec = self.resolve()[0]
        return None if codec is None else self.engine().name

    def note(self) -> str:
        """For the server's ready line: the policy served beside the main model (with --policy-model)."""
        return "" if self.service is None else f"; robot policy {self.service.engine.name} on {PATH}"

    def metrics_text(self) -> bytes:
        """--policy-model's engine metrics as Prometheus text, named `streamserve_policy_*` (none without it: the
        policy then runs on the main engine, whose metrics /metrics shows)."""
        return b"" if self.service is None else self.service.engine.metrics.exposition("streamserve_policy_")

    def engine(self) -> Engine:
        engine = self.service.engine if self.service is not None else self.server.engine
        assert engine is not None
        return engine

    def resolve(self) -> tuple[PolicyCodec | None, str, StateProjector | None]:
        """The served model's codec and its state projector (read once per engine), or None and what to tell a
        client."""
        engine = self.engine()
        if self.codec_of is None or self.codec_of[0] is not engine:
            codec, refusal, projector = None, "", None
            try:
                codec = PolicyCodec.load(engine.path) if engine.path.is_dir() else None
                if codec is not None:
                    codec.validate(engine.config.vocab_size)
                    if codec.state_encoding == "projector":
                        projector = StateProjector.load(engine.path, codec, engine.config.hidden_size)
            except StreamserveError as e:
                log.error("streamserve: the policy codec of %s is unusable: %s", engine.path, e)
                codec, refusal = None, "no_policy: this model's policy.json is unusable (the server log says why)"
            if codec is None and not refusal:
                refusal = (f"no_policy: the served model ({engine.name}) is not a robot policy (its checkpoint has no "
                           "policy.json); start the server with `--policy-model default-policy` (beside it) or "
                           "`--model default-policy`")
            self.codec_of = (engine, codec, refusal, projector)
        return self.codec_of[1], self.codec_of[2], self.codec_of[3]

    def connection(self, service: SessionService, transport: Transport, grant: Grant,
                   messages: Counter) -> PolicyConnection:
        service = self.service or service  # --policy-model: its own service
        codec, refusal, projector = self.resolve()
        if codec is not None and codec.image_keys and service.images.info() is None:  # no vision path to feed
            refusal, codec = (f"unsupported_observation: this policy reads camera images {list(codec.image_keys)}; "
                              f"{unavailable()}"), None
        return PolicyConnection(service, transport, grant, messages, codec, refusal, projector)

    async def route(self, request: web.Request) -> web.StreamResponse:
        # frames up to twice max_frame_bytes are read, so that one over max_frame_bytes is answered in openpi's
        # way (text frame, 1011) rather than by aiohttp's 1009
        return await self.server.websocket(request, self.connection, 2 * self.server.config.max_frame_bytes)

    async def start_site(self, main: web.AppRunner) -> int | None:
        """With --policy-port: serve the endpoint at `/` on that port (same host); -> the bound port. If it cannot
        start (the port is taken), the main site `main` is stopped too and the error raised."""
        port = self.server.config.policy_port
        if port is None:
            return None
        app = web.Application(client_max_size=self.server.config.max_frame_bytes, middlewares=[self.server.guard])
        app.add_routes([web.get("/", self.route, expect_handler=expect),
                        web.get("/healthz", self.server.healthz, expect_handler=expect)])
        answer_unmatched_expectations(app)
        self.runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=5.0)
        try:
            await self.runner.setup()
            await web.TCPSite(self.runner, self.server.config.host, port).start()
        except BaseException:
            await self.on_shutdown(app)
            await main.cleanup()
            raise
        self.port = self.runner.addresses[0][1]
        log.info("streamserve: the robot policy endpoint also listens on ws://%s:%d (openpi clients)",
                 self.server.config.host, self.port)
        return self.port

    def where(self) -> str:
        """For the server's start-up line: where openpi clients connect (with --policy-port), else nothing."""
        return "" if self.port is None else f"; robot policy ws://{self.server.config.host}:{self.port}"

    async def close_model(self) -> None:
        """--policy-model's sessions closed and its engine stopped (the server's cleanup)."""
        if self.service is not None:
            service, self.service = self.service, None
            await service.shutdown()

    async def on_shutdown(self, app: web.Application) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()
