"""Speculative steps of a reply, for the runner: draft, then verify in one target forward, then keep what
was accepted.

A verification step runs [pending token, d_1 .. d_k] through the target like an append (all k+1 logits
kept), `drafters.verify` picks the tokens to emit, and the rejected drafts leave the KV cache by moving
its length back (`kv.truncate`: whole pages past it return to the pool; nothing is copied). Only then do
pages outside the window go back, so a rejection never needs a page the window already dropped. Emitted
tokens stop at the reply's max_tokens and after a stop token, exactly as plain decoding would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from streamserve.engine.drafters.base import DraftProposal
from streamserve.engine.drafters.verify import verify
from streamserve.engine.snapshot import ChunkRecord
from streamserve.engine.state import SessionState
from streamserve.engine.work import Detokenizer, Response

# a reply's detokenizer, given the session's last tokens as context
DetokenizerFactory = Callable[[list[int]], Detokenizer]

log = logging.getLogger("streamserve")


def draft(s: SessionState, r: Response, k: int, context_limit: int | None) -> DraftProposal:
    """Up to k drafted tokens for the reply's next step: fewer near max_tokens or the context's end, and no
    more than fit in the pages a plain step could take (drafting never makes a reply fail for memory).
    A drafter that fails proposes nothing (logged); it never fails the session."""
    assert s.spec is not None
    room = r.max_tokens - r.produced - 1  # the verification emits one more token than it accepts
    if context_limit is not None:
        room = min(room, context_limit - len(s.token_ids) - 1)
    k = min(k, room, _page_room(s, k))
    if k <= 0:
        return DraftProposal([])
    drafter = s.spec.current
    t0 = time.perf_counter()
    try:
        proposal = drafter.propose(s, k, r)
    except Exception:
        log.exception("streamserve: drafter %s failed; drafting nothing this step", drafter.name)
        drafter.release(s.id)
        proposal = DraftProposal([])
    seconds = proposal.seconds if proposal.seconds is not None else time.perf_counter() - t0
    s.spec.observe_drafting(drafter.name, len(proposal.tokens), seconds)
    proposal.tokens = proposal.tokens[:k]
    if proposal.probs is not None:
        proposal.probs = proposal.probs[:k]
    return proposal


def given(s: SessionState, r: Response, k: int, context_limit: int | None, base: int = 1) -> DraftProposal:
    """Up to k tokens of the caller's draft (`r.draft`, by reply position) for the reply's next verification:
    the positions from the next token to emit on, within max_tokens, the context and the pages a plain step of
    `base` tokens could take (an append carrying its reply's draft: base = the append's tokens)."""
    room = r.max_tokens - r.produced - 1
    if context_limit is not None:
        room = min(room, context_limit - len(s.token_ids) - base)
    k = min(k, room, _page_room(s, k, base))
    return DraftProposal(list(r.draft[r.produced:r.produced + k])) if k > 0 else DraftProposal([])


def _page_room(s: SessionState, k: int, base: int = 1) -> int:
    """The most drafts a step of `base` tokens (a plain decode: 1) can carry without more pages than the session's
    cap or the pool's free pages allow beyond what the step alone needs (in every layer group)."""
    kv = s.kv
    alloc = kv.pool.allocator
    plain = kv.group_pages_needed(base)
    held = [kv.held_in(g) for g in range(len(plain))]
    free = [alloc.free_in(g) for g in range(len(plain))]
    while k > 0:
        extra = kv.group_pages_needed(base + k)
        if all((kv.page_cap is None or h + e <= kv.page_cap) and e - p <= max(0, f - p)
               for h, e, p, f in zip(held, extra, plain, free, strict=True)):
            return k
        k -= 1
    return 0


def accept(s: SessionState, r: Response, proposal: DraftProposal, logits: torch.Tensor,
           new_detokenizer: DetokenizerFactory) -> list[int]:
    """The target's logits [k+1, V] over [pending, drafts] are in; -> the tokens emitted. The session keeps
    the pending token and the accepted drafts in its KV, the last emitted token becomes pending."""
    if r.allowed is not None:  # a constrained reply: drafts are checked against what it may emit
        logits = logits.masked_fill(~r.allowed, float("-inf"))
    emitted = verify(logits, proposal.tokens, proposal.probs, r.temperature, r.top_p, r.top_k, r.draws,
                     len(s.token_ids))
    accepted = len(emitted) - 1
    if not r.draft and s.spec is not None:  # a drafter's proposal (the caller's own draft teaches it nothing)
        s.spec.observe(s.spec.current.name, len(proposal.tokens), accepted)
    r.forwards, r.drafted, r.accepted = r.forwards + 1, r.drafted + len(proposal.tokens), r.accepted + accepted
    emitted = emitted[:r.max_tokens - r.produced]
    stop = next((i for i, t in enumerate(emitted) if t in r.stop_token_ids), None)
    if stop is not None:
        emitted = emitted[:stop + 1]
    extend_reply(s, r, emitted, new_detokenizer)
    s.kv.truncate(len(s.token_ids) - 1)  # the rejected drafts leave the cache
    s.kv.drop_outside_window()
    s.trim()  # what the window dropped: ids, records, vectors
    s.keep_logits(None)  # the next step runs the new pending token
    return emitted


def extend_reply(s: SessionState, r: Response, tokens: list[int], new_detokenizer: DetokenizerFactory) -> None:
    """Generated tokens join the session and the reply's timeline record."""
    if not r.opened:  # the reply's first token: its record opens here
        r.opened = True
        if r.detokenize:  # its text follows the session so far
            h, start = s.token_ids, max(0, len(s.token_ids) - 8)
            r.detok = new_detokenizer([h[p] for p in range(start, len(h)) if p not in s.vectors])  # no vectors
        s.timeline.append(ChunkRecord("reply", None, len(s.token_ids), len(s.token_ids)))
    s.token_ids.extend(tokens)
    rec = s.timeline[-1]
    s.timeline[-1] = ChunkRecord("reply", None, rec.start, len(s.token_ids))
