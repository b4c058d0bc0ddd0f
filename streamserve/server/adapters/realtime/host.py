"""What a Realtime connection's input audio (listening.py) and its speculated responses (speculation.py) need of
the connection (RealtimeConnection, connection.py, which imports both)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from streamserve.server.adapters.realtime.conversation import Conversation, Entry, Item
    from streamserve.server.adapters.realtime.media import MediaPath
    from streamserve.server.adapters.realtime.response import ResponseRun
    from streamserve.server.adapters.realtime.settings import Settings
    from streamserve.server.media.voice.speculate import Gate
    from streamserve.server.service.service import ClientContext, SessionService


class Host(Protocol):
    service: SessionService
    settings: Settings
    session: str | None
    conv: Conversation
    current: ResponseRun | None
    idle: asyncio.Event
    ctx: ClientContext
    announced: set[str]
    media: MediaPath | None
    cached: int  # session tokens already in the KV cache at the last response's end
    spoken: dict[str, ResponseRun]  # item id -> recent audio response
    instructions: str | None  # set and not yet in the session

    async def send(self, message: dict[str, Any]) -> None: ...
    async def error(self, e: BaseException, event_id: str | None = None) -> None: ...
    async def append(self, entries: list[Entry], event_id: str | None = None, item: Item | None = None) -> int: ...
    def take_instructions(self) -> list[Entry]: ...
    def next_seq(self) -> int: ...
    async def respond(self, modalities: tuple[str, ...], max_tokens: int | None, instructions: str | None = None,
                      event_id: str | None = None, gate: Gate | None = None) -> ResponseRun: ...
    async def truncate(self, item: Item, heard: str, event_id: str | None = None) -> None: ...


__all__ = ["Host"]
