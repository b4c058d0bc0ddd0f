"""POST/DELETE /v1/realtime/calls against a real server (text model, no voice models needed): typed errors for
bad offers and bodies, auth like /v1/realtime (API key or client secret), the calls-per-key limit, and every way a
call ends (DELETE, a peer that goes away, server shutdown) leaving no session, page, task or call behind."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from rtc import CallClient, delete_call, post_offer, settled, state
from serving import serve

from streamserve.config import ServerConfig

KEY = "test-key-0123456789"


async def an_offer(audio: bool = True) -> str:
    c = CallClient() if audio else None
    if c is None:
        from aiortc import RTCConfiguration, RTCPeerConnection

        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
        await pc.close()
        return sdp
    sdp = await c.offer()
    await c.close()
    return sdp


async def refused(http: str, body: Any, status: int, code: str, **kw: Any) -> None:
    got, raw, _ = await post_offer(http, body, **kw)
    import json

    err = json.loads(raw)["error"]
    assert (got, err["code"]) == (status, code), err
    assert err["type"] in ("invalid_request_error", "authentication_error") and err["message"]


@pytest.mark.asyncio
async def test_bad_offers_get_typed_errors() -> None:
    async with serve(ServerConfig()) as srv:
        before = state(srv)
        offer = await an_offer()
        await refused(srv.http, b"\xff\xfe garbage", 400, "invalid_sdp")
        await refused(srv.http, "hello there", 400, "invalid_sdp")
        await refused(srv.http, "v=0\r\nm=audio broken\r\n", 400, "invalid_sdp")
        await refused(srv.http, offer + "a=x-pad:" + "x" * 70000 + "\r\n", 413, "sdp_too_large")
        await refused(srv.http, offer.replace("a=setup:actpass", "a=setup:active"), 400, "sdp_not_offer")
        await refused(srv.http, await an_offer(audio=False), 400, "no_audio")
        await refused(srv.http, offer, 415, "unsupported_media_type", content_type="text/plain")
        await refused(srv.http, offer, 400, "invalid_value", session={"type": "realtime", "video": {"fps": 9}})
        await refused(srv.http, offer, 400, "invalid_value", session={"type": "transcription"})
        await settled(srv, before)  # a refused offer leaves nothing


@pytest.mark.asyncio
async def test_auth_and_the_calls_per_key_limit() -> None:
    async with serve(ServerConfig(api_key=KEY)) as srv:
        offer = await an_offer()
        await refused(srv.http, offer, 401, "invalid_api_key")
        await refused(srv.http, offer, 401, "invalid_api_key", key="wrong")
        async with aiohttp.ClientSession() as s, s.post(f"{srv.http}/v1/realtime/client_secrets", json={},
                                                        headers={"Authorization": f"Bearer {KEY}"}) as r:
            secret = (await r.json())["value"]
        c = CallClient()
        await c.connect(srv.http, key=secret)  # a page's client secret works in place of the key
        await refused(srv.http, await an_offer(), 401, "client_secret_used", key=secret)  # one session per secret
        assert c.location is not None
        assert await delete_call(srv.http, c.location) == 401
        assert await delete_call(srv.http, c.location, key="wrong") == 401
        srv.server.calls.limit = 1
        k = CallClient()
        await k.connect(srv.http, key=KEY)
        await refused(srv.http, await an_offer(), 429, "too_many_calls", key=KEY)  # the key's one call is live
        assert k.location is not None
        assert await delete_call(srv.http, k.location, key=secret) == 404  # not the secret's call
        assert await delete_call(srv.http, k.location, key=KEY) == 204
        await k.close()
        assert await delete_call(srv.http, c.location, key=secret) == 204
        assert await delete_call(srv.http, c.location, key=KEY) == 404  # gone
        await c.close()


@pytest.mark.asyncio
async def test_a_text_call_then_delete_leaves_nothing() -> None:
    async with serve(ServerConfig(api_key=KEY)) as srv:
        before = state(srv)
        c = CallClient()
        await c.connect(srv.http, key=KEY, session={"type": "realtime", "instructions": "Be brief.",
                                                    "output_modalities": ["text"]})
        await c.send({"type": "input_audio_buffer.append", "audio": "AAAA"})
        assert (await c.until("error"))[-1]["error"]["code"] == "unsupported_event"  # the mic track is the input
        await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "In the beginning"}]}})
        await c.send({"type": "response.create", "response": {"max_output_tokens": 300}})
        await c.until("response.output_text.delta")
        assert c.location is not None
        assert await delete_call(srv.http, c.location, key=KEY) == 204  # mid-reply
        await c.close()
        await settled(srv, before)
        async with aiohttp.ClientSession() as s, s.get(f"{srv.http}/metrics",
                                                       headers={"Authorization": f"Bearer {KEY}"}) as r:
            text = await r.text()
        assert "streamserve_webrtc_calls 0.0" in text and "streamserve_webrtc_calls_ended_total 1.0" in text


@pytest.mark.asyncio
async def test_a_peer_that_goes_away_frees_its_call() -> None:
    async with serve(ServerConfig()) as srv:
        before = state(srv)
        c = CallClient()
        await c.connect(srv.http)
        await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "In the beginning"}]}})
        await c.send({"type": "response.create", "response": {"max_output_tokens": 300}})
        await c.until("response.output_text.delta")
        await c.close()  # no DELETE: the peer closes (DTLS and SCTP go)
        await settled(srv, before)


@pytest.mark.asyncio
async def test_an_offer_never_connected_and_shutdown_free_calls() -> None:
    async with serve(ServerConfig()) as srv:
        status, _, _ = await post_offer(srv.http, await an_offer())  # answered, and the client never connects
        assert status == 201
        c = CallClient()
        await c.connect(srv.http)
        assert len(srv.server.calls.live) == 2
        calls = list(srv.server.calls.live.values())
        await srv.stop()  # shutdown with both live
        assert not srv.server.calls.live
        assert all(call.closed.is_set() and call.pc.connectionState == "closed" for call in calls)
        assert all(not call.tasks and call.runner is not None and call.runner.done() for call in calls)
        assert srv.engine.stats()["sessions_open"] == 0
        await c.close()


@pytest.mark.asyncio
async def test_a_peer_that_vanishes_without_a_word_is_noticed() -> None:
    async with serve(ServerConfig()) as srv:
        before = state(srv)
        c = CallClient()
        await c.connect(srv.http)
        c.vanish()  # no DTLS close, no SCTP abort: only ICE consent freshness (aioice: ~30 s) can tell
        await settled(srv, before, polls=2400)
        await c.close()


@pytest.mark.asyncio
async def test_ice_and_dtls_failures_free_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever notices first, the peer's state (failed) or the connect deadline (no connected peer with an events
    channel within CONNECT_TIMEOUT, shortened here), the call is freed."""
    from streamserve.server.adapters.webrtc import call

    monkeypatch.setattr(call, "CONNECT_TIMEOUT", 5.0)
    async with serve(ServerConfig()) as srv:
        before = state(srv)
        # ICE: the client goes before any check can succeed (its sockets closed; the server's checks fail)
        c = CallClient()
        status, _, _ = await post_offer(srv.http, await c.offer())
        assert status == 201 and len(srv.server.calls.live) == 1
        await c.close()
        await settled(srv, before, polls=1200)
        # DTLS: the answer's certificate fingerprint is not the one the server presents: the handshake fails
        c = CallClient()
        status, answer, _ = await post_offer(srv.http, await c.offer())
        assert status == 201
        from aiortc import RTCSessionDescription

        forged = "\r\n".join(line[:-2] + ("00" if line[-2:] != "00" else "11") if line.startswith("a=fingerprint:")
                             else line for line in answer.decode().split("\r\n"))
        await c.pc.setRemoteDescription(RTCSessionDescription(forged, "answer"))
        for _ in range(1200):  # the server ends the call by itself (the client's peer is still up)
            if not srv.server.calls.live:
                break
            await asyncio.sleep(0.05)
        assert not srv.server.calls.live
        await c.close()
        await settled(srv, before)
