"""The Realtime conversation: its items, and how they map onto ONE persistent chat session.

Every chat message on the session is an `Entry`, in the session's order: a conversation item (user, system or
assistant message) or the session's instructions (a system message that is no item of the API's conversation).
Items are appended to the session as they arrive; a response appends only its generation prompt. Changing the past
(truncate, delete, insert before the end) is a `Plan`: the session is rewound to the first message that changes and
the messages after it are appended again, so it costs the tokens of those messages, never the whole history.
I/O-free: the connection carries plans out over the session service.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from streamserve.server.adapters.realtime.events import MAX_ITEM_ID, RealtimeError, new_id, opt_str

MAX_ITEMS = 1024  # items one conversation holds; more are refused (delete some, or start a new connection)
MAX_PARTS = 16  # content parts of one item
MAX_TEXT = 32768  # characters of one content part
USER_PARTS = ("input_text", "input_audio")
ASSISTANT_PARTS = ("output_text", "output_audio", "input_text", "text")  # pipecat sends its context as input_text


@dataclass
class Item:
    id: str
    role: str  # user, assistant, system
    content: list[dict[str, Any]]  # the API's content parts, as rendered
    status: str = "completed"  # in_progress while a response or the speaker's audio fills it

    @property
    def text(self) -> str:
        """What the model reads of it: the parts' text and transcripts, one line each."""
        return "\n".join(p.get("text") or p.get("transcript") or "" for p in self.content
                         if p.get("text") or p.get("transcript"))

    def render(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status,
                "role": self.role, "content": [dict(p) for p in self.content]}


@dataclass(frozen=True)
class Entry:
    """One chat message on the session: an item's, or (item None) the instructions'."""

    message: dict[str, str]
    item: Item | None = None


@dataclass
class Conversation:
    entries: list[Entry] = field(default_factory=list)

    @property
    def items(self) -> list[Item]:
        return [e.item for e in self.entries if e.item is not None]

    def find(self, item_id: str, param: str = "item_id", code: str = "item_not_found") -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise RealtimeError(f"no item with id {item_id!r} in this conversation", code, param)

    def index(self, item: Item) -> int:
        return next(i for i, e in enumerate(self.entries) if e.item is item)

    def previous_id(self, item: Item) -> str | None:
        before = None
        for it in self.items:
            if it is item:
                return before
            before = it.id
        return before

    def check_room(self) -> None:
        if len(self.items) >= MAX_ITEMS:
            raise RealtimeError(f"this conversation holds {MAX_ITEMS} items, its limit: delete items or start a new "
                                "session", "conversation_full")

    def new_id(self, given: str | None) -> str:
        if given is None:
            return new_id("item_")
        if any(it.id == given for it in self.items):
            raise RealtimeError(f"an item with id {given!r} is already in the conversation", "duplicate_item_id",
                                "item.id")
        return given

    # ---- plans: the entries wanted; the connection rewinds to the first change and appends the rest --------
    def with_entry_at(self, position: int, entry: Entry) -> list[Entry]:
        return [*self.entries[:position], entry, *self.entries[position:]]

    def insert_position(self, previous_item_id: str | None) -> int:
        """Where an item created after `previous_item_id` goes (None: the end, "root": the start)."""
        if previous_item_id is None:
            return len(self.entries)
        if previous_item_id == "root":
            return 0
        return self.index(self.find(previous_item_id, "previous_item_id", "previous_item_not_found")) + 1

    def without(self, item: Item) -> list[Entry]:
        return [e for e in self.entries if e.item is not item]

    def truncated(self, item: Item, heard: str) -> list[Entry]:
        """The entries with an assistant item cut to what the person heard (`heard`)."""
        cut = Item(item.id, item.role, [{**item.content[0], "transcript": heard}], "incomplete")
        return [Entry({"role": "assistant", "content": heard}, cut) if e.item is item else e for e in self.entries]


def common_prefix(a: list[Entry], b: list[Entry]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] is b[n]:
        n += 1
    return n


# ---- items the client creates ---------------------------------------------------------------------------
@dataclass(frozen=True)
class NewItem:
    item: Item
    audio: list[bytes]  # input_audio parts without a transcript: to transcribe (one per part, in order)
    previous_item_id: str | None


def parse_item(body: Mapping[str, Any], conversation: Conversation) -> NewItem:
    """`conversation.item.create` -> the item (messages only; function items are refused), or RealtimeError."""
    item = body.get("item")
    if not isinstance(item, dict):
        raise RealtimeError("item must be an object", "invalid_type", "item")
    kind = item.get("type", "message")
    if kind != "message":
        raise RealtimeError(f"items of type {kind!r} are not supported by this server: function calls and tools are "
                            "not served here; send message items", "unsupported_item_type", "item.type")
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise RealtimeError("item.role must be user, assistant or system", "invalid_value", "item.role")
    parts = item.get("content")
    if not isinstance(parts, list) or not parts or len(parts) > MAX_PARTS:
        raise RealtimeError(f"item.content must be a list of 1 to {MAX_PARTS} content parts", "invalid_value",
                            "item.content")
    allowed = {"user": USER_PARTS, "system": ("input_text",), "assistant": ASSISTANT_PARTS}[role]
    content, audio = [], []
    for i, part in enumerate(parts):
        param = f"item.content[{i}]"
        if not isinstance(part, dict):
            raise RealtimeError(f"{param} must be an object", "invalid_type", param)
        ptype = part.get("type")
        if ptype not in allowed:
            hint = " (images are not supported)" if ptype == "input_image" else ""
            raise RealtimeError(f"{param}.type must be one of {', '.join(allowed)} for a {role} message{hint}",
                                "invalid_value", f"{param}.type")
        if ptype == "input_audio":
            transcript = opt_str(part, "transcript", f"{param}.transcript", MAX_TEXT)
            if transcript is None:
                audio.append(_b64(part, f"{param}.audio"))
            content.append({"type": "input_audio", "audio": None, "transcript": transcript})
        elif ptype == "output_audio":
            content.append({"type": "output_audio", "audio": None,
                            "transcript": opt_str(part, "transcript", f"{param}.transcript", MAX_TEXT) or ""})
        else:
            text = opt_str(part, "text", f"{param}.text", MAX_TEXT) or ""
            out = "output_text" if role == "assistant" else "input_text"
            content.append({"type": out, "text": text})
    given = opt_str(item, "id", "item.id", MAX_ITEM_ID)
    previous = opt_str(body, "previous_item_id", "previous_item_id", MAX_ITEM_ID)
    return NewItem(Item(conversation.new_id(given), role, content), audio, previous)


def _b64(part: Mapping[str, Any], param: str) -> bytes:
    data = opt_str(part, "audio", param)
    if not data:
        raise RealtimeError(f"{param} is missing: an input_audio part carries base64 audio or a transcript",
                            "missing_required_parameter", param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError(f"{param} is not valid base64", "invalid_value", param) from None


def message_of(item: Item) -> dict[str, str]:
    return {"role": item.role, "content": item.text}


def with_transcripts(item: Item, transcripts: list[str]) -> Item:
    """`item` with its untranscribed input_audio parts filled, in order."""
    it = iter(transcripts)
    parts = [{**p, "transcript": next(it)} if p["type"] == "input_audio" and p["transcript"] is None else p
             for p in item.content]
    return replace(item, content=parts)
