"""Prompt lookup over the session's own history: if the last n tokens occurred before, propose what
followed them then. Everything the session holds counts — earlier turns, appended input, replies.

`NgramIndex` keeps, for every n-gram (n = 1..max_n) of the history, where its latest earlier occurrence
was followed; each appended token adds max_n entries (amortised O(1) per token for a fixed max_n), and a
lookup tries the longest suffix first. Memory is bounded by what it covers: the last `max_tokens` (16k) of
the history, and of an endless session only the tokens the session still keeps (`TokenLog.base` on: its
window; engine/token_log.py). As the history moves on, the oldest tokens and the entries that point into
them go, a quarter of what it covers at a time, so its size stays flat (at most max_n entries a token). Its
first build, a rebuild after a rewind (the session's `revisions` counter moves) and one after the session
forgot tokens it had not indexed yet index the last `REBUILD_TAIL` tokens only, so no step spends long on it.

Embedding vectors sit in the history as the session's placeholder id: an n-gram through one is never
indexed, a suffix ending in one matches nothing, and a proposal stops before one, so nothing is ever
proposed from a placeholder or as one. The drafter keeps one index per session id, freed by `release`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from streamserve.engine.drafters.base import DraftProposal
from streamserve.engine.token_log import TokenLog

if TYPE_CHECKING:
    from streamserve.engine.drafters.base import DraftContext
    from streamserve.engine.work import Response


REBUILD_TAIL = 8192  # tokens of history indexed again after a rewind
MIN_TRIM = 32  # the oldest tokens are dropped once at least this many (and a quarter of those covered) are due


class NgramIndex:
    def __init__(self, max_n: int = 4, max_tokens: int = 1 << 14, placeholder: int | None = None) -> None:
        self.max_n, self.max_tokens = max_n, max_tokens
        self.placeholder = placeholder  # an id that breaks the history (an embedding vector's position)
        self.tokens: list[int] = []
        self.offset = 0  # history position of tokens[0]
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> history position of what followed it last
        self.revision = -1

    @property
    def end(self) -> int:
        """The history position after the last token indexed."""
        return self.offset + len(self.tokens)

    def sync(self, history: Sequence[int], revision: int) -> None:
        """Catch up with the session's history (appends since last time; a rebuild after a rewind, or where the
        session forgot tokens not indexed yet), then drop what it no longer covers."""
        kept = history.base if isinstance(history, TokenLog) else 0  # an endless session's oldest kept position
        if revision != self.revision or len(history) < self.end or self.end < kept:
            self.tokens, self.follows, self.revision = [], {}, revision
            self.offset = max(kept, len(history) - REBUILD_TAIL)
        for t in history[self.end:]:
            self._push(t)
        floor = max(kept, self.end - self.max_tokens)
        if floor - self.offset >= max(MIN_TRIM, len(self.tokens) // 4):
            self._drop_before(floor)

    def _drop_before(self, floor: int) -> None:
        """Forget the tokens before history position `floor` and the entries whose continuation starts there
        (a new dict: deleting in place would leave the old one's size)."""
        del self.tokens[:floor - self.offset]
        self.offset = floor
        self.follows = {g: at for g, at in self.follows.items() if at >= floor}

    def _push(self, token: int) -> None:
        toks = self.tokens
        i = len(toks)  # the position `token` takes: every n-gram ending just before it is now followed by it
        for n in range(1, min(self.max_n, i) + 1):
            if toks[i - n] == self.placeholder:  # this n-gram and every longer one run through a vector
                break
            self.follows[tuple(toks[i - n:i])] = self.offset + i
        toks.append(token)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the history's suffix."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), 0, -1):
            at = self.follows.get(tuple(toks[-n:]))
            if at is not None:
                out = toks[at - self.offset:at - self.offset + k]
                return out[:out.index(self.placeholder)] if self.placeholder in out else out
        return []


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_n: int = 4) -> None:
        self.max_n = max_n
        self.indexes: dict[str, NgramIndex] = {}  # by session id; used on the engine thread or between steps

    def propose(self, session: DraftContext, k: int, reply: Response | None = None) -> DraftProposal:
        index = self.indexes.get(session.id)
        if index is None:
            index = self.indexes[session.id] = NgramIndex(self.max_n, placeholder=session.placeholder_id)
        index.sync(session.token_ids, session.revisions)
        return DraftProposal(index.lookup(k))

    def release(self, session_id: str) -> None:
        self.indexes.pop(session_id, None)

    def held(self) -> set[str]:
        return set(self.indexes)
