"""The native protocol's decoder tells msgpack how much one frame may build (docs/security.md, Known gap 3, fixed):
a frame of a million empty maps, flat or nested in many arrays, is refused as `bad_message` without building them;
the largest messages the protocol has (token_ids of MAX_TOKEN_LIST, audio and text up to the frame limit, 16 chat
messages, an image array, every field of an append) still decode."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from streamserve.server.adapters import protocol as P

MiB = 1 << 20


def decode(message: Any, limit: int = MiB) -> P.ClientMessage:
    return P.decode_client(msgpack.packb(message, use_bin_type=True), limit)


def refused(message: Any) -> str:
    with pytest.raises(P.ProtocolError) as info:
        decode(message)
    assert info.value.code == "bad_message"
    return info.value.message


def test_a_frame_of_many_maps_is_refused_flat_or_nested() -> None:
    assert "not valid msgpack" in refused([{}] * (MiB - 8))  # over MAX_ARRAY_ITEMS: msgpack stops at the header
    nested = {"type": "append", "session": "s", "seq": 0, "token_ids": [[{}] * 60_000 for _ in range(17)]}
    assert f"at most {P.MAX_CONTAINERS} maps and arrays" in refused(nested)  # each array is under its limit
    assert f"at most {P.MAX_CONTAINERS} maps and arrays" in refused([[]] * (P.MAX_CONTAINERS + 1))


def test_per_container_limits() -> None:
    wide = {"type": "stats", **{f"k{i}": i for i in range(P.MAX_MAP_KEYS)}}  # one key over, with `type`
    assert "not valid msgpack" in refused(wide)
    assert "not valid msgpack" in refused({"type": "stats", "id": msgpack.ExtType(1, b"x")})  # no extension types
    assert "not valid msgpack" in refused({"type": "append", "token_ids": [1] * (P.MAX_ARRAY_ITEMS + 1)})


def test_the_largest_real_messages_still_decode() -> None:
    tokens = decode({"type": "append", "session": "s", "seq": 0, "token_ids": list(range(P.MAX_TOKEN_LIST))})
    assert len(tokens.fields["token_ids"]) == P.MAX_TOKEN_LIST
    audio = bytes(MiB - 256)  # a bin up to the frame limit (the other fields take the rest)
    got = decode({"type": "append", "session": "s", "seq": 1, "audio": audio, "rate": 16000, "channels": 1,
                  "encoding": "pcm16", "capture_time": 1.0, "deadline_ms": 50.0, "kind": "audio"})
    assert got.fields["audio"] == audio and got.fields["rate"] == 16000
    assert decode({"type": "append", "session": "s", "seq": 2, "text": "a" * (MiB - 64)}).fields["text"]
    chat = [{"role": "user", "content": "hi"}] * P.MAX_CHAT_MESSAGES
    assert decode({"type": "append", "session": "s", "seq": 3, "message": chat}).fields["message"] == chat
    image = {"__ndarray__": True, "data": bytes(12), "dtype": "|u1", "shape": [2, 2, 3]}
    assert decode({"type": "append", "session": "s", "seq": 4, "image": image}).fields["image"].shape == (2, 2, 3)
    voice = {"input": {"encoding": "pcm16", "rate": 16000, "channels": 1}, "speak": True,
             "turn_detection": {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                                "silence_duration_ms": 500, "idle_timeout_ms": 1000, "create_response": True,
                                "interrupt_response": True}}
    opened = decode({"type": "open", "id": 1, "window": 64, "sinks": 4, "positions": "rolling", "drafter": "ngram",
                     "chunk_budget_ms": 50.0, "chat": True, "voice": voice,
                     "sampling": {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 1,
                                  "stop": ["x"] * P.MAX_STOP_STRINGS}})
    assert opened.fields["voice"]["turn_detection"]["threshold"] == 0.5
