"""Issue 17's bounds on /v1/realtime input (docs/security.md, Known gaps 1-3, fixed): every entry that waits in a
connection's inbox is bounded (count and frame bytes, parse errors included); malformed frames close the connection
with 4400 after MAX_BAD_FRAMES, as the native protocol does, after their `error` event; a frame of too many JSON
objects/arrays is refused with `invalid_event` before json.loads runs; and another connection still converses.
Loopback only."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import websockets
from rt import RawRealtime, user_text
from serving import serve

from streamserve.config import ServerConfig
from streamserve.server.adapters.protocol import CLOSE_BAD_CLIENT
from streamserve.server.adapters.realtime import events as E
from streamserve.server.adapters.realtime.events import ClientEvent, RealtimeError
from streamserve.server.adapters.realtime.inbox import MAX_BAD_FRAMES, MAX_WAITING, MAX_WAITING_BYTES, Inbox

MiB = 1 << 20


def parse(frame: str) -> ClientEvent:
    return E.parse(frame, 2 * MiB)


async def stream(frames: list[str]) -> AsyncIterator[str]:
    for frame in frames:  # nothing handles them meanwhile (a client that reads slowly)
        yield frame


class Told:
    """The inbox's `refuse` and `close`: what it told out of turn, and how it closed."""

    def __init__(self) -> None:
        self.refused: list[RealtimeError] = []
        self.closed: list[tuple[int, str]] = []

    async def refuse(self, e: RealtimeError) -> None:
        self.refused.append(e)

    async def close(self, code: int, reason: str) -> None:
        self.closed.append((code, reason))


def retrieve(n: int, pad: int = 0) -> str:
    return json.dumps({"type": "conversation.item.retrieve", "item_id": "x", "event_id": f"e{n}", "pad": "." * pad})


@pytest.mark.asyncio
async def test_malformed_frames_past_the_limit_close_the_inbox() -> None:
    told = Told()
    inbox = Inbox(parse, lambda ev: 0.0, 30e3, told.refuse, told.close)
    frames = [retrieve(0)] + ["{"] * (MAX_BAD_FRAMES + 5) + [retrieve(1)]
    await inbox.read(stream(frames))
    assert told.closed == [(CLOSE_BAD_CLIENT, f"{MAX_BAD_FRAMES} malformed frames")]
    assert inbox.bad == MAX_BAD_FRAMES  # reading stopped at the limit: the frames after it were not read
    assert [e.code for e in told.refused] == ["invalid_json"] and "closed" in told.refused[0].message
    assert inbox.queue.qsize() == 1 + (MAX_BAD_FRAMES - 1) + 1  # the event, the errors before the limit, the end
    assert inbox.closed


@pytest.mark.asyncio
async def test_the_queue_never_exceeds_its_bound_whatever_the_frames() -> None:
    told = Told()
    inbox = Inbox(parse, lambda ev: 0.0, 30e3, told.refuse, told.close)
    frames = [retrieve(n) for n in range(MAX_WAITING + 3)] + ["[1, 2"] * (MAX_BAD_FRAMES - 1)
    await inbox.read(stream(frames))
    assert inbox.queue.qsize() == MAX_WAITING + 1  # + the end marker
    codes = [e.code for e in told.refused]  # refused at once, not queued: 3 events and every malformed frame
    assert codes == ["too_many_events"] * 3 + ["invalid_json"] * (MAX_BAD_FRAMES - 1)
    assert told.closed == []  # one short of the limit


@pytest.mark.asyncio
async def test_the_events_waiting_are_bounded_in_bytes() -> None:
    told = Told()
    inbox = Inbox(parse, lambda ev: 0.0, 30e3, told.refuse, told.close)
    per = MAX_WAITING_BYTES // 16 - 100  # 1 MiB events (with their other fields): 16 fit, the 17th does not
    await inbox.read(stream([retrieve(n, pad=per) for n in range(20)]))
    assert inbox.queue.qsize() == 16 + 1 and inbox.bytes <= MAX_WAITING_BYTES
    assert [(e.code, e.event_id) for e in told.refused] == [("too_many_events", f"e{n}") for n in range(16, 20)]
    got = [w async for w in inbox]  # handled: the budget is given back
    assert len(got) == 16 and inbox.bytes == 0


def test_a_frame_of_many_containers_is_refused_before_json_parses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_parse(*args: object, **kw: object) -> object:
        raise AssertionError("json.loads ran on a frame over the container limit")

    wide = '{"type":"session.update","x":[' + ",".join(["{}"] * (MiB // 3 - 20)) + "]}"
    deep = '{"type":"session.update","x":' + "[" * (E.MAX_JSON_CONTAINERS + 1) + "]" * (E.MAX_JSON_CONTAINERS + 1) + "}"
    monkeypatch.setattr(E.json, "loads", no_parse)
    for frame in (wide, deep):
        with pytest.raises(RealtimeError) as info:
            E.parse(frame, MiB)
        assert info.value.code == "invalid_event" and "objects and arrays" in info.value.message


def test_braces_inside_strings_are_no_containers() -> None:
    text = '{"x": "\\\\"}' + "{" * 10 + '"\\"' + "{[" * E.MAX_JSON_CONTAINERS + '"'
    assert E.containers(text) == 1 + 10  # the object, then ten braces after the string "\\"
    ev = E.parse(json.dumps(user_text("{[" * E.MAX_JSON_CONTAINERS + '\\"' + "}" * 9)), MiB)
    assert ev.type == "conversation.item.create"
    assert E.containers(json.dumps({"a": [{"b": "["}] * (E.MAX_JSON_CONTAINERS + 1)})) == E.MAX_JSON_CONTAINERS + 3


@pytest.mark.asyncio
async def test_over_the_wire_bad_frames_close_with_4400_and_another_connection_goes_on() -> None:
    async with serve(ServerConfig()) as srv:
        bystander = await RawRealtime.connect(srv.http)
        c = await RawRealtime.connect(srv.http)
        wide = '{"type":"session.update","session":{"type":"realtime"},"x":[' + ",".join(["{}"] * 100_000) + "]}"
        await c.send(wide)
        error = await c.error()
        assert error["code"] == "invalid_event" and "objects and arrays" in error["message"], error
        for _ in range(MAX_BAD_FRAMES - 1):
            await c.send("not json")
        codes = [m["error"]["code"] for m in c.seen if m["type"] == "error"]
        with pytest.raises(websockets.ConnectionClosed) as info:
            while True:
                m = await c.recv()
                if m["type"] == "error":
                    codes.append(m["error"]["code"])
        assert info.value.rcvd is not None and info.value.rcvd.code == CLOSE_BAD_CLIENT
        assert codes[0] == "invalid_event" and codes[-1] == "invalid_json" and len(codes) <= MAX_BAD_FRAMES
        assert "closed" in c.seen[-1]["error"]["message"]  # the last event before the close says so
        await bystander.send(user_text("In the beginning", id="after"))
        done = await bystander.until("conversation.item.done")
        assert done[-1]["item"]["id"] == "after"
        await bystander.close()
        srv.engine.check_integrity()
