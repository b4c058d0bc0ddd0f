"""A fixed set of spoken utterances for measuring speech to text: 36 sentences, each said once by one of six
conditions (two voice engines, three speaking rates, with and without background noise), at 16 kHz.

    piper        the Piper voice (piper-joe) at its own rate                 (length_scale 1.0)
    piper-fast   the same voice, faster                                      (length_scale 0.8)
    piper-slow   the same voice, slower                                      (length_scale 1.3)
    piper-noise  the Piper voice over pink noise at 10 dB SNR
    espeak-us    eSpeak NG's en-us voice (a formant synthesiser: another timbre altogether), 160 words a minute
    espeak-gb    eSpeak NG's en-gb voice, female variant, 190 words a minute, over pink noise at 15 dB SNR

Everything is deterministic: no sampling noise in Piper, seeded noise. eSpeak NG runs in a child process of its
own: its library keeps one global state, which the Piper voice's phonemizer also uses in this process. The
library and its data come from the voice extra's espeakng-loader; no system eSpeak.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RATE = 16000
SENTENCES = (
    "What is the capital of France?",
    "Okay.",
    "Tell me a short story about a dragon who loves to bake bread.",
    "Could you turn the lights off in the kitchen and then lock the front door?",
    "Hello there, how are you doing today?",
    "Yes, please.",
    "How far away is the moon from the earth?",
    "I would like to book a table for two at seven tonight.",
    "Why is the sky blue?",
    "Please remind me to call my mother tomorrow morning.",
    "What time does the train to Boston leave?",
    "Thank you very much.",
    "Can you explain how a rainbow forms after the rain?",
    "Play some quiet music while I read.",
    "Is it going to snow this weekend?",
    "My favourite colour is green, what is yours?",
    "Stop.",
    "How many legs does a spider have?",
    "Write a poem about the ocean at night.",
    "The meeting has been moved to Thursday afternoon.",
    "Who wrote the play about the prince of Denmark?",
    "Set a timer for ten minutes.",
    "What should I cook for dinner with rice and beans?",
    "Good morning.",
    "Translate good night into Spanish.",
    "How do airplanes stay up in the air?",
    "I think I left my keys somewhere in the car.",
    "Which planet is the largest in our solar system?",
    "Let me think about that for a second.",
    "Can you recommend a good book about history?",
    "No, that is not what I meant.",
    "How long should I boil an egg?",
    "Open the window in the bedroom, please.",
    "What is seven times eight?",
    "Describe a busy market on a sunny day.",
    "Where is the nearest hospital?",
)
CONDITIONS = ("piper", "piper-fast", "piper-slow", "piper-noise", "espeak-us", "espeak-gb")
PIPER_LENGTH = {"piper": 1.0, "piper-fast": 0.8, "piper-slow": 1.3, "piper-noise": 1.0}
ESPEAK = {"espeak-us": ("en-us", 160, None), "espeak-gb": ("en-gb+f3", 190, 15.0)}  # voice, words/min, SNR dB
SNR_DB = {"piper-noise": 10.0}


@dataclass(frozen=True)
class Utterance:
    text: str
    condition: str
    audio: np.ndarray  # [n] float32 at 16 kHz


def pink_noise(n: int, seed: int) -> np.ndarray:
    """[n] float32 noise with a 1/f power spectrum (room and traffic noise are closer to it than white noise)."""
    rng = np.random.default_rng(seed)
    spectrum = np.fft.rfft(rng.standard_normal(n))
    spectrum /= np.sqrt(np.maximum(np.arange(spectrum.size), 1.0))
    noise = np.fft.irfft(spectrum, n)
    return (noise / (np.std(noise) + 1e-12)).astype(np.float32)


def with_noise(audio: np.ndarray, snr_db: float, seed: int) -> np.ndarray:
    speech_power = float(np.mean(audio[np.abs(audio) > 1e-3] ** 2)) if np.any(np.abs(audio) > 1e-3) else 1e-6
    noise = pink_noise(audio.size, seed) * np.sqrt(speech_power / 10 ** (snr_db / 10))
    return np.clip(audio + noise, -1.0, 1.0).astype(np.float32)


def _to_16k(audio: np.ndarray, rate: int) -> np.ndarray:
    from streamserve.media.audio import Resampler

    resampler = Resampler(rate, RATE)
    return np.concatenate([resampler.process(audio.astype(np.float32)), resampler.flush()])


def _piper(items: list[tuple[int, str, str]]) -> dict[int, np.ndarray]:
    from streamserve.media.tts import PiperVoice
    from streamserve.models.store import installed

    path = installed("piper-joe")
    if path is None:
        raise SystemExit("the Piper voice is not in the model cache: streamserve models pull piper-joe")
    voice = PiperVoice(path, variation=False)
    out = {}
    for i, text, condition in items:
        voice.scales[1] = PIPER_LENGTH[condition]  # [noise_scale, length_scale, noise_w]
        out[i] = _to_16k(voice.synthesize(text), voice.sample_rate)
    return out


def _espeak_child(items: list[tuple[int, str, str]]) -> dict[int, tuple[np.ndarray, int]]:
    """In the child process: each text spoken by eSpeak NG -> (int16 samples as float32 [n], sample rate)."""
    import espeakng_loader

    lib = ctypes.CDLL(espeakng_loader.get_library_path())
    callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_SetSynthCallback.argtypes = [callback_type]
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                 ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    rate = lib.espeak_Initialize(2, 0, str(espeakng_loader.get_data_path()).encode(), 0)  # 2: synchronous
    chunks: list[np.ndarray] = []

    def collect(wav: ctypes.POINTER(ctypes.c_short), n: int, _events: ctypes.c_void_p) -> int:
        if n > 0:
            chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).astype(np.float32) / 32768.0)
        return 0

    keep = callback_type(collect)  # referenced until the end: eSpeak calls it
    lib.espeak_SetSynthCallback(keep)
    out = {}
    for i, text, condition in items:
        voice, words_per_minute, _ = ESPEAK[condition]
        lib.espeak_SetVoiceByName(voice.encode())
        lib.espeak_SetParameter(1, words_per_minute, 0)  # espeakRATE
        chunks.clear()
        data = text.encode()
        lib.espeak_Synth(data, len(data) + 1, 0, 0, 0, 1, None, None)  # position 0 in characters, espeakCHARS_UTF8
        lib.espeak_Synchronize()
        out[i] = (np.concatenate(chunks) if chunks else np.zeros(0, np.float32), rate)
    return out


def _espeak(items: list[tuple[int, str, str]]) -> dict[int, tuple[np.ndarray, int]]:
    """_espeak_child in a fresh Python (this file run as a script), its results through an .npz file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "espeak.npz"
        subprocess.run([sys.executable, __file__, str(out)], input=json.dumps(items), text=True, check=True,
                       timeout=300)
        with np.load(out) as saved:
            return {int(k): (saved[k], int(saved["rate"])) for k in saved.files if k != "rate"}


def utterances(count: int | None = None) -> list[Utterance]:
    """The first `count` utterances of the set (all 36 by default); sentence i is said by condition i % 6."""
    chosen = [(i, text, CONDITIONS[i % len(CONDITIONS)]) for i, text in enumerate(SENTENCES[:count])]
    audio = _piper([item for item in chosen if item[2].startswith("piper")])
    spoken = [item for item in chosen if item[2].startswith("espeak")]
    if spoken:
        audio.update({i: _to_16k(samples, rate) for i, (samples, rate) in _espeak(spoken).items()})
    out = []
    for i, text, condition in chosen:
        x = audio[i]
        snr = SNR_DB.get(condition) or (ESPEAK[condition][2] if condition in ESPEAK else None)
        if snr is not None:
            x = with_noise(x, snr, seed=i)
        out.append(Utterance(text, condition, x))
    return out


if __name__ == "__main__":  # the eSpeak child: items as JSON on stdin, the audio into the .npz named by argv[1]
    spoken = _espeak_child([tuple(item) for item in json.load(sys.stdin)])
    rates = {rate for _, rate in spoken.values()}
    np.savez(sys.argv[1], rate=np.array(rates.pop() if rates else RATE), **{str(i): a for i, (a, _) in spoken.items()})
