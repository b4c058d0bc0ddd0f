"""A reply started before the turn is confirmed, and the gate that keeps it from the client until it is.

When the VAD first scores silence and the words so far look complete (the Listener's `TurnLikely`), the person has
probably stopped: their message is ended and the reply starts at once, during the VAD's hangover (server_vad's
silence_duration_ms, semantic_vad's), instead of after it. Everything the reply sends (response events, reply
audio, on a WebRTC call the outgoing track) goes through a `Gate`, which holds it:

- the turn is confirmed (the VAD's stop, then the final transcript, equal to the one speculated on): the held
  output leaves in order (`release`), and what follows passes straight through; the first audio is usually
  synthesised by then;
- speech resumes (`TurnResumed`), the final transcript differs, or the audio is cleared: the held output is
  dropped and nothing more passes (`discard`); the adapter cancels the reply, waits for its end, and returns the
  chat to its mark (engine/chat_mark.py): the same token ids, messages and open message, so the resumed
  utterance goes on as if nothing had happened. Not one event or audio byte of the discarded reply leaves.

The gate is bounded: past `limit` bytes held, what sends waits (the Speaker's synthesis pauses) until the gate
opens or drops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

Out = Callable[..., Awaitable[None]]
LIMIT = 4 << 20  # bytes held at most: about 40 s of 48 kHz PCM16 reply audio, far past any hangover


def size(args: tuple[Any, ...]) -> int:
    return sum(len(a) if isinstance(a, (bytes, str)) else 64 for a in args)


class Gate:
    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self.held: list[tuple[Out, tuple[Any, ...]]] = []
        self.bytes = 0
        self.state = "held"  # -> "open" (released) or "dropped" (discarded)
        self.after: list[Callable[[], Any]] = []  # run at the release (never at a discard)
        self.changed = asyncio.Event()  # set when the gate opens or drops: a sender waiting for room goes on
        self.settled = asyncio.Event()  # the same, for whoever waits on the speculation's outcome

    @property
    def holding(self) -> bool:
        return self.state == "held"

    def wrap(self, out: Out) -> Out:
        """`out` through the gate."""
        async def gated(*args: Any) -> None:
            await self.send(out, *args)
        return gated

    async def send(self, out: Out, *args: Any) -> None:
        while self.state == "held" and self.bytes >= self.limit:
            await self.changed.wait()  # full: the sender waits (bounded), never drops
        if self.state == "dropped":
            return
        if self.state == "open":
            await out(*args)
            return
        self.held.append((out, args))
        self.bytes += size(args)

    def hold_nowait(self, out: Out, *args: Any) -> bool:
        """While held: keep `out(*args)` for the release without waiting (False when the gate is full: not kept).
        Dropped: True (nothing to do). Open: False (the caller sends it itself)."""
        if self.state == "dropped":
            return True
        if self.state == "open" or self.bytes >= self.limit:
            return False
        self.held.append((out, args))
        self.bytes += size(args)
        return True

    def then(self, fn: Callable[[], Any]) -> None:
        """`fn` when the output is released (now, if it was); never, if it is dropped."""
        if self.state == "open":
            fn()
        elif self.state == "held":
            self.after.append(fn)

    async def release(self) -> None:
        """The turn is confirmed: what is held leaves in order (what is sent meanwhile queues behind it), then
        everything passes straight through."""
        while self.held:
            out, args = self.held.pop(0)
            self.bytes -= size(args)
            await out(*args)
        if self.state != "held":
            return
        self.state = "open"
        self.changed.set()
        self.settled.set()
        after, self.after = self.after, []
        for fn in after:
            fn()

    def discard(self) -> None:
        """Speech resumed: nothing held or sent later leaves."""
        if self.state == "held":
            self.state, self.held, self.bytes, self.after = "dropped", [], 0, []
            self.changed.set()
            self.settled.set()


class Speculations:
    """Whether this server speculates replies (`streamserve serve --no-speculation`: never), and how many it
    started, released and took back (on /metrics: streamserve_voice_speculations_total)."""

    OUTCOMES = ("started", "released", "taken_back")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.counts = dict.fromkeys(self.OUTCOMES, 0)
        self._metric: Any = None

    def count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._metric is not None:
            self._metric.labels(outcome).inc()

    def metrics(self, registry: Any) -> None:
        from prometheus_client import Counter

        self._metric = Counter("streamserve_voice_speculations", "Replies started at the likely end of a turn, "
                               "held until it was confirmed: started, released (confirmed), taken_back (speech "
                               "resumed)", ["outcome"], registry=registry)


__all__ = ["Gate", "Speculations"]
