"""The scheduler: which sessions run how many tokens in the next engine step. Pure Python, no torch.

Each session has a FIFO of work (appended chunks and requested responses, in the order they were
submitted); only its head runs, so a reply starts after the chunks sent before it and a chunk sent
during a reply enters the KV after the reply ends. Each step (`schedule`):

1. Cancelled responses leave their queues (they end in this step: barge-in within one step).
2. Under overload (a queued chunk is past its deadline) stale video chunks are shed, oldest first,
   keeping each session's newest video chunk; text and audio are never shed.
3. Answering sessions first: one decode token each, up to `max_batch`, least recently served first.
4. The rest of the token budget B (`step_tokens`, but never less than `min_append_tokens`, so appends
   always progress) goes to appends. A long chunk is split across steps, so the inter-token latency of
   answering sessions stays bounded by one step of at most `step_tokens`, and chunks queued right behind
   each other in a session share its step. The budget is shared by deficit round-robin: with n sessions
   appending, a session's share of a step is q = B // n (at least one token), and each keeps a deficit
   counter (tokens it is owed; negative when it took more than its shares):
   a. Sessions owed tokens by earlier steps go first and take what they are owed (no more than one share).
      Those are sessions that got less than their share, or found no slot in the batch (`max_batch`).
   b. The rest goes by need. First sessions whose queued chunks fit in a share, then the other sessions,
      each group earliest deadline first (late chunks first: a session that fell behind catches up; a
      chunk waiting longer than `max_wait` is ordered as if due now: nothing starves); last the sessions
      in debt, the least indebted first. So a small chunk finishes in the first step that starts after
      it is queued, even behind a long chunk due earlier, and a session flooding the engine with long
      chunks takes only what the others leave once it has had its share.
   c. A session still appending after the step gains one share and is charged what it took. Credit is
      capped at one share (no session is owed more); debt at one step's budget, so a session that took
      whole steps (leftovers count) yields to the others in the next steps it contends with them: over
      time each gets its share. A big chunk in debt still gets leftovers, and its share again once the
      debt is repaid. A session whose queued chunks are all in forgets its deficit: idle time banks
      nothing.

5. An append that finishes every chunk queued before a session's reply carries that reply (`WorkItem.then`):
   its first token is sampled from the append's own logits in the same step (with a draft, its first tokens are
   verified in the append's forward), not in a step of its own one step later.

`update` applies the runner's output and returns the events for callers (acks, deltas, done, errors).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from streamserve.config import SchedulerConfig
from streamserve.engine.work import (
    Ack,
    Chunk,
    ChunkAcked,
    ChunkFailed,
    Event,
    ItemResult,
    Plan,
    Response,
    ResponseDone,
    ResponseFailed,
    SessionFailed,
    StepOutput,
    TokenProduced,
    WorkItem,
)
from streamserve.errors import CapacityError, SessionClosedError, StepError


class Scheduler:
    def __init__(self, limits: SchedulerConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        # step budget and queue bounds; an open step budget is an accelerator's here (the engine fills in its
        # device's: SchedulerConfig.for_device)
        self.limits = (limits or SchedulerConfig()).for_device(None)
        assert self.limits.step_tokens is not None
        self.clock = clock
        self._queues: dict[str, deque[Chunk | Response]] = {}
        self._last_served: dict[str, int] = {}
        self._served = 0
        self._deficit: dict[str, int] = {}  # tokens each appending session is owed (< 0: it owes), step 4c
        self.shed_total = 0

    # ---- submission (callers hold the loop's lock) ----------------------------------------------------
    def add(self, work: Chunk | Response) -> None:
        q = self._queues.setdefault(work.session_id, deque())
        if len(q) >= self.limits.max_queued:
            raise CapacityError(f"session {work.session_id} has {len(q)} chunks and responses queued (the limit); "
                                "wait for acks before sending more")
        q.append(work)

    def cancel(self, session_id: str) -> int:
        """Mark the session's responses (running and queued) cancelled; they end in the next step."""
        n = 0
        for w in self._queues.get(session_id, ()):
            if isinstance(w, Response) and not w.cancelled:
                w.cancelled, n = True, n + 1
        return n

    def drop_session(self, session_id: str, error: BaseException | None = None) -> list[Event]:
        """Take the session's queue away: its chunks fail and its responses end ("closed", or failed with
        `error`)."""
        self._last_served.pop(session_id, None)
        self._deficit.pop(session_id, None)
        events: list[Event] = []
        for w in self._queues.pop(session_id, ()):
            if isinstance(w, Chunk):
                events.append(ChunkFailed(w, error or SessionClosedError(f"session {session_id} was closed "
                                                                         "before this chunk ran")))
            elif error is not None:
                w.finished = True
                events.append(ResponseFailed(w, error))
            else:
                events.append(self._done(w, "closed"))
        return events

    # ---- queries --------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return any(self._queues.values())

    def responding(self, session_id: str) -> bool:
        """Whether the session's head of queue is a response (it is answering now)."""
        q = self._queues.get(session_id)
        return bool(q) and isinstance(q[0], Response)

    def open_response(self, session_id: str) -> Response | None:
        """The session's running or queued response that is not cancelled, if any."""
        return next((w for w in self._queues.get(session_id, ()) if isinstance(w, Response) and not w.cancelled),
                    None)

    def queued_chunks(self, session_id: str) -> int:
        return sum(1 for w in self._queues.get(session_id, ()) if isinstance(w, Chunk))

    def busy_sessions(self) -> set[str]:
        return {sid for sid, q in self._queues.items() if q}

    def tracked_sessions(self) -> set[str]:
        """Every session the scheduler keeps any state for (a queue, even empty; its service order; a deficit).
        Idle sessions are forgotten at the next `schedule`, so this stays bounded by the busy ones."""
        return set(self._queues) | set(self._last_served) | set(self._deficit)

    def depths(self) -> dict[str, int]:
        chunks = [w for q in self._queues.values() for w in q if isinstance(w, Chunk)]
        return {"queued_chunks": len(chunks), "queued_tokens": sum(c.remaining for c in chunks),
                "responding": sum(1 for q in self._queues.values() if q and isinstance(q[0], Response)),
                "queued_responses": sum(1 for q in self._queues.values() for w in list(q)[1:]
                                        if isinstance(w, Response))}

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> Plan:
        now = self.clock()
        lim = self.limits
        plan = Plan(items=[], created=now)
        for q in self._queues.values():
            cancelled = [w for w in q if isinstance(w, Response) and w.cancelled]
            for r in cancelled:
                q.remove(r)
            plan.cancelled += cancelled
        plan.shed = self._shed(now)
        for sid in [sid for sid, q in self._queues.items() if not q]:  # idle sessions hold nothing here
            del self._queues[sid]
            self._last_served.pop(sid, None)
        heads = {sid: q[0] for sid, q in self._queues.items()}
        decoders = sorted((sid for sid, w in heads.items() if isinstance(w, Response)),
                          key=lambda sid: self._last_served.get(sid, -1))
        appending = any(isinstance(w, Chunk) for w in heads.values())
        n_dec = min(len(decoders), lim.max_batch - (1 if appending else 0))
        for sid in decoders[:n_dec]:
            k = heads[sid].draft_len  # type: ignore[union-attr]
            plan.items.append(WorkItem(sid, "verify" if k else "decode", 1 + k, heads[sid]))
        budget = max(lim.step_tokens - sum(i.n_tokens for i in plan.items), lim.min_append_tokens)
        self._plan_appends(plan, {sid: w for sid, w in heads.items() if isinstance(w, Chunk)}, budget, now)
        for item in plan.items:  # a running count, not the step number: ties would favour the same sessions
            self._served += 1
            self._last_served[item.session_id] = self._served
        return plan

    def _plan_appends(self, plan: Plan, heads: dict[str, Chunk], budget: int, now: float) -> None:
        """Step 4: share `budget` tokens among the sessions whose head of queue is a chunk (`heads`)."""
        if not heads:
            self._deficit.clear()
            return
        share, floor = max(1, budget // len(heads)), budget
        deficit = {sid: self._deficit.get(sid, 0) for sid in heads}
        demand = {sid: self._demand(sid) for sid in heads}

        def by_need(sid: str) -> tuple[int, int, float, float]:
            if deficit[sid] < 0:  # it took more than its shares (leftovers count): the others go first
                return (2, -deficit[sid], *self._priority(heads[sid]))
            return (0 if demand[sid] <= share else 1, 0, *self._priority(heads[sid]))

        need = {sid: by_need(sid) for sid in heads}
        order = sorted(heads, key=lambda sid: (deficit[sid] <= 0, need[sid]))
        running = order[:self.limits.max_batch - len(plan.items)]  # owed sessions get the free slots first
        took = dict.fromkeys(running, 0)
        for sid in running:  # 4a: what earlier steps owe
            n = min(max(deficit[sid], 0), share, demand[sid], budget)
            took[sid] += n
            budget -= n
        for sid in sorted(running, key=need.__getitem__):  # 4b: the rest by need
            n = min(demand[sid] - took[sid], budget)
            took[sid] += n
            budget -= n
        # 4c: sessions with chunks still queued (and those that found no slot) carry their deficit
        self._deficit = {sid: max(-floor, min(share, deficit[sid] + share - took.get(sid, 0)))
                         for sid in heads if took.get(sid, 0) < demand[sid]}
        for sid in running:
            if took[sid]:
                plan.items.append(self._append_item(sid, took[sid]))

    def _demand(self, session_id: str) -> int:
        """Tokens of the chunks at the head of the session's queue (they may share a step; a reply ends them)."""
        n = 0
        for w in self._queues[session_id]:
            if not isinstance(w, Chunk):
                break
            n += w.remaining
        return n

    def _append_item(self, session_id: str, n_tokens: int) -> WorkItem:
        """The session's next `n_tokens` of input: the rest of its head chunk, then the chunks behind it; and
        when they finish every chunk queued before a reply, that reply (`then`: it starts in the same step, from
        the append's logits, instead of one step later)."""
        parts: list[tuple[Chunk, int]] = []
        then: Response | None = None
        for w in self._queues[session_id]:
            if not isinstance(w, Chunk):
                then = w  # every chunk before it is taken whole (the loop stops at a partial one)
                break
            if n_tokens <= 0:
                break
            n = min(w.remaining, n_tokens)
            parts.append((w, n))
            n_tokens -= n
            if n < w.remaining:
                break
        return WorkItem(session_id, "append", sum(n for _, n in parts), parts[0][0], tuple(parts), then)

    def _priority(self, chunk: Chunk) -> tuple[float, float]:
        """Earliest deadline first; waiting past `max_wait` counts as due (no starvation)."""
        return (min(chunk.deadline, chunk.arrival + self.limits.max_wait), chunk.arrival)

    def _shed(self, now: float) -> list[Chunk]:
        waiting = [w for q in self._queues.values() for w in q if isinstance(w, Chunk) and w.started is None]
        if not any(c.deadline < now for c in waiting):
            return []  # not behind: nothing is shed
        shed: list[Chunk] = []
        for q in self._queues.values():
            videos = [w for w in q if isinstance(w, Chunk) and w.kind == "video" and w.started is None]
            stale = [c for c in videos[:-1] if c.deadline < now]  # the newest frame is always kept
            for c in stale:
                q.remove(c)
            shed += stale
        shed.sort(key=lambda c: c.capture_time)
        self.shed_total += len(shed)
        return shed

    def update(self, plan: Plan, out: StepOutput) -> list[Event]:
        events: list[Event] = []
        for c in plan.shed:
            events.append(ChunkAcked(c, Ack(c.seq, 0, (out.started - c.arrival) * 1e3, 0.0, True, shed=True)))
        for r in plan.cancelled:
            events.append(self._done(r, "cancelled"))
        for item in plan.items:
            res = out.results.get(item.session_id) or ItemResult(error=StepError("internal: no result for this step"),
                                                                fatal=True)
            q = self._queues.get(item.session_id)
            if q is None or not q or q[0] is not item.work:
                continue  # the session was dropped while the step ran
            if res.fatal:
                err = res.error or StepError("the step failed")
                events += self.drop_session(item.session_id, err)
                if not isinstance(err, SessionClosedError):  # a session closed meanwhile did not fail
                    events.append(SessionFailed(item.session_id, err))
            elif isinstance(item.work, Chunk):
                events += self._update_chunk(q, item, res, out)
                then = out.then.get(item.session_id) if item.then is not None else None
                if then is not None and q and q[0] is item.then:  # the reply the append started
                    events += self._update_then(item.session_id, q, item.then, then, out)
            else:
                events += self._update_response(q, item.work, res, out)
        return events

    def _update_then(self, session_id: str, q: deque[Chunk | Response], r: Response, res: ItemResult,
                     out: StepOutput) -> list[Event]:
        if res.fatal:
            err = res.error or StepError("the step failed")
            events = self.drop_session(session_id, err)
            return [*events, SessionFailed(session_id, err)] if not isinstance(err, SessionClosedError) else events
        self._served += 1
        self._last_served[session_id] = self._served
        return self._update_response(q, r, res, out)

    def _update_chunk(self, q: deque[Chunk | Response], item: WorkItem, res: ItemResult,
                      out: StepOutput) -> list[Event]:
        if res.error is not None:  # every chunk the step attempted fails with it
            for _ in item.parts:
                q.popleft()
            return [ChunkFailed(c, res.error) for c, _ in item.parts]
        events: list[Event] = []
        for c, n in item.parts:
            if c.started is None:
                c.started = out.started
            c.done += n
            if c.remaining == 0:
                q.popleft()
                events.append(ChunkAcked(c, Ack(c.seq, len(c.token_ids), (c.started - c.arrival) * 1e3,
                                                (out.finished - c.started) * 1e3, out.finished > c.deadline)))
        return events

    def _update_response(self, q: deque[Chunk | Response], r: Response, res: ItemResult,
                         out: StepOutput) -> list[Event]:
        if res.error is not None:
            q.popleft()
            r.finished = True
            return [ResponseFailed(r, res.error)]
        if res.context_full:
            q.popleft()
            return [self._done(r, "context")]
        tokens = res.tokens if res.tokens is not None else [res.token]
        events: list[Event] = []
        reason = None
        for tok in tokens:
            assert tok is not None
            text, stopped = r.add_token(tok)
            events.append(TokenProduced(r, tok, text))
            reason = ("stop" if stopped or tok in r.stop_token_ids else "length" if r.produced >= r.max_tokens
                      else None)
            if reason is not None:
                break  # (the runner never emits past a stop token or max_tokens; a stop string ends it here)
        r.first_token_at = r.first_token_at or out.finished
        r.prev_token_at, r.last_token_at = r.last_token_at, out.finished
        if r.cancelled:
            reason = "cancelled"
        if reason is not None:
            q.popleft()
            events.append(self._done(r, reason))
        return events

    @staticmethod
    def _done(r: Response, reason: str) -> ResponseDone:
        r.finished = True
        return ResponseDone(r, reason, r.finish_text())  # type: ignore[arg-type]
