"""Stored responses and conversations: bounded by bytes, a TTL and least-recently-used eviction.

Each object belongs to an owner (host.py) and is charged what it holds: a response its whole history (the
messages a re-prefill would append: the shared message maps are counted in full for every response that refers to
them, an upper bound) and its output; a conversation its items. Past `max_bytes` the least recently used objects go
first; an object unused for `ttl` seconds goes at the next access. A response or conversation that is in progress
is never evicted. `gone` is told of every object that leaves (its resident session, if any, is then let go).

With --snapshot-store, `persist` writes every object to `<store>/openai/<id>.json` at a drain, and `load` reads one
back on another instance (owner checked; a file past its expiry is removed): stored state survives the hand-off.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from streamserve.engine.chat import Message

OBJECT_ID = re.compile(r"(resp|conv)_[A-Za-z0-9]{1,64}")


@dataclass
class Resume:
    """Where the state after an object's last turn can be restored from: a hand-off record in the snapshot store."""

    session_id: str
    token: str


@dataclass
class StoredResponse:
    id: str
    owner: str
    created_at: int
    body: dict[str, Any]  # the Response object as answered (status, output, usage, ...), updated as it ends
    input_items: list[dict[str, Any]]  # this response's input items, with ids (GET .../input_items)
    history: list[Message]  # the conversation through this response's output: what a re-prefill appends
    instructions: str | None = None  # in effect for its turn (a follow-up with other instructions appends them)
    session_id: str | None = None  # the resident session that held its state when it ended
    resume: Resume | None = None
    in_progress: bool = False
    kind: str = "response"

    def size(self) -> int:
        return len(json.dumps([self.body, self.input_items, self.history]))


@dataclass
class StoredConversation:
    id: str
    owner: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)  # message items {id, type, role, content, status}
    session_id: str | None = None  # the resident session holding a prefix of its items, if any
    resume: Resume | None = None
    in_progress: bool = False
    instructions: str | None = None  # in effect: appended as a system item when a response's differ
    kind: str = "conversation"

    def size(self) -> int:
        return len(json.dumps([self.metadata, self.items]))

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


Stored = StoredResponse | StoredConversation


class ObjectStore:
    def __init__(self, max_bytes: int, ttl: float, directory: str | None = None,
                 gone: Callable[[Stored], None] = lambda obj: None) -> None:
        self.max_bytes, self.ttl, self.gone = max_bytes, ttl, gone
        self.objects: OrderedDict[str, Stored] = OrderedDict()  # least recently used first
        self.sizes: dict[str, int] = {}
        self.used_at: dict[str, float] = {}
        self.bytes = 0
        self.directory = None if directory is None else Path(directory) / "openai"

    def __len__(self) -> int:
        return len(self.objects)

    def get(self, owner: str, object_id: str) -> Stored | None:
        """The owner's object (used now: it moves to the back), or None: unknown, expired, or another owner's."""
        self.expire()
        obj = self.objects.get(object_id)
        if obj is None:
            obj = self.load(object_id)
        if obj is None or obj.owner != owner:
            return None
        self.touch(obj)
        return obj

    def put(self, obj: Stored) -> None:
        """Add or re-charge `obj` (after it changed); evicts the least recently used others past the budget."""
        self.bytes -= self.sizes.pop(obj.id, 0)
        self.sizes[obj.id] = obj.size()
        self.bytes += self.sizes[obj.id]
        self.objects[obj.id] = obj
        self.touch(obj)
        self.expire()
        for other in list(self.objects.values()):
            if self.bytes <= self.max_bytes:
                break
            if other is not obj and not other.in_progress:
                self.drop(other.id)

    def touch(self, obj: Stored) -> None:
        self.objects.move_to_end(obj.id)
        self.used_at[obj.id] = time.monotonic()

    def drop(self, object_id: str, forget_file: bool = False) -> Stored | None:
        obj = self.objects.pop(object_id, None)
        if obj is not None:
            self.bytes -= self.sizes.pop(object_id, 0)
            self.used_at.pop(object_id, None)
            self.gone(obj)
        if forget_file and self.directory is not None:
            with contextlib.suppress(OSError):
                (self.directory / f"{object_id}.json").unlink()
        return obj

    def expire(self) -> None:
        now = time.monotonic()
        for object_id, obj in list(self.objects.items()):
            if now - self.used_at.get(object_id, now) <= self.ttl:
                break  # in order of use: the rest are younger
            if not obj.in_progress:
                self.drop(object_id)

    def of_owner(self, owner: str) -> list[Stored]:
        return [o for o in self.objects.values() if o.owner == owner]

    # ---- the snapshot store: stored state across a drain -------------------------------------------------------
    def persist(self) -> Callable[[], int]:
        """Every object serialised now (on the event loop: nothing changes them meanwhile) -> the blocking write of
        their files, to run off the loop (-> how many)."""
        expires = time.time() + self.ttl
        texts = {obj.id: json.dumps({"kind": obj.kind, "expires": expires, "object": asdict(obj)})
                 for obj in self.objects.values()}
        directory = self.directory

        def write() -> int:
            if directory is None or not texts:  # nothing stored: the store's directory is left as it was
                return 0
            directory.mkdir(parents=True, exist_ok=True)
            for object_id, text in texts.items():
                tmp = directory / f".{object_id}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                tmp.replace(directory / f"{object_id}.json")
            return len(texts)
        return write

    def load(self, object_id: str) -> Stored | None:
        """An object another instance persisted, now held here (None: none, expired, damaged)."""
        if self.directory is None or not OBJECT_ID.fullmatch(object_id):
            return None
        path = self.directory / f"{object_id}.json"
        try:
            data = json.loads(path.read_text())
            if data["expires"] < time.time():
                path.unlink()
                return None
            fields = dict(data["object"])
            fields["resume"] = None if fields.get("resume") is None else Resume(**fields["resume"])
            fields["session_id"], fields["in_progress"] = None, False  # sessions of the instance that wrote it
            obj: Stored = StoredResponse(**fields) if data["kind"] == "response" else StoredConversation(**fields)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        with contextlib.suppress(OSError):  # held here now; written again at this instance's drain
            path.unlink()
        self.put(obj)
        return obj
