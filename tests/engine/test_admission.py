"""Memory pressure: idle sessions are parked, a full pool is a typed error, caps and TTLs hold."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy, random_ids

from streamserve import Engine
from streamserve.config import SchedulerConfig
from streamserve.errors import CapacityError, PageCapError


@pytest.fixture()
def small(checkpoints) -> Engine:
    """A pool of 10 pages of 8 tokens (80 tokens in all)."""
    from streamserve.sessions import KVPool

    path = checkpoints["qwen3_moe"][0]
    engine = Engine.from_pretrained(path, device="cpu", kv_memory=1 << 30, page_size=8)
    cfg = engine.config
    per_page = KVPool.bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, engine.dtype)
    # 256-token steps (the accelerator default): a chunk of up to 256 tokens asks for all its pages in one step
    return Engine.from_pretrained(path, device="cpu", kv_memory=10 * per_page, page_size=8,
                                  scheduler=SchedulerConfig(step_tokens=256))


def test_pressure_parks_the_least_recently_active_idle_session(small: Engine, engines) -> None:
    ids_a = random_ids(30, seed=41)
    expected = greedy(engines["qwen3_moe"], ids_a, 6)  # the same model with plenty of memory
    a, b = small.open_session(), small.open_session()
    a.append(token_ids=ids_a)  # 4 pages
    b.append(token_ids=random_ids(30, seed=42))  # 4 pages
    c = small.open_session()
    c.append(token_ids=random_ids(30, seed=43))  # needs 4 of 2 free: parks a, the least recently active
    assert (a.state.value, b.state.value, c.state.value) == ("parked", "open", "open")
    assert small.stats()["sessions_parked"] == 1
    small.check_integrity()
    # a comes back transparently (parking b, now the least recently active) and goes on as if never parked
    assert a.generate(max_tokens=6, stop_token_ids=()) == expected
    assert b.state.value == "parked" and small.stats()["sessions_parked_total"] == 2
    small.check_integrity()


def test_a_full_pool_with_nothing_to_park_is_a_capacity_error(small: Engine) -> None:
    a = small.open_session()
    with pytest.raises(CapacityError, match="retry later"):
        a.append(token_ids=random_ids(90, seed=44))  # 12 pages > 10
    assert a.token_ids == [] and small.stats()["kv_pages_used"] == 0
    a.append(token_ids=random_ids(70, seed=45))  # 9 pages: fits
    small.check_integrity()


def test_page_cap(small: Engine) -> None:
    s = small.open_session(page_cap=2)
    s.append(token_ids=random_ids(16, seed=46))
    with pytest.raises(PageCapError, match="cap of 2"):
        s.append(token_ids=[1])
    assert len(s.token_ids) == 16
    small.check_integrity()


def test_idle_sessions_expire(checkpoints) -> None:
    engine = Engine.from_pretrained(checkpoints["llama"][0], device="cpu", idle_ttl=60.0)
    s = engine.open_session()
    s.append(token_ids=[1, 2, 3])
    assert engine.expire_idle(now=s.last_active + 30) == 0
    assert engine.expire_idle(now=s.last_active + 61) == 1
    assert s.closed and engine.stats()["kv_pages_used"] == 0


def test_a_request_that_can_never_fit_parks_nobody(small: Engine) -> None:
    a, b = small.open_session(), small.open_session()
    a.append(token_ids=random_ids(20, seed=47))
    b.append(token_ids=random_ids(20, seed=48))
    c = small.open_session()
    with pytest.raises(CapacityError, match="needs 12 KV pages"):
        c.append(token_ids=random_ids(90, seed=49))
    assert small.stats()["sessions_parked"] == 0
    small.check_integrity()


def test_stats_never_trip_over_a_session_brought_back_meanwhile(engines, monkeypatch) -> None:
    """stats() runs on other threads while the engine unparks sessions: a session parked when stats checks
    it and back on the pool when stats reads its host pages must not raise (AttributeError on None)."""
    from streamserve.sessions import PagedSessionKV

    engine = engines["qwen3"]
    with engine.open_session() as s:
        s.append(token_ids=[1, 2, 3])
        s.park()
        host, reads = s.kv.parked, iter(range(1_000_000))

        def parked(kv: PagedSessionKV):  # the engine thread unparks it right after stats' second look
            if kv is not s.kv:
                return kv.__dict__.get("parked")
            return None if next(reads) == 2 else host

        monkeypatch.setattr(PagedSessionKV, "parked", property(parked, lambda kv, v: kv.__dict__.update(parked=v)),
                            raising=False)
        stats = engine.stats()
        monkeypatch.undo()
        assert stats["sessions_parked"] == 1


def test_the_leak_checker_sees_drafter_state_and_vectors_of_no_open_session(engines) -> None:
    """check_integrity counts more than pages: drafter state kept for a session that is gone, and vectors at
    positions that are not the session's placeholders, are leaks too."""
    from streamserve.engine.drafters.ngram import NgramIndex

    engine = engines["qwen3"]
    ngram = engine.drafters.make("ngram")[0]
    with engine.open_session(drafter="ngram") as s:
        s.append(token_ids=random_ids(20, seed=24, vocab=250))
        s.generate(max_tokens=6, stop_token_ids=())
        engine.check_integrity()
        ngram.indexes["a-session-long-closed"] = NgramIndex()
        with pytest.raises(AssertionError, match="drafter"):
            engine.check_integrity()
        del ngram.indexes["a-session-long-closed"]
        s.core.vectors[3] = torch.zeros(engine.config.hidden_size)
        with pytest.raises(AssertionError, match="vectors"):
            engine.check_integrity()
        del s.core.vectors[3]
    engine.check_integrity()
