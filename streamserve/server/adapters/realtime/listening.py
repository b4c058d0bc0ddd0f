"""The Realtime session's audio: the input audio buffer over a `Listener` (server VAD turns, streaming transcription
with local agreement) and the `Speaker` of each spoken response. Imported only when the server has voice.

Input: `input_audio_buffer.append` feeds the Listener (decoded and resampled once, bounded by max_audio_buffer_s and
by the connection's media account: server/media/media_budget.py).
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
from streamserve.server.adapters.realtime import speculation
from streamserve.server.adapters.realtime.conversation import Entry, Item, with_transcripts
from streamserve.server.adapters.realtime.events import RealtimeError, event, new_id
from streamserve.server.adapters.realtime.host import Host
from streamserve.server.adapters.realtime.response import ResponseRun
from streamserve.server.adapters.realtime.settings import Settings, TurnDetection
from streamserve.server.media.voice.listen import (
    Listener,
    SpeechStarted,
    SpeechStopped,
    TranscriptDelta,
    TranscriptDone,
    TurnLikely,
    TurnResumed,
)
from streamserve.server.media.voice.speak import Speaker

if TYPE_CHECKING:
    from streamserve.media.audio import AudioFormat

WHISPER_RATE = 16000


def vad_config(td: TurnDetection | None) -> Any:
    from streamserve.media.vad import VADConfig

    if td is None:
        return None
    if td.type == "semantic_vad":
        return VADConfig.semantic(td.eagerness, threshold=td.threshold, prefix_padding_ms=td.prefix_padding_ms)
    return VADConfig(td.threshold, td.prefix_padding_ms, td.silence_duration_ms, td.idle_timeout_ms).check()


class InputAudio:
    def __init__(self, conn: Host) -> None:
        self.conn = conn
        voice = conn.service.voice
        assert voice is not None
        self.runtime = voice
        s = conn.settings
        self.listener = Listener(voice, self.input_format(s), vad_config(s.turn_detection), self.on_event,
                                 max_buffer_s=conn.service.config.max_audio_buffer_s,
                                 account=conn.service.budget.account(conn.ctx))  # its backlog's bytes count there
        self.item_id: str | None = None  # the user item the utterance being heard becomes
        self.idle_timer: asyncio.Task | None = None
        # the utterance streamed into the session as a user message while it is said (ChatSessions.begin/extend/end)
        self.placeholder: Entry | None = None  # its place in the conversation, from its begin
        self.pending: list[asyncio.Future[Any]] = []  # its begin and extends, checked at its end
        self.after: list[tuple[Item, str]] = []  # truncations asked while it was open: done after its end
        self.quiet = asyncio.Event()  # no utterance open: set once the last one is an announced item (or dropped)
        self.quiet.set()
        self.spec: speculation.Speculation | None = None  # a response started at the likely end, held back

    @property
    def streaming(self) -> bool:
        return self.placeholder is not None

    @property
    def settings(self) -> Settings:
        return self.conn.settings

    def input_format(self, s: Settings) -> AudioFormat:
        """The session's input format, or a WebRTC call's microphone track's (session formats are the WebSocket's)."""
        return s.input_audio if self.conn.media is None else self.conn.media.input_format

    def configure(self, new: Settings) -> None:
        self.listener.configure(fmt=self.input_format(new), turn_detection=vad_config(new.turn_detection))

    # ---- client events ---------------------------------------------------------------------------------
    async def append(self, audio: str) -> None:
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("audio is not valid base64", "invalid_value", "audio") from None
        await self.listener.append(data)

    async def commit(self) -> None:
        if await self.listener.commit() is None:  # else its TranscriptDone was emitted: committed() did the rest
            raise RealtimeError("Error committing input audio buffer: the buffer holds no speech to commit",
                                "input_audio_buffer_commit_empty")

    async def clear(self) -> None:
        await self.listener.clear()
        if self.spec is not None:  # the speech it answered is dropped: so is it
            spec, self.spec = self.spec, None
            await speculation.take_back(self, spec)
        await self.abort()
        self.item_id = None

    async def utterance_end(self) -> None:
        """Wait until the utterance being streamed in is an item (its speech has stopped: its last pass is left);
        RealtimeError `conversation_busy` while the person still speaks (their message is open in the session, and
        their next audio waits behind the caller's event, so waiting could not end)."""
        if self.streaming and self.listener.speaking:
            raise RealtimeError("the person is speaking: their message is being streamed into the session; send "
                                "this after input_audio_buffer.speech_stopped (or commit the input audio buffer "
                                "first)", "conversation_busy")
        await self.quiet.wait()

    # ---- the utterance as a streamed user message -----------------------------------------------------------
    def chunk(self) -> dict[str, Any]:
        return {"seq": self.conn.next_seq()}

    async def begin(self) -> None:
        conn = self.conn
        assert conn.session is not None
        if (system := conn.take_instructions()):
            await conn.append(system)
        self.pending.append(conn.service.chats.begin(conn.session, "user", self.chunk()))
        self.placeholder = Entry({"role": "user", "content": ""})
        conn.conv.entries.append(self.placeholder)
        self.quiet.clear()

    async def extend(self, text: str) -> None:
        if not self.streaming:
            await self.begin()
        assert self.conn.session is not None
        self.pending.append(self.conn.service.chats.extend(self.conn.session, text, self.chunk()))

    async def settle(self) -> BaseException | None:
        """Wait for the streamed chunks; -> the first failure."""
        results = await asyncio.gather(*self.pending, return_exceptions=True)
        self.pending = []
        return next((r for r in results if isinstance(r, BaseException)), None)

    async def end(self) -> dict[str, str] | None:
        """The utterance's message ends: -> it as recorded, or None (aborted after a failure, reported)."""
        conn = self.conn
        assert conn.session is not None
        failure = await self.settle()
        if failure is None:
            try:
                return await conn.service.chats.end(conn.session, self.chunk())
            except Exception as e:
                failure = e
        await conn.error(failure)
        await self.abort()
        return None

    async def abort(self) -> None:
        conn = self.conn
        if self.placeholder is None or conn.session is None:
            return
        await self.settle()
        with contextlib.suppress(Exception):  # a session closed meanwhile: nothing to take out
            await conn.service.chats.abort(conn.session)
        conn.conv.entries = [e for e in conn.conv.entries if e is not self.placeholder]
        self.placeholder = None
        self.quiet.set()

    # ---- the Listener's events -------------------------------------------------------------------------
    async def on_event(self, ev: Any) -> None:
        conn = self.conn
        if isinstance(ev, SpeechStarted):
            self.cancel_idle()
            self.item_id = new_id("item_")
            if not self.streaming:
                await self.begin()
            await conn.send(event("input_audio_buffer.speech_started", audio_start_ms=int(ev.audio_start_ms),
                                  item_id=self.item_id))
            td = self.settings.turn_detection
            if conn.current is not None and td is not None and td.interrupt_response and conn.session is not None:
                conn.current.cancel("turn_detected")  # barge-in: its audio stops now, the reply within one step
                conn.service.cancel(conn.ctx, conn.session)
            if conn.media is not None and td is not None and td.interrupt_response:
                await conn.media.interrupted()  # a call's track plays on after its response: cleared, truncated
        elif isinstance(ev, SpeechStopped):
            await conn.send(event("input_audio_buffer.speech_stopped", audio_end_ms=int(ev.audio_end_ms),
                                  item_id=self.current_id()))
        elif isinstance(ev, TurnLikely) and self.spec is None:
            self.spec = await speculation.start(self, ev)
        elif isinstance(ev, TurnResumed) and self.spec is not None:
            spec, self.spec = self.spec, None
            await speculation.take_back(self, spec)
        elif isinstance(ev, TranscriptDelta) and ev.text:
            if self.spec is not None:  # the speculation put these words in already
                self.spec.deltas.append(ev.text)
            else:
                await self.extend(ev.text)  # agreed words go into the session now, while the person speaks
            if self.settings.transcription:
                await conn.send(event("conversation.item.input_audio_transcription.delta", item_id=self.current_id(),
                                      content_index=0, delta=ev.text, logprobs=None))
        elif isinstance(ev, TranscriptDone):
            await self.committed(ev)

    def current_id(self) -> str:
        if self.item_id is None:
            self.item_id = new_id("item_")
        return self.item_id

    async def committed(self, done: TranscriptDone) -> None:
        """The utterance ends: it becomes a user item (its transcript the message), then maybe a response (or the
        one speculated on this transcript is released)."""
        conn = self.conn
        spec, self.spec = self.spec, None
        if spec is not None and spec.text == done.text.strip() and spec.gate.holding:
            self.item_id = None
            await self.announce(spec.item, done)
            self.runtime.speculations.count("released")
            await spec.gate.release()  # the response's held events and audio, then the rest as it comes
            return
        if spec is not None:  # the words changed after all: the response goes, the final words get their own
            await speculation.take_back(self, spec)
        item_id, self.item_id = self.current_id(), None
        if not done.text.strip():  # noise: no item, no response
            await self.abort()
            return
        if not self.streaming:
            await self.extend(done.text)
        placeholder = self.placeholder
        message = await self.end()
        self.placeholder = None
        at = next((i for i, e in enumerate(conn.conv.entries) if e is placeholder), None)
        if message is None or at is None:
            self.quiet.set()
            return
        item = Item(item_id, "user", [{"type": "input_audio", "audio": None, "transcript": message["content"]}])
        conn.conv.entries[at] = Entry(message, item)
        await self.announce(item, done)
        td = self.settings.turn_detection
        if td is None or not td.create_response or conn.ctx.gone:  # gone: its session closed, nobody to answer
            return
        if conn.current is not None:
            if conn.current.cancel_reason is None:
                return  # a response runs on (interrupt_response false): no second one
            await conn.idle.wait()  # the interrupted one is being recorded (within one engine step)
        await conn.respond(self.settings.output_modalities, self.settings.max_output_tokens)

    async def announce(self, item: Item, done: TranscriptDone) -> None:
        """The person's item (in the conversation) goes out: committed, added, done, the transcription's end."""
        conn = self.conn
        previous = conn.conv.previous_id(item)
        await conn.send(event("input_audio_buffer.committed", item_id=item.id, previous_item_id=previous))
        await conn.send(event("conversation.item.added", previous_item_id=previous, item=item.render()))
        await conn.send(event("conversation.item.done", previous_item_id=previous, item=item.render()))
        conn.announced.add(item.id)
        self.quiet.set()  # a response asked for after the speech stopped follows this item
        if self.settings.transcription:
            seconds = max(0.0, (done.audio_end_ms - done.audio_start_ms) / 1e3)
            await conn.send(event("conversation.item.input_audio_transcription.completed", item_id=item.id,
                                  content_index=0, transcript=item.content[0]["transcript"], logprobs=None,
                                  languages=[{"code": "en"}],
                                  usage={"type": "duration", "seconds": round(seconds, 3)}))
        for cut, heard in self.after:  # truncations asked while the person spoke
            with contextlib.suppress(RealtimeError):  # an item deleted meanwhile
                await conn.truncate(cut, heard)
        self.after = []

    # ---- spoken responses and the idle timeout ---------------------------------------------------------
    def speaker(self, run: ResponseRun) -> Speaker:
        media, account = self.conn.media, self.conn.service.budget.account(self.conn.ctx)  # its unsent audio
        if media is None:  # (a held response's audio_delta events go through its gate: run.send)
            return Speaker(self.runtime, self.settings.output_audio, run.audio_delta, account)
        emit = media.emitter(run) if run.gate is None else run.gate.wrap(media.emitter(run))
        return Speaker(self.runtime, media.output_format, emit, account)

    async def truncate_heard(self, item: Item, heard: str) -> None:
        """Cut an assistant item to what was heard: now, or (the person speaks: their message is open in the
        session) right after their message ends."""
        if self.streaming:
            self.after.append((item, heard))
        else:
            await self.conn.truncate(item, heard)

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
        limit = self.conn.service.config.max_audio_buffer_s
        for data in audio:
            if self.settings.input_audio.duration_ms(len(data)) > 1e3 * limit:
                raise RealtimeError(f"an input_audio part is over this server's limit of {limit:g} s "
                                    "(max_audio_buffer_s)", "audio_too_long", "item.content")
            decoder = AudioInput(self.settings.input_audio, WHISPER_RATE)
            samples = decoder.feed(data)  # AudioFormatError (typed) for audio not in the session's format
            texts.append(await self.runtime.run(self.runtime.whisper.transcribe, samples))
        return with_transcripts(item, texts)

    async def close(self) -> None:
        self.cancel_idle()
        if self.spec is not None:  # nobody hears it: the connection ends
            self.spec.gate.discard()
        self.quiet.set()
        await self.listener.close()
        for fut in self.pending:  # the session closes with the connection: nothing waits for these
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: the failure of a closing session is no news
