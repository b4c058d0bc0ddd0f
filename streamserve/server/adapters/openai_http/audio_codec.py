"""Audio files and transcripts of the OpenAI audio endpoints (audio.py): an uploaded file -> 16 kHz mono for
Whisper, Whisper's words -> the transcription formats, and the speech formats out. The file work blocks: the server
runs it on the voice's media executor, never on the event loop.

In: WAV is read here (PCM 8/16/24/32-bit, IEEE float 32/64, G.711 A-law/mu-law; any rate and channel count, the
channels averaged; a streamed WAV whose sizes say 0 or 0xFFFFFFFF is read to the end of the file), through
streamserve.media.audio's decoders and resampler. Anything else (mp3, m4a/mp4, ogg/opus, flac, webm, ...) goes
through PyAV, the decoder faster-whisper itself uses (the voice extra installs it), stopping as soon as the audio
passes the length bound, so a small compressed file cannot expand into a huge buffer.
Out: OpenAI's pcm (24 kHz, 16-bit signed little-endian, mono); wav, the same samples behind a streaming header
(sizes 0xFFFFFFFF, as OpenAI streams it: Python's wave, soundfile and ffmpeg read it to the end); mp3, opus (in
Ogg), aac (ADTS) and flac encoded by PyAV as the audio comes, each piece's bytes out as soon as they are encoded.
"""

from __future__ import annotations

import io
import itertools
import struct
import zlib
from typing import Any

import numpy as np

from streamserve.errors import InvalidInputError
from streamserve.media import require
from streamserve.media.audio import (
    MAX_RATE,
    MIN_RATE,
    AudioFormat,
    AudioFormatError,
    Resampler,
    alaw_decode,
    decode,
    ulaw_decode,
)
from streamserve.media.stt import normalize
from streamserve.media.whisper import Word

WHISPER_RATE = 16000
SPEECH = AudioFormat("pcm16", 24000, 1)  # OpenAI's pcm
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
                 "wav": "audio/wav", "pcm": "audio/pcm"}
_AV = {"mp3": ("mp3", "libmp3lame"), "opus": ("ogg", "libopus"), "aac": ("adts", "aac"), "flac": ("flac", "flac")}
TAIL_S = 3.0  # a Whisper pass short of the audio's end keeps the words that end this long before its end ...
HANDOVER_S = 0.2  # ... and the next pass starts this long after the last word kept at most
SQUEEZED_S, SQUEEZED_RUN = 0.1, 3  # at the end of a pass, this many words each aligned to less audio: a loop
GAP_S = 1.0  # a pause this long between two words starts a new verbose_json segment
UNREADABLE = ("the file is not audio this server can read: send WAV (PCM 8/16/24/32-bit, float, G.711), or mp3, "
              "m4a, mp4, ogg, opus, flac or webm")


class AudioTooLongError(InvalidInputError):
    code = "audio_too_long"


def too_long(max_s: float) -> AudioTooLongError:
    return AudioTooLongError(f"the audio is longer than {max_s:g} s, the most this server transcribes in one "
                             "request: cut it into parts")


def decode_upload(data: bytes, max_s: float) -> np.ndarray:
    """An uploaded audio file -> float32 mono [n] at 16 kHz. AudioFormatError when it cannot be read (the message
    says what to send), AudioTooLongError past `max_s` seconds."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        x, rate = read_wav(data)
        if x.size > max_s * rate:
            raise too_long(max_s)
        resampler = Resampler(rate, WHISPER_RATE)
        return np.concatenate([resampler.process(x), resampler.flush()])
    return _decode_av(data, max_s)


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A WAV file -> (float32 mono [n], its rate)."""
    fmt: tuple[int, int, int, int] | None = None  # (format tag, channels, rate, bits per sample)
    pos = 12
    while pos + 8 <= len(data):
        kind, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if kind == b"fmt " and size >= 16:
            tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", data, body)
            if tag == 0xFFFE and size >= 26:  # WAVE_FORMAT_EXTENSIBLE: the sub-format's tag leads its GUID
                tag = struct.unpack_from("<H", data, body + 24)[0]
            fmt = (tag, channels, rate, bits)
        elif kind == b"data":
            if fmt is None:
                break
            end = len(data) if size in (0, 0xFFFFFFFF) or body + size > len(data) else body + size  # streamed WAV
            return _samples(data[body:end], *fmt), fmt[2]
        pos = body + size + (size & 1)  # chunks are padded to even sizes
    raise AudioFormatError(f"the WAV file has no readable fmt and data chunks: {UNREADABLE}")


def _samples(raw: bytes, tag: int, channels: int, rate: int, bits: int) -> np.ndarray:
    if not MIN_RATE <= rate <= MAX_RATE or not 1 <= channels <= 8:
        raise AudioFormatError(f"a WAV file of {rate} Hz and {channels} channels is not supported: send {MIN_RATE} "
                               f"to {MAX_RATE} Hz, 1 to 8 channels")
    frame = channels * max(bits // 8, 1)
    raw = raw[:len(raw) - len(raw) % frame]  # whole sample frames (a cut file loses its partial last frame)
    if (tag, bits) in ((1, 16), (3, 32)):
        return decode(raw, AudioFormat("pcm16" if tag == 1 else "float32", rate, channels))
    if tag in (6, 7) and bits == 8:  # G.711 at any rate (the streaming format fixes it at 8 kHz; a file need not)
        x = alaw_decode(raw) if tag == 6 else ulaw_decode(raw)
    elif tag == 1 and bits == 8:  # unsigned
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == 1 and bits in (24, 32):  # little-endian; 24-bit widened to 32 with a zero low byte
        b = np.frombuffer(raw, np.uint8).reshape(-1, bits // 8)
        if bits == 24:
            b = np.concatenate([np.zeros((b.shape[0], 1), np.uint8), b], axis=1)
        x = np.ascontiguousarray(b).view("<i4").reshape(-1).astype(np.float32) / np.float32(2 ** 31)
    elif tag == 3 and bits == 64:
        x = np.frombuffer(raw, "<f8")
        if not np.isfinite(x).all():
            raise AudioFormatError("the WAV file holds NaN or infinite samples")
        x = np.clip(x, -1.0, 1.0).astype(np.float32)
    else:
        raise AudioFormatError(f"WAV format tag {tag} with {bits}-bit samples is not supported: {UNREADABLE}")
    return x.reshape(-1, channels).mean(axis=1, dtype=np.float64).astype(np.float32) if channels > 1 else x


def _decode_av(data: bytes, max_s: float) -> np.ndarray:
    av = require("av")
    parts: list[np.ndarray] = []
    n = 0
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise AudioFormatError(f"the file has no audio stream: {UNREADABLE}")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=WHISPER_RATE)
            for frame in (*container.decode(audio=0), None):  # None: the resampler's tail
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))  # [1, k] packed float32 mono
                    n += parts[-1].size
                if n > max_s * WHISPER_RATE:
                    raise too_long(max_s)
    except av.FFmpegError as e:
        raise AudioFormatError(f"{UNREADABLE} ({e.strerror or 'undecodable'})") from None
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def wav_header(rate: int = SPEECH.rate) -> bytes:
    """A 16-bit mono WAV header whose sizes are unknown (0xFFFFFFFF: read to the end), for a streamed body."""
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)  # PCM, mono, 2 bytes a frame, 16-bit
    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", 0xFFFFFFFF)


class SpeechEncoder:
    """OpenAI's pcm (24 kHz pcm16 mono bytes) -> a speech response format, piece by piece (not thread-safe: one
    piece at a time, in order)."""

    def __init__(self, fmt: str) -> None:
        self.format = fmt
        self.content_type = CONTENT_TYPES[fmt]
        self._head = wav_header() if fmt == "wav" else b""
        self._container: Any = None
        if fmt in _AV:
            av = require("av")
            self._av, self._out = av, _Sink()
            muxer, codec = _AV[fmt]
            options = {"flush_packets": "1", **({"page_duration": "100000"} if muxer == "ogg" else {})}  # no holding
            self._container = av.open(self._out, mode="w", format=muxer, options=options)
            self._stream = self._container.add_stream(codec, rate=SPEECH.rate, layout="mono")

    def feed(self, pcm: bytes, last: bool = False) -> bytes:
        """The bytes of `pcm` in this format (a WAV's header first); `last`: the encoder's tail too."""
        head, self._head = self._head, b""
        if self._container is None:
            return head + pcm
        if pcm:
            frame = self._av.AudioFrame.from_ndarray(np.frombuffer(pcm, "<i2")[None, :], format="s16", layout="mono")
            frame.sample_rate = SPEECH.rate
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        if last:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
        return self._out.take()


class _Sink:
    """A write-only file for PyAV: what the muxer wrote since the last take() (no seek: nothing is rewritten)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, b: Any) -> int:
        self._parts.append(bytes(b))
        return len(b)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


# ---- Whisper's words -> transcripts ----------------------------------------------------------------------

def unlooped(words: list[Word]) -> list[Word]:
    """`words` less a loop at their end: Whisper going over what it just heard again once the speech ends ("... aloud.
    Sentence number twenty is here to be spoken aloud." twice over), its repeats aligned to hardly any audio: a run
    that repeats the words before it in less than half their time, or SQUEEZED_RUN words and more aligned to less
    than SQUEEZED_S each and a third of it on average (a repeat spoken, as long as the words it repeats, stays)."""
    out, said = list(words), [normalize(w.text) for w in words]
    k = min(len(out) // 2, 64)  # the longest repeated run first
    while k >= SQUEEZED_RUN:
        n = len(out)
        if n >= 2 * k and said[n - k:] == said[n - 2 * k:n - k] \
                and out[-1].end - out[n - k].start < 0.5 * (out[n - k - 1].end - out[n - 2 * k].start):
            del out[n - k:], said[n - k:]
            k = min(k, len(out) // 2)
        else:
            k -= 1
    tail = list(itertools.takewhile(lambda w: w.end - w.start < SQUEEZED_S, reversed(out)))
    if len(tail) >= SQUEEZED_RUN and sum(w.end - w.start for w in tail) < SQUEEZED_S / 3 * len(tail):
        return out[:len(out) - len(tail)]
    return out


def settle(words: list[Word], held_s: float) -> tuple[list[Word], float]:
    """A pass that stops before the end of the audio: the words it keeps (those ending TAIL_S before its end: at the
    end of a pass Whisper cuts words and makes some up, going on with what it heard) and where the next pass starts
    (s, from this pass's start): just after the last word kept (half way to the next word, HANDOVER_S at most, so
    audio Whisper skipped is heard again), never less than a second on."""
    kept = list(itertools.takewhile(lambda w: w.end <= held_s - TAIL_S, words))
    if not kept:
        return [], held_s - TAIL_S
    after = words[len(kept)].start if len(words) > len(kept) else held_s - TAIL_S
    return kept, max(1.0, kept[-1].end + min(HANDOVER_S, max(0.0, after - kept[-1].end) / 2))


def segments(passes: list[tuple[float, list[Word]]]) -> list[dict[str, Any]]:
    """verbose_json's segments: the words cut after . ? ! and at pauses of GAP_S (Whisper base's log-probabilities
    are not kept: avg_logprob and no_speech_prob are 0; tokens are not returned)."""
    out: list[dict[str, Any]] = []
    for offset, words in passes:
        run: list[Word] = []
        for i, w in enumerate(words):
            run.append(w)
            last = i + 1 == len(words)
            if last or w.text.rstrip().endswith((".", "?", "!")) or words[i + 1].start - w.end >= GAP_S:
                text = "".join(x.text for x in run)
                raw = text.encode()
                out.append({"id": len(out), "seek": round(offset * 100), "start": run[0].start, "end": run[-1].end,
                            "text": text, "tokens": [], "temperature": 0.0, "avg_logprob": 0.0,
                            "compression_ratio": round(len(raw) / len(zlib.compress(raw)), 3),
                            "no_speech_prob": 0.0})
                run = []
    return out


def subtitles(parts: list[dict[str, Any]], vtt: bool) -> str:
    """The segments as SubRip (srt) or WebVTT cues."""
    def at(t: float) -> str:
        ms = round(t * 1000)
        return f"{ms // 3600000:02}:{ms // 60000 % 60:02}:{ms // 1000 % 60:02}{'.' if vtt else ','}{ms % 1000:03}"

    cues = [f"{at(s['start'])} --> {at(s['end'])}\n{s['text'].strip()}\n" for s in parts]
    if vtt:
        return "WEBVTT\n\n" + "\n".join(cues)
    return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))


# Whisper base's 99 languages (ISO-639-1 codes; Whisper's own for a few) and the names verbose_json gives them
# (as OpenAI's whisper-1 does)
_NAMES = ("en english,zh chinese,de german,es spanish,ru russian,ko korean,fr french,ja japanese,pt portuguese,"
          "tr turkish,pl polish,ca catalan,nl dutch,ar arabic,sv swedish,it italian,id indonesian,hi hindi,fi finnish,"
          "vi vietnamese,he hebrew,uk ukrainian,el greek,ms malay,cs czech,ro romanian,da danish,hu hungarian,"
          "ta tamil,no norwegian,th thai,ur urdu,hr croatian,bg bulgarian,lt lithuanian,la latin,mi maori,"
          "ml malayalam,cy welsh,sk slovak,te telugu,fa persian,lv latvian,bn bengali,sr serbian,az azerbaijani,"
          "sl slovenian,kn kannada,et estonian,mk macedonian,br breton,eu basque,is icelandic,hy armenian,"
          "ne nepali,mn mongolian,bs bosnian,kk kazakh,sq albanian,sw swahili,gl galician,mr marathi,pa punjabi,"
          "si sinhala,km khmer,sn shona,yo yoruba,so somali,af afrikaans,oc occitan,ka georgian,be belarusian,"
          "tg tajik,sd sindhi,gu gujarati,am amharic,yi yiddish,lo lao,uz uzbek,fo faroese,ht haitian creole,"
          "ps pashto,tk turkmen,nn nynorsk,mt maltese,sa sanskrit,lb luxembourgish,my myanmar,bo tibetan,"
          "tl tagalog,mg malagasy,as assamese,tt tatar,haw hawaiian,ln lingala,ha hausa,ba bashkir,jw javanese,"
          "su sundanese")
LANGUAGES: dict[str, str] = dict(item.split(" ", 1) for item in _NAMES.split(","))  # type: ignore[misc]
