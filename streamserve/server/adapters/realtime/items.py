"""The Realtime API's conversation.item.* events (create, retrieve, delete, truncate), as a part of
RealtimeConnection (connection.py): what they need of it is declared below."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamserve.server.adapters.realtime import events as E
from streamserve.server.adapters.realtime import settings as S
from streamserve.server.adapters.realtime.conversation import Conversation, Item, parse_item
from streamserve.server.adapters.realtime.events import RealtimeError, event

if TYPE_CHECKING:
    from streamserve.server.adapters.realtime.conversation import Entry
    from streamserve.server.adapters.realtime.listening import InputAudio
    from streamserve.server.adapters.realtime.response import ResponseRun


class ItemEvents:
    conv: Conversation
    audio: InputAudio | None
    spoken: dict[str, ResponseRun]

    if TYPE_CHECKING:  # RealtimeConnection's (only declared here, so that they never shadow its methods)
        async def send(self, message: dict[str, Any]) -> None: ...
        async def add_item(self, item: Item, position: int | None = None, event_id: str | None = None) -> None: ...
        async def rebuild(self, wanted: list[Entry], event_id: str | None = None,
                          item: Item | None = None) -> None: ...

    async def on_conversation_item_create(self, ev: E.ClientEvent) -> None:
        new = parse_item(ev.body, self.conv)
        position = self.conv.insert_position(new.previous_item_id)
        item = new.item
        if new.audio:
            if self.audio is None:
                raise S.no_voice("item.content")
            item = await self.audio.transcribe_item(item, new.audio)
        await self.add_item(item, position, ev.event_id)

    async def on_conversation_item_retrieve(self, ev: E.ClientEvent) -> None:
        item = self.conv.find(E.item_id(ev.body, "item_id", "item_id"), code="item_retrieve_invalid_item_id")
        await self.send(event("conversation.item.retrieved", item=item.render()))

    async def on_conversation_item_delete(self, ev: E.ClientEvent) -> None:
        item = self.conv.find(E.item_id(ev.body, "item_id", "item_id"), code="item_delete_invalid_item_id")
        await self.rebuild(self.conv.without(item), ev.event_id)
        self.spoken.pop(item.id, None)
        await self.send(event("conversation.item.deleted", item_id=item.id))

    async def on_conversation_item_truncate(self, ev: E.ClientEvent) -> None:
        """Cut an assistant audio item to what the person heard: the session is rewound to before it and the
        assistant's message appended again as the Speaker's text of the first audio_end_ms."""
        item = self.conv.find(E.item_id(ev.body, "item_id", "item_id"), code="item_truncate_invalid_item_id")
        E.opt_int(ev.body, "content_index", "content_index", 0, 0)
        end = E.opt_int(ev.body, "audio_end_ms", "audio_end_ms", 0, 1 << 31)
        run = self.spoken.get(item.id)
        if item.role != "assistant" or run is None or run.speaker is None or end is None:
            raise RealtimeError("only an assistant message with audio, given audio_end_ms, can be truncated",
                                "item_truncate_invalid_item_id", "item_id")
        if end > run.speaker.audio_ms + 1:
            raise RealtimeError(f"audio_end_ms {end} is past the item's audio ({run.speaker.audio_ms:.0f} ms)",
                                "invalid_value", "audio_end_ms")
        heard = run.speaker.heard_text(end)
        if self.audio is not None and self.audio.streaming:  # the person speaks: the rewind waits for their turn
            self.audio.after.append((item, heard))
        else:
            await self.truncate(item, heard, ev.event_id)
        await self.send(event("conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=end))

    async def truncate(self, item: Item, heard: str, event_id: str | None = None) -> None:
        self.conv.find(item.id)
        await self.rebuild(self.conv.truncated(item, heard), event_id)

