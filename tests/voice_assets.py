"""Test helpers for the voice path: voice models from the cache, the voice extra, and real synthesised speech.

Tests that need a voice model or a package of the voice extra skip (never fail) when it is missing, with the
command that installs it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from streamserve.media import VOICE_EXTRA


def voice_model(name: str) -> Path:
    """The main file of voice model `name` in the model cache, or a skip naming the pull command."""
    from streamserve.models.store import installed

    path = installed(name)
    if path is None:
        pytest.skip(f"voice model {name} is not in the model cache: run `streamserve models pull {name}`")
    return path


def needs(module: str) -> ModuleType:
    """Import `module` of the voice extra, or skip the test naming the extra."""
    return pytest.importorskip(module, reason=f"{module} is not installed: it comes with the voice extra, "
                                              f"{VOICE_EXTRA}")


def needs_voice() -> None:
    """Skip (naming what is missing) unless the voice extra's modules and the three voice models are here."""
    for module in ("onnxruntime", "faster_whisper", "soxr", "espeakng_loader"):
        needs(module)
    for name in ("whisper-base", "piper-joe", "silero-vad"):
        voice_model(name)


@functools.lru_cache(maxsize=8)
def _spoken(text: str, rate: int) -> np.ndarray:
    from streamserve.media.audio import Resampler
    from streamserve.media.tts import PiperVoice

    # without the voice's sampling noise: the same text gives the same samples in every run (with it, Whisper base
    # heard "capital of France" as "capital of friends" in some runs and not others)
    voice = PiperVoice(voice_model("piper-joe"), variation=False)
    audio = voice.synthesize(text)  # [n] float32 at voice.sample_rate (22050 Hz for piper-joe)
    resampler = Resampler(voice.sample_rate, rate)
    out = np.concatenate([resampler.process(audio), resampler.flush()])
    out.flags.writeable = False  # cached and shared between tests: nobody may change it in place
    return out


def speech(text: str, rate: int = 16000) -> np.ndarray:
    """`text` spoken by the Piper voice (piper-joe), as float32 mono [n] at `rate` (read-only, cached per text;
    the same samples in every run).

    Skips when onnxruntime, soxr or the piper-joe model is missing.
    """
    needs("onnxruntime")
    needs("soxr")
    voice_model("piper-joe")  # skip here, outside the cache, so a skip is never cached as a failure
    return _spoken(text, rate)


def norm_words(text: str) -> list[str]:
    """The words of `text` as passes are compared: lowercase, punctuation stripped (streamserve.media.stt.normalize)."""
    from streamserve.media.stt import normalize

    return [w for w in (normalize(t) for t in text.split()) if w]


def edit_distance(a: list[str], b: list[str]) -> int:
    """Levenshtein distance over words (insertions, deletions, substitutions)."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]
