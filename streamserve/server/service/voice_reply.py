"""A session's voice state and a reply spoken aloud (split from voice_sessions.py, which owns the rest).

`VoiceState`: one session's voice settings, its Listener, encoder-path embedder and the Speaker of the reply being
spoken. `SpeakingReply`: a reply's ResultListener that also speaks it (text deltas -> a Speaker -> `ReplyAudio`
chunks, then `ReplyAudioDone`). A new reply's Speaker takes over from the last reply's at its first delta, not
before: a respond refused (a reply already running) leaves the running reply speaking.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamserve.media import VOICE_EXTRA, VoiceUnavailableError
from streamserve.server.service.results import (
    ReplyAudio,
    ReplyAudioDone,
    ReplyDelta,
    ReplyDone,
    ResultListener,
    ServiceError,
    VoiceSettings,
    service_error,
)

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.media.audio import AudioFormat
    from streamserve.media.vad import VADConfig
    from streamserve.server.media.voice.embed import AudioEmbedder
    from streamserve.server.media.voice.listen import Listener
    from streamserve.server.media.voice.runtime import VoiceRuntime
    from streamserve.server.media.voice.speak import Speaker

log = logging.getLogger("streamserve.voice")


def voice_unavailable() -> VoiceUnavailableError:
    return VoiceUnavailableError(f"this server has no voice (started with --no-voice, or the voice extra or models "
                                 f"are missing): install the extra with {VOICE_EXTRA} and pull the models with "
                                 "`streamserve models pull whisper-base piper-joe silero-vad`")


def default_rate(encoding: str, other: int | None = 16000) -> int | None:
    """The rate of audio that names none: G.711 is 8 kHz by definition; `other` for the rest."""
    return 8000 if encoding in ("g711_ulaw", "g711_alaw") else other


@dataclass
class VoiceState:
    encoding: str = "pcm16"
    rate: int | None = None  # None: each append says
    channels: int = 1
    vad: VADConfig | None = None  # None: turn detection off
    create_response: bool = True
    interrupt_response: bool = True
    speak: AudioFormat | None = None  # reply audio format; None: text only
    configured: bool = False  # set by open/configure (shown in opened/configured)
    listener: Listener | None = None
    embedder: AudioEmbedder | None = None  # the encoder path (a model that hears audio natively)
    speaker: Speaker | None = None
    message_open: bool = False  # a chat session: a user message is being streamed in (ChatSessions.begin)
    pending: list[Any] = field(default_factory=list)  # ... its begin's and extends' futures, until its end
    spec: Any = None  # voice_speculation.NativeSpeculation: a reply started at the likely end of the turn, held


def voice_settings(st: VoiceState) -> VoiceSettings:
    vad = None if st.vad is None else {
        "type": "semantic_vad" if st.vad.eagerness else "server_vad", "threshold": st.vad.threshold,
        "prefix_padding_ms": st.vad.prefix_padding_ms, "silence_duration_ms": st.vad.silence_duration_ms,
        "idle_timeout_ms": st.vad.idle_timeout_ms, "create_response": st.create_response,
        "interrupt_response": st.interrupt_response}
    if vad is not None and st.vad is not None and st.vad.eagerness:
        vad["eagerness"] = st.vad.eagerness
    speak = None if st.speak is None else {"encoding": st.speak.encoding, "rate": st.speak.rate,
                                           "channels": st.speak.channels}
    return VoiceSettings({"encoding": st.encoding, "rate": st.rate, "channels": st.channels}, vad, speak)


class SpeakingReply:
    """A reply's ResultListener that also speaks it: text deltas feed a Speaker, whose audio follows the text."""

    def __init__(self, runtime: VoiceRuntime, live: set[Any], spawn: Callable[[Coroutine[Any, Any, Any]], None],
                 st: VoiceState, inner: ResultListener, session_id: str) -> None:
        self.runtime, self.live, self.spawn = runtime, live, spawn  # the service's: `live` counts Speakers running
        self.st, self.inner, self.session_id = st, inner, session_id
        self.speaker: Speaker | None = None
        self.response = ""

    def speaker_for(self, response: str) -> Speaker:
        if self.speaker is None:
            from streamserve.server.media.voice.speak import Speaker

            fmt = self.st.speak
            assert fmt is not None and self.runtime is not None
            self.response = response

            async def emit(data: bytes) -> None:
                await self.inner.push(ReplyAudio(self.session_id, response, data, fmt.rate, fmt.encoding,
                                                 fmt.channels))

            if self.st.speaker is not None:  # this reply runs while the last one's audio still plays: it gives way
                self.st.speaker.cancel()  # (not before: a refused respond must not silence the running reply)
            self.speaker = self.st.speaker = Speaker(self.runtime, fmt, emit)
            self.live.add(self.speaker)
        return self.speaker

    async def push(self, result: Any) -> None:
        if isinstance(result, ReplyDelta) and result.text:
            self.speaker_for(result.response).feed(result.text)
        await self.inner.push(result)
        if isinstance(result, ReplyDone):
            self.spawn(self.finish(result))

    def push_nowait(self, result: Any) -> bool:
        return self.inner.push_nowait(result)

    async def finish(self, done: ReplyDone) -> None:
        """The reply's text is complete: speak the rest, then mark the end of its audio."""
        sp, reason = self.speaker, "done"
        if sp is not None:
            if done.reason in ("cancelled", "error", "closed"):
                sp.cancel()
            try:
                await sp.finish()
            except Exception as e:
                log.exception("streamserve: a reply's speech failed")
                await self.inner.push(ServiceError("internal_error", str(service_error(e).message), self.session_id))
                reason = "error"
            if sp.cancelled:
                reason = "cancelled"
            if self.st.speaker is sp:
                self.st.speaker = None
            await sp.wait_idle()
            self.live.discard(sp)
        await self.inner.push(ReplyAudioDone(self.session_id, self.response or done.response, reason,
                                             0.0 if sp is None else round(sp.audio_ms, 1)))
