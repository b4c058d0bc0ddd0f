"""eSpeak NG phonemes for Piper: IPA per sentence, clause punctuation restored, one lock around eSpeak's state."""

from __future__ import annotations

import threading
import unicodedata

import pytest
from voice_assets import needs

from streamserve.errors import InvalidInputError

needs("espeakng_loader")

from streamserve.media.phonemes import Phonemizer  # noqa: E402  (after the skip: it loads eSpeak NG)

STRESS = "ˈ"  # IPA primary stress: eSpeak's IPA output marks it on every stressed syllable


@pytest.fixture(scope="module")
def phonemizer() -> Phonemizer:
    return Phonemizer("en-us")


def test_hello_world_is_ipa_with_word_boundary_and_final_period(phonemizer: Phonemizer) -> None:
    (sentence,) = phonemizer.phonemize("Hello world.")
    assert sentence.endswith(".")
    words = sentence[:-1].split(" ")
    assert len(words) == 2 and all(words), sentence  # one word boundary: "hello" | "world"
    assert STRESS in sentence
    assert words[0].startswith("h") and "l" in words[0] and "w" in words[1] and "d" in words[1]
    assert not any(c.isupper() for c in sentence)  # IPA, not eSpeak's ASCII names (which use capitals)


def test_one_string_per_sentence_with_clause_punctuation(phonemizer: Phonemizer) -> None:
    out = phonemizer.phonemize("Hello, world! How are you today? I am fine; thanks: truly.")
    assert len(out) == 3, out
    assert out[0].endswith("!") and ", " in out[0]  # eSpeak drops the comma; it is put back, then a space
    assert out[1].endswith("?")
    assert out[2].endswith(".") and "; " in out[2] and ": " in out[2]


def test_abbreviations_and_decimals_do_not_end_a_sentence(phonemizer: Phonemizer) -> None:
    # eSpeak ends a clause after "Mr." (reading "mister"); the sentence goes on without a period or pause
    (sentence,) = phonemizer.phonemize("Hello, Mr. Smith!")
    assert sentence.endswith("!") and sentence.count(".") == 0
    (number,) = phonemizer.phonemize("It costs 3.14 dollars.")
    assert number.count(".") == 1 and number.endswith(".")  # "three point one four", one period at the end


def test_quotes_after_the_period_and_text_without_punctuation(phonemizer: Phonemizer) -> None:
    out = phonemizer.phonemize('He said "hi." Then he left')
    assert len(out) == 2 and out[0].endswith(".") and out[1][-1].isalpha(), out
    paragraphs = phonemizer.phonemize("first line\n\nsecond line")
    assert len(paragraphs) == 2 and all(p[-1].isalpha() for p in paragraphs), paragraphs


@pytest.mark.parametrize("text", ["", "   ", "\n\n", "...", "?!"])
def test_nothing_to_say_gives_no_sentences(phonemizer: Phonemizer, text: str) -> None:
    assert phonemizer.phonemize(text) == []


def test_a_nul_character_does_not_cut_the_text(phonemizer: Phonemizer) -> None:
    (sentence,) = phonemizer.phonemize("Hello\x00world.")
    assert len(sentence.split(" ")) == 2


def test_output_is_unicode_nfd(phonemizer: Phonemizer) -> None:
    # Piper's ids are of decomposed code points (its map has the combining marks on their own)
    for sentence in phonemizer.phonemize("Français, façade, naïve café. Über München."):
        assert sentence == unicodedata.normalize("NFD", sentence)


def test_unknown_voice_is_a_typed_error() -> None:
    with pytest.raises(InvalidInputError, match="no voice"):
        Phonemizer("xx-not-a-voice")


def test_two_threads_at_once_give_what_one_gives() -> None:
    """eSpeak is one global state (voice, translator, read-ahead): two phonemizers of different voices on two
    threads, interleaving freely, must each get exactly what they get alone."""
    texts = ["The quick brown fox jumps over the lazy dog.", "Tomatoes, potatoes; schedule: aluminium!",
             "What is the capital of France? Paris, of course.", "Mr. Brown read 3.14 digits aloud."]
    us, gb = Phonemizer("en-us"), Phonemizer("en")  # American, British
    alone = {"us": [us.phonemize(t) for t in texts], "gb": [gb.phonemize(t) for t in texts]}
    assert alone["us"] != alone["gb"]  # the voices differ, so a wrongly selected voice would show
    got: dict[str, list[list[list[str]]]] = {"us": [], "gb": []}
    start = threading.Barrier(2)

    def work(name: str, p: Phonemizer) -> None:
        start.wait()
        for _ in range(15):
            got[name].append([p.phonemize(t) for t in texts])

    threads = [threading.Thread(target=work, args=(n, p)) for n, p in (("us", us), ("gb", gb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["us"] == [alone["us"]] * 15
    assert got["gb"] == [alone["gb"]] * 15
