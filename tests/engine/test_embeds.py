"""Embedding chunks: vectors appended in place of token ids (audio, image, video, robot state).

The reference everywhere: appending `embed_tokens(ids)` as vectors must give exactly what appending `ids`
gives (logits and greedy tokens), however the session is chunked, windowed, rewound, snapshot, parked,
batched with other sessions or drafted on; and every bad input is a typed error that changes nothing.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import greedy, random_ids

from streamserve import Engine
from streamserve.config import SchedulerConfig
from streamserve.engine.drafters.ngram import NgramIndex
from streamserve.errors import (
    ChunkTooLargeError,
    ContextLengthError,
    EmbeddingDtypeError,
    EmbeddingShapeError,
    EmptyAppendError,
    InvalidInputError,
    NonFiniteInputError,
    RewindError,
    SnapshotError,
)


@pytest.fixture(scope="module")
def default_engine() -> Engine:
    engine = Engine.from_pretrained("default", device="cpu", kv_memory="64MiB")
    yield engine
    engine.shutdown()


@pytest.fixture(params=["default", "qwen3"])
def engine(request, engines, default_engine) -> Engine:
    return default_engine if request.param == "default" else engines["qwen3"]


def vectors(engine: Engine, ids: list[int]) -> torch.Tensor:
    """[T, hidden]: the model's own embeddings of ids (what an append of ids feeds the first layer)."""
    with torch.no_grad():
        return engine.model.embed_tokens(torch.tensor(ids)).clone()


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


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= 1e-6


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


def bad_inputs(hidden: int) -> list[tuple[object, type[Exception]]]:
    nan = torch.zeros(3, hidden)
    nan[1, 2] = float("nan")
    return [
        (torch.zeros(3, hidden + 1), EmbeddingShapeError),
        (torch.zeros(hidden), EmbeddingShapeError),
        (torch.zeros(1, 3, hidden), EmbeddingShapeError),
        (torch.zeros(3, hidden, dtype=torch.long), EmbeddingDtypeError),
        (nan, NonFiniteInputError),
        (torch.full((2, hidden), float("inf")), NonFiniteInputError),
        (torch.zeros(0, hidden), EmptyAppendError),
        (torch.zeros(9, hidden), ChunkTooLargeError),
        ([[0.0] * hidden], InvalidInputError),
    ]


def test_bad_embeddings_are_typed_errors_that_change_nothing(engine) -> None:
    hidden = engine.config.hidden_size
    with engine.open_session() as s:
        s.max_chunk_tokens = 8
        s.append(embeds=vectors(engine, [5, 6, 7]), kind="audio")
        before = (len(s), s.kv.length, s.next_seq, len(s.core.vectors), engine.pool.allocator.used_count)
        for bad, error in bad_inputs(hidden):
            with pytest.raises(error) as info:
                s.append(embeds=bad, kind="audio")
            assert info.value.code
        with pytest.raises(InvalidInputError):
            s.append(token_ids=[1], embeds=vectors(engine, [1]))
        with pytest.raises(InvalidInputError):
            s.append(embeds=vectors(engine, [1]), kind="smell")
        assert (len(s), s.kv.length, s.next_seq, len(s.core.vectors), engine.pool.allocator.used_count) == before
    limit = engine.config.max_position_embeddings
    with engine.open_session() as s:  # past the context (absolute positions)
        s.append(embeds=torch.zeros(limit - 2, hidden), kind="state")
        with pytest.raises(ContextLengthError):
            s.append(embeds=torch.zeros(3, hidden), kind="state")
        assert len(s) == limit - 2
    engine.check_integrity()


def test_vectors_are_copied_at_the_call(engines) -> None:
    engine = engines["qwen3"]
    ids = random_ids(6, seed=13, vocab=250)
    with engine.open_session() as ref, engine.open_session() as s:
        ref.append(token_ids=ids)
        x = vectors(engine, ids)
        with engine.guard:  # the chunk cannot run before the caller scribbles on its tensor
            fut = s.submit_chunk(embeds=x, kind="audio")
            x.fill_(123.0)
        fut.result(30)
        assert_same(ref.core.logits, s.core.logits)


def test_window_plus_sinks_is_capped_by_the_context(engines) -> None:
    engine = engines["qwen3"]
    limit = engine.config.max_position_embeddings
    with pytest.raises(InvalidInputError, match="context"):
        engine.open_session(window=limit, sinks=4)
    engine.open_session(window=limit - 4, sinks=4).close()


def test_the_draft_model_is_never_fed_a_placeholder(default_engine) -> None:
    from streamserve.engine.loading import DEFAULT_MODEL_DIR

    engine = default_engine
    spec = f"draft:{DEFAULT_MODEL_DIR.parent / 'default-draft'}"
    ids = engine.tokenizer.encode("In the beginning God created the heaven and the earth. And the earth was")
    with engine.open_session(drafter="none") as ref:
        ref.append(token_ids=ids)
        expected = ref.generate(max_tokens=12, stop_token_ids=())
    drafter = engine.drafters.make(spec)[0]
    with engine.open_session(drafter=spec) as s:
        s.append(token_ids=ids[:6])
        s.append(embeds=vectors(engine, ids[6:12]), kind="audio")
        with engine.guard:  # the last token is a vector: nothing of token ids to draft from
            assert drafter.propose(s.core, 3).tokens == []
        s.append(token_ids=ids[12:])
        assert s.generate(max_tokens=12, stop_token_ids=()) == expected
        with engine.guard:
            drafter.propose(s.core, 3)
            st = drafter.states[s.id]
            assert st.offset >= 12 and s.core.placeholder_id not in st.tokens  # its view starts after the vectors
    assert s.id not in drafter.states


def test_a_dropped_session_frees_its_vectors_and_its_ngram_index(engines) -> None:
    import gc
    import weakref

    engine = engines["qwen3"]
    used = engine.stats()["kv_pages_used"]
    s = engine.open_session(drafter="ngram")
    x = vectors(engine, random_ids(20, seed=15, vocab=250))
    s.append(embeds=x, kind="image")
    s.append(token_ids=random_ids(20, seed=15, vocab=250))
    s.generate(max_tokens=8, stop_token_ids=())
    ngram = engine.drafters.make("ngram")[0]
    sid, state = s.id, weakref.ref(s.core)
    assert sid in ngram.indexes and len(s.core.vectors) == 20
    del s
    gc.collect()
    engine.check_integrity()  # reclaims what collected sessions held, between steps
    assert state() is None and sid not in ngram.indexes
    assert engine.stats()["kv_pages_used"] == used


def test_a_steps_vectors_are_moved_to_its_device() -> None:
    """A parked session's vectors wait on the host; a step that gathered one before its admission brought the
    session back still feeds the model vectors on the step's device (on a GPU: no device mismatch)."""
    from streamserve.engine.batch import flat_vectors

    host = torch.arange(8.0).view(2, 4)
    rows, values = flat_vectors([1, 3], [[(0, host[0])], [(1, host)]], torch.device("meta"))
    assert rows.device.type == "meta" and values.device.type == "meta" and tuple(values.shape) == (3, 4)


def test_a_refused_rewind_leaves_a_parked_session_parked(engines) -> None:
    """Bringing a parked session back takes pages (and may park others): a rewind the window refuses must not."""
    engine = engines["qwen3"]
    ids = random_ids(200, seed=17, vocab=250)
    with engine.open_session(window=16, sinks=4) as s:
        s.append(embeds=vectors(engine, ids[:100]), kind="audio")
        s.append(token_ids=ids[100:])
        s.park()
        used = engine.pool.allocator.used_count
        with pytest.raises(RewindError):
            s.rewind(to=30)  # the window dropped what that needs
        assert s.pages_held == 0 and s.kv.parked is not None and engine.pool.allocator.used_count == used
        s.rewind(to=195)  # a reachable point: brought back and cut
        assert s.pages_held > 0 and len(s) == 195
        assert s.generate(max_tokens=4, stop_token_ids=()) == greedy(engine, ids[:195], 4, window=16, sinks=4)
    engine.check_integrity()


def test_a_restored_session_does_not_share_the_snapshots_tensors(engines) -> None:
    """The caller keeps its Snapshot: changing its tensors after a restore changes nothing in the session; and
    a snapshot whose vectors are not finite is refused."""
    engine = engines["qwen3"]
    ids = random_ids(12, seed=18, vocab=250)
    expected = greedy(engine, ids, 5)
    with engine.open_session() as s:
        s.append(token_ids=ids[:4])
        s.append(embeds=vectors(engine, ids[4:]), kind="image")
        snap = s.snapshot()
    with engine.restore(snap) as r, engine.restore(snap) as r2:
        snap.vectors.fill_(7.0)
        snap.logits.fill_(0.0)
        assert r.generate(max_tokens=5, stop_token_ids=()) == expected  # samples from the restored logits
        r2.rewind(to=10)  # runs position 9 (a vector) again
        assert r2.generate(max_tokens=3, stop_token_ids=()) == greedy(engine, ids[:10], 3)
    snap.vectors[0, 0] = float("nan")
    with pytest.raises(SnapshotError, match="finite"):
        engine.restore(snap)
    engine.check_integrity()


def held_rows(session) -> int:
    """Rows of vector storage the session's table keeps alive (a view pins its whole block)."""
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in session.core.vectors.values()}
    row = session.core.vectors[next(iter(session.core.vectors))].numel() * 4
    return sum(storages.values()) // row


def test_vectors_kept_for_ever_do_not_pin_their_chunk(engines) -> None:
    """The sink positions' vectors stay for ever; as views they kept the whole chunk (or the whole parked or
    restored block) they came from alive for ever, so host memory grew with the first chunk's length."""
    engine = engines["qwen3"]
    assert engine.dtype == torch.float32
    kw = dict(window=16, sinks=4)
    bound = 2 * (16 + 4 + engine.pool.page_size + 1)
    with engine.open_session(**kw) as s:
        s.append(embeds=vectors(engine, random_ids(300, seed=19, vocab=250)), kind="audio")
        s.append(token_ids=random_ids(40, seed=20, vocab=250))
        assert held_rows(s) <= bound
        s.append(embeds=vectors(engine, random_ids(100, seed=21, vocab=250)), kind="audio")
        s.park()  # parking moves every vector into one block
        s.append(token_ids=random_ids(40, seed=22, vocab=250))
        assert held_rows(s) <= bound
        with engine.restore(s.snapshot()) as r:  # a restore loads them as one block too
            r.append(token_ids=random_ids(40, seed=23, vocab=250))
            assert held_rows(r) <= bound
