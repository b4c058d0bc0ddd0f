"""Fixtures of the /v1/realtime tests."""

from __future__ import annotations

import pytest
from voice_assets import needs_voice


@pytest.fixture(scope="module")
def voiced() -> None:
    """Skips (naming what to install or pull) unless the voice extra and the voice models are there."""
    needs_voice()
