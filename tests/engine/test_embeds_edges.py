"""Embedding chunks, the edges: bad input is a typed error that changes nothing, vectors are copied (at the call,
into snapshots, out of chunks kept for ever), moved to the step's device, capped by the context, never fed to a
drafter, and freed with their session. The equivalence with token ids is in test_embeds.py."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same, greedy, random_ids, vectors

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
