"""The voice pipeline's media stages on this CPU, as real-time factors (compute time / audio duration), for
benchmarks/voice_latency.py: Silero VAD over 10 s of speech fed in 20 ms pieces, one Whisper pass over 2 s and
over 5 s, Piper synthesis of one sentence, each with the threads the server gives each model.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from streamserve.models.store import installed


def need(name: str) -> Path:
    if (path := installed(name)) is None:
        raise SystemExit(f"voice model {name} is not in the model cache: run `streamserve models pull {name}`")
    return path


def media_rtf(at16k: list[np.ndarray], sentence: str, reps: int) -> dict[str, Any]:
    """Real-time factor of each media stage on the speech `at16k` ([n] float32 at 16 kHz, several utterances) and
    Piper's synthesis of `sentence` (best of `reps` after a warm-up)."""
    from streamserve.media.stt import Whisper
    from streamserve.media.tts import PiperVoice
    from streamserve.media.vad import SileroVAD

    threads = max(1, (os.cpu_count() or 2) // 2)  # what VoiceRuntime.load gives each model
    gap = np.zeros(4800, np.float32)  # 0.3 s at 16 kHz
    speech = np.concatenate([p for a in at16k for p in (a, gap)])
    speech = np.tile(speech, math.ceil(160000 / len(speech)))[:160000]  # 10 s at 16 kHz

    def best(fn: Any, *args: Any) -> float:
        fn(*args)  # warm-up: first-run allocations are not the steady state
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        return min(times)

    vad = SileroVAD(need("silero-vad"))

    def vad_pass() -> None:
        stream = vad.stream()
        for i in range(0, len(speech), 320):  # 20 ms pieces, as frames arrive
            stream.probabilities(speech[i:i + 320])

    whisper = Whisper(need("whisper-base").parent, threads=threads)
    voice = PiperVoice(need("piper-joe"), threads=threads)
    spoken_s = len(voice.synthesize(sentence)) / voice.sample_rate
    compute = {"vad_10s": best(vad_pass), "whisper_2s": best(whisper.transcribe, speech[:32000]),
               "whisper_5s": best(whisper.transcribe, speech[:80000]),
               "piper_sentence": best(voice.synthesize, sentence)}
    audio_s = {"vad_10s": 10.0, "whisper_2s": 2.0, "whisper_5s": 5.0, "piper_sentence": spoken_s}
    return {"threads": threads, **{k: round(v / audio_s[k], 4) for k, v in compute.items()},
            "compute_s": {k: round(v, 3) for k, v in compute.items()}, "piper_sentence_audio_s": round(spoken_s, 2)}
