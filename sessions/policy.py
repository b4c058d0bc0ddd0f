"""What a session keeps of its history: `[first `sinks` tokens | last `window` tokens]`, and how it
numbers positions.

- `absolute`: model-native positions (RoPE applied before caching). Within the window it equals the
  model exactly; beyond it, it equals the model with attention masked to sinks + window. Positions grow
  with the stream, so a session is limited to the model's context.
- `rolling` (StreamingLLM): keys are cached before RoPE and positions are counted inside the cache, so
  they stay below sinks + window for ever: an endless stream in constant memory.

Default: `rolling` when a window is set (a windowed session is an endless stream, and absolute positions
would run past the model's context), `absolute` otherwise (no window: exactly the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from streamserve.errors import InvalidInputError

PositionMode = Literal["absolute", "rolling"]


@dataclass(frozen=True)
class WindowPolicy:
    window: int | None = None  # the most recent tokens kept (None: everything up to the context)
    sinks: int = 4  # the first tokens kept for ever (attention sinks); only used with a window
    mode: PositionMode | None = None  # None: rolling with a window, absolute without

    def __post_init__(self) -> None:
        for name in ("window", "sinks"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int)):
                raise InvalidInputError(f"{name} must be an integer, got {val!r}")
        if self.sinks < 0:
            raise InvalidInputError(f"sinks must be >= 0, got {self.sinks}")
        if self.window is not None:
            if self.window < 1:
                raise InvalidInputError(f"window must be >= 1, got {self.window}")
            if self.window < self.sinks:
                raise InvalidInputError(f"the window ({self.window}) is smaller than the sinks ({self.sinks}); "
                                        "use a window of at least as many tokens as sinks")
        if self.mode not in (None, "absolute", "rolling"):
            raise InvalidInputError(f"position mode must be 'absolute' or 'rolling', got {self.mode!r}")
        if self.mode == "rolling" and self.window is None:
            raise InvalidInputError("rolling positions need a window")
        if self.mode is None:
            object.__setattr__(self, "mode", "rolling" if self.window is not None else "absolute")

    @property
    def rolling(self) -> bool:
        return self.mode == "rolling"

    @property
    def bounded(self) -> bool:
        """Whether the session's memory and positions stay bounded on an endless stream."""
        return self.rolling

    def first_needed(self, length: int) -> int:
        """The oldest non-sink position a query at `length` (the next token) may attend to."""
        if self.window is None:
            return 0
        return max(self.sinks, length - self.window + 1)
