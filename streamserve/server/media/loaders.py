"""What `streamserve serve` loads besides its routes: the engine (in a worker thread, after the port is open, with
the thread budget of server/media/threads.py) and the voice and vision models (each optional: missing or damaged, it
is logged and its input refused, and text serving goes on). The WebRTC calls' routes (the webrtc extra) are added by
server/adapters/webrtc/ (`webrtc_calls`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamserve.config import EngineConfig, SchedulerConfig
from streamserve.engine import Engine
from streamserve.errors import StreamserveError
from streamserve.server.media.threads import ThreadBudget, apply_engine_threads

if TYPE_CHECKING:
    from streamserve.server.media.voice.runtime import VoiceRuntime

log = logging.getLogger("streamserve.server")


def load_voice() -> VoiceRuntime | None:
    """The voice models, or None (logged: what to install) when the voice extra or a model is missing."""
    from streamserve.server.media.voice.runtime import VoiceRuntime

    try:
        return VoiceRuntime.load()
    except StreamserveError as e:
        log.warning("streamserve: no voice (audio is refused): %s", e)
    except Exception:  # a damaged voice model must not take text serving down with it
        log.exception("streamserve: the voice models failed to load (audio is refused)")
    return None


def load_vision() -> Any:
    """The vision model (vision.py), or None (logged: what to install) when the extra or the model is missing."""
    try:
        from streamserve.server.media.vision import VisionRuntime

        return VisionRuntime.load()
    except (StreamserveError, ImportError) as e:
        log.warning("streamserve: no vision (images are refused): %s", e)
    except Exception:  # a damaged vision model must not take text serving down with it
        log.exception("streamserve: the vision model failed to load (images are refused)")
    return None


def torch_device_is_cpu(device: str | None) -> bool:
    """Whether the engine will run on the CPU ("auto" or none: the CPU unless CUDA is there)."""
    if device and device != "auto":
        return device.split(":")[0] == "cpu"
    import torch

    return not torch.cuda.is_available()


def engine_loader(engine: EngineConfig, scheduler: SchedulerConfig | None = None) -> Callable[[], Engine]:
    def load() -> Engine:
        if torch_device_is_cpu(engine.device):
            budget = ThreadBudget.plan()
            threads = apply_engine_threads(budget)
            log.info("streamserve: %s (engine now %d)", budget.describe(), threads)
        return Engine.from_pretrained(engine.model, device=engine.device, dtype=engine.dtype, quantize=engine.quantize,
                                      kernels=engine.kernels,
                                      cuda_graphs=engine.cuda_graphs, cpu_compile=engine.cpu_compile,
                                      kv_memory=engine.kv_memory,
                                      drafter=engine.drafter, max_draft=engine.max_draft,
                                      page_size=engine.page_size, idle_ttl=engine.idle_ttl, scheduler=scheduler,
                                      rewind_reach=engine.rewind_reach, offline=engine.offline)
    return load
