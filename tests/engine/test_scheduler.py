"""The scheduler alone, with a scripted clock and made-up runner outputs (no model)."""

from __future__ import annotations

import pytest

from streamserve.config import SchedulerConfig
from streamserve.engine.scheduler import Scheduler
from streamserve.engine.work import (
    Chunk,
    ChunkAcked,
    ChunkFailed,
    ItemResult,
    Plan,
    Response,
    ResponseDone,
    StepOutput,
)
from streamserve.errors import CapacityError, InvalidInputError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def chunk(sid: str, n: int, arrival: float, deadline: float | None = None, kind: str = "text", seq: int = 0) -> Chunk:
    due = arrival + 0.2 if deadline is None else deadline
    return Chunk(sid, seq, list(range(1, n + 1)), kind, arrival, arrival, due)


def response(sid: str, max_tokens: int = 4, arrival: float = 100.0,
             stop_ids: frozenset[int] = frozenset()) -> Response:
    return Response(sid, max_tokens, 0.0, 1.0, 0, stop_ids, (), None, arrival)


def run(sched: Scheduler, clock: Clock, token: int = 7, dt: float = 0.01) -> tuple[Plan, list]:
    """One step whose runner succeeds at everything, taking `dt` seconds."""
    plan = sched.schedule()
    start = clock.t
    clock.t += dt
    out = StepOutput({i.session_id: ItemResult(token=token if i.kind == "decode" else None) for i in plan.items},
                     start, clock.t)
    return plan, sched.update(plan, out)


def test_answering_sessions_go_first_and_appends_fill_the_budget_in_deadline_order() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=20, max_batch=8, min_append_tokens=4), clock)
    sched.add(chunk("late", 10, 100.0, deadline=100.9))
    sched.add(chunk("early", 10, 100.0, deadline=100.1))
    sched.add(chunk("middle", 10, 100.0, deadline=100.5))
    for sid in ("r1", "r2"):
        sched.add(response(sid))
    plan, _ = run(sched, clock)
    assert [(i.session_id, i.kind, i.n_tokens) for i in plan.items] == [
        ("r1", "decode", 1), ("r2", "decode", 1), ("early", "append", 10), ("middle", "append", 8)]
    assert plan.as_dict() == {"r1": 1, "r2": 1, "early": 10, "middle": 8}
    plan, events = run(sched, clock)  # the split chunk goes on where it stopped
    assert plan.as_dict() == {"r1": 1, "r2": 1, "middle": 2, "late": 10}
    acks = [e.ack for e in events if isinstance(e, ChunkAcked)]
    assert [(a.tokens, a.shed) for a in acks] == [(10, False), (10, False)]


def test_a_chunk_is_acked_with_its_queue_and_compute_time() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=6, min_append_tokens=1), clock)
    sched.add(chunk("a", 10, 99.9, deadline=100.015, seq=3))
    assert run(sched, clock)[1] == []  # 6 of 10 tokens: no ack yet
    _, events = run(sched, clock)
    (ack,) = [e.ack for e in events if isinstance(e, ChunkAcked)]
    assert ack.seq == 3 and ack.tokens == 10
    assert ack.queue_ms == pytest.approx(100.0) and ack.compute_ms == pytest.approx(20.0)
    assert ack.deadline_missed  # finished at 100.02, due at 100.015


def test_appends_progress_even_when_many_sessions_answer() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=8, max_batch=8, min_append_tokens=3), clock)
    for i in range(20):
        sched.add(response(f"r{i}", max_tokens=100))
    sched.add(chunk("in", 5, 100.0))
    plan, _ = run(sched, clock)
    kinds = [i.kind for i in plan.items]
    assert kinds.count("decode") == 7 and plan.as_dict()["in"] == 3  # a slot and a share kept for appends
    plan, events = run(sched, clock)
    assert plan.as_dict()["in"] == 2 and any(isinstance(e, ChunkAcked) for e in events)


def test_answering_sessions_take_turns_when_there_are_more_than_fit() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=64, max_batch=3), clock)
    for i in range(5):
        sched.add(response(f"r{i}", max_tokens=100))
    served: dict[str, int] = {}
    for _ in range(10):
        plan, _ = run(sched, clock)
        assert len(plan.items) == 3
        for sid in plan.as_dict():
            served[sid] = served.get(sid, 0) + 1
    assert sorted(served.values()) == [6, 6, 6, 6, 6]  # 30 slots, 5 sessions: nobody starves


def test_a_late_deadline_does_not_starve_a_chunk() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=4, min_append_tokens=4, max_wait=0.05), clock)
    sched.add(chunk("patient", 4, 100.0, deadline=200.0))
    acked = []
    for step in range(12):  # a new urgent chunk arrives every step, each due 30 ms after it arrives
        sched.add(chunk(f"urgent{step}", 4, clock.t, deadline=clock.t + 0.03))
        _, events = run(sched, clock)
        acked += [e.chunk.session_id for e in events if isinstance(e, ChunkAcked)]
    # waiting past max_wait orders the patient chunk as due then: it runs after at most a few steps
    assert "patient" in acked[:7]


def test_each_session_runs_its_work_in_submission_order() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(), clock)
    sched.add(chunk("s", 3, 100.0))
    sched.add(response("s", max_tokens=2))
    sched.add(chunk("s", 2, 100.0, seq=1))
    kinds = []
    for _ in range(5):
        plan, _ = run(sched, clock)
        kinds += [(i.kind, i.n_tokens) for i in plan.items]
    assert kinds == [("append", 3), ("decode", 1), ("decode", 1), ("append", 2)]
    assert not sched.has_work()


def test_a_reply_ends_at_max_tokens_at_a_stop_token_or_when_cancelled_within_one_step() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(), clock)
    sched.add(response("a", max_tokens=3))
    sched.add(response("b", max_tokens=50, stop_ids=frozenset({9})))
    sched.add(response("c", max_tokens=50))
    ends: dict[str, str] = {}
    for step in range(6):
        if step == 1:
            assert sched.cancel("c") == 1
        plan = sched.schedule()
        out = StepOutput({i.session_id: ItemResult(token=9 if i.session_id == "b" and step == 1 else 1)
                          for i in plan.items}, clock.t, clock.t)
        for e in sched.update(plan, out):
            if isinstance(e, ResponseDone):
                ends[e.response.session_id] = f"{e.reason}@{step}"
    assert ends == {"a": "length@2", "b": "stop@1", "c": "cancelled@1"}


def test_under_overload_stale_video_is_shed_oldest_first_but_never_text_or_audio() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=2, min_append_tokens=2), clock)
    for j in range(4):
        sched.add(chunk("cam", 2, 100.0 + j * 0.01, kind="video", seq=j))
    sched.add(chunk("mic", 2, 100.0, kind="audio"))
    sched.add(chunk("txt", 2, 100.0, kind="text"))
    plan, events = run(sched, clock)  # on time: nothing is shed
    assert not plan.shed
    clock.t = 101.0  # everything is late now
    plan, events = run(sched, clock)
    assert [c.seq for c in plan.shed] == [1, 2]  # the started frame 0 and the newest frame 3 are kept
    shed_acks = [e.ack for e in events if isinstance(e, ChunkAcked) and e.ack.shed]
    assert [(a.seq, a.tokens) for a in shed_acks] == [(1, 0), (2, 0)]
    assert sched.shed_total == 2
    while sched.has_work():
        plan, _ = run(sched, clock)
        assert not plan.shed or all(c.kind == "video" for c in plan.shed)


def test_queues_are_bounded_and_limits_are_checked() -> None:
    sched = Scheduler(SchedulerConfig(max_queued=3), Clock())
    for i in range(3):
        sched.add(chunk("s", 1, 100.0, seq=i))
    with pytest.raises(CapacityError, match="queued"):
        sched.add(chunk("s", 1, 100.0, seq=3))
    sched.add(chunk("other", 1, 100.0))  # another session's queue is separate
    with pytest.raises(InvalidInputError, match="step_tokens"):
        SchedulerConfig(step_tokens=0)


def test_a_failed_item_fails_only_its_work_and_a_fatal_one_its_whole_session() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(), clock)
    sched.add(chunk("bad", 3, 100.0))
    sched.add(chunk("worse", 3, 100.0))
    sched.add(response("worse"))
    sched.add(chunk("good", 3, 100.0))
    plan = sched.schedule()
    results = {"bad": ItemResult(error=ValueError("x")), "worse": ItemResult(error=RuntimeError("y"), fatal=True),
               "good": ItemResult()}
    events = sched.update(plan, StepOutput(results, clock.t, clock.t))
    kinds = sorted(type(e).__name__ + ":" + getattr(getattr(e, "chunk", getattr(e, "response", None)), "session_id",
                                                     getattr(e, "session_id", "")) for e in events)
    assert kinds == ["ChunkAcked:good", "ChunkFailed:bad", "ChunkFailed:worse", "ResponseFailed:worse",
                     "SessionFailed:worse"]
    assert not sched.has_work()


def test_dropping_a_session_fails_its_chunks_and_closes_its_reply() -> None:
    sched = Scheduler(SchedulerConfig(), Clock())
    sched.add(response("s"))
    sched.add(chunk("s", 2, 100.0))
    events = sched.drop_session("s")
    assert [type(e) for e in events] == [ResponseDone, ChunkFailed]
    assert events[0].reason == "closed"  # type: ignore[union-attr]


def test_chunks_queued_behind_each_other_share_a_step() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=10, min_append_tokens=10), clock)
    for seq in range(4):
        sched.add(chunk("s", 4, 100.0, seq=seq))
    sched.add(response("s"))
    sched.add(chunk("s", 4, 100.0, seq=4))
    plan, events = run(sched, clock)
    (item,) = plan.items
    assert [(c.seq, n) for c, n in item.parts] == [(0, 4), (1, 4), (2, 2)] and item.n_tokens == 10
    assert [e.ack.seq for e in events if isinstance(e, ChunkAcked)] == [0, 1]
    plan, events = run(sched, clock)  # the rest of chunk 2, then chunk 3; never past the reply
    assert [(c.seq, n) for c, n in plan.items[0].parts] == [(2, 2), (3, 4)]
    assert [e.ack.seq for e in events if isinstance(e, ChunkAcked)] == [2, 3]
    plan, _ = run(sched, clock)
    assert plan.items[0].kind == "decode"


# ---- sharing the append budget (deficit round-robin) -------------------------------------------------------
def test_a_flood_of_late_long_chunks_takes_only_what_on_time_chunks_leave() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=64), clock)
    for seq in range(4):  # 4,000 tokens queued long ago: every one of them is already late
        sched.add(chunk("flood", 1000, 99.0, seq=seq))
    flood_tokens = []
    for step in range(30):
        small = {f"s{i}": chunk(f"s{i}", 5, clock.t, seq=step) for i in range(8)}
        for c in small.values():
            sched.add(c)
        plan, events = run(sched, clock)
        acked = {e.chunk.session_id for e in events if isinstance(e, ChunkAcked)}
        assert set(small) <= acked  # every small chunk finished in the step after it was queued
        flood_tokens.append(plan.as_dict()["flood"])
    assert flood_tokens == [64 - 8 * 5] * 30  # the flood still makes progress every step, with what is left


def test_a_flooding_session_takes_no_more_than_its_shares_while_others_wait() -> None:
    import random

    rng = random.Random(11)
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=64), clock)
    for seq in range(8):
        sched.add(chunk("flood", 1000, 99.0, seq=seq))
    seqs = dict.fromkeys((f"s{i}" for i in range(6)), 0)
    excess, over_share_steps = 0, 0
    for _ in range(200):
        for sid in seqs:  # on-time chunks of random sizes, some bigger than a share, arriving at random
            if rng.random() < 0.3 and sched.queued_chunks(sid) < 4:
                sched.add(chunk(sid, rng.randint(1, 40), clock.t, deadline=clock.t + 60, seq=seqs[sid]))
                seqs[sid] += 1
        appending = sum(1 for sid in ("flood", *seqs) if sched.queued_chunks(sid))
        plan, _ = run(sched, clock)
        took, share = plan.as_dict().get("flood", 0), 64 // appending
        if any(sched.queued_chunks(sid) for sid in seqs):  # someone else is still waiting after the step
            excess += took - share
            assert excess <= 64  # ahead of its shares by one step's budget at most, ever
        over_share_steps += took > share
    assert over_share_steps > 20  # and it takes the rest of the budget whenever nobody else wants it


def test_late_floods_share_what_is_left_in_turn() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=64), clock)
    for seq in range(4):
        sched.add(chunk("a", 1000, 98.0, seq=seq))  # the earlier deadline: pure deadline order would serve only a
        sched.add(chunk("b", 1000, 99.0, seq=seq))
    totals = {"a": 0, "b": 0}
    for _ in range(40):
        plan, _ = run(sched, clock)
        for sid, n in plan.as_dict().items():
            totals[sid] += n
        assert abs(totals["a"] - totals["b"]) <= 64  # never more than one step apart
    assert totals == {"a": 1280, "b": 1280}


def test_a_session_short_of_its_share_is_owed_it_and_goes_first_next_step() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=12, max_batch=2, min_append_tokens=1), clock)
    for sid, due in (("a", 100.3), ("b", 100.5), ("c", 100.7)):
        sched.add(chunk(sid, 100, 100.0, deadline=due))
    plan, _ = run(sched, clock)  # shares of 4; c finds no slot, b none of the budget: both are owed
    assert plan.as_dict() == {"a": 12}
    plan, _ = run(sched, clock)  # the owed sessions take the slots and their shares first, then deadline order
    assert [(i.session_id, i.n_tokens) for i in plan.items] == [("b", 8), ("c", 4)]
    plan, _ = run(sched, clock)  # b, not a: a took three shares in the first step and still owes them
    assert plan.as_dict() == {"c": 4, "b": 8}
    totals = {"a": 12, "b": 16, "c": 8}
    for _ in range(20):
        for sid, n in run(sched, clock)[0].as_dict().items():
            totals[sid] += n
    assert max(totals.values()) - min(totals.values()) <= 12  # over time, a share each: one step apart at most


def test_a_big_chunk_is_not_starved_by_small_chunks_that_fill_every_step() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=16, min_append_tokens=1), clock)
    sched.add(chunk("big", 200, 100.0, deadline=200.0))  # on time but due last: deadline order alone starves it
    got, gap, longest_gap = 0, 0, 0
    for step in range(60):
        for i in range(4):  # 16 tokens of urgent chunks every step: the whole budget
            if sched.queued_chunks(f"s{i}") < 2:
                sched.add(chunk(f"s{i}", 4, clock.t, deadline=clock.t + 0.05, seq=step))
        n = run(sched, clock)[0].as_dict().get("big", 0)
        got += n
        gap = 0 if n else gap + 1
        longest_gap = max(longest_gap, gap)
    assert longest_gap <= 2 and got >= 60 * (16 // 5) // 3  # at least a share in every three steps


def test_sharing_is_deterministic() -> None:
    def script() -> list[dict[str, int]]:
        clock = Clock()
        sched = Scheduler(SchedulerConfig(step_tokens=48, max_batch=6), clock)
        plans = []
        for step in range(40):
            for i in range(7):
                if (step * 7 + i) % 3 == 0:
                    sched.add(chunk(f"s{i}", 1 + (step * 13 + i * 5) % 60, clock.t - (i % 2), seq=step))
            if step % 9 == 0:
                sched.add(response(f"s{step % 7}", max_tokens=3))
            plans.append(run(sched, clock)[0].as_dict())
        return plans

    assert script() == script()


def test_a_small_chunk_finishes_in_one_step_even_behind_a_long_chunk_due_first() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=32, min_append_tokens=1), clock)
    sched.add(chunk("long", 1000, 100.0, deadline=100.05))  # on time, due first, far more than a step
    for step in range(5):  # it is refreshed every step: always the earliest deadline, never late
        sched.add(chunk("small", 6, clock.t, seq=step))
        plan, events = run(sched, clock)
        assert plan.as_dict() == {"small": 6, "long": 26}
        assert [e.chunk.session_id for e in events if isinstance(e, ChunkAcked)] == ["small"]
        sched.drop_session("long")
        sched.add(chunk("long", 1000, clock.t, deadline=clock.t + 0.05))


def test_a_reply_queued_behind_the_chunks_a_step_finishes_starts_in_that_step() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(step_tokens=8, max_batch=8, min_append_tokens=4), clock)
    c1, c2, r = chunk("a", 5, 100.0), chunk("a", 6, 100.0, seq=1), response("a", max_tokens=3)
    for w in (c1, c2, r):
        sched.add(w)
    plan = sched.schedule()  # 8 of the 11 tokens: the second chunk is split, the reply waits
    assert plan.items[0].n_tokens == 8 and plan.items[0].then is None
    sched.update(plan, StepOutput({"a": ItemResult()}, clock.t, clock.t))
    plan = sched.schedule()  # the rest of the chunk: the reply rides on it
    item = plan.items[0]
    assert (item.kind, item.n_tokens, item.then) == ("append", 3, r)
    events = sched.update(plan, StepOutput({"a": ItemResult()}, clock.t, clock.t, {"a": ItemResult(tokens=[4, 5])}))
    assert [type(e).__name__ for e in events] == ["ChunkAcked", "TokenProduced", "TokenProduced"]
    assert r.produced == 2 and sched.responding("a")
    plan, events = run(sched, clock)
    assert [(i.kind, i.n_tokens) for i in plan.items] == [("decode", 1)]
    assert isinstance(events[-1], ResponseDone) and events[-1].reason == "length"
    # a runner that did not start the reply (no result for it): the reply runs in the next step as before
    sched.add(chunk("b", 2, 100.0))
    sched.add(r2 := response("b", max_tokens=1))
    plan = sched.schedule()
    assert plan.items[0].then is r2
    sched.update(plan, StepOutput({"b": ItemResult()}, clock.t, clock.t))
    assert r2.produced == 0 and sched.responding("b")
