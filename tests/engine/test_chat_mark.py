"""A speculative turn taken back: a chat marked with a message open, the message ended and a reply run, then
restored, stands exactly as at the mark (token ids, messages, the open message) and goes on as if nothing had
happened (engine level, no I/O)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from typing import Any

import pytest
from chat_checkpoints import END_OF_TURN, IM_END, NL, SPACE, TAB, chat_checkpoint, scripted

from streamserve import Engine
from streamserve.engine.chat import ChatTranscript
from streamserve.errors import ResponseInProgressError

KINDS = {"chatml": [NL, SPACE, *scripted("hi"), TAB, IM_END], "gemma": [NL, SPACE, *scripted("ok"), END_OF_TURN]}
REPLY = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    root = tmp_path_factory.mktemp("chat-mark")
    out = {k: Engine.from_pretrained(chat_checkpoint(root / k, k, script), device="cpu", kv_memory="64MiB")
           for k, script in KINDS.items()}
    yield out
    for e in out.values():
        e.shutdown()


def said(chat: ChatTranscript, first: list[str], second: list[str], speculate: bool) -> None:
    """One exchange, then a user message streamed in two parts with a pause between them: with `speculate`, at the
    pause the message is ended and a reply run, then both are taken back (the person went on speaking)."""
    chat.add({"role": "user", "content": "hello"})
    chat.reply(**REPLY).wait()
    chat.begin_message("user")
    for piece in first:
        chat.extend_message(piece)
    if speculate:
        m = chat.mark()
        state = (list(chat.session.token_ids), list(chat.messages), copy.copy(chat.open_message))
        chat.extend_message(" maybe?")  # the speculation's own tail, then the turn's end and a reply
        chat.end_message()
        chat.reply(**REPLY).wait()
        assert len(chat.messages) == 4
        chat.restore(m)
        assert (list(chat.session.token_ids), list(chat.messages), chat.open_message) == state
        chat.restore(m)  # a mark can be restored again (nothing to cut): the same state
        assert list(chat.session.token_ids) == state[0]
    for piece in second:
        chat.extend_message(piece)
    chat.end_message()
    chat.reply(**REPLY).wait()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_restored_speculation_equals_a_run_without_it(engines: dict[str, Engine], kind: str) -> None:
    first, second = [" What is", " the capital "], [" of", " France?"]
    with engines[kind].open_session() as a, engines[kind].open_session() as b:
        spec, ref = ChatTranscript(a), ChatTranscript(b)
        said(spec, first, second, True)
        said(ref, first, second, False)
        assert a.token_ids == b.token_ids and spec.messages == ref.messages and spec.pending == ref.pending
        assert spec.messages[2] == {"role": "user", "content": "What is the capital  of France?"}


def test_no_mark_while_a_reply_runs(engines: dict[str, Engine]) -> None:
    with engines["chatml"].open_session() as s:
        chat = ChatTranscript(s)
        chat.add({"role": "user", "content": "hi"})
        reply = chat.reply(temperature=0.0, max_tokens=4)
        with pytest.raises(ResponseInProgressError):
            chat.mark()
        reply.wait()


def test_restore_async_after_the_reply_keeps_the_message_open(engines: dict[str, Engine]) -> None:
    engine = engines["gemma"]

    async def offload(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def main() -> None:
        with engine.open_session() as a, engine.open_session() as b:
            chat, ref = ChatTranscript(a), ChatTranscript(b)
            for c in (chat, ref):
                await c.begin_message_async("user", offload)
                await c.extend_message_async(" Tell me", offload)
            m = chat.mark()
            await chat.extend_message_async(" a story.", offload)
            await chat.end_message_async(offload)
            deltas: list[str] = []

            async def on_delta(stream: Any, d: Any) -> None:
                deltas.append(d.text)

            reply = asyncio.ensure_future(chat.reply_async(chat.ask_reply({}), on_delta, offload,
                                                           temperature=0.0, max_tokens=64))
            with pytest.raises(ResponseInProgressError):  # asked for and not ended: refused, nothing changed
                await chat.restore_async(offload, m)
            chat.cancel()
            await reply  # recorded (cancelled), then cut away with the rest
            await chat.restore_async(offload, m)
            assert chat.open_message is not None and chat.open_message.content == "Tell me"
            for c in (chat, ref):  # the message goes on: its turns are held as after its begin
                await c.extend_message_async(" a joke.", offload)
                await c.end_message_async(offload)
            assert a.token_ids == b.token_ids and chat.messages == ref.messages
            assert not chat.turns.locked()

    asyncio.run(main())
