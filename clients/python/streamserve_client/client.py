"""The asyncio client of streamserve's native protocol.

    async with streamserve_client.connect("ws://127.0.0.1:8000", api_key=None) as client:
        session = await client.open_session(window=None, sinks=4)
        ack = await session.append(text="...")
        async for delta in session.respond(max_tokens=32, temperature=0.0):
            print(delta.text, end="")

The connection (socket, request ids, routing, reconnects and resumes) is the `Channel` (channel.py);
the client opens sessions on it.

Affinity (docs/protocol.md, Affinity): the URL carries `affinity=KEY` as a query parameter, which a proxy in front
of many servers (`streamserve proxy-config`, docs/scale.md) hashes to choose the server. The key is random per
Client unless given (or already in the URL), so a client's sessions, its reconnects and its resumes all reach the
server that holds them; a server ignores the parameter.
"""

from __future__ import annotations

import secrets
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from streamserve_client.channel import Channel
from streamserve_client.errors import StreamserveClientError
from streamserve_client.session import Session

PATH = "/v1/stream"
AFFINITY_PARAM = "affinity"  # the query parameter a session-affine proxy hashes (docs/protocol.md, Affinity)


def stream_url(url: str, affinity: str | None = None) -> tuple[str, str]:
    """(the /v1/stream URL with `affinity=KEY` in its query, the key): /v1/stream is added to a URL without it; the
    key is `affinity`, else the one already in the URL, else a new random one. Other query parameters stay."""
    if affinity is not None and (not isinstance(affinity, str) or not affinity):
        raise ValueError(f"affinity must be a non-empty string, got {affinity!r}")
    parts = urlsplit(url)
    path = parts.path if parts.path.rstrip("/").endswith(PATH) else parts.path.rstrip("/") + PATH
    query = parse_qsl(parts.query, keep_blank_values=True)
    given = [v for k, v in query if k == AFFINITY_PARAM and v]
    key = affinity if affinity is not None else given[-1] if given else secrets.token_urlsafe(12)  # 96 random bits
    query = [(k, v) for k, v in query if k != AFFINITY_PARAM] + [(AFFINITY_PARAM, key)]
    return urlunsplit((parts.scheme, parts.netloc, path, urlencode(query), parts.fragment)), key


class Client:
    def __init__(self, url: str, api_key: str | None = None, reconnect: bool = True, retries: int = 5,
                 max_frame_bytes: int = 1 << 22, affinity: str | None = None) -> None:
        """`affinity`: the key a session-affine proxy routes this client by (default: random per Client, or the
        URL's own `affinity` parameter); `self.affinity` is the key in use."""
        self.url, self.affinity = stream_url(url, affinity)
        self.channel = Channel(self.url, api_key=api_key, reconnect=reconnect, retries=retries,
                               max_frame_bytes=max_frame_bytes)
        self._sessions: dict[str, Session] = {}

    @property
    def hello(self) -> dict[str, Any]:
        """The server's hello: protocol version, model, modalities, limits."""
        return self.channel.hello

    @property
    def errors(self) -> list[StreamserveClientError]:
        """The latest errors the server sent about no pending call (rate limits, malformed messages)."""
        return self.channel.errors

    @property
    def retries(self) -> int:
        """Reconnect attempts after a dropped connection before every call fails."""
        return self.channel.retries

    @retries.setter
    def retries(self, value: int) -> None:
        self.channel.retries = value

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        await self.channel.connect()

    async def close(self) -> None:
        """Close this client's sessions (unless the connection is gone) and the connection."""
        if self.channel.dead is None:
            for s in list(self._sessions.values()):
                await s.close()
        self._sessions.clear()
        await self.channel.close()

    async def drop_connection(self) -> None:
        """Cut the connection as a network failure would (for tests, or when the application's own
        heartbeat finds the network dead): with `reconnect` on, the client reconnects and resumes its
        sessions; with it off, every call fails with ConnectionLostError."""
        await self.channel.drop()

    async def open_session(self, window: int | None = None, sinks: int | None = None,
                           positions: str | None = None, chunk_budget_ms: float | None = None,
                           drafter: str | None = None, chat: bool = False, voice: dict[str, Any] | None = None,
                           **sampling: Any) -> Session:
        """A new persistent session; `drafter` ("none", "ngram", "auto") its speculative decoding (default:
        the server's); `chat`: a chat session, whose appends are messages (`append(message={"role": "user",
        "content": ...})`) rendered by the model's chat template (`hello["chat_template"]` says whether it has
        one); `voice` its voice settings (docs/protocol.md, Voice; `hello["audio"]` says whether the server has
        voice); `sampling` (max_tokens, temperature, top_p, top_k, seed, stop) its reply defaults."""
        reply = await self.request({"type": "open", "window": window, "sinks": sinks, "positions": positions,
                                    "chunk_budget_ms": chunk_budget_ms, "drafter": drafter,
                                    "sampling": sampling or None, "chat": True if chat else None, "voice": voice})
        return self._keep(Session(self.channel, reply))

    async def resume_session(self, session_id: str, resume_token: str) -> Session:
        """Take over a session opened by another connection (or a previous run of this program)."""
        reply = await self.request({"type": "resume", "session": session_id, "resume_token": resume_token})
        return self._keep(Session(self.channel, reply))

    async def stats(self) -> dict[str, Any]:
        return await self.request({"type": "stats"})

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send any protocol message as a request (an `id` is added) and wait for its answer; an `error`
        answer raises its typed error. For messages this client has no method for."""
        if self.channel.dead is not None:
            raise self.channel.dead.copy()
        return await self.channel.request(message)

    def _keep(self, session: Session) -> Session:
        self._sessions = {sid: s for sid, s in self._sessions.items() if not s.closed}
        self._sessions[session.id] = session
        return session


def connect(url: str, api_key: str | None = None, reconnect: bool = True, affinity: str | None = None) -> Client:
    """`async with connect("ws://127.0.0.1:8000") as client:` (the /v1/stream path is added if missing);
    `affinity`: the key a session-affine proxy routes by (default: random per Client)."""
    return Client(url, api_key=api_key, reconnect=reconnect, affinity=affinity)

