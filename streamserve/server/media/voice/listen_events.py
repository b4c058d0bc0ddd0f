"""What a Listener (server/media/voice/listen.py) emits and raises: turn events, transcript text, and its two errors;
and the items of its work queue. Protocol-neutral: the session service turns them into TurnEvent / Transcript
results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamserve.errors import StreamserveError

if TYPE_CHECKING:
    import asyncio

    import numpy as np


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int


@dataclass(frozen=True)
class TranscriptDelta:
    text: str  # newly agreed words, append-only: the text to append to the session now


@dataclass(frozen=True)
class TranscriptPartial:
    text: str  # the unagreed tail after all agreed text (may change; for display only)


@dataclass(frozen=True)
class TranscriptDone:
    text: str  # the utterance's whole transcript
    audio_start_ms: int
    audio_end_ms: int


@dataclass(frozen=True)
class TurnLikely:
    """At the first silence, before the VAD's hangover confirms a stop: the pass over the speech so far gave words
    that look complete (media/turns.py). A reply may start now, held back (server/media/voice/speculate.py). Then either
    the stop follows (SpeechStopped, the final delta: `tail`, TranscriptDone whose text is `text`) or TurnResumed."""

    text: str  # the utterance's whole transcript if the stop follows
    tail: str  # its words not sent as a TranscriptDelta yet (they come in the final delta)


@dataclass(frozen=True)
class TurnResumed:
    """After a TurnLikely: speech went on (or the client committed the audio): it was not the end of the turn."""


ListenEvent = SpeechStarted | SpeechStopped | TranscriptDelta | TranscriptPartial | TranscriptDone | TurnLikely \
    | TurnResumed


class AudioBufferFullError(StreamserveError):
    """Audio arrives faster than this server transcribes it: more than the stream's limit is waiting."""

    code = "audio_buffer_full"


class ListenerClosedError(StreamserveError):
    code = "session_closed"


@dataclass
class Work:
    """One item of a Listener's work queue (server/media/voice/listen.py), in the order its audio came."""

    kind: str  # "audio" (samples), "start" (SpeechStarted: samples = its audio), "stop", "commit", "reset",
    # "silence" (the VAD scores silence since `ms`: speculate), "resume" (speech again before the stop),
    # "barrier" (settled once all work queued before it is done)
    epoch: int
    samples: np.ndarray | None = None
    ms: int = 0  # start or end of speech on the stream's clock
    n: int = 0  # start: the utterance's number
    said: bool = False  # stop: its SpeechStopped already went out (from append, not behind a pass)
    done: asyncio.Future[Any] | None = None  # commit -> TranscriptDone | None; reset -> None


__all__ = ["AudioBufferFullError", "ListenEvent", "ListenerClosedError", "SpeechStarted", "SpeechStopped",
           "TranscriptDelta", "TranscriptDone", "TranscriptPartial", "TurnLikely", "TurnResumed", "Work"]
