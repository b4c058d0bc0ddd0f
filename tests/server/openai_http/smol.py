"""SmolLM2-135M-Instruct for the OpenAI HTTP API tests: its loader, and a reference chat on the served engine (the
same conversation on one chat session through the engine's own API) whose greedy replies the HTTP turns must
equal."""

from __future__ import annotations

import asyncio

import pytest

from streamserve.engine import Engine
from streamserve.engine.chat import ChatTranscript, Message

NAME = "smollm2-135m-instruct"
GREEDY = {"temperature": 0.0, "max_tokens": 24}


def smol() -> Engine:
    from streamserve.models.store import installed

    if installed(NAME) is None:
        pytest.skip(f"{NAME} is not in the model cache: `streamserve models pull {NAME}`")
    return Engine.from_pretrained(NAME, device="cpu", kv_memory="256MiB", offline=True)


class Reference:
    """A conversation on one chat session of `engine` (blocking calls, run off the event loop)."""

    def __init__(self, engine: Engine) -> None:
        self.chat = ChatTranscript(engine.open_session())

    def turn_blocking(self, messages: list[Message], max_tokens: int = GREEDY["max_tokens"]) -> tuple[str, int, int]:
        """Append `messages`, reply greedily; -> (the reply, the session's length before the turn, before the
        reply's first token)."""
        before = len(self.chat.session.token_ids)
        self.chat.add(messages if len(messages) > 1 else messages[0])
        reply = self.chat.reply(**(GREEDY | {"max_tokens": max_tokens}))
        text = reply.wait()
        return text, before, reply.stream.usage["session_tokens"] - reply.stream.usage["completion_tokens"]

    async def turn(self, *messages: Message, max_tokens: int = GREEDY["max_tokens"]) -> tuple[str, int, int]:
        return await asyncio.to_thread(self.turn_blocking, list(messages), max_tokens)

    def close(self) -> None:
        self.chat.session.close()


def user(text: str) -> Message:
    return {"role": "user", "content": text}


QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?", "Name a river there.",
             "How long is it?", "Tell me a fact about it.", "Thanks. What is 2 + 2?", "And 3 + 5?",
             "Say hello in French.", "Goodbye!"]
