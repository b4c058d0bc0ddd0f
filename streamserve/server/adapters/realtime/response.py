"""One Realtime response: the chat reply's text deltas (and, for audio, the Speaker's audio) as the API's event
sequence, every event carrying its response, item, output and content ids:

    response.created, response.output_item.added, conversation.item.added, response.content_part.added,
    response.output_text.delta* | (response.output_audio_transcript.delta* + response.output_audio.delta*),
    response.output_text.done | (response.output_audio.done + response.output_audio_transcript.done),
    response.content_part.done, response.output_item.done, conversation.item.done, response.done (with usage)

The reply runs in the session service (a chat reply, recorded as the assistant's message); this object only renders.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from streamserve.server.adapters.realtime.conversation import Item
from streamserve.server.adapters.realtime.events import RealtimeError, event

if TYPE_CHECKING:
    from streamserve.server.media.voice.speak import Speaker
    from streamserve.server.media.voice.speculate import Gate

Send = Callable[[dict[str, Any]], Awaitable[None]]
FINISH = {"stop": ("completed", None), "length": ("incomplete", "max_output_tokens"),
          "context": ("incomplete", "max_output_tokens"), "cancelled": ("cancelled", "client_cancelled")}


def usage(input_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    """The API's usage object. `input_tokens`: the context the reply was generated from (the whole session);
    `cached`: the part of it already in the KV cache before this turn (never computed again)."""
    return {"total_tokens": input_tokens + output_tokens, "input_tokens": input_tokens, "output_tokens": output_tokens,
            "input_token_details": {"text_tokens": input_tokens, "audio_tokens": 0, "image_tokens": 0,
                                    "cached_tokens": cached,
                                    "cached_tokens_details": {"text_tokens": cached, "audio_tokens": 0,
                                                              "image_tokens": 0}},
            "output_token_details": {"text_tokens": output_tokens, "audio_tokens": 0}}


class ResponseRun:
    def __init__(self, send: Send, item: Item, modalities: tuple[str, ...], max_output_tokens: int | None,
                 voice: str, audio_format: dict[str, Any], conversation_id: str, previous_item_id: str | None,
                 response_id: str, gate: Gate | None = None) -> None:
        self.send, self.item, self.modalities = send, item, modalities
        self.id, self.conversation_id, self.previous_item_id = response_id, conversation_id, previous_item_id
        self.max_output_tokens, self.voice, self.audio_format = max_output_tokens, voice, audio_format
        self.audio = modalities == ("audio",)
        self.speaker: Speaker | None = None
        self.gate = gate  # a speculated response's: its output held until the turn is confirmed (`send` is wrapped)
        self.text = ""
        self.cancel_reason: str | None = None  # client_cancelled or turn_detected, once cancelled
        self.status = "in_progress"
        self.audio_started: float | None = None  # monotonic time of the first audio delta
        self.ids = {"response_id": response_id, "item_id": item.id, "output_index": 0, "content_index": 0}

    # ---- rendering ---------------------------------------------------------------------------------------
    def part(self) -> dict[str, Any]:
        if self.audio:
            return {"type": "audio", "audio": None, "text": None, "transcript": self.text}
        return {"type": "text", "audio": None, "text": self.text, "transcript": None}

    def content(self) -> dict[str, Any]:
        if self.audio:
            return {"type": "output_audio", "audio": None, "transcript": self.text}
        return {"type": "output_text", "text": self.text}

    def response(self, status_details: dict[str, Any] | None = None, used: dict[str, Any] | None = None,
                 output: bool = False) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.response", "status": self.status, "status_details": status_details,
                "output": [self.item.render()] if output else [], "conversation_id": self.conversation_id,
                "output_modalities": list(self.modalities),
                "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
                "audio": {"output": {"format": self.audio_format, "voice": self.voice}}, "usage": used,
                "metadata": None}

    # ---- the sequence ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.item.status, self.item.content = "in_progress", []
        await self.send(event("response.created", response=self.response()))
        await self.send(event("response.output_item.added", response_id=self.id, output_index=0,
                              item=self.item.render()))
        await self.send(event("conversation.item.added", previous_item_id=self.previous_item_id,
                              item=self.item.render()))
        await self.send(event("response.content_part.added", **self.ids, part=self.part()))
        self.item.content = [self.content()]

    async def delta(self, text: str) -> None:
        if not text or self.status != "in_progress":
            return
        self.text += text
        self.item.content = [self.content()]
        kind = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
        await self.send(event(kind, **self.ids, delta=text))
        if self.speaker is not None and self.cancel_reason is None:
            self.speaker.feed(text)

    async def audio_delta(self, data: bytes) -> None:
        """The Speaker's emit: audio in the session's output format, base64 on the wire."""
        if self.cancel_reason is not None or not data:
            return
        if self.audio_started is None:
            self.audio_started = time.monotonic()
        await self.send(event("response.output_audio.delta", **self.ids, delta=base64.b64encode(data).decode()))

    def cancel(self, reason: str) -> None:
        """Barge-in or response.cancel: no more audio leaves (the reply itself is cancelled by the caller)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
        if self.speaker is not None:
            self.speaker.cancel()

    async def finish(self, reason: str, recorded: str | None, used: dict[str, Any],
                     error: RealtimeError | None = None) -> None:
        """The reply ended (`reason`: the service's finish reason); `recorded`: the assistant message the chat
        session keeps (None: none was recorded)."""
        if self.speaker is not None:
            if self.cancel_reason is None and reason != "cancelled":
                await self.speaker.finish()  # the rest of the audio leaves before the done events
            else:
                self.speaker.cancel()
            await self.speaker.wait_idle()  # nothing of it is left on the media executor
        status, why = FINISH.get(reason, ("failed", None))
        if self.cancel_reason is not None:
            status, why = "cancelled", self.cancel_reason
        details: dict[str, Any] | None = None
        if status == "failed":
            err = error or RealtimeError(f"the reply ended: {reason}", reason, kind="server_error")
            details = {"type": "failed", "reason": None,
                       "error": {"type": err.kind, "code": err.code, "message": err.message}}
        elif status != "completed":
            details = {"type": status, "reason": why, "error": None}
        if recorded is not None and not self.audio:
            self.text = recorded  # the text as the session keeps it (a stop string cut, say)
        self.status = status
        self.item.status = "completed" if status == "completed" else "incomplete"
        self.item.content = [self.content()]
        if self.audio:
            await self.send(event("response.output_audio.done", **self.ids))
            await self.send(event("response.output_audio_transcript.done", **self.ids, transcript=self.text))
        else:
            await self.send(event("response.output_text.done", **self.ids, text=self.text))
        await self.send(event("response.content_part.done", **self.ids, part=self.part()))
        await self.send(event("response.output_item.done", response_id=self.id, output_index=0,
                              item=self.item.render()))
        await self.send(event("conversation.item.done", previous_item_id=self.previous_item_id,
                              item=self.item.render()))
        await self.send(event("response.done", response=self.response(details, used, output=True)))

    def then(self, fn: Callable[[], Any]) -> None:
        """`fn` now, or (a held response) once its output is released; never if it is dropped."""
        if self.gate is None:
            fn()
        else:
            self.gate.then(fn)

    def audio_end(self) -> float:
        """When the client will have played the reply's audio (monotonic): its start plus its length."""
        if self.speaker is None or self.audio_started is None:
            return time.monotonic()
        return max(time.monotonic(), self.audio_started + self.speaker.audio_ms / 1e3)
