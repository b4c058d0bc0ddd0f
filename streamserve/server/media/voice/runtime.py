"""The voice models of one server and the executor their work runs on.

Loaded once at start (`streamserve serve`, unless --no-voice) from the model cache: Silero VAD, Whisper base
(faster-whisper) and the Piper voice. Their inference never runs on the event loop (every connection would
stall) nor on the engine thread (decode would stall). Three executors, so cheap work never waits behind dear work:
    run_light  decode, resampling and VAD of each incoming frame (~0.2 ms per 32 ms window): one thread of its
               own, so a turn's end is detected exactly silence_duration_ms after the speech, even while a
               Whisper pass (~1 s on a 2-core CPU) or a synthesis runs;
    run_stt    Whisper passes, one batch at a time for the whole server (two at once on a small CPU would each
               take twice as long, so both utterances would be final late instead of one on time), fed by `stt`,
               the scheduler that batches the passes of all streams and runs final passes first
               (server/media/voice/stt_scheduler.py);
    run        everything else (text to speech, whole-item transcriptions), sized to the cores the engine leaves;
               text to speech goes through `tts` (deadlines.py): the piece due soonest first, so every
               reply's first audio goes before other replies' later sentences.
How many threads each model gets: server/media/threads.py (one budget over the cores this process may use).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from streamserve.media import VOICE_EXTRA, VOICE_MODELS, VoiceUnavailableError, require
from streamserve.server.media.threads import ThreadBudget
from streamserve.server.media.voice.deadlines import DeadlineRunner
from streamserve.server.media.voice.speculate import Speculations
from streamserve.server.media.voice.stt_scheduler import SttScheduler

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
        self.light_executor = ThreadPoolExecutor(1, thread_name_prefix="streamserve-vad")
        self.stt_executor = ThreadPoolExecutor(1, thread_name_prefix="streamserve-stt")
        self.tts = DeadlineRunner(self.executor, workers)  # text to speech: each reply's first piece first
        # partial transcripts only while no speech is being synthesised (the cores are not spare then)
        self.stt = SttScheduler(whisper, self.stt_executor, spare=lambda: not self.tts.busy)
        self.speculations = Speculations()  # replies started at the likely end of a turn (voice/speculate.py)

    @classmethod
    def load(cls, threads: int | None = None) -> VoiceRuntime:
        """The voice models from the model cache. VoiceUnavailableError when the voice extra is not installed
        (naming it) or a model is not pulled (naming the command). `threads`: cores each model's inference may
        use (default: server/media/threads.py's budget over the cores this process may use)."""
        for module in ("onnxruntime", "faster_whisper", "soxr", "espeakng_loader"):
            require(module)
        paths = voice_model_paths()
        from streamserve.media.stt import Whisper
        from streamserve.media.tts import PiperVoice
        from streamserve.media.vad import SileroVAD

        budget = ThreadBudget.plan(threads=threads)  # the cores this process may use, shared out (threads.py)
        runtime = cls(SileroVAD(paths["silero-vad"], threads=budget.vad),
                      Whisper(paths["whisper-base"].parent, threads=budget.stt),
                      PiperVoice(paths["piper-joe"], threads=budget.tts), workers=budget.tts_workers)
        log.info("streamserve: voice models loaded (%s)", budget.describe())
        return runtime

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the media executor."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: fn(*args))

    async def run_light(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the per-frame thread: only work of a few ms (decode, resample, VAD), never a model pass
        that takes longer, or every stream's turn detection would wait behind it."""
        return await asyncio.get_running_loop().run_in_executor(self.light_executor, lambda: fn(*args))

    async def run_stt(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) (a Whisper pass) on the speech-to-text thread: passes of all streams one after another."""
        return await asyncio.get_running_loop().run_in_executor(self.stt_executor, lambda: fn(*args))

    def close(self) -> None:
        self.stt.close()
        for executor in (self.executor, self.light_executor, self.stt_executor):
            executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["VOICE_EXTRA", "VoiceRuntime", "VoiceUnavailableError", "voice_model_paths"]
