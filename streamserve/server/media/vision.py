"""The vision model of one server (`VisionRuntime`: the image classifier and the one thread it runs on) and the
served model's own image encoder (`model_image_encoder`). The session service's image appends over them are
server/service/images.py (`ImageSessions`).

Two paths, chosen per served model (hello's `image.input`):
- "encoder": the model's checkpoint ships an image encoder (streamserve/media/encoder.py,
  `image_projector.safetensors`): an image becomes an `embeds` chunk [T, hidden] the model reads in place of token
  embeddings;
- "labels": a text-only model, with the vision model loaded (EfficientNet-Lite0, streamserve/media/vision.py): the
  image's ImageNet labels become a short text note ("The camera shows: coffee mug, desk.").
Neither: images are refused with `unsupported_modality`, naming the extra and the pull command (`unavailable`).

Decoding and inference never run on the event loop (every connection would stall) nor on the engine thread (decode
would stall): one thread of their own (`Worker`), one image at a time, with at most MAX_PENDING images waiting (more
are refused with `vision_busy`, nothing taken: a camera drops that frame).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from streamserve.engine.openmp import releasing
from streamserve.errors import StreamserveError
from streamserve.media.vision import VISION_EXTRA, VISION_MODEL, VisionUnavailableError

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.media.encoder import ImageEncoder
    from streamserve.media.vision import Classifier

log = logging.getLogger("streamserve.vision")
T = TypeVar("T")
MAX_PENDING = 8  # images waiting for the vision thread, server-wide; past it an image is refused (vision_busy)
TOP_LABELS = 5  # labels `VisionRuntime.labels` returns per image


class VisionBusyError(StreamserveError):
    """More images are waiting for the vision thread than it holds (MAX_PENDING); this one was dropped."""

    code = "vision_busy"


def unavailable() -> VisionUnavailableError:
    return VisionUnavailableError(
        f"this server takes no images: its model has no image encoder and the vision model is not loaded (started "
        f"with --no-vision, or missing): install the extra with {VISION_EXTRA}, pull the model with "
        f"`streamserve models pull {VISION_MODEL}`, and restart the server")


class Worker:
    """One thread for image work, with a bound on what waits for it."""

    def __init__(self, name: str, max_pending: int = MAX_PENDING) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.max_pending, self.pending = max_pending, 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.pending >= self.max_pending:
            raise VisionBusyError(f"{self.pending} images are waiting for the vision thread; this one was dropped "
                                  "(send frames no faster than they are acked)")
        self.pending += 1
        try:
            # releasing: the classifier's OpenMP workers do not stay next to the engine thread (engine/openmp.py)
            return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: releasing(lambda: fn(*args)))
        finally:
            self.pending -= 1

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class VisionRuntime:
    """The image classifier and the thread it runs on. `labels` is what the WebRTC camera path calls per frame."""

    def __init__(self, classifier: Classifier, path: Path | None = None, max_pending: int = MAX_PENDING) -> None:
        self.classifier, self.path = classifier, path
        self.worker = Worker("streamserve-vision", max_pending)

    @classmethod
    def load(cls, path: str | Path | None = None) -> VisionRuntime:
        """The classifier from the model cache (or `path`). VisionUnavailableError naming the extra when Pillow or
        torch is missing, naming the pull command when the model is not pulled; ModelLoadError for a damaged file."""
        for module in ("PIL", "torch"):
            try:
                __import__(module)
            except ImportError as e:
                raise VisionUnavailableError(f"images need the vision extra ({module} is not installed): "
                                             f"{VISION_EXTRA}") from e
        from streamserve.media.vision import load_classifier
        from streamserve.models.store import installed

        found = Path(path) if path is not None else installed(VISION_MODEL)
        if found is None:
            raise VisionUnavailableError(f"the vision model {VISION_MODEL} is not in the model cache: run "
                                         f"`streamserve models pull {VISION_MODEL}`")
        runtime = cls(load_classifier(found), found)
        runtime.classifier.labels(np.zeros((8, 8, 3), np.uint8))  # the first call's one-off costs, at start
        log.info("streamserve: vision model %s loaded (images into text-only models become labels)", VISION_MODEL)
        return runtime

    async def labels(self, rgb: np.ndarray) -> list[tuple[str, float]]:
        """An image (an array decode_image takes: uint8 RGB [H, W, 3] as a camera frame is) -> its top ImageNet
        labels [(name, probability)], most likely first. ImageError for a bad array, VisionBusyError when full."""
        return await self.worker.run(self.classify, rgb)

    async def describe(self, data: bytes | np.ndarray) -> list[tuple[str, float]]:
        """JPEG/PNG bytes or an array -> labels, decoded and classified in one trip to the vision thread."""
        return await self.worker.run(self.classify, data)

    def classify(self, data: bytes | np.ndarray) -> list[tuple[str, float]]:
        """Blocking: decode (limits checked) and classify. ~20-40 ms on a 2-core CPU (docs/protocol.md)."""
        from streamserve.media.vision import decode_image

        return self.classifier.labels(decode_image(data), TOP_LABELS)

    def close(self) -> None:
        self.worker.close()


def model_image_encoder(engine: Any) -> ImageEncoder | None:
    """The served model's own image encoder (media/encoder.py), or None: a text-only model, or a file that cannot be
    used (logged; images then take the labels path when the vision model is loaded)."""
    from streamserve.media.encoder import ImageEncoderError, load_image_encoder

    if getattr(engine, "path", None) is None:  # an engine without a local checkpoint has no encoder file
        return None
    try:
        encoder = load_image_encoder(Path(engine.path), engine.config.hidden_size)
    except ImageEncoderError:
        log.exception("streamserve: the model's image encoder cannot be used; images take the labels path")
        return None
    if encoder is not None:
        log.info("streamserve: the model sees images natively (its image encoder): images become embeddings")
    return encoder
