"""Whisper over the audio held (streamserve.media.whisper): the window and bound rules and the repeat filter on
hand-made tokens (no model), then the real Whisper base against its own 30 s window path, batched against one at a
time, on silence, noise and long audio (skipped without the voice extra or the models)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from voice_assets import edit_distance, needs, norm_words, speech, voice_model

from streamserve.errors import InvalidInputError
from streamserve.media.stt import StreamingTranscriber
from streamserve.media.whisper import (
    MIN_WINDOW_S,
    SAMPLE_RATE,
    WINDOW_S,
    PassRequest,
    Whisper,
    held_window_s,
    token_bound,
)

PHRASES = ("Which city is the capital of France?", "Okay.", "Please remind me to call my sister at seven.",
           "The quick brown fox jumps over the lazy dog near the river bank today.")


def text_of(words: list) -> str:
    return "".join(w.text for w in words)


# -- rules, no model ---------------------------------------------------------------------------------------------

def test_held_window_is_the_audio_plus_padding_in_whole_steps_and_at_most_whisper_s() -> None:
    assert held_window_s(int(0.3 * SAMPLE_RATE)) == MIN_WINDOW_S  # never shorter
    assert held_window_s(int(5.0 * SAMPLE_RATE)) == 6.0  # 5 s + 1 s of silence
    assert held_window_s(int(5.01 * SAMPLE_RATE)) == 8.0  # ... rounded up to a 2 s step
    assert held_window_s(int(7.5 * SAMPLE_RATE)) == 10.0
    assert held_window_s(int(29.5 * SAMPLE_RATE)) == WINDOW_S


def test_token_bound_grows_with_the_audio() -> None:
    assert token_bound(0) < token_bound(SAMPLE_RATE) < token_bound(10 * SAMPLE_RATE)
    assert token_bound(10 * SAMPLE_RATE) <= 16 + 12 * 10


def test_segments_that_start_in_the_padding_are_dropped() -> None:
    tok = SimpleNamespace(timestamp_begin=1000, eot=999)
    ts = lambda s: 1000 + round(s / 0.02)  # noqa: E731 - a timestamp token at s seconds
    # <|0.00|> 1 2 <|1.50|><|1.50|> 3 4 <|2.40|>: the second segment starts at 1.5 s, the audio ends at 1.55 s
    ids = [ts(0.0), 1, 2, ts(1.5), ts(1.5), 3, 4, ts(2.4), 999]
    assert Whisper._kept_text(tok, ids, duration_s=1.55) == [1, 2]
    assert Whisper._kept_text(tok, ids, duration_s=3.0) == [1, 2, 3, 4]
    # a segment the token bound cut before its closing timestamp is kept when it started inside the audio
    assert Whisper._kept_text(tok, [ts(0.0), 1, 2, ts(0.8), ts(0.8), 3], duration_s=2.0) == [1, 2, 3]
    assert Whisper._kept_text(tok, [ts(0.0), 1, 2, ts(0.8), ts(1.95), 3], duration_s=2.0) == [1, 2]
    assert Whisper._kept_text(tok, [999], duration_s=2.0) == []


def test_segments_that_replay_the_pass_are_dropped_with_what_follows() -> None:
    tok = SimpleNamespace(timestamp_begin=1000, eot=999)
    ts = lambda s: 1000 + round(s / 0.02)  # noqa: E731
    said = [11, 12, 13, 14, 15, 16, 17]  # "Good morning to you, tell me about the sea."
    # inside the audio's own trailing silence (starts before its end), a replay of a run of it: dropped
    replay = [ts(0.0), *said, ts(2.0), ts(2.1), 11, 12, 13, 14, ts(2.5), ts(2.5), 20, 21, ts(2.7)]
    assert Whisper._kept_text(tok, replay, duration_s=3.0) == said
    # a start over that then differs ("What is the capital of friends?"): dropped
    over = [ts(0.0), *said, ts(1.5), ts(1.6), 11, 12, 13, 14, 15, 30, ts(2.5)]
    assert Whisper._kept_text(tok, over, duration_s=3.0) == said
    # a second sentence that shares a word or two with the first is speech: kept ("okay, okay" too)
    second = [ts(0.0), *said, ts(1.5), ts(1.6), 13, 14, 40, 41, ts(2.5)]
    assert Whisper._kept_text(tok, second, duration_s=3.0) == [*said, 13, 14, 40, 41]
    assert Whisper._kept_text(tok, [ts(0.0), 50, ts(0.4), ts(0.5), 50, ts(0.9)], duration_s=1.5) == [50, 50]


def test_a_window_that_is_neither_held_nor_full_is_refused(tmp_path) -> None:
    with pytest.raises(InvalidInputError, match="held"):
        Whisper(tmp_path, window="half")


# -- the real model ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models() -> tuple[Whisper, Whisper]:
    needs("faster_whisper")
    path = voice_model("whisper-base")
    return Whisper(path), Whisper(path, window="full")


def test_held_passes_hear_what_the_30s_window_hears(models: tuple[Whisper, Whisper]) -> None:
    held, full = models
    for phrase in PHRASES:
        audio = speech(phrase)
        got, want = held.words(audio), full.words(audio)
        said = norm_words(phrase)
        # no worse than the 30 s window, by one word at most (on "Which city..." the window hears "What city")
        held_errors, window_errors = (edit_distance(norm_words(text_of(w)), said) for w in (got, want))
        assert held_errors <= window_errors + 1 <= 2, (phrase, text_of(got), text_of(want))
        assert all(0 <= w.start <= w.end <= audio.size / SAMPLE_RATE + 0.05 for w in got)
        assert all(w.text.startswith(" ") for w in got)


def test_a_batch_hears_what_one_pass_at_a_time_hears(models: tuple[Whisper, Whisper]) -> None:
    held, _ = models
    audios = [speech(p) for p in PHRASES]
    prompts = [None, "Are you ready?", None, "A typing exercise."]
    requests = [PassRequest(a, p) for a, p in zip(audios, prompts, strict=True)]
    requests.insert(2, PassRequest(np.zeros(0, np.float32)))  # an empty pass in the batch: no words, no harm
    batched = held.words_batch(requests)
    assert batched[2] == []
    del batched[2], requests[2]
    alone = [held.words(r.audio, r.prompt) for r in requests]
    assert [norm_words(text_of(b)) for b in batched] == [norm_words(text_of(a)) for a in alone]
    for b, a in zip(batched, alone, strict=True):  # the same words at about the same times
        assert all(abs(x.start - y.start) < 0.1 for x, y in zip(b, a, strict=True))


def test_silence_and_noise_give_no_endless_text(models: tuple[Whisper, Whisper]) -> None:
    held, _ = models
    assert held.words(np.zeros(2 * SAMPLE_RATE, np.float32)) == []
    assert held.transcribe(np.zeros(SAMPLE_RATE // 2, np.float32)) == ""
    noise = (np.random.default_rng(0).standard_normal(28 * SAMPLE_RATE) * 0.05).astype(np.float32)
    heard = held.words(noise)  # Whisper may "hear" something in noise; never more than the bound allows
    assert len(heard) <= token_bound(noise.size)


def test_audio_longer_than_a_window_takes_whisper_s_windows(models: tuple[Whisper, Whisper]) -> None:
    held, _ = models
    audio = np.concatenate([speech(PHRASES[0]), np.zeros(30 * SAMPLE_RATE, np.float32), speech(PHRASES[1])])
    text = held.transcribe(audio).lower()
    assert "france" in text and "okay" in text


def test_the_transcriber_s_requests_give_what_its_own_passes_give(models: tuple[Whisper, Whisper]) -> None:
    held, _ = models
    audio = speech(PHRASES[3])
    half = audio.size // 2
    one, two = StreamingTranscriber(held), StreamingTranscriber(held)
    for t in (one, two):
        t.add(audio[:half])
    first = one.step()
    request = two.step_request()
    assert request is not None
    assert two.apply_step(held.words_batch([request])[0]) == first
    for t in (one, two):
        t.add(audio[half:])
    done = one.finish()
    request = two.finish_request()
    assert request is not None
    assert two.apply_finish(held.words_batch([request])[0]) == done
    assert one.text == two.text == ""
