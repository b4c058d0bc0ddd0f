"""The Realtime session's configuration: what `session.update` may set, checked whole before any of it applies (a
refused update changes nothing), and the session object `session.created` / `session.updated` report.

Audio formats are the API's three: `audio/pcm` (PCM16 mono at 24 kHz), `audio/pcmu` and `audio/pcma` (G.711 at
8 kHz). Turn detection is `server_vad` (Silero VAD), `semantic_vad` (Silero VAD with the silence that ends a turn
set by the words said so far: media/turns.py) or null; input transcription is Whisper base whatever model the
client names (the session object says `whisper-base`, so the client sees which input path a text-only model uses).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from streamserve.media.audio import AudioFormat
from streamserve.media.turns import EAGERNESS
from streamserve.server.adapters.realtime.events import (
    RealtimeError,
    opt_bool,
    opt_float,
    opt_int,
    opt_map,
    opt_str,
)

FORMATS = {"audio/pcm": AudioFormat("pcm16", 24000), "audio/pcmu": AudioFormat("g711_ulaw", 8000),
           "audio/pcma": AudioFormat("g711_alaw", 8000)}
TRANSCRIPTION_MODEL = "whisper-base"  # what turns speech into the text a text-only model reads
DEFAULT_VOICE = "alloy"  # any name is accepted: one Piper voice (piper-joe) speaks every reply
MAX_INSTRUCTIONS = 32768  # characters
SESSION_TTL_S = 3600  # reported in expires_at (the connection's own lifetime is not limited by it)
MODALITIES = (("text",), ("audio",))  # the API takes one at a time


@dataclass(frozen=True)
class TurnDetection:
    """server_vad's or semantic_vad's parameters, with the API's defaults (semantic_vad has only eagerness,
    create_response and interrupt_response; the others stay as they were for a later switch back)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    type: str = "server_vad"
    eagerness: str = "auto"

    def render(self) -> dict[str, Any]:
        if self.type == "semantic_vad":
            return {"type": "semantic_vad", "eagerness": self.eagerness, "create_response": self.create_response,
                    "interrupt_response": self.interrupt_response}
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": self.idle_timeout_ms}


@dataclass(frozen=True)
class Settings:
    model: str
    output_modalities: tuple[str, ...]
    instructions: str = ""
    voice: str = DEFAULT_VOICE
    speed: float = 1.0
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    transcription: bool = True  # transcription events are sent (the transcript is made in any case)
    max_output_tokens: int | None = None  # None: "inf", the server's max_reply_tokens
    id: str = ""
    expires_at: int = field(default_factory=lambda: int(time.time()) + SESSION_TTL_S)

    @property
    def input_audio(self) -> AudioFormat:
        return FORMATS[self.input_format]

    @property
    def output_audio(self) -> AudioFormat:
        return FORMATS[self.output_format]


def check_modalities(value: Any, param: str, voice: bool) -> tuple[str, ...]:
    if not isinstance(value, list) or tuple(value) not in MODALITIES:
        raise RealtimeError(f"{param} must be [\"text\"] or [\"audio\"]", "invalid_value", param)
    if value == ["audio"] and not voice:
        raise RealtimeError(f"{param} [\"audio\"] needs the voice models, which this server has not loaded: "
                            f"install the voice extra (pip install \"streamserve[voice]\") and pull the models "
                            f"(streamserve models pull whisper-base piper-joe silero-vad)", "unsupported_modality",
                            param)
    return tuple(value)


def check_max_tokens(value: Any, param: str, limit: int) -> int | None:
    if value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise RealtimeError(f"{param} must be an integer from 1 to {limit} (this server's max_reply_tokens) or "
                            "\"inf\"", "invalid_value", param)
    return value


def response_params(body: Mapping[str, Any], s: Settings, voice: bool, max_reply_tokens: int
                    ) -> tuple[tuple[str, ...], int | None, str | None]:
    """response.create's `response` -> (output modalities, max output tokens, instructions), the session's where
    it sets none; RealtimeError for what this server does not do (out-of-band responses, input, tools, prompt)."""
    r = opt_map(body, "response", "response") or {}
    if r.get("conversation") not in (None, "auto"):
        raise RealtimeError("out-of-band responses (conversation \"none\") are not supported: every response joins "
                            "the conversation", "unsupported_conversation", "response.conversation")
    if r.get("input") is not None or r.get("tools") or r.get("prompt") is not None:
        param = next(p for p in ("input", "tools", "prompt") if r.get(p))
        raise RealtimeError(f"response.{param} is not supported by this server", "unsupported_parameter",
                            f"response.{param}")
    modalities = s.output_modalities
    if r.get("output_modalities") is not None:
        modalities = check_modalities(r["output_modalities"], "response.output_modalities", voice)
    max_tokens = s.max_output_tokens
    if r.get("max_output_tokens") is not None:
        max_tokens = check_max_tokens(r["max_output_tokens"], "response.max_output_tokens", max_reply_tokens)
    return modalities, max_tokens, opt_str(r, "instructions", "response.instructions", MAX_INSTRUCTIONS)


def no_voice(param: str = "type") -> RealtimeError:
    return RealtimeError("audio needs the voice models, which this server has not loaded: install the voice extra "
                         "(pip install \"streamserve[voice]\") and pull the models (streamserve models pull "
                         "whisper-base piper-joe silero-vad)", "unsupported_modality", param)


def webrtc_only() -> RealtimeError:
    return RealtimeError("output_audio_buffer.clear is for WebRTC connections; over a WebSocket, cancel the response "
                         "(response.cancel) and truncate its item", "unsupported_event", "type")


def track_input() -> RealtimeError:
    return RealtimeError("over WebRTC the input audio is the microphone track: input_audio_buffer.append is not "
                         "taken (commit and clear are)", "unsupported_event", "type")


def check_format(fmt: Mapping[str, Any] | None, param: str) -> str | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in FORMATS:
        raise RealtimeError(f"{param}.type must be one of {', '.join(FORMATS)}", "invalid_value", f"{param}.type")
    if kind == "audio/pcm" and fmt.get("rate", 24000) != 24000:
        raise RealtimeError(f"{param}.rate must be 24000: audio/pcm is PCM16 mono at 24 kHz (resample before "
                            "sending, or send audio/pcmu)", "invalid_value", f"{param}.rate")
    return str(kind)


def check_turn_detection(td: Any, param: str, base: TurnDetection | None) -> TurnDetection | None:
    if td is None:
        return None
    if not isinstance(td, dict):
        raise RealtimeError(f"{param} must be an object or null", "invalid_type", param)
    kind = td.get("type")
    if kind not in ("server_vad", "semantic_vad"):
        raise RealtimeError(f"{param}.type must be \"server_vad\" or \"semantic_vad\", or set {param} to null",
                            "invalid_value", f"{param}.type")
    b = base or TurnDetection()
    create = opt_bool(td, "create_response", f"{param}.create_response")
    interrupt = opt_bool(td, "interrupt_response", f"{param}.interrupt_response")
    create, interrupt = (b.create_response if create is None else create,
                         b.interrupt_response if interrupt is None else interrupt)
    if kind == "semantic_vad":
        eagerness = opt_str(td, "eagerness", f"{param}.eagerness") or "auto"
        if eagerness not in EAGERNESS:
            raise RealtimeError(f"{param}.eagerness must be one of {', '.join(EAGERNESS)}", "invalid_value",
                                f"{param}.eagerness")
        return replace(b, create_response=create, interrupt_response=interrupt, idle_timeout_ms=None,
                       type="semantic_vad", eagerness=eagerness)
    threshold = opt_float(td, "threshold", f"{param}.threshold", 0.0, 1.0)
    prefix = opt_int(td, "prefix_padding_ms", f"{param}.prefix_padding_ms", 0, 5000)
    silence = opt_int(td, "silence_duration_ms", f"{param}.silence_duration_ms", 0, 10000)
    idle = opt_int(td, "idle_timeout_ms", f"{param}.idle_timeout_ms", 5000, 30000)
    return TurnDetection(b.threshold if threshold is None else threshold,
                         b.prefix_padding_ms if prefix is None else prefix,
                         b.silence_duration_ms if silence is None else silence, create, interrupt,
                         idle if "idle_timeout_ms" in td else b.idle_timeout_ms)


def update(s: Settings, session: Any, voice: bool, max_reply_tokens: int) -> Settings:
    """`session.update`'s session object -> the new settings, or RealtimeError (nothing applied)."""
    if not isinstance(session, dict):
        raise RealtimeError("session must be an object", "invalid_type", "session")
    if session.get("type", "realtime") != "realtime":
        raise RealtimeError("session.type must be \"realtime\" (transcription sessions are not served here)",
                            "invalid_value", "session.type")
    if session.get("tools"):
        raise RealtimeError("function and MCP tools are not supported by this server: send tools [] or omit them",
                            "unsupported_tools", "session.tools")
    if session.get("prompt") is not None:
        raise RealtimeError("stored prompts are not supported by this server: send instructions instead",
                            "unsupported_prompt", "session.prompt")
    changes: dict[str, Any] = {}
    if (instructions := opt_str(session, "instructions", "session.instructions", MAX_INSTRUCTIONS)) is not None:
        changes["instructions"] = instructions
    if "output_modalities" in session and session["output_modalities"] is not None:
        changes["output_modalities"] = check_modalities(session["output_modalities"], "session.output_modalities",
                                                        voice)
    if "max_output_tokens" in session and session["max_output_tokens"] is not None:
        changes["max_output_tokens"] = check_max_tokens(session["max_output_tokens"], "session.max_output_tokens",
                                                        max_reply_tokens)
    audio = opt_map(session, "audio", "session.audio") or {}
    inp = opt_map(audio, "input", "session.audio.input") or {}
    out = opt_map(audio, "output", "session.audio.output") or {}
    if (fmt := check_format(opt_map(inp, "format", "session.audio.input.format"), "session.audio.input.format")):
        changes["input_format"] = fmt
    if (fmt := check_format(opt_map(out, "format", "session.audio.output.format"), "session.audio.output.format")):
        changes["output_format"] = fmt
    if "turn_detection" in inp:
        changes["turn_detection"] = check_turn_detection(inp["turn_detection"], "session.audio.input.turn_detection",
                                                         s.turn_detection)
    if "transcription" in inp:
        opt_map(inp, "transcription", "session.audio.input.transcription")
        changes["transcription"] = inp["transcription"] is not None
    voice_value = out.get("voice")
    if isinstance(voice_value, dict):  # a custom voice {id}: only the one Piper voice speaks here
        voice_value = opt_str(voice_value, "id", "session.audio.output.voice.id", 64)
    elif voice_value is not None:
        voice_value = opt_str(out, "voice", "session.audio.output.voice", 64)
    if voice_value is not None:
        changes["voice"] = voice_value
    if (speed := opt_float(out, "speed", "session.audio.output.speed", 0.25, 1.5)) is not None:
        changes["speed"] = speed
    return replace(s, **changes)


def render(s: Settings) -> dict[str, Any]:
    """The session object (the GA API's `RealtimeSessionCreateRequest` fields, all filled)."""
    fmt = {"audio/pcm": {"type": "audio/pcm", "rate": 24000}, "audio/pcmu": {"type": "audio/pcmu"},
           "audio/pcma": {"type": "audio/pcma"}}
    transcription = {"model": TRANSCRIPTION_MODEL, "language": "en", "prompt": None} if s.transcription else None
    return {
        "type": "realtime", "object": "realtime.session", "id": s.id, "model": s.model,
        "output_modalities": list(s.output_modalities), "instructions": s.instructions,
        "audio": {"input": {"format": fmt[s.input_format], "transcription": transcription, "noise_reduction": None,
                            "turn_detection": s.turn_detection.render() if s.turn_detection else None},
                  "output": {"format": fmt[s.output_format], "voice": s.voice, "speed": s.speed}},
        "include": None, "max_output_tokens": "inf" if s.max_output_tokens is None else s.max_output_tokens,
        "tools": [], "tool_choice": "auto", "tracing": None, "truncation": "disabled", "prompt": None,
        "expires_at": s.expires_at,
    }
