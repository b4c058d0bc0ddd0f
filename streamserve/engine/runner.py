"""The runner: executes a `Plan` on the sessions, one batched forward per step, then samples.

For each item it works out the tokens to run: an append runs its slice of the chunk (after the session's
pending generated token, if any); a decode runs the pending token (the last one sampled) and samples
the next from the resulting logits, or samples straight from the logits the last append left. All
sessions' tokens go through the model together (`BatchForward.run`); a failure there is isolated to the
session that causes it. Then every plain decode of the step samples together: one `sampling.sample_rows`
call over the stacked logits [B, V] and one read back of the B ids, the step's one host sync for sampling
(a draft verification reads its own). An append that carries the reply queued behind it (`WorkItem.then`)
starts it in the same step: its first token is sampled with the plain decodes from the append's last logits, or,
when the reply has a caller's draft, the draft rides on the append's forward and is verified from its rows.
Results are committed to the sessions' `SessionState`s here (token
ids, vectors, timeline, logits); the scheduler only counts. The runner knows sessions by id through the
`SessionTable` and never sees a user's handle.
"""

from __future__ import annotations

import time

import torch

from streamserve.engine import speculate
from streamserve.engine.admission import Admission
from streamserve.engine.batch import BatchForward, Job
from streamserve.engine.drafters import DrafterCatalog
from streamserve.engine.drafters.base import DraftProposal
from streamserve.engine.sampling import allowed_mask, sample_rows
from streamserve.engine.snapshot import ChunkRecord
from streamserve.engine.state import SessionState
from streamserve.engine.table import SessionTable
from streamserve.engine.work import Chunk, ItemResult, Plan, Response, StepOutput, WorkItem
from streamserve.errors import InvalidInputError, RewindError, SessionClosedError, StepError, StreamserveError

# errors a step raises because of what the caller asked (the item fails, the session goes on); any other
# exception while running a session's step is a fault: the session is failed and closed
USER_ERRORS = (StreamserveError,)


class Runner:
    def __init__(self, table: SessionTable, batch: BatchForward, drafters: DrafterCatalog, admission: Admission,
                 new_detokenizer: speculate.DetokenizerFactory) -> None:
        self.table, self.batch, self.drafters, self.admission = table, batch, drafters, admission
        self.new_detokenizer = new_detokenizer
        self._proposals: dict[str, DraftProposal] = {}  # this step's drafts, by session id
        self.sample_reads = 0  # reads of sampled ids back to the host: one per step with plain decodes

    def execute(self, plan: Plan) -> StepOutput:
        started = time.monotonic()
        results: dict[str, ItemResult] = {}
        jobs: list[tuple[SessionState, WorkItem, Job]] = []
        for item in plan.items:
            s = self.table.state_of(item.session_id)
            if s is None:
                results[item.session_id] = ItemResult(error=SessionClosedError(f"session {item.session_id} is "
                                                                               "closed"), fatal=True)
                continue
            try:
                job = self._prepare(s, item)
            except USER_ERRORS as e:
                results[item.session_id] = self._refused(s, item, e)
                continue
            if isinstance(job, ItemResult):
                results[item.session_id] = job
            else:
                jobs.append((s, item, job))
        decodes: list[tuple[SessionState, Response]] = []  # plain decodes: they sample together after the loop
        then: dict[str, ItemResult] = {}  # the replies appends started (WorkItem.then)
        try:
            forward = [job for _, _, job in jobs if job.ids]
            outs = iter(self.batch.run(forward)) if forward else iter(())
            seconds = self.batch.seconds
            if len(forward) == 1 and seconds is not None:  # what a step of this width costs (drafting's cost)
                self.drafters.costs.observe(len(forward[0].ids), seconds)
            for s, item, job in jobs:
                logits = next(outs) if job.ids else None
                result = self._finish(s, item, logits)
                if result is None:
                    decodes.append((s, item.work))  # type: ignore[arg-type]
                    continue
                results[item.session_id] = result
                r = item.then
                if r is None or result.error is not None or result.fatal:
                    continue
                if s.id in self._proposals:  # the append's forward verified the reply's first tokens too
                    then[s.id] = self._accept(s, r, logits[-len(self._proposals[s.id].tokens) - 1:])  # type: ignore[index]
                else:  # sampled with the step's decodes, from the logits the append kept
                    decodes.append((s, r))
        finally:
            self._proposals.clear()
        for sid, res in self._decode(decodes).items():
            (then if sid in results else results)[sid] = res
        return StepOutput(results, started, time.monotonic(), then)

    def _prepare(self, s: SessionState, item: WorkItem) -> Job | ItemResult:
        """What this item runs through the model (no ids when a decode samples from kept logits): the pending
        token (a vector position run again uses its vector), then the chunks' slices (with their vectors)."""
        job = self._prepare_ids(s, item)
        if isinstance(job, ItemResult):
            return job
        job.vectors = s.vector_rows(s.kv.length, len(s.token_ids))  # pending positions that hold vectors
        if isinstance(item.work, Chunk):
            row = len(s.token_ids) - s.kv.length
            for c, n in item.parts:
                if c.embeds is not None:  # this part's rows of the chunk, as one block
                    job.vectors.append((row, c.embeds[c.done:c.done + n]))
                row += n
        return job

    def _prepare_ids(self, s: SessionState, item: WorkItem) -> Job | ItemResult:
        s.last_active = time.monotonic()
        if s.kv.length > len(s.token_ids):  # defensive: a committed step whose bookkeeping was lost
            s.kv.truncate(len(s.token_ids))
        work = item.work
        if isinstance(work, Chunk):
            ids = list(s.pending)
            if any(c.done == 0 for c, _ in item.parts):  # chunks starting here must fit whole before any runs
                rest = sum(c.remaining for c, _ in item.parts)
                s.check_context(rest)
                s.kv.check_fits(len(ids) + rest)
            for c, n in item.parts:
                ids += c.token_ids[c.done:c.done + n]
            r = item.then
            if r is not None and r.draft and not r.stop:  # the reply's guessed tokens ride on the append
                limit = None if s.kv.rolling else s.max_positions
                proposal = speculate.given(s, r, len(r.draft), limit, base=len(ids))
                if proposal.tokens:
                    self._proposals[s.id] = proposal
                    return Job(s, ids + proposal.tokens, all_rows=True)
            return Job(s, ids)
        if not s.token_ids:  # the chunks before this reply failed or were shed
            raise InvalidInputError("a reply needs at least one appended token; the chunks before it did not "
                                    "enter the session")
        if not s.kv.rolling and len(s.token_ids) >= s.max_positions:
            return ItemResult(context_full=True)
        if not s.pending and s.logits_at != len(s.token_ids):
            # no logits for the session as it stands (after a rewind or a restore): run its last token again
            s.kv.truncate(s.kv.length - 1)
        if item.kind == "verify" and len(s.pending) == 1:
            limit = None if s.kv.rolling else s.max_positions
            proposal = (speculate.given(s, work, item.n_tokens - 1, limit) if work.draft  # type: ignore[union-attr]
                        else speculate.draft(s, work, item.n_tokens - 1, limit))  # type: ignore[arg-type]
            if proposal.tokens:
                self._proposals[s.id] = proposal
                return Job(s, s.pending + proposal.tokens, all_rows=True)
        return Job(s, s.pending)

    def _finish(self, s: SessionState, item: WorkItem,
                logits: torch.Tensor | BaseException | None) -> ItemResult | None:
        """Commits the item's forward; None for a plain decode, whose token the step samples with the others."""
        if isinstance(logits, BaseException):
            if not isinstance(logits, USER_ERRORS):
                return ItemResult(error=_fault(logits), fatal=True)
            return self._refused(s, item, logits)
        work = item.work
        proposal = self._proposals.get(s.id)
        if proposal is not None and isinstance(work, Response):
            assert logits is not None
            return self._accept(s, work, logits)
        if proposal is not None:  # an append carrying its reply's draft: the chunk's rows go in, verified after
            assert logits is not None
            s.keep_logits(None)
        elif logits is not None:
            s.keep_logits(logits)
        if isinstance(work, Chunk):
            for c, n in item.parts:
                start = len(s.token_ids)
                s.token_ids.extend(c.token_ids[c.done:c.done + n])
                if c.embeds is not None:  # the vectors of this part, by position (its ids are placeholders)
                    s.add_vectors(start, c.embeds[c.done:c.done + n])
                if c.done == 0:
                    s.timeline.append(ChunkRecord("input", c.seq, start, len(s.token_ids), c.capture_time,
                                                  c.deadline))
                else:  # a later part of a chunk split across steps: its record grows
                    r = s.timeline[-1]
                    s.timeline[-1] = ChunkRecord(r.kind, r.seq, r.start, len(s.token_ids), r.capture_time,
                                                 r.deadline)
        if logits is not None or isinstance(work, Chunk):  # (once a chunk's ids are in)
            s.trim()  # the window may have dropped positions: their ids, records and vectors no rewind can reach
        return ItemResult() if isinstance(work, Chunk) else None

    def _accept(self, s: SessionState, r: Response, logits: torch.Tensor) -> ItemResult:
        """The verification rows [k+1, V] of the reply's proposal -> the tokens it emits."""
        try:
            if isinstance(r.allowed, tuple):  # ids as submitted: the mask is made here, on the engine thread
                r.allowed = allowed_mask(r.allowed, logits.shape[-1], logits.device)
            tokens = speculate.accept(s, r, self._proposals[s.id], logits, self.new_detokenizer)
        except Exception as e:
            return ItemResult(error=_fault(e), fatal=True)
        r.draft_len = self._draft_len(s, r)
        return ItemResult(tokens=tokens)

    @staticmethod
    def _draft_len(s: SessionState, r: Response) -> int:
        """Tokens to draft for the reply's next step: the rest of the caller's draft, else what the session's
        drafter offers. None for replies with stop strings (a string can end inside a verified run, and the
        session must hold exactly what plain decoding leaves in it). A constrained reply's drafts are verified
        against its masked logits, so they are as lossless as its plain steps."""
        if r.stop:
            return 0
        if r.draft:
            return max(0, min(len(r.draft) - r.produced, r.max_tokens - r.produced - 1))
        if s.spec is None:
            return 0
        return s.spec.next_k(fixed_costs=r.seeded)

    def _refused(self, s: SessionState, item: WorkItem, error: StreamserveError) -> ItemResult:
        """The item fails with a caller's error (the session goes on). A chunk split across steps whose
        earlier parts are in the session is taken out again."""
        if isinstance(item.work, Chunk) and item.work.done > 0:
            error = self._undo_partial(s, item.work, error)
        return ItemResult(error=error)

    def _undo_partial(self, s: SessionState, chunk: Chunk, error: StreamserveError) -> StreamserveError:
        """A later part of a split chunk failed: take the parts that ran out of the session again, so a
        failed chunk is never half in it. Where the window already dropped what that needs, say so."""
        rec = s.timeline[-1]
        assert rec.kind == "input" and rec.seq == chunk.seq
        try:
            if rec.start < len(s.token_ids):
                s.check_cut(rec.start)
                self.admission.unpark(s)
            s.cut(rec.start, renumber=False)
        except RewindError as e:  # its reason names what dropped the keys: the session's window or the model's
            error.args = (f"{error} ({chunk.done} of its {len(chunk.token_ids)} tokens had entered the session and "
                          f"stay: undoing them needs keys already given back; {e})",)
        return error

    def _decode(self, decodes: list[tuple[SessionState, Response]]) -> dict[str, ItemResult]:
        """Samples every plain decode of the step in one call and reads the ids back once; a session whose
        inputs fail is failed alone, and a fault in the batched call falls back to one row at a time."""
        results: dict[str, ItemResult] = {}
        rows: list[tuple[SessionState, Response, torch.Tensor]] = []
        for s, r in decodes:
            try:
                assert s.logits is not None
                if isinstance(r.allowed, tuple):  # ids as submitted: the mask is made here, on the engine thread
                    r.allowed = allowed_mask(r.allowed, s.logits.shape[-1], s.logits.device)
                rows.append((s, r, s.logits if r.allowed is None else s.logits.masked_fill(~r.allowed, float("-inf"))))
            except Exception as e:
                results[s.id] = ItemResult(error=_fault(e), fatal=True)
        if not rows:
            return results
        try:
            tokens: list[int | BaseException] = list(self._sample(rows))
        except Exception:  # one row's fault fails the batch: find it, and sample the others on their own
            tokens = []
            for row in rows:
                try:
                    tokens.extend(self._sample([row]))
                except Exception as e:
                    tokens.append(e)
        for (s, r, _), tok in zip(rows, tokens, strict=True):
            if isinstance(tok, BaseException):
                results[s.id] = ItemResult(error=_fault(tok), fatal=True)
                continue
            # pending from here on: it enters the KV with the next forward
            r.forwards += 1  # its logits came from one forward: this step's, or the append's it follows
            speculate.extend_reply(s, r, [tok], self.new_detokenizer)
            r.draft_len = self._draft_len(s, r)
            results[s.id] = ItemResult(token=tok)
        return results

    def _sample(self, rows: list[tuple[SessionState, Response, torch.Tensor]]) -> list[int]:
        """rows' logits [V] each -> their tokens: one `sample_rows` call, one read back (the host sync)."""
        drawn = sample_rows(torch.stack([logits for _, _, logits in rows]), [r.temperature for _, r, _ in rows],
                            [r.top_p for _, r, _ in rows], [r.top_k for _, r, _ in rows],
                            [r.draws.seed for _, r, _ in rows], [len(s.token_ids) for s, _, _ in rows])
        tokens = drawn.tolist()
        self.sample_reads += 1
        return tokens


def _fault(e: BaseException) -> StepError:
    err = StepError(f"the engine failed on this session's step ({e!r}); the session was closed")
    err.__cause__ = e
    return err
