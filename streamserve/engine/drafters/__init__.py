"""Drafters for speculative decoding: what may follow a session, checked by one target forward.

- "ngram": prompt lookup over the session's own history (`ngram.py`).
- "draft:PATH": a small model with the target's tokenizer, its KV on a pool of its own (`model.py`).
- "auto": n-gram, plus a draft model when the engine's drafter names one, or on a GPU the one shipped with
  the default model (on a CPU a draft forward costs too much of a target forward to pay: docs/benchmarks.md);
  each session uses the one that gives the most tokens per unit of cost (`adaptive.py`).
- "mtp": multi-token-prediction heads. None of the supported architectures (Qwen3-MoE, Qwen3, Mixtral,
  OLMoE, Llama) has them, so this is refused with the reason (docs/architecture.md).
- "none": plain decoding.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from streamserve.engine.drafters.adaptive import SpecController, VerifyCosts
from streamserve.engine.drafters.base import MAX_DRAFT, DraftContext, Drafter, DraftProposal
from streamserve.engine.drafters.ngram import NgramDrafter
from streamserve.engine.loading import DEFAULT_MODEL_DIR, resolve_model_path
from streamserve.errors import InvalidInputError

if TYPE_CHECKING:
    from streamserve.models import ModelConfig, Tokenizer
    from streamserve.models.ops import Ops
    from streamserve.sessions import KVPool

DRAFTER_CHOICES = ("none", "ngram", "auto", "mtp", "draft:PATH")

__all__ = ["DRAFTER_CHOICES", "MAX_DRAFT", "DraftContext", "DraftProposal", "Drafter", "DrafterCatalog",
           "NgramDrafter", "UnknownDrafterError"]


class UnknownDrafterError(InvalidInputError):
    code = "unknown_drafter"


class DrafterCatalog:
    """The engine's drafters: the default spec, the drafter objects (one per kind, shared by sessions; each keeps
    its per-session state by session id), the measured verification costs, and the totals that
    `engine.stats()["speculative"]` and the metrics report (`on_observe`: drafter, proposed, accepted)."""

    def __init__(self, model_path: Path, config: ModelConfig, tokenizer: Tokenizer, ops: Ops, pool: KVPool,
                 on_observe: Callable[[str, int, int], None] | None = None) -> None:
        self.model_path, self.config, self.tokenizer, self.ops, self.pool = model_path, config, tokenizer, ops, pool
        self.on_observe = on_observe
        self.spec, self.max_draft = "none", MAX_DRAFT
        self.costs = VerifyCosts()  # what a verification of each width costs on this engine (measured)
        self.totals: dict[str, dict[str, int]] = {}  # per drafter: verifications, proposed, accepted
        self._objects: dict[str, Drafter] = {}
        self._lock = threading.Lock()  # sessions open from worker threads: one object per kind, ever

    def configure(self, spec: str, max_draft: int = MAX_DRAFT) -> None:
        """The default drafter ("none", "ngram", "draft:PATH", "auto") and the most tokens drafted per
        verification (1..7). Checked now: an unknown or unusable drafter, or max_draft out of range, fails."""
        if isinstance(max_draft, bool) or not isinstance(max_draft, int) or not 1 <= max_draft <= MAX_DRAFT:
            raise InvalidInputError(f"max_draft must be an integer in [1, {MAX_DRAFT}] (a verification step of at "
                                    f"most {MAX_DRAFT + 1} tokens), got {max_draft!r}")
        self.make(spec)
        self.spec, self.max_draft = spec, max_draft

    def controller(self, spec: str | None = None) -> SpecController | None:
        """A new session's controller for `spec` (None: the default); None when it drafts nothing."""
        drafters = self.make(self.spec if spec is None else spec)
        return SpecController(drafters, self.costs, self.max_draft, self.observe) if drafters else None

    def make(self, spec: str | None) -> list[Drafter]:
        """The drafters a spec names ([] for "none"); typed errors for unknown or unavailable ones."""
        if spec is None or spec == "none":
            return []
        if not isinstance(spec, str):
            raise UnknownDrafterError(f"drafter must be a string, one of {list(DRAFTER_CHOICES)}; got {spec!r}")
        if spec == "ngram":
            return [self.shared("ngram", NgramDrafter)]
        if spec == "auto":
            drafters: list[Drafter] = [self.shared("ngram", NgramDrafter)]
            draft = self.default_draft_path()
            return [*drafters, self.draft_model(str(draft))] if draft is not None else drafters
        if spec.startswith("draft:"):
            return [self.draft_model(spec.removeprefix("draft:"))]
        if spec == "mtp":
            raise UnknownDrafterError(f"drafter 'mtp': {self.config.architecture} has no "
                                      "multi-token-prediction heads (none of the supported architectures does); "
                                      "use 'ngram', 'draft:PATH' or 'auto'")
        raise UnknownDrafterError(f"unknown drafter {spec!r}; choose one of {list(DRAFTER_CHOICES)}")

    def shared(self, name: str, factory: Callable[[], Drafter]) -> Drafter:
        with self._lock:
            if name not in self._objects:
                self._objects[name] = factory()
            return self._objects[name]

    def forget(self, session_id: str) -> None:
        """A session was garbage-collected without close(): every drafter frees what it holds for it."""
        for d in list(self._objects.values()):
            d.release(session_id)

    def check_integrity(self, open_ids: set[str]) -> None:
        """AssertionError unless every drafter holds state for open sessions only (and its pages add up)."""
        for d in list(self._objects.values()):
            stale = d.held() - open_ids
            assert not stale, f"drafter {d.name} still holds state for closed sessions {sorted(stale)[:4]}"

    def draft_model(self, path: str) -> Drafter:
        from streamserve.engine.drafters.model import DraftModelDrafter  # loads only when a draft model is named

        resolved = str(resolve_model_path(path))
        return self.shared(f"draft:{resolved}", lambda: DraftModelDrafter.load(resolved, self.tokenizer, self.config,
                                                                               self.ops, self.pool))

    def default_draft_path(self) -> Path | None:
        """The draft model "auto" adds: the one the default spec names, else on a GPU the one shipped beside
        the embedded default model."""
        if self.spec.startswith("draft:"):
            return Path(self.spec.removeprefix("draft:"))
        shipped = DEFAULT_MODEL_DIR.parent / "default-draft"
        usable = self.model_path == DEFAULT_MODEL_DIR and (shipped / "config.json").exists()
        return shipped if usable and self.pool.device.type == "cuda" else None

    def observe(self, drafter: str, proposed: int, accepted: int) -> None:
        t = self.totals.setdefault(drafter, {"verifications": 0, "proposed": 0, "accepted": 0})
        t["verifications"] += 1
        t["proposed"] += proposed
        t["accepted"] += accepted
        if self.on_observe is not None:
            self.on_observe(drafter, proposed, accepted)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per drafter: verifications, proposed, accepted, acceptance rate, mean accepted length."""
        return {name: {**t, "acceptance_rate": round(t["accepted"] / max(1, t["proposed"]), 4),
                       "mean_accepted_length": round(t["accepted"] / max(1, t["verifications"]), 3)}
                for name, t in self.totals.items()}
