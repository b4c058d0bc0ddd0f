"""Whisper base on the CPU (CTranslate2, int8), over the audio held rather than a fixed 30 s window.

faster-whisper's `transcribe` pads every pass to Whisper's 30 s window, so a pass over 2 s of speech costs a 30 s
encoder forward (~0.9 s on a 2-core CPU). CTranslate2's encoder takes shorter mel features as they are, so a pass
here encodes only the audio plus a little padding, rounded up to a window of WINDOW_STEP_S steps: its cost grows
with the speech. Passes of several streams run as one batch (one encoder forward per window length, one batched
decode, one batched alignment).

Short windows have a known failure: after the speech Whisper starts over ("What is the capital of France? What is
the"), or loops on one word ("Okay, okay, okay"), since it was trained on 30 s windows. Three guards (tested on
hand-made tokens in tests/media/test_whisper.py; the word error rate with them in benchmarks/stt_wer.py):
- decoding with timestamp tokens, and dropping every segment that starts after the speech ends (a repeat starts in
  the padding, past the audio: a segment's own timestamps say so);
- a decoder length bounded by the audio's duration (MAX_TOKENS_PER_S), so nothing loops for long;
- a second of silence after the speech at least (PAD_S): with none, a pass loops more often.
Word times come from the cross-attention alignment (CTranslate2's `align`, as faster-whisper's word_timestamps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamserve.errors import InvalidInputError
from streamserve.media import VoiceUnavailableError, require

SAMPLE_RATE = 16000
HOP = 160  # samples per mel frame (10 ms); the encoder halves the frames: one output position per 20 ms
MODEL_FILES = ("config.json", "model.bin", "tokenizer.json", "vocabulary.txt")
WINDOW_S = 30.0  # Whisper's own window: audio longer than a held window takes faster-whisper's windowed path
PAD_S = 1.0  # silence after the speech in a held window
WINDOW_STEP_S = 2.0  # held windows are whole multiples of this: passes of one length share a batch
MIN_WINDOW_S = 6.0  # ... and never shorter: a 4 s window heard "why it" as "white" where 5 s and more did not
MAX_TOKENS_PER_S = 12  # decoder bound: fast speech is ~5 text tokens a second; timestamps add a few per segment
MIN_TOKENS = 16
PROMPT_TOKENS = 223  # Whisper's decoder has 448 positions: half of them at most for the prompt (as Whisper does)
PROMPT_CHARS = 200  # committed text given as the prompt: the end of it (Machacek et al. 2023 do the same)
LATE_S = 0.1  # a segment starting this close to the end of the audio, or later, is a repeat in the padding
# Whisper's own silence rule (and faster-whisper's defaults): a pass whose no-speech probability is above this and
# whose mean token log-probability is below LOGPROB_FLOOR heard no speech (2 s of zeros otherwise give " you")
NO_SPEECH = 0.6
LOGPROB_FLOOR = -1.0
# Greedy decoding: on five synthesised phrases beam 5 gave the same words as beam 1 (one misheard word differed,
# wrong both ways) in 1.27x the time, and the agreement between passes already guards against unstable guesses.
BEAM_SIZE = 1
# faster-whisper's defaults: punctuation that joins the word after it / before it
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"


@dataclass(frozen=True)
class Word:
    """One recognised word: `text` keeps Whisper's leading space (" capital,"); start/end in seconds."""

    text: str
    start: float
    end: float


@dataclass(frozen=True)
class PassRequest:
    """One pass: `audio` [n] float32 at 16 kHz, and the text said just before it (the decoder's prompt)."""

    audio: np.ndarray
    prompt: str | None = None


def check_audio(audio16k: np.ndarray) -> np.ndarray:
    x = np.asarray(audio16k)
    if x.ndim != 1 or not np.issubdtype(x.dtype, np.floating):
        raise InvalidInputError(f"speech to text wants float32 mono samples at 16 kHz, shape [n]; got {x.dtype} "
                                f"{x.shape} (decode the frames with streamserve.media.audio.AudioInput first)")
    return x.astype(np.float32, copy=False)


def held_window_s(samples: int) -> float:
    """The window a held pass over `samples` encodes: the audio, PAD_S of silence, rounded up to WINDOW_STEP_S, at
    least MIN_WINDOW_S."""
    held = WINDOW_STEP_S * math.ceil((samples / SAMPLE_RATE + PAD_S) / WINDOW_STEP_S)
    return min(WINDOW_S, max(MIN_WINDOW_S, held))


def token_bound(samples: int) -> int:
    """How many tokens a pass over `samples` may decode (text and timestamps)."""
    return MIN_TOKENS + math.ceil(MAX_TOKENS_PER_S * samples / SAMPLE_RATE)


def _repeats(segment: list[int], before: list[int], min_tokens: int = 3, restart_tokens: int = 5) -> bool:
    """Whether `segment` replays what this pass already heard: a run of `before` of at least min_tokens tokens
    ("Good morning to you," after "Good morning to you, tell me about the sea."), or a start over: its first
    restart_tokens tokens are the pass's first ("What is the capital of friends?" after "What is the capital of
    France?"). A person may repeat a word ("okay, okay"); a replay that long is Whisper looping."""
    n = len(segment)
    if n >= min_tokens and any(before[i:i + n] == segment for i in range(len(before) - n + 1)):
        return True
    return n >= restart_tokens and segment[:restart_tokens] == before[:restart_tokens]


class Whisper:
    """A CTranslate2 Whisper model folder (never downloads) on the CPU.

    `window`: "held" (default) encodes the audio held plus padding; "full" pads every pass to Whisper's 30 s
    window, as faster-whisper's transcribe does (the reference path benchmarks/stt_wer.py compares against).
    Passes are not thread-safe against each other: the server runs them on its one speech-to-text thread.
    """

    def __init__(self, model_dir: str | Path, threads: int = 2, compute_type: str = "int8",
                 window: str = "held") -> None:
        if window not in ("held", "full"):
            raise InvalidInputError(f"window must be 'held' or 'full', not {window!r}")
        folder = Path(model_dir)
        folder = folder.parent if folder.is_file() else folder  # store.installed() gives model.bin itself
        missing = [name for name in MODEL_FILES if not (folder / name).is_file()]
        if missing:
            raise VoiceUnavailableError(f"the Whisper model folder {folder} lacks {', '.join(missing)}: "
                                        "run `streamserve models pull whisper-base`")
        faster_whisper = require("faster_whisper")
        from faster_whisper.tokenizer import Tokenizer

        self.window = window
        # A folder path (and tokenizer.json in it) keeps faster-whisper off the Hugging Face hub entirely;
        # local_files_only also guards the hub path should it ever be taken.
        self._model: Any = faster_whisper.WhisperModel(
            str(folder), device="cpu", compute_type=compute_type, cpu_threads=threads, num_workers=1,
            local_files_only=True)
        self._tokenizers: dict[str, Any] = {}
        self._make_tokenizer = lambda language: Tokenizer(self._model.hf_tokenizer, True, task="transcribe",
                                                          language=language)

    # ---- the public passes -------------------------------------------------------------------------------
    def words(self, audio16k: np.ndarray, prompt: str | None = None, language: str = "en") -> list[Word]:
        """Words of `audio16k` [n] with times from its first sample; `prompt` is text said just before it."""
        return self.words_batch([PassRequest(audio16k, prompt)], language)[0]

    def words_batch(self, requests: Sequence[PassRequest], language: str = "en") -> list[list[Word]]:
        """The words of each request's audio, as words() gives them one at a time, in batches: one batch (encoder
        forward, decode, alignment) per window length and prompt length (CTranslate2 decodes a batch only when
        <|startoftranscript|> stands at the same position in every prompt)."""
        audios = [check_audio(r.audio) for r in requests]
        out: list[list[Word]] = [[] for _ in requests]
        tok = self._tokenizer(language) if self.window == "held" else None
        batches: dict[tuple[float, int], list[tuple[int, list[int]]]] = {}
        for i, audio in enumerate(audios):
            if audio.size == 0:
                continue
            if tok is None or audio.size > (WINDOW_S - PAD_S) * SAMPLE_RATE:
                out[i] = self._windowed_words(audio, requests[i].prompt, language)
            else:
                start = self._prompt(tok, requests[i].prompt)
                batches.setdefault((held_window_s(audio.size), len(start)), []).append((i, start))
        for (window_s, _), members in batches.items():
            found = self._held_words(tok, [audios[i] for i, _ in members], [s for _, s in members], window_s)
            for (i, _), words in zip(members, found, strict=True):
                out[i] = words
        return out

    def transcribe(self, audio16k: np.ndarray, language: str = "en") -> str:
        """The whole text of `audio16k` [n] of any length, stripped ("" for silence)."""
        audio = check_audio(audio16k)
        if audio.size == 0:
            return ""
        if self.window == "held" and audio.size <= (WINDOW_S - PAD_S) * SAMPLE_RATE:
            return "".join(w.text for w in self.words(audio, language=language)).strip()
        # Without word timestamps each window is decoded once and the next window starts where it ends.
        segments, _ = self._model.transcribe(
            audio, language=language, beam_size=BEAM_SIZE, temperature=0.0, without_timestamps=True,
            vad_filter=False, condition_on_previous_text=False)
        return "".join(segment.text for segment in segments).strip()

    # ---- held windows ------------------------------------------------------------------------------------
    def _tokenizer(self, language: str) -> Any:
        if language not in self._tokenizers:
            self._tokenizers[language] = self._make_tokenizer(language)
        return self._tokenizers[language]

    def _held_words(self, tok: Any, audios: list[np.ndarray], starts: list[list[int]], window_s: float
                    ) -> list[list[Word]]:
        """One batch: audios [n_i] within `window_s`, each decoded from its start tokens (all of one length)."""
        import ctranslate2

        window = round(window_s * SAMPLE_RATE)
        # [B, 80, frames]: each audio's log-mel over its own window (Whisper normalises each spectrogram by its max)
        feats = np.stack([self._model.feature_extractor(np.pad(a, (0, window - a.size)), padding=0) for a in audios])
        frames = feats.shape[-1] - feats.shape[-1] % 2  # the encoder's stride-2 convolution wants an even count
        features = ctranslate2.StorageView.from_array(np.ascontiguousarray(feats[..., :frames]))
        encoded = self._model.model.encode(features)  # [B, frames / 2, 512]
        bounds = [len(s) + token_bound(a.size) for s, a in zip(starts, audios, strict=True)]
        results = self._model.model.generate(encoded, starts, beam_size=BEAM_SIZE, max_length=max(bounds),
                                             suppress_blank=True, return_scores=True, return_no_speech_prob=True)
        texts = [[] if r.no_speech_prob > NO_SPEECH and r.scores[0] < LOGPROB_FLOOR else
                 self._kept_text(tok, r.sequences_ids[0][:bound - len(start)], a.size / SAMPLE_RATE)
                 for r, start, bound, a in zip(results, starts, bounds, audios, strict=True)]
        return self._align(tok, encoded, texts, [a.size // HOP for a in audios])

    @staticmethod
    def _prompt(tok: Any, prompt: str | None) -> list[int]:
        """[sot_prev, the prompt's last tokens] + [sot, language, transcribe]: timestamps on (no notimestamps)."""
        head: list[int] = []
        if prompt and prompt.strip():
            head = [tok.sot_prev, *tok.encode(" " + prompt.strip()[-PROMPT_CHARS:])[-(PROMPT_TOKENS - 1):]]
        return [*head, *tok.sot_sequence]

    @staticmethod
    def _kept_text(tok: Any, ids: Sequence[int], duration_s: float) -> list[int]:
        """The text tokens of the segments [<|t0|> text <|t1|>]* up to the first that starts at or after the end of
        the audio (less LATE_S) or that repeats words this pass already gave: Whisper starting over (into the
        padding, or into the trailing silence of the audio itself), never speech."""
        segments: list[tuple[float, list[int]]] = []  # (start s, text tokens)
        start: float | None = None
        for t in ids:
            if t >= tok.timestamp_begin:
                if start is None:  # a segment opens ...
                    start = (t - tok.timestamp_begin) * 0.02
                    segments.append((start, []))
                else:  # ... and closes
                    start = None
            elif t < tok.eot:
                if not segments or start is None:  # text outside timestamps (a prompt without them): from 0 or on
                    start = segments[-1][0] if segments else 0.0
                    segments.append((start, []))
                segments[-1][1].append(t)
        kept: list[int] = []
        for at, text in segments:
            if at >= duration_s - LATE_S or (kept and _repeats(text, kept)):
                break
            kept += text
        return kept

    def _align(self, tok: Any, encoded: Any, texts: list[list[int]], frames: list[int]) -> list[list[Word]]:
        """Word times of each text from the cross-attention alignment; punctuation joins its neighbour word."""
        from faster_whisper.transcribe import merge_punctuations

        out: list[list[Word]] = [[] for _ in texts]
        todo = [i for i, t in enumerate(texts) if t]
        if not todo:
            return out
        # CTranslate2's align takes one batch as the encoder output: align all, keep the non-empty ones' results
        tokens = [texts[i] if texts[i] else [tok.eot] for i in range(len(texts))]
        alignments = self._model.find_alignment(tok, tokens, encoded, frames)
        for i in todo:
            words = alignments[i]
            merge_punctuations(words, PREPEND_PUNCTUATIONS, APPEND_PUNCTUATIONS)
            out[i] = [Word(w["word"], round(float(w["start"]), 2), round(float(w["end"]), 2))
                      for w in words if w["word"]]
        return out

    # ---- Whisper's own 30 s windows (faster-whisper) ------------------------------------------------------
    def _windowed_words(self, audio: np.ndarray, prompt: str | None, language: str) -> list[Word]:
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
