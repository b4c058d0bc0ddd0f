"""The Realtime API's events, I/O-free: a client's JSON text frame -> a checked `ClientEvent`, or a `RealtimeError`
that becomes an `error` event (the connection survives it); server events rendered as JSON text, each with its own
`event_id`. The event types and fields are the GA API's (`openai.types.realtime`); nothing here sends or waits.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streamserve.server.service.results import ServiceError, service_error

CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
                 "conversation.item.create", "conversation.item.retrieve", "conversation.item.truncate",
                 "conversation.item.delete", "response.create", "response.cancel", "output_audio_buffer.clear")
MAX_EVENT_ID = 512  # characters of a client's event_id (it is echoed in errors)
MAX_ITEM_ID = 32  # as OpenAI's item ids
# objects + arrays in one event, counted before json.loads (a 1 MiB `[{},{},...]` took 35-50 ms to parse on the event
# loop); real events hold tens to hundreds (a session.update with many tools' schemas the most)
MAX_JSON_CONTAINERS = 4096


class RealtimeError(Exception):
    """What the client is told in an `error` event: the API's error `type` (invalid_request_error, server_error),
    a stable `code`, the `param` at fault and the `event_id` of the client event that caused it."""

    def __init__(self, message: str, code: str, param: str | None = None, kind: str = "invalid_request_error",
                 event_id: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.kind, self.event_id = message, code, param, kind, event_id


def from_service(e: BaseException | ServiceError, event_id: str | None = None) -> RealtimeError:
    """A streamserve error (raised, or a service's ServiceError) -> the Realtime API's error: the client's own
    mistakes are `invalid_request_error`, the rest `server_error` (internal ones carry a request id only)."""
    if isinstance(e, RealtimeError):
        e.event_id = e.event_id or event_id
        return e
    err = e if isinstance(e, ServiceError) else service_error(e)
    kind = "server_error" if err.request_id is not None else "invalid_request_error"  # internal: a request id only
    return RealtimeError(err.message, err.code, None, kind, event_id)

def new_id(prefix: str) -> str:
    """An id of the API's shape: a prefix (event_, item_, resp_, sess_) and 20 random hex characters."""
    return f"{prefix}{secrets.token_hex(10)}"


@dataclass(frozen=True)
class ClientEvent:
    type: str
    event_id: str | None
    body: Mapping[str, Any]  # the whole event, checked field by field by its handler (helpers below)


def parse(frame: bytes | str, max_bytes: int) -> ClientEvent:
    """One client frame -> its event (type and event_id checked), or RealtimeError."""
    if isinstance(frame, bytes):
        raise RealtimeError("the Realtime API takes JSON text frames; this was a binary frame", "invalid_frame")
    if len(frame) > max_bytes and len(frame.encode()) > max_bytes:
        raise RealtimeError(f"this event is {len(frame.encode())} bytes, over this server's limit of {max_bytes} "
                            "(max_frame_bytes): send audio in smaller appends (20-200 ms each)", "event_too_large")
    if (n := containers(frame)) > MAX_JSON_CONTAINERS:
        raise RealtimeError(f"this event holds {n} JSON objects and arrays, over this server's limit of "
                            f"{MAX_JSON_CONTAINERS}", "invalid_event")
    try:
        data = json.loads(frame, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError, RecursionError):
        raise RealtimeError("the event is not valid JSON: send one JSON object per text frame",
                            "invalid_json") from None
    if not isinstance(data, dict):
        raise RealtimeError(f"an event is a JSON object, got {type(data).__name__}", "invalid_event")
    event_id = data.get("event_id")
    if event_id is not None and (not isinstance(event_id, str) or len(event_id) > MAX_EVENT_ID):
        raise RealtimeError(f"event_id must be a string of at most {MAX_EVENT_ID} characters", "invalid_type",
                            "event_id")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise RealtimeError("the event has no string 'type'", "missing_required_parameter", "type", event_id=event_id)
    if kind not in CLIENT_EVENTS:
        raise RealtimeError(f"Invalid value: {kind[:64]!r}. Supported values are: "
                            f"{', '.join(repr(t) for t in CLIENT_EVENTS)}", "invalid_value", "type", event_id=event_id)
    return ClientEvent(kind, event_id, data)


def containers(text: str) -> int:
    """The '{' and '[' of a JSON text outside its strings. The raw count first (C speed, ~1.5 ms a MiB); only
    over the limit are the strings taken out (text with braces in it is no container): escaped backslashes and then
    escaped quotes dropped (they pair left to right, as JSON reads them), every other '"' delimits a string. Where
    that reading differs from JSON's the text is invalid before that point, and json.loads stops there."""
    raw = text.count("{") + text.count("[")
    if raw <= MAX_JSON_CONTAINERS or '"' not in text:
        return raw
    outside = "".join(text.replace("\\\\", "").replace('\\"', "").split('"')[0::2])
    return outside.count("{") + outside.count("[")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: Python's json would take them


# ---- field checks (handlers call these; param names follow the API's dotted paths) -------------------------
def opt_str(obj: Mapping[str, Any], key: str, param: str, limit: int | None = None) -> str | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, str):
        raise RealtimeError(f"{param} must be a string, got {type(v).__name__}", "invalid_type", param)
    if v is not None and limit is not None and len(v) > limit:
        raise RealtimeError(f"{param} is {len(v)} characters, over the limit of {limit}", "string_above_max_length",
                            param)
    return v


def req_str(obj: Mapping[str, Any], key: str, param: str, limit: int | None = None) -> str:
    v = opt_str(obj, key, param, limit)
    if v is None:
        raise RealtimeError(f"missing required parameter {param}", "missing_required_parameter", param)
    return v


def opt_map(obj: Mapping[str, Any], key: str, param: str) -> Mapping[str, Any] | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, dict):
        raise RealtimeError(f"{param} must be an object, got {type(v).__name__}", "invalid_type", param)
    return v


def opt_bool(obj: Mapping[str, Any], key: str, param: str) -> bool | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, bool):
        raise RealtimeError(f"{param} must be true or false, got {type(v).__name__}", "invalid_type", param)
    return v


def opt_int(obj: Mapping[str, Any], key: str, param: str, low: int, high: int) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise RealtimeError(f"{param} must be an integer, got {type(v).__name__}", "invalid_type", param)
    if not low <= v <= high:
        raise RealtimeError(f"{param} must be from {low} to {high}, got {v}", "invalid_value", param)
    return v


def opt_float(obj: Mapping[str, Any], key: str, param: str, low: float, high: float) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RealtimeError(f"{param} must be a number, got {type(v).__name__}", "invalid_type", param)
    if not low <= v <= high:
        raise RealtimeError(f"{param} must be from {low} to {high}, got {v}", "invalid_value", param)
    return float(v)


def item_id(obj: Mapping[str, Any], key: str, param: str) -> str:
    return req_str(obj, key, param, MAX_ITEM_ID)


# ---- server events ----------------------------------------------------------------------------------------
def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"event_id": new_id("event_"), "type": kind, **fields}


def error_event(e: RealtimeError) -> dict[str, Any]:
    return event("error", error={"type": e.kind, "code": e.code, "message": e.message, "param": e.param,
                                 "event_id": e.event_id})


def encode(message: Mapping[str, Any]) -> str:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))
