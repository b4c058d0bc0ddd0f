"""What an endless chat session keeps of its conversation: `GapList`, a chat transcript's per-message records
(messages, starts, offsets) by absolute message number, of which only a bounded part is kept;
`ForgottenMessagesError` for the others; `ForgettingMessages`, ChatTranscript's half that forgets them (`_forget`)
and finds messages by session position (`messages_within`).

A windowed session forgets the token ids its window dropped (engine/token_log.py); its chat transcript
(engine/chat.py) then forgets the messages whose tokens have all gone, keeping

    messages [0, lo)      the head: those that begin within the sink pages and the position after them (a rewind
                          reaches those for ever, and templates read `messages[0]` and `loop.first`)
    messages [hi, len)    the tail: the messages whose tokens the session still keeps, and the last few

Messages [lo, hi) are forgotten: reading one, or slicing over one, raises `ForgottenMessagesError`. `len()` counts
every message ever kept in the conversation (messages are never renumbered); iteration, `list()` and `==` with a
list read the kept rows in order (head, then tail): that is the conversation the transcript renders. `items()`
gives (number, row) pairs for code that needs numbers. A list that has forgotten nothing behaves like a list.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar, overload

from streamserve.engine.chat_render import Message
from streamserve.engine.session import Session
from streamserve.engine.token_log import ForgottenTokensError
from streamserve.errors import ChatTemplateError, RewindError

T = TypeVar("T")
FORGET_BATCH = 8  # an endless chat forgets messages at least this many at a time (each time: one check rendering)
MIN_TAIL = 2  # an endless chat keeps at least its last this many messages (the last exchange), whatever its window
FORGET_TRIES = 4  # cuts tried, latest first (Gemma's alternating roles: an even number of messages must go)
log = logging.getLogger("streamserve")


class ForgottenMessagesError(ForgottenTokensError, RewindError):
    """A chat message an endless chat session no longer keeps: every token of it left the session's window, so no
    rewind reaches it (code `tokens_forgotten`, as for the token ids themselves)."""

    code = "tokens_forgotten"


class GapList(Generic[T]):
    """Rows by absolute number, one gap of forgotten ones (see the module's docstring)."""

    def __init__(self, rows: Iterable[T] = (), gap: tuple[int, int] | None = None) -> None:
        """`rows`: the kept rows in order; `gap`: the forgotten numbers [lo, hi) among them (None: none)."""
        self._rows: list[T] = list(rows)
        lo, hi = gap if gap is not None else (len(self._rows), len(self._rows))
        if not 0 <= lo <= hi or lo > len(self._rows):
            raise ValueError(f"a gap list's forgotten rows must be 0 <= lo <= hi <= the head, got {gap}")
        self._lo, self._hi = lo, hi

    def __len__(self) -> int:
        return len(self._rows) + self._hi - self._lo

    @property
    def gap(self) -> tuple[int, int] | None:
        """The forgotten numbers [lo, hi), or None."""
        return (self._lo, self._hi) if self._hi > self._lo else None

    @property
    def stored(self) -> int:
        """How many rows are held."""
        return len(self._rows)

    def kept(self) -> list[T]:
        return list(self._rows)

    def items(self) -> Iterator[tuple[int, T]]:
        """(number, row) of the kept rows, in order."""
        for i, row in enumerate(self._rows):
            yield (i if i < self._lo else i + self._hi - self._lo), row

    def _row(self, i: int) -> int:
        if self._lo <= i < self._hi:
            raise ForgottenMessagesError(self._why(i, i + 1))
        return i if i < self._lo else i - self._hi + self._lo

    def _why(self, start: int, end: int) -> str:
        what = f"message {start}" if end == start + 1 else f"messages {start}..{end - 1}"
        return (f"{what} of this chat {'was' if end == start + 1 else 'were'} forgotten: every token of "
                f"{'it' if end == start + 1 else 'them'} left the endless (windowed) session, which keeps messages "
                f"0..{self._lo - 1} and {self._hi}..{len(self) - 1} only (a rewind reaches no further)")

    @overload
    def __getitem__(self, key: int) -> T: ...

    @overload
    def __getitem__(self, key: slice) -> list[T]: ...

    def __getitem__(self, key: int | slice) -> T | list[T]:
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise ValueError("a gap list is sliced with step 1 only")
            if stop <= start:
                return []
            if self._lo < self._hi and start < self._hi and stop > self._lo:
                raise ForgottenMessagesError(self._why(max(start, self._lo), min(stop, self._hi)))
            a = self._row(start)
            return self._rows[a:a + stop - start]
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"gap list indices must be integers or slices, not {type(key).__name__}")
        i = key + n if key < 0 else key
        if not 0 <= i < n:
            raise IndexError(f"index {key} is outside 0..{n - 1}")
        return self._rows[self._row(i)]

    def __iter__(self) -> Iterator[T]:
        return iter(self._rows)

    def __eq__(self, other: object) -> bool:
        """Another gap list: the same length, gap and rows. A list: the kept rows."""
        if isinstance(other, GapList):
            return (len(self), self.gap, self._rows) == (len(other), other.gap, list(other))
        if isinstance(other, list):
            return self._rows == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like a list

    def __repr__(self) -> str:
        gap = "" if self.gap is None else f", forgotten {self._lo}..{self._hi - 1}"
        return f"GapList(len={len(self)}{gap}, rows={self._rows!r})"

    def append(self, row: T) -> None:
        self._rows.append(row)

    def extend(self, rows: Iterable[T]) -> None:
        self._rows.extend(rows)

    def __delitem__(self, key: slice) -> None:
        """`del rows[a:]`: drop every row from number a on. Into the head, the gap goes with them; into the gap:
        ForgottenMessagesError (there is no such point to go back to)."""
        if not isinstance(key, slice) or key.stop is not None or key.step not in (None, 1):
            raise TypeError("a gap list is cut at its end only: del rows[a:]")
        a = slice(key.start, None).indices(len(self))[0]
        if a < self._lo:
            del self._rows[a:]
            self._lo = self._hi = a
        else:
            del self._rows[self._row(a) if a < len(self) else len(self._rows):]

    def forget(self, lo: int, hi: int) -> None:
        """Forget rows [lo, hi): the first forgetting makes the gap, later ones widen it at its end (lo is then
        the gap's own lo)."""
        if self.gap is not None and lo != self._lo:
            raise ValueError(f"a gap list forgets from its gap's start ({self._lo}) on, not from {lo}")
        if not 0 <= lo <= hi <= len(self):
            raise ValueError(f"cannot forget rows {lo}..{hi - 1} of {len(self)}")
        if hi <= self._hi and self.gap is not None:
            return  # forgotten already
        del self._rows[lo if self.gap is None else self._lo:self._row(hi) if hi < len(self) else len(self._rows)]
        self._lo, self._hi = lo, hi


class ForgettingMessages:
    """ChatTranscript's forgetting on an endless session (a mixin: ChatTranscript, engine/chat.py, holds the
    conversation's state, calls `_forget` before each operation that renders, and rewinds)."""

    session: Session
    messages: GapList[Message]
    starts: GapList[int]  # per message: the session position where its rendering begins
    offsets: GapList[int]  # per message: where its rendering begins in `rendered`
    rendered: str  # the messages kept, rendered
    length: int
    forgot: tuple[int, int] | None  # where the forgotten messages begin and end in the session
    _forgets: bool  # False once the template rendered the messages kept otherwise without the others
    if TYPE_CHECKING:
        def render(self, messages: Iterable[Message], generation_prompt: bool = False) -> str: ...

    def _forget(self) -> None:
        """On an endless session: forget the messages all of whose tokens the session forgot (engine/chat_log.py).
        Kept: the head (the messages that begin in the sink pages or at the position after them: a rewind reaches
        those for ever, and templates read `messages[0]` and `loop.first`), and from the first message whose tokens
        the session still keeps on (at least the last MIN_TAIL). Messages go whole groups at a time (those appended
        together: one start), FORGET_BATCH or more at once, and only where the template renders the kept ones
        without them as their text with the forgotten ones' text cut out, nothing else changed. That is enough for
        the turns after: the incremental check of every turn shows that no turn's text changes once rendered, and
        this one that the kept turns read the same without the forgotten ones, so a new turn (rendered after the
        head and the recent turns, as in the whole conversation) adds the text it would add to the whole one. A
        template for which no cut passes (one that numbers turns) makes the chat keep every message, as before."""
        tokens = self.session.token_ids.gap
        if tokens is None or not self._forgets:
            return
        sinks_end, base = tokens  # the session keeps positions < sinks_end and >= base
        n, gap = len(self.messages), self.messages.gap
        lo = gap[0] if gap is not None else sum(1 for s in self.starts if s <= sinks_end)  # the head's end
        first = gap[1] if gap is not None else lo  # the first message after the head
        cuts = []  # messages [first, j) may go: they end where message j begins, at or before `base`
        for j in range(n - MIN_TAIL, first, -1):
            if len(cuts) == FORGET_TRIES:
                break
            if self.starts[j] <= base and self.starts[j - 1] < self.starts[j]:
                cuts.append(j)
        if not cuts or cuts[0] - first < FORGET_BATCH:
            return
        rows, text, at = self.messages.kept(), self.rendered, self.offsets[first]
        for j in cuts:
            kept = text[:at] + text[self.offsets[j]:]  # the forgotten messages' text cut out
            try:
                same = self.render(rows[:lo] + rows[lo + j - first:]) == kept
            except ChatTemplateError:  # e.g. Gemma's "roles must alternate": another cut
                same = False
            if same:
                shift, resumed = self.offsets[j] - at, self.starts[j]
                self.forgot = (self.starts[first] if self.forgot is None else self.forgot[0], resumed)
                self.offsets = GapList([*self.offsets[:lo], *(o - shift for o in self.offsets[j:])], (lo, j))
                self.messages.forget(lo, j)
                self.starts.forget(lo, j)
                self.rendered = kept
                return
        self._forgets = False
        log.warning("streamserve: this chat template renders the later messages otherwise without the earlier ones; "
                    "endless chat session %s keeps every message (its host memory grows)", self.session.id)

    def messages_within(self, to: int | None = None, to_seq: int | None = None) -> int:
        """How many messages lie whole in the session's first `to` tokens, or up to the end of chunk `to_seq`
        (ForgottenMessagesError for a point among forgotten messages)."""
        if to_seq is not None:
            rec = next((r for r in self.session.timeline if r.kind == "input" and r.seq == to_seq), None)
            if rec is None:
                raise RewindError(f"no chunk with seq {to_seq!r} on this session's timeline")
            to = rec.end
        if to is None or not 0 <= to <= self.length:
            raise RewindError(f"cannot rewind to {to!r}: the session holds positions 0..{self.length}")
        n, gap = len(self.messages), self.messages.gap
        if gap is None or self.forgot is None:
            return sum(1 for end in [*self.starts[1:], self.length] if end <= to)
        (lo, hi), (begun, resumed) = gap, self.forgot  # message lo - 1 ends at `begun`, message hi - 1 at `resumed`
        if to < begun:
            return sum(1 for end in self.starts[1:lo] if end <= to)
        if to >= resumed:
            return hi + sum(1 for end in [*self.starts[hi + 1:], self.length][:n - hi] if end <= to)
        raise ForgottenMessagesError(f"cannot rewind to position {to}: it lies in messages {lo}..{hi - 1} of this "
                                     f"chat (positions {begun}..{resumed - 1}), which the endless session forgot")
