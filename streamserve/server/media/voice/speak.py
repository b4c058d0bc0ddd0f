"""The Speaker: one reply's streamed text -> audio in the client's format, sentence by sentence (protocol-neutral).

    feed(delta) -> SentenceSplitter -> pieces --synthesis task (runtime.tts: earliest deadline first)--> [<= 2 pieces]
                                             --emission task--> emit(<= 100 ms of bytes), in order

Two tasks make a pipeline: while piece n is being emitted (the transport paces it: a slow client slows only its
own reply), piece n+1 is synthesised, so the next sentence is ready when the last one's audio has gone out.
The first audio leaves after the splitter's first piece (an early clause), long before the reply is finished.
`cancel()` (barge-in) stops both at once: queued text and audio are dropped and nothing is emitted after it returns.
`heard_text(ms)` maps audio played back to the text spoken in it, for truncating a reply to what was heard.
Audio synthesised and not yet emitted counts on the connection's media account (server/media/media_budget.py) until it
is emitted or dropped. It is taken, never refused: the reply was admitted and its text is generated already, and it is
bounded by the AHEAD pieces; the input media of the connection (and of the server) is refused earlier instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamserve.server.media import media_budget

if TYPE_CHECKING:
    from streamserve.media.audio import AudioFormat, AudioOutput
    from streamserve.server.media.media_budget import MediaAccount
    from streamserve.server.media.voice.runtime import VoiceRuntime

log = logging.getLogger("streamserve.voice")

CHUNK_MS = 100  # the most audio in one emitted chunk
AHEAD = 2  # synthesised pieces waiting for emission at most (memory bound; synthesis stays one piece ahead)
_END = None


@dataclass
class _Spoken:
    text: str
    start_ms: float  # on the reply's audio clock
    end_ms: float


class Speaker:
    def __init__(self, runtime: VoiceRuntime, fmt: AudioFormat, emit: Callable[[bytes], Awaitable[None]],
                 account: MediaAccount | None = None) -> None:
        from streamserve.media.audio import AudioOutput
        from streamserve.media.tts import SentenceSplitter

        self.runtime, self.emit = runtime, emit
        self.fmt = fmt.check()
        self.audio_ms = 0.0  # audio emitted so far
        self._splitter = SentenceSplitter()
        self._output: AudioOutput = AudioOutput(runtime.voice.sample_rate, self.fmt)
        self._chunk_bytes = max(self.fmt.bytes_per_frame, self.fmt.bytes_per_frame * (self.fmt.rate * CHUNK_MS // 1000))
        self._text: asyncio.Queue[str | None] = asyncio.Queue()  # pieces to synthesise (text: bounded by the reply)
        self._audio: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue(AHEAD)
        self._spoken: list[_Spoken] = []
        self._finished = False
        self._cancelled = False
        self._in_flight: asyncio.Future[bytes] | None = None  # the synthesis running on the executor
        self._held = media_budget.Holding(account or media_budget.current(), "reply audio")  # synthesised, not emitted
        self._synth = asyncio.create_task(self._synthesise(), name="streamserve-speaker-synth")
        self._play = asyncio.create_task(self._emit_all(), name="streamserve-speaker-emit")

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def done(self) -> bool:
        """All audio emitted (after finish), or cancelled."""
        return self._play.done()

    def feed(self, delta: str) -> None:
        """More of the reply's text; complete pieces start synthesis at once."""
        if self._cancelled:
            return
        if self._finished:
            raise RuntimeError("this reply's speech is finished: feed() comes before finish()")
        for piece in self._splitter.push(delta):
            self._text.put_nowait(piece)

    async def finish(self) -> None:
        """The reply's text is complete: speak the rest; returns when all audio has been emitted (or cancelled)."""
        if not self._finished and not self._cancelled:
            self._finished = True
            for piece in self._splitter.flush():
                self._text.put_nowait(piece)
            self._text.put_nowait(_END)
        try:
            await asyncio.shield(self._play)
        except asyncio.CancelledError:
            if not self._play.done():  # our caller was cancelled, not the emission
                raise

    def cancel(self) -> None:
        """Barge-in: stop now. Queued text and audio are dropped; no emit call starts after this returns."""
        if self._cancelled:
            return
        self._cancelled = True
        self.runtime.tts.withdraw(self._in_flight)  # a piece still waiting for the executor is not synthesised
        self._synth.cancel()
        self._play.cancel()

    async def wait_idle(self) -> None:
        """Wait until no synthesis of this reply is left on the media executor (after cancel or finish)."""
        for task in (self._synth, self._play):
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.done():
                    raise
            except Exception:  # logged where it happened
                pass
        if self._in_flight is not None:  # its thread runs to the end even when the synthesis task was cancelled
            await asyncio.wait({self._in_flight})

    # ---- the pipeline ---------------------------------------------------------------------------------------
    def _convert(self, text: str) -> bytes:
        """On the media executor: one piece of text -> bytes in the client's format (the voice's rate resampled)."""
        return self._output.feed(self.runtime.voice.synthesize(text))

    async def _synthesise(self) -> None:
        try:
            while True:
                text = await self._text.get()
                if text is _END:
                    tail = await self._run(self._output.flush)
                    self._held.settle(self._held.bytes + len(tail))
                    await self._audio.put(("", tail))
                    await self._audio.put(_END)
                    return
                if not text.strip():
                    continue
                data = await self._run(self._convert, text)
                self._held.settle(self._held.bytes + len(data))
                await self._audio.put((text, data))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("streamserve: speech synthesis failed; the reply goes on without audio")
            await self._audio.put(_END)  # the emitter ends (the reply's audio stops here)

    async def _run(self, fn: Callable[..., bytes], *args: str) -> bytes:
        """fn(*args) through the runtime's text-to-speech scheduler (deadlines.py), due when the audio
        synthesised so far and not yet emitted has played: at once for the reply's first piece."""
        due = asyncio.get_running_loop().time() + self.fmt.duration_ms(self._held.bytes) / 1e3
        fut = self.runtime.tts.submit(due, fn, *args)
        self._in_flight = fut  # shielded: a cancel stops waiting for it, wait_idle() can still wait for its end
        return await asyncio.shield(fut)

    async def _emit_all(self) -> None:
        try:
            while True:
                item = await self._audio.get()
                if item is _END:
                    return
                text, data = item
                start = self.audio_ms
                if text:
                    self._spoken.append(_Spoken(text, start, start + self.fmt.duration_ms(len(data))))
                for i in range(0, len(data), self._chunk_bytes):
                    if self._cancelled:
                        return
                    chunk = data[i:i + self._chunk_bytes]
                    await self.emit(chunk)
                    self.audio_ms += self.fmt.duration_ms(len(chunk))
                    self._held.settle(self._held.bytes - len(chunk))
        except BaseException:
            # emit failed (or this task was cancelled): nobody drains the audio queue any more, so the synthesis
            # task, which may be blocked putting into it, must stop too (else wait_idle() waits for ever)
            self._synth.cancel()
            raise
        finally:
            self._held.drop()  # emitted, or dropped with the reply's audio (a cancel, a failure)

    # ---- what was heard ---------------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """All the reply's text spoken (or being spoken) so far."""
        return " ".join(s.text.strip() for s in self._spoken).strip()

    def heard_text(self, audio_end_ms: float) -> str:
        """The reply text spoken in its first `audio_end_ms` of audio: whole pieces played before it, and of the
        piece being played, the share of its words that its played share of audio holds (rounded)."""
        out: list[str] = []
        for s in self._spoken:
            if audio_end_ms >= s.end_ms:
                out.append(s.text.strip())
                continue
            if audio_end_ms > s.start_ms:
                words = s.text.split()
                share = (audio_end_ms - s.start_ms) / max(s.end_ms - s.start_ms, 1e-9)
                n = round(len(words) * share)
                if n:
                    out.append(" ".join(words[:n]))
            break
        return " ".join(out).strip()
