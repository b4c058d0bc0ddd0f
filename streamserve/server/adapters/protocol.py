"""The native streaming protocol, version 1: msgpack maps in binary WebSocket frames (docs/protocol.md).

No I/O and no torch here: `decode_client` turns one frame into a validated `ClientMessage` or raises
`ProtocolError` (a typed code and a message the client can act on); `encode` turns a server message
(a plain dict with a `type`) into a frame. Transports only move bytes through these two functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
MAX_ID_CHARS = 128  # session ids, resume tokens and request ids
MAX_STOP_STRINGS = 16
MAX_INT = (1 << 63) - 1  # seq, seeds, ids: what every peer can hold
MAX_TOKEN_LIST = 1 << 16  # token_ids per message (servers set a lower max_chunk_tokens)
# what msgpack may build from one frame, told to the decoder (as policy/wire.py does): its defaults scale with the
# frame, and a 1 MiB frame of a million empty maps took ~115 ms to decode on the event loop before it was refused
MAX_ARRAY_ITEMS = MAX_TOKEN_LIST  # the longest array a message holds: token_ids
MAX_MAP_KEYS = 32  # an append's fields (14 + type, id, session) are the most; unknown fields are refused anyway
MAX_CONTAINERS = 256  # maps + arrays in one message (chat messages, voice, sampling, stop, an image's shape: < 40)

# WebSocket close codes the server uses
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the server is shutting down
CLOSE_POLICY = 1008  # a permanent error: too many malformed messages, a protocol the server cannot serve
CLOSE_TOO_BIG = 1009  # a frame over max_frame_bytes
CLOSE_INTERNAL = 1011
CLOSE_SERVICE_RESTART = 1012  # the server drains: its sessions moved; reconnect at once and resume them
CLOSE_TRY_LATER = 1013  # overload: too many connections; retry after a pause
CLOSE_BAD_CLIENT = 4400  # the client keeps sending what the protocol does not allow

DRAIN_TYPES = ("cancel", "close", "stats")  # what a draining server still carries out (it ignores the rest)
CLIENT_TYPES = ("open", "resume", "append", "respond", "cancel", "rewind", "configure", "close", "stats", "commit")
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
CHAT_ROLES = ("system", "user", "assistant", "tool")  # engine/chat.py's ROLES (this module imports no engine)
MAX_CHAT_MESSAGES = 16  # messages in one append (appended together, as one chunk)
# voice settings (open/configure `voice`); values are range-checked by the service (media's AudioFormat, VADConfig)
FORMAT_KEYS = ("encoding", "rate", "channels")
# images (append `image`): encoded bytes, or an array in openpi's form {__ndarray__: true, data, dtype, shape}
IMAGE_DTYPES = ("|u1", "<f4", "<f8")  # uint8 0..255, float32/float64 0..1 (media/vision.py checks the values)
NDARRAY_KEYS = ("__ndarray__", "data", "dtype", "shape")
CHUNK_KINDS = ("text", "audio", "video", "image")  # an append's `kind`: only "video" may be shed under load
VAD_KEYS = ("type", "threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms", "create_response",
            "interrupt_response", "eagerness")


class ProtocolError(Exception):
    """A frame the protocol does not allow; answered with an `error` message carrying `code`."""

    def __init__(self, code: str, message: str, *, request_id: Any = None, session: str | None = None,
                 seq: int | None = None, fatal: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.fatal = code, message, fatal
        self.request_id, self.session, self.seq = request_id, session, seq


@dataclass
class ClientMessage:
    type: str
    id: Any = None  # the client's request id, echoed in the reply
    session: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # the validated type-specific fields


def encode(message: dict[str, Any]) -> bytes:
    """A server message -> one binary frame."""
    return msgpack.packb({k: v for k, v in message.items() if v is not None}, use_bin_type=True)


def error_message(code: str, message: str, *, fatal: bool = False, request_id: Any = None,
                  session: str | None = None, seq: int | None = None) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message, "fatal": fatal, "id": request_id,
            "session": session, "seq": seq}


def decode_client(frame: bytes | str, max_frame_bytes: int) -> ClientMessage:
    """One client frame -> a validated message, or ProtocolError("bad_message", ...)."""
    if isinstance(frame, str):
        raise ProtocolError("bad_message", "send binary frames (msgpack), not text frames")
    if len(frame) > max_frame_bytes:
        raise ProtocolError("frame_too_large", f"a frame of {len(frame)} bytes is over the limit of "
                                               f"{max_frame_bytes}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_str_len=max_frame_bytes,
                              max_bin_len=max_frame_bytes, max_array_len=MAX_ARRAY_ITEMS, max_map_len=MAX_MAP_KEYS,
                              max_ext_len=0, object_hook=(count := _ContainerCount()), list_hook=count)
    except _TooManyContainers:
        raise ProtocolError("bad_message", f"a message holds at most {MAX_CONTAINERS} maps and arrays") from None
    except Exception as e:  # msgpack raises several types for malformed input (and for a container over its limit)
        raise ProtocolError("bad_message", f"the frame is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_message", f"a frame must be a msgpack map, got {type(obj).__name__}")
    request_id = obj.get("id")
    if request_id is not None and not (_is_int(request_id) or (isinstance(request_id, str)
                                                               and len(request_id) <= MAX_ID_CHARS)):
        raise ProtocolError("bad_message", f"id must be an int or a string of at most {MAX_ID_CHARS} characters")
    kind = obj.get("type")
    if kind not in CLIENT_TYPES:
        raise ProtocolError("bad_message", f"unknown message type {kind!r}; expected one of {list(CLIENT_TYPES)}",
                            request_id=request_id)
    f = _Fields(obj, request_id)
    session = None
    if kind not in ("open", "stats"):
        session = f.text("session", required=True, max_chars=MAX_ID_CHARS)
    msg = ClientMessage(kind, request_id, session)
    f.session = session
    msg.fields = _PARSERS[kind](f)
    f.reject_unknown()
    return msg


class _TooManyContainers(Exception):
    pass


class _ContainerCount:
    """msgpack's object_hook and list_hook (called as each map / array is finished): stops the decoding past
    MAX_CONTAINERS, however the frame nests them (a per-container limit alone lets 16 arrays of 65536 maps by)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, container: Any) -> Any:
        self.n += 1
        if self.n > MAX_CONTAINERS:
            raise _TooManyContainers
        return container


# ---- per-type fields ------------------------------------------------------------------------------------
def _open(f: _Fields) -> dict[str, Any]:
    return {"window": f.integer("window", minimum=1), "sinks": f.integer("sinks", minimum=0),
            "positions": f.choice("positions", ("absolute", "rolling")),
            "drafter": f.choice("drafter", ("none", "ngram", "auto")),
            "chunk_budget_ms": f.number("chunk_budget_ms", positive=True), "sampling": f.sampling("sampling"),
            "chat": f.flag("chat"), "voice": f.voice("voice")}


def _resume(f: _Fields) -> dict[str, Any]:
    return {"resume_token": f.text("resume_token", required=True, max_chars=MAX_ID_CHARS)}


def _append(f: _Fields) -> dict[str, Any]:
    out = {"seq": f.integer("seq", minimum=0), "capture_time": f.number("capture_time"),
           "deadline_ms": f.number("deadline_ms", positive=True), "kind": f.choice("kind", CHUNK_KINDS),
           "text": f.text("text"), "token_ids": f.int_list("token_ids"),
           "audio": f.binary("audio"), "image": f.image("image"), "rate": f.integer("rate", minimum=1),
           "channels": f.integer("channels", minimum=1), "encoding": f.text("encoding", max_chars=32)}
    out["message"] = f.chat_message("message", out["seq"])
    given = [k for k in ("text", "token_ids", "audio", "image", "message") if out[k] is not None]
    if len(given) != 1:
        raise f.error(f"append takes exactly one of text, token_ids, audio, image, message; got {given or 'none'}",
                      out["seq"])
    if out["audio"] is None and any(out[k] is not None for k in ("rate", "channels", "encoding")):
        raise f.error("rate, channels and encoding describe `audio`: send them with audio only", out["seq"])
    return out


def _respond(f: _Fields) -> dict[str, Any]:
    out = f.sampling_fields()
    seq = f.integer("seq", minimum=0)  # chat sessions: the chunk of the generation prompt
    return out if seq is None else {**out, "seq": seq}


def _nothing(f: _Fields) -> dict[str, Any]:
    return {}


def _rewind(f: _Fields) -> dict[str, Any]:
    out = {"to_seq": f.integer("to_seq", minimum=0), "to": f.integer("to", minimum=0),
           "to_message": f.integer("to_message", minimum=0)}
    if sum(v is not None for v in out.values()) != 1:
        raise f.error("rewind takes exactly one of to_seq, to and to_message")
    return out


def _configure(f: _Fields) -> dict[str, Any]:
    return {"sampling": f.sampling("sampling"), "chunk_budget_ms": f.number("chunk_budget_ms", positive=True),
            "voice": f.voice("voice")}


_PARSERS = {"open": _open, "resume": _resume, "append": _append, "respond": _respond, "cancel": _nothing,
            "rewind": _rewind, "configure": _configure, "close": _nothing, "stats": _nothing, "commit": _nothing}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Fields:
    """Typed access to a message's fields; every accessor marks the key as known."""

    def __init__(self, obj: dict[str, Any], request_id: Any) -> None:
        self.obj, self.request_id, self.session = obj, request_id, None
        self.seen = {"type", "id", "session"}
        self.prefix: str | None = None  # a sub-map's: "message type: its key"

    def error(self, message: str, seq: int | None = None) -> ProtocolError:
        return ProtocolError("bad_message", f"{self.prefix or self.obj.get('type')}: {message}",
                             request_id=self.request_id,
                             session=self.session, seq=seq)

    def get_field(self, key: str, required: bool) -> Any:
        self.seen.add(key)
        v = self.obj.get(key)
        if v is None and required:
            raise self.error(f"missing field {key!r}")
        return v

    def text(self, key: str, required: bool = False, max_chars: int | None = None) -> str | None:
        v = self.get_field(key, required)
        if v is not None and (not isinstance(v, str) or (max_chars is not None and len(v) > max_chars)):
            raise self.error(f"{key} must be a string" + (f" of at most {max_chars} characters" if max_chars else ""))
        return v

    def integer(self, key: str, minimum: int | None = None) -> int | None:
        v = self.get_field(key, False)
        if v is not None and (not _is_int(v) or (minimum is not None and v < minimum) or abs(v) > MAX_INT):
            raise self.error(f"{key} must be an integer" + (f" >= {minimum}" if minimum is not None else "")
                             + " below 2**63")
        return v

    def number(self, key: str, positive: bool = False) -> float | None:
        v = self.get_field(key, False)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
            raise self.error(f"{key} must be a finite number" + (" > 0" if positive else ""))
        return float(v)

    def choice(self, key: str, options: tuple[str, ...]) -> str | None:
        v = self.get_field(key, False)
        if v is not None and v not in options:
            raise self.error(f"{key} must be one of {list(options)}, got {v!r}")
        return v

    def int_list(self, key: str) -> list[int] | None:
        v = self.get_field(key, False)
        if v is not None and (not isinstance(v, list) or len(v) > MAX_TOKEN_LIST or not all(_is_int(i) for i in v)):
            raise self.error(f"{key} must be a list of at most {MAX_TOKEN_LIST} integers")
        return v

    def image(self, key: str) -> bytes | np.ndarray | None:
        """Encoded image bytes (msgpack bin), or an array in openpi's form -> a read-only numpy array viewing the
        frame's bytes; its shape and values are checked by media/vision.py's decode_image."""
        v = self.get_field(key, False)
        if v is None or isinstance(v, bytes):
            return v
        if not isinstance(v, dict) or set(v) != set(NDARRAY_KEYS) or v["__ndarray__"] is not True:
            raise self.bad_image(f"{key} must be JPEG/PNG bytes (msgpack bin) or an array {{__ndarray__: true, data, "
                                 "dtype, shape}")
        data, dtype, shape = v["data"], v["dtype"], v["shape"]
        if dtype not in IMAGE_DTYPES:
            raise self.bad_image(f"{key}: an image array's dtype is one of {list(IMAGE_DTYPES)}, got {dtype!r}")
        if not (isinstance(shape, list) and len(shape) in (2, 3) and all(_is_int(n) and 0 <= n < 1 << 20
                                                                          for n in shape)):
            raise self.bad_image(f"{key}: an image array's shape is [H, W] or [H, W, C], got {shape!r}")
        size = math.prod(shape) * np.dtype(dtype).itemsize
        if not isinstance(data, bytes) or len(data) != size:
            raise self.bad_image(f"{key}: shape {shape} of {dtype} needs {size} bytes of data, got "
                                 f"{len(data) if isinstance(data, bytes) else type(data).__name__}")
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)

    def bad_image(self, message: str) -> ProtocolError:
        return ProtocolError("invalid_image", f"{self.obj.get('type')}: {message}", request_id=self.request_id,
                             session=self.session, seq=self.obj.get("seq") if _is_int(self.obj.get("seq")) else None)

    def binary(self, key: str) -> bytes | None:
        v = self.get_field(key, False)
        if v is not None and not isinstance(v, bytes):
            raise self.error(f"{key} must be raw bytes (msgpack bin, never base64 text)")
        return v

    def voice(self, key: str) -> dict[str, Any] | None:
        """A session's voice settings: {input: {encoding, rate, channels}, turn_detection: {type: "server_vad" |
        "semantic_vad", ...} or false (off), speak: true/false or {encoding, rate, channels}}; types checked here,
        ranges by the service. -> the map with absent keys left out (a key left out keeps the session's current
        setting)."""
        v = self.get_field(key, False)
        if v is None:
            return None
        sub = self.submap(key, v, ("input", "turn_detection", "speak"))
        out: dict[str, Any] = {}
        inp = sub.get_field("input", False)
        if inp is not None:
            out["input"] = self.audio_format(f"{key}.input", inp)
        td = sub.get_field("turn_detection", False)
        if td is False:
            out["turn_detection"] = False
        elif td is not None:
            t = self.submap(f"{key}.turn_detection", td, VAD_KEYS)
            kind = t.choice("type", ("server_vad", "semantic_vad", "none"))
            vals = {"type": kind, "eagerness": t.choice("eagerness", ("low", "medium", "high", "auto")),
                    "threshold": t.number("threshold"), "prefix_padding_ms": t.integer("prefix_padding_ms", 0),
                    "silence_duration_ms": t.integer("silence_duration_ms", 0),
                    "idle_timeout_ms": t.integer("idle_timeout_ms", 1),
                    "create_response": t.flag("create_response"), "interrupt_response": t.flag("interrupt_response")}
            t.reject_unknown()
            out["turn_detection"] = False if kind == "none" else {k: x for k, x in vals.items() if x is not None}
        speak = sub.get_field("speak", False)
        if isinstance(speak, bool):
            out["speak"] = speak
        elif speak is not None:
            out["speak"] = self.audio_format(f"{key}.speak", speak)
        sub.reject_unknown()
        return out

    def submap(self, key: str, v: Any, keys: tuple[str, ...]) -> _Fields:
        if not isinstance(v, dict):
            raise self.error(f"{key} must be a map of {list(keys)}")
        sub = _Fields(v, self.request_id)
        sub.session, sub.seen, sub.prefix = self.session, set(), f"{self.obj.get('type')}: {key}"
        return sub

    def audio_format(self, key: str, v: Any) -> dict[str, Any]:
        f = self.submap(key, v, FORMAT_KEYS)
        out = {"encoding": f.text("encoding", max_chars=32), "rate": f.integer("rate", minimum=1),
               "channels": f.integer("channels", minimum=1)}
        f.reject_unknown()
        return {k: x for k, x in out.items() if x is not None}

    def flag(self, key: str) -> bool | None:
        v = self.get_field(key, False)
        if v is not None and not isinstance(v, bool):
            raise self.error(f"{key} must be true or false")
        return v

    def chat_message(self, key: str, seq: int | None) -> Any:
        """A chat message: a map of exactly `role` (one of CHAT_ROLES) and `content` (a string); or a list of 1 to
        MAX_CHAT_MESSAGES of them."""
        v = self.get_field(key, False)
        items = v if isinstance(v, list) else [v]
        if v is not None and not (0 < len(items) <= MAX_CHAT_MESSAGES and all(
                isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in CHAT_ROLES
                and isinstance(m["content"], str) for m in items)):
            raise ProtocolError("invalid_chat_message", f"{self.obj.get('type')}: {key} must be a map of exactly role "
                                f"(one of {list(CHAT_ROLES)}) and content (a string), or a list of 1 to "
                                f"{MAX_CHAT_MESSAGES} of them", request_id=self.request_id, session=self.session,
                                seq=seq)
        return v

    def sampling_fields(self, obj: dict[str, Any] | None = None) -> dict[str, Any]:
        sub = _Fields(obj, self.request_id) if obj is not None else self
        sub.session = self.session
        out = {"max_tokens": sub.integer("max_tokens"), "temperature": sub.number("temperature"),
               "top_p": sub.number("top_p"), "top_k": sub.integer("top_k"), "seed": sub.integer("seed")}
        stop = sub.get_field("stop", False)
        if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                                 or not all(isinstance(s, str) for s in stop)):
            raise self.error(f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
        out["stop"] = stop
        if obj is not None:
            sub.reject_unknown()
        return {k: v for k, v in out.items() if v is not None}

    def sampling(self, key: str) -> dict[str, Any] | None:
        v = self.get_field(key, False)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self.error(f"{key} must be a map of {list(SAMPLING_KEYS)}")
        return self.sampling_fields(v)

    def reject_unknown(self) -> None:
        unknown = sorted(str(k) for k in self.obj if k not in self.seen)
        if unknown:
            raise self.error(f"unknown field(s) {unknown}")
