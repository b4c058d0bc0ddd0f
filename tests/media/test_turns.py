"""Semantic turn detection (media/turns.py and TurnDetector.hear): the rule set on hand-written transcripts, and the
detector ending a complete question's turn sooner than a trailing fragment's on real audio, compared by where the
stop lands on the audio clock (no times measured)."""

from __future__ import annotations

import numpy as np
import pytest
from voice_assets import needs, speech, voice_model

from streamserve.media.turns import SILENCE_MS, turn_silence_ms, turn_state
from streamserve.media.vad import SAMPLE_RATE, InvalidTurnDetectionError, SpeechStopped, TurnDetector, VADConfig


@pytest.mark.parametrize(("text", "state"), [
    ("What is the capital of France?", "complete"),
    (" Tell me a story.", "complete"),
    ("Stop!", "complete"),
    ('He said "yes."', "complete"),
    ("I went to the market and", "trailing"),
    ("I went to the market and.", "trailing"),  # Whisper's period after a fragment: the trailing word wins
    ("So I think.", "trailing"),
    ("Well, um", "trailing"),
    ("Let me see,", "trailing"),
    ("and then...", "trailing"),
    ("The weather today", "open"),
    ("", "open"),
    ("   ", "open"),
])
def test_how_the_words_so_far_end(text: str, state: str) -> None:
    assert turn_state(text) == state


def test_eagerness_orders_the_silences() -> None:
    for eagerness in ("low", "medium", "high", "auto"):
        complete, open_, trailing = SILENCE_MS[eagerness]
        assert complete < open_ < trailing
    assert SILENCE_MS["auto"] == SILENCE_MS["medium"]
    assert [SILENCE_MS[e][2] for e in ("high", "medium", "low")] == [2000, 4000, 8000]  # the API's maximum waits
    assert turn_silence_ms("Why?", "high") < turn_silence_ms("Why?", "medium") < turn_silence_ms("Why?", "low")


def test_semantic_config_checks_its_eagerness() -> None:
    config = VADConfig.semantic("high")
    assert config.eagerness == "high" and config.silence_duration_ms == SILENCE_MS["high"][1]
    with pytest.raises(InvalidTurnDetectionError, match="eagerness"):
        VADConfig.semantic("eager")
    with pytest.raises(InvalidTurnDetectionError, match="eagerness"):
        VADConfig(eagerness="sometimes").check()


def stop_after_speech(detector: TurnDetector, audio: np.ndarray, text: str, speech_end: int) -> int:
    """Feed 20 ms frames; once the speech is over, tell the detector the words (as the Listener does after its
    pass at the first silence). -> the stop's audio_end_ms."""
    told = False
    for i in range(0, audio.size, 320):
        if not told and i >= speech_end:
            detector.hear(text)
            told = True
        for event in detector.feed(audio[i:i + 320]):
            if isinstance(event, SpeechStopped):
                return event.audio_end_ms
    raise AssertionError("the turn never ended")


def test_a_complete_question_ends_sooner_than_a_trailing_fragment() -> None:
    needs("onnxruntime")
    from streamserve.media.vad import SileroVAD

    vad = SileroVAD(voice_model("silero-vad"))
    ends = {}
    for text in ("What is the capital of France?", "I went to the market and"):
        said = speech(text)
        audio = np.concatenate([said, np.zeros(5 * SAMPLE_RATE, np.float32)])
        detector = TurnDetector(vad, VADConfig.semantic("auto"))
        ends[text] = stop_after_speech(detector, audio, text, said.size) - 1000 * said.size // SAMPLE_RATE
    complete, trailing = ends["What is the capital of France?"], ends["I went to the market and"]
    assert complete < trailing, ends
    assert complete <= SILENCE_MS["auto"][0] + 300 and trailing >= SILENCE_MS["auto"][2] - 300, ends
    # server_vad ignores the words: its silence is its own
    detector = TurnDetector(vad, VADConfig(silence_duration_ms=500))
    said = speech("What is the capital of France?")
    audio = np.concatenate([said, np.zeros(2 * SAMPLE_RATE, np.float32)])
    end = stop_after_speech(detector, audio, "What is the capital of France?", said.size)
    assert end - 1000 * said.size // SAMPLE_RATE >= 500 - 100
