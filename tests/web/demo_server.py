"""`streamserve serve` with the browser demo's routes, for the browser tests (run as a subprocess, inside the test's
network namespace): `python tests/web/demo_server.py serve --port 8000 [any serve flag]`.

The demo's routes (streamserve/server/static.py) are added to the app unless app.py already registers them, so the
tests serve the page the same way before and after the route is wired into app.py.
"""

from __future__ import annotations

import argparse
import logging
import sys

from streamserve.cli import build_parser
from streamserve.cli.args import config_from_args, resolve_named_model
from streamserve.config import EngineConfig, SchedulerConfig, ServerConfig, SessionConfig
from streamserve.server.app import Server, engine_loader, run
from streamserve.server.static import StaticFiles


def with_demo(server: Server) -> Server:
    """Add `GET /` and `GET /web/{path}` unless the app has them."""
    served = {r.resource.canonical for r in server.app.router.routes() if r.resource is not None}
    if "/" not in served:
        server.app.add_routes(StaticFiles().routes())
    return server


def main(argv: list[str]) -> int:
    args: argparse.Namespace = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    server = Server(config_from_args(ServerConfig, args),
                    engine_loader(resolve_named_model(config_from_args(EngineConfig, args)),
                                  config_from_args(SchedulerConfig, args)),
                    config_from_args(SessionConfig, args))
    run(with_demo(server), announce=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
