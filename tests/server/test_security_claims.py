"""Claims of docs/security.md that no other test pins: the routes the review covers are exactly the server's (a new
route fails here until the review lists it), what every route answers without a credential, with a client secret
and with the API key, that a foreign Origin is refused on every route before auth is looked at, and that the
Realtime reader bounds the frames it could not parse (a gap of the review, fixed). Loopback only."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from serving import RunningServer, default_engine

from streamserve.config import ServerConfig
from streamserve.server.adapters.realtime.events import RealtimeError
from streamserve.server.adapters.realtime.inbox import MAX_WAITING, Inbox
from streamserve.server.app import Server

module_loop = pytest.mark.asyncio(loop_scope="module")  # the keyed server lives in the module's loop
KEY = "security-claims-key"
REVIEW = Path(__file__).resolve().parents[2] / "docs" / "security.md"
# (method, path) of every route, as docs/security.md's route table lists them (aiohttp adds HEAD to each GET)
ROUTES = {("GET", "/healthz"), ("GET", "/metrics"), ("GET", "/v1/stream"), ("GET", "/v1/realtime"),
          ("POST", "/v1/realtime/client_secrets"), ("GET", "/"), ("GET", "/web/{path}"), ("GET", "/v1/policy"),
          ("POST", "/v1/realtime/calls"), ("DELETE", "/v1/realtime/calls/{call_id}"), ("POST", "/admin/drain")}
OPENAI_HTTP = {("GET", "/v1/models"), ("GET", "/v1/models/{model}"), ("POST", "/v1/chat/completions"),
               ("POST", "/v1/responses"), ("GET", "/v1/responses/{id}"), ("DELETE", "/v1/responses/{id}"),
               ("POST", "/v1/responses/{id}/cancel"), ("GET", "/v1/responses/{id}/input_items"),
               ("POST", "/v1/conversations"), ("GET", "/v1/conversations/{id}"), ("POST", "/v1/conversations/{id}"),
               ("DELETE", "/v1/conversations/{id}"), ("GET", "/v1/conversations/{id}/items"),
               ("POST", "/v1/conversations/{id}/items"), ("GET", "/v1/conversations/{id}/items/{item}"),
               ("DELETE", "/v1/conversations/{id}/items/{item}"), ("POST", "/v1/audio/transcriptions"),
               ("POST", "/v1/audio/speech")}
ROUTES |= OPENAI_HTTP
WEBSOCKETS = ("/v1/stream", "/v1/realtime", "/v1/policy")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keyed() -> AsyncIterator[RunningServer]:
    srv = await RunningServer.start(ServerConfig(api_key=KEY), default_engine)
    yield srv
    await srv.stop()


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


async def status(http: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str] | None = None) -> int:
    async with http.request(method, url, headers=headers or {}, data=b"v=0\r\n" if method == "POST" else None) as r:
        await r.read()
        return r.status


async def upgrade(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> int:
    """The handshake's HTTP status: 101 when the server upgraded (the socket is closed again at once)."""
    try:
        async with http.ws_connect(url, headers=headers or {}):
            return 101
    except aiohttp.WSServerHandshakeError as e:
        return e.status


def test_the_review_covers_every_route() -> None:
    server = Server(ServerConfig(), default_engine)  # routes are added at construction; nothing is loaded or bound
    routes = {(r.method, r.resource.canonical) for r in server.app.router.routes() if r.method != "HEAD"}
    if server.calls is None:  # no aiortc: no WebRTC routes, and the review says so
        routes |= {("POST", "/v1/realtime/calls"), ("DELETE", "/v1/realtime/calls/{call_id}")}
    assert routes == ROUTES
    text = REVIEW.read_text()
    assert all(f"`{method} {path}`" in text for method, path in ROUTES), "docs/security.md's route table"


@module_loop
async def test_each_route_without_a_credential_with_a_client_secret_and_with_the_key(keyed: RunningServer) -> None:
    base = keyed.http
    async with aiohttp.ClientSession() as http:
        async with http.post(base + "/v1/realtime/client_secrets", json={}, headers=bearer(KEY)) as r:
            assert r.status == 200
            secret = (await r.json())["value"]
        for path in WEBSOCKETS:  # refused before the upgrade
            assert await upgrade(http, keyed.url + path) == 401
            assert await upgrade(http, keyed.url + path, bearer("ek_" + "x" * 43)) == 401  # unknown secret
        assert await upgrade(http, keyed.url + "/v1/stream", bearer(KEY)) == 101
        # server-wide figures and minting need the key itself: a client secret is not enough
        for method, path in (("GET", "/metrics"), ("POST", "/v1/realtime/client_secrets")):
            assert await status(http, method, base + path) == 401
            assert await status(http, method, base + path, bearer(secret)) == 401
        assert await status(http, "GET", base + "/metrics", bearer(KEY)) == 200
        for method, path in sorted(OPENAI_HTTP):  # the HTTP APIs: the key itself, answered in OpenAI's shape
            url = base + path.replace("{model}", "default").replace("{id}", "resp_x").replace("{item}", "msg_x")
            assert await status(http, method, url) == 401, path
            assert await status(http, method, url, bearer(secret)) == 401, path
            assert await status(http, method, url, bearer(KEY)) != 401, path
        assert await status(http, "POST", base + "/v1/realtime/calls") == 401  # auth before the body is read
        assert await status(http, "DELETE", base + "/v1/realtime/calls/rtc_nope") == 401
        assert await status(http, "DELETE", base + "/v1/realtime/calls/rtc_nope", bearer(KEY)) == 404
        # open: health (the bare status only) and the demo page, whose answers carry the CSP
        async with http.get(base + "/healthz") as r:
            assert r.status == 200 and json.loads(await r.read()) == {"status": "ok"}
        for path in ("/", "/web/app.js"):
            async with http.get(base + path) as r:
                assert r.status == 200 and "connect-src 'self'" in r.headers["Content-Security-Policy"]
                assert r.headers["X-Content-Type-Options"] == "nosniff"


@module_loop
async def test_a_foreign_origin_is_refused_on_every_route_even_with_the_key(keyed: RunningServer) -> None:
    evil = {"Origin": "https://evil.example", **bearer(KEY)}
    async with aiohttp.ClientSession() as http:
        for method, path in sorted(ROUTES):
            url = keyed.http + path.replace("{path}", "app.js").replace("{call_id}", "rtc_nope").replace(
                "{model}", "default").replace("{id}", "resp_x").replace("{item}", "msg_x")
            if path in WEBSOCKETS:
                assert await upgrade(http, url.replace("http://", "ws://"), evil) == 403, path
            else:
                assert await status(http, method, url, evil) == 403, (method, path)


@pytest.mark.asyncio
async def test_the_realtime_reader_bounds_frames_it_could_not_parse() -> None:
    def parse(frame: str) -> object:
        raise RealtimeError("the event is not valid JSON", "invalid_json")

    async def refuse(e: RealtimeError) -> None:
        pass

    async def frames() -> AsyncIterator[str]:
        for _ in range(2 * MAX_WAITING):  # nothing handles them meanwhile (a client that reads slowly)
            yield "{"

    inbox = Inbox(parse, lambda ev: 0.0, 30e3, refuse)  # type: ignore[arg-type]
    await inbox.read(frames())
    assert inbox.queue.qsize() <= MAX_WAITING + 1  # + the end marker
