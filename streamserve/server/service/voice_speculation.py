"""A native voice session's reply speculated at the likely end of a turn, held until the turn is confirmed (the
mechanism: server/media/voice/speculate.py; the Realtime API's: server/adapters/realtime/speculation.py). Chat sessions
with turn detection and create_response: the reply's results (ReplyDelta, ReplyAudio, ReplyDone, ReplyAudioDone) reach
the connection through a `HeldListener` whose gate holds them until the speech's stop and final transcript confirm the
turn; if speech resumes, they are dropped, the reply is cancelled and, once it is recorded, the chat returns to its mark
(engine/chat_mark.py) with the person's message open again. (Split from voice_sessions.py, which calls this.)
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from streamserve.engine.chat_mark import ChatMark
from streamserve.server.media.voice.speculate import Gate
from streamserve.server.service.results import ReplyDone, ResultListener, service_error

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.server.media.voice.listen_events import TurnLikely
    from streamserve.server.media.voice.runtime import VoiceRuntime
    from streamserve.server.service.chat import ChatSessions
    from streamserve.server.service.registry import SessionRegistry

log = logging.getLogger("streamserve.voice")


class Voice(Protocol):
    """What a speculation needs of the service's voice sessions (voice_sessions.py's VoiceSessions, which calls
    this module)."""

    runtime: VoiceRuntime | None
    registry: SessionRegistry
    chats: ChatSessions

    def respond(self, ctx: Any, session_id: str, params: dict[str, Any], listener: Any = None) -> None: ...
    def cancel(self, session_id: str) -> None: ...
    async def report(self, session_id: str, e: BaseException) -> None: ...


class State(Protocol):
    """A session's voice state (voice_reply.py's VoiceState)."""

    vad: Any
    create_response: bool
    message_open: bool
    speaker: Any
    pending: list[Any]


class HeldListener:
    """A ResultListener whose pushes go through a gate; it notes the reply's end (ReplyDone) whatever the gate does."""

    def __init__(self, inner: ResultListener, gate: Gate) -> None:
        self.inner, self.gate = inner, gate
        self.ended = asyncio.Event()

    async def push(self, result: Any) -> None:
        try:
            await self.gate.send(self.inner.push, result)
        finally:
            if isinstance(result, ReplyDone):
                self.ended.set()

    def push_nowait(self, result: Any) -> bool:
        if self.gate.state == "open":
            return self.inner.push_nowait(result)
        return self.gate.hold_nowait(self.inner.push, result)  # held (bounded) or dropped


@dataclass
class NativeSpeculation:
    text: str  # the transcript it was started on: the final must equal it
    mark: ChatMark
    gate: Gate
    listener: HeldListener
    deltas: list[str] = field(default_factory=list)  # final deltas that came meanwhile (already in the message)


async def start(voice: Voice, session_id: str, st: State, ev: TurnLikely) -> NativeSpeculation | None:
    """End the person's streamed message with `ev`'s words and start the reply, held; None when it cannot be now
    (a plain session, a reply running or still speaking, speculation off)."""
    entry, chat, runtime = voice.registry.find(session_id), voice.chats.get(session_id), voice.runtime
    if entry is None or entry.owner is None or chat is None or runtime is None or not runtime.speculations.enabled \
            or st.vad is None or not st.create_response or not st.message_open or st.speaker is not None \
            or chat.reply_pending:
        return None
    if st.pending:  # the message's chunks in: the mark is taken between operations
        await asyncio.wait(st.pending)
        if any(f.cancelled() or f.exception() is not None for f in st.pending):
            return None  # the message's end reports it
    st.pending = []
    try:
        at_mark = chat.mark()
    except Exception:
        return None
    try:
        if ev.tail:
            await voice.chats.extend(session_id, ev.tail)
        await voice.chats.end(session_id)
    except Exception:  # reported at the confirmed end, as without speculation
        await chat.restore_async(voice.chats.offload, at_mark)
        return None
    st.message_open = False
    gate = Gate()
    spec = NativeSpeculation(ev.text, at_mark, gate, HeldListener(entry.owner.listener, gate))
    try:
        voice.respond(entry.owner, session_id, {}, spec.listener)
    except Exception:
        await take_back(voice, session_id, st, spec, started=False)
        return None
    runtime.speculations.count("started")
    return spec


async def take_back(voice: Voice, session_id: str, st: State, spec: NativeSpeculation,
                    started: bool = True) -> None:
    """Drop the held results, end the reply, and return the chat to the mark (the message open again)."""
    spec.gate.discard()
    if started:
        assert voice.runtime is not None
        voice.runtime.speculations.count("taken_back")
        voice.cancel(session_id)  # the reply ends within one engine step; its speech stops now
        await spec.listener.ended.wait()  # recorded (cancelled): cut away below
    chat = voice.chats.get(session_id)
    if chat is None:
        return
    try:
        await chat.restore_async(voice.chats.offload, spec.mark)
    except Exception as e:  # e.g. an endless session's window moved on: the exchange stays, reported
        log.warning("streamserve: a speculative reply could not be taken back: %s", e)
        await voice.report(session_id, e)
        return
    st.message_open = True
    for text in spec.deltas:
        st.pending.append(voice.chats.extend(session_id, text))


async def confirm(voice: Voice, session_id: str, spec: NativeSpeculation) -> None:
    """The turn is confirmed: the held results go out, then the rest as it comes."""
    assert voice.runtime is not None
    voice.runtime.speculations.count("released")
    try:
        await spec.gate.release()
    except Exception as e:  # the connection is gone: nothing to deliver to
        log.debug("streamserve: a speculated reply's results were not delivered: %s", service_error(e).message)


__all__ = ["HeldListener", "NativeSpeculation", "confirm", "start", "take_back"]
