"""An endless windowed session holds a bounded host state (issue 17, item 2): its token ids (`TokenLog`), timeline
records, embedding vectors and the drafters' per-session state stay within a constant set by the window, and the
Python heap does not grow over 20,000 tokens; rewind still reaches everything the KV allows (and a typed
RewindError below it); forgetting changes no output."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest
from helpers import greedy, random_ids, vectors

from streamserve.engine.drafters.model import FORGET_BATCH
from streamserve.engine.state import SessionState
from streamserve.engine.token_log import ForgottenTokensError, TokenLog
from streamserve.errors import RewindError

WINDOW, SINKS = 64, 4
TOTAL, WARM = 20_000, 4_000  # tokens streamed; sizes and the heap are compared from WARM on
HEAP_GROWTH = 1 << 20  # bytes of Python objects the stream may add after warm-up (the code before bounding the
# history added 5.5 MiB here: its ids, timeline records and n-gram index)


def _stored(ids: TokenLog | list[int]) -> int:
    """Ids a session holds (a plain list holds them all)."""
    return ids.stored if isinstance(ids, TokenLog) else len(ids)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _feed(s, engine, ids: list[int], i: int) -> None:
    """Chunk i of a stream: mostly 100 ids (every third starts with a phrase that recurs, for the n-gram
    drafter), every tenth four embedding vectors, and a greedy reply of 8 tokens after every fifth."""
    vocab_phrase = ids[:24]
    at = len(s)  # a stream that never repeats, but for the phrase
    if i % 10 == 9:
        s.append(embeds=vectors(engine, ids[at:at + 4]), kind="audio")
    elif i % 3 == 0:
        s.append(token_ids=vocab_phrase + ids[at:at + 76])
    else:
        s.append(token_ids=ids[at:at + 100])
    if i % 5 == 4:
        s.generate(max_tokens=8, stop_token_ids=())


def test_an_endless_windowed_session_keeps_a_bounded_host_state(default_engine) -> None:
    engine = default_engine
    ids = random_ids(TOTAL + 200, seed=71, vocab=engine.config.vocab_size)
    ngram = engine.drafters.make("ngram")[0]
    verified = engine.stats()["speculative"].get("ngram", {}).get("verifications", 0)
    page = engine.pool.page_size
    head = -(-SINKS // page) * page + 1  # the sink pages' positions and the one after them: kept for ever
    sizes: list[tuple[int, int, int, int, int]] = []  # after warm-up: ids, records, vectors, index tokens, entries
    gc.collect()
    tracemalloc.start()
    try:
        with engine.open_session(window=WINDOW, sinks=SINKS, drafter="ngram") as s:
            i = 0
            while len(s) < WARM:
                _feed(s, engine, ids, i)
                i += 1
            gc.collect()
            heap0, rss0 = tracemalloc.get_traced_memory()[0], _rss_kib()
            while len(s) < TOTAL:
                _feed(s, engine, ids, i)
                i += 1
                index = ngram.indexes.get(s.id)
                sizes.append((_stored(s.token_ids), len(s.timeline), len(s.core.vectors),
                              len(index.tokens) if index else 0, len(index.follows) if index else 0))
            gc.collect()
            heap1, rss1 = tracemalloc.get_traced_memory()[0], _rss_kib()
            assert engine.stats()["speculative"]["ngram"]["verifications"] > verified  # the index was used
            assert s.token_ids.gap is not None and s.token_ids.gap[0] == head
    finally:
        tracemalloc.stop()
    print(f"\nafter warm-up ({WARM} tokens) to {TOTAL}: Python heap {heap0 / 2**20:.2f} -> {heap1 / 2**20:.2f} MiB, "
          f"RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB; largest (ids, records, vectors, index tokens, "
          f"index entries): {tuple(max(c) for c in zip(*sizes, strict=True))}")
    assert heap1 - heap0 < HEAP_GROWTH, f"the Python heap grew by {(heap1 - heap0) / 2**20:.2f} MiB"
    kept = head + WINDOW + 2 * page  # the sinks, the window and the pages it straddles (a reply's pending token)
    ids_max, records_max, vectors_max, index_max, entries_max = (max(c) for c in zip(*sizes, strict=True))
    assert ids_max <= kept
    assert records_max <= 8  # the first chunk's, the last input one before the window's, the window's
    assert vectors_max <= 4  # at most one embedding chunk is in reach at a time here
    assert index_max <= 2 * kept and entries_max <= 4 * index_max  # the index covers the kept ids (+ a quarter)


def test_rewind_reaches_what_the_kv_allows_and_no_further(default_engine) -> None:
    engine = default_engine
    ids = random_ids(1_500, seed=72, vocab=engine.config.vocab_size)
    with engine.open_session(window=WINDOW, sinks=SINKS) as s:
        for i in range(0, len(ids), 100):
            s.append(token_ids=ids[i:i + 100], seq=i // 100)
        s.generate(max_tokens=5, stop_token_ids=())
        st = s.core
        assert st.token_ids.gap is not None
        head, base = st.token_ids.gap
        with pytest.raises(ForgottenTokensError, match="forgotten"):
            _ = s.token_ids[base - 1]
        # the oldest point a rewind may keep: its last kept token runs again, so the KV must allow that position
        t = next(t for t in range(head + 1, len(s) + 1) if st.kv.can_rewind(t - 1))
        assert t - 1 >= base  # and its id is kept
        before, last = (len(s), s.token_ids.kept(), list(s.timeline), s.kv.length), s.token_ids[t - 1]
        with pytest.raises(RewindError):
            s.rewind(to=t - 1)
        with pytest.raises(RewindError, match="forgets the chunks"):
            s.rewind(to_seq=1)  # a chunk whose record went with its tokens
        assert (len(s), s.token_ids.kept(), list(s.timeline), s.kv.length) == before  # refused: nothing changed
        s.rewind(to=t)
        assert len(s) == t and s.token_ids[t - 1] == last
        first = s.generate(max_tokens=6, stop_token_ids=())
        s.rewind(to=t)
        assert s.generate(max_tokens=6, stop_token_ids=()) == first
        # into the sinks: the session is then exactly its first `head` tokens, as a fresh one fed them
        s.rewind(to=head)
        assert s.token_ids.gap is None and list(s.token_ids) == ids[:head] and s.next_seq == 1
        assert s.generate(max_tokens=6, stop_token_ids=()) == greedy(engine, ids[:head], 6, window=WINDOW,
                                                                     sinks=SINKS)


def _script(engine, tmp_path, drafter: str) -> list[list[int]]:
    """Replies of a windowed session through appends, replies, a snapshot restored, and rewinds."""
    ids = random_ids(2_000, seed=73, vocab=engine.config.vocab_size)
    phrase, out = ids[:30], []
    with engine.open_session(window=WINDOW, sinks=SINKS, drafter=drafter) as s:
        for i in range(12):
            s.append(token_ids=(phrase if i % 2 else []) + ids[100 * i:100 * i + 70])
            out.append(s.generate(max_tokens=10, stop_token_ids=()))
        s.rewind(to=next(t for t in range(len(s) - 10, len(s)) if s.kv.can_rewind(t - 1)))  # as far as it goes
        out.append(s.generate(max_tokens=10, stop_token_ids=()))
        path = s.snapshot(tmp_path / f"{drafter}.pt")
    with engine.restore(path) as r:
        out.append(r.token_ids.kept())
        r.append(token_ids=phrase)
        out.append(r.generate(max_tokens=12, stop_token_ids=()))
    return out


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_forgetting_changes_no_output(default_engine, tmp_path, monkeypatch, drafter: str) -> None:
    """The same script with the history kept whole (the code before bounding it) gives the same replies."""
    engine = default_engine
    bounded = _script(engine, tmp_path, drafter)
    monkeypatch.setattr(SessionState, "trim", lambda self: None)
    whole = _script(engine, tmp_path, drafter)
    stored = bounded.pop(-2)  # a restored session's kept ids: the tail of the whole history
    history = whole.pop(-2)
    assert stored == history[:17] + history[len(history) - len(stored) + 17:] and len(stored) <= 17 + WINDOW + 32
    assert bounded == whole


def test_a_draft_model_keeps_a_bounded_view(engines, checkpoints) -> None:
    """The draft model's own history of an endless session forgets what its window dropped; drafting stays
    lossless."""
    engine = engines["qwen3_moe"]
    draft = f"draft:{checkpoints['llama'][0]}"
    ids = random_ids(1_200, seed=75)
    plain, drafted = [], []
    for spec, out in (("none", plain), (draft, drafted)):
        with engine.open_session(window=20, sinks=2, drafter=spec) as s:
            held = []
            for i in range(0, len(ids), 30):  # replies long enough for the drafter to run in each (it probes)
                s.append(token_ids=ids[i:i + 30] if i % 60 else ids[:20] + ids[i + 20:i + 30])
                out.append(s.generate(max_tokens=24, stop_token_ids=()))
                if spec != "none" and s.id in engine.drafters.make(draft)[0].states:
                    log = engine.drafters.make(draft)[0].states[s.id].tokens
                    held.append((log.stored, log.gap is not None))
    assert drafted == plain
    assert any(forgot for _, forgot in held)  # the draft's own history forgot what its window dropped
    assert max(n for n, _ in held) <= 17 + 20 + 2 * 16 + FORGET_BATCH + 8  # head, window, pages, a batch, drafts


def test_a_token_log_reads_as_the_list_it_keeps() -> None:
    rng = random.Random(5)
    for _ in range(300):
        ref: list[int] = []
        log, kept = TokenLog(), set()
        for _ in range(25):
            r = rng.random()
            if r < 0.45:
                new = [rng.randrange(50) for _ in range(rng.randrange(6))]
                kept |= set(range(len(ref), len(ref) + len(new)))
                ref += new
                log.extend(new)
            elif r < 0.65 and ref:
                a = rng.randrange(len(ref) + 1)
                del ref[a:]
                del log[a:]
                kept = {p for p in kept if p < a}
            else:
                keep_first, pos = rng.randrange(4), rng.randrange(len(ref) + 3)
                gap = log.gap
                if min(pos, len(ref)) > keep_first:  # the one gap widens to cover the old one and the new
                    lo, hi = keep_first, min(pos, len(ref))
                    lo, hi = (lo, hi) if gap is None else (min(lo, gap[0]), max(hi, gap[1]))
                    kept -= set(range(lo, hi))
                log.forget_before(pos, keep_first)
            assert len(log) == len(ref) and log.stored == len(kept) and list(log) == [ref[p] for p in sorted(kept)]
            for p in range(-len(ref), len(ref)):
                if p % len(ref) in kept:
                    assert log[p] == ref[p]
                else:
                    with pytest.raises(ForgottenTokensError):
                        _ = log[p]
            a, b = sorted(rng.randrange(len(ref) + 1) for _ in range(2))
            if all(p in kept for p in range(a, b)):
                assert log[a:b] == ref[a:b]
            else:
                with pytest.raises(ForgottenTokensError):
                    _ = log[a:b]
            assert log.copy() == log == TokenLog(log.kept(), log.gap)
