"""OpenAI's audio endpoints as services on the server's voice models (docs/openai.md, "Audio").

    POST /v1/audio/transcriptions   multipart/form-data as the `openai` SDK sends it: `file` (WAV of any rate and
                                    channels, or what PyAV reads: audio_codec.py), `model` (any name: Whisper base
                                    answers), `language` (ISO-639-1, default "en": no detection), `prompt`,
                                    `temperature` (0..1, checked; decoding is greedy), `response_format` json | text |
                                    srt | vtt | verbose_json, `timestamp_granularities[]`, `stream` (SSE
                                    transcript.text.delta / .done), `include[]` (no logprobs to give: ignored)
    POST /v1/audio/speech           JSON: `input` (<= 4096 chars), `voice` (OpenAI's names and "piper-joe": the one
                                    Piper voice speaks them all), `model` (any name), `response_format` mp3 (default) |
                                    opus | aac | flac | wav | pcm (24 kHz 16-bit mono), `speed` 0.25..4 (Piper's length
                                    scale: the pitch stays), `instructions` (ignored), `stream_format` audio | sse

A transcription is decoded and resampled on the media executor, then transcribed by Whisper passes of at most
PASS_S on the speech-to-text thread (`run_stt`), one after another, so a live voice session's pass waits behind one
of them at most, never behind a whole file. Each pass is prompted with the text before it; one short of the end keeps
the words that end a few seconds before its end and the next starts just after them (as Whisper's own long-form
transcription seeks to its last word), so no word is cut in two; a loop Whisper adds at a pass's end is dropped
(audio_codec.settle, unlooped). Speech is split into pieces
(SentenceSplitter: an early clause first, then sentences); each piece is synthesised through the text-to-speech
scheduler (`runtime.tts`, the earliest deadline first: a live reply's first audio still goes first) on the media
executor, one piece ahead of the one being written, and written to the response as soon as it is ready. A client
that goes away stops it: the piece waiting is withdrawn, none is submitted after it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import logging
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import BodyPartReader, web

from streamserve.errors import InvalidInputError
from streamserve.media.whisper import Word
from streamserve.server.adapters.openai_http import audio_codec as codec
from streamserve.server.adapters.openai_http.errors import ApiError, bad, from_exception, read_json
from streamserve.server.adapters.openai_http.params import number
from streamserve.server.adapters.openai_http.sse import EventStream
from streamserve.server.service.voice_reply import voice_unavailable

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Awaitable, Callable

    from streamserve.media.tts import PiperVoice
    from streamserve.server.adapters.openai_http.host import Host
    from streamserve.server.media.voice.runtime import VoiceRuntime

log = logging.getLogger("streamserve.server")

MAX_TRANSCRIPTION_S = 600.0  # the longest audio one transcription request takes
MIN_TRANSCRIPTION_S = 0.1
PASS_S = 28.0  # one Whisper pass: within one held window (media/whisper.py); longer audio takes several (codec.settle)
MAX_INPUT_CHARS = 4096
SERVER_VOICE = "piper-joe"
VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer",
          "verse", SERVER_VOICE)
TRANSCRIPTION_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")


class AudioRoutes:
    def __init__(self, host: Host) -> None:
        self.host = host

    def table(self) -> list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]]:
        return [("POST", "/v1/audio/transcriptions", self.transcriptions), ("POST", "/v1/audio/speech", self.speech)]

    def runtime(self) -> VoiceRuntime:
        voice = self.host.service().voice
        if voice is None:
            why = str(voice_unavailable())  # the wording of the other protocols' answer
            raise ApiError(400, f"{why[:1].upper()}{why[1:]}.", "voice_unavailable")
        return voice

    # ---- transcriptions ------------------------------------------------------------------------------------
    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        self.host.owner(request)
        voice = self.runtime()
        fields, data = await self.form(request)

        def one(name: str, default: str | None = None) -> str | None:
            return fields[name][-1] if fields.get(name) else default

        if data is None:
            raise bad("'file' is required: the audio to transcribe, as a multipart file field.", "file",
                      "missing_required_parameter")
        fmt = one("response_format", "json")
        if fmt not in TRANSCRIPTION_FORMATS:
            raise bad(f"'response_format' must be one of {', '.join(TRANSCRIPTION_FORMATS)}.", "response_format")
        language = (one("language") or "en").strip().lower()
        if language not in codec.LANGUAGES:
            raise bad(f"'language' {language!r} is not one Whisper knows: send an ISO-639-1 code such as 'en' or "
                      "'fr'.", "language")
        try:
            temperature = float(one("temperature", "0"))  # type: ignore[arg-type]
        except ValueError:
            temperature = math.nan
        if not 0.0 <= temperature <= 1.0:
            raise bad("'temperature' must be a number from 0 to 1.", "temperature")
        stream = one("stream", "false")
        if stream not in ("true", "false"):
            raise bad("'stream' must be true or false.", "stream")
        if stream == "true" and fmt not in ("json", "text"):
            raise bad("a streamed transcription is text: 'response_format' json or text.", "stream")
        granularities = set(fields.get("timestamp_granularities[]", ()))
        if granularities - {"word", "segment"} or (granularities and fmt != "verbose_json"):
            raise bad("'timestamp_granularities' takes 'word' and 'segment', with response_format verbose_json.",
                      "timestamp_granularities")
        try:
            audio = await voice.run(codec.decode_upload, data, MAX_TRANSCRIPTION_S)
        except InvalidInputError as e:
            raise bad(f"{str(e)[:1].upper()}{str(e)[1:]}.", "file", e.code) from None
        if audio.size < MIN_TRANSCRIPTION_S * codec.WHISPER_RATE:
            raise bad(f"The audio is shorter than {MIN_TRANSCRIPTION_S:g} s.", "file", "audio_too_short")
        passes = self.passes(request, voice, audio, language, one("prompt"))
        if stream == "true":
            return await self.stream_transcript(request, passes)
        done = [p async for p in passes]
        text = "".join(w.text for _, words in done for w in words).strip()
        duration = round(audio.size / codec.WHISPER_RATE, 2)
        usage = {"type": "duration", "seconds": math.ceil(duration)}
        if fmt == "json":
            return web.json_response({"text": text, "usage": usage})
        if fmt == "text":
            return web.Response(text=f"{text}\n", content_type="text/plain")
        parts = codec.segments(done)
        if fmt in ("srt", "vtt"):
            return web.Response(text=codec.subtitles(parts, fmt == "vtt"), content_type="text/plain")
        body: dict[str, Any] = {"task": "transcribe", "language": codec.LANGUAGES[language], "duration": duration,
                                "text": text}
        if not granularities or "segment" in granularities:
            body["segments"] = parts
        if "word" in granularities:
            body["words"] = [{"word": w.text.strip(), "start": w.start, "end": w.end} for _, ws in done for w in ws]
        return web.json_response({**body, "usage": usage})

    async def form(self, request: web.Request) -> tuple[dict[str, list[str]], bytes | None]:
        """The multipart fields (text, by name, in order) and the `file` field's bytes; 413 past the body limit."""
        limit = self.host.server.config.max_frame_bytes
        too_large = ApiError(413, f"The request is larger than {limit} bytes, this server's limit (its "
                             "--max-frame-bytes): send a shorter file, or a compressed one (mp3, opus).",
                             "request_too_large", "file")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        if request.content_type != "multipart/form-data":
            raise bad("Send the audio as multipart/form-data with a 'file' field (as the openai SDK does).", "file",
                      "invalid_content_type")
        fields: dict[str, list[str]] = {}
        data: bytes | None = None
        used = 0
        try:
            async for part in await request.multipart():
                if not isinstance(part, BodyPartReader) or not part.name:
                    raise bad("Each multipart part must be a named field.", None, "invalid_multipart")
                value = bytearray()
                while chunk := await part.read_chunk(1 << 16):
                    used += len(chunk)
                    if used > limit:
                        raise too_large
                    value += chunk
                if part.name == "file":
                    data = bytes(value)
                    continue
                try:
                    fields.setdefault(part.name, []).append(value.decode())
                except UnicodeDecodeError:
                    raise bad(f"'{part.name}' must be UTF-8 text.", part.name) from None
        except (ValueError, AssertionError) as e:  # aiohttp's multipart reader on a malformed body
            raise bad(f"The multipart body is malformed ({e}).", None, "invalid_multipart") from None
        return fields, data

    async def passes(self, request: web.Request, voice: VoiceRuntime, audio: np.ndarray, language: str,
                     prompt: str | None) -> AsyncIterator[tuple[float, list[Word]]]:
        """(start s, words on the audio's clock) of each Whisper pass, in order, each prompted with the text before it;
        they stop when the client has gone."""
        said, start = prompt or "", 0
        while start < audio.size:
            if request.transport is None or request.transport.is_closing():
                return
            end = min(audio.size, start + int(PASS_S * codec.WHISPER_RATE))
            words = codec.unlooped(await voice.run_stt(voice.whisper.words, audio[start:end], said.strip() or None,
                                                 language))
            offset, step_s = start / codec.WHISPER_RATE, (end - start) / codec.WHISPER_RATE
            if end < audio.size:  # the next pass hears this one's tail again, whole
                words, step_s = codec.settle(words, step_s)
            start += round(step_s * codec.WHISPER_RATE)
            words = [Word(w.text, round(w.start + offset, 2), round(w.end + offset, 2)) for w in words]
            said += "".join(w.text for w in words)
            yield offset, words

    async def stream_transcript(self, request: web.Request, passes: AsyncIterator[tuple[float, list[Word]]]
                                ) -> web.StreamResponse:
        """`stream=true`: transcript.text.delta per pass, then transcript.text.done (an error: an error event)."""
        out = EventStream(request)
        await out.start()
        text = ""
        try:
            async for _, words in passes:
                delta = "".join(w.text for w in words)
                delta = delta.lstrip() if not text else delta
                if delta:
                    text += delta
                    await out.data({"type": "transcript.text.delta", "delta": delta})
            await out.data({"type": "transcript.text.done", "text": text.strip()})
        except ConnectionResetError:
            return out.response
        except Exception as e:  # the headers are sent: the error goes as an event the SDK raises
            with contextlib.suppress(ConnectionResetError):
                await out.data({"type": "error", **from_exception(e).body()})
        with contextlib.suppress(ConnectionResetError):
            await out.response.write_eof()
        return out.response

    # ---- speech --------------------------------------------------------------------------------------------
    async def speech(self, request: web.Request) -> web.StreamResponse:
        self.host.owner(request)
        voice = self.runtime()
        body = await read_json(request)
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise bad("'input' must be a non-empty string: the text to speak.", "input")
        if len(text) > MAX_INPUT_CHARS:
            raise bad(f"'input' is {len(text)} characters long: the most is {MAX_INPUT_CHARS}.", "input",
                      "string_above_max_length")
        name = body.get("voice")
        name = name.get("id") if isinstance(name, dict) else name
        if name not in VOICES:
            raise bad(f"'voice' must be one of {', '.join(VOICES)} (one Piper voice, {SERVER_VOICE}, speaks them "
                      "all).", "voice")
        for key in ("model", "instructions"):
            if body.get(key) is not None and not isinstance(body[key], str):
                raise bad(f"'{key}' must be a string.", key, "invalid_type")
        fmt = body.get("response_format") or "mp3"
        if fmt not in SPEECH_FORMATS:
            raise bad(f"'response_format' must be one of {', '.join(SPEECH_FORMATS)}.", "response_format")
        speed = number(body, "speed", 0.25, 4.0) or 1.0
        stream_format = body.get("stream_format") or "audio"
        if stream_format not in ("audio", "sse"):
            raise bad("'stream_format' must be 'audio' or 'sse'.", "stream_format")
        return await self.speak(request, voice, text, fmt, speed, stream_format == "sse")

    async def speak(self, request: web.Request, voice: VoiceRuntime, text: str, fmt: str, speed: float, sse: bool
                    ) -> web.StreamResponse:
        from streamserve.media.audio import AudioOutput
        from streamserve.media.tts import SentenceSplitter

        splitter = SentenceSplitter()
        pieces = [*splitter.push(text), *splitter.flush()] or [""]
        piper = voice.voice if speed == 1.0 else at_speed(voice.voice, speed)
        output, encoder = AudioOutput(piper.sample_rate, codec.SPEECH), codec.SpeechEncoder(fmt)

        def synthesise(piece: str, last: bool) -> tuple[bytes, float]:  # on the media executor, pieces in order
            pcm = output.feed(piper.synthesize(piece)) + (output.flush() if last else b"")
            return encoder.feed(pcm, last), codec.SPEECH.duration_ms(len(pcm)) / 1e3

        loop = asyncio.get_running_loop()
        began, ahead = loop.time(), 0.0  # a piece is due when the audio before it has played (the first: now)
        pending: asyncio.Future[tuple[bytes, float]] | None = voice.tts.submit(began, synthesise, pieces[0],
                                                                               len(pieces) == 1)
        out = EventStream(request) if sse else None
        response = out.response if out is not None else web.StreamResponse(
            headers={"Content-Type": encoder.content_type, "Cache-Control": "no-cache"})
        try:
            for i in range(len(pieces)):
                assert pending is not None
                data, seconds = await pending
                pending, ahead = None, ahead + seconds
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("the client went away")  # no further piece is submitted
                if i + 1 < len(pieces):
                    pending = voice.tts.submit(began + ahead, synthesise, pieces[i + 1], i + 2 == len(pieces))
                if not response.prepared:  # after the first piece: a failure before it is still an error answer
                    await response.prepare(request)
                if out is not None and data:
                    await out.data({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                elif data:
                    await response.write(data)
            if out is not None:
                await out.data({"type": "speech.audio.done"})
            await response.write_eof()
        except ConnectionResetError:
            log.debug("streamserve: a speech client went away; its synthesis stops")
        except Exception:
            if not response.prepared:
                raise
            log.exception("streamserve: speech synthesis failed mid-stream; the response is cut short")
            if request.transport is not None:
                request.transport.abort()  # the client sees a truncated body, never a complete-looking one
        finally:
            if pending is not None:  # not started: withdrawn; started: it runs to its end, its result dropped
                voice.tts.withdraw(pending)
                pending.add_done_callback(lambda f: f.cancelled() or f.exception())
        return response


def at_speed(piper: PiperVoice, speed: float) -> PiperVoice:
    """The voice `speed` times as fast: Piper's length scale (the pitch stays), a shallow copy sharing the model."""
    faster = copy.copy(piper)
    faster.scales = piper.scales.copy()
    faster.scales[1] /= speed
    return faster
