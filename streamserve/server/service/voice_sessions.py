"""Audio on sessions of the session service (split from service.py, which calls this and owns the rest).

Each session that takes audio has a `VoiceState`: its voice settings (input format, server-VAD turn detection,
reply audio), a Listener (server/media/voice/listen.py) made at its first audio append, and the Speaker of the reply
being spoken (server/media/voice/speak.py). What the Listener hears goes where the session's text goes:

- agreed transcript words are appended to a plain session as they arrive (text chunks of kind "audio"); a chat
  session gets the utterance as one user message at its end;
- turn and transcript events reach the connection holding the session (`TurnEvent`, `Transcript`);
- with `create_response` a reply starts at the end of speech; with `interrupt_response` speech during a reply
  cancels it (and its audio);
- with `speak` a reply's text deltas also feed a Speaker, whose audio goes out as `ReplyAudio` chunks followed by
  `ReplyAudioDone`.

A close frees the session's Listener and Speaker. A disconnect frees them too, but first ends the utterance the
Listener holds (`drain`): the audio it acknowledged is transcribed and its words appended (acknowledged audio is
never lost); a resumed session's new Listener starts after that, so the words stay in the order they were said.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from streamserve.server.media.voice import listen as L
from streamserve.server.service import voice_speculation as speculation
from streamserve.server.service.chat import ChatSessions
from streamserve.server.service.registry import SessionRegistry
from streamserve.server.service.results import (
    AppendRequest,
    AudioInfo,
    ChunkResult,
    Committed,
    ResultListener,
    Transcript,
    TurnEvent,
    VoiceSettings,
    service_error,
)
from streamserve.server.service.seqs import ClientSeqs
from streamserve.server.service.voice_reply import (
    SpeakingReply,
    VoiceState,
    default_rate,
    voice_settings,
    voice_unavailable,
)

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.media.audio import AudioFormat
    from streamserve.media.encoder import AudioEncoder
    from streamserve.server.media.voice.runtime import VoiceRuntime
    from streamserve.server.media.voice.speak import Speaker

log = logging.getLogger("streamserve.voice")
Respond = Callable[..., None]  # (connection, session id, params, listener=None): the service's respond


class VoiceSessions:
    def __init__(self, runtime: VoiceRuntime | None, registry: SessionRegistry, chats: ChatSessions,
                 max_buffer_s: float, respond: Respond, cancel: Callable[[str], None],
                 spawn: Callable[[Coroutine[Any, Any, Any]], None], encoder: AudioEncoder | None = None) -> None:
        self.runtime, self.registry, self.chats, self.max_buffer_s = runtime, registry, chats, max_buffer_s
        self.encoder = encoder  # the model's own audio encoder: audio goes in as embeds, not through speech to text
        self.respond, self.cancel, self.spawn = respond, cancel, spawn
        self.states: dict[str, VoiceState] = {}
        self.live: set[Any] = set()  # Listeners and Speakers not yet stopped (a leak check's figure)
        self.seqs = ClientSeqs()  # transcript chunks never cost the client an out-of-order seq (seqs.py)
        self.draining: dict[str, asyncio.Future[None]] = {}  # session -> its cut Listener's drain, until it ends

    def info(self) -> AudioInfo | None:
        if self.runtime is None:
            return None
        from streamserve.media.audio import ENCODINGS, AudioFormat

        path = "transcribe" if self.encoder is None else "encoder"
        return AudioInfo(path, AudioFormat().rate, "piper-joe", self.runtime.voice.sample_rate, ENCODINGS)

    # ---- settings --------------------------------------------------------------------------------------
    def configure(self, session_id: str, voice: dict[str, Any] | None, store: bool = True) -> VoiceSettings | None:
        """Apply a `voice` map (from open or configure; its shape checked by the protocol) -> the settings now
        (`store` False: only check it). Typed errors for values out of range, nothing changed."""
        if voice is None:
            st = self.states.get(session_id)
            return self.settings(st) if st is not None and st.configured else None
        if self.runtime is None:
            raise voice_unavailable()
        from streamserve.media.audio import AudioFormat
        from streamserve.media.vad import VADConfig

        st = replace(self.states.get(session_id) or VoiceState(vad=VADConfig()), configured=True)  # VAD on: default
        inp = voice.get("input")
        if inp is not None:
            st.encoding, st.rate = inp.get("encoding", st.encoding), inp.get("rate", st.rate)
            st.channels = inp.get("channels", st.channels)
            AudioFormat(st.encoding, st.rate or default_rate(st.encoding), st.channels).check()
        td = voice.get("turn_detection")
        if td is False:
            st.vad = None
        elif td is not None:  # keys left out keep the session's values (the defaults when it had none)
            was = st.vad or VADConfig()
            kw: dict[str, Any] = {"threshold": td.get("threshold", was.threshold),
                                  "prefix_padding_ms": td.get("prefix_padding_ms", was.prefix_padding_ms)}
            if td.get("type", "semantic_vad" if was.eagerness else "server_vad") == "semantic_vad":
                st.vad = VADConfig.semantic(td.get("eagerness", was.eagerness or "auto"), **kw).check()
            else:  # from semantic_vad back to server_vad: the default silence, not semantic's starting one
                silence = VADConfig.silence_duration_ms if was.eagerness else was.silence_duration_ms
                st.vad = VADConfig(silence_duration_ms=td.get("silence_duration_ms", silence),
                                   idle_timeout_ms=td.get("idle_timeout_ms", was.idle_timeout_ms), **kw).check()
            st.create_response = td.get("create_response", st.create_response)
            st.interrupt_response = td.get("interrupt_response", st.interrupt_response)
        speak = voice.get("speak")
        if speak is False:
            st.speak = None
        elif speak is True:
            st.speak = AudioFormat()
        elif speak is not None:
            st.speak = AudioFormat(speak.get("encoding", "pcm16"), speak.get("rate", 24000),
                                   speak.get("channels", 1)).check()
        old = self.states.get(session_id)
        if not store:
            return None
        self.states[session_id] = st
        if old is not None and old.listener is not None:
            st.listener = old.listener
            st.listener.configure(turn_detection=st.vad)
        if old is not None:
            st.speaker = old.speaker
        return self.settings(st)

    settings = staticmethod(voice_settings)  # a session's voice settings as opened/configured report them

    def state(self, session_id: str) -> VoiceState:
        st = self.states.get(session_id)
        if st is None:
            from streamserve.media.vad import VADConfig

            st = self.states[session_id] = VoiceState(vad=VADConfig())  # server VAD by default, as OpenAI's
        return st

    # ---- audio in --------------------------------------------------------------------------------------
    async def append(self, ctx: Any, session_id: str, req: AppendRequest, deliver: Callable[[ChunkResult], Any],
                     finish: Callable[..., Coroutine[Any, Any, None]]) -> None:
        """Audio of a session through its Listener: its result (an ack of 0 tokens: the audio is in, its words follow
        as transcript chunks) goes to `deliver` now. The encoder path: its embeds chunk's ack follows when the chunk
        is in the KV cache (`finish`: the service's finish_chunk). Typed errors for bad audio, nothing taken."""
        if self.runtime is None:
            raise voice_unavailable()
        from streamserve.media.audio import AudioFormat, AudioFormatError

        st = self.state(session_id)
        encoding = req.encoding or st.encoding
        rate = req.rate if req.rate is not None else st.rate if st.rate is not None else default_rate(encoding, None)
        if rate is None:
            raise AudioFormatError("audio needs its sample rate: send `rate` with the append, or set the session's "
                                   "voice input rate (open/configure voice.input.rate)")
        fmt = AudioFormat(encoding, rate, req.channels or st.channels).check()
        if self.encoder is not None:  # the engine checks the seq of its embeds chunk
            result = await self.embed(session_id, st, fmt, req)
            if isinstance(result, ChunkResult):
                return await deliver(result)
            await ctx.pending_acks.acquire()  # released by `finish` with the ack
            return self.spawn(finish(ctx, session_id, req, 0, result))
        self.seqs.check_audio(session_id, req.seq)  # a seq sent again (a retry after a resume): not heard twice
        drain = self.draining.get(session_id)
        if st.listener is None and drain is not None:  # resumed: the cut Listener's words go in first
            await asyncio.wait({drain})
        if st.listener is None:
            st.listener = L.Listener(self.runtime, fmt, st.vad, lambda ev: self.on_event(session_id, ev),
                                     max_buffer_s=self.max_buffer_s)
            self.live.add(st.listener)
        elif st.listener.fmt != fmt:
            st.listener.configure(fmt=fmt)
        t0 = time.perf_counter()
        await st.listener.append(req.audio or b"")
        self.seqs.client_used(session_id, req.seq)
        entry = self.registry.find(session_id)
        seq = req.seq if req.seq is not None else (entry.session.next_seq if entry is not None else None)
        await deliver(ChunkResult(session_id, seq, req.capture_time, 0, 0.0, round(1e3 * (time.perf_counter() - t0),
                                                                                   3)))

    async def embed(self, session_id: str, st: VoiceState, fmt: AudioFormat, req: AppendRequest) -> Any:
        """The encoder path: the audio's embeddings appended as a chunk of kind "audio" (-> its ack's future; an
        append too short for one embedding waits for the next and is acked with 0 tokens)."""
        import torch

        from streamserve.server.media.voice.embed import AudioEmbedder

        assert self.runtime is not None and self.encoder is not None
        if st.embedder is None or st.embedder.fmt != fmt:
            st.embedder = AudioEmbedder(self.runtime, self.encoder, fmt)
        t0 = time.perf_counter()
        vectors = await st.embedder.feed(req.audio or b"")  # [T, hidden]
        entry = self.registry.find(session_id)
        if entry is None or len(vectors) == 0:
            seq = req.seq if req.seq is not None or entry is None else entry.session.next_seq
            return ChunkResult(session_id, seq, req.capture_time, 0, 0.0, round(1e3 * (time.perf_counter() - t0), 3))
        return entry.session.submit_chunk(embeds=torch.from_numpy(vectors), seq=req.seq,
                                          capture_time=req.capture_time, kind="audio")

    async def commit(self, session_id: str) -> Committed:
        st = self.states.get(session_id)
        done = None if st is None or st.listener is None else await st.listener.commit()
        if done is None:
            return Committed(session_id, "", None, None)
        return Committed(session_id, done.text, done.audio_start_ms, done.audio_end_ms)

    # ---- what the Listener hears -------------------------------------------------------------------------
    async def on_event(self, session_id: str, ev: L.ListenEvent) -> None:
        entry = self.registry.find(session_id)
        st = self.states.get(session_id)
        if entry is None or st is None:
            return
        live = st.listener is not None  # False: a cut connection's Listener ending its utterance (drain)
        out: Any = None
        spec = st.spec
        if isinstance(ev, L.TurnLikely):  # maybe the end: the reply starts now, held (voice_speculation.py)
            if live and spec is None:
                st.spec = await speculation.start(self, session_id, st, ev)
            return
        if isinstance(ev, L.TurnResumed) or (isinstance(ev, L.TranscriptDone) and spec is not None
                                             and (ev.text.strip() != spec.text or not spec.gate.holding)):
            if spec is not None:  # it was not the end (or its words changed): taken back, unseen
                st.spec = None
                await speculation.take_back(self, session_id, st, spec)
            if isinstance(ev, L.TurnResumed):
                return
        if isinstance(ev, L.SpeechStarted):
            out = TurnEvent(session_id, "speech_started", ev.audio_start_ms)
            if st.interrupt_response and st.vad is not None and live:
                self.interrupt(session_id, st)
        elif isinstance(ev, L.SpeechStopped):
            out = TurnEvent(session_id, "speech_stopped", ev.audio_end_ms)
        elif isinstance(ev, L.TranscriptPartial):
            out = Transcript(session_id, "partial", ev.text)
        elif isinstance(ev, L.TranscriptDelta) and st.spec is not None:  # its words are in the message already
            st.spec.deltas.append(ev.text)
            out = Transcript(session_id, "delta", ev.text)
        elif isinstance(ev, L.TranscriptDelta):
            out = Transcript(session_id, "delta", ev.text, seq=self.append_text(session_id, st, ev.text))
        else:
            out = Transcript(session_id, "final", ev.text, audio_start_ms=ev.audio_start_ms,
                             audio_end_ms=ev.audio_end_ms)
        owner = entry.owner
        if owner is not None:
            await owner.listener.push(out)
        if isinstance(ev, L.TranscriptDone) and st.spec is not None:  # confirmed: the held reply goes out
            spec, st.spec = st.spec, None
            return await speculation.confirm(self, session_id, spec)
        if isinstance(ev, L.TranscriptDone) and st.message_open:  # a chat session: the user message ends here
            st.message_open, st.pending = False, []
            self.spawn(self.watch(session_id, self.chats.end(session_id)))
        if isinstance(ev, L.TranscriptDone) and ev.text and st.create_response and st.vad is not None \
                and entry.owner is not None and live:  # the end of a cut utterance starts no reply
            try:
                self.respond(entry.owner, session_id, {})
            except Exception as e:  # e.g. a reply the client started is still running
                await entry.owner.listener.push(service_error(e, session_id))

    def append_text(self, session_id: str, st: VoiceState, text: str) -> int | None:
        """Agreed words into the session now: a plain session's as a chunk of kind "audio" (-> its seq); a chat
        session's into a user message streamed in (ChatSessions.begin/extend; its end comes with the transcript's)."""
        entry = self.registry.find(session_id)
        if entry is None or not text.strip():
            return None
        self.seqs.server_took(session_id)
        if self.chats.get(session_id) is not None:
            if not st.message_open:
                st.message_open = True
                st.pending.append(self.chats.begin(session_id, "user"))
                self.spawn(self.watch(session_id, st.pending[-1]))
                text = text.lstrip()  # the message's content starts at its first word
            st.pending.append(self.chats.extend(session_id, text))
            self.spawn(self.watch(session_id, st.pending[-1]))
            return None
        seq = entry.session.next_seq
        if seq > 0 and not text[0].isspace():  # an utterance's first words (stt strips them) after earlier text
            text = " " + text
        try:
            fut = entry.session.submit_chunk(text=text, seq=seq, kind="audio")
        except Exception as e:
            self.spawn(self.report(session_id, e))
            return None
        self.spawn(self.watch(session_id, fut))
        return seq

    async def watch(self, session_id: str, fut: Any) -> None:
        """A chunk the server appended: nobody waits for its ack, but its failure reaches the client."""
        try:
            await (fut if isinstance(fut, asyncio.Future) else asyncio.wrap_future(fut))
        except Exception as e:
            await self.report(session_id, e)

    async def report(self, session_id: str, e: BaseException) -> None:
        entry = self.registry.find(session_id)
        if entry is not None and entry.owner is not None:
            await entry.owner.listener.push(service_error(e, session_id))

    def interrupt(self, session_id: str, st: VoiceState) -> None:
        """Barge-in: the person speaks during a reply: its audio stops now, the reply within one engine step."""
        if st.speaker is not None:
            st.speaker.cancel()
        self.cancel(session_id)  # nothing running: nothing happens

    # ---- audio out ---------------------------------------------------------------------------------------
    def reply_listener(self, listener: ResultListener, session_id: str) -> ResultListener:
        """Where a reply's output goes: `listener` itself, or (reply audio on) a listener that also speaks it."""
        st = self.states.get(session_id)
        if st is None or st.speak is None or self.runtime is None:
            return listener
        # the last reply's audio gives way at this reply's first delta (voice_reply.py)
        return SpeakingReply(self.runtime, self.live, self.spawn, st, listener, session_id)

    def hush(self, session_id: str) -> None:
        """The session's reply is cancelled: its audio stops now too."""
        st = self.states.get(session_id)
        if st is not None and st.speaker is not None:
            st.speaker.cancel()

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def detach(self, session_id: str) -> None:
        """The session's connection is gone: its Listener and Speaker go (its settings stay for a resume). They are
        taken from the session now (its reply audio stops at once); the Listener first ends its utterance (`drain`),
        and a resumed session's first audio waits for that before a new Listener starts."""
        st = self.states.get(session_id)
        if st is None:
            return
        listener, speaker, st.listener, st.speaker, st.embedder = st.listener, st.speaker, None, None, None
        if speaker is not None:
            speaker.cancel()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        before, self.draining[session_id] = self.draining.get(session_id), done
        self.spawn(self.drain(session_id, st, listener, speaker, before, done))

    async def drain(self, session_id: str, st: VoiceState, listener: L.Listener | None, speaker: Speaker | None,
                    before: asyncio.Future[None] | None, done: asyncio.Future[None]) -> None:
        """A cut connection's Listener: the utterance it holds ends now (`commit`: the acknowledged audio not yet
        transcribed is, and its words are appended as when the speech stops, with no reply after it), then it stops."""
        try:
            if before is not None:  # cut again before the last drain ended: the words stay in order
                await asyncio.wait({before})
            if listener is not None:
                try:
                    await listener.commit()
                except Exception:  # closed meanwhile (the session was closed): nothing more to hear
                    log.debug("streamserve: a cut utterance could not be finished", exc_info=True)
            if st.message_open:  # a chat session's spoken message its final did not end: taken out, or the chat
                st.message_open = False  # would wait for its end
                await self.watch(session_id, self.chats.abort(session_id))
            await self.stop(listener, speaker)
        finally:
            done.set_result(None)
            if self.draining.get(session_id) is done:
                del self.draining[session_id]

    def forget(self, session_id: str) -> None:
        self.seqs.forget(session_id)
        st = self.states.pop(session_id, None)
        if st is not None:
            self.spawn(self.release(st))

    async def free_all(self, session_id: str) -> None:
        """The session closes (by the client, or with the server): its Listener and Speaker stop before this
        returns."""
        self.seqs.forget(session_id)
        st = self.states.pop(session_id, None)
        if st is not None:
            await self.release(st)
        drain = self.draining.get(session_id)
        if drain is not None:  # a cut utterance still ending: its Listener has stopped when this returns
            await asyncio.wait({drain})

    def release(self, st: VoiceState) -> Coroutine[Any, Any, None]:
        """Take the session's Listener, Speaker and embedder away now (its speech stops at once) -> what stops
        them (await it: their media work ends)."""
        listener, speaker, st.listener, st.speaker, st.embedder = st.listener, st.speaker, None, None, None
        if speaker is not None:
            speaker.cancel()
        if st.spec is not None:  # nobody hears it
            st.spec.gate.discard()
        return self.stop(listener, speaker)

    async def stop(self, listener: L.Listener | None, speaker: Speaker | None) -> None:
        if speaker is not None:
            await speaker.wait_idle()
            self.live.discard(speaker)
        if listener is not None:
            await listener.close()
            self.live.discard(listener)

    def active(self) -> int:
        """Listeners and Speakers not yet stopped, their media work included (a leak check's figure)."""
        return len(self.live)
