"""Choosing the next token from logits, with validated parameters."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from streamserve.errors import InvalidInputError
from streamserve.kernels.reference import MIN_TEMPERATURE, sample_tokens

MAX_TOP_K = 1 << 24  # larger than any vocabulary; a larger top_k means no limit anyway
MAX_SEED = (1 << 63) - 1


def _finite(x: object) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an int too large for a float
        return False


def check_sampling(max_tokens: int, temperature: float, top_p: float, top_k: int = 0) -> None:
    """InvalidInputError for any parameter out of range (everything is checked before the engine sees it)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise InvalidInputError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0: no limit), got {top_k!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidInputError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not _finite(temperature) or temperature < 0:
        raise InvalidInputError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not _finite(top_p) or not 0 < top_p <= 1:
        raise InvalidInputError(f"top_p must be in (0, 1], got {top_p!r}")


def check_seed(seed: object) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise InvalidInputError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")


class Draws:
    """A reply's randomness, keyed by token position: the draw for position n is the same whatever else
    happened — how many tokens were drafted, how steps were batched — so a seeded reply repeats exactly,
    and speculation with deterministic drafts samples the very tokens plain decoding would."""

    STREAMS = 4  # per position: 0 the target's draw, 1 acceptance, 2 residual resampling, 3 a draft model's draw

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed, self.device = seed, device

    def at(self, position: int, stream: int = 0) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 0x9E3779B97F4A7C15 + position * self.STREAMS + stream) % MAX_SEED)
        return g


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


def allowed_mask(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Checked ids -> a bool mask [vocab] on `device`, True where a constrained reply may emit the id."""
    if not ids:
        raise InvalidInputError("allowed_token_ids is empty: a constrained reply needs at least one id")
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[torch.tensor(list(ids), dtype=torch.long)] = True
    return mask.to(device)


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def check_stop(stop: Sequence[str] | None) -> list[str]:
    """Stop strings: None, one string, or a list of at most MAX_STOP_STRINGS non-empty strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence) or len(stop) > MAX_STOP_STRINGS:
        raise InvalidInputError(f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
    for s in stop:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise InvalidInputError(f"each stop string must be a non-empty str of at most {MAX_STOP_CHARS} "
                                    f"characters, got {s!r}")
    return list(stop)
