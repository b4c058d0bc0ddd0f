"""The engine loop through the async API: many sessions at once, cancel, faults, bad input, leaks."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from helpers import greedy, random_ids

from streamserve.engine import Engine
from streamserve.errors import (
    InvalidInputError,
    ResponseInProgressError,
    SessionClosedError,
    SessionNotFoundError,
    StepError,
)


def chunks_of(ids: list[int], sizes: tuple[int, ...] = (20, 3, 7)) -> list[list[int]]:
    """Irregular chunks: long ones run alone in a step, short ones share a padded attention call."""
    out, i, k = [], 0, 0
    while i < len(ids):
        out.append(ids[i:i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("arch", ["qwen3_moe", "llama", "qwen3"])
async def test_concurrent_sessions_each_get_the_tokens_they_get_alone(engines, arch: str) -> None:
    engine = engines[arch]
    prompts = [random_ids(n, seed=200 + n) for n in (5, 9, 14, 23, 31, 40)]
    windows = [None, None, 16, None, None, 24]  # rolling sessions among absolute ones
    alone = [greedy(engine, p, 12, window=w) for p, w in zip(prompts, windows, strict=True)]

    async def one(p: list[int], window: int | None) -> list[int]:
        s = engine.open_session(window=window)
        try:
            for part in chunks_of(p):  # several chunks, each awaited: appends interleave with others' replies
                await s.append_async(token_ids=part)
            got: list[int] = []
            async for d in s.stream(max_tokens=12, stop_token_ids=()):
                got += d.token_ids
            return got
        finally:
            s.close()

    steps = engine.loop.steps
    assert await asyncio.gather(*(one(p, w) for p, w in zip(prompts, windows, strict=True))) == alone
    one_by_one = sum(len(chunks_of(p)) + 12 for p in prompts)  # steps if nothing ran together
    assert engine.loop.steps - steps < one_by_one  # sessions shared steps
    assert engine.stats()["kv_pages_used"] == 0
    engine.check_integrity()


@pytest.mark.asyncio
async def test_cancel_ends_a_long_stream_within_one_step_and_close_frees_everything(engines) -> None:
    engine = engines["qwen3"]
    s = engine.open_session(window=24)  # rolling positions: this reply would never end by itself
    other = engine.open_session()
    await s.append_async(token_ids=random_ids(10, seed=3))
    await other.append_async(token_ids=random_ids(10, seed=4))
    stream = s.stream(max_tokens=1_000_000, stop_token_ids=())
    background = other.stream(max_tokens=200, stop_token_ids=())  # keeps the engine busy meanwhile
    n = 0
    async for _ in stream:
        n += 1
        if n == 5:
            before = engine.loop.steps
            s.cancel()
    after = engine.loop.steps
    background.cancel()
    background.wait()
    s.close()
    other.close()
    assert stream.finish_reason == "cancelled" and after - before <= 1
    assert engine.stats()["kv_pages_used"] == 0
    engine.check_integrity()


@pytest.mark.asyncio
async def test_a_fault_in_one_session_leaves_the_others_unchanged(engines, monkeypatch) -> None:
    engine = engines["qwen3_moe"]
    prompts = [random_ids(16, seed=300 + i) for i in range(3)]
    alone = [greedy(engine, p, 10) for p in prompts]
    model = type(engine.model)
    real = model.forward_batch
    victim: dict[str, object] = {}

    def faulty(self, ids, kvs, rows=None):  # from its 4th reply step on, any forward with the victim raises
        if any(kv is victim.get("kv") for kv in kvs):
            victim["steps"] = victim.get("steps", 0) + 1  # type: ignore[operator]
            if victim["steps"] >= 4:
                raise RuntimeError("injected fault")
        return real(self, ids, kvs, rows)

    monkeypatch.setattr(model, "forward_batch", faulty)

    async def one(i: int) -> list[int] | BaseException:
        s = engine.open_session()
        await s.append_async(token_ids=prompts[i])
        if i == 1:
            victim["kv"] = s.kv
        got: list[int] = []
        try:
            async for d in s.stream(max_tokens=10, stop_token_ids=()):
                got += d.token_ids
        except StepError as e:
            assert s.closed and not s.kv.page_table  # the faulted session is closed, its pages are back
            return e
        finally:
            s.close()
        return got

    out = await asyncio.gather(*(one(i) for i in range(3)))
    assert isinstance(out[1], StepError) and "injected" in str(out[1])
    assert out[0] == alone[0] and out[2] == alone[2]
    monkeypatch.setattr(model, "forward_batch", real)
    assert engine.stats()["kv_pages_used"] == 0
    engine.check_integrity()


@pytest.mark.asyncio
async def test_bad_input_fails_at_the_call(engines) -> None:
    engine = engines["qwen3"]
    s = engine.open_session()
    with pytest.raises(InvalidInputError, match="appended"):
        s.stream()  # nothing to answer yet
    s.append(token_ids=[1, 2, 3])
    for kw in ({"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -0.5}, {"top_p": 0.0}, {"top_p": 1.5},
               {"stop": [""]}, {"stop": "x" * 300}, {"seed": "1"}):
        with pytest.raises(InvalidInputError):
            s.stream(**kw)
    with pytest.raises(InvalidInputError, match="kind"):
        s.append(token_ids=[1], kind="smell")  # type: ignore[arg-type]
    first = s.stream(max_tokens=100_000, stop_token_ids=())
    with pytest.raises(ResponseInProgressError):
        s.stream(max_tokens=4)
    s.cancel()
    assert first.wait() == "cancelled"
    s.stream(max_tokens=2).wait()  # after the end, a new reply is fine
    with pytest.raises(SessionNotFoundError):
        engine.get_session("no-such-session")
    assert engine.get_session(s.id) is s
    s.close()
    with pytest.raises(SessionNotFoundError):
        engine.get_session(s.id)
    with pytest.raises(SessionClosedError):
        s.stream()

    with pytest.raises(SessionClosedError):
        await s.append_async(token_ids=[1])


def test_stop_strings_end_the_reply_before_them(engines) -> None:
    engine = Engine.from_pretrained("default", kv_memory="64MiB")
    with engine:
        with engine.open_session() as s:
            s.append(text="In the beginning God created the heaven and the earth.")
            free = s.stream(max_tokens=40, stop_token_ids=())
            text = "".join(d.text for d in free)
        stop = text[12:15]
        with engine.open_session() as s:
            s.append(text="In the beginning God created the heaven and the earth.")
            st = s.stream(max_tokens=40, stop=[stop, "never appears"], stop_token_ids=())
            got = "".join(d.text for d in st)
        assert st.finish_reason == "stop" and got == text[:text.index(stop)]


def test_acks_time_each_chunk_and_a_slow_consumer_never_blocks_the_engine(engines) -> None:
    engine = engines["olmoe"]
    a, b = engine.open_session(), engine.open_session()
    ack = a.append_chunk(token_ids=random_ids(20, seed=5), seq=7)
    assert ack.seq == 7 and ack.tokens == 20 and ack.queue_ms >= 0 and ack.compute_ms > 0 and not ack.shed
    unread = a.stream(max_tokens=40, stop_token_ids=())  # nobody reads it
    b.append(token_ids=random_ids(8, seed=6))
    assert len(b.generate(max_tokens=5, stop_token_ids=())) == 5  # served while a's reply piles up
    deadline = time.monotonic() + 60
    while unread.unread < 2 and time.monotonic() < deadline:  # the reply's end is delivered
        time.sleep(0.01)
    assert unread.finished and unread.unread == 2  # 40 unread deltas merged into one, then the end
    assert unread.wait() == "length" and len(unread.token_ids) == 40
    a.close()
    b.close()


def test_stale_video_chunks_are_shed_under_overload(engines) -> None:
    engine = engines["qwen3"]
    s = engine.open_session()
    past = time.monotonic() - 5.0
    with engine.guard:  # the engine is held between steps while the frames queue up, all already late
        futures = [s.submit_chunk(None, [10 + i, 11 + i], None, None, past, past + 0.2, "video") for i in range(3)]
        text = s.submit_chunk(None, [1, 2], None, None, past, past + 0.2, "text")
    acks = [f.result(timeout=30) for f in futures]
    assert [(a.seq, a.shed, a.tokens) for a in acks] == [(0, True, 0), (1, True, 0), (2, False, 2)]
    assert text.result(timeout=30).tokens == 2  # text is never shed
    assert s.token_ids == [12, 13, 1, 2] and [r.seq for r in s.timeline] == [2, 3]
    assert "streamserve_chunks_shed_total 2.0" in engine.metrics.exposition().decode()
    s.close()


def test_shutdown_ends_replies_and_refuses_new_work(checkpoints) -> None:
    engine = Engine.from_pretrained(checkpoints["qwen3"][0], device="cpu")
    s = engine.open_session(window=16)
    s.append(token_ids=[1, 2, 3])
    st = s.stream(max_tokens=1_000_000, stop_token_ids=())
    next(st)
    engine.shutdown()
    assert st.wait() == "closed"
    with pytest.raises(SessionClosedError, match="shut down"):
        s.append(token_ids=[4])
    s.close()
    assert engine.stats()["kv_pages_used"] == 0


def test_nothing_is_left_behind_after_sessions_end_one_way_or_another(checkpoints) -> None:
    """Closed, dropped (garbage-collected), cancelled and finished sessions leave no queue, no pages and
    no session entry behind."""
    import gc

    engine = Engine.from_pretrained(checkpoints["qwen3"][0], device="cpu", kv_memory="16MiB")
    for i in range(12):
        s = engine.open_session(window=16 if i % 2 else None)
        s.append(token_ids=random_ids(9, seed=i))
        st = s.stream(max_tokens=50_000 if i % 3 == 0 else 4, stop_token_ids=())
        if i % 3 == 0:
            next(st)
            s.cancel()
        st.wait()
        if i % 4 == 0:
            del s, st  # dropped without close: the finalizer gives the pages back
            gc.collect()
        else:
            s.close()
    engine.loop.step()  # one more step lets the scheduler forget idle queues
    assert engine.stats()["kv_pages_used"] == 0 and engine.stats()["sessions_open"] == 0
    assert not engine.loop.scheduler.tracked_sessions()
    engine.check_integrity()
    engine.shutdown()


def test_an_engine_nobody_uses_is_collected_with_its_thread(checkpoints) -> None:
    """The engine thread holds its engine only while it works: a dropped engine (and its KV pool) is
    garbage-collected and its thread ends."""
    import gc
    import weakref

    engine = Engine.from_pretrained(checkpoints["llama"][0], device="cpu", kv_memory="8MiB")
    with engine.open_session() as s:
        s.append(token_ids=[1, 2, 3])
        s.generate(max_tokens=2)
    thread = engine.loop.thread
    assert thread is not None and thread.is_alive()
    ref = weakref.ref(engine)
    del engine, s
    deadline = time.monotonic() + 10
    while (ref() is not None or thread.is_alive()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert ref() is None and not thread.is_alive()


@pytest.mark.asyncio
async def test_pipelined_chunks_share_steps_and_change_nothing(engines) -> None:
    engine = engines["qwen3_moe"]
    prompt = random_ids(45, seed=21)
    expected = greedy(engine, prompt, 10)
    parts = chunks_of(prompt, (4, 9, 1, 6))
    s = engine.open_session()
    steps = engine.loop.steps
    acks = await asyncio.gather(*(s.append_chunk_async(token_ids=p) for p in parts))  # all in flight at once
    used = engine.loop.steps - steps
    got = [t async for d in s.stream(max_tokens=10, stop_token_ids=()) for t in d.token_ids]
    timeline = [(r.seq, r.start, r.end) for r in s.timeline if r.kind == "input"]
    s.close()
    seqs = [a.seq for a in acks]
    assert got == expected and seqs == list(range(len(parts)))
    assert used < len(parts)  # several chunks per step
    ends = list(itertools.accumulate(len(p) for p in parts))
    assert timeline == [(i, e - len(p), e) for i, (p, e) in enumerate(zip(parts, ends, strict=True))]
