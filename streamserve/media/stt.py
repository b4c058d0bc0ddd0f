"""Speech to text: Whisper (faster-whisper, int8 on CPU) and a streaming transcriber with local agreement.

Audio here is always float32 mono at 16 kHz, shape [n]; times are seconds. The streaming transcriber follows the
LocalAgreement-2 policy of Machacek et al. 2023 ("Turning Whisper into Real-Time Transcription System"): the audio
of the utterance since the last trim is transcribed again and again as it grows, and a word is committed once two
consecutive passes agree on it, so committed words are stable and never repeated. Everything here blocks; the
server runs it on its media executor (streamserve.server.media.voice.runtime.VoiceRuntime.run).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from streamserve.errors import InvalidInputError
from streamserve.media.whisper import SAMPLE_RATE, WINDOW_S, PassRequest, Whisper, Word, check_audio

SLACK_S = 0.1  # a word starting this much before the last committed end may still be new (timestamp jitter)
OVERLAP_WORDS = 5  # committed words looked for in a new pass, to find where its new words begin
ANCHOR_S = 1.0  # ... when the repeat ends this close to the committed end
MIN_FINISH_S = 0.1  # less audio than this left at finish() is not worth a pass


@dataclass(frozen=True)
class TranscriptUpdate:
    """What a pass adds: `committed` is new agreed text to append now ("" if none; it starts with a space unless it
    is the first text of the utterance) and is never repeated later; `partial` is the unagreed tail after all
    committed text (it may change with the next pass; for display only)."""

    committed: str
    partial: str


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
        self._new_samples = 0  # samples added since the last pass that ran
        self._committed: list[Word] = []  # on the utterance clock
        self._tail: list[Word] = []  # the last pass's words not committed yet (to be agreed with the next)
        self._passed = False  # a pass ran since reset()
        self._unseen = False  # the buffer holds audio that no pass has seen (one was skipped)
        self._finish_start: float | None = None  # finish_request()'s pass starts here (utterance clock)
        self.text = ""  # all text committed in this utterance so far

    def add(self, audio16k: np.ndarray) -> None:
        """Append audio [k] at 16 kHz (cheap: never transcribes)."""
        x = check_audio(audio16k)
        if x.size:
            self._chunks.append(x.copy())  # the caller may reuse its array
            self._new_samples += x.size

    def ready(self) -> bool:
        """At least min_pass_s of audio came since the last pass."""
        return self._new_samples >= self.min_pass_s * SAMPLE_RATE

    @property
    def buffered_s(self) -> float:
        """Seconds of audio the next pass would transcribe."""
        return (self._buffer.size + sum(c.size for c in self._chunks)) / SAMPLE_RATE

    def step(self) -> TranscriptUpdate:
        """One pass over the buffer: commits the words this pass and the previous one agree on."""
        return self.apply_step(self._run(self.step_request()))

    def step_request(self) -> PassRequest | None:
        """The pass step() runs, for a caller that batches passes of several streams (None: no audio): the buffer
        with the audio added since the last pass, prompted with the committed text the buffer no longer holds.
        Its words go to apply_step(); nothing but add() may come between."""
        audio = self._take()
        if audio.size == 0:
            return None
        before = [w for w in self._committed if w.end <= self._offset + 1e-6]
        return PassRequest(audio, _join(before, True) or None)

    def apply_step(self, words: Sequence[Word] | None) -> TranscriptUpdate:
        """step()'s result from the words of step_request()'s pass (times from the start of its audio). None: the
        pass did not run (no audio, or a scheduler skipped it): nothing changes, the next pass covers the audio."""
        if words is None:
            return TranscriptUpdate("", _join(self._tail, not self.text))
        self._new_samples, self._unseen = 0, False
        shifted = [Word(w.text, w.start + self._offset, w.end + self._offset) for w in words]  # utterance clock
        new = unseen(shifted, self._committed)
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
        return self.apply_finish(self._run(self.finish_request()))

    def finish_request(self) -> PassRequest | None:
        """The pass finish() runs (None: it needs none); its words go to apply_finish(), which must follow."""
        self._finish_start = None
        if self._passed and not self._chunks and not self._unseen:
            # The last pass saw all the audio: its unagreed tail is what a new pass would give, at no cost (the
            # caller can run step() during the VAD's silence hangover to make the end of speech cheap).
            return None
        audio = self._take()
        # From the start of the last committed word still in the buffer: it anchors the new words (unseen()),
        # so a committed end time that came out late cannot clip the next word; the prompt is the text before it.
        inside = [w for w in self._committed if w.start >= self._offset]
        start = inside[-1].start if inside else self._offset
        rest = audio[max(0, round((start - self._offset) * SAMPLE_RATE)):]  # [m] from `start` on
        if rest.size < MIN_FINISH_S * SAMPLE_RATE:
            return None
        self._finish_start = start
        return PassRequest(rest, _join([w for w in self._committed if w.start < start], True) or None)

    def apply_finish(self, words: Sequence[Word] | None) -> TranscriptUpdate:
        """finish()'s result from the words of finish_request()'s pass: commits the rest and resets."""
        start = self._finish_start
        if words is None or start is None:  # no pass: the last pass's unagreed tail is the rest (if it saw all)
            committed = self._commit(self._tail) if self._passed and not self._chunks and not self._unseen else ""
        else:
            shifted = [Word(w.text, w.start + start, w.end + start) for w in words]
            committed = self._commit(unseen(shifted, self._committed))
        self.reset()
        return TranscriptUpdate(committed, "")

    # -- internals ---------------------------------------------------------------------------------------------

    def _run(self, request: PassRequest | None) -> list[Word] | None:
        return None if request is None else self.whisper.words(request.audio, request.prompt, self.language)

    def _take(self) -> np.ndarray:
        """The buffer [n] with the audio added since the last pass appended (unseen until a pass's words come)."""
        if self._chunks:
            self._buffer = np.concatenate([self._buffer, *self._chunks])
            self._chunks.clear()
            self._unseen = True
        return self._buffer

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
