"""WebRTC call latency and capacity: end of speech -> first reply audio at the client, over /v1/realtime/calls (aiortc
client) against the same turn over /v1/realtime (WebSocket) in the same run, CPU per call, and how many calls at
once this CPU holds with audio keeping real time.

    python benchmarks/webrtc_latency.py [--turns 4] [--calls 1,2,4] [--max-tokens 16] [--quick]

Needs the voice extra, the voice models (streamserve models pull whisper-base piper-joe silero-vad) and aiortc (the
webrtc extra). The server is `streamserve serve` (the default model) in a subprocess on a loopback port, with ICE host
candidates pinned to 127.0.0.1 (aioice's discovery patched before it starts, no ICE servers: nothing but loopback is
ever contacted); the clients run in this process, pinned the same way.

Per turn the question is synthesised by the Piper voice and played into the microphone at real-time pace, silence
before and after. End of speech: when the 20 ms frame holding the question's last sample above -40 dBFS is sent (the
call's microphone track hands it to aiortc; the WebSocket's append is sent). First audio: the first frame of the
reply track decoded at the client above -40 dBFS (WebRTC: Opus, the client's jitter buffer included), or the first
response.output_audio.delta (WebSocket). p50 / p99 (nearest rank) over the turns.
CPU per call: the server process's CPU seconds (/proc) per second of one call, idle (connected, microphone sending
silence) and over its turns. Capacity: N calls at once, each speaking one question; kept up when every call's
speech_stopped arrived within KEPT_UP_STOP_MS of its end of speech and every reply track delivered at least
KEPT_UP_RATE of its 50 frames a second. The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import fractions
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import aioice.ice
import av
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from websockets.asyncio.client import connect

from streamserve.media.audio import Resampler

RATE = 48000
FRAME = RATE // 50
LEVEL = 0.01  # -40 dBFS
QUESTION = "Which city is the capital of France?"
KEPT_UP_STOP_MS = 1500.0  # speech_stopped within this of the end of speech (silence_duration_ms 500 included)
KEPT_UP_RATE = 0.95
LOOPBACK = "import aioice.ice as i; i.get_host_addresses = lambda use_ipv4, use_ipv6: ['127.0.0.1']; "


def pin_loopback() -> None:
    aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: ["127.0.0.1"]  # type: ignore[assignment]


def speech(text: str, rate: int) -> np.ndarray:
    from streamserve.media.tts import PiperVoice
    from streamserve.models.store import installed

    path = installed("piper-joe")
    if path is None:
        raise SystemExit("the piper-joe voice is not pulled: streamserve models pull piper-joe")
    voice = PiperVoice(path)
    r = Resampler(voice.sample_rate, rate)
    x = voice.synthesize(text)
    return np.concatenate([r.process(x), r.flush()]).astype(np.float32)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, max(0, int(np.ceil(q / 100 * len(s))) - 1))], 1)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server() -> tuple[subprocess.Popen[str], int]:
    code = LOOPBACK + "import runpy, sys; sys.argv = ['streamserve', 'serve', '--port', '0', '--device', 'cpu', " \
        "'--offline']; runpy.run_module('streamserve', run_name='__main__')"
    env = {k: v for k, v in os.environ.items() if k != "STREAMSERVE_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1"}, cwd=Path(__file__).resolve().parent.parent)
    port, lines = None, collections.deque(maxlen=200)
    assert proc.stderr is not None
    for line in proc.stderr:  # it announces and logs on stderr
        lines.append(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        port = int(m.group(1)) if m else port
        if "ready:" in line or "failed" in line:
            break
    if port is None or not any("ready:" in x for x in lines):
        proc.kill()
        raise SystemExit(f"the server did not start: {''.join(lines)[-3000:]}")
    threading.Thread(target=lines.extend, args=(proc.stderr,), daemon=True).start()  # a full pipe would stall it
    return proc, port


class Mic(MediaStreamTrack):
    """Plays queued float32 48 kHz audio in paced 20 ms frames (silence otherwise); notes when the last voiced frame
    of what was queued goes out."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.queue = np.zeros(0, np.float32)
        self.voiced_left = 0  # samples until the last voiced sample queued has gone
        self.eos: float | None = None
        self.pts, self.t0 = 0, None

    def say(self, x: np.ndarray) -> None:
        loud = np.flatnonzero(np.abs(x) > LEVEL)
        self.voiced_left = len(self.queue) + (int(loud[-1]) + 1 if len(loud) else 0)
        self.queue, self.eos = np.concatenate([self.queue, x]), None

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        self.t0 = self.t0 if self.t0 is not None else now
        if (wait := self.t0 + self.pts / RATE - now) > 0:
            await asyncio.sleep(wait)
        chunk, self.queue = self.queue[:FRAME], self.queue[FRAME:]
        if self.voiced_left > 0:
            self.voiced_left -= FRAME
            if self.voiced_left <= 0:
                self.eos = time.monotonic()
        pcm = np.zeros(FRAME, np.int16)
        pcm[:len(chunk)] = (np.clip(chunk, -1, 1) * 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, self.pts, fractions.Fraction(1, RATE)
        self.pts += FRAME
        return frame


class Call:
    def __init__(self) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = Mic()
        self.pc.addTrack(self.mic)
        self.dc = self.pc.createDataChannel("oai-events")
        self.events: asyncio.Queue[tuple[float, dict[str, Any]]] = asyncio.Queue()
        self.dc.on("message", lambda m: self.events.put_nowait((time.monotonic(), json.loads(m))))
        self.frames: list[tuple[float, float]] = []  # (arrival, rms) of every reply-track frame
        self.tasks: list[asyncio.Task] = []
        self.pc.on("track", lambda t: self.tasks.append(asyncio.ensure_future(self.listen(t))))

    async def listen(self, track: MediaStreamTrack) -> None:
        try:
            while True:
                f = await track.recv()
                x = f.to_ndarray().astype(np.float32) / 32768
                self.frames.append((time.monotonic(), float(np.sqrt(np.mean(x ** 2)))))
        except MediaStreamError:
            pass

    async def connect(self, http: str, max_tokens: int) -> None:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        form = aiohttp.FormData()
        form.add_field("sdp", self.pc.localDescription.sdp, content_type="application/sdp")
        form.add_field("session", json.dumps({"type": "realtime", "max_output_tokens": max_tokens}))
        async with aiohttp.ClientSession() as s, s.post(f"{http}/v1/realtime/calls", data=form) as r:
            assert r.status == 201, await r.text()
            answer = await r.text()
        await self.pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
        await self.until("session.created")

    async def until(self, kind: str, timeout: float = 120.0) -> tuple[float, dict[str, Any]]:
        while True:
            t, m = await asyncio.wait_for(self.events.get(), timeout)
            if m["type"] == "error":
                raise RuntimeError(m["error"])
            if m["type"] == kind:
                return t, m

    async def turn(self, question: np.ndarray) -> tuple[float, float]:
        """-> (end of speech -> first loud reply frame, speech_stopped - end of speech), ms."""
        self.mic.say(question)
        stopped, _ = await self.until("input_audio_buffer.speech_stopped")
        await self.until("output_audio_buffer.stopped")
        eos = self.mic.eos
        assert eos is not None
        first = next(t for t, rms in self.frames if t > eos and rms > LEVEL)
        return 1e3 * (first - eos), 1e3 * (stopped - eos)

    async def close(self) -> None:
        await self.pc.close()
        for t in self.tasks:
            t.cancel()


async def ws_turn(url: str, question: np.ndarray, max_tokens: int) -> float:
    """The same turn over /v1/realtime: 24 kHz PCM16 appends at real-time pace -> ms to the first audio delta."""
    x24 = Resampler(RATE, 24000)
    pcm = (np.clip(np.concatenate([x24.process(question), x24.flush()]), -1, 1) * 32767).astype("<i2")
    loud = np.flatnonzero(np.abs(pcm) > LEVEL * 32767)
    last_voiced = int(loud[-1]) if len(loud) else 0
    step = 480  # 20 ms at 24 kHz
    async with connect(url.replace("http", "ws", 1) + "/v1/realtime", max_size=None) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                        "max_output_tokens": max_tokens}}))
        eos: float | None = None
        first: float | None = None

        async def reader() -> None:
            nonlocal first
            async for raw in ws:
                m = json.loads(raw)
                if m["type"] == "response.output_audio.delta" and first is None:
                    first = time.monotonic()
                if m["type"] == "response.done":
                    return

        task = asyncio.create_task(reader())
        t0 = time.monotonic()
        for i in range(0, len(pcm), step):
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(pcm[i:i + step].tobytes()).decode()}))
            if eos is None and i + step > last_voiced:
                eos = time.monotonic()
            await asyncio.sleep(max(0.0, t0 + (i + step) / 24000 - time.monotonic()))
        await asyncio.wait_for(task, 120)
        assert eos is not None and first is not None
        return 1e3 * (first - eos)


async def capacity(http: str, n: int, question: np.ndarray, max_tokens: int) -> dict[str, Any]:
    calls = [Call() for _ in range(n)]
    await asyncio.gather(*(c.connect(http, max_tokens) for c in calls))
    t0 = time.monotonic()
    results = await asyncio.gather(*(c.turn(question) for c in calls), return_exceptions=True)
    t1 = time.monotonic()
    rates = [sum(1 for t, _ in c.frames if t0 <= t <= t1) / max(t1 - t0, 1e-9) / 50 for c in calls]
    await asyncio.gather(*(c.close() for c in calls))
    ok = [r for r in results if not isinstance(r, BaseException)]
    stops = [r[1] for r in ok]
    kept = len(ok) == n and max(stops) < KEPT_UP_STOP_MS and min(rates) >= KEPT_UP_RATE
    return {"calls": n, "kept_up": kept, "answered": len(ok),
            "stop_lag_ms_max": round(max(stops), 1) if stops else None,
            "first_audio_ms_p50": pct([r[0] for r in ok], 50), "reply_track_rate_min": round(min(rates), 3)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    pin_loopback()
    proc, port = start_server()
    http = f"http://127.0.0.1:{port}"
    lead, tail = np.zeros(int(0.3 * RATE), np.float32), np.zeros(int(1.5 * RATE), np.float32)
    question = np.concatenate([lead, speech(QUESTION, RATE), tail])
    out: dict[str, Any] = {"benchmark": "webrtc_latency", "turns": args.turns, "max_tokens": args.max_tokens}
    try:
        call = Call()
        await call.connect(http, args.max_tokens)
        c0, w0 = cpu_seconds(proc.pid), time.monotonic()
        await asyncio.sleep(args.idle_s)
        out["cpu_per_call_idle"] = round((cpu_seconds(proc.pid) - c0) / (time.monotonic() - w0), 3)
        rtc, ws, stops = [], [], []
        c0, w0 = cpu_seconds(proc.pid), time.monotonic()
        for _ in range(args.turns):
            first, stop = await call.turn(question)
            rtc.append(first)
            stops.append(stop)
        out["cpu_per_call_turns"] = round((cpu_seconds(proc.pid) - c0) / (time.monotonic() - w0), 3)
        await call.close()
        for _ in range(args.turns):
            ws.append(await ws_turn(http, question, args.max_tokens))
        out["webrtc_first_audio_ms"] = {"p50": pct(rtc, 50), "p99": pct(rtc, 99)}
        out["websocket_first_audio_ms"] = {"p50": pct(ws, 50), "p99": pct(ws, 99)}
        out["webrtc_speech_stopped_after_eos_ms"] = {"p50": pct(stops, 50), "p99": pct(stops, 99)}
        levels = []
        for n in args.calls:
            level = await capacity(http, n, question, args.max_tokens)
            levels.append(level)
            print(json.dumps(level), file=sys.stderr)
            if not level["kept_up"]:
                break
        out["capacity"] = levels
        held = [lv["calls"] for lv in levels if lv["kept_up"]]
        out["calls_kept_up_max"] = max(held) if held else 0
        out["cores"] = os.cpu_count()
    finally:
        proc.terminate()
        proc.wait(30)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--calls", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--quick", action="store_true", help="1 turn, 2 calls at once, 2 s idle (a smoke run)")
    a = p.parse_args()
    if a.quick:
        a.turns, a.calls, a.idle_s = 1, [2], 2.0
    print(json.dumps(asyncio.run(main(a))))
