"""Two `streamserve serve` instances behind Debian's nginx, configured by `streamserve proxy-config --standalone`, with
the SDK through it: affinity keys pin clients to instances, replies stream through unchanged, every route ignores
the affinity parameter, and an instance that dies hands its keys to the other.

An instance is told apart by what it reports: instance i's hello says max_reply_tokens 1000 + i (scale_support)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import websockets
from aiohttp import web
from scale_support import Instance, Nginx, instances, needs_nginx, start_nginx, which

import streamserve_client as sc

pytestmark = [needs_nginx, pytest.mark.slow]
KEYS = [f"key-{i}" for i in range(16)]
PROMPT = "In the beginning God created the heaven and the earth. And the earth was"


async def landing(url: str, key: str | None = None, header: str | None = None) -> int:
    """The instance a raw WebSocket to /v1/stream reaches (its hello), with the key as query parameter / header."""
    query = f"?affinity={key}" if key is not None else ""
    headers = {"X-Streamserve-Affinity": header} if header is not None else None
    async with websockets.connect(f"{url}/v1/stream{query}", additional_headers=headers) as ws:
        return which(msgpack.unpackb(await ws.recv()))


async def greedy(url: str, affinity: str | None = None, turns: int = 2) -> tuple[int, list[list[int]]]:
    """(the instance reached, each turn's greedy reply tokens) of one session."""
    async with sc.connect(url, affinity=affinity) as client:
        session = await client.open_session()
        replies: list[list[int]] = []
        for turn in range(turns):
            await session.append(text=PROMPT if turn == 0 else " And God said,")
            replies.append([t async for d in session.respond(max_tokens=24, temperature=0.0) for t in d.token_ids])
        return which(client.hello), replies


@pytest.mark.asyncio
async def test_a_key_always_reaches_one_instance_and_keys_spread_over_both(pair: list[Instance],
                                                                          proxy: Nginx) -> None:
    first = {key: await landing(proxy.url, key) for key in KEYS}
    assert set(first.values()) == {0, 1}, first  # consistent hashing spreads keys (fixed keys: no luck involved)
    for _ in range(2):
        assert {key: await landing(proxy.url, key) for key in KEYS} == first  # and keeps each on its instance
    for key in KEYS[:4]:  # the SDK's key is the same query parameter
        async with sc.connect(proxy.url, affinity=key) as client:
            assert which(client.hello) == first[key] and client.affinity == key
    # the header wins over the query parameter (a server-side client can set it; a browser cannot)
    a = next(k for k in KEYS if first[k] == 0)
    b = next(k for k in KEYS if first[k] == 1)
    assert await landing(proxy.url, key=a, header=b) == 1 and await landing(proxy.url, key=b, header=a) == 0
    assert await landing(proxy.url, header=b) == 1


@pytest.mark.asyncio
async def test_the_sdk_keeps_each_client_on_one_instance_and_spreads_clients(pair: list[Instance],
                                                                            proxy: Nginx) -> None:
    """With no key given, each Client draws its own: all clients come from one address (which alone would pin them
    all to one instance), and still land on both; a client's reconnect and resume reach its own instance."""
    seen: set[int] = set()
    for _ in range(24):  # a random key per client: all 24 on one instance has probability 2^-23
        async with sc.connect(proxy.url) as client:
            seen.add(which(client.hello))
    assert seen == {0, 1}
    async with sc.connect(proxy.url) as client:
        home = which(client.hello)
        session = await client.open_session()
        await session.append(text=PROMPT)
        await client.drop_connection()  # reconnect through nginx and resume: only its own instance has the session
        await session.append(text=" And God said,")
        assert which(client.hello) == home
        assert [t async for d in session.respond(max_tokens=4, temperature=0.0) for t in d.token_ids]


@pytest.mark.asyncio
async def test_a_reply_streams_through_nginx_unchanged(pair: list[Instance], proxy: Nginx) -> None:
    for key in ("key-0", "key-1", "key-2"):
        home, through = await greedy(proxy.url, affinity=key)
        _, direct = await greedy(pair[home].url)
        assert through == direct and all(len(r) == 24 for r in through)
        _, other = await greedy(pair[1 - home].url)
        assert other == direct  # the instances serve the same model: any of them continues a key identically


async def status_of(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, str]:
    async with http.request(method, url, **kw) as r:
        body = await r.read()
        return r.status, r.headers.get("Content-Type", "").split(";")[0] + (
            f" {json.loads(body).get('status')}" if url.split("?")[0].endswith("/healthz") else "")


async def first_frame(url: str, **kw: Any) -> tuple[object, int | None]:
    """The first thing a WebSocket route says (its first message's type, or its close code and reason)."""
    try:
        async with websockets.connect(url, **kw) as ws:
            frame = await asyncio.wait_for(ws.recv(), 30)
    except websockets.ConnectionClosed as e:
        return (e.rcvd.reason if e.rcvd else None), e.rcvd.code if e.rcvd else None
    if isinstance(frame, bytes):
        return msgpack.unpackb(frame)["type"], None
    try:
        return json.loads(frame).get("type"), None
    except json.JSONDecodeError:
        return frame.split(":")[0], None  # openpi's refusals are text: "no_policy: ..."


@pytest.mark.asyncio
async def test_every_route_answers_the_same_with_an_affinity_parameter(pair: list[Instance], proxy: Nginx) -> None:
    """The affinity parameter is the proxy's: every route of a server (directly, and through nginx) answers as it does
    without it."""
    for base in (f"http://{pair[0].address}", proxy.http):
        ws_base = base.replace("http://", "ws://")
        async with aiohttp.ClientSession() as http:
            for method, path, kw in (("GET", "/healthz", {}), ("GET", "/metrics", {}), ("GET", "/", {}),
                                     ("POST", "/v1/realtime/client_secrets", {"json": {}}),
                                     ("POST", "/v1/realtime/calls", {"data": b"v=0\r\n",
                                                                     "headers": {"Content-Type": "application/sdp"}}),
                                     ("GET", "/no-such-route", {})):
                plain = await status_of(http, method, base + path, **kw)
                assert await status_of(http, method, f"{base}{path}?affinity=k3y&x=1", **kw) == plain, path
                if path in ("/healthz", "/metrics", "/", "/v1/realtime/client_secrets"):
                    assert plain[0] == 200, (path, plain)
            if base == proxy.http:  # an instance's admin routes are not proxied (the instance would say 403)
                assert (await status_of(http, "POST", base + "/admin/drain"))[0] == 404
        for path, kw in (("/v1/stream", {}), ("/v1/realtime", {"subprotocols": ["realtime"]}), ("/v1/policy", {})):
            plain_frame = await first_frame(ws_base + path, **kw)
            assert await first_frame(f"{ws_base}{path}?affinity=k3y", **kw) == plain_frame, path
            # hello, session.created; the default model is no robot policy: the same refusal, after the upgrade
            assert plain_frame[0] in ("hello", "session.created", "no_policy"), (path, plain_frame)


@pytest.mark.asyncio
async def test_an_instance_that_dies_hands_its_keys_to_the_other(tmp_path: Path) -> None:
    with instances(2) as own:
        nginx = start_nginx(tmp_path / "nginx", tuple(i.address for i in own))
        try:
            homes = {key: await landing(nginx.url, key) for key in KEYS}
            moved = [k for k in KEYS if homes[k] == 0]
            stayed = [k for k in KEYS if homes[k] == 1]
            assert moved and stayed
            own[0].kill()  # SIGKILL: connections to it are refused from now on
            for key in moved + stayed:
                assert await landing(nginx.url, key) == 1, key
            for key in moved[:2]:  # a whole conversation on the survivor, through the SDK
                home, replies = await greedy(nginx.url, affinity=key, turns=1)
                assert home == 1 and len(replies[0]) == 24
        finally:
            nginx.stop()


@pytest.mark.asyncio
async def test_a_draining_instance_503_moves_its_keys_to_the_next_but_no_post_is_retried(
        pair: list[Instance], tmp_path: Path) -> None:
    """A draining instance answers 503 to WebSocket upgrades and /healthz: nginx passes those to the next instance of
    the ring (http_503 in proxy_next_upstream). A POST it answered is not retried (no non_idempotent): the client
    sees the 503. Here the draining instance is a stand-in that answers 503 to everything; max_fails is high so that
    nginx keeps asking it (each key meets it first)."""
    hits: list[str] = []

    async def draining(request: web.Request) -> web.Response:
        hits.append(request.method)
        return web.json_response({"status": "draining"}, status=503)

    app = web.Application()
    app.add_routes([web.route("*", "/{tail:.*}", draining)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    nginx = start_nginx(tmp_path / "nginx", (f"127.0.0.1:{port}", pair[1].address), max_fails=1000)
    try:
        keys = [f"drain-{i}" for i in range(64)]  # the stand-in's port is random: 2^-64 that no key hashes to it
        for key in keys:
            assert await landing(nginx.url, key) == 1, key
        assert hits, "no key was routed to the draining instance first"
        met = [k for k in keys if (await passes(nginx, k))[0] == 503]  # POSTs that met the draining instance
        assert met and len(hits) > len(met)
        async with aiohttp.ClientSession() as http:
            for key in keys:
                healthz = f"{nginx.http}/healthz?affinity={key}"
                assert await status_of(http, "GET", healthz) == (200, "application/json ok")
    finally:
        nginx.stop()
        await runner.cleanup()


async def passes(nginx: Nginx, key: str) -> tuple[int, str]:
    """POST /v1/realtime/client_secrets through nginx with this key."""
    async with aiohttp.ClientSession() as http:
        return await status_of(http, "POST", f"{nginx.http}/v1/realtime/client_secrets?affinity={key}", json={})


async def hello_or_close(url: str, local: str, kept: list[Any]) -> int | None:
    """Connect from the loopback address `local`: None once served (its hello came; the connection is kept open in
    `kept`), else the close code."""
    ws = await websockets.connect(url, local_addr=(local, 0))
    try:
        msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30))
    except websockets.ConnectionClosed as e:
        return e.rcvd.code if e.rcvd else -1
    kept.append(ws)
    return None


@pytest.mark.asyncio
async def test_instances_count_each_client_behind_nginx_by_its_own_address(pair: list[Instance],
                                                                           proxy: Nginx) -> None:
    """nginx appends the client's address to X-Forwarded-For and the instances trust it from nginx
    (--trusted-proxies 127.0.0.1): one client at its --max-connections-per-ip (64) is refused more, another client
    is not (without the header every client would be nginx's one address)."""
    url = f"{proxy.url}/v1/stream?affinity=xff"  # one key: every connection reaches the same instance
    kept: list[Any] = []
    try:
        assert [await hello_or_close(url, "127.0.0.2", kept) for _ in range(64)] == [None] * 64
        assert await hello_or_close(url, "127.0.0.2", kept) == 1013  # too_many_connections, for this client only
        assert await hello_or_close(url, "127.0.0.3", kept) is None
    finally:
        await asyncio.gather(*(ws.close() for ws in kept))
