"""The Realtime session's audio: the input audio buffer over a `Listener` (server VAD turns, streaming transcription
with local agreement) and the `Speaker` of each spoken response. Imported only when the server has voice.

Input: `input_audio_buffer.append` feeds the Listener (decoded and resampled once, bounded by max_audio_buffer_s).
With server_vad, speech start is `input_audio_buffer.speech_started` (and cancels a running response when
interrupt_response); words agreed by two transcription passes are `conversation.item.input_audio_transcription.delta`
as the person speaks; at the end of speech the utterance is committed as a user item whose transcript is the
message the model reads, and (create_response) a response starts. idle_timeout_ms: after a response's audio has
played out, that long without speech triggers `input_audio_buffer.timeout_triggered` and a response.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import time
from typing import TYPE_CHECKING, Any

from streamserve.media.audio import AudioInput
from streamserve.server.realtime.conversation import Item, with_transcripts
from streamserve.server.realtime.events import RealtimeError, event, new_id
from streamserve.server.realtime.response import ResponseRun
from streamserve.server.realtime.settings import Settings, TurnDetection
from streamserve.server.voice.listen import (
    Listener,
    SpeechStarted,
    SpeechStopped,
    TranscriptDelta,
    TranscriptDone,
)
from streamserve.server.voice.speak import Speaker

if TYPE_CHECKING:
    from streamserve.server.realtime.connection import RealtimeConnection

WHISPER_RATE = 16000


def vad_config(td: TurnDetection | None) -> Any:
    from streamserve.media.vad import VADConfig

    if td is None:
        return None
    return VADConfig(td.threshold, td.prefix_padding_ms, td.silence_duration_ms, td.idle_timeout_ms).check()


class InputAudio:
    def __init__(self, conn: RealtimeConnection) -> None:
        self.conn = conn
        voice = conn.service.voice
        assert voice is not None
        self.runtime = voice
        s = conn.settings
        self.listener = Listener(voice, s.input_audio, vad_config(s.turn_detection), self.on_event)
        self.item_id: str | None = None  # the user item the utterance being heard becomes
        self.idle_timer: asyncio.Task | None = None

    @property
    def settings(self) -> Settings:
        return self.conn.settings

    def configure(self, new: Settings) -> None:
        self.listener.configure(fmt=new.input_audio, turn_detection=vad_config(new.turn_detection))

    # ---- client events ---------------------------------------------------------------------------------
    async def append(self, audio: str) -> None:
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("audio is not valid base64", "invalid_value", "audio") from None
        await self.listener.append(data)

    async def commit(self) -> None:
        done = await self.listener.commit()
        if done is None:
            raise RealtimeError("Error committing input audio buffer: the buffer holds no speech to commit",
                                "input_audio_buffer_commit_empty")
        await self.committed(done)

    async def clear(self) -> None:
        await self.listener.clear()
        self.item_id = None

    # ---- the Listener's events -------------------------------------------------------------------------
    async def on_event(self, ev: Any) -> None:
        conn = self.conn
        if isinstance(ev, SpeechStarted):
            self.cancel_idle()
            self.item_id = new_id("item_")
            await conn.send(event("input_audio_buffer.speech_started", audio_start_ms=int(ev.audio_start_ms),
                                  item_id=self.item_id))
            td = self.settings.turn_detection
            if conn.current is not None and td is not None and td.interrupt_response and conn.session is not None:
                conn.current.cancel("turn_detected")  # barge-in: its audio stops now, the reply within one step
                conn.service.cancel(conn.ctx, conn.session)
        elif isinstance(ev, SpeechStopped):
            await conn.send(event("input_audio_buffer.speech_stopped", audio_end_ms=int(ev.audio_end_ms),
                                  item_id=self.current_id()))
        elif isinstance(ev, TranscriptDelta) and ev.text and self.settings.transcription:
            await conn.send(event("conversation.item.input_audio_transcription.delta", item_id=self.current_id(),
                                  content_index=0, delta=ev.text, logprobs=None))
        elif isinstance(ev, TranscriptDone):
            await self.committed(ev)

    def current_id(self) -> str:
        if self.item_id is None:
            self.item_id = new_id("item_")
        return self.item_id

    async def committed(self, done: TranscriptDone) -> None:
        """The utterance ends: it becomes a user item (its transcript the message), then maybe a response."""
        conn = self.conn
        item_id, self.item_id = self.current_id(), None
        if any(it.id == item_id for it in conn.conv.items):
            return  # committed already (the Listener's event after a manual commit)
        item = Item(item_id, "user", [{"type": "input_audio", "audio": None, "transcript": done.text}])
        previous = conn.conv.items[-1].id if conn.conv.items else None
        await conn.send(event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous))
        await conn.add_item(item)
        if self.settings.transcription:
            seconds = max(0.0, (done.audio_end_ms - done.audio_start_ms) / 1e3)
            await conn.send(event("conversation.item.input_audio_transcription.completed", item_id=item_id,
                                  content_index=0, transcript=done.text, logprobs=None,
                                  usage={"type": "duration", "seconds": round(seconds, 3)}))
        td = self.settings.turn_detection
        if td is None or not td.create_response or not done.text.strip():
            return
        if conn.current is not None:
            if conn.current.cancel_reason is None:
                return  # a response runs on (interrupt_response false): no second one
            await conn.idle.wait()  # the interrupted one is being recorded (within one engine step)
        await conn.respond(self.settings.output_modalities, self.settings.max_output_tokens)

    # ---- spoken responses and the idle timeout ---------------------------------------------------------
    def speaker(self, run: ResponseRun) -> Speaker:
        return Speaker(self.runtime, self.settings.output_audio, run.audio_delta)

    def response_ended(self, run: ResponseRun) -> None:
        td = self.settings.turn_detection
        if td is None or td.idle_timeout_ms is None or run.cancel_reason is not None:
            return
        self.cancel_idle()
        delay = run.audio_end() - time.monotonic() + td.idle_timeout_ms / 1e3
        self.idle_timer = asyncio.create_task(self.idle_timeout(delay))
        self.conn.ctx.tasks.add(self.idle_timer)  # cancelled with the connection's tasks
        self.idle_timer.add_done_callback(self.conn.ctx.tasks.discard)

    def cancel_idle(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    async def idle_timeout(self, delay: float) -> None:
        await asyncio.sleep(max(0.0, delay))
        conn = self.conn
        if conn.current is not None or self.listener.audio_ms is None:
            return
        now = int(self.listener.audio_ms)
        td = self.settings.turn_detection
        start = max(0, now - (td.idle_timeout_ms or 0)) if td is not None else now
        await conn.send(event("input_audio_buffer.timeout_triggered", audio_start_ms=start, audio_end_ms=now,
                              item_id=self.current_id()))
        self.item_id = None
        with contextlib.suppress(Exception):  # a refused response is reported by respond itself
            await conn.respond(self.settings.output_modalities, self.settings.max_output_tokens)

    # ---- items the client creates with audio ------------------------------------------------------------
    async def transcribe_item(self, item: Item, audio: list[bytes]) -> Item:
        """input_audio parts without a transcript: decoded from the session's input format and transcribed."""
        texts = []
        for data in audio:
            decoder = AudioInput(self.settings.input_audio, WHISPER_RATE)
            samples = decoder.feed(data)  # AudioFormatError (typed) for audio not in the session's format
            texts.append(await self.runtime.run(self.runtime.whisper.transcribe, samples))
        return with_transcripts(item, texts)

    async def close(self) -> None:
        self.cancel_idle()
        await self.listener.close()
