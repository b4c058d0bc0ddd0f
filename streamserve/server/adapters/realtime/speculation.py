"""A Realtime response started at the likely end of a turn, held until the turn is confirmed (the mechanism:
server/media/voice/speculate.py). WebSocket and WebRTC alike: the response's events and its audio (events, or the call's
outgoing track) go through the speculation's Gate.

At `TurnLikely` (InputAudio.on_event): the chat is marked (engine/chat_mark.py), the person's message gets the
words not yet in it and ends, its user item takes its place in the conversation (not announced), and the response
starts with its output held. Then:
- confirmed (InputAudio.committed: the final transcript equals the speculated one): the item is announced
  (`input_audio_buffer.committed`, `conversation.item.added`/`done`, the transcription's `completed`) and the held
  response follows: `response.created`, its deltas and audio, as if it had started just now;
- taken back (`TurnResumed`, a different final transcript, `input_audio_buffer.clear`): the held output is
  dropped, the response cancelled and, once it ended, the chat, the conversation and the open message are as at
  the mark; the final deltas that arrived meanwhile go into the message again. The client saw nothing of it.
A response is speculated only when nothing else would go in first (no response running, no camera note, no
truncation or instructions waiting).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from streamserve.engine.chat_mark import ChatMark
from streamserve.server.adapters.realtime.conversation import Entry, Item
from streamserve.server.media.voice.speculate import Gate

if TYPE_CHECKING:
    from streamserve.server.adapters.realtime.host import Host
    from streamserve.server.adapters.realtime.response import ResponseRun
    from streamserve.server.adapters.realtime.settings import Settings
    from streamserve.server.media.voice.listen_events import TurnLikely
    from streamserve.server.media.voice.runtime import VoiceRuntime

log = logging.getLogger("streamserve.voice")


class InputAudio(Protocol):
    """What a speculation needs of the connection's input audio (realtime/listening.py's InputAudio, which calls
    this module)."""

    conn: Host
    runtime: VoiceRuntime
    placeholder: Entry | None
    pending: list[asyncio.Future[Any]]
    after: list[Any]
    quiet: asyncio.Event

    @property
    def settings(self) -> Settings: ...
    @property
    def streaming(self) -> bool: ...
    def current_id(self) -> str: ...
    async def extend(self, text: str) -> None: ...
    async def end(self) -> dict[str, str] | None: ...


@dataclass
class Speculation:
    text: str  # the transcript it was started on: the final must equal it
    mark: ChatMark
    gate: Gate
    entries: list[Entry]  # the conversation at the mark (the open message's placeholder in it)
    placeholder: Entry | None
    cached: int  # the connection's cached tokens at the mark
    item: Item  # the person's item, announced if the turn is confirmed
    run: ResponseRun | None = None
    deltas: list[str] = field(default_factory=list)  # final deltas that came meanwhile (already in the message)


async def start(audio: InputAudio, ev: TurnLikely) -> Speculation | None:
    """End the person's message with `ev`'s words and start the response, held; None when it cannot be now."""
    conn = audio.conn
    td, counts = audio.settings.turn_detection, audio.runtime.speculations
    # not while something else must go in first: a barge-in's truncation (it rewinds the chat at the turn's end),
    # instructions set meanwhile (the reply takes them: a rewind would lose them)
    busy = conn.current is not None or conn.ctx.gone or conn.session is None or not audio.streaming \
        or bool(audio.after) or conn.instructions is not None
    if not counts.enabled or td is None or not td.create_response or busy \
            or (conn.media is not None and not conn.media.quiet()):
        return None
    chat = conn.service.chats.get(conn.session)
    if chat is None:
        return None
    if audio.pending:  # the message's chunks in: the mark is taken between operations
        await asyncio.wait(audio.pending)
        if any(f.cancelled() or f.exception() is not None for f in audio.pending):
            return None  # the message's end reports it
    try:
        at_mark = chat.mark()
    except Exception:  # a reply the client asked for runs on: no speculation
        return None
    placeholder, entries, cached = audio.placeholder, list(conn.conv.entries), conn.cached
    if ev.tail:
        await audio.extend(ev.tail)
    message = await audio.end()  # failures reported (as at a confirmed end), the message dropped
    audio.placeholder = None
    at = next((i for i, e in enumerate(conn.conv.entries) if e is placeholder), None)
    if message is None or at is None:
        audio.quiet.set()
        return None
    item = Item(audio.current_id(), "user", [{"type": "input_audio", "audio": None, "transcript": message["content"]}])
    conn.conv.entries[at] = Entry(message, item)
    spec = Speculation(ev.text, at_mark, Gate(), entries, placeholder, cached, item)
    try:
        spec.run = await conn.respond(audio.settings.output_modalities, audio.settings.max_output_tokens,
                                      gate=spec.gate)
    except Exception:  # refused (its error went into the gate): back to the mark; the confirmed end tries again
        await take_back(audio, spec)
        return None
    counts.count("started")
    return spec


async def take_back(audio: InputAudio, spec: Speculation) -> None:
    """Drop the held output, end the response, and return the chat and the conversation to the mark."""
    conn = audio.conn
    spec.gate.discard()
    run = spec.run
    if run is not None:
        audio.runtime.speculations.count("taken_back")
    if run is not None:
        run.cancel("turn_detected")
        if conn.current is run and conn.session is not None:
            conn.service.cancel(conn.ctx, conn.session)
        while conn.current is run:  # its end is recorded (within one engine step), its done events dropped
            await conn.idle.wait()
        conn.spoken.pop(run.item.id, None)
    chat = conn.service.chats.get(conn.session) if conn.session is not None else None
    if chat is None:  # the session is gone: nothing to return to
        return
    try:
        await chat.restore_async(conn.service.chats.offload, spec.mark)
    except Exception as e:  # e.g. an endless session's window moved on: the exchange stays, reported
        log.warning("streamserve: a speculative response could not be taken back: %s", e)
        await conn.error(e)
        audio.quiet.set()
        return
    conn.conv.entries, audio.placeholder, conn.cached = spec.entries, spec.placeholder, spec.cached
    audio.quiet.clear()  # the person's message is open again
    for text in spec.deltas:
        await audio.extend(text)


__all__ = ["Speculation", "start", "take_back"]
