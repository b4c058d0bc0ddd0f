"""`Session`: a persistent conversation whose KV cache stays on the device between chunks.

The methods here validate input (typed errors at the call) and submit work to the engine loop, which
runs every session's chunks and replies on one thread (`loop.py`). Each appended chunk runs only its
new tokens against the cached prefix. Generated tokens join the session too; the last one enters the KV
lazily, with the next append or reply step, so a reply costs exactly one forward per generated token.
`token_ids` is the one record of the session; the tokens not yet in the KV are always
`token_ids[kv.length:]`.
"""

from __future__ import annotations

import asyncio
import enum
import math
import secrets
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from streamserve.config import SAMPLING_DEFAULTS as SD
from streamserve.config import SESSION_DEFAULTS
from streamserve.engine.sampling import MAX_SEED, Draws, check_sampling, check_seed, check_stop
from streamserve.engine.snapshot import ChunkRecord, Snapshot
from streamserve.engine.streams import Outbox, ResponseStream, TokenIterator
from streamserve.engine.work import CHUNK_KINDS, Ack, Chunk, ChunkKind, Response
from streamserve.errors import (
    ChunkTooLargeError,
    ContextLengthError,
    EmptyAppendError,
    InvalidInputError,
    RewindError,
    SessionClosedError,
    TokenOutOfRangeError,
)
from streamserve.sessions import PagedSessionKV, WindowPolicy

if TYPE_CHECKING:
    from streamserve.engine.drafters.adaptive import SpecController
    from streamserve.engine.engine import Engine


class SessionState(enum.Enum):
    OPEN = "open"  # idle between chunks: may be parked under memory pressure
    RESPONDING = "responding"  # a reply is being generated
    PARKED = "parked"  # KV offloaded to host memory; restored on the next use
    CLOSED = "closed"


def _orphaned(engine_ref: weakref.ref, kv: PagedSessionKV, session_id: str) -> None:
    """A session was garbage-collected without close(): hand its KV (and its drafters' state) to the engine,
    which frees them between steps. Takes no lock: the collector may run on any thread, mid-anything."""
    engine = engine_ref()
    if engine is not None:
        engine._orphans.put((kv, session_id))


class Session:
    def __init__(self, engine: Engine, kv: PagedSessionKV, seed: int | None = None,
                 chunk_budget: float = SESSION_DEFAULTS.chunk_budget) -> None:
        self.id = secrets.token_urlsafe(16)
        self.engine = engine
        self.kv = kv
        self.token_ids: list[int] = []  # everything appended or generated, in order
        self.timeline: list[ChunkRecord] = []
        self.last_active = time.monotonic()
        self.chunk_budget = chunk_budget  # seconds from capture to the default deadline of a chunk
        self.max_chunk_tokens: int | None = None  # set by servers: a longer chunk is refused at the call
        self._next_seq = 0
        self._submit_lock = threading.Lock()
        self.spec: SpecController | None = None  # speculative decoding: drafters and draft length (engine sets)
        self._drafts: dict[str, Any] = {}  # the drafters' per-session state (n-gram index, draft-model KV)
        self.revisions = 0  # counts cuts of the history (rewinds): drafters' indexes rebuild after one
        self._logits: torch.Tensor | None = None  # [V] after the first `_logits_at` tokens
        self._logits_at = -1
        self.seeded = seed is not None
        self._generator = torch.Generator(device=engine.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self.closed = False
        # a session dropped without close() still gives its pages back when it is collected
        self._finalizer = weakref.finalize(self, _orphaned, weakref.ref(engine), kv, self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def state(self) -> SessionState:
        if self.closed:
            return SessionState.CLOSED
        if self.kv.parked is not None:
            return SessionState.PARKED
        loop = self.engine.loop
        with loop.cv:
            responding = loop.scheduler.responding(self.id)
        return SessionState.RESPONDING if responding else SessionState.OPEN

    @property
    def policy(self) -> WindowPolicy:
        """What the session keeps of its history: sinks, window, position mode."""
        return self.kv.policy

    @property
    def pages_held(self) -> int:
        """KV pages the session holds on the pool now (0 while parked)."""
        return len(self.kv.page_table)

    @property
    def next_seq(self) -> int:
        """The seq the next chunk gets unless it names one (chunk seqs must grow)."""
        return self._next_seq

    @property
    def _pending(self) -> list[int]:
        """The tokens of the session not yet in the KV cache (at most the last generated one)."""
        return self.token_ids[self.kv.length:]

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open a new one")

    # ---- input ----------------------------------------------------------------------------------------
    def append(self, text: str | None = None, token_ids: Sequence[int] | None = None,
               add_special_tokens: bool | None = None, seq: int | None = None, capture_time: float | None = None,
               deadline: float | None = None, kind: ChunkKind = "text") -> int:
        """Append a chunk of text or token ids and wait until it is in the KV cache; -> tokens appended.

        `add_special_tokens` (text only): run the tokenizer's post-processor (e.g. add BOS). None means
        yes for the first chunk of a session and no after it; pass False for chat-templated text, which
        carries its own special tokens. `seq` (default: the next number) must grow from chunk to chunk.
        `capture_time` and `deadline` are seconds on the engine's clock (`time.monotonic()`); the deadline
        defaults to capture time + the session's `chunk_budget`, and orders the work of all sessions.
        `kind` "video" marks a chunk the engine may shed under overload (0 tokens appended then).
        """
        return self.append_chunk(text, token_ids, add_special_tokens, seq, capture_time, deadline, kind).tokens

    def append_chunk(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                     add_special_tokens: bool | None = None, seq: int | None = None,
                     capture_time: float | None = None, deadline: float | None = None,
                     kind: ChunkKind = "text") -> Ack:
        """`append`, returning the chunk's `Ack` (seq, tokens, queue and compute ms, missed deadline, shed)."""
        if self.engine.loop.in_engine_thread():
            raise RuntimeError("a session's blocking append cannot run on the engine thread")
        return self.submit_chunk(text, token_ids, add_special_tokens, seq, capture_time, deadline, kind).result()

    async def append_async(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                           add_special_tokens: bool | None = None, seq: int | None = None,
                           capture_time: float | None = None, deadline: float | None = None,
                           kind: ChunkKind = "text") -> int:
        """`append` for asyncio: bad input raises at the call; resolves when the chunk is in the KV."""
        fut = self.submit_chunk(text, token_ids, add_special_tokens, seq, capture_time, deadline, kind)
        return (await asyncio.wrap_future(fut)).tokens

    async def append_chunk_async(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                                 add_special_tokens: bool | None = None, seq: int | None = None,
                                 capture_time: float | None = None, deadline: float | None = None,
                                 kind: ChunkKind = "text") -> Ack:
        fut = self.submit_chunk(text, token_ids, add_special_tokens, seq, capture_time, deadline, kind)
        return await asyncio.wrap_future(fut)

    def submit_chunk(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                     add_special_tokens: bool | None = None, seq: int | None = None,
                     capture_time: float | None = None, deadline: float | None = None,
                     kind: ChunkKind = "text") -> Future[Ack]:
        """Queue a chunk and return at once: the future resolves to its `Ack` (or fails with the step's typed
        error). Bad input raises here. The blocking and asyncio appends are this plus a wait."""
        self._check_open()
        if (text is None) == (token_ids is None):
            raise InvalidInputError("append takes exactly one of text= or token_ids=")
        for name, t in (("capture_time", capture_time), ("deadline", deadline)):
            if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)):
                raise InvalidInputError(f"{name} must be a finite number, got {t!r}")
        if kind not in CHUNK_KINDS:
            raise InvalidInputError(f"chunk kind must be one of {list(CHUNK_KINDS)}, got {kind!r}")
        loop = self.engine.loop
        with self._submit_lock:  # seq numbers and first-chunk special tokens follow the submission order
            if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < self._next_seq):
                raise InvalidInputError(f"chunk seq {seq!r} is out of order: the next seq must be >= {self._next_seq}")
            if text is not None:
                if not isinstance(text, str):
                    raise InvalidInputError(f"text must be a str, got {type(text).__name__}")
                with loop.cv:
                    first = not self.token_ids and not loop.scheduler.queued_chunks(self.id)
                ids = self.engine.tokenizer.encode(text, add_special_tokens=first if add_special_tokens is None
                                                   else add_special_tokens)
            else:
                ids = self._check_ids(token_ids)
            if not ids:
                raise EmptyAppendError("append got an empty chunk; send at least one token or character")
            if self.max_chunk_tokens is not None and len(ids) > self.max_chunk_tokens:
                raise ChunkTooLargeError(f"a chunk of {len(ids)} tokens is over the limit of {self.max_chunk_tokens}; "
                                         "split it into smaller chunks")
            self._check_context(len(ids))
            now = time.monotonic()
            capture = now if capture_time is None else float(capture_time)
            seq = self._next_seq if seq is None else seq
            ticket: Future[Ack] = Future()
            ticket.set_running_or_notify_cancel()  # a caller giving up on it can no longer cancel it under the engine
            chunk = Chunk(self.id, seq, ids, kind, now, capture,
                          capture + self.chunk_budget if deadline is None else float(deadline), ticket=ticket)
            loop.submit(chunk)
            self._next_seq = seq + 1
            self.last_active = now
        return chunk.ticket

    def _check_context(self, n: int) -> None:
        """ContextLengthError unless n more tokens fit after the session (absolute positions only)."""
        limit = self.engine.config.max_position_embeddings
        if not self.kv.rolling and len(self.token_ids) + n > limit:
            raise ContextLengthError(f"appending {n} tokens to a session of {len(self.token_ids)} would exceed the "
                                     f"model's context of {limit}; rewind, or open the session with a window for "
                                     "endless streams")

    def _check_ids(self, token_ids: Sequence[int] | None) -> list[int]:
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise InvalidInputError("token_ids must be a sequence of ints")
        vocab = self.engine.config.vocab_size
        ids = []
        for i in token_ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise InvalidInputError(f"token_ids must be ints, got {type(i).__name__}")
            if not 0 <= i < vocab:
                raise TokenOutOfRangeError(f"token id {i} is out of range: the vocabulary has {vocab} ids")
            ids.append(i)
        return ids

    # ---- output ---------------------------------------------------------------------------------------
    def stream(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature, top_p: float = SD.top_p,
               top_k: int = SD.top_k, seed: int | None = SD.seed, stop: Sequence[str] | None = None,
               stop_token_ids: Sequence[int] | None = None) -> ResponseStream:
        """Request a reply; iterate the returned stream (`async for` or `for`) for its `Delta`s.

        It starts after the chunks appended before it. Ends after `max_tokens`, at a stop token
        (`stop_token_ids`, default the model's EOS ids; `()` never stops early; the stop token is
        delivered), before a stop string of `stop` (not delivered in the text), at the model's context, or
        at `cancel()`. Bad parameters, a closed session or a reply already running raise here."""
        self._check_open()
        check_sampling(max_tokens, temperature, top_p, top_k)
        stops = tuple(check_stop(stop))
        stop_ids = frozenset(self.engine.eos_token_ids if stop_token_ids is None
                             else self._check_ids(list(stop_token_ids)))
        check_seed(seed)
        loop = self.engine.loop
        with loop.cv:
            queued = loop.scheduler.queued_chunks(self.id)
        if not self.token_ids and not queued:
            raise InvalidInputError("a reply needs at least one appended token first")
        if seed is None:  # one draw of the session's generator seeds the reply (a seeded session repeats too)
            seed = int(torch.randint(0, MAX_SEED, (1,), generator=self._generator, device=self.engine.device))
        r = Response(self.id, max_tokens, float(temperature), float(top_p), top_k, stop_ids, stops,
                     Draws(seed, self.engine.device), time.monotonic(), outbox=Outbox(),
                     seeded=self.seeded or seed is not None)
        self.engine.loop.submit(r)
        self.last_active = r.arrival
        return ResponseStream(self, r)

    def iter_generate(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature,
                      top_p: float = SD.top_p, seed: int | None = SD.seed,
                      stop_token_ids: Sequence[int] | None = None, top_k: int = SD.top_k) -> Iterator[int]:
        """Generate a reply, yielding its token ids as they come (the reply runs ahead of the iteration).
        Closing the iterator early cancels the reply. `stop_token_ids=None` means the model's EOS ids."""
        return TokenIterator(self.stream(max_tokens, temperature, top_p, top_k, seed, stop_token_ids=stop_token_ids))

    def generate(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature,
                 top_p: float = SD.top_p, seed: int | None = SD.seed,
                 stop_token_ids: Sequence[int] | None = None, top_k: int = SD.top_k) -> list[int]:
        """Generate a reply; the tokens are returned and also become part of the session."""
        return list(self.iter_generate(max_tokens, temperature, top_p, seed, stop_token_ids, top_k))

    def cancel(self) -> None:
        """Barge-in: end the running reply (and any queued one) within one engine step. What it produced
        stays in the session (`rewind` can drop it). Queued chunks are unaffected."""
        if not self.closed:
            self.engine.loop.cancel(self.id)

    # ---- rewind, park, snapshot -----------------------------------------------------------------------
    def rewind(self, to: int | None = None, to_seq: int | None = None) -> int:
        """Forget everything after token position `to`, or after the chunk numbered `to_seq` (that chunk
        is kept). Returns the new length. A rewind then an append equals a fresh session fed the same
        tokens. With a window, a point whose visible past was already dropped is refused."""
        self._check_open()
        if (to is None) == (to_seq is None):
            raise RewindError("rewind takes exactly one of to= or to_seq=")
        with self.engine._lock:  # never in the middle of another thread's step
            return self._rewind(to, to_seq)

    def _rewind(self, to: int | None, to_seq: int | None) -> int:
        loop = self.engine.loop
        with loop.cv:
            if loop.scheduler.queued_chunks(self.id):
                raise RewindError("this session has chunks still queued; wait for their acks, then rewind")
        if to_seq is not None:
            rec = next((r for r in self.timeline if r.kind == "input" and r.seq == to_seq), None)
            if rec is None:
                raise RewindError(f"no chunk with seq {to_seq!r} on this session's timeline")
            to = rec.end
        assert to is not None
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to <= len(self.token_ids):
            raise RewindError(f"cannot rewind to {to!r}: the session holds positions 0..{len(self.token_ids)}")
        self._rewind_to(to, rewind=True)
        return to

    def _rewind_to(self, to: int, rewind: bool = False) -> None:
        """Cut the session back to its first `to` tokens; RewindError, changing nothing, where the window
        already dropped what a query there would see. `rewind`: a user's rewind, which also ends a running
        reply and numbers the next chunk after the last one kept (undoing a failed chunk does neither)."""
        keep = max(0, to - 1)  # the KV keeps all but the last kept token, which runs again to give the logits
        if to < len(self.token_ids):
            if self.kv.parked is not None:
                self.engine.admit(self, self.kv.unpark, self.kv.pages_needed(0))
            self.kv.check_rewind(min(keep, self.kv.length))
        if rewind:
            with self.engine.loop.cv:  # every check passed: a reply in progress ends here (in the next step)
                self.engine.loop.scheduler.cancel(self.id)
        if to == len(self.token_ids):
            return
        self.kv.truncate(min(keep, self.kv.length))
        del self.token_ids[to:]
        self.revisions += 1
        self._logits, self._logits_at = None, -1
        self.timeline = [r if r.end <= to else ChunkRecord(r.kind, r.seq, r.start, to, r.capture_time, r.deadline)
                         for r in self.timeline if r.start < to]
        if rewind:
            self._next_seq = max((r.seq for r in self.timeline if r.seq is not None), default=-1) + 1
        self.last_active = time.monotonic()

    def park(self) -> None:
        """Offload the KV to host memory and give its pages back; the next use brings it back."""
        self._check_open()
        with self.engine._lock:
            self.kv.park()

    def snapshot(self, path: str | Path | None = None) -> Snapshot | Path:
        """Everything the session is, copied to host memory (-> Snapshot), or written to `path` (-> Path).
        The session itself goes on unchanged; `engine.restore(...)` makes a new session from it."""
        self._check_open()
        with self.engine._lock:
            pages = self.kv.parked if self.kv.parked is not None else self.kv.to_host()
            # between steps: a running reply's timeline record is current
            snap = Snapshot(model=self.engine.fingerprint, model_name=self.engine.name,
                            page_size=self.kv.pool.page_size, policy=self.kv.policy, token_ids=list(self.token_ids),
                            timeline=list(self.timeline), kv_length=self.kv.length, pages=pages,
                            logits=None if self._logits is None else self._logits.detach().cpu().clone(),
                            logits_at=self._logits_at, next_seq=self._next_seq, page_cap=self.kv.page_cap)
        return snap.save(path) if path is not None else snap

    def _load_state(self, snap: Snapshot) -> None:
        self.token_ids = list(snap.token_ids)
        self.timeline = list(snap.timeline)
        self.kv.length = snap.kv_length
        self._next_seq = snap.next_seq
        self._logits = None if snap.logits is None else snap.logits.to(self.engine.device)
        self._logits_at = snap.logits_at

    def close(self) -> None:
        """Free the session's KV memory: a running reply ends ("closed"), queued chunks fail with
        SessionClosedError. Closing twice is harmless."""
        self._close()

    def _close(self, drop: bool = True) -> None:
        if self.closed:
            return
        with self.engine._lock:  # between steps
            self.closed = True
            if drop:
                self.engine.loop.drop_session(self.id)
            self.kv.release()
            self.kv.parked = None
            for d in self.spec.drafters if self.spec is not None else ():
                d.release(self)
        self._finalizer.detach()
        self.engine._release(self)
