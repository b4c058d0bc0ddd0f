"""What every drafter is: `propose(session, k, reply)` -> up to k tokens that may follow the session (and their
draft probabilities when the drafter has them), `release(session)` when the session closes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from streamserve.engine.session import Session
    from streamserve.engine.work import Response

MAX_DRAFT = 7  # drafted tokens per verification at most: with the pending token, a step of 8 (a graph width)


@dataclass
class DraftProposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] the drafter's distributions (None: deterministic)
    seconds: float | None = None  # time spent drafting them, catching up excluded (None: all of propose)


class Drafter(Protocol):
    name: str

    def propose(self, session: Session, k: int, reply: Response | None = None) -> DraftProposal:
        """Up to k tokens that may follow the session; `reply` gives the sampling parameters (a drafter with
        probabilities draws from its own distribution filtered the same way)."""
        ...

    def release(self, session: Session) -> None: ...
