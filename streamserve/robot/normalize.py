"""Normalisation statistics of a policy (policy.json's `norm_stats`), as openpi keeps them: the state is normalised on
the way in (before it is binned or projected) and the actions are un-normalised on the way out (after their bins
decode), so `state_low`/`state_high` and `action_low`/`action_high` are in normalised units.

    "norm_stats": {"state": {"mean": [...], "std": [...]}, "actions": {"q01": [...], "q99": [...]}}

mean/std: (x - mean) / (std + 1e-6); quantiles: 2 (x - q01) / (q99 - q01 + 1e-6) - 1, which maps the 1st..99th
percentile onto [-1, 1] (openpi's `use_quantile_norm`). Either part may be left out: those values pass unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamserve.robot.errors import PolicyConfigError

EPS = 1e-6  # openpi's: a constant dimension (std 0, q01 == q99) does not divide by zero
KINDS = {"mean_std": ("mean", "std"), "quantile": ("q01", "q99")}
PARTS = ("state", "actions")


@dataclass(frozen=True)
class Normalization:
    kind: str  # "mean_std" or "quantile"
    a: np.ndarray  # [D] mean, or q01
    b: np.ndarray  # [D] std, or q99

    @classmethod
    def from_json(cls, name: str, data: Any, dims: int) -> Normalization:
        """One part of norm_stats (`name`: "state" or "actions") for `dims` values; PolicyConfigError when it is
        not exactly {mean, std} or {q01, q99} of `dims` finite numbers (std >= 0, q01 <= q99)."""
        if not isinstance(data, dict):
            raise PolicyConfigError(f"policy.json: norm_stats.{name} must be an object")
        kind = next((k for k, keys in KINDS.items() if set(data) == set(keys)), None)
        if kind is None:
            raise PolicyConfigError(f"policy.json: norm_stats.{name} holds either mean and std or q01 and q99, got "
                                    f"{sorted(data)}")
        a, b = (_floats(f"norm_stats.{name}.{key}", data[key], dims) for key in KINDS[kind])
        if kind == "mean_std" and (b < 0).any():
            raise PolicyConfigError(f"policy.json: norm_stats.{name}.std must not be negative")
        if kind == "quantile" and (b < a).any():
            raise PolicyConfigError(f"policy.json: norm_stats.{name}.q99 must not be below q01")
        return cls(kind, a, b)

    def apply(self, x: np.ndarray) -> np.ndarray:
        """Raw values [..., D] -> normalised."""
        if self.kind == "mean_std":
            return (x - self.a) / (self.b + EPS)
        return 2.0 * (x - self.a) / (self.b - self.a + EPS) - 1.0

    def invert(self, y: np.ndarray) -> np.ndarray:
        """Normalised values [..., D] -> raw."""
        if self.kind == "mean_std":
            return y * (self.b + EPS) + self.a
        return (y + 1.0) / 2.0 * (self.b - self.a + EPS) + self.a


def parse_norm_stats(data: Any, state_dims: int, action_dims: int) -> dict[str, Normalization]:
    """policy.json's norm_stats (None: none) -> {"state"?: ..., "actions"?: ...}."""
    if data is None:
        return {}
    if not isinstance(data, dict) or not set(data) <= set(PARTS):
        raise PolicyConfigError(f"policy.json: norm_stats must be an object with {list(PARTS)} (either or both)")
    dims = {"state": state_dims, "actions": action_dims}
    return {part: Normalization.from_json(part, data[part], dims[part]) for part in PARTS if part in data}


def _floats(name: str, value: Any, dims: int) -> np.ndarray:
    if not isinstance(value, list) or len(value) != dims or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in value):
        raise PolicyConfigError(f"policy.json: {name} must be a list of {dims} finite numbers")
    return np.asarray(value, dtype=np.float64)
