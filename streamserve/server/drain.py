"""The server's drain (SIGUSR1 or POST /admin/drain; server/app.py `Server.drain` starts it): connection-bound
protocols' connections close as at a shutdown, the session service hands its native sessions over to the snapshot
store (service/lifecycle.py `hand_off`), each native connection hears which of its sessions moved (`reconnect`) and
is closed with 1012, and then `server.drained` is set: `run` stops the server (exit 0). Meanwhile the server
answers new connections and /healthz with 503 `{"status": "draining"}` (app.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import hdrs, web

from streamserve.server.transports.http_replies import error_response, unauthorized

log = logging.getLogger("streamserve.server")

DRAIN_WAIT_S = 30.0  # a drain lets running replies and queued chunks end this long, then cancels them
MOVE_OUT_S = 4.0  # a native connection's `reconnect` and close; then it is cut
LOOPBACK = ("127.0.0.1", "::1")


async def drain_route(server: Any, request: web.Request) -> web.Response:
    """POST /admin/drain: start the drain (202). With an API key configured it needs the key (a client secret is
    not enough); without one, a loopback peer that no proxy forwarded (no X-Forwarded-For)."""
    if server.auth.required and not server.operator(request):
        return unauthorized()
    if not server.auth.required and (request.remote not in LOOPBACK or hdrs.X_FORWARDED_FOR in request.headers):
        return error_response(403, "forbidden", "this server has no API key: only a loopback client may drain it")
    start_drain(server)
    return web.json_response({"status": "draining"}, status=202)


def start_drain(server: Any) -> asyncio.Task:
    """Start draining (once: SIGUSR1 and POST /admin/drain); -> the drain's task (`server.draining`)."""
    if server.draining is None:
        server.draining = asyncio.create_task(drain_server(server, DRAIN_WAIT_S))
    return server.draining


# ---- the server's drain (server/app.py `Server.drain`: SIGUSR1, POST /admin/drain) -------------------------------
async def drain_server(server: Any, wait_s: float) -> None:
    """Connection-bound protocols' connections close as at a shutdown; the service hands its sessions over
    (`hand_off`); each native connection hears which of its sessions moved and is closed with 1012. Whatever
    happens, `server.drained` is set at the end (`run` then stops the server)."""
    try:
        conns, service = list(server.connections), server.service
        if service is None or service.store is None:
            log.warning("streamserve: draining without --snapshot-store: sessions are not handed over; this is a "
                        "graceful shutdown")
        if service is not None:
            held = {c: set(service.held(c.ctx)) for c in conns}
            native = [c for c in conns if getattr(c, "hands_off", False)]
            await asyncio.gather(*(server.say_goodbye(c) for c in conns if c not in native))
            if server.calls is not None:
                await server.calls.close_all()
            moved = await service.hand_off(wait_s)
            await server.openai.hand_off(moved)  # stored responses and conversations, and where their sessions went
            log.info("streamserve: drain: %d sessions handed over to %s", len(moved), service.config.snapshot_store)
            await asyncio.gather(*(move_out(server, c, held[c], moved) for c in native))
    except Exception:
        log.exception("streamserve: the drain failed; shutting down")
    finally:
        server.drained.set()


async def move_out(server: Any, conn: Any, held: set[str], moved: set[str]) -> None:
    """Tell a native connection its sessions moved (NativeConnection.move_out) or, when none did, say goodbye."""
    if not moved & held:
        return await server.say_goodbye(conn)
    try:
        await asyncio.wait_for(conn.move_out(sorted(held & moved), sorted(held - moved)), MOVE_OUT_S)
    except Exception:  # a client that does not read: cut it
        conn.transport.abort()
