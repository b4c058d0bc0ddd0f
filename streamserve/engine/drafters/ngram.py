"""Prompt lookup over the session's own history: if the last n tokens occurred before, propose what
followed them then. Everything the session holds counts — earlier turns, appended input, replies.

`NgramIndex` keeps, for every n-gram (n = 1..max_n) of the history, where its latest earlier occurrence
was followed; each appended token adds max_n entries (amortised O(1) per token for a fixed max_n), and a
lookup tries the longest suffix first. Memory is bounded: past `max_entries` (64k: a few MB) the index is
rebuilt over the newer half of what it covers. Its first build and a rebuild after a rewind (the session's
`revisions` counter moves) index the last `REBUILD_TAIL` tokens only, so no step spends long on it.

Embedding vectors sit in the history as the session's placeholder id: an n-gram through one is never
indexed, a suffix ending in one matches nothing, and a proposal stops before one, so nothing is ever
proposed from a placeholder or as one. The drafter keeps one index per session id, freed by `release`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamserve.engine.drafters.base import DraftProposal

if TYPE_CHECKING:
    from streamserve.engine.drafters.base import DraftContext
    from streamserve.engine.work import Response


REBUILD_TAIL = 8192  # tokens of history indexed again after a rewind


class NgramIndex:
    def __init__(self, max_n: int = 4, max_entries: int = 1 << 16, placeholder: int | None = None) -> None:
        self.max_n, self.max_entries = max_n, max_entries
        self.placeholder = placeholder  # an id that breaks the history (an embedding vector's position)
        self.tokens: list[int] = []
        self.offset = 0  # history position of tokens[0] (after a rebuild over the newer half)
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> index in `tokens` of what followed it last
        self.revision = -1

    def sync(self, history: list[int], revision: int) -> None:
        """Catch up with the session's history (appends since last time; a rebuild after a rewind)."""
        if revision != self.revision or len(history) < self.offset + len(self.tokens):
            self.tokens, self.follows, self.revision = [], {}, revision
            self.offset = max(0, len(history) - REBUILD_TAIL)
        for t in history[self.offset + len(self.tokens):]:
            self._push(t)
        if len(self.follows) > self.max_entries:
            keep = history[-(len(self.tokens) // 2):]
            self.tokens, self.follows = [], {}
            self.offset = len(history) - len(keep)
            for t in keep:
                self._push(t)

    def _push(self, token: int) -> None:
        toks = self.tokens
        i = len(toks)  # the position `token` takes: every n-gram ending just before it is now followed by it
        for n in range(1, min(self.max_n, i) + 1):
            if toks[i - n] == self.placeholder:  # this n-gram and every longer one run through a vector
                break
            self.follows[tuple(toks[i - n:i])] = i
        toks.append(token)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the history's suffix."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), 0, -1):
            start = self.follows.get(tuple(toks[-n:]))
            if start is not None:
                out = toks[start:start + k]
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
