"""/v1/realtime keeps reading while an event is being handled: the client's keepalive pings are answered (aiohttp
answers a ping only when the connection's frames are read), a burst of audio beyond the buffer limit is refused
with typed errors instead of piling up unread, and the events still run one at a time, in order."""

from __future__ import annotations

import asyncio

import pytest
from rt import RawRealtime, user_text
from serving import engine_paused, serve

from streamserve.config import ServerConfig

GUARD_S = 60.0  # a guard against a hang only: under the bug the pong never comes while the engine is held


@pytest.mark.asyncio
async def test_pings_are_answered_while_an_event_waits_for_the_engine() -> None:
    async with serve(ServerConfig()) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send(user_text("In the beginning", id="first"))
        await c.until("conversation.item.done")
        await c.send(user_text("God created", id="third"))
        await c.until("conversation.item.done")
        with engine_paused(srv.engine):  # the insertion's rewind cannot run: its handler waits on the engine
            await c.send(user_text("the heaven", id="second", previous_item_id="first"))
            await c.send({"type": "conversation.item.retrieve", "item_id": "first"})  # queued behind it
            pong = await c.ws.ping()
            await asyncio.wait_for(pong, GUARD_S)
            assert [m["type"] for m in c.seen[-1:]] == ["conversation.item.done"]  # nothing handled meanwhile
        added = await c.until("conversation.item.added")
        assert added[-1]["item"]["id"] == "second" and added[-1]["previous_item_id"] == "first"
        got = await c.until("conversation.item.retrieved")  # handled after the insertion, in order
        assert got[-1]["item"]["id"] == "first"
        await c.close()
