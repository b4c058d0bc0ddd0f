"""The voice pipeline a user would otherwise assemble with pipecat, on this machine: the peer of
benchmarks/voice_latency.py's end of speech -> first reply audio.

    python benchmarks/pipecat_peer.py [--turns 6] [--silence 0.5] [--max-tokens 40]

The peer: pipecat (pipecat-ai, in this venv) running Silero VAD (pipecat's SileroVADAnalyzer and its own silero
onnx, VAD stop_secs = the silence, 0.5 s by default) -> faster-whisper base (pipecat's WhisperSTTService on the
local model folder, CPU, int8) -> pipecat's LLM context aggregators -> SmolLM2-135M-Instruct (GGUF) served by
llama.cpp's OpenAI-compatible server (`python -m llama_cpp.server`, 2 threads, from the virtual environment that
`make llamacpp-venv` builds) through pipecat's OpenAILLMService -> Piper (piper-joe, through streamserve's own
PiperVoice wrapper in a small pipecat TTSService: pipecat's PiperTTSService needs the piper-tts package). Every
model file comes from streamserve's model cache; nothing is downloaded.

No network transport: a source processor pushes 20 ms frames of 16 kHz PCM16 at real-time pace (silence between
questions: the microphone stays open), and probes record when frames pass. The questions are voice_latency.py's,
synthesised the same way, one conversation of --turns turns through one pipeline.

Per turn, from the end of speech (the time the 20 ms frame holding it was pushed; end of speech as voice_latency.py
finds it: the last sample above -40 dBFS) to the first TTSAudioRawFrame out of the TTS service, with on the way
VADUserStoppedSpeakingFrame (vad_stop_ms), the TranscriptionFrame (transcript_ms), UserStoppedSpeakingFrame, the
user aggregator's turn end (turn_end_ms) and the first LLMTextFrame (first_token_ms), each in ms after the end of
speech. The user's turn ends as pipecat recommends for a VAD-based turn end, at full strength for the same
silence as voice_latency.py's server_vad (500 ms): the VAD stops after 200 ms (stop_secs 0.2, pipecat's default,
so Whisper starts then) and SpeechTimeoutUserTurnStopStrategy waits the other 300 ms (user_speech_timeout), the
turn ending when both that silence has passed and the transcript is in. (VAD stop_secs 0.5 and no timeout, the
same silence, starts Whisper 300 ms later: about 0.3 s slower at first audio.)
The last line printed is one JSON object: p50 and p99 (nearest rank) over the turns.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import numpy as np
from loguru import logger
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADParams
from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    LLMFullResponseEndFrame,
    LLMTextFrame,
    StartFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    UserStoppedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair, LLMUserAggregatorParams
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TTSService
from pipecat.services.whisper.stt import WhisperSTTService
from pipecat.turns.user_stop import SpeechTimeoutUserTurnStopStrategy
from pipecat.turns.user_turn_strategies import UserTurnStrategies
from pipecat.workers.runner import WorkerRunner

from streamserve.models.store import installed

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is no package: voice_latency.py is imported lazily

ROOT = Path(__file__).resolve().parent.parent
LLAMA_PYTHON = ROOT / "build" / "llamacpp-venv" / "bin" / "python"
RATE = 16000  # pipecat's input rate, Silero's and Whisper's
FRAME_S = 0.02
FRAME_BYTES = int(RATE * FRAME_S) * 2  # 320 samples of int16
TURN_WAIT_S = 30.0  # from the end of speech, for the reply to finish
EOS_LEVEL = 0.01  # -40 dBFS, voice_latency.py's EOS_LEVEL
# the threads streamserve's VoiceRuntime.load gives each model on this machine: Whisper every core, Piper half;
# llama.cpp 2 (n_threads and n_threads_batch). Silero runs on 1: pipecat fixes it.
CORES = os.cpu_count() or 2
PIPER_THREADS = max(1, CORES // 2)
LLAMA_THREADS = 2
# what the probes time, by kind (named in a turn's result): each probe watches some of them, those first seen there
WATCHED: dict[str, type[Frame]] = {
    "vad_stop": VADUserStoppedSpeakingFrame, "transcript": TranscriptionFrame, "turn_end": UserStoppedSpeakingFrame,
    "first_token": LLMTextFrame, "first_audio": TTSAudioRawFrame, "reply_end": LLMFullResponseEndFrame,
    "error": ErrorFrame}


class Microphone(FrameProcessor):
    """The pipeline's source, in a transport input's place: 20 ms InputAudioRawFrames at real-time pace on one
    clock (frame k pushed at t0 + 20k ms, so a late frame does not shift the ones after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.t0: float | None = None
        self.pushed = 0

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)

    async def play(self, pcm: bytes) -> list[float]:
        """Push `pcm` (PCM16 mono 16 kHz, whole frames) -> the time each frame was pushed."""
        times: list[float] = []
        for i in range(0, len(pcm), FRAME_BYTES):
            self.t0 = self.t0 or time.perf_counter()
            wait = self.t0 + self.pushed * FRAME_S - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            await self.push_frame(InputAudioRawFrame(audio=pcm[i:i + FRAME_BYTES], sample_rate=RATE, num_channels=1))
            times.append(time.perf_counter())
            self.pushed += 1
        return times


class Probe(FrameProcessor):
    """Passes every frame on and logs (time, kind, text) of the `kinds` of WATCHED frames. One after the STT (the
    user aggregator consumes transcripts), one after the LLM (the TTS consumes its text), one as the sink after the
    TTS, where a transport's output would be (the reply ends there: the TTS queues its end behind the audio)."""

    def __init__(self, log: list[tuple[float, str, str]], *kinds: str) -> None:
        super().__init__()
        self.log, self.watched = log, [(k, WATCHED[k]) for k in (*kinds, "error")]
        self.started = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        t = time.perf_counter()
        if isinstance(frame, StartFrame):
            self.started.set()
        kind = next((k for k, cls in self.watched if isinstance(frame, cls)), None)
        if kind is not None:
            self.log.append((t, kind, getattr(frame, "text", None) or getattr(frame, "error", None) or ""))
        await self.push_frame(frame, direction)


class StreamservePiperTTS(TTSService):
    """Piper TTS with streamserve's PiperVoice (the same voice file and runtime streamserve speaks with): pipecat's
    sentence aggregation hands run_tts one sentence at a time; synthesis runs off the event loop."""

    def __init__(self, onnx: Path, threads: int = PIPER_THREADS, **kwargs: Any) -> None:
        from streamserve.media.tts import PiperVoice

        self.voice = PiperVoice(onnx, threads=threads)
        super().__init__(push_start_frame=True, push_stop_frames=True, sample_rate=self.voice.sample_rate,
                         settings=TTSSettings(model=None, voice=None, language=None), **kwargs)

    def can_generate_metrics(self) -> bool:
        return True

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        audio = await asyncio.to_thread(self.voice.synthesize, text)  # [n] float32 in [-1, 1]
        pcm = (audio * 32767).astype(np.int16).tobytes()
        for i in range(0, len(pcm), self.chunk_size):  # as a streaming service would hand it on
            yield TTSAudioRawFrame(pcm[i:i + self.chunk_size], self.sample_rate, 1, context_id=context_id)


def _after(log: list[tuple[float, str, str]], kind: str, t: float) -> list[tuple[float, str]]:
    return [(ti, text) for ti, k, text in log if k == kind and ti >= t]


def turn_result(log: list[tuple[float, str, str]], t_eos: float) -> dict[str, Any]:
    """One turn's log (from its first frame on) -> latencies in ms after the end of speech, and the texts."""
    def ms(kind: str, since: float) -> float | None:
        hits = _after(log, kind, since)
        return round((hits[0][0] - t_eos) * 1e3, 1) if hits else None

    vad = _after(log, "vad_stop", t_eos)
    out: dict[str, Any] = {"vad_stop_ms": ms("vad_stop", t_eos),
                           # the transcript of the segment the VAD closed after the end of speech
                           "transcript_ms": ms("transcript", vad[0][0]) if vad else None,
                           "turn_end_ms": ms("turn_end", t_eos), "first_token_ms": ms("first_token", t_eos),
                           # VAD stops inside the question (a pause longer than the silence): a turn ended early
                           "early_vad_stops": sum(k == "vad_stop" and ti < t_eos for ti, k, _ in log),
                           "eos_to_first_audio_ms": ms("first_audio", t_eos),
                           "transcript": " ".join(x.strip() for _, k, x in log if k == "transcript").strip(),
                           "reply": "".join(x for _, x in _after(log, "first_token", t_eos))}
    if out["eos_to_first_audio_ms"] is None:
        errors = [x for _, k, x in log if k == "error"]
        out["error"] = f"no reply audio within {TURN_WAIT_S:.0f} s" + (f": {errors[:3]}" if errors else "")
    return out


def reply_done(log: list[tuple[float, str, str]], t_eos: float) -> bool:
    """The reply's audio has all left the TTS: its LLMFullResponseEndFrame (queued behind the audio) has passed."""
    audio = _after(log, "first_audio", t_eos)
    return bool(audio) and bool(_after(log, "reply_end", audio[0][0]))


def to_pcm16(audio: np.ndarray) -> bytes:
    pcm = (np.clip(audio, -1.0, 1.0) * 32767).astype(np.int16).tobytes()
    return pcm + bytes(-len(pcm) % FRAME_BYTES)  # padded to whole frames


async def run_peer(utterances: list[tuple[np.ndarray, float]], llm_url: str, llm_model: str, *,
                   silence_s: float = 0.5, vad_stop_s: float = 0.2, max_tokens: int = 40, gap_s: float = 0.3
                   ) -> list[dict[str, Any]]:
    """Each (16 kHz float32 [n] speech, end of speech in s) through one pipecat pipeline, one conversation, as
    one user: the speech, silence at real-time pace until the reply's audio is all out (at most TURN_WAIT_S
    after the end of speech), `gap_s` more silence, the next question. -> one dict per turn (turn_result)."""
    import voice_latency  # the questions' instructions; imported here, since voice_latency.py imports this module

    logger.remove()  # pipecat logs every frame decision at DEBUG
    logger.add(sys.stderr, level="WARNING")
    os.environ["HF_HUB_OFFLINE"] = "1"  # belt and braces: every model is a local file
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"  # the LLM client talks to the loopback server directly
    whisper, voice = installed("whisper-base"), installed("piper-joe")
    if whisper is None or voice is None:
        raise SystemExit("voice models missing: streamserve models pull whisper-base piper-joe")
    log: list[tuple[float, str, str]] = []
    mic, sink = Microphone(), Probe(log, "first_audio", "reply_end")
    context = LLMContext()
    # the turn's silence: the VAD's stop (Whisper starts there), then the rest of it on the strategy's timer
    timeout = max(0.0, silence_s - vad_stop_s)
    turns = UserTurnStrategies(stop=[SpeechTimeoutUserTurnStopStrategy(user_speech_timeout=timeout)])
    aggregators = LLMContextAggregatorPair(context, user_params=LLMUserAggregatorParams(user_turn_strategies=turns))
    # faster-whisper's cpu_threads stays at its default (0: CTranslate2's 4 capped at the cores, so 2 here, what
    # streamserve gives Whisper; checked: the same threads as cpu_threads=2): the service does not expose it
    stt = WhisperSTTService(device="cpu", compute_type="int8", settings=WhisperSTTService.Settings(
        model=str(whisper.parent)))  # a folder: faster-whisper loads it and never asks the hub
    # greedy, as streamserve's realtime replies are (its sampling default, temperature 0): the same first sentence
    llm = OpenAILLMService(base_url=llm_url, api_key="none", settings=OpenAILLMService.Settings(
        model=llm_model, max_tokens=max_tokens, temperature=0.0, system_instruction=voice_latency.INSTRUCTIONS))
    tts = StreamservePiperTTS(voice)
    vad = VADProcessor(vad_analyzer=SileroVADAnalyzer(params=VADParams(stop_secs=min(vad_stop_s, silence_s))))
    pipeline = Pipeline([mic, vad,
                         stt, Probe(log, "vad_stop", "transcript"), aggregators.user(), llm,
                         Probe(log, "turn_end", "first_token"), tts, sink, aggregators.assistant()])
    worker = PipelineWorker(pipeline, params=PipelineParams(audio_in_sample_rate=RATE,
                                                            audio_out_sample_rate=tts.sample_rate),
                            enable_rtvi=False, idle_timeout_secs=None)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    results: list[dict[str, Any]] = []
    try:
        await asyncio.wait_for(sink.started.wait(), 60)
        silence = bytes(FRAME_BYTES)
        for audio, eos_s in utterances:
            since = len(log)
            times = await mic.play(to_pcm16(audio))
            t_eos = times[min(len(times) - 1, max(0, round(eos_s / FRAME_S) - 1))]  # the frame ending at eos_s
            while not reply_done(log[since:], t_eos) and time.perf_counter() < t_eos + TURN_WAIT_S:
                await mic.play(silence)
            await mic.play(silence * round(gap_s / FRAME_S))
            results.append(turn_result(log[since:], t_eos))
    finally:
        await worker.stop_when_done()
        try:
            await asyncio.wait_for(running, 30)
        except TimeoutError:
            await runner.cancel()
    return results


def start_llama_server(gguf: Path, threads: int = 2) -> tuple[subprocess.Popen[bytes], str]:
    """llama.cpp's OpenAI-compatible server on a free loopback port, ready -> (process, base URL ending in /v1);
    the model is named by the file's stem, the chat template is the one the GGUF carries. Its log goes to a file in
    the temporary folder (a pipe nobody reads would fill and stall the server), shown if it fails to start."""
    if not LLAMA_PYTHON.exists():
        raise SystemExit(f"{LLAMA_PYTHON} is missing: build llama.cpp's server with `make llamacpp-venv`")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.gettempdir()) / f"llama-server-{port}.log"
    cmd = [str(LLAMA_PYTHON), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", gguf.stem,
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
           "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:  # the server keeps its own handle
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, whatever the env says
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            opener.open(f"{url}/models", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"llama.cpp's server did not start: {log.read_text(errors='replace')[-3000:]}")


def llama_build() -> str:
    """How the server's llama.cpp was built: its system info (the SIMD it uses), from the server's venv."""
    info = subprocess.run([str(LLAMA_PYTHON), "-c", "import llama_cpp; print(llama_cpp.__version__, "
                           "llama_cpp.llama_print_system_info().decode())"], capture_output=True, text=True)
    return info.stdout.strip() or info.stderr.strip()[-300:]


def end_of_speech(x: np.ndarray) -> float:
    """Seconds to the end of the 20 ms frame holding the last sample above EOS_LEVEL: where voice_latency.py puts
    the end of speech (at 24 kHz; its frames end at the same times), so that both measure from the same instant."""
    return (int(np.nonzero(np.abs(x) > EOS_LEVEL)[0][-1]) // (FRAME_BYTES // 2) + 1) * FRAME_S


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=6, help="turns of the one conversation (default 6)")
    ap.add_argument("--silence", type=float, default=0.5, help="VAD stop_secs, the silence that ends a turn")
    ap.add_argument("--max-tokens", type=int, default=40, help="max_tokens per reply (default 40)")
    args = ap.parse_args()
    import voice_latency

    gguf = installed("smollm2-135m-instruct")
    if gguf is None:
        raise SystemExit("streamserve models pull smollm2-135m-instruct")
    _, at16k = voice_latency.synthesize(voice_latency.QUESTIONS)
    speech = [at16k[i % len(at16k)] for i in range(args.turns)]
    utts = [(x, end_of_speech(x)) for x in speech]
    t_start = time.perf_counter()
    proc, url = start_llama_server(gguf, LLAMA_THREADS)
    try:
        turns = asyncio.run(run_peer(utts, url, gguf.stem, silence_s=args.silence, max_tokens=args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(30)
    for i, t in enumerate(turns):
        print(f"turn {i}: {json.dumps(t)}", file=sys.stderr)
    done = [t for t in turns if "error" not in t]
    result: dict[str, Any] = {
        "benchmark": "pipecat_peer", "turns_answered": f"{len(done)}/{len(turns)}",
        "eos_to_first_audio_ms": voice_latency.spread([t["eos_to_first_audio_ms"] for t in done]),
        **{f"{k}_p50": voice_latency.pct([t[k] for t in done if t[k] is not None], 0.5)
           for k in ("vad_stop_ms", "transcript_ms", "turn_end_ms", "first_token_ms")},
        "silence_s": args.silence, "max_tokens": args.max_tokens, "cpu_count": CORES,
        "threads": {"llama_cpp": LLAMA_THREADS, "whisper": min(4, CORES), "piper": PIPER_THREADS, "silero": 1},
        "llama_cpp_build": llama_build(), "pipecat": importlib.metadata.version("pipecat-ai"),
        "wall_s": round(time.perf_counter() - t_start, 1), "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "sample": {k: done[0][k] for k in ("transcript", "reply")} if done else None,
        "problems": [t for t in turns if "error" in t][:3]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
