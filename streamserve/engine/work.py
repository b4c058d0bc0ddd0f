"""The plain dataclasses that cross between the session API, the scheduler, the runner and the loop.

No torch here: the scheduler is pure Python and its tests drive it with made-up runner outputs.
A `Chunk` is one appended piece of input; a `Response` one requested reply. Each session has a FIFO of
them; each step the scheduler turns the heads of those FIFOs into a `Plan` of `WorkItem`s, the runner
executes the plan into a `StepOutput`, and the scheduler's `update` turns that into `Event`s for the
callers (acks, deltas, done, errors).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

ChunkKind = Literal["text", "audio", "video", "image", "state"]
CHUNK_KINDS: tuple[str, ...] = ("text", "audio", "video", "image", "state")  # only "video" is ever shed
WorkKind = Literal["append", "decode", "verify"]
FinishReason = Literal["length", "stop", "context", "cancelled", "closed"]

_response_ids = itertools.count(1)


class Detokenizer(Protocol):
    def push(self, ids: list[int]) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class Ack:
    """What the caller of an append learns once its chunk is in the KV cache (or was shed)."""

    seq: int
    tokens: int  # tokens appended (0 when shed)
    queue_ms: float  # from submission to the first step that ran part of the chunk
    compute_ms: float  # from that step's start to the end of the step that finished the chunk
    deadline_missed: bool = False  # the chunk finished after its deadline
    shed: bool = False  # dropped under overload (video only); nothing of it entered the session


@dataclass(eq=False)
class Chunk:
    session_id: str
    seq: int
    token_ids: list[int]
    kind: str  # one of CHUNK_KINDS; only "video" may be shed under overload
    arrival: float  # engine clock (time.monotonic) at submission
    capture_time: float
    deadline: float
    done: int = 0  # tokens of it already in the KV cache
    started: float | None = None  # start of the first step that ran part of it
    ticket: Any = None  # how the loop delivers the Ack (a concurrent.futures.Future)
    # an embedding chunk: its vectors [T, hidden] (a torch tensor on the engine's device, owned by the chunk);
    # token_ids then holds T placeholder ids. None: a chunk of token ids
    embeds: Any = None

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.done


@dataclass(eq=False)
class Response:
    session_id: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: frozenset[int]
    stop: tuple[str, ...]  # stop strings: the reply ends before the first of them (not included in the text)
    draws: Any  # the reply's randomness by token position (`sampling.Draws`; opaque here)
    arrival: float
    id: str = field(default_factory=lambda: f"r{next(_response_ids)}")
    produced: int = 0
    cancelled: bool = False
    finished: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    prev_token_at: float | None = None  # the token before the last (inter-token latency)
    detok: Detokenizer | None = None  # set by the runner at the first token (it knows the session's context)
    held_text: str = ""  # text held back because it may be the start of a stop string
    outbox: Any = None  # where the loop delivers deltas and the end (an Outbox)
    draft_len: int = 0  # tokens to draft for the next step (set by the runner from the session's controller)
    seeded: bool = False  # a seed fixes its draws: draft lengths then follow acceptance only, not timings
    # constrained decoding: the ids the reply may emit (robot action tokens), a tuple as submitted, replaced on the
    # engine thread by a bool mask [V] on the device (`sampling.allowed_mask`); the sampler sets every other logit
    # to -inf before drawing. None: the whole vocabulary
    allowed: Any = None
    # the caller's guess at the reply's tokens by position (a robot's previous chunk of actions, shifted by the
    # steps since): verified like a drafter's proposal, so a right guess makes several tokens in one forward and a
    # wrong one changes nothing in the output. () : none
    draft: tuple[int, ...] = ()
    detokenize: bool = True  # False: token ids only (action tokens have no text worth decoding)
    opened: bool = False  # its first token came (its timeline record is open)
    forwards: int = 0  # model forwards that produced its tokens (the append's it started from counts)
    drafted: int = 0  # draft tokens verified (a drafter's or the caller's)
    accepted: int = 0  # of those, accepted

    def add_token(self, token: int) -> tuple[str, bool]:
        """Count a generated token; -> (text that may be shown now, whether a stop string was reached)."""
        self.produced += 1
        if self.detok is None:
            return "", False
        return self._release(self.detok.push([token]))

    def finish_text(self) -> str:
        """At the end: the held-back text and any incomplete UTF-8 bytes (as U+FFFD)."""
        text = self.held_text + (self.detok.flush() if self.detok is not None else "")
        self.held_text = ""
        if self.stop:
            for s in self.stop:
                if s in text:
                    text = text[:text.index(s)]
        return text

    def _release(self, text: str) -> tuple[str, bool]:
        buf = self.held_text + text
        if not self.stop:
            self.held_text = ""
            return buf, False
        hits = [buf.index(s) for s in self.stop if s in buf]
        if hits:
            self.held_text = ""
            return buf[:min(hits)], True
        # hold back the longest tail of the text that could still grow into a stop string
        hold = max((k for s in self.stop for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held_text = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False


@dataclass(frozen=True)
class WorkItem:
    session_id: str
    kind: WorkKind
    n_tokens: int  # tokens of input this step runs (decode: 1; the runner may also run a pending token)
    work: Chunk | Response = field(compare=False)  # the head of the session's queue
    # append: (chunk, tokens of it) in queue order, the head first: consecutive chunks of a session share a step
    parts: tuple[tuple[Chunk, int], ...] = field(default=(), compare=False)
    # append: the reply queued right behind the chunks this step finishes; its first token (with a draft, its
    # first tokens) comes from this step's forward instead of a step of its own
    then: Response | None = field(default=None, compare=False)


@dataclass
class Plan:
    """One engine step: at most one item per session, plus what the step drops without running."""

    items: list[WorkItem]
    shed: list[Chunk] = field(default_factory=list)  # video chunks dropped under overload
    cancelled: list[Response] = field(default_factory=list)  # responses that end without running
    created: float = 0.0

    def as_dict(self) -> dict[str, int]:
        """{session_id: n_tokens}"""
        return {i.session_id: i.n_tokens for i in self.items}

    @property
    def empty(self) -> bool:
        return not (self.items or self.shed or self.cancelled)


@dataclass
class ItemResult:
    token: int | None = None  # decode: the sampled token
    tokens: list[int] | None = None  # verify: the tokens emitted (accepted drafts, then the target's next)
    context_full: bool = False  # decode: the session reached the model's context; nothing was sampled
    error: BaseException | None = None  # this item failed (the others in the step are unaffected)
    fatal: bool = False  # the error fails the whole session (it is closed), not only this item


@dataclass
class StepOutput:
    results: dict[str, ItemResult]  # by session id, one per plan item
    started: float
    finished: float
    then: dict[str, ItemResult] = field(default_factory=dict)  # the replies started by appends (WorkItem.then)


# ---- events: what the loop delivers to callers -------------------------------------------------------
@dataclass
class ChunkAcked:
    chunk: Chunk
    ack: Ack


@dataclass
class ChunkFailed:
    chunk: Chunk
    error: BaseException


@dataclass
class TokenProduced:
    response: Response
    token: int
    text: str


@dataclass
class ResponseDone:
    response: Response
    reason: FinishReason
    text: str = ""  # the final held-back text, if any


@dataclass
class ResponseFailed:
    response: Response
    error: BaseException


@dataclass
class SessionFailed:
    session_id: str
    error: BaseException


Event = ChunkAcked | ChunkFailed | TokenProduced | ResponseDone | ResponseFailed | SessionFailed
