"""The robot codec's errors (robot code may import them with NumPy alone)."""

from __future__ import annotations

from streamserve.errors import InvalidInputError, ModelLoadError


class PolicyInputError(InvalidInputError):
    """An observation (or action chunk) the codec cannot encode: missing key, wrong shape or type, NaN/inf."""

    code = "invalid_observation"


class PolicyConfigError(ModelLoadError):
    """A checkpoint's policy.json is malformed: missing or mistyped fields, bad ranges, overlapping token ids."""

    code = "invalid_policy_config"


__all__ = ["PolicyConfigError", "PolicyInputError"]
