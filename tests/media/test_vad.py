"""Voice activity: Silero VAD over onnxruntime and server-VAD turn detection on real synthesised speech."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from voice_assets import needs, speech, voice_model

from streamserve.errors import InvalidInputError
from streamserve.media.vad import (
    SAMPLE_RATE,
    WINDOW,
    InvalidTurnDetectionError,
    SileroVAD,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    VADConfig,
)

QUESTION = "Which city is the capital of France?"
MS = SAMPLE_RATE // 1000  # samples per ms


@pytest.fixture(scope="module")
def vad() -> SileroVAD:
    needs("onnxruntime")
    return SileroVAD(voice_model("silero-vad"))


def _padded(x: np.ndarray, seconds: float = 1.0) -> tuple[np.ndarray, int, int]:
    """x with `seconds` of silence both sides; returns (audio, first and last audible ms of the speech)."""
    pad = np.zeros(int(SAMPLE_RATE * seconds), np.float32)
    audible = np.nonzero(np.abs(x) > 0.02)[0]
    first, last = (len(pad) + audible[0]) // MS, (len(pad) + audible[-1]) // MS
    return np.concatenate([pad, x, pad]), int(first), int(last)


def _feed(det: TurnDetector, audio: np.ndarray, frame: int) -> list[tuple[int, SpeechStarted | SpeechStopped]]:
    """Feed `audio` in frames of `frame` samples; returns (samples fed when it came, event) pairs."""
    events = []
    for i in range(0, len(audio), frame):
        events += [(min(i + frame, len(audio)), e) for e in det.feed(audio[i:i + frame])]
    return events


def test_model_inputs_are_silero_v6(vad: SileroVAD):
    inputs = {i.name: i.shape for i in vad.session.get_inputs()}
    assert set(inputs) == {"input", "state", "sr"} and inputs["state"][0] == 2 and inputs["state"][2] == 128
    assert [o.name for o in vad.session.get_outputs()] == ["output", "stateN"]


def test_missing_model_names_the_pull_command(tmp_path):
    from streamserve.media import VoiceUnavailableError

    with pytest.raises(VoiceUnavailableError, match="streamserve models pull silero-vad"):
        SileroVAD(tmp_path / "nope.onnx")


def test_one_probability_per_complete_window(vad: SileroVAD):
    x = speech(QUESTION)
    whole = vad.stream().probabilities(x)
    assert whole.shape == (len(x) // WINDOW,) and whole.dtype == np.float32
    assert ((whole >= 0) & (whole <= 1)).all() and whole.max() > 0.9
    s = vad.stream()
    parts = [s.probabilities(x[i:i + n]) for i, n in _cuts(len(x), [1, 511, 0, 700, 13, 2048])]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-5)  # leftovers and state carry over
    assert s.pending == len(x) % WINDOW
    s.reset()
    np.testing.assert_allclose(s.probabilities(x), whole, atol=1e-5)


def _cuts(n: int, sizes: list[int]) -> list[tuple[int, int]]:
    out, i, k = [], 0, 0
    while i < n:
        out.append((i, sizes[k % len(sizes)]))
        i += sizes[k % len(sizes)]
        k += 1
    return out


@pytest.mark.parametrize("level", [0.0, 0.003, 0.02])
def test_silence_and_low_noise_are_not_speech(vad: SileroVAD, level: float):
    noise = (np.random.default_rng(1).standard_normal(SAMPLE_RATE * 4) * level).astype(np.float32)
    det = TurnDetector(vad, VADConfig())
    assert _feed(det, noise, 320) == [] and not det.speaking
    assert det.audio_ms == 4000.0


def test_one_turn_from_synthesised_speech(vad: SileroVAD):
    audio, first_ms, last_ms = _padded(speech(QUESTION))
    det = TurnDetector(vad, VADConfig())  # threshold 0.5, 300 ms prefix, 500 ms silence
    events = _feed(det, audio, 320)  # 20 ms frames
    assert [type(e) for _, e in events] == [SpeechStarted, SpeechStopped]
    (fed_start, start), (fed_stop, stop) = events
    # detected within a few windows of the first audible sound, reported 300 ms before the detecting window
    assert first_ms - 300 - 4 * 32 <= start.audio_start_ms <= first_ms - 300 + 4 * 32
    assert (start.audio_start_ms + 300) * MS % WINDOW == 0  # a window boundary, minus the prefix padding
    # stopped 500 ms of silence after the last voiced window: Silero keeps scoring the 2-4 windows after the
    # last audible sample as speech (~100-150 ms over the runs of Piper, whose synthesis is randomised)
    assert last_ms + 500 - 2 * 32 <= stop.audio_end_ms <= last_ms + 500 + 8 * 32
    assert stop.audio_end_ms * MS <= fed_stop  # detected on audio already fed
    assert not det.speaking and det.audio_ms == len(audio) / MS
    # the started event carries the audio from audio_start_ms to what was fed, prefix padding included
    np.testing.assert_array_equal(start.audio, audio[start.audio_start_ms * MS:fed_start])


def test_frame_size_does_not_change_the_events(vad: SileroVAD):
    audio, _, _ = _padded(speech(QUESTION))
    runs = {}
    for frame in (160, 320, 441, 512, 1600, 3200, 7):
        events = _feed(TurnDetector(vad, VADConfig()), audio, frame)
        runs[frame] = [(type(e).__name__, getattr(e, "audio_start_ms", None), getattr(e, "audio_end_ms", None))
                       for _, e in events]
    assert len(runs[320]) == 2
    assert all(r == runs[320] for r in runs.values()), runs
    one = TurnDetector(vad, VADConfig()).feed(audio)  # the whole signal at once: the same two events
    assert [(type(e).__name__, getattr(e, "audio_start_ms", None), getattr(e, "audio_end_ms", None))
            for e in one] == runs[320]
    np.testing.assert_array_equal(one[0].audio, audio[one[0].audio_start_ms * MS:])


@pytest.mark.parametrize("prefix_ms", [0, 100, 300, 800, 5000])
def test_prefix_padding_length(vad: SileroVAD, prefix_ms: int):
    audio, _, _ = _padded(speech(QUESTION))
    config = VADConfig(prefix_padding_ms=prefix_ms)
    base = _feed(TurnDetector(vad, VADConfig(prefix_padding_ms=0)), audio, 320)[0]
    fed, start = _feed(TurnDetector(vad, config), audio, 320)[0]
    assert fed == base[0]  # the padding does not change when speech is detected
    detected_ms = base[1].audio_start_ms  # the detecting window's start
    assert start.audio_start_ms == max(detected_ms - prefix_ms, 0)  # clamped at the start of the stream
    assert len(start.audio) == fed - start.audio_start_ms * MS
    assert len(start.audio) - len(base[1].audio) == min(prefix_ms, detected_ms) * MS


def test_a_short_pause_does_not_end_the_turn(vad: SileroVAD):
    x = speech(QUESTION)
    # the 200 ms pause scores under the release threshold for ~320-380 ms (with Piper's own quiet edges); the
    # question itself never dips under it
    audio, _, _ = _padded(np.concatenate([x, np.zeros(200 * MS, np.float32), x]))
    events = [e for _, e in _feed(TurnDetector(vad, VADConfig(silence_duration_ms=500)), audio, 320)]
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
    split = [e for _, e in _feed(TurnDetector(vad, VADConfig(silence_duration_ms=100)), audio, 320)]
    assert [type(e) for e in split] == [SpeechStarted, SpeechStopped] * 2  # a shorter silence splits it


def test_two_streams_share_one_vad(vad: SileroVAD):
    audio, _, _ = _padded(speech(QUESTION))
    quiet = np.zeros_like(audio)
    alone = _feed(TurnDetector(vad, VADConfig()), audio, 320)
    a, b, c = (TurnDetector(vad, VADConfig()) for _ in range(3))
    got: dict[str, list] = {"a": [], "b": [], "c": []}
    for i in range(0, len(audio), 320):  # interleaved on one thread
        got["a"] += a.feed(audio[i:i + 320])
        got["b"] += b.feed(quiet[i:i + 320])
    assert got["b"] == [] and _same(got["a"], [e for _, e in alone])

    def run() -> None:  # and on another thread at the same time
        got["c"] = [e for _, e in _feed(c, audio, 480)]

    t = threading.Thread(target=run)
    t.start()
    mine = [e for _, e in _feed(TurnDetector(vad, VADConfig()), audio, 320)]
    t.join()
    assert _same(got["c"], mine) and _same(mine, [e for _, e in alone])


def _same(x: list, y: list) -> bool:
    key = [(type(e), getattr(e, "audio_start_ms", None), getattr(e, "audio_end_ms", None)) for e in x]
    return key == [(type(e), getattr(e, "audio_start_ms", None), getattr(e, "audio_end_ms", None)) for e in y]


def test_reset_forgets_speech_but_keeps_the_clock(vad: SileroVAD):
    audio, _, _ = _padded(speech(QUESTION))
    det = TurnDetector(vad, VADConfig())
    half = len(audio) // 2  # in the middle of the speech
    assert [type(e) for e in det.feed(audio[:half])] == [SpeechStarted] and det.speaking
    det.reset()
    assert not det.speaking and det.audio_ms == half / MS
    events = det.feed(np.zeros(SAMPLE_RATE, np.float32))
    assert events == [] and det.audio_ms == (half + SAMPLE_RATE) / MS
    later = det.feed(audio)  # times stay on the stream's clock, after the reset point
    assert [type(e) for e in later] == [SpeechStarted, SpeechStopped]
    assert later[0].audio_start_ms >= (half + SAMPLE_RATE) // MS


@pytest.mark.parametrize(("config", "field"), [
    (VADConfig(threshold=0.0), "threshold"), (VADConfig(threshold=1.0), "threshold"),
    (VADConfig(threshold=float("nan")), "threshold"), (VADConfig(threshold="0.5"), "threshold"),  # type: ignore
    (VADConfig(prefix_padding_ms=-1), "prefix_padding_ms"), (VADConfig(prefix_padding_ms=5001), "prefix_padding_ms"),
    (VADConfig(silence_duration_ms=10001), "silence_duration_ms"),
    (VADConfig(silence_duration_ms=True), "silence_duration_ms"),  # type: ignore[arg-type]
    (VADConfig(idle_timeout_ms=0), "idle_timeout_ms"),
])
def test_bad_config_is_a_typed_error(config: VADConfig, field: str):
    with pytest.raises(InvalidTurnDetectionError, match=f"turn_detection.{field}") as e:
        config.check()
    assert e.value.code == "invalid_turn_detection" and isinstance(e.value, InvalidInputError)


def test_config_edges_are_accepted():
    for config in (VADConfig(), VADConfig(0.01, 0, 0), VADConfig(0.99, 5000, 10000, idle_timeout_ms=5000)):
        assert config.check() is config
