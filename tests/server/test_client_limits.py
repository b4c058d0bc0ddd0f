"""Limits per client address (server/transports/clients.py, server/service/registry.py) and the `Expect` handler, on
loopback: the X-Forwarded-For rules on their own; then real servers, where two client addresses are 127.0.0.1 and
127.0.0.2 (the client socket bound to either; all of 127.0.0.0/8 is loopback) or, behind a trusted proxy at 127.0.0.1,
the addresses its X-Forwarded-For names. WebRTC calls' share of these limits: webrtc/test_call_limits.py; the registry's
count of sessions per address on its own: test_registry.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import websockets
from serving import RunningServer, serve

import streamserve_client as sc
from streamserve.config import ServerConfig
from streamserve.errors import InvalidInputError
from streamserve.server.app import Server
from streamserve.server.transports.clients import (
    ConnectionCounts,
    TooManyConnectionsError,
    forwarded_client,
    parse_trusted_proxies,
)

KEY = "limits-key-0123456789"
A, B = "127.0.0.1", "127.0.0.2"
PROXIES = parse_trusted_proxies("127.0.0.1, 10.0.0.9, ::1")


# ---- who the client is ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("peer", "headers", "client"), [
    ("127.0.0.1", [], "127.0.0.1"),  # no header: the peer
    ("127.0.0.1", ["203.0.113.7"], "203.0.113.7"),  # a trusted proxy names the client
    ("192.0.2.1", ["203.0.113.7"], "192.0.2.1"),  # an untrusted peer's header is its own claim: ignored
    ("127.0.0.1", ["6.6.6.6, 203.0.113.7"], "203.0.113.7"),  # left of the proxy's entry: written by the client
    ("127.0.0.1", ["203.0.113.7, 10.0.0.9"], "203.0.113.7"),  # a chain of trusted proxies is skipped
    ("127.0.0.1", ["6.6.6.6", "203.0.113.7"], "203.0.113.7"),  # several headers read as one list, in order
    ("127.0.0.1", ["junk, 203.0.113.7"], "203.0.113.7"),  # junk the client wrote before the proxy's entry
    ("127.0.0.1", ["203.0.113.7, junk"], "127.0.0.1"),  # malformed where it is read: the peer
    ("127.0.0.1", ["203.0.113.7:443"], "127.0.0.1"),  # an address with a port is no address
    ("127.0.0.1", [""], "127.0.0.1"),
    ("127.0.0.1", [" , "], "127.0.0.1"),
    ("127.0.0.1", ["\udcff"], "127.0.0.1"),  # a header byte that was not UTF-8
    ("127.0.0.1", ["10.0.0.9"], "10.0.0.9"),  # only proxies: the left-most
    ("::ffff:127.0.0.1", ["203.0.113.7"], "203.0.113.7"),  # IPv4-mapped peer: its IPv4 address (trusted)
    ("::ffff:192.0.2.1", [], "192.0.2.1"),
    ("::1", ["2001:db8::1"], "2001:db8::1"),
    (None, ["203.0.113.7"], "unknown"),  # the transport is gone
])
def test_the_client_address_is_the_right_most_untrusted_forwarded_address(
        peer: str | None, headers: list[str], client: str) -> None:
    assert forwarded_client(peer, headers, PROXIES) == client


def test_trusted_proxies_are_checked_at_start() -> None:
    assert parse_trusted_proxies(None) == parse_trusted_proxies(" , ") == frozenset()
    assert {str(a) for a in parse_trusted_proxies("127.0.0.1,::1, ::ffff:10.0.0.1")} == {"127.0.0.1", "::1",
                                                                                         "10.0.0.1"}
    for bad in ("127.0.0.1,nginx", "10.0.0.0/8", "10.0.0.300", "127.0.0.1:8080"):
        with pytest.raises(InvalidInputError, match="trusted_proxies") as info:
            parse_trusted_proxies(bad)
        assert bad.split(",")[-1] in str(info.value)  # it names the entry
    with pytest.raises(InvalidInputError, match=r"'proxy\.local'"):
        Server(ServerConfig(trusted_proxies="127.0.0.1,proxy.local"), lambda: None)  # type: ignore[arg-type,return-value]


def test_connection_counts_refuse_an_address_at_its_limit_only() -> None:
    counts = ConnectionCounts(2)
    counts.acquire(A)
    counts.acquire(A)
    with pytest.raises(TooManyConnectionsError) as info:
        counts.acquire(A)
    assert info.value.code == "too_many_connections" and "close one" in str(info.value)
    counts.acquire(B)
    counts.release(A)
    counts.acquire(A)
    for address in (A, A, B):
        counts.release(address)
    assert not counts.open


# ---- the real server ------------------------------------------------------------------------------------------------
async def ws_connect(srv: RunningServer, local: str = A, path: str = "/v1/stream", port: int | None = None,
                     **headers: str) -> websockets.ClientConnection:
    url = f"ws://127.0.0.1:{port or srv.port}{path}"
    return await websockets.connect(url, local_addr=(local, 0), additional_headers={
        "Authorization": f"Bearer {KEY}", **{k.replace("_", "-"): v for k, v in headers.items()}})


async def served(srv: RunningServer, local: str = A, path: str = "/v1/stream", **headers: str) -> Any:
    """A connection the server serves: its first frame (hello, session.created) has come."""
    ws = await ws_connect(srv, local, path, **headers)
    await asyncio.wait_for(ws.recv(), 30)
    return ws


async def refused(srv: RunningServer, local: str = A, path: str = "/v1/stream", port: int | None = None,
                  **headers: str) -> None:
    """The upgrade is closed at once with 1013 and the reason `too_many_connections: ...`."""
    ws = await ws_connect(srv, local, path, port, **headers)
    with pytest.raises(websockets.ConnectionClosed) as info:
        await asyncio.wait_for(ws.recv(), 30)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1013, info.value
    assert info.value.rcvd.reason.startswith("too_many_connections: "), info.value.rcvd.reason


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll (bounded) until the server has noticed what a client did."""
    for _ in range(600):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(what)


@pytest.mark.asyncio
async def test_connections_per_address_every_route_and_other_addresses_unaffected() -> None:
    async with serve(ServerConfig(api_key=KEY, max_connections_per_ip=3, policy_port=0)) as srv:
        held = [await served(srv), await served(srv, path="/v1/realtime"), await served(srv)]
        await refused(srv)
        await refused(srv, path="/v1/realtime")
        await refused(srv, path="/v1/policy")
        await refused(srv, path="/", port=srv.server.policy.port)  # the --policy-port site counts too
        with pytest.raises(sc.ServerBusyError) as info:  # the SDK's typed error
            await sc.connect(srv.url, api_key=KEY).connect()
        assert "too_many_connections" in str(info.value)
        other = [await served(srv, B), await served(srv, B, "/v1/realtime")]  # another address is not affected
        assert srv.server.per_address.open == {A: 3, B: 2}
        await held.pop().close()
        await until(lambda: srv.server.per_address.open[A] == 2, "the closed connection is not given back")
        held.append(await served(srv))
        for ws in held + other:
            await ws.close()
        await until(lambda: not srv.server.per_address.open, "connections are still counted")


@pytest.mark.asyncio
async def test_every_way_a_connection_ends_gives_its_count_back() -> None:
    async with serve(ServerConfig(api_key=KEY, max_connections_per_ip=4, messages_per_second=500.0)) as srv:
        for _ in range(6):
            polite, cut, realtime, bad = (await served(srv), await served(srv), await served(srv, path="/v1/realtime"),
                                          await served(srv))
            await refused(srv)  # refusals take no count
            with pytest.raises(websockets.InvalidStatus):  # nor do unauthorized ones
                await websockets.connect(srv.url + "/v1/stream", additional_headers={"Authorization": "Bearer no"})
            for _ in range(16):  # malformed frames: the server closes it (4400)
                await bad.send(b"\xc1")
            with pytest.raises(websockets.ConnectionClosed) as info:
                while True:
                    await asyncio.wait_for(bad.recv(), 30)
            assert info.value.rcvd is not None and info.value.rcvd.code == 4400
            await polite.close()
            cut.transport.abort()  # gone without a close
            await realtime.close()
            await until(lambda: not srv.server.per_address.open and not srv.server.connections,
                        f"connections are still counted: {srv.server.per_address.open}")


async def request(ws: websockets.ClientConnection, frame: dict[str, Any]) -> dict[str, Any]:
    await ws.send(msgpack.packb(frame, use_bin_type=True))
    while True:
        m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30))
        if m.get("id") == frame["id"] and m["type"] in ("opened", "error"):
            return m


@pytest.mark.asyncio
async def test_one_address_filling_the_server_no_longer_evicts_another_addresses_detached_session() -> None:
    config = ServerConfig(api_key=KEY, max_sessions=4, max_sessions_per_ip=3, max_sessions_per_connection=8)
    async with serve(config) as srv:
        registry = srv.server.service.registry  # type: ignore[union-attr]
        b = await served(srv, B)
        theirs = await request(b, {"type": "open", "id": 1})
        await b.close()
        await until(lambda: all(e.owner is None for e in registry.all()), "B's session is not detached")
        a = await served(srv)
        for i in range(3):
            assert (await request(a, {"type": "open", "id": i}))["type"] == "opened"
        assert len(registry) == 4  # the server is full; before the per-address limit, A's next open evicted B's
        err = await request(a, {"type": "open", "id": 9})
        assert err["type"] == "error" and err["code"] == "too_many_sessions" and "per address" in err["message"]
        async with sc.connect(srv.url, api_key=KEY) as client:  # a second connection of A: refused as well, typed
            with pytest.raises(sc.CapacityError) as info:
                await client.open_session()
            assert info.value.code == "too_many_sessions"
        await a.close()  # A's sessions are detached now, and still count for A
        await until(lambda: all(e.owner is None for e in registry.all()), "A's sessions are not detached")
        a = await served(srv)
        assert (await request(a, {"type": "open", "id": 1}))["code"] == "too_many_sessions"
        b = await served(srv, B)
        resumed = await request(b, {"type": "resume", "id": 2, "session": theirs["session"],
                                    "resume_token": theirs["resume_token"]})
        assert resumed["type"] == "opened" and resumed["resumed"] is True
        await a.close()
        await b.close()


@pytest.mark.asyncio
async def test_x_forwarded_for_counts_only_behind_a_trusted_proxy() -> None:
    async with serve(ServerConfig(api_key=KEY, max_connections_per_ip=2)) as srv:  # no trusted proxy
        held = [await served(srv, X_Forwarded_For=f"203.0.113.{i}") for i in range(2)]
        await refused(srv, X_Forwarded_For="203.0.113.9")  # a new address claimed in vain: the peer counts
        assert srv.server.per_address.open == {A: 2}
        for ws in held:
            await ws.close()
    config = ServerConfig(api_key=KEY, max_connections_per_ip=2, trusted_proxies="127.0.0.1")
    async with serve(config) as srv:
        one = "203.0.113.1"
        held = [await served(srv, X_Forwarded_For=one), await served(srv, X_Forwarded_For=f"6.6.6.6, {one}")]
        await refused(srv, X_Forwarded_For=one)
        held.append(await served(srv, X_Forwarded_For="203.0.113.2"))  # another client behind the proxy
        held.append(await served(srv))  # the proxy's own connection (no header): its own address
        held += [await served(srv, B, X_Forwarded_For=f"203.0.113.{i}") for i in (3, 4)]  # B is no trusted proxy
        await refused(srv, B, X_Forwarded_For="203.0.113.5")
        assert srv.server.per_address.open == {one: 2, "203.0.113.2": 1, A: 1, B: 2}
        opened = await request(held[2], {"type": "open", "id": 1})  # its sessions count for the forwarded address
        assert srv.server.service.registry.find(opened["session"]).address == "203.0.113.2"  # type: ignore[union-attr]
        for ws in held:
            await ws.close()


# ---- Expect ---------------------------------------------------------------------------------------------------------
async def raw_answer(port: int, request: bytes, body: bytes = b"") -> tuple[bytes, bytes]:
    """-> (what came before the body was sent, what came after); `Connection: close` is in `request`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        writer.write(body)
        return first, await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


def expecting(method: str, path: str, value: bytes, length: int = 0) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n"
            f"Content-Length: {length}\r\nContent-Type: application/json\r\nExpect: ").encode() + value + b"\r\n\r\n"


@pytest.mark.asyncio
async def test_every_route_answers_expect_with_100_or_417_never_500() -> None:
    async with serve(ServerConfig(api_key=KEY, policy_port=0)) as srv:
        sites = [(srv.port, srv.server.app), (srv.server.policy.port, srv.server.policy.runner.app)]  # type: ignore
        routes = [(port, r.method, r.resource.canonical.replace("{call_id}", "rtc_x").replace("{path}", "app.js"))
                  for port, app in sites for r in app.router.routes() if r.resource is not None]
        assert len(routes) >= 12 and any(path == "/web/app.js" for _, _, path in routes), routes
        routes += [(srv.port, "GET", "/nowhere"), (srv.port, "PUT", "/healthz"), (srv.port, "OPTIONS", "*"),
                   (srv.server.policy.port, "GET", "/nowhere")]  # aiohttp's own 404 and 405 answers too
        for port, method, path in routes:
            for value in (b"\xff", b"\xe9t\xe9", b"x" * 4000, b"100-continue-please"):
                first, _ = await raw_answer(port, expecting(method, path, value))
                assert first.startswith(b"HTTP/1.1 417 "), (method, path, value[:20], first[:200])
        first, rest = await raw_answer(srv.port, expecting("POST", "/v1/realtime/client_secrets", b"100-Continue", 2),
                                       b"{}")
        assert first == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert rest.startswith(b"HTTP/1.1 200 ") and b'"value": "ek_' in rest, rest[:300]
        first, _ = await raw_answer(srv.port, expecting("GET", "/healthz", b"100-continue"))
        assert first == b"HTTP/1.1 100 Continue\r\n\r\n"
