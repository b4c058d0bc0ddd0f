"""The typed errors of streamserve. Every error a user can cause is one of these, never a torch crash.

Each class carries a stable `code` (used later by the wire protocols) and a message that says what to do.
This module imports nothing from the project, so every layer (kernels, sessions, engine, server) may use it.
"""

from __future__ import annotations


class StreamserveError(Exception):
    """Base class of every error streamserve raises on purpose."""

    code = "internal_error"


class InvalidInputError(StreamserveError, ValueError):
    """The caller passed something malformed: wrong types, bad ranges, both or neither of two options."""

    code = "invalid_input"


class EmptyAppendError(InvalidInputError):
    code = "empty_append"


class TokenOutOfRangeError(InvalidInputError):
    code = "token_out_of_range"


class ContextLengthError(InvalidInputError):
    """The session would grow past the model's maximum context."""

    code = "context_length_exceeded"


class SessionClosedError(StreamserveError):
    code = "session_closed"


class CapacityError(StreamserveError):
    """No KV memory for this now: the pool is full and no idle session could be parked. Retry later."""

    code = "capacity_exceeded"


class QuotaExceededError(StreamserveError):
    """Over one of a server connection's quotas (KV pages reserved, tokens queued); nothing was taken."""

    code = "quota_exceeded"


class PageCapError(InvalidInputError):
    """The session would hold more KV pages than its cap allows."""

    code = "session_page_cap"


class RewindError(InvalidInputError):
    """A rewind point before the start, past the end, or inside what the window already dropped."""

    code = "invalid_rewind"


class SnapshotError(StreamserveError):
    """A snapshot that cannot be written (a full disk) or restored here (another model, another format version, a
    damaged file)."""

    code = "snapshot_mismatch"


class ModelLoadError(StreamserveError):
    """A checkpoint could not be loaded: missing files, tensors, or an unsupported configuration."""

    code = "model_load_error"


class UnsupportedArchitectureError(ModelLoadError):
    code = "unsupported_architecture"


class MissingTensorError(ModelLoadError):
    code = "missing_tensor"


class TensorShapeError(ModelLoadError):
    code = "tensor_shape_mismatch"


class SessionNotFoundError(InvalidInputError):
    """No open session has this id (it never existed, was closed, or expired)."""

    code = "unknown_session"


class ResponseInProgressError(InvalidInputError):
    """The session already has a reply running or queued; cancel it or wait for it to end."""

    code = "response_in_progress"


class StepError(StreamserveError):
    """The engine failed while running this session's step (the message says why); the session was closed."""

    code = "step_failed"


class EngineDiedError(StreamserveError):
    """The engine thread ended on an unrecoverable fault: nothing more runs on this engine; restart the server."""

    code = "engine_failed"


class ChunkTooLargeError(InvalidInputError):
    """A chunk with more tokens than the server allows in one append; split it."""

    code = "chunk_too_large"


class ChatTemplateError(StreamserveError):
    code = "chat_template_error"


class EmbeddingShapeError(InvalidInputError):
    """An embedding chunk is not a [T, hidden] tensor of the model's hidden size."""

    code = "embedding_shape"


class EmbeddingDtypeError(InvalidInputError):
    """An embedding chunk's values are not floating point."""

    code = "embedding_dtype"


class NonFiniteInputError(InvalidInputError):
    """Input values hold NaN or infinity (or overflow the engine's dtype)."""

    code = "non_finite_input"


class NotSupportedError(InvalidInputError):
    """An operation this server's backend cannot do (`hello.capabilities` lists what it can): e.g. a window, a
    snapshot or embedding chunks on the SGLang backend. Never silently approximated."""

    code = "not_supported"
