"""Choosing the next token from logits, with validated parameters."""

from __future__ import annotations

import math

import torch

from streamserve.errors import InvalidInputError


def check_sampling(max_tokens: int, temperature: float, top_p: float) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidInputError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise InvalidInputError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise InvalidInputError(f"top_p must be in (0, 1], got {top_p!r}")


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """logits [V] fp32 -> a token id. temperature 0 is greedy (argmax, lowest id on ties)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep a token if the mass before it is below top_p: the first token is always kept
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))
