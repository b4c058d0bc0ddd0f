"""Rewind, snapshot/restore and park/unpark all leave a session equal to one fed the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import greedy, make_checkpoint, random_ids

from streamserve import Engine
from streamserve.errors import RewindError, SessionClosedError, SnapshotError


@pytest.mark.parametrize("kw", [{}, {"window": 24, "sinks": 4}, {"window": 24, "sinks": 4, "positions": "absolute"}])
def test_rewind_then_append_equals_a_fresh_session(engines, kw) -> None:
    engine = engines["qwen3_moe"]
    a, b, c = random_ids(20, seed=31), random_ids(9, seed=32), random_ids(7, seed=33)
    with engine.open_session(**kw) as s:
        s.append(token_ids=a, seq=10)
        s.append(token_ids=b, seq=11)
        s.generate(max_tokens=5, stop_token_ids=())
        assert s.rewind(to_seq=10) == len(a)  # keeps chunk 10, drops chunk 11 and the reply
        assert s.token_ids == a and [r.seq for r in s.timeline] == [10]
        s.append(token_ids=c)  # seq 11 again
        assert s.timeline[-1].seq == 11
        assert s.generate(max_tokens=8, stop_token_ids=()) == greedy(engine, a + c, **kw)
        s.rewind(to=5)
        s.append(token_ids=c)
        assert s.generate(max_tokens=8, stop_token_ids=()) == greedy(engine, a[:5] + c, **kw)
        engine.check_integrity()


def test_bad_rewinds_are_typed_and_harmless(engines) -> None:
    engine = engines["llama"]
    with engine.open_session(window=16, sinks=2) as s:
        s.append(token_ids=random_ids(100, seed=34))
        before, pages = list(s.token_ids), dict(s.kv.page_table)
        for kw in ({"to": -1}, {"to": 101}, {"to_seq": 7}, {}, {"to": 1, "to_seq": 0}, {"to": 30}):
            with pytest.raises(RewindError):
                s.rewind(**kw)  # to=30: the window already dropped what a query there would see
        assert s.token_ids == before and s.kv.page_table == pages
        s.rewind(to=99)  # what a query at 98 sees is all still held: fine
        engine.check_integrity()
    with pytest.raises(SessionClosedError):
        s.rewind(to=0)


@pytest.mark.parametrize("to_file", [False, True])
def test_snapshot_restore_continues_identically(engines, tmp_path: Path, to_file: bool) -> None:
    engine = engines["mixtral"]
    ids = random_ids(45, seed=35)
    with engine.open_session(window=30, sinks=4) as s:
        s.append(token_ids=ids)
        s.generate(max_tokens=3, stop_token_ids=())
        snap = s.snapshot(tmp_path / "s.snap" if to_file else None)
        expected = s.generate(max_tokens=10, stop_token_ids=())
        timeline = list(s.timeline)
    with engine.restore(snap) as r:
        assert r.generate(max_tokens=10, stop_token_ids=()) == expected
        assert r.timeline == timeline
        engine.check_integrity()


def test_snapshot_from_another_model_is_refused(engines, tmp_path: Path) -> None:
    with engines["qwen3"].open_session() as s:
        s.append(token_ids=[1, 2, 3])
        path = s.snapshot(tmp_path / "q.snap")
    make_checkpoint(tmp_path / "other", "qwen3", seed=1)  # same architecture and sizes, other weights
    other = Engine.from_pretrained(tmp_path / "other", device="cpu")
    with pytest.raises(SnapshotError, match="fingerprint"):
        other.restore(path)
    (tmp_path / "junk.snap").write_bytes(b"not a snapshot")
    with pytest.raises(SnapshotError):
        other.restore(tmp_path / "junk.snap")
    torch.save({"format": "streamserve.session", "version": 99}, tmp_path / "v99.snap")
    with pytest.raises(SnapshotError, match="version 99"):
        other.restore(tmp_path / "v99.snap")
    assert other.stats()["kv_pages_used"] == 0


def test_park_and_unpark_are_invisible(engines) -> None:
    engine = engines["olmoe"]
    ids = random_ids(40, seed=36)
    expected = greedy(engine, ids)
    with engine.open_session() as s:
        s.append(token_ids=ids)
        used = engine.stats()["kv_pages_used"]
        s.park()
        st = engine.stats()
        assert s.state.value == "parked" and st["sessions_parked"] >= 1 and st["kv_pages_used"] < used
        assert s.generate(max_tokens=8, stop_token_ids=()) == expected
        assert s.state.value == "open"
        engine.check_integrity()


def test_closed_sessions_and_bad_windows_are_typed(engines) -> None:
    from streamserve.errors import InvalidInputError

    engine = engines["qwen3"]
    s = engine.open_session()
    s.append(token_ids=[1, 2])
    s.close()
    for call in (s.snapshot, s.park, lambda: s.append(token_ids=[1])):
        with pytest.raises(SessionClosedError):
            call()
    for kw in ({"window": 2, "sinks": 4}, {"window": 0}, {"positions": "rolling"}, {"page_cap": 0},
               {"window": "16"}):
        with pytest.raises(InvalidInputError):
            engine.open_session(**kw)
    engine.check_integrity()


@pytest.mark.parametrize(("window", "sinks"), [(1, 0), (1, 1), (5, 2), (12, 3)])
def test_rewind_across_dropped_pages_with_small_pages(checkpoints, window, sinks) -> None:
    engine = Engine.from_pretrained(checkpoints["qwen3"][0], device="cpu", page_size=4, kv_memory="16MiB")
    ids, c = random_ids(20, seed=37), random_ids(3, seed=38)
    for to in (19, 16, 11):
        with engine.open_session(window=window, sinks=sinks) as s:
            s.append(token_ids=ids)
            try:
                s.rewind(to=to)
            except RewindError:
                continue  # the window dropped what a query there sees: refused, nothing changed
            s.append(token_ids=c)
            assert s.generate(max_tokens=8, stop_token_ids=()) == greedy(engine, ids[:to] + c, window=window,
                                                                         sinks=sinks)
        engine.check_integrity()


def test_a_damaged_snapshot_is_typed_and_takes_nothing(engines) -> None:
    engine = engines["llama"]
    with engine.open_session(page_cap=9) as s:
        s.append(token_ids=random_ids(40, seed=39))
        snap = s.snapshot()
    with engine.restore(snap) as r:
        assert r.kv.page_cap == 9  # the cap travels with the snapshot
    used = engine.stats()["kv_pages_used"]
    sessions = engine.stats()["sessions_open"]
    snap.pages.logical.append(99)
    with pytest.raises(SnapshotError, match="damaged"):
        engine.restore(snap)
    assert engine.stats()["kv_pages_used"] == used and engine.stats()["sessions_open"] == sessions
    engine.check_integrity()


def test_snapshot_and_rewind_in_the_middle_of_a_reply(engines) -> None:
    engine = engines["qwen3_moe"]
    with engine.open_session() as s:
        s.append(token_ids=random_ids(20, seed=40))
        reply = s.stream(max_tokens=60, stop_token_ids=())
        got = next(reply).token_ids
        with engine.guard:  # between two steps: the reply is somewhere in its 60 tokens
            n = len(s.token_ids) - 20
            snap = s.snapshot()
            last = snap.timeline[-1]
            assert last.kind == "reply" and (last.start, last.end) == (20, 20 + n)
            s.rewind(to=21)  # ends the reply, keeps its first token
        list(reply)
        assert reply.finish_reason in ("cancelled", "length") and len(reply.token_ids) == n
        assert s.token_ids[20:] == got[:1]
        assert [(r.kind, r.start, r.end) for r in s.timeline] == [("input", 0, 20), ("reply", 20, 21)]
