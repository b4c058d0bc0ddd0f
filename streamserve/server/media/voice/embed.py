"""The encoder path: audio straight into a model that hears it natively (its checkpoint ships an audio encoder,
media/encoder.py), as `embeds` chunks, with no speech to text in between.

One `AudioEmbedder` per session stream: decode + stateful resampling to 16 kHz, then the encoder over whole
embedding periods (`samples_per_embedding`: 40 ms for the mel projector); the samples of an unfinished period wait
for the next append. All of it runs on the media executor, one append at a time.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

log = logging.getLogger("streamserve.voice")

if TYPE_CHECKING:
    from streamserve.media.audio import AudioFormat
    from streamserve.media.encoder import AudioEncoder
    from streamserve.server.media.voice.runtime import VoiceRuntime


class AudioEmbedder:
    def __init__(self, runtime: VoiceRuntime, encoder: AudioEncoder, fmt: AudioFormat) -> None:
        from streamserve.media.audio import AudioInput

        self.runtime, self.encoder = runtime, encoder
        self.fmt = fmt.check()
        self._input = AudioInput(self.fmt, encoder.sample_rate)
        self._period = int(getattr(encoder, "samples_per_embedding", 640))  # samples per embedding vector
        self._pending = np.zeros(0, np.float32)  # [k < period] samples waiting for a whole period
        self._lock = asyncio.Lock()  # appends in order

    async def feed(self, data: bytes) -> np.ndarray:
        """Audio bytes in `fmt` -> float32 [T, hidden] embeddings of the whole periods they complete (T may be 0).
        AudioFormatError for partial frames, nothing taken."""
        async with self._lock:
            return await self.runtime.run(self._encode, data)

    def _encode(self, data: bytes) -> np.ndarray:
        x = np.concatenate([self._pending, self._input.feed(data)])  # [n] at 16 kHz
        whole = len(x) // self._period * self._period
        self._pending = x[whole:].copy()
        return self.encoder.encode(x[:whole])  # [whole // period, hidden]


def model_encoder(engine: Any) -> AudioEncoder | None:
    """The served model's own audio encoder (media/encoder.py), or None: a text-only model (speech to text feeds
    it), or an encoder file that cannot be used (logged; the server then transcribes instead of failing to start)."""
    from streamserve.media.encoder import AudioEncoderError, load_audio_encoder

    try:
        encoder = load_audio_encoder(Path(engine.path), engine.config.hidden_size)
    except AudioEncoderError:
        log.exception("streamserve: the model's audio encoder cannot be used; its audio goes through speech to text")
        return None
    if encoder is not None:
        log.info("streamserve: the model hears audio natively (its audio encoder): audio appends become embeddings")
    return encoder
