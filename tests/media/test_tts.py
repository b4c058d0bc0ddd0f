"""Text to speech: the sentence splitter for streamed replies, and the Piper voice (piper-joe) through onnxruntime."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from voice_assets import needs, voice_model

from streamserve.errors import InvalidInputError, ModelLoadError
from streamserve.media.tts import (
    FIRST_PIECE_MAX_WORDS,
    FIRST_PIECE_WORDS,
    LONG_PIECE_CHARS,
    MAX_PIECE_CHARS,
    SENTENCE_PAUSE_S,
    PiperVoice,
    SentenceSplitter,
    speakable,
)

if TYPE_CHECKING:
    from streamserve.media.stt import Whisper

REPLY = ("Sure, the capital of France is Paris. It is home to about 2.1 million people, e.g. in the city proper; "
         "Mr. Smith and Dr. Jones visited it in 2019... Did they like it?! \"Very much.\" They said so at 3 p.m. "
         "and left.\n## Notes\n- **Food**: excellent, truly excellent\n- `Museums`: many (the Louvre)\nThat is all")


def split(text: str, sizes: list[int] | None = None) -> list[str]:
    """Pieces of `text` pushed in deltas of the given sizes (one delta if None), then flushed."""
    s = SentenceSplitter()
    out: list[str] = []
    i = 0
    for n in sizes or [len(text)]:
        out += s.push(text[i:i + n])
        i += n
    out += s.push(text[i:])
    return out + s.flush()


def test_pieces_do_not_depend_on_how_the_text_streams_in() -> None:
    whole = split(REPLY)
    assert " ".join(whole) == speakable(REPLY)  # nothing lost, nothing repeated, markdown dropped
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 12) for _ in range(len(REPLY))]
        assert split(REPLY, sizes) == whole
    assert split(REPLY, [1] * len(REPLY)) == whole  # character by character


def test_sentences_abbreviations_decimals_and_markdown() -> None:
    assert split(REPLY) == [
        "Sure, the capital of",  # the comma comes before 4 words; the 4th word ends the first piece
        "France is Paris.",
        "It is home to about 2.1 million people, e.g. in the city proper; Mr. Smith and Dr. Jones visited it in "
        "2019...",
        "Did they like it?!",
        "\"Very much.\"",
        "They said so at 3 p.m. and left.",
        "Notes",
        "Food: excellent, truly excellent",
        "Museums: many (the Louvre)",
        "That is all",
    ]
    assert split("Yes. Pi is 3.14159 and e is 2.71828. J. K. Rowling wrote it.") == [
        "Yes.", "Pi is 3.14159 and e is 2.71828.", "J. K. Rowling wrote it."]


def test_the_first_piece_ends_early_at_a_clause() -> None:
    text = "Well, I think that the answer, which is long, is yes. Then, after a while, I said no, and left."
    pieces = split(text)
    assert pieces == ["Well, I think that", "the answer, which is long, is yes.", "Then, after a while, I said no, "
                      "and left."]
    assert len(pieces[0].split()) >= FIRST_PIECE_WORDS
    # clauses inside numbers and times are no boundaries
    assert split("We sold 3,000 units, a record for us.")[0] == "We sold 3,000 units,"
    assert split("At 12:30 we sold 3,000 units today, a record.")[0] == "At 12:30 we sold"


def test_the_first_piece_is_a_few_words_later_pieces_whole_sentences() -> None:
    text = "The quick brown fox jumps over the lazy dog near the river bank. Then it ran off into the woods again."
    pieces = split(text)
    assert pieces == ["The quick brown fox", "jumps over the lazy dog near the river bank.",
                      "Then it ran off into the woods again."]
    assert len(pieces[0].split()) == FIRST_PIECE_MAX_WORDS
    assert split("Yes.") == ["Yes."] and split("One two three four five six") == ["One two three four", "five six"]
    assert split("**Bold** one two three four five six seven")[0] == "Bold one two three"


def test_a_sentence_is_only_complete_once_the_next_character_arrives() -> None:
    s = SentenceSplitter()
    assert s.push("Hello there.") == []  # "." then a digit or a letter would not end it
    assert s.push("5 is fine") == []  # ".5": a decimal point
    assert s.push(".") == [] and s.push(" An") == ["Hello there.5 is fine."]
    assert s.push("d more") == []
    assert s.flush() == ["And more"]


def test_long_sentences_are_cut_at_a_clause_and_flush_starts_a_new_reply() -> None:
    clause = "this clause goes on and on for a while"
    text = "Short start. " + ", ".join([clause] * 12) + "."
    pieces = split(text)
    assert pieces[0] == "Short start."
    assert len(pieces) > 2 and all(len(p) <= LONG_PIECE_CHARS + len(clause) + 2 for p in pieces[1:])
    assert " ".join(pieces) == text
    endless = " ".join(["word"] * 300)  # no boundary at all: cut at a space past MAX_PIECE_CHARS
    pieces = split(endless)
    assert len(pieces[0].split()) == FIRST_PIECE_MAX_WORDS  # then cut at spaces past MAX_PIECE_CHARS
    assert len(pieces) == 5 and all(len(p) <= MAX_PIECE_CHARS + 5 for p in pieces) and " ".join(pieces) == endless
    s = SentenceSplitter()
    assert s.push("One two three four, five six") == ["One two three four,"]
    assert s.flush() == ["five six"]
    assert s.push("Again one two three, and on. ") == ["Again one two three,", "and on."]  # first piece again


def test_nothing_to_speak_gives_no_piece() -> None:
    assert split("") == [] and split("  \n\n ** ## ``` \n") == []


# ---- the Piper voice (needs onnxruntime, eSpeak NG and the piper-joe model) ----

@pytest.fixture(scope="module")
def voice() -> PiperVoice:
    needs("onnxruntime")
    needs("espeakng_loader")
    return PiperVoice(voice_model("piper-joe"), threads=1, variation=False)  # the same speech every run


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


@pytest.mark.models
def test_variation_off_gives_the_same_samples_every_run() -> None:
    text = "Hello there, how are you?"
    varied = PiperVoice(voice_model("piper-joe"))
    fixed = PiperVoice(voice_model("piper-joe"), variation=False)
    assert not np.array_equal(varied.synthesize(text), varied.synthesize(text))  # the voice's sampling noise
    a, b = fixed.synthesize(text), fixed.synthesize(text)
    assert np.array_equal(a, b) and rms(a) > 0.01


@pytest.mark.models
def test_a_question_is_speech(voice: PiperVoice) -> None:
    audio = voice.synthesize("What is the capital of France?")
    assert voice.sample_rate == 22050
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert 1.0 <= audio.size / voice.sample_rate <= 4.0
    assert np.isfinite(audio).all() and np.abs(audio).max() <= 1.0
    assert rms(audio) > 0.01  # speech, well above silence (piper-joe speaks at an RMS of ~0.05)


@pytest.mark.models
@pytest.mark.parametrize("text", ["", "   ", "** ##", "..."])
def test_nothing_to_say_is_an_empty_array(voice: PiperVoice, text: str) -> None:
    audio = voice.synthesize(text)
    assert audio.dtype == np.float32 and audio.shape == (0,)


@pytest.mark.models
def test_sentences_are_run_one_by_one_and_joined_by_a_pause(voice: PiperVoice) -> None:
    one = voice.synthesize("The weather is lovely today.")
    three = voice.synthesize("The weather is lovely today. Let us go for a walk. We will be back soon.")
    assert three.size > 2 * one.size
    pause = int(SENTENCE_PAUSE_S * voice.sample_rate)
    zeros = np.flatnonzero(three == 0.0)
    runs = np.split(zeros, np.flatnonzero(np.diff(zeros) != 1) + 1)  # runs of exact zeros: the inserted pauses
    assert sum(len(r) >= pause for r in runs) == 2


@pytest.mark.models
def test_ids_are_bos_pad_interleaved_eos(voice: PiperVoice) -> None:
    ids = voice.ids("hə")
    m = voice.phoneme_ids
    pad = m["_"][0]
    assert ids == [m["^"][0], pad, m["h"][0], pad, m["ə"][0], pad, m["$"][0]]
    assert voice.ids("h\u2603ə") == ids  # a phoneme the voice has no id for is left out


@pytest.mark.models
def test_typed_errors(voice: PiperVoice, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError):
        voice.synthesize(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="models pull piper-joe"):
        PiperVoice(tmp_path / "missing.onnx")
    model = voice_model("piper-joe")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"audio": {"sample_rate": 22050}}))
    with pytest.raises(ModelLoadError, match="not a Piper voice config"):
        PiperVoice(model, bad)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx file")
    (tmp_path / "broken.onnx.json").write_text(Path(f"{model}.json").read_text())
    with pytest.raises(ModelLoadError, match="onnxruntime could not load"):
        PiperVoice(broken)


# ---- the strongest check: Whisper hears the words back ----

SPOKEN = ("The weather is lovely today. Let us go for a walk in the park, and then we will have some tea. "
          "Would you like to come with us?")


def words_of(text: str) -> list[str]:
    """Lower-case words without punctuation: what a listener would write down."""
    return re.sub(r"[^a-z' ]+", " ", text.lower().replace("-", " ")).split()


@pytest.fixture(scope="module")
def whisper() -> Whisper:
    needs("faster_whisper")
    from streamserve.media.stt import Whisper

    return Whisper(voice_model("whisper-base").parent, threads=2)


def at16k(audio: np.ndarray, rate: int) -> np.ndarray:
    needs("soxr")
    from streamserve.media.audio import Resampler

    resampler = Resampler(rate, 16000)
    return np.concatenate([resampler.process(audio), resampler.flush()])  # float32 [n * 16000 / rate]


@pytest.mark.models
def test_whisper_transcribes_three_sentences_back_to_the_text(voice: PiperVoice, whisper: Whisper) -> None:
    audio = voice.synthesize(SPOKEN)
    assert words_of(whisper.transcribe(at16k(audio, voice.sample_rate))) == words_of(SPOKEN)


@pytest.mark.models
def test_a_streamed_reply_spoken_piece_by_piece_is_heard_back(voice: PiperVoice, whisper: Whisper) -> None:
    """As the server speaks a reply: deltas -> splitter pieces -> one synthesis each, the audio back to back."""
    splitter = SentenceSplitter()
    pieces: list[str] = []
    for delta in re.findall(r"\S+\s*", SPOKEN):  # word by word, as an LLM streams
        pieces += splitter.push(delta)
    pieces += splitter.flush()
    assert len(pieces) == 4  # the first sentence's first four words, the rest of it, then one per sentence
    audio = np.concatenate([voice.synthesize(p) for p in pieces])
    assert words_of(whisper.transcribe(at16k(audio, voice.sample_rate))) == words_of(SPOKEN)
