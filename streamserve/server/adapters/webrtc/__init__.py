"""WebRTC calls (`POST /v1/realtime/calls`, docs/webrtc.md): the OpenAI Realtime protocol on the data channel
`oai-events`, the person's audio on a microphone track, the reply on an audio track, camera frames sampled into the
session. One implementation with /v1/realtime (server/adapters/realtime/), another transport: aiortc.

    routes.py   the HTTP endpoints (SDP checks, auth, limits) and the server's live calls
    call.py     one call: the peer, its lifecycle, the Realtime connection's media hook
    channel.py  the data channel as a transport Channel
    tracks.py   the reply track (paced 20 ms frames) and the microphone drain
    video.py    the camera sampler (vision labels -> notes)

`webrtc_calls` adds the routes to the server's app when aiortc is installed; this module itself imports no aiortc.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("streamserve.server")


def webrtc_calls(server: Any) -> Any:
    """The WebRTC calls' routes added to the server's app (server/adapters/webrtc/), or None without aiortc (logged)."""
    try:
        from streamserve.server.adapters.webrtc.routes import Calls, routes
    except ImportError as e:
        log.info("streamserve: no WebRTC calls (install the webrtc extra): %s", e)
        return None
    calls = Calls(server)
    server.app.add_routes(routes(calls))
    return calls
