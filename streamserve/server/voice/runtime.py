"""The voice models of one server and the executor their work runs on.

Loaded once at start (`streamserve serve`, unless --no-voice) from the model cache: Silero VAD, Whisper base
(faster-whisper) and the Piper voice. Their inference never runs on the event loop (every connection would
stall) nor on the engine thread (decode would stall): `run` puts it on a media executor of its own, sized to
the cores the engine leaves.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from streamserve.media import VOICE_EXTRA, VOICE_MODELS, VoiceUnavailableError, require

if TYPE_CHECKING:
    from streamserve.media.stt import Whisper
    from streamserve.media.tts import PiperVoice
    from streamserve.media.vad import SileroVAD

log = logging.getLogger("streamserve.voice")
T = TypeVar("T")


def voice_model_paths() -> dict[str, Any]:
    """name -> the installed main file of each voice model; VoiceUnavailableError naming the pull command when
    any is missing."""
    from streamserve.models.store import installed

    paths = {name: installed(name) for name in VOICE_MODELS}
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        raise VoiceUnavailableError(f"the voice models {', '.join(missing)} are not in the model cache: run "
                                    f"`streamserve models pull {' '.join(missing)}` (or `make models`)")
    return paths


class VoiceRuntime:
    def __init__(self, vad: SileroVAD, whisper: Whisper, voice: PiperVoice, workers: int) -> None:
        self.vad, self.whisper, self.voice = vad, whisper, voice
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="streamserve-media")

    @classmethod
    def load(cls, threads: int | None = None) -> VoiceRuntime:
        """The voice models from the model cache. VoiceUnavailableError when the voice extra is not installed
        (naming it) or a model is not pulled (naming the command). `threads`: cores each model's inference may
        use (default: half the machine's, at least 1)."""
        for module in ("onnxruntime", "faster_whisper", "soxr", "espeakng_loader"):
            require(module)
        paths = voice_model_paths()
        from streamserve.media.stt import Whisper
        from streamserve.media.tts import PiperVoice
        from streamserve.media.vad import SileroVAD

        n = threads or max(1, (os.cpu_count() or 2) // 2)
        runtime = cls(SileroVAD(paths["silero-vad"]), Whisper(paths["whisper-base"].parent, threads=n),
                      PiperVoice(paths["piper-joe"], threads=n), workers=max(2, n))
        log.info("streamserve: voice models loaded (VAD, speech to text, text to speech; %d threads each)", n)
        return runtime

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the media executor."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: fn(*args))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["VOICE_EXTRA", "VoiceRuntime", "VoiceUnavailableError", "voice_model_paths"]
