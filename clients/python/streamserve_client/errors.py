"""Typed errors, one class per family of the server's error codes (docs/protocol.md)."""

from __future__ import annotations


class StreamserveClientError(Exception):
    """An error the server reported (`code` is its stable code) or the client detected."""

    code = "client_error"

    def __init__(self, message: str, code: str | None = None, seq: int | None = None, fatal: bool = False) -> None:
        super().__init__(message)
        self.message, self.seq, self.fatal = message, seq, fatal
        if code is not None:
            self.code = code

    def copy(self) -> StreamserveClientError:
        """The same error, to raise again (each raise gets its own traceback)."""
        return type(self)(self.message, code=self.code, seq=self.seq, fatal=self.fatal)


class InvalidInputError(StreamserveClientError):
    """The request was malformed or out of range; fix it and send again."""

    code = "invalid_input"


class NotSupportedError(InvalidInputError):
    """An operation the server's backend cannot do (`hello["capabilities"]` lists what it can)."""

    code = "not_supported"


class UnknownSessionError(StreamserveClientError):
    """The session is not (or no longer) held by this connection: closed, expired, or moved."""

    code = "unknown_session"


class CapacityError(StreamserveClientError):
    """The server is at a limit (KV memory, queued chunks, sessions, message rate); retry later."""

    code = "capacity_exceeded"


class UnsupportedModalityError(StreamserveClientError):
    code = "unsupported_modality"


class StepFailedError(StreamserveClientError):
    """The engine failed on this session's step; the server closed the session."""

    code = "step_failed"


class EngineFailedError(StepFailedError):
    """The server's engine died (`engine_failed`): nothing more runs there until it is restarted; reconnect later."""

    code = "engine_failed"


class UnauthorizedError(StreamserveClientError):
    """The server wants `api_key=` (or a different one)."""

    code = "unauthorized"


class ServerBusyError(StreamserveClientError):
    """The server closed the connection with 1013 (too many connections, server-wide or from this client address:
    `too_many_connections`; or the model is still loading)."""

    code = "busy"


class CallTimeoutError(StreamserveClientError, TimeoutError):
    """A blocking call (SyncClient) took longer than its timeout; it was cancelled."""

    code = "timeout"


class ConnectionLostError(StreamserveClientError):
    """The connection dropped and could not be resumed (or a reply was running when it dropped)."""

    code = "connection_lost"


class ProtocolViolationError(ConnectionLostError):
    """The server sent something the protocol does not allow (a frame that is not a msgpack map, a known
    message with a missing or mistyped field, output for a reply that is not running): every call waiting
    on the connection fails with it, and the client reconnects and resumes as after a dropped connection
    (with `reconnect=False` the client stays failed). Calls that failed may or may not have been carried out."""

    code = "protocol_violation"


_FAMILIES: dict[str, type[StreamserveClientError]] = {
    **dict.fromkeys(("invalid_input", "bad_message", "empty_append", "token_out_of_range", "context_length_exceeded",
                     "session_page_cap", "invalid_rewind", "tokens_forgotten", "chunk_too_large",
                     "response_in_progress", "frame_too_large", "chat_template_error", "window_too_large",
                     "unknown_drafter", "embedding_shape", "embedding_dtype", "non_finite_input", "no_chat_template",
                     "chat_template_not_incremental", "invalid_chat_message", "not_chat_session",
                     "invalid_audio_format", "invalid_turn_detection", "message_in_progress", "no_open_message",
                     "invalid_audio_encoder", "invalid_image", "invalid_image_encoder", "invalid_observation",
                     "audio_too_long"),
                    InvalidInputError),
    **dict.fromkeys(("unknown_session", "session_closed", "invalid_resume_token", "session_moved"),
                    UnknownSessionError),
    **dict.fromkeys(("capacity_exceeded", "too_many_sessions", "quota_exceeded", "audio_buffer_full",
                     "vision_busy", "server_busy"),
                    CapacityError),
    "unsupported_modality": UnsupportedModalityError,
    "not_supported": NotSupportedError,
    **dict.fromkeys(("step_failed", "backend_error"), StepFailedError),
    **dict.fromkeys(("engine_failed", "backend_unavailable"), EngineFailedError),
    "too_many_connections": ServerBusyError,
    **dict.fromkeys(("unauthorized", "client_secret_used"), UnauthorizedError),
}


def from_message(msg: dict) -> StreamserveClientError:
    """An `error` message -> the matching exception."""
    code = str(msg.get("code", "internal_error"))
    cls = _FAMILIES.get(code, StreamserveClientError)
    return cls(str(msg.get("message", "")), code=code, seq=msg.get("seq"), fatal=bool(msg.get("fatal")))
