"""Media: audio frames, voice activity, speech to text, text to speech, images (and the encoder interfaces).

I/O-free building blocks over maintained libraries (soxr, onnxruntime, faster-whisper, eSpeak NG); the server
schedules them (streamserve.server.media.voice). They need the voice extra, `pip install "streamserve[voice]"`, and the
voice models (`streamserve models pull whisper-base piper-joe silero-vad`); importing this package needs neither.

    audio.py      formats (PCM16, float32, G.711 mu-law/A-law), stateful resampling
    vad.py        Silero VAD and server-VAD turn detection
    stt.py        Whisper and a streaming transcriber (local agreement)
    phonemes.py   eSpeak NG phonemes (IPA) for Piper
    tts.py        the Piper voice and a sentence splitter for streamed replies
    vision.py     images: decoding, the EfficientNet-Lite0 classifier, scene notes (the vision extra, pillow;
                  streamserve models pull efficientnet-lite0)
    encoder.py    the audio- and image-encoder interfaces (models that take media as embeds)
"""

from __future__ import annotations

import importlib
import types

from streamserve.errors import StreamserveError

VOICE_EXTRA = 'pip install "streamserve[voice]"'
VOICE_MODELS = ("whisper-base", "piper-joe", "silero-vad")


class VoiceUnavailableError(StreamserveError):
    """Audio asked of a server without the voice extra or the voice models; the message says what to install."""

    code = "unsupported_modality"


def require(module: str) -> types.ModuleType:
    """Import `module`, one of the voice extra's, or VoiceUnavailableError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise VoiceUnavailableError(f"audio needs the voice extra ({module} is not installed): {VOICE_EXTRA}") from e
