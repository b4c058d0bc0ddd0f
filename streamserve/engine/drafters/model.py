"""A draft model: a small checkpoint (folder or GGUF file) with the target's tokenizer proposes the next tokens.

Its KV cache lives on a pool of its own (its layers and heads differ from the target's, so its pages
cannot share the target's tensors), sized at an eighth of the target's. Per session the drafter keeps a
paged KV under the session's window policy and the stretch of history it holds; before each proposal it
catches up with the session's history (the tokens accepted since, in chunks), drafts k tokens one forward
each, then moves its length back to the real history, so rejected drafts never linger. A rewind (the
session's `revisions` counter) makes it find the common prefix and cut back to it; a new, restored or
evicted session's draft state is rebuilt on first use — for a windowed session from its last window only
(a draft need not be exact, and an endless stream must not be replayed from its start). It never fails a
session: when its pool is full it frees the least recently used session's draft state; when it still
cannot draft (pool, context), it proposes nothing and does not try again for RETRY_AFTER tokens.
The draft model reads token ids only: its view of the history starts after the last embedding vector (the
session's placeholder id), and while the last token is one it proposes nothing.
Bounded on an endless stream: the history it holds is a `TokenLog` that forgets what its own window dropped,
as the session's does; its view never starts before the session's oldest kept token (`TokenLog.base`), and
a draft state that fell behind what the session forgot starts over.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamserve.engine.drafters.base import DraftProposal
from streamserve.engine.drafters.verify import target_probs
from streamserve.engine.token_log import TokenLog
from streamserve.errors import CapacityError, ContextLengthError, InvalidInputError, RewindError, StreamserveError
from streamserve.kernels.reference import MIN_TEMPERATURE, argmax_last
from streamserve.models import CausalLM, ModelConfig, Tokenizer, load_model, open_pretrained
from streamserve.sessions import DEFAULT_REWIND_REACH, KVPool, PagedSessionKV, layer_groups, split_pages

if TYPE_CHECKING:
    from streamserve.engine.drafters.base import DraftContext
    from streamserve.engine.work import Response
    from streamserve.models.ops import Ops

CATCH_UP_CHUNK = 256  # history tokens per draft forward when catching up
RETRY_AFTER = 64  # tokens of history after a failed proposal before the drafter tries that session again
POOL_SHARE = 8  # the draft pool gets 1/POOL_SHARE of the target pool's bytes (at least MIN_POOL_PAGES pages)
MIN_POOL_PAGES = 256
FORGET_BATCH = 256  # an endless session's draft history forgets the positions its window dropped this many at a time


class DraftTokenizerError(InvalidInputError):
    code = "draft_tokenizer_mismatch"


@dataclass
class DraftState:
    kv: PagedSessionKV
    offset: int = 0  # the history position its view starts at (a windowed session: its last window)
    tokens: TokenLog = field(default_factory=TokenLog)  # history[offset:offset + len(tokens)], what the KV holds
    revision: int = 0


class DraftModelDrafter:
    def __init__(self, name: str, model: CausalLM, pool: KVPool) -> None:
        self.name, self.model, self.pool = name, model, pool
        self.states: OrderedDict[str, DraftState] = OrderedDict()  # by session id, least recently used first
        self.failed_at: dict[str, int] = {}  # session id -> history length when drafting last failed

    @classmethod
    def load(cls, path: str, tokenizer: Tokenizer, target: ModelConfig, ops: Ops, target_pool: KVPool
             ) -> DraftModelDrafter:
        """The draft model at `path` for a target with this tokenizer, config, kernel ops and KV pool (its own
        pool gets 1/POOL_SHARE of the target pool's bytes, on the same device, in the same dtype)."""
        folder = Path(path)  # a checkpoint folder or a GGUF file
        pretrained = open_pretrained(folder)
        cfg, tok = pretrained.config, pretrained.tokenizer()
        if tok.vocab() != tokenizer.vocab() or cfg.vocab_size != target.vocab_size:
            raise DraftTokenizerError(f"the draft model {folder} does not share the target's tokenizer "
                                      f"(vocabulary {cfg.vocab_size} vs {target.vocab_size}, or different ids): "
                                      "a draft must use exactly the target's tokenizer")
        dev, dtype, page = target_pool.device, target_pool.dtype, target_pool.page_size
        model = load_model(pretrained.checkpoint, cfg, dev, dtype, ops)
        # a draft with native sliding-window layers frees their old pages as the target does (the target's reach)
        reach = max((g.reach for g in target_pool.groups if g.window is not None), default=DEFAULT_REWIND_REACH)
        groups = layer_groups(cfg.sliding_windows, reach)
        token_bytes = KVPool.bytes_per_page(1, cfg.num_kv_heads, cfg.head_dim, 1, dtype)  # one token, one layer
        budget = max(target_pool.total_bytes // POOL_SHARE, MIN_POOL_PAGES * page * token_bytes * cfg.num_layers)
        pages = split_pages(groups, budget, token_bytes, page, cfg.max_position_embeddings)
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pages, page, dtype, dev, groups)
        return cls(f"draft:{folder.name}", model, pool)

    # ---- the Drafter interface ------------------------------------------------------------------------
    def propose(self, session: DraftContext, k: int, reply: Response | None = None) -> DraftProposal:
        failed = self.failed_at.get(session.id)
        if failed is not None and len(session.token_ids) - failed < RETRY_AFTER:
            return DraftProposal([])
        try:
            return self._propose(session, k, reply)
        except StreamserveError:  # its pool is full even after evicting, or past its context: draft nothing
            self.release(session.id)
            self.failed_at[session.id] = len(session.token_ids)
            return DraftProposal([])

    def release(self, session_id: str) -> None:
        self.failed_at.pop(session_id, None)
        st = self.states.pop(session_id, None)
        if st is not None:
            st.kv.release()

    def held(self) -> set[str]:
        """(Also checks that every page of its own pool is free or held by exactly one session's draft KV.)"""
        self.pool.allocator.check([st.kv.held_pages for st in self.states.values()])
        return set(self.states) | set(self.failed_at)

    # ---- internals ------------------------------------------------------------------------------------
    def _state(self, session: DraftContext) -> DraftState:
        st = self.states.get(session.id)
        if st is None:
            st = DraftState(PagedSessionKV(self.pool, session.kv.policy, self.model.cfg.max_position_embeddings),
                            revision=session.revisions)
            self._start_over(st, session)
            self.states[session.id] = st
        self.states.move_to_end(session.id)
        if st.revision != session.revisions:  # the history was cut: keep the common prefix only
            self._cut(st, st.offset + _common_prefix(session.token_ids, st), session)
            st.revision = session.revisions
        ph = session.placeholder_id
        h = session.token_ids
        # the session forgot tokens it never ran, or a vector came since (the view starts after it): start over
        if st.offset + len(st.tokens) < _kept_from(h) or ph in h[st.offset + len(st.tokens):]:
            self._start_over(st, session)
        return st

    def _start_over(self, st: DraftState, session: DraftContext) -> None:
        """An empty draft cache viewing the history from its start, or for a windowed session from its last
        window (plus the pending token)."""
        st.kv.release()
        st.kv.length, st.tokens = 0, TokenLog()
        pol, h = session.kv.policy, session.token_ids
        st.offset = 0 if pol.window is None else max(0, len(h) - pol.window - pol.sinks - 1, _kept_from(h))
        last_vector = next((i for i in range(len(h) - 1, st.offset - 1, -1) if h[i] == session.placeholder_id), -1)
        st.offset = max(st.offset, last_vector + 1)

    def _cut(self, st: DraftState, n: int, session: DraftContext) -> None:
        """Keep history[:n] in the draft cache (starting over where its window already dropped that)."""
        local = n - st.offset
        try:
            if local < 0:
                raise RewindError("before the draft's view")
            st.kv.check_rewind(local)
            st.kv.truncate(local)
            del st.tokens[local:]
        except RewindError:
            self._start_over(st, session)

    def _forward(self, st: DraftState, ids: list[int], drop: bool = True) -> torch.Tensor:
        """Run ids after the draft KV; -> logits [V] of the last. Frees LRU states when the pool is full."""
        while True:
            try:
                st.kv.begin(len(ids))
                break
            except CapacityError:
                victim = next((sid for sid, s in self.states.items() if s is not st), None)
                if victim is None:
                    raise
                self.states.pop(victim).kv.release()
        try:
            logits = self.model(torch.tensor(ids, dtype=torch.long, device=self.pool.device), st.kv)
        except BaseException:
            st.kv.abort()
            raise
        st.kv.commit(drop=drop)
        st.tokens.extend(ids)
        return logits

    def _propose(self, session: DraftContext, k: int, reply: Response | None) -> DraftProposal:
        h = session.token_ids
        if not h or h[-1] == session.placeholder_id:  # after a vector: nothing of token ids to draft from
            return DraftProposal([])
        if session.kv.policy.window is None and len(h) + k > self.model.cfg.max_position_embeddings:
            raise ContextLengthError("past the draft model's context")
        st = self._state(session)
        if st.offset + len(st.tokens) >= len(h):  # it holds the whole history: run the last token again
            self._cut(st, len(h) - 1, session)
        logits = None
        t0 = time.perf_counter()
        behind = len(h) - st.offset - len(st.tokens)
        while st.offset + len(st.tokens) < len(h):
            start = st.offset + len(st.tokens)
            logits = self._forward(st, h[start:start + CATCH_UP_CHUNK])
        assert logits is not None
        if behind > CATCH_UP_CHUNK // 8:  # a first fill (new, restored, evicted): not what drafting costs
            t0 = time.perf_counter()  # (catching up with the few tokens accepted since the last draft is)
        sampled = reply is not None and reply.temperature >= MIN_TEMPERATURE
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            if sampled:
                assert reply is not None
                q = target_probs(logits[None].float(), reply.temperature, reply.top_k, reply.top_p)[0]
                tok = int(reply.draws.pick(q[None], len(h) + i, 3)[0])
                probs.append(q)
            else:
                tok = int(argmax_last(logits.reshape(-1)))
            tokens.append(tok)
            if i < k - 1:
                logits = self._forward(st, [tok], drop=False)
        self._cut(st, len(h), session)  # the drafts leave the draft cache: it holds the real history only
        st.kv.drop_outside_window()
        _forget_dropped(st)
        return DraftProposal(tokens, torch.stack(probs) if sampled else None, time.perf_counter() - t0)


def _kept_from(h: Sequence[int]) -> int:
    """The oldest position of an endless session's kept tail (0: everything is kept)."""
    return h.base if isinstance(h, TokenLog) else 0


def _forget_dropped(st: DraftState) -> None:
    """The draft history forgets the positions its KV dropped for good (its sink pages' and the one after them
    stay, as a rewind may still reach those), FORGET_BATCH at least at a time: it holds at most that many more
    than the draft KV's positions."""
    kv = st.kv
    if kv.policy.window is None:
        return
    head = -(-kv.policy.sinks // kv.pool.page_size) * kv.pool.page_size + 1
    base = max(g.oldest_kept(g.table, kv.length) for g in kv.groups)
    if base - max(head, st.tokens.base) >= FORGET_BATCH:
        st.tokens.forget_before(base, keep_first=head)


def _common_prefix(h: Sequence[int], st: DraftState) -> int:
    """How many tokens of the draft's view agree with the history h (from st.offset) after a cut. Positions
    either side forgot are taken as agreeing: a cut keeps the positions before it, and a draft need not be exact."""
    gaps = [st.tokens.gap] if st.tokens.gap else []  # in the draft's positions
    if isinstance(h, TokenLog) and h.gap is not None:
        gaps.append((h.gap[0] - st.offset, h.gap[1] - st.offset))
    n, limit = 0, min(len(h) - st.offset, len(st.tokens))
    while n < limit:
        skip = next((hi for lo, hi in gaps if lo <= n < hi), None)
        if skip is not None:
            n = skip
        elif h[st.offset + n] != st.tokens[n]:
            break
        else:
            n += 1
    return min(n, limit)
