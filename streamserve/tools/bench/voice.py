"""Voice sessions on `WS /v1/realtime` (OpenAI Realtime GA events over the `websockets` package), paced in real time.

Questions are synthesised once, before the clock starts, by the Piper voice (piper-joe, the voice extra), resampled
to 24 kHz PCM16 and streamed in 20 ms `input_audio_buffer.append` frames on each session's own clock, silence in
between (the microphone stays open while the reply plays). Turn detection is the server's VAD (`server_vad`, 500 ms
of silence, create_response). A turn: the question, then silence until the reply created after speech stopped is
done, then 0.3 s more; the next question follows until the duration ends.

Measures (ms), from the end of speech (the send time of the frame holding the question's last voiced sample):
`turn_ms` to the first `response.output_audio.delta` (the turn latency), `speech_stopped_ms` to the server's
`speech_stopped` (its VAD hangover, the silence duration included), `reply_done_ms` to `response.done`.
`stop_lag_ms`: `speech_stopped` received - the send time of the frame holding its `audio_end_ms`, i.e. how far the
server's listening runs behind the audio it is sent. Missed deadlines: a turn answered later than --voice-turn-ms
(end of speech -> first audio), and a stop lag over STOP_LAG_BUDGET_MS (the server fell behind the audio). A turn
asked is waited for past the duration: no reply within --turn-timeout is an error (`no_reply`); a question still
being spoken when the duration ends is counted as `turns_cut` and is no error. `client_late_frames`: frames this
process sent more than a frame period after their slot (the load generator itself fell behind, not the server).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from streamserve.errors import StreamserveError
from streamserve.tools.bench.config import PROBE_TIMEOUT_S, BenchConfig
from streamserve.tools.bench.record import SessionRecord, code_of, wind_down

RATE = 24000  # the Realtime API's PCM16 rate
FRAME_S = 0.02
FRAME_BYTES = int(RATE * FRAME_S) * 2  # 480 int16 samples
SILENCE = base64.b64encode(bytes(FRAME_BYTES)).decode()
EOS_LEVEL = 0.01  # |x| above this (-40 dBFS) is voiced, for finding where the speech ends
GAP_FRAMES = 15  # 0.3 s of silence after a reply, before the next question
SILENCE_MS = 500
STOP_LAG_BUDGET_MS = 100.0  # a VAD window (32 ms) and a few frames: a server that keeps pace is within it
KEPT_SEND_TIMES = 3000  # frames whose send times are kept (60 s): speech_stopped refers to recent audio
QUESTIONS = ("What is the capital of France?", "How many days are in a week?", "Tell me something about the sea.")


@dataclass(frozen=True)
class Utterance:
    frames: list[str]  # base64 PCM16 24 kHz mono, 20 ms each
    eos_frame: int  # the frame holding the last voiced sample


def synthesize() -> list[Utterance] | str:
    """The questions spoken by piper-joe, or why voice sessions cannot run here (what to install)."""
    from streamserve.media import VOICE_EXTRA
    from streamserve.models.store import installed

    path = installed("piper-joe")
    if path is None:
        return "the Piper voice is not in the model cache: streamserve models pull piper-joe"
    try:
        from streamserve.media.audio import AudioFormat, Resampler, encode
        from streamserve.media.tts import PiperVoice

        voice = PiperVoice(path, variation=False)
        out = []
        for text in QUESTIONS:
            audio = voice.synthesize(text)  # [n] float32 at voice.sample_rate (22050 Hz)
            r = Resampler(voice.sample_rate, RATE)
            x = np.concatenate([r.process(audio), r.flush()])  # [m] float32 at 24 kHz
            pcm = encode(x, AudioFormat()) + bytes(-2 * len(x) % FRAME_BYTES)  # padded to whole frames
            frames = [base64.b64encode(pcm[i:i + FRAME_BYTES]).decode() for i in range(0, len(pcm), FRAME_BYTES)]
            voiced = np.nonzero(np.abs(x) > EOS_LEVEL)[0]
            out.append(Utterance(frames, int(voiced[-1]) * 2 // FRAME_BYTES if len(voiced) else len(frames) - 1))
        return out
    except (StreamserveError, ImportError, OSError) as e:
        return f"speech synthesis is unavailable ({e}); it needs the voice extra: {VOICE_EXTRA}"


async def open_stream(url: str, key: str | None, max_tokens: int) -> tuple[ClientConnection, dict[str, Any] | None]:
    """A /v1/realtime connection with audio in and out and server VAD -> (socket, None), or (socket, the error
    event) when the server refuses the settings (a server without voice says unsupported_modality)."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    ws = await connect(f"{url.rstrip('/')}/v1/realtime", additional_headers=headers, max_size=None, compression=None)
    created = json.loads(await ws.recv())
    if created.get("type") != "session.created":
        return ws, created
    turn = {"type": "server_vad", "silence_duration_ms": SILENCE_MS, "prefix_padding_ms": 300, "threshold": 0.5,
            "create_response": True}
    await ws.send(json.dumps({"type": "session.update", "session": {
        "type": "realtime", "instructions": "Answer in one short sentence.", "output_modalities": ["audio"],
        "max_output_tokens": max_tokens,
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": turn},
                  "output": {"format": {"type": "audio/pcm", "rate": RATE}}}}}))
    while (ev := json.loads(await ws.recv()))["type"] != "session.updated":
        if ev["type"] == "error":
            return ws, ev
    return ws, None


async def probe(url: str, key: str | None, max_tokens: int) -> str | None:
    """None when the server takes voice sessions; else why they are skipped (the server's error)."""
    ws, refused = await asyncio.wait_for(open_stream(url, key, max_tokens), PROBE_TIMEOUT_S)
    await ws.close()
    if refused is not None:
        err = refused.get("error") or {}
        return f"{err.get('code', refused.get('type'))}: {err.get('message', '')}"
    return None


@dataclass
class Turn:
    eos_at: float = float("inf")  # send time of the end-of-speech frame (inf until it is sent)
    stopped_at: float | None = None  # speech_stopped received after the end of speech
    responses: set[str] = field(default_factory=set)  # responses created after that stop
    first_audio_at: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Stream:
    """One voice session: the reader follows the current turn's events as they arrive."""

    def __init__(self, ws: ClientConnection, rec: SessionRecord, turn_budget_s: float) -> None:
        self.ws, self.rec, self.turn_budget_s = ws, rec, turn_budget_s
        self.turn = Turn()
        self.sent = 0  # frames sent: the session's audio clock
        self.sent_at: collections.deque[float] = collections.deque(maxlen=KEPT_SEND_TIMES)  # send times, latest last
        self.t0 = 0.0
        self.reader = asyncio.create_task(self.read())

    async def read(self) -> None:
        async for msg in self.ws:
            t, ev = time.monotonic(), json.loads(msg)
            kind, turn = ev.get("type"), self.turn
            if kind == "error":
                self.rec.error(str((ev.get("error") or {}).get("code") or "error"))
            elif kind == "input_audio_buffer.speech_stopped":
                self.stop_lag(t, ev.get("audio_end_ms"))
                if t >= turn.eos_at:
                    turn.stopped_at, turn.responses = t, set()
                    self.rec.latency("speech_stopped_ms", t - turn.eos_at)
            elif kind == "response.created" and turn.stopped_at is not None:
                turn.responses.add(ev["response"]["id"])
            elif (kind == "response.output_audio.delta" and ev.get("response_id") in turn.responses
                  and turn.first_audio_at is None):
                turn.first_audio_at = t
                self.rec.latency("turn_ms", t - turn.eos_at)
                self.rec.missed += t - turn.eos_at > self.turn_budget_s
            elif kind == "response.done" and ev["response"]["id"] in turn.responses:
                self.rec.latency("reply_done_ms", t - turn.eos_at)
                self.rec.counts["replies_with_audio" if turn.first_audio_at else "replies_without_audio"] += 1
                turn.done.set()

    def stop_lag(self, t: float, audio_end_ms: Any) -> None:
        """speech_stopped received at `t` for audio up to `audio_end_ms` (the session's audio clock)."""
        if isinstance(audio_end_ms, bool) or not isinstance(audio_end_ms, (int, float)):
            return
        frame = max(0, math.ceil(audio_end_ms / 1e3 / FRAME_S) - 1)
        back = self.sent - frame  # 1 for the latest frame sent
        if 1 <= back <= len(self.sent_at):
            lag = t - self.sent_at[-back]
            self.rec.latency("stop_lag_ms", lag)
            self.rec.missed += lag * 1e3 > STOP_LAG_BUDGET_MS

    async def send(self, frame: str) -> None:
        """The next 20 ms frame at its slot on this session's clock."""
        slot = self.t0 + self.sent * FRAME_S
        wait = slot - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        elif -wait > FRAME_S:
            self.rec.counts["client_late_frames"] += 1
        await self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": frame}))
        self.sent_at.append(time.monotonic())
        self.sent += 1
        self.rec.counts["frames"] += 1


async def voice_session(cfg: BenchConfig, key: str | None, utts: list[Utterance], rec: SessionRecord,
                        start: float) -> None:
    """One voice session from monotonic time `start` for cfg.duration seconds; its figures go to `rec`."""
    ws: ClientConnection | None = None
    stream: Stream | None = None
    try:
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        ws, refused = await asyncio.wait_for(open_stream(cfg.url, key, cfg.voice_reply_tokens), cfg.turn_timeout)
        if refused is not None:
            rec.error(str((refused.get("error") or {}).get("code") or refused.get("type")))
            return
        stream = Stream(ws, rec, cfg.voice_turn_ms / 1e3)
        rec.started = True
        stream.t0 = end = time.monotonic()
        end += cfg.duration
        k = 0
        while time.monotonic() < end:
            utt, stream.turn = utts[(rec.index + k) % len(utts)], Turn()
            k += 1
            for i, frame in enumerate(utt.frames):
                await stream.send(frame)
                if i == utt.eos_frame:
                    stream.turn.eos_at = time.monotonic()
                if time.monotonic() >= end:
                    break
            if stream.turn.eos_at == float("inf"):  # the duration ended before the question did
                rec.counts["turns_cut"] += 1
                break
            rec.counts["turns"] += 1
            give_up = stream.turn.eos_at + cfg.turn_timeout  # past the duration too: a turn asked is answered
            while not stream.turn.done.is_set() and time.monotonic() < give_up:
                if stream.reader.done():  # the connection closed
                    raise stream.reader.exception() or ConnectionError("the server closed the connection")
                await stream.send(SILENCE)
            if not stream.turn.done.is_set():
                rec.error("no_reply")
                continue
            rec.counts["turns_answered"] += 1
            if time.monotonic() >= end:
                break
            for _ in range(GAP_FRAMES):
                await stream.send(SILENCE)
        rec.completed = True
    except (ConnectionClosed, asyncio.TimeoutError, OSError) as e:
        rec.error(code_of(e))
    finally:
        if ws is not None:
            await wind_down(stream.reader if stream is not None else None, ws.close)
