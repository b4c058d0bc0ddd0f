"""A live hand-off behind nginx: two instances sharing a `--snapshot-store`, nginx (`proxy-config --standalone`) in
front, an SDK client mid-conversation through nginx; the instance its key hashes to drains (POST /admin/drain), the
client reconnects through nginx (same key: the next instance of the ring) and resumes there, and its greedy
continuation is the one an uninterrupted conversation has."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from scale_support import instances, needs_nginx, start_nginx, which

import streamserve_client as sc

pytestmark = [needs_nginx, pytest.mark.slow]
TURNS = ("In the beginning God created the heaven and the earth. And the earth was",
         " And God said, Let there be", " And the evening and the morning were")


def drain(address: str) -> int:
    """POST /admin/drain straight to the instance (loopback, no proxy: what an instance without a key allows)."""
    req = urllib.request.Request(f"http://{address}/admin/drain", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return int(r.status)


async def conversation(url: str, affinity: str | None = None, drain_after: int | None = None,
                       on_drain: object = None) -> tuple[list[list[int]], list[int]]:
    """(each turn's greedy reply, the instance each turn's reply came from) of one session: a turn appends its text
    and asks for 16 tokens; after turn `drain_after`'s append is acknowledged, `on_drain()` (a coroutine) runs."""
    replies: list[list[int]] = []
    served_by: list[int] = []
    async with sc.connect(url, affinity=affinity) as client:
        session = await client.open_session()
        for i, text in enumerate(TURNS):
            await session.append(text=text)
            if i == drain_after:
                assert callable(on_drain)
                await on_drain()  # mid-turn: the chunk is in the KV cache, its reply not yet asked for
            replies.append([t async for d in session.respond(max_tokens=16, temperature=0.0) for t in d.token_ids])
            served_by.append(which(client.hello))
    return replies, served_by


@pytest.mark.asyncio
async def test_a_drained_instance_hands_the_conversation_to_the_other_through_nginx(tmp_path: Path) -> None:
    store = tmp_path / "snapshots"
    store.mkdir()
    with instances(2, "--snapshot-store", str(store)) as pair:
        nginx = start_nginx(tmp_path / "nginx", tuple(i.address for i in pair))
        try:
            uninterrupted, _ = await conversation(pair[1].url)  # the same model on either instance
            async with sc.connect(nginx.url) as probe:  # the key of this test's client, and where it lands
                key, home = probe.affinity, which(probe.hello)

            async def drain_home() -> None:
                assert drain(pair[home].address) == 202
                # the drain ends with every session in the store and the instance gone (exit 0): only then is the
                # next reply asked for, so it can only come from the other instance, restored from the store
                assert await asyncio.to_thread(pair[home].proc.wait, 120) == 0

            replies, served_by = await conversation(nginx.url, affinity=key, drain_after=1, on_drain=drain_home)
            assert served_by == [home, 1 - home, 1 - home]  # moved by nginx after the drain, then stayed
            assert replies == uninterrupted and all(len(r) == 16 for r in replies)
            assert not list(store.glob("*.rec"))  # the other instance claimed the record
        finally:
            nginx.stop()
