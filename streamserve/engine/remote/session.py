"""`RemoteSession`: a persistent session whose KV cache lives in an SGLang server's streaming session.

It offers what the session service uses of `engine.Session` (append, reply, cancel, rewind, close; the token log,
the timeline, seq numbers), with the same typed errors at the call, so every front end works on it unchanged.
Its work runs in order on the backend's event loop (remote/worker.py): one FIFO per session, because SGLang takes
one request at a time per streaming session. An append is a `/generate` with `max_new_tokens: 0` (SGLang prefills
it into the session; the ack follows); a reply is a streamed `/generate` with no new input, whose tokens join the
token log as they arrive.

Where SGLang's semantics differ from this product's, the session restores this product's:
- a cancelled reply keeps what it produced (SGLang drops an aborted turn whole: the tokens received are
  prefilled again, so both sides hold the same context);
- `rewind` (which chat sessions use to cut a reply's end) opens a new SGLang session and prefills the kept tokens
  (SGLang's radix cache holds most of them); the old one is closed;
- `stop_token_ids` that leave out the model's EOS are refused (SGLang always stops at EOS unless told to ignore
  it, and then ignores every stop id), as are windows, embedding chunks, logit masks, snapshots and parking.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from streamserve.config import SAMPLING_DEFAULTS as SD
from streamserve.config import SESSION_DEFAULTS, SchedulerConfig
from streamserve.engine.inputs import check_ids, check_time
from streamserve.engine.remote.http import BackendUnavailableError, SGLangHTTP
from streamserve.engine.remote.worker import BackendLoop
from streamserve.engine.sampling import check_sampling, check_seed, check_stop
from streamserve.engine.snapshot import ChunkRecord
from streamserve.engine.state import SessionStatus
from streamserve.engine.streams import Delta, End, Outbox, ResponseStream
from streamserve.engine.token_log import TokenLog
from streamserve.engine.work import CHUNK_KINDS, Ack, ChunkKind, Response
from streamserve.errors import (
    CapacityError,
    ChunkTooLargeError,
    ContextLengthError,
    EmptyAppendError,
    InvalidInputError,
    NotSupportedError,
    ResponseInProgressError,
    RewindError,
    SessionClosedError,
)
from streamserve.models import ModelConfig, Tokenizer
from streamserve.sessions import WindowPolicy

DETOK_CONTEXT = 8  # ids before a reply its detokenizer sees (leading spaces), as the engine's runner does


@dataclass(eq=False)
class _Append:
    ids: list[int]
    seq: int
    arrival: float
    capture: float
    deadline: float
    ticket: Future[Ack]


@dataclass(eq=False)
class _Reply:
    response: Response
    rid: str
    seed: int | None
    abort_sent: bool = False


@dataclass(eq=False)
class _Rewind:
    to: int
    done: Future[int]


class RemoteHost(Protocol):
    """What a remote session uses of its backend (`remote.engine.SGLangEngine` is one)."""

    tokenizer: Tokenizer
    config: ModelConfig
    eos_token_ids: tuple[int, ...]
    max_context: int
    limits: SchedulerConfig
    loop: BackendLoop
    http: SGLangHTTP
    stats_: Any  # remote.engine.BackendStats

    def forget(self, session_id: str) -> None: ...

    def backend_failed(self, error: BaseException) -> None: ...


class RemoteSession:
    def __init__(self, engine: RemoteHost, session_id: str, chunk_budget: float = SESSION_DEFAULTS.chunk_budget,
                 seed: int | None = None) -> None:
        self.id, self.engine, self.chunk_budget = session_id, engine, chunk_budget
        self.max_chunk_tokens: int | None = None  # set by servers: a longer chunk is refused at the call
        self.policy = WindowPolicy(window=None, sinks=0)  # the whole context: SGLang sessions have no window
        self.token_ids = TokenLog()  # what SGLang's session holds, by position (written on the backend loop)
        self.timeline: list[ChunkRecord] = []
        self.next_seq = 0
        self.last_active = time.monotonic()
        self.seed, self.seeded = seed, seed is not None
        self.closed = False
        self.backend_id = session_id  # the SGLang session now holding the context (a rewind makes a new one)
        # SGLang's (context tokens, of them served from its cache) for this session's latest request: each turn
        # reuses the session's KV, so the second is the previous context less one (the last token runs again)
        self.cache = (0, 0)
        self.revisions = 0  # rewinds so far (each made a new SGLang session)
        self.lock = threading.Lock()  # the queue, the seq numbers, the state flags
        self._queue: deque[_Append | _Reply | _Rewind] = deque()
        self._queued_tokens = 0  # tokens of queued appends, for the context check at the call
        self.running: _Reply | None = None
        self.wake: asyncio.Event | None = None  # made on the backend loop by `serve`

    # ---- what the service reads -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def state(self) -> SessionStatus:
        return SessionStatus.CLOSED if self.closed else SessionStatus.ACTIVE

    @property
    def pages_held(self) -> int:
        return 0  # the KV is SGLang's

    def queued(self) -> tuple[int, int]:
        """(chunks, tokens) waiting to be sent to SGLang."""
        with self.lock:
            return sum(isinstance(w, _Append) for w in self._queue), self._queued_tokens

    def on_engine_thread(self) -> bool:
        return self.engine.loop.in_thread()

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open a new one")

    # ---- input ----------------------------------------------------------------------------------------
    def submit_chunk(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                     add_special_tokens: bool | None = None, seq: int | None = None,
                     capture_time: float | None = None, deadline: float | None = None,
                     kind: ChunkKind = "text", *, embeds: Any = None) -> Future[Ack]:
        """Queue a chunk; the future resolves to its `Ack` once SGLang holds it. Bad input raises here."""
        self._check_open()
        if embeds is not None:
            raise NotSupportedError("the SGLang backend takes text and token ids, not embedding vectors (audio and "
                                    "images reach it as transcripts and labels)")
        if (text is None) == (token_ids is None):
            raise InvalidInputError("append takes exactly one of text= or token_ids=")
        check_time("capture_time", capture_time)
        check_time("deadline", deadline)
        if kind not in CHUNK_KINDS:
            raise InvalidInputError(f"chunk kind must be one of {list(CHUNK_KINDS)}, got {kind!r}")
        e = self.engine
        with self.lock:
            if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < self.next_seq):
                raise InvalidInputError(f"chunk seq {seq!r} is out of order: the next seq must be >= {self.next_seq}")
            if text is not None:
                if not isinstance(text, str):
                    raise InvalidInputError(f"text must be a str, got {type(text).__name__}")
                first = not self.token_ids and not self._queued_tokens
                ids = e.tokenizer.encode(text, add_special_tokens=first if add_special_tokens is None
                                         else add_special_tokens)
            else:
                ids = check_ids(token_ids, e.config.vocab_size)
            if not ids:
                raise EmptyAppendError("append got an empty chunk; send at least one token or character")
            if self.max_chunk_tokens is not None and len(ids) > self.max_chunk_tokens:
                raise ChunkTooLargeError(f"a chunk of {len(ids)} tokens is over the limit of {self.max_chunk_tokens}; "
                                         "split it into smaller chunks")
            held = len(self.token_ids) + self._queued_tokens
            if held + len(ids) > e.max_context:
                raise ContextLengthError(f"the session holds {held} tokens; {len(ids)} more would pass the model's "
                                         f"context of {e.max_context} (this backend has no window: open a new "
                                         "session)")
            now = time.monotonic()
            capture = now if capture_time is None else float(capture_time)
            seq = self.next_seq if seq is None else seq
            ticket: Future[Ack] = Future()
            ticket.set_running_or_notify_cancel()
            self._put(_Append(ids, seq, now, capture, capture + self.chunk_budget if deadline is None
                              else float(deadline), ticket))
            self._queued_tokens += len(ids)
            self.next_seq = seq + 1
            self.last_active = now
        return ticket

    def append_chunk(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                     add_special_tokens: bool | None = None, seq: int | None = None,
                     capture_time: float | None = None, deadline: float | None = None,
                     kind: ChunkKind = "text", *, embeds: Any = None) -> Ack:
        """`submit_chunk`, waiting for the ack."""
        if self.on_engine_thread():
            raise RuntimeError("a session's blocking append cannot run on the backend's thread")
        return self.submit_chunk(text, token_ids, add_special_tokens, seq, capture_time, deadline, kind,
                                 embeds=embeds).result()

    def append(self, text: str | None = None, token_ids: Sequence[int] | None = None,
               add_special_tokens: bool | None = None, seq: int | None = None, capture_time: float | None = None,
               deadline: float | None = None, kind: ChunkKind = "text", *, embeds: Any = None) -> int:
        return self.append_chunk(text, token_ids, add_special_tokens, seq, capture_time, deadline, kind,
                                 embeds=embeds).tokens

    def _put(self, item: _Append | _Reply | _Rewind) -> None:  # under the lock
        if len(self._queue) >= self.engine.limits.max_queued:
            raise CapacityError(f"session {self.id} has {len(self._queue)} chunks and replies queued (the limit); "
                                "wait for acks before sending more")
        self._queue.append(item)
        self.engine.loop.call(self._poke)

    def _poke(self) -> None:  # on the backend loop
        if self.wake is not None:
            self.wake.set()

    # ---- output ---------------------------------------------------------------------------------------
    def stream(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature, top_p: float = SD.top_p,
               top_k: int = SD.top_k, seed: int | None = SD.seed, stop: Sequence[str] | None = None,
               stop_token_ids: Sequence[int] | None = None,
               allowed_token_ids: Sequence[int] | None = None, draft_token_ids: Sequence[int] | None = None,
               detokenize: bool = True) -> ResponseStream:
        """Request a reply (as `engine.Session.stream`); iterate the returned stream for its `Delta`s. A draft is
        a hint SGLang does not take (the reply is the same without it); text is always decoded."""
        self._check_open()
        e = self.engine
        check_sampling(max_tokens, temperature, top_p, top_k)
        stops = tuple(check_stop(stop))
        check_seed(seed)
        if allowed_token_ids is not None:
            raise NotSupportedError("the SGLang backend cannot constrain a reply to given token ids (robot policies "
                                    "need the engine backend)")
        stop_ids = frozenset(e.eos_token_ids if stop_token_ids is None
                             else check_ids(list(stop_token_ids), e.config.vocab_size))
        if stop_ids and not stop_ids >= set(e.eos_token_ids):
            raise NotSupportedError("on the SGLang backend a reply's stop_token_ids must include the model's EOS ids "
                                    f"{sorted(e.eos_token_ids)} (or be empty: never stop early)")
        with self.lock:
            if not self.token_ids and not self._queued_tokens:
                raise InvalidInputError("a reply needs at least one appended token first")
            if self.running is not None or any(isinstance(w, _Reply) for w in self._queue):
                raise ResponseInProgressError(f"session {self.id} already has a reply running or queued; cancel it "
                                              "first or wait for it to end")
            r = Response(self.id, max_tokens, float(temperature), float(top_p), top_k, stop_ids, stops, None,
                         time.monotonic(), outbox=Outbox(), seeded=self.seeded or seed is not None)
            self._put(_Reply(r, f"{self.id}-{r.id}", seed if seed is not None else self.seed))
            self.last_active = r.arrival
        return ResponseStream(self, r)

    def generate(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature,
                 top_p: float = SD.top_p, seed: int | None = SD.seed,
                 stop_token_ids: Sequence[int] | None = None, top_k: int = SD.top_k) -> list[int]:
        """A reply's token ids (blocking)."""
        st = self.stream(max_tokens, temperature, top_p, top_k, seed, stop_token_ids=stop_token_ids)
        st.wait()
        return st.token_ids

    def cancel(self) -> None:
        """End the running reply and drop queued ones; what the running one produced stays in the session."""
        with self.lock:
            dropped = [w for w in self._queue if isinstance(w, _Reply)]
            for w in dropped:
                self._queue.remove(w)
            running = self.running
            if running is not None:
                running.response.cancelled = True
        for w in dropped:
            _end(w.response, "cancelled")
        if running is not None:
            self.engine.loop.call(self.engine.loop.spawn, self.abort(running))

    async def abort(self, item: _Reply) -> None:
        """On the backend loop: ask SGLang to abort the reply (once)."""
        if not item.abort_sent and not item.response.finished:
            item.abort_sent = True
            await self.engine.http.abort(item.rid)

    # ---- rewind, and what this backend cannot do ----------------------------------------------------
    def rewind(self, to: int | None = None, to_seq: int | None = None) -> int:
        """Forget everything after position `to` (or after chunk `to_seq`); -> the new length. A running reply
        ends first. Blocking: it waits for SGLang to hold the kept tokens in a new session."""
        self._check_open()
        if (to is None) == (to_seq is None):
            raise RewindError("rewind takes exactly one of to= or to_seq=")
        if self.on_engine_thread():
            raise RuntimeError("a rewind cannot run on the backend's thread")
        with self.lock:
            if any(isinstance(w, _Append) for w in self._queue):
                raise RewindError("this session has chunks still queued; wait for their acks, then rewind")
            if to_seq is not None:
                rec = next((r for r in self.timeline if r.kind == "input" and r.seq == to_seq), None)
                if rec is None:
                    raise RewindError(f"no chunk with seq {to_seq!r} on this session's timeline")
                to = rec.end
            if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to <= len(self.token_ids):
                raise RewindError(f"cannot rewind to {to!r}: the session holds positions 0..{len(self.token_ids)}")
            done: Future[int] = Future()
            self._put(_Rewind(to, done))
        self.cancel()  # a reply in progress ends (the rewind runs after it)
        return done.result()

    def snapshot(self, path: Any = None) -> Any:
        raise NotSupportedError("the SGLang backend cannot snapshot a session (its KV cache is SGLang's)")

    def park(self) -> None:
        raise NotSupportedError("the SGLang backend does not park sessions (SGLang manages its own KV memory)")

    # ---- close ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """End the session: a running reply ends ("closed"), queued chunks fail, SGLang's session is closed.
        Closing twice is harmless."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            queued, self._queue = list(self._queue), deque()
            self._queued_tokens = 0
            running = self.running
        self.engine.forget(self.id)
        err = SessionClosedError(f"session {self.id} was closed")
        for w in queued:
            _fail(w, err, "closed")
        self.engine.loop.call(self._poke)  # its server task ends, and closes SGLang's session
        if running is not None:
            running.response.cancelled = True
            self.engine.loop.call(self.engine.loop.spawn, self.abort(running))

    def fail(self, error: BaseException) -> None:
        """The backend died: everything queued or running ends with `error`, and the session is closed."""
        with self.lock:
            self.closed = True
            queued, self._queue = list(self._queue), deque()
            running, self.running = self.running, None
        self.engine.forget(self.id)
        for w in queued + ([running] if running is not None else []):
            _fail(w, error, "error")

    # ---- the backend loop's side: remote/serve.py runs the FIFO ------------------------------------------
    def take(self) -> _Append | _Reply | _Rewind | None:
        with self.lock:
            item = self._queue.popleft() if self._queue else None
            if isinstance(item, _Reply):
                self.running = item
            if isinstance(item, _Append):
                self._queued_tokens -= len(item.ids)
            return item


def _end(r: Response, reason: str, error: BaseException | None = None) -> None:
    if r.finished:
        return
    r.finished = True
    tail = r.finish_text()
    if tail:
        r.outbox.put(Delta(tail, []))
    r.outbox.put(End(reason, error))


def _fail(item: _Append | _Reply | _Rewind, error: BaseException, reason: str) -> None:
    if isinstance(item, _Reply):
        _end(item.response, reason, error if reason == "error" else None)
    elif isinstance(item, _Append):
        if not item.ticket.done():
            item.ticket.set_exception(error)
    elif not item.done.done():
        item.done.set_exception(error)


__all__ = ["BackendUnavailableError", "RemoteSession"]
