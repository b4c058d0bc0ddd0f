"""Chat completions and models with the real `openai` SDK on SmolLM2: streamed and not, equal to one chat session's
greedy replies, with session reuse visible in cached_tokens; errors in OpenAI's shape for every bad field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from serving import RunningServer

from openai_http.smol import GREEDY, Reference, smol, user
from streamserve.config import ServerConfig

pytestmark = [pytest.mark.models, pytest.mark.asyncio(loop_scope="module")]
ARGS = {"model": "default", "temperature": 0.0, "max_tokens": GREEDY["max_tokens"]}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv() -> AsyncIterator[RunningServer]:
    s = await RunningServer.start(ServerConfig(max_chunk_tokens=256, max_sessions_per_connection=4), smol)
    yield s
    await s.stop()


def client(srv: RunningServer, key: str = "key-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{srv.http}/v1", api_key=key, max_retries=0)


async def test_models_list_what_is_served(srv: RunningServer) -> None:
    c = client(srv)
    listed = [m.id async for m in c.models.list()]
    assert listed == [srv.engine.name]
    assert (await c.models.retrieve(srv.engine.name)).id == srv.engine.name
    with pytest.raises(openai.NotFoundError):
        await c.models.retrieve("gpt-nothing")


async def test_a_conversation_resent_whole_reuses_its_session(srv: RunningServer) -> None:
    c, ref = client(srv), Reference(srv.engine)
    messages: list[dict[str, Any]] = [user("What is the capital of France?")]
    want, _, at_reply = await ref.turn(user("What is the capital of France?"))
    r = await c.chat.completions.create(messages=messages, **ARGS)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.prompt_tokens == at_reply
    for q in ("And of Italy?", "Which is older?"):
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, user(q)]
        want, before, _ = await ref.turn(user(q))
        stream = await c.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **ARGS)
        chunks = [ch async for ch in stream]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == want
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == before
        r = type("R", (), {"choices": [type("C", (), {"message": type("M", (), {"content": text})})]})
    ref.close()
    # another key never reuses this key's sessions
    other = await client(srv, "key-b").chat.completions.create(messages=messages[:1], **ARGS)
    assert other.usage.prompt_tokens_details.cached_tokens == 0


async def test_a_changed_history_is_not_reused(srv: RunningServer) -> None:
    c = client(srv, "key-c")
    first = await c.chat.completions.create(messages=[user("Count to three.")], **ARGS)
    edited = [user("Count to three."), {"role": "assistant", "content": "1, 2, 3, 4"}, user("And back?")]
    r = await c.chat.completions.create(messages=edited, **ARGS)
    ref = Reference(srv.engine)
    want, _, _ = await ref.turn(*edited)
    ref.close()
    assert first.choices[0].message.content != "1, 2, 3, 4"
    assert r.choices[0].message.content == want and r.usage.prompt_tokens_details.cached_tokens == 0


BAD: list[tuple[dict[str, Any], str | None]] = [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [user("x")], "n": 2}, "n"),
    ({"messages": [user("x")], "temperature": 3}, "temperature"),
    ({"messages": [user("x")], "top_p": 0}, "top_p"),
    ({"messages": [user("x")], "max_tokens": 0}, "max_tokens"),
    ({"messages": [user("x")], "logprobs": True}, "logprobs"),
    ({"messages": [user("x")], "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": [user("x")], "frequency_penalty": 1.0}, "frequency_penalty"),
    ({"messages": [user("x")], "seed": -1}, "seed"),
    ({"messages": [user("x")], "bogus": 1}, "bogus"),
    ({"messages": [user("x" * 20000)]}, None),  # over the chunk limit: 400, nothing taken
]


@pytest.mark.parametrize(("body", "param"), BAD)
async def test_bad_chat_fields_get_openais_error_shape(srv: RunningServer, body: dict[str, Any],
                                                       param: str | None) -> None:
    before = srv.engine.stats()["sessions_open"]
    async with aiohttp.ClientSession() as http, http.post(f"{srv.http}/v1/chat/completions",
                                                          json={"model": "default", **body}) as r:
        got = await r.json()
    assert r.status == 400, got
    assert got["error"]["type"] == "invalid_request_error" and got["error"]["message"]
    assert got["error"]["param"] == param
    # nothing held for it: a session the turn opened is dropped by a task the failure spawned (turns.py), which
    # may end just after the answer went out (CI saw 5 open against 4 once): waited for, never for long
    for _ in range(500):
        if srv.engine.stats()["sessions_open"] <= before:
            break
        await asyncio.sleep(0.01)
    assert srv.engine.stats()["sessions_open"] <= before


BAD_RESPONSES: list[tuple[dict[str, Any], int, str | None]] = [
    ({}, 400, "input"),
    ({"input": 3}, 400, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": "x", "max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"input": "x", "metadata": {"k": 1}}, 400, "metadata.k"),
    ({"input": "x", "store": "yes"}, 400, "store"),
    ({"input": "x", "background": True, "store": False}, 400, "background"),
    ({"input": "x", "model": "gpt-nothing"}, 404, "model"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "x", "conversation": "conv_nope"}, 404, "conversation"),
    ({"input": "x", "conversation": "conv_a", "previous_response_id": "resp_b"}, 400, "conversation"),
    ({"input": "x" * 40000}, 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_RESPONSES)
async def test_bad_response_fields_get_openais_error_shape(srv: RunningServer, body: dict[str, Any], status: int,
                                                           param: str | None) -> None:
    async with aiohttp.ClientSession() as http, http.post(f"{srv.http}/v1/responses", json=body) as r:
        got = await r.json()
    assert r.status == status, got
    assert set(got["error"]) == {"message", "type", "param", "code"} and got["error"]["param"] == param
    assert not srv.server.openai.store.of_owner(srv.server.openai.host.owner(fake_request()))


def fake_request() -> Any:
    return type("Req", (), {"headers": {}})()


async def test_unknown_ids_and_bodies(srv: RunningServer) -> None:
    async with aiohttp.ClientSession() as http:
        for method, path in (("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
                             ("POST", "/v1/responses/resp_x/cancel"), ("GET", "/v1/conversations/conv_x"),
                             ("GET", "/v1/conversations/conv_x/items"), ("DELETE", "/v1/conversations/conv_x")):
            async with http.request(method, srv.http + path) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "not_found", path
        async with http.post(srv.http + "/v1/responses", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"


async def test_a_client_gone_mid_stream_frees_its_session(srv: RunningServer) -> None:
    c = client(srv, "key-gone")
    stream = await c.chat.completions.create(messages=[user("Write a long story about a cat.")], stream=True,
                                             **(ARGS | {"max_tokens": 200}))
    async for _ in stream:
        break
    await stream.close()
    owner = srv.server.openai.turns.owners[srv.server.openai.host.owner(
        type("Req", (), {"headers": {"Authorization": "Bearer key-gone"}})())]
    for _ in range(500):
        if not owner.residents:
            break
        await asyncio.sleep(0.01)
    assert not owner.residents  # the cancelled turn's session closed
    r = await c.chat.completions.create(messages=[user("Hi")], **ARGS)  # and the key goes on
    assert r.choices[0].message.content


async def test_stop_and_seed(srv: RunningServer) -> None:
    c = client(srv, "key-seed")
    messages = [user("List five fruits, separated by commas.")]
    stopped = await c.chat.completions.create(messages=messages, stop=[","], **ARGS)
    assert "," not in stopped.choices[0].message.content and stopped.choices[0].finish_reason == "stop"
    sampled = [await client(srv, f"key-seed-{i}").chat.completions.create(
        messages=messages, model="default", temperature=1.0, seed=7, max_tokens=16) for i in range(2)]
    assert sampled[0].choices[0].message.content == sampled[1].choices[0].message.content
