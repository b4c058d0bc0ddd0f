"""Drafters for speculative decoding: what may follow a session, checked by one target forward.

- "ngram": prompt lookup over the session's own history (`ngram.py`).
- "draft:PATH": a small model with the target's tokenizer, its KV on a pool of its own (`model.py`).
- "auto": n-gram, and the draft model when one is configured or shipped with the model; each session uses
  the one whose drafts it accepts most (`adaptive.py`).
- "mtp": multi-token-prediction heads. None of the supported architectures (Qwen3-MoE, Qwen3, Mixtral,
  OLMoE, Llama) has them, so this is refused with the reason (docs/architecture.md).
- "none": plain decoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamserve.engine.drafters.base import MAX_DRAFT, Drafter, DraftProposal
from streamserve.engine.drafters.ngram import NgramDrafter
from streamserve.errors import InvalidInputError

if TYPE_CHECKING:
    from streamserve.engine.engine import Engine

DRAFTER_CHOICES = ("none", "ngram", "auto", "mtp", "draft:PATH")

__all__ = ["DRAFTER_CHOICES", "MAX_DRAFT", "DraftProposal", "Drafter", "NgramDrafter", "UnknownDrafterError",
           "make_drafters"]


class UnknownDrafterError(InvalidInputError):
    code = "unknown_drafter"


def make_drafters(spec: str | None, engine: Engine) -> list[Drafter]:
    """The drafters a spec names ([] for "none"); typed errors for unknown or unavailable ones."""
    if spec is None or spec == "none":
        return []
    if not isinstance(spec, str):
        raise UnknownDrafterError(f"drafter must be a string, one of {list(DRAFTER_CHOICES)}; got {spec!r}")
    if spec == "ngram":
        return [engine.shared_drafter("ngram", NgramDrafter)]
    if spec == "auto":
        drafters: list[Drafter] = [engine.shared_drafter("ngram", NgramDrafter)]
        default_draft = engine.default_draft_path()
        if default_draft is not None:
            drafters.append(engine.draft_model(str(default_draft)))
        return drafters
    if spec.startswith("draft:"):
        return [engine.draft_model(spec.removeprefix("draft:"))]
    if spec == "mtp":
        raise UnknownDrafterError(f"drafter 'mtp': {engine.config.architecture} has no multi-token-prediction heads "
                                  "(none of the supported architectures does); use 'ngram', 'draft:PATH' or 'auto'")
    raise UnknownDrafterError(f"unknown drafter {spec!r}; choose one of {list(DRAFTER_CHOICES)}")
