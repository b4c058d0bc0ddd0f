"""End to end on the default model: one session floods 1,000-token chunks while 8 others send 200 ms chunks in real
time, and none of the 8 misses a deadline with the flood that it met without it (issue 11).

Both phases run here, on one engine: the 8 talking sessions alone, then the same workload with the flood. Each
talking chunk carries its capture time (when it was due) and the default deadline of capture + 200 ms, as the
server sets them; whether it missed is the engine's own accounting (`Ack.deadline_missed`). Nothing else is timed.

The engine runs with its defaults: on a CPU a 64-token step budget (`SchedulerConfig.for_device`). A step in
flight is never interrupted, so a chunk that arrives during one waits for it and then runs in the next; at 256
tokens a step of the default model takes 100-130 ms on a 2-core CPU, more than half a 200 ms budget, which is
why the CPU default is smaller (`benchmarks/concurrency.py`, docs/benchmarks.md). What the test checks is who
gets each step's tokens: the old earliest-deadline-first order gave all of them to the flood, whose chunks are
late and so always the most urgent, until its chunks were done (with it this test fails: 12 of 12 chunks missed
in every session, both tries).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator

import pytest

from streamserve import Engine
from streamserve.engine.session import Session
from streamserve.errors import SessionClosedError

TALKERS = 8
CHUNKS = 12  # per talking session: 2.4 s of real time
CHUNK_S = 0.2
CHUNK_TOKENS = 4  # about what 200 ms of speech transcribes to: every chunk fits one step with a wide margin
FLOOD_TOKENS = 1000
FLOOD_QUEUED = 3  # the flood keeps this many chunks submitted (3,000 tokens: more than the engine runs meanwhile)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.from_pretrained("default", device="cpu", kv_memory="128MiB")  # the defaults: 64-token CPU steps
    warm = eng.open_session()
    warm.append(token_ids=list(range(10, 74)))  # first-call allocations before anything counts
    warm.close()
    yield eng
    eng.shutdown()


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


async def talk(session: Session, start: float, rng: random.Random) -> int:
    """Send CHUNKS chunks in real time, each when it is due; -> how many missed their deadline."""
    missed = 0
    for k in range(CHUNKS):
        due = start + k * CHUNK_S
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        ack = await session.append_chunk_async(token_ids=token_ids(rng, CHUNK_TOKENS), capture_time=due)
        assert ack.tokens == CHUNK_TOKENS and not ack.shed
        missed += ack.deadline_missed
    return missed


async def run_talkers(engine: Engine, seed: int) -> list[int]:
    """The 8-session workload (starts spread over one chunk period); -> missed deadlines per session."""
    rng = random.Random(seed)
    sessions = [engine.open_session() for _ in range(TALKERS)]
    t0 = time.monotonic() + 0.05
    try:
        return list(await asyncio.gather(*(talk(s, t0 + CHUNK_S * i / TALKERS, random.Random(rng.random()))
                                           for i, s in enumerate(sessions))))
    finally:
        for s in sessions:
            s.close()


async def flood(session: Session, stop: asyncio.Event) -> int:
    """Keep FLOOD_QUEUED 1,000-token chunks submitted until `stop` is set and one of them is in; -> chunks acked."""
    rng = random.Random(7)
    pending: set[asyncio.Future] = set()
    acked = 0
    while not (stop.is_set() and acked):
        while len(pending) < FLOOD_QUEUED:  # capture time now, default deadline: late long before it is done
            pending.add(asyncio.wrap_future(session.submit_chunk(token_ids=token_ids(rng, FLOOD_TOKENS))))
        done, pending = await asyncio.wait(pending, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
        for f in done:
            assert f.result().tokens == FLOOD_TOKENS
            acked += 1
    session.close()  # the chunks still queued fail; nothing of them matters here
    for f in pending:
        with contextlib.suppress(SessionClosedError):
            await f
    return acked


async def both_phases(engine: Engine) -> tuple[list[int], list[int]]:
    """-> missed deadlines per talking session: alone, then with the flood."""
    alone = await run_talkers(engine, seed=1)
    flooder = engine.open_session(window=1024)  # rolling positions: an endless stream within bounded memory
    stop = asyncio.Event()
    flooding = asyncio.create_task(flood(flooder, stop))
    await asyncio.sleep(0.3)  # the flood queues up first: its chunks are ahead of everyone's
    with_flood = await run_talkers(engine, seed=1)
    stop.set()
    assert await flooding >= 1  # it was running all along (3,000 tokens queued), and made progress too
    return alone, with_flood


@pytest.mark.asyncio
async def test_a_flood_of_long_chunks_makes_no_talking_session_miss_a_deadline_it_met_without_it(
        engine: Engine) -> None:
    # One more try of both phases when the first misses: on a 2-core machine shared with other work, the OS can
    # stall the engine thread for longer than the 120 ms of margin a chunk has here. A scheduler that lets the
    # flood through fails both tries by far (the earliest-deadline-first one missed 12 of 12 in every session).
    runs = []
    for _ in range(2):
        alone, with_flood = await both_phases(engine)
        runs.append(f"without the flood {alone}, with it {with_flood}")
        met_alone = [i for i, m in enumerate(alone) if m == 0]
        # (most sessions must meet their deadlines alone, or the comparison would say little)
        if len(met_alone) >= TALKERS // 2 and all(with_flood[i] == 0 for i in met_alone):
            return
    pytest.fail("missed deadlines per session: " + "; then ".join(runs))
