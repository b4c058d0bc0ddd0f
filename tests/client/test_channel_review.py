"""Review regressions of the channel and the blocking client: no call hangs when the reconnect path
itself fails unexpectedly, and a blocking call that times out stops its coroutine with a typed error."""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_server import FakeServer

import streamserve_client as sc
from streamserve_client import channel

BOUND_S = 5.0


@pytest.mark.asyncio
async def test_an_unexpected_error_while_reconnecting_fails_every_call_instead_of_hanging(
        fake_server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: object) -> None:
        raise RuntimeError("a bug in the handshake")

    async with sc.connect(fake_server.url) as client:
        s = await client.open_session()
        fake_server.hold_acks = True
        pending = asyncio.create_task(s.append(text="x"))
        while not any(m["type"] == "append" for m in fake_server.received):
            await asyncio.sleep(0.01)
        monkeypatch.setattr(channel, "open_connection", broken)
        await client.drop_connection()
        with pytest.raises(sc.ConnectionLostError):
            await asyncio.wait_for(pending, BOUND_S)
        with pytest.raises(sc.ConnectionLostError):
            await asyncio.wait_for(client.stats(), BOUND_S)
        assert client.channel.dead is not None


def test_a_blocking_call_that_times_out_is_cancelled_and_raises_a_typed_error(
        fake_server_thread: FakeServer) -> None:
    fake = fake_server_thread
    with sc.SyncClient(fake.url, timeout=0.3) as client:
        s = client.open_session()
        fake.hold_acks = True
        with pytest.raises(sc.StreamserveClientError) as info:
            s.append(text="x")
        assert isinstance(info.value, TimeoutError) or info.value.code == "timeout"
        fake.hold_acks = False
        time.sleep(0.05)
        # the timed-out append no longer waits: its seq is free, nothing is pending on the loop
        assert s.append(text="y", seq=0).seq == 0
