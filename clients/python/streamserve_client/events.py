"""A session's voice events (`async for event in session.events()`), from the server's `turn`, `transcript`,
`audio`, `audio_done`, `delta` and `done` messages, through a bounded queue.

The queue holds at most `MAX_EVENTS` events. When the application reads more slowly than they come, the OLDEST
REPLY AUDIO is dropped first (`EventQueue.dropped_audio` counts it; audio is the bulk, and late audio is useless
anyway); only when no audio is queued does the oldest event of any kind go (`EventQueue.dropped` counts all).
Memory is bounded whatever the application does.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int  # on the session's audio clock (ms of audio sent), prefix padding included


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int


@dataclass(frozen=True)
class TranscriptDelta:
    text: str  # words the server agreed on and appended to the session (never repeated)
    seq: int | None = None  # the chunk holding them (plain sessions)


@dataclass(frozen=True)
class TranscriptPartial:
    text: str  # the unagreed tail: may change; for display only


@dataclass(frozen=True)
class TranscriptFinal:
    text: str  # the utterance's whole transcript
    audio_start_ms: int | None = None
    audio_end_ms: int | None = None


@dataclass(frozen=True)
class ReplyText:
    response: Any
    text: str
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ReplyDone:
    response: Any
    reason: str
    usage: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplyAudio:
    response: Any
    audio: bytes  # at most 100 ms in `encoding`, `channels` interleaved
    rate: int
    encoding: str = "pcm16"
    channels: int = 1


@dataclass(frozen=True)
class ReplyAudioDone:
    response: Any
    reason: str  # done, cancelled, error
    audio_ms: float = 0.0


@dataclass(frozen=True)
class SessionEnded:
    """The last event: the session is closed (or lost); `error` says why when it was not closed by this client."""

    error: Exception | None = None


Event = (SpeechStarted | SpeechStopped | TranscriptDelta | TranscriptPartial | TranscriptFinal | ReplyText | ReplyDone
         | ReplyAudio | ReplyAudioDone | SessionEnded)
MAX_EVENTS = 1024


def event_of(m: dict[str, Any]) -> Event | None:
    """A server message -> its event (None: not an event)."""
    kind = m["type"]
    if kind == "turn":
        if m.get("event") == "speech_started":
            return SpeechStarted(int(m.get("audio_start_ms") or 0))
        if m.get("event") == "speech_stopped":
            return SpeechStopped(int(m.get("audio_end_ms") or 0))
        return None  # a newer server's turn event
    if kind == "transcript":
        if m.get("final") is not None:
            return TranscriptFinal(m["final"], m.get("audio_start_ms"), m.get("audio_end_ms"))
        if m.get("delta") is not None:
            return TranscriptDelta(m["delta"], m.get("seq"))
        if m.get("partial") is not None:
            return TranscriptPartial(m["partial"])
        return None
    if kind == "audio":
        return ReplyAudio(m.get("response"), m["audio"], int(m["rate"]), m.get("encoding") or "pcm16",
                          int(m.get("channels") or 1))
    if kind == "audio_done":
        return ReplyAudioDone(m.get("response"), m.get("reason") or "done", float(m.get("audio_ms") or 0.0))
    if kind == "delta":
        return ReplyText(m.get("response"), m.get("text") or "", list(m.get("token_ids") or []))
    if kind == "done":
        return ReplyDone(m.get("response"), m.get("reason") or "error", m.get("usage") or {})
    return None


class EventQueue:
    def __init__(self, capacity: int = MAX_EVENTS) -> None:
        self.capacity = capacity
        self.dropped = 0  # events dropped because the application read too slowly
        self.dropped_audio = 0  # of which reply audio
        self._items: collections.deque[Event] = collections.deque()
        self._arrived = asyncio.Event()
        self._ended = False
        self._end: SessionEnded = SessionEnded()  # the last event, kept: events() read again ends at once

    def __len__(self) -> int:
        return len(self._items)

    def put(self, event: Event) -> None:
        if self._ended:
            return
        if len(self._items) >= self.capacity:
            self._drop_one()
        self._items.append(event)
        if isinstance(event, SessionEnded):
            self._ended, self._end = True, event
        self._arrived.set()

    def _drop_one(self) -> None:
        for i, old in enumerate(self._items):
            if isinstance(old, ReplyAudio):
                del self._items[i]
                self.dropped_audio += 1
                break
        else:
            self._items.popleft()
        self.dropped += 1

    async def get(self) -> Event:
        """The oldest event; after the session's end has been read, that end again (never waits for ever)."""
        while not self._items:
            if self._ended:
                return self._end
            self._arrived.clear()
            await self._arrived.wait()
        return self._items.popleft()
