"""What every drafter is: `propose(session, k)` -> up to k tokens that may follow the session (and their
draft probabilities when the drafter has them), `release(session)` when the session closes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from streamserve.engine.session import Session

MAX_DRAFT = 7  # drafted tokens per verification at most: with the pending token, a step of 8 (a graph width)


@dataclass
class DraftProposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] the drafter's distributions (None: deterministic)


class Drafter(Protocol):
    name: str

    def propose(self, session: Session, k: int) -> DraftProposal: ...

    def release(self, session: Session) -> None: ...
