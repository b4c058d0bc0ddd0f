"""Choosing the next token from logits, with validated parameters."""

from __future__ import annotations

import math

import torch

from streamserve.errors import InvalidInputError
from streamserve.kernels.reference import MIN_TEMPERATURE, sample_tokens


def check_sampling(max_tokens: int, temperature: float, top_p: float, top_k: int = 0) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise InvalidInputError(f"top_k must be an integer >= 0 (0: no limit), got {top_k!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidInputError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise InvalidInputError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise InvalidInputError(f"top_p must be in (0, 1], got {top_p!r}")


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
           top_k: int = 0) -> int:
    """logits [V] fp32 -> a token id, drawn on the device (`kernels.reference.sample_tokens`); greedy at
    temperature 0 (argmax, lowest id on ties). The one host sync is reading the id back."""
    if temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    dev = logits.device
    tok = sample_tokens(logits[None], torch.tensor([float(temperature)], device=dev),
                        torch.tensor([int(top_k)], device=dev), torch.tensor([float(top_p)], device=dev), generator)
    return int(tok[0])
