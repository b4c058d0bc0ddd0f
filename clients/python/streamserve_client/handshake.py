"""Opening a connection: the WebSocket upgrade (with the API key) and the server's `hello`."""

from __future__ import annotations

import asyncio
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from streamserve_client.errors import ConnectionLostError, ProtocolViolationError, ServerBusyError, UnauthorizedError
from streamserve_client.protocol import decode

CLOSE_TIMEOUT_S = 2.0  # how long a close waits for the server's closing handshake
HELLO_TIMEOUT_S = 10.0  # the server speaks first; one that stays silent is not a streamserve


async def open_connection(url: str, api_key: str | None, max_frame_bytes: int,
                          ) -> tuple[ClientConnection, dict[str, Any]]:
    """-> the connection and the server's hello; typed errors for 401, 1013 and a server that does not
    speak first with `hello`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        ws = await websockets.connect(url, additional_headers=headers, max_size=max_frame_bytes,
                                      close_timeout=CLOSE_TIMEOUT_S)
    except websockets.InvalidStatus as e:
        if e.response.status_code == 401:
            raise UnauthorizedError("the server wants an API key (api_key=...) or a different one",
                                    code="unauthorized") from None
        raise
    try:
        hello = decode(await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT_S))
        if hello["type"] != "hello":
            raise ProtocolViolationError(f"the server spoke first with `{hello['type']}`, not `hello`")
    except websockets.ConnectionClosed as e:
        if e.rcvd is not None and e.rcvd.code == 1013:
            raise ServerBusyError(f"server busy: {e.rcvd.reason}", code="busy") from None
        raise ConnectionLostError(f"the connection closed before the server's hello: {e}") from None
    except asyncio.TimeoutError:
        ws.transport.abort()
        raise ConnectionLostError(f"the server sent no hello within {HELLO_TIMEOUT_S:.0f} s") from None
    except BaseException:
        ws.transport.abort()  # a failed or cancelled handshake leaves no socket behind
        raise
    return ws, hello
