"""Chunk results on their way to the client (split from service.py, which owns the rest of the service).

A chunk's `ChunkResult` (its ack or its error) reaches whichever connection holds its session when it is done, and
is kept for a resume. A client chunk that server-numbered chunks made renumber (seqs.py) is acked with the
client's seq and the seq it holds (`chunk_seq`).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import TYPE_CHECKING

from streamserve.server.service.registry import SessionRegistry
from streamserve.server.service.results import AppendRequest, ChunkResult, service_error
from streamserve.server.service.seqs import ClientSeqs

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.server.service.context import ClientContext


class Acks:
    def __init__(self, registry: SessionRegistry, seqs: ClientSeqs) -> None:
        self.registry, self.seqs = registry, seqs

    async def finish(self, ctx: ClientContext, session_id: str, req: AppendRequest, n_tokens: int,
                     fut: Future | asyncio.Future) -> None:
        """Wait for a submitted chunk's ack (or error), deliver it, then give back what its append took of the
        connection's quotas (queued tokens, an ack in flight)."""
        try:
            try:
                ack = await asyncio.wrap_future(fut)
                self.seqs.landed(session_id, req.seq, ack.seq)
                seq = req.seq if req.seq is not None else ack.seq  # the client matches acks by the seq it sent
                result = ChunkResult(session_id, seq, req.capture_time, ack.tokens, round(ack.queue_ms, 3),
                                     round(ack.compute_ms, 3), ack.deadline_missed, ack.shed,
                                     chunk_seq=None if ack.seq == seq else ack.seq)
            except Exception as e:
                result = ChunkResult(session_id, req.seq, req.capture_time, error=service_error(e, session_id,
                                                                                                req.seq))
            await self.deliver(result)
        finally:
            ctx.queued_tokens -= n_tokens
            ctx.pending_acks.release()

    async def deliver(self, result: ChunkResult) -> None:
        """A chunk's result goes to the connection holding its session now (none while detached), kept for a resume."""
        entry = self.registry.find(result.session)
        if entry is None:
            return
        entry.recent.append(result)
        if entry.owner is not None:
            await entry.owner.listener.push(result)
