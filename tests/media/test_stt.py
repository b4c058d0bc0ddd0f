"""Speech to text: the LocalAgreement-2 logic on hand-made words (no model), and Whisper with the streaming
transcriber on speech synthesised by the Piper voice (skipped without the voice extra or the models)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from voice_assets import edit_distance, needs, norm_words, speech, voice_model

from streamserve.errors import InvalidInputError
from streamserve.media import VoiceUnavailableError
from streamserve.media.stt import (
    SAMPLE_RATE,
    StreamingTranscriber,
    TranscriptUpdate,
    Whisper,
    Word,
    agreed_prefix,
    normalize,
    unseen,
)

FRAME = 320  # 20 ms at 16 kHz


def words(*items: tuple[str, float, float]) -> list[Word]:
    return [Word(text, start, end) for text, start, end in items]


# -- the agreement logic on hand-made word lists ---------------------------------------------------------------

def test_normalize_ignores_case_punctuation_and_space() -> None:
    assert normalize(" France?") == normalize("france") == normalize('"France,"') == "france"
    assert normalize(" don't") == "don't"  # inner apostrophes stay: "dont" and "don't" are not merged


def test_agreed_prefix_growing_revised_punctuated_and_disjoint() -> None:
    one = words((" What", 0.0, 0.2), (" is", 0.2, 0.3))
    grown = words((" What", 0.0, 0.2), (" is", 0.2, 0.3), (" the", 0.3, 0.4), (" capital", 0.4, 0.8))
    assert agreed_prefix(one, grown) == 2  # a growing hypothesis: all of the previous pass agrees
    revised = words((" What", 0.0, 0.2), (" is", 0.2, 0.3), (" the", 0.3, 0.4), (" cap", 0.4, 0.7))
    assert agreed_prefix(revised, grown) == 3  # the revised tail is not agreed
    shouty = words((" WHAT", 0.0, 0.2), (" is,", 0.2, 0.3), (" the...", 0.3, 0.4))
    assert agreed_prefix(shouty, grown) == 3  # case and punctuation differences still agree
    assert agreed_prefix(words((" Watts", 0.0, 0.2)), grown) == 0  # nothing agreed
    assert agreed_prefix([], grown) == agreed_prefix(grown, []) == 0


def test_unseen_drops_committed_words_by_text_even_when_times_jitter() -> None:
    committed = words((" The", 0.0, 0.2), (" quick", 0.2, 0.5))
    # times moved later by 0.2 s: time alone would keep " quick" again
    late = words((" The", 0.1, 0.4), (" quick", 0.4, 0.7), (" brown", 0.7, 1.0))
    assert [w.text for w in unseen(late, committed)] == [" brown"]
    # the next word's start came out before the committed end: the text anchor still keeps it
    early = words((" The", 0.0, 0.1), (" quick", 0.1, 0.25), (" brown", 0.25, 0.6))
    assert [w.text for w in unseen(early, committed)] == [" brown"]
    # no committed word in the pass (the buffer was trimmed): time decides
    fresh = words((" brown", 0.55, 0.8), (" fox", 0.8, 1.0))
    assert [w.text for w in unseen(fresh, committed)] == [" brown", " fox"]
    assert unseen(fresh, []) == fresh


class TimelineWhisper:
    """A stand-in for Whisper: each sample's value is its own index in the utterance, so a pass knows which part
    of the utterance the buffer holds. It hears every word wholly inside the buffer and misspells the last one
    when the buffer ends inside it (a revised tail), as Whisper does; times are on the buffer's clock."""

    def __init__(self, timeline: list[Word]) -> None:
        self.timeline, self.prompts = timeline, []

    def words(self, audio16k: np.ndarray, prompt: str | None = None, language: str = "en") -> list[Word]:
        self.prompts.append(prompt)
        if audio16k.size == 0:
            return []
        start, end = float(audio16k[0]) / SAMPLE_RATE, (float(audio16k[-1]) + 1) / SAMPLE_RATE
        out = []
        for w in self.timeline:
            if w.start >= start - 0.01 and w.end <= end:
                out.append(Word(w.text, w.start - start, w.end - start))
            elif w.start >= start - 0.01 and w.start < end:
                out.append(Word(w.text + "zz", w.start - start, end - start))  # half heard
        return out


def timeline_audio(seconds: float) -> np.ndarray:
    return np.arange(round(seconds * SAMPLE_RATE), dtype=np.float32)  # [n] sample index = value


def stream(transcriber: StreamingTranscriber, audio: np.ndarray) -> tuple[list[TranscriptUpdate], list[float]]:
    """Feed 20 ms frames, step whenever ready, finish: every update, and the buffer length after each step."""
    updates, buffered = [], []
    for i in range(0, audio.size, FRAME):
        transcriber.add(audio[i:i + FRAME])
        if transcriber.ready():
            updates.append(transcriber.step())
            buffered.append(transcriber.buffered_s)
    updates.append(transcriber.finish())
    return updates, buffered


def test_streaming_logic_commits_each_word_once_across_trims() -> None:
    spoken = [f" w{i}" for i in range(30)]
    timeline = [Word(text, 0.25 * i, 0.25 * i + 0.2) for i, text in enumerate(spoken)]  # 7.5 s of words
    fake = TimelineWhisper(timeline)
    transcriber = StreamingTranscriber(fake, min_pass_s=0.4, max_buffer_s=2.0)  # type: ignore[arg-type]
    updates, buffered = stream(transcriber, timeline_audio(7.6))
    text = "".join(u.committed for u in updates)
    assert text == "".join(spoken).lstrip()  # every word once, in order, first without its space
    assert "".join(u.committed for u in updates[:-1])  # words were committed before finish()
    assert all("zz" not in u.committed for u in updates)  # a misspelt tail is never agreed
    assert max(buffered) <= 2.0 + 0.4 + 0.25  # trimmed: at most max_buffer_s + one pass + one word
    assert any(p for p in fake.prompts)  # after a trim the pass is prompted with the text before the buffer
    assert transcriber.text == "" and not transcriber.ready()  # finish() reset it


def test_streaming_logic_partial_is_the_unagreed_tail() -> None:
    timeline = words((" one", 0.0, 0.3), (" two", 0.4, 0.7), (" three", 0.8, 1.1))
    transcriber = StreamingTranscriber(TimelineWhisper(timeline), min_pass_s=0.2)  # type: ignore[arg-type]
    audio = timeline_audio(1.2)
    transcriber.add(audio[:round(0.5 * SAMPLE_RATE)])
    first = transcriber.step()  # nothing to agree with yet
    assert first == TranscriptUpdate("", "one twozz")
    transcriber.add(audio[round(0.5 * SAMPLE_RATE):round(0.9 * SAMPLE_RATE)])
    second = transcriber.step()  # " one" agreed; " two" was misspelt last time, so it waits
    assert second == TranscriptUpdate("one", " two threezz")
    assert transcriber.text == "one"
    transcriber.add(audio[round(0.9 * SAMPLE_RATE):])
    assert transcriber.finish() == TranscriptUpdate(" two three", "")


def test_finish_right_after_a_pass_commits_its_tail_without_another_pass() -> None:
    timeline = words((" one", 0.0, 0.3), (" two", 0.4, 0.7))
    fake = TimelineWhisper(timeline)
    transcriber = StreamingTranscriber(fake, min_pass_s=0.2)  # type: ignore[arg-type]
    transcriber.add(timeline_audio(0.8))
    assert transcriber.step() == TranscriptUpdate("", "one two")
    assert transcriber.finish() == TranscriptUpdate("one two", "")
    assert len(fake.prompts) == 1  # the pass over all the audio was not repeated
    transcriber.add(timeline_audio(0.8))
    assert transcriber.finish() == TranscriptUpdate("one two", "")  # no pass yet in this utterance: one now
    assert len(fake.prompts) == 2


def test_reset_and_bad_input() -> None:
    transcriber = StreamingTranscriber(TimelineWhisper([]), min_pass_s=0.2)  # type: ignore[arg-type]
    transcriber.add(np.zeros(SAMPLE_RATE, np.float32))
    assert transcriber.ready()
    transcriber.reset()
    assert not transcriber.ready() and transcriber.buffered_s == 0 and transcriber.text == ""
    with pytest.raises(InvalidInputError, match="float32 mono"):
        transcriber.add(np.zeros((2, 10), np.float32))
    with pytest.raises(InvalidInputError, match="float32 mono"):
        transcriber.add(np.zeros(10, np.int16))
    with pytest.raises(InvalidInputError, match="max_buffer_s"):
        StreamingTranscriber(TimelineWhisper([]), max_buffer_s=60.0)  # type: ignore[arg-type]


def test_whisper_names_the_pull_command_when_the_model_folder_is_incomplete(tmp_path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(VoiceUnavailableError, match="streamserve models pull whisper-base"):
        Whisper(tmp_path)


# -- Whisper on synthesised speech ------------------------------------------------------------------------------

QUESTION = "Which city is the capital of France?"
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank today."
LONG = ("I would like two tickets for the concert on Saturday night, if there are any left. "
        "Please remind me to call my sister at seven tomorrow evening.")


@pytest.fixture(scope="module")
def whisper() -> Whisper:
    needs("faster_whisper")
    return Whisper(voice_model("whisper-base"))


def check_stream(whisper: Whisper, text: str, max_buffer_s: float = 12.0) -> tuple[list[TranscriptUpdate], list[float]]:
    audio = speech(text)
    transcriber = StreamingTranscriber(whisper, max_buffer_s=max_buffer_s)
    updates, buffered = stream(transcriber, audio)
    streamed = "".join(u.committed for u in updates)
    got, want = norm_words(streamed), norm_words(whisper.transcribe(audio))
    assert streamed == streamed.strip() and "  " not in streamed  # deltas join with single spaces
    assert all(a != b for a, b in pairwise(got)), streamed  # no word emitted twice at a seam
    # about the same words as one pass over all of it: early passes over a second of audio may agree on words a
    # longer context hears otherwise ("to take it" for "two tickets" in LONG's first 1.8 s: LocalAgreement's
    # known weakness), and committed words are never taken back
    assert edit_distance(got, want) <= 3, (streamed, want)
    assert edit_distance(got, norm_words(text)) <= 4, streamed  # the above, and numbers in digits (seven: 7)
    assert transcriber.text == ""  # finish() reset it
    return updates, buffered


def test_transcribe_a_question(whisper: Whisper) -> None:
    text = whisper.transcribe(speech(QUESTION)).lower()
    assert "capital" in text and "france" in text


def test_words_have_times_in_order(whisper: Whisper) -> None:
    audio = speech(QUESTION)
    got = whisper.words(audio)
    assert [normalize(w.text) for w in got][-2:] == ["of", "france"]
    assert all(w.text.startswith(" ") for w in got)
    assert all(0 <= a.start <= a.end <= b.start + 1e-6 for a, b in pairwise(got))
    assert got[-1].end <= audio.size / SAMPLE_RATE + 0.05
    assert whisper.words(audio, prompt="A geography quiz.")[-1].text.strip(" ?.").lower() == "france"


def test_streaming_commits_before_the_end_and_matches_one_pass(whisper: Whisper) -> None:
    updates, _ = check_stream(whisper, SENTENCE)
    assert norm_words("".join(u.committed for u in updates[:-1]))  # words agreed while still speaking
    assert all(u.partial == "" for u in updates[-1:])


def test_streaming_trims_a_long_utterance_without_losing_or_repeating_words(whisper: Whisper) -> None:
    _, buffered = check_stream(whisper, LONG, max_buffer_s=3.0)
    assert any(b < a for a, b in pairwise(buffered))  # the buffer was cut at least once


def test_silence_gives_no_text(whisper: Whisper) -> None:
    silence = np.zeros(2 * SAMPLE_RATE, np.float32)
    assert whisper.transcribe(silence) == ""
    updates, _ = stream(StreamingTranscriber(whisper), silence)
    assert [u.committed for u in updates] == [""] * len(updates)


def test_reset_forgets_the_utterance(whisper: Whisper) -> None:
    transcriber = StreamingTranscriber(whisper)
    sentence = speech(SENTENCE)
    transcriber.add(sentence[: sentence.size // 2])
    transcriber.step()
    transcriber.reset()
    updates, _ = stream(transcriber, speech(QUESTION))
    text = "".join(u.committed for u in updates).lower()
    assert "capital" in text and "france" in text and "fox" not in text and "quick" not in text
