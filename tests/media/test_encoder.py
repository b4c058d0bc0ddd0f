"""The audio-encoder interface: a tiny random checkpoint that ships an audio projector hears audio as `embeds`
chunks; one without it is text-only (None); Whisper's log-mel features; typed errors for bad files and audio."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_checkpoint
from voice_assets import needs

from streamserve import Engine
from streamserve.media.audio import AudioFormatError
from streamserve.media.encoder import (
    N_MELS,
    PROJECTOR_FILE,
    AudioEncoder,
    AudioEncoderError,
    MelProjector,
    load_audio_encoder,
    log_mel,
    mel_filters,
    save_audio_projector,
)

STACK = 4


def speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """float32 [n] at 16 kHz: a gliding tone with harmonics over a little noise (a voice's spectral shape)."""
    t = np.arange(int(16000 * seconds)) / 16000
    f0 = 140 + 40 * np.sin(2 * np.pi * 1.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / 16000
    x = sum(0.2 / k * np.sin(k * phase) for k in range(1, 6))
    return (x + 0.01 * np.random.default_rng(seed).standard_normal(len(t))).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("audio-model")
    make_checkpoint(folder, "qwen3")
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    projection = np.random.default_rng(1).standard_normal((N_MELS * STACK, hidden)).astype(np.float32) * 0.05
    save_audio_projector(folder, projection, STACK)
    return folder


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    e = Engine.from_pretrained(checkpoint, device="cpu", kv_memory="64MiB")
    yield e
    e.shutdown()


def test_one_second_of_audio_is_25_embeddings_that_a_session_appends_in_any_cut(checkpoint: Path,
                                                                                  engine: Engine) -> None:
    encoder = load_audio_encoder(checkpoint)
    assert isinstance(encoder, MelProjector) and isinstance(encoder, AudioEncoder)
    assert encoder.sample_rate == 16000 and encoder.hidden_size == engine.config.hidden_size
    embeds = encoder.encode(speechlike(1.0))
    assert embeds.shape == (25, engine.config.hidden_size) and embeds.dtype == np.float32
    assert np.isfinite(embeds).all() and embeds.std() > 0
    vectors = torch.from_numpy(embeds)
    with engine.open_session() as whole, engine.open_session() as halves:
        for s in (whole, halves):
            s.append(token_ids=[1, 2, 3])
        ack = whole.submit_chunk(embeds=vectors, kind="audio").result()
        assert ack.tokens == 25 and len(whole) == 28
        for part in (vectors[:12], vectors[12:]):
            halves.submit_chunk(embeds=part, kind="audio").result()
        assert len(halves) == 28
        assert torch.allclose(whole.core.logits, halves.core.logits, atol=1e-5, rtol=0)
        assert whole.generate(max_tokens=6, stop_token_ids=()) == halves.generate(max_tokens=6, stop_token_ids=())
    engine.check_integrity()


def test_audio_is_encoded_per_40_ms_and_a_remainder_gives_nothing(checkpoint: Path) -> None:
    encoder = load_audio_encoder(checkpoint)
    assert encoder is not None
    audio = speechlike(0.5)
    assert encoder.encode(audio[:3200]).shape[0] == 5  # a 200 ms frame: 5 embeddings of 40 ms
    assert encoder.encode(audio[:639]).shape == (0, encoder.hidden_size)  # under 40 ms
    assert encoder.encode(audio[:700]).shape[0] == 1  # the last 60 samples wait for the caller's next call
    assert encoder.encode(np.zeros(0, np.float32)).shape == (0, encoder.hidden_size)


def test_log_mel_is_whispers() -> None:
    feature_extractor = needs("faster_whisper.feature_extractor")
    audio = speechlike(1.3, seed=2)
    ref = feature_extractor.FeatureExtractor()(audio, padding=0)  # [80, frames]
    mine = log_mel(audio, mel_filters())  # [frames, 80]
    assert mine.shape == (130, N_MELS)
    assert np.abs(ref.T[:len(mine)] - mine).max() < 1e-4


def test_a_checkpoint_without_a_projector_is_text_only(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3")
    assert load_audio_encoder(tmp_path) is None
    assert load_audio_encoder(tmp_path / "model.safetensors") is None  # a file in the folder (a GGUF's case)


def write(folder: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(folder / PROJECTOR_FILE), metadata=metadata)


@pytest.mark.parametrize("case", ["other-hidden", "rows-not-stack", "no-stack", "no-projection", "damaged",
                                  "other-mels", "non-finite"])
def test_a_projector_that_does_not_fit_is_a_typed_error(tmp_path: Path, case: str) -> None:
    make_checkpoint(tmp_path, "qwen3")
    hidden = json.loads((tmp_path / "config.json").read_text())["hidden_size"]
    good = np.zeros((N_MELS * STACK, hidden), np.float32)
    meta = {"stack": str(STACK)}
    if case == "other-hidden":
        write(tmp_path, {"projection": np.zeros((N_MELS * STACK, hidden + 8), np.float32)}, meta)
    elif case == "rows-not-stack":
        write(tmp_path, {"projection": np.zeros((N_MELS * 3, hidden), np.float32)}, meta)
    elif case == "no-stack":
        write(tmp_path, {"projection": good}, {})
    elif case == "no-projection":
        write(tmp_path, {"weight": good}, meta)
    elif case == "damaged":
        (tmp_path / PROJECTOR_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    elif case == "other-mels":
        write(tmp_path, {"projection": good}, {**meta, "n_mels": "128"})
    else:
        write(tmp_path, {"projection": np.full_like(good, np.nan)}, meta)
    with pytest.raises(AudioEncoderError) as e:
        load_audio_encoder(tmp_path)
    assert e.value.code == "invalid_audio_encoder"


def test_the_models_hidden_size_given_by_the_caller_is_checked(checkpoint: Path) -> None:
    assert load_audio_encoder(checkpoint, hidden_size=json.loads((checkpoint / "config.json").read_text())[
        "hidden_size"]) is not None
    with pytest.raises(AudioEncoderError, match="hidden size is 7"):
        load_audio_encoder(checkpoint, hidden_size=7)


@pytest.mark.parametrize("audio", [np.zeros((2, 1600), np.float32), np.zeros(1600, np.int16),
                                   np.array([0.0, np.nan] * 800, np.float32)])
def test_audio_an_encoder_cannot_take_is_a_typed_error(checkpoint: Path, audio: np.ndarray) -> None:
    encoder = load_audio_encoder(checkpoint)
    assert encoder is not None
    with pytest.raises(AudioFormatError):
        encoder.encode(audio)


def test_importing_the_encoder_imports_no_torch() -> None:
    code = "import sys, streamserve.media.encoder; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
