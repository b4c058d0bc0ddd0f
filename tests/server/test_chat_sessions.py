"""Chat sessions end to end over loopback: the real server on tiny chat checkpoints, the Python client SDK."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from chat_checkpoints import NL, SPACE, TAB, chat_checkpoint, scripted
from serving import RunningServer, serve

import streamserve_client as sc
from streamserve.config import ServerConfig
from streamserve.engine import Engine
from streamserve.engine.chat import ChatTranscript

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONFIG = ServerConfig(resume_ttl=30.0, max_sessions_per_connection=4, max_chunk_tokens=256, messages_per_second=500.0)
REPLY = {"max_tokens": 8, "temperature": 0.0}


def loader(path: Path) -> Any:
    return lambda: Engine.from_pretrained(path, device="cpu", kv_memory="64MiB")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chat_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    """A random ChatML checkpoint (SmolLM2's template): greedy replies of varied tokens, some cut short."""
    path = chat_checkpoint(tmp_path_factory.mktemp("chat-server"), "chatml", seed=3)
    srv = await RunningServer.start(CONFIG, loader(path))
    yield srv
    await srv.stop()


def server_chat(srv: RunningServer, session_id: str) -> ChatTranscript:
    assert srv.server.service is not None
    chat = srv.server.service.chats.get(session_id)
    assert chat is not None
    return chat


async def engine_transcript(srv: RunningServer, steps: list[Any]) -> tuple[list[int], list[dict[str, str]]]:
    """The same conversation on an engine-level transcript (a worker thread: the server shares this loop):
    each step a message to add, or None for a reply with REPLY's parameters."""
    def run() -> tuple[list[int], list[dict[str, str]]]:
        with srv.engine.open_session() as s:
            chat = ChatTranscript(s)
            for step in steps:
                if step is None:
                    chat.reply(**REPLY).wait()
                else:
                    chat.add(step)
            return list(s.token_ids), list(chat.messages)

    return await asyncio.to_thread(run)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


async def test_chat_turns_over_the_wire_equal_the_engine_level_transcript(chat_server: RunningServer) -> None:
    steps: list[Any] = [[{"role": "system", "content": "Be brief."}, user("hello")], None, user("and then?"), None,
                        {"role": "assistant", "content": "a given answer"}, user("last one"), None]
    async with sc.connect(chat_server.url) as client:
        assert client.hello["chat_template"] is True
        s = await client.open_session(chat=True, **REPLY)
        assert s.chat and s.info["chat"]
        texts = []
        for step in steps:
            if step is None:
                r = s.respond()
                texts.append("".join([d.text async for d in r]))
                assert r.finish_reason in ("length", "stop")
            else:
                ack = await s.append(message=step)
                assert ack.tokens > 0
        wire = list(chat_server.engine.get_session(s.id).token_ids)
        messages = list(server_chat(chat_server, s.id).messages)
        await s.close()
    ids, expected = await engine_transcript(chat_server, steps)
    assert wire == ids and messages == expected
    assert next(m["content"] for m in messages if m["role"] == "assistant").startswith(texts[0][:1])
    assert chat_server.server.service is not None and s.id not in chat_server.server.service.chats.transcripts


async def test_rewind_to_a_message_and_a_resume_keep_the_transcript(chat_server: RunningServer) -> None:
    async with sc.connect(chat_server.url) as client:
        s = await client.open_session(chat=True, **REPLY)
        await s.append(message=user("first"))
        await s.respond().wait()
        await s.append(message=user("second"))
        await s.respond().wait()
        tokens = await s.rewind(to_message=2)  # keep the first exchange
        await client.drop_connection()  # the network drops: the client resumes the session
        await s.append(message=user("third"))
        await s.respond().wait()
        assert s.next_seq >= 4
        wire = list(chat_server.engine.get_session(s.id).token_ids)
        messages = list(server_chat(chat_server, s.id).messages)
        await s.close()
    ids, expected = await engine_transcript(chat_server, [user("first"), None, user("third"), None])
    assert wire == ids and messages == expected and len(ids) > tokens


async def test_chat_errors_are_typed(chat_server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    async with sc.connect(chat_server.url) as client:
        plain = await client.open_session()
        with pytest.raises(sc.InvalidInputError) as e:
            await plain.append(message=user("hi"))
        assert e.value.code == "not_chat_session" and e.value.seq == 0
        with pytest.raises(sc.InvalidInputError) as e:
            await plain.rewind(to_message=0)
        assert e.value.code == "not_chat_session"
        chat = await client.open_session(chat=True)
        for bad in ({"role": "robot", "content": "x"}, {"role": "user", "content": 5}, {"role": "user"},
                    {"role": "user", "content": "x", "name": "n"}, [], [user("ok"), {"role": "user"}]):
            with pytest.raises(sc.InvalidInputError) as e:
                await chat.append(message=bad)
            assert e.value.code == "invalid_chat_message"
        with pytest.raises(sc.InvalidInputError) as e:
            await chat.append(text="plain text")
        assert e.value.code == "invalid_input" and "chat session" in e.value.message
        await chat.append(message=user("still fine"))  # the refusals changed nothing
        assert server_chat(chat_server, chat.id).messages == [user("still fine")]
        monkeypatch.setattr(chat_server.engine.tokenizer, "chat_template", None)
        with pytest.raises(sc.InvalidInputError) as e:
            await client.open_session(chat=True)
        assert e.value.code == "no_chat_template"
    async with sc.connect(chat_server.url) as client:
        assert client.hello["chat_template"] is False


async def test_a_cancel_mid_reply_then_another_turn(tmp_path: Path) -> None:
    # a scripted model whose replies never end by themselves: " hi\t\n hi\t\n ..."
    path = chat_checkpoint(tmp_path, "chatml", [NL, SPACE, *scripted("hi"), TAB])
    async with serve(CONFIG, loader(path)) as srv, sc.connect(srv.url) as client:
        s = await client.open_session(chat=True, temperature=0.0)
        await s.append(message=user("talk"))
        r = s.respond(max_tokens=200)
        n = 0
        async for d in r:
            n += len(d.token_ids)
            if n >= 3 and n - len(d.token_ids) < 3:
                await s.cancel()
        assert r.finish_reason == "cancelled" and 3 <= n < 200 and r.text == (" hi\t\n" * 50)[:n]
        await s.append(message=user("again"))
        r2 = s.respond(max_tokens=4)
        assert "".join([d.text async for d in r2]) == " hi\t" and r2.finish_reason == "length"
        chat = server_chat(srv, s.id)
        assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
        full = chat.render(chat.messages)  # the session stands for the rendering, all but the pending end of turn
        assert srv.engine.get_session(s.id).token_ids == chat.encode(full[:len(full) - len(chat.pending)])
        assert chat.messages[1]["content"] == (" hi\t\n" * 50)[:n] and chat.pending == "<|im_end|>\n"


async def test_a_connection_dropped_mid_reply_leaves_the_reply_recorded_and_the_chat_consistent(
        tmp_path: Path) -> None:
    path = chat_checkpoint(tmp_path, "chatml", [NL, SPACE, *scripted("hi"), TAB])  # replies never end by themselves
    endless = " hi\t\n" * 100
    async with serve(CONFIG, loader(path)) as srv, sc.connect(srv.url) as client:
        s = await client.open_session(chat=True, temperature=0.0)
        await s.append(message=user("talk"))
        r = s.respond(max_tokens=300)
        seen = ""
        with pytest.raises(sc.ConnectionLostError):
            async for d in r:
                seen += d.text
                if len(seen) >= 3:
                    await client.drop_connection()  # the server cancels the reply and records what it made
        await s.append(message=user("again"))  # after the resume; goes in after the reply's record
        assert "".join([d.text async for d in s.respond(max_tokens=4)]) == " hi\t"
        chat = server_chat(srv, s.id)
        assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
        cut = chat.messages[1]["content"]
        assert cut.startswith(seen) and endless.startswith(cut) and len(cut) < len(endless)
        full = chat.render(chat.messages)
        assert srv.engine.get_session(s.id).token_ids == chat.encode(full[:len(full) - len(chat.pending)])
        assert await s.rewind(to_message=1) == len(chat.encode(chat.render(chat.messages[:1])))  # re-sync: drop it
