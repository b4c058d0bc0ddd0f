"""Embedding chunks: vectors appended in place of token ids (audio, image, video, robot state).

The reference everywhere: appending `embed_tokens(ids)` as vectors must give exactly what appending `ids`
gives (logits and greedy tokens), however the session is chunked, windowed, rewound, snapshot, parked,
batched with other sessions or drafted on; and every bad input is a typed error that changes nothing.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import assert_same, greedy, random_ids, vectors

from streamserve import Engine
from streamserve.config import SchedulerConfig
from streamserve.engine.drafters.ngram import NgramIndex
from streamserve.errors import (
    SnapshotError,
)


def feed(engine: Engine, session, ids: list[int], cuts: list[int], as_vectors: set[int]) -> list[torch.Tensor]:
    """Append ids cut at `cuts`; the pieces numbered in `as_vectors` go in as vectors. -> logits after each."""
    out, bounds = [], [0, *cuts, len(ids)]
    kinds = ["audio", "image", "state", "video"]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        if i in as_vectors:
            session.append(embeds=vectors(engine, ids[a:b]), kind=kinds[i % len(kinds)])
        else:
            session.append(token_ids=ids[a:b])
        out.append(session.core.logits.clone())
    return out


@pytest.mark.parametrize("cuts,as_vectors", [([], {0}), ([5, 9, 20], {1, 3}), ([3, 4, 12, 13], {0, 2, 4})])
def test_vectors_of_the_ids_give_the_ids_logits_and_greedy_tokens(engine, cuts, as_vectors) -> None:
    ids = random_ids(26, seed=3, vocab=250)
    with engine.open_session() as ref, engine.open_session() as s:
        for a, b in zip(feed(engine, ref, ids, cuts, set()), feed(engine, s, ids, cuts, as_vectors), strict=True):
            assert_same(a, b)
        assert s.generate(max_tokens=8, stop_token_ids=()) == ref.generate(max_tokens=8, stop_token_ids=())
        assert len(s) == len(ref) and s.kv.length == ref.kv.length
        assert [(r.kind, r.seq, r.start, r.end) for r in s.timeline] == [
            (r.kind, r.seq, r.start, r.end) for r in ref.timeline]
        ph = s.core.placeholder_id
        assert all(s.token_ids[p] == ph for p in s.core.vectors)
    engine.check_integrity()


@pytest.mark.parametrize("positions", ["rolling", "absolute"])
def test_windows_and_sinks_and_bounded_vectors(engines, positions) -> None:
    engine = engines["qwen3"]
    ids = random_ids(90, seed=4, vocab=250)
    cuts = list(range(7, 90, 7))
    kw = dict(window=16, sinks=4, positions=positions)
    with engine.open_session(**kw) as ref, engine.open_session(**kw) as s:
        vec = set(range(0, len(cuts) + 1, 2))
        for a, b in zip(feed(engine, ref, ids, cuts, set()), feed(engine, s, ids, cuts, vec), strict=True):
            assert_same(a, b)
        assert s.generate(max_tokens=6, stop_token_ids=()) == ref.generate(max_tokens=6, stop_token_ids=())
        # the window dropped most positions; every position a rewind can still run again keeps its vector
        reachable = [t for t in range(1, len(s)) if s.kv.can_rewind(min(t - 1, s.kv.length))]
        vector_positions = {p for i, (a, b) in enumerate(itertools.pairwise([0, *cuts, 90])) if i in vec
                            for p in range(a, b)}
        assert all(t - 1 in s.core.vectors for t in reachable if t - 1 in vector_positions)
        assert len(s.core.vectors) < len(vector_positions) // 2
        targets = sorted({reachable[-1], reachable[len(reachable) // 2], 17, 15, 3} & set(reachable), reverse=True)
        assert 17 in targets  # keeps 16 in the KV: the first position after the sink page, run again
        for t in targets:  # deepest last: each rewind cuts what the next one keeps
            s.rewind(to=t)
            ref.rewind(to=t)
            assert s.generate(max_tokens=3, stop_token_ids=()) == ref.generate(max_tokens=3, stop_token_ids=())
            assert_same(s.core.logits, ref.core.logits)
    if positions == "rolling":  # an endless stream of embedding chunks keeps host memory bounded
        with engine.open_session(**kw) as s:
            for i in range(40):
                s.append(embeds=vectors(engine, random_ids(8, seed=100 + i, vocab=250)), kind="audio")
            assert len(s) == 320 and len(s.core.vectors) <= 4 + 16 + engine.pool.page_size + 8
    engine.check_integrity()


@pytest.mark.parametrize("to", [3, 9, 12, 14, 20])
def test_rewind_into_and_after_an_embedding_chunk(engine, to) -> None:
    ids = random_ids(24, seed=5, vocab=250)
    more = random_ids(5, seed=6, vocab=250)
    expected = greedy(engine, ids[:to] + more, max_tokens=6)
    with engine.open_session() as s:
        feed(engine, s, ids, [8, 14], {1, 2})  # [0, 8) ids, [8, 14) and [14, 24) vectors
        s.generate(max_tokens=3, stop_token_ids=())
        s.rewind(to=to)
        assert len(s) == to and all(p < to for p in s.core.vectors)
        s.append(token_ids=more)
        assert s.generate(max_tokens=6, stop_token_ids=()) == expected
    with engine.open_session() as s:  # a reply right after the rewind runs the last kept position again
        feed(engine, s, ids, [8, 14], {1, 2})
        s.rewind(to=to)
        assert s.generate(max_tokens=6, stop_token_ids=()) == greedy(engine, ids[:to], max_tokens=6)
    engine.check_integrity()


def test_rewind_to_seq_and_a_chunk_split_across_steps(checkpoints) -> None:
    path, _ = checkpoints["qwen3"]
    engine = Engine.from_pretrained(path, device="cpu", kv_memory="16MiB",
                                    scheduler=SchedulerConfig(step_tokens=8, min_append_tokens=8))
    ids = random_ids(40, seed=7, vocab=250)
    with engine.open_session() as ref, engine.open_session() as s:
        ref.append(token_ids=ids[:10])
        ref.append(token_ids=ids[10:])
        s.append(token_ids=ids[:10])
        steps = engine.loop.steps
        s.append(embeds=vectors(engine, ids[10:]), kind="image")  # 30 vectors: 4 steps of at most 8
        assert engine.loop.steps - steps >= 4
        assert_same(ref.core.logits, s.core.logits)
        assert [(r.seq, r.start, r.end) for r in s.timeline] == [(0, 0, 10), (1, 10, 40)]
        s.rewind(to_seq=0)
        assert len(s) == 10 and not s.core.vectors
        assert s.generate(max_tokens=5, stop_token_ids=()) == greedy(engine, ids[:10], max_tokens=5)
    engine.check_integrity()
    engine.shutdown()


def test_snapshot_restore_and_park_keep_the_vectors(engine, tmp_path) -> None:
    ids = random_ids(30, seed=8, vocab=250)
    expected = greedy(engine, ids, max_tokens=8)
    with engine.open_session() as s:
        feed(engine, s, ids, [10, 19], {1, 2})  # ends on an embedding chunk
        path = s.snapshot(tmp_path / "s.pt")
        with engine.restore(path) as r:  # torch.load(weights_only=True)
            assert sorted(r.core.vectors) == sorted(s.core.vectors)
            assert r.generate(max_tokens=8, stop_token_ids=()) == expected
        with engine.restore(s.snapshot()) as r:
            r.rewind(to=15)  # into a restored embedding chunk
            assert r.generate(max_tokens=4, stop_token_ids=()) == greedy(engine, ids[:15], max_tokens=4)
        s.park()
        assert s.pages_held == 0
        assert s.generate(max_tokens=8, stop_token_ids=()) == expected
    snap = engine.open_session()
    snap.append(embeds=vectors(engine, ids[:4]), kind="state")
    bad = snap.snapshot()
    snap.close()
    bad.vectors = bad.vectors[:, :3]
    with pytest.raises(SnapshotError):
        engine.restore(bad)
    engine.check_integrity()


def test_mixed_steps_are_one_batched_forward(engine) -> None:
    a_ids, b_ids, c_ids = (random_ids(12, seed=s, vocab=250) for s in (10, 11, 12))
    refs = []
    for ids in (a_ids, b_ids, c_ids):
        with engine.open_session() as r:
            r.append(token_ids=ids[:4])
            r.append(token_ids=ids[4:])
            refs.append((r.core.logits.clone(), r.generate(max_tokens=6, stop_token_ids=())))
    sessions = [engine.open_session() for _ in range(3)]
    for s, ids in zip(sessions, (a_ids, b_ids, c_ids), strict=True):
        s.append(token_ids=ids[:4])
    calls = engine.counters.forward_calls
    with engine.guard:  # queued together: one step runs ids, vectors, and ids + vectors
        futures = [sessions[0].submit_chunk(token_ids=a_ids[4:]),
                   sessions[1].submit_chunk(embeds=vectors(engine, b_ids[4:]), kind="audio"),
                   sessions[2].submit_chunk(embeds=vectors(engine, c_ids[4:8]), kind="image"),
                   sessions[2].submit_chunk(token_ids=c_ids[8:])]
    for f in futures:
        f.result(60)
    assert engine.counters.forward_calls == calls + 1
    for s, (logits, tokens) in zip(sessions, refs, strict=True):
        assert (s.core.logits - logits).abs().max().item() <= 1e-5
        assert s.generate(max_tokens=6, stop_token_ids=()) == tokens
        s.close()
    engine.check_integrity()


def test_drafters_never_draft_from_a_placeholder(default_engine) -> None:
    engine = default_engine
    ids = engine.tokenizer.encode("And God said, Let there be light: and there was light. " * 4)
    with engine.open_session(drafter="none") as ref:
        ref.append(token_ids=ids)
        expected = ref.generate(max_tokens=16, stop_token_ids=())
    with engine.open_session(drafter="ngram") as s:
        s.append(token_ids=ids[:20])
        s.append(embeds=vectors(engine, ids[20:30]), kind="audio")
        s.append(token_ids=ids[30:])
        assert s.generate(max_tokens=16, stop_token_ids=()) == expected
    # the index itself: n-grams through a placeholder are never indexed, proposals stop before one
    index = NgramIndex(3, placeholder=-7)
    index.sync([1, 2, 3, -7, 1, 2, 3, 4, -7, 5, 1, 2, 3], revision=0)
    assert -7 not in index.lookup(4) and index.lookup(4) == [4]
    index.sync([1, 2, 3, -7, 1, 2, 3, 4, -7, 5, 1, 2, 3, -7], revision=0)
    assert index.lookup(4) == []
