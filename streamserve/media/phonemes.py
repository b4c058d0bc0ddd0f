"""eSpeak NG phonemes (IPA) for Piper voices, through the shared library that `espeakng-loader` ships.

Piper voices are trained on eSpeak NG's IPA output, clause by clause, with the clause's punctuation put back
(eSpeak drops it) and one string per sentence. This module does the same with ctypes over
`espeakng_loader.get_library_path()` and its bundled data: no subprocess, no system eSpeak, no GPL Python package.

eSpeak keeps one global state (the selected voice, its translator, the read-ahead character of the text being
translated), so every call into the library holds one process-wide lock, and the library is loaded and
initialised once per process.
"""

from __future__ import annotations

import ctypes
import re
import threading
import unicodedata

from streamserve.errors import InvalidInputError
from streamserve.media import VoiceUnavailableError, require

# speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS = 2  # espeak_AUDIO_OUTPUT: no audio thread; we only ask for phonemes
_CHARS_UTF8 = 1  # espeakCHARS_UTF8
_PHONEMES_IPA = 0x02  # phonememode bit 1: IPA as UTF-8 instead of eSpeak's ASCII names
_EE_OK = 0

SENTENCE_ENDS = ".!?"
CLAUSE_ENDS = ",;:"
_ENDS = SENTENCE_ENDS + CLAUSE_ENDS
# Closing (and opening) quotes and brackets that may stand after a clause's punctuation: 'He said "hi." Then'
_QUOTES = "\"'()[]{}«»“”‘’"
# Abbreviations whose period eSpeak ends a clause on ("Mr. Smith" -> "Mr." | "Smith"); a Piper voice would pause
# there as at a sentence end, so such a clause goes on without the period. Shared with the sentence splitter.
ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "approx", "dept", "inc", "ltd",
    "corp", "vol", "sgt", "capt", "lt", "jan", "feb", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov",
})
# eSpeak marks words it reads in another language as "(fr)...(en)"; Piper's ids have no such symbols
_LANG_SWITCH = re.compile(r"\([a-z]{2,3}(?:-[a-z0-9]+)*\)")
_LAST_WORD = re.compile(r"([A-Za-z][A-Za-z.]*)\.$")

_LOCK = threading.Lock()  # all eSpeak calls, process-wide
_lib: ctypes.CDLL | None = None
_voice: str | None = None  # the voice eSpeak has selected now (global state)


def _library() -> ctypes.CDLL:
    """The eSpeak NG library, loaded and initialised once (call with _LOCK held)."""
    global _lib
    if _lib is not None:
        return _lib
    loader = require("espeakng_loader")
    try:
        lib = ctypes.CDLL(loader.get_library_path())
    except OSError as e:
        raise VoiceUnavailableError(f"could not load eSpeak NG from espeakng-loader ({e}); reinstall the voice "
                                    "extra: pip install --force-reinstall espeakng-loader") from e
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_Initialize.restype = ctypes.c_int
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_SetVoiceByName.restype = ctypes.c_int
    lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
    lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
    data = str(loader.get_data_path()).encode()
    # buflength 0 = default; options 0: no phoneme events. Returns the sample rate, or -1 without its data.
    if lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data, 0) <= 0:
        raise VoiceUnavailableError(f"eSpeak NG could not read its data at {data.decode()}; reinstall the voice "
                                    "extra: pip install --force-reinstall espeakng-loader")
    _lib = lib
    return lib


def _select(lib: ctypes.CDLL, voice: str) -> None:
    """Make `voice` eSpeak's current voice (call with _LOCK held)."""
    global _voice
    if _voice == voice:
        return
    if lib.espeak_SetVoiceByName(voice.encode()) != _EE_OK:
        _voice = None
        raise InvalidInputError(f"eSpeak NG has no voice {voice!r}; use a language code such as 'en-us' "
                                "(a Piper voice's config names it under espeak.voice)")
    _voice = voice


def _read_ahead(consumed: str, at_end: bool) -> int:
    """How many characters at the end of the text eSpeak consumed for a clause belong to the next clause.

    eSpeak reads one character ahead: the text consumed for a clause may end with the first character of the next
    one ("Hello, M" for "Hello, Mr. Smith"), which is never punctuation nor space.
    """
    if at_end or not consumed or consumed[-1].isspace() or consumed[-1] in _ENDS + _QUOTES:
        return 0
    return 1


def _terminator(clause: str) -> str:
    """The punctuation that ended a clause, from its text ("" if none, or if it is an abbreviation's period)."""
    clause = clause.rstrip().rstrip(_QUOTES).rstrip()
    if not clause or clause[-1] not in _ENDS:
        return ""
    if clause[-1] == ".":
        word = _LAST_WORD.search(clause)
        if word and word.group(1).lower() in ABBREVIATIONS:
            return ""  # "Mr." goes on: no pause, no sentence end
    return clause[-1]


def _paragraph(consumed: str) -> bool:
    """Whether a clause eSpeak ended without punctuation ended at a blank line (a paragraph: a sentence end)
    rather than because it grew too long (the sentence goes on)."""
    return re.search(r"\n[ \t\r]*\n", consumed) is not None


class Phonemizer:
    """Text -> eSpeak NG IPA phonemes, one string per sentence, as Piper's phonemizer gives them."""

    def __init__(self, voice: str = "en-us") -> None:
        self.voice = voice
        with _LOCK:
            _select(_library(), voice)  # fail now on a missing library or an unknown voice

    def phonemize(self, text: str) -> list[str]:
        """IPA phonemes of `text`, one string per sentence (Unicode NFD, words split by spaces, the clauses'
        punctuation kept). Thread-safe: eSpeak's global state is held under one lock for the whole text."""
        data = text.replace("\x00", " ").encode("utf-8")
        if not data.strip():
            return []
        sentences: list[str] = []
        current: list[str] = []
        buf = ctypes.create_string_buffer(data)  # NUL-terminated copy eSpeak reads and points into
        base = ctypes.addressof(buf)
        ptr = ctypes.c_void_p(base)
        with _LOCK:
            lib = _library()
            _select(lib, self.voice)
            start = 0  # where the current clause's text starts (in bytes of `data`)
            while ptr.value is not None:
                out = lib.espeak_TextToPhonemes(ctypes.byref(ptr), _CHARS_UTF8, _PHONEMES_IPA)
                at_end = ptr.value is None
                end = len(data) if at_end else ptr.value - base
                consumed = data[start:end].decode("utf-8", errors="ignore")
                if _read_ahead(consumed, at_end):
                    end -= len(consumed[-1].encode("utf-8"))
                    consumed = consumed[:-1]
                start = end
                phonemes = _LANG_SWITCH.sub("", (out or b"").decode("utf-8", errors="ignore")).strip()
                term = _terminator(consumed)
                if phonemes:
                    current.append(phonemes + term)
                # a sentence ends at . ! ?, at a paragraph break (a clause without punctuation) and at the end
                if current and (at_end or (term != "" and term in SENTENCE_ENDS)
                                or (term == "" and _paragraph(consumed))):
                    sentences.append(unicodedata.normalize("NFD", " ".join(current)))
                    current = []
        if current:
            sentences.append(unicodedata.normalize("NFD", " ".join(current)))
        return sentences
