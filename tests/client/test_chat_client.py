"""The client SDK's chat sessions against a real server on loopback: chunk numbering (a reply's generation
prompt takes a seq), the blocking client, and a message and a reply sent without waiting in between."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from chat_checkpoints import IM_END, NL, SPACE, TAB, chat_checkpoint, scripted
from serving import RunningServer

import streamserve_client as sc
from streamserve.config import ServerConfig
from streamserve.engine import Engine

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    """Every reply of this scripted model is " hi\\t" and its end of turn."""
    path: Path = chat_checkpoint(tmp_path_factory.mktemp("client-chat"), "chatml",
                                 [NL, SPACE, *scripted("hi"), TAB, IM_END])
    srv = await RunningServer.start(ServerConfig(messages_per_second=500.0),
                                    lambda: Engine.from_pretrained(path, device="cpu", kv_memory="32MiB"))
    yield srv
    await srv.stop()


def sync_chat(url: str) -> list[tuple[int | str, int]]:
    seen: list[tuple[int | str, int]] = []  # (an ack's seq or a reply's text, the client's next seq after it)
    with sc.SyncClient(url) as client:
        assert client.hello["chat_template"] is True
        s = client.open_session(chat=True, max_tokens=8, temperature=0.0)

        def note(result: int | str) -> None:
            seen.append((result, s.session.next_seq))

        note(s.append(message={"role": "system", "content": "Be brief."}).seq)
        note(s.append(message={"role": "user", "content": "hi"}).seq)
        note("".join(d.text for d in s.respond()))
        note(s.append(message={"role": "user", "content": "more"}).seq)
        note("".join(d.text for d in s.respond()))
        s.rewind(to_message=3)  # keep the system prompt, the first question and its answer
        note(s.session.next_seq)
        note(s.append(message={"role": "user", "content": "other"}).seq)
        with pytest.raises(sc.InvalidInputError) as e:
            s.append(text="not a message")
        assert e.value.code == "invalid_input"
    return seen


async def test_the_blocking_client_numbers_chat_chunks_as_the_server_does(server: RunningServer) -> None:
    seen = await asyncio.to_thread(sync_chat, server.url)  # blocking calls: off the server's loop
    # each message takes a seq; so does each reply's generation prompt (seqs 2 and 4). The rewind keeps chunk 3
    # (its start holds the end of the first reply's turn, "\n"): the server's next seq is 4 again, and the client's
    assert seen == [(0, 1), (1, 2), (" hi\t", 3), (3, 4), (" hi\t", 5), (4, 4), (4, 5)]


async def test_messages_and_a_reply_sent_without_waiting_run_in_order(server: RunningServer) -> None:
    async with sc.connect(server.url) as client:
        s = await client.open_session(chat=True, max_tokens=8, temperature=0.0)
        for i in range(3):  # sent one after the other, no ack awaited (these acks go to no call)
            await client.channel.send({"type": "append", "session": s.id, "seq": i,
                                       "message": {"role": "user", "content": f"q{i}"}})
        s.next_seq = 3
        r = s.respond()  # asked before the messages' acks came: it runs after them
        text = "".join([d.text async for d in r])
        assert text == " hi\t" and r.finish_reason == "stop"
        assert server.server.service is not None
        chat = server.server.service.chats.get(s.id)
        assert chat is not None and [m["content"] for m in chat.messages] == ["q0", "q1", "q2", " hi\t"]


async def test_a_reply_before_any_message_is_refused_by_this_template(server: RunningServer) -> None:
    # SmolLM2's template puts its default system prompt before the first message whatever its role: a reply
    # first would rewrite the text before it. Refused, and the chat goes on unchanged.
    async with sc.connect(server.url) as client:
        s = await client.open_session(chat=True, max_tokens=8, temperature=0.0)
        r = s.respond()
        with pytest.raises(sc.InvalidInputError) as e:
            await r.wait()
        assert e.value.code == "chat_template_not_incremental"
        await s.append(message={"role": "user", "content": "hello"})
        assert "".join([d.text async for d in s.respond()]) == " hi\t"
