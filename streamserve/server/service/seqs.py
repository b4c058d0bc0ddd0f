"""Chunk seqs shared by a client and the server on one session (used by service.py and voice_sessions.py).

A session's chunks carry seqs that must grow (engine/session.py). The client numbers its own chunks; the server
numbers the chunks it appends itself (the agreed words of the session's speech, transcript deltas). The two cannot
coordinate: a client's chunk numbered N may be in flight while a transcript takes N. So a transcript must never
cost the client an out-of-order error: a client chunk whose seq is above every seq the client used on the session
but below the session's next seq only because server-numbered chunks took those seqs meanwhile is appended as the
next chunk (renumbered). Its ack keeps the client's `seq` (the client matches acks by it) and says the seq the
chunk holds (`chunk_seq`); `rewind(to_seq=<the client's seq>)` reaches it. A seq the client itself already used is
still refused. What is kept per session is bounded (MAX_RENUMBERED).

Audio heard by a Listener takes no place on the session's timeline, so the engine cannot refuse a repeated seq of
it: `check_audio` does (a client resending an acknowledged audio chunk after a resume must not be heard twice).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from streamserve.errors import InvalidInputError

MAX_RENUMBERED = 4096  # renumbered chunks remembered per session, newest kept (for rewinds to them)


@dataclass
class _Seqs:
    client_high: int = -1  # the highest seq the client used (explicit, or taken by an unnumbered chunk)
    server_chunks: bool = False  # the server numbered a chunk of this session (a transcript)
    renumbered: collections.OrderedDict[int, int] = field(default_factory=collections.OrderedDict)


class ClientSeqs:
    def __init__(self) -> None:
        self.sessions: dict[str, _Seqs] = {}

    def server_took(self, session_id: str) -> None:
        """The server appended a chunk of its own numbering to the session."""
        self.sessions.setdefault(session_id, _Seqs()).server_chunks = True

    def check_audio(self, session_id: str, seq: int | None) -> None:
        """Refuse an audio chunk whose seq the client already used on the session (as the engine refuses a repeated
        seq of a chunk on the timeline): it was acknowledged once, and would be heard twice."""
        st = self.sessions.get(session_id)
        if seq is not None and st is not None and seq <= st.client_high:
            raise InvalidInputError(f"chunk seq {seq!r} is out of order: the next seq must be > {st.client_high}")

    def client_used(self, session_id: str, seq: int | None) -> None:
        """A client seq consumed without a chunk of the session's own (an audio append: its words come later)."""
        if seq is not None:
            st = self.sessions.setdefault(session_id, _Seqs())
            st.client_high = max(st.client_high, seq)

    def assign(self, session_id: str, seq: int | None, next_seq: int) -> int | None:
        """The seq to submit a client chunk with: `seq` as sent, or None (the session's next: renumbered) when only
        server-numbered chunks stand between the client's last seq and it. Records the client's use of it."""
        st = self.sessions.get(session_id)
        if st is None:
            return seq
        if seq is None:
            st.client_high = max(st.client_high, next_seq)  # the chunk takes next_seq (or later): the client's
            return None
        renumber = st.server_chunks and st.client_high < seq < next_seq
        st.client_high = max(st.client_high, seq)
        return None if renumber else seq

    def landed(self, session_id: str, client_seq: int | None, chunk_seq: int) -> None:
        """A client chunk's ack: remember where a renumbered one went."""
        st = self.sessions.get(session_id)
        if st is None or client_seq is None or client_seq == chunk_seq:
            return
        st.renumbered[client_seq] = chunk_seq
        while len(st.renumbered) > MAX_RENUMBERED:
            st.renumbered.popitem(last=False)

    def resolve(self, session_id: str, to_seq: int | None) -> int | None:
        """A rewind's `to_seq` as the client means it -> the seq on the session's timeline."""
        st = self.sessions.get(session_id)
        if st is None or to_seq is None:
            return to_seq
        return st.renumbered.get(to_seq, to_seq)

    def rewound(self, session_id: str, to_seq: int | None) -> None:
        """After a rewind to the client's `to_seq`: the chunks after it are gone, and so are their numbers."""
        st = self.sessions.get(session_id)
        if st is not None and to_seq is not None:
            for k in [k for k in st.renumbered if k > to_seq]:
                del st.renumbered[k]
            st.client_high = min(st.client_high, to_seq)  # the client may number from to_seq + 1 again

    def forget(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
