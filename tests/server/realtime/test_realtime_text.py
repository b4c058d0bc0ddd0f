"""/v1/realtime on text, against a real server: the official `openai` SDK holds a conversation on one persistent
session (a turn appends only its new item and generation prompt), and every event the server sends validates
against the SDK's GA models and pipecat's parser (tests/server/realtime/rt.py)."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI
from rt import RawRealtime, check_event, user_text
from serving import RunningServer, serve

from streamserve.config import ServerConfig


def counter(srv: RunningServer, kind: str) -> float:
    return srv.engine.metrics.tokens.labels(kind)._value.get()


def only_session(srv: RunningServer):  # the realtime connection's chat session (the only one on its own server)
    service = srv.server.service
    assert service is not None
    (entry,) = service.registry.all()
    return entry.session


@pytest.mark.asyncio
async def test_sdk_text_conversation_appends_only_new_turns() -> None:
    async with serve(ServerConfig()) as srv:
        client = AsyncOpenAI(api_key="unused", base_url=f"{srv.http}/v1")
        async with client.realtime.connect(model="default") as conn:
            created = await conn.recv()
            assert created.type == "session.created" and created.session.output_modalities == ["text"]
            await conn.session.update(session={"type": "realtime", "instructions": "Answer in the words of Genesis.",
                                               "output_modalities": ["text"]})
            updated = await conn.recv()
            assert updated.type == "session.updated"
            assert updated.session.instructions == "Answer in the words of Genesis."

            async def turn(text: str) -> tuple[str, object]:
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": text}]})
                await conn.response.create(response={"max_output_tokens": 12})
                deltas, done_text = [], None
                async for ev in conn:
                    check_event(ev.to_dict())
                    if ev.type == "response.output_text.delta":
                        deltas.append(ev.delta)
                    elif ev.type == "response.output_text.done":
                        done_text = ev.text
                    elif ev.type == "error":
                        raise AssertionError(ev.error)
                    elif ev.type == "response.done":
                        assert ev.response.status in ("completed", "incomplete"), ev.response
                        assert done_text == "".join(deltas) and done_text
                        assert ev.response.output[0].content[0].text == done_text
                        return done_text, ev.response.usage
                raise AssertionError("the connection ended")

            _, usage1 = await turn("In the beginning")
            session = only_session(srv)
            length1, appended1 = len(session.token_ids), counter(srv, "append")
            _, usage2 = await turn("And the earth was")
            length2, appended2 = len(session.token_ids), counter(srv, "append")
    assert usage1.input_token_details.cached_tokens == 0
    assert usage2.input_token_details.cached_tokens == length1  # the whole first turn stayed in the KV cache
    new_input = usage2.input_tokens - usage2.input_token_details.cached_tokens
    # the second turn prefilled its item and generation prompt only: never the history again
    assert appended2 - appended1 == new_input
    assert 0 < new_input < length1
    assert length2 == usage2.input_tokens + usage2.output_tokens or length2 == usage2.input_tokens + \
        usage2.output_tokens - 1  # a stop token closing the reply is not kept


@pytest.mark.asyncio(loop_scope="module")
async def test_event_errors_keep_the_connection(served: RunningServer) -> None:
    c = await RawRealtime.connect(served.http)
    await c.send({"type": "response.cancel", "event_id": "cancel-1"})
    err = await c.error()
    assert (err["type"], err["code"], err["event_id"]) == ("invalid_request_error", "response_cancel_not_active",
                                                           "cancel-1")
    await c.send("{not json")
    assert (await c.error())["code"] == "invalid_json"
    await c.send({"type": "response.explode", "event_id": "x1"})
    err = await c.error()
    assert (err["code"], err["param"], err["event_id"]) == ("invalid_value", "type", "x1")
    await c.send('["a list"]')
    assert (await c.error())["code"] == "invalid_event"
    await c.send({"type": "input_audio_buffer.append", "audio": "AAAA"})  # this server runs without voice
    err = await c.error()
    assert err["code"] == "unsupported_modality" and "streamserve[voice]" in err["message"]
    await c.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"]}})
    assert (await c.error())["code"] == "unsupported_modality"
    await c.send({"type": "conversation.item.create", "item": {"type": "function_call", "name": "f",
                                                               "arguments": "{}"}})
    assert (await c.error())["code"] == "unsupported_item_type"
    await c.send({"type": "conversation.item.retrieve", "item_id": "nope"})
    assert (await c.error())["code"] == "item_retrieve_invalid_item_id"
    await c.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000}}}}})
    err = await c.error()
    assert (err["code"], err["param"]) == ("invalid_value", "session.audio.input.format.rate")
    await c.send({"type": "response.create", "response": {"conversation": "none"}})
    assert (await c.error())["code"] == "unsupported_conversation"
    await c.send({"type": "response.create", "response": {"max_output_tokens": 10 ** 9}})
    assert (await c.error())["param"] == "response.max_output_tokens"
    await c.send("x" * (served.server.config.max_frame_bytes + 10))  # over max_frame_bytes: refused, not closed
    assert (await c.error())["code"] == "event_too_large"
    # after all that, the connection still converses
    await c.send(user_text("In the beginning"))
    await c.send({"type": "response.create", "response": {"max_output_tokens": 4}})
    done = (await c.until("response.done"))[-1]
    assert done["response"]["status"] in ("completed", "incomplete")
    await c.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_items_retrieve_insert_delete_and_second_response_refused(served: RunningServer) -> None:
    c = await RawRealtime.connect(served.http)
    await c.send(user_text("In the beginning", id="first"))
    added = (await c.until("conversation.item.done"))
    assert [m["type"] for m in added] == ["conversation.item.added", "conversation.item.done"]
    assert added[0]["previous_item_id"] is None and added[1]["item"]["id"] == "first"
    await c.send(user_text("God created", id="third"))
    await c.until("conversation.item.done")
    await c.send(user_text("the heaven", id="second", previous_item_id="first"))  # inserted: rewind + re-append
    added = await c.until("conversation.item.added")
    assert added[-1]["previous_item_id"] == "first"
    await c.until("conversation.item.done")
    chat = served.server.service.chats  # the chat session's messages follow the conversation's order
    transcript = next(chat.get(e.session.id) for e in served.server.service.registry.all()
                      if chat.get(e.session.id) is not None and len(chat.get(e.session.id).messages) == 3)
    assert [m["content"] for m in transcript.messages] == ["In the beginning", "the heaven", "God created"]
    await c.send({"type": "conversation.item.retrieve", "item_id": "second"})
    got = (await c.until("conversation.item.retrieved"))[-1]
    assert got["item"]["content"][0]["text"] == "the heaven"
    await c.send({"type": "conversation.item.delete", "item_id": "second", "event_id": "del"})
    assert (await c.until("conversation.item.deleted"))[-1]["item_id"] == "second"
    assert [m["content"] for m in transcript.messages] == ["In the beginning", "God created"]
    await c.send({"type": "response.create", "response": {"max_output_tokens": 40, "instructions": "Be brief."}})
    await c.until("response.created")
    await c.send({"type": "response.create", "event_id": "again"})
    err = await c.error()
    assert (err["code"], err["event_id"]) == ("conversation_already_has_active_response", "again")
    done = (await c.until("response.done"))[-1]
    assert done["response"]["status"] in ("completed", "incomplete")
    # the per-response instructions went in as a system message before the reply (docs/realtime.md: a difference)
    assert [m["role"] for m in transcript.messages] == ["user", "user", "system", "assistant"]
    assert transcript.messages[-1]["content"] == done["response"]["output"][0]["content"][0]["text"]
    await c.close()


@pytest.mark.asyncio
async def test_auth_as_the_native_endpoint() -> None:
    import websockets

    async with serve(ServerConfig(api_key="sekrit")) as srv:
        with pytest.raises(websockets.InvalidStatus):
            await RawRealtime.connect(srv.http)
        c = await RawRealtime.connect(srv.http, additional_headers={"Authorization": "Bearer sekrit"})
        await c.close()
        c = await RawRealtime.connect(srv.http, subprotocols=["realtime", "openai-insecure-api-key.sekrit"])
        assert c.ws.subprotocol == "realtime"  # the key is never echoed
        await c.close()
        client = AsyncOpenAI(api_key="sekrit", base_url=f"{srv.http}/v1")
        secret = await client.realtime.client_secrets.create()
        c = await RawRealtime.connect(srv.http, additional_headers={"Authorization": f"Bearer {secret.value}"})
        await c.close()
