"""WebRTC calls and the limits per client address (server/transports/clients.py): `max_calls_per_key` counts a client
secret's own calls and, for the API key or with no key configured, the calls of each client address; every call is a
connection of its address (`max_connections_per_ip`, shared with WebSockets) until it ends. Offers are only POSTed
(answered, never connected: the call stays live until DELETE), from 127.0.0.1 and 127.0.0.2 (the client socket bound to
either: both loopback)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import websockets
from rtc import CallClient
from serving import RunningServer, serve

from streamserve.config import ServerConfig

KEY = "calls-key-0123456789"
A, B = "127.0.0.1", "127.0.0.2"


async def an_offer() -> str:
    c = CallClient()
    sdp = await c.offer()
    await c.close()
    return sdp


async def post(srv: RunningServer, offer: str, local: str = A, key: str | None = None) -> tuple[int, str]:
    """POST the offer from `local` -> (status, the call's Location or the error's code)."""
    headers = {"Content-Type": "application/sdp", **({"Authorization": f"Bearer {key}"} if key else {})}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(local, 0))) as s, \
            s.post(f"{srv.http}/v1/realtime/calls", data=offer, headers=headers) as r:
        body = await r.read()
        return r.status, r.headers["Location"] if r.status == 201 else json.loads(body)["error"]["code"]


async def hang_up(srv: RunningServer, location: str, key: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.delete(f"{srv.http}{location}", headers=headers) as r:
        assert r.status == 204


@pytest.mark.asyncio
async def test_calls_per_key_count_per_address_and_a_client_secret_its_own() -> None:
    async with serve(ServerConfig(max_calls_per_key=2)) as srv:  # no key: every caller counts per address
        offer = await an_offer()
        calls = [(await post(srv, offer))[1], (await post(srv, offer))[1]]
        assert await post(srv, offer) == (429, "too_many_calls")
        status, other = await post(srv, offer, B)  # another address has calls of its own
        assert status == 201
        await hang_up(srv, calls.pop())
        status, again = await post(srv, offer)
        assert status == 201
        for location in (*calls, other, again):
            await hang_up(srv, location)
        assert not srv.server.calls.live and not srv.server.per_address.open
    async with serve(ServerConfig(api_key=KEY, max_calls_per_key=1)) as srv:
        offer = await an_offer()
        status, mine = await post(srv, offer, key=KEY)
        assert status == 201
        assert await post(srv, offer, key=KEY) == (429, "too_many_calls")  # the key's one call from this address
        status, theirs = await post(srv, offer, B, key=KEY)
        assert status == 201
        async with aiohttp.ClientSession() as s, s.post(f"{srv.http}/v1/realtime/client_secrets", json={},
                                                        headers={"Authorization": f"Bearer {KEY}"}) as r:
            secret = (await r.json())["value"]
        status, secrets = await post(srv, offer, key=secret)  # a client secret counts its own calls
        assert status == 201
        for location in (mine, theirs, secrets):
            await hang_up(srv, location, KEY)
        assert not srv.server.calls.live and not srv.server.per_address.open


@pytest.mark.asyncio
async def test_a_call_is_a_connection_of_its_address_until_it_ends() -> None:
    async with serve(ServerConfig(max_connections_per_ip=2)) as srv:
        offer = await an_offer()
        ws = await websockets.connect(srv.url + "/v1/stream")
        await asyncio.wait_for(ws.recv(), 30)  # hello: one connection of 127.0.0.1
        status, call = await post(srv, offer)
        assert status == 201
        assert await post(srv, offer) == (429, "too_many_connections")
        refused = await websockets.connect(srv.url + "/v1/stream")
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(refused.recv(), 30)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1013
        assert info.value.rcvd.reason.startswith("too_many_connections")
        status, other = await post(srv, offer, B)  # another address is not affected
        assert status == 201
        assert srv.server.per_address.open == {A: 2, B: 1}
        for _ in range(3):  # a call's end gives its connection back, every time
            await hang_up(srv, call)
            status, call = await post(srv, offer)
            assert status == 201
        assert await post(srv, offer) == (429, "too_many_connections")
        # a refused session configuration builds the call and refuses it: its connection goes back too
        form = aiohttp.FormData()
        form.add_field("sdp", offer, content_type="application/sdp")
        form.add_field("session", json.dumps({"type": "transcription"}), content_type="application/json")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(B, 0))) as s, \
                s.post(f"{srv.http}/v1/realtime/calls", data=form) as r:
            assert r.status == 400
        assert srv.server.per_address.open == {A: 2, B: 1}
        await ws.close()
        for location in (call, other):
            await hang_up(srv, location)
        for _ in range(600):
            if not srv.server.per_address.open:
                break
            await asyncio.sleep(0.05)
        assert not srv.server.per_address.open and not srv.server.calls.live
