"""Voice activity: Silero VAD (its ONNX model through onnxruntime) and server-VAD turn detection.

Silero v6 scores one window of 512 samples at 16 kHz (32 ms) at a time. Its ONNX graph takes
    input  [1, 64 + 512] float32   the previous window's last 64 samples (context), then the new window
    state  [2, 1, 128]   float32   the recurrent state (zeros at the start of a stream)
    sr     []            int64     16000
and returns `output` [1, 1] (the speech probability) and `stateN` [2, 1, 128]. One InferenceSession is shared by
every stream (onnxruntime runs are thread-safe); each stream keeps its own state, context and leftover samples.

TurnDetector gives the server-VAD semantics of OpenAI's Realtime API on the stream's audio clock (ms of audio fed):
speech starts at the first window whose probability >= threshold, reported from `prefix_padding_ms` before it;
it stops once `silence_duration_ms` of audio scores under a release threshold (threshold - 0.15, as Silero's own
iterator uses, so a brief dip between the two thresholds neither ends a turn nor restarts the silence count).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamserve.errors import InvalidInputError, ModelLoadError
from streamserve.media import VoiceUnavailableError, require

SAMPLE_RATE = 16000
WINDOW = 512  # samples per Silero window at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous window prepended to each window
RELEASE_MARGIN = 0.15  # speech ends below threshold - RELEASE_MARGIN
_MS = SAMPLE_RATE // 1000  # 16 samples per ms


class InvalidTurnDetectionError(InvalidInputError):
    """Turn-detection settings out of range; the message gives the accepted range."""

    code = "invalid_turn_detection"


class SileroVAD:
    """The Silero VAD ONNX model, loaded once and shared by all streams."""

    def __init__(self, model_path: str | Path, threads: int = 1) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise VoiceUnavailableError(f"no Silero VAD model at {path}: run `streamserve models pull silero-vad`")
        ort = require("onnxruntime")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle: sleep, never spin
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = {i.name for i in self.session.get_inputs()}
        if names != {"input", "state", "sr"}:
            raise ModelLoadError(f"{path} is not a Silero VAD v5/v6 ONNX model (inputs {sorted(names)}, expected "
                                 "input, state, sr): run `streamserve models pull silero-vad`")
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)

    def stream(self) -> SileroStream:
        """A new stream with its own recurrent state over this shared model."""
        return SileroStream(self)

    def score(self, frame: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
        """One window: frame [1, 64 + 512] float32, state [2, 1, 128] -> (speech probability, new state)."""
        prob, new_state = self.session.run(None, {"input": frame, "state": state, "sr": self._sr})
        return float(prob[0, 0]), new_state


class SileroStream:
    """One audio stream's VAD state: recurrent state, the last window's context, samples not yet a full window."""

    def __init__(self, vad: SileroVAD) -> None:
        self.vad = vad
        self.reset()

    def reset(self) -> None:
        """Start over as a new stream (state, context and leftover samples dropped)."""
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros(CONTEXT, np.float32)
        self._pending = np.zeros(0, np.float32)  # [< WINDOW] samples waiting for a full window

    @property
    def pending(self) -> int:
        """Samples held back until the next window completes (0..511)."""
        return len(self._pending)

    def probabilities(self, audio16k: np.ndarray) -> np.ndarray:
        """16 kHz float32 mono [n] -> [k] speech probabilities, one per window completed by this audio."""
        audio = np.concatenate([self._pending, np.asarray(audio16k, np.float32).reshape(-1)])
        k = len(audio) // WINDOW
        probs = np.empty(k, np.float32)
        frame = np.empty((1, CONTEXT + WINDOW), np.float32)  # [context | window]
        for i in range(k):
            window = audio[i * WINDOW:(i + 1) * WINDOW]
            frame[0, :CONTEXT] = self._context
            frame[0, CONTEXT:] = window
            probs[i], self._state = self.vad.score(frame, self._state)
            self._context = window[-CONTEXT:].copy()
        self._pending = audio[k * WINDOW:].copy()
        return probs


@dataclass(frozen=True)
class VADConfig:
    """Turn detection settings: OpenAI Realtime's `turn_detection` of type server_vad, or of type semantic_vad when
    `eagerness` is set (then the silence that ends a turn follows the words said so far, media/turns.py, and
    silence_duration_ms is only where each utterance starts, before any words are known)."""

    threshold: float = 0.5  # speech probability at which speech starts
    prefix_padding_ms: int = 300  # audio kept before the detected start
    silence_duration_ms: int = 500  # silence that ends a turn
    idle_timeout_ms: int | None = None  # the Listener's: no speech this long after a reply -> timeout_triggered
    eagerness: str | None = None  # semantic_vad: "low", "medium", "high" or "auto"; None: server_vad

    @classmethod
    def semantic(cls, eagerness: str = "auto", **kw: object) -> VADConfig:
        """semantic_vad at `eagerness`: each utterance starts with the silence of words that are not complete yet."""
        from streamserve.media.turns import EAGERNESS, SILENCE_MS

        if eagerness not in EAGERNESS:
            raise InvalidTurnDetectionError(f"turn_detection.eagerness {eagerness!r} is not one of "
                                            f"{', '.join(EAGERNESS)}")
        return cls(silence_duration_ms=SILENCE_MS[eagerness][1], eagerness=eagerness, **kw)  # type: ignore[arg-type]

    def check(self) -> VADConfig:
        """These settings, or InvalidTurnDetectionError naming the accepted range."""
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float) \
                or not 0.0 < self.threshold < 1.0:
            raise InvalidTurnDetectionError(f"turn_detection.threshold {self.threshold!r} is out of range: "
                                            "send a number between 0 and 1 (exclusive), 0.5 by default")
        _check_ms("prefix_padding_ms", self.prefix_padding_ms, 0, 5000)
        _check_ms("silence_duration_ms", self.silence_duration_ms, 0, 10000)
        if self.idle_timeout_ms is not None:
            _check_ms("idle_timeout_ms", self.idle_timeout_ms, 1, 3_600_000)
        if self.eagerness is not None:
            from streamserve.media.turns import EAGERNESS

            if self.eagerness not in EAGERNESS:
                raise InvalidTurnDetectionError(f"turn_detection.eagerness {self.eagerness!r} is not one of "
                                                f"{', '.join(EAGERNESS)}")
        return self


def _check_ms(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidTurnDetectionError(f"turn_detection.{name} {value!r} is out of range: send an integer "
                                        f"number of milliseconds from {low} to {high}")


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int  # where speech was detected minus prefix_padding_ms (not below 0), on the stream's clock
    audio: np.ndarray  # [n] float32 16 kHz samples from audio_start_ms to the end of the audio fed so far


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int  # where the stop was detected: the last voiced ms + silence_duration_ms, rounded up to a window


class TurnDetector:
    """Speech started / stopped events for one stream, from Silero probabilities and a VADConfig."""

    def __init__(self, vad: SileroVAD, config: VADConfig) -> None:
        self.config = config.check()
        self._stream = vad.stream()
        self._prefix = config.prefix_padding_ms * _MS  # samples
        self._silence = config.silence_duration_ms * _MS  # samples (semantic_vad: set by the words, hear())
        self._release = max(config.threshold - RELEASE_MARGIN, 0.0)
        self._fed = 0  # samples fed since the start of the stream (the audio clock, never reset)
        self.reset()

    @property
    def audio_ms(self) -> float:
        """Milliseconds of audio fed to this stream so far."""
        return self._fed / _MS

    @property
    def silent_since_ms(self) -> float | None:
        """While speaking: where the current run of silence began (the first window under the release threshold,
        on the audio clock), i.e. the person may have stopped there; None when speech goes on or nobody speaks.
        A hint only (no event): a SpeechStopped follows silence_duration_ms later unless speech resumes first,
        which sets it back to None. The Listener starts its final transcription pass on it."""
        return None if self._silence_start is None else self._silence_start / _MS

    def hear(self, text: str) -> None:
        """semantic_vad: the words of the current utterance so far; the silence that ends the turn follows them
        (media/turns.py). Takes effect at the next window fed. No effect with server_vad."""
        if self.config.eagerness is not None:
            from streamserve.media.turns import turn_silence_ms

            self._silence = turn_silence_ms(text, self.config.eagerness) * _MS

    def reset(self) -> None:
        """Forget speech and the VAD state (the audio clock keeps running); windows restart at the current sample."""
        self._silence = self.config.silence_duration_ms * _MS
        self._stream.reset()
        self.speaking = False
        self._next_window = self._fed  # sample index where the next window starts
        self._silence_start: int | None = None  # sample where the current run of silence began (while speaking)
        self._ring = np.zeros(0, np.float32)  # recent audio [m], from sample self._ring_start to self._fed
        self._ring_start = self._fed

    def feed(self, audio16k: np.ndarray) -> list[SpeechStarted | SpeechStopped]:
        """Feed 16 kHz float32 mono audio [n] (any n); returns the turn events it completes, in order."""
        audio = np.asarray(audio16k, np.float32).reshape(-1)
        self._ring = np.concatenate([self._ring, audio])
        self._fed += len(audio)
        events: list[SpeechStarted | SpeechStopped] = []
        for prob in self._stream.probabilities(audio):
            start, end = self._next_window, self._next_window + WINDOW  # this window's samples
            self._next_window = end
            if not self.speaking:
                if prob >= self.config.threshold:
                    self.speaking, self._silence_start = True, None
                    begin = max(start - self._prefix, self._ring_start)  # never before 0 or a reset
                    events.append(SpeechStarted(begin // _MS, self._ring[begin - self._ring_start:].copy()))
            elif prob >= self.config.threshold:
                self._silence_start = None
            elif prob < self._release:
                if self._silence_start is None:
                    self._silence_start = start
                if end - self._silence_start >= self._silence:
                    self.speaking, self._silence_start = False, None
                    self._silence = self.config.silence_duration_ms * _MS  # the next utterance's words are unknown
                    events.append(SpeechStopped(end // _MS))
        # keep what a start detected in a later window may still need: its prefix padding before the next window
        keep_from = max(self._next_window - self._prefix, self._ring_start)
        self._ring = self._ring[keep_from - self._ring_start:].copy()
        self._ring_start = keep_from
        return events
