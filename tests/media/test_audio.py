"""Audio frames: wire formats round trip, G.711 bit-exact to the standard, stateful resampling, typed errors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from voice_assets import needs

from streamserve.errors import InvalidInputError
from streamserve.media.audio import (
    ENCODINGS,
    AudioFormat,
    AudioFormatError,
    AudioInput,
    AudioOutput,
    Resampler,
    alaw_decode,
    alaw_encode,
    decode,
    encode,
    ulaw_decode,
    ulaw_encode,
)

RATES = (8000, 16000, 22050, 24000, 44100, 48000)
ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)  # [65536]
ALL_CODES = bytes(range(256))


def _audioop():
    with warnings.catch_warnings():  # deprecated in 3.11, gone in 3.13: the reference only where it exists
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip("audioop", reason="audioop (the G.711 reference) was removed in Python 3.13")


def _sine(freq: float, rate: int, seconds: float = 0.5, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _noise(n: int, seed: int = 0, amp: float = 0.3) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).standard_normal(n) * amp, -1, 1).astype(np.float32)


# ---- G.711 ----------------------------------------------------------------------------------------------------------

def test_g711_encode_is_bit_exact_for_every_int16_sample():
    audioop = _audioop()
    pcm = ALL_INT16.tobytes()
    assert ulaw_encode(ALL_INT16) == audioop.lin2ulaw(pcm, 2)
    assert alaw_encode(ALL_INT16) == audioop.lin2alaw(pcm, 2)
    # float input is the int16 value / 32768: the same codes
    assert ulaw_encode(ALL_INT16 / 32768.0) == audioop.lin2ulaw(pcm, 2)
    assert alaw_encode(ALL_INT16.astype(np.float32) / 32768) == audioop.lin2alaw(pcm, 2)


def test_g711_decode_is_bit_exact_for_every_code():
    audioop = _audioop()
    for ours, ref in ((ulaw_decode, audioop.ulaw2lin), (alaw_decode, audioop.alaw2lin)):
        x = ours(ALL_CODES)
        assert x.dtype == np.float32 and x.shape == (256,)
        assert (x * 32768).astype(np.int16).tobytes() == ref(ALL_CODES, 2)


def test_g711_codes_survive_decode_encode():
    # every code decodes to a level that encodes back to the same code (mu-law's two zeros aside)
    assert alaw_encode(alaw_decode(ALL_CODES)) == ALL_CODES
    back = np.frombuffer(ulaw_encode(ulaw_decode(ALL_CODES)), np.uint8)
    differ = np.nonzero(back != np.arange(256))[0]
    assert set(differ.tolist()) <= {0x7F}  # 0x7F is "-0", which encodes back as 0xFF ("+0")


def test_g711_clips_out_of_range_floats_and_nan():
    x = np.array([2.0, -2.0, np.nan, 1.0, -1.0], np.float32)
    assert ulaw_encode(x) == ulaw_encode(np.array([32767, -32768, 0, 32767, -32768], np.int16))
    assert alaw_encode(x) == alaw_encode(np.array([32767, -32768, 0, 32767, -32768], np.int16))


# ---- formats --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("channels", [1, 2, 3])
def test_round_trip(encoding: str, channels: int):
    rate = 8000 if encoding.startswith("g711") else 24000
    fmt = AudioFormat(encoding, rate, channels)
    x = _noise(1001)  # an odd number of frames
    data = encode(x, fmt)
    assert len(data) == 1001 * fmt.bytes_per_frame
    assert fmt.duration_ms(len(data)) == pytest.approx(1000 * 1001 / rate)
    y = decode(data, fmt)
    assert y.dtype == np.float32 and y.shape == (1001,)
    tol = {"pcm16": 1 / 32768, "float32": 0.0}.get(encoding)
    if tol is not None:
        np.testing.assert_allclose(y, x, atol=tol)
    else:  # G.711: about 38 dB of SNR on a loud signal
        snr = 10 * np.log10(np.sum(x**2) / np.sum((y - x) ** 2))
        assert snr > 30
    assert encode(y, fmt) == data  # decoded levels are exact codes of the format


def test_pcm16_is_little_endian_and_channels_average():
    fmt = AudioFormat("pcm16", 16000, 2)
    data = np.array([16384, -16384, 8192, 8192], "<i2").tobytes()  # two frames of (left, right)
    np.testing.assert_array_equal(decode(data, fmt), np.array([0.0, 0.25], np.float32))
    assert encode(np.array([0.5], np.float32), fmt) == np.array([16384, 16384], "<i2").tobytes()
    assert encode(np.array([1.5, -1.5], np.float32), AudioFormat("pcm16")) == b"\xff\x7f\x00\x80"  # clipped


def test_float32_decode_clips_and_empty_input():
    fmt = AudioFormat("float32", 48000)
    np.testing.assert_array_equal(decode(np.array([1.5, -0.25], "<f4").tobytes(), fmt), [1.0, -0.25])
    for encoding in ENCODINGS:
        fmt = AudioFormat(encoding, 8000, 2)
        assert decode(b"", fmt).shape == (0,)
        assert encode(np.zeros(0, np.float32), fmt) == b""


@pytest.mark.parametrize(("fmt", "hint"), [
    (AudioFormat("opus"), "pcm16"),
    (AudioFormat("pcm16", 7999), "8000"),
    (AudioFormat("pcm16", 192001), "192000"),
    (AudioFormat("pcm16", 16000.0), "integer"),  # type: ignore[arg-type]
    (AudioFormat("pcm16", 16000, 0), "mono"),
    (AudioFormat("pcm16", 16000, 9), "8"),
    (AudioFormat("g711_ulaw", 16000), "8000 Hz"),
    (AudioFormat("g711_alaw", 24000), "8000 Hz"),
])
def test_bad_formats_are_typed_errors(fmt: AudioFormat, hint: str):
    with pytest.raises(AudioFormatError, match=hint) as e:
        fmt.check()
    assert e.value.code == "invalid_audio_format" and isinstance(e.value, InvalidInputError)
    with pytest.raises(AudioFormatError):
        decode(b"\x00" * 8, fmt)
    with pytest.raises(AudioFormatError):
        AudioInput(fmt)


@pytest.mark.parametrize(("fmt", "n_bytes"), [
    (AudioFormat("pcm16"), 3), (AudioFormat("pcm16", channels=2), 6),
    (AudioFormat("float32"), 6), (AudioFormat("g711_ulaw", 8000, 2), 5),
])
def test_partial_frames_are_refused(fmt: AudioFormat, n_bytes: int):
    with pytest.raises(AudioFormatError, match=f"multiple of {fmt.bytes_per_frame} bytes"):
        decode(b"\x01" * n_bytes, fmt)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_float32_is_refused(bad: float):
    data = np.array([0.0, bad, 0.1], "<f4").tobytes()
    with pytest.raises(AudioFormatError, match="finite"):
        decode(data, AudioFormat("float32", 16000))


def test_encode_wants_mono():
    with pytest.raises(AudioFormatError, match="mono"):
        encode(np.zeros((10, 2), np.float32), AudioFormat())


# ---- resampling -----------------------------------------------------------------------------------------------------

def _resample_in_pieces(r: Resampler, x: np.ndarray, sizes: list[int]) -> np.ndarray:
    out, i = [], 0
    while i < len(x):
        for n in sizes:
            out.append(r.process(x[i:i + n]))
            i += n
    out.append(r.flush())
    return np.concatenate(out)


@pytest.mark.parametrize(("src", "dst"), [(24000, 16000), (44100, 16000), (8000, 16000), (22050, 24000),
                                          (48000, 8000), (16000, 44100)])
def test_resampler_is_chunk_invariant(src: int, dst: int):
    needs("soxr")
    x = _noise(src // 2 + 7)
    whole = Resampler(src, dst)
    once = np.concatenate([whole.process(x), whole.flush()])
    pieces = _resample_in_pieces(Resampler(src, dst), x, [1, 0, 7, 333, 160, 1001, 2])
    assert len(once) == len(pieces) == pytest.approx(len(x) * dst / src, abs=2)
    np.testing.assert_allclose(pieces, once, atol=1e-5)
    # after flush the resampler starts a fresh signal: the same input gives the same output again
    again = np.concatenate([whole.process(x), whole.flush()])
    np.testing.assert_allclose(again, once, atol=1e-6)


@pytest.mark.parametrize("src", RATES)
@pytest.mark.parametrize("dst", RATES)
def test_sine_keeps_its_frequency(src: int, dst: int):
    needs("soxr")
    freq = 440.0 * 3  # 1320 Hz: under every Nyquist frequency here
    r = Resampler(src, dst)
    y = np.concatenate([r.process(_sine(freq, src, 1.0)), r.flush()])  # [~dst] samples of one second
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    peak_hz = np.argmax(spectrum) * dst / len(y)
    assert abs(peak_hz - freq) <= 2.0
    rms = np.sqrt(np.mean(y[len(y) // 4: -len(y) // 4] ** 2))
    assert rms == pytest.approx(0.5 / np.sqrt(2), rel=0.02)  # the level survives too


def test_identity_resampler_copies():
    r = Resampler(16000, 16000)
    x = _noise(100)
    y = r.process(x)
    np.testing.assert_array_equal(y, x)
    assert y is not x and r.flush().shape == (0,)


def test_resampler_refuses_bad_rates():
    with pytest.raises(AudioFormatError, match="8000 to 192000"):
        Resampler(0, 16000)


def test_audio_input_decodes_and_resamples_to_16k():
    needs("soxr")
    fmt = AudioFormat("pcm16", 24000, 2)
    x = _sine(1000.0, 24000, 1.0)
    data = encode(x, fmt)
    inp = AudioInput(fmt)
    frame = 24000 // 50 * fmt.bytes_per_frame  # 20 ms frames
    out = np.concatenate([inp.feed(data[i:i + frame]) for i in range(0, len(data), frame)] + [inp.flush()])
    ref = Resampler(24000, 16000)
    expected = np.concatenate([ref.process(decode(data, fmt)), ref.flush()])
    assert len(out) == 16000
    np.testing.assert_allclose(out, expected, atol=1e-5)
    with pytest.raises(AudioFormatError):
        inp.feed(data[:3])


@pytest.mark.parametrize("fmt", [AudioFormat("pcm16", 24000), AudioFormat("g711_ulaw", 8000),
                                 AudioFormat("float32", 48000, 2)])
def test_audio_output_encodes_tts_audio(fmt: AudioFormat):
    needs("soxr")
    x = _sine(500.0, 22050, 0.5)
    out = AudioOutput(22050, fmt)
    pieces = [out.feed(x[i:i + 1000]) for i in range(0, len(x), 1000)]
    data = b"".join(pieces) + out.flush()
    assert all(len(p) % fmt.bytes_per_frame == 0 for p in pieces)
    y = decode(data, fmt)
    assert len(y) == pytest.approx(fmt.rate // 2, abs=2)
    peak_hz = np.argmax(np.abs(np.fft.rfft(y * np.hanning(len(y))))) * fmt.rate / len(y)
    assert abs(peak_hz - 500.0) <= 4.0
