"""A session on the server and its replies, as the client sees them. Both talk to the connection only
through the public methods of the channel (channel.py), which routes the server's messages to them."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from streamserve_client.channel import Channel
from streamserve_client.errors import InvalidInputError, StreamserveClientError
from streamserve_client.events import Event, EventQueue, SessionEnded, TranscriptDelta, event_of
from streamserve_client.protocol import Ack, Delta, ndarray, pack
from streamserve_client.routes import ReplyItem

# Deltas waiting to be read beyond this many are merged into the last one (as the server merges them for
# a slow reader): a reply's memory here is bounded by its tokens, never by a message count.
MAX_BUFFERED_DELTAS = 256


class Response:
    """One reply: iterate it for `Delta`s; `finish_reason` and `usage` are set when it ends."""

    def __init__(self, session: Session, params: dict[str, Any]) -> None:
        self.session, self.params = session, params
        self.id: str | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, int] = {}
        self.text = ""
        self.token_ids: list[int] = []
        self._buffer: collections.deque[ReplyItem] = collections.deque()
        self._arrived = asyncio.Event()
        self._started = False

    @property
    def started(self) -> bool:
        """Whether iterating has sent the request (a reply that never started needs no cancel)."""
        return self._started

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        if not self._started:
            self._started = True
            if self.session.chat:  # its generation prompt is a chunk of the session: it takes the next seq
                self.params = {**self.params, "seq": self.session.take_seq()}
            try:
                await self.session.channel.respond(self.session.id, self.params, self._deliver)
            except BaseException:
                self.finish_reason = "error"  # refused before it started: iterating again ends at once
                raise
        if self.finish_reason is not None:
            raise StopAsyncIteration
        while not self._buffer:
            self._arrived.clear()
            await self._arrived.wait()
        item = self._buffer.popleft()
        if isinstance(item, BaseException):
            self.finish_reason = "error"
            raise item
        if item["type"] == "done":
            self.finish_reason = item.get("reason") or "error"
            self.usage = item.get("usage") or {}
            raise StopAsyncIteration
        self.id = item.get("response", self.id)
        d = Delta(item.get("text") or "", list(item.get("token_ids") or []))
        self.text += d.text
        self.token_ids += d.token_ids
        return d

    def _deliver(self, item: ReplyItem) -> None:
        """From the channel: a `delta`, the `done`, or the error that ends this reply."""
        last = self._buffer[-1] if self._buffer else None
        if (len(self._buffer) >= MAX_BUFFERED_DELTAS and isinstance(item, dict) and item["type"] == "delta"
                and isinstance(last, dict) and last["type"] == "delta"):
            self._buffer[-1] = {**last, "text": (last.get("text") or "") + (item.get("text") or ""),
                                "token_ids": [*(last.get("token_ids") or []), *(item.get("token_ids") or [])]}
        else:
            self._buffer.append(item)
        self._arrived.set()

    async def wait(self) -> str:
        """Read to the end; -> the finish reason."""
        async for _ in self:
            pass
        assert self.finish_reason is not None
        return self.finish_reason


class Session:
    def __init__(self, channel: Channel, opened: dict[str, Any]) -> None:
        self.channel = channel
        self.id: str = opened["session"]
        self.resume_token: str = opened["resume_token"]
        self.info = opened
        self.next_seq: int = opened.get("next_seq") or 0
        self.chat = bool(opened.get("chat"))  # appends are messages; replies become the assistant's messages
        self.closed = False
        self._lost_with: StreamserveClientError | None = None  # why the session ended, if not closed by us
        self.event_queue = EventQueue()  # voice events, bounded (events.py says what is dropped first)
        channel.attach(self.id, self.resume_token, self._on_lost, self._on_event, voice=bool(opened.get("voice")))

    async def append(self, text: str | None = None, token_ids: list[int] | None = None,
                     audio: tuple[np.ndarray | bytes, int] | None = None, image: np.ndarray | bytes | None = None, *,
                     message: dict[str, str] | list[dict[str, str]] | None = None, seq: int | None = None,
                     capture_time: float | None = None,
                     deadline_ms: float | None = None, kind: str | None = None, channels: int | None = None,
                     encoding: str = "pcm16") -> Ack:
        """Send a chunk (exactly one of text, token_ids, audio=(pcm, rate), image, or on a chat session
        message={"role": "system"|"user"|"assistant"|"tool", "content": str}, or a list of such messages
        appended together) and wait for its ack.
        `seq` defaults to the next number; `capture_time` (any clock) comes back in the ack's message;
        `deadline_ms`: how soon after it reaches the server the chunk should be in the KV cache.
        Audio: raw bytes in `encoding` ("pcm16", "float32", "g711_ulaw", "g711_alaw") with `channels` interleaved
        (default 1), or a numpy array (int16 or finite float samples in [-1, 1], [n] or [n, channels]: `channels`
        defaults to its shape's) sent as `encoding`. Its ack
        (0 tokens) says the server has it; what it hears comes as `events()`.
        Image: JPEG or PNG bytes, or an array (uint8 [H, W, 3], [H, W, 4] or [H, W]; float values in [0, 1]; a
        Pillow image works too), checked here before sending. On a text-only model the server appends a note of
        what the image shows when that changed (`kind` "video" by default: sheddable); an unchanged scene is
        acked with 0 tokens (docs/protocol.md, Images)."""
        self._check()
        if sum(x is not None for x in (text, token_ids, audio, image, message)) != 1:
            raise InvalidInputError("append takes exactly one of text, token_ids, audio, image, message")
        msg: dict[str, Any] = {"type": "append", "session": self.id, "text": text, "capture_time": capture_time,
                               "token_ids": None if token_ids is None else [int(t) for t in token_ids],
                               "deadline_ms": deadline_ms, "kind": kind, "message": message}
        if audio is not None:
            pcm, rate = audio
            channels = audio_channels(pcm, channels)
            msg.update(audio=audio_bytes(pcm, encoding), rate=int(rate), channels=channels, encoding=encoding)
            self.channel.voice_on(self.id)
        if image is not None:
            msg["image"] = image_payload(image, (self.channel.hello.get("image") or {}).get("max_pixels"))
        seq = self.next_seq if seq is None else seq
        msg["seq"] = seq
        limit = self.channel.hello.get("limits", {}).get("max_frame_bytes")
        if limit is not None and len(pack(msg)) > limit:
            raise InvalidInputError(f"this chunk is over the server's frame limit of {limit} bytes; split it")
        self.next_seq = seq + 1
        return await self.channel.append(self.id, seq, msg)

    def respond(self, max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                top_k: int | None = None, seed: int | None = None, stop: list[str] | None = None) -> Response:
        """A reply to everything appended so far: `async for delta in session.respond(...)`.
        Parameters left out take the session's defaults (set at open or by `configure`)."""
        self._check()
        return Response(self, {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                               "top_k": top_k, "seed": seed, "stop": stop})

    async def cancel(self) -> None:
        """Stop the running reply (its iteration ends with finish_reason "cancelled")."""
        self._check()
        await self.channel.send({"type": "cancel", "session": self.id})

    async def rewind(self, to_seq: int | None = None, to: int | None = None, to_message: int | None = None) -> int:
        """Forget everything after chunk `to_seq` (kept) or token position `to`, or (chat sessions) keep the first
        `to_message` messages (a chat session keeps whole messages); -> the session's length."""
        reply = await self.channel.request({"type": "rewind", "session": self.id, "to_seq": to_seq, "to": to,
                                            "to_message": to_message})
        self.next_seq = reply.get("next_seq", self.next_seq)
        return int(reply["tokens"])

    async def configure(self, chunk_budget_ms: float | None = None, voice: dict[str, Any] | None = None,
                        **sampling: Any) -> dict[str, Any]:
        """Change the session's reply defaults (max_tokens, temperature, top_p, top_k, seed, stop), its
        chunk deadline budget, or its voice settings (docs/protocol.md, Voice: {"input": {...},
        "turn_detection": {...} or False, "speak": True/False or {...}}; keys left out keep their value)."""
        if voice is not None:
            self.channel.voice_on(self.id)
        return await self.channel.request({"type": "configure", "session": self.id, "voice": voice,
                                           "chunk_budget_ms": chunk_budget_ms, "sampling": sampling or None})

    async def commit(self) -> dict[str, Any]:
        """End the utterance being spoken now (turn detection off, or the application's decision); -> the
        server's `committed` message ({text, audio_start_ms, audio_end_ms}; text "" when no audio was buffered)."""
        self._check()
        return await self.channel.request({"type": "commit", "session": self.id})

    async def events(self) -> AsyncIterator[Event]:
        """The session's voice events, in order, until it is closed: speech started/stopped, transcript
        delta/partial/final, reply text and reply audio (events.py). Read them steadily: the queue is bounded
        and drops the oldest reply audio first (`event_queue.dropped_audio` counts it)."""
        while True:
            event = await self.event_queue.get()
            if isinstance(event, SessionEnded):
                return
            yield event

    async def close(self) -> None:
        if not self.closed:
            try:
                await self.channel.request({"type": "close", "session": self.id})
            except StreamserveClientError:
                pass  # already gone on the server (or the connection is): either way it is closed here
            finally:
                self.channel.detach(self.id)
                self.closed = True

    def take_seq(self) -> int:
        """The next chunk seq, taken (a chat reply's generation prompt uses one)."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq

    def _check(self) -> None:
        if self._lost_with is not None:
            raise self._lost_with.copy()
        if self.closed:
            raise StreamserveClientError(f"session {self.id} is closed", code="session_closed")

    def _on_lost(self, error: StreamserveClientError | None) -> None:
        """From the channel: the session is gone (closed, moved, not resumable, or the connection is)."""
        self.closed = True
        self._lost_with = error
        self.event_queue.put(SessionEnded(error))

    def _on_event(self, m: dict[str, Any]) -> None:
        """From the channel: a voice message (or a reply message of a session taking audio)."""
        event = event_of(m)
        if isinstance(event, TranscriptDelta) and event.seq is not None:  # the server numbered a chunk of ours
            self.next_seq = max(self.next_seq, event.seq + 1)
        if event is not None:
            self.event_queue.put(event)


def audio_channels(pcm: np.ndarray | bytes, channels: int | None) -> int:
    """The channel count to send: bytes say none (`channels`, default 1); an array [n, c] has c (a `channels` that
    contradicts it is refused: its samples would be read as another layout)."""
    if isinstance(pcm, (bytes, bytearray, memoryview)):
        return 1 if channels is None else int(channels)
    shape = np.shape(pcm)
    if len(shape) not in (1, 2):
        raise InvalidInputError(f"audio arrays are [n] or [n, channels]; got shape {shape}")
    have = 1 if len(shape) == 1 else shape[1]
    if channels is not None and int(channels) != have:
        raise InvalidInputError(f"channels={channels} but the audio array has {have} (shape {shape})")
    return have


def audio_bytes(pcm: np.ndarray | bytes, encoding: str) -> bytes:
    """Audio to send: bytes as they are; an array [n] or [n, channels] (int16, or float in [-1, 1]) in `encoding`
    (pcm16 or float32; G.711 is sent as bytes)."""
    if isinstance(pcm, (bytes, bytearray, memoryview)):
        return bytes(pcm)
    a = np.asarray(pcm)
    if a.dtype.kind == "f" and not np.isfinite(a).all():  # the server refuses them; as pcm16 they would be noise
        raise InvalidInputError("audio samples must be finite (NaN or inf found)")
    if encoding == "float32":
        return (a.astype("<f4") if a.dtype.kind == "f" else (a.astype(np.float32) / 32768)).astype("<f4").tobytes()
    if encoding != "pcm16":
        raise InvalidInputError(f"send {encoding} audio as bytes (arrays are sent as pcm16 or float32)")
    if a.dtype.kind == "f":
        a = np.clip(np.rint(a * 32768.0), -32768, 32767)
    return a.astype("<i2").tobytes()


JPEG_MAGIC, PNG_MAGIC = b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n"


def image_payload(image: Any, max_pixels: int | None = None) -> bytes | dict[str, Any]:
    """An image to send: JPEG/PNG bytes as they are; an array in openpi's form (uint8, or float32 in [0, 1]).
    InvalidInputError for what the server would refuse (other bytes, shapes, dtypes, NaN, values out of range,
    more pixels than the server's `max_pixels`)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        if not data.startswith((JPEG_MAGIC, PNG_MAGIC)):
            raise InvalidInputError(f"image bytes must be a JPEG or PNG file (they start {data[:8].hex() or 'empty'}); "
                                    "send other images as an array")
        return data
    a = np.asarray(image)
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (1, 3, 4)) or 0 in a.shape:
        raise InvalidInputError(f"an image array is [H, W, 3], [H, W, 4] or [H, W]; got shape {list(a.shape)}")
    if max_pixels is not None and a.shape[0] * a.shape[1] > max_pixels:
        raise InvalidInputError(f"an image of {a.shape[1]} x {a.shape[0]} pixels is over the server's limit of "
                                f"{max_pixels}; scale it down")
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or a.min() < 0.0 or a.max() > 1.0:
            raise InvalidInputError("a float image array's values must be finite and in [0, 1]")
        a = a.astype("<f4")
    elif a.dtype != np.uint8:
        raise InvalidInputError(f"an image array is uint8 (0..255) or float (0..1), not {a.dtype}")
    return ndarray(a)
