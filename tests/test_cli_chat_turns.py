"""`streamserve chat`'s Terminal in-process: a turn the engine refuses leaves the conversation as it was."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest
from chat_checkpoints import IM_END, NL, SPACE, TAB, chat_checkpoint, scripted

from streamserve import Engine
from streamserve.cli.chat import Terminal, register
from streamserve.errors import StreamserveError


def terminal(engine: Engine, model: Path) -> Terminal:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers().add_parser)
    return Terminal(engine, parser.parse_args(["chat", "--model", str(model), "--temperature", "0"]))


def test_a_turn_whose_reply_cannot_start_is_undone_whole(tmp_path: Path) -> None:
    model = chat_checkpoint(tmp_path, "chatml", [NL, SPACE, *scripted("hi"), TAB, IM_END])
    with Engine.from_pretrained(model, device="cpu", kv_memory="16MiB") as engine:
        term = terminal(engine, model)
        try:
            chat = term.chat
            context = engine.config.max_position_embeddings
            first = chat.plan_message({"role": "user", "content": ""})  # the rendering around an empty message
            prompt = len(chat.encode("<|im_start|>assistant\n"))
            # one character a token: the message fits in the context, its reply's generation prompt does not
            line = "x" * (context - len(first.ids) - prompt // 2)
            with pytest.raises(StreamserveError):
                term.say(line, io.StringIO())
            assert chat.messages == [] and len(chat.session) == 0  # as before the turn
            out = io.StringIO()
            term.say("hello", out)  # the conversation goes on
            assert out.getvalue() == " hi\t\n" and [m["role"] for m in chat.messages] == ["user", "assistant"]
        finally:
            term.close()
