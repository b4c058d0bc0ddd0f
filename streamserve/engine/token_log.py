"""`TokenLog`: a session's token ids by absolute position, of which an endless session keeps only a bounded part.

A windowed session's KV drops the pages that leave its `[sinks | window]` (sessions/paged_kv.py); the tokens of
those positions can never be read by attention again nor rewound to, so keeping their ids would make host
memory grow for ever on an endless stream. The log keeps absolute positions (`len()` is the session's length,
indexes and slices take positions 0..len-1, negative ones counted from the end) but stores only

    positions [0, lo)      the head: the sink pages and the position after them (rewind reaches those for ever)
    positions [hi, len)    the tail: what the KV still holds and rewind may still reach (`base` is hi)

Positions [lo, hi) are forgotten (`forget_before`); reading one by position or slice raises
`ForgottenTokensError`, which says which positions are kept. Appending, extending and cutting the end
(`del log[a:]`) work as on a list. A log that has forgotten nothing behaves like the list of its ids. The
operations without positions (iteration, `list(log)`, `in`, `count`, `==` with a list) read the kept ids, in
order (`kept()`): on an endless session that is the sinks' tokens then the tail's, and `len(list(log))` is
`stored`, not `len(log)` — code that needs positions indexes or slices the log itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import overload

from streamserve.errors import InvalidInputError


class ForgottenTokensError(InvalidInputError, IndexError):
    """A read of token ids at positions an endless session no longer keeps (its window dropped them)."""

    code = "tokens_forgotten"


class TokenLog:
    def __init__(self, ids: Iterable[int] = (), gap: tuple[int, int] | None = None) -> None:
        """`ids`: the stored ids in position order; `gap`: the forgotten positions [lo, hi) among them (None:
        none, `ids` are positions 0..len-1)."""
        self._ids: list[int] = list(ids)
        lo, hi = gap if gap is not None else (len(self._ids), len(self._ids))
        if not 0 <= lo <= hi or lo > len(self._ids):
            raise InvalidInputError(f"a token log's forgotten positions must be 0 <= lo <= hi <= the head, got {gap}")
        self._lo, self._hi = lo, hi  # the forgotten positions [lo, hi); lo == hi: none

    # ---- what is kept ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ids) + self._hi - self._lo

    @property
    def base(self) -> int:
        """The oldest position of the kept tail: positions base..len-1 are all kept (0 while nothing is forgotten)."""
        return self._hi if self._hi > self._lo else 0

    @property
    def gap(self) -> tuple[int, int] | None:
        """The forgotten positions [lo, hi), or None."""
        return (self._lo, self._hi) if self._hi > self._lo else None

    @property
    def stored(self) -> int:
        """How many ids are held (the memory the log takes, in ids)."""
        return len(self._ids)

    def kept(self) -> list[int]:
        """The ids held: the head's then the tail's (all of them while nothing is forgotten)."""
        return list(self._ids)

    def copy(self) -> TokenLog:
        return TokenLog(self._ids, self.gap)

    # ---- reading by position -----------------------------------------------------------------------------
    def _row(self, pos: int) -> int:
        """Absolute position (0 <= pos < len) -> its index in `_ids` (ForgottenTokensError in the gap)."""
        if pos < self._lo:
            return pos
        if pos >= self._hi:
            return pos - self._hi + self._lo
        raise ForgottenTokensError(self._why(pos, pos + 1))

    def _why(self, start: int, end: int) -> str:
        what = f"position {start}" if end == start + 1 else f"positions {start}..{end - 1}"
        return (f"{what} of this session {'was' if end == start + 1 else 'were'} forgotten: an endless (windowed) "
                f"session keeps the token ids of positions 0..{self._lo - 1} and {self._hi}..{len(self) - 1} only "
                "(what its KV still holds and a rewind can still reach)")

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> list[int]: ...

    def __getitem__(self, key: int | slice) -> int | list[int]:
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise ValueError("a token log is sliced with step 1 only")
            if stop <= start:
                return []
            if self._lo < self._hi and start < self._hi and stop > self._lo:  # it overlaps the forgotten positions
                raise ForgottenTokensError(self._why(max(start, self._lo), min(stop, self._hi)))
            a = self._row(start)
            return self._ids[a:a + stop - start]
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"token log indices must be integers or slices, not {type(key).__name__}")
        pos = key + n if key < 0 else key
        if not 0 <= pos < n:
            raise IndexError(f"position {key} is outside the session's 0..{n - 1}")
        return self._ids[self._row(pos)]

    def __iter__(self) -> Iterator[int]:
        """The kept ids in position order (all of them while nothing is forgotten)."""
        return iter(self._ids)

    def __contains__(self, token: object) -> bool:
        return token in self._ids

    def count(self, token: int) -> int:
        """How often `token` occurs among the kept ids."""
        return self._ids.count(token)

    def __eq__(self, other: object) -> bool:
        """Another log: the same length, forgotten positions and ids. A list: the kept ids."""
        if isinstance(other, TokenLog):
            return (len(self), self.gap, self._ids) == (len(other), other.gap, other.kept())
        if isinstance(other, list):
            return self._ids == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like a list

    def __repr__(self) -> str:
        gap = "" if self.gap is None else f", forgotten {self._lo}..{self._hi - 1}"
        return f"TokenLog(len={len(self)}{gap}, stored={len(self._ids)})"

    # ---- changing it -------------------------------------------------------------------------------------
    def append(self, token: int) -> None:
        self._ids.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        self._ids.extend(tokens)

    def __delitem__(self, key: slice) -> None:
        """`del log[a:]`: forget everything from position a on (the end of the session is cut)."""
        if not isinstance(key, slice) or key.stop is not None or key.step not in (None, 1):
            raise TypeError("a token log is cut at its end only: del log[a:]")
        a = slice(key.start, None).indices(len(self))[0]
        if a >= self._hi:
            del self._ids[a - self._hi + self._lo:]
        elif a >= self._lo:  # into the forgotten positions: the tail goes, [lo, a) stays forgotten
            del self._ids[self._lo:]
            self._hi = a
        else:  # into the head: what is left is contiguous
            del self._ids[a:]
            self._lo = self._hi = a

    def forget_before(self, pos: int, keep_first: int = 0) -> None:
        """Forget the ids of positions [keep_first, pos) (those already forgotten stay so; the first
        `keep_first` positions are kept, as far as they still are). The log has one gap: where one exists, the
        new one covers both (the engine forgets from a fixed head up to a point that only moves on). Positions
        at or past the end are never forgotten: `pos` is clamped to len."""
        pos = min(pos, len(self))
        if pos <= keep_first:
            return
        if self._hi > self._lo:  # a gap already: it can only widen
            lo, hi = min(keep_first, self._lo), max(pos, self._hi)
        else:
            lo, hi = keep_first, pos
        if hi <= lo or (lo, hi) == (self._lo, self._hi):
            return
        # `_ids` rows to drop: [lo, old lo) of the head, then the tail's first hi - old hi
        if self._hi > self._lo:
            del self._ids[self._lo:self._lo + hi - self._hi]
            del self._ids[lo:self._lo]
        else:
            del self._ids[lo:hi]
        self._lo, self._hi = lo, hi
