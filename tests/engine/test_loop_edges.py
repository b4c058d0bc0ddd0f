"""Edge cases of the engine loop found in review: each test names the failure it guards against."""

from __future__ import annotations

import pytest
from helpers import random_ids

from streamserve.config import SchedulerConfig
from streamserve.engine import Engine
from streamserve.errors import CapacityError, InvalidInputError, PageCapError, RewindError
from streamserve.sessions import KVPool


def small_engine(path, pages: int, **kw) -> Engine:
    probe = Engine.from_pretrained(path, device="cpu", kv_memory="1MiB", page_size=4)
    c = probe.config
    probe.shutdown()
    per_page = KVPool.bytes_per_page(c.num_layers, c.num_kv_heads, c.head_dim, 4, probe.dtype)
    return Engine.from_pretrained(path, device="cpu", kv_memory=pages * per_page, page_size=4, **kw)


def test_a_caller_giving_up_on_an_ack_does_not_cost_other_sessions_theirs(engines) -> None:
    engine = engines["qwen3"]
    a, b = engine.open_session(), engine.open_session()
    with engine.guard:  # both chunks run in the same step
        fa = a.submit_chunk(None, [1, 2, 3], None, None, None, None, "text")
        fb = b.submit_chunk(None, [4, 5, 6], None, None, None, None, "text")
        assert not fa.cancel()  # too late to cancel: the engine owns it
    assert fa.result(30).tokens == 3 and fb.result(30).tokens == 3
    a.close()
    b.close()


def test_a_chunk_failing_halfway_leaves_nothing_of_it_in_the_session(checkpoints) -> None:
    engine = small_engine(checkpoints["llama"][0], pages=12, scheduler=SchedulerConfig(step_tokens=16,
                                                                                      min_append_tokens=16))
    s = engine.open_session()
    s.append(token_ids=random_ids(6, seed=1))
    before = (list(s.token_ids), list(s.timeline))
    with pytest.raises(CapacityError):  # 60 tokens need 15 pages of 4: the third 16-token part finds none
        s.append(token_ids=random_ids(60, seed=2))
    assert (s.token_ids, s.timeline) == before  # (its last token re-enters the KV with the next step, as
    assert s.kv.length in (5, 6)  # after any rewind)
    s.append(token_ids=[7, 8])  # and the session goes on
    engine.check_integrity()
    capped = engine.open_session(page_cap=3)
    with pytest.raises(PageCapError):  # refused before any of it runs
        capped.append(token_ids=random_ids(20, seed=3))
    assert capped.token_ids == [] and capped.kv.length == 0
    engine.shutdown()


def test_sampling_parameters_out_of_any_range_fail_at_the_call(engines) -> None:
    s = engines["qwen3"].open_session()
    s.append(token_ids=[1, 2])
    for kw in ({"top_k": 2**63, "temperature": 1.0}, {"seed": 2**64}, {"seed": -1}, {"temperature": 10**400},
               {"top_p": 10**400}):
        with pytest.raises(InvalidInputError):
            s.stream(**kw)
    assert s.generate(max_tokens=2, temperature=1.0, top_k=10**6) and not s.closed  # no limit in effect
    s.close()


def test_a_reply_behind_a_failed_first_chunk_gets_a_clear_error(checkpoints) -> None:
    engine = small_engine(checkpoints["llama"][0], pages=64)
    s = engine.open_session(page_cap=1)
    with engine.guard:
        chunk = s.submit_chunk(None, random_ids(40, seed=4), None, None, None, None, "text")
        reply = s.stream(max_tokens=3)
    with pytest.raises(PageCapError):
        chunk.result(30)
    with pytest.raises(InvalidInputError, match="did not enter"):
        reply.wait()
    assert not s.closed
    engine.shutdown()


def test_a_refused_rewind_leaves_the_running_reply_alone(engines) -> None:
    engine = engines["qwen3"]
    s = engine.open_session(window=16)
    s.append(token_ids=random_ids(8, seed=5))
    st = s.stream(max_tokens=100_000, stop_token_ids=())
    next(st)
    with pytest.raises(RewindError):
        s.rewind(to_seq=999)
    with engine.guard:
        assert s.state.value == "responding"
    s.cancel()
    assert st.wait() == "cancelled"
    s.close()


def test_closing_an_unstarted_token_iterator_cancels_its_reply(engines) -> None:
    engine = engines["qwen3"]
    s = engine.open_session(window=16)
    s.append(token_ids=[1, 2, 3])
    it = s.iter_generate(max_tokens=100_000, stop_token_ids=())
    it.close()
    assert s.generate(max_tokens=2, stop_token_ids=())  # no ResponseInProgressError
    s.close()


def test_sessions_closed_with_work_queued_are_not_counted_as_failures(engines) -> None:
    engine = engines["olmoe"]
    failed = engine.stats()["sessions_failed_total"]
    for _ in range(5):
        s = engine.open_session()
        with engine.guard:
            s.submit_chunk(None, [1, 2, 3], None, None, None, None, "text")
            s.core.closed = True  # closed by another thread between the submission and the step
            engine.table.remove(s.id)
        engine.loop.step()
    assert engine.stats()["sessions_failed_total"] == failed
    engine.check_integrity()


def test_kept_logits_do_not_pin_the_whole_batch(engines) -> None:
    engine = engines["qwen3"]
    sessions = [engine.open_session() for _ in range(4)]
    with engine.guard:
        futures = [s.submit_chunk(None, [1, 2, 3], None, None, None, None, "text") for s in sessions]
    for f in futures:
        f.result(30)
    for s in sessions:
        assert s.core.logits.untyped_storage().nbytes() == s.core.logits.numel() * s.core.logits.element_size()
        s.close()
