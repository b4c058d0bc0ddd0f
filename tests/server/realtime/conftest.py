"""Fixtures of the /v1/realtime tests."""

from __future__ import annotations

import pytest
from voice_assets import needs, voice_model


@pytest.fixture(scope="module")
def voiced() -> None:
    """Skips (naming what to install or pull) unless the voice extra and the voice models are there."""
    for module in ("onnxruntime", "faster_whisper", "soxr", "espeakng_loader"):
        needs(module)
    for name in ("whisper-base", "piper-joe", "silero-vad"):
        voice_model(name)
