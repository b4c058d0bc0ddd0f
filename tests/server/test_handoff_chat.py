"""A chat transcript's state survives a hand-off record (engine/chat.py `export_state`, server/service/handoff.py): an
endless (windowed) chat that already forgot messages continues on a restored session exactly as the one that
never moved — same replies, same session tokens, same messages kept and forgotten; a state that does not fit
the session is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from chat_checkpoints import write_chat_tokenizer
from helpers import make_checkpoint

from streamserve import Engine
from streamserve.engine.chat import ChatTranscript
from streamserve.server.service.handoff import HandoffRecord, token_hash

WINDOW, SINKS = 64, 4
BEFORE, AFTER = 48, 12  # user messages before the hand-off (a reply after every fourth), then after it


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A random chatml checkpoint whose greedy replies are printable ASCII but space (as test_chat_bounded's): a
    reply is never cut back when it is recorded, which a window reaching less than a page back cannot always do."""
    folder = tmp_path_factory.mktemp("handoff-chat")
    model = make_checkpoint(folder, "qwen3")
    with torch.no_grad():
        other = torch.ones(model.lm_head.weight.shape[0], dtype=torch.bool)
        other[0x21:0x7F] = False
        model.lm_head.weight[other] = 0.0
    model.save_pretrained(folder)
    write_chat_tokenizer(folder, "chatml")
    e = Engine.from_pretrained(folder, device="cpu", kv_memory="64MiB")
    yield e
    e.shutdown()


def turns(chat: ChatTranscript, start: int, stop: int) -> list[str]:
    replies = []
    for i in range(start, stop):
        chat.add({"role": "user", "content": f"question {i} about {i * 7 % 13}"})
        if i % 4 == 3:
            replies.append(chat.reply(max_tokens=8).wait())
    return replies


def test_an_endless_chat_that_forgot_messages_continues_identically_after_a_hand_off(engine: Engine) -> None:
    with engine.open_session(window=WINDOW, sinks=SINKS) as s:
        chat = ChatTranscript(s)
        turns(chat, 0, BEFORE)
        expected = turns(chat, BEFORE, BEFORE + AFTER)
        expected_tokens, expected_messages = s.token_ids.kept(), (len(chat.messages), chat.messages.gap)

    with engine.open_session(window=WINDOW, sinks=SINKS) as s:
        chat = ChatTranscript(s)
        turns(chat, 0, BEFORE)
        assert chat.messages.gap is not None  # it forgot messages already: their gap travels too
        record = HandoffRecord(s.id, token_hash("t"), s.snapshot(), time.time() + 60,  # type: ignore[arg-type]
                               chat=chat.export_state())
        data = record.encode()
    back = HandoffRecord.decode(data)  # through the file format (torch.load with weights_only)
    with engine.restore(back.snapshot) as moved:
        assert back.chat is not None
        chat = ChatTranscript(moved, back.chat)
        assert turns(chat, BEFORE, BEFORE + AFTER) == expected
        assert moved.token_ids.kept() == expected_tokens
        assert (len(chat.messages), chat.messages.gap) == expected_messages


def test_a_chat_state_that_does_not_fit_the_session_is_refused(engine: Engine) -> None:
    with engine.open_session() as s:
        chat = ChatTranscript(s)
        turns(chat, 0, 4)
        state = chat.export_state()
        snap = s.snapshot()
    with engine.restore(snap) as moved:  # type: ignore[arg-type]
        for bad in ({**state, "length": state["length"] + 1},
                    {**state, "starts": {"rows": state["starts"]["rows"][:-1], "gap": None}},
                    {**state, "messages": {"rows": [{"role": "nobody", "content": "x"}], "gap": None}},
                    {k: v for k, v in state.items() if k != "rendered"}):
            with pytest.raises(ValueError):
                ChatTranscript(moved, bad)
        assert ChatTranscript(moved, state).messages == chat.messages  # the right one fits


def test_a_chat_with_a_reply_asked_for_cannot_be_exported(engine: Engine) -> None:
    with engine.open_session() as s:
        chat = ChatTranscript(s)
        chat.add({"role": "user", "content": "hello"})
        reply = chat.reply(max_tokens=4)
        with pytest.raises(Exception) as info:
            chat.export_state()
        assert getattr(info.value, "code", None) == "response_in_progress"
        reply.wait()
        assert chat.export_state()["length"] == len(s.token_ids)
