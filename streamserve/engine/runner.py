"""The runner: executes a `Plan` on the sessions, one batched forward per step, then samples.

For each item it works out the tokens to run: an append runs its slice of the chunk (after the session's
pending generated token, if any); a decode runs the pending token (the last one sampled) and samples
the next from the resulting logits, or samples straight from the logits the last append left. All
sessions' tokens go through the model together (`Engine.run_step`); a failure there is isolated to the
session that causes it. Results are committed to the sessions here (token ids, timeline, logits);
the scheduler only counts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from streamserve.engine import speculate
from streamserve.engine.drafters.base import DraftProposal
from streamserve.engine.sampling import sample
from streamserve.engine.snapshot import ChunkRecord
from streamserve.engine.work import Chunk, ItemResult, Plan, Response, StepOutput, WorkItem
from streamserve.errors import InvalidInputError, RewindError, SessionClosedError, StepError, StreamserveError

if TYPE_CHECKING:
    from streamserve.engine.engine import Engine
    from streamserve.engine.session import Session

# errors a step raises because of what the caller asked (the item fails, the session goes on); any other
# exception while running a session's step is a fault: the session is failed and closed
USER_ERRORS = (StreamserveError,)


class Runner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._proposals: dict[str, DraftProposal] = {}  # this step's drafts, by session id

    def execute(self, plan: Plan) -> StepOutput:
        started = time.monotonic()
        results: dict[str, ItemResult] = {}
        jobs: list[tuple[Session, WorkItem, list[int]]] = []
        for item in plan.items:
            s = self.engine._sessions.get(item.session_id)
            if s is None or s.closed:
                results[item.session_id] = ItemResult(error=SessionClosedError(f"session {item.session_id} is "
                                                                               "closed"), fatal=True)
                continue
            try:
                ids = self._prepare(s, item)
            except USER_ERRORS as e:
                results[item.session_id] = self._refused(s, item, e)
                continue
            if isinstance(ids, ItemResult):
                results[item.session_id] = ids
            else:
                jobs.append((s, item, ids))
        try:
            forward = [(s, ids) for s, _, ids in jobs if ids]
            verifying = [s.id in self._proposals for s, _ in forward]
            outs = iter(self.engine.run_step(forward, verifying)) if forward else iter(())
            seconds = self.engine.batch.seconds
            if len(forward) == 1 and seconds is not None:  # what a step of this width costs (drafting's cost)
                self.engine.drafters.costs.observe(len(forward[0][1]), seconds)
            for s, item, ids in jobs:
                logits = next(outs) if ids else None
                results[item.session_id] = self._finish(s, item, ids, logits)
        finally:
            self._proposals.clear()
        return StepOutput(results, started, time.monotonic())

    def _prepare(self, s: Session, item: WorkItem) -> list[int] | ItemResult:
        """The token ids this item runs through the model ([] when a decode samples from kept logits)."""
        s.last_active = time.monotonic()
        if s.kv.length > len(s.token_ids):  # defensive: a committed step whose bookkeeping was lost
            s.kv.truncate(len(s.token_ids))
        work = item.work
        if isinstance(work, Chunk):
            ids = list(s._pending)
            if any(c.done == 0 for c, _ in item.parts):  # chunks starting here must fit whole before any runs
                rest = sum(c.remaining for c, _ in item.parts)
                s._check_context(rest)
                s.kv.check_fits(len(ids) + rest)
            for c, n in item.parts:
                ids += c.token_ids[c.done:c.done + n]
            return ids
        if not s.token_ids:  # the chunks before this reply failed or were shed
            raise InvalidInputError("a reply needs at least one appended token; the chunks before it did not "
                                    "enter the session")
        if not s.kv.rolling and len(s.token_ids) >= self.engine.config.max_position_embeddings:
            return ItemResult(context_full=True)
        if not s._pending and s._logits_at != len(s.token_ids):
            # no logits for the session as it stands (after a rewind or a restore): run its last token again
            s.kv.truncate(s.kv.length - 1)
        if item.kind == "verify" and len(s._pending) == 1:
            limit = None if s.kv.rolling else self.engine.config.max_position_embeddings
            proposal = speculate.draft(s, work, item.n_tokens - 1, limit)  # type: ignore[arg-type]
            if proposal.tokens:
                self._proposals[s.id] = proposal
                return s._pending + proposal.tokens
        return s._pending

    def _finish(self, s: Session, item: WorkItem, ids: list[int], logits: torch.Tensor | BaseException | None
                ) -> ItemResult:
        if isinstance(logits, BaseException):
            if not isinstance(logits, USER_ERRORS):
                return ItemResult(error=_fault(logits), fatal=True)
            return self._refused(s, item, logits)
        work = item.work
        proposal = self._proposals.get(s.id)
        if proposal is not None:
            assert logits is not None and isinstance(work, Response)
            try:
                tokens = speculate.accept(s, work, proposal, logits)
            except Exception as e:
                return ItemResult(error=_fault(e), fatal=True)
            work.draft_len = self._draft_len(s, work)
            return ItemResult(tokens=tokens)
        if logits is not None:
            s._logits, s._logits_at = logits, s.kv.length
        if isinstance(work, Chunk):
            for c, n in item.parts:
                start = len(s.token_ids)
                s.token_ids.extend(c.token_ids[c.done:c.done + n])
                if c.done == 0:
                    s.timeline.append(ChunkRecord("input", c.seq, start, len(s.token_ids), c.capture_time,
                                                  c.deadline))
                else:  # a later part of a chunk split across steps: its record grows
                    r = s.timeline[-1]
                    s.timeline[-1] = ChunkRecord(r.kind, r.seq, r.start, len(s.token_ids), r.capture_time,
                                                 r.deadline)
            return ItemResult()
        return self._decode(s, work)

    @staticmethod
    def _draft_len(s: Session, r: Response) -> int:
        """Tokens to draft for the reply's next step. None for replies with stop strings: a string can end
        inside a verified run, and the session must hold exactly what plain decoding leaves in it."""
        if s.spec is None or r.stop:
            return 0
        return s.spec.next_k(fixed_costs=r.seeded)

    def _refused(self, s: Session, item: WorkItem, error: StreamserveError) -> ItemResult:
        """The item fails with a caller's error (the session goes on). A chunk split across steps whose
        earlier parts are in the session is taken out again."""
        if isinstance(item.work, Chunk) and item.work.done > 0:
            error = self._undo_partial(s, item.work, error)
        return ItemResult(error=error)

    @staticmethod
    def _undo_partial(s: Session, chunk: Chunk, error: StreamserveError) -> StreamserveError:
        """A later part of a split chunk failed: take the parts that ran out of the session again, so a
        failed chunk is never half in it. Where the window already dropped what that needs, say so."""
        rec = s.timeline[-1]
        assert rec.kind == "input" and rec.seq == chunk.seq
        try:
            s._rewind_to(rec.start)
        except RewindError:
            error.args = (f"{error} ({chunk.done} of its {len(chunk.token_ids)} tokens had entered the session and "
                          "stay: the window dropped what undoing them needs)",)
        return error

    def _decode(self, s: Session, r: Response) -> ItemResult:
        assert s._logits is not None
        try:
            tok = sample(s._logits, r.temperature, r.top_p, r.draws.at(len(s.token_ids)), r.top_k)
        except Exception as e:
            return ItemResult(error=_fault(e), fatal=True)
        speculate.extend_reply(s, r, [tok])  # pending from here on: it enters the KV with the next forward
        r.draft_len = self._draft_len(s, r)
        return ItemResult(token=tok)



def _fault(e: BaseException) -> StepError:
    err = StepError(f"the engine failed on this session's step ({e!r}); the session was closed")
    err.__cause__ = e
    return err
