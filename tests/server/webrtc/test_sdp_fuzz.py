"""SDP fuzz (issue 17): random and mutated offers POSTed to /v1/realtime/calls over loopback HTTP, as
application/sdp and as multipart/form-data (well-formed forms with random `sdp`/`session` fields, and raw bodies
with broken boundaries and headers), plus random content types.

Every answer is the endpoint's typed JSON error ({"error": {"message", "type", "code", "param"}}, a 4xx), or,
for a mutation that is still a valid offer, a 201 with an SDP answer (that call is hung up at once, DELETE 204);
never a 5xx, every request bounded. Afterwards a native-protocol session opened before the fuzz answers exactly
as the engine does, /healthz answers, a normal call connects and converses, and nothing of the fuzzed calls is
left (sessions, pages, tasks, calls, connections).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from fuzz_options import fuzz
from hypothesis import strategies as st
from rtc import CallClient, settled, state
from serving import serve

import streamserve_client as sc
from streamserve.config import ServerConfig

WAIT = 60.0  # seconds one request may take
CONTENT_TYPES = ["application/sdp", "multipart/form-data", "multipart/form-data; boundary=", "text/plain",
                 "application/json", "application/sdp; charset=latin-1", "APPLICATION/SDP", "", "x/y; a=\"b",
                 "multipart/mixed; boundary=zz", "application/x-www-form-urlencoded"]
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)
sessions = st.one_of(st.none(), json_values, st.fixed_dictionaries({"type": st.sampled_from(["realtime", "x"])},
                                                                  optional={
    "instructions": st.text(max_size=20), "output_modalities": st.lists(st.sampled_from(["text", "audio", "x"])),
    "video": st.one_of(json_values, st.fixed_dictionaries({"fps": json_values})), "audio": json_values,
    "model": json_values, "max_output_tokens": json_values, "tools": json_values}))


@st.composite
def mutated(draw: st.DrawFn, offer: str) -> str:
    """The offer's lines dropped, duplicated, swapped, cut or rewritten (attribute values, ports, payload types,
    fingerprints, setup roles); candidate lines are only dropped, so that no mutation names a non-loopback host."""
    lines = offer.strip().split("\r\n")
    for _ in range(draw(st.integers(1, 4))):
        lines = lines or ["v=0"]
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.integers(0, 7))
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(i, lines[i])
        elif op == 2:
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == 3:
            lines[i] = lines[i][:draw(st.integers(0, len(lines[i])))]
        elif op == 4 and not lines[i].startswith("a=candidate"):
            head, sep, _ = lines[i].partition(":" if lines[i].startswith("a=") else "=")
            lines[i] = head + (sep or "=") + draw(st.text(st.characters(exclude_characters="\r\n"), max_size=30))
        elif op == 5:
            lines.insert(i, draw(st.sampled_from([
                "m=audio 0 UDP/TLS/RTP/SAVPF", "m=audio 99999999999 UDP/TLS/RTP/SAVPF 111", "m=video 9 RTP/AVP -1",
                "m=application 9 UDP/DTLS/SCTP webrtc-datachannel", "a=setup:active", "a=setup:holdconn",
                "a=fingerprint:sha-256 ZZ", "a=fingerprint:md5 00", "a=rtpmap:111 opus/0/0", "a=rtpmap:x y",
                "a=fmtp:111 " + "x" * 2000, "a=ssrc:4294967296 cname:x", "a=sctp-port:-1", "a=max-message-size:1e99",
                "a=ice-ufrag:", "a=ice-pwd:", "a=mid:" + "m" * 300, "a=group:BUNDLE 0 1 2 3 4 5 6 7", "c=IN IP4",
                "a=rtcp:0", "a=extmap:999999 urn:x", "a=msid:", "a=sendrecv a=recvonly", "v=0", "s=\x00",
                "t=0 0 0", "o=- x x IN IP4 127.0.0.1"])))
        elif op == 6:
            lines = lines[:i]
        elif op == 7:  # every m-line or setup role rewritten (no_audio, sdp_not_offer, a video-only offer)
            old, to = draw(st.sampled_from([("m=audio", "m=video"), ("m=audio", "m=text"), ("actpass", "active"),
                                            ("actpass", "passive"), ("actpass", "holdconn"), ("UDP/", "TCP/")]))
            lines = [ln.replace(old, to) for ln in lines]
    return "\r\n".join(lines) + draw(st.sampled_from(["\r\n", "\n", "", "\r\n\r\n"]))


def raw_multipart(draw: st.DrawFn, sdp: str) -> tuple[bytes, str]:
    """A multipart body written by hand: the boundary declared, used, misspelt or missing; part headers broken."""
    b = draw(st.sampled_from(["zz", "a" * 80, "", "x y", "--"]))
    used = draw(st.sampled_from([b, b, b + "x", ""]))
    name = draw(st.sampled_from(["sdp", "session", "", "sdp\"", "SDP", "sdp; filename=x"]))
    head = draw(st.sampled_from([f'Content-Disposition: form-data; name="{name}"', "Content-Disposition: nope",
                                 "", f'Content-Disposition: form-data; name="{name}"\r\nContent-Length: 5']))
    body = f"--{used}\r\n{head}\r\n\r\n{sdp}\r\n" + draw(st.sampled_from([f"--{used}--\r\n", "", f"--{used}"]))
    return body.encode(), draw(st.sampled_from([f"multipart/form-data; boundary={b}", "multipart/form-data",
                                                f"multipart/form-data; boundary=\"{b}\""]))


@st.composite
def requests(draw: st.DrawFn, offer: str) -> tuple[str, Any]:
    """-> ("sdp", (body, content type)) or ("form", (sdp, session JSON or junk text))."""
    sdp = draw(st.one_of(mutated(offer), mutated(offer), st.text(max_size=300), st.just("v=0\r\nm=audio\r\n"),
                         st.just(offer + "a=x:" + "y" * 70000 + "\r\n")))
    body: bytes = draw(st.one_of(st.just(sdp.encode("utf-8", "surrogatepass")), st.binary(max_size=300),
                                 st.just(b"\xff\xfe" + sdp.encode("utf-8", "surrogatepass"))))
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return "sdp", (body, "application/sdp")
    if kind == 1:
        return "sdp", (body, draw(st.sampled_from(CONTENT_TYPES)))
    if kind == 2:
        session = draw(st.one_of(sessions.map(json.dumps), st.text(max_size=40)))
        return "form", (body, session)
    return "sdp", raw_multipart(draw, sdp)


async def post(http: str, kind: str, what: Any) -> tuple[int, bytes, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as s:
        if kind == "form":
            form = aiohttp.FormData()
            form.add_field("sdp", what[0], content_type="application/sdp", filename="offer.sdp")
            form.add_field("session", what[1], content_type="application/json")
            r = await s.post(f"{http}/v1/realtime/calls", data=form)
        else:
            r = await s.post(f"{http}/v1/realtime/calls", data=what[0], headers={"Content-Type": what[1]})
        async with r:
            return r.status, await r.read(), r.headers


async def check(http: str, kind: str, what: Any) -> None:
    status, body, headers = await asyncio.wait_for(post(http, kind, what), WAIT)
    assert status < 500, (status, body[:300], what)
    if status == 201:  # the mutation left a valid offer: an answer, and the call hangs up cleanly
        assert headers["Content-Type"].startswith("application/sdp") and body.startswith(b"v=0"), body[:100]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as s, \
                s.delete(f"{http}{headers['Location']}") as r:
            assert r.status == 204
        return
    assert 400 <= status < 500, status
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["type"] == "invalid_request_error", err
    assert isinstance(err["code"], str) and err["message"] and "Traceback" not in err["message"], err


@pytest.mark.asyncio
async def test_random_and_mutated_offers_get_typed_errors(request: pytest.FixtureRequest) -> None:
    async with serve(ServerConfig(max_calls_per_key=64)) as srv:
        empty = state(srv)
        expected = await asyncio.to_thread(engine_tokens, srv.engine)
        client = sc.connect(srv.url)
        await client.connect()
        bystander = await client.open_session()
        await bystander.append(text="And God said")
        caller = CallClient()
        offer = await caller.offer()
        await caller.close()
        before = state(srv)
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(fuzz, request.config, "sdp", requests(offer),  # hypothesis runs in a worker thread
                                lambda r: asyncio.run_coroutine_threadsafe(check(srv.http, *r), loop).result(300), 1000)
        await settled(srv, before)  # every fuzzed call is gone
        r = bystander.respond(max_tokens=8, temperature=0.0)
        await asyncio.wait_for(r.wait(), WAIT)
        assert r.token_ids == expected
        async with aiohttp.ClientSession() as s, s.get(f"{srv.http}/healthz") as h:
            assert h.status == 200 and (await h.json())["status"] == "ok"
        c = CallClient()  # a normal call still connects and converses
        await c.connect(srv.http, session={"type": "realtime", "output_modalities": ["text"]})
        await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "In the beginning"}]}})
        await c.send({"type": "response.create", "response": {"max_output_tokens": 4}})
        assert (await c.until("response.done"))[-1]["response"]["status"] in ("completed", "incomplete")
        await c.close()
        await client.close()
        await settled(srv, empty)


def engine_tokens(engine: Any) -> list[int]:
    with engine.open_session() as s:
        s.append(text="And God said")
        return s.generate(max_tokens=8, stop_token_ids=())
