"""What every drafter is: `propose(state, k, reply)` -> up to k tokens that may follow the session (and their
draft probabilities when the drafter has them), `release(session_id)` when the session closes. A drafter keeps
its per-session state itself, keyed by session id, frees it in `release`, and says whose it holds (`held`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from streamserve.engine.token_log import TokenLog
    from streamserve.engine.work import Response
    from streamserve.sessions import PagedSessionKV

MAX_DRAFT = 7  # drafted tokens per verification at most: with the pending token, a step of 8 (a graph width)


@dataclass
class DraftProposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] the drafter's distributions (None: deterministic)
    seconds: float | None = None  # time spent drafting them, catching up excluded (None: all of propose)


class DraftContext(Protocol):
    """What a drafter reads of a session (`state.SessionState` is one)."""

    id: str
    token_ids: TokenLog  # the history (an endless session's kept part); `placeholder_id` marks a vector
    revisions: int  # moves when the history is cut (a rewind)
    placeholder_id: int
    kv: PagedSessionKV  # its window policy


class Drafter(Protocol):
    name: str

    def propose(self, session: DraftContext, k: int, reply: Response | None = None) -> DraftProposal:
        """Up to k tokens that may follow the session; `reply` gives the sampling parameters (a drafter with
        probabilities draws from its own distribution filtered the same way)."""
        ...

    def release(self, session_id: str) -> None:
        """Free what the drafter holds for this session (closed, collected, or its drafter failed)."""
        ...

    def held(self) -> set[str]:
        """The ids of the sessions it holds state for (a leak checker compares them with the open ones)."""
        ...
