"""Choosing the next token from logits, with validated parameters."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from streamserve.errors import InvalidInputError
from streamserve.kernels.reference import MIN_TEMPERATURE, argmax_last, race, race_noise, race_uniform, sample_tokens

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
    happened — how many tokens were drafted, how steps were batched, which other sessions shared the step —
    so a seeded reply repeats exactly, and speculation with deterministic drafts samples the very tokens
    plain decoding would. Every draw is `kernels.reference.race_noise` / `race_uniform` of (seed, position,
    stream): counters hashed on the device, no generator object and no state."""

    STREAMS = 4  # per position: 0 the target's draw, 1 acceptance, 2 residual resampling, 3 a draft model's draw

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed, self.device = seed, device

    def _counters(self, position: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows] seeds and positions position .. position + rows - 1, made on the device (no copy, no sync)."""
        seeds = torch.full((rows,), self.seed, dtype=torch.int64, device=self.device)
        return seeds, torch.arange(position, position + rows, dtype=torch.int64, device=self.device)

    def noise(self, position: int, rows: int, vocab: int, stream: int = 0) -> torch.Tensor:
        """The race noise [rows, vocab] fp32 of positions position .. position + rows - 1 in `stream`."""
        return race_noise(*self._counters(position, rows), stream, vocab)

    def uniform(self, position: int, rows: int, stream: int) -> torch.Tensor:
        """One uniform in (0, 1) per position position .. position + rows - 1 of `stream`: [rows] fp32."""
        return race_uniform(*self._counters(position, rows), stream, 1)[:, 0]

    def pick(self, probs: torch.Tensor, position: int, stream: int) -> torch.Tensor:
        """probs [R, V] (rows need not sum to 1) -> [R] int64 on the device: row i drawn with the noise of
        position + i in `stream`."""
        return race(probs, self.noise(position, probs.shape[0], probs.shape[1], stream))


def sample_rows(logits: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float], top_k: Sequence[int],
                seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """The next token of B rows in one call: logits [B, V] fp32 (masks applied), each row's sampling parameters,
    its reply's seed and the session position of the token it draws -> [B] int64 on the device, no host sync
    (the caller reads the ids back once). Row b draws with `Draws(seeds[b]).noise(positions[b])`, so its token
    is the same whatever rows share the call; greedy rows (temperature below MIN_TEMPERATURE) take the argmax,
    lowest id on ties."""
    if all(t < MIN_TEMPERATURE for t in temperature):  # nothing to draw: no noise, no sort
        return argmax_last(logits)
    dev = logits.device
    # host lists -> the device without waiting for it (a blocking copy would wait for the step's forward)
    ints = torch.tensor([list(top_k), list(seeds), list(positions)], dtype=torch.int64).to(dev, non_blocking=True)
    floats = torch.tensor([list(temperature), list(top_p)], dtype=torch.float32).to(dev, non_blocking=True)
    noise = race_noise(ints[1], ints[2], 0, logits.shape[1])  # [B, V]: stream 0, the target's draw
    return sample_tokens(logits, floats[0], ints[0], floats[1], noise=noise)


def allowed_mask(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Checked ids -> a bool mask [vocab] on `device`, True where a constrained reply may emit the id. Called on
    the engine thread: the caller's thread (the server's event loop) never touches torch."""
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
