"""Text to speech: a Piper voice (VITS, ONNX) through onnxruntime, and a sentence splitter for streamed replies.

PiperVoice turns text into eSpeak NG phonemes (media.phonemes), phonemes into the voice's symbol ids (its config's
phoneme_id_map: BOS, each phoneme's ids followed by the pad id, EOS, as Piper encodes them) and runs the model once
per sentence. The server calls `synthesize` on its media executor, never on the event loop.

SentenceSplitter cuts a reply streaming in as text deltas into pieces worth a model run: whole sentences, except
that the reply's first piece may end at a clause so that the first audio leaves sooner.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from streamserve.errors import InvalidInputError, ModelLoadError
from streamserve.media import require
from streamserve.media.phonemes import ABBREVIATIONS, Phonemizer

BOS, EOS, PAD = "^", "$", "_"
SENTENCE_PAUSE_S = 0.2  # silence between two sentences of one synthesize call (Piper's default)
FIRST_PIECE_WORDS = 4  # the first piece may end at a clause (, ; :) once it has this many words
FIRST_PIECE_MAX_WORDS = 4  # ... and ends at the word boundary after this many words, punctuation or not
# (a short first piece is generated and synthesised sooner: docs/benchmarks.md, voice turns; the pieces after it
# are whole sentences, so only the first join is cut mid-sentence)
LONG_PIECE_CHARS = 200  # later pieces end at a clause only past this length
MAX_PIECE_CHARS = 400  # a piece without any boundary is cut at the first space past this length
_TERMINATORS = ".!?"
_CLAUSES = ",;:"
_CLOSERS = "\"')]}»”’"  # may follow a sentence's punctuation: 'He said "no." Then'
_MARKDOWN = re.compile(r"[*#`]+|^[ \t]*[-+][ \t]+", re.MULTILINE)  # emphasis, headings, code, list bullets
_SPACES = re.compile(r"\s+")


class PiperVoice:
    """A Piper voice: text -> float32 mono audio at `sample_rate`. `synthesize` may run on several threads."""

    def __init__(self, model_path: str | Path, config_path: str | Path | None = None, threads: int = 1,
                 variation: bool = True) -> None:
        """`variation`: the voice's sampling noise (its config's noise_scale and noise_w, drawn anew each run, so the
        same text never sounds exactly the same); False sets both to 0: the same text, the same samples (tests)."""
        ort = require("onnxruntime")
        model_path = Path(model_path)
        config_path = Path(config_path) if config_path is not None else Path(f"{model_path}.json")
        for path in (model_path, config_path):
            if not path.is_file():
                raise ModelLoadError(f"Piper voice file {path} is missing; pull the voice: "
                                     "streamserve models pull piper-joe")
        try:
            config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
            self.sample_rate: int = int(config["audio"]["sample_rate"])
            self.phoneme_ids: dict[str, list[int]] = {k: list(v) for k, v in config["phoneme_id_map"].items()}
            inference = config.get("inference", {})
            voice = config.get("espeak", {}).get("voice", "en-us")
            num_speakers = int(config.get("num_speakers", 1))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{config_path} is not a Piper voice config ({e!r}); pull the voice again: "
                                 "streamserve models pull piper-joe") from e
        for symbol in (BOS, EOS, PAD):
            if symbol not in self.phoneme_ids:
                raise ModelLoadError(f"{config_path}: phoneme_id_map has no {symbol!r}; not a Piper voice config")
        # scales input: [noise_scale, length_scale, noise_w] (float32 [3])
        noise = 1.0 if variation else 0.0
        self.scales = np.array([noise * inference.get("noise_scale", 0.667), inference.get("length_scale", 1.0),
                                noise * inference.get("noise_w", 0.8)], dtype=np.float32)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle: sleep, never spin
        try:
            self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types for a damaged file
            raise ModelLoadError(f"onnxruntime could not load {model_path} ({e}); pull the voice again: "
                                 "streamserve models pull piper-joe") from e
        self._inputs = {i.name for i in self.session.get_inputs()}
        # a multi-speaker voice takes a speaker id; speaker 0 is the config's first
        self._sid = np.zeros(1, dtype=np.int64) if num_speakers > 1 and "sid" in self._inputs else None
        self.phonemizer = Phonemizer(voice)

    def ids(self, phonemes: str) -> list[int]:
        """Piper's symbol ids of one sentence's phonemes: BOS, pad, then each phoneme's ids and a pad, EOS.
        Phonemes the voice has no id for are left out (Piper does the same)."""
        pad = self.phoneme_ids[PAD]
        out = self.phoneme_ids[BOS] + pad
        for ph in phonemes:
            ids = self.phoneme_ids.get(ph)
            if ids is not None:
                out += ids + pad
        return out + self.phoneme_ids[EOS]

    def synthesize_phonemes(self, phonemes: str) -> np.ndarray:
        """One model run: one sentence's phonemes -> float32 [n] at sample_rate."""
        ids = self.ids(phonemes)
        feeds: dict[str, np.ndarray] = {
            "input": np.array([ids], dtype=np.int64),  # [1, n_ids]
            "input_lengths": np.array([len(ids)], dtype=np.int64),  # [1]
            "scales": self.scales,  # [3]
        }
        if self._sid is not None:
            feeds["sid"] = self._sid
        (audio,) = self.session.run(None, feeds)  # [1, 1, 1, n_samples] (or [1, 1, n_samples])
        return np.asarray(audio, dtype=np.float32).reshape(-1)

    def synthesize(self, text: str) -> np.ndarray:
        """Speech for `text`: float32 mono in [-1, 1] at sample_rate, one model run per sentence, sentences joined
        by a short pause. Markdown symbols are not read out; nothing to speak gives an empty array."""
        if not isinstance(text, str):
            raise InvalidInputError(f"synthesize takes text (str), not {type(text).__name__}")
        pause = np.zeros(int(SENTENCE_PAUSE_S * self.sample_rate), dtype=np.float32)
        parts: list[np.ndarray] = []
        for phonemes in self.phonemizer.phonemize(_MARKDOWN.sub("", text)):  # keeps line breaks (paragraphs)
            audio = self.synthesize_phonemes(phonemes)
            if audio.size:
                if parts:
                    parts.append(pause)
                parts.append(audio)
        if not parts:
            return np.zeros(0, dtype=np.float32)
        # VITS output can overshoot [-1, 1] a little; clip rather than let an encoder wrap around
        return np.clip(np.concatenate(parts), -1.0, 1.0)


_WORD_BEFORE = re.compile(r"(\S+)$")
_DOTTED = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")  # "u.s", "e.g", "p.m": letters between periods


def speakable(text: str) -> str:
    """`text` as it is spoken: markdown symbols (* # ` and line-leading - + bullets) dropped, whitespace runs
    made one space, stripped."""
    return _SPACES.sub(" ", _MARKDOWN.sub("", text)).strip()


def _abbreviation(before: str) -> bool:
    """Whether the period after `before` (the text up to it) belongs to a word, not a sentence end:
    "Mr.", "e.g.", "U.S.", an initial ("J. K. Rowling")."""
    match = _WORD_BEFORE.search(before)
    if match is None:
        return False
    word = match.group(1).lstrip("(\"'[“‘").lower()
    return word in ABBREVIATIONS or _DOTTED.fullmatch(word) is not None or (len(word) == 1 and word.isalpha())


class SentenceSplitter:
    """A reply streaming in as text deltas -> pieces to speak, each one model run.

    A piece ends at . ! ? (and closing quotes after them) followed by whitespace, unless the period is an
    abbreviation's or an initial's ("Mr.", "e.g.", "J."); decimals ("3.14") have no space after the period. A
    newline ends a piece too. The reply's first piece may also end at a clause (, ; : and a space) once it has
    FIRST_PIECE_WORDS words, and ends at the space after its FIRST_PIECE_MAX_WORDS-th word if nothing ended it
    before, so the first audio waits for a few words, never for a whole sentence; a later piece ends at a clause
    only when it has grown past LONG_PIECE_CHARS. The pieces depend on the text only, never on how it was split into
    deltas: a boundary is decided once the character after it has arrived (or at flush). Pieces are `speakable` (no
    markdown symbols).
    """

    def __init__(self) -> None:
        self._buf = ""  # text not yet returned as a piece
        self._pos = 0  # _buf[:_pos] holds no boundary
        self._first = True  # no piece of this reply returned yet

    def push(self, delta: str) -> list[str]:
        """Add a text delta; the pieces it completes (often none)."""
        self._buf += delta
        return self._cut(final=False)

    def flush(self) -> list[str]:
        """The end of the reply: the pieces left (the last one need not end with punctuation). The splitter is
        then ready for the next reply."""
        pieces = self._cut(final=True)
        rest = speakable(self._buf)
        if rest:
            pieces.append(rest)
        self._buf, self._pos, self._first = "", 0, True
        return pieces

    def _cut(self, final: bool) -> list[str]:
        pieces: list[str] = []
        buf, i = self._buf, self._pos
        while i < len(buf):
            end = self._boundary(buf, i, final)
            if end is None:  # the character after buf[i] has not arrived yet
                break
            if end < 0:
                i += 1
                continue
            piece = speakable(buf[:end])
            buf, i = buf[end:], 0
            if piece:
                pieces.append(piece)
                self._first = False
        self._buf, self._pos = buf, i
        return pieces

    def _boundary(self, buf: str, i: int, final: bool) -> int | None:
        """Where a piece ending at buf[i] ends (exclusive), -1 if none ends there, None if that depends on text
        not yet received."""
        c = buf[i]
        if c == "\n":
            return i + 1
        if c in _TERMINATORS:
            j = i
            while j + 1 < len(buf) and (buf[j + 1] in _TERMINATORS or buf[j + 1] in _CLOSERS):
                j += 1  # "..." "?!" '."'
            if j + 1 == len(buf):
                return None if not final else -1  # at the very end: flush speaks the rest anyway
            if not buf[j + 1].isspace():
                return -1  # "3.14", "e.g.x", "www.site"
            if c == "." and j == i and _abbreviation(buf[:i]):
                return -1
            return j + 1
        if c in _CLAUSES:
            if i + 1 == len(buf):
                return None if not final else -1
            if not buf[i + 1].isspace():
                return -1  # "3,000", "12:30"
            if self._first and len(speakable(buf[:i]).split()) >= FIRST_PIECE_WORDS:
                return i + 1
            return i + 1 if i + 1 >= LONG_PIECE_CHARS else -1
        if c.isspace() and (i >= MAX_PIECE_CHARS or (self._first and len(buf[:i].split()) >= FIRST_PIECE_MAX_WORDS
                                                      and len(speakable(buf[:i]).split()) >= FIRST_PIECE_MAX_WORDS)):
            return i + 1  # (the cheap count first: markdown symbols alone are words to split() but not spoken)
        return -1
