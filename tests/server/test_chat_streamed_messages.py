"""Streamed chat messages through the service's ChatSessions (begin, extend, end, abort): in order with the
chat's other operations, equal to the message added whole, typed errors (a tiny ChatML checkpoint, no I/O)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import pytest_asyncio
from chat_checkpoints import chat_checkpoint

from streamserve.engine import Engine
from streamserve.engine.chat import ChatMessageError, MessageNotOpenError, MessageOpenError
from streamserve.errors import SessionClosedError
from streamserve.server.service.chat import ChatSessions, NotChatSessionError
from streamserve.server.service.results import ReplyDelta, ReplyDone

pytestmark = pytest.mark.asyncio(loop_scope="module")
REPLY = {"max_tokens": 6, "temperature": 0.0}


class Listener:
    """Collects what the service pushes (a connection that is never behind)."""

    def __init__(self) -> None:
        self.results: list[Any] = []
        self.done = asyncio.Event()

    async def push(self, result: Any) -> None:
        self.results.append(result)
        if isinstance(result, ReplyDone):
            self.done.set()

    def push_nowait(self, result: Any) -> bool:
        self.results.append(result)
        return True

    def text(self) -> str:
        return "".join(r.text for r in self.results if isinstance(r, ReplyDelta))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    e = Engine.from_pretrained(chat_checkpoint(tmp_path_factory.mktemp("chat-stream"), "chatml", seed=5),
                               device="cpu", kv_memory="64MiB")
    yield e
    e.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def chats(engine: Engine) -> AsyncIterator[ChatSessions]:
    """ChatSessions as the service makes it: engine calls on an executor, replies as tasks."""
    pool, tasks = ThreadPoolExecutor(2), set()

    async def offload(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*args))

    def spawn(coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    yield ChatSessions(engine, offload, spawn)
    await asyncio.gather(*tasks, return_exceptions=True)
    pool.shutdown()


def open_chat(chats: ChatSessions) -> str:
    s = chats.engine.open_session()
    chats.start(s, chat=True)
    return s.id


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


async def reply(chats: ChatSessions, sid: str) -> str:
    listener = Listener()
    assert chats.respond(listener, sid, dict(REPLY))
    await listener.done.wait()
    return listener.text()


async def test_streamed_turns_equal_added_ones_and_a_reply_asked_meanwhile_waits(chats: ChatSessions) -> None:
    streamed, added = open_chat(chats), open_chat(chats)
    # streamed: the reply and the next message are asked while the message is open; they go after its end
    futures: list[asyncio.Future[Any]] = [chats.begin(streamed, "user"), chats.extend(streamed, " What")]
    listener = Listener()
    assert chats.respond(listener, streamed, dict(REPLY))
    futures.append(chats.add(streamed, user("and then?"), {}))
    futures += [chats.extend(streamed, " is ", {"seq": 10}), chats.extend(streamed, "it?"), chats.end(streamed)]
    results = await asyncio.gather(*futures)
    await listener.done.wait()
    assert results[3].seq == 10 and results[3].tokens > 0
    assert results[5] == user("What is it?")
    assert chats.message_count(streamed) == 3 and chats.open_message(streamed) is None

    await chats.add(added, user("What is it?"), {})
    text = await reply(chats, added)
    await chats.add(added, user("and then?"), {})
    assert listener.text() == text
    a, b = chats.get(streamed), chats.get(added)
    assert a is not None and b is not None
    assert a.messages == b.messages and a.session.token_ids == b.session.token_ids

    # a rewind to the streamed message (keeps none after it) works, and the chat goes on
    await chats.rewind(streamed, None, None, 0)
    assert chats.message_count(streamed) == 0 and a.session.token_ids == []
    for sid in (streamed, added):
        chats.forget(sid)


async def test_abort_leaves_the_session_as_before_begin_and_the_chat_goes_on(chats: ChatSessions) -> None:
    sid = open_chat(chats)
    await chats.add(sid, user("hello"), {})
    await reply(chats, sid)
    chat = chats.get(sid)
    assert chat is not None
    ids, pending = list(chat.session.token_ids), chat.pending
    await chats.begin(sid, "user")
    await chats.extend(sid, " never mind")
    assert chats.open_message(sid) == user("never mind")
    assert await chats.abort(sid) is True
    assert chat.session.token_ids == ids and chat.pending == pending
    assert await chats.abort(sid) is False  # a clear with nothing open
    await asyncio.gather(chats.begin(sid, "user"), chats.extend(sid, "bye"), chats.end(sid))
    assert chats.message_count(sid) == 3
    assert chat.template.decode(chat.session.token_ids) == chat.render(chat.messages)
    chats.forget(sid)


async def test_streamed_message_errors_are_typed(chats: ChatSessions) -> None:
    plain = chats.engine.open_session()
    chats.start(plain, chat=False)
    with pytest.raises(NotChatSessionError):
        chats.begin(plain.id, "user")
    with pytest.raises(NotChatSessionError):
        chats.message_count(plain.id)
    plain.close()
    sid = open_chat(chats)
    with pytest.raises(ChatMessageError):
        chats.begin(sid, "robot")
    with pytest.raises(ChatMessageError):
        chats.extend(sid, b"bytes")  # type: ignore[arg-type]
    with pytest.raises(MessageNotOpenError):
        await chats.extend(sid, "no begin")
    with pytest.raises(MessageNotOpenError):
        await chats.end(sid)
    first, second = chats.begin(sid, "user"), chats.begin(sid, "user")
    await first
    with pytest.raises(MessageOpenError):
        await second
    chat = chats.get(sid)
    assert chat is not None
    await chats.offload(chat.session.close)  # the engine closes the session under the open message
    with pytest.raises(SessionClosedError):
        await chats.end(sid)
    chats.forget(sid)
    with pytest.raises(NotChatSessionError):
        chats.end(sid)


async def test_a_reply_waiting_for_an_open_message_ends_when_the_session_goes(chats: ChatSessions) -> None:
    sid = open_chat(chats)
    await chats.begin(sid, "user")
    listener = Listener()
    assert chats.respond(listener, sid, dict(REPLY))
    chat = chats.get(sid)
    assert chat is not None
    await chats.offload(chat.session.close)
    chats.forget(sid)  # the service closes the session: the reply waiting for the message's end goes on, and ends
    await listener.done.wait()
    assert listener.results[-1].reason in ("error", "cancelled")
