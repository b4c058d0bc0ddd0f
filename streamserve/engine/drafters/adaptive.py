"""How much to draft, per session, and with which drafter: from observed acceptance and measured cost.

With a per-token acceptance rate a, drafting k tokens emits (1 - a^(k+1)) / (1 - a) tokens per
verification on average, and a verification of k+1 tokens costs r(k+1) times a one-token step
(`VerifyCosts`, measured on this engine). The controller drafts the k that maximises tokens per unit of
cost, and none when no k beats plain decoding; then it probes again every `PROBE_EVERY` tokens, so a
session whose text turns repetitive starts drafting again. With several drafters ("auto"), each session
uses the one with the best acceptance so far (untried ones start at the prior, so each gets tried).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from streamserve.engine.drafters.base import MAX_DRAFT, Drafter

PRIOR_ACCEPTANCE = 0.6
EMA = 0.3  # weight of the newest observation
PROBE_EVERY = 16  # tokens between probes while drafting does not pay
PROBE_K = 2
PRIOR_COST_PER_TOKEN = 0.15  # r(w) = 1 + 0.15 (w - 1) until measured


class VerifyCosts:
    """Seconds of a one-session step by its width (EMA), measured by the engine: r(w) = t(w) / t(1)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def observe(self, width: int, seconds: float) -> None:
        old = self.seconds.get(width)
        self.seconds[width] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def ratio(self, width: int) -> float:
        one, w = self.seconds.get(1), self.seconds.get(width)
        if width == 1:
            return 1.0
        if one is None or w is None:
            return 1 + PRIOR_COST_PER_TOKEN * (width - 1)
        return max(w / one, 1.0)


@dataclass
class DrafterStats:
    acceptance: float = PRIOR_ACCEPTANCE
    verifications: int = 0
    proposed: int = 0
    accepted: int = 0


@dataclass
class SpecController:
    drafters: list[Drafter]
    costs: VerifyCosts
    max_draft: int = MAX_DRAFT
    on_observe: Callable[[str, int, int], None] | None = None  # the engine's totals and metrics
    stats: dict[str, DrafterStats] = field(default_factory=dict)
    probe_in: int = 0

    def __post_init__(self) -> None:
        self.stats = {d.name: DrafterStats() for d in self.drafters}
        self.current = self.drafters[0]

    def next_k(self) -> int:
        """How many tokens to draft for the next step (0: decode plainly)."""
        self.current = max(self.drafters, key=lambda d: self.stats[d.name].acceptance)
        if self.probe_in > 0:
            self.probe_in -= 1
            return min(PROBE_K, self.max_draft) if self.probe_in == 0 else 0
        a = min(self.stats[self.current.name].acceptance, 0.999)
        best_k, best = 0, 1.0
        for k in range(1, self.max_draft + 1):
            value = (1 - a ** (k + 1)) / (1 - a) / self.costs.ratio(k + 1)
            if value > best * 1.02:  # a margin: drafting must clearly pay
                best_k, best = k, value
        if best_k == 0:
            self.probe_in = PROBE_EVERY
        return best_k

    def observe(self, drafter: str, proposed: int, accepted: int) -> None:
        """A verification of `proposed` drafted tokens accepted the first `accepted`."""
        if proposed == 0:
            return
        st = self.stats[drafter]
        st.verifications += 1
        st.proposed += proposed
        st.accepted += accepted
        # per-token acceptance: accepting a of k (stopping at the first rejection) estimates a / (a + 1) when
        # rejected, and 1 when all were accepted
        rate = 1.0 if accepted == proposed else accepted / (accepted + 1)
        st.acceptance = (1 - EMA) * st.acceptance + EMA * rate
        if self.on_observe is not None:
            self.on_observe(drafter, proposed, accepted)
