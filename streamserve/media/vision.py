"""Vision for text-only models: an image -> the ImageNet labels a classifier gives it -> a short text note.

A text-only model cannot see, so a camera frame reaches it as words: EfficientNet-Lite0 (an ImageNet classifier,
the `efficientnet-lite0` catalog model: `streamserve models pull efficientnet-lite0`) names what the image shows
among the 1000 ImageNet classes, and `SceneNotes` turns the labels into a note such as "The camera shows: coffee mug,
desk." when they change. It names objects, nothing more: no positions, counts, text or people's actions.

    decode_image    JPEG/PNG bytes (Pillow: the vision extra) or a numpy array -> uint8 RGB [H, W, 3], with limits
    preprocess      RGB -> the classifier's input [1, 3, 224, 224] (shorter side to 256, centre crop 224, bicubic)
    build_model, load_classifier, Classifier   the network in plain torch, its checkpoint, top-k labels
    SceneNotes      labels -> a note when the label set changes (I/O-free)

The checkpoint (efficientnet-lite0-57934424.pth) is Google's TensorFlow EfficientNet-Lite0 converted to PyTorch, so
this network does what TensorFlow's does: "SAME" padding (asymmetric for stride 2: the extra row and column at the
bottom and right), batch norm with eps 1e-3, ReLU6, no squeeze-and-excitation, inputs scaled as (x - 127) / 128
(the Lite models' preprocessing; ImageNet's mean/std scaling gives other, worse labels: tests/media/test_vision.py).
`imagenet_labels.txt` beside this module holds the class names, line i = class i (WordNet's first lemma of each
class, underscores as spaces; the two classes that lemma names twice are told apart: "crane (bird)", "tank suit").
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamserve.errors import InvalidInputError, ModelLoadError, StreamserveError

if TYPE_CHECKING:  # pragma: no cover
    import torch

VISION_EXTRA = 'pip install "streamserve[vision]"'
VISION_MODEL = "efficientnet-lite0"  # the catalog name of the classifier
MAX_IMAGE_BYTES = 16 << 20  # an encoded image bigger than this is refused before decoding
MAX_PIXELS = 1 << 24  # width * height (16.7 M: 4096 x 4096); checked from the header before pixels are decoded
MAX_SIDE = 16384  # pixels along either side
INPUT_SIZE, RESIZE_TO = 224, 256  # the network's input; the shorter side is scaled to 256, then 224 cut from the centre
MEAN, STD = 127.0, 128.0  # TensorFlow EfficientNet-Lite's input scaling, on 0..255 pixel values
BN_EPS = 1e-3
FORMATS = ("JPEG", "PNG")


class ImageError(InvalidInputError):
    """An image that cannot be used: not JPEG/PNG, damaged, too large, or an array of the wrong shape or values."""

    code = "invalid_image"


class VisionUnavailableError(StreamserveError):
    """An image sent to a server without the vision extra or model; the message says what to install."""

    code = "unsupported_modality"


# ---- images in ----------------------------------------------------------------------------------------------
def _check_size(h: int, w: int, max_pixels: int) -> None:
    if h < 1 or w < 1:
        raise ImageError(f"an image of {w} x {h} pixels is empty")
    if h > MAX_SIDE or w > MAX_SIDE or h * w > max_pixels:
        raise ImageError(f"an image of {w} x {h} pixels is over the limit of {max_pixels} pixels (and {MAX_SIDE} "
                         "per side); scale it down before sending (the classifier sees 224 x 224)")


def decode_image(data: bytes | bytearray | memoryview | np.ndarray, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """An image -> uint8 RGB [H, W, 3] (a new array: the caller's is never kept or changed).

    `data`: JPEG or PNG bytes (needs Pillow, the vision extra; alpha is dropped, grey and palette images become
    RGB, 16-bit PNGs keep their top 8 bits), or an array: uint8 [H, W, 3], [H, W, 4] (alpha dropped) or [H, W]
    (grey), or float [H, W, 3] / [H, W] with values in [0, 1]. ImageError for anything else, for damaged or
    truncated files and for images over `max_pixels` (checked from the file's header, before decoding: a
    decompression bomb is refused without being expanded)."""
    if isinstance(data, np.ndarray):
        return _from_array(data, max_pixels)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"an image is JPEG/PNG bytes or a numpy array, not {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"an encoded image of {len(data)} bytes is over the limit of {MAX_IMAGE_BYTES}")
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as e:
        raise VisionUnavailableError(f"decoding JPEG/PNG needs Pillow, the vision extra: {VISION_EXTRA} (or send a "
                                     "uint8 array)") from e
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as img:
            w, h = img.size
            _check_size(h, w, max_pixels)  # the header's size: nothing decoded yet
            img.load()
            return _to_rgb(img)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"the bytes are not a JPEG or PNG image (they start {data[:8].hex()})") from None
    except Image.DecompressionBombError as e:  # Pillow's own guard, at open: headers claiming > 179 M pixels
        raise ImageError(f"the image is over the limit of {max_pixels} pixels ({e})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or damaged data (Pillow raises these)
        raise ImageError(f"the image is damaged or truncated and cannot be decoded ({e})") from None


def _to_rgb(img: Any) -> np.ndarray:
    """A loaded Pillow image -> uint8 [H, W, 3]."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit grey: its top 8 bits (Pillow's RGB conversion clips)
        grey = np.asarray(img).astype(np.int64)
        hi = 65535 if img.mode.startswith("I;16") or grey.max(initial=0) > 255 else 255
        grey8 = np.clip(np.rint(grey * (255.0 / hi)), 0, 255).astype(np.uint8)
        return np.repeat(grey8[:, :, None], 3, axis=2)
    return np.array(img.convert("RGB"), dtype=np.uint8)


def _from_array(a: np.ndarray, max_pixels: int) -> np.ndarray:
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (1, 3, 4)):
        raise ImageError(f"an image array is [H, W, 3], [H, W, 4] or [H, W], got shape {list(a.shape)}")
    _check_size(int(a.shape[0]), int(a.shape[1]), max_pixels)
    if a.dtype == np.uint8:
        out = a
    elif np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all():
            raise ImageError("an image array's values must be finite (no NaN or infinity)")
        if a.size and (a.min() < 0.0 or a.max() > 1.0):
            raise ImageError(f"a float image array's values must be in [0, 1], got {float(a.min()):.3g} to "
                             f"{float(a.max()):.3g} (send uint8 for 0..255)")
        out = np.rint(a.astype(np.float32) * 255.0).astype(np.uint8)
    else:
        raise ImageError(f"an image array is uint8 (0..255) or float (0..1), not {a.dtype}")
    if out.ndim == 2:
        out = out[:, :, None]
    if out.shape[2] == 1:
        out = np.repeat(out, 3, axis=2)
    return np.array(out[:, :, :3], order="C")  # always a copy: the caller's buffer (a frame's, read-only) is not kept


def preprocess(rgb: np.ndarray) -> torch.Tensor:
    """uint8 RGB [H, W, 3] -> float32 [1, 3, 224, 224]: the shorter side scaled to 256 (bicubic, antialiased: a big
    frame is averaged, not sampled), the centre 224 x 224 cut out, scaled as (x - 127) / 128."""
    import torch
    import torch.nn.functional as F

    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ImageError(f"preprocess takes uint8 RGB [H, W, 3] (decode_image makes it), got {rgb.dtype} "
                         f"{list(rgb.shape)}")
    h, w = rgb.shape[:2]
    scale = RESIZE_TO / min(h, w)
    size = (max(INPUT_SIZE, round(h * scale)), max(INPUT_SIZE, round(w * scale)))
    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None].float()  # [1, 3, H, W] 0..255
    x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True).clamp_(0.0, 255.0)
    top, left = (size[0] - INPUT_SIZE) // 2, (size[1] - INPUT_SIZE) // 2
    x = x[:, :, top:top + INPUT_SIZE, left:left + INPUT_SIZE]
    return ((x - MEAN) / STD).contiguous()


# ---- the network ---------------------------------------------------------------------------------------------
# One row per stage: (repeats, kernel, stride of the first block, expansion, channels in, channels out). Lite0 is
# EfficientNet-B0's stages with ReLU6 and no squeeze-and-excitation: 16 blocks, stem 32 and head 1280 channels.
STAGES = ((1, 3, 1, 1, 32, 16), (2, 3, 2, 6, 16, 24), (2, 5, 2, 6, 24, 40), (3, 3, 2, 6, 40, 80),
          (3, 5, 1, 6, 80, 112), (4, 5, 2, 6, 112, 192), (1, 3, 1, 6, 192, 320))
STEM, HEAD, CLASSES = 32, 1280, 1000


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow "SAME" padding along one side of `size`: (before, after); the odd one goes after."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _nn() -> Any:
    import torch.nn as nn

    return nn


def pad_same(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """[N, C, H, W] padded with zeros as TensorFlow's "SAME" convolution pads it (the convolutions have none)."""
    import torch.nn.functional as F

    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    return F.pad(x, (left, right, top, bottom)) if top or bottom or left or right else x


def _conv(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> Any:
    return _nn().Conv2d(cin, cout, kernel, stride=stride, groups=groups, bias=False)


def _bn(c: int) -> Any:
    return _nn().BatchNorm2d(c, eps=BN_EPS)


def build_model() -> Any:
    """An EfficientNet-Lite0 with random weights; its parameter names are the checkpoint's (`_blocks.3._bn1...`)."""
    import torch
    import torch.nn.functional as F

    nn = _nn()

    class MBConv(nn.Module):
        """Inverted residual: 1x1 expand (absent for expansion 1), depthwise k x k, 1x1 project; a skip connection
        when the block keeps its shape."""

        def __init__(self, kernel: int, stride: int, expand: int, cin: int, cout: int) -> None:
            super().__init__()
            mid = cin * expand
            self.kernel, self.stride, self.skip = kernel, stride, stride == 1 and cin == cout
            if expand != 1:
                self._expand_conv, self._bn0 = _conv(cin, mid, 1), _bn(mid)
            self._depthwise_conv, self._bn1 = _conv(mid, mid, kernel, stride, groups=mid), _bn(mid)
            self._project_conv, self._bn2 = _conv(mid, cout, 1), _bn(cout)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x
            if hasattr(self, "_expand_conv"):
                y = F.relu6(self._bn0(self._expand_conv(y)))
            y = F.relu6(self._bn1(self._depthwise_conv(pad_same(y, self.kernel, self.stride))))
            y = self._bn2(self._project_conv(y))  # linear bottleneck: no activation
            return x + y if self.skip else y

    class EfficientNetLite0(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._conv_stem, self._bn0 = _conv(3, STEM, 3, 2), _bn(STEM)
            blocks = []
            for repeats, kernel, stride, expand, cin, cout in STAGES:
                for i in range(repeats):
                    blocks.append(MBConv(kernel, stride if i == 0 else 1, expand, cin if i == 0 else cout, cout))
            self._blocks = nn.ModuleList(blocks)
            self._conv_head, self._bn1 = _conv(STAGES[-1][5], HEAD, 1), _bn(HEAD)
            self._fc = nn.Linear(HEAD, CLASSES)

        def features(self, x: torch.Tensor) -> torch.Tensor:
            """[N, 3, H, W] -> [N, 1280, H / 32, W / 32]."""
            x = F.relu6(self._bn0(self._conv_stem(pad_same(x, 3, 2))))
            for block in self._blocks:
                x = block(x)
            return F.relu6(self._bn1(self._conv_head(x)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            """[N, 3, 224, 224] -> logits [N, 1000] (dropout is a no-op in eval)."""
            return self._fc(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))

    return EfficientNetLite0()


@lru_cache(maxsize=1)
def imagenet_labels() -> tuple[str, ...]:
    """The 1000 ImageNet class names, index = class (imagenet_labels.txt, shipped with the package)."""
    names = tuple(resources.files("streamserve.media").joinpath("imagenet_labels.txt").read_text("utf-8").splitlines())
    if len(names) != CLASSES:  # pragma: no cover - a damaged installation
        raise ModelLoadError(f"imagenet_labels.txt has {len(names)} names, not {CLASSES}: reinstall streamserve")
    return names


@dataclass
class Classifier:
    """The network in eval mode and the class names; `labels` is the whole per-image pipeline (blocking: the server
    runs it on a thread of its own)."""

    model: Any
    names: tuple[str, ...]

    def probabilities(self, rgb: np.ndarray) -> np.ndarray:
        """uint8 RGB [H, W, 3] -> softmax over the 1000 classes, float32 [1000]."""
        import torch

        with torch.inference_mode():
            return torch.softmax(self.model(preprocess(rgb)).float(), dim=-1)[0].numpy()

    def labels(self, rgb: np.ndarray, top: int = 5) -> list[tuple[str, float]]:
        """uint8 RGB [H, W, 3] -> the `top` classes, most likely first: [(name, probability)]."""
        p = self.probabilities(rgb)
        best = np.argsort(-p, kind="stable")[:top]
        return [(self.names[i], float(p[i])) for i in best]


def load_classifier(path: str | Path) -> Classifier:
    """The classifier from its checkpoint (a state dict, read with weights_only: no pickled code runs).
    ModelLoadError for a file that is not that state dict."""
    import torch

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for damaged or non-tensor files
        raise ModelLoadError(f"cannot read the vision model {path} ({e}); pull it again: "
                             f"`streamserve models pull {VISION_MODEL} --force`") from None
    model = build_model()
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{path} is not an EfficientNet-Lite0 ImageNet checkpoint: {str(e)[:500]}") from None
    return Classifier(model.eval(), imagenet_labels())


# ---- notes for the model -------------------------------------------------------------------------------------
class SceneNotes:
    """Labels per frame -> a note for a text-only model, only when what it would say changes (I/O-free).

    Keeps the `top` labels with probability >= `min_confidence`; the note names them, most likely first: "The camera
    shows: coffee mug, desk." When the kept labels become none after some were named: "The camera shows nothing it
    recognises." A frame whose kept label set (order aside) is the last note's gives None: the session already has it.
    """

    def __init__(self, min_confidence: float = 0.2, top: int = 3) -> None:
        if not (isinstance(min_confidence, (int, float)) and 0.0 <= min_confidence <= 1.0):
            raise InvalidInputError(f"min_confidence must be in [0, 1], got {min_confidence!r}")
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise InvalidInputError(f"top must be an integer >= 1, got {top!r}")
        self.min_confidence, self.top = float(min_confidence), top
        self.current: frozenset[str] | None = None  # the label set of the last note (None: no note yet)

    def kept(self, labels: Sequence[tuple[str, float]]) -> list[str]:
        """The names a note would give: above the confidence, most likely first, each once, at most `top`."""
        out: list[str] = []
        for name, p in sorted(labels, key=lambda x: -x[1]):
            if p >= self.min_confidence and name not in out:
                out.append(name)
        return out[:self.top]

    def update(self, labels: Sequence[tuple[str, float]]) -> str | None:
        """One frame's labels [(name, probability)] -> the note to append, or None when nothing changed."""
        names = self.kept(labels)
        key = frozenset(names)
        if key == self.current or (not names and self.current is None):
            return None
        self.current = key
        return f"The camera shows: {', '.join(names)}." if names else "The camera shows nothing it recognises."

    def reset(self) -> None:
        """Forget the last note (the session was rewound past it): the next frame's labels are noted again."""
        self.current = None
