"""What a Listener (server/voice/listen.py) emits and raises: turn events, transcript text, and its two errors.
Protocol-neutral: the session service turns them into TurnEvent / Transcript results."""

from __future__ import annotations

from dataclasses import dataclass

from streamserve.errors import StreamserveError


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


ListenEvent = SpeechStarted | SpeechStopped | TranscriptDelta | TranscriptPartial | TranscriptDone


class AudioBufferFullError(StreamserveError):
    """Audio arrives faster than this server transcribes it: more than the stream's limit is waiting."""

    code = "audio_buffer_full"


class ListenerClosedError(StreamserveError):
    code = "session_closed"


__all__ = ["AudioBufferFullError", "ListenEvent", "ListenerClosedError", "SpeechStarted", "SpeechStopped",
           "TranscriptDelta", "TranscriptDone", "TranscriptPartial"]
