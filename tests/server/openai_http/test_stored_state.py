"""Stored responses and conversations are bounded (bytes, TTL) and survive their sessions: a session idle past
--http-session-ttl is parked in the snapshot store (restored, nothing recomputed) or closed (re-prefilled from the
stored history, the same reply); with --snapshot-store, a drain hands stored state and sessions to another
instance."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import openai
import pytest
from serving import RunningServer, serve

from openai_http.smol import GREEDY, Reference, smol, user
from streamserve.config import ServerConfig

pytestmark = [pytest.mark.models, pytest.mark.asyncio]
ARGS = {"temperature": 0.0, "max_output_tokens": GREEDY["max_tokens"]}


def client(srv: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{srv.http}/v1", api_key="k", max_retries=0)


async def until(check: object, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not reached in time")


async def test_the_byte_budget_evicts_the_least_recently_used(tmp_path: Path) -> None:
    async with serve(ServerConfig(max_stored_responses_bytes=6000), smol) as srv:
        c, api = client(srv), srv.server.openai
        ids = [(await c.responses.create(input=f"Say the number {i}. " + "pad " * 100, **ARGS)).id for i in range(6)]
        assert api.store.bytes <= 6000
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(ids[0])
        assert (await c.responses.retrieve(ids[-1])).id == ids[-1]
        conv = await c.conversations.create(items=[{"role": "user", "content": "x" * 4500}])
        assert (await c.conversations.retrieve(conv.id)).id == conv.id  # the newest stays; older ones made room
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(ids[-2])
        with pytest.raises(openai.BadRequestError) as e:  # one object alone over the budget: refused, nothing kept
            await c.conversations.items.create(conv.id, items=[{"role": "user", "content": "y" * 2000}])
        assert e.value.body["code"] == "conversation_too_large"
        assert len((await c.conversations.items.list(conv.id)).data) == 1 and api.store.bytes <= 6000


async def test_ttls_let_everything_go() -> None:
    async with serve(ServerConfig(stored_responses_ttl=1.0, http_session_ttl=0.5), smol) as srv:
        c, api = client(srv), srv.server.openai
        r = await c.responses.create(input="Hello", **ARGS)
        await c.chat.completions.create(model="default", messages=[user("Hi")], max_tokens=4)
        await c.conversations.create()
        assert api.held() == 2 and len(api.store) == 2
        await until(lambda: api.held() == 0 and len(api.store) == 0 and srv.engine.stats()["sessions_open"] == 0)
        assert srv.engine.stats()["kv_pages_used"] == 0
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(r.id)


@pytest.mark.parametrize("parked", [True, False])
async def test_an_idle_session_is_parked_or_closed_and_the_chain_goes_on(tmp_path: Path, parked: bool) -> None:
    store = str(tmp_path / "store") if parked else None
    async with serve(ServerConfig(http_session_ttl=0.5, snapshot_store=store), smol) as srv:
        c, api, ref = client(srv), srv.server.openai, Reference(srv.engine)
        await ref.turn(user("What is the capital of France?"))
        r1 = await c.responses.create(input="What is the capital of France?", **ARGS)
        await until(lambda: api.held() == 0 and srv.engine.stats()["sessions_open"] == 1)  # the reference's only
        want, before, _ = await ref.turn(user("And of Italy?"))
        r2 = await c.responses.create(input="And of Italy?", previous_response_id=r1.id, **ARGS)
        assert r2.output_text == want
        assert r2.usage.input_tokens_details.cached_tokens == (before if parked else 0)
        ref.close()


async def test_a_drain_hands_stored_state_and_sessions_to_another_instance(tmp_path: Path) -> None:
    config = ServerConfig(snapshot_store=str(tmp_path / "store"))
    async with serve(config, smol) as a, serve(config, smol) as b:
        ca, cb, ref = client(a), client(b), Reference(b.engine)
        await ref.turn(user("What is the capital of France?"))
        r1 = await ca.responses.create(input="What is the capital of France?", **ARGS)
        conv = await ca.conversations.create(items=[{"role": "user", "content": "Remember: blue."}])
        await asyncio.to_thread(urllib.request.urlopen, urllib.request.Request(a.http + "/admin/drain",
                                                                               method="POST"))
        await asyncio.wait_for(a.server.drained.wait(), 60)
        want, before, _ = await ref.turn(user("And of Italy?"))
        r2 = await cb.responses.create(input="And of Italy?", previous_response_id=r1.id, **ARGS)
        assert r2.output_text == want and r2.usage.input_tokens_details.cached_tokens == before  # restored
        assert (await cb.responses.retrieve(r1.id)).output_text == r1.output_text
        assert (await cb.conversations.retrieve(conv.id)).id == conv.id
        ref.close()


async def test_two_follow_ups_on_a_parked_response_at_once(tmp_path: Path) -> None:
    async with serve(ServerConfig(http_session_ttl=0.5, snapshot_store=str(tmp_path / "store")), smol) as srv:
        c, api = client(srv), srv.server.openai
        refs = [Reference(srv.engine), Reference(srv.engine)]
        for ref in refs:
            await ref.turn(user("What is the capital of France?"))
        r1 = await c.responses.create(input="What is the capital of France?", **ARGS)
        await until(lambda: api.held() == 0 and srv.engine.stats()["sessions_open"] == 2)  # parked
        wants = [(await ref.turn(user(q)))[0] for ref, q in zip(refs, ("And of Italy?", "And of Spain?"), strict=True)]
        got = await asyncio.gather(*(c.responses.create(input=q, previous_response_id=r1.id, **ARGS)
                                     for q in ("And of Italy?", "And of Spain?")))
        assert [r.output_text for r in got] == wants
        assert max(r.usage.input_tokens_details.cached_tokens for r in got) > 0  # one of them restored it
        for ref in refs:
            ref.close()
        for r in (r1, *got):
            await c.responses.delete(r.id)
        await until(lambda: api.held() == 0 and srv.engine.stats()["sessions_open"] == 0)


async def test_a_long_history_of_short_messages_is_prefilled_in_chunks_under_the_limit() -> None:
    async with serve(ServerConfig(max_chunk_tokens=128), smol) as srv:
        c = client(srv)
        messages = [user(f"Item {i}.") if i % 2 == 0 else {"role": "assistant", "content": "Noted."} for i in range(41)]
        r = await c.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0.0)
        assert r.usage.prompt_tokens > 128 and r.choices[0].message.content
