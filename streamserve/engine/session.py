"""`Session`: the user's handle onto a persistent conversation whose KV cache stays on the device between chunks.

The methods here validate input (typed errors at the call) and submit work to the engine loop, which
runs every session's chunks and replies on one thread (`loop.py`). Everything the session is lives in its
`SessionState` (`session.core`), which the engine's step operates on; nothing below this module sees the
handle. Each appended chunk runs only its new tokens against the cached prefix. Generated tokens join the
session too; the last one enters the KV lazily, with the next append or reply step, so a reply costs
exactly one forward per generated token. A chunk is text, token ids or embedding vectors (`embeds`
[T, hidden]: audio, image, video or robot-state encodings); an embedding chunk's positions hold
placeholder ids in `token_ids` (`state.py` says which) and their vectors in the state's side table.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from streamserve.config import SAMPLING_DEFAULTS as SD
from streamserve.config import SESSION_DEFAULTS
from streamserve.engine.admission import Admission
from streamserve.engine.guard import BetweenSteps
from streamserve.engine.inputs import check_embeds, check_ids, check_reply_ids, check_time
from streamserve.engine.loop import EngineLoop
from streamserve.engine.sampling import MAX_SEED, Draws, check_sampling, check_seed, check_stop
from streamserve.engine.snapshot import ChunkRecord, Snapshot
from streamserve.engine.state import SessionState, SessionStatus
from streamserve.engine.streams import Outbox, ResponseStream, TokenIterator
from streamserve.engine.table import SessionTable
from streamserve.engine.token_log import TokenLog
from streamserve.engine.work import CHUNK_KINDS, Ack, Chunk, ChunkKind, Response
from streamserve.errors import (
    ChunkTooLargeError,
    EmptyAppendError,
    InvalidInputError,
    RewindError,
    SessionClosedError,
)
from streamserve.models import ModelConfig, Tokenizer
from streamserve.sessions import PagedSessionKV, WindowPolicy

if TYPE_CHECKING:
    from streamserve.engine.drafters.adaptive import SpecController


class SessionHost(Protocol):
    """What a session uses of its engine (`engine.Engine` is one)."""

    loop: EngineLoop
    guard: BetweenSteps
    admission: Admission
    table: SessionTable
    tokenizer: Tokenizer
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    name: str


class Session:
    def __init__(self, engine: SessionHost, state: SessionState,
                 chunk_budget: float = SESSION_DEFAULTS.chunk_budget) -> None:
        self.id = state.id
        self.engine = engine
        self.core = state
        self.chunk_budget = chunk_budget  # seconds from capture to the default deadline of a chunk
        self.max_chunk_tokens: int | None = None  # set by servers: a longer chunk is refused at the call
        self._submit_lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return secrets.token_urlsafe(16)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.core.token_ids)

    # ---- what the session is (read from its state) --------------------------------------------------
    @property
    def kv(self) -> PagedSessionKV:
        return self.core.kv

    @property
    def token_ids(self) -> TokenLog:
        """Everything appended or generated, by position (a vector's position holds a placeholder id). An endless
        session keeps its sinks' and its KV's positions only: `list()` gives those (docs/protocol.md)."""
        return self.core.token_ids

    @property
    def timeline(self) -> list[ChunkRecord]:
        return self.core.timeline

    @property
    def closed(self) -> bool:
        return self.core.closed

    @property
    def last_active(self) -> float:
        return self.core.last_active

    @last_active.setter
    def last_active(self, t: float) -> None:
        self.core.last_active = t

    @property
    def spec(self) -> SpecController | None:
        """Speculative decoding: the session's drafters and draft length (None: it drafts nothing)."""
        return self.core.spec

    @property
    def revisions(self) -> int:
        return self.core.revisions

    @property
    def seeded(self) -> bool:
        return self.core.seeded

    @property
    def state(self) -> SessionStatus:
        if self.closed:
            return SessionStatus.CLOSED
        if self.kv.parked is not None:
            return SessionStatus.PARKED
        loop = self.engine.loop
        with loop.cv:
            responding = loop.scheduler.responding(self.id)
        return SessionStatus.RESPONDING if responding else SessionStatus.OPEN

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
        return self.core.next_seq

    def on_engine_thread(self) -> bool:
        """Whether the caller runs on the engine thread (which must never wait for the engine)."""
        return self.engine.loop.in_engine_thread()

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open a new one")

    # ---- input ----------------------------------------------------------------------------------------
    def append(self, text: str | None = None, token_ids: Sequence[int] | None = None,
               add_special_tokens: bool | None = None, seq: int | None = None, capture_time: float | None = None,
               deadline: float | None = None, kind: ChunkKind = "text", *, embeds: torch.Tensor | None = None) -> int:
        """Append a chunk of text, token ids or embedding vectors and wait until it is in the KV cache;
        -> tokens (positions) appended.

        `add_special_tokens` (text only): run the tokenizer's post-processor (e.g. add BOS). None means
        yes for the first chunk of a session and no after it; pass False for chat-templated text, which
        carries its own special tokens. `seq` (default: the next number) must grow from chunk to chunk.
        `capture_time` and `deadline` are seconds on the engine's clock (`time.monotonic()`); the deadline
        defaults to capture time + the session's `chunk_budget`, and orders the work of all sessions.
        `kind` ("text", "audio", "video", "image", "state") labels the chunk; "video" marks one the engine may
        shed under overload (0 tokens appended then). `embeds` [T, hidden] (floating, finite): vectors that
        enter the model in place of token embeddings, one position each (copied at the call).
        """
        return self.append_chunk(text, token_ids, add_special_tokens, seq, capture_time, deadline, kind,
                                 embeds=embeds).tokens

    def append_chunk(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                     add_special_tokens: bool | None = None, seq: int | None = None,
                     capture_time: float | None = None, deadline: float | None = None,
                     kind: ChunkKind = "text", *, embeds: torch.Tensor | None = None) -> Ack:
        """`append`, returning the chunk's `Ack` (seq, tokens, queue and compute ms, missed deadline, shed)."""
        if self.engine.loop.in_engine_thread():
            raise RuntimeError("a session's blocking append cannot run on the engine thread")
        return self.submit_chunk(text, token_ids, add_special_tokens, seq, capture_time, deadline, kind,
                                 embeds=embeds).result()

    async def append_async(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                           add_special_tokens: bool | None = None, seq: int | None = None,
                           capture_time: float | None = None, deadline: float | None = None,
                           kind: ChunkKind = "text", *, embeds: torch.Tensor | None = None) -> int:
        """`append` for asyncio: bad input raises at the call; resolves when the chunk is in the KV."""
        fut = self.submit_chunk(text, token_ids, add_special_tokens, seq, capture_time, deadline, kind, embeds=embeds)
        return (await asyncio.wrap_future(fut)).tokens

    async def append_chunk_async(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                                 add_special_tokens: bool | None = None, seq: int | None = None,
                                 capture_time: float | None = None, deadline: float | None = None,
                                 kind: ChunkKind = "text", *, embeds: torch.Tensor | None = None) -> Ack:
        fut = self.submit_chunk(text, token_ids, add_special_tokens, seq, capture_time, deadline, kind, embeds=embeds)
        return await asyncio.wrap_future(fut)

    def submit_chunk(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                     add_special_tokens: bool | None = None, seq: int | None = None,
                     capture_time: float | None = None, deadline: float | None = None,
                     kind: ChunkKind = "text", *, embeds: torch.Tensor | None = None) -> Future[Ack]:
        """Queue a chunk and return at once: the future resolves to its `Ack` (or fails with the step's typed
        error). Bad input raises here, changing nothing. The blocking and asyncio appends are this plus a wait."""
        self._check_open()
        if sum(x is not None for x in (text, token_ids, embeds)) != 1:
            raise InvalidInputError("append takes exactly one of text=, token_ids= or embeds=")
        check_time("capture_time", capture_time)
        check_time("deadline", deadline)
        if kind not in CHUNK_KINDS:
            raise InvalidInputError(f"chunk kind must be one of {list(CHUNK_KINDS)}, got {kind!r}")
        st, e = self.core, self.engine
        vectors = None
        if embeds is not None:  # checked and copied off the engine thread, before anything is taken
            vectors = check_embeds(embeds, e.config.hidden_size, e.device, e.dtype, self.max_chunk_tokens)
        loop = e.loop
        with self._submit_lock:  # seq numbers and first-chunk special tokens follow the submission order
            if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < st.next_seq):
                raise InvalidInputError(f"chunk seq {seq!r} is out of order: the next seq must be >= {st.next_seq}")
            if vectors is not None:
                ids = [st.placeholder_id] * vectors.shape[0]
            elif text is not None:
                if not isinstance(text, str):
                    raise InvalidInputError(f"text must be a str, got {type(text).__name__}")
                with loop.cv:
                    first = not st.token_ids and not loop.scheduler.queued_chunks(self.id)
                ids = e.tokenizer.encode(text, add_special_tokens=first if add_special_tokens is None
                                         else add_special_tokens)
            else:
                ids = check_ids(token_ids, e.config.vocab_size)
            if not ids:
                raise EmptyAppendError("append got an empty chunk; send at least one token or character")
            self._check_chunk_size(len(ids))
            st.check_context(len(ids))
            now = time.monotonic()
            capture = now if capture_time is None else float(capture_time)
            seq = st.next_seq if seq is None else seq
            ticket: Future[Ack] = Future()
            ticket.set_running_or_notify_cancel()  # a caller giving up on it can no longer cancel it under the engine
            chunk = Chunk(self.id, seq, ids, kind, now, capture,
                          capture + self.chunk_budget if deadline is None else float(deadline), ticket=ticket,
                          embeds=vectors)
            loop.submit(chunk)
            st.next_seq = seq + 1
            st.last_active = now
        return chunk.ticket

    def _check_chunk_size(self, n: int) -> None:
        if self.max_chunk_tokens is not None and n > self.max_chunk_tokens:
            raise ChunkTooLargeError(f"a chunk of {n} tokens is over the limit of {self.max_chunk_tokens}; "
                                     "split it into smaller chunks")

    # ---- output ---------------------------------------------------------------------------------------
    def stream(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature, top_p: float = SD.top_p,
               top_k: int = SD.top_k, seed: int | None = SD.seed, stop: Sequence[str] | None = None,
               stop_token_ids: Sequence[int] | None = None,
               allowed_token_ids: Sequence[int] | None = None, draft_token_ids: Sequence[int] | None = None,
               detokenize: bool = True) -> ResponseStream:
        """Request a reply; iterate the returned stream (`async for` or `for`) for its `Delta`s.

        It starts after the chunks appended before it. Ends after `max_tokens`, at a stop token
        (`stop_token_ids`, default the model's EOS ids; `()` never stops early; the stop token is
        delivered), before a stop string of `stop` (not delivered in the text), at the model's context, or
        at `cancel()`. `allowed_token_ids`: every token among those ids (a logits mask; drafts are verified
        against the masked logits). `draft_token_ids`: a guess at the reply's tokens by position (a robot's last
        chunk, shifted), verified in forwards that run anyway (the first in the append's just before): a right
        guess gives several tokens per forward, a wrong one changes nothing (ignored with stop strings).
        `detokenize=False`: ids only. Bad parameters, a closed session or a reply already running raise here."""
        self._check_open()
        check_sampling(max_tokens, temperature, top_p, top_k)
        stops = tuple(check_stop(stop))
        check_seed(seed)
        stop_ids, allowed, draft = check_reply_ids(self.engine.config.vocab_size, self.engine.eos_token_ids,
                                                   max_tokens, stop_token_ids, allowed_token_ids, draft_token_ids)
        loop, gen = self.engine.loop, self.core.generator
        with loop.cv:  # the draw and the submission under one hold: a refused reply takes no draw
            if not self.core.token_ids and not loop.scheduler.queued_chunks(self.id):
                raise InvalidInputError("a reply needs at least one appended token first")
            drawn = gen.getstate() if seed is None else None
            seeded = self.seeded or seed is not None
            if seed is None:  # one draw of the session's generator seeds the reply (a seeded session repeats too)
                seed = gen.randrange(MAX_SEED)
            r = Response(self.id, max_tokens, float(temperature), float(top_p), top_k, stop_ids, stops,
                         Draws(seed, self.engine.device), time.monotonic(), outbox=Outbox(), seeded=seeded,
                         allowed=allowed, draft=draft, detokenize=bool(detokenize))
            try:
                loop.submit(r)
            except BaseException:
                if drawn is not None:
                    gen.setstate(drawn)
                raise
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
        tokens (or vectors). With a window, a point whose visible past was already dropped is refused."""
        self._check_open()
        if (to is None) == (to_seq is None):
            raise RewindError("rewind takes exactly one of to= or to_seq=")
        # never in the middle of another thread's step, nor of a submission (which reads the seq it renumbers)
        with self.engine.guard, self._submit_lock:
            self._check_open()
            return self._rewind(to, to_seq)

    def _rewind(self, to: int | None, to_seq: int | None) -> int:
        loop, st = self.engine.loop, self.core
        with loop.cv:
            if loop.scheduler.queued_chunks(self.id):
                raise RewindError("this session has chunks still queued; wait for their acks, then rewind")
        if to_seq is not None:
            rec = next((r for r in st.timeline if r.kind == "input" and r.seq == to_seq), None)
            if rec is None:
                gone = "" if st.token_ids.gap is None else (" (an endless session forgets the chunks its window "
                                                           f"dropped: rewind reaches back to {st.token_ids.base})")
                raise RewindError(f"no chunk with seq {to_seq!r} on this session's timeline{gone}")
            to = rec.end
        assert to is not None
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to <= len(st.token_ids):
            raise RewindError(f"cannot rewind to {to!r}: the session holds positions 0..{len(st.token_ids)}")
        if to < len(st.token_ids):
            st.check_cut(to)  # before the unpark: a refused rewind leaves a parked session parked
            self.engine.admission.unpark(st)
        with loop.cv:  # every check passed: a reply in progress ends here (in the next step)
            loop.scheduler.cancel(self.id)
        st.cut(to, renumber=True)
        return to

    def park(self) -> None:
        """Offload the KV to host memory and give its pages back; the next use brings it back."""
        with self.engine.guard:  # checked under the guard: a close on another thread runs under it too
            self._check_open()
            self.core.park()

    def snapshot(self, path: str | Path | None = None) -> Snapshot | Path:
        """Everything the session is, copied to host memory (-> Snapshot), or written to `path` (-> Path),
        the vectors of its embedding chunks included. The session itself goes on unchanged;
        `engine.restore(...)` makes a new session from it."""
        st, e = self.core, self.engine
        with e.guard:
            self._check_open()  # under the guard: a session closed meanwhile has no pages to copy
            pages = self.kv.parked if self.kv.parked is not None else self.kv.to_host()
            positions = list(st.vectors)
            vectors = torch.stack([st.vectors[p] for p in positions]).cpu().clone() if positions else None
            # between steps: a running reply's timeline record is current
            snap = Snapshot(model=e.fingerprint, model_name=e.name,
                            page_size=self.kv.pool.page_size, policy=self.kv.policy, token_ids=st.token_ids.copy(),
                            timeline=list(st.timeline), kv_length=self.kv.length, pages=pages,
                            logits=None if st.logits is None else st.logits.detach().cpu().clone(),
                            logits_at=st.logits_at, next_seq=st.next_seq, page_cap=self.kv.page_cap,
                            vector_positions=positions, vectors=vectors)
        return snap.save(path) if path is not None else snap

    def close(self) -> None:
        """Free the session's KV memory: a running reply ends ("closed"), queued chunks fail with
        SessionClosedError. Closing twice is harmless."""
        self.close_now(drop=True)

    def close_now(self, drop: bool) -> None:
        """Close; `drop=False` when the scheduler already took the session's queue (a faulted step)."""
        if self.closed:
            return
        with self.engine.guard:  # between steps
            self.core.closed = True
            if drop:
                self.engine.loop.drop_session(self.id)
            self.core.release()
        self.engine.table.remove(self.id)
