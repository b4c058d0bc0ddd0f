"""What the session service answers, protocol-neutral: plain dataclasses that each protocol adapter renders
in its own wire format (server/adapters/native.py: msgpack maps). No aiohttp, no msgpack, no torch here.

Direct answers (`Opened`, `Rewound`, `Configured`, `Closed`, `Stats`) are returned by the service call;
asynchronous ones (`ChunkResult`, `ReplyDelta`, `ReplyDone`, `ServiceError` for a session moved or
closed by the server) reach the connection holding the session through its `ResultListener`.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamserve.errors import InvalidInputError, StepError, StreamserveError
from streamserve.errors import QuotaExceededError as QuotaExceededError  # the service's too (re-exported)

log = logging.getLogger("streamserve.server")

INTERNAL_ERROR = "internal_error"


@dataclass(frozen=True)
class ServiceError:
    """A typed error for the client: a stable `code`, a message written for clients, and where they apply the
    session and chunk it concerns. `request_id` ties an internal error to the server log's traceback."""

    code: str
    message: str
    session: str | None = None
    seq: int | None = None
    fatal: bool = False
    request_id: str | None = None


@dataclass(frozen=True)
class Limits:
    max_frame_bytes: int
    max_chunk_tokens: int
    max_sessions: int
    messages_per_second: float
    bytes_per_second: float
    resume_ttl_s: float
    max_reply_tokens: int
    max_window: int
    max_pages: int | None
    max_queued_tokens: int | None
    min_deadline_ms: float


@dataclass(frozen=True)
class AudioInfo:
    """What the server does with audio (when its voice models are loaded)."""

    input: str  # "transcribe" (speech to text into a text-only model) or "encoder" (the model's own audio tower)
    output_rate: int  # the default rate of reply audio (any rate may be asked for)
    voice: str  # the text-to-speech voice
    voice_rate: int  # the voice's own sample rate
    encodings: tuple[str, ...]  # audio encodings accepted in and out


@dataclass(frozen=True)
class ImageInfo:
    """What the server does with images (images.py)."""

    input: str  # "labels" (a classifier's labels as a text note, for text-only models) or "encoder" (the model's own)
    model: str | None  # the classifier of the labels path (efficientnet-lite0)
    max_pixels: int  # width * height of the largest image accepted


@dataclass(frozen=True)
class ServerInfo:
    model: str
    architecture: str
    vocab_size: int
    max_context: int
    modalities: tuple[str, ...]
    limits: Limits
    chat_template: bool = False  # whether the model has one: sessions may be opened with `chat`
    audio: AudioInfo | None = None  # None: no voice on this server (audio is refused)
    image: ImageInfo | None = None  # None: no image input on this server (images are refused)
    capabilities: tuple[str, ...] = ()  # what sessions can do besides append/reply/cancel/close (engine.CAPABILITIES)
    policy_model: str | None = None  # the model WS /v1/policy serves (None: no policy on this server)


@dataclass(frozen=True)
class VoiceSettings:
    """A session's voice settings as the client sees them (maps of plain values)."""

    input: dict[str, Any]  # {encoding, rate (None: each append's), channels}
    turn_detection: dict[str, Any] | None  # {type: "server_vad", threshold, ...}; None: off (commit ends a turn)
    speak: dict[str, Any] | None  # reply audio format {encoding, rate, channels}; None: replies are text only


@dataclass(frozen=True)
class Opened:
    session: str
    resume_token: str
    resumed: bool
    next_seq: int
    tokens: int  # the session's length
    window: int | None
    sinks: int
    positions: str
    chunk_budget_ms: float
    reserved_pages: int | None  # what the session counts against its connection's page quota
    chat: bool = False  # a chat session: its appends are messages, its replies the assistant's messages
    voice: VoiceSettings | None = None  # set when the session was opened or configured with voice


@dataclass(frozen=True)
class ChunkResult:
    """The fate of one appended chunk: an ack (the chunk is in the KV cache, or was shed) or an error."""

    session: str
    seq: int | None
    capture_time: float | None
    tokens: int = 0
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    deadline_missed: bool = False
    shed: bool = False
    error: ServiceError | None = None
    chunk_seq: int | None = None  # the seq the chunk holds, when not `seq` (renumbered past transcripts: seqs.py)


@dataclass(frozen=True)
class ReplyDelta:
    session: str
    response: str
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class ReplyDone:
    session: str
    response: str
    reason: str  # length, stop, context, cancelled, closed, error
    usage: dict[str, int]


@dataclass(frozen=True)
class Rewound:
    session: str
    tokens: int
    next_seq: int


@dataclass(frozen=True)
class Configured:
    session: str
    sampling: dict[str, Any]
    chunk_budget_ms: float
    voice: VoiceSettings | None = None


@dataclass(frozen=True)
class Closed:
    session: str
    reason: str  # client, shutdown


@dataclass(frozen=True)
class Stats:
    engine: dict[str, Any] = field(default_factory=dict)  # the engine's public figures
    connection_sessions: int = 0
    connection_pages_reserved: int = 0
    connection_queued_tokens: int = 0


@dataclass(frozen=True)
class TurnEvent:
    """Server VAD on a session's audio: speech started (`audio_ms` = its start, prefix padding included) or
    stopped (`audio_ms` = its end), on the session's audio clock."""

    session: str
    event: str  # speech_started, speech_stopped
    audio_ms: int


@dataclass(frozen=True)
class Transcript:
    """Speech to text of a session's audio: `delta` (agreed words, appended to the session as chunk `seq`),
    `partial` (the unagreed tail, display only) or `final` (the utterance's whole text)."""

    session: str
    kind: str  # delta, partial, final
    text: str
    seq: int | None = None  # delta: the chunk holding the text (plain sessions)
    audio_start_ms: int | None = None  # final
    audio_end_ms: int | None = None  # final


@dataclass(frozen=True)
class ReplyAudio:
    session: str
    response: str
    audio: bytes  # at most 100 ms
    rate: int
    encoding: str
    channels: int


@dataclass(frozen=True)
class ReplyAudioDone:
    session: str
    response: str
    reason: str  # done, cancelled (barge-in, cancel), error
    audio_ms: float  # audio sent for the reply


@dataclass(frozen=True)
class Committed:
    """The answer to a commit: the utterance ended by hand (text "" when no audio was buffered)."""

    session: str
    text: str
    audio_start_ms: int | None
    audio_end_ms: int | None


Pushed = (ChunkResult | ReplyDelta | ReplyDone | ServiceError | Closed | TurnEvent | Transcript | ReplyAudio
          | ReplyAudioDone)


class ResultListener(Protocol):
    """What the service needs of a connection: a way to push results it did not ask for right now."""

    async def push(self, result: Pushed) -> None:
        """Deliver a result; may wait while the connection's outgoing queue is full (backpressure)."""

    def push_nowait(self, result: Pushed) -> bool:
        """Best effort, never waits: False when the client is too far behind."""


# ---- the service's own typed errors --------------------------------------------------------------------
# (and QuotaExceededError, imported above: defined in streamserve.errors, for the media runtime's budgets raise it too)
class WindowTooLargeError(InvalidInputError):
    """window + sinks over the model's context or the server's --max-window."""

    code = "window_too_large"


class UnsupportedModalityError(StreamserveError):
    code = "unsupported_modality"


class ClientSecretScopeError(StreamserveError):
    """A client secret authenticates one session: the first one opened with it (and resumes of it)."""

    code = "client_secret_used"


def service_error(e: BaseException, session: str | None = None, seq: int | None = None) -> ServiceError:
    """Any exception -> what the client may see. Typed errors keep their message (written for clients),
    except those that carry an internal exception's text (`StepError`, `internal_error`): those, like any
    untyped exception, become `internal_error` with a random request id, logged here with the detail."""
    if isinstance(e, StreamserveError) and not isinstance(e, StepError) and e.code != INTERNAL_ERROR:
        return ServiceError(e.code, str(e), session, seq)
    request_id = secrets.token_hex(8)
    log.error("streamserve: request %s failed (session %s, seq %s)", request_id, session, seq, exc_info=e)
    if isinstance(e, StepError):  # the session was closed by the engine; the cause is in the log only
        return ServiceError(e.code, f"the engine failed on this session's step and closed it (request id "
                                    f"{request_id})", session, seq, request_id=request_id)
    return ServiceError(INTERNAL_ERROR, f"internal server error (request id {request_id}; the server log has "
                                        "the detail)", session, seq, request_id=request_id)


# ---- what the service is asked, protocol-neutral ---------------------------------------------------------
@dataclass(frozen=True)
class OpenRequest:
    window: int | None = None  # None: the server's session default
    sinks: int | None = None
    positions: str | None = None
    drafter: str | None = None
    chunk_budget_ms: float | None = None
    sampling: dict[str, Any] | None = None  # reply defaults
    voice: dict[str, Any] | None = None  # voice settings (protocol-checked shape; voice_sessions.py checks)


@dataclass(frozen=True)
class AppendRequest:
    seq: int | None = None
    capture_time: float | None = None  # the client's clock: echoed in the result
    deadline_ms: float | None = None  # from arrival; raised to the server's floor
    kind: str = "text"
    text: str | None = None
    token_ids: list[int] | None = None
    audio: bytes | None = None  # raw audio in `encoding` at `rate` with `channels` interleaved
    image: Any = None  # JPEG/PNG bytes or a decoded array (images.py turns it into text or embeds)
    embeds: Any = None  # a torch tensor [T, hidden]: an image through the model's own image encoder
    rate: int | None = None  # audio only: None takes the session's voice input rate
    channels: int | None = None
    encoding: str | None = None
