"""`SessionState`: everything one session is, the part the engine's step operates on.

The user's handle (`session.Session`) validates and submits; the runner, speculation, the drafters, the
batched forward and the graphs read and change this object through its public attributes and methods,
and never see the handle. It holds the session's KV (`PagedSessionKV`), its token ids (the one record of
the session: the tokens not yet in the KV are always `token_ids[kv.length:]`), its timeline, the logits
kept after the last forward and the position they belong to, the next chunk seq, the sampling generator,
the revision counter (cuts of the history), the drafting controller and the vectors of embedding chunks.

Embedding chunks: a position whose input was a vector holds `placeholder_id` in `token_ids` (the
tokenizer's pad id, else the model's last id: `engine.placeholder_id`) and its vector [hidden] in
`vectors`, a side table by position. Which positions are vectors is known from that table alone (a real
token equal to the placeholder id is just a token). The forward embeds the placeholder and then puts the
vector in its row. Drafters treat `placeholder_id` as a break in the history (they never propose it or
draft through it).

An endless (windowed) session holds a bounded host state (`trim`, after each commit, on the engine thread):
once the window dropped a position's pages no rewind can reach it again nor attention read it, so the token
ids (`token_ids` is a `TokenLog`: absolute positions, only the kept ones stored), the timeline records and the
vectors of such positions are forgotten. Kept for ever: the sink pages' positions and the one after them (a
rewind into the sinks stays possible); kept as the stream goes on: the positions from the oldest one the KV
still holds (and at least the last `RECENT_TOKENS`, the detokenizer's and drafters' context); vectors only
from the oldest position a rewind can still run again.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from streamserve.engine.snapshot import ChunkRecord
from streamserve.engine.token_log import TokenLog
from streamserve.errors import ContextLengthError
from streamserve.sessions import PagedSessionKV

if TYPE_CHECKING:
    from streamserve.engine.drafters.adaptive import SpecController

RECENT_TOKENS = 64  # an endless session keeps at least its last this many token ids (a reply's detokenizer
# starts from the 8 before it; drafters look back over them), whatever its window


class SessionStatus(enum.Enum):
    OPEN = "open"  # idle between chunks: may be parked under memory pressure
    RESPONDING = "responding"  # a reply is being generated
    PARKED = "parked"  # KV offloaded to host memory; restored on the next use
    CLOSED = "closed"


class SessionState:
    def __init__(self, session_id: str, kv: PagedSessionKV, max_positions: int, device: torch.device,
                 seed: int | None = None, placeholder_id: int = 0) -> None:
        self.id = session_id
        self.kv = kv
        self.max_positions = max_positions  # the model's context (limits sessions with absolute positions)
        self.device = device
        self.placeholder_id = placeholder_id
        # everything appended or generated, by position (placeholders at vectors); an endless session keeps part
        self.token_ids = TokenLog()
        self.timeline: list[ChunkRecord] = []
        self.vectors: dict[int, torch.Tensor] = {}  # position -> [hidden] vector of an embedding chunk
        self.logits: torch.Tensor | None = None  # [V] fp32 after the first `logits_at` tokens
        self.logits_at = -1
        self.next_seq = 0
        self.revisions = 0  # counts cuts of the history (rewinds): drafters' indexes rebuild after one
        self.last_active = time.monotonic()
        self.closed = False
        self.spec: SpecController | None = None  # speculative decoding: drafters and draft length
        self._trimmed: tuple[int, int, int] | None = None  # what `trim` last saw (pages held, KV pages, vectors)
        self.seeded = seed is not None
        # draws each reply's seed: plain Python, so the caller's thread (the server's event loop) never calls torch
        self.generator = random.Random(seed)  # None: seeded from the OS

    @property
    def pending(self) -> list[int]:
        """The tokens of the session not yet in the KV cache (at most the last generated one, or after a
        rewind or restore the last kept token)."""
        return self.token_ids[self.kv.length:]

    def check_context(self, n: int) -> None:
        """ContextLengthError unless n more tokens fit after the session (absolute positions only)."""
        if not self.kv.rolling and len(self.token_ids) + n > self.max_positions:
            raise ContextLengthError(f"appending {n} tokens to a session of {len(self.token_ids)} would exceed the "
                                     f"model's context of {self.max_positions}; rewind, or open the session with a "
                                     "window for endless streams")

    def keep_logits(self, logits: torch.Tensor | None) -> None:
        """The logits [V] after the tokens now in the KV (None: the next step must run a token again)."""
        self.logits, self.logits_at = logits, (self.kv.length if logits is not None else -1)

    # ---- embedding vectors --------------------------------------------------------------------------
    def add_vectors(self, start: int, rows: torch.Tensor) -> None:
        """Record the vectors rows [n, hidden] of positions start .. start + n - 1 (their ids are placeholders).
        The table holds views of the chunk's block; those kept for ever get storage of their own."""
        for i in range(rows.shape[0]):
            self.vectors[start + i] = rows[i]
        self._own_kept(start)

    def _kept_until(self) -> int:
        """Vectors at positions up to this one are never trimmed (-1: none are kept for ever). With a window:
        the positions in the sink pages; without one nothing is trimmed, and a chunk's block is kept whole."""
        if self.kv.policy.window is None:
            return -1
        page = self.kv.pool.page_size
        return -(-self.kv.policy.sinks // page) * page

    def _own_kept(self, start: int = 0) -> None:
        """Give the vectors kept for ever (from `start` on) storage of their own: a view would pin the whole
        block it came from (a chunk of any length, or everything parked or restored with it) for ever."""
        end = self._kept_until()
        for p in range(start, end + 1):
            v = self.vectors.get(p)
            if v is not None and v.untyped_storage().nbytes() > v.numel() * v.element_size():
                self.vectors[p] = v.clone()

    def vector_rows(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(position - start, vector [hidden]) of the vector positions in [start, end)."""
        if not self.vectors:
            return []
        return [(p - start, self.vectors[p]) for p in range(start, end) if p in self.vectors]

    # ---- bounded history (an endless session) -------------------------------------------------------
    def forgettable(self) -> tuple[int, int] | None:
        """The positions [head, base) no step and no rewind can need again (None: no window, or the KV is parked;
        the span may be empty). A rewind keeping `keep` tokens in the KV runs position `keep` again: the KV allows
        that for every position up to the end of the sink pages (`head` - 1), and past them only where every layer
        group still holds the pages a query there reads, which (pages leave oldest first) is never below the
        oldest non-sink page a group holds; below that no step reads a key either. `base` is the start of the
        latest such page (over the groups)."""
        kv = self.kv
        if kv.policy.window is None or kv.parked is not None:
            return None
        head = self._kept_until() + 1
        return head, max(g.oldest_kept(g.table, kv.length) for g in kv.groups)

    def trim(self) -> None:
        """Forget what no step and no rewind can need again (after a commit: the window may have dropped pages):
        the token ids and the timeline records before `base` (see `forgettable`; the sinks' are kept, and the last
        `RECENT_TOKENS`), and the vectors no rewind can run again."""
        kv = self.kv
        # what it forgets moves with the pages held only (and new vectors): once a page, not every token
        seen = (kv.held_count, kv.length // kv.pool.page_size, len(self.vectors))
        span = None if seen == self._trimmed else self.forgettable()
        self._trimmed = seen
        if span is None:
            return
        head, reach = span
        self._trim_vectors(head, reach)
        base = min(reach, kv.length - RECENT_TOKENS)
        if base <= head:
            return
        self.token_ids.forget_before(base, keep_first=head)
        # timeline records wholly in [head, base) go (they are in position order: one run after the sinks'),
        # but the latest input one (a rewind renumbers the chunks after the last one before the point it keeps)
        # and the last one (the record a reply or a split chunk is growing)
        tl, i = self.timeline, 0
        while i < len(tl) and tl[i].start < head:
            i += 1
        j = i
        while j < len(tl) - 1 and tl[j].end <= base:
            j += 1
        inputs = [k for k in range(i, j) if tl[k].kind == "input"]
        keep = [tl[inputs[-1]]] if inputs else []
        if j - i > len(keep):
            self.timeline = tl[:i] + keep + tl[j:]

    def _trim_vectors(self, head: int, base: int) -> None:
        """Free the vectors no rewind can run again: those in [head, base), then in position order up to the
        first one a rewind can still reach."""
        kv = self.kv
        free = []
        for p in self.vectors:  # in position order; stops at the first one kept (no walk over the table)
            if p < head:
                continue
            if p >= base and (p >= kv.length or kv.can_rewind(p)):
                break
            free.append(p)
        for p in free:
            del self.vectors[p]

    def park(self) -> None:
        """Offload the KV and the vectors to host memory; the KV's pages go back to the pool."""
        self.kv.park()
        self.vectors = _moved(self.vectors, torch.device("cpu"))
        self._own_kept()

    def unpark(self) -> None:
        """Bring a parked KV (CapacityError: nothing taken) and the vectors back to the device."""
        self.kv.unpark()
        self.vectors = _moved(self.vectors, self.device)
        self._own_kept()

    # ---- cuts of the history ------------------------------------------------------------------------
    def check_cut(self, to: int) -> None:
        """RewindError unless the KV can go back to where `to` tokens are kept (parked or not: a refused cut
        must not bring a parked session back). The KV keeps all but the last kept token, which runs again to
        give the logits."""
        if to < len(self.token_ids):
            self.kv.check_rewind(min(max(0, to - 1), self.kv.length))

    def cut(self, to: int, renumber: bool) -> None:
        """Forget everything after the first `to` tokens (after `check_cut`). `renumber`: the next chunk seq
        follows the last chunk kept (a user's rewind)."""
        if to == len(self.token_ids):
            return
        # (an endless session keeps the ids this needs: `check_cut` lets through only a rewind into the sink pages
        # or one whose last kept token, run again, sits where the KV still holds pages)
        self.kv.truncate(min(max(0, to - 1), self.kv.length))
        del self.token_ids[to:]
        for p in [p for p in self.vectors if p >= to]:
            del self.vectors[p]
        self.revisions += 1
        self._trimmed = None
        self.keep_logits(None)
        self.timeline = [r if r.end <= to else ChunkRecord(r.kind, r.seq, r.start, to, r.capture_time, r.deadline)
                         for r in self.timeline if r.start < to]
        if renumber:
            self.next_seq = max((r.seq for r in self.timeline if r.seq is not None), default=-1) + 1
        self.last_active = time.monotonic()

    def release(self) -> None:
        """Give back every KV page and parked copy (close, expiry, orphan reclaim), and the drafters' state."""
        self.kv.release()
        self.kv.parked = None
        self.vectors.clear()
        for d in self.spec.drafters if self.spec is not None else ():
            d.release(self.id)

    def load(self, token_ids: TokenLog | list[int], timeline: list[ChunkRecord], kv_length: int, next_seq: int,
             logits: torch.Tensor | None, logits_at: int, vectors: Mapping[int, torch.Tensor]) -> None:
        """Take the record of a snapshot (its KV pages are loaded separately)."""
        self.token_ids = token_ids.copy() if isinstance(token_ids, TokenLog) else TokenLog(token_ids)
        self._trimmed = None
        self.timeline = list(timeline)
        self.kv.length = kv_length
        self.next_seq = next_seq
        self.logits, self.logits_at = logits, logits_at
        self.vectors = dict(sorted(vectors.items()))
        self._own_kept()


def _moved(vectors: dict[int, torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
    """The vectors by position on `device`, moved in one copy ([n, hidden] stacked)."""
    if not vectors or next(iter(vectors.values())).device == device:
        return vectors
    block = torch.stack(list(vectors.values())).to(device)
    return {p: block[i] for i, p in enumerate(vectors)}
