"""Auth a browser can use, and no leaks: the key in the WebSocket subprotocol list, client secrets minted with
the real `openai` SDK (expiry, one session each), the Origin allow-list, what /healthz tells a stranger,
permessage-deflate off, and internal errors that reach the client as a code and a request id only."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import openai
import pytest
import pytest_asyncio
import websockets
from serving import RunningServer, default_engine, serve

from streamserve.config import ServerConfig
from streamserve.errors import InvalidInputError, StepError
from streamserve.server.service.auth import origin_allowed, parse_origins, resolve_api_key
from streamserve.server.service.results import service_error

module_loop = pytest.mark.asyncio(loop_scope="module")  # the keyed server lives in the module's loop
KEY = "k3y-for-tests"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keyed() -> AsyncIterator[RunningServer]:
    srv = await RunningServer.start(ServerConfig(api_key=KEY), default_engine)
    yield srv
    await srv.stop()


async def http(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    def run() -> tuple[int, dict]:
        req = urllib.request.Request(url, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    return await asyncio.to_thread(run)


async def connect(srv: RunningServer, **kw: object) -> websockets.ClientConnection:
    ws = await websockets.connect(srv.url + "/v1/stream", **kw)  # type: ignore[arg-type]
    assert msgpack.unpackb(await ws.recv())["type"] == "hello"
    return ws


async def ask(ws: websockets.ClientConnection, message: dict) -> dict:
    await ws.send(msgpack.packb(message))
    while True:
        m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30))
        if m.get("id") == message.get("id"):
            return m


def status_of(info: pytest.ExceptionInfo) -> int:
    return info.value.response.status_code


async def mint(srv: RunningServer, seconds: int = 600) -> str:
    client = openai.AsyncOpenAI(api_key=KEY, base_url=srv.http + "/v1", max_retries=0)
    secret = await client.realtime.client_secrets.create(expires_after={"anchor": "created_at", "seconds": seconds})
    assert secret.value.startswith("ek_") and len(secret.value) >= 43
    assert abs(secret.expires_at - (time.time() + seconds)) < 5 and secret.session.type == "realtime"
    await client.close()
    return secret.value


@module_loop
async def test_the_key_in_the_subprotocol_list_is_accepted_and_never_echoed(keyed: RunningServer) -> None:
    ws = await connect(keyed, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"])
    assert ws.subprotocol == "realtime"  # the non-secret protocol the client offered, never the key
    assert (await ask(ws, {"type": "stats", "id": 1}))["type"] == "stats"
    await ws.close()
    ws = await connect(keyed, subprotocols=["streamserve", f"streamserve-key.{KEY}"])
    assert ws.subprotocol == "streamserve"
    await ws.close()
    for protocols in (["realtime", "openai-insecure-api-key.wrong"], ["streamserve"], None):
        with pytest.raises(websockets.InvalidStatus) as info:
            await websockets.connect(keyed.url + "/v1/stream", subprotocols=protocols)  # type: ignore[arg-type]
        assert status_of(info) == 401


@module_loop
async def test_a_key_offered_as_the_only_subprotocol_is_never_logged(keyed: RunningServer,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """With no other protocol to echo, aiohttp warns that the client's protocols do not overlap, listing
    them: the key must not be among what reaches the log."""
    with caplog.at_level(logging.DEBUG):
        ws = await connect(keyed, subprotocols=[f"streamserve-key.{KEY}"])  # type: ignore[list-item]
        assert ws.subprotocol is None
        assert (await ask(ws, {"type": "stats", "id": 1}))["type"] == "stats"
        await ws.close()
    server_side = [r.getMessage() for r in caplog.records if not r.name.startswith("websockets")]  # not the client's
    assert not any(KEY in line for line in server_side)  # before the fix: aiohttp's warning listed it


@module_loop
async def test_client_secrets_from_the_openai_sdk_authenticate_one_session(keyed: RunningServer) -> None:
    secret = await mint(keyed)
    ws = await connect(keyed, subprotocols=["realtime", f"openai-insecure-api-key.{secret}"])
    opened = await ask(ws, {"type": "open", "id": 1})
    assert opened["type"] == "opened"
    second = await ask(ws, {"type": "open", "id": 2})
    assert second["type"] == "error" and second["code"] == "client_secret_used"
    other = await connect(keyed, additional_headers={"Authorization": f"Bearer {secret}"})
    assert (await ask(other, {"type": "open", "id": 3}))["code"] == "client_secret_used"
    ws.transport.abort()  # the connection drops: the secret may still resume its own session
    resumed = await ask(other, {"type": "resume", "id": 4, "session": opened["session"],
                                "resume_token": opened["resume_token"]})
    assert resumed["type"] == "opened" and resumed["resumed"]
    await ask(other, {"type": "close", "id": 5, "session": opened["session"]})
    await other.close()
    # a secret cannot mint more; the SDK's bounds are the server's
    client = openai.AsyncOpenAI(api_key=secret, base_url=keyed.http + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await client.realtime.client_secrets.create()
    client = openai.AsyncOpenAI(api_key=KEY, base_url=keyed.http + "/v1", max_retries=0)
    for seconds in (5, 7201):
        with pytest.raises(openai.BadRequestError):
            await client.realtime.client_secrets.create(expires_after={"anchor": "created_at", "seconds": seconds})
    default = await client.realtime.client_secrets.create()
    assert 590 < default.expires_at - time.time() <= 600
    await client.close()


@module_loop
async def test_a_client_secret_sees_its_own_connection_in_stats_not_the_server(keyed: RunningServer) -> None:
    """Server-wide figures need the API key (/healthz, /metrics): `stats` on a secret's connection is its own."""
    secret = await mint(keyed)
    ws = await connect(keyed, subprotocols=["realtime", f"openai-insecure-api-key.{secret}"])
    await ask(ws, {"type": "open", "id": 1})
    stats = await ask(ws, {"type": "stats", "id": 2})
    await ws.close()
    assert stats["connection_sessions"] == 1 and stats["model"] == "default"
    assert not {"sessions_open", "kv_pages_used", "steps", "queued_tokens"} & set(stats)
    ws = await connect(keyed, additional_headers={"Authorization": f"Bearer {KEY}"})
    assert "sessions_open" in await ask(ws, {"type": "stats", "id": 3})
    await ws.close()


@module_loop
async def test_an_expired_secret_is_refused(keyed: RunningServer) -> None:
    secret = await mint(keyed, seconds=10)
    for record in keyed.server.auth.secrets.values():
        record.expires_at = time.time() - 1  # ten seconds later
    with pytest.raises(websockets.InvalidStatus) as info:
        await websockets.connect(keyed.url + "/v1/stream", subprotocols=["realtime",  # type: ignore[list-item]
                                                                         f"openai-insecure-api-key.{secret}"])
    assert status_of(info) == 401
    await mint(keyed)  # minting purges every expired secret
    assert len(keyed.server.auth.secrets) == 1


@module_loop
async def test_origins_healthz_and_deflate(keyed: RunningServer) -> None:
    evil = {"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"}
    assert (await http(keyed.http + "/healthz", evil))[0] == 403
    with pytest.raises(websockets.InvalidStatus) as info:
        await websockets.connect(keyed.url + "/v1/stream", origin="https://evil.example",  # type: ignore[arg-type]
                                 additional_headers={"Authorization": f"Bearer {KEY}"})
    assert status_of(info) == 403
    for origin in (f"http://127.0.0.1:{keyed.port}", "http://localhost:5173", "http://[::1]:8080"):
        ws = await connect(keyed, origin=origin, additional_headers={"Authorization": f"Bearer {KEY}"})
        await ws.close()
    # no Origin (not a browser), no key: health says ready and nothing else
    assert await http(keyed.http + "/healthz") == (200, {"status": "ok"})
    status, body = await http(keyed.http + "/healthz", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["model"] == "default" and "uptime_s" in body
    # the client offers permessage-deflate (websockets does by default); the server does not grant it
    ws = await connect(keyed, additional_headers={"Authorization": f"Bearer {KEY}"})
    assert ws.response.headers.get("Sec-WebSocket-Extensions") is None
    await ws.close()


def test_the_origin_allow_list() -> None:
    allowed = parse_origins("https://app.example.com, http://localhost:*")
    assert origin_allowed("https://app.example.com", "srv:8000", allowed)
    assert origin_allowed("http://localhost:3000", "srv:8000", allowed)
    assert origin_allowed("http://srv:8000", "srv:8000", allowed, "srv")  # the server's own pages
    assert origin_allowed("http://10.0.0.5:8000", "10.0.0.5:8000", (), "0.0.0.0")
    # DNS rebinding: a page of evil.example whose name now resolves to this server is not "its own"
    assert not origin_allowed("http://evil.example:8000", "evil.example:8000", (), "127.0.0.1")
    assert not origin_allowed("http://127.0.0.1:3000", "srv:8000", allowed)  # a list replaces the loopback default
    assert not origin_allowed("https://app.example.com.evil.io", "srv:8000", allowed)
    assert not origin_allowed("null", "srv:8000", ())
    assert origin_allowed(None, "srv:8000", allowed)


@module_loop
async def test_internal_errors_reach_clients_as_a_code_and_a_request_id(
        keyed: RunningServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    service = keyed.server.service
    assert service is not None

    def broken(ctx: object) -> None:
        raise RuntimeError("/very/secret/path 0xdeadbeef")

    monkeypatch.setattr(service, "stats", broken)
    ws = await connect(keyed, additional_headers={"Authorization": f"Bearer {KEY}"})
    with caplog.at_level(logging.ERROR, logger="streamserve.server"):
        err = await ask(ws, {"type": "stats", "id": 9})
    await ws.close()
    assert err["code"] == "internal_error" and "secret" not in err["message"] and "RuntimeError" not in err["message"]
    request_id = err["message"].split("request id ")[1].split(";")[0]
    assert len(request_id) == 16 and request_id in caplog.text and "/very/secret/path" in caplog.text
    monkeypatch.setattr(keyed.engine, "stats", lambda: broken(None))
    status, body = await http(keyed.http + "/healthz", {"Authorization": f"Bearer {KEY}"})
    assert status == 500 and body["code"] == "internal_error" and len(body["request_id"]) == 16
    assert "secret" not in json.dumps(body)
    # the engine's StepError carries the exception's repr: the client gets its code, not its text
    step = service_error(StepError("the engine failed on this session's step (RuntimeError('x'))"), "sid", 3)
    assert step.code == "step_failed" and "RuntimeError" not in step.message and step.request_id
    typed = service_error(InvalidInputError("top_p must be in (0, 1]"))
    assert typed.message == "top_p must be in (0, 1]" and typed.request_id is None


@module_loop
async def test_a_load_failure_is_not_described_to_clients() -> None:
    def fail() -> None:
        raise RuntimeError("cannot open /very/secret/model.safetensors")

    from streamserve.server.app import Server, start

    server = Server(ServerConfig(host="127.0.0.1", port=0), fail)  # type: ignore[arg-type]
    runner, port = await start(server)
    try:
        await asyncio.wait_for(server.ready.wait(), 30)
        assert await http(f"http://127.0.0.1:{port}/healthz") == (503, {"status": "failed"})
        # a failed load is not "still loading, retry shortly" (1013, which clients retry for ever)
        ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/stream")
        with pytest.raises(websockets.ConnectionClosed) as info:
            await ws.recv()
        assert info.value.rcvd is not None and info.value.rcvd.code == 1011
        assert "secret" not in info.value.rcvd.reason
    finally:
        await runner.cleanup()


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-the-file\n")
    monkeypatch.setenv("STREAMSERVE_API_KEY", "from-the-env")
    assert resolve_api_key(ServerConfig(api_key_file=str(key_file))) == "from-the-file"
    assert resolve_api_key(ServerConfig()) == "from-the-env"
    assert resolve_api_key(ServerConfig(api_key="given")) == "given"
    assert "given" not in repr(ServerConfig(api_key="given"))  # a config in a log or traceback shows no key
    with pytest.raises(InvalidInputError, match="cannot read"):
        resolve_api_key(ServerConfig(api_key_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InvalidInputError, match="empty"):
        resolve_api_key(ServerConfig(api_key_file=str(tmp_path / "empty")))
    for blank in ("", "  "):  # an empty key would let in anyone offering an empty credential
        with pytest.raises(InvalidInputError, match="empty"):
            resolve_api_key(ServerConfig(api_key=blank))


@module_loop
async def test_without_a_key_everyone_may_connect_but_an_unknown_secret_may_not() -> None:
    async with serve(ServerConfig()) as srv:
        ws = await connect(srv)
        await ws.close()
        with pytest.raises(websockets.InvalidStatus) as info:
            await websockets.connect(srv.url + "/v1/stream", additional_headers={"Authorization": "Bearer ek_nope"})
        assert status_of(info) == 401
