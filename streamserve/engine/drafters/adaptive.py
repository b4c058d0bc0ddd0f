"""How much to draft, per session, and with which drafter: from observed acceptance and measured cost.

With a per-token acceptance rate a, drafting k tokens emits (1 - a^(k+1)) / (1 - a) tokens per
verification on average, and a verification of k+1 tokens costs r(k+1) times a one-token step
(`VerifyCosts`, measured on this engine). The controller drafts the k that maximises tokens per unit of
cost, and none when no k beats plain decoding; then it probes again every `PROBE_EVERY` tokens, so a
session whose text turns repetitive starts drafting again. With several drafters ("auto"), each session
uses the one whose best draft length gives the most tokens per unit of cost so far (untried ones start at the
prior, so each gets tried).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from streamserve.engine.drafters.base import MAX_DRAFT, Drafter

PRIOR_ACCEPTANCE = 0.6
EMA = 0.3  # weight of the newest observation
PROBE_EVERY = 8  # tokens between probes while drafting does not pay
PROBE_K = 2
PRIOR_COST_PER_TOKEN = 0.15  # r(w) = 1 + 0.15 (w - 1) until measured


class VerifyCosts:
    """Seconds of a one-session step by its width (EMA), measured by the engine: r(w) = t(w) / t(1)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def observe(self, width: int, seconds: float) -> None:
        old = self.seconds.get(width)
        self.seconds[width] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def one_step(self) -> float | None:
        return self.seconds.get(1)

    def ratio(self, width: int) -> float:
        one, w = self.seconds.get(1), self.seconds.get(width)
        if width == 1:
            return 1.0
        if one is None or w is None:
            return 1 + PRIOR_COST_PER_TOKEN * (width - 1)
        return max(w / one, 1.0)


@dataclass
class DrafterStats:
    # per-token acceptance, the geometric MLE over recent verifications: accepted / (accepted + rejections),
    # each an EMA (a verification that stops at a rejection contributes its accepted drafts and one rejection)
    accepted_ema: float = PRIOR_ACCEPTANCE / (1 - PRIOR_ACCEPTANCE)
    rejected_ema: float = 1.0
    seconds_per_draft: float = 0.0  # EMA: time to draft one token
    verifications: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted_ema / (self.accepted_ema + self.rejected_ema)


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

    def next_k(self, fixed_costs: bool = False) -> int:
        """How many tokens to draft for the next step (0: decode plainly), and with which drafter (the one
        whose best draft length gives the most tokens per unit of cost). `fixed_costs` (seeded replies): the
        prior cost model instead of measured timings, so the choice depends on what was accepted only."""
        choices = [(self._best(d, fixed_costs), d) for d in self.drafters]
        (best_k, _), self.current = max(choices, key=lambda c: c[0][1])
        if self.probe_in > 0:
            self.probe_in -= 1
            return min(PROBE_K, self.max_draft) if self.probe_in == 0 else 0
        if best_k == 0:
            self.probe_in = PROBE_EVERY
        return best_k

    def _best(self, drafter: Drafter, fixed_costs: bool) -> tuple[int, float]:
        """-> (k, tokens per unit of cost) of the best draft length for this drafter (k = 0: value 1)."""
        st = self.stats[drafter.name]
        a = min(st.acceptance, 0.999)
        one = None if fixed_costs else self.costs.one_step()
        draft_cost = st.seconds_per_draft / one if one else 0.0  # drafting one token, in one-step units
        best_k, best = 0, 1.0
        for k in range(1, self.max_draft + 1):
            ratio = 1 + PRIOR_COST_PER_TOKEN * k if fixed_costs else self.costs.ratio(k + 1)
            value = (1 - a ** (k + 1)) / (1 - a) / (ratio + k * draft_cost)
            if value > best * 1.02:  # a margin: drafting must clearly pay
                best_k, best = k, value
        return best_k, best

    def observe_drafting(self, drafter: str, tokens: int, seconds: float) -> None:
        if tokens:
            st = self.stats[drafter]
            per = seconds / tokens
            st.seconds_per_draft = per if st.seconds_per_draft == 0.0 else (1 - EMA) * st.seconds_per_draft + EMA * per

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
        st.accepted_ema = (1 - EMA) * st.accepted_ema + EMA * accepted
        st.rejected_ema = (1 - EMA) * st.rejected_ema + EMA * (accepted < proposed)
        if self.on_observe is not None:
            self.on_observe(drafter, proposed, accepted)
