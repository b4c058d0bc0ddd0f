"""The Responses and Conversations APIs with the real `openai` SDK on SmolLM2: a previous_response_id chain and a
conversation whose greedy replies equal one chat session's, with cached_tokens equal to the context held; a fork;
the streamed events; leaks after deletes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio
from serving import RunningServer

from openai_http.smol import GREEDY, QUESTIONS, Reference, smol, user
from streamserve.config import ServerConfig

pytestmark = [pytest.mark.models, pytest.mark.asyncio(loop_scope="module")]
ARGS = {"temperature": 0.0, "max_output_tokens": GREEDY["max_tokens"]}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv() -> AsyncIterator[RunningServer]:
    s = await RunningServer.start(ServerConfig(max_sessions_per_connection=4), smol)
    yield s
    await s.stop()


def client(srv: RunningServer, key: str = "key-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{srv.http}/v1", api_key=key, max_retries=0)


async def clean(srv: RunningServer) -> None:
    """Nothing held: no stored object, no HTTP session, no engine session, no KV page (sessions close in the
    background after a delete: waited for, bounded)."""
    api = srv.server.openai
    for _ in range(500):
        st = srv.engine.stats()
        if api.held() == 0 and st["sessions_open"] == 0:
            break
        await asyncio.sleep(0.01)
    assert len(api.store) == 0 and api.store.bytes == 0
    assert api.held() == 0
    assert st["sessions_open"] == 0 and st["kv_pages_used"] == 0, st


async def test_a_ten_turn_chain_equals_one_chat_session_and_reuses_its_context(srv: RunningServer) -> None:
    ref, c = Reference(srv.engine), client(srv)
    prev, ids = None, []
    for q in QUESTIONS:
        want, before, at_reply = await ref.turn(user(q))
        r = await c.responses.create(model="default", input=q, previous_response_id=prev, **ARGS)
        assert r.status in ("completed", "incomplete") and r.output_text == want, (q, r.output_text, want)
        assert r.usage.input_tokens_details.cached_tokens == before  # the whole previous context, not recomputed
        assert r.usage.input_tokens == at_reply
        assert r.previous_response_id == prev
        prev = r.id
        ids.append(r.id)
    got = await c.responses.retrieve(prev)
    assert got.output_text == r.output_text
    items = await c.responses.input_items.list(prev)
    assert [i.content[0].text for i in items.data] == [QUESTIONS[-1]]
    ref.close()
    for i in ids:
        await c.responses.delete(i)
    await clean(srv)


async def test_a_second_continuation_forks_without_recomputing(srv: RunningServer) -> None:
    c = client(srv)
    a = Reference(srv.engine)
    first, _, _ = await a.turn(user("What is the capital of France?"))
    r1 = await c.responses.create(input="What is the capital of France?", **ARGS)
    assert r1.output_text == first
    branch_one, before, _ = await a.turn(user("And of Spain?"))
    r2 = await c.responses.create(input="And of Spain?", previous_response_id=r1.id, **ARGS)
    assert r2.output_text == branch_one
    # r1 again: its session moved on to r2; the continuation copies it and goes back to r1's end
    b = Reference(srv.engine)
    await b.turn(user("What is the capital of France?"))
    branch_two, before_two, _ = await b.turn(user("And of Germany?"))
    r3 = await c.responses.create(input="And of Germany?", previous_response_id=r1.id, **ARGS)
    assert r3.output_text == branch_two
    # r1's context is kept whole, with the end of its turn that went in with r2's message (one token on SmolLM2)
    assert before_two == before and before <= r3.usage.input_tokens_details.cached_tokens <= before + 2
    # both branches go on from their own sessions
    more_one, held_one, _ = await a.turn(user("Thanks."))
    more_two, held_two, _ = await b.turn(user("Thanks."))
    r4 = await c.responses.create(input="Thanks.", previous_response_id=r2.id, **ARGS)
    r5 = await c.responses.create(input="Thanks.", previous_response_id=r3.id, **ARGS)
    assert (r4.output_text, r5.output_text) == (more_one, more_two)
    assert r4.usage.input_tokens_details.cached_tokens == held_one
    assert r5.usage.input_tokens_details.cached_tokens == held_two
    a.close(), b.close()
    for r in (r1, r2, r3, r4, r5):
        await c.responses.delete(r.id)
    await clean(srv)


async def test_streamed_events_parse_and_end_in_the_stored_response(srv: RunningServer) -> None:
    c = client(srv)
    ref = Reference(srv.engine)
    want, _, _ = await ref.turn(user("Name three colours."))
    kinds, deltas = [], []
    stream = await c.responses.create(input="Name three colours.", stream=True, **ARGS)
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):  # incomplete: at max_output_tokens
            final = event.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{final.status}"]
    assert "".join(deltas) == want == final.output_text
    assert (await c.responses.retrieve(final.id)).output_text == want
    # the SDK's helper stream, continuing it
    want2, before, _ = await ref.turn(user("Say hi."), max_tokens=200)  # to its end: the helper wants `completed`
    async with c.responses.stream(model="default", input="Say hi.", previous_response_id=final.id,
                                  **(ARGS | {"max_output_tokens": 200})) as s:
        async for _ in s:
            pass
        done = await s.get_final_response()
    assert done.output_text == want2 and done.usage.input_tokens_details.cached_tokens == before
    ref.close()
    for rid in (final.id, done.id):
        await c.responses.delete(rid)
    await clean(srv)


async def test_a_conversation_is_a_session_plus_its_items(srv: RunningServer) -> None:
    c = client(srv)
    ref = Reference(srv.engine)
    conv = await c.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi, I am Ada."}],
                                        metadata={"topic": "intro"})
    want, _, _ = await ref.turn(user("Hi, I am Ada."), user("What is my name?"))
    r1 = await c.responses.create(conversation=conv.id, input="What is my name?", **ARGS)
    assert r1.output_text == want
    want2, before, _ = await ref.turn(user("Spell it."))
    r2 = await c.responses.create(conversation=conv.id, input="Spell it.", **ARGS)
    assert r2.output_text == want2 and r2.usage.input_tokens_details.cached_tokens == before
    items = [i async for i in c.conversations.items.list(conv.id, order="asc")]
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "Hi, I am Ada."), ("user", "What is my name?"), ("assistant", want), ("user", "Spell it."),
        ("assistant", want2)]
    one = await c.conversations.items.retrieve(items[3].id, conversation_id=conv.id)
    assert one.content[0].text == "Spell it."
    updated = await c.conversations.update(conv.id, metadata={"topic": "names"})
    assert updated.metadata == {"topic": "names"}
    # an item deleted: the next turn runs on the items left (the session is rewound to them, then appended)
    await c.conversations.items.delete(items[4].id, conversation_id=conv.id)
    await c.conversations.items.delete(items[3].id, conversation_id=conv.id)
    other = Reference(srv.engine)
    await other.turn(user("Hi, I am Ada."), user("What is my name?"))
    want3, _, _ = await other.turn(user("Say it twice."))
    r3 = await c.responses.create(conversation=conv.id, input="Say it twice.", **ARGS)
    assert r3.output_text == want3
    assert r3.usage.input_tokens_details.cached_tokens > 0  # the kept items were not recomputed
    ref.close(), other.close()
    await c.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        await c.conversations.retrieve(conv.id)
    for r in (r1, r2, r3):
        await c.responses.delete(r.id)
    await clean(srv)


async def test_another_keys_ids_are_not_found(srv: RunningServer) -> None:
    a, b = client(srv, "key-a"), client(srv, "key-b")
    r = await a.responses.create(input="Hello", **ARGS)
    conv = await a.conversations.create()
    with pytest.raises(openai.NotFoundError) as e:
        await b.responses.create(input="Hi", previous_response_id=r.id, **ARGS)
    assert e.value.body["param"] == "previous_response_id"
    for call in (b.responses.retrieve(r.id), b.responses.delete(r.id), b.conversations.retrieve(conv.id),
                 b.responses.create(input="Hi", conversation=conv.id, **ARGS)):
        with pytest.raises(openai.NotFoundError):
            await call
    await a.responses.delete(r.id)
    await a.conversations.delete(conv.id)
    await clean(srv)


async def test_a_background_response_is_polled_or_cancelled(srv: RunningServer) -> None:
    c = client(srv)
    long = await c.responses.create(input="Write a long story about a lighthouse.", background=True,
                                    temperature=0.0, max_output_tokens=400)
    assert long.status in ("queued", "in_progress") and long.background
    cancelled = await c.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and (await c.responses.retrieve(long.id)).status == "cancelled"
    # a follow-up on the cancelled response sees its input (its session closed: prefilled again)
    after = await c.responses.create(input="Shorter, please.", previous_response_id=long.id, **ARGS)
    assert after.status in ("completed", "incomplete") and after.usage.input_tokens_details.cached_tokens == 0
    short = await c.responses.create(input="Say hi.", background=True, **ARGS)
    for _ in range(600):
        got = await c.responses.retrieve(short.id)
        if got.status not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.05)
    assert got.status in ("completed", "incomplete") and got.output_text
    assert (await c.responses.cancel(short.id)).status == got.status  # ended: answered as it is
    with pytest.raises(openai.BadRequestError):
        await c.responses.cancel(after.id)  # not a background one
    for r in (long, after, short):
        await c.responses.delete(r.id)
    await clean(srv)


async def test_a_conversation_with_instructions_continues_its_session(srv: RunningServer) -> None:
    c = client(srv)
    conv = await c.conversations.create()
    r1 = await c.responses.create(conversation=conv.id, input="Hi.", instructions="Answer in one word.", **ARGS)
    r2 = await c.responses.create(conversation=conv.id, input="And again?", instructions="Answer in one word.", **ARGS)
    assert r2.usage.input_tokens_details.cached_tokens > r1.usage.input_tokens  # the whole first turn reused
    roles = [i.role async for i in c.conversations.items.list(conv.id, order="asc")]
    assert roles == ["system", "user", "assistant", "user", "assistant"]  # the instructions once, where they went in
    await c.conversations.delete(conv.id)
    for r in (r1, r2):
        await c.responses.delete(r.id)
    await clean(srv)


async def test_a_stream_whose_client_goes_at_once_leaves_nothing_locked(srv: RunningServer) -> None:
    import aiohttp

    c = client(srv)
    conv = await c.conversations.create()
    body = {"input": "Write a long story.", "conversation": conv.id, "stream": True, "max_output_tokens": 300}
    async with aiohttp.ClientSession() as http, http.post(f"{srv.http}/v1/responses", json=body,
                                                          headers={"Authorization": "Bearer key-a"}) as r:
        await r.content.readline()  # the head and a first line, then the connection goes
    for _ in range(500):
        stored = srv.server.openai.store.of_owner(srv.server.openai.host.owner(
            type("Req", (), {"headers": {"Authorization": "Bearer key-a"}})()))
        if not any(o.in_progress for o in stored) and srv.server.openai.held() == 0:
            break
        await asyncio.sleep(0.02)
    r2 = await c.responses.create(conversation=conv.id, input="Hello.", **ARGS)  # the conversation is not locked
    assert r2.status in ("completed", "incomplete")
    for o in list(srv.server.openai.store.of_owner(srv.server.openai.host.owner(
            type("Req", (), {"headers": {"Authorization": "Bearer key-a"}})()))):
        if o.kind == "response":
            await c.responses.delete(o.id)
    await c.conversations.delete(conv.id)
    await clean(srv)
