"""The native protocol as the client sees it (docs/protocol.md): framing, validation of the server's
messages and the values made from them. No I/O.

What is a protocol violation and what is not (the channel fails every pending call on a violation and
reconnects; see channel.py):

- A violation: a frame that is not a msgpack map with a string `type`; a message of a type this module
  knows (`SERVER_MESSAGES`) with a required field missing or any field it defines of the wrong type.
- Not a violation, for forward compatibility with newer servers: a message of an unknown type (ignored),
  a field this module does not know (ignored), a field set to nil (absent, as in the protocol).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from streamserve_client.errors import ProtocolViolationError

FieldCheck = Callable[[Any], bool]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_map(v: Any) -> bool:
    return isinstance(v, dict)


def _is_list(v: Any) -> bool:
    return isinstance(v, list)


def _is_id(v: Any) -> bool:
    """Request ids are ints or strings (docs/protocol.md, Framing)."""
    return _is_int(v) or _is_str(v)


def _is_bytes(v: Any) -> bool:
    return isinstance(v, bytes)


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


@dataclass(frozen=True)
class MessageSpec:
    required: dict[str, FieldCheck]
    optional: dict[str, FieldCheck] = field(default_factory=dict)


# The server messages of protocol version 1 and the fields the client relies on (docs/protocol.md).
SERVER_MESSAGES: dict[str, MessageSpec] = {
    "hello": MessageSpec({"protocol": _is_int}, {"limits": _is_map, "modalities": _is_list, "model": _is_str,
                                                 "chat_template": _is_bool, "image": _is_map}),
    "opened": MessageSpec({"id": _is_id, "session": _is_str, "resume_token": _is_str},
                          {"resumed": _is_bool, "next_seq": _is_int, "tokens": _is_int, "chat": _is_bool}),
    "ack": MessageSpec({"session": _is_str, "seq": _is_int},
                       {"tokens": _is_int, "queue_ms": _is_number, "compute_ms": _is_number,
                        "deadline_missed": _is_bool, "shed": _is_bool}),
    "delta": MessageSpec({"session": _is_str}, {"response": _is_id, "text": _is_str, "token_ids": _is_int_list}),
    "done": MessageSpec({"session": _is_str}, {"response": _is_id, "reason": _is_str, "usage": _is_map}),
    "rewound": MessageSpec({"id": _is_id, "session": _is_str, "tokens": _is_int}, {"next_seq": _is_int}),
    "configured": MessageSpec({"id": _is_id, "session": _is_str},
                              {"sampling": _is_map, "chunk_budget_ms": _is_number}),
    "closed": MessageSpec({"session": _is_str}, {"id": _is_id, "reason": _is_str}),
    "stats": MessageSpec({"id": _is_id}),
    "turn": MessageSpec({"session": _is_str, "event": _is_str}, {"audio_start_ms": _is_int, "audio_end_ms": _is_int}),
    "transcript": MessageSpec({"session": _is_str}, {"delta": _is_str, "partial": _is_str, "final": _is_str,
                                                     "seq": _is_int, "audio_start_ms": _is_int,
                                                     "audio_end_ms": _is_int}),
    "audio": MessageSpec({"session": _is_str, "audio": _is_bytes, "rate": _is_int},
                         {"response": _is_id, "encoding": _is_str, "channels": _is_int}),
    "audio_done": MessageSpec({"session": _is_str}, {"response": _is_id, "reason": _is_str, "audio_ms": _is_number}),
    "committed": MessageSpec({"id": _is_id, "session": _is_str}, {"text": _is_str}),
    "error": MessageSpec({"code": _is_str}, {"message": _is_str, "id": _is_id, "session": _is_str,
                                             "seq": _is_int, "fatal": _is_bool}),
}


def decode(frame: bytes | str) -> dict[str, Any]:
    """One server frame -> its message, checked against `SERVER_MESSAGES`; raises ProtocolViolationError."""
    if not isinstance(frame, bytes):
        raise ProtocolViolationError("the server sent a text frame; the native protocol is binary msgpack")
    try:
        message = msgpack.unpackb(frame, raw=False)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise ProtocolViolationError(f"the server sent a frame that is not msgpack ({type(e).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolViolationError(f"the server sent a msgpack {type(message).__name__}, not a map")
    kind = message.get("type")
    if not isinstance(kind, str):
        raise ProtocolViolationError("the server sent a message without a string `type`")
    spec = SERVER_MESSAGES.get(kind)
    if spec is None:
        return message  # a newer server's message type: the caller ignores it
    for name in spec.required:
        if message.get(name) is None:
            raise ProtocolViolationError(f"the server's `{kind}` message lacks its `{name}` field")
    for name, check in (*spec.required.items(), *spec.optional.items()):
        value = message.get(name)
        if value is not None and not check(value):
            raise ProtocolViolationError(f"the server's `{kind}` message has a `{name}` of the wrong type "
                                         f"({type(value).__name__})")
    return message


def pack(message: dict[str, Any]) -> bytes:
    """A client message -> its frame (nil fields are left out: the server treats them as absent)."""
    return msgpack.packb({k: v for k, v in message.items() if v is not None}, use_bin_type=True)


def ndarray(a: np.ndarray) -> dict[str, Any]:
    """openpi's array form."""
    a = np.ascontiguousarray(a)
    return {"__ndarray__": True, "data": a.tobytes(), "dtype": a.dtype.str, "shape": list(a.shape)}


@dataclass(frozen=True)
class Ack:
    """A chunk is in the session's KV cache (or was shed). Times in milliseconds."""

    seq: int
    tokens: int
    queue_ms: float  # waiting in the server's scheduler
    compute_ms: float  # in the engine
    round_trip_ms: float  # send to ack, measured here
    deadline_missed: bool = False
    shed: bool = False
    chunk_seq: int | None = None  # the seq the chunk holds when the server renumbered it past a transcript chunk

    @classmethod
    def from_message(cls, m: dict[str, Any], round_trip_ms: float) -> Ack:
        """An `ack` message that `decode` checked."""
        chunk_seq = m.get("chunk_seq")
        return cls(m["seq"], m.get("tokens") or 0, float(m.get("queue_ms") or 0.0), float(m.get("compute_ms") or 0.0),
                   round_trip_ms, bool(m.get("deadline_missed")), bool(m.get("shed")),
                   chunk_seq if isinstance(chunk_seq, int) and not isinstance(chunk_seq, bool) else None)


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)
