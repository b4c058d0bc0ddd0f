"""A draft model: a small checkpoint with the target's tokenizer proposes the next tokens itself.

Its KV cache lives on a pool of its own (its layers and heads differ from the target's, so its pages
cannot share the target's tensors), sized at an eighth of the target's. Per session the drafter keeps a
paged KV under the session's window policy and the tokens it holds; before each proposal it catches up
with the session's history (the tokens accepted since, in chunks), drafts k tokens one forward each, then
moves its length back to the real history, so rejected drafts never linger. A rewind (the session's
`revisions` counter) makes it find the common prefix and cut back to it; a restored session's draft state
is rebuilt from the history on first use. It never fails a session: when its pool is full it frees the
least recently used session's draft state, and if that is not enough it proposes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamserve.engine.drafters.base import DraftProposal
from streamserve.engine.drafters.verify import target_probs
from streamserve.errors import CapacityError, InvalidInputError, RewindError, StreamserveError
from streamserve.kernels.reference import MIN_TEMPERATURE
from streamserve.models import CausalLM, ModelConfig, Tokenizer, load_model
from streamserve.sessions import KVPool, PagedSessionKV

if TYPE_CHECKING:
    from streamserve.engine.engine import Engine
    from streamserve.engine.session import Session
    from streamserve.engine.work import Response

CATCH_UP_CHUNK = 256  # history tokens per draft forward when catching up
POOL_SHARE = 8  # the draft pool gets 1/POOL_SHARE of the target pool's bytes (at least MIN_POOL_PAGES pages)
MIN_POOL_PAGES = 256


class DraftTokenizerError(InvalidInputError):
    code = "draft_tokenizer_mismatch"


@dataclass
class DraftState:
    kv: PagedSessionKV
    tokens: list[int] = field(default_factory=list)  # the history the draft KV holds
    revision: int = 0


class DraftModelDrafter:
    def __init__(self, name: str, model: CausalLM, pool: KVPool) -> None:
        self.name, self.model, self.pool = name, model, pool
        self.states: OrderedDict[str, DraftState] = OrderedDict()  # by session id, least recently used first

    @classmethod
    def load(cls, engine: Engine, path: str) -> DraftModelDrafter:
        folder = Path(path)
        cfg = ModelConfig.from_file(folder / "config.json")
        tok = Tokenizer.from_dir(folder)
        if tok.vocab() != engine.tokenizer.vocab() or cfg.vocab_size != engine.config.vocab_size:
            raise DraftTokenizerError(f"the draft model {folder} does not share the target's tokenizer "
                                      f"(vocabulary {cfg.vocab_size} vs {engine.config.vocab_size}, or different ids): "
                                      "a draft must use exactly the target's tokenizer")
        model = load_model(folder, cfg, engine.device, engine.dtype, engine.model.ops)
        per_page = KVPool.bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, engine.pool.page_size,
                                         engine.dtype)
        target_bytes = engine.pool.num_pages * KVPool.bytes_per_page(
            engine.config.num_layers, engine.config.num_kv_heads, engine.config.head_dim, engine.pool.page_size,
            engine.dtype)
        pages = max(MIN_POOL_PAGES, target_bytes // POOL_SHARE // per_page)
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pages, engine.pool.page_size, engine.dtype,
                      engine.device)
        return cls(f"draft:{folder.name}", model, pool)

    # ---- the Drafter interface ------------------------------------------------------------------------
    def propose(self, session: Session, k: int, reply: Response | None = None) -> DraftProposal:
        try:
            return self._propose(session, k, reply)
        except StreamserveError:  # its pool is full even after evicting, or past its context: draft nothing
            self.release(session)
            return DraftProposal([])

    def release(self, session: Session) -> None:
        st = self.states.pop(session.id, None)
        if st is not None:
            st.kv.release()

    # ---- internals ------------------------------------------------------------------------------------
    def _state(self, session: Session) -> DraftState:
        st = self.states.get(session.id)
        if st is None:
            st = DraftState(PagedSessionKV(self.pool, session.kv.policy, self.model.cfg.max_position_embeddings),
                            revision=session.revisions)
            self.states[session.id] = st
        self.states.move_to_end(session.id)
        if st.revision != session.revisions:  # the history was cut: keep the common prefix only
            h, n = session.token_ids, 0
            while n < min(len(h), len(st.tokens)) and h[n] == st.tokens[n]:
                n += 1
            self._cut(st, n)
            st.revision = session.revisions
        return st

    def _cut(self, st: DraftState, n: int) -> None:
        try:
            st.kv.check_rewind(n)
            st.kv.truncate(n)
            del st.tokens[n:]
        except RewindError:  # the window already dropped what that needs: start over
            st.kv.release()
            st.kv.length, st.tokens = 0, []

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
        st.tokens += ids
        return logits

    def _propose(self, session: Session, k: int, reply: Response | None) -> DraftProposal:
        st = self._state(session)
        h = session.token_ids
        if len(st.tokens) >= len(h):  # it holds the whole history: run the last token again for its logits
            self._cut(st, len(h) - 1)
        logits = None
        while len(st.tokens) < len(h):
            start = len(st.tokens)
            logits = self._forward(st, h[start:start + CATCH_UP_CHUNK])
        assert logits is not None
        sampled = reply is not None and reply.temperature >= MIN_TEMPERATURE
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            if sampled:
                assert reply is not None
                q = target_probs(logits[None].float(), reply.temperature, reply.top_k, reply.top_p)[0]
                tok = int(torch.multinomial(q, 1, generator=reply.draws.at(len(h) + i, 3)))
                probs.append(q)
            else:
                tok = int(torch.argmax(logits))
            tokens.append(tok)
            if i < k - 1:
                logits = self._forward(st, [tok], drop=False)
        self._cut(st, len(h))  # the drafts leave the draft cache: it holds the real history only
        st.kv.drop_outside_window()
        return DraftProposal(tokens, torch.stack(probs) if sampled else None)
