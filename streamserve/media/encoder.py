"""Audio and image encoders for models that take them natively -> `embeds` [T, hidden] for a session chunk.

Which way a model hears is decided per checkpoint by `load_audio_encoder`: a checkpoint folder that ships an
`audio_projector.safetensors` takes audio as embeddings (`session.submit_chunk(embeds=..., kind="audio")`); one
without it is text-only, and its audio goes through speech to text (media/stt.py) into its chat.

`AudioEncoder` is the interface (a model's own audio tower can implement it later); `MelProjector` the encoder a
checkpoint can ship today: Whisper's log-mel features (80 mel bands of 25 ms windows every 10 ms, numpy), `stack`
consecutive frames concatenated (4: one embedding per 40 ms) and multiplied by a learned projection.

The projector file holds one tensor, `projection` [80 * stack, hidden] (float32 or float16), and `stack` in its
metadata (`save_audio_projector` writes one).

Images likewise (below): a checkpoint folder that ships an `image_projector.safetensors` takes images as embeddings
(`PatchProjector`, linear patch embeddings); one without it gets a text note of the image's labels (media/vision.py).
Imports numpy and safetensors only (no torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from streamserve.errors import ModelLoadError
from streamserve.media.audio import AudioFormatError

PROJECTOR_FILE = "audio_projector.safetensors"
SAMPLE_RATE = 16000
N_FFT, HOP, N_MELS = 400, 160, 80  # Whisper's: 25 ms windows every 10 ms, 80 mel bands
LOG_RANGE = 8.0  # decades of the log-mel kept below a call's peak (Whisper's dynamic range)


class AudioEncoderError(ModelLoadError):
    """A checkpoint's audio encoder file that cannot be used: damaged, or not of the model's sizes."""

    code = "invalid_audio_encoder"


@runtime_checkable
class AudioEncoder(Protocol):
    """Audio -> embedding vectors the model reads in place of token embeddings."""

    sample_rate: int  # of the audio `encode` takes (Hz)
    hidden_size: int  # the model's: each embedding's length

    def encode(self, audio: np.ndarray) -> np.ndarray:
        """float32 mono [n] at `sample_rate` -> float32 [T, hidden_size] (T may be 0 for very short audio)."""
        ...


def mel_filters(sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangular filters on the Slaney mel scale (linear to 1 kHz, logarithmic above),
    each scaled to unit area (Slaney's normalisation): the filterbank Whisper's features use."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0

    def to_mel(hz: np.ndarray) -> np.ndarray:
        return np.where(hz < min_log_hz, hz / f_sp, min_log_mel + np.log(np.maximum(hz, 1e-9) / min_log_hz) / logstep)

    def to_hz(mel: np.ndarray) -> np.ndarray:
        return np.where(mel < min_log_mel, mel * f_sp, min_log_hz * np.exp(logstep * (mel - min_log_mel)))

    bins = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)  # [F] the FFT bins' frequencies
    edges = to_hz(np.linspace(to_mel(np.array(0.0)), to_mel(np.array(sample_rate / 2)), n_mels + 2))  # [n_mels+2]
    lower = (bins[None, :] - edges[:-2, None]) / (edges[1:-1] - edges[:-2])[:, None]  # rising edges [n_mels, F]
    upper = (edges[2:, None] - bins[None, :]) / (edges[2:] - edges[1:-1])[:, None]  # falling edges
    weights = np.maximum(0.0, np.minimum(lower, upper))
    return (weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]).astype(np.float32)


def log_mel(audio: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """float32 [n] at 16 kHz -> Whisper's log-mel features [n // HOP, N_MELS]: centred 400-sample Hann windows
    every 160 samples (reflect-padded ends), power spectrum, mel filterbank, log10 floored at 1e-10 and at
    LOG_RANGE decades below the peak, scaled (x + 4) / 4."""
    frames = len(audio) // HOP
    if frames == 0:
        return np.zeros((0, N_MELS), np.float32)
    pad = N_FFT // 2
    x = np.pad(audio.astype(np.float64), pad, mode="reflect" if len(audio) > pad else "constant")
    idx = np.arange(N_FFT)[None, :] + HOP * np.arange(frames)[:, None]  # [frames, N_FFT] (the last one dropped)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    power = np.abs(np.fft.rfft(x[idx] * window, axis=-1)) ** 2  # [frames, F]
    spec = np.log10(np.maximum(power @ filters.T.astype(np.float64), 1e-10))  # [frames, N_MELS]
    spec = np.maximum(spec, spec.max() - LOG_RANGE)
    return ((spec + 4.0) / 4.0).astype(np.float32)


class MelProjector:
    """Log-mel frames, `stack` at a time, times a projection [N_MELS * stack, hidden]: one embedding per
    stack * 10 ms. Audio is encoded per call: feed whole multiples of `stack * 160` samples (640 for stack 4:
    40 ms) to lose nothing; a shorter remainder gives no embedding (the caller keeps it for the next call)."""

    sample_rate = SAMPLE_RATE

    def __init__(self, projection: np.ndarray, stack: int) -> None:
        if isinstance(stack, bool) or not isinstance(stack, int) or stack < 1:
            raise AudioEncoderError(f"an audio projector's stack must be a positive integer, got {stack!r}")
        if projection.ndim != 2 or projection.shape[0] != N_MELS * stack:
            raise AudioEncoderError(f"an audio projector for {stack} stacked frames of {N_MELS} mel bands is "
                                    f"[{N_MELS * stack}, hidden], got {list(projection.shape)}")
        if not np.issubdtype(projection.dtype, np.floating) or not np.isfinite(projection).all():
            raise AudioEncoderError("an audio projector's values must be finite floating-point numbers")
        self.projection = projection.astype(np.float32)  # [N_MELS * stack, hidden]
        self.stack = stack
        self.hidden_size = int(projection.shape[1])
        self.filters = mel_filters()  # [N_MELS, N_FFT // 2 + 1]

    @property
    def samples_per_embedding(self) -> int:
        return HOP * self.stack

    def encode(self, audio: np.ndarray) -> np.ndarray:
        """float32 mono [n] at 16 kHz -> float32 [n // (160 * stack), hidden]."""
        audio = np.asarray(audio)
        if audio.ndim != 1 or not np.issubdtype(audio.dtype, np.floating):
            raise AudioFormatError(f"an audio encoder takes float mono samples [n] at {SAMPLE_RATE} Hz, got "
                                   f"{audio.dtype} of shape {list(audio.shape)}: decode and resample it first")
        if not np.isfinite(audio).all():
            raise AudioFormatError("audio samples must be finite (no NaN or infinity)")
        t = len(audio) // self.samples_per_embedding
        mel = log_mel(audio[:t * self.samples_per_embedding], self.filters)  # [t * stack, N_MELS]
        stacked = mel.reshape(t, self.stack * N_MELS)  # frames of one embedding side by side, in time order
        return stacked @ self.projection  # [t, hidden] float32


def save_audio_projector(folder: str | Path, projection: np.ndarray, stack: int) -> Path:
    """Write `projection` [N_MELS * stack, hidden] as the checkpoint folder's audio projector; -> its path."""
    from safetensors.numpy import save_file

    MelProjector(projection, stack)  # checked as a load checks it
    path = Path(folder) / PROJECTOR_FILE
    save_file({"projection": np.ascontiguousarray(projection)}, str(path),
              metadata={"stack": str(stack), "n_mels": str(N_MELS), "sample_rate": str(SAMPLE_RATE)})
    return path


def load_audio_encoder(checkpoint: str | Path, hidden_size: int | None = None) -> AudioEncoder | None:
    """The checkpoint's audio encoder, or None when it has none (a text-only model: speech to text feeds it).

    `checkpoint`: its folder (or a file in it, such as a GGUF). `hidden_size`: the model's (default: config.json's
    `hidden_size`); an encoder of another size is refused. AudioEncoderError for a damaged or mismatched file."""
    found = _read_projector(checkpoint, PROJECTOR_FILE, AudioEncoderError, "save_audio_projector")
    if found is None:
        return None
    folder, path, meta, projection = found
    try:
        stack = int(meta["stack"])
    except (KeyError, ValueError):
        raise AudioEncoderError(f"{path} must say `stack` (frames per embedding) in its metadata") from None
    if meta.get("n_mels", str(N_MELS)) != str(N_MELS) or meta.get("sample_rate", str(SAMPLE_RATE)) != str(SAMPLE_RATE):
        raise AudioEncoderError(f"{path} is for {meta.get('n_mels')} mel bands at {meta.get('sample_rate')} Hz; "
                                f"this encoder computes {N_MELS} at {SAMPLE_RATE} Hz")
    encoder = MelProjector(projection, stack)
    expected = hidden_size if hidden_size is not None else _config_hidden_size(folder)
    if expected is not None and encoder.hidden_size != expected:
        raise AudioEncoderError(f"{path} projects to {encoder.hidden_size} values per embedding, but the model's "
                                f"hidden size is {expected}: it belongs to another model")
    return encoder


def _read_projector(checkpoint: str | Path, filename: str, error: type[ModelLoadError],
                    writer: str) -> tuple[Path, Path, dict[str, str], np.ndarray] | None:
    """The checkpoint folder's projector file `filename` -> (folder, its path, its metadata, its 'projection'
    [in, hidden]), or None when the checkpoint has none; `error` (naming `writer`) for a damaged file."""
    folder = Path(checkpoint)
    folder = folder if folder.is_dir() else folder.parent
    path = folder / filename
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if "projection" not in list(f.keys()):
                raise error(f"{path} has no 'projection' tensor; write it with {writer}")
            projection = f.get_tensor("projection")
    except error:
        raise
    except Exception as e:  # safetensors raises its own errors (and numpy TypeErrors) for damaged or bf16 files
        raise error(f"cannot read {path} ({e}); it must be safetensors holding a float32 or float16 "
                    "'projection'") from None
    return folder, path, meta, projection


def _config_hidden_size(folder: Path) -> int | None:
    """config.json's hidden_size (a multimodal config's text_config's), or None without a config."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    size = cfg.get("hidden_size", (cfg.get("text_config") or {}).get("hidden_size"))
    return int(size) if size is not None else None


# ---- images ------------------------------------------------------------------------------------------------
# A model that sees images natively ships `image_projector.safetensors`: images become embeddings as Fuyu's do, with
# no vision tower of their own: the image scaled to `size` x `size` (shorter side, centre crop), cut into
# `patch` x `patch` patches in reading order, each patch's pixels (scaled to [-1, 1], row-major, RGB interleaved)
# times `projection` [patch * patch * 3, hidden]: (size / patch) ** 2 embeddings per image.
IMAGE_PROJECTOR_FILE = "image_projector.safetensors"


class ImageEncoderError(ModelLoadError):
    """A checkpoint's image encoder file that cannot be used: damaged, or not of the model's sizes."""

    code = "invalid_image_encoder"


@runtime_checkable
class ImageEncoder(Protocol):
    """An image -> embedding vectors the model reads in place of token embeddings."""

    hidden_size: int  # the model's: each embedding's length

    def encode(self, rgb: np.ndarray) -> np.ndarray:
        """uint8 RGB [H, W, 3] (media/vision.py's decode_image makes it) -> float32 [T, hidden_size]."""
        ...


def square_resize(rgb: np.ndarray, size: int) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [size, size, 3]: the centred square of side min(H, W), each output pixel the mean
    of the input pixels it covers (box filter; nearest pixel when enlarging)."""
    h, w = rgb.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    edges = np.linspace(0, side, size + 1)  # [size + 1] the output pixels' borders in input pixels
    lo = np.minimum(np.floor(edges[:-1]).astype(np.int64), side - 1)
    hi = np.maximum(np.ceil(edges[1:]).astype(np.int64), lo + 1)
    # integral image: the sum over any box in O(1), [side + 1, side + 1, 3]
    sq = rgb[top:top + side, left:left + side].astype(np.float64)
    ii = np.zeros((side + 1, side + 1, 3))
    ii[1:, 1:] = sq.cumsum(0).cumsum(1)
    y0, y1, x0, x1 = lo[:, None], hi[:, None], lo[None, :], hi[None, :]
    total = ii[y1, x1] - ii[y0, x1] - ii[y1, x0] + ii[y0, x0]  # [size, size, 3]
    return (total / ((y1 - y0) * (x1 - x0))[:, :, None]).astype(np.float32)


class PatchProjector:
    """Linear patch embeddings: `(size // patch) ** 2` vectors per image (see above)."""

    def __init__(self, projection: np.ndarray, patch: int, size: int) -> None:
        for name, v in (("patch", patch), ("size", size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ImageEncoderError(f"an image projector's {name} must be a positive integer, got {v!r}")
        if size % patch:
            raise ImageEncoderError(f"an image projector's size {size} must be a multiple of its patch {patch}")
        if projection.ndim != 2 or projection.shape[0] != patch * patch * 3:
            raise ImageEncoderError(f"an image projector for {patch} x {patch} RGB patches is [{patch * patch * 3}, "
                                    f"hidden], got {list(projection.shape)}")
        if not np.issubdtype(projection.dtype, np.floating) or not np.isfinite(projection).all():
            raise ImageEncoderError("an image projector's values must be finite floating-point numbers")
        self.projection = projection.astype(np.float32)  # [patch * patch * 3, hidden]
        self.patch, self.size = patch, size
        self.hidden_size = int(projection.shape[1])

    @property
    def tokens(self) -> int:
        """Embeddings per image."""
        return (self.size // self.patch) ** 2

    def encode(self, rgb: np.ndarray) -> np.ndarray:
        """uint8 RGB [H, W, 3] -> float32 [(size / patch) ** 2, hidden]."""
        rgb = np.asarray(rgb)
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
            raise ImageEncoderError(f"an image encoder takes uint8 RGB [H, W, 3] (decode_image makes it), got "
                                    f"{rgb.dtype} {list(rgb.shape)}")
        n, p = self.size // self.patch, self.patch
        x = square_resize(rgb, self.size) / 127.5 - 1.0  # [size, size, 3] in [-1, 1]
        patches = x.reshape(n, p, n, p, 3).transpose(0, 2, 1, 3, 4).reshape(n * n, p * p * 3)  # reading order
        return patches @ self.projection  # [n * n, hidden] float32


def save_image_projector(folder: str | Path, projection: np.ndarray, patch: int, size: int) -> Path:
    """Write `projection` [patch * patch * 3, hidden] as the checkpoint folder's image projector; -> its path."""
    from safetensors.numpy import save_file

    PatchProjector(projection, patch, size)  # checked as a load checks it
    path = Path(folder) / IMAGE_PROJECTOR_FILE
    save_file({"projection": np.ascontiguousarray(projection)}, str(path),
              metadata={"patch": str(patch), "size": str(size)})
    return path


def load_image_encoder(checkpoint: str | Path, hidden_size: int | None = None) -> ImageEncoder | None:
    """The checkpoint's image encoder, or None when it has none (a text-only model: images take the labels path).
    As load_audio_encoder; ImageEncoderError for a damaged or mismatched file."""
    found = _read_projector(checkpoint, IMAGE_PROJECTOR_FILE, ImageEncoderError, "save_image_projector")
    if found is None:
        return None
    folder, path, meta, projection = found
    try:
        patch, size = int(meta["patch"]), int(meta["size"])
    except (KeyError, ValueError):
        raise ImageEncoderError(f"{path} must say `patch` and `size` (pixels) in its metadata") from None
    encoder = PatchProjector(projection, patch, size)
    expected = hidden_size if hidden_size is not None else _config_hidden_size(folder)
    if expected is not None and encoder.hidden_size != expected:
        raise ImageEncoderError(f"{path} projects to {encoder.hidden_size} values per embedding, but the model's "
                                f"hidden size is {expected}: it belongs to another model")
    return encoder
