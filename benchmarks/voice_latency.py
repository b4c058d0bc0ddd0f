"""Voice turn-taking latency over /v1/realtime: end of speech -> first reply audio byte, and where it goes.

    python benchmarks/voice_latency.py [--model default,smollm2-135m-instruct] [--turns 10] [--sessions 1,2,4]
                                       [--session-turns 4] [--max-tokens 40] [--quick] [--no-wer]
                                       [--no-pipecat] [--no-speculation-peer]

Needs the voice extra (pip install "streamserve[voice]") and the voice models (streamserve models pull whisper-base
piper-joe silero-vad). Questions are synthesised with the Piper voice (piper-joe), resampled to 24 kHz PCM16 and
streamed in 20 ms `input_audio_buffer.append` frames at real-time pace, silence in between (the microphone stays
open while the reply plays), over raw WebSockets (the `websockets` package) to `streamserve serve` started as a
subprocess on a free loopback port, one server per model, turn detection `server_vad` with create_response.

Per turn, from the end of speech (the send time of the 20 ms frame holding the question's last sample above
EOS_LEVEL, -40 dBFS) to the first `response.output_audio.delta`, split into:
  vad_hangover     speech_stopped received - end of speech (contains silence_duration_ms by design)
  transcript_final the turn's item transcribed (conversation.item.input_audio_transcription.completed; the
                   committed event when no transcription event comes) - speech_stopped
  ttft             first reply text (response.output_audio_transcript.delta / output_text.delta) - that
  first_tts_chunk  first response.output_audio.delta - first reply text
p50 and p99 (nearest rank: with few turns p99 is the slowest turn), server_vad at silence_duration_ms 500 (the
default) and 200 and semantic_vad (eagerness auto) side by side, for each model asked (SmolLM2 only when pulled).
stop_lag: speech_stopped received - send time of the frame holding its audio_end_ms, i.e. how far the server's
VAD runs behind the audio it is sent (a server that keeps pace is within a VAD window, 32 ms, plus a frame), and
audio_end_after_eos: speech_stopped's audio_end_ms - the end of the last voiced frame on the session's audio clock
(silence_duration_ms when the VAD ends speech where the audio does); vad_hangover is about their sum.
Concurrency: 1, 2, 4 sessions at once (own connections, starts staggered by STAGGER_S, --session-turns turns
each), first model, silence 500 ms: eos -> first audio p50, the stages' p50 and the stop lag; `kept_up` = every
turn answered and the stop lag p99 under KEPT_UP_LAG_MS. Media real-time factors (compute / audio time), in this
process with the server's threads: Silero over 10 s in 20 ms pieces, Whisper over 2 s and 5 s, Piper one sentence.
Word error rate: benchmarks/stt_wer.py (36 utterances, several voices, speeds and noise; the held-audio path
against Whisper's 30 s window) runs first, its JSON under `wer`.
Speculation: by default the server starts a reply at the first silence when the words look complete, held until
the turn is confirmed (server/media/voice/speculate.py); the same silence-500 turns on a second server started with
--no-speculation (first model) give `no_speculation.speculation_speedup_p50`, the ratio of the medians.
The peer: benchmarks/pipecat_peer.py, the pipeline a user would otherwise assemble with pipecat on this machine
(Silero VAD, faster-whisper base, SmolLM2 served by llama.cpp's OpenAI-compatible server, Piper), fed the same
questions with the same 500 ms silence after streamserve's servers stopped: `pipecat_over_streamserve_p50` is the
ratio of its median end of speech -> first audio to streamserve's (SmolLM2, server_vad 500).
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import voice_side_runs as side_runs  # siblings (benchmarks/ is no package): on sys.path as run
from media_rtf import media_rtf, need
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from streamserve.media.audio import AudioFormat, Resampler, encode
from streamserve.models.store import installed

RATE = 24000  # the Realtime API's PCM16 rate, both directions
FRAME_MS = 20
FRAME_BYTES = RATE * FRAME_MS // 1000 * 2  # 480 samples of int16
EOS_LEVEL = 0.01  # |x| above this (-40 dBFS) counts as voiced when finding where the speech ends
GAP_S = 0.3  # silence sent after a reply finishes, before the next question
STAGGER_S = 0.35  # concurrent sessions start this far apart
KEPT_UP_LAG_MS = 100.0
TURN_TIMEOUT_S = 60.0
QUESTIONS = ("What is the capital of France?", "How many days are in a week?", "Who was the first king of Israel?",
             "What color is the sky on a clear day?", "Tell me something about the sea.",
             "Why do birds sing in the morning?")
INSTRUCTIONS = "You are a helpful voice assistant. Answer in one short sentence."
SILENCE_FRAME = bytes(FRAME_BYTES)


@dataclass(frozen=True)
class Utterance:
    text: str
    pcm: bytes  # PCM16 mono 24 kHz
    eos_frame: int  # index of the 20 ms frame holding the last voiced sample


STAGES = ("vad_hangover", "transcript_final", "ttft", "first_tts_chunk")  # a turn's split, in order


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile, ms rounded to 0.1."""
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))], 1) if xs else None


def spread(xs: list[float]) -> dict[str, float | None]:
    return {"p50": pct(xs, 0.5), "p99": pct(xs, 0.99)}


def synthesize(texts: tuple[str, ...]) -> tuple[list[Utterance], list[np.ndarray]]:
    """Each text spoken by piper-joe -> (24 kHz utterances to stream, the same speech at 16 kHz [n] float32)."""
    from streamserve.media.tts import PiperVoice

    voice = PiperVoice(need("piper-joe"))
    utts, at16k = [], []
    for text in texts:
        audio = voice.synthesize(text)  # [n] float32 at voice.sample_rate (22050 Hz)
        r24, r16 = Resampler(voice.sample_rate, RATE), Resampler(voice.sample_rate, 16000)
        x = np.concatenate([r24.process(audio), r24.flush()])
        at16k.append(np.concatenate([r16.process(audio), r16.flush()]))
        voiced = np.nonzero(np.abs(x) > EOS_LEVEL)[0]
        pcm = encode(x, AudioFormat()) + bytes(-2 * len(x) % FRAME_BYTES)  # padded to whole frames
        utts.append(Utterance(text, pcm, int(voiced[-1]) * 2 // FRAME_BYTES))
    return utts, at16k


def start_server(model: str, *extra: str) -> tuple[subprocess.Popen[str], int, collections.deque[str]]:
    """`streamserve serve` on a free loopback port, ready (model and voice models loaded) -> (process, port, the
    last lines of its log). It announces and logs on stderr; a thread keeps reading it, since a pipe nobody reads
    would fill and stall the server."""
    env = {k: v for k, v in os.environ.items() if k != "STREAMSERVE_API_KEY"}  # the clients send no key
    proc = subprocess.Popen([sys.executable, "-m", "streamserve", "serve", "--port", "0", "--device", "cpu",
                             "--model", model, "--offline", *extra], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=Path(__file__).resolve().parent.parent)
    port, lines = None, collections.deque(maxlen=200)
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        port = int(m.group(1)) if m else port
        if "ready:" in line or "failed" in line:
            break
    if port is None or not any("ready:" in x for x in lines):
        proc.kill()
        raise SystemExit(f"streamserve serve --model {model} did not start: {''.join(lines)[-3000:]}")
    threading.Thread(target=lines.extend, args=(proc.stderr,), daemon=True).start()
    return proc, port, lines


class Stream:
    """One /v1/realtime connection: audio sent at real-time pace on one clock, every server event logged with its
    receipt time."""

    def __init__(self, ws: ClientConnection, session: dict[str, Any]) -> None:
        self.ws, self.session = ws, session
        self.sent: list[float] = []  # send time of frame k (session audio [20k, 20k + 20) ms)
        self.log: list[tuple[float, dict[str, Any]]] = []
        self.t0: float | None = None
        self.client_lag_s = 0.0  # worst lateness of this client's own sends (its pacing, not the server's)
        self.reader = asyncio.create_task(self.receive())

    @classmethod
    async def open(cls, url: str, turn: dict[str, Any], max_tokens: int) -> Stream:
        ws = await connect(f"{url}/v1/realtime", max_size=None)
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created", created
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "instructions": INSTRUCTIONS, "output_modalities": ["audio"],
            "max_output_tokens": max_tokens,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": turn,
                                "transcription": {"model": "whisper-1"}},
                      "output": {"format": {"type": "audio/pcm", "rate": RATE}}}}}))
        while (ev := json.loads(await ws.recv()))["type"] != "session.updated":
            if ev["type"] == "error":
                raise SystemExit(f"session.update refused: {ev['error']}")
        return cls(ws, ev["session"])

    async def receive(self) -> None:
        try:
            async for msg in self.ws:
                t, ev = time.perf_counter(), json.loads(msg)
                if ev["type"] == "response.output_audio.delta":
                    ev["delta"] = len(base64.b64decode(ev["delta"]))  # keep the byte count only
                self.log.append((t, ev))
        except ConnectionClosed as e:  # the turn in progress reports it (no answered turn)
            self.log.append((time.perf_counter(), {"type": "closed", "reason": str(e)}))

    async def send(self, pcm: bytes) -> None:
        for i in range(0, len(pcm), FRAME_BYTES):
            if self.t0 is None:
                self.t0 = time.perf_counter()
            wait = self.t0 + len(self.sent) * FRAME_MS / 1000 - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                self.client_lag_s = max(self.client_lag_s, -wait)
            frame = base64.b64encode(pcm[i:i + FRAME_BYTES]).decode()
            await self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": frame}))
            self.sent.append(time.perf_counter())

    def turn_over(self, since: int, t_eos: float) -> bool:
        """The turn is answered: speech has stopped after the question ended, and a response created after that
        stop is done."""
        active, t_stop, created = False, None, set()
        for t, ev in self.log[since:]:
            kind = ev["type"]
            if kind == "input_audio_buffer.speech_started":
                active = True
            elif kind == "input_audio_buffer.speech_stopped":
                active, t_stop, created = False, t, set()
            elif kind == "response.created" and t_stop is not None:
                created.add(ev["response"]["id"])
            elif kind == "response.done" and ev["response"]["id"] in created:
                return not active and t_stop is not None and t_stop >= t_eos
        return False

    async def turn(self, utt: Utterance) -> dict[str, Any]:
        since, first = len(self.log), len(self.sent)
        try:
            await self.send(utt.pcm)
            t_eos = self.sent[first + utt.eos_frame]
            deadline = time.perf_counter() + TURN_TIMEOUT_S
            while not self.turn_over(since, t_eos):
                if time.perf_counter() > deadline or self.reader.done():
                    return {"error": "no answered turn",
                            "events": sorted({ev["type"] for _, ev in self.log[since:]})}
                await self.send(SILENCE_FRAME)
            await self.send(SILENCE_FRAME * int(GAP_S * 1000 / FRAME_MS))
        except ConnectionClosed as e:  # e.g. the keepalive ping unanswered for 20 s: the server stalled
            return {"error": f"connection closed: {e}"}
        return analyse(self.log[since:], t_eos, (first + utt.eos_frame + 1) * FRAME_MS, self.sent)

    async def close(self) -> None:
        await self.ws.close()
        await self.reader


def analyse(events: list[tuple[float, dict[str, Any]]], t_eos: float, eos_ms: int, sent: list[float]) -> dict[str, Any]:
    """One answered turn's events -> its latency split (ms) and texts. `eos_ms`: the end of the last voiced frame on
    the session's audio clock (ms of audio sent)."""
    t_stop, stop = [(t, ev) for t, ev in events if ev["type"] == "input_audio_buffer.speech_stopped"][-1]
    item = stop["item_id"]
    final = [(t, "transcription.completed", ev) for t, ev in events if t >= t_stop and ev["type"] ==
             "conversation.item.input_audio_transcription.completed" and ev["item_id"] == item]
    final += [(t, "committed", ev) for t, ev in events
              if t >= t_stop and ev["type"] == "input_audio_buffer.committed" and ev["item_id"] == item]
    rid = next(ev["response"]["id"] for t, ev in events if t >= t_stop and ev["type"] == "response.created")
    ours = [(t, ev) for t, ev in events if ev.get("response_id") == rid]
    texts = [(t, ev["delta"]) for t, ev in ours
             if ev["type"] in ("response.output_audio_transcript.delta", "response.output_text.delta")]
    audio = [t for t, ev in ours if ev["type"] == "response.output_audio.delta"]
    frame = min(len(sent) - 1, max(0, math.ceil(stop["audio_end_ms"] / FRAME_MS) - 1))
    stops = sum(ev["type"] == "input_audio_buffer.speech_stopped" for _, ev in events)
    out: dict[str, Any] = {"early_stops": stops - 1, "vad_hangover": (t_stop - t_eos) * 1e3,
                           "audio_end_after_eos": stop["audio_end_ms"] - eos_ms,  # ~silence_duration_ms if exact
                           "stop_lag": (t_stop - sent[frame]) * 1e3, "reply": "".join(d for _, d in texts)}
    t_final = None
    if final:
        t_final, out["final_event"], ev = min(final, key=lambda f: (f[1] == "committed", f[0]))
        out["transcript"] = ev.get("transcript")
        out["transcript_final"] = (t_final - t_stop) * 1e3
    if texts and t_final is not None:
        out["ttft"] = (texts[0][0] - t_final) * 1e3
    if texts and audio:
        out["first_tts_chunk"] = (audio[0] - texts[0][0]) * 1e3
    if audio:
        out["eos_to_first_audio"] = (audio[0] - t_eos) * 1e3
    errors = [ev["error"].get("message") for _, ev in events if ev["type"] == "error"]
    if errors:
        out["errors"] = errors[:3]
    return out


def summarise(turns: list[dict[str, Any]], stream: Stream | None = None) -> dict[str, Any]:
    done = [t for t in turns if "error" not in t]
    out: dict[str, Any] = {"turns_answered": f"{len(done)}/{len(turns)}"}
    for key in ("eos_to_first_audio", *STAGES, "stop_lag", "audio_end_after_eos"):
        out[f"{key}_ms"] = spread([t[key] for t in done if key in t])
    out["final_event"] = sorted({t["final_event"] for t in done if "final_event" in t})
    out["early_stops"] = sum(t["early_stops"] for t in done)
    if stream is not None:
        td = stream.session.get("audio", {}).get("input", {}).get("turn_detection") or {}
        out["silence_duration_ms"] = td.get("silence_duration_ms")  # as the server echoed it in session.updated
        out["client_send_lag_max_ms"] = round(stream.client_lag_s * 1e3, 1)
    if done:
        out["sample"] = {"transcript": done[0].get("transcript"), "reply": done[0]["reply"][:160]}
    out["problems"] = [t for t in turns if "error" in t or "errors" in t][:3]
    return out


def server_vad(silence_ms: int) -> dict[str, Any]:
    return {"type": "server_vad", "silence_duration_ms": silence_ms, "prefix_padding_ms": 300, "threshold": 0.5,
            "create_response": True}


# the turn detection of each condition: server_vad at 500 ms (the API's default) and 200 ms, and semantic_vad
CONDITIONS = {"silence_500": server_vad(500), "silence_200": server_vad(200),
              "semantic_auto": {"type": "semantic_vad", "eagerness": "auto", "create_response": True}}


async def conversation(url: str, utts: list[Utterance], n: int, turn: dict[str, Any], max_tokens: int
                       ) -> dict[str, Any]:
    stream = await Stream.open(url, turn, max_tokens)
    turns = [await stream.turn(utts[i % len(utts)]) for i in range(n)]
    await stream.close()
    return summarise(turns, stream)


async def concurrent(url: str, utts: list[Utterance], sessions: int, n: int, max_tokens: int) -> dict[str, Any]:
    async def one(k: int) -> tuple[list[dict[str, Any]], float]:
        await asyncio.sleep(k * STAGGER_S)
        stream = await Stream.open(url, server_vad(500), max_tokens)
        turns = [await stream.turn(utts[(k + i) % len(utts)]) for i in range(n)]
        await stream.close()
        return turns, stream.client_lag_s

    results = await asyncio.gather(*(one(k) for k in range(sessions)))
    turns = [t for ts, _ in results for t in ts]
    s = summarise(turns)
    lags = [t["stop_lag"] for t in turns if "stop_lag" in t]
    kept_up = all("error" not in t for t in turns) and bool(lags) and (pct(lags, 0.99) or 0) < KEPT_UP_LAG_MS
    return {"sessions": sessions, "turns_answered": s["turns_answered"],
            "eos_to_first_audio_p50_ms": s["eos_to_first_audio_ms"]["p50"], "stop_lag_ms": s["stop_lag_ms"],
            "stages_p50_ms": {k: s[f"{k}_ms"]["p50"] for k in STAGES},
            "stop_lag_max_ms": round(max(lags), 1) if lags else None, "kept_up": kept_up,
            "client_send_lag_max_ms": round(max(lag for _, lag in results) * 1e3, 1), "problems": s["problems"]}


async def bench_model(url: str, utts: list[Utterance], args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, turn in CONDITIONS.items():
        out[name] = await conversation(url, utts, args.turns, turn, args.max_tokens)
        print(f"{name}: {json.dumps(out[name])}", file=sys.stderr)
    if levels:
        out["concurrency"] = []
        for n in levels:
            out["concurrency"].append(await concurrent(url, utts, n, args.session_turns, args.max_tokens))
            print(f"{n} sessions: {json.dumps(out['concurrency'][-1])}", file=sys.stderr)
        held = [c["sessions"] for c in out["concurrency"] if c["kept_up"]]
        out["sessions_at_real_time"] = max(held) if held else 0
    out["speculations"] = side_runs.speculations(url)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="comma-separated models (default: default,smollm2-135m-instruct; "
                                                  "SmolLM2 when pulled; --quick: default)")
    ap.add_argument("--turns", type=int, default=None, help="turns per condition (default 10; --quick 1)")
    ap.add_argument("--sessions", default=None, help="concurrent sessions to try (default 1,2,4; --quick 2)")
    ap.add_argument("--session-turns", type=int, default=None, help="turns per concurrent session (4; --quick 1)")
    ap.add_argument("--max-tokens", type=int, default=None, help="max_output_tokens per reply (default 40)")
    ap.add_argument("--quick", action="store_true", help="the default model, 1 turn, 2 sessions at once (CI smoke run)")
    ap.add_argument("--no-wer", action="store_true", help="skip the word error rates of benchmarks/stt_wer.py "
                                                         "(default: run it first and include its JSON; --quick skips)")
    ap.add_argument("--no-pipecat", action="store_true",
                    help="skip the pipecat pipeline of benchmarks/pipecat_peer.py (default: the same questions, the "
                         "same 500 ms silence, after the servers stop; needs `make llamacpp-venv`; --quick skips)")
    ap.add_argument("--no-speculation-peer", action="store_true",
                    help="skip the same turns on a second server started with --no-speculation (default: run them "
                         "for the first model, silence 500 ms, and report the ratio of medians; --quick skips them)")
    args = ap.parse_args()
    args.turns = args.turns or (1 if args.quick else 10)
    args.session_turns = args.session_turns or (1 if args.quick else 4)
    args.max_tokens = args.max_tokens or (24 if args.quick else 40)
    models = (args.model or ("default" if args.quick else "default,smollm2-135m-instruct")).split(",")
    levels = [int(x) for x in (args.sessions or ("2" if args.quick else "1,2,4")).split(",")]
    utts, at16k = synthesize(QUESTIONS)
    result: dict[str, Any] = {"benchmark": "voice_latency", "cpu_count": os.cpu_count(),
                              "load_avg_1m_at_start": round(os.getloadavg()[0], 2), "frame_ms": FRAME_MS,
                              "turns": args.turns, "session_turns": args.session_turns,
                              "max_output_tokens": args.max_tokens, "eos_level": EOS_LEVEL,
                              "media_rtf": media_rtf(at16k, QUESTIONS[0], 1 if args.quick else 3), "models": {}}
    if not (args.quick or args.no_wer):  # the speech-to-text path's accuracy, on this machine, before any server
        result["wer"] = side_runs.wer()
    for i, model in enumerate(models):
        if model != "default" and installed(model) is None:
            result["models"][model] = {"skipped": f"not pulled: streamserve models pull {model}"}
            continue
        proc, port, log = start_server(model)
        try:
            result["models"][model] = asyncio.run(bench_model(f"ws://127.0.0.1:{port}", utts, args,
                                                              levels if i == 0 else []))
        except BaseException:
            print("".join(log)[-3000:], file=sys.stderr)  # the server's side of what went wrong
            raise
        finally:
            proc.terminate()
            proc.wait(30)
    if not (args.quick or args.no_speculation_peer):  # the same turns with replies started only once confirmed
        ours = result["models"][models[0]].get("silence_500", {}).get("eos_to_first_audio_ms", {}).get("p50")
        result["no_speculation"] = side_runs.no_speculation(models[0], ours, start_server, lambda url: asyncio.run(
            conversation(url, utts, args.turns, CONDITIONS["silence_500"], args.max_tokens)))
    if not (args.quick or args.no_pipecat):  # the peer a user would assemble, with streamserve's server stopped
        result["pipecat"] = side_runs.pipecat(args.turns, args.max_tokens)
        ours = result["models"].get("smollm2-135m-instruct", {}).get("silence_500", {})
        theirs = result["pipecat"].get("eos_to_first_audio_ms", {}).get("p50")
        mine = ours.get("eos_to_first_audio_ms", {}).get("p50")
        result["pipecat_over_streamserve_p50"] = round(theirs / mine, 3) if theirs and mine else None
    result["concurrency_model"], result["concurrency_silence_ms"] = models[0], 500
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)  # other work on this machine skews every figure
    print(json.dumps(result))


if __name__ == "__main__":
    main()
