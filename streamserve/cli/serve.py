"""`streamserve serve`: the server on one port."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from streamserve.cli.args import add_config_args, config_from_args, resolve_named_model
from streamserve.config import EngineConfig, SchedulerConfig, ServerConfig, SessionConfig


def register(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this sub-command with `add_parser` (argparse's `add_subparsers().add_parser`)."""
    serve = add_parser("serve", help="serve the model: sessions (native, OpenAI Realtime), voice, health, metrics",
                       description="Serve the model on one port: WS /v1/stream (the native msgpack protocol, "
                                   "docs/protocol.md), WS /v1/realtime (OpenAI Realtime, docs/realtime.md), "
                                   "GET /healthz, GET /metrics, POST /v1/realtime/client_secrets (short-lived "
                                   "secrets for browsers). Audio in and out when the voice extra and the voice "
                                   "models are installed (else refused; --no-voice skips loading them). "
                                   "--window/--sinks/--positions are the defaults of sessions that do not choose. "
                                   "SIGINT or SIGTERM shuts down gracefully.")
    add_config_args(serve, ServerConfig)
    add_config_args(serve, EngineConfig)
    add_config_args(serve, SessionConfig)
    add_config_args(serve, SchedulerConfig)
    serve.set_defaults(run=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from streamserve.server.app import Server, run
    from streamserve.server.service.backends import backend_loader

    server_cfg: ServerConfig = config_from_args(ServerConfig, args)
    # a named model is pulled (and its licence asked for) here, in the foreground, before the port opens
    engine_cfg: EngineConfig = resolve_named_model(config_from_args(EngineConfig, args))
    scheduler_cfg: SchedulerConfig = config_from_args(SchedulerConfig, args)
    server = Server(server_cfg, backend_loader(engine_cfg, scheduler_cfg), config_from_args(SessionConfig, args))
    run(server, announce=lambda line: print(line, file=sys.stderr, flush=True))
    return 0
