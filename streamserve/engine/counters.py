"""`Counters`: the engine's running totals (tokens, forwards, their time, parked/expired/failed sessions),
one object that the batched forward, admission, expiry and the loop add to and `engine.stats()` reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Counters:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    forward_calls: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    sessions_parked_total: int = 0
    sessions_expired_total: int = 0
    sessions_failed_total: int = 0

    def count_forward(self, widths: list[int], seconds: float) -> None:
        """A forward of sessions taking these numbers of tokens: one-token rows are decode, wider ones prefill."""
        self.decode_tokens += sum(1 for w in widths if w == 1)
        self.prefill_tokens += sum(w for w in widths if w > 1)
        if all(w == 1 for w in widths):
            self.decode_seconds += seconds
        else:
            self.prefill_seconds += seconds
        self.forward_calls += 1

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)
