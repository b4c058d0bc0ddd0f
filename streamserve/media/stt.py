"""Speech to text: Whisper (faster-whisper, int8 on CPU) and a streaming transcriber with local agreement.

Audio here is always float32 mono at 16 kHz, shape [n]; times are seconds. The streaming transcriber follows the
LocalAgreement-2 policy of Machacek et al. 2023 ("Turning Whisper into Real-Time Transcription System"): the audio
of the utterance since the last trim is transcribed again and again as it grows, and a word is committed once two
consecutive passes agree on it, so committed words are stable and never repeated. Everything here blocks; the
server runs it on its media executor (streamserve.server.voice.runtime.VoiceRuntime.run).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamserve.errors import InvalidInputError
from streamserve.media import VoiceUnavailableError, require

SAMPLE_RATE = 16000
MODEL_FILES = ("config.json", "model.bin", "tokenizer.json", "vocabulary.txt")
# Greedy decoding: on five synthesised phrases beam 5 gave the same words as beam 1 (one misheard word differed,
# wrong both ways) in 1.27x the time, and the agreement between passes already guards against unstable guesses.
BEAM_SIZE = 1
WINDOW_S = 30.0  # Whisper's encoder always sees a 30 s window (shorter ones loop and misspell with whisper-base)
PROMPT_CHARS = 200  # committed text given as the prompt: the end of it, as the paper does
SLACK_S = 0.1  # a word starting this much before the last committed end may still be new (timestamp jitter)
OVERLAP_WORDS = 5  # committed words looked for in a new pass, to find where its new words begin
ANCHOR_S = 1.0  # ... when the repeat ends this close to the committed end
MIN_FINISH_S = 0.1  # less audio than this left at finish() is not worth a pass


@dataclass(frozen=True)
class Word:
    """One recognised word: `text` keeps Whisper's leading space (" capital,"); start/end in seconds."""

    text: str
    start: float
    end: float


@dataclass(frozen=True)
class TranscriptUpdate:
    """What a pass adds: `committed` is new agreed text to append now ("" if none; it starts with a space unless it
    is the first text of the utterance) and is never repeated later; `partial` is the unagreed tail after all
    committed text (it may change with the next pass; for display only)."""

    committed: str
    partial: str


def _check_audio(audio16k: np.ndarray) -> np.ndarray:
    x = np.asarray(audio16k)
    if x.ndim != 1 or not np.issubdtype(x.dtype, np.floating):
        raise InvalidInputError(f"speech to text wants float32 mono samples at 16 kHz, shape [n]; got {x.dtype} "
                                f"{x.shape} (decode the frames with streamserve.media.audio.AudioInput first)")
    return x.astype(np.float32, copy=False)


class Whisper:
    """faster_whisper.WhisperModel over a local CTranslate2 model folder (never downloads), on the CPU."""

    def __init__(self, model_dir: str | Path, threads: int = 2, compute_type: str = "int8") -> None:
        folder = Path(model_dir)
        folder = folder.parent if folder.is_file() else folder  # store.installed() gives model.bin itself
        missing = [name for name in MODEL_FILES if not (folder / name).is_file()]
        if missing:
            raise VoiceUnavailableError(f"the Whisper model folder {folder} lacks {', '.join(missing)}: "
                                        "run `streamserve models pull whisper-base`")
        faster_whisper = require("faster_whisper")
        # A folder path (and tokenizer.json in it) keeps faster-whisper off the Hugging Face hub entirely;
        # local_files_only also guards the hub path should it ever be taken.
        self._model: Any = faster_whisper.WhisperModel(
            str(folder), device="cpu", compute_type=compute_type, cpu_threads=threads, num_workers=1,
            local_files_only=True)

    def words(self, audio16k: np.ndarray, prompt: str | None = None, language: str = "en") -> list[Word]:
        """Words of `audio16k` [n] with times from its first sample; `prompt` is text said just before it."""
        audio = _check_audio(audio16k)
        if audio.size == 0:
            return []
        prompt = prompt.strip()[-PROMPT_CHARS:] if prompt else None
        # One decode per 30 s window: no temperature fallback (each retry is another full decode), no language
        # detection, no timestamp tokens. Our own VAD has already cut the utterance, so no VAD here.
        segments, _ = self._model.transcribe(
            audio, language=language, beam_size=BEAM_SIZE, temperature=0.0, word_timestamps=True,
            without_timestamps=True, vad_filter=False, condition_on_previous_text=False, initial_prompt=prompt)
        out: list[Word] = []
        for segment in segments:
            out.extend(Word(w.word, float(w.start), float(w.end)) for w in segment.words or ())
            # With word timestamps but no timestamp tokens, faster-whisper goes on to decode the audio after the
            # last word as one more window (another 30 s encoder pass, ~1 s here, that tends to hallucinate
            # " you" on the tail). The generator is lazy: stop once a window reached the end of the audio.
            if segment.seek * SAMPLE_RATE // 100 + WINDOW_S * SAMPLE_RATE >= audio.size:
                break
        return out

    def transcribe(self, audio16k: np.ndarray, language: str = "en") -> str:
        """The whole text of `audio16k` [n], stripped ("" for silence)."""
        audio = _check_audio(audio16k)
        if audio.size == 0:
            return ""
        # Without word timestamps each window is decoded once and the next window starts where it ends.
        segments, _ = self._model.transcribe(
            audio, language=language, beam_size=BEAM_SIZE, temperature=0.0, without_timestamps=True,
            vad_filter=False, condition_on_previous_text=False)
        return "".join(segment.text for segment in segments).strip()


def normalize(text: str) -> str:
    """A word as passes are compared: lowercase, punctuation and spaces stripped (" France?" -> "france")."""
    return text.strip().strip(string.punctuation + "\u201c\u201d\u2018\u2019\u00bf\u00a1").lower()


def agreed_prefix(previous: Sequence[Word], current: Sequence[Word]) -> int:
    """How many words at the start of `current` the previous pass also had (normalised): LocalAgreement-2."""
    n = 0
    for a, b in zip(previous, current, strict=False):
        if normalize(a.text) != normalize(b.text):
            break
        n += 1
    return n


def unseen(hypothesis: Sequence[Word], committed: Sequence[Word]) -> list[Word]:
    """The words of a pass that come after the committed ones (both on the same clock).

    Word times jitter by a word or so between passes, so time alone is not enough: where the pass repeats the
    last committed words (up to OVERLAP_WORDS, the longest run, ending within ANCHOR_S of the committed end),
    the new words start right after that run; otherwise they are those starting after the committed end
    (less SLACK_S). So no committed word comes back, and a word is not lost for a late committed end time.
    """
    if not committed:
        return list(hypothesis)
    end = committed[-1].end
    by_time = next((i for i, w in enumerate(hypothesis) if w.start >= end - SLACK_S), len(hypothesis))
    said = [normalize(w.text) for w in committed[-OVERLAP_WORDS:]]
    heard = [normalize(w.text) for w in hypothesis]
    for k in range(min(len(said), len(heard)), 0, -1):
        # every i where hypothesis[i - k:i] repeats the last k committed words near the committed end
        anchors = [i for i in range(k, len(heard) + 1)
                   if heard[i - k:i] == said[-k:] and abs(hypothesis[i - 1].end - end) < ANCHOR_S]
        if anchors:
            return list(hypothesis[min(anchors, key=lambda i: abs(i - by_time)):])
    return list(hypothesis[by_time:])


def _join(words: Sequence[Word], first: bool) -> str:
    text = "".join(w.text for w in words)
    return text.lstrip() if first else text


class StreamingTranscriber:
    """One stream's utterance, transcribed while it is spoken (LocalAgreement-2 over a sliding buffer).

    Feed 16 kHz audio with add(); call step() whenever ready() (a pass over the buffer, prompted with the text
    committed before it); finish() at the end of the utterance commits the rest and resets for the next one.
    The buffer is trimmed at the end of the last committed word once it is longer than max_buffer_s, so a pass
    costs at most one 30 s Whisper window. Not thread-safe: one caller at a time (the stream's, in order).
    """

    def __init__(self, whisper: Whisper, language: str = "en", min_pass_s: float = 0.6,
                 max_buffer_s: float = 12.0) -> None:
        if not 0.0 < min_pass_s <= max_buffer_s <= WINDOW_S - 5.0:
            raise InvalidInputError(
                f"StreamingTranscriber wants 0 < min_pass_s <= max_buffer_s <= {WINDOW_S - 5.0:g} s (a pass must fit "
                f"one Whisper window); got min_pass_s={min_pass_s}, max_buffer_s={max_buffer_s}")
        self.whisper, self.language = whisper, language
        self.min_pass_s, self.max_buffer_s = min_pass_s, max_buffer_s
        self.reset()

    def reset(self) -> None:
        """Forget the utterance: audio, committed words, the pending hypothesis."""
        self._chunks: list[np.ndarray] = []  # audio added since the last pass, each [k]
        self._buffer = np.zeros(0, np.float32)  # [n] the utterance's audio from _offset on
        self._offset = 0.0  # utterance time (s) of _buffer[0]
        self._new_samples = 0  # samples added since the last pass
        self._committed: list[Word] = []  # on the utterance clock
        self._tail: list[Word] = []  # the last pass's words not committed yet (to be agreed with the next)
        self._passed = False  # a pass ran since reset()
        self.text = ""  # all text committed in this utterance so far

    def add(self, audio16k: np.ndarray) -> None:
        """Append audio [k] at 16 kHz (cheap: never transcribes)."""
        x = _check_audio(audio16k)
        if x.size:
            self._chunks.append(x.copy())  # the caller may reuse its array
            self._new_samples += x.size

    def ready(self) -> bool:
        """At least min_pass_s of audio came since the last pass."""
        return self._new_samples >= self.min_pass_s * SAMPLE_RATE

    @property
    def buffered_s(self) -> float:
        """Seconds of audio the next pass would transcribe."""
        return (self._buffer.size + self._new_samples) / SAMPLE_RATE

    def step(self) -> TranscriptUpdate:
        """One pass over the buffer: commits the words this pass and the previous one agree on."""
        audio = self._take()
        if audio.size == 0:
            return TranscriptUpdate("", _join(self._tail, not self.text))
        new = unseen(self._pass(audio), self._committed)
        self._passed = True
        k = agreed_prefix(self._tail, new)
        committed = self._commit(new[:k])  # in the newest pass's spelling
        self._tail = new[k:]
        committed += self._trim()
        return TranscriptUpdate(committed, _join(self._tail, not self.text))

    def finish(self) -> TranscriptUpdate:
        """End of the utterance: transcribe the audio after the last committed word, commit all of it, reset.
        With no audio added since the last step(), that pass's unagreed tail is committed without a new pass.

        `text` is reset too: the utterance's whole transcript is `text` read before finish() plus the returned
        `committed`.
        """
        if self._passed and not self._chunks:
            # The last pass saw all the audio: its unagreed tail is what a new pass would give, at no cost (the
            # caller can run step() during the VAD's silence hangover to make the end of speech cheap).
            committed = self._commit(self._tail)
            self.reset()
            return TranscriptUpdate(committed, "")
        audio = self._take()
        # From the start of the last committed word still in the buffer: it anchors the new words (unseen()),
        # so a committed end time that came out late cannot clip the next word; the prompt is the text before it.
        inside = [w for w in self._committed if w.start >= self._offset]
        start = inside[-1].start if inside else self._offset
        prompt = _join([w for w in self._committed if w.start < start], True)
        rest = audio[max(0, round((start - self._offset) * SAMPLE_RATE)):]  # [m] from `start` on
        committed = ""
        if rest.size >= MIN_FINISH_S * SAMPLE_RATE:
            words = self.whisper.words(rest, prompt=prompt or None, language=self.language)
            shifted = [Word(w.text, w.start + start, w.end + start) for w in words]
            committed = self._commit(unseen(shifted, self._committed))
        self.reset()
        return TranscriptUpdate(committed, "")

    # -- internals ---------------------------------------------------------------------------------------------

    def _take(self) -> np.ndarray:
        """The buffer [n] with the audio added since the last pass appended."""
        if self._chunks:
            self._buffer = np.concatenate([self._buffer, *self._chunks])
            self._chunks.clear()
        self._new_samples = 0
        return self._buffer

    def _pass(self, audio: np.ndarray) -> list[Word]:
        """Whisper over the buffer, prompted with the committed text the buffer no longer holds; utterance clock."""
        before = [w for w in self._committed if w.end <= self._offset + 1e-6]
        prompt = _join(before, True) or None
        words = self.whisper.words(audio, prompt=prompt, language=self.language)
        return [Word(w.text, w.start + self._offset, w.end + self._offset) for w in words]

    def _commit(self, words: Sequence[Word]) -> str:
        text = _join(words, not self.text)
        self._committed.extend(words)
        self.text += text
        return text

    def _trim(self) -> str:
        """Keep the buffer under max_buffer_s: cut it at the end of the last committed word. Returns text that had
        to be committed to make room (only when no word was agreed for a whole buffer; normally "")."""
        if self._buffer.size <= self.max_buffer_s * SAMPLE_RATE:
            return ""
        forced = ""
        if not self._committed or self._committed[-1].end <= self._offset + 1e-6:
            if len(self._tail) > 1:
                # Nothing agreed in max_buffer_s: commit the newest pass but its last word rather than let the
                # buffer grow past Whisper's window.
                forced = self._commit(self._tail[:-1])
                self._tail = self._tail[-1:]
            else:
                # No words at all (noise): keep only the newest half of the buffer.
                self._cut(self._offset + self._buffer.size / SAMPLE_RATE - self.max_buffer_s / 2)
                return ""
        self._cut(self._committed[-1].end)
        return forced

    def _cut(self, at: float) -> None:
        """Drop the buffer's audio before utterance time `at` (s); later times stay as they are."""
        n = min(self._buffer.size, max(0, round((at - self._offset) * SAMPLE_RATE)))
        self._buffer = self._buffer[n:].copy()
        self._offset += n / SAMPLE_RATE
