"""`WS /v1/realtime`: the OpenAI Realtime API's protocol adapter (docs/realtime.md).

One connection is one Realtime session, and its conversation is ONE persistent chat session on the session service
(opened at the greeting): items are appended as they arrive, instructions go through the chat template as system
messages, a response appends only its generation prompt and its reply is recorded as the assistant's message.
Client events are parsed by events.py (I/O-free) and answered with server events; a client's mistake is an `error`
event carrying the API's error type, a code and the offending event's id, and the connection goes on.
Audio (input buffer, VAD turns, transcription; spoken replies) is listening.py's and response.py's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from streamserve.server.adapters import protocol as P
from streamserve.server.adapters.adapter import ProtocolAdapter
from streamserve.server.adapters.realtime import events as E
from streamserve.server.adapters.realtime import settings as S
from streamserve.server.adapters.realtime.conversation import Conversation, Entry, Item, common_prefix, message_of
from streamserve.server.adapters.realtime.events import RealtimeError, event
from streamserve.server.adapters.realtime.inbox import Inbox
from streamserve.server.adapters.realtime.items import ItemEvents
from streamserve.server.adapters.realtime.response import ResponseRun, usage
from streamserve.server.service.auth import Grant
from streamserve.server.service.results import (
    AppendRequest,
    ChunkResult,
    OpenRequest,
    Pushed,
    ReplyDelta,
    ReplyDone,
    ServiceError,
)
from streamserve.server.service.service import SessionService
from streamserve.server.transports.transport import Frame, Transport

if TYPE_CHECKING:
    from streamserve.server.adapters.realtime.listening import InputAudio
    from streamserve.server.adapters.realtime.media import MediaPath
    from streamserve.server.media.voice.speculate import Gate

log = logging.getLogger("streamserve.server")
KEEP_SPOKEN = 8  # recent audio responses whose Speaker is kept for conversation.item.truncate


class RealtimeConnection(ItemEvents, ProtocolAdapter):
    def __init__(self, service: SessionService, transport: Transport, grant: Grant, messages: Counter,
                 media: MediaPath | None = None) -> None:
        super().__init__(service, transport, grant)
        self.messages = messages
        self.media = media  # a WebRTC call's tracks (realtime/media.py); None: audio travels in events
        self.voice = service.voice is not None
        self.settings = S.Settings(model=service.engine.name, output_modalities=("audio",) if self.voice else ("text",),
                                   turn_detection=S.TurnDetection() if self.voice else None, id=E.new_id("sess_"))
        self.conv = Conversation()
        self.conversation_id = E.new_id("conv_")
        self.session: str | None = None  # the chat session's id
        self.seq = 0  # the chunk seqs this connection gives its session (its own counter: they must grow)
        self.acks: dict[int, tuple[Item | None, str | None]] = {}  # seq -> (item, client event id) awaiting an ack
        self.instructions: str | None = None  # set and not yet in the session
        self.current: ResponseRun | None = None
        self.idle = asyncio.Event()  # no response running
        self.idle.set()
        self.cached = 0  # session tokens at the end of the last response: already in the KV cache
        self.spoken: dict[str, ResponseRun] = {}  # item id -> recent audio response (truncate asks its Speaker)
        self.audio: InputAudio | None = None
        self.announced: set[str] = set()  # item ids whose conversation.item.added has gone out
        self.waiting: dict[int, asyncio.Future[None]] = {}  # seq -> a rebuild waiting for its ack
        self.early: dict[str, ChunkResult] = {}  # item id -> its ack, come before the item was announced
        transport.on_detach(self.forget)  # after the service's detach (registered first, in ProtocolAdapter)

    def forget(self) -> None:
        """The connection ended: the Realtime API has no resume, so its session closes now (not after a TTL)."""
        if self.current is not None:
            self.current.cancel("client_cancelled")  # nobody hears it: its speech stops at once
        for waiter in self.waiting.values():  # a rebuild waiting for an ack that will never come (the Listener's
            if not waiter.done():  # worker may be the one waiting, and its close waits for it)
                waiter.set_exception(RealtimeError("the connection ended", "session_closed"))
        self.waiting.clear()
        if self.session is not None and (entry := self.service.registry.find(self.session)) is not None:
            self.service.chats.forget(self.session)
            self.service.abandon(entry)

    async def run(self) -> None:
        """Frames are read by the Inbox's task (pings answered at once, inbox.py) and handled here in order."""
        self.transport.start()
        inbox = Inbox(self.parse, self.audio_ms, 1e3 * self.service.config.max_audio_buffer_s, self.error,
                      self.transport.close,  # closes after MAX_BAD_FRAMES malformed frames, as native does
                      account=self.service.budget.account(self.ctx))  # waiting audio counts as this connection's
        reader = asyncio.create_task(inbox.read(self.transport.frames()), name="streamserve-realtime-reader")
        try:
            await self.greet()
            async for waiting in inbox:
                await self.dispatch(waiting.event, waiting.error)
        finally:
            reader.cancel()
            await asyncio.wait({reader})
            await self.transport.finish()
            if self.audio is not None:  # the Listener's worker and any transcription in flight end with it
                await self.audio.close()

    async def send(self, message: dict[str, Any]) -> None:
        await self.transport.send(E.encode(message))

    async def error(self, e: BaseException | ServiceError, event_id: str | None = None) -> None:
        await self.send(E.error_event(E.from_service(e, event_id)))

    # ---- greeting and dispatch -----------------------------------------------------------------------
    async def greet(self) -> None:
        if self.session is None:  # a WebRTC call opened it before answering its offer
            try:
                await self.open_session()
            except Exception as e:  # no chat template, no room: nothing can be served on this connection
                await self.error(e)
                await self.transport.close(P.CLOSE_BAD_CLIENT if E.from_service(e).kind == "invalid_request_error"
                                           else P.CLOSE_INTERNAL, "cannot open the conversation's session")
                return
        await self.send(event("session.created", session=S.render(self.settings)))

    async def open_session(self) -> None:
        """The conversation's chat session (and the input audio's Listener); raises what the service refuses."""
        opened = await self.service.open(self.ctx, OpenRequest(), chat=True)
        self.session = opened.session
        if self.voice:
            from streamserve.server.adapters.realtime.listening import InputAudio

            self.audio = InputAudio(self)

    def parse(self, frame: Frame) -> E.ClientEvent:
        ev = E.parse(frame, self.service.config.max_frame_bytes)
        self.messages.labels(ev.type).inc()
        return ev

    def audio_ms(self, ev: E.ClientEvent) -> float:
        """Audio an event carries (by its base64 length; 0 without voice: such appends are refused at once)."""
        audio = ev.body.get("audio") if ev.type == "input_audio_buffer.append" and self.voice else None
        return self.settings.input_audio.duration_ms(len(audio) * 3 // 4) if isinstance(audio, str) else 0.0

    async def handle(self, frame: Frame) -> None:  # one frame read and handled (run() reads apart: an Inbox)
        try:
            await self.dispatch(self.parse(frame))
        except RealtimeError as e:  # from parse only: dispatch answers its own errors
            await self.dispatch(None, e)

    async def dispatch(self, ev: E.ClientEvent | None, invalid: RealtimeError | None = None) -> None:
        """One client event (or the error of a frame that was none), answered; the connection goes on."""
        try:
            if ev is None:
                raise invalid or RealtimeError("the frame is no event", "invalid_event")
            if self.session is None:
                raise RealtimeError("this connection has no conversation (see the error before)", "session_closed")
            await getattr(self, "on_" + ev.type.replace(".", "_"))(ev)
        except Exception as e:  # a client's mistake or a refusal: an error event, and the connection goes on
            await self.error(e, ev.event_id if ev is not None else None)

    # ---- session ------------------------------------------------------------------------------------
    async def on_session_update(self, ev: E.ClientEvent) -> None:
        new = S.update(self.settings, ev.body.get("session"), self.voice, self.service.config.max_reply_tokens)
        if new.instructions != self.settings.instructions:
            self.instructions = new.instructions or None  # goes in with the next message (docs: a difference)
        if self.audio is not None:
            self.audio.configure(new)
        self.settings = new
        await self.send(event("session.updated", session=S.render(new)))

    def take_instructions(self) -> list[Entry]:
        text, self.instructions = self.instructions, None
        return [Entry({"role": "system", "content": text})] if text else []

    # ---- appending to the chat session -----------------------------------------------------------------
    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    async def append(self, entries: list[Entry], event_id: str | None = None, item: Item | None = None,
                     kind: str = "text") -> int:
        """Append entries' messages as one chunk (in the chat's order); its ack (conversation.item.done for `item`)
        or error arrives pushed. `kind`: the chunk's (video: a camera note, sheddable)."""
        assert self.session is not None
        if self.audio is not None and self.audio.spec is not None:  # a response held at the likely end of a turn:
            await self.audio.spec.gate.settled.wait()  # released or taken back first (the chat returns to its mark)
        seq = self.next_seq()
        msgs = [e.message for e in entries]
        self.acks[seq] = (item, event_id)
        try:
            await self.service.append(self.ctx, self.session, AppendRequest(seq=seq, kind=kind),
                                      msgs if len(msgs) > 1 else msgs[0])
        except BaseException:
            self.acks.pop(seq, None)
            raise
        self.conv.entries += entries
        return seq

    async def add_item(self, item: Item, position: int | None = None, event_id: str | None = None,
                       kind: str = "text") -> None:
        """A new item into the conversation and the session: at the end, or at `position` (a rewind)."""
        self.conv.check_room()
        entry = Entry(message_of(item), item)
        if position is None or position >= len(self.conv.entries):
            await self.append([*self.take_instructions(), entry], event_id, item, kind)
        else:
            await self.rebuild(self.conv.with_entry_at(position, entry), event_id, item)
        previous = self.conv.previous_id(item)
        await self.send(event("conversation.item.added", previous_item_id=previous, item=item.render()))
        self.announced.add(item.id)
        if (early := self.early.pop(item.id, None)) is not None:  # acked before it was announced
            await self.acked(early)

    async def rebuild(self, wanted: list[Entry], event_id: str | None = None, item: Item | None = None) -> None:
        """Make the session's messages `wanted`: rewind to the first that changes, append the rest again (their
        tokens are the cost). A running response is cancelled and recorded first."""
        assert self.session is not None
        if self.audio is not None and self.audio.streaming:
            raise RealtimeError("the person is speaking: their message is being streamed into the session; retry "
                                "after its input_audio_buffer.committed", "conversation_busy")
        await self.stop_response("client_cancelled")
        keep = common_prefix(self.conv.entries, wanted)
        rewound = await self.service.rewind(self.ctx, self.session, None, None, keep)
        chat = self.service.chats.get(self.session)
        kept = len(chat.messages) if chat is not None else 0  # messages appended together go back together
        self.cached = min(self.cached, rewound.tokens)
        self.conv.entries = list(self.conv.entries[:kept])
        if wanted[kept:]:  # done when the messages are in again (the next event sees the session as it stands)
            acked = asyncio.get_running_loop().create_future()
            self.waiting[await self.append(wanted[kept:], event_id, item)] = acked
            await acked

    # ---- responses ----------------------------------------------------------------------------------------
    async def on_response_create(self, ev: E.ClientEvent) -> None:
        if self.audio is not None:  # after the person's message (busy while they speak)
            await self.audio.utterance_end()
        if self.current is not None:
            raise RealtimeError(f"Conversation already has an active response in progress: {self.current.id}. Wait "
                                "for it to finish (response.done) or cancel it (response.cancel)",
                                "conversation_already_has_active_response")
        params = S.response_params(ev.body, self.settings, self.voice, self.service.config.max_reply_tokens)
        await self.respond(*params, event_id=ev.event_id)

    async def respond(self, modalities: tuple[str, ...], max_tokens: int | None, instructions: str | None = None,
                      event_id: str | None = None, gate: Gate | None = None) -> ResponseRun:
        """Start a response: its events, the instructions (session's, then this response's) as system messages,
        the chat reply (its generation prompt is the only other thing appended). `gate`: its output is held there
        (a response speculated at the likely end of a turn: realtime/speculation.py)."""
        assert self.session is not None
        if self.media is not None and gate is None:  # (a speculated one starts only when no note waits)
            await self.media.before_reply()
        item = Item(E.new_id("item_"), "assistant", [], "in_progress")
        fmt = S.render(self.settings)["audio"]["output"]["format"]
        previous = self.conv.items[-1].id if self.conv.items else None
        run = ResponseRun(self.send if gate is None else gate.wrap(self.send), item, modalities, max_tokens,
                          self.settings.voice, fmt, self.conversation_id, previous, E.new_id("resp_"), gate)
        if run.audio and self.audio is not None:
            run.speaker = self.audio.speaker(run)
            self.spoken[item.id] = run  # truncatable at once: clients truncate right at speech_started
            while len(self.spoken) > KEEP_SPOKEN:
                self.spoken.pop(next(iter(self.spoken)))
        self.current = run
        self.idle.clear()
        await run.start()
        try:
            system = self.take_instructions()
            if instructions:
                system.append(Entry({"role": "system", "content": instructions}))
            if system:
                await self.append(system, event_id)
            self.conv.check_room()
            limit = self.service.config.max_reply_tokens if max_tokens is None else max_tokens
            self.service.respond(self.ctx, self.session, {"max_tokens": limit, "seq": self.next_seq()})
        except Exception as e:
            await self.end_response(run, "error", None, {}, E.from_service(e, event_id))
            raise
        self.conv.entries.append(Entry({"role": "assistant", "content": ""}, item))  # the reply fills it
        return run

    async def stop_response(self, reason: str) -> None:
        """Cancel the running response (if any) and wait until it is recorded and its response.done sent."""
        if self.current is not None and self.session is not None:
            self.current.cancel(reason)
            self.service.cancel(self.ctx, self.session)
        await self.idle.wait()

    async def on_response_cancel(self, ev: E.ClientEvent) -> None:
        rid = E.opt_str(ev.body, "response_id", "response_id")
        if self.current is None or (rid is not None and rid != self.current.id):
            raise RealtimeError("Cancellation failed: no active response found", "response_cancel_not_active")
        assert self.session is not None
        self.current.cancel("client_cancelled")
        self.service.cancel(self.ctx, self.session)

    async def on_output_audio_buffer_clear(self, ev: E.ClientEvent) -> None:
        if self.media is None:
            raise S.webrtc_only()
        await self.media.clear()

    async def end_response(self, run: ResponseRun, reason: str, recorded: str | None, used: dict[str, int],
                           error: RealtimeError | None = None) -> None:
        """The reply ended: the entry takes the recorded message (or goes), the done events leave."""
        at = self.entry_of(run.item)
        if at is not None and recorded is None:
            del self.conv.entries[at]
        elif at is not None:
            self.conv.entries[at] = Entry({"role": "assistant", "content": recorded or ""}, run.item)
        total = used.get("session_tokens", self.cached)
        out = used.get("completion_tokens", 0)
        try:
            await run.finish(reason, recorded, usage(max(0, total - out), min(self.cached, total), out), error)
        finally:
            self.cached = total
            if recorded is None:  # its item is gone: nothing left to truncate
                self.spoken.pop(run.item.id, None)
            if self.current is run:
                self.current = None
                self.idle.set()
            audio, media = self.audio, self.media
            if audio is not None and recorded is not None:  # (a held response's: once it is released)
                run.then(lambda: audio.response_ended(run))
            if media is not None and run.speaker is not None:
                run.then(lambda: media.reply_done(run))

    # ---- audio events (listening.py) -------------------------------------------------------------------
    def input_audio(self) -> InputAudio:
        if self.audio is None:
            raise S.no_voice()
        return self.audio

    async def on_input_audio_buffer_append(self, ev: E.ClientEvent) -> None:
        if self.media is not None:
            raise S.track_input()
        await self.input_audio().append(E.req_str(ev.body, "audio", "audio"))

    async def on_input_audio_buffer_commit(self, ev: E.ClientEvent) -> None:
        await self.input_audio().commit()

    async def on_input_audio_buffer_clear(self, ev: E.ClientEvent) -> None:
        await self.input_audio().clear()
        await self.send(event("input_audio_buffer.cleared"))

    # ---- what the service pushes ----------------------------------------------------------------------
    def render_pushed(self, result: Pushed) -> list[Frame]:
        if isinstance(result, ServiceError):
            return [E.encode(E.error_event(E.from_service(result)))]
        return []  # the rest is handled in push (it changes state and may wait for audio)

    async def push(self, result: Pushed) -> None:
        try:
            if isinstance(result, ReplyDelta) and self.current is not None:
                await self.current.delta(result.text)
            elif isinstance(result, ReplyDone) and self.current is not None:
                await self.reply_done(self.current, result)
            elif isinstance(result, ChunkResult):
                await self.acked(result)
            else:
                await super().push(result)
        except Exception as e:  # never let a rendering fault kill the service task that pushes
            log.exception("streamserve: realtime push failed")
            await self.error(e)

    async def reply_done(self, run: ResponseRun, done: ReplyDone) -> None:
        chat = self.service.chats.get(done.session)
        recorded, at = None, self.entry_of(run.item)
        if done.response and chat is not None and at is not None and at < len(chat.messages) \
                and chat.messages[at]["role"] == "assistant":
            recorded = chat.messages[at]["content"]
        await self.end_response(run, done.reason, recorded, done.usage)

    def entry_of(self, item: Item) -> int | None:
        return next((i for i, e in enumerate(self.conv.entries) if e.item is item), None)

    async def acked(self, result: ChunkResult) -> None:
        waiter = self.waiting.pop(result.seq or 0, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        item, event_id = self.acks.pop(result.seq, (None, None)) if result.seq is not None else (None, None)
        if item is not None and item.id not in self.announced:
            self.early[item.id] = result
            self.acks[result.seq or 0] = (item, event_id)  # popped again when it is handled
            return
        if result.error is not None:
            if item is not None:  # it never reached the session
                self.conv.entries = [e for e in self.conv.entries if e.item is not item]
            await self.error(result.error, event_id)
        elif item is not None:
            await self.send(event("conversation.item.done", previous_item_id=self.conv.previous_id(item),
                                  item=item.render()))
