"""Audio frames: the client's wire formats <-> float32 mono, and stateful resampling.

Every sample inside streamserve is float32 mono in [-1, 1] ("audio" below, shape [n]). A client's format is an
AudioFormat (encoding, rate, channels); `decode` turns its bytes into audio (channels averaged), `encode` turns audio
back into its bytes (channels duplicated). G.711 (mu-law, A-law) follows ITU-T G.711 bit for bit through lookup
tables built once from the standard's segment rules (65536 entries to encode an int16, 256 to decode a byte).
Resampling is soxr's streaming resampler (the voice extra), stateful so a stream cut into frames of any size
resamples as one signal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamserve.errors import InvalidInputError
from streamserve.media import require

ENCODINGS = ("pcm16", "float32", "g711_ulaw", "g711_alaw")
_SAMPLE_BYTES = {"pcm16": 2, "float32": 4, "g711_ulaw": 1, "g711_alaw": 1}
_G711 = ("g711_ulaw", "g711_alaw")
MIN_RATE, MAX_RATE, MAX_CHANNELS = 8000, 192000, 8


class AudioFormatError(InvalidInputError):
    """Audio the server cannot read as declared; the message says what to send instead."""

    code = "invalid_audio_format"


@dataclass(frozen=True)
class AudioFormat:
    """A client's audio on the wire: little-endian PCM16, float32, or 8-bit G.711, `channels` interleaved."""

    encoding: str = "pcm16"
    rate: int = 24000  # sample frames per second
    channels: int = 1

    def check(self) -> AudioFormat:
        """This format, or AudioFormatError naming what is accepted."""
        if self.encoding not in ENCODINGS:
            raise AudioFormatError(f"unknown audio encoding {self.encoding!r}: send one of {', '.join(ENCODINGS)}")
        if isinstance(self.rate, bool) or not isinstance(self.rate, int) or not MIN_RATE <= self.rate <= MAX_RATE:
            raise AudioFormatError(f"audio rate {self.rate!r} Hz is not supported: send an integer sample rate "
                                   f"from {MIN_RATE} to {MAX_RATE} Hz (16000 or 24000 are typical)")
        if isinstance(self.channels, bool) or not isinstance(self.channels, int) \
                or not 1 <= self.channels <= MAX_CHANNELS:
            raise AudioFormatError(f"{self.channels!r} audio channels are not supported: send 1 (mono) to "
                                   f"{MAX_CHANNELS} interleaved channels")
        if self.encoding in _G711 and self.rate != 8000:
            raise AudioFormatError(f"{self.encoding} audio is 8000 Hz by definition (G.711), not {self.rate} Hz: "
                                   "send it at 8000 Hz, or send pcm16 at the higher rate")
        return self

    @property
    def bytes_per_frame(self) -> int:
        """Bytes of one sample frame (one sample of every channel)."""
        return _SAMPLE_BYTES[self.encoding] * self.channels

    def duration_ms(self, n_bytes: int) -> float:
        """Milliseconds of audio in `n_bytes` of this format."""
        return 1000.0 * n_bytes / self.bytes_per_frame / self.rate


# ---- G.711 (ITU-T), as lookup tables -------------------------------------------------------------------------------

_ALL_INT16 = np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.int32)  # [65536] every sample, by uint16 view
_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])  # 14-bit magnitude + bias
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])  # 13-bit magnitude


def _ulaw_from_int16(s: np.ndarray) -> np.ndarray:
    """[n] int32 samples of int16 range -> [n] uint8 mu-law codes."""
    v = s >> 2  # mu-law codes a 14-bit signal
    negative = v < 0
    mag = np.where(negative, -v, v) + 0x21  # biased magnitude: the segments then start at powers of two
    seg = np.searchsorted(_ULAW_SEG_END, mag, side="left")  # first segment whose end >= mag (8: beyond the last)
    code = (seg << 4) | ((mag >> (np.minimum(seg, 7) + 1)) & 0xF)
    code = np.where(seg >= 8, 0x7F, code)  # over range: the largest code
    return (code ^ np.where(negative, 0x7F, 0xFF)).astype(np.uint8)  # sign bit, and all bits inverted


def _alaw_from_int16(s: np.ndarray) -> np.ndarray:
    """[n] int32 samples of int16 range -> [n] uint8 A-law codes."""
    v = s >> 3  # A-law codes a 13-bit signal
    negative = v < 0
    mag = np.where(negative, -v - 1, v)  # one's complement magnitude for negatives, as the standard does
    seg = np.searchsorted(_ALAW_SEG_END, mag, side="left")
    shift = np.where(seg < 2, 1, np.minimum(seg, 7))  # the first two segments share one step size
    code = (seg << 4) | ((mag >> shift) & 0xF)
    code = np.where(seg >= 8, 0x7F, code)
    return (code ^ np.where(negative, 0x55, 0xD5)).astype(np.uint8)  # even bits inverted, sign bit set if >= 0


def _ulaw_to_int16(c: np.ndarray) -> np.ndarray:
    """[n] mu-law codes (0..255) -> [n] int16 samples."""
    u = ~c & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)  # mantissa with bias, shifted by the segment
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _alaw_to_int16(c: np.ndarray) -> np.ndarray:
    """[n] A-law codes (0..255) -> [n] int16 samples."""
    a = c ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))  # mid-step reconstruction
    return np.where(a & 0x80, t, -t).astype(np.int16)


_CODES = np.arange(256, dtype=np.int32)
_ULAW_ENC = _ulaw_from_int16(_ALL_INT16)  # [65536] uint8, indexed by the int16 sample's uint16 view
_ALAW_ENC = _alaw_from_int16(_ALL_INT16)
_ULAW_DEC = _ulaw_to_int16(_CODES)  # [256] int16
_ALAW_DEC = _alaw_to_int16(_CODES)


def _to_int16(x: np.ndarray) -> np.ndarray:
    """float audio [n] -> int16 [n] (x * 32768 rounded, clipped; NaN -> 0); int16 input passes through."""
    x = np.asarray(x)
    if x.dtype == np.int16:
        return x
    y = np.nan_to_num(x.astype(np.float64), nan=0.0) * 32768.0
    return np.clip(np.rint(y), -32768, 32767).astype(np.int16)


def ulaw_encode(x: np.ndarray) -> bytes:
    """Audio [n] (float in [-1, 1], or int16 samples) -> n bytes of G.711 mu-law."""
    return _ULAW_ENC[_to_int16(x).view(np.uint16)].tobytes()


def ulaw_decode(b: bytes) -> np.ndarray:
    """n bytes of G.711 mu-law -> float32 audio [n] in [-1, 1] (the int16 value / 32768)."""
    return _ULAW_DEC[np.frombuffer(b, np.uint8)].astype(np.float32) / np.float32(32768)


def alaw_encode(x: np.ndarray) -> bytes:
    """Audio [n] (float in [-1, 1], or int16 samples) -> n bytes of G.711 A-law."""
    return _ALAW_ENC[_to_int16(x).view(np.uint16)].tobytes()


def alaw_decode(b: bytes) -> np.ndarray:
    """n bytes of G.711 A-law -> float32 audio [n] in [-1, 1] (the int16 value / 32768)."""
    return _ALAW_DEC[np.frombuffer(b, np.uint8)].astype(np.float32) / np.float32(32768)


# ---- whole frames ---------------------------------------------------------------------------------------------------

def decode(data: bytes, fmt: AudioFormat) -> np.ndarray:
    """Bytes in `fmt` -> float32 mono audio [n_frames] in [-1, 1], the channels averaged."""
    fmt.check()
    if len(data) % fmt.bytes_per_frame:
        raise AudioFormatError(
            f"{len(data)} bytes are not whole {fmt.encoding} frames: with {fmt.channels} channel(s) a frame is "
            f"{fmt.bytes_per_frame} bytes, so send a multiple of {fmt.bytes_per_frame} bytes per append")
    if fmt.encoding == "pcm16":
        x = np.frombuffer(data, "<i2").astype(np.float32) / np.float32(32768)
    elif fmt.encoding == "float32":
        x = np.frombuffer(data, "<f4").astype(np.float32)
        if not np.isfinite(x).all():
            raise AudioFormatError("float32 audio holds NaN or infinite samples: send finite little-endian "
                                   "float32 samples in [-1, 1] (or pcm16)")
        x = np.clip(x, -1.0, 1.0)
    elif fmt.encoding == "g711_ulaw":
        x = ulaw_decode(data)
    else:
        x = alaw_decode(data)
    if fmt.channels > 1:  # [n_frames * channels] interleaved -> [n_frames]
        x = x.reshape(-1, fmt.channels).mean(axis=1, dtype=np.float64).astype(np.float32)  # exact for equal channels
    return x


def encode(x: np.ndarray, fmt: AudioFormat) -> bytes:
    """Float mono audio [n] -> bytes in `fmt` (clipped to [-1, 1]; the signal copied to every channel)."""
    fmt.check()
    x = _mono(x)
    if fmt.channels > 1:  # [n] -> [n, channels] -> interleaved [n * channels]
        x = np.repeat(x[:, None], fmt.channels, axis=1).reshape(-1)
    if fmt.encoding == "pcm16":
        return _to_int16(x).astype("<i2").tobytes()
    if fmt.encoding == "float32":
        return np.clip(np.nan_to_num(x, nan=0.0), -1.0, 1.0).astype("<f4").tobytes()
    return ulaw_encode(x) if fmt.encoding == "g711_ulaw" else alaw_encode(x)


def _mono(x: np.ndarray) -> np.ndarray:
    """A 1-D float32 array, or AudioFormatError (a programming slip: the media path is mono float32)."""
    x = np.asarray(x)
    if x.ndim != 1:
        raise AudioFormatError(f"expected mono audio of shape [n], got shape {list(x.shape)}: average the "
                               "channels first (decode does)")
    return np.ascontiguousarray(x, dtype=np.float32)


# ---- resampling -----------------------------------------------------------------------------------------------------

class Resampler:
    """Stateful resampling of one mono stream from in_rate to out_rate (soxr, high quality).

    The filter holds back a few ms of output (its delay: ~264 samples at 16 kHz out of 24 kHz); `flush` returns
    them at the end of the signal, after which the resampler starts a fresh signal.
    """

    def __init__(self, in_rate: int, out_rate: int) -> None:
        for rate in (in_rate, out_rate):
            if isinstance(rate, bool) or not isinstance(rate, int) or not MIN_RATE <= rate <= MAX_RATE:
                raise AudioFormatError(f"cannot resample at {rate!r} Hz: rates go from {MIN_RATE} to {MAX_RATE} Hz")
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream = None
        if in_rate != out_rate:
            soxr = require("soxr")
            self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ")

    def process(self, x: np.ndarray) -> np.ndarray:
        """Float32 mono [n] at in_rate -> float32 mono [m] at out_rate (m ~ n * out/in, less the held-back tail)."""
        x = _mono(x)
        if self._stream is None:
            return x.copy()
        if x.size == 0:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(x)

    def flush(self) -> np.ndarray:
        """The tail the filter held back [k] at out_rate; the resampler is then ready for a new signal."""
        if self._stream is None:
            return np.zeros(0, np.float32)
        tail = self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
        self._stream.clear()  # soxr refuses input after the last chunk until cleared
        return tail


class AudioInput:
    """One stream's input: client bytes in `fmt` -> float32 mono audio at out_rate (16 kHz for VAD and Whisper)."""

    def __init__(self, fmt: AudioFormat, out_rate: int = 16000) -> None:
        self.format = fmt.check()
        self.out_rate = out_rate
        self._resampler = Resampler(fmt.rate, out_rate)

    def feed(self, data: bytes) -> np.ndarray:
        """Whole frames of `fmt` -> float32 mono [m] at out_rate (AudioFormatError for partial frames)."""
        return self._resampler.process(decode(data, self.format))

    def flush(self) -> np.ndarray:
        """The resampler's held-back tail at the end of the input [k] at out_rate."""
        return self._resampler.flush()


class AudioOutput:
    """One reply's output: float32 mono audio at in_rate (the TTS voice's) -> bytes in the client's `fmt`."""

    def __init__(self, in_rate: int, fmt: AudioFormat) -> None:
        self.format = fmt.check()
        self.in_rate = in_rate
        self._resampler = Resampler(in_rate, fmt.rate)

    def feed(self, x: np.ndarray) -> bytes:
        """Audio [n] at in_rate -> whole frames of `fmt` (part may be held back by the resampler until flush)."""
        return encode(self._resampler.process(x), self.format)

    def flush(self) -> bytes:
        """The held-back tail, encoded, at the end of the reply."""
        return encode(self._resampler.flush(), self.format)
