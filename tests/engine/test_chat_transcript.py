"""The chat-template incremental path equals rendering the whole conversation (engine level, no I/O)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chat_checkpoints import END_OF_TURN, EOS_ID, IM_END, NL, SPACE, TAB, chat_checkpoint, scripted
from helpers import make_checkpoint

from streamserve import Engine
from streamserve.engine.chat import (
    ChatMessageError,
    ChatTranscript,
    NoChatTemplateError,
    TemplateNotIncrementalError,
)
from streamserve.errors import InvalidInputError, ResponseInProgressError

# name -> (template kind, the scripted reply's chain after the generation prompt's "\n", or None: random)
KINDS: dict[str, tuple[str, list[int] | None]] = {
    "chatml-im_end": ("chatml", [NL, SPACE, *scripted("hi"), TAB, IM_END]),  # stops at the end-of-turn token
    "chatml-eos": ("chatml", [NL, SPACE, *scripted("ok"), EOS_ID]),  # stops at an EOS that is not the turn's end
    "gemma-trim": ("gemma", [NL, SPACE, *scripted("hi"), TAB, END_OF_TURN]),  # content trimmed by the template
    "chatml-random": ("chatml", None),
    "gemma-random": ("gemma", None),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    root = tmp_path_factory.mktemp("chat")
    out = {name: Engine.from_pretrained(chat_checkpoint(root / name, kind, script), device="cpu", kv_memory="64MiB")
           for name, (kind, script) in KINDS.items()}
    yield out
    for e in out.values():
        e.shutdown()


def assert_stands_for_rendering(chat: ChatTranscript, pending: bool = False) -> None:
    """The session's ids are the tokenization of the whole conversation's rendering, and its text that rendering
    (with `pending`: all but the end of the last reply's turn, which the next turn brings)."""
    full = chat.render(chat.messages)
    held = full[:len(full) - len(chat.pending)] if pending else full
    assert not pending or full.endswith(chat.pending)
    ids = chat.session.token_ids
    assert ids == chat.encode(held)
    assert chat.tokenizer.decode(ids, skip_special_tokens=False) == held


def conversation(chat: ChatTranscript, kind: str) -> None:
    """Several turns: user messages, replies generated (to their stop token, cut by max_tokens, cancelled at
    once, with a stop string), a reply given as an assistant message."""
    if kind == "gemma":
        chat.add({"role": "system", "content": "Be brief."})
    for turn, params in enumerate([{"max_tokens": 8}, {"max_tokens": 2}, None, {"max_tokens": 6, "stop": ["i"]},
                                   {"max_tokens": 50, "cancel": True}]):
        chat.add({"role": "user", "content": f"  question {turn} "})
        assert_stands_for_rendering(chat)  # after a message: exactly the rendering, nothing pending
        if params is None:
            chat.add({"role": "assistant", "content": " a given answer "})
            continue
        cancel = params.pop("cancel", False)
        reply = chat.reply(temperature=0.0, **params)
        if cancel:
            reply.stream.cancel()  # however many tokens it made before the cancel: the transcript stays right
        text = "".join(d.text for d in reply)
        assert reply.content is not None and chat.messages[-1] == {"role": "assistant", "content": reply.content}
        assert text == reply.content.replace("<|endoftext|>", "") or "<" in reply.content
        assert_stands_for_rendering(chat, pending=True)


@pytest.mark.parametrize("name", list(KINDS))
def test_incremental_path_equals_rendering_the_whole_conversation(engines: dict[str, Engine], name: str) -> None:
    kind, script = KINDS[name]
    with engines[name].open_session() as s:
        chat = ChatTranscript(s)
        conversation(chat, kind)
        chat.settle()
        assert_stands_for_rendering(chat)
        assert chat.length == len(s.token_ids) and not chat.pending
        if kind == "chatml":  # SmolLM2's default system prompt came with the first turn, once
            assert chat.tokenizer.decode(s.token_ids, False).count("You are a helpful AI assistant") == 1
        if script is not None:  # the scripted replies: each reply's text is known
            replies = [m["content"] for m in chat.messages if m["role"] == "assistant"]
            whole = " ok" if name == "chatml-eos" else " hi\t"
            # to the stop token; cut by max_tokens; given; before the stop string "i"; cancelled (a prefix)
            assert replies[:4] == [whole, whole[:2], " a given answer ", whole.split("i")[0]]
            assert whole.startswith(replies[4])


def test_the_stop_token_the_template_ends_turns_with_stays_in_the_session(engines: dict[str, Engine]) -> None:
    with engines["chatml-im_end"].open_session() as s:
        chat = ChatTranscript(s)
        chat.add({"role": "user", "content": "hello"})
        reply = chat.reply(max_tokens=8)
        assert reply.wait() == " hi\t" and reply.stream.finish_reason == "stop"
        assert s.token_ids[-5:] == [SPACE, *scripted("hi"), TAB, IM_END]  # generated, nothing cut
        assert chat.pending == "\n"  # all that is left of the turn: it comes with the next chunk
        chat.add({"role": "user", "content": "more"})
        assert s.token_ids[len(s.token_ids) - len(chat.encode("\n<|im_start|>user\nmore<|im_end|>\n")) - 1] == IM_END


def test_an_eos_that_is_not_the_end_of_turn_is_cut_and_the_turn_closed(engines: dict[str, Engine]) -> None:
    with engines["chatml-eos"].open_session() as s:
        chat = ChatTranscript(s)
        chat.add({"role": "user", "content": "hello"})
        reply = chat.reply(max_tokens=8)
        assert reply.wait() == " ok" and EOS_ID not in s.token_ids and chat.pending == "<|im_end|>\n"


def test_rewind_to_an_earlier_turn_drops_the_later_messages(engines: dict[str, Engine]) -> None:
    engine = engines["gemma-trim"]
    with engine.open_session() as s, engine.open_session() as fresh:
        chat = ChatTranscript(s)
        conversation(chat, "gemma")
        kept = chat.messages[:3]  # system, user, the first reply
        assert chat.rewind(3) == chat.starts[2] + len(chat.encode(chat.render(kept)[chat.offsets[2]:]))
        assert chat.messages == kept
        assert_stands_for_rendering(chat)
        chat.add({"role": "user", "content": "after the rewind"})
        chat.reply(max_tokens=3).wait()
        chat.settle()
        assert_stands_for_rendering(chat)
        same = ChatTranscript(fresh)  # the same messages given to a fresh session: the same tokens
        for m in chat.messages:
            same.add(m)
        assert fresh.token_ids == s.token_ids
        assert chat.rewind(0) == 0 and s.token_ids == [] and chat.rendered == ""


def test_a_model_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3")
    with (Engine.from_pretrained(tmp_path, device="cpu", kv_memory="16MiB") as engine, engine.open_session() as s,
          pytest.raises(NoChatTemplateError, match="streamserve generate")):
        ChatTranscript(s)


def test_a_template_that_rewrites_history_is_refused_and_nothing_changes(engines: dict[str, Engine],
                                                                         monkeypatch: Any) -> None:
    engine = engines["chatml-random"]
    # marks the last message: each longer conversation rewrites the turn before it
    monkeypatch.setattr(engine.tokenizer, "chat_template",
                        "{% for m in messages %}{{ m['role'] }}{% if loop.last %}*{% endif %}: {{ m['content'] }}\n"
                        "{% endfor %}")
    with engine.open_session() as s:
        chat = ChatTranscript(s)
        chat.add({"role": "user", "content": "one"})
        before = list(s.token_ids)
        with pytest.raises(TemplateNotIncrementalError, match="not incremental"):
            chat.add({"role": "user", "content": "two"})
        assert s.token_ids == before and len(chat.messages) == 1


@pytest.mark.parametrize("message", [{"role": "robot", "content": "x"}, {"role": "user", "content": 3},
                                     {"role": "user"}, {"role": "user", "content": "x", "name": "n"}, "hi"])
def test_malformed_messages_are_refused(engines: dict[str, Engine], message: Any) -> None:
    with engines["chatml-random"].open_session() as s:
        chat = ChatTranscript(s)
        with pytest.raises(ChatMessageError):
            chat.add(message)
        assert s.token_ids == [] and chat.messages == []


def test_a_message_while_a_reply_runs_is_refused(engines: dict[str, Engine]) -> None:
    with engines["chatml-random"].open_session() as s:
        chat = ChatTranscript(s)
        chat.add({"role": "user", "content": "hello"})
        reply = chat.reply(max_tokens=4)
        with pytest.raises(ResponseInProgressError):
            chat.add({"role": "user", "content": "too soon"})
        reply.wait()
        chat.add({"role": "user", "content": "now"})
        assert_stands_for_rendering(chat)


@pytest.mark.asyncio
async def test_async_replies_go_one_at_a_time_and_a_cancel_before_the_start_appends_nothing(
        engines: dict[str, Engine]) -> None:
    async def offload(fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    texts: list[str] = []

    async def on_delta(stream: Any, d: Any) -> None:
        texts.append(d.text)

    with engines["chatml-im_end"].open_session() as s:
        chat = ChatTranscript(s)
        await chat.add_async({"role": "user", "content": "hello"}, offload)
        ticket = chat.ask_reply({"max_tokens": 8})
        with pytest.raises(ResponseInProgressError):
            chat.ask_reply({})
        chat.cancel()  # before the reply started: it never starts
        before = list(s.token_ids)
        assert await chat.reply_async(ticket, on_delta, offload) is None
        assert s.token_ids == before and texts == [] and len(chat.messages) == 1
        stream = await chat.reply_async(chat.ask_reply({"max_tokens": 8}), on_delta, offload)
        assert stream is not None and stream.finish_reason == "stop" and "".join(texts) == " hi\t"
        assert chat.messages[-1] == {"role": "assistant", "content": " hi\t"}
        reply_start = chat.starts[1]
        assert await chat.rewind_async(offload, to=reply_start + 1) == reply_start  # a point inside the reply's turn
        assert len(chat.messages) == 1
        assert_stands_for_rendering(chat)


def test_a_system_prompt_goes_in_with_the_first_message_where_the_template_folds_it(
        engines: dict[str, Engine], monkeypatch: Any) -> None:
    from streamserve.models.catalog import GEMMA_CHAT_TEMPLATE  # a lone system prompt renders as a user turn

    engine = engines["gemma-trim"]
    monkeypatch.setattr(engine.tokenizer, "chat_template", GEMMA_CHAT_TEMPLATE)
    system, first = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}
    with engine.open_session() as s:
        chat = ChatTranscript(s)
        chat.add(system)
        with pytest.raises(TemplateNotIncrementalError):  # the user turn would rewrite the system prompt's turn
            chat.add(first)
        chat.rewind(0)
        chat.add([system, first])  # together: one chunk
        assert chat.starts == [0, 0]
        chat.reply(max_tokens=8).wait()
        chat.add({"role": "user", "content": "more"})
        assert_stands_for_rendering(chat)
        assert chat.rewind(1) == 0 and chat.messages == []  # inside the pair: both go


def test_an_empty_list_of_messages_is_refused_and_the_chat_goes_on(engines: dict[str, Engine]) -> None:
    with engines["chatml-im_end"].open_session() as s:
        chat = ChatTranscript(s)
        chat.add({"role": "user", "content": "hello"})
        chat.reply(max_tokens=8).wait()  # the "\n" closing its turn is pending: an empty list would append it alone
        before = list(s.token_ids)
        with pytest.raises(ChatMessageError, match="at least one"):
            chat.add([])
        assert s.token_ids == before and chat.pending == "\n"
        chat.add({"role": "user", "content": "more"})  # not taken for a reply's generation prompt
        assert_stands_for_rendering(chat)


def test_chat_needs_a_rewind_reach_on_models_with_sliding_window_layers(tmp_path: Path) -> None:
    """A reply's end is cut back by a few tokens: with local pages freed at once that rewind fails, and the chat
    would break on the turn after; refused up front instead, naming the flag."""
    folder = tmp_path / "gemma"
    make_checkpoint(folder, "gemma3")
    chat_checkpoint(tmp_path / "chat", "chatml")  # a template to borrow: the random gemma3 has none
    tok = Engine.from_pretrained(tmp_path / "chat", device="cpu", kv_memory="16MiB").tokenizer
    for reach, ok in ((0, False), (8, False), (16, True)):
        engine = Engine.from_pretrained(folder, device="cpu", kv_memory="16MiB", rewind_reach=reach)
        engine.tokenizer.chat_template = tok.chat_template
        with engine.open_session() as s:
            if ok:
                ChatTranscript(s)
            else:
                with pytest.raises(InvalidInputError, match="--rewind-reach >= 16"):
                    ChatTranscript(s)
        engine.shutdown()



def test_a_reply_longer_than_an_endless_session_keeps_is_recorded_whole(tmp_path: Path) -> None:
    """A windowed (endless) chat session forgets the start of a reply longer than its window keeps: the transcript
    records the reply from the stream, which received every token, not from the session's forgotten ids."""
    looping = chat_checkpoint(tmp_path / "loop", "chatml", [NL, SPACE, *scripted("hi"), TAB])  # " hi\t\n" for ever
    engine = Engine.from_pretrained(looping, device="cpu", kv_memory="64MiB")
    try:
        with engine.open_session(window=16, sinks=4) as s:
            chat = ChatTranscript(s)
            chat.add({"role": "user", "content": "tell me everything"})
            reply = chat.reply(temperature=0.0, max_tokens=300)
            text = "".join(d.text for d in reply)
            assert reply.stream.finish_reason == "length" and len(reply.stream.token_ids) == 300
            assert s.token_ids.stored < 300  # the reply's start is forgotten by the session
            assert reply.content == text == " hi\t\n" * 60
            assert chat.messages[-1] == {"role": "assistant", "content": reply.content}
    finally:
        engine.shutdown()
