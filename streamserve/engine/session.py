"""`Session`: a persistent conversation whose KV cache stays on the device between chunks.

Each `append` runs only the new tokens against the cached prefix. Generated tokens join the session
too; the last one enters the KV lazily, with the next append or generate, so a reply costs exactly one
forward per generated token. `token_ids` is the one record of the session; the tokens not yet in the
KV are always `token_ids[kv.length:]`, so an exception or interrupt anywhere leaves the two consistent.
"""

from __future__ import annotations

import enum
import math
import secrets
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamserve.config import SAMPLING_DEFAULTS as SD
from streamserve.engine.sampling import check_sampling, sample
from streamserve.engine.snapshot import ChunkRecord, Snapshot
from streamserve.errors import (
    ContextLengthError,
    EmptyAppendError,
    InvalidInputError,
    RewindError,
    SessionClosedError,
    TokenOutOfRangeError,
)
from streamserve.sessions import PagedSessionKV

if TYPE_CHECKING:
    from streamserve.engine.engine import Engine


class SessionState(enum.Enum):
    OPEN = "open"  # idle between chunks: may be parked under memory pressure
    RESPONDING = "responding"  # a reply is being generated
    PARKED = "parked"  # KV offloaded to host memory; restored on the next use
    CLOSED = "closed"


def _release_locked(lock: threading.RLock, kv: PagedSessionKV) -> None:
    with lock:
        kv.release()


class Session:
    def __init__(self, engine: Engine, kv: PagedSessionKV, seed: int | None = None) -> None:
        self.id = secrets.token_urlsafe(16)
        self.engine = engine
        self.kv = kv
        self.token_ids: list[int] = []  # everything appended or generated, in order
        self.timeline: list[ChunkRecord] = []
        self.last_active = time.monotonic()
        self._next_seq = 0
        self._responding = False
        self._reply: Iterator[int] | None = None  # the reply being generated, if any
        self._reply_start = 0
        self._logits: torch.Tensor | None = None  # [V] after the first `_logits_at` tokens
        self._logits_at = -1
        self._generator = torch.Generator(device=engine.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self.closed = False
        # a session dropped without close() still gives its pages back when it is collected
        self._finalizer = weakref.finalize(self, _release_locked, engine._lock, kv)

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
        return SessionState.RESPONDING if self._responding else SessionState.OPEN

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
               deadline: float | None = None) -> int:
        """Append a chunk of text or token ids; returns the number of tokens appended.

        `add_special_tokens` (text only): run the tokenizer's post-processor (e.g. add BOS). None means
        yes for the first chunk of a session and no after it; pass False for chat-templated text, which
        carries its own special tokens. `seq` (default: the next number) must grow from chunk to chunk;
        it and `capture_time`/`deadline` are kept on the session's timeline.
        """
        self._check_open()
        if (text is None) == (token_ids is None):
            raise InvalidInputError("append takes exactly one of text= or token_ids=")
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < self._next_seq):
            raise InvalidInputError(f"chunk seq {seq!r} is out of order: the next seq must be >= {self._next_seq}")
        for name, t in (("capture_time", capture_time), ("deadline", deadline)):
            if t is not None and (not isinstance(t, (int, float)) or not math.isfinite(t)):
                raise InvalidInputError(f"{name} must be a finite number, got {t!r}")
        if text is not None:
            if not isinstance(text, str):
                raise InvalidInputError(f"text must be a str, got {type(text).__name__}")
            special = not self.token_ids if add_special_tokens is None else add_special_tokens
            ids = self.engine.tokenizer.encode(text, add_special_tokens=special)
        else:
            ids = self._check_ids(token_ids)
        if not ids:
            raise EmptyAppendError("append got an empty chunk; send at least one token or character")
        start = len(self.token_ids)
        self._run(ids)
        seq = self._next_seq if seq is None else seq
        self._next_seq = seq + 1
        self.timeline.append(ChunkRecord("input", seq, start, len(self.token_ids), capture_time, deadline))
        return len(ids)

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

    def _forward(self, ids: list[int]) -> torch.Tensor:
        self.last_active = time.monotonic()
        return self.engine.forward(self.kv, ids, session=self)

    def _run(self, ids: list[int]) -> None:
        """Forward pending + ids; on success they join the session and the logits of the last one are kept."""
        if self.kv.length > len(self.token_ids):  # an interrupt lost a committed step's bookkeeping
            self.kv.truncate(len(self.token_ids))
        chunk = self._pending + ids
        limit = self.engine.config.max_position_embeddings
        if not self.kv.rolling and self.kv.length + len(chunk) > limit:
            raise ContextLengthError(f"appending {len(ids)} tokens to a session of {len(self.token_ids)} "
                                     f"would exceed the model's context of {limit}; rewind, or open the session "
                                     "with a window for endless streams")
        logits = self._forward(chunk)
        self.token_ids.extend(ids)
        self._logits, self._logits_at = logits, self.kv.length

    def _catch_up(self) -> torch.Tensor:
        """The logits after the whole session, running the pending token first if there is one."""
        if not self._pending and self._logits_at != len(self.token_ids):
            # an interrupt landed between a forward and its bookkeeping: run the last token again
            self.kv.truncate(self.kv.length - 1)
        if self._pending:
            self._logits = self._forward(self._pending)
            self._logits_at = self.kv.length
        assert self._logits is not None
        return self._logits

    # ---- output ---------------------------------------------------------------------------------------
    def iter_generate(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature,
                      top_p: float = SD.top_p, seed: int | None = SD.seed,
                      stop_token_ids: Sequence[int] | None = None, top_k: int = SD.top_k) -> Iterator[int]:
        """Yield generated token ids one by one. Stops after `max_tokens`, at a stop token (yielded), or
        at the model's context. `stop_token_ids=None` means the model's EOS ids; `()` never stops early."""
        self._check_open()
        check_sampling(max_tokens, temperature, top_p, top_k)
        if not self.token_ids:
            raise InvalidInputError("generate needs at least one appended token first")
        stops = set(self.engine.eos_token_ids if stop_token_ids is None else stop_token_ids)
        gen = self._generator if seed is None else torch.Generator(device=self.engine.device).manual_seed(seed)
        self._end_reply()  # one reply at a time: a new one ends the previous
        self._reply = self._generate(max_tokens, temperature, top_p, top_k, gen, stops)
        return self._reply

    def _end_reply(self) -> None:
        """Stop a reply in progress (its tokens so far stay in the session)."""
        reply, self._reply = self._reply, None
        if reply is not None:
            reply.close()  # type: ignore[attr-defined]

    def _generate(self, max_tokens: int, temperature: float, top_p: float, top_k: int, gen: torch.Generator,
                  stops: set[int]) -> Iterator[int]:
        limit = None if self.kv.rolling else self.engine.config.max_position_embeddings
        start = self._reply_start = len(self.token_ids)
        self._responding = True
        try:
            for _ in range(max_tokens):
                self._check_open()
                if limit is not None and len(self.token_ids) >= limit:  # the context is full: the reply ends
                    return
                tok = sample(self._catch_up(), temperature, top_p, gen, top_k)
                self.token_ids.append(tok)  # pending from here on: it enters the KV with the next forward
                yield tok
                if tok in stops:
                    return
        finally:
            self._responding = False
            self.last_active = time.monotonic()
            if len(self.token_ids) > start:
                self.timeline.append(ChunkRecord("reply", None, start, len(self.token_ids)))

    def generate(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature,
                 top_p: float = SD.top_p, seed: int | None = SD.seed,
                 stop_token_ids: Sequence[int] | None = None, top_k: int = SD.top_k) -> list[int]:
        """Generate a reply; the tokens are returned and also become part of the session."""
        return list(self.iter_generate(max_tokens, temperature, top_p, seed, stop_token_ids, top_k))

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
        self._end_reply()  # a reply in progress ends here: its timeline record is written, then cut
        if to_seq is not None:
            rec = next((r for r in self.timeline if r.kind == "input" and r.seq == to_seq), None)
            if rec is None:
                raise RewindError(f"no chunk with seq {to_seq!r} on this session's timeline")
            to = rec.end
        assert to is not None
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to <= len(self.token_ids):
            raise RewindError(f"cannot rewind to {to!r}: the session holds positions 0..{len(self.token_ids)}")
        if to == len(self.token_ids):
            return to
        # the KV keeps all but the last kept token, which runs again to give the logits at `to`
        keep = max(0, to - 1)
        if self.kv.parked is not None:
            self.engine.admit(self, self.kv.unpark, self.kv.pages_needed(0))
        self.kv.check_rewind(keep)
        self.kv.truncate(keep)
        del self.token_ids[to:]
        self._logits, self._logits_at = None, -1
        self.timeline = [r if r.end <= to else ChunkRecord(r.kind, r.seq, r.start, to, r.capture_time, r.deadline)
                         for r in self.timeline if r.start < to]
        self._next_seq = max((r.seq for r in self.timeline if r.seq is not None), default=-1) + 1
        self.last_active = time.monotonic()
        return to

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
        timeline = list(self.timeline)
        if self._responding and len(self.token_ids) > self._reply_start:  # the reply so far
            timeline.append(ChunkRecord("reply", None, self._reply_start, len(self.token_ids)))
        snap = Snapshot(model=self.engine.fingerprint, model_name=self.engine.name, page_size=self.kv.pool.page_size,
                        policy=self.kv.policy, token_ids=list(self.token_ids), timeline=timeline,
                        kv_length=self.kv.length, pages=pages,
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
        """Free the session's KV memory. Closing twice is harmless."""
        if not self.closed:
            self._end_reply()
            self.closed = True
            with self.engine._lock:
                self.kv.release()
                self.kv.parked = None
            self.engine._release(self)
