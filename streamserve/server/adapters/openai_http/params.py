"""Sampling fields of a request, checked with OpenAI's names and ranges -> the session service's reply parameters
(`max_tokens`, `temperature`, `top_p`, `seed`, `stop`; its own ranges and --max-reply-tokens are checked after)."""

from __future__ import annotations

import math
from typing import Any

from streamserve.server.adapters.openai_http.errors import bad

OPENAI_TEMPERATURE = 1.0  # OpenAI's defaults, where a request does not say
OPENAI_TOP_P = 1.0


def number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high:
        raise bad(f"'{key}' must be a number from {low:g} to {high:g}.", key)
    return float(v)


def integer(body: dict[str, Any], key: str, low: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise bad(f"'{key}' must be an integer >= {low}.", key)
    return v


def sampling(body: dict[str, Any], max_keys: tuple[str, ...]) -> dict[str, Any]:
    """The reply parameters of `body`; `max_keys`: the fields that may bound the reply's length, first given wins."""
    out: dict[str, Any] = {"temperature": OPENAI_TEMPERATURE, "top_p": OPENAI_TOP_P}
    for key in max_keys:
        if (n := integer(body, key, 1)) is not None:
            out["max_tokens"] = n
            break
    if (t := number(body, "temperature", 0.0, 2.0)) is not None:
        out["temperature"] = t
    if (p := number(body, "top_p", 0.0, 1.0)) is not None:
        if p == 0.0:
            raise bad("'top_p' must be above 0.", "top_p")
        out["top_p"] = p
    return out
